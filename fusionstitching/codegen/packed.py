"""Thread composition of packed roots: a kernel whose every root is computed by the threads that
store it (no value crosses threads), for ``lower.lower``.

Kernel packing [C §4.1]: roots whose iteration spaces and tilings are identical share one loop
nest (same-shape ops in one loop) when they read a common value; groups with different shapes are
sub-kernels that each get a range of blocks, proportional to their steps (``schedule.packing.block_ranges``), and dispatch on
``blockIdx.x``. A root's loop nest follows its schedule (see the tiling note in
``schedule/template.py``): a grid-stride loop over the GRID space, a block-stride loop over the
CTA space (or warp/lane loops when there are WARP tiles), serial loops over THREAD factors, dim
indices rebuilt mixed-radix and tails predicated off. Reductions as roots are lowered here only
when every reduced dim is THREAD-tiled (each thread reduces sequentially, [B §5.2]); reductions of
one nest (same dims, a common input) share that loop, an accumulator each.
"""

from __future__ import annotations

import math

from fusionstitching.codegen import kernel_ir as K
from fusionstitching.codegen.groups import Factor, decompose, strided_loop
from fusionstitching.codegen.values import (
    CodegenError,
    ValueEmitter,
    combine,
    is_reduction,
    reduce_identity,
    reduced_dims,
    reduction_kind,
    register_type,
    reshape_index,
    rounded,
)
from fusionstitching.codegen.vectorize import pack_lanes
from fusionstitching.graph.graph import Node
from fusionstitching.graph.pattern import iteration_space
from fusionstitching.schedule.packing import block_ranges, packed_groups
from fusionstitching.schedule.template import KernelSchedule, Level, Schedule, tile_extents


def lower_packed(emitter, schedule, pattern, out_names, output_layouts, vectorize_access, guard_tails,
                  probe=False):
    """Thread composition only: one loop nest per group of same-shape roots, packed by block ranges.
    A probe lowers only the first lane of a vector (``_element``)."""
    groups = _group_schedules(schedule, {o.name: o for o in pattern.outputs}, {id(n) for n in pattern.nodes})
    ranges = block_ranges(groups, schedule.launch.blocks)
    parts: list[tuple[int, list[K.Stmt]]] = []
    out_position = {o.name: k for k, o in enumerate(pattern.outputs)}
    for (sched, group_roots), (start, stop) in zip(groups, ranges):
        stores = [(r, out_names[out_position[r.name]], output_layouts[out_position[r.name]]) for r in group_roots]
        emitter.stmts = []
        parts.append((start, _lower_group(emitter, sched, stores, start, stop, schedule.launch.threads,
                                          len(groups) > 1, vectorize_access, guard_tails, probe)))
    return _dispatch(parts)


def _dispatch(parts: list[tuple[int, list[K.Stmt]]]) -> list[K.Stmt]:
    """Sub-kernels (first block, statements) in block order, reached by a binary search on the block
    index: a block of the last of 199 sub-kernels (AdamW over BERT-base) tests 8 ranges, not 199,
    and does not fetch the code of the others on the way (each sub-kernel keeps its own range test)."""
    if len(parts) <= 2:
        return [stmt for _, stmts in parts for stmt in stmts]
    mid = len(parts) // 2
    below = K.lt(K.Special("bid"), K.Const(parts[mid][0], "i32"))
    return [K.If(below, tuple(_dispatch(parts[:mid])), tuple(_dispatch(parts[mid:])))]


def _group_schedules(schedule: KernelSchedule, outputs: dict[str, Node], inside: set[int]):
    """Schedules with identical iteration spaces and tilings share one loop nest when their roots
    are related (``packed_groups``)."""
    roots = []
    for sched in schedule.schedules:
        root = outputs[sched.root]
        space = iteration_space(root)
        if len(sched.dims) != len(space):
            raise CodegenError(f"{root.name}: schedule has {len(sched.dims)} dims, its iteration space "
                               f"{list(space)} has {len(space)}")
        roots.append((sched, root))
    return packed_groups(roots, inside)


def _lower_group(em: ValueEmitter, sched: Schedule, stores, start: int, stop: int, threads: int,
                 packed: bool, vectorize_access: bool, guard_tails: bool, probe: bool = False) -> list[K.Stmt]:
    lead = stores[0][0]
    space = iteration_space(lead)
    reduced = set(reduced_dims(lead)) if is_reduction(lead) else set()
    factors: list[Factor] = []
    for d, (size, tiles) in enumerate(zip(space, sched.dims)):
        try:
            exts = tile_extents(size, tiles)
        except ValueError as err:
            raise CodegenError(f"{lead.name}: dim {d}: {err}") from None
        for tile, ext in zip(tiles, exts):
            if d in reduced and tile.level != Level.THREAD:
                raise CodegenError(f"{lead.name}: reduced dim {d} is tiled {tile.level.value}; reductions "
                                   "across threads need warp or block composition")
            factors.append(Factor(d, tile.level, ext))
    if sched.shared:
        raise CodegenError(f"{lead.name}: 'S' (shared-memory result) needs block composition")
    has_warp = any(f.level == Level.WARP for f in factors)
    lane = _vector_lane(factors, space, stores, reduced)
    if has_warp and threads % 32:
        raise CodegenError(f"{lead.name}: WARP tiles need a multiple of 32 threads")
    it = em.index_type

    def special(name: str) -> K.Expr:
        s = K.Special(name)
        return K.Cast(s, it) if it != "i32" else s

    def level_loop(level: Level, first: K.Expr, step: K.Expr, count: int, inner, kind: str) -> list[K.Stmt]:
        fs = [f for f in factors if f.level == level]
        total = math.prod(f.extent for f in fs)
        if level == Level.CTA and kind == "block_stride" and count < total:
            # a block looping over a row (``packing._root_schedule(row_loop=)``): in unrolled
            # rounds, so that a thread's loads of several iterations are in flight together
            def iteration(var: K.Expr) -> list[K.Stmt]:
                made: list[K.Stmt] = []
                stmts, _ = em.nested(lambda: made.extend(decompose(em, fs, var) + inner()))
                return stmts + made

            return strided_loop(em, level.value.lower(), first, count, total, iteration)
        var = em.fresh(level.value.lower(), it)
        body = decompose(em, fs, var) + inner()
        if count >= total:
            return [K.Let(var, first), K.If(K.lt(var, em.idx(total)), tuple(body))]
        return [K.For(var, first, em.idx(total), step, tuple(body), kind)]

    def cta_level() -> list[K.Stmt]:
        if has_warp:
            return level_loop(Level.WARP, special("warp"), special("nwarp"), threads // 32,
                              lambda: level_loop(Level.CTA, special("lane"), em.idx(32), 32, thread_level, "lane_stride"),
                              "warp_stride")
        return level_loop(Level.CTA, special("tid"), special("ntid"), threads, thread_level, "block_stride")

    def thread_level() -> list[K.Stmt]:
        kept = [f for f in factors if f.level == Level.THREAD and f.dim not in reduced and f is not lane]
        red = [f for f in factors if f.level == Level.THREAD and f.dim in reduced]
        # Tails of dims no THREAD tile walks are tested once, outside the thread's loop: tested per
        # point, the unrolled points keep a branch each between their loads, and a thread waits for
        # each load before it issues the next (see ``groups.strided_loop``).
        outside = [d for d, size in enumerate(space) if guard_tails and d not in reduced
                   and math.prod(f.extent for f in factors if f.dim == d) > size
                   and all(f.level != Level.THREAD for f in factors if f.dim == d)]
        if not outside or all(f.extent == 1 for f in kept):
            return _serial(em, kept, lambda: _element(em, stores, factors, space, reduced, red, lane,
                                                      vectorize_access, guard_tails, probe))

        def hoisted():
            guard = None
            for d in outside:
                guard = K.land(guard, K.lt(em.let("i", _dim_index(em, factors, d)), em.idx(space[d])))
            return guard, _serial(em, kept, lambda: _element(em, stores, factors, space, reduced, red, lane,
                                                             vectorize_access, guard_tails, probe,
                                                             tested=frozenset(outside)))

        prefix, (guard, loops) = em.nested(hoisted)
        return prefix + [K.If(guard, tuple(loops))]

    grid_first = K.Binary("sub", special("bid"), em.idx(start), it) if start else special("bid")
    nest = level_loop(Level.GRID, grid_first, em.idx(stop - start), stop - start, cta_level, "grid_stride")
    if packed:
        in_range = K.land(K.Binary("ge", K.Special("bid"), K.Const(start, "i32"), "bool"),
                          K.lt(K.Special("bid"), K.Const(stop, "i32")))
        return [K.Comment(f"sub-kernel {', '.join(r.name for r, _, _ in stores)}: blocks [{start}, {stop})"),
                K.If(in_range, tuple(nest))]
    return [K.Comment(f"{', '.join(r.name for r, _, _ in stores)}")] + nest


def _serial(em: ValueEmitter, fs: list[Factor], inner) -> list[K.Stmt]:
    """Nested serial loops over THREAD factors (unrolled when short), then ``inner``."""
    if not fs:
        return inner()
    f = fs[0]
    if f.extent == 1:
        f.var = em.idx(0)
        return _serial(em, fs[1:], inner)
    var = em.fresh("t", em.index_type)
    f.var = var
    body = _serial(em, fs[1:], inner)
    return [K.For(var, em.idx(0), em.idx(f.extent), em.idx(1), tuple(body), "unroll" if f.extent <= 8 else "serial")]


def _dim_index(em: ValueEmitter, factors: list[Factor], d: int) -> K.Expr:
    index: K.Expr = em.idx(0)
    for f in factors:
        if f.dim == d:
            index = K.add(K.mul(index, em.idx(f.extent)), f.var)
    return index


def _vector_lane(factors: list[Factor], space, stores, reduced) -> Factor | None:
    """The innermost THREAD factor whose lanes are unrolled for vector accesses, if any.

    It must be the last tile of the last dim, that dim kept (a column sum's lanes each have their
    accumulator) and a multiple of the lane count (so one guard covers all lanes), and every output
    written with unit stride in that dim.
    """
    last = factors[-1] if factors else None
    if last is None or last.level != Level.THREAD or last.extent < 2 or last.extent > 16:
        return None
    if last.dim != len(space) - 1 or last.dim in reduced or space[-1] % last.extent:
        return None
    if any(layout.strides[-1] != 1 for _, _, layout in stores):
        return None
    return last


def _element(em: ValueEmitter, stores, factors: list[Factor], space, reduced, red_factors,
             lane: Factor | None = None, vectorize_access: bool = False,
             guard_tails: bool = True, probe: bool = False, tested: frozenset[int] = frozenset()) -> list[K.Stmt]:
    """The body at one point of the iteration space (or the lanes of a vector): compute, store;
    the tails of dims in ``tested`` are tested by the caller. A probe lowers the first lane only: every lane computes the same nodes at indices that differ by
    a constant, and what lowering refuses here (an op, a dtype, a constant) does not depend on the
    index, so the other lanes refuse nothing the first one accepts."""
    saved = em.stmts
    em.stmts = []
    lanes = lane.extent if lane is not None and not probe else 1
    if lane is not None:
        lane.var = em.idx(0)

    def point() -> list[K.Expr]:
        index = [_dim_index(em, factors, d) if d not in reduced else em.idx(0) for d in range(len(space))]
        return [em.let("i", e) if not isinstance(e, (K.Var, K.Const)) else e for e in index]

    index = point()
    guard = None
    for d, size in enumerate(space):
        covered = math.prod(f.extent for f in factors if f.dim == d)
        if covered > size and d not in reduced and d not in tested and guard_tails:
            guard = K.land(guard, K.lt(index[d], em.idx(size)))
    prefix = em.stmts

    def compute() -> None:
        ats = [index]
        for j in range(1, lanes):
            lane.var = em.idx(j)
            ats.append(point())
        if reduced:  # the nest's roots are reductions over the same dims: one loop for all lanes and roots
            roots = [root for root, _, _ in stores]
            per_lane = _reduce_roots(em, roots, ats, factors, space, red_factors, vectorize_access)
            for at, values in zip(ats, per_lane):
                out_index = [at[d] for d in range(len(space)) if d not in reduced]
                for (root, buffer, layout), value in zip(stores, values):
                    em.stmts.append(K.Store(buffer, em.linear(out_index, layout.strides), em.stored(value, root.dtype)))
            return
        for at in ats:
            for root, buffer, layout in stores:
                mine = at  # the lead's index, or the same element in this root's shape (``_nest_key``)
                if root.shape != stores[0][0].shape:
                    em.bound(at, stores[0][0].shape)
                    mine = [em.let("i", i) for i in reshape_index(at, stores[0][0].shape, root.shape, em.idx,
                                                                   em.definitions, em.index_bounds)]
                value = em.value(root, tuple(mine))
                em.stmts.append(K.Store(buffer, em.linear(mine, layout.strides), em.stored(value, root.dtype)))

    body, _ = em.nested(lambda: compute())
    if lane is not None and vectorize_access:
        body = pack_lanes(body, em.definitions, lanes)
    em.stmts = saved
    if guard is not None:
        return list(prefix) + [K.If(guard, tuple(body))]
    return list(prefix) + body


def _reduce_roots(em: ValueEmitter, roots: list[Node], indices, factors, space, red_factors,
                  vectorize_access: bool = False) -> list[list[K.Expr]]:
    """Reductions over the same dims in one serial loop, an accumulator per root and per vector lane
    (``indices``: the kept index of each lane): a value several of them read (an input element) is
    loaded once per point, and the lanes' loads of one point become one vector access (a column
    sum of bf16 rows reads 8 bytes per thread and row, not 2). Returns the values per lane."""
    dims = reduced_dims(roots[0])
    accs = []
    for _ in indices:
        lane_accs = []
        for root in roots:
            acc = em.accumulator("acc", register_type(root.dtype))
            em.stmts.append(K.Let(acc, reduce_identity(reduction_kind(root), root.dtype)))
            lane_accs.append(acc)
        accs.append(lane_accs)

    def body() -> None:
        for index, lane_accs in zip(indices, accs):
            point = [_dim_index(em, factors, d) if d in dims else index[d] for d in range(len(space))]
            guard = None
            for d in dims:
                if math.prod(f.extent for f in factors if f.dim == d) > space[d]:
                    guard = K.land(guard, K.lt(point[d], em.idx(space[d])))

            def terms(point=point, lane_accs=lane_accs) -> list[K.Stmt]:
                return [K.Assign(acc, combine(reduction_kind(root), acc, em.term(root, point), acc.dtype))
                        for root, acc in zip(roots, lane_accs)]

            inner, updates = em.nested(terms)
            update = tuple(inner) + tuple(updates)
            em.stmts.extend([K.If(guard, update)] if guard is not None else update)
        if len(indices) > 1 and vectorize_access:
            em.stmts[:] = pack_lanes(em.stmts, em.definitions, len(indices))

    stmts, _ = em.nested(lambda: _serial_into(em, red_factors, body))
    em.stmts.extend(stmts)
    return [[em.let("v", rounded(acc, root.dtype)) if root.dtype.widened else acc
             for root, acc in zip(roots, lane_accs)] for lane_accs in accs]


def _serial_into(em: ValueEmitter, fs: list[Factor], body) -> None:
    def inner() -> list[K.Stmt]:
        stmts, _ = em.nested(body)
        return stmts

    em.stmts.extend(_serial(em, fs, inner))
