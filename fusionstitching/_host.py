"""Host-side speed of the compiler itself, and where a first call's time goes.

Planning and lowering allocate many short-lived objects (expression trees, candidate templates,
per-pattern dictionaries): with Python's cyclic collector running, a young-generation collection
every 700 allocations scans the survivors over and over, which took 10–20 % of the exploration of
BERT-base's training graphs on a 2-core machine, and half of the time the tuner takes to make its
candidates (lowering checks and lowering, the first GPU call's own compile work).
``collector_paused`` switches the cyclic collector off while a compile stage, or one pattern's
candidates, are made, and back on afterwards (reference counting still frees everything acyclic at
once; cycles left behind are collected at the next collection); it leaves a collector that the
caller had switched off alone.

``COMPILE_SECONDS`` adds up, per phase, the seconds this process spent compiling (``timed``):
AOTAutograd's tracing ("tracing", what the backend call takes besides the phases inside it), the
frontend's conversion to IR ("conversion"), "exploration", "code generation", NVRTC compilation
and module loading ("nvrtc"), and the first GPU call of a graph that tunes its schedules
("tuning": the measurements and the call's own kernels).
``stats()["compile seconds"]`` reports it.
"""

from __future__ import annotations

import contextlib
import gc
import threading
import time
from collections import Counter
from collections.abc import Iterator

COMPILE_SECONDS: Counter[str] = Counter()
_SECONDS_LOCK = threading.Lock()  # phases are timed in calls and in the background compile thread
PHASES = ("tracing", "conversion", "exploration", "code generation", "nvrtc", "tuning")


@contextlib.contextmanager
def timed(phase: str) -> Iterator[None]:
    """Add the seconds spent inside to ``COMPILE_SECONDS[phase]`` (one of ``PHASES``)."""
    if phase not in PHASES:
        raise ValueError(f"unknown compile phase {phase!r}; known: {', '.join(PHASES)}")
    start = time.perf_counter()
    try:
        yield
    finally:
        add_seconds(phase, time.perf_counter() - start)


def add_seconds(phase: str, seconds: float) -> None:
    """Add ``seconds`` to ``COMPILE_SECONDS[phase]``."""
    with _SECONDS_LOCK:
        COMPILE_SECONDS[phase] += seconds


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
