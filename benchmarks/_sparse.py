"""Writing safetensors files whose large tensors are holes (sparse files): a header and the small
tensors are real bytes, the large ones read back as zeros and cost no disk.

Used by the benchmarks that need checkpoints of DeepSeek-V3's size, or of 100k tensors, on a
small disk. No torch: the bytes are written with ``os.pwrite`` and ``ftruncate``.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path

#: safetensors dtype -> bytes per element
ITEMSIZE = {"F8_E4M3": 1, "U8": 1, "BF16": 2, "F16": 2, "F32": 4, "I64": 8}


def write_sparse_safetensors(path: Path, tensors: list[tuple[str, str, tuple[int, ...]]],
                             data: Callable[[str, str, tuple[int, ...]], bytes | None],
                             metadata: dict[str, str] | None = None) -> int:
    """Write ``tensors`` (name, dtype, shape) to ``path``; ``data(name, dtype, shape)`` returns a
    tensor's bytes, or None to leave it a hole (zeros). Returns the file's size.

    Tensors are stored in the order given, data offsets contiguous, header padded to 8 bytes (as
    safetensors writes it).
    """
    header: dict = {"__metadata__": metadata or {"format": "pt"}}
    pos = 0
    spans = []
    for name, dtype, shape in tensors:
        n = ITEMSIZE[dtype]
        for d in shape:
            n *= d
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [pos, pos + n]}
        spans.append((name, dtype, shape, pos, n))
        pos += n
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    start = 8 + len(raw)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        os.pwrite(fd, len(raw).to_bytes(8, "little") + raw, 0)
        for name, dtype, shape, off, n in spans:
            b = data(name, dtype, shape)
            if b is not None:
                if len(b) != n:
                    raise ValueError(f"{name}: {len(b)} bytes, {dtype} {list(shape)} needs {n}")
                os.pwrite(fd, b, start + off)
        os.ftruncate(fd, start + pos)
    finally:
        os.close(fd)
    return start + pos


def write_index(root: Path, weight_map: dict[str, str], total: int) -> None:
    (root / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1))
