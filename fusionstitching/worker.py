"""The worker process that explores ahead and alongside: its main module and its loop (the side
of ``fusion/background.py`` that answers).

It is started with ``background.PLANNER_ONLY`` set in its environment, so that the package imports
its planner and code generator without PyTorch and TorchDynamo (``fusionstitching/__init__.py``):
it is ready in about a third of the time a full import takes, by the time the graph it is wanted
for has been traced. The step after a plan it sends, generating the plan's kernels and compiling
them with NVRTC (``pipeline._compile_kernels``), needs the runtime and loads it at its first use.
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
from collections.abc import Callable
from typing import IO, Any

from fusionstitching.fusion import background
from fusionstitching.fusion.explore import explore, unsplit_plan
from fusionstitching.fusion.plan_cache import encode
from fusionstitching.graph.serialize import from_json
from fusionstitching.options import Options


def _compile_kernels(plan: Any, options: Options, arch: str) -> None:
    from fusionstitching.pipeline import _compile_kernels as compile_kernels

    compile_kernels(plan, options, arch)


def serve(after: Callable[[Any, Options, str], None] | None = None) -> None:
    """The worker's loop: say it is ready, then for each request say it has begun, explore it (or,
    for an "unsplit" request, ``explore.unsplit_plan``) and send back its plan, or the error's text;
    then, where a plan's request names an arch, ``after(plan, options, arch)`` (the pipeline
    compiles the plan's kernels). Messages go
    out on the original standard output only; anything printed goes to standard error."""
    channel = os.fdopen(os.dup(sys.stdout.fileno()), "wb")
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())
    _serve(sys.stdin.buffer, channel, after)
    with contextlib.suppress(OSError):  # a parent gone: the buffered rest has nowhere to go
        channel.close()


def _serve(source: IO[bytes], sink: IO[bytes], after: Callable[[Any, Options, str], None] | None) -> None:
    """``_answer`` until the input ends, or quietly once the parent has gone (a closed pipe)."""
    try:
        _answer(source, sink, after)
    except BrokenPipeError:  # the parent exited (or closed the worker) first: nothing is waiting
        return


def _answer(source: IO[bytes], sink: IO[bytes], after: Callable[[Any, Options, str], None] | None) -> None:
    background.send(sink, ("ready",))
    while True:
        request = background.receive(source)
        if request is None:
            return
        # ``detail``: for a "plan", the GPU arch to compile its kernels for (or None); for an
        # "unsplit" exploration, the notes of the prepared graph (``explore.unsplit_plan``)
        job, task, text, origins, checks, solver, generators, options, key, detail = request
        background.send(sink, ("started", job))
        start = time.perf_counter()
        try:
            graph = from_json(text)
            graph.origins = dict(origins)
            graph.checks = checks
            if task == "unsplit":
                plan = unsplit_plan((graph, tuple(detail)), solver, options, generators)
            else:
                plan = explore(graph, solver=solver, options=options, generators=generators)
            answer = ("done", job, True, encode(plan, key), time.perf_counter() - start)
        except Exception as err:  # noqa: BLE001 -- reported; the graph is explored where it is compiled
            answer = ("done", job, False, f"{type(err).__name__}: {err}", time.perf_counter() - start)
            plan = None
        background.send(sink, answer)
        if task == "plan" and plan is not None and detail is not None and after is not None:
            with contextlib.suppress(Exception):  # the graph's first call compiles what is missing
                after(plan, options, detail)


if __name__ == "__main__":
    serve(after=_compile_kernels)
