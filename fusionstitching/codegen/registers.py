"""Register composition: groups that tile a row alike share one straight-line body.

When every group of a composed kernel tiles its thread-level dims identically, with no tails
(but whole vectors with a tail of slots in the last dim, ``_vector_tail``), one CTA iteration per
thread and few THREAD elements, each thread keeps its elements in registers from one group to the
next: a row is read from memory once, values like exp are computed once (let-CSE across groups),
and the THREAD lanes of the last dim become 16-byte vector accesses. Reductions across warps
(which only write outputs) follow the register body; those tiled like it (stitched partial
column sums) take their elements from the body's registers and add only their stores and sums.
"""

from __future__ import annotations

import itertools
import math
from typing import TYPE_CHECKING, Protocol

from fusionstitching.codegen import kernel_ir as K
from fusionstitching.codegen.reductions import LoopNest, Reductions
from fusionstitching.codegen.values import (
    CodegenError,
    combine,
    reduce_identity,
    reduction_kind,
    register_type,
    rounded,
    shared_value,
)
from fusionstitching.codegen.vectorize import affine, pack_lanes
from fusionstitching.schedule.template import WARP_SIZE as WARP
from fusionstitching.schedule.template import Level

if TYPE_CHECKING:
    from collections.abc import Sequence

    from fusionstitching.codegen.groups import Factor, Group
    from fusionstitching.codegen.values import ValueEmitter



class RegisterNest(LoopNest, Protocol):
    """What register composition asks of the kernel's loop nest (``compose.Composer``) beyond a
    reduction's questions: factor registers decomposed from a linear index and shared between
    groups, and the shared-memory buffer, local index and readers of a group cached there."""

    def decompose_index(self, fs: list[Factor], linear: K.Expr) -> list[K.Stmt]: ...

    def share_factors(self, group: Group, level: Level, source: list[Factor]) -> None: ...

    def shared_buffer(self, group: Group) -> K.Buffer: ...

    def local_index(self, group: Group, index: Sequence[K.Expr]) -> K.Expr: ...

    def register_shared_reader(self, group: Group, buffer: K.Buffer) -> None: ...

    prologue: list[K.Stmt]  # before the grid loop (carried accumulators)
    epilogue: list[K.Stmt]  # after it (their stores)


class RegisterComposition:
    """Register composition of one composed kernel's ``groups`` (``can_fuse``, then ``lower``). It
    emits through ``em``, asks ``nest`` for indices, factor registers and shared buffers, and
    ``reductions`` for the reductions across threads and warps; ``ranges`` (register → exclusive
    upper bound) gains the symbolic registers of a probe lowering (``probe``)."""

    def __init__(self, em: ValueEmitter, groups: list[Group], nest: RegisterNest, reductions: Reductions,
                 ranges: dict[str, int], threads: int, warp_mode: bool, probe: bool, vectorize: bool) -> None:
        self.em, self.groups, self.nest, self.reductions, self.ranges = em, groups, nest, reductions, ranges
        self.threads, self.warp_mode, self.probe, self.vectorize = threads, warp_mode, probe, vectorize

    def _local(self, group: Group) -> list[tuple[int, Level, int]]:
        return [(f.dim, f.level, f.extent) for f in group.factors if f.level in (Level.CTA, Level.THREAD)]

    def can_fuse(self) -> bool:
        """Whether every group tiles its thread-level dims identically, with no tails, one CTA
        iteration per thread and few THREAD elements: then each thread keeps its elements in
        registers from one group to the next (a row is read from memory once)."""
        groups = self._register_groups()
        if not groups:
            return False
        first = self._local(groups[0])
        count = WARP if self.warp_mode else self.threads
        if self._row_value(groups[0]):
            return False
        for g in groups:
            if self._local(g) != first:
                return False
            if self._row_value(g):
                continue
            for d, size in enumerate(g.space):
                if math.prod(f.extent for f in g.factors if f.dim == d) != size and self._vector_tail(g, d) is None:
                    return False
        cta = math.prod(e for _, level, e in first if level == Level.CTA)
        serial = math.prod(e for _, level, e in first if level == Level.THREAD)
        return cta == count and serial <= 64

    @staticmethod
    def _vector_tail(group: Group, d: int) -> int | None:
        """The vectors in dim ``d`` when it is the last dim, its tiles end in a THREAD vector whose
        width divides it and they cover it with a tail (a row of 1000 f32 as ``THREAD_8-CTA_32-
        THREAD_4``: 250 vectors in 256 slots). The slots past the end read the last vector again
        (the index is clamped, so every load stays in bounds and vectors stay whole) and are masked
        out of reductions and stores."""
        fs = [f for f in group.factors if f.dim == d]
        if d != len(group.space) - 1 or not fs or fs[-1].level != Level.THREAD or fs[-1].extent < 2:
            return None
        size, width = group.space[d], fs[-1].extent
        if size % width or math.prod(f.extent for f in fs) < size:
            return None
        return size // width

    def _register_index(self, group: Group) -> tuple[list[K.Expr], K.Expr | None]:
        """``nest.index`` for a register body (only dims the tiles cover exactly, or with a vector tail:
        ``can_fuse``): a tail dim has its vector slot clamped to the last vector, and the guard
        says whether the slot is real."""
        em = self.em
        tails = {d: self._vector_tail(group, d) for d, size in enumerate(group.space)
                 if math.prod(f.extent for f in group.factors if f.dim == d) != size}
        index, _ = self.nest.index(group, [d for d in range(len(group.space)) if d not in tails])
        guard = None
        for d, vectors in tails.items():
            fs = [f for f in group.factors if f.dim == d]
            slot: K.Expr = em.idx(0)
            for f in fs[:-1]:
                slot = K.add(K.mul(slot, em.idx(f.extent)), f.var)
            form = affine(slot, em.definitions, em.affine_forms)
            high = None if form is None else form[1] + sum(
                c * (self.ranges[n] - 1) if n in self.ranges else math.inf for n, c in form[0].items())
            if high is None or high >= vectors:  # some slot of this copy may be past the end
                slot = em.let("i", slot)
                guard = K.land(guard, K.lt(slot, em.idx(vectors)))
                slot = em.let("i", K.Binary("min", slot, em.idx(vectors - 1), em.index_type))
            index[d] = em.let("i", K.add(K.mul(slot, em.idx(fs[-1].extent)), fs[-1].var))
        return index, guard

    @staticmethod
    def _row_value(group: Group) -> bool:
        """An output with one element per row (a LayerNorm's saved mean or rstd, [rows, 1]): tiled
        like the rows, it has tails on its last dim; the lane holding element 0 stores it."""
        return (not group.reduced and not group.shared and group.output is not None and len(group.space) > 1
                and group.space[-1] == 1)

    def _register_groups(self) -> list[Group]:
        """The groups register composition covers; reductions across warps follow them (they only
        write the kernel's outputs, so nothing in the register body waits for them)."""
        return [g for g in self.groups if not g.cross_warp and not g.carried]

    def combos(self, extents: list[int]) -> list[tuple[K.Expr, ...]]:
        """The values of a thread's THREAD factors, one tuple per register copy of the body: every
        combination of constants; when probing (``feasible``), one tuple of registers ranging over
        the extents, so the body is lowered once and its reads are checked for all copies at once
        (an affine index within bounds over the ranges, or equal as a form, holds for every constant
        in them)."""
        em = self.em
        if not self.probe:
            return [tuple(em.idx(v) for v in combo) for combo in itertools.product(*[range(e) for e in extents])]
        symbolic = []
        for extent in extents:
            if extent == 1:
                symbolic.append(em.idx(0))
                continue
            var = em.fresh("t", em.index_type)
            self.ranges[var.name] = extent
            symbolic.append(var)
        return [tuple(symbolic)]

    def lower(self) -> list[K.Stmt]:
        em = self.em
        groups = self._register_groups()
        lead = groups[0]
        c_var = em.fresh("cta", em.index_type)
        em.stmts = [K.Let(c_var, self.nest.special("lane" if self.warp_mode else "tid"))]
        em.stmts += self.nest.decompose_index([f for f in lead.factors if f.level == Level.CTA], c_var)
        for g in groups[1:]:
            self.nest.share_factors(g, Level.CTA, [f for f in lead.factors if f.level == Level.CTA])
        serial = [(f.dim, f.extent) for f in lead.factors if f.level == Level.THREAD]
        combos = self.combos([e for _, e in serial])
        for group in groups:
            em.current = group.root.name
            em.stmts.append(K.Comment(f"group {group.root.name}: {group.sched} (registers)"))
            thread_factors = [f for f in group.factors if f.level == Level.THREAD]
            if group.cross_thread:
                root = group.root
                kind, rtype = reduction_kind(root), register_type(root.dtype)
                kept_thread = [f for f in thread_factors if f.dim not in group.reduced]
                accs: dict[tuple, K.Var] = {}  # one accumulator per kept element this thread holds
                for combo in combos:
                    for f, value in zip(thread_factors, combo):
                        f.var = value
                    key = tuple(f.var for f in kept_thread)
                    if key not in accs:
                        accs[key] = em.accumulator("acc", rtype)
                        em.stmts.append(K.Let(accs[key], reduce_identity(kind, root.dtype)))
                    index, guard = self._register_index(group)
                    if guard is None:
                        value = em.term(root, index)
                        em.stmts.append(K.Assign(accs[key], combine(kind, accs[key], value, rtype)))
                    else:  # a tail: the element (and its loads) only where it exists
                        inner, value = em.nested(lambda root=root, index=index: em.term(root, index))
                        em.stmts.append(K.If(guard, tuple(inner) + (
                            K.Assign(accs[key], combine(kind, accs[key], value, rtype)),)))
                for key, acc in accs.items():
                    for f, value in zip(kept_thread, key):
                        f.var = value
                    em.stmts.extend(self.reductions.finish_reduction(group, acc))
                continue
            if self._row_value(group):
                rows = [f for f in thread_factors if group.space[f.dim] > 1]  # e.g. two rows per warp
                if self.probe:  # the rows' registers of the body above, so that reads of it match
                    row_combos = [tuple(v for f, v in zip(thread_factors, combos[0]) if group.space[f.dim] > 1)]
                else:
                    row_combos = self.combos([f.extent for f in rows])
                for combo in row_combos:
                    for f in thread_factors:
                        f.var = em.idx(0)
                    for f, value in zip(rows, combo):
                        f.var = value
                    index, guard = self.nest.index(group)
                    name, layout = group.output

                    def store(group=group, index=index, name=name, layout=layout) -> K.Stmt:
                        value = em.value(group.root, tuple(index))
                        return K.Store(name, em.linear(index, layout.strides), em.stored(value, group.root.dtype))

                    if guard is None:
                        em.stmts.append(store())
                    else:  # a tail: the element's loads only where it exists
                        inner, stmt = em.nested(store)
                        em.stmts.append(K.If(guard, tuple(inner) + (stmt,)))
                continue
            buffer = self.nest.shared_buffer(group) if group.shared else None
            kept = [d for d in range(len(group.space)) if d not in group.reduced]
            done: set[tuple] = set()
            for combo in combos:
                for f, value in zip(thread_factors, combo):
                    f.var = value
                if group.reduced:  # a reduction within the thread: once per kept element it holds
                    key = tuple(repr(v) for f, v in zip(thread_factors, combo) if f.dim not in group.reduced)
                    if key in done:
                        continue
                    done.add(key)
                index, guard = self._register_index(group)
                if group.reduced:  # its index is the output's: the kept dims of the iteration space
                    value, out_index = self.reductions.serial_reduction(group, index), [index[d] for d in kept]
                else:
                    value, out_index = em.value(group.root, tuple(index)), index
                stores = []
                if group.output is not None:
                    name, layout = group.output
                    stores.append(K.Store(name, em.linear(out_index, layout.strides),
                                          em.stored(value, group.root.dtype)))
                if buffer is not None:
                    stores.append(K.Store(buffer.name, self.nest.local_index(group, index), shared_value(value)))
                em.stmts.extend([K.If(guard, tuple(stores))] if guard is not None and stores else stores)
            if buffer is not None:
                em.stmts.append(K.Barrier())
                self.nest.register_shared_reader(group, buffer)
        partials = {id(g): self._register_partials(g, lead, combos) for g in self.groups
                    if g.cross_warp and self._tiles_like(g, lead)}
        for group in self.groups:
            if group.carried:
                self._carry(group, lead, combos)
        lanes = serial[-1][1] if serial and serial[-1][0] == len(lead.space) - 1 else 1
        stmts = em.stmts
        if lanes > 1 and self.vectorize:
            stmts = pack_lanes(stmts, em.definitions, lanes)
        for group in self.groups:
            if group.cross_warp:
                em.stmts = []
                em.current = group.root.name
                stmts = stmts + [K.Comment(f"group {group.root.name}: {group.sched}")]
                if id(group) in partials:
                    stmts += self._store_partials(group, partials[id(group)])
                else:
                    stmts += self.reductions.cross_warp(group)
        return stmts

    def _tiles_like(self, group: Group, lead: Group) -> bool:
        """Whether a reduction across warps tiles its thread-level dims like the register body
        (the same CTA and THREAD extents in the same order, all on kept dims that they cover
        exactly): then each thread's elements of it are elements of the body's copies."""
        local = [f for f in group.factors if f.level in (Level.CTA, Level.THREAD)]
        if any(f.dim in group.reduced for f in local):
            return False
        if [(f.level, f.extent) for f in local] != [(level, e) for _, level, e in self._local(lead)]:
            return False
        return all(math.prod(f.extent for f in group.factors if f.dim == d) == size
                   for d, size in enumerate(group.space) if d not in group.reduced)

    def _register_partials(self, group: Group, lead: Group, combos) -> list[tuple[K.Expr, K.Expr]]:
        """A reduction across warps computed in the register body: per register copy, the
        element this warp folds in (its only one: no THREAD tiles on reduced dims) and its slot in
        the block's footprint. A stitched partial column sum reads the rows the body holds (the same
        index registers, through ``_op_reshape``), so it reuses their loads and values: LayerNorm
        backward's dβ partial adds dy, which the body loaded for dx; in a loop of its own it
        loaded every element again, two bytes at a time."""
        em = self.em
        root = group.root
        em.current = root.name
        self.nest.share_factors(group, Level.CTA, [f for f in lead.factors if f.level == Level.CTA])
        thread_factors = [f for f in group.factors if f.level == Level.THREAD]
        values = []
        for combo in combos:
            for f, value in zip(thread_factors, combo):
                f.var = value
            index, _ = self.nest.index(group)
            value = em.term(root, index)
            if root.dtype.widened:  # rounded as a fold of one element is
                value = em.let("v", rounded(value, root.dtype))
            values.append((self.reductions.slot(group, index), value))
        return values

    def _carry(self, group: Group, lead: Group, combos) -> None:
        """A reduction carried by the grid loop (``template.grid_carried``: a partial column sum over
        the rows a block visits, beside row reductions of a block per row): per register copy, an
        accumulator set before the grid loop (``nest.prologue``), the element of this iteration
        added in the register body (the body's own loads and values, as for ``_register_partials``),
        and a store after the loop (``nest.epilogue``) at the block's kept GRID index."""
        em = self.em
        root = group.root
        if not self._tiles_like(group, lead):
            raise CodegenError(f"{root.name}: a reduction carried by the grid loop must tile its kept dims "
                               f"like the register body ({lead.sched})")
        em.current = root.name
        self.nest.share_factors(group, Level.CTA, [f for f in lead.factors if f.level == Level.CTA])
        thread_factors = [f for f in group.factors if f.level == Level.THREAD]
        kind, rtype = reduction_kind(root), register_type(root.dtype)
        em.stmts.append(K.Comment(f"group {root.name}: {group.sched} (carried by the grid loop)"))
        accs = []
        for combo in combos:
            for f, value in zip(thread_factors, combo):
                f.var = value
            index, guard = self.nest.index(group)
            if guard is not None:
                raise CodegenError(f"{root.name}: a reduction carried by the grid loop cannot have tails")
            value = em.term(root, index)
            acc = em.accumulator("acc", rtype)
            self.nest.prologue.append(K.Let(acc, reduce_identity(kind, root.dtype)))
            em.stmts.append(K.Assign(acc, combine(kind, acc, value, rtype)))
            accs.append(acc)

        def stores() -> None:
            cta = em.fresh("cta", em.index_type)
            em.stmts.append(K.Let(cta, self.nest.special("tid")))
            em.stmts.extend(self.nest.decompose_index([f for f in group.factors if f.level == Level.CTA], cta))
            block = em.fresh("blk", em.index_type)
            em.stmts.append(K.Let(block, self.nest.special("bid")))
            kept_grid = [f for f in group.factors if f.level == Level.GRID and f.dim not in group.reduced]
            em.stmts.extend(self.nest.decompose_index(kept_grid, block))
            for f in group.factors:
                if f.level == Level.GRID and f.dim in group.reduced:
                    f.var = em.idx(0)
            kept = [d for d in range(len(group.space)) if d not in group.reduced]
            name, layout = group.output
            for combo, acc in zip(combos, accs):
                for f, value in zip(thread_factors, combo):
                    f.var = value
                index, _ = self.nest.index(group)
                em.stmts.append(K.Store(name, em.linear([index[d] for d in kept], layout.strides),
                                        K.Cast(acc, root.dtype.value) if root.dtype.widened else acc))

        epilogue, _ = em.nested(stores)
        lanes = thread_factors[-1].extent if thread_factors and thread_factors[-1].dim == len(group.space) - 1 else 1
        if lanes > 1 and self.vectorize:
            epilogue = pack_lanes(epilogue, em.definitions, lanes)
        self.nest.epilogue.extend(epilogue)

    def _store_partials(self, group: Group, values: list[tuple[K.Expr, K.Expr]]) -> list[K.Stmt]:
        em = self.em
        buffer, count, warp_index = self.reductions.cross_warp_slots(group)
        stmts: list[K.Stmt] = [K.Store(buffer.name, self.reductions.skewed(K.add(K.mul(warp_index, em.idx(count)), slot)), value)
                               for slot, value in values]
        return stmts + self.reductions.sum_cross_warp(group, buffer, count)

