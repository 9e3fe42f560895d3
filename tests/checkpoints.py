"""Helpers shared by end-to-end tests: build checkpoints, read them back, invert layouts."""

from __future__ import annotations

import hashlib
import itertools
import json
import subprocess
import tarfile
from dataclasses import fields
from io import BytesIO
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from mxfp8_convert._buffers import Scratch
from mxfp8_convert.backends import BACKENDS
from mxfp8_convert.layouts import p32_unshuffle_rows, trtllm_scale_to_canonical, unswizzle_128x4
from mxfp8_convert.read import SourceCheckpoint

REPO = Path(__file__).resolve().parent.parent


def package_at(commit: str, out: Path) -> Path:
    """Unpack the package as it was at ``commit`` into ``out`` (for ``PYTHONPATH``); ``out``."""
    tar = subprocess.run(["git", "-C", str(REPO), "archive", commit, "mxfp8_convert"],
                         check=True, capture_output=True).stdout
    with tarfile.open(fileobj=BytesIO(tar)) as t:
        t.extractall(out, filter="data")
    return out


class Referable(SourceCheckpoint):
    """A checkpoint a weak reference can point at (``SourceCheckpoint`` has slots, none for
    weak references): ``Referable.of(ckpt)`` holds the same objects."""

    @classmethod
    def of(cls, ckpt: SourceCheckpoint) -> Referable:
        return cls(**{f.name: getattr(ckpt, f.name) for f in fields(ckpt) if f.init})


def scratch_requests(monkeypatch) -> list[tuple[int, str, int, bool]]:
    """``(thread, key, numel, allocated)`` for each CPU buffer the quantizer asks its thread's
    scratch for (``_buffers.Scratch``), appended as asked: ``thread`` numbers a thread's life (a
    thread's id and name may be reused), ``allocated`` says whether a new buffer was made."""
    asked: list = []
    lives = itertools.count()
    real = Scratch.get
    this_spy = object()  # a thread's life numbered by an earlier spy is numbered again

    def spy(self, key, numel, dtype, device):
        if getattr(self, "spy", None) is not this_spy:  # attributes of this thread's scratch
            self.spy, self.life = this_spy, next(lives)
        before = self.buffers.get((key, dtype))  # held: a new buffer cannot reuse its id
        out = real(self, key, numel, dtype, device)
        if device.type == "cpu":
            asked.append((self.life, key, numel, self.buffers[(key, dtype)] is not before))
        return out

    monkeypatch.setattr(Scratch, "get", spy)
    return asked


def xxh(path: Path) -> str:
    import xxhash

    return xxhash.xxh3_128(path.read_bytes()).hexdigest()


def tree_hashes(root: Path) -> dict[str, str]:
    """sha256 of every file under ``root`` (relative path -> hex)."""
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*")) if p.is_file()
    }


def load_all(root: Path) -> tuple[dict[str, torch.Tensor], dict[str, dict]]:
    """All tensors of a checkpoint folder and each shard's metadata (read with safe_open)."""
    tensors, meta = {}, {}
    for f in sorted(root.glob("*.safetensors")):
        with safe_open(str(f), "pt") as fh:
            meta[f.name] = fh.metadata() or {}
            for k in fh.keys():
                tensors[k] = fh.get_tensor(k)
    return tensors, meta


def to_canonical(backend: str, weight: torch.Tensor, scale: torch.Tensor, n: int, k: int):
    """Invert a backend's layouts: (uint8 [N, K], uint8 [N, K/32])."""
    w = weight.view(torch.uint8)
    if backend == "trtllm":
        return p32_unshuffle_rows(w), trtllm_scale_to_canonical(scale, n, k // 32)
    assert BACKENDS[backend].weight_layout == "identity"
    return w, unswizzle_128x4(scale, n, k // 32)


def marker(root: Path) -> dict:
    return json.loads((root / "config.json").read_text())["quantization_config"]


def leftovers(parent: Path) -> list[str]:
    """Work folders a failed run might leave beside its destination: ``.NAME.mxfp8-*``
    (``-tmp-``, ``-partial``, ``-old-``: whatever write.py names them)."""
    return sorted(p.name for p in parent.iterdir()
                  if p.name.startswith(".") and ".mxfp8-" in p.name)


def spec_swizzle_128x4(s: torch.Tensor) -> torch.Tensor:
    """docs/LAYOUTS.md section 2, literally: scatter ``(r, c)`` to its offset (``R % 128 == 0``,
    ``C % 4 == 0``); an independent reference for the 128x4 swizzle."""
    r, c = s.shape
    rr = torch.arange(r).unsqueeze(1)
    cc = torch.arange(c).unsqueeze(0)
    off = (
        (rr // 128) * (c // 4) * 512
        + (cc // 4) * 512
        + (rr % 32) * 16
        + ((rr % 128) // 32) * 4
        + cc % 4
    )
    out = torch.zeros(r * c, dtype=torch.uint8)
    out[off.flatten()] = s.flatten()
    return out


def flip_byte(out: Path, tensor: str, index: int) -> None:
    """Flip one byte of ``tensor`` (flat byte ``index``) in place in the output file."""
    from mxfp8_convert.read import open_checkpoint

    info = open_checkpoint(out).tensors[tensor]
    with open(out / info.file, "r+b") as f:
        f.seek(info.begin + index)
        b = f.read(1)
        f.seek(info.begin + index)
        f.write(bytes([b[0] ^ 0x01]))


class Stop(KeyboardInterrupt):
    """What ``interrupt_after`` raises: an interrupt the test can tell from a real one."""


def interrupt_after(shards: int):
    """A progress callback that raises ``Stop`` once ``shards`` shards are finished."""
    seen: set[str] = set()

    def on_event(e):
        if e.shard:
            seen.add(e.shard)
        if len(seen) > shards:
            raise Stop()

    return on_event


def replace_tensor(root: Path, name: str, new: torch.Tensor) -> str:
    """Store ``new`` as tensor ``name`` in whichever shard of ``root`` holds it (that shard's
    metadata kept); returns the shard's file name."""
    for f in sorted(root.glob("*.safetensors")):
        with safe_open(str(f), "pt") as fh:
            if name not in fh.keys():
                continue
            tensors = {k: fh.get_tensor(k) for k in fh.keys()}
            meta = fh.metadata()
        tensors[name] = new
        save_file(tensors, str(f), metadata=meta)
        return f.name
    raise KeyError(name)
