"""Reusable buffers: a fixed pool of byte buffers for the streaming pipeline, and each
thread's working buffers for the quantizer.

Fresh 64 MB tensors per chunk cost a page fault per 4 KB on every use; recycling a few buffers
keeps the pipeline at memcpy speed and its memory fixed at ``count * nbytes``. The pool's
buffers are numpy arrays (laying MXFP8 out never imports torch); ``torch.from_numpy`` shares
their memory.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterator
from contextlib import contextmanager

from mxfp8_convert._lazy import numpy as np
from mxfp8_convert._lazy import torch


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


class Scratch(threading.local):
    """One thread's working buffers for the quantizer's chunks (``quantize``): kept from chunk
    to chunk of one call, and from call to call while the thread holds them (``kept()``, or
    ``keep()`` for the rest of a thread's life): a conversion's threads do, from module to
    module. Otherwise a call releases them as it returns, so that the thread of a library
    caller holds none once the call is over.

    Fresh chunk-sized temporaries (and float64 ones per module) cost a page fault per 4 KiB
    each time they are first touched; on CPU the quantizer writes its float32 and float64
    intermediates into these instead (about 30 MiB per thread at the default chunk size,
    ``convert.HELPER_SCRATCH_BYTES``). Other devices allocate as before.
    """

    def __init__(self) -> None:
        self.buffers: dict[tuple[str, object], object] = {}
        self.holds = 0  # ``kept()`` blocks open on this thread, and ``keep()`` calls

    def get(self, key: str, numel: int, dtype, device):
        """A flat ``dtype`` tensor of ``numel`` elements (its contents are undefined)."""
        if device.type != "cpu":
            return torch.empty(numel, dtype=dtype, device=device)
        buf = self.buffers.get((key, dtype))
        if buf is None or buf.numel() < numel:
            buf = self.buffers[(key, dtype)] = torch.empty(numel, dtype=dtype)
        return buf[:numel]

    @contextmanager
    def kept(self) -> Iterator[None]:
        """This thread's buffers serve every call inside the block; at its end they are
        released, unless an outer block (or ``keep()``) still holds them."""
        self.holds += 1
        try:
            yield
        finally:
            self.holds -= 1
            if not self.holds:
                self.buffers.clear()

    def keep(self) -> None:
        """Keep this thread's buffers for the rest of its life (a thread a conversion starts
        and ends: its thread pool's ``initializer``)."""
        self.holds += 1


#: the quantizer's working buffers, one set per thread
SCRATCH = Scratch()
