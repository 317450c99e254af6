"""The tuning space of a pattern: every template the code generator builds for it, ranked by the
latency evaluator [C §5.4], for the runtime to measure (``runtime/tuner.py``) [A §4.4].

The space is the template grammar's knobs that the default rule (``grouping.choose_template``)
fixes by heuristics:

- thread composition and packing (no value crossing threads): threads per block (128 to 1024),
  where the pattern reads an interleaving (interior padding), each thread taking one point of
  each of its classes (``packing.with_neighbours``; the model ranks these first where the kernel
  is bound by issue, ``diverging_classes``), and where some node computes values broadcast into the roots (a BatchNorm's per-channel scale),
  2, 4 or 8 points of an outer dim per thread, which then computes those values once; where some
  node computes values per row (a loss gradient's scale), a block per row (128 to 1024 threads
  looping over it); where a root is a column sum, 2, 4 or 8 adjacent columns per thread (up to 16
  bytes of the narrowest input), read as one vector per row; where every output is a column sum
  of one space (a BatchNorm gradient's partial sums over a part's rows), the column template's
  reduction across 2 to 32 warps per 32 columns, whose rows the thread-per-column templates loop
  over one thread each;
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
default rule's template is first among equal estimates. The plan's template is the default rule's
(or the first that lowered), except in patterns without cross-thread reductions, where exploration
takes the model's first wherever it is estimated faster beyond a tie (``model_choice``). The
runtime's tuner puts the plan's template first of all: that is the model's first choice, the one
``Options(tune="off")`` runs. Templates print with their roots named by position (``canonical``),
so a template measured on one pattern applies to every pattern of its structure (``renamed``).
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterable, Sequence

from fusionstitching.cost.bandwidth import BandwidthModel
from fusionstitching.cost.gpu_spec import GpuSpec
from fusionstitching.cost.latency import instructions_per_thread, issue_bound_us, kernel_latency_us, waves
from fusionstitching.graph.graph import Graph, Node
from fusionstitching.graph.ops import Category
from fusionstitching.graph.pattern import PatternError, is_reduction, reduced_dims, resolve_pattern
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
    column_template,
    composed_template,
    is_looped_partial,
    row_partial_template,
    thread_serial_template,
)
from fusionstitching.schedule.packing import (
    _column_sum,
    _packed_template,
    interleave_period,
    loop_rounds,
    row_invariant_work,
    serial_rounds,
)
from fusionstitching.schedule.propagate import check_block_locality
from fusionstitching.schedule.refusals import refusal
from fusionstitching.schedule.template import WARP_SIZE, KernelSchedule, Level, Schedule, tile_extents

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
        period = interleave_period(pattern)
        if period > 1:  # no divergence between classes in a warp (``diverging_classes``)
            makes += [("neighbours", lambda t=t: _packed_template(pattern, t, neighbours=period))
                      for t in _near(BLOCK_THREADS, 256)]
        makes += [("threads", lambda t=t: _packed_template(pattern, t)) for t in _near(BLOCK_THREADS, 256)]
        makes += [("rows", lambda r=r: _packed_template(pattern, DEFAULT_THREADS, rows=r))
                  for r in _near(ROWS_PER_THREAD, 4)]
        if row_invariant_work(pattern):
            makes += [("row loop", lambda t=t: _packed_template(pattern, t, row_loop=True))
                      for t in _near(BLOCK_THREADS, 256)]
        if any(_column_sum(o) for o in pattern.outputs):
            widest = 16 // min([n.dtype.itemsize for n in pattern.inputs] or [4])
            makes += [("columns", lambda t=t, v=v: _packed_template(pattern, t, columns=v))
                      for v in COLUMNS_PER_THREAD if v <= widest for t in _near(BLOCK_THREADS[:3], 128)]
        sums = list(pattern.outputs)
        if _column_pattern(pattern, sums):  # every output a column sum of one space
            makes += [("column warps", lambda w=w: column_template(pattern, sums, max_warps=w))
                      for w in _near(WARPS_PER_BLOCK[1:], 8)]
        return makes
    if any(is_looped_partial(o) for o in pattern.outputs):  # rows of a block each, partials in registers
        return makes + [("threads", lambda t=t: row_partial_template(pattern, threads=t))
                        for t in _near(BLOCK_THREADS, DEFAULT_THREADS)]
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
    """The latency evaluator's time for ``template``: the largest of L = N_wave × L_warp of its launch
    (``cost.latency``), the memory round trips the busiest block of a packed template makes one
    after another (``packing.serial_rounds``) or a thread makes in its loops (``packing.loop_rounds``),
    as ``fusion/estimate.py`` counts them, the time to
    issue every thread's instructions (``issue_bound_us``, times the classes of an interleaving a
    warp's diverging lanes run one after the other, ``diverging_classes``) and M(V) the pattern's DRAM traffic
    (inputs read once, outputs written once). The instructions count each node as often as the
    template evaluates it (``evaluations``): a value broadcast into a root is computed again by
    every thread that reads it, once per thread over its THREAD tiles."""
    launch = template.launch
    computed = evaluations(pattern, template)
    cycles = instructions_per_thread(pattern.nodes, launch.blocks, launch.threads, computed)
    latency = kernel_latency_us(spec, launch.blocks, launch.threads, cycles)
    outputs = {n.name: n for n in pattern.outputs}
    rounds = max(serial_rounds(template, pattern.nodes, outputs), loop_rounds(template, pattern.nodes, outputs))
    if rounds:
        latency = max(latency, waves(spec, launch.blocks, launch.threads) * rounds * spec.memory_latency_us)
    issue = issue_bound_us(spec, cycles * launch.blocks * launch.threads) * diverging_classes(pattern, template)
    moved = sum(n.size * n.dtype.itemsize for n in list(pattern.inputs) + list(pattern.outputs))
    return max(latency, issue, bandwidth.time_us(moved))


def diverging_classes(pattern, template: KernelSchedule) -> int:
    """The classes of an interleaving (``packing.interleave_period``) whose branches the lanes of
    one warp run one after the other: consecutive points of the dim before the last are of
    different classes, and lanes that hold different classes diverge, so a warp issues every
    class's guarded reads and arithmetic for all its lanes. A template whose threads take one point
    of each class (``packing.with_neighbours``) has all its lanes run every branch for points of
    their own: 1. So does a pattern that reads no interleaving."""
    period = interleave_period(pattern)
    if period == 1:
        return 1
    by_name = {n.name: n for n in pattern.nodes}
    for sched in template.schedules:
        root = by_name.get(sched.root)
        if root is None or is_reduction(root) or len(sched.dims) < 2:
            continue
        tiles = sched.dims[-2]
        extents = tile_extents(_space(root)[-2], tiles)
        if not (tiles and tiles[-1].level == Level.THREAD and extents[-1] % period == 0):
            return period
    return 1


_ELEMENTWISE = (Category.LIGHT_ELEMENTWISE, Category.EXPENSIVE_ELEMENTWISE)


def evaluations(pattern, template: KernelSchedule) -> dict[int, float]:
    """How many times the kernel computes each node that an elementwise root reads through
    elementwise ops, broadcasts, transposes and reshapes, as a multiple of the node's size (the
    ``computed`` argument of ``instructions_per_thread``), summed over the roots that read it.

    A root's threads evaluate the node once per point of the root, except along the root's dims on
    which the node does not vary: there the points of one thread's THREAD tiles share one value
    (the unrolled copies read the same addresses and compute the same values, which the compiler
    computes once). A BatchNorm's per-channel scale in a [N, H, W, C] kernel is computed N·H·W
    times over at one point per thread, N·H·W / 8 times at ``GRID-THREAD_8`` on N. Nodes read
    another way (slices, gathers, reductions and what they read) keep the factor 1."""
    by_name = {n.name: n for n in pattern.nodes}
    inside = {id(n) for n in pattern.nodes}
    # a reduction with a schedule of its own is summed once by its threads; the roots that read it
    # read its result (a register, or shared memory), they do not sum it again
    reduced_roots = {s.root for s in template.schedules if s.root in by_name and is_reduction(by_name[s.root])}
    factors: dict[int, float] = {}
    for sched in template.schedules:
        root = by_name.get(sched.root)
        if root is None or is_reduction(root) or len(sched.dims) != len(root.shape):
            continue
        shared_by: list[tuple[int, int]] = []  # (dim, extent) of the root's THREAD tiles
        for d, tiles in enumerate(sched.dims):
            for tile, extent in zip(tiles, tile_extents(root.shape[d], tiles)):
                if tile.level == Level.THREAD and extent > 1:
                    shared_by.append((d, extent))
        for node, varying in _varying_dims(root, inside).items():
            if node.size == 0 or (node.name in reduced_roots and node is not root):
                continue
            reuse = math.prod(extent for d, extent in shared_by if d not in varying)
            factors[id(node)] = factors.get(id(node), 0.0) + root.size / reuse / node.size
    return factors


def _varying_dims(root: Node, inside: set[int]) -> dict[Node, frozenset[int]]:
    """The nodes of the pattern (ids in ``inside``) that ``root`` reads through shape-preserving
    elementwise ops, ``broadcast_in_dim``, ``transpose`` and reshapes that only add or drop dims of
    1, each with the dims of root's shape along which its value may change."""
    everything = frozenset(range(len(root.shape)))
    varying: dict[Node, frozenset[int]] = {}
    seen: set[tuple[int, tuple]] = set()
    stack: list[tuple[Node, tuple[int | None, ...]]] = [(root, tuple(range(len(root.shape))))]
    while stack:
        node, dims = stack.pop()
        if (id(node), dims) in seen:
            continue
        seen.add((id(node), dims))
        moving = [d for d, size in zip(dims, node.shape) if size > 1]
        here = everything if None in moving else frozenset(moving)
        varying[node] = varying.get(node, frozenset()) | here
        for operand, operand_dims in _operand_dims(node, dims):
            if id(operand) in inside and operand_dims is not None:
                stack.append((operand, operand_dims))
    return varying


def _operand_dims(node: Node, dims: tuple[int | None, ...]):
    """(operand, the root dim of each of its dims, or None for the operand's dims where unknown)
    for the operands of ``node`` whose dims ``dims`` (of node's) map onto; operands reached in no
    such way (a slice, a gather, a reduction) are left out."""
    if node.op == "broadcast_in_dim":
        operand = node.operands[0]
        yield operand, tuple(dims[k] for k in node.attrs["broadcast_dimensions"])
    elif node.op == "transpose":
        operand = node.operands[0]
        mapped: list[int | None] = [None] * len(operand.shape)
        for k, p in enumerate(node.attrs["permutation"]):
            mapped[p] = dims[k]
        yield operand, tuple(mapped)
    elif node.op == "reshape":
        operand = node.operands[0]
        kept = [d for d, size in zip(dims, node.shape) if size > 1]
        if [s for s in operand.shape if s > 1] == [s for s in node.shape if s > 1]:
            it = iter(kept)
            yield operand, tuple(next(it) if size > 1 else None for size in operand.shape)
        else:
            yield operand, tuple(None for _ in operand.shape)
    elif node.category in _ELEMENTWISE:
        for operand in node.operands:
            if operand.shape == node.shape:
                yield operand, dims


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
    nodes = list(nodes)
    pattern = resolve_pattern(graph, nodes)
    for _, template in _model_ranked(pattern, spec, bandwidth):
        if _builds(graph, nodes, pattern, template, smem_limit, lowers):
            yield template


def _model_ranked(pattern, spec: GpuSpec, bandwidth: BandwidthModel) -> list[tuple[int, KernelSchedule]]:
    """(estimate's tie class, template) for the distinct templates of the tuning space with a finite
    ``model_estimate_us``, best first (ties in the order of ``tuning_space``, the default first)."""
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
            made.append((_tie_class(estimate), k, template))
    made.sort(key=lambda item: (item[0], item[1]))
    return [(tie, template) for tie, _, template in made]


def _builds(graph: Graph, nodes: list[Node], pattern, template: KernelSchedule, smem_limit: int,
            lowers: LoweringCheck | None) -> bool:
    """Whether the schedule's checks and the code generator's (``lowers``, default: the registered
    ``LoweringCheck``) accept ``template`` for the pattern."""
    if lowers is None and _LOWERING:
        lowers = _LOWERING[0]
    try:
        refused = refusal(pattern, template)
        if refused is None:
            refused = check_block_locality(graph, nodes, template, smem_limit, pattern=pattern)
        if refused is None and lowers is not None:
            refused = lowers(graph, nodes, pattern, template, smem_limit)
    except (ValueError, PatternError):
        return False
    return refused is None


def model_choice(graph: Graph, nodes: Sequence[Node], template: KernelSchedule, spec: GpuSpec,
                 bandwidth: BandwidthModel, smem_limit: int = 48 * 1024,
                 lowers: LoweringCheck | None = None) -> KernelSchedule:
    """The template the latency evaluator ranks first for the pattern, where it is estimated faster
    than ``template`` (the default rule's) beyond a tie (5 %) and lowers; ``template`` otherwise.
    ``Options(tune="off")`` runs this choice, and tuning measures it first. Reductions take it too:
    the default rule splits a column sum's rows over few blocks, one thread per column looping over
    hundreds of rows (a BatchNorm's per-channel sums), where the evaluator's round trips and waves
    rank a split of the rows over warps first, as measurement does."""
    pattern = resolve_pattern(graph, nodes)
    try:
        current = _tie_class(model_estimate_us(pattern, template, spec, bandwidth))
    except ValueError:
        return template
    nodes = list(nodes)
    for tie, candidate in _model_ranked(pattern, spec, bandwidth):
        if tie >= current:  # this template and every one after it rank no better than the default's
            break
        if _builds(graph, nodes, pattern, candidate, smem_limit, lowers):
            return candidate
    return template


def _tie_class(estimate_us: float) -> int:
    """Estimates 5 % apart or less fall in one class: the evaluator is no finer than that."""
    return round(math.log(max(estimate_us, 1e-3)) / math.log(1.05))


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


def form(text: str) -> str:
    """A canonical template's text without its launch's block count, which follows the shapes: the
    template of one pattern at other sizes of the same shape class (``refit``)."""
    return _BLOCKS.sub("blocks=*", text)


_BLOCKS = re.compile(r"blocks=\d+")


def refit(graph: Graph, nodes: Sequence[Node], wanted: str, default: KernelSchedule, smem_limit: int = 48 * 1024,
          lowers: LoweringCheck | None = None) -> KernelSchedule | None:
    """The template of the pattern's tuning space at ``graph``'s shapes whose ``form`` is ``wanted``
    (a template chosen for the pattern at other sizes) and which builds here; None where none does.
    ``default`` is the default rule's template, legal here. The space's own makers size the launch
    and every shape-derived tile, so a template taken over is one the tuner could have measured."""
    nodes = list(nodes)
    if form(canonical(default, nodes)) == wanted:
        return default
    pattern = resolve_pattern(graph, nodes)
    for _, make in tuning_space(pattern):
        try:
            template = make()
        except (ValueError, PatternError):
            continue
        if form(canonical(template, nodes)) == wanted and _builds(graph, nodes, pattern, template, smem_limit, lowers):
            return template
    return None


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
    "evaluations",
    "form",
    "iter_ranked_templates",
    "model_choice",
    "model_estimate_us",
    "ranked_templates",
    "refit",
    "renamed",
    "tuning_space",
]
