"""Helpers for the hostile-input tests: raw safetensors files, an audit of every write, an
evil pickle, a Hugging Face cache laid out as huggingface_hub lays it out, and the CLI's
"failed cleanly" contract (one ``Error:`` line, optional ``Hint:``, exit 1, nothing left).
"""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import stat
import struct
import sys
import threading
from contextlib import contextmanager
from pathlib import Path

from mxfp8_convert.cli import main
from mxfp8_convert.synth import SynthSpec, write_checkpoint
from tests.checkpoints import leftovers  # noqa: F401 - also imported from here by the tests

#: a tiny two-shard sglang MXFP8 model (~220 KB) that cutlass converts; fast enough to fuzz
SMALL = SynthSpec(layers=1, hidden=128, intermediate=256, heads=2, kv_heads=2, vocab=128, shards=2)
SHARD1, SHARD2 = "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"
INDEX = "model.safetensors.index.json"


def small_model(path: Path, spec: SynthSpec = SMALL) -> Path:
    return write_checkpoint(path, spec)


# --- raw safetensors ----------------------------------------------------------------------


def st_bytes(header: dict | bytes, data: bytes = b"", *, length: int | None = None) -> bytes:
    """A safetensors file: 8-byte little-endian length, the header (a dict is JSON-encoded), data.

    ``length`` overrides the length prefix (to point it anywhere).
    """
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    return struct.pack("<Q", len(raw) if length is None else length) + raw + data


def split_st(data: bytes) -> tuple[dict, bytes]:
    """(header dict, tensor bytes) of a valid safetensors file."""
    (n,) = struct.unpack("<Q", data[:8])
    return json.loads(data[8 : 8 + n]), data[8 + n :]


def edit_header(path: Path, edit) -> None:
    """Rewrite the header of safetensors file ``path`` after ``edit(header)`` changed it in
    place (its return value is ignored); the tensor bytes are kept."""
    header, data = split_st(path.read_bytes())
    edit(header)
    path.write_bytes(st_bytes(header, data))


# --- the CLI contract ---------------------------------------------------------------------


def run_cli(capsys, *args) -> tuple[int, str, str]:
    code = main([str(a) for a in args])
    out, err = capsys.readouterr()
    return code, out, err


def error_lines(err: str) -> list[str]:
    """The stderr lines that are not a ``Hint:`` line."""
    return [ln for ln in err.strip().splitlines() if not ln.startswith("Hint: ")]


def assert_clean_failure(result: tuple[int, str, str], dest: Path, *expected: str) -> str:
    """Exit 1, exactly one ``Error:`` line (+ at most one ``Hint:``) holding every ``expected``
    text, no traceback, empty stdout, no destination, no temporary folder. Returns the line."""
    code, out, err = result
    assert code == 1, err
    lines = err.strip().splitlines()
    assert 1 <= len(lines) <= 2, err
    assert lines[0].startswith("Error: "), err
    assert len(lines) == 1 or lines[1].startswith("Hint: "), err
    for text in expected:
        assert text in lines[0], lines[0]
    assert "Traceback" not in err and out == ""
    assert not dest.exists()
    assert leftovers(dest.parent) == [], f"left behind: {leftovers(dest.parent)} after: {lines[0]}"
    return lines[0]


def tree_state(root: Path) -> dict[str, str]:
    """Relative path -> sha256 (files), link target (links), "dir" or "special", for everything
    under ``root``. Links are recorded, never followed."""
    state = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            p = Path(dirpath) / name
            mode = p.lstat().st_mode
            if stat.S_ISLNK(mode):
                state[str(p.relative_to(root))] = "-> " + os.readlink(p)
            elif stat.S_ISDIR(mode):
                state[str(p.relative_to(root))] = "dir"
            elif stat.S_ISREG(mode):
                state[str(p.relative_to(root))] = hashlib.sha256(p.read_bytes()).hexdigest()
            else:
                state[str(p.relative_to(root))] = "special"
    return state


# --- an audit of every write (and every open) ---------------------------------------------

_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND
#: audit event -> ((index of a path argument, index of its dir_fd argument or None), ...)
_MUTATING = {
    "os.rename": ((0, 2), (1, 3)), "os.link": ((0, 2), (1, 3)), "os.symlink": ((1, 2),),
    "os.remove": ((0, 1),), "os.rmdir": ((0, 1),), "os.mkdir": ((0, 2),),
    "os.truncate": ((0, None),),
    "os.chmod": ((0, 2),), "os.chown": ((0, 3),), "os.utime": ((0, 3),), "shutil.rmtree": ((0, 1),),
    "shutil.copyfile": ((1, None),), "shutil.move": ((0, None), (1, None)),
}
_recorder: list | None = None
_on_write = None  # called with the path of every open-for-writing inside audit(on_write=...)
_lock = threading.Lock()
_busy = threading.local()


def _hook(event: str, args: tuple) -> None:
    rec = _recorder
    if rec is None or getattr(_busy, "flag", False):
        return
    if event == "open":
        path, mode, flags = args
        if isinstance(path, int):
            return
        writes = (isinstance(mode, str) and any(c in mode for c in "wax+")) or (
            mode is None and isinstance(flags, int) and flags & _WRITE_FLAGS)
        rec.append(("write" if writes else "read", os.fsdecode(path)))
        if writes and _on_write is not None:
            _busy.flag = True  # what the callback opens is not ours to record
            try:
                _on_write(os.fsdecode(path))
            finally:
                _busy.flag = False
    elif event in _MUTATING:
        for i, fd_i in _MUTATING[event]:
            path = args[i] if i < len(args) else None
            if not isinstance(path, (str, bytes, os.PathLike)):
                continue
            path = os.fsdecode(path)
            dir_fd = args[fd_i] if fd_i is not None and fd_i < len(args) else None
            if isinstance(dir_fd, int) and not os.path.isabs(path):  # rmtree works relative to fds
                path = os.path.join(os.readlink(f"/proc/self/fd/{dir_fd}"), path)
            rec.append((event, path))
    elif event == "pickle.find_class":
        rec.append(("unpickle", f"{args[0]}.{args[1]}"))
    elif event == "mmap.__new__" and len(args) > 2 and args[2] not in (1,):  # 1 = ACCESS_READ
        rec.append(("mmap-writable", str(args)))


_installed = False


@contextmanager
def audit(on_write=None):
    """Record file events (reads, writes, renames, removals, unpickling) in this block.

    Audit hooks cannot be removed, so one is installed once and only records inside ``audit()``.
    Yields the list of ``(kind, path)``; ``kind`` is "read", "write", "unpickle" or an os event.
    ``on_write(path)`` runs just before each file is opened for writing (what it does itself
    is not recorded): a way to play another process at an exact moment.
    """
    global _recorder, _installed, _on_write
    with _lock:
        if not _installed:
            sys.addaudithook(_hook)
            _installed = True
        events: list = []
        _recorder, _on_write = events, on_write
    try:
        yield events
    finally:
        _recorder = _on_write = None


def writes_outside(events: list, dest: Path) -> list[tuple[str, str]]:
    """Writing events whose path is not the destination, under it, or its work folders
    ``.NAME.mxfp8-*`` beside it.

    ``Staging`` may ``mkdir(exist_ok=True)`` the destination's parent: that one is allowed.
    Writes of ``__pycache__`` by a first-time import are the interpreter's, not ours.
    """
    dest = Path(os.path.abspath(dest))
    bad = []
    for kind, path in events:
        if kind in ("read", "unpickle"):
            continue
        p = Path(os.path.abspath(path))
        if "__pycache__" in p.parts or (kind == "os.mkdir" and p == dest.parent):
            continue
        top = p.relative_to(dest.parent).parts[0] if dest.parent in p.parents else None
        if top != dest.name and not (top or "").startswith(f".{dest.name}.mxfp8-"):
            bad.append((kind, path))
    return bad


# --- an evil pickle -----------------------------------------------------------------------


class _Touch:
    """Unpickling this object creates ``path``: proof of unpickling if the file ever appears."""

    def __init__(self, path: Path) -> None:
        self.path = str(path)

    def __reduce__(self):
        return (Path.touch, (Path(self.path),))


def evil_pickle(path: Path, canary: Path) -> Path:
    path.write_bytes(pickle.dumps({"model.embed_tokens.weight": _Touch(canary)}))
    return path


# --- a Hugging Face cache, laid out as huggingface_hub lays it out --------------------------


def _git_blob_sha1(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def hf_cache_repo(
    cache: Path, repo_id: str, files: dict[str, bytes], *, commit: str = "a" * 40
) -> Path:
    """Lay ``files`` out in HF cache ``cache`` (HF_HUB_CACHE) as ``snapshot_download`` does.

    ``models--org--name/blobs/<id>`` holds the bytes (sha256 for LFS files such as
    ``*.safetensors``, git blob sha1 for the rest), ``refs/main`` the commit, and
    ``snapshots/<commit>/<file>`` is a relative link into ``blobs`` made by huggingface_hub's
    own ``_create_symlink``. Returns the snapshot folder.
    """
    try:
        from huggingface_hub.file_download import _create_symlink
    except ImportError:  # private helper moved: same relative links, made by hand
        def _create_symlink(src: str, dst: str, new_blob: bool = False) -> None:
            os.symlink(os.path.relpath(src, os.path.dirname(dst)), dst)
    storage = cache / ("models--" + repo_id.replace("/", "--"))
    (storage / "blobs").mkdir(parents=True, exist_ok=True)
    (storage / "refs").mkdir(exist_ok=True)
    (storage / "refs" / "main").write_text(commit)
    snapshot = storage / "snapshots" / commit
    for rel, data in files.items():
        lfs = rel.endswith(".safetensors") or len(data) > 10 * 1024 * 1024
        sha = hashlib.sha256(data).hexdigest() if lfs else _git_blob_sha1(data)
        blob = storage / "blobs" / sha
        blob.write_bytes(data)
        dst = snapshot / rel
        dst.parent.mkdir(parents=True, exist_ok=True)
        _create_symlink(str(blob), str(dst), new_blob=True)
    return snapshot


def folder_files(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes()
            for p in sorted(root.rglob("*")) if p.is_file()}


def rewrite_tensors(src: Path, edit) -> None:
    """Re-save every shard of ``src`` after ``edit(tensors)`` changes ``{name: (shard, tensor)}``
    in place; the index follows."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    shards = sorted(p.name for p in src.glob("*.safetensors"))
    tensors = {}
    for shard in shards:
        with safe_open(str(src / shard), "pt") as f:
            tensors.update({k: (shard, f.get_tensor(k)) for k in f.keys()})
    edit(tensors)
    for shard in shards:
        save_file({k: t for k, (s, t) in tensors.items() if s == shard}, str(src / shard),
                  metadata={"format": "pt"})
    index = json.loads((src / INDEX).read_text())
    index["weight_map"] = {k: s for k, (s, _) in sorted(tensors.items())}
    (src / INDEX).write_text(json.dumps(index))
