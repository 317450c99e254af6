"""The groups of a composed kernel: one per root of its template, with the root's iteration space
split into tile factors (``Factor``: a dim's tile at one level and its extent, bound to an index
register while lowering), its reduced dims, where it is stored and whether it is cached in shared
memory (``S``)."""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from fusionstitching.codegen import kernel_ir as K
from fusionstitching.codegen.values import CodegenError, ValueEmitter
from fusionstitching.graph.graph import Layout, Node
from fusionstitching.graph.pattern import is_reduction, iteration_space, reduced_dims
from fusionstitching.schedule.template import Level, Schedule, tile_extents


@dataclass
class Factor:
    dim: int
    level: Level
    extent: int
    var: K.Expr | None = None


@dataclass
class Group:
    sched: Schedule
    root: Node
    space: tuple[int, ...]
    factors: list[Factor]
    reduced: set[int]
    output: tuple[str, Layout] | None
    shared: bool

    @functools.cached_property
    def cross_thread(self) -> bool:
        """Reduced across the lanes of a warp or the threads of a block (CTA tiles on reduced dims)."""
        return any(f.dim in self.reduced and f.level == Level.CTA for f in self.factors)

    @functools.cached_property
    def carried(self) -> bool:
        """An output reduced across the iterations of the grid-stride loop: the reduced dims have
        GRID tiles only (``template.grid_carried``), so each block sums the tiles it visits in
        registers. (A sub-root tiled so is recomputed whole by each reader instead.)"""
        return bool(self.reduced) and self.output is not None and not self.shared and all(f.level == Level.GRID for f in self.factors if f.dim in self.reduced) \
            and any(f.extent > 1 for f in self.factors if f.dim in self.reduced)

    @functools.cached_property
    def cross_warp(self) -> bool:
        """Reduced across the warps of a block (WARP tiles on reduced dims), kept dims on the lanes."""
        return not self.cross_thread and any(f.dim in self.reduced and f.level == Level.WARP for f in self.factors)


# Iterations of a block- or lane-strided loop that a thread issues together (``strided_loop``).
STRIDED_UNROLL = 4


def strided_loop(em: ValueEmitter, var_name: str, first: K.Expr, count: int, total: int,
                 iteration: Callable[[K.Expr], list[K.Stmt]]) -> list[K.Stmt]:
    """``for (c = first; c < total; c += count) iteration(c)``, with ``count`` threads taking
    every ``count``-th of ``total`` iterations, in rounds of ``STRIDED_UNROLL`` iterations per
    thread that every thread completes, then the rest as a plain loop. Within a round no bound is
    tested, so the loads of its iterations issue together: a thread waiting for each iteration's
    load before the next keeps one load in flight, too few to cover DRAM latency with element-wide
    loads (a row of odd length cannot be read in vectors): an SM needs about bandwidth × latency /
    SMs bytes in flight, some 18 KB on an H100, and 2048 threads loading 2 bytes each hold 4 KB.
    (``#pragma unroll`` does not do it: the unrolled copies keep their bound tests between them.)
    Each thread visits its iterations in the same order as the plain loop, so reductions add in
    the same order."""
    span = STRIDED_UNROLL * count
    rounds = total // span
    tail_var = em.fresh(var_name, em.index_type)
    tail_start = K.add(first, em.idx(rounds * span)) if rounds else first
    tail = K.For(tail_var, tail_start, em.idx(total), em.idx(count), tuple(iteration(tail_var)), "block_stride")
    if rounds == 0:
        return [tail]
    r = em.fresh("round", em.index_type)
    base = em.fresh(var_name, em.index_type)
    body: list[K.Stmt] = [K.Let(base, K.add(first, K.mul(r, em.idx(span))))]
    for u in range(STRIDED_UNROLL):
        c = em.fresh(var_name, em.index_type)
        body.append(K.Let(c, K.add(base, em.idx(u * count)) if u else base))
        body.extend(iteration(c))
    return [K.For(r, em.idx(0), em.idx(rounds), em.idx(1), tuple(body), "serial"), tail]


def decompose(em: ValueEmitter, fs: list[Factor], linear: K.Expr, ranges: dict[str, int] | None = None
              ) -> list[K.Stmt]:
    """Split a level's linear index into its factors' indices (mixed radix, first factor most
    significant), binding each to a register; ``ranges`` records each register's extent."""
    stmts: list[K.Stmt] = []
    remaining = linear
    for k in range(len(fs) - 1, -1, -1):
        f = fs[k]
        if f.extent == 1:
            f.var = em.idx(0)
            continue
        value = remaining if k == 0 else K.rem(remaining, em.idx(f.extent))
        var = em.fresh("f", em.index_type)
        stmts.append(K.Let(var, value))
        if ranges is not None:
            ranges[var.name] = f.extent
        f.var = var
        remaining = K.div(remaining, em.idx(f.extent))
    return stmts


def make_groups(schedules: Sequence[Schedule], nodes: dict[str, Node], outputs: dict[str, tuple[str, Layout]],
                order: dict[str, int]) -> list[Group]:
    groups = []
    for sched in sorted(schedules, key=lambda s: order[s.root]):
        root = nodes[sched.root]
        space = iteration_space(root)
        if len(sched.dims) != len(space):
            raise CodegenError(f"{root.name}: schedule has {len(sched.dims)} dims, its iteration space "
                               f"{list(space)} has {len(space)}")
        factors = []
        for d, (size, tiles) in enumerate(zip(space, sched.dims)):
            try:
                extents = tile_extents(size, tiles)
            except ValueError as err:
                raise CodegenError(f"{root.name}: dim {d}: {err}") from None
            factors += [Factor(d, t.level, e) for t, e in zip(tiles, extents)]
        reduced = set(reduced_dims(root)) if is_reduction(root) else set()
        groups.append(Group(sched, root, space, factors, reduced, outputs.get(root.name), sched.shared))
    return groups

