"""The reduction-splitting pass that runs before exploration (DESIGN.md "Fusion exploration").

A reduction the code generator runs with too few threads underfills the GPU: a bias gradient sums
4096 rows into 768 columns, and with a thread per column only 768 threads loop 4096 times each.
For every reduce the pass estimates, with the latency evaluator (``cost/latency.py``), the time
of the reduction as one kernel and as a partial reduce over ``p`` chunks plus a final reduce (one
more launch), for every ``p`` that divides the split dim (``graph.transforms.split_dim``) and
leaves chunks of at least ``MIN_CHUNK`` elements; it splits with the best ``p`` when that saves at
least ``MIN_GAIN`` of the time. Each kernel's time is the largest of its memory time (the bandwidth
model), its latency estimate, and the time its threads wait on loads: a thread that reduces n
elements issues n dependent global loads, of which about ``LOADS_IN_FLIGHT`` overlap (the loop is
unrolled), each taking ``LOAD_LATENCY_CYCLES``. The latency evaluator's CPI counts issue cycles
only, which is right for a full GPU whose warps hide each other's loads but far too optimistic for
the 768 threads of an unsplit bias gradient, which is exactly the case this pass is for.

How many threads a reduce gets follows the default template of the schedule stage: a warp per row
when the last dim is reduced (up to 1024 long), a block per row beyond, one block for a reduction
to a scalar, and a thread per output element when the last dim is kept (column reduction): fused
with its producers and consumers, a column reduction often runs so (the thread-serial and packed
templates), and splitting it lets its partial fuse with the producers on many threads.

The final sum of stitched partials (LayerNorm's dγ and dβ: the row kernel writes a partial row per
8 rows) is different: its operand is written by another kernel, so it runs alone, and alone a
column reduction whose columns fill a warp's lanes takes the column template
(``schedule/grouping.column_template``: 32 columns a block, up to 32 warps over the rows). Such a
reduce, and the partials split from it, are estimated with that template's threads, with the
kernel's floor (the bandwidth model's least GPU time) added to the time its threads wait on loads,
and without the host's launch cost: the final sum of 8192 partial rows into 256 columns runs on 8
blocks and is split, that of 512 rows into 768 columns is not (CHANGELOG.md has the measurements).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from fusionstitching.cost.bandwidth import BandwidthModel
from fusionstitching.cost.gpu_spec import GpuSpec
from fusionstitching.cost.latency import instructions_per_thread, kernel_latency_us
from fusionstitching.graph.graph import Graph, Node
from fusionstitching.graph.transforms import row_loop_dim, split_dim, split_reductions, variance_pairs
from fusionstitching.schedule.grouping import column_warps

THREADS = 256
MIN_CHUNK = 8
LOAD_LATENCY_CYCLES = 600  # a global load that misses the caches, H100-class GPUs
LOADS_IN_FLIGHT = 4
MIN_GAIN = 0.25
WARP_ROW_MAX = 1024
WARP_SIZE = 32
STITCH_MIN_ROWS = 1024
MAX_ROUNDS = 4  # splits of one reduction: one per reduced dim of a 4-d tensor
STITCH_ROWS = 8  # rows per part of a column reduction stitched to row reductions (8 warps per block)


@dataclass(frozen=True)
class SplitDecision:
    node: str
    parts: int
    before_us: float
    after_us: float
    stitched: bool = False  # parts aligned with a row reduction's blocks
    looped: bool = False  # parts are the rows a row reduction's blocks loop over
    variance: str | None = None  # a variance split with this reduce, from its partial sums

    def __str__(self) -> str:
        if self.looped:
            return (f"{self.node}: split in {self.parts} parts, the rows each block of the row reductions over "
                    f"the same tensor shape loops over (partial sums carried by their kernel's grid loop)")
        if self.stitched:
            return (f"{self.node}: split in blocks of {STITCH_ROWS} rows, the rows of a block of the row "
                    f"reductions over the same tensor shape (partial sums stitched into their kernel)")
        paired = f"; {self.variance} summed per part around the part's mean" if self.variance else ""
        return (f"{self.node}: split in {self.parts} parts (estimated {self.before_us:.1f} us as one kernel, "
                f"{self.after_us:.1f} us as partial + final){paired}")


def reduction_threads(node: Node, alone: bool = False) -> int:
    """Threads the default template gives a reduce (``alone``: in a kernel by itself; see the
    module docstring)."""
    operand = node.operands[0]
    dims = set(node.attrs["dims"])
    if node.size == 1:
        return THREADS
    if len(operand.shape) - 1 in dims:
        length = math.prod(operand.shape[d] for d in dims)
        return node.size * (32 if length <= WARP_ROW_MAX else THREADS)
    if alone and _warp_columns(node):
        return column_threads(node.size, operand.size // node.size)
    return node.size


def _warp_columns(node: Node) -> bool:
    """Whether ``node`` keeps its innermost dim and that dim fills warps' lanes (the column template)."""
    shape = node.operands[0].shape
    return len(shape) - 1 not in set(node.attrs["dims"]) and shape[-1] % WARP_SIZE == 0


def column_threads(outputs: int, rows: int) -> int:
    """Threads of the column template summing ``rows`` rows into ``outputs`` elements: a lane per
    output, warps over the rows."""
    return outputs * column_warps(rows)


class ReductionSplitter:
    def __init__(self, spec: GpuSpec, memory: BandwidthModel) -> None:
        self.spec = spec
        self.memory = memory

    def kernel_us(self, node: Node, threads: int, alone: bool = False) -> float:
        blocks = max(1, math.ceil(threads / THREADS))
        work = instructions_per_thread([node], blocks, THREADS)
        latency = kernel_latency_us(self.spec, blocks, THREADS, work)
        nbytes = (node.operands[0].size + node.size) * node.dtype.itemsize
        loads = node.operands[0].size / threads * LOAD_LATENCY_CYCLES / LOADS_IN_FLIGHT / (self.spec.clock_ghz * 1e3)
        return max(latency, self.memory.time_us(nbytes), loads + (self.memory.floor_us if alone else 0.0))

    def decide(self, node: Node, force: bool = False, alone: bool = False) -> SplitDecision | None:
        """The split that saves the most estimated time, if it saves ``MIN_GAIN`` of it (``force``:
        the split into the most parts, whatever it saves; ``alone``: a reduce in a kernel by itself,
        estimated as the module docstring says)."""
        before = self.kernel_us(node, reduction_threads(node, alone), alone)
        operand = node.operands[0]
        dims = tuple(node.attrs["dims"])
        dim = max(dims, key=lambda d: operand.shape[d])
        size = operand.shape[dim]
        best: tuple[float, int] | None = None
        for parts in range(2, size // MIN_CHUNK + 1):
            if size % parts:
                continue
            split_dim(node, parts)  # raises on a split the transform would refuse
            partial_out = node.size * parts
            partial = _shaped(node, operand.size, partial_out)
            final = _shaped(node, partial_out, node.size)
            if alone and _warp_columns(node):
                after = (self.kernel_us(partial, column_threads(partial_out, operand.size // partial_out), True)
                         + self.kernel_us(final, column_threads(node.size, parts), True))
            else:
                after = (self.kernel_us(partial, _threads_like(node, partial_out)) + self.kernel_us(final, node.size)
                         + (0.0 if alone else self.memory.launch_us))
            # Forced (no template builds it whole): the most parts, the most threads, since the
            # estimate, which sees no gain, cannot rank the splits.
            if best is None or (parts > best[1] if force else after < best[0]):
                best = (after, parts)
        if best is None or (not force and best[0] > (1 - MIN_GAIN) * before):
            return None
        return SplitDecision(node.name, best[1], before, best[0])


def _unbuildable(graph: Graph, node: Node, smem_limit: int) -> bool:
    """Whether no template builds ``node`` alone; asked only of a reduce with more points per
    output than a thread may take (``schedule.refusals.MAX_ELEMENTS_PER_THREAD``)."""
    from fusionstitching.schedule import feasible
    from fusionstitching.schedule.refusals import MAX_ELEMENTS_PER_THREAD

    if node.operands[0].size <= MAX_ELEMENTS_PER_THREAD * max(node.size, 1):
        return False
    return not feasible(graph, [node], smem_limit)


def _threads_like(node: Node, outputs: int) -> int:
    """Threads of the partial reduce: its output elements, or warps of rows for row reductions."""
    return reduction_threads(node) * outputs // max(node.size, 1)


def _shaped(node: Node, input_size: int, output_size: int) -> Node:
    """A stand-in reduce with the given input and output sizes, for the cost estimate only."""
    operand = Node("in", "parameter", (), (input_size,), node.dtype, {"index": 0})
    return Node(node.name, "reduce", (operand,), (output_size,), node.dtype, {"dims": (0,), "kind": "sum"})


def _row_reduced_shapes(graph: Graph) -> set[tuple[int, ...]]:
    """Operand shapes of the graph's row reductions (a reduce over the innermost dim only)."""
    return {n.operands[0].shape for n in graph.nodes
            if n.op == "reduce" and tuple(n.attrs["dims"]) == (len(n.operands[0].shape) - 1,)}


def stitched_rows(node: Node, row_shapes: set[tuple[int, ...]]) -> int | None:
    """Rows per block for a column reduction over at least ``STITCH_MIN_ROWS`` rows (fewer fit one
    kernel) and over the same rows as a row reduction of the graph
    (LayerNorm backward's dgamma/dbeta beside dx): ``STITCH_ROWS``, the rows a block of the row
    reduction's warp-per-row kernel holds, so the partial sums can be computed in that kernel
    (``schedule/grouping.row_partial_template``) and only a small final sum is left."""
    if node.op != "reduce":
        return None
    shape, dims = node.operands[0].shape, tuple(node.attrs["dims"])
    if len(shape) < 2 or dims != tuple(range(len(dims))) or len(dims) >= len(shape) or shape not in row_shapes:
        return None
    last = shape[len(dims) - 1]
    if math.prod(shape[: len(dims)]) < STITCH_MIN_ROWS:
        return None
    if last % STITCH_ROWS or last < 2 * STITCH_ROWS or shape[-1] % 32:
        return None
    return STITCH_ROWS


def row_loop_parts(node: Node, spec: GpuSpec) -> int | None:
    """Parts of a column reduction beside row reductions whose rows are too long for a warp per row
    (a block per row, ``WARP_ROW_MAX``): the partial is then carried by the row kernel's grid loop,
    each block visiting ``parts`` rows and summing them in registers (``graph.transforms``' row
    loops). The blocks are one wave of the GPU at half its threads (the rows' values and the partial
    sums take registers); the parts, the fewest that divide the leading dims with no more blocks
    than that, so the partial written and read back stays a small share of the rows' bytes."""
    shape, dims = node.operands[0].shape, tuple(node.attrs["dims"])
    rows = math.prod(shape[: len(dims)])
    blocks = spec.sms * spec.max_threads_per_sm // (2 * THREADS)
    for parts in range(2, rows // 2 + 1):
        if rows % parts or rows // parts > blocks:
            continue
        try:
            row_loop_dim(node, parts)
        except ValueError:
            continue
        return parts
    return None


def split_underfilled_reductions(graph: Graph, spec: GpuSpec, memory: BandwidthModel, smem_limit: int = 48 * 1024
                                 ) -> tuple[Graph, list[SplitDecision]]:
    """Split every reduce that is faster as partial + final, then the partials that are still
    underfilled and the final sums of stitched partials (judged alone, see the module docstring),
    up to ``MAX_ROUNDS`` times: a split divides one reduced dim, and a reduction over
    several large dims (BatchNorm's statistics over N, H and W of an NCHW tensor: 25 million points
    into 256 channels) needs a split of each before its threads have a bounded share of the points.
    A reduce that no template builds alone (too many points per thread) is split even where the
    estimate sees no gain: unsplit it would run outside the generated kernels."""
    decisions: list[SplitDecision] = []
    fresh: set[str] | None = None  # the reduces a round may split: all at first, then the new partials
    alone: set[str] = set()  # the final sums of stitched partials and the partials split from them
    for _ in range(MAX_ROUNDS):
        before = {n.name for n in graph.nodes}
        graph, made = _split_round(graph, spec, memory, fresh, smem_limit, alone)
        if not made:
            break
        decisions += made
        held = _variance_partials(graph, [d for d in made if d.variance])
        fresh = {n.name for n in graph.nodes if n.op == "reduce" and n.name not in before and n.name not in held}
        split_alone = {d.node for d in made if d.node in alone and not d.stitched}
        alone = {d.node for d in made if d.stitched} | _partials_of(graph, split_alone, fresh)
        fresh |= {d.node for d in made if d.stitched}
    return graph, decisions


def _partials_of(graph: Graph, finals: set[str], fresh: set[str]) -> set[str]:
    """The new reduces (``fresh``) that the reduces ``finals`` read, through the views and converts
    between a partial and its final."""
    found, stack, seen = set(), [o for name in finals for o in graph.node(name).operands], set()
    while stack:
        node = stack.pop()
        if id(node) in seen:
            continue
        seen.add(id(node))
        if node.op == "reduce":
            if node.name in fresh:
                found.add(node.name)
            continue
        stack.extend(node.operands)
    return found


def _variance_partials(graph: Graph, decisions: list[SplitDecision]) -> set[str]:
    """The new reduces of the variances split with their partners, and the partners' partials: one
    kernel must read each part for both partial sums (``graph.transforms._split_variance``), so no
    later round splits them."""
    held = set()
    for decision in decisions:
        total = graph.node(decision.node).operands[0]  # the partner's partial sums, shifted back
        held |= {n.name for n in total.operands[0:1] if n.op == "reduce"}
        total, weighted = graph.node(decision.variance).operands  # within + c * between
        held |= {total.name, total.operands[0].name, weighted.operands[0].name}
    return held


def _split_round(graph: Graph, spec: GpuSpec, memory: BandwidthModel, only: set[str] | None,
                 smem_limit: int, alone: set[str]) -> tuple[Graph, list[SplitDecision]]:
    splitter = ReductionSplitter(spec, memory)
    decisions, blocks, loops = [], {}, {}
    row_shapes = _row_reduced_shapes(graph)
    for node in graph.nodes:
        if node.op != "reduce" or (only is not None and node.name not in only):
            continue
        rows = stitched_rows(node, row_shapes) if only is None else None
        if rows is not None and node.operands[0].shape[-1] > WARP_ROW_MAX:
            parts = row_loop_parts(node, spec)
            if parts is not None:
                loops[node.name] = parts
                decisions.append(SplitDecision(node.name, parts, 0.0, 0.0, looped=True))
                continue
        if rows is not None:
            blocks[node.name] = rows
            size = node.operands[0].shape[max(node.attrs["dims"])]
            decisions.append(SplitDecision(node.name, size // rows, 0.0, 0.0, stitched=True))
            continue
        decision = splitter.decide(node, alone=node.name in alone)
        if decision is None and _unbuildable(graph, node, smem_limit):
            decision = splitter.decide(node, force=True)
        if decision is not None:
            decisions.append(decision)
    if not decisions:
        return graph, []
    parts = {d.node: d.parts for d in decisions if not d.stitched and not d.looped}
    variances = {}
    if only is None:  # a variance split as its partner: both partial sums from one read of each part
        for variance, partner in variance_pairs(graph).items():
            if partner in parts and variance not in blocks and variance not in loops:
                variances[variance] = partner
                parts.pop(variance, None)
        decisions = [dataclasses.replace(d, variance=next((v for v, p in variances.items() if p == d.node), None))
                     for d in decisions if d.node not in variances]
    return split_reductions(graph, parts, blocks, loops, variances), decisions


def part_kernels(graph: Graph, decisions: list[SplitDecision]) -> list[list[Node]]:
    """For each variance split with its partner: the nodes of the kernel meant to read each part
    once for both partial sums (every ancestor of the variance's partial up to the graph's inputs
    and library calls), a candidate pattern for exploration to check and score like any other."""
    kernels = []
    for decision in decisions:
        if not decision.variance:
            continue
        total = graph.node(decision.variance).operands[0]
        stack, seen = [total.operands[0]], set()
        while stack:
            node = stack.pop()
            if id(node) in seen or node.op in ("parameter", "constant", "library"):
                continue
            seen.add(id(node))
            stack.extend(node.operands)
        members = [n for n in graph.nodes if id(n) in seen]
        kernels.append(members)
    return kernels

