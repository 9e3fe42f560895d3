"""A fixed pool of reusable byte buffers for the streaming pipeline.

Fresh 64 MB tensors per chunk cost a page fault per 4 KB on every use; recycling a few buffers
keeps the pipeline at memcpy speed and its memory fixed at ``count * nbytes``. The buffers are
numpy arrays (laying MXFP8 out never imports torch); ``torch.from_numpy`` shares their memory.
"""

from __future__ import annotations

import queue
import threading

from mxfp8_convert._lazy import numpy as np


class BufferPool:
    def __init__(self, nbytes: int, count: int) -> None:
        self.nbytes = nbytes
        self._free: queue.SimpleQueue = queue.SimpleQueue()
        self._unmade = count  # allocated on first need: a conversion that never shuffles in
        self._lock = threading.Lock()  # memory allocates nothing (and never imports torch)

    def get(self, n: int) -> np.ndarray:
        """A uint8 array of ``n`` bytes; blocks until one is released. Larger requests get a
        one-off allocation (only for rows wider than the chunk size)."""
        if n > self.nbytes:
            return np.empty(n, dtype=np.uint8)
        try:
            return self._free.get_nowait()[:n]
        except queue.Empty:
            pass
        with self._lock:
            make = self._unmade > 0
            self._unmade -= make
        return (np.empty(self.nbytes, dtype=np.uint8) if make else self._free.get())[:n]

    def release(self, buf: np.ndarray) -> None:
        """Give back an array ``get()`` returned (one-off allocations are simply dropped)."""
        base = buf.base if buf.base is not None else buf
        if isinstance(base, np.ndarray) and base.size == self.nbytes and base.dtype == np.uint8:
            self._free.put(base)
