"""What padding an unaligned library GEMM saves, measured on the GPU before the graph is planned.

``fusion/padding.py`` pads a GEMM whose leading dimensions are not whole 16-byte vectors where the
copies cost less than the slow kernel loses. How much cuBLAS's narrow-load kernels lose depends on
the shape, the layout and the alignment in ways no arithmetic bound captures: where they are
memory-bound, their 2- to 8-byte stores run at a fraction of the bandwidth; in f32 without TF32 they
lose nothing. So each unaligned problem is timed once per GPU, unaligned and padded, on operands of
its shape and layout (values from a private generator: torch's is untouched), and the times are
kept in the performance library (``perflib.sqlite``): a later process reads them and times nothing.
The planner receives them as ``Options.gemm_timings``.
"""

from __future__ import annotations

import logging
import math
import statistics
from typing import Any

from fusionstitching.cost.perflib import FILE_NAME, Measured, PerfLib, entry_key
from fusionstitching.fusion.padding import GemmProblem, unaligned_gemms
from fusionstitching.graph.graph import Graph
from fusionstitching.options import Options, cache_root

logger = logging.getLogger(__name__)

ROUNDS = 9  # timed runs of each variant, the two interleaved
# Back-to-back launches per timed run, at most: events around several, so that the timing
# resolution is no issue for a small GEMM, while a large one is timed in one launch per run.
REPEATS = 5
RUN_US = 50.0
SPACER_CYCLES = 200_000  # a GPU spin before each timed run, so that the events time the GPU, not the host's launches
# (device name, problem) -> (unaligned µs, padded µs); measured or read in this process
_TIMED: dict[tuple[str, str], tuple[float, float]] = {}
COUNTS = {"timed": 0, "read": 0}
LIBRARY = "GEMM library:"  # the ``generator`` of these entries begins so (``is_gemm_entry``)


def gemm_timings(graph: Graph, options: Options, device: Any) -> tuple[tuple[str, float, float], ...]:
    """``Options.gemm_timings`` for ``graph`` on CUDA ``device``: each unaligned library GEMM's
    problem with its time unaligned and padded, read from the performance library or measured now.
    Empty under tune="off", without the padding pass, and while a CUDA graph is being captured."""
    import torch

    if not options.pad_gemms or options.tune == "off" or torch.cuda.is_current_stream_capturing():
        return ()
    problems = unaligned_gemms(graph, options)
    if not problems:
        return ()
    device = torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
    name = torch.cuda.get_device_name(device)
    library = PerfLib(cache_root(options.cache_dir) / FILE_NAME)
    version = library_version()
    timings = []
    for problem in problems:
        text = problem.describe()
        times = _TIMED.get((name, text))
        key = entry_key(f"GEMM {text}", name, "", version)
        if times is None:
            stored = {m.template: m.us for m in library.measurements(key)}
            if "unaligned" in stored and "padded" in stored:
                times = stored["unaligned"], stored["padded"]
                COUNTS["read"] += 1
        if times is None:
            try:
                times = _measure(problem, device)
            except torch.OutOfMemoryError:
                logger.info("GEMM %s: no memory to time it; the padding model decides", text)
                continue
            except RuntimeError:  # another thread capturing a CUDA graph, say: the model decides
                if options.strict:
                    raise
                logger.warning("GEMM %s could not be timed; the padding model decides", text, exc_info=True)
                continue
            COUNTS["timed"] += 1
            library.store(key, [Measured("unaligned", times[0]), Measured("padded", times[1])],
                          chosen="padded" if times[1] < times[0] else "unaligned",
                          description=f"GEMM {text}", device=name, generator=version)
        _TIMED[(name, text)] = times
        timings.append((text, *times))
    return tuple(sorted(timings))


def library_version() -> str:
    """The ``generator`` of the library's GEMM entries: the GEMM library that was timed, as torch
    and CUDA versions (a new torch may bring another cuBLAS)."""
    import torch

    return f"{LIBRARY} torch {torch.__version__} cuda {torch.version.cuda}"


def is_gemm_entry(generator: str) -> bool:
    """Whether a library entry of this ``generator`` holds a GEMM's times (not a pattern's schedules)."""
    return generator.startswith(LIBRARY)


def _operand(torch: Any, generator: Any, batch: int, rows: int, inner: int, transposed: bool, dtype: Any,
             device: Any) -> Any:
    """A random ``batch`` x ``rows`` x ``inner`` operand, stored transposed (``inner`` outermost)
    where ``transposed``."""
    shape = (batch, inner, rows) if transposed else (batch, rows, inner)
    value = torch.empty(shape, dtype=dtype, device=device).uniform_(-1, 1, generator=generator)
    return value.transpose(1, 2) if transposed else value


def _measure(problem: GemmProblem, device: Any) -> tuple[float, float]:
    """(unaligned µs, padded µs) of ``problem`` on ``device``: the median of ``ROUNDS`` timed runs
    each, interleaved, with the inputs in L2 as in a model where the producer just wrote them."""
    import torch

    from fusionstitching.graph.ops import DType
    from fusionstitching.graph.torch_dtypes import DTYPE_TO_TORCH

    dtype, out_dtype = DTYPE_TO_TORCH[DType(problem.dtype)], DTYPE_TO_TORCH[DType(problem.out_dtype)]
    generator = torch.Generator(device=device)
    generator.manual_seed(0)

    def product(m: int, k: int, n: int) -> Any:
        a = _operand(torch, generator, problem.batch, m, k, not problem.lhs_k_inner, dtype, device)
        b = _operand(torch, generator, problem.batch, n, k, not problem.rhs_k_inner, dtype, device).transpose(1, 2)
        if problem.batch == 1:  # as ``dot_function`` calls it
            a, b, multiply = a[0], b[0], torch.mm
        else:
            multiply = torch.bmm
        widened = out_dtype != dtype

        def run() -> Any:
            if widened:
                try:
                    return multiply(a, b, out_dtype=out_dtype)
                except (TypeError, RuntimeError, NotImplementedError):
                    return multiply(a, b).to(out_dtype)
            return multiply(a, b)

        return run

    variants = [product(problem.m, problem.k, problem.n), product(*problem.padded)]
    # the problem's own dtypes, whatever autocast the compiling call runs under
    with torch.cuda.device(device), torch.autocast("cuda", enabled=False):
        for run in variants:
            run()
        # as many launches per timed run as make it last RUN_US (a large GEMM: one)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        variants[0]()
        end.record()
        end.synchronize()
        repeats = max(1, min(REPEATS, math.ceil(RUN_US / max(1e3 * start.elapsed_time(end), 1e-3))))
        samples: list[list[Any]] = [[], []]
        for _ in range(ROUNDS):
            for j, run in enumerate(variants):
                torch.cuda._sleep(SPACER_CYCLES)
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                for _ in range(repeats):
                    run()
                end.record()
                samples[j].append((start, end))
        torch.cuda.synchronize(device)
    unaligned, padded = (statistics.median(1e3 * s.elapsed_time(e) / repeats for s, e in runs) for runs in samples)
    return unaligned, padded
