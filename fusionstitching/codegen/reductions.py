"""Reductions inside composed kernels: per thread, across the lanes of a warp, across a block's warps.

- thread-serial: every reduced dim is THREAD tiled; each thread loops over them;
- across threads (CTA tiles on reduced dims): a register per thread, ``__shfl_xor_sync``
  butterflies over the warp, and in block mode the warps' results through a small shared array,
  a barrier and one more butterfly, so that every thread holds the result (warp / block
  composition);
- across warps (WARP tiles on reduced dims, kept dims on the lanes): each warp writes its slice
  for every kept element to shared memory and, after a barrier, the block's threads sum the slices
  (per-block partial column sums, e.g. LayerNorm backward's dgamma and dbeta). The slots skip a
  cell after every 32 (``skewed``), so lanes holding vectors of adjacent slots hit distinct banks.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Protocol

from fusionstitching.codegen import kernel_ir as K
from fusionstitching.codegen.values import (
    CodegenError,
    InRegisters,
    combine,
    reduce_identity,
    reduction_kind,
    register_type,
    rounded,
)
from fusionstitching.schedule.template import WARP_SIZE as WARP
from fusionstitching.schedule.template import Level

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence

    from fusionstitching.codegen.groups import Factor, Group
    from fusionstitching.codegen.values import ValueEmitter
    from fusionstitching.graph.graph import Node



class LoopNest(Protocol):
    """What a reduction asks of the kernel's loop nest (``compose.Composer``): a group's index
    expressions and tail guard, its THREAD loops and serial loops, the footprint of a block, and
    the CUDA special registers in the kernel's index type."""

    def index(self, group: Group, dims: Sequence[int] | None = None) -> tuple[list[K.Expr], K.Expr | None]: ...

    def thread_loops(self, group: Group, body: Callable[[], None],
                     skip_dims: frozenset[int] = frozenset()) -> list[K.Stmt]: ...

    def serial(self, fs: list[Factor], body: Callable[[], None]) -> list[K.Stmt]: ...

    def footprint(self, group: Group) -> list[tuple[list[Factor], list[Factor]]]: ...

    def special(self, name: str) -> K.Expr: ...


class Reductions:
    """The reductions of one composed kernel. It emits through ``em``, asks ``nest`` for indices and
    loops, and adds the shared arrays it needs (warp results, cross-warp slots) to ``shared``, the
    kernel's list of shared buffers."""

    def __init__(self, em: ValueEmitter, nest: LoopNest, shared: list[K.Buffer], threads: int, warp_mode: bool,
                 guard_tails: bool) -> None:
        self.em, self.nest, self.shared = em, nest, shared
        self.threads, self.warp_mode, self.guard_tails = threads, warp_mode, guard_tails

    def serial_reduction(self, group: Group, index: list[K.Expr]) -> K.Expr:
        """A reduction whose reduced dims are all THREAD tiled: each thread loops over them."""
        em = self.em
        root = group.root
        kind, rtype = reduction_kind(root), register_type(root.dtype)
        acc = em.accumulator("acc", rtype)
        em.stmts.append(K.Let(acc, reduce_identity(kind, root.dtype)))
        reduced = [f for f in group.factors if f.dim in group.reduced and f.level == Level.THREAD]

        def body() -> None:
            inner, guard = self.nest.index(group, sorted(group.reduced))
            point = [inner[d] if d in group.reduced else index[d] for d in range(len(group.space))]
            stmts, value = em.nested(lambda: em.term(root, point))
            update = tuple(stmts) + (K.Assign(acc, combine(kind, acc, value, rtype)),)
            em.stmts.extend([K.If(guard, update)] if guard is not None else update)

        em.stmts.extend(self.nest.serial(reduced, body))
        if root.dtype.widened:
            return em.let("v", rounded(acc, root.dtype))
        return acc

    def cross_warp(self, group: Group, tile: tuple[K.Buffer, Sequence[int]] | None = None) -> list[K.Stmt]:
        """Each warp folds its slice of the reduced dims for every kept element its lanes hold and
        writes it to shared memory; after a barrier the block's threads sum the warps' slices.
        With ``tile`` (a shared buffer and its strides per kept dim), the sums are also kept there
        for the kernel's later groups, which read them after the closing barrier."""
        em = self.em
        buffer, count, warp_index = self.cross_warp_slots(group)
        kept = [d for d in range(len(group.space)) if d not in group.reduced]

        def body() -> None:
            index, guard = self.nest.index(group, kept)

            def compute() -> None:
                value = self.serial_reduction(group, index)
                slot = K.add(K.mul(warp_index, em.idx(count)), self.slot(group, index))
                em.stmts.append(K.Store(buffer.name, self.skewed(slot), value))

            stmts, _ = em.nested(compute)
            em.stmts.extend([K.If(guard, tuple(stmts))] if guard is not None else stmts)

        stmts = self.nest.thread_loops(group, body, frozenset(group.reduced))
        return stmts + self.sum_cross_warp(group, buffer, count, tile)

    def cross_warp_slots(self, group: Group) -> tuple[K.Buffer, int, K.Expr]:
        """The shared buffer of a reduction across warps, the slots of one warp (the kept elements
        of the block) and this warp's index among the WARP tiles."""
        em = self.em
        root = group.root
        warps = [f for f in group.factors if f.level == Level.WARP]
        if not self.warp_mode or math.prod(f.extent for f in warps) != self.threads // WARP:
            raise CodegenError(f"{root.name}: a reduction across warps needs one WARP tile per warp of the block")
        if any(f.dim not in group.reduced for f in warps):
            raise CodegenError(f"{root.name}: a reduction across warps keeps its WARP tiles on reduced dims only")
        if group.output is None:
            raise CodegenError(f"{root.name}: a reduction across warps must be an output of the kernel; "
                               "other groups cannot read it")
        count = math.prod(math.prod(f.extent for f in local) for _, local in self.nest.footprint(group))
        slots = (self.threads // WARP) * count
        buffer = self._cross_warp_buffer(slots + slots // WARP, register_type(root.dtype))
        warp_index: K.Expr = em.idx(0)
        for f in warps:
            warp_index = K.add(K.mul(warp_index, em.idx(f.extent)), f.var)
        return buffer, count, warp_index

    def slot(self, group: Group, index: Sequence[K.Expr]) -> K.Expr:
        """The kept element's slot among a warp's ``count`` slots: row-major over the local extents
        of the kept dims, unpadded, as ``_sum_slots`` reads them back (the padded layout of a
        shared tile, ``Composer.local_index``, would reach past them)."""
        em = self.em
        linear: K.Expr = em.idx(0)
        kept = [i for d, i in enumerate(index) if d not in group.reduced]
        for (_, local), _i in zip(self.nest.footprint(group), kept):
            for f in local:
                linear = K.add(K.mul(linear, em.idx(f.extent)), f.var)
        return linear

    def skewed(self, slot: K.Expr) -> K.Expr:
        """A slot of the cross-warp buffer with one cell skipped after every 32: lanes that write
        slots 8 apart (a THREAD_8 vector each, LayerNorm backward's partials) hit 32 banks instead
        of 4, and consecutive slots stay in distinct banks for the readers."""
        return K.add(slot, K.Binary("shr", slot, self.em.idx(WARP.bit_length() - 1), slot.dtype))  # slot / 32, slots >= 0

    def sum_cross_warp(self, group: Group, buffer: K.Buffer, count: int,
                       tile: tuple[K.Buffer, Sequence[int]] | None = None) -> list[K.Stmt]:
        footprint = self.nest.footprint(group)
        local_extents = [math.prod(f.extent for f in local) for _, local in footprint]
        stmts: list[K.Stmt] = [K.Barrier()]
        stmts += self._sum_slots(group, buffer, self.threads // WARP, count, footprint, local_extents, tile)
        return stmts + [K.Barrier()]

    def _sum_slots(self, group, buffer, slots, count, footprint, local_extents, tile=None) -> list[K.Stmt]:
        em = self.em
        root = group.root
        kind, rtype = reduction_kind(root), register_type(root.dtype)
        j = em.fresh("j", em.index_type)
        v = em.fresh("w", em.index_type)
        acc = em.accumulator("acc", rtype)
        fold = K.For(v, em.idx(0), em.idx(slots), em.idx(1), (K.Assign(acc, combine(
            kind, acc, K.Load(buffer.name, self.skewed(K.add(K.mul(v, em.idx(count)), j)), rtype), rtype)),),
            "unroll")
        body: list[K.Stmt] = [K.Let(acc, reduce_identity(kind, root.dtype)), fold]
        # j → kept index: per kept dim, the grid part of this block plus the local offset.
        remaining: K.Expr = j
        offsets = []
        for k in range(len(local_extents) - 1, -1, -1):
            extent = local_extents[k]
            offsets.append(remaining if k == 0 else K.rem(remaining, em.idx(extent)))
            remaining = K.div(remaining, em.idx(extent))
        offsets.reverse()
        index, guard = [], None
        kept_dims = [d for d in range(len(group.space)) if d not in group.reduced]
        for d, (grid, _), extent, offset in zip(kept_dims, footprint, local_extents, offsets):
            base: K.Expr = em.idx(0)
            for f in grid:
                base = K.add(K.mul(base, em.idx(f.extent)), f.var)
            i = em.fresh("i", em.index_type)
            body.append(K.Let(i, K.add(K.mul(base, em.idx(extent)), offset)))
            index.append(i)
            if math.prod(f.extent for f in group.factors if f.dim == d) > group.space[d]:
                guard = K.land(guard, K.lt(i, em.idx(group.space[d])))
        value: K.Expr = acc
        if root.dtype.widened:
            value = K.Cast(acc, root.dtype.value)
        name, layout = group.output
        store = K.Store(name, em.linear(index, layout.strides), value)
        body.append(K.If(guard, (store,)) if guard is not None else store)
        if tile is not None:  # every slot, tails too: readers past the tail are guarded themselves
            cells, strides = tile
            at: K.Expr = em.idx(0)
            for offset, stride in zip(offsets, strides):
                at = K.add(at, K.mul(offset, em.idx(stride)))
            body.append(K.Store(cells.name, at, acc))
        return [K.For(j, self.nest.special("tid"), em.idx(count), self.nest.special("ntid"), tuple(body), "block_stride")]

    def _cross_warp_buffer(self, size: int, rtype: str) -> K.Buffer:
        name = f"xw_{rtype}"
        for b in self.shared:
            if b.name == name:
                if b.extent < size:
                    index = self.shared.index(b)
                    self.shared[index] = K.Buffer(name, rtype, size, space="shared")
                    return self.shared[index]
                return b
        buffer = K.Buffer(name, rtype, size, space="shared")
        self.shared.append(buffer)
        self.em.shared_buffers.add(name)
        return buffer

    def cross_thread(self, group: Group) -> list[K.Stmt]:
        em = self.em
        root = group.root
        for f in group.factors:
            if f.dim not in group.reduced and f.level == Level.THREAD and f.extent > 1:
                raise CodegenError(f"{root.name}: kept dim {f.dim} is THREAD tiled, which needs register "
                                   "composition (identical thread tiling in all groups, no tails)")
        kind = reduction_kind(root)
        rtype = register_type(root.dtype)
        acc = em.accumulator("acc", rtype)
        stmts: list[K.Stmt] = [K.Let(acc, reduce_identity(kind, root.dtype))]

        def body() -> None:
            index, guard = self.nest.index(group)
            inner, value = em.nested(lambda: em.term(root, index))
            update = tuple(inner) + (K.Assign(acc, combine(kind, acc, value, rtype)),)
            em.stmts.extend([K.If(guard, update)] if guard is not None else update)

        stmts += self.nest.thread_loops(group, body)
        return stmts + self.finish_reduction(group, acc)

    def finish_reduction(self, group: Group, acc: K.Var) -> list[K.Stmt]:
        """Combine the threads' partial results; every thread (lane) ends with the result."""
        em = self.em
        root = group.root
        kind = reduction_kind(root)
        rtype = register_type(root.dtype)
        stmts = self._butterfly(acc, kind, rtype)
        if not self.warp_mode and self.threads > WARP:
            stmts += self._across_warps(acc, kind, root)
        across = self.warp_mode and self._reduced_across_warps(group)
        if across:
            stmts += self._across_warps(acc, kind, root)
        result = acc
        if root.dtype.widened:
            result = em.fresh("r", register_type(root.dtype))
            stmts.append(K.Let(result, rounded(acc, root.dtype)))
        kept = [d for d in range(len(group.space)) if d not in group.reduced]
        kept_index = [self._kept_index(group, d) for d in kept]
        if group.output is not None:
            name, layout = group.output
            value = K.Cast(acc, root.dtype.value) if root.dtype.widened else result  # rounded once
            storer = "lane" if self.warp_mode and not across else "tid"
            first: K.Expr = K.Binary("eq", self.nest.special(storer), em.idx(0), "bool")
            for d, i in zip(kept, kept_index):
                covered = math.prod(f.extent for f in group.factors if f.dim == d)
                if covered > group.space[d] and self.guard_tails:
                    first = K.land(first, K.lt(i, em.idx(group.space[d])))
            stmts.append(K.If(first, (K.Store(name, em.linear(kept_index, layout.strides), value),)))
        previous = em.sub_roots.get(id(root))
        earlier = previous.values if isinstance(previous, InRegisters) else ()
        em.sub_roots[id(root)] = InRegisters(root, (*earlier, (kept_index, result)))
        return stmts

    def _reduced_across_warps(self, group: Group) -> bool:
        """In warp mode, whether ``group`` reduces over a WARP-tiled dim (a sum to a scalar beside
        row reductions, whose rows are the warps): each warp then holds a partial result, and the
        warps' partials are combined through shared memory. That needs a block barrier inside the
        warp loop, so every warp must run exactly one iteration of it (the WARP tiles cover the
        block's warps) and no WARP tile may sit on a kept dim (warps of other kept elements would
        be folded in)."""
        warps = [f for f in group.factors if f.level == Level.WARP and f.extent > 1]
        if not any(f.dim in group.reduced for f in warps):
            return False
        if any(f.dim not in group.reduced for f in warps):
            raise CodegenError(f"{group.root.name}: a reduction over WARP tiles keeps other WARP tiles on kept dims")
        if math.prod(f.extent for f in warps) != self.threads // WARP:
            raise CodegenError(f"{group.root.name}: a reduction over WARP tiles needs one tile per warp of the block "
                               f"({self.threads // WARP} warps)")
        return True

    def _kept_index(self, group: Group, d: int) -> K.Expr:
        expr: K.Expr = self.em.idx(0)
        for f in group.factors:
            if f.dim == d:
                expr = K.add(K.mul(expr, self.em.idx(f.extent)), f.var)
        return expr

    def _butterfly(self, acc: K.Var, kind: str, rtype: str) -> list[K.Stmt]:
        stmts = []
        offset = WARP // 2
        while offset:
            # The shuffle gets a statement of its own: inside the combine, a bool reduction's
            # ``acc || shfl(...)`` would skip the shuffle in lanes whose acc is already true, and a
            # full-mask shuffle that some lanes skip returns undefined values to the others.
            partner = self.em.fresh("s", rtype)
            stmts.append(K.Let(partner, K.Shuffle("xor", acc, K.Const(offset, "i32"), WARP, rtype)))
            stmts.append(K.Assign(acc, combine(kind, acc, partner, rtype)))
            offset //= 2
        return stmts

    def _across_warps(self, acc: K.Var, kind: str, root: Node) -> list[K.Stmt]:
        em = self.em
        rtype = register_type(root.dtype)
        warps = self.threads // WARP
        buffer = self._reduction_buffer(rtype)
        lane = self.nest.special("lane")
        stmts: list[K.Stmt] = [
            K.If(K.Binary("eq", lane, em.idx(0), "bool"), (K.Store(buffer.name, self.nest.special("warp"), acc),)),
            K.Barrier(),
            K.Assign(acc, K.Select(K.lt(lane, em.idx(warps)), K.Load(buffer.name, lane, rtype),
                                   reduce_identity(reduction_kind(root), root.dtype), rtype)),
        ]
        stmts += self._butterfly(acc, kind, rtype)
        stmts.append(K.Barrier())  # the buffer is free again for the next reduction
        return stmts

    def _reduction_buffer(self, rtype: str) -> K.Buffer:
        name = f"red_{rtype}"
        for b in self.shared:
            if b.name == name:
                return b
        buffer = K.Buffer(name, rtype, WARP, space="shared")
        self.shared.append(buffer)
        self.em.shared_buffers.add(name)
        return buffer
