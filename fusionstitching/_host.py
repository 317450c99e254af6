"""Host-side speed of the compiler itself.

Planning and lowering allocate many short-lived objects (expression trees, candidate templates,
per-pattern dictionaries): with Python's cyclic collector running, a young-generation collection
every 700 allocations scans the survivors over and over, which took 10–20 % of the exploration
of BERT-base's training graphs on a 2-core machine. ``collector_paused`` switches the cyclic
collector off while a compile stage runs and back on afterwards (reference counting still frees
everything acyclic at once; cycles left behind are collected at the next collection); it leaves
a collector that the caller had switched off alone.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator


@contextlib.contextmanager
def collector_paused() -> Iterator[None]:
    """Pause Python's cyclic garbage collector inside (usable as a decorator)."""
    if not gc.isenabled():
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        gc.enable()
