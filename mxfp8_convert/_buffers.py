"""A fixed pool of reusable byte buffers for the streaming pipeline.

Fresh 64 MB tensors per chunk cost a page fault per 4 KB on every use; recycling a few buffers
keeps the pipeline at memcpy speed and its memory fixed at ``count * nbytes``.
"""

from __future__ import annotations

import queue
import threading

from mxfp8_convert._lazy import torch


class BufferPool:
    def __init__(self, nbytes: int, count: int) -> None:
        self.nbytes = nbytes
        self._free: queue.SimpleQueue = queue.SimpleQueue()
        self._unmade = count  # allocated on first need: a conversion that never shuffles in
        self._lock = threading.Lock()  # memory allocates nothing (and never imports torch)

    def get(self, n: int) -> torch.Tensor:
        """A uint8 buffer of ``n`` bytes; blocks until one is released. Larger requests get a
        one-off allocation (only for rows wider than the chunk size)."""
        if n > self.nbytes:
            return torch.empty(n, dtype=torch.uint8)
        try:
            return self._free.get_nowait()[:n]
        except queue.Empty:
            pass
        with self._lock:
            make = self._unmade > 0
            self._unmade -= make
        return (torch.empty(self.nbytes, dtype=torch.uint8) if make else self._free.get())[:n]

    def release(self, buf: torch.Tensor) -> None:
        base = buf._base if buf._base is not None else buf
        if base.numel() == self.nbytes and base.dtype == torch.uint8:
            self._free.put(base)
