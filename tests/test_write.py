"""The work folder, locks, --overwrite, resume safety, disk full, signals and file modes
(``write.py`` and the orchestration of ``convert.py``), tried on the real filesystem: symlinks
and FIFOs where our files go, two processes racing at injected points, a small tmpfs.

Every test hashes the source and a decoy folder beside it (``tree_state``: links recorded,
never followed) before and after: nothing outside our own folders may change.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import signal
import stat
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from mxfp8_convert import convert as _convert
from mxfp8_convert.convert import finalize, plan_conversion
from mxfp8_convert.errors import OutputError, SourceError
from mxfp8_convert.synth import SynthSpec, write_checkpoint
from mxfp8_convert.verify import verify
from mxfp8_convert.write import file_digest
from tests.checkpoints import Stop, interrupt_after
from tests.hostile import leftovers, run_cli, small_model, tree_state

SHARDED = SynthSpec(layers=2, hidden=256, intermediate=512, heads=4, kv_heads=2, vocab=256,
                    shards=3)
SHARD1 = "model-00001-of-00003.safetensors"
#: output shards of at most 0.6 MB: 3 of them for SHARDED (1.5 MB)
SHARD_SIZE = 600_000


def convert(*args, **kwargs):
    return _convert(*args, max_shard_size=SHARD_SIZE, **kwargs)


def _first_source(src: Path, backend: str = "trtllm", shard: int = 0) -> tuple[Path, str]:
    """The source file and name of the first tensor read for output shard ``shard``."""
    ckpt, plan = plan_conversion(src, backend, max_shard_size=SHARD_SIZE)
    name = plan.shards[shard].tensors[0].source
    return src / ckpt.tensors[name].file, name
DECOY_FILES = {"notes.txt": b"the user's own notes\n", "data/results.csv": b"a,b\n1,2\n"}


def _decoy(path: Path) -> Path:
    for rel, data in DECOY_FILES.items():
        (path / rel).parent.mkdir(parents=True, exist_ok=True)
        (path / rel).write_bytes(data)
    return path


@pytest.fixture()
def world(tmp_path):
    """(source, decoy folder, destination, the state of everything not ours)."""
    src = write_checkpoint(tmp_path / "src", SHARDED)
    decoy = _decoy(tmp_path / "decoy")
    state = lambda: (tree_state(src), tree_state(decoy))  # noqa: E731
    return src, decoy, tmp_path / "out", state


def _backend(out: Path) -> str:
    return json.loads((out / "config.json").read_text())["quantization_config"]["backend"]


def work(dest: Path) -> Path:
    return dest.parent / f".{dest.name}.mxfp8-partial"


# --- 1. symlinks and foreign folders where our work folder and files go ---------------------


@pytest.mark.parametrize("target", ["src", "decoy"])
@pytest.mark.parametrize("fresh", [False, True])
def test_work_folder_that_is_a_link_is_refused_and_nothing_deleted(world, target, fresh):
    src, decoy, out, state = world
    before = state()
    os.symlink(src if target == "src" else decoy, work(out))
    with pytest.raises(OutputError, match=r"partial: exists and is not a work folder of mxfp8"):
        convert(src, "trtllm", out, fresh=fresh)
    assert state() == before and os.path.islink(work(out)) and not out.exists()


@pytest.mark.parametrize("fresh", [False, True])
def test_foreign_folder_at_the_work_folder_name_is_never_deleted(world, fresh):
    """A model folder that happens to be named ``.out.mxfp8-partial`` (no manifest of ours)."""
    src, decoy, out, state = world
    other = write_checkpoint(work(out), SHARDED)
    before, theirs = state(), tree_state(other)
    with pytest.raises(OutputError, match="not a work folder of mxfp8-convert"):
        convert(src, "trtllm", out, fresh=fresh)
    assert state() == before and tree_state(other) == theirs


def test_lock_file_that_is_a_link_never_truncates_its_target(world):
    src, decoy, out, state = world
    before = state()
    os.symlink(decoy / "notes.txt", out.parent / ".out.mxfp8-lock")
    with pytest.raises(OutputError, match=r"\.out\.mxfp8-lock: cannot be used as a lock file"):
        convert(src, "trtllm", out)
    assert state() == before


def test_old_style_lock_link_inside_a_foreign_folder_is_left_alone(world):
    """The earlier layout kept ``.lock`` in the work folder: a link there truncated its target."""
    src, decoy, out, state = world
    work(out).mkdir()
    os.symlink(decoy / "notes.txt", work(out) / ".lock")
    before = state()
    with pytest.raises(OutputError, match="not a work folder"):
        convert(src, "trtllm", out)
    assert state() == before


@pytest.mark.parametrize("name", ["mxfp8_convert.partial.json.tmp", SHARD1.replace("1-of", "2-of")])
def test_links_planted_in_our_work_folder_are_unlinked_not_followed(world, name):
    """An interrupted run's work folder; a link to the user's file is planted where the next run
    writes (the manifest's temp file, an unfinished shard): it resumes, the target is untouched."""
    src, decoy, out, state = world
    with pytest.raises(Stop):
        convert(src, "trtllm", out, progress=interrupt_after(1))
    os.symlink(decoy / "notes.txt", work(out) / name)
    before = state()
    convert(src, "trtllm", out)
    assert state() == before and verify(out, src).ok


# --- 3. one lock per destination, for every mode, held until after the rename ---------------

CHILD = textwrap.dedent(r"""
    import os, sys, time
    from pathlib import Path
    point, flags = sys.argv[1], Path(sys.argv[2])
    argv = sys.argv[3:]

    def pause():
        (flags / "ready").write_text(str(os.getpid()))
        while not (flags / "go").exists():
            time.sleep(0.005)

    import mxfp8_convert.cli as cli
    conv = sys.modules["mxfp8_convert.convert"]
    real_rename, real_replace = os.rename, os.replace

    if point == "before-final-rename":  # the work folder is complete, about to become the output
        def rename(a, b, *k, **kw):
            if str(a).endswith(".mxfp8-partial") and not Path(b).name.startswith("."):
                pause()
            return real_rename(a, b, *k, **kw)
        os.rename = rename
    elif point == "after-swap":  # an old output has just been moved aside
        def rename(a, b, *k, **kw):
            r = real_rename(a, b, *k, **kw)
            if ".mxfp8-old-" in str(b):
                pause()
            return r
        os.rename = rename
    elif point == "first-manifest":  # the work folder was just made
        def replace(a, b, *k, **kw):
            if str(a).endswith(".json.tmp") and not getattr(replace, "done", False):
                replace.done = True
                pause()
            return real_replace(a, b, *k, **kw)
        os.replace = replace
    elif point == "writing-shard":
        real_shard = conv._ShardWriting._write_shard
        def write_shard(self, shard):
            pause()
            return real_shard(self, shard)
        conv._ShardWriting._write_shard = write_shard
    elif point == "reading":  # a source shard is open and mapped
        reader = sys.modules["mxfp8_convert.read"].ShardReader
        real_bytes = reader.bytes
        def read_bytes(self, *a):
            if not getattr(read_bytes, "done", False):
                read_bytes.done = True
                pause()
            return real_bytes(self, *a)
        reader.bytes = read_bytes
    elif point in ("parsing", "parsing-typer"):  # the fast path's reading, or Typer's
        import mxfp8_convert.cli._app as typer_app
        real_app, real_fast = typer_app.app, cli.convert_args
        def app(*a, **kw):
            pause()
            return real_app(*a, **kw)
        def convert_args(args):
            if point == "parsing-typer":
                return None
            pause()
            return real_fast(args)
        typer_app.app, cli.convert_args = app, convert_args
    elif point == "printing":
        real_result = cli.Output.result
        def result(self, *a, **kw):
            pause()
            return real_result(self, *a, **kw)
        cli.Output.result = result
    sys.exit(cli.main(argv))
""")


class Child:
    """``mxfp8-convert ARGS`` in another process, stopped at an injected point until released."""

    def __init__(self, tmp_path: Path, point: str, *args) -> None:
        self.flags = tmp_path / f"flags-{point}-{time.monotonic_ns()}"
        self.flags.mkdir()
        env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
        cmd = [sys.executable, "-c", CHILD, point, str(self.flags), *map(str, args)]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                     env=env)

    def wait_ready(self, timeout: float = 120) -> None:
        deadline = time.time() + timeout
        while not (self.flags / "ready").exists():
            assert self.proc.poll() is None, self.proc.communicate()[1]
            assert time.time() < deadline, "the child never reached its injected point"
            time.sleep(0.005)

    def go(self) -> tuple[int, str, str]:
        (self.flags / "go").write_text("")
        out, err = self.proc.communicate(timeout=120)
        return self.proc.returncode, out, err

    def signal(self, sig: int) -> tuple[int, str, str]:
        self.proc.send_signal(sig)
        if sig != signal.SIGKILL:
            (self.flags / "go").write_text("")
        out, err = self.proc.communicate(timeout=120)
        return self.proc.returncode, out, err


def _args(src, out, *extra):
    return [src, "--backend", "trtllm", "-o", out, "--quiet", *extra,
            "--max-shard-size", str(SHARD_SIZE)]


@pytest.mark.parametrize("mode", ["run", "fresh", "part"])
def test_a_run_holding_the_lock_in_its_final_rename_excludes_every_other_mode(world, tmp_path, mode,
                                                                              monkeypatch):
    """A run stopped just before its final rename still holds the lock: a second run, a
    ``--fresh`` run and a part are refused, and the first finishes complete."""
    import mxfp8_convert.write as write_mod

    monkeypatch.setattr(write_mod, "PART_WAIT", 0.2)  # a part waits for the lock; not a minute here
    src, decoy, out, state = world
    before = state()
    child = Child(tmp_path, "before-final-rename", *_args(src, out))
    child.wait_ready()
    inside = tree_state(work(out))
    with pytest.raises(OutputError, match="another mxfp8-convert is writing"):
        convert(src, "trtllm", out, fresh=mode == "fresh", part=(0, 2) if mode == "part" else None)
    assert tree_state(work(out)) == inside, "the other run touched the work folder"
    code, _, err = child.go()
    assert code == 0, err
    assert verify(out, src).ok and leftovers(tmp_path) == [] and state() == before


@pytest.mark.parametrize("fresh", [False, True])
def test_a_running_part_excludes_whole_runs_and_finalize(world, tmp_path, fresh):
    src, decoy, out, state = world
    before = state()
    child = Child(tmp_path, "writing-shard", *_args(src, out, "--num-parts", "2", "--part", "0"))
    child.wait_ready()
    with pytest.raises(OutputError, match="part 0 of this destination is still running"):
        convert(src, "trtllm", out, fresh=fresh)
    with pytest.raises(OutputError, match="part 0 of this destination is still running"):
        finalize(out)
    with pytest.raises(OutputError, match="another mxfp8-convert is writing part 0 of this dest"):
        convert(src, "trtllm", out, part=(0, 2))
    convert(src, "trtllm", out, part=(1, 2))  # another part runs beside it
    code, _, err = child.go()
    assert code == 0, err
    finalize(out)
    assert verify(out, src).ok and leftovers(tmp_path) == [] and state() == before


# --- 6. manifests stay until after the final rename -------------------------------------------


def test_killed_just_before_the_final_rename_resumes_keeping_every_file(world, tmp_path):
    src, decoy, out, state = world
    before = state()
    child = Child(tmp_path, "before-final-rename", *_args(src, out))
    child.wait_ready()
    shards = {p.name: p.stat().st_ino for p in work(out).glob("*.safetensors")}
    child.signal(signal.SIGKILL)
    assert not out.exists() and (work(out) / "mxfp8_convert.partial.json").is_file()
    convert(src, "trtllm", out)
    assert {n: (out / n).stat().st_ino for n in shards} == shards, "finished shards were redone"
    assert verify(out, src).ok and leftovers(tmp_path) == [] and state() == before


def test_finalize_killed_before_its_rename_can_run_again(world, tmp_path):
    src, decoy, out, state = world
    for i in range(2):
        convert(src, "trtllm", out, part=(i, 2))
    child = Child(tmp_path, "before-final-rename", "finalize", out, "--quiet")
    child.wait_ready()
    child.signal(signal.SIGKILL)
    assert not out.exists()
    finalize(out)
    assert verify(out, src).ok and leftovers(tmp_path) == []


# --- 5 (and issue 27.5). --overwrite: ours only, atomic, leftovers cleaned -----------------------


def test_overwrite_refuses_a_folder_that_is_not_our_output(world):
    src, decoy, out, state = world
    before = state()
    with pytest.raises(OutputError, match=r"decoy: exists and is not an mxfp8-convert output .*"
                                          r"--overwrite only"):
        convert(src, "trtllm", decoy, overwrite=True)
    assert state() == before and leftovers(decoy.parent) == []


def test_overwrite_replaces_an_empty_folder_and_an_earlier_output(world):
    src, decoy, out, state = world
    out.mkdir()
    convert(src, "trtllm", out, overwrite=True)
    assert verify(out, src).ok
    convert(src, "cutlass", out, overwrite=True)
    assert verify(out, src).ok and _backend(out) == "cutlass"
    assert leftovers(out.parent) == []


def test_overwrite_always_shows_old_or_new_and_the_next_run_cleans_up(world, tmp_path):
    """Stopped right after the old output is moved aside: the destination is already the new,
    complete output; killed there, the next run removes the old one (ours, recorded by inode)."""
    src, decoy, out, state = world
    convert(src, "cutlass", out)
    before = state()
    child = Child(tmp_path, "after-swap", *_args(src, out, "--overwrite"))
    child.wait_ready()
    assert _backend(out) == "trtllm"
    files = json.loads((out / "mxfp8_convert.complete.json").read_text())["files"]
    assert all(file_digest(out / rel) == rec["xxh3_128"] for rel, rec in files.items()), \
        "the destination must hold a complete output"
    child.signal(signal.SIGKILL)
    assert [n for n in leftovers(tmp_path) if ".mxfp8-old-" in n], "nothing was left to clean"
    with pytest.raises(OutputError, match="already exists"):
        convert(src, "trtllm", out)  # the next run, whatever it does, cleans up first
    assert leftovers(tmp_path) == []
    assert verify(out, src).ok and state() == before
    assert sorted(os.listdir(out)) == sorted([*files, "mxfp8_convert.complete.json"])


def test_sigterm_during_the_final_swap_finishes_it_and_says_so(world, tmp_path):
    src, decoy, out, state = world
    convert(src, "cutlass", out)
    child = Child(tmp_path, "after-swap", *_args(src, out, "--overwrite"))
    child.wait_ready()
    code, out_text, err = child.signal(signal.SIGTERM)
    assert code == 143 and "Traceback" not in err, err
    assert err.strip().splitlines() == ["Error: terminated",
                                        f"Hint: the output was already complete: {out}"]
    assert verify(out, src).ok and leftovers(tmp_path) == []


@pytest.mark.parametrize("length", [236, 240])
def test_overwrite_of_a_long_name_fails_before_converting(world, tmp_path, length):
    src, decoy, out, state = world
    dest = tmp_path / ("o" * length)
    dest.mkdir()
    (dest / "mxfp8_convert.complete.json").write_text('{"format_version": 1, "files": {}}')
    seen = []
    with pytest.raises(OutputError, match=f"the folder name is {length} bytes"):
        convert(src, "trtllm", dest, overwrite=True, progress=lambda e: seen.append(e.stage))
    assert "transforming" not in seen and leftovers(tmp_path) == []


# --- 4. files copied beside the tensors: checked when they are opened -------------------------


def _replace_when_copying(src: Path, rel: str, how):
    def on_event(e):
        if e.stage == "writing" and not getattr(on_event, "done", False):  # planned; now copying
            on_event.done = True
            (src / rel).unlink()
            how(src / rel)
    return on_event


def test_side_file_relinked_outside_after_planning_is_refused(world, tmp_path):
    src, decoy, out, state = world
    secret = tmp_path / "secret.txt"
    secret.write_bytes(b"outside the model folder\n")
    before_decoy = tree_state(decoy)
    with pytest.raises(SourceError, match=r"tokenizer.json. is a link that leads outside"):
        convert(src, "trtllm", out, progress=_replace_when_copying(src, "tokenizer.json",
                                                                   lambda p: os.symlink(secret, p)))
    assert not out.exists() and leftovers(tmp_path) == [] and tree_state(decoy) == before_decoy


def test_side_file_replaced_by_a_fifo_after_planning_does_not_hang(world, tmp_path):
    src, decoy, out, state = world
    script = textwrap.dedent(f"""
        import os
        from mxfp8_convert import convert
        from mxfp8_convert.errors import SourceError
        def on_event(e):
            if e.stage == "writing" and not os.path.exists({str(tmp_path / 'done')!r}):
                open({str(tmp_path / 'done')!r}, "w").close()
                os.unlink({str(src / 'README.md')!r})
                os.mkfifo({str(src / 'README.md')!r})
        try:
            convert({str(src)!r}, "trtllm", {str(out)!r}, progress=on_event)
        except SourceError as e:
            print(e)
    """)
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                       env=env)
    assert "README.md: is not a regular file (pipe, socket or device)" in r.stdout, r.stderr
    assert not out.exists() and leftovers(tmp_path) == []


# --- 9. disk full and the free-space check ------------------------------------------------------


@pytest.fixture()
def tmpfs(tmp_path):
    mounted = []

    def mount(size: int) -> Path:
        if not sys.platform.startswith("linux") or shutil.which("mount") is None:
            pytest.skip("needs Linux and mount(8)")
        mnt = tmp_path / f"tmpfs{len(mounted)}"
        mnt.mkdir()
        r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size},mode=0755", "tmpfs",
                            str(mnt)], capture_output=True, text=True)
        if r.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here ({r.stderr.strip() or r.returncode})")
        mounted.append(mnt)
        return mnt

    yield mount
    for mnt in mounted:
        subprocess.run(["umount", str(mnt)], check=False)


def _ballast(fs: Path, name: str, size: int | None) -> None:
    """Another process's file: ``size`` bytes, or every free byte (until ENOSPC)."""
    fd = os.open(fs / name, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        left, chunk = size, b"\x5a" * 65536
        while left is None or left > 0:
            piece = chunk if left is None else chunk[:min(len(chunk), left)]
            try:
                n = os.write(fd, piece)
            except OSError as e:
                if e.errno != errno.ENOSPC or size is not None:
                    raise
                if len(chunk) == 1:
                    break
                chunk = chunk[: len(chunk) // 2]
                continue
            left = None if left is None else left - n
    finally:
        os.close(fd)


#: two shards of about 1 MB: a 4 MiB tmpfs takes the whole output, not the whole output twice
BIGGER = SynthSpec(layers=2, hidden=256, intermediate=1024, heads=4, kv_heads=2, vocab=256,
                   shards=2)
BIGGER_SHARDS = ("--max-shard-size", "1500000")  # two output shards, as the source has


def test_disk_full_keeps_finished_shards_and_a_resume_needs_only_the_rest(tmp_path, tmpfs, capsys):
    """A real tmpfs fills up (another process) as the second shard starts: one line, exit 1,
    the first shard kept and listed, no half-written second one. With the space back, but less
    than the whole output needs, the same command resumes (the free-space check counts what is
    done) and keeps the first shard. The other process's files are untouched throughout."""
    from tests.hostile import audit

    src = write_checkpoint(tmp_path / "src", BIGGER)
    before = tree_state(src)
    fs = tmpfs(4 << 20)
    dest = fs / "out"
    shards = ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]  # output
    filled = []

    def other_process(path: str) -> None:
        if not filled and path.endswith(shards[1]) and ".out.mxfp8-partial" in path:
            _ballast(fs, "ballast.bin", None)
            filled.append(path)

    with audit(on_write=other_process):
        code, out, err = run_cli(capsys, src, "-b", "trtllm", "-o", dest, *BIGGER_SHARDS)
    assert filled and code == 1 and "Traceback" not in err, err
    lines = err.strip().splitlines()
    assert len(lines) == 2 and "no space left on device" in lines[0], err
    assert lines[1].startswith("Hint: free disk space and rerun the same command: it resumes"), err
    manifest = json.loads((work(dest) / "mxfp8_convert.partial.json").read_text())
    assert sorted(manifest["files"]) == [shards[0]]
    assert sorted(os.listdir(work(dest))) == sorted([shards[0], "mxfp8_convert.partial.json"])
    kept = (work(dest) / shards[0]).stat().st_ino
    assert set((fs / "ballast.bin").read_bytes()) == {0x5A}  # the other process's file, untouched
    (fs / "ballast.bin").unlink()
    # leave less room than the whole output needs, but enough for what is left
    _, plan = plan_conversion(src, "trtllm", max_shard_size=BIGGER_SHARDS[1])
    assert [s.name for s in plan.shards] == shards
    whole = plan.nbytes + sum((src / f).stat().st_size for f in plan.copied_files) + (1 << 20)
    done = manifest["files"][shards[0]]["size"]
    free = shutil.disk_usage(fs).free
    assert free > whole - done // 2, "the tmpfs is too small for this test's arithmetic"
    _ballast(fs, "ballast.bin", free - (whole - done // 2))
    assert shutil.disk_usage(fs).free < whole
    code, out, err = run_cli(capsys, src, "-b", "trtllm", "-o", dest, *BIGGER_SHARDS)
    assert code == 0, err
    assert (dest / shards[0]).stat().st_ino == kept and verify(dest, src).ok
    assert tree_state(src) == before and set((fs / "ballast.bin").read_bytes()) == {0x5A}
    assert sorted(os.listdir(fs)) == ["ballast.bin", "out"]


def test_failed_part_leaves_no_half_written_shard(world, tmp_path):
    """Issue 27.12: a part that fails inside a shard (a NaN found while writing) removes it."""
    src, decoy, out, state = world
    ckpt, plan = plan_conversion(src, "trtllm", max_shard_size=SHARD_SIZE)
    name = next(t.source for t in plan.shards[1].tensors if t.source.endswith("proj.weight"))
    shard = src / ckpt.tensors[name].file
    raw = bytearray(shard.read_bytes())
    (n,) = __import__("struct").unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    begin = 8 + n + header[name]["data_offsets"][0]
    raw[begin + 5] = 0x7F  # e4m3 NaN
    shard.write_bytes(bytes(raw))
    with pytest.raises(Exception, match="holds NaN"):
        convert(src, "trtllm", out, part=(1, 3))
    assert not (work(out) / "model-00002-of-00003.safetensors").exists()


# --- 10. signals anywhere, a source truncated under the mapping, file modes, finalize ------------


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="read leases are Linux's")
def test_source_shard_truncated_while_mapped_names_the_file(world, tmp_path):
    """Another process truncates the shard being read: no SIGBUS (exit 135, no message) but one
    line naming the file, exit 1, nothing left; the other process's truncate goes through."""
    import threading

    src, decoy, out, state = world
    child = Child(tmp_path, "reading", *_args(src, out))
    child.wait_ready()
    shard, _ = _first_source(src)  # the file the child has open: the first one it reads
    done = threading.Event()
    threading.Thread(target=lambda: (os.truncate(shard, 4096), done.set()), daemon=True).start()
    done.wait(10)  # with the lease the truncate waits for the converter to let go
    code, _, err = child.go()
    assert code == 1 and "Traceback" not in err, (code, err)
    expected = (f"Error: {shard.name}: another process opened this source shard for writing or "
                "truncated it during the conversion")
    assert err.strip().splitlines()[0] == expected, err
    assert done.wait(60) and shard.stat().st_size == 4096
    assert not out.exists() and leftovers(tmp_path) == []


@pytest.mark.parametrize("point", ["parsing", "parsing-typer", "first-manifest",
                                   "printing"])
@pytest.mark.parametrize("sig,code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_signals_outside_the_conversion_exit_cleanly(world, tmp_path, point, sig, code):
    """Before the command's own error handling (parsing), as the work folder is made (the race
    behind the flaky test_sigint_sigterm_exit_cleanly_and_resumable[2-130]: an interrupt there
    removed the folder), and after it (printing the result)."""
    src, decoy, out, state = world
    before = state()
    child = Child(tmp_path, point, *_args(src, out))
    child.wait_ready()
    rc, _, err = child.signal(sig)
    assert rc == code and "Traceback" not in err, err
    first = "Error: interrupted" if sig == signal.SIGINT else "Error: terminated"
    assert err.strip().splitlines()[0] == first
    if point == "first-manifest":
        assert work(out).is_dir() and not out.exists()
    assert subprocess.run([sys.executable, "-m", "mxfp8_convert", *map(str, _args(src, out))],
                          capture_output=True).returncode in ((0,) if point != "printing" else (1,))
    assert verify(out, src).ok and state() == before


@pytest.mark.parametrize("umask", [0o000, 0o022, 0o077])
def test_output_modes_are_capped_and_never_wider_than_the_source(tmp_path, umask):
    src = small_model(tmp_path / "src")
    private = sorted(src.glob("*.safetensors"))[0]
    os.chmod(private, 0o600)
    old = os.umask(umask)
    try:
        convert(src, "cutlass", tmp_path / "out")
    finally:
        os.umask(old)
    out = tmp_path / "out"
    assert stat.S_IMODE(out.stat().st_mode) & ~0o755 == 0
    for p in out.rglob("*"):
        m = stat.S_IMODE(p.stat().st_mode)
        assert m & ~(0o755 if p.is_dir() else 0o644) == 0, (p.name, oct(m))
        assert m & umask == 0, (p.name, oct(m))
    _, plan = plan_conversion(src, "cutlass", max_shard_size=SHARD_SIZE)
    private_tensors = set(safetensors_keys(private))
    drawing = [s.name for s in plan.shards if any(t.source in private_tensors for t in s.tensors)]
    assert drawing
    for name in drawing:  # every output shard holding bytes of the private source shard
        assert stat.S_IMODE((out / name).stat().st_mode) & 0o077 == 0, name


def safetensors_keys(path: Path) -> list[str]:
    raw = path.read_bytes()
    header = json.loads(raw[8:8 + int.from_bytes(raw[:8], "little")])
    return [k for k in header if k != "__metadata__"]


def test_finalize_from_another_working_directory(tmp_path, monkeypatch):
    """Issue 27.8: parts record the source resolved, not as typed."""
    write_checkpoint(tmp_path / "a" / "src", SHARDED)
    monkeypatch.chdir(tmp_path / "a")
    for i in range(2):
        convert("src", "trtllm", "out", part=(i, 2))
    monkeypatch.chdir(tmp_path)
    r = finalize(tmp_path / "a" / "out")
    assert verify(r.output, tmp_path / "a" / "src").ok


def test_leftovers_cleaned_are_made_durable_and_a_clean_start_commits_nothing(tmp_path,
                                                                            monkeypatch):
    """The parent of the destination is fsynced after ``clean_leftovers`` changed it, and not
    when there was nothing to clean (that fsync only forced a journal commit)."""
    import mxfp8_convert.write as w

    synced = []
    monkeypatch.setattr(w, "_fsync_dir", lambda p: synced.append(Path(p)))
    dest = tmp_path / "out"
    w.clean_leftovers(dest)
    assert synced == [] and sorted(os.listdir(tmp_path)) == []
    aside = tmp_path / f".out{w.OLD_INFIX}0123abcd"  # an old output put aside, emptied
    aside.mkdir()
    w.clean_leftovers(dest)
    assert not aside.exists() and synced == [tmp_path]
