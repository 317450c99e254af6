"""Groups, sub-roots and the default template of a pattern [C §4.2].

A pattern's ops split into groups at sub-roots: every reduction whose result other ops of the
pattern use is a sub-root (its result crosses threads), the pattern's outputs are roots, and all
other ops are thread-composed into the groups that use them (expensive ops may be made ``S``
sub-roots by a template; the default recomputes them).

``choose_template`` is the documented default rule:

- no reduction inside the pattern (thread composition and packing, ``schedule/packing.py``): each
  output gets its own schedule; the innermost dims go to the threads of a block as 16-byte vectors
  where the rows allow, the rest to the grid; a root reading a transposed input gets 32×32 tiles;
  reduced dims of a reduction root are THREAD loops; packed sub-kernels get blocks in proportion
  to their size;
- only column reductions (reduced dims exclude the innermost one): ``column_template``, the
  innermost dim across lanes and the reduced rows across warps; column reductions with an
  epilogue over many columns: ``thread_serial_template``, a thread per column;
- small batched dots with other groups (``batched_template``): a block per batch element;
- with reductions (composition): all groups share one tiling. Dims that no reduction reduces are
  GRID (in warp mode the last of them is ``GRID-WARP_4``: a row per warp, four warps, the best of
  1–16 warps per block when measured on softmax and LayerNorm); the reduced dims are
  CTA (the last one; across lanes in warp mode, across the block otherwise) and THREAD (the
  others). Warp mode is chosen when the reduced length is at most 1024, block mode otherwise.
  When the row divides evenly, the last reduced dim is ``THREAD_k-CTA-THREAD_v``: each thread
  keeps k 16-byte vectors of the row in registers, from which every group reads (the row is
  loaded from memory once; lowering's register composition).

``feasible`` asks the code generator itself: it lowers the default template (a probe lowering, in
which a thread's register copies of a row are lowered once with registers for their indices; its
refusals of reads outside the footprint are confirmed by the full lowering) and returns it; when
lowering refuses it, a composed pattern is tried with one row per warp at a time, then in block
mode, then thread-serial (``thread_serial_template``), and the first template that lowers is returned, else the reason lowering gave for the default (block locality, shared memory, an unsupported op), so that whatever it
accepts, ``generate`` builds. A template that would leave each thread more than
``MAX_ELEMENTS_PER_THREAD`` elements of some node is refused before lowering (``refusals.py``; too little
parallelism: a large result fused into the one block of a full reduction).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable

from fusionstitching.cost.gpu_spec import gpu_spec
from fusionstitching.cost.latency import occupancy
from fusionstitching.graph.graph import Graph, Node
from fusionstitching.graph.ops import Category
from fusionstitching.graph.pattern import Pattern, PatternError, is_reduction, reduced_dims, resolve_pattern
from fusionstitching.graph.pattern import iteration_space as _space
from fusionstitching.options import Options
from fusionstitching.schedule.packing import MAX_BLOCKS, _packed_template
from fusionstitching.schedule.propagate import check_block_locality
from fusionstitching.schedule.refusals import Reason, refusal
from fusionstitching.schedule.template import (
    WARP_SIZE,
    KernelSchedule,
    Launch,
    Level,
    Schedule,
    Tile,
    level_extent,
)
from fusionstitching.schedule.transpose import transpose_smem_template

DEFAULT_THREADS = 256
WARP_ROWS = 4  # rows (warps) per block in warp mode: measured best for softmax and LayerNorm
WARP_MODE_MAX_LENGTH = 1024
# Warp mode wants at least this many blocks of WARP_ROWS rows. With fewer rows, a row at least a
# block of threads long takes a whole block: BERT's batch-1 LayerNorms (128 rows of 768) ran as 32
# blocks of 4 warps, each lane working through 24 values, slower than a kernel of a block per
# row.
FEW_ROWS_BLOCKS = 128
MAX_REGISTER_ELEMENTS = 32
SERIAL_COLUMNS_MIN = 8192  # column reductions with an epilogue: a thread per column from this many


def sub_roots(pattern) -> list[Node]:
    """Reductions whose result other nodes of the pattern read."""
    inside = {id(n) for n in pattern.nodes}
    used = {id(o) for n in pattern.nodes for o in n.operands if id(o) in inside}
    outputs = {id(o) for o in pattern.outputs}
    return [n for n in pattern.nodes if is_reduction(n) and id(n) in used and id(n) not in outputs]


def _roots(pattern, reductions: list[Node]) -> list[Node]:
    """The pattern's nodes that are ``reductions`` or outputs, in pattern order."""
    chosen = {id(n) for n in reductions} | {id(o) for o in pattern.outputs}
    return [n for n in pattern.nodes if id(n) in chosen]


def _crossing(pattern) -> list[Node]:
    """The reductions whose results cross threads: sub-roots, and outputs worth a cross-thread reduce."""
    return sub_roots(pattern) + [o for o in pattern.outputs if is_reduction(o) and _cross_thread_worthy(o)]


def _batched(pattern, reductions: list[Node]) -> bool:
    spaces = {_space(r) for r in reductions} | {_space(o) for o in pattern.outputs}
    return bool(reductions) and (any(r.op == "dot_general" for r in reductions) or len({len(x) for x in spaces}) > 1)


def choose_template(pattern, threads: int = DEFAULT_THREADS) -> KernelSchedule:
    reductions = _crossing(pattern)
    if _batched(pattern, reductions):
        if all(r.op == "reduce" for r in reductions):  # a block per row, looping over it
            space, reduced = _space(reductions[0]), reduced_dims(reductions[0])
            rows = math.prod(size for d, size in enumerate(space) if d not in reduced)
            threads = _rereading_threads(pattern, reductions, rows, math.prod(space) // max(rows, 1), threads)
        return batched_template(pattern, reductions, threads=threads)
    if reductions and _column_pattern(pattern, reductions):
        return column_template(pattern, reductions)
    if reductions and _wide_columns(reductions) and _lanes_on_long_dims(pattern, reductions):
        return thread_serial_template(pattern, reductions, threads)
    if reductions:
        space, reduced = _space(reductions[0]), reduced_dims(reductions[0])
        length = math.prod(space[d] for d in reduced)
        rows = math.prod(size for d, size in enumerate(space) if d not in reduced)
        few_rows = rows < WARP_ROWS * FEW_ROWS_BLOCKS and length >= threads and _block_registers(pattern, length, threads)
        warp_rows = WARP_ROWS if length <= WARP_MODE_MAX_LENGTH and not few_rows else None
        if warp_rows is None and not _block_registers(pattern, length, threads):
            threads = _rereading_threads(pattern, reductions, rows, length, threads)
        return composed_template(pattern, reductions, threads, warp_rows)
    return _packed_template(pattern, threads)


def _rereading_threads(pattern, reductions: list[Node], rows: int, length: int, threads: int) -> int:
    """Threads per block for a block per row that loops over its row more than once to compute
    per-row results (statistics that feed each other: GroupNorm's mean and variance, a loss's max,
    sum of exponentials and target). The second pass finds the row in L2 only while the rows in
    flight, the blocks resident on every SM times the bytes of a row, fit there; a larger block
    leaves fewer blocks resident. The fewest threads from ``threads`` up at which they fit, else a
    block's most (CHANGELOG.md has the measurements). A pattern that also writes whole rows (a
    normalization, a loss's gradient) keeps ``threads``: its writes pass through L2 beside the rows
    it re-reads, and a cross-entropy backward measured no faster with its rows fitting. The rows are
    sized on the reference GPU (``Options.device``); the tuner measures on the real one."""
    space = _space(reductions[0])
    if any(_space(o) == space and not is_reduction(o) for o in pattern.outputs):
        return threads
    passes = sum(1 for r in _roots(pattern, reductions) if _space(r) == space)
    row_bytes = sum(n.dtype.itemsize for n in pattern.inputs if n.size == rows * length) * length
    if passes < 2 or not row_bytes:
        return threads
    spec = gpu_spec(Options.device)
    candidates = [t for t in (threads, 2 * threads, 4 * threads) if t <= spec.max_threads_per_block]
    for t in candidates:
        resident = spec.sms * occupancy(spec, t)
        if min(rows, resident) * row_bytes <= spec.l2_bytes:
            return t
    return candidates[-1]


def _block_registers(pattern, length: int, threads: int) -> bool:
    """Whether block mode keeps a row of ``length`` in the registers of ``threads`` threads (rather
    than looping over it at block stride)."""
    itemsize = min([n.dtype.itemsize for n in pattern.inputs] or [4])
    tiles = _reduced_tiles(length, threads, max(1, 16 // itemsize))
    return len(tiles) > 1 or tiles[0].size is not None


def _cross_thread_worthy(node: Node) -> bool:
    """A reduction output is reduced across threads when its rows are long and its kept part small."""
    space = _space(node)
    reduced = math.prod(space[d] for d in reduced_dims(node))
    return reduced >= 32 and node.size < reduced * 64


# ----------------------------------------------------------------------------------------------
# Composition
# ----------------------------------------------------------------------------------------------


def composed_template(pattern, reductions: list[Node], threads: int, warp_rows: int | None,
                      shared: Iterable[str] = (), rows_per_warp: int | None = None) -> KernelSchedule:
    """One tiling for all groups: kept dims on the grid (the last one ``GRID-WARP_<warp_rows>`` in
    warp mode), the last reduced dim across threads (lanes in warp mode), other reduced dims THREAD;
    the nodes named in ``shared`` become ``S`` sub-roots. A warp takes ``rows_per_warp`` rows at a
    time (a THREAD tile on the last kept dim; default: 2 for rows of at most 256 elements held in
    registers, which gives each warp two independent reductions to overlap)."""
    reduced = set(reduced_dims(reductions[0]))
    rank = len(_space(reductions[0]))
    kept = [d for d in range(rank) if d not in reduced]
    warp_mode = warp_rows is not None and kept
    if warp_mode:
        threads = WARP_SIZE * warp_rows
    shared = set(shared)
    extra = [n for n in pattern.nodes if n.name in shared]
    reductions = list(reductions) + extra
    roots = _roots(pattern, reductions)
    lanes = WARP_SIZE if warp_mode else threads
    itemsize = min([n.dtype.itemsize for n in pattern.inputs if len(n.shape) == rank] or [4])
    length = _space(reductions[0])[max(reduced)]
    reduced_tiles = _reduced_tiles(length, lanes, max(1, 16 // itemsize))
    run_tiles = _run_tiles(_space(reductions[0]), reduced, lanes, max(1, 16 // itemsize), reduced_tiles)
    if rows_per_warp is None:
        in_registers = len(reduced_tiles) > 1 or reduced_tiles[0].size is not None
        last_kept = _space(reductions[0])[kept[-1]] if kept else 1
        rows_per_warp = 2 if warp_mode and in_registers and length <= 256 and last_kept % (2 * warp_rows) == 0 else 1
    schedules = []
    for root in roots:
        space = _space(root)
        if len(space) != rank:
            dims = tuple((Tile(Level.GRID),) for _ in space)  # let lowering report the mismatch
        else:
            dims = _composed_dims(space, reduced, kept, warp_rows if warp_mode else None, reduced_tiles,
                                  rows_per_warp)
            if run_tiles:
                dims = tuple(run_tiles.get(d, tiles) for d, tiles in enumerate(dims))
        schedules.append(Schedule(root.name, dims, shared=root.name in shared))
    grid = level_extent(schedules[0], _space(roots[0]), Level.GRID)
    return KernelSchedule(tuple(schedules), Launch(max(1, min(grid, MAX_BLOCKS)), threads))


def _reduced_tiles(length: int, lanes: int, vector: int) -> tuple[Tile, ...]:
    """Tiles of the last reduced dim: each thread holds ``k x vector`` elements in registers
    (``THREAD_k-CTA_lanes-THREAD_vector``: 16-byte vectors, coalesced) when the row divides evenly
    and stays small (the widest power-of-two vector that divides it: BERT's bf16 attention rows of
    128 take 8-byte vectors of 4, so a thread's elements are consecutive and share one Philox
    block of a dropout mask); otherwise a lane- or block-stride loop."""
    widths = [vector]
    while widths[-1] > 1:
        widths.append(widths[-1] // 2)
    for v in widths:
        if length % (lanes * v) == 0 and length // lanes <= MAX_REGISTER_ELEMENTS:
            k = length // (lanes * v)
            tiles = ([Tile(Level.THREAD, k)] if k > 1 else []) + [Tile(Level.CTA, lanes)]
            return tuple(tiles + ([Tile(Level.THREAD, v)] if v > 1 else []))
    v = next((v for v in widths if v > 1 and length % v == 0), None)
    if v is not None and length > lanes * v:  # whole vectors with a tail of slots: 1000 f32 = 250 of 256
        k = -(-length // (lanes * v))
        if k * v <= MAX_REGISTER_ELEMENTS:
            return (Tile(Level.THREAD, k), Tile(Level.CTA, lanes), Tile(Level.THREAD, v))
    # A row shorter than the slots, one vector per lane (BERT's attention rows of 100 bf16: 25 vectors
    # of 4 in a warp's 32): in registers it is read once, where the loop reads it again for every
    # reduction. Taken when no more lanes idle than in the loop's last pass (v at most the loop's
    # passes), so a row of a few elements keeps the loop, which spreads it over more lanes.
    v = next((v for v in widths if 1 < v <= -(-length // lanes) and length % v == 0 and length <= lanes * v), None)
    if v is not None:
        return (Tile(Level.CTA, lanes), Tile(Level.THREAD, v))
    return (Tile(Level.CTA),)


def _run_tiles(space, reduced: set[int], lanes: int, vector: int,
               last_tiles: tuple[Tile, ...]) -> dict[int, tuple[Tile, ...]] | None:
    """Tiles for the trailing run of reduced dims taken as one row, where the last reduced dim alone
    leaves lanes idle or its row out of registers (``last_tiles`` has no sized CTA tile): an
    InstanceNorm's 64 × 64 image over 256 threads, each holding 4 × 4 elements, instead of 64 lanes
    looping over 64 rows while 192 wait. The row's tiling (``_reduced_tiles`` of the run's length)
    is laid onto the dims innermost first; None where it has no registers or does not divide."""
    if any(t.level == Level.CTA and t.size is not None for t in last_tiles):
        return None
    run = [max(reduced)]
    while run[0] - 1 in reduced:
        run.insert(0, run[0] - 1)
    if len(run) < 2:
        return None
    flat = _reduced_tiles(math.prod(space[d] for d in run), lanes, vector)
    if not any(t.size is not None for t in flat):
        return None
    tiles: dict[int, list[Tile]] = {d: [] for d in run}
    dims = list(reversed(run))  # innermost first
    left = {d: space[d] for d in run}
    k = 0
    for tile in reversed(flat):  # innermost tile first
        size = tile.size
        while size > 1:
            if k == len(dims):
                return None
            d = dims[k]
            take = math.gcd(size, left[d])
            if take == 1:
                if left[d] != 1:
                    return None  # the tile straddles a dim it does not divide
                k += 1
                continue
            tiles[d].insert(0, Tile(tile.level, take))
            left[d] //= take
            size //= take
            if left[d] == 1:
                k += 1
    if any(v != 1 for v in left.values()):
        return None
    return {d: tuple(t) for d, t in tiles.items()}


def _composed_dims(space, reduced: set[int], kept: list[int], warp_rows: int | None,
                   reduced_tiles: tuple[Tile, ...] = (Tile(Level.CTA),), rows_per_warp: int = 1):
    dims: list[tuple[Tile, ...]] = []
    last_reduced = max(reduced)
    for d in range(len(space)):
        if d in reduced:
            dims.append(reduced_tiles if d == last_reduced else (Tile(Level.THREAD),))
        elif warp_rows is not None and d == kept[-1]:
            extra = (Tile(Level.THREAD, rows_per_warp),) if rows_per_warp > 1 else ()
            dims.append((Tile(Level.GRID), Tile(Level.WARP, warp_rows)) + extra)
        else:
            dims.append((Tile(Level.GRID),))
    return tuple(dims)


def _column_pattern(pattern, reductions: list[Node]) -> bool:
    """Only column reductions of one space, nothing else: reduced dims exclude the innermost dim,
    which is long enough for a warp's lanes."""
    if any(r.op != "reduce" for r in reductions) or len({_space(r) for r in reductions}) != 1:
        return False
    if {id(o) for o in pattern.outputs} != {id(r) for r in reductions}:
        return False
    space = _space(reductions[0])
    return (len(space) - 1) not in set(reduced_dims(reductions[0])) and space[-1] % WARP_SIZE == 0


def _read_columns(pattern) -> list[Node]:
    """The pattern's reductions (sub-roots and reduced outputs), when they are column sums of one
    space of which some other node of the pattern reads one and the pattern's outputs are all among
    them (the column template schedules reductions only); otherwise none."""
    if not all(is_reduction(o) for o in pattern.outputs):
        return []
    inside = {id(n) for n in pattern.nodes}
    read = {id(o) for n in pattern.nodes for o in n.operands if id(o) in inside}
    reductions = [n for n in pattern.nodes if is_reduction(n)
                  and (id(n) in read or any(n is o for o in pattern.outputs))]
    if not any(id(r) in read for r in reductions) or not _columns(reductions):
        return []
    return reductions


def _columns(reductions: list[Node]) -> bool:
    """Reduces of one space over dims that exclude the innermost, which fills a warp's lanes."""
    if any(r.op != "reduce" for r in reductions) or len({_space(r) for r in reductions}) != 1:
        return False
    space = _space(reductions[0])
    return (len(space) - 1) not in set(reduced_dims(reductions[0])) and space[-1] % WARP_SIZE == 0


def _wide_columns(reductions: list[Node]) -> bool:
    """Column reductions (the innermost dim kept) with an epilogue and at least
    ``SERIAL_COLUMNS_MIN`` columns each: a thread per column, looping over the reduced rows, keeps
    the reads coalesced and the GPU full (a position-embedding gradient [32, 128, 768] → [128, 768]
    with its mask: the warp template put the lanes on the 32 batch rows, 98304 elements apart)."""
    for r in reductions:
        space, reduced = _space(r), set(reduced_dims(r)) if is_reduction(r) else set()
        if r.op != "reduce" or (len(space) - 1) in reduced or space[-1] < WARP_SIZE:
            return False
        if math.prod(space[d] for d in range(len(space)) if d not in reduced) < SERIAL_COLUMNS_MIN:
            return False
    return True


def column_warps(rows: int, dim: int | None = None, max_warps: int = 32) -> int:
    """Warps of the column template over ``rows`` reduced rows, split along a reduced dim of size
    ``dim`` (all of them when None): a power of two up to ``max_warps`` that divides ``dim`` and
    leaves each warp at least 8 rows."""
    dim = rows if dim is None else dim
    warps = 1
    while warps < max_warps and dim % (2 * warps) == 0 and rows // (2 * warps) >= 8:
        warps *= 2
    return warps


def column_template(pattern, reductions: list[Node], max_warps: int = 32) -> KernelSchedule:
    """Column reductions (e.g. the final sum of per-block partials, a bias gradient): the innermost
    kept dim goes to the lanes (``GRID-CTA_32``: each warp reads whole 128-byte rows), the last
    reduced dim that divides best is split over up to ``max_warps`` (32) warps (``THREAD_k-WARP_w``:
    warp w reads rows w, w + w, …; at least 8 rows of all reduced dims per warp), other reduced dims
    are THREAD loops (the final sums of stitched partials, [32, 16, 768] → [768], take 32 warps on
    the first dim instead of 2 on the second); the warps' partial sums meet in shared memory,
    several times faster than a block per column."""
    space = _space(reductions[0])
    reduced = set(reduced_dims(reductions[0]))
    rows_total = math.prod(space[d] for d in reduced)
    warps, last = 1, max(reduced)
    for d in sorted(reduced, reverse=True):  # the reduced dim that takes the most warps; the last on ties
        w = column_warps(rows_total, space[d], max_warps)
        if w > warps:
            warps, last = w, d
    dims: list[tuple[Tile, ...]] = []
    for d, size in enumerate(space):
        if d == len(space) - 1:
            dims.append((Tile(Level.GRID), Tile(Level.CTA, WARP_SIZE)))
        elif d == last:
            rows = size // warps
            dims.append(((Tile(Level.THREAD, rows),) if rows > 1 else ()) + (Tile(Level.WARP, warps),))
        elif d in reduced:
            dims.append((Tile(Level.THREAD),))
        else:
            dims.append((Tile(Level.GRID),))
    schedules = tuple(Schedule(r.name, tuple(dims)) for r in reductions)
    grid = level_extent(schedules[0], space, Level.GRID)
    return KernelSchedule(schedules, Launch(max(1, min(grid, MAX_BLOCKS)), WARP_SIZE * warps))


def batched_template(pattern, reductions: list[Node], cache_operands: bool = True,
                     threads: int = DEFAULT_THREADS) -> KernelSchedule:
    """Groups of different shapes sharing leading batch dims (small batched dots with a softmax in
    between, e.g. DIN attention): a block per batch element; in each group the last reduced dim of
    a reduce goes across the threads, a dot's contracting dims are THREAD loops and its last other
    dim goes across the threads; dots read by other groups are cached in shared memory (``S``).
    A block has at most ``threads`` threads, fewer when the widest dim across them is shorter.

    Expensive ops both ways [C §4.2]: a dot operand computed inside the pattern with an expensive
    op in it (the softmax before DIN's second dot) is recomputed by every thread of the dot's
    output row, i.e. once per output column; with ``cache_operands`` it becomes an ``S`` sub-root
    computed once per element, which on DIN attention more than halves the kernel's time.
    ``feasible`` tries the other way when this one does not lower.

    A dot operand that transposes a kernel input's last dim away (DIN's keysᵀ) is staged in shared
    memory too, loaded with the threads along the input's contiguous dim: the dot's threads, which
    go along its output dim, would otherwise each read their own row of the input (a 256-byte
    stride between lanes)."""
    reductions = list(reductions) + _staged_transposes(pattern)
    reductions += _cached_operands(pattern) if cache_operands else []
    roots = _roots(pattern, reductions)
    spaces = [_space(r) for r in roots]
    batch = 0
    while all(len(x) > batch for x in spaces) and len({x[batch] for x in spaces}) == 1 \
            and all(batch not in set(reduced_dims(r)) for r in roots if is_reduction(r)):
        batch += 1
    inside = {id(n) for n in pattern.nodes}
    used = {id(o) for n in pattern.nodes for o in n.operands if id(o) in inside}
    schedules, widest = [], 1
    for root, space in zip(roots, spaces):
        reduced = set(reduced_dims(root)) if is_reduction(root) else set()
        across = max(reduced) if root.op == "reduce" else max([d for d in range(batch, len(space))
                                                               if d not in reduced] or [len(space) - 1])
        if root.op == "transpose":  # threads along the operand's contiguous dim: coalesced loads
            # (every dim a batch dim, as in a transpose of [1, 1]: all GRID, none across)
            across = min(max(batch, list(root.attrs["permutation"]).index(len(space) - 1)), len(space) - 1)
        dims = []
        for d in range(len(space)):
            level = Level.GRID if d < batch else Level.CTA if d == across else Level.THREAD
            dims.append((Tile(level),))
        if across >= batch:
            widest = max(widest, space[across])
        shared = (root.op == "dot_general" or not is_reduction(root)) and id(root) in used
        schedules.append(Schedule(root.name, tuple(dims), shared=shared))
    threads = min(threads, max(WARP_SIZE, 1 << (widest - 1).bit_length()))
    blocks = math.prod(spaces[0][:batch]) if batch else 1
    return KernelSchedule(tuple(schedules), Launch(max(1, min(blocks, MAX_BLOCKS)), threads))


def _cached_operands(pattern) -> list[Node]:
    """Dot operands computed inside the pattern whose computation has an expensive op in it
    (through elementwise and shape ops, not past other reductions)."""
    inside = {id(n) for n in pattern.nodes}
    found = []
    for dot in (n for n in pattern.nodes if n.op == "dot_general"):
        for operand in dot.operands:
            if id(operand) in inside and not is_reduction(operand) and _has_expensive(operand, inside) \
                    and not any(operand is f for f in found):
                found.append(operand)
    return found


def _staged_transposes(pattern) -> list[Node]:
    """Dot operands inside the pattern that transpose a kernel input's last dim (``batched_template``)."""
    inside = {id(n) for n in pattern.nodes}
    found = []
    for dot in (n for n in pattern.nodes if n.op == "dot_general"):
        for operand in dot.operands:
            if (operand.op == "transpose" and id(operand) in inside and id(operand.operands[0]) not in inside
                    and operand.attrs["permutation"][-1] != len(operand.shape) - 1
                    and not any(operand is f for f in found)):
                found.append(operand)
    return found


def _has_expensive(node: Node, inside: set[int]) -> bool:
    stack, seen = [node], set()
    while stack:
        n = stack.pop()
        if id(n) in seen or id(n) not in inside or is_reduction(n):
            continue
        seen.add(id(n))
        if n.category == Category.EXPENSIVE_ELEMENTWISE:
            return True
        stack.extend(n.operands)
    return False


# ----------------------------------------------------------------------------------------------
# Feasibility
# ----------------------------------------------------------------------------------------------


LoweringCheck = Callable[[Graph, list[Node], Pattern, KernelSchedule, int], "Reason | None"]
"""``(graph, nodes, pattern, template, smem_limit) -> Reason | None``: why the code generator
cannot build ``template`` for the pattern within ``smem_limit`` bytes of shared memory, or None.
Raises ``ValueError`` for a template the tiling rules refuse."""

_LOWERING: list[LoweringCheck] = []


def register_lowering_check(check: LoweringCheck | None) -> None:
    """The check ``feasible`` asks last by default. Schedule analysis cannot see every refusal of
    the code generator (an op or dtype it does not lower, a footprint it cannot prove, shared
    memory over the limit), and the code generator stands above this package: the package
    registers its check when it is imported (``fusionstitching/__init__.py``), as a compiler's
    scheduler asks its backend whether a fusion can be built. None unregisters it."""
    _LOWERING[:] = [check] if check is not None else []


def feasible(graph: Graph, nodes: Iterable[Node | str], smem_limit: int = 48 * 1024,
             lowers: LoweringCheck | None = None) -> KernelSchedule | Reason:
    """A template that the code generator builds for this pattern, or the Reason there is none.
    Candidate templates are tried in order (``_candidate_templates``); each is refused by the
    schedule's own analysis (``refusal``, ``propagate.check_block_locality``, which cost far less
    than lowering) or by ``lowers`` (default: the registered ``LoweringCheck``)."""
    if lowers is None and _LOWERING:
        lowers = _LOWERING[0]
    nodes = list(nodes)
    try:
        pattern = resolve_pattern(graph, nodes)
    except PatternError as err:
        return Reason(str(err))
    reasons: list[Reason] = []
    tried: set[KernelSchedule] = set()
    for make in _candidate_templates(pattern):
        try:
            template = make()
            if template in tried:  # another candidate's template again: its answer stands
                continue
            tried.add(template)
            refused = refusal(pattern, template)  # a Reason is falsy: tested against None, not chained by `or`
            if refused is None:
                refused = check_block_locality(graph, nodes, template, smem_limit, pattern=pattern)
            if refused is None and lowers is not None:
                refused = lowers(graph, nodes, pattern, template, smem_limit)
        except PatternError as err:
            refused = Reason(str(err))
        except ValueError as err:  # a template the tiling rules refuse
            refused = Reason(f"no valid template: {err}")
        if refused is not None:
            reasons.append(refused)
            continue
        return template
    return reasons[0]  # the default template's reason


def is_stitched_partial(node: Node) -> bool:
    """A partial column sum over blocks of rows: reduce the second-to-last dim (4 to 32 rows) of a
    ``[..., blocks, rows, columns]`` split (``fusion/split.stitched_rows``)."""
    if node.op != "reduce" or node.operands[0].op != "reshape":
        return False
    shape = node.operands[0].shape
    return len(shape) >= 3 and tuple(node.attrs["dims"]) == (len(shape) - 2,) and shape[-2] in (4, 8, 16, 32)


def is_looped_partial(node: Node) -> bool:
    """A partial column sum over the rows a block visits in a grid-stride loop: reduce dims
    ``0..j`` of ``[d0, .., q, n, .., columns]``, a reshape of ``[d0, .., q * n, .., columns]``
    (``graph.transforms`` row loops, ``fusion/split.row_loop_parts``), keeping at least a dim of
    rows and the columns."""
    if node.op != "reduce" or node.operands[0].op != "reshape":
        return False
    split, dims = node.operands[0].shape, tuple(sorted(node.attrs["dims"]))
    j = len(dims) - 1
    if not dims or dims != tuple(range(len(dims))) or len(split) < j + 3:
        return False
    source = node.operands[0].operands[0].shape
    return source == split[:j] + (split[j] * split[j + 1],) + split[j + 2:]


def _stitched_partials(pattern) -> list[Node]:
    return [o for o in pattern.outputs if is_stitched_partial(o) or is_looped_partial(o)]


def _row_loop_template(pattern, partials: list[Node], rows: list[Node], threads: int) -> KernelSchedule:
    """Row reductions of a block per row with partial column sums carried by the grid loop (an
    RMSNorm backward over rows too long for a warp: dx and dw's partials in one kernel). Every
    group tiles the rows' split dim ``GRID_q-GRID`` like the partials' reshape, and the launch has
    one block per kept row of the partial: block ``b`` visits rows ``b``, ``b + n``, ... and sums
    their columns in registers (``template.grid_carried``)."""
    split, dims = partials[0].operands[0].shape, tuple(sorted(partials[0].attrs["dims"]))
    if any(p.operands[0].shape != split or tuple(sorted(p.attrs["dims"])) != dims for p in partials):
        raise ValueError("partials carried by the grid loop over different splits")
    j = len(dims) - 1
    base = composed_template(pattern, rows, threads, None)
    lead = base.schedule(rows[0].name)
    space = _space(rows[0])
    if len(space) != len(split) - 1 or any(lead.dims[d] != (Tile(Level.GRID),) for d in range(len(space) - 1)):
        raise ValueError(f"row reductions of {list(space)} are not a block per row: {lead}")
    by_name = {n.name: n for n in pattern.nodes}
    schedules = []
    for sched in base.schedules:
        if any(p.name == sched.root for p in partials):
            dims_ = tuple((Tile(Level.GRID),) for _ in split[:-1]) + (lead.dims[-1],)
            schedules.append(Schedule(sched.root, dims_))
            continue
        own = _space(by_name[sched.root])
        if len(own) == len(space) and own[:-1] == space[:-1] and sched.dims[j] == (Tile(Level.GRID),):
            sched = Schedule(sched.root, sched.dims[:j] + ((Tile(Level.GRID, split[j]), Tile(Level.GRID)),)
                             + sched.dims[j + 1:], shared=sched.shared)
        schedules.append(sched)
    return KernelSchedule(tuple(schedules), Launch(math.prod(split[j + 1:-1]), base.launch.threads))


def row_partial_template(pattern, threads: int = DEFAULT_THREADS) -> KernelSchedule:
    """Row reductions with partial column sums over the same rows in one kernel (LayerNorm
    backward: dx with its two row reductions, and dgamma/dbeta's per-block partials): a warp per
    row and a block per ``r`` rows (``GRID-WARP_r`` on the last kept dim); each partial sums its
    block of rows across the block's warps (``WARP_r``) with the row kernel's grid and column
    tiling, so both read the same elements in the same block. Partials carried by a grid loop
    take a block of ``threads`` per row instead (``_row_loop_template``)."""
    partials = _stitched_partials(pattern)
    rows = [r for r in _crossing(pattern) if not any(r is p for p in partials)]
    if not partials or not rows:
        raise ValueError("no row reductions with stitched partial column sums")
    if all(is_looped_partial(p) for p in partials):
        return _row_loop_template(pattern, partials, rows, threads)
    if any(is_looped_partial(p) for p in partials):
        raise ValueError("partials of row blocks and of row loops in one kernel")
    per_part = partials[0].operands[0].shape[-2]
    base = composed_template(pattern, rows, DEFAULT_THREADS, per_part, rows_per_warp=1)
    lead = base.schedule(rows[0].name)
    space = _space(rows[0])
    if len(lead.dims) != len(space) or len(space) < 2 or lead.dims[-2] != (Tile(Level.GRID), Tile(Level.WARP, per_part)):
        raise ValueError(f"row reductions of {list(space)} are not a warp per row: {lead}")
    schedules = []
    for sched in base.schedules:
        partial = next((p for p in partials if p.name == sched.root), None)
        if partial is None:
            schedules.append(sched)
            continue
        split = partial.operands[0].shape
        if split[:-3] != space[:-2] or split[-1] != space[-1] or split[-3] * split[-2] != space[-2] \
                or split[-2] != per_part:
            raise ValueError(f"partial {partial.name} over {list(split)} does not match rows of {list(space)}")
        dims = lead.dims[:-2] + ((Tile(Level.GRID),), (Tile(Level.WARP, per_part),), lead.dims[-1])
        schedules.append(Schedule(partial.name, dims))
    blocks = level_extent(lead, space, Level.GRID)
    return KernelSchedule(tuple(schedules), Launch(max(1, min(blocks, MAX_BLOCKS)), base.launch.threads))


def _candidate_templates(pattern):
    """The default template first; for composed patterns, then 8, 16 and 32 warps per block (a
    column reduction over few rows fits in one block), one row per warp at a time (no THREAD tile
    on the kept dim, which register composition needs to be exact), then block mode."""
    if _stitched_partials(pattern):
        yield lambda: row_partial_template(pattern)
    columns = _read_columns(pattern)
    if columns:
        # column sums that other nodes of the pattern read (a variance summed around its parts'
        # means): the warps' sums meet in shared memory and stay there for the readers, where a
        # thread-serial template would sum them again for every point that reads them
        yield lambda: column_template(pattern, columns)
    yield lambda: choose_template(pattern)
    yield lambda: transpose_smem_template(pattern, DEFAULT_THREADS)  # transposed reads: tiles through shared memory
    reductions = _crossing(pattern)
    if reductions and _batched(pattern, reductions):
        yield lambda: batched_template(pattern, reductions, cache_operands=False)  # recompute instead
    if reductions and not _batched(pattern, reductions):
        for warps in (8, 16, 32):  # more rows per block: a column reduction over few rows fits in one
            yield lambda w=warps: composed_template(pattern, reductions, DEFAULT_THREADS, w)
        yield lambda: composed_template(pattern, reductions, DEFAULT_THREADS, WARP_ROWS, rows_per_warp=1)
        yield lambda: composed_template(pattern, reductions, DEFAULT_THREADS, None)
    if reductions and all(r.op == "reduce" for r in reductions):
        if len(pattern.outputs) > 1 and _independent_outputs(pattern):
            yield lambda: _packed_template(pattern, DEFAULT_THREADS)  # each output's own blocks
        if not any(_strided_rows(r) for r in reductions):
            yield lambda: thread_serial_template(pattern, reductions)


SECTOR_BYTES = 32  # the unit in which a warp's loads reach memory


def _strided_rows(reduce: Node) -> bool:
    """Whether a thread reducing whole rows of ``reduce`` by itself (``thread_serial_template``)
    would read rows longer than a memory sector: the reduce's innermost dim is reduced, so a warp's
    lanes, along a kept outer dim, each read a sector of their own per load, and the rows' threads
    are few (BatchNorm's statistics of [32, 64, 56, 56] on 64 blocks ran at 2 % of a copy's speed)."""
    shape = reduce.operands[0].shape
    return bool(shape) and len(shape) - 1 in set(reduced_dims(reduce)) \
        and shape[-1] * reduce.operands[0].dtype.itemsize > SECTOR_BYTES


def _independent_outputs(pattern) -> bool:
    """Whether the pattern's outputs share no node of the pattern, so that packing them as
    sub-kernels, each thread reducing its own elements inline, computes nothing twice. Packed final
    sums of bias gradients (thirty [64, 768] → [768] sums, each with its casts) then get a block range
    each, where the thread-serial template ran them all on the blocks of one output."""
    inside = {id(n) for n in pattern.nodes}
    owner: dict[int, int] = {}
    for k, out in enumerate(pattern.outputs):
        stack = [out]
        while stack:
            node = stack.pop()
            if id(node) not in inside or node.op == "constant":
                continue
            if owner.setdefault(id(node), k) != k:
                return False
            stack.extend(n for n in node.operands if owner.get(id(n)) != k)
    return True


def _lanes_on_long_dims(pattern, reductions: list[Node]) -> bool:
    """Whether no root of the pattern would have its lanes on a dim of size 1 under
    ``thread_serial_template``, which tiles every root's last kept dim ``GRID-CTA``: a root of
    other dims packed beside the reductions (a weight's cast [256, 1024, 1, 1] beside the final
    sums of BatchNorm's statistics) ran on one lane of a block, over the sums' few blocks."""
    def lanes(node: Node) -> int:
        space = _space(node)
        reduced = set(reduced_dims(node)) if is_reduction(node) else set()
        kept = [d for d in range(len(space)) if d not in reduced]
        return space[kept[-1]] if kept else 1

    return lanes(reductions[0]) == 1 or all(lanes(root) > 1 for root in _roots(pattern, reductions))


def thread_serial_template(pattern, reductions: list[Node], threads: int = DEFAULT_THREADS,
                           vector: int = 1) -> KernelSchedule:
    """Each thread reduces whole columns by itself (reduced dims THREAD) and applies the epilogue to
    its own results, so no value crosses threads: the kept dims are tiled alike in every group, the
    last one ``GRID-CTA_<threads>``. A root that reduces nothing (a cast packed beside the sums)
    spreads the lanes over its innermost dims that fit whole with lanes to spare, then
    ``GRID-CTA_<the lanes left>`` over the next: a [64, 64, 3, 3] weight's cast tiled over its last
    dim alone kept 3 of each block's 256 lanes busy. The reductions keep one block per GRID point of
    their last kept dim, so that their few active threads are spread over the GPU's SMs. Fits
    column reductions whose consumers have the reduced shape (a bias gradient and its convert back
    to bf16, a column sum and its epilogue); a ValueError
    where a root's lanes would fall on a dim of size 1 (``_lanes_on_long_dims``).

    With ``vector`` = v > 1, each thread takes v adjacent columns (``GRID-CTA_<lanes>-THREAD_v`` on
    every root's lane dim, which v must divide): its loads of a row become one v-wide access and a
    warp reads v times as many bytes per load instruction, with v times fewer threads."""
    if not _lanes_on_long_dims(pattern, reductions):
        raise ValueError("the thread-serial template tiles every root as the reductions' kept dims, "
                         "which would put some root's lanes on a dim of size 1")
    roots = _roots(pattern, reductions)
    schedules = []
    for root in roots:
        space = _space(root)
        reduced = set(reduced_dims(root)) if is_reduction(root) else set()
        kept = [d for d in range(len(space)) if d not in reduced]
        dims: list[tuple[Tile, ...]] = [(Tile(Level.THREAD),) if d in reduced else (Tile(Level.GRID),)
                                        for d in range(len(space))]
        remaining = threads
        for d in reversed(kept):
            if not reduced and d != kept[0] and space[d] * 2 <= remaining:
                dims[d] = (Tile(Level.CTA),)  # the whole dim, the lanes left over to the dims outside it
                remaining //= max(space[d], 1)
                continue
            if vector > 1 and (d != len(space) - 1 or space[d] % vector):
                raise ValueError(f"{root.name}: {vector} adjacent columns per thread need its innermost dim "
                                 f"across the lanes, a multiple of {vector}")
            vectors = (Tile(Level.THREAD, vector),) if vector > 1 else ()
            dims[d] = (Tile(Level.GRID), Tile(Level.CTA, remaining)) + vectors
            break
        schedules.append(Schedule(root.name, tuple(dims)))
    grid = level_extent(schedules[0], _space(roots[0]), Level.GRID)
    return KernelSchedule(tuple(schedules), Launch(max(1, min(grid, MAX_BLOCKS)), threads))
