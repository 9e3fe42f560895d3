"""Reading a source checkpoint: local folder or Hub snapshot -> headers + lazy tensor bytes.

Only this module and ``write.py`` touch the disk. Nothing here trusts the input: safetensors
headers, the index and config are validated before a byte of tensor data is read, paths are
kept inside the model folder, and pickles are never opened.
"""

from __future__ import annotations

import ctypes
import json
import math
import mmap
import os
import posixpath
import signal
import stat
import struct
import sys
import threading
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

from mxfp8_convert._gc import paused_gc
from mxfp8_convert._lazy import numpy as np
from mxfp8_convert._lazy import torch
from mxfp8_convert.dtypes import ST_DTYPES, torch_dtype
from mxfp8_convert.errors import LayoutError, SourceError
from mxfp8_convert.format import COMPLETE_MARKER, CONFIG_FILE
from mxfp8_convert.format import INDEX_FILE as INDEX_NAME
from mxfp8_convert.format import SINGLE_FILE as SINGLE_NAME

#: files besides config.json that declare a quantization (ModelOpt, AutoAWQ, AutoGPTQ); they
#: describe the source's format, so they are read for detection and never copied
QUANT_FILES = ("hf_quant_config.json", "quant_config.json", "quantize_config.json")

#: safetensors itself refuses headers over 100 MB; so do we, before allocating anything.
#: The same bound holds for the index (a 1M-tensor model's index is ~100 MB).
MAX_HEADER_BYTES = 100 * 1024 * 1024
#: config.json and hf_quant_config.json are KBs; they are re-written indented, so their size and
#: nesting bound the output's (indentation grows with depth: 16 MiB at depth 32 is ~0.5 GB)
MAX_CONFIG_BYTES = 16 * 1024 * 1024
MAX_JSON_DEPTH = 32
#: what a model folder may hold beside its weights that the conversion never needs to read
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")
#: bytes per memchr() call of ``ShardReader.find_byte``: the second byte's pass over a block
#: reads it from the CPU cache, not memory
SCAN_BLOCK = 1 << 20


def _libc_memchr():
    """libc's memchr through ctypes (which lets other threads run during the call), or None."""
    try:
        f = ctypes.CDLL(None).memchr
    except (OSError, AttributeError):
        return None
    f.restype, f.argtypes = ctypes.c_void_p, [ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t]
    return f


_memchr = _libc_memchr()


class TensorInfo(NamedTuple):
    """Where one tensor's bytes sit: ``nbytes`` bytes at absolute offset ``begin`` of ``file``.

    Immutable, as a frozen dataclass would be, and built in a fraction of its time: a
    DeepSeek-V3 checkpoint has 91,991 of them.
    """

    name: str
    dtype: str  # safetensors dtype string, e.g. "F8_E4M3"
    shape: tuple[int, ...]
    file: str  # path relative to the model folder
    begin: int
    nbytes: int

    def to_dict(self) -> dict:
        return {
            "name": self.name,
            "dtype": self.dtype,
            "shape": list(self.shape),
            "file": self.file,
        }


@dataclass(frozen=True, slots=True)
class ShardHeader:
    """A parsed, validated safetensors header."""

    relpath: str
    size: int
    raw: bytes  # the 8 length bytes + JSON header, as on disk (fingerprinted)
    metadata: dict[str, str]
    tensors: dict[str, TensorInfo]


@dataclass(frozen=True, slots=True)
class SourceCheckpoint:
    """A model folder: its config, shard headers, tensor locations and other files."""

    root: Path
    config: dict | None
    config_raw: bytes
    hf_quant_config: dict | None
    shards: dict[str, ShardHeader]
    tensors: dict[str, TensorInfo]
    indexed: bool  # True when model.safetensors.index.json exists
    other_files: tuple[str, ...] = field(default=())
    #: the files of ``formats.QUANT_FILES`` that exist, parsed (any JSON value)
    quant_files: dict = field(default_factory=dict)
    #: what planning found once for this checkpoint object (``plan.classify``: its quantized
    #: pairs, its dense architecture); it goes with the checkpoint, so a process that converts
    #: many models holds only what the checkpoints it still uses need
    memo: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    def path(self, relpath: str) -> Path:
        return self.root / relpath


def _fail(path: str, what: str, hint: str | None = None) -> SourceError:
    return SourceError(f"{path}: {what}", hint=hint)


def safe_child(root: Path, rel: str, *, what: str) -> Path:
    """Return ``root/rel`` if ``rel`` stays inside ``root``, else raise SourceError.

    ``rel`` must be relative, normalised (no ``.``, ``..``, ``//`` or trailing ``/``: one
    spelling per file) and free of NUL bytes. A symlink may point outside the folder only into
    the blob store of the Hugging Face cache snapshot the folder belongs to
    (``<repo>/snapshots/<rev>[/<sub>]`` -> ``<repo>/blobs``), which is how the Hub cache lays
    files out. Nothing is opened.
    """
    if (
        not isinstance(rel, str)
        or not rel
        or "\0" in rel
        or rel.startswith(("/", "\\"))
        or Path(rel).is_absolute()
        or ".." in Path(rel).parts
        or posixpath.normpath(rel) != rel  # "./x", "a//b", "a/": one spelling per file
    ):
        raise SourceError(f"{what} {rel!r} is not a path inside the model folder")
    p = root / rel
    try:
        real = p.resolve()
        real_root = root.resolve()
    except (OSError, RuntimeError) as e:  # symlink loop (RuntimeError before 3.13), name too long
        raise SourceError(f"{what} {rel!r} cannot be resolved ({_reason(e)})") from None
    if real == real_root or real_root in real.parents:
        return p
    blobs = _hub_blobs(real_root)
    if blobs is not None and blobs in real.parents:
        return p
    raise SourceError(f"{what} {rel!r} is a link that leads outside the model folder")


def _hub_blobs(real_root: Path) -> Path | None:
    """``<repo>/blobs`` if ``real_root`` is (inside) a Hub cache snapshot
    ``<repo>/snapshots/<rev>``.

    Its files are links ``../../blobs/<hash>`` (huggingface_hub ``_create_symlink``). ``blobs``
    is deliberately not resolved: were it a link itself, no resolved path would have it as a
    parent, so it cannot widen what is reachable.
    """
    for folder in (real_root, *real_root.parents):
        if folder.parent.name == "snapshots":
            return folder.parent.parent / "blobs"
    return None


def hub_blob_sha256(root: Path, rel: str) -> str | None:
    """The Hub's SHA-256 of file ``root/rel`` when it is a Hub cache snapshot link to a blob
    named by it (how huggingface_hub stores LFS files: ``blobs/<sha256>``), else None."""
    p = root / rel
    if not p.is_symlink():
        return None
    try:
        real = p.resolve(strict=True)
    except (OSError, RuntimeError):
        return None
    blobs = _hub_blobs(root.resolve())
    name = real.name
    if blobs is None or real.parent != blobs or len(name) != 64 or name.strip("0123456789abcdef"):
        return None
    return name


def _reason(e: BaseException) -> str:
    return (e.strerror if isinstance(e, OSError) and e.strerror else str(e)) or type(e).__name__


def _open_regular(root: Path, rel: str, *, what: str):
    """Open ``root/rel`` for reading if it is a regular file inside the model folder.

    Returns ``(binary file object, size)``. ``O_NONBLOCK`` makes opening a FIFO return at once
    (instead of waiting for a writer), so ``fstat`` can refuse it; it changes nothing for a
    regular file.
    """
    path = safe_child(root, rel, what=what)
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        raise _fail(rel, "file not found") from None
    except (OSError, ValueError) as e:
        raise _fail(rel, f"cannot be opened ({_reason(e)})") from None
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        kind = (
            "a directory"
            if stat.S_ISDIR(st.st_mode)
            else "not a regular file (pipe, socket or device)"
        )
        raise _fail(rel, f"is {kind}, not a {'safetensors' if what == 'shard' else 'regular'} file")
    try:  # what was opened is what was checked: the path, checked again, still names this file
        same = os.path.samestat(os.stat(safe_child(root, rel, what=what)), st)
    except OSError:
        same = False
    except SourceError:
        os.close(fd)
        raise
    if not same:
        os.close(fd)
        raise _fail(rel, "changed while it was being opened (replaced or relinked)")
    f = os.fdopen(fd, "rb")
    return f, st.st_size


def open_source_file(root: Path, rel: str):
    """Open file ``rel`` of the model folder for copying, checked as it is opened: a regular
    file (a FIFO is refused without waiting), inside the folder (or the Hub cache's blobs).

    Returns ``(binary file object, os.stat_result)``.

    Raises:
        SourceError: naming the file.
    """
    f, _ = _open_regular(root, rel, what="file")
    return f, os.fstat(f.fileno())


class _Pairs(dict):
    """A JSON object that had repeated keys (``json.loads`` alone keeps the last silently)."""

    __slots__ = ("repeated",)


def _object_pairs(pairs: list[tuple[str, object]]) -> dict:
    d = dict(pairs)
    if len(d) == len(pairs):
        return d
    d = _Pairs(d)
    d.repeated, seen = [], set()
    for k, _ in pairs:
        if k in seen:
            d.repeated.append(k)
        seen.add(k)
    return d


def _repeated(obj) -> list[str]:
    return getattr(obj, "repeated", []) if isinstance(obj, dict) else []


def _json_loads(
    raw: bytes, rel: str, what: str = "not valid JSON", *, max_depth: int | None = None
):
    """Parse JSON bytes, or raise SourceError ``rel: what``. Objects with repeated keys come back
    as ``_Pairs`` (see ``_repeated``).

    Without a backslash in the text every ``"`` delimits a string, so a parse that keeps as many
    strings (keys and values) as the text has pairs of quotes dropped no repeated key: then the
    hook that finds them, a Python call per object, is not needed.
    """
    try:
        text = raw.decode("utf-8")
        obj, depth = None, None
        if "\\" not in text:
            obj = json.loads(text)
            strings, depth = _strings_and_depth(obj)
            if 2 * strings != text.count('"'):
                obj, depth = None, None
        if depth is None:
            obj = json.loads(text, object_pairs_hook=_object_pairs)
    except (UnicodeDecodeError, ValueError, RecursionError):  # ValueError: also >4300-digit ints
        raise _fail(rel, what) from None
    if max_depth is not None and (
        depth > max_depth if depth is not None else _depth_exceeds(obj, max_depth)
    ):
        raise _fail(rel, f"nested more than {max_depth} levels deep")
    return obj


def _strings_and_depth(obj) -> tuple[int, int]:
    """How many strings (object keys included) a parsed JSON value holds, and how deep its
    objects and arrays nest (0 for a scalar, 1 for a flat object)."""
    strings, deepest = 0, 0
    stack = [(obj, 1)]
    while stack:
        o, depth = stack.pop()
        if type(o) is dict:
            strings += len(o)
            children = o.values()
        elif type(o) is list:
            children = o
        else:
            strings += type(o) is str
            continue
        deepest = max(deepest, depth)
        for c in children:
            t = type(c)
            if t is str:
                strings += 1
            elif t is dict or t is list:
                stack.append((c, depth + 1))
    return strings, deepest


def _depth_exceeds(obj, limit: int) -> bool:
    stack = [(obj, 1)]
    while stack:
        o, depth = stack.pop()
        children = o.values() if isinstance(o, dict) else o if isinstance(o, list) else None
        if children is None:
            continue
        if depth > limit:
            return True
        stack.extend((c, depth + 1) for c in children)
    return False


def read_header(root: Path, relpath: str) -> ShardHeader:
    """Parse and validate the header of safetensors file ``root/relpath``.

    Checks: the file is a regular file inside the model folder; the length prefix fits the
    file and the 100 MB limit; the header is a JSON object naming each tensor once; every entry
    has a known dtype, a shape of non-negative ints and ``data_offsets`` that match dtype x
    shape, lie inside the file and neither overlap nor leave holes. Shapes are multiplied as
    Python ints, never allocated: ``[2**40, 2**40]`` fails on its offsets.

    Raises:
        SourceError: naming ``relpath`` and, where it is one tensor's fault, the tensor.
    """
    f, size = _open_regular(root, relpath, what="shard")
    try:
        with f:
            prefix = f.read(8)
            if len(prefix) < 8:
                raise _fail(relpath, f"file is {size} bytes, too short to be safetensors")
            (n,) = struct.unpack("<Q", prefix)
            if n > MAX_HEADER_BYTES or 8 + n > size:
                raise _fail(
                    relpath, f"header length {n} points past the end of the {size}-byte file"
                )
            raw = f.read(n)
    except OSError as e:
        raise _fail(relpath, f"cannot be read ({_reason(e)})") from None
    if len(raw) != n:
        raise _fail(relpath, f"file ended inside the {n}-byte header (changed while read?)")
    fast = _fast_header(relpath, raw, data_start=8 + n, size=size)
    if fast is not None:
        return ShardHeader(
            relpath=relpath, size=size, raw=prefix + raw, metadata=fast[0], tensors=fast[1]
        )
    header = _json_loads(
        raw, relpath, "header is not valid JSON (truncated or not a safetensors file)"
    )
    if not isinstance(header, dict):
        raise _fail(relpath, "header is not a JSON object")
    if _repeated(header):
        raise _fail(relpath, f"tensor {_repeated(header)[0]!r} is declared twice in the header")
    metadata = header.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()
    ):
        raise _fail(relpath, "__metadata__ must map strings to strings")
    tensors = _parse_entries(relpath, header, data_start=8 + n, size=size)
    return ShardHeader(
        relpath=relpath, size=size, raw=prefix + raw, metadata=metadata, tensors=tensors
    )


#: safetensors dtype -> bytes per element
_ITEMSIZE = {name: size for name, (_, size) in ST_DTYPES.items()}


def _fast_header(
    relpath: str, raw: bytes, *, data_start: int, size: int
) -> tuple[dict[str, str], dict[str, TensorInfo]] | None:
    """``(metadata, tensors)`` of a header that passes every check of ``read_header``; None
    at the first thing to report, for the checks that name it (which parse again).

    The same checks with less Python per entry. Repeated keys are found without a Python hook
    per JSON object (which cost more than the rest of planning): every entry must have exactly
    the keys ``dtype``, ``shape`` and ``data_offsets``, and with no backslash in the header (so
    no escaped spelling of a key) each of those, and ``__metadata__``, must appear as a string
    in the raw bytes exactly as often as the parsed header holds it.
    """
    if b"\\" in raw:
        return None
    try:
        top = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError):
        return None
    if type(top) is not dict:
        return None
    meta = top.pop("__metadata__", None)
    if raw.count(b'"__metadata__"') != (meta is not None):
        return None
    meta = meta or {}
    if type(meta) is not dict or not all(
        type(k) is str and type(v) is str for k, v in meta.items()
    ):
        return None
    n = len(top)
    if not raw.count(b'"data_offsets"') == raw.count(b'"dtype"') == raw.count(b'"shape"') == n:
        return None
    tensors: dict[str, TensorInfo] = {}
    spans = []
    limit = 2**48
    itemsize = _ITEMSIZE.get
    new = tuple.__new__  # a TensorInfo without the Python frame of its class's ``__new__``
    for name, e in top.items():
        if type(e) is not dict or len(e) != 3:
            return None
        try:  # a missing key, or offsets that are not two values
            dtype, shape, (begin, end) = e["dtype"], e["shape"], e["data_offsets"]
        except (KeyError, TypeError, ValueError):
            return None
        item = itemsize(dtype) if type(dtype) is str else None
        if (
            item is None
            or type(shape) is not list
            or type(begin) is not int
            or type(end) is not int
            or not 0 <= begin <= end
        ):
            return None
        if len(shape) == 2:  # most tensors: the loop below, unrolled
            n, k = shape
            if type(n) is not int or type(k) is not int or not (0 <= n < limit and 0 <= k < limit):
                return None
            nbytes = item * n * k
        else:
            nbytes = item
            for d in shape:
                if type(d) is not int or not 0 <= d < limit:
                    return None
                nbytes *= d
        if end - begin != nbytes or data_start + end > size:
            return None
        spans.append((begin, end))
        tensors[name] = new(TensorInfo, (name, dtype, tuple(shape), relpath, data_start + begin,
                                         nbytes))
    spans.sort()
    pos = 0
    for begin, end in spans:
        if begin != pos:
            return None
        pos = end
    return meta, tensors


def _parse_entries(
    relpath: str, header: dict, *, data_start: int, size: int
) -> dict[str, TensorInfo]:
    tensors: dict[str, TensorInfo] = {}
    spans = []
    for name, entry in header.items():
        if not isinstance(entry, dict):
            raise _fail(relpath, f"tensor {name!r}: header entry is not an object")
        if _repeated(entry):
            raise _fail(relpath, f"tensor {name!r}: key {_repeated(entry)[0]!r} appears twice")
        dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
        if not isinstance(dtype, str) or dtype not in ST_DTYPES:  # a list would be unhashable
            raise _fail(relpath, f"tensor {name!r}: unknown dtype {dtype!r}")
        if not isinstance(shape, list) or not all(type(d) is int and 0 <= d < 2**48 for d in shape):
            raise _fail(relpath, f"tensor {name!r}: invalid shape {shape!r}")
        if (
            not isinstance(offsets, list)
            or len(offsets) != 2
            or not all(type(o) is int and o >= 0 for o in offsets)
            or offsets[0] > offsets[1]
        ):
            raise _fail(relpath, f"tensor {name!r}: invalid data_offsets {offsets!r}")
        nbytes = math.prod(shape) * ST_DTYPES[dtype][1]
        if offsets[1] - offsets[0] != nbytes:
            raise _fail(
                relpath,
                f"tensor {name!r}: data_offsets span {offsets[1] - offsets[0]} bytes but "
                f"{dtype} {shape} needs {nbytes}",
            )
        if data_start + offsets[1] > size:
            raise _fail(
                relpath,
                f"tensor {name!r}: data ends at byte {data_start + offsets[1]} past the end of "
                f"the {size}-byte file (truncated?)",
            )
        spans.append((offsets[0], offsets[1], name))
        tensors[name] = TensorInfo(
            name, dtype, tuple(shape), relpath, data_start + offsets[0], nbytes
        )
    spans.sort()
    pos = 0
    for begin, end, name in spans:
        if begin != pos:
            what = "overlaps the previous tensor" if begin < pos else "leaves a hole before it"
            raise _fail(relpath, f"tensor {name!r}: data_offsets {what}")
        pos = end
    return tensors


def _load_json(
    root: Path, rel: str, *, max_bytes: int = MAX_CONFIG_BYTES
) -> tuple[object | None, bytes]:
    """``(parsed, raw bytes)`` of JSON file ``root/rel``, or ``(None, b"")`` if there is none.

    A link (even a dangling one) counts as present: it must lead inside the folder and to a
    regular file. The size is checked before reading, the nesting after parsing.
    """
    if not os.path.lexists(root / rel):
        return None, b""
    f, size = _open_regular(root, rel, what="file")
    with f:
        if size > max_bytes:
            raise _fail(rel, f"{size} bytes is too large for this JSON file (limit {max_bytes})")
        try:
            raw = f.read(max_bytes + 1)
        except OSError as e:
            raise _fail(rel, f"cannot be read ({_reason(e)})") from None
    if len(raw) > max_bytes:
        raise _fail(rel, f"grew past {max_bytes} bytes while read")
    return _json_loads(raw, rel, max_depth=MAX_JSON_DEPTH), raw


def _shard_names(root: Path) -> tuple[list[str], dict | None]:
    index, _ = _load_json(root, INDEX_NAME, max_bytes=MAX_HEADER_BYTES)
    if index is not None:
        wm = index.get("weight_map") if isinstance(index, dict) else None
        if (
            not isinstance(wm, dict)
            or not wm
            or not all(isinstance(k, str) and isinstance(v, str) for k, v in wm.items())
        ):
            raise SourceError(
                f"{INDEX_NAME}: 'weight_map' must be a non-empty object of name -> file"
            )
        if _repeated(wm):
            raise SourceError(
                f"{INDEX_NAME}: tensor {_repeated(wm)[0]!r} is listed twice in weight_map"
            )
        shards = sorted(set(wm.values()))
        for rel in shards:
            if not rel.endswith(".safetensors"):
                raise SourceError(
                    f"{INDEX_NAME}: weight_map names {rel!r}, which is not a .safetensors file"
                )
            safe_child(root, rel, what=f"{INDEX_NAME}: shard")
        return shards, wm
    if (root / SINGLE_NAME).exists():
        return [SINGLE_NAME], None
    shards = sorted(p.name for p in root.glob("*.safetensors"))
    if shards:
        return shards, None
    pickles = sorted(
        p.name for p in root.iterdir() if p.name.endswith(PICKLE_SUFFIXES)
    )  # names only
    if pickles:
        raise SourceError(
            f"{root}: only pickle weights ({pickles[0]}{', ...' if len(pickles) > 1 else ''}); "
            "safetensors is required",
            hint="convert the checkpoint to safetensors first; pickles are never opened",
        )
    raise SourceError(f"{root}: no model.safetensors, shards or {INDEX_NAME} found")


@paused_gc()  # ~10^5 header entries and tensor locations, no cycles (``_gc``)
def open_checkpoint(root: str | os.PathLike) -> SourceCheckpoint:
    """Read and validate everything but tensor data: config, index, every shard header.

    Raises:
        SourceError: missing folder or files, malformed JSON or headers, index naming missing
            shards or tensors or one tensor twice, a tensor in two shards, paths or links
            leaving the folder, pipes or devices where files should be, JSON files too large
            or nested too deep. Pickles (``*.bin``, ``*.pt``...) are never opened: alone they
            fail ("safetensors is required"), beside safetensors they are ignored.
    """
    root = Path(root)
    try:
        is_dir = root.is_dir()
    except (OSError, ValueError):  # name too long, NUL byte
        is_dir = False
    if not is_dir:
        raise SourceError(f"{root}: not a folder", hint="pass a model folder or a Hub repo id")
    config, config_raw = _load_json(root, CONFIG_FILE)
    if config is not None and not isinstance(config, dict):
        raise SourceError(f"{CONFIG_FILE}: not a JSON object")
    quant_files = {}
    for rel in QUANT_FILES:
        obj, raw = _load_json(root, rel)
        if raw:
            quant_files[rel] = obj
    hfq = quant_files.get("hf_quant_config.json")
    names, weight_map = _shard_names(root)
    shards = {rel: read_header(root, rel) for rel in names}
    tensors: dict[str, TensorInfo] = {}
    for rel, sh in shards.items():
        for name, info in sh.tensors.items():
            if name in tensors:
                raise SourceError(
                    f"tensor {name!r} is stored twice: in {tensors[name].file} and {rel}"
                )
            tensors[name] = info
    if weight_map is not None:
        _check_weight_map(weight_map, tensors)
    return SourceCheckpoint(
        root=root,
        config=config,
        config_raw=config_raw,
        hf_quant_config=hfq if isinstance(hfq, dict) else None,
        shards=shards,
        tensors=tensors,
        indexed=weight_map is not None,
        other_files=tuple(_other_files(root, set(shards))),
        quant_files=quant_files,
    )


def _check_weight_map(weight_map: dict[str, str], tensors: dict[str, TensorInfo]) -> None:
    for name, rel in weight_map.items():
        info = tensors.get(name)
        if info is None:
            raise SourceError(f"{INDEX_NAME}: tensor {name!r} is not in {rel}")
        if info.file != rel:
            raise SourceError(
                f"{INDEX_NAME}: tensor {name!r} is listed in {rel} but stored in {info.file}"
            )
    if len(tensors) == len(weight_map):  # every name of weight_map is a tensor: none missing
        return
    missing = sorted(set(tensors) - set(weight_map))
    if missing:
        raise SourceError(
            f"{INDEX_NAME}: tensor {missing[0]!r} of {tensors[missing[0]].file} is not in "
            "weight_map"
        )


#: files and folders of a model folder that are never copied to the output
_NOT_COPIED = {INDEX_NAME, CONFIG_FILE, *QUANT_FILES, ".cache", ".git", COMPLETE_MARKER}


def _other_files(root: Path, shards: set[str]) -> Iterator[str]:
    """Files to copy byte for byte: everything but shards, index, configs we rewrite, pickles.

    Each must be a regular file inside the folder (or the Hub cache's blobs): a link leading
    elsewhere, a pipe or a device fails the conversion before anything is read. Linked folders
    are not followed (a link leading outside still fails).
    """
    for dirpath, dirnames, filenames in os.walk(root):
        rel_dir = Path(dirpath).relative_to(root)
        keep = []
        for d in sorted(dirnames):
            if d in _NOT_COPIED or d.startswith(".mxfp8"):
                continue
            if os.path.islink(os.path.join(dirpath, d)):
                safe_child(root, _join(rel_dir, d), what="folder")
                continue
            keep.append(d)
        dirnames[:] = keep
        for fn in sorted(filenames):
            rel = _join(rel_dir, fn)
            if rel in shards or rel in _NOT_COPIED or fn.endswith(PICKLE_SUFFIXES):
                continue
            if fn.endswith(".safetensors"):
                continue  # a stray shard not in the index: never part of the model
            path = safe_child(root, rel, what="file")
            try:
                mode = path.stat().st_mode
            except OSError as e:
                raise _fail(rel, f"cannot be read ({_reason(e)})") from None
            if not stat.S_ISREG(mode):
                raise _fail(rel, "is not a regular file (pipe, socket or device)")
            yield rel


def _join(rel_dir: Path, name: str) -> str:
    return name if str(rel_dir) == "." else f"{rel_dir.as_posix()}/{name}"


class _Watch:
    """Source shards mapped under a read lease (Linux ``F_SETLEASE``), so that another process
    that truncates or rewrites one cannot pull the pages from under the mapping.

    Touching a mapped page past a shrunken file's end raises SIGBUS, which no Python code can
    catch: the process just dies (exit 135). With a read lease, the kernel makes the other
    process's ``open(O_WRONLY)`` / ``truncate()`` wait (up to ``/proc/sys/fs/lease-break-time``,
    45 s) and sends us SIGIO; the handler raises a ``SourceError`` naming the file, the
    conversion stops, its mappings close and the lease goes, and the other process goes on.
    Leases are taken only inside ``watch_source()`` (its SIGIO handler must be there: SIGIO's
    default action ends the process), in the main thread, where the system grants them (our
    own files, a local filesystem); elsewhere the size is checked before mapping, as always.
    """

    active = False
    leased: dict[int, str] = {}  # fd -> shard
    changed: str | None = None  # the shard another process started to change
    _lock = threading.Lock()

    @classmethod
    def lease(cls, fd: int, rel: str) -> bool:
        if not cls.active or _F_SETLEASE is None:
            return False
        import fcntl

        try:
            fcntl.fcntl(fd, _F_SETLEASE, fcntl.F_RDLCK)
        except OSError:  # not our file, open for writing elsewhere, NFS...: size checks only
            return False
        with cls._lock:
            cls.leased[fd] = rel
        return True

    @classmethod
    def release(cls, fd: int) -> None:
        with cls._lock:
            if cls.leased.pop(fd, None) is None:
                return
        import fcntl

        try:
            fcntl.fcntl(fd, _F_SETLEASE, fcntl.F_UNLCK)
        except OSError:
            pass

    @classmethod
    def on_sigio(cls, signum, frame) -> None:
        import fcntl

        with cls._lock:
            leased = list(cls.leased.items())
        for fd, rel in leased:
            try:
                breaking = fcntl.fcntl(fd, _F_GETLEASE) == fcntl.F_UNLCK
            except OSError:
                continue
            if breaking:
                cls.changed = rel
                raise source_changed(rel)


def source_changed(rel: str) -> SourceError:
    return SourceError(
        f"{rel}: another process opened this source shard for writing or truncated "
        "it during the conversion",
        hint="rerun once nothing else writes the source",
    )


def check_source_unchanged() -> None:
    """For worker threads: stop once the SIGIO handler saw a source shard being changed."""
    if _Watch.changed is not None:
        raise source_changed(_Watch.changed)


#: Linux's fcntl commands for file leases (the values of <fcntl.h>)
_F_SETLEASE, _F_GETLEASE = (1024, 1025) if sys.platform.startswith("linux") else (None, None)


@contextmanager
def watch_source() -> Iterator[None]:
    """Within this block, shards opened by ``ShardReader`` are read under a lease (``_Watch``).

    Only in the main thread of the process (where a signal handler can be set) and on Linux;
    a no-op elsewhere.
    """
    main = threading.current_thread() is threading.main_thread()
    if _F_SETLEASE is None or not main or _Watch.active:
        yield
        return
    previous = signal.signal(signal.SIGIO, _Watch.on_sigio)
    _Watch.active, _Watch.changed = True, None
    try:
        yield
    finally:
        _Watch.active = False
        signal.signal(signal.SIGIO, previous)


def find_bytes(buf, values: bytes) -> int:
    """Index of the first byte of ``buf`` (any contiguous buffer) equal to one of ``values``, or -1.

    A check on every weight byte must run at memory speed and beside the other threads: libc's
    memchr, called through ctypes so that the GIL is released while it scans (``mmap.find``
    holds it), one ``SCAN_BLOCK`` at a time so that the scan for the second value reads the
    block from the CPU cache. Without a libc memchr, a numpy comparison per value.
    """
    a = np.frombuffer(buf, dtype=np.uint8)
    if a.size == 0:
        return -1
    if _memchr is None:
        hits = [int(h[0]) for v in values if (h := np.flatnonzero(a == v)).size]
        return min(hits) if hits else -1
    base = a.ctypes.data
    for at in range(0, a.size, SCAN_BLOCK):
        size = min(SCAN_BLOCK, a.size - at)
        hits = [h for v in values if (h := _memchr(base + at, v, size))]
        if hits:
            return min(hits) - base
    return -1


class ShardReader:
    """One open source shard: an fd for in-kernel copies and a read-only mmap for views.

    Views cost no copy; ``drop()`` tells the kernel we are done with a range, so the pages we
    touched leave this process's resident set (they stay in the page cache).
    """

    def __init__(self, root: Path, relpath: str, expected_size: int) -> None:
        self.relpath = relpath
        self._f, size = _open_regular(root, relpath, what="shard")
        self.fd = self._f.fileno()
        if _Watch.lease(self.fd, relpath):  # from now on a truncation waits for us: size again
            size = os.fstat(self.fd).st_size
        if size != expected_size:  # changed since its header was validated: never mmap past EOF
            self.close()
            raise SourceError(
                f"{relpath}: file changed size during conversion ({expected_size} -> {size})"
            )
        self._mm = mmap.mmap(self.fd, 0, access=mmap.ACCESS_READ) if size else None

    def view(self, begin: int, n: int) -> torch.Tensor:
        """Read-only uint8 view of bytes ``[begin, begin + n)`` (do not write to it)."""
        if n == 0:
            return torch.empty(0, dtype=torch.uint8)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # "buffer is not writable": we never write
            return torch.frombuffer(self._mm, dtype=torch.uint8, count=n, offset=begin)

    def bytes(self, begin: int, n: int) -> memoryview:
        """Read-only memoryview of bytes ``[begin, begin + n)``, without torch."""
        if n == 0:
            return memoryview(b"")
        return memoryview(self._mm)[begin : begin + n]

    def find_byte(self, begin: int, n: int, values: bytes) -> int:
        """Offset of the first byte in ``[begin, begin + n)`` equal to one of ``values``, or -1
        (``find_bytes`` over the mapping)."""
        if self._mm is None or n == 0:
            return -1
        at = find_bytes(self.bytes(begin, n), values)
        return at if at < 0 else begin + at

    def drop(self, begin: int, n: int) -> None:
        page = mmap.PAGESIZE
        start, end = -(-begin // page) * page, (begin + n) // page * page
        if self._mm is not None and end > start and hasattr(mmap, "MADV_DONTNEED"):
            self._mm.madvise(mmap.MADV_DONTNEED, start, end - start)

    def close(self) -> None:
        _Watch.release(self.fd)
        if getattr(self, "_mm", None) is not None:
            try:
                self._mm.close()
            except BufferError:  # a view is still referenced somewhere; the GC unmaps it later
                pass
        self._f.close()


def read_tensor(ckpt_root: Path, info: TensorInfo) -> torch.Tensor:
    """The whole tensor, as a new CPU tensor of its own dtype and shape."""
    f, size = _open_regular(ckpt_root, info.file, what="shard")
    with f:
        if info.begin + info.nbytes > size:  # before allocating: the header may have lied
            raise SourceError(f"{info.file}: file ended inside tensor {info.name!r} (truncated?)")
        buf = torch.empty(info.nbytes, dtype=torch.uint8)
        f.seek(info.begin)
        if f.readinto(memoryview(buf.numpy()).cast("B")) != info.nbytes:
            raise SourceError(f"{info.file}: file ended inside tensor {info.name!r} (truncated?)")
    return buf.view(torch_dtype(info.dtype)).reshape(info.shape)


#: float safetensors dtype -> how its bytes become float32 with numpy (exact, or rounded to
#: nearest as torch's ``.to(torch.float32)`` does for F64)
_AS_F32 = {
    "F32": lambda b: np.frombuffer(b, dtype="<f4"),
    "F16": lambda b: np.frombuffer(b, dtype="<f2").astype(np.float32),
    "BF16": lambda b: (np.frombuffer(b, dtype="<u2").astype(np.uint32) << 16).view(np.float32),
    "F64": lambda b: np.frombuffer(b, dtype="<f8").astype(np.float32),
}


#: scales at most this many bytes apart are read with one ``pread`` (the bytes between them are
#: read and dropped): a system call costs about what copying this much from the page cache does
SCALE_READ_GAP = 16 * 1024
#: the most one such ``pread`` reads
SCALE_READ_MAX = 32 * 1024 * 1024


def pow2_scales(ckpt_root: Path, scales: list[TensorInfo]) -> dict[str, bool]:
    """Scale name -> whether every multiplier of that float scale tensor is an exact power of
    two in ``[2^-127, 2^127]``: then it maps losslessly to UE8M0 (an FP8 pair converts without
    requantizing). The one fact about tensor data a plan needs.

    Each file is opened (and its path checked) once and told that it is read at random
    (``POSIX_FADV_RANDOM``: no readahead, which on sparse or cold files would read the weights
    around every scale); its scales are read in file order with one ``pread`` per run of scales
    at most ``SCALE_READ_GAP`` bytes apart (safetensors stores a file's float32 scales side by
    side: one read; a mapping would fault in the pages around every scale), and tested together
    with numpy on their float32 bits (the values ``.to(torch.float32)`` gives). Tensors of
    other dtypes are left out.

    Raises:
        LayoutError: a zero, negative, NaN or Inf multiplier, naming the tensor, the value and
            its index.
        SourceError: a file that cannot be opened, or that ends inside a tensor.
    """
    by_file: dict[str, list[TensorInfo]] = {}
    for s in scales:
        if s is not None and s.dtype in _AS_F32:
            by_file.setdefault(s.file, []).append(s)
    out: dict[str, bool] = {}
    for rel in sorted(by_file):  # a file at a time: memory bounded by one file's scales
        group = sorted(by_file[rel], key=lambda i: i.begin)
        f, size = _open_regular(ckpt_root, rel, what="shard")
        with f:
            for info in group:  # before any read: the first (in file order) the file cannot hold
                if info.begin + info.nbytes > size:
                    raise SourceError(f"{rel}: file ended inside tensor {info.name!r} (truncated?)")
            if hasattr(os, "posix_fadvise"):
                os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_RANDOM)
            data = _read_runs(f.fileno(), rel, group)
        out.update(_pow2_of(group, data))
    return out


def _read_runs(fd: int, rel: str, group: list[TensorInfo]) -> list[memoryview]:
    """The bytes of each tensor of ``group`` (sorted by offset), read with one ``pread`` per run
    of tensors at most ``SCALE_READ_GAP`` bytes apart (and ``SCALE_READ_MAX`` long)."""
    data: list[memoryview] = []
    i = 0
    while i < len(group):
        start, end, j = group[i].begin, group[i].begin + group[i].nbytes, i + 1
        while j < len(group):
            b, e = group[j].begin, group[j].begin + group[j].nbytes
            if b - end > SCALE_READ_GAP or max(e, end) - start > SCALE_READ_MAX:
                break
            end, j = max(e, end), j + 1
        try:
            buf = memoryview(os.pread(fd, end - start, start)) if end > start else memoryview(b"")
        except OSError as e:
            raise _fail(rel, f"cannot be read ({_reason(e)})") from None
        for info in group[i:j]:
            at = info.begin - start
            if at + info.nbytes > len(buf):  # the file shrank since it was opened
                raise SourceError(f"{rel}: file ended inside tensor {info.name!r} (truncated?)")
            data.append(buf[at : at + info.nbytes])
        i = j
    return data


def _pow2_of(group: list[TensorInfo], data: list[memoryview]) -> dict[str, bool]:
    """``pow2_scales`` of the scales of one file, ``data[i]`` the bytes of ``group[i]``."""
    out = {}
    for dtype in sorted({s.dtype for s in group}):
        idx = [i for i, s in enumerate(group) if s.dtype == dtype]
        same = [group[i] for i in idx]
        raw = b"".join([data[i] for i in idx])
        with np.errstate(over="ignore"):  # F64 beyond float32: inf, refused below
            bits = _AS_F32[dtype](raw).view(np.uint32)
        sizes = np.array([s.nbytes // ST_DTYPES[dtype][1] for s in same], dtype=np.int64)
        starts = np.concatenate(([0], np.cumsum(sizes)[:-1]))
        nonempty = sizes > 0
        tensor_bad = np.zeros(len(same), dtype=bool)
        tensor_pow2 = np.ones(len(same), dtype=bool)
        if nonempty.any():
            at = starts[nonempty]
            # a finite positive float32 is 1 .. 0x7F7FFFFF: bits - 1 wraps +0 to 2^32 - 1, and
            # NaN, Inf and every sign bit are above
            tensor_bad[nonempty] = np.maximum.reduceat(bits - np.uint32(1), at) >= 0x7F7FFFFF
            # a positive finite power of two: mantissa 0, or the subnormal 2^-127 (1 << 22):
            # then the smaller of the mantissa and ``bits ^ (1 << 22)`` is 0
            low = np.bitwise_and(bits, np.uint32(0x7FFFFF))
            np.minimum(low, bits ^ np.uint32(1 << 22), out=low)
            tensor_pow2[nonempty] = np.maximum.reduceat(low, at) == 0
        for j in np.flatnonzero(tensor_bad)[:1].tolist():
            s = same[j]
            _refuse_scale(s, bits[starts[j] : starts[j] + sizes[j]].view(np.float32))
        out.update(zip([s.name for s in same], tensor_pow2.tolist(), strict=True))
    return out


def _refuse_scale(s: TensorInfo, values: np.ndarray) -> None:
    """Raise the error for a scale tensor holding a multiplier that is not a finite positive
    number: the first one, by value and index."""
    flat = int(np.flatnonzero(~np.isfinite(values) | (values <= 0))[0])
    idx = [int(i) for i in np.unravel_index(flat, s.shape)] if s.shape else []
    raise LayoutError(
        f"{s.name}: scale {float(values[flat])} at index {idx} is not a finite positive number",
        hint="the source checkpoint's scale tensor is corrupt",
    )


def chunk_ranges(info: TensorInfo, *, granule: int, chunk_bytes: int) -> Iterator[tuple[int, int]]:
    """``(absolute offset, length)`` pieces of a tensor, each a multiple of ``granule`` bytes."""
    step = max(granule, chunk_bytes // granule * granule)
    for off in range(0, info.nbytes, step):
        yield info.begin + off, min(step, info.nbytes - off)


#: what a conversion needs from a Hub repo: weights, configs, tokenizer and other small files
HUB_ALLOW_PATTERNS = [
    "*.safetensors",
    "*.json",
    "*.txt",
    "*.model",
    "*.tiktoken",
    "*.py",
    "*.md",
    "*.jinja",
    "*.yaml",
    "LICENSE*",
    "NOTICE*",
    "tokenizer*",
    "vocab*",
    "merges*",
    ".gitattributes",
]
#: never downloaded: pickled weights and other frameworks' copies of the weights
HUB_IGNORE_PATTERNS = [
    "*.bin",
    "*.pt",
    "*.pth",
    "*.ckpt",
    "*.pkl",
    "*.h5",
    "*.msgpack",
    "*.onnx",
    "*.gguf",
    "original/*",
]


def looks_like_repo_id(model: str) -> bool:
    parts = model.split("/")
    return (
        len(parts) == 2
        and all(parts)
        and not model.startswith((".", "~"))
        and all(c.isalnum() or c in "-_." for p in parts for c in p)
    )


def resolve_model(model: str, *, revision: str | None = None, token: str | None = None) -> Path:
    """A local model folder, or the snapshot folder of Hub repo ``model`` (downloaded if needed).

    Hub downloads go through ``huggingface_hub.snapshot_download``, so HF_HOME, HF_HUB_OFFLINE
    and HF_TOKEN behave as its users expect; only the files a conversion needs are fetched.
    """
    local = Path(model).expanduser()
    try:
        exists = local.exists()
    except (OSError, ValueError):  # name too long, NUL byte: not a folder, maybe a repo id
        exists = False
    if exists:
        if revision is not None:
            raise SourceError(f"{model}: --revision applies to Hub repo ids, not local folders")
        return local
    if not looks_like_repo_id(model):
        raise SourceError(
            f"{model}: no such folder", hint="pass a model folder or a Hub repo id (org/name)"
        )
    return _snapshot(model, revision=revision, token=token)


def _snapshot(repo_id: str, *, revision: str | None, token: str | None) -> Path:
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    try:
        path = snapshot_download(
            repo_id,
            revision=revision,
            token=token,
            allow_patterns=HUB_ALLOW_PATTERNS,
            ignore_patterns=HUB_IGNORE_PATTERNS,
        )
    except GatedRepoError:
        raise SourceError(
            f"{repo_id}: gated repo, access not granted",
            hint="accept its terms on the Hub and set HF_TOKEN",
        ) from None
    except RepositoryNotFoundError:
        raise SourceError(
            f"{repo_id}: repository not found on the Hub (or private)",
            hint="check the id, or set HF_TOKEN",
        ) from None
    except RevisionNotFoundError:
        raise SourceError(f"{repo_id}: revision {revision!r} not found") from None
    except LocalEntryNotFoundError:
        raise SourceError(
            f"{repo_id}: not in the local Hub cache and the Hub cannot be reached"
            + (" (HF_HUB_OFFLINE is set)" if os.environ.get("HF_HUB_OFFLINE") else ""),
        ) from None
    return Path(path)
