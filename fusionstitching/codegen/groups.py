"""The groups of a composed kernel: one per root of its template, with the root's iteration space
split into tile factors (``Factor``: a dim's tile at one level and its extent, bound to an index
register while lowering), its reduced dims, where it is stored and whether it is cached in shared
memory (``S``)."""

from __future__ import annotations

import functools
from collections.abc import Sequence
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
    def cross_warp(self) -> bool:
        """Reduced across the warps of a block (WARP tiles on reduced dims), kept dims on the lanes."""
        return not self.cross_thread and any(f.dim in self.reduced and f.level == Level.WARP for f in self.factors)


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
