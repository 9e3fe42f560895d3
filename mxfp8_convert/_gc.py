"""The cycle collector paused while a plan is built.

Opening a DeepSeek-V3-sized checkpoint and planning it create a few hundred thousand objects
that form no reference cycles (header entries, tensor locations, module plans). Each time
enough of them have been allocated, Python's cycle collector runs, and its full passes walk
every object alive, so they cost more the more has been planned: a large share of planning
(BENCHMARKS.md, issue 25). These objects are freed by reference counting; what the collector
would find once it runs again afterwards, it still finds.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def paused_gc() -> Iterator[None]:
    """Within this block, no automatic cycle collection; afterwards it runs as before. Nested
    blocks leave it paused until the outermost ends; a collector the caller turned off stays
    off."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()
