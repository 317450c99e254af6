"""Warp and block composition: kernels whose groups pass results through shuffles and shared memory.

A composed kernel runs its groups one after the other inside one loop over the GRID space (and,
in warp mode, one loop over the WARP space), so every group of a block works on the same block
index [A §4, C §4.1]. For that, all schedules must tile the grid identically: the same GRID
factor extents in the same order (and the same WARP extents); the grid index is decomposed once
and every group uses the same factor registers. Groups follow the topological order of their
roots; a group whose result other groups read is a sub-root:

- a reduction whose reduced dims are CTA-tiled is reduced across threads: each thread folds its
  elements into a register, then ``__shfl_xor_sync`` butterflies combine the lanes of a warp
  (warp composition; every lane ends with the result), and in block mode the warps' results go
  through a small shared array, a barrier, and one more butterfly, so every thread of the block
  holds the result (block composition). Consumers read that register;
- a group marked ``S`` stores its block footprint in shared memory, a barrier follows, and
  consumers read the cell of the element they need (a tiled transpose is this with a transposed
  consumer);
- an output whose reduced dims are GRID-tiled only, where those tiles are the iterations of each
  block's grid-stride loop (``template.grid_carried``), is summed in registers across the loop: set
  before it, added to in the register body, stored after it (``registers._carry``; a norm's weight
  gradient beside the rows of a block each).

[Note: shared-memory tiles and the tiled transpose]
An ``S`` group's buffer holds its block footprint row-major over the kept dims (``_tile_layout``).
When the innermost row spans whole bank rows (a multiple of 32 cells) and there are several rows,
each row is padded by one cell (a 32 x 32 tile is stored 32 x 33): a consumer reading a column
(consecutive lanes, consecutive rows) then hits 32 different banks instead of one. The classic
shared-memory transpose is ``schedule/transpose.py: transpose_smem_template``: in warp mode, the
transpose group puts the lanes on the dim that is innermost in the transposed input (coalesced
reads) and the warps on the other, the consumer the other way round (coalesced writes). ``S``
groups are allowed in warp mode only when the WARP space is exactly the block's warps, so the
warp loop is one iteration that every thread takes and the barrier after the group is reached by
the whole block. When blocks loop over the grid (fewer blocks than tiles), a barrier ends each
iteration, so the next tile is not written while other threads still read the last one.

Block locality (DESIGN.md) is checked on every such read: the index a consumer asks for must,
for each GRID-split dim, be the producer's own grid part for this block (compared as affine forms
of the shared factor registers), and the rest must stay inside the producer's footprint (an
interval bound over the factor ranges). A read that cannot be proved local is an error naming
both nodes, so whatever lowers is correct by construction.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from fusionstitching.codegen import kernel_ir as K
from fusionstitching.codegen.groups import Factor, Group, decompose, strided_loop
from fusionstitching.codegen.reductions import Reductions
from fusionstitching.codegen.registers import RegisterComposition
from fusionstitching.codegen.values import (
    CodegenError,
    DataDependentRead,
    FootprintError,
    InRegisters,
    InShared,
    ValueEmitter,
    register_type,
    shared_value,
)
from fusionstitching.codegen.vectorize import affine, pack_lanes
from fusionstitching.schedule.template import WARP_SIZE as WARP
from fusionstitching.schedule.template import Level, grid_carried

# THREAD extents of an innermost serial tile written out point by point for the vectorizer (a
# 16-byte access holds 8 halves; larger tiles stay loops)
VECTOR_LANES = (2, 4, 8)


@dataclass
class ComposedKernel:
    body: list[K.Stmt]
    shared: list[K.Buffer] = field(default_factory=list)
    smem_plan: object = None


def _level_extents(group: Group, level: Level) -> list[int]:
    """The extents of a group's tiles at ``level``, but those of 1 (a [1, 128, 768] epilogue of a
    [128, 768] column sum shares its grid)."""
    return [f.extent for f in group.factors if f.level == level and f.extent > 1]


class Composer:
    """The loop nest of one composed kernel: the grid and warp loops its groups share, each group's
    thread loops and index expressions, and the shared-memory tiles of ``S`` groups. Its reductions
    (``reductions.Reductions``) and register composition (``registers.RegisterComposition``) are
    objects of their own that it hands the emitter, the groups and itself as their loop nest."""

    def __init__(self, em: ValueEmitter, groups: list[Group], threads: int, blocks: int, guard_tails: bool,
                 vectorize: bool = True, probe: bool = False) -> None:
        self.em, self.groups, self.threads, self.blocks = em, groups, threads, blocks
        self.vectorize = vectorize
        self.probe = probe  # lower register copies once, symbolically (``RegisterComposition.combos``)
        self.guard_tails = guard_tails
        self.warp_mode = any(_level_extents(g, Level.WARP) for g in groups)
        self.ranges: dict[str, int] = {}  # register → exclusive upper bound (factor registers)
        em.factor_ranges = self.ranges  # reshapes read them too (``ValueEmitter.index_bounds``)
        self.shared: list[K.Buffer] = []
        self.placement: dict[str, K.Buffer] = {}  # S sub-root → its (possibly shared) buffer
        self._layouts: dict[int, tuple] = {}  # id(group) → (footprint, tile layout): factors never change
        # Statements before and after the grid loop: the registers of carried reductions
        # (``template.grid_carried``), set to the identity before it and stored after it.
        self.prologue: list[K.Stmt] = []
        self.epilogue: list[K.Stmt] = []
        self.reductions = Reductions(em, self, self.shared, threads, self.warp_mode, guard_tails)
        self.registers = RegisterComposition(em, groups, self, self.reductions, self.ranges, threads, self.warp_mode,
                                             probe, vectorize)
        self._check_common_tiling()

    # -- structure -------------------------------------------------------------------------------
    def _check_common_tiling(self) -> None:
        first = self.groups[0]
        for level in (Level.GRID, Level.WARP):
            want = _level_extents(first, level)
            for g in self.groups[1:]:
                if _level_extents(g, level) != want:
                    raise CodegenError(f"block locality: {g.root.name} tiles the {level.value} space as "
                                       f"{_level_extents(g, level)}, {first.root.name} as {want}; composed "
                                       "groups must share the grid")
        if self.warp_mode and self.threads % WARP:
            raise CodegenError("WARP tiles need a multiple of 32 threads")
        for g in self.groups:
            for f in g.factors:
                if g.cross_thread and f.dim not in g.reduced and f.level == Level.CTA:
                    raise CodegenError(f"{g.root.name}: a reduction across threads keeps dim {f.dim} tiled "
                                       f"{f.level.value}; its kept dims must be GRID, WARP or THREAD tiled")
                if self.warp_mode and g.shared and math.prod(_level_extents(g, Level.WARP)) != self.threads // WARP:
                    raise CodegenError(f"{g.root.name}: 'S' needs a block barrier, which warp loops cannot have "
                                       f"(in warp mode the WARP tiles must cover exactly the {self.threads // WARP} "
                                       "warps of the block)")
            if g.cross_thread and not self.warp_mode and self.threads > WARP and self.threads & (self.threads - 1):
                raise CodegenError(f"{g.root.name}: block reductions need a power-of-two thread count")
            if g.carried and (self.warp_mode or not grid_carried(g.sched, g.space, g.reduced, self.blocks)):
                raise CodegenError(f"{g.root.name}: an output reduced over GRID tiles needs them to be the "
                                   f"iterations of a block's grid loop (block mode, {self.blocks} blocks: the "
                                   "kept GRID points)")

    def lower(self) -> list[K.Stmt]:
        loop = self._level_loop(Level.GRID, self.special("bid"), self.blocks, "grid_stride", self._block_body)
        return self.prologue + loop + self.epilogue

    def _block_body(self) -> list[K.Stmt]:
        stmts = self._warp_level()
        tiles = math.prod(_level_extents(self.groups[0], Level.GRID))
        if self.blocks < tiles and any(g.shared for g in self.groups):
            stmts.append(K.Barrier())  # the next tile must not overwrite cells others still read
        return stmts

    def _warp_level(self) -> list[K.Stmt]:
        if not self.warp_mode:
            for group in self.groups:  # WARP tiles of extent 1 (one warp per block): index 0
                for f in group.factors:
                    if f.level == Level.WARP:
                        f.var = self.em.idx(0)
            return self._groups()
        return self._level_loop(Level.WARP, self.special("warp"), self.threads // WARP, "warp_stride",
                                self._groups)

    def _level_loop(self, level: Level, first: K.Expr, count: int, kind: str, inner) -> list[K.Stmt]:
        """The loop over ``level``'s space shared by all groups: its index is decomposed once and
        every group uses the same factor registers. A single iteration is an ``If``."""
        em = self.em
        factors = [f for f in self.groups[0].factors if f.level == level]
        total = math.prod(f.extent for f in factors)
        var = em.fresh(level.value.lower(), em.index_type)
        decompose = self.decompose_index(factors, var)
        for group in self.groups[1:]:
            self.share_factors(group, level, factors)
        body = decompose + inner()
        if count >= total:
            return [K.Let(var, first), K.If(K.lt(var, em.idx(total)), tuple(body))]
        return [K.For(var, first, em.idx(total), em.idx(count), tuple(body), kind)]

    def share_factors(self, group: Group, level: Level, source: list[Factor]) -> None:
        mine = [f for f in group.factors if f.level == level]
        for f in mine:
            if f.extent == 1:
                f.var = self.em.idx(0)
        for f, s in zip([f for f in mine if f.extent > 1], [s for s in source if s.extent > 1]):
            f.var = s.var

    def special(self, name: str) -> K.Expr:
        s = K.Special(name)
        return K.Cast(s, self.em.index_type) if self.em.index_type != "i32" else s

    def decompose_index(self, fs: list[Factor], linear: K.Expr) -> list[K.Stmt]:
        return decompose(self.em, fs, linear, self.ranges)

    def _groups(self) -> list[K.Stmt]:
        if self.registers.can_fuse():
            return self.registers.lower()
        for group in self.groups:
            if group.carried:
                raise CodegenError(f"{group.root.name}: a reduction carried by the grid loop takes its elements "
                                   "from a register body, and these groups do not share one")
        out: list[K.Stmt] = []
        for k, group in enumerate(self.groups):
            self.em.stmts = []
            self.em.current = group.root.name
            out.append(K.Comment(f"group {group.root.name}: {group.sched}"))
            if group.cross_thread:
                out.extend(self.reductions.cross_thread(group))
            elif group.cross_warp:
                tile = self._cross_warp_tile(group) if self._read_later(k) else None
                out.extend(self.reductions.cross_warp(group, tile))
                if tile is not None:
                    self.register_shared_reader(group, tile[0])
            else:
                out.extend(self._parallel(group))
        return out

    def _read_later(self, k: int) -> bool:
        """Whether a later group of the kernel reads group ``k``'s root (through the nodes it
        computes, not through other groups' roots)."""
        root = self.groups[k].root
        roots = {id(g.root) for g in self.groups}
        for later in self.groups[k + 1:]:
            stack, seen = [later.root], set()
            while stack:
                for operand in stack.pop().operands:
                    if operand is root:
                        return True
                    if id(operand) in self.em.pattern and id(operand) not in roots and id(operand) not in seen:
                        seen.add(id(operand))
                        stack.append(operand)
        return False

    def _cross_warp_tile(self, group: Group) -> tuple[K.Buffer, list[int]]:
        """A shared tile for a cross-warp reduction's block results that later groups read (each
        thread would otherwise recompute the column sums it needs), laid out as an S sub-root's."""
        if register_type(group.root.dtype) != "f32":
            raise CodegenError(f"{group.root.name}: a reduction across warps read by other groups must be f32, "
                               f"not {group.root.dtype.value}")
        layout, size = self._tile_layout(group)
        buffer = K.Buffer(f"xr_{group.root.name}", "f32", size, space="shared")
        self.shared.append(buffer)
        self.em.shared_buffers.add(buffer.name)
        return buffer, [stride for _, stride in layout]

    # -- per-thread loops ----------------------------------------------------------------------------
    def thread_loops(self, group: Group, body, skip_dims: frozenset[int] = frozenset()) -> list[K.Stmt]:
        """The CTA (or lane) loop and the THREAD loops of ``group`` (but those of ``skip_dims``)
        around ``body()``."""
        em = self.em
        cta = [f for f in group.factors if f.level == Level.CTA]
        total = math.prod(f.extent for f in cta)
        c_var = em.fresh("cta", em.index_type)
        first, count = (self.special("lane"), WARP) if self.warp_mode else (self.special("tid"), self.threads)
        serial = [f for f in group.factors if f.level == Level.THREAD and f.dim not in skip_dims]
        if count >= total:
            inner = self.decompose_index(cta, c_var) + self.serial(serial, body)
            return [K.Let(c_var, first), K.If(K.lt(c_var, em.idx(total)), tuple(inner))]
        return strided_loop(em, "cta", first, count, total,
                            lambda var: self.decompose_index(cta, var) + self.serial(serial, body))

    def serial(self, fs: list[Factor], body) -> list[K.Stmt]:
        if not fs:
            stmts, _ = self.em.nested(body)
            return stmts
        f = fs[0]
        if f.extent == 1:
            f.var = self.em.idx(0)
            return self.serial(fs[1:], body)
        if len(fs) == 1 and self.vectorize and f.extent in VECTOR_LANES:
            # the innermost THREAD tile's points written out one after another, as the loop would
            # run them, so that the vectorizer merges their accesses (the elementwise roots and the
            # loads of a reduction's serial loop, whose accumulation keeps its order)
            stmts = []
            for lane in range(f.extent):
                f.var = self.em.idx(lane)
                stmts += self.serial([], body)
            return pack_lanes(stmts, self.em.definitions, f.extent)
        var = self.em.fresh("t", self.em.index_type)
        f.var = var
        self.ranges[var.name] = f.extent
        inner = self.serial(fs[1:], body)
        return [K.For(var, self.em.idx(0), self.em.idx(f.extent), self.em.idx(1), tuple(inner),
                      "unroll" if f.extent <= 8 else "serial")]

    def index(self, group: Group, dims: Sequence[int] | None = None) -> tuple[list[K.Expr], K.Expr | None]:
        em = self.em
        index, guard = [], None
        for d, size in enumerate(group.space):
            if dims is not None and d not in dims:
                index.append(em.idx(0))
                continue
            expr: K.Expr = em.idx(0)
            for f in group.factors:
                if f.dim == d:
                    expr = K.add(K.mul(expr, em.idx(f.extent)), f.var)
            covered = math.prod(f.extent for f in group.factors if f.dim == d)
            expr = em.let("i", expr) if not isinstance(expr, (K.Var, K.Const)) else expr
            if covered > size and self.guard_tails:
                guard = K.land(guard, K.lt(expr, em.idx(size)))
            index.append(expr)
        return index, guard

    # -- groups ----------------------------------------------------------------------------------
    def _parallel(self, group: Group) -> list[K.Stmt]:
        em = self.em
        root = group.root
        buffer = self.shared_buffer(group) if group.shared else None

        kept = [d for d in range(len(group.space)) if d not in group.reduced]

        def body() -> None:
            index, guard = self.index(group, kept)

            def compute() -> None:
                if group.reduced:
                    value = self.reductions.serial_reduction(group, index)
                    out_index = [index[d] for d in kept]
                else:
                    value, out_index = em.value(root, tuple(index)), index
                if group.output is not None:
                    name, layout = group.output
                    em.stmts.append(K.Store(name, em.linear(out_index, layout.strides), em.stored(value, root.dtype)))
                if buffer is not None:
                    em.stmts.append(K.Store(buffer.name, self.local_index(group, index), shared_value(value)))

            stmts, _ = em.nested(compute)
            if guard is not None:
                em.stmts.append(K.If(guard, tuple(stmts)))
            else:
                em.stmts.extend(stmts)

        stmts = self.thread_loops(group, body, frozenset(group.reduced))
        if buffer is not None:
            stmts.append(K.Barrier())
            self.register_shared_reader(group, buffer)
        return stmts

    # -- shared memory -------------------------------------------------------------------------------
    def plan_shared(self, graph, pattern_nodes, limit: int):
        """Place the S sub-roots with ``schedule/smem.py``: sharing by dominance and liveness, and
        recomputation (the group is dropped, its consumers recompute it) when over ``limit``."""
        from fusionstitching.schedule.smem import SmemRequest, plan_shared_memory, side_by_side

        requests, sizes = [], {}
        fusable = None
        for g in self.groups:
            if not g.shared:
                continue
            if register_type(g.root.dtype) not in ("f32", "bool"):
                raise CodegenError(f"{g.root.name}: 'S' is supported for float and bool sub-roots, "
                                   f"not {g.root.dtype.value}")
            size = self._tile_layout(g)[1]
            sizes[g.root.name] = size
            if fusable is None:
                fusable = sum(1 for n in pattern_nodes if n.category.fusable)
            cost = float(fusable + (0 if g.root.category.fusable else 1)) * size
            requests.append(SmemRequest(g.root.name, size * 4, recompute_cost=cost))
        reductions = 4 * WARP * 2 if any(g.cross_thread for g in self.groups) else 0
        # A stored reduction keeps its buffer: its readers need the block's finished result. A stored
        # sub-root of another kind that does not fit is written by its group all the same, and its
        # readers recompute it (a row of GEMM logits that is both saved and reduced over).
        must_keep = [g.root.name for g in self.groups if g.shared and g.output is not None and g.reduced]
        plan = side_by_side(requests, limit - reductions) if self.probe else None  # a plan exists
        if plan is None:
            plan = plan_shared_memory(graph, pattern_nodes, requests, limit - reductions, must_keep=must_keep)
        if not plan:
            raise CodegenError(str(plan))
        for name in plan.recomputed:
            for g in self.groups:
                if g.root.name == name and g.output is not None:
                    g.shared = False
            self.groups = [g for g in self.groups if g.root.name != name or g.output is not None]
        buffers = {b.name: K.Buffer(f"smem_{b.name}", "f32", b.bytes // 4, space="shared") for b in plan.buffers}
        self.shared.extend(buffers.values())
        self.em.shared_buffers.update(b.name for b in buffers.values())
        self.placement = {node: buffers[name] for node, name in plan.placement.items()}
        return plan

    def footprint(self, group: Group) -> list[tuple[list[Factor], list[Factor]]]:
        """Per dim: (GRID factors, the local factors below them); GRID must come first in a dim."""
        return self._layout(group)[0]

    def _tile_layout(self, group: Group) -> tuple[list[tuple[int, int]], int]:
        """Per kept dim, (local extent, stride in cells) of the group's tile, and its size in cells:
        row-major, the innermost row padded by one cell when it is a multiple of 32 cells and there
        are several rows (module note)."""
        return self._layout(group)[1]

    def _layout(self, group: Group) -> tuple:
        cached = self._layouts.get(id(group))
        if cached is None:
            footprint = self._make_footprint(group)
            cached = self._layouts[id(group)] = (footprint, self._make_tile_layout(footprint))
        return cached

    def _make_footprint(self, group: Group) -> list[tuple[list[Factor], list[Factor]]]:
        result = []
        for d in range(len(group.space)):
            if d in group.reduced:
                continue
            fs = [f for f in group.factors if f.dim == d]
            grid = [f for f in fs if f.level == Level.GRID]
            if grid and fs[: len(grid)] != grid:
                raise CodegenError(f"{group.root.name}: 'S' needs GRID tiles outermost in dim {d}")
            result.append((grid, fs[len(grid):]))
        return result

    def shared_buffer(self, group: Group) -> K.Buffer:
        return self.placement[group.root.name]

    @staticmethod
    def _make_tile_layout(footprint) -> tuple[list[tuple[int, int]], int]:
        extents = [math.prod(f.extent for f in local) for _, local in footprint]
        inner = max((k for k, e in enumerate(extents) if e > 1), default=None)
        strides = [0] * len(extents)
        size = 1
        for k in range(len(extents) - 1, -1, -1):
            strides[k] = size
            size *= extents[k]
            if k == inner and extents[k] % WARP == 0 and math.prod(extents[:k]) > 1:
                size += 1
        return list(zip(extents, strides)), size

    def local_index(self, group: Group, index: Sequence[K.Expr]) -> K.Expr:
        em = self.em
        linear: K.Expr = em.idx(0)
        kept = [i for d, i in enumerate(index) if d not in group.reduced]
        for (grid, local), (_, stride), i in zip(self.footprint(group), self._tile_layout(group)[0], kept):
            part: K.Expr = em.idx(0)
            for f in local:
                part = K.add(K.mul(part, em.idx(f.extent)), f.var)
            linear = K.add(linear, K.mul(part, em.idx(stride)))
        return linear

    def register_shared_reader(self, group: Group, buffer: K.Buffer) -> None:
        bases = []
        for (grid, _), (extent, stride) in zip(self.footprint(group), self._tile_layout(group)[0]):
            base: K.Expr = self.em.idx(0)
            for f in grid:
                base = K.add(K.mul(base, self.em.idx(f.extent)), f.var)
            bases.append((K.mul(base, self.em.idx(extent)), extent, stride))
        self.em.sub_roots[id(group.root)] = InShared(group.root, tuple(bases), buffer)

    # -- reads of sub-roots (called by the value emitter) -----------------------------------------------
    def read(self, result: InRegisters | InShared, index: Sequence[K.Expr], consumer: str) -> K.Expr:
        em = self.em
        root = result.root
        if isinstance(result, InRegisters):
            for kept_index, value in result.values:
                if self._same_element(kept_index, index, root.shape, consumer):
                    return value
            raise FootprintError(f"block locality: {consumer} reads {root.name} at an element outside the "
                               "block's footprint (its kept index is not one this thread reduced)")
        bases, buffer = result.bases, result.buffer
        linear: K.Expr = em.idx(0)
        for d, ((base, extent, stride), i) in enumerate(zip(bases, index)):
            local = K.Binary("sub", i, base, em.index_type)
            form = affine(local, em.definitions, em.affine_forms)
            if form is None or not self._within(form, extent):
                if _from_loaded_data(i, em.definitions):
                    raise DataDependentRead(f"block locality: {consumer} reads {root.name} in dim {d} at an "
                                            "index computed from loaded data")
                raise FootprintError(f"block locality: {consumer} reads {root.name} in dim {d} outside the "
                                   "block's shared-memory footprint")
            linear = K.add(linear, K.mul(local, em.idx(stride)))
        value: K.Expr = K.Load(buffer.name, linear, buffer.dtype)
        if register_type(root.dtype) == "bool":
            value = K.Cast(value, "bool")
        return em.let("s", value)

    def _same_element(self, kept_index, index, shape, consumer: str) -> bool:
        defs, forms = self.em.definitions, self.em.affine_forms
        for want, got, size in zip(kept_index, index, shape):
            if size == 1 and affine(got, defs, forms) == ({}, 0) and self._only_first(want, consumer):
                continue  # the only element, which every consumer thread left running reduced
            form = affine(want, defs, forms)
            if form is None or form != affine(got, defs, forms):
                return False
        return True

    def _only_first(self, want: K.Expr, consumer: str) -> bool:
        """Whether the consumer threads that reach a read of a size-1 dim's element 0 are the ones
        whose register holds it: the producer's kept index ``want`` is 0 for every thread, or each
        tile register in it tiles a dim of size 1 in the consumer too, so the consumer's tail guard
        stops the threads where it is not 0. A consumer that broadcasts the element along a longer
        dim (``x.sum(1, keepdim=True).expand(4, 1)``) reads it in threads that reduced nothing."""
        form = affine(want, self.em.definitions, self.em.affine_forms)
        if form is None:
            return False
        terms, constant = form
        if constant != 0:
            return False
        group = next((g for g in self.groups if g.root.name == consumer), None)
        if group is None:
            return not terms
        for name in terms:
            dims = [f.dim for f in group.factors if isinstance(f.var, K.Var) and f.var.name == name]
            if not dims or any(group.space[d] != 1 for d in dims):
                return False
        return True

    def _within(self, form, extent: int) -> bool:
        terms, constant = form
        low = high = constant
        for name, coeff in terms.items():
            bound = self.ranges.get(name)
            if bound is None:
                return False
            low += min(0, coeff * (bound - 1))
            high += max(0, coeff * (bound - 1))
        return 0 <= low and high < extent


def _from_loaded_data(e: K.Expr, definitions, seen: set[str] | None = None) -> bool:
    """Whether index ``e`` depends on a value loaded from memory (through let-bound registers)."""
    if isinstance(e, (K.Load, K.VecLoad)):
        return True
    if isinstance(e, K.Var):
        seen = set() if seen is None else seen
        if e.name in seen or e.name not in definitions:
            return False
        seen.add(e.name)
        return _from_loaded_data(definitions[e.name], definitions, seen)
    if isinstance(e, K.Cast):
        return _from_loaded_data(e.x, definitions, seen)
    if isinstance(e, K.Unary):
        return _from_loaded_data(e.x, definitions, seen)
    if isinstance(e, K.Binary):
        return _from_loaded_data(e.a, definitions, seen) or _from_loaded_data(e.b, definitions, seen)
    if isinstance(e, K.Select):
        return any(_from_loaded_data(x, definitions, seen) for x in (e.cond, e.a, e.b))
    return False
