"""Thread composition and packing: the templates of patterns with no value crossing threads.

Each output of such a pattern gets its own schedule (``_root_schedule``): the innermost dims go to
the threads of a block as 16-byte vectors where the rows allow (a long row: ``GRID-CTA_256-
THREAD_v``; a row of up to a block of vectors: its vectors across lanes and the rest of the block
on the dims before it), the rest to the grid; a root that reads a transposed input gets 32×32
tiles; the reduced dims of a reduction root are THREAD loops. Roots of one shape that read a
common value share a loop nest (``packed_groups``); packed sub-kernels get blocks in
proportion to their size.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from fusionstitching.graph.graph import Node
from fusionstitching.graph.pattern import is_reduction, iteration_space, reduced_dims
from fusionstitching.schedule.template import (
    WARP_SIZE,
    KernelSchedule,
    Launch,
    Level,
    Schedule,
    Tile,
    level_extent,
    tile_extents,
)

MAX_BLOCKS = 65535
# Loads one thread keeps in flight in a serial loop: the code generator unrolls long serial loops
# by this many iterations (``codegen.cuda_c.NESTED_SERIAL_UNROLL``).
LOADS_IN_FLIGHT = 16
# Loads a thread has in flight in a loop the code generator leaves rolled: NVCC unrolls a
# constant-trip loop by about four, as the code generator does with a CTA tile's rounds.
LOOP_LOADS_IN_FLIGHT = 4


def _packed_template(pattern, threads: int, rows: int = 1, columns: int = 1, row_loop: bool = False,
                     neighbours: int = 1) -> KernelSchedule:
    """``rows``: points of an outer dim each thread takes (``with_rows``); ``columns``: adjacent
    columns each thread of a column sum takes; ``row_loop``: a block per row of each elementwise
    root (``_root_schedule``); ``neighbours``: adjacent points of the dim before the last each
    thread takes (``with_neighbours``)."""
    transposed = _reads_transposed(pattern)
    widest: dict[tuple[int, int], int] = {}  # (size, last dim) → the widest item of such elementwise roots
    for root in pattern.outputs:
        if not is_reduction(root) and root.shape:
            key = (root.size, root.shape[-1])
            widest[key] = max(widest.get(key, 1), root.dtype.itemsize)
    schedules = [_root_schedule(root, threads, transposed[id(root)],
                                None if is_reduction(root) or not root.shape else widest[(root.size, root.shape[-1])],
                                columns, row_loop)
                 for root in pattern.outputs]
    if rows > 1:
        schedules = [with_rows(sched, root, rows) for sched, root in zip(schedules, pattern.outputs)]
    if neighbours > 1:
        schedules = [with_neighbours(sched, root, neighbours) for sched, root in zip(schedules, pattern.outputs)]
    groups = packed_groups(list(zip(schedules, pattern.outputs)), {id(n) for n in pattern.nodes})
    total = sum(level_extent(sched, iteration_space(members[0]), Level.GRID) for sched, members in groups)
    blocks = max(len(groups), min(total, MAX_BLOCKS))
    return KernelSchedule(tuple(schedules), Launch(blocks, threads))


def with_rows(schedule: Schedule, root: Node, rows: int) -> Schedule:
    """``schedule`` with each thread taking ``rows`` points of the outermost dim that the grid alone
    tiles (``GRID`` becomes ``GRID-THREAD_<rows>``), so that what the root computes from values
    broadcast along that dim is computed once per thread for ``rows`` points: the copies of the
    unrolled loop read the same addresses and compute the same values, which the compiler computes
    once. A BatchNorm's per-channel scale (a square root and a division of its variance) was
    computed per element, its kernels bound by issue rather than memory. A reduction, or a root with
    no such dim divisible by ``rows``, keeps its schedule."""
    if is_reduction(root):
        return schedule
    space = iteration_space(root)
    for d, tiles in enumerate(schedule.dims):
        if tiles == (Tile(Level.GRID),) and space[d] > rows and space[d] % rows == 0:
            dims = list(schedule.dims)
            dims[d] = (Tile(Level.GRID), Tile(Level.THREAD, rows))
            return Schedule(schedule.root, tuple(dims), schedule.shared)
    return schedule


def with_neighbours(schedule: Schedule, root: Node, points: int) -> Schedule:
    """``schedule`` with each thread taking ``points`` adjacent points of the dim before the last
    (a ``THREAD_<points>`` tile innermost on it), where that dim divides by ``points`` and has no
    THREAD tile yet. For a read of an interleaving (``interleave_period``): consecutive points of
    that dim cycle through the interleaving's classes, and a warp whose lanes hold points of
    different classes runs every class's branch for all of them; a thread that holds one point of
    each class uses every branch it runs. A reduction, or a root of one dim, keeps its schedule."""
    if is_reduction(root) or len(schedule.dims) < 2:
        return schedule
    space = iteration_space(root)
    d = len(space) - 2
    tiles = schedule.dims[d]
    if space[d] % points or any(t.level == Level.THREAD for t in tiles):
        return schedule
    dims = list(schedule.dims)
    dims[d] = tiles + (Tile(Level.THREAD, points),)
    return Schedule(schedule.root, tuple(dims), schedule.shared)


def interleave_period(pattern) -> int:
    """The number of classes of the interleavings ``pattern`` reads along the dim before the last:
    a pad with ``k`` cells of interior padding there puts a point of its operand every ``k + 1``
    points, so the guard of the read differs between consecutive points, which neighbouring lanes
    hold (max pooling's gradient, summed per stride class and spread back by interior padding of
    the rows of an NHWC image; the gradient of a strided slice). Interior padding of the last dim
    falls inside a thread's vector of it, and that of outer dims between the rows a warp spans
    rarely. 1 where the pattern reads none."""
    periods = [n.attrs["interior"][-2] + 1 for n in pattern.nodes
               if n.op == "pad" and len(n.shape) >= 2 and n.attrs["interior"][-2] > 0]
    return max(periods, default=1)


def invariant_work(pattern, rows: int = 2) -> bool:
    """Whether some node of ``pattern`` that is not free index arithmetic (``_FREE_OPS``) has at most
    1/``rows`` of the points of the largest root: its values are broadcast into the root and, a
    thread per vector of the root, computed again for every vector. ``with_rows`` can share such a
    value between ``rows`` points of a thread only where it repeats at least that often."""
    roots = [r.size for r in pattern.outputs if not is_reduction(r)]
    if not roots:
        return False
    largest = max(roots)
    return any(n.op not in _FREE_OPS and n.op not in ("parameter", "iota") and n.size * rows <= largest
               for n in pattern.nodes)


def row_invariant_work(pattern) -> bool:
    """Whether some node of ``pattern`` that is not free index arithmetic has no more points than
    the largest elementwise root has rows (its innermost dim taken away): values computed per row
    and broadcast along it, which a block per row (``_root_schedule(row_loop=)``) computes once per
    thread and row."""
    roots = [r for r in pattern.outputs if not is_reduction(r) and len(r.shape) >= 2]
    if not roots:
        return False
    largest = max(roots, key=lambda r: r.size)
    return any(n.op not in _FREE_OPS and n.op not in ("parameter", "iota") and n.size * largest.shape[-1] <= largest.size
               for n in pattern.nodes)


def _reads_transposed(pattern) -> dict[int, int | None]:
    """Per pattern node (by id), the dim of its iteration space along which it reads some input
    contiguously when that is not its innermost dim (a transpose), else None; one pass in pattern
    order. A transpose of the innermost dim gives the dim that dim becomes, and an op of the same
    shape keeps its operand's; an input with strides, its dim of stride 1; elsewhere the dim before
    last. Other roots packed with such a root keep their row-major tiles."""
    inside = {id(n) for n in pattern.nodes}
    result: dict[int, int | None] = {}
    for node in pattern.nodes:
        last = len(node.shape) - 1
        across = None
        if node.op == "transpose" and node.attrs["permutation"][-1] != last:
            across = list(node.attrs["permutation"]).index(last)
        for x in node.operands:
            if across is not None:
                break
            if id(x) in inside:
                if result[id(x)] is not None:
                    across = result[id(x)] if x.shape == node.shape else max(last - 1, 0)
            elif x.layout is not None and len(x.shape) >= 2 and x.shape[-1] > 1 and x.layout.strides[-1] != 1:
                unit = [d for d, stride in enumerate(x.layout.strides) if stride == 1 and x.shape[d] > 1]
                across = unit[0] if unit and x.shape == node.shape else max(last - 1, 0)
        result[id(node)] = across
    return result


def _narrow_vector_rows(space, kept: list[int], threads: int, vector: int) -> tuple[int, int] | None:
    """(dim, lanes) when the innermost dim is too short for a block of vector accesses but splits
    into ``lanes`` (a power of two, 32 to ``threads``/2) vectors per block row, the rest of the
    block taking rows of the dim before it (BERT's 768-wide rows: 64 lanes × 4 rows of a block).
    Unlike ``_short_vector_rows`` it takes a tail in the rows rather than only a power of two that
    divides them: AdamW's update of the [30522, 768] word embeddings (30522 = 2 × 15261) keeps all
    256 threads of a block busy here, where the power-of-two rule would leave half of them idle.
    A row longer than a block of vectors that is not a whole number of blocks is split the same way:
    BERT's [4096, 3072] bf16 GELU rows are 384 vectors, which blocks of 256 lanes covered with a
    quarter of their threads idle; 128 lanes × 2 rows leave none idle."""
    if len(kept) < 2 or kept[-1] != len(space) - 1 or kept[-2] != len(space) - 2:
        return None
    d = kept[-1]
    size = space[d]
    if size % vector:
        return None
    per_row = size // vector
    if per_row >= threads and per_row % threads == 0:
        return None  # whole blocks of vectors along the row: the general rule
    lanes = per_row & -per_row  # largest power of two dividing it
    while lanes > threads // 2:
        lanes //= 2
    if lanes < 32 or space[d - 1] < threads // lanes:
        return None
    return d, lanes


def _short_vector_rows(space, kept: list[int], threads: int, vector: int) -> dict[int, tuple[Tile, ...]] | None:
    """Tiles for an innermost dim of a few 16-byte vectors (a head's 64 bf16 values: 8 vectors):
    its vectors across lanes and the rest of the block over the dims before it, each taking the
    largest power of two of the threads left that divides it, so that a block has no idle threads
    (heads × tokens of an attention transpose [32, 128, 12, 64]: ``GRID-CTA_8, GRID-CTA_4,
    CTA_8-THREAD_8``). Without it such a dim got one element per thread, far from the bandwidth."""
    if not kept or kept[-1] != len(space) - 1:
        return None
    d = kept[-1]
    size = space[d]
    if size % vector or size >= vector * threads or size < 2 * vector:
        return None
    per_row = size // vector
    lanes = per_row if per_row <= WARP_SIZE else min(per_row & -per_row, threads)  # a short row: all on lanes
    tiles = {d: ((Tile(Level.GRID),) if per_row > lanes else ()) + (Tile(Level.CTA, lanes), Tile(Level.THREAD, vector))}
    remaining = threads // lanes
    for outer in reversed(kept[:-1]):
        if remaining < 2:
            break
        extent = space[outer]
        part = min(extent & -extent, remaining)
        if part == extent or (part == 1 and extent <= remaining):
            part = extent  # whole (an odd dim that fits: some threads of the block idle)
            tiles[outer] = (Tile(Level.CTA),)
        elif part > 1:
            tiles[outer] = (Tile(Level.GRID), Tile(Level.CTA, part))
        else:
            break  # an odd dim longer than the threads left: it would need tails
        remaining //= part
    return tiles if remaining < threads // lanes else None


def _root_schedule(root: Node, threads: int, across: int | None = None, item: int | None = None,
                   columns: int = 1, row_loop: bool = False) -> Schedule:
    """``row_loop``: an elementwise root whose rows are longer than the block gets a block per row,
    its threads looping over the row (``GRID`` on the outer dims, ``CTA`` on the innermost): what
    it computes per row (a loss gradient's scale, a softmax's row statistics) is computed once per
    thread and row instead of once per element, which a row whose length is no multiple of a vector
    otherwise costs (a thread per element).
    ``across``: the dim along which the root reads a transposed input (``_reads_transposed``).
    ``columns``: for a column sum (a reduction keeping the innermost dim), adjacent columns per
    thread (``CTA-THREAD_<columns>`` on that dim): each row's loads of a thread become one vector
    access, a warp reading ``columns`` times the bytes per load instruction.
    ``item``: the bytes per element that size the vectors (default: the root's own). Elementwise
    roots of one size and last dim are all tiled by the widest of their types, so that related ones
    share a loop nest (``_nest_key``): BERT's first dropout mask (bool) and the bf16
    probabilities it masks were two sub-kernels of 16 and 8 lanes per thread, each drawing the
    random numbers and the second reading the f32 softmax numerators again."""
    space = iteration_space(root)
    reduced = set(reduced_dims(root)) if is_reduction(root) else set()
    if row_loop and not reduced and len(space) >= 2 and space[-1] > threads:
        return Schedule(root.name, tuple([(Tile(Level.GRID),)] * (len(space) - 1) + [(Tile(Level.CTA),)]))
    if reduced or len(space) < 2 or across == len(space) - 1:
        across = None
    if across is not None and threads == 256 and space[across] >= 32 and space[-1] >= 32 and space[-1] % 4 == 0:
        # 32 x 32 tiles over the output's last dim and the dim its input runs along: a warp reads
        # 32 consecutive rows of the output's column for the transposed operand and each thread 4
        # consecutive elements of the row-major ones. The dim is not always the one before last: a
        # key gradient [b, h, d, s] -> [b, s, h, d] runs along s with h between (tiled as a short
        # vector row it read only 2 bytes per row and lane).
        dims = [(Tile(Level.GRID),)] * len(space)
        dims[across] = (Tile(Level.GRID), Tile(Level.CTA, 32))
        dims[-1] = (Tile(Level.GRID), Tile(Level.CTA, 8), Tile(Level.THREAD, 4))
        return Schedule(root.name, tuple(dims))
    kept = [d for d in range(len(space)) if d not in reduced]
    dims: list[tuple[Tile, ...]] = [(Tile(Level.THREAD),) if d in reduced else (Tile(Level.GRID),)
                                    for d in range(len(space))]
    remaining = threads
    vector = max(1, 16 // (item or root.dtype.itemsize))
    narrow = _narrow_vector_rows(space, kept, threads, vector) if not is_reduction(root) else None
    if narrow is not None:
        d, lanes = narrow
        dims[d] = ((Tile(Level.GRID),) if space[d] > lanes * vector else ()) + (
            Tile(Level.CTA, lanes), Tile(Level.THREAD, vector))
        dims[d - 1] = (Tile(Level.GRID), Tile(Level.CTA, threads // lanes))
        return Schedule(root.name, tuple(dims))
    short = _short_vector_rows(space, kept, threads, vector) if not is_reduction(root) else None
    if short is not None:
        for d, tiles in short.items():
            dims[d] = tiles
        return Schedule(root.name, tuple(dims))
    for position, d in enumerate(reversed(kept)):
        size = space[d]
        if position == 0 and columns > 1 and reduced and d == len(space) - 1 and size % columns == 0:
            lanes = size // columns
            if lanes > remaining:
                dims[d] = (Tile(Level.GRID), Tile(Level.CTA, remaining), Tile(Level.THREAD, columns))
                break
            dims[d] = (Tile(Level.CTA), Tile(Level.THREAD, columns))
            remaining //= lanes
            if remaining < 2:
                break
            continue
        if position == 0 and not is_reduction(root) and size % vector == 0 and size >= vector * threads:
            dims[d] = (Tile(Level.GRID), Tile(Level.CTA, threads), Tile(Level.THREAD, vector))
            break
        if size <= remaining:
            dims[d] = (Tile(Level.CTA),)
            remaining //= max(size, 1)
            if remaining < 2:
                break
            continue
        dims[d] = (Tile(Level.GRID), Tile(Level.CTA, remaining))
        break
    return Schedule(root.name, tuple(dims))


_FREE_OPS = frozenset(("reshape", "broadcast_in_dim", "transpose", "convert", "constant"))


def recomputed_work(pattern, template: KernelSchedule) -> str | None:
    """A packed template whose column-sum sub-kernel recomputes what another sub-kernel computes from
    two or more inputs: sub-kernels share no registers, so the reduction's loop reads those inputs
    again (more bytes than the value they make) and redoes the arithmetic, on the few threads of a
    reduction. An FFN bias gradient's partial sums (256 rows per thread, 192 blocks) packed with the
    GELU backward they sum re-read dy and h and recomputed erf and exp, at a quarter of the
    bandwidth. Recomputing from one input (an exp of x summed next to the exp itself)
    reads no more than the value would, and stays allowed; so do row sums (a softmax's, each
    thread along its contiguous row), which measured near a copy's rate in BERT's attention."""
    roots = {s.root for s in template.schedules}
    if len(roots) < 2 or roots != {o.name for o in pattern.outputs} \
            or not any(is_reduction(o) for o in pattern.outputs):
        return None
    by_root = {s.root: s for s in template.schedules}
    for root in pattern.outputs:  # a reduction across threads: a composed template, not packed
        if is_reduction(root) and any(t.level != Level.THREAD for d in reduced_dims(root)
                                      for t in by_root[root.name].dims[d]):
            return None
    inside = {id(n) for n in pattern.nodes}
    nests = packed_groups([(by_root[o.name], o) for o in pattern.outputs], inside)
    if len(nests) < 2:
        return None
    computed = [(_work(members, inside), any(_column_sum(m) for m in members), members[0].name)
                for _, members in nests]
    for k, (mine, reduces, name) in enumerate(computed):
        if not reduces:
            continue
        for j, (theirs, _, other) in enumerate(computed):
            shared = [mine[i] for i in mine.keys() & theirs.keys() if mine[i].op not in _FREE_OPS]
            if j != k and len(_inputs_of(shared, inside)) >= 2:
                return f"{name} would recompute in its own sub-kernel what {other}'s computes"
    return None


def _column_sum(node: Node) -> bool:
    """A reduction that keeps its operand's innermost dim: each thread loops down a column."""
    return is_reduction(node) and node.op == "reduce" and len(node.operands[0].shape) - 1 not in reduced_dims(node)


def _work(members, inside: set[int]) -> dict[int, Node]:
    """The pattern nodes a nest of roots computes, by id."""
    work: dict[int, Node] = {}
    stack = list(members)
    while stack:
        node = stack.pop()
        if id(node) not in work and id(node) in inside:
            work[id(node)] = node
            stack.extend(node.operands)
    return work


def _inputs_of(nodes, inside: set[int]) -> set[int]:
    """The non-scalar pattern inputs that ``nodes`` read, directly or through other pattern nodes."""
    found: set[int] = set()
    seen: set[int] = set()
    stack = list(nodes)
    while stack:
        node = stack.pop()
        if id(node) in seen:
            continue
        seen.add(id(node))
        if id(node) in inside:
            stack.extend(node.operands)
        elif node.size > 1 and node.op != "constant":
            found.add(id(node))
    return found


def needs_composition(schedules: Sequence[Schedule], outputs: dict[str, Node], nodes: dict[str, Node]) -> bool:
    """Whether a template's roots need warp or block composition: a root that is no output (its
    value is read by other groups), one cached in shared memory, or a reduction tiled across
    threads. Otherwise every root runs in its own threads, packed (``codegen/packed.py``)."""
    for sched in schedules:
        if sched.root not in outputs or sched.shared:
            return True
        root = nodes[sched.root]
        if is_reduction(root):
            reduced = set(reduced_dims(root))
            if any(t.level != Level.THREAD for d, tiles in enumerate(sched.dims) if d in reduced for t in tiles):
                return True
    return False


# ----------------------------------------------------------------------------------------------
# Loop nests of a packed kernel (codegen/packed.py lowers them)
# ----------------------------------------------------------------------------------------------


def serial_rounds(schedule: KernelSchedule, nodes: Sequence[Node], outputs: dict[str, Node],
                  recomputed: bool = True) -> int:
    """The memory round trips the busiest block of a packed kernel (no composition) makes one after
    another: per sub-kernel, its GRID iterations per block (``block_ranges``) times its THREAD points
    per thread in runs of ``LOADS_IN_FLIGHT``; 0 for a template that needs composition. A small
    reduction packed beside a large one gets one block, whose grid loop then runs hundreds of
    iterations, each a load's round trip. With ``recomputed`` false, a point's reads count one
    each, as if the reductions a sub-kernel recomputes (``_recomputed_reads``) were read from
    memory: the difference is what recomputing them costs."""
    by_name = {n.name: n for n in nodes}
    if any(s.root not in by_name for s in schedule.schedules) \
            or needs_composition(schedule.schedules, outputs, by_name):
        return 0
    in_pattern = {id(n) for n in nodes}
    groups = packed_groups([(s, by_name[s.root]) for s in schedule.schedules], in_pattern)
    if len(groups) > schedule.launch.blocks:
        return 0
    rounds = 0
    for (sched, members), (start, stop) in zip(groups, block_ranges(groups, schedule.launch.blocks)):
        space = iteration_space(members[0])
        grid, thread = level_extent(sched, space, Level.GRID), level_extent(sched, space, Level.THREAD)
        loads = thread * (_recomputed_reads(members, in_pattern) if recomputed else 1)
        rounds = max(rounds, math.ceil(grid / max(1, stop - start)) * math.ceil(loads / LOADS_IN_FLIGHT))
    return rounds


def loop_rounds(schedule: KernelSchedule, nodes: Sequence[Node], outputs: dict[str, Node]) -> int:
    """The memory round trips a thread makes one after another in its loops over the points of the
    template's roots: per root, the points one thread takes (its THREAD extent, times the rounds
    by which the CTA tiles exceed the block's threads, times the grid iterations of a block: a CTA
    tile smaller than the block leaves threads idle, and the others take every point) over the
    loads it has in flight, the unrolled
    points (sized THREAD tiles, at most ``LOADS_IN_FLIGHT``) or ``LOOP_LOADS_IN_FLIGHT`` for a loop
    the compiler unrolls itself. The groups of a composed template run one after another in each
    block, so their rounds add; packed roots run in their own threads, so the longest counts. A
    kernel whose few threads each walk a long loop (a block per normalization group and a thread
    per 1024 points) is bound by these round trips, not by the bytes it moves."""
    by_name = {n.name: n for n in nodes}
    if any(s.root not in by_name for s in schedule.schedules):
        return 0
    threads = schedule.launch.threads
    per_root = []
    for sched in schedule.schedules:
        space = iteration_space(by_name[sched.root])
        if len(space) != len(sched.dims):
            continue
        unrolled = 1
        try:
            for size, tiles in zip(space, sched.dims):
                for tile, extent in zip(tiles, tile_extents(size, tiles)):
                    if tile.level == Level.THREAD and tile.size is not None:
                        unrolled *= extent
            cta, grid = level_extent(sched, space, Level.CTA), level_extent(sched, space, Level.GRID)
        except ValueError:  # tiles that do not cover the dim: no template the code generator builds
            continue
        points = level_extent(sched, space, Level.THREAD) * max(1, math.ceil(cta / threads)) \
            * max(1, math.ceil(grid / schedule.launch.blocks))
        in_flight = min(LOADS_IN_FLIGHT, max(LOOP_LOADS_IN_FLIGHT, unrolled))
        per_root.append(math.ceil(points / in_flight))
    if not per_root:
        return 0
    composed = needs_composition(schedule.schedules, outputs, by_name)
    return sum(per_root) if composed else max(per_root)


def _recomputed_reads(members: Sequence[Node], in_pattern: set[int]) -> int:
    """Elements a point of a packed loop nest reads per point of its own: sub-kernels share no
    values, so a reduction the nest's roots read from elsewhere in the kernel is recomputed at each
    point, its whole reduced length (times what its own operands recompute). Only the nodes the
    members depend on within the pattern (ids ``in_pattern``) are visited: a packed kernel's other
    sub-kernels can hold a thousand nodes."""
    own = {id(m) for m in members}
    reads: dict[int, int] = {}
    stack = [(m, False) for m in members]
    while stack:  # depth first, each node after its operands
        node, ready = stack.pop()
        if id(node) in reads:
            continue
        if not ready:
            stack.append((node, True))
            stack.extend((x, False) for x in node.operands if id(x) in in_pattern and id(x) not in reads)
            continue
        below = max([reads[id(x)] for x in node.operands if id(x) in reads] or [1])
        if node.op == "reduce" and id(node) not in own:
            below *= max(1, node.operands[0].size // max(1, node.size))
        reads[id(node)] = below
    return max(max([reads[id(x)] for x in m.operands if id(x) in reads] or [1]) for m in members)


def block_ranges(groups: list[tuple[Schedule, list[Node]]], blocks: int) -> list[tuple[int, int]]:
    """Block ranges of packed sub-kernels: proportional to each one's steps (its GRID iterations
    times each thread's serial THREAD points, times its roots), at least one block, never more than
    its GRID space; one sub-kernel takes all blocks. Steps, not elements: a cast of a [64, 64, 3, 3]
    weight tiled CTA_256 over its innermost dim keeps 3 of each block's 256 threads busy, and given
    blocks by its elements beside a large reduction it ran 12288 block iterations on 2 blocks."""
    if len(groups) == 1:
        return [(0, blocks)]
    if blocks < len(groups):
        raise ValueError(f"launch has {blocks} blocks for {len(groups)} packed sub-kernels")
    spaces = [iteration_space(members[0]) for _, members in groups]
    grids = [level_extent(s, space, Level.GRID) for (s, _), space in zip(groups, spaces)]
    work = [g * level_extent(s, space, Level.THREAD) * len(members)
            for g, (s, members), space in zip(grids, groups, spaces)]
    total = sum(work) or 1
    counts = [max(1, min(g, round(blocks * w / total))) for g, w in zip(grids, work)]
    while sum(counts) > blocks:
        largest = max(range(len(counts)), key=lambda k: counts[k])
        counts[largest] -= 1
    spare = blocks - sum(counts)  # blocks a sub-kernel's grid capped go to those with tiles left
    while spare > 0:
        room = [k for k in range(len(counts)) if counts[k] < grids[k]]
        if not room:
            break
        k = max(room, key=lambda k: work[k] / counts[k])
        extra = min(spare, grids[k] - counts[k], max(1, spare // len(room)))
        counts[k] += extra
        spare -= extra
    ranges, start = [], 0
    for count in counts:
        ranges.append((start, start + count))
        start += count
    return ranges


def packed_groups(roots: Sequence[tuple[Schedule, Node]], inside: set[int]) -> list[tuple[Schedule, list[Node]]]:
    """Roots of a packed kernel in loop nests: roots with one iteration space and tiling share a nest
    when they read a common value (an AdamW tensor's new parameter, first and second moments all
    read its gradient: each element is loaded once); unrelated roots keep their own nests, and so
    their own block ranges (AdamW over 147 tensors of one shape in a single nest ran on the blocks
    of one tensor, at a fraction of the bandwidth). ``inside``: ids of the
    pattern's nodes; the values a root reads are its pattern inputs and nodes, less single
    elements (a step count or learning rate every tensor's update reads relates nothing)."""
    reads: dict[int, set[int]] = {}

    def ancestry(root: Node) -> set[int]:
        found: set[int] = set()
        seen: set[int] = set()
        stack = [root]
        while stack:
            node = stack.pop()
            if id(node) in seen or node.op == "constant":
                continue
            seen.add(id(node))
            if id(node) in reads:
                found |= reads[id(node)]
                continue
            if node.size > 1:
                found.add(id(node))
            if id(node) in inside:
                stack.extend(node.operands)
        reads[id(root)] = found
        return found

    groups: list[list] = []  # [lead's schedule, members (the lead first), values they read]
    alike: dict[tuple, list[int]] = {}  # tiling key (``_nest_key``) → the groups a root of it may join
    for sched, root in roots:
        mine = ancestry(root)
        candidates = alike.setdefault(_nest_key(sched, root), [])
        for k in candidates:
            group = groups[k]
            members, theirs = group[1], group[2]
            if (_nest_alike(members[0], root) and not sched.shared and not mine.isdisjoint(theirs)):
                members.append(root)
                theirs |= mine
                if len(root.shape) < len(members[0].shape):  # the coarsest shape leads (``_nest_key``)
                    members.insert(0, members.pop())
                    group[0] = sched
                break
        else:
            candidates.append(len(groups))
            groups.append([sched, [root], set(mine)])
    return [(sched, members) for sched, members, _ in groups]


def _nest_key(sched: Schedule, root: Node) -> tuple:
    """Roots with equal keys may share a loop nest. A reduction's key is its tiling and iteration
    space. An elementwise root's key is its tiling read along the row-major order of its elements:
    the (level, extent) of every tile, dims in order, runs of one level merged, together with its
    size and last dim. Two shapes that one reshape relates (BERT's bias add [4096, 3072], saved for
    the backward, and the GELU of its [32, 128, 3072] view) then put the same elements on the same
    thread, and one nest computes both (``_element`` maps the lead's index to each root's shape):
    as separate sub-kernels the GELU's read the GEMM output a second time. The root of fewest dims
    leads: the others' indices split its own, and where their values come back through a reshape
    to it, the merge of the split parts folds to the lead's index register (``reshape_index``), so
    the values it computed are reused."""
    space = iteration_space(root)
    exact = True
    flat: list[list] = []
    for size, tiles in zip(space, sched.dims):
        extents = tile_extents(size, tiles)
        exact = exact and math.prod(extents) == size
        for tile, extent in zip(tiles, extents):
            if extent == 1:
                continue
            if flat and flat[-1][0] == tile.level:
                flat[-1][1] *= extent
            else:
                flat.append([tile.level, extent])
    if is_reduction(root) or not exact or not space:
        return ("tiling", sched.dims, space)
    return ("flat", tuple((level, extent) for level, extent in flat), math.prod(space), space[-1])


def _nest_alike(first: Node, root: Node) -> bool:
    """Whether ``root`` can share the loop nest of ``first`` (same iteration space and tiling): both
    elementwise, or both reductions over the same dims, which then run in one loop with an
    accumulator each (a LayerNorm's dγ and dβ partial sums read the normalized input once)."""
    if is_reduction(first) != is_reduction(root):
        return False
    return not is_reduction(root) or reduced_dims(first) == reduced_dims(root)
