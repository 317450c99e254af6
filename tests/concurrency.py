"""Running a test's worker in several processes at once, as the ranks of a data-parallel job do."""

from __future__ import annotations

import multiprocessing
from collections.abc import Callable
from typing import Any


def at_once(worker: Callable[..., None], args: tuple, processes: int, timeout: float = 120) -> list[Any]:
    """Start ``processes`` spawned processes calling ``worker(barrier, results, *args)``; each waits
    at ``barrier`` before the part that races and puts one result on the queue ``results``. The
    results, sorted."""
    context = multiprocessing.get_context("spawn")
    barrier, results = context.Barrier(processes), context.Queue()
    workers = [context.Process(target=worker, args=(barrier, results, *args)) for _ in range(processes)]
    for process in workers:
        process.start()
    outcomes = sorted(results.get(timeout=timeout) for _ in workers)
    for process in workers:
        process.join(timeout=60)
    return outcomes
