"""The tuning space of a pattern: every template the code generator builds for it, ranked by the
latency evaluator [C §5.4], for the runtime to measure (``runtime/tuner.py``) [A §4.4].

The space is the template grammar's knobs that the default rule (``grouping.choose_template``)
fixes by heuristics:

- thread composition and packing (no value crossing threads): threads per block (128 to 1024),
  and where some node computes values broadcast into the roots (a BatchNorm's per-channel scale),
  2, 4 or 8 points of an outer dim per thread, which then computes those values once; where some
  node computes values per row (a loss gradient's scale), a block per row (128 to 1024 threads
  looping over it); where a root is a column sum, 2, 4 or 8 adjacent columns per thread (up to 16
  bytes of the narrowest input), read as one vector per row;
- batched patterns (groups of different ranks, a block per batch element): threads per block (128
  to 1024, at most the widest dim across the threads);
- composed row reductions: block mode (a block per row) with 128 to 1024 threads, and warp mode
  with 1 to 32 rows (warps) per block and 1, 2 or 4 rows per warp at a time (where the rows divide
  evenly, as the default requires);
- reductions only: a thread per column (``thread_serial_template``) at 128 to 512 threads, or per
  2, 4 or 8 adjacent columns (up to 16 bytes of the narrowest input), read as one vector per row;
- everything ``grouping._candidate_templates`` tries when the default does not lower (shared-memory
  transposes, recomputation instead of caching, packed reductions).

``ranked_templates`` checks each as ``feasible`` does (the schedule's own refusals, block locality,
then the registered lowering check) and returns the ones that pass, best model estimate first; the
default rule's template is first among equal estimates. The runtime's tuner puts the plan's template
(the default rule's, or the first that lowered) first of all: that is the model's first choice, the
one ``Options(tune="off")`` runs. Templates print with their roots named by position (``canonical``),
so a template measured on one pattern applies to every pattern of its structure (``renamed``).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence

from fusionstitching.cost.bandwidth import BandwidthModel
from fusionstitching.cost.gpu_spec import GpuSpec
from fusionstitching.cost.latency import instructions_per_thread, kernel_latency_us
from fusionstitching.graph.graph import Graph, Node
from fusionstitching.graph.pattern import PatternError, reduced_dims, resolve_pattern
from fusionstitching.graph.pattern import iteration_space as _space
from fusionstitching.schedule.grouping import (
    _LOWERING,
    DEFAULT_THREADS,
    LoweringCheck,
    _batched,
    _candidate_templates,
    _column_pattern,
    _crossing,
    batched_template,
    composed_template,
    thread_serial_template,
)
from fusionstitching.schedule.packing import _column_sum, _packed_template, invariant_work, row_invariant_work
from fusionstitching.schedule.propagate import check_block_locality
from fusionstitching.schedule.refusals import refusal
from fusionstitching.schedule.template import WARP_SIZE, KernelSchedule, Schedule

BLOCK_THREADS = (128, 256, 512, 1024)
WARPS_PER_BLOCK = (1, 2, 4, 8, 16, 32)
ROWS_PER_WARP = (1, 2, 4)
ROWS_PER_THREAD = (2, 4, 8)  # points of an outer dim per thread in thread composition (``packing.with_rows``)
COLUMNS_PER_THREAD = (2, 4, 8)  # adjacent columns per thread of a thread-serial reduction, at most 16 bytes


def tuning_space(pattern) -> list[tuple[str, Callable[[], KernelSchedule]]]:
    """The candidate templates of ``pattern`` as (family, maker) pairs, the default rule's first; each
    maker may raise ``ValueError`` or ``PatternError`` for a tiling the rules refuse. Within a family
    the templates nearest the default rule's come first (``ranked_templates`` takes the families in
    turn, so a short list of candidates spans the space instead of one corner of it)."""
    makes = [("default", make) for make in _candidate_templates(pattern)]
    reductions = _crossing(pattern)
    if not reductions:
        makes += [("threads", lambda t=t: _packed_template(pattern, t)) for t in _near(BLOCK_THREADS, 256)]
        if invariant_work(pattern, min(ROWS_PER_THREAD)):
            makes += [("rows", lambda r=r: _packed_template(pattern, DEFAULT_THREADS, rows=r))
                      for r in _near(ROWS_PER_THREAD, 4)]
        if row_invariant_work(pattern):
            makes += [("row loop", lambda t=t: _packed_template(pattern, t, row_loop=True))
                      for t in _near(BLOCK_THREADS, 256)]
        if any(_column_sum(o) for o in pattern.outputs):
            widest = 16 // min([n.dtype.itemsize for n in pattern.inputs] or [4])
            makes += [("columns", lambda t=t, v=v: _packed_template(pattern, t, columns=v))
                      for v in COLUMNS_PER_THREAD if v <= widest for t in _near(BLOCK_THREADS[:3], 128)]
        return makes
    if _batched(pattern, reductions):
        return makes + [("threads", lambda t=t: batched_template(pattern, reductions, threads=t))
                        for t in _near(BLOCK_THREADS, DEFAULT_THREADS)]
    if not _column_pattern(pattern, reductions):
        space, reduced = _space(reductions[0]), set(reduced_dims(reductions[0]))
        kept = [d for d in range(len(space)) if d not in reduced]
        last_kept = space[kept[-1]] if kept else 1
        makes += [("block", lambda t=t: composed_template(pattern, reductions, t, None))
                  for t in _near(BLOCK_THREADS, DEFAULT_THREADS)]
        for warps in _near(WARPS_PER_BLOCK, 4):
            for rows in ROWS_PER_WARP:
                if rows == 1 or last_kept % (rows * warps) == 0:
                    makes.append((f"warp rows {rows}", lambda w=warps, r=rows: composed_template(
                        pattern, reductions, DEFAULT_THREADS, w, rows_per_warp=r)))
    if all(r.op == "reduce" for r in reductions):
        makes += [("serial", lambda t=t: thread_serial_template(pattern, reductions, t))
                  for t in _near(BLOCK_THREADS[:3], DEFAULT_THREADS)]
        widest = 16 // min([n.dtype.itemsize for n in pattern.inputs] or [4])
        makes += [("serial vector", lambda t=t, v=v: thread_serial_template(pattern, reductions, t, vector=v))
                  for v in COLUMNS_PER_THREAD if v <= widest for t in _near(BLOCK_THREADS[:3], 128)]
    return makes


def _near(values: Sequence[int], centre: int) -> list[int]:
    """``values`` by their distance from ``centre`` in factors of two, the larger first on ties."""
    return sorted(values, key=lambda v: (abs(math.log2(v / centre)), -v))


def model_estimate_us(pattern, template: KernelSchedule, spec: GpuSpec, bandwidth: BandwidthModel) -> float:
    """The latency evaluator's time for ``template``: max(L, M(V)), L = N_wave × L_warp of its launch
    (``cost.latency``), M(V) the pattern's DRAM traffic (inputs read once, outputs written once)."""
    launch = template.launch
    cycles = instructions_per_thread(pattern.nodes, launch.blocks, launch.threads)
    latency = kernel_latency_us(spec, launch.blocks, launch.threads, cycles)
    moved = sum(n.size * n.dtype.itemsize for n in list(pattern.inputs) + list(pattern.outputs))
    return max(latency, bandwidth.time_us(moved))


def ranked_templates(graph: Graph, nodes: Iterable[Node | str], spec: GpuSpec, bandwidth: BandwidthModel,
                     smem_limit: int = 48 * 1024, limit: int | None = None,
                     lowers: LoweringCheck | None = None) -> list[KernelSchedule]:
    """Up to ``limit`` distinct templates that the code generator builds for the pattern, in the
    model's order (``model_estimate_us``; ties in the order of ``tuning_space``, the default
    first). Refused ones are skipped; an empty list means none of the space lowers."""
    found = []
    for template in iter_ranked_templates(graph, nodes, spec, bandwidth, smem_limit, lowers):
        if limit is not None and len(found) >= limit:
            break
        found.append(template)
    return found


def iter_ranked_templates(graph: Graph, nodes: Iterable[Node | str], spec: GpuSpec, bandwidth: BandwidthModel,
                          smem_limit: int = 48 * 1024, lowers: LoweringCheck | None = None):
    """``ranked_templates`` one at a time: each template's lowering check (seconds for a large
    packed kernel) runs only when the caller asks for it."""
    if lowers is None and _LOWERING:
        lowers = _LOWERING[0]
    nodes = list(nodes)
    pattern = resolve_pattern(graph, nodes)
    made: list[tuple[float, int, KernelSchedule]] = []
    seen: set[KernelSchedule] = set()
    for k, make in _interleaved(tuning_space(pattern)):
        try:
            template = make()
        except (ValueError, PatternError):
            continue
        if template in seen:
            continue
        seen.add(template)
        try:
            estimate = model_estimate_us(pattern, template, spec, bandwidth)
        except ValueError:
            continue
        if math.isfinite(estimate):
            # 5 % apart or less is a tie: the evaluator is no finer than that
            made.append((round(math.log(max(estimate, 1e-3)) / math.log(1.05)), k, template))
    made.sort(key=lambda item: (item[0], item[1]))
    for _, _, template in made:
        try:
            refused = refusal(pattern, template)
            if refused is None:
                refused = check_block_locality(graph, nodes, template, smem_limit, pattern=pattern)
            if refused is None and lowers is not None:
                refused = lowers(graph, nodes, pattern, template, smem_limit)
        except (ValueError, PatternError):
            continue
        if refused is None:
            yield template


def _interleaved(space: list[tuple[str, Callable[[], KernelSchedule]]]) -> list[tuple[int, Callable]]:
    """(order, maker) with the families taken in turn, each in its own order; the default rule's
    template first."""
    families: dict[str, list[Callable]] = {}
    for family, make in space:
        families.setdefault(family, []).append(make)
    order: list[tuple[int, Callable]] = []
    rounds = max((len(v) for v in families.values()), default=0)
    for r in range(rounds):
        for makes in families.values():
            if r < len(makes):
                order.append((len(order), makes[r]))
    return order


def canonical(template: KernelSchedule, nodes: Sequence[Node]) -> str:
    """``template`` as text with each root named ``n<k>``, k its node's position in ``nodes``."""
    position = {node.name: k for k, node in enumerate(nodes)}
    schedules = tuple(Schedule(f"n{position[s.root]}", s.dims, s.shared) for s in template.schedules)
    return str(KernelSchedule(schedules, template.launch))


def renamed(text: str, nodes: Sequence[Node]) -> KernelSchedule:
    """The canonical template ``text`` with its roots named after ``nodes`` (``canonical``'s inverse)."""
    from fusionstitching.schedule.template import parse_template

    template = parse_template(text)
    schedules = []
    for s in template.schedules:
        if not s.root.startswith("n") or not s.root[1:].isdigit() or int(s.root[1:]) >= len(nodes):
            raise ValueError(f"template root {s.root!r} names no node of a pattern of {len(nodes)}")
        schedules.append(Schedule(nodes[int(s.root[1:])].name, s.dims, s.shared))
    return KernelSchedule(tuple(schedules), template.launch)


__all__ = [
    "BLOCK_THREADS",
    "ROWS_PER_WARP",
    "WARPS_PER_BLOCK",
    "WARP_SIZE",
    "canonical",
    "iter_ranked_templates",
    "model_estimate_us",
    "ranked_templates",
    "renamed",
    "tuning_space",
]
