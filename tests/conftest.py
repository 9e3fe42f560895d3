"""Shared test fixtures: FlashInfer (when installed), a byte comparer, the ``gpu`` marker."""

from __future__ import annotations

import pytest
import torch


def pytest_collection_modifyitems(config, items):
    """Skip tests marked ``gpu`` when there is no CUDA device (pyproject declares the marker)."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _own_user_cache(tmp_path_factory, monkeypatch):
    """Each test its own empty user cache (``XDG_CACHE_HOME``, inherited by the CLI processes
    tests start): architecture decisions one test cached must not answer another's."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path_factory.mktemp("xdg-cache")))


@pytest.fixture(scope="session")
def flashinfer():
    """The installed FlashInfer package; the test setup installs it, so these tests run in CI."""
    return pytest.importorskip("flashinfer")


def _describe(shape: tuple[int, ...], idx: tuple[int, ...]) -> str:
    """Say where ``idx`` sits in a layout, so a mismatch names the tile, row and byte."""
    if len(shape) >= 3 and shape[-1] in (512, 32):
        *lead, ti, tj, b = idx
        expert = f"expert {tuple(lead)}, " if lead else ""
        if shape[-1] == 512:  # 128x4: byte b = (r%32)*16 + ((r%128)//32)*4 + c%4
            r, c = 128 * ti + b // 16 + 32 * ((b % 16) // 4), 4 * tj + b % 4
            kind = "128x4"
        else:  # 8x4: byte b = (r%8)*4 + c%4
            r, c = 8 * ti + b // 4, 4 * tj + b % 4
            kind = "8x4"
        return f"{expert}{kind} tile ({ti}, {tj}) byte {b} = scale row {r}, col {c}"
    if len(shape) == 1:
        where = f"flat byte {idx[0]}"
        if shape[0] % 512 == 0:  # a flat 128x4 buffer does not say Cp: name the tile's own cell
            k, b = divmod(idx[0], 512)
            r, c = b // 16 + 32 * ((b % 16) // 4), b % 4
            where += f" = 128x4 tile #{k} (row-tile-major), row {r}, col {c} inside it"
        return where
    *lead, r, c = idx
    expert = f"expert {tuple(lead)}, " if lead else ""
    return f"{expert}row {r} (32-row block {r // 32}, row {r % 32} in it), byte {c}"


def assert_same_bytes(got: torch.Tensor, want: torch.Tensor, what: str = "bytes") -> None:
    """Assert two tensors hold identical bytes; on failure name the first differing
    tile/row/byte."""
    got = got.detach().cpu()
    want = want.detach().cpu()
    if got.element_size() == 1:
        got = got.view(torch.uint8)
    if want.element_size() == 1:
        want = want.view(torch.uint8)
    assert tuple(got.shape) == tuple(want.shape), (
        f"{what}: shape {list(got.shape)} != expected {list(want.shape)}"
    )
    assert got.dtype == want.dtype, f"{what}: dtype {got.dtype} != expected {want.dtype}"
    if torch.equal(got, want):
        return
    diff = (got != want).flatten().nonzero().flatten()
    first = int(diff[0])
    idx = tuple(int(i) for i in torch.unravel_index(torch.tensor(first), got.shape))
    raise AssertionError(
        f"{what}: {diff.numel()} of {got.numel()} bytes differ; first at index {idx}, "
        f"{_describe(tuple(got.shape), idx)}: got {int(got.flatten()[first])}, "
        f"expected {int(want.flatten()[first])}"
    )


@pytest.fixture(scope="session")
def same_bytes():
    """:func:`assert_same_bytes`, as a fixture so every test directory can use it."""
    return assert_same_bytes


@pytest.fixture(scope="session")
def random_bytes():
    """``random_bytes(shape, seed, dtype=uint8)``: reproducible random bytes viewed as ``dtype``."""

    def make(shape, seed: int, dtype: torch.dtype = torch.uint8) -> torch.Tensor:
        gen = torch.Generator().manual_seed(seed)
        return torch.randint(0, 256, tuple(shape), dtype=torch.uint8, generator=gen).view(dtype)

    return make


@pytest.fixture(scope="session")
def flashinfer_ref(flashinfer):
    """``flashinfer_ref("pkg.module:name")``: a pure-torch reference inside the FlashInfer package.

    These are private names. On the pinned FlashInfer a missing one fails the test (the proof must
    run in CI); on another version it skips, saying which reference went away.
    """
    import importlib

    from mxfp8_convert.backends import FLASHINFER_LAYOUT_VERSION

    def get(target: str):
        module, name = target.split(":")
        try:
            return getattr(importlib.import_module(module), name)
        except (ImportError, AttributeError) as exc:
            msg = f"FlashInfer {flashinfer.__version__} has no {target} ({exc})"
            if flashinfer.__version__ == FLASHINFER_LAYOUT_VERSION:
                pytest.fail(msg)
            pytest.skip(msg)

    return get


@pytest.fixture()
def mount_fs(tmp_path):
    """``mount_fs(fstype, size=None)`` -> a fresh mount of a memory file system under
    ``tmp_path`` (``ramfs`` refuses O_DIRECT; ``tmpfs`` takes it), unmounted afterwards.
    Skipped where mounting is not allowed (not root, not Linux)."""
    import shutil
    import subprocess
    import sys

    mounted = []

    def mount(fstype: str, size: int | None = None):
        if not sys.platform.startswith("linux") or shutil.which("mount") is None:
            pytest.skip("needs Linux and mount(8)")
        mnt = tmp_path / f"{fstype}{len(mounted)}"
        mnt.mkdir()
        opts = "mode=0755" + (f",size={size}" if size is not None else "")
        r = subprocess.run(["mount", "-t", fstype, "-o", opts, fstype, str(mnt)],
                           capture_output=True, text=True)
        if r.returncode != 0:
            pytest.skip(f"cannot mount a {fstype} here ({r.stderr.strip() or r.returncode})")
        mounted.append(mnt)
        return mnt

    yield mount
    for mnt in reversed(mounted):
        subprocess.run(["umount", str(mnt)], check=False)
