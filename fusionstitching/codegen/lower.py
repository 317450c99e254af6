"""Lowering: a pattern of graph nodes + a KernelSchedule → one Kernel IR kernel.

The pattern's outputs (nodes used outside it, or graph outputs) are the roots; each has a schedule
in the template. Every other node is recomputed inside the thread that needs it (thread
composition, ``values.py``). A root's loop nest follows its schedule (see the tiling note in
``schedule/template.py``): a grid-stride loop over the GRID space, a block-stride loop over the
CTA space (or warp/lane loops when there are WARP tiles), serial loops over THREAD factors, dim
indices rebuilt mixed-radix and tails predicated off.

Kernel packing [C §4.1]: roots whose iteration spaces and tilings are identical share one loop
nest (same-shape ops in one loop); groups with different shapes are sub-kernels that each get a
range of blocks, proportional to their element counts, and dispatch on ``blockIdx.x``.

Reductions as roots are lowered here only when every reduced dim is THREAD-tiled (each thread
reduces sequentially, [B §5.2]); reductions across threads need warp or block composition.
Index arithmetic is 32-bit unless a buffer or a loop extent needs 64 bits.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from fusionstitching.codegen import kernel_ir as K
from fusionstitching.codegen.compose import (
    Composer,
    Factor,
    decompose,
    iteration_space,
    make_groups,
    needs_composition,
)
from fusionstitching.codegen.values import (
    CodegenError,
    InputBuffer,
    ValueEmitter,
    combine,
    is_reduction,
    reduce_identity,
    reduced_dims,
    reduction_kind,
    register_type,
)
from fusionstitching.codegen.vectorize import ITEM_BYTES as _ITEM_BYTES
from fusionstitching.codegen.vectorize import pack_lanes
from fusionstitching.graph.graph import Graph, Layout, Node, contiguous_strides
from fusionstitching.graph.ops import Category
from fusionstitching.schedule.template import KernelSchedule, Level, Schedule, tile_extents

_NOT_COMPUTED = (Category.PARAMETER, Category.LIBRARY)


@dataclass(frozen=True)
class Pattern:
    """The nodes a kernel computes, its external inputs and its outputs, in graph order."""

    nodes: tuple[Node, ...]
    inputs: tuple[Node, ...]
    outputs: tuple[Node, ...]


@dataclass(frozen=True)
class LoweredKernel:
    kernel: K.Kernel
    pattern: Pattern
    input_layouts: tuple[Layout, ...]
    output_layouts: tuple[Layout, ...]
    aliases: dict[int, int]  # output position → input position whose storage it overwrites
    smem_plan: object = None  # schedule.smem.SmemPlan of a composed kernel

    def _checked(self) -> LoweredKernel:
        """Self, once its in-place outputs are known to be elementwise (``_NotElementwise`` if not)."""
        names = [b.name for b in self.kernel.params]
        outs = [n for n in names if n.startswith("out")]
        ins = [n for n in names if n.startswith("in")]
        _check_in_place(self.kernel, self.aliases, ins, outs)
        return self


def resolve_pattern(graph: Graph, nodes: Iterable[Node | str]) -> Pattern:
    index = graph.index
    chosen: set[Node] = set()
    for item in nodes:
        node = index.by_name.get(item) if isinstance(item, str) else item
        if node is None or index.by_name.get(node.name) is not node:
            raise CodegenError(f"{item!r} is not a node of graph {graph.name}")
        if node.category in _NOT_COMPUTED:
            raise CodegenError(f"node {node.name} ({node.op}) cannot be computed inside a kernel")
        chosen.add(node)
    if not chosen:
        raise CodegenError("empty pattern")
    ordered = sorted(chosen, key=index.position.__getitem__)
    used_outside = {id(n) for n in ordered
                    if id(n) in index.output_ids or any(u not in chosen for u in index.users[n])}
    inputs: list[Node] = []
    seen: set[int] = set()
    for node in ordered:
        for operand in node.operands:
            if operand in chosen or id(operand) in seen:
                continue
            if operand.op == "constant" and operand.attrs["value"].ndim == 0:
                continue  # scalar constants are inlined
            inputs.append(operand)
            seen.add(id(operand))
    outputs = [n for n in ordered if id(n) in used_outside]
    if not outputs:
        raise CodegenError("the pattern has no output")
    return Pattern(tuple(ordered), tuple(inputs), tuple(outputs))


def lower(graph: Graph, nodes: Iterable[Node | str], schedule: KernelSchedule, *,
          name: str = "fused", vectorize_access: bool = True, guard_tails: bool = True,
          check_in_place: bool = True, smem_limit: int = 48 * 1024, in_place: bool = True,
          probe: bool = False, pattern: Pattern | None = None) -> LoweredKernel:
    """Lower ``nodes`` of ``graph`` under ``schedule``. ``guard_tails`` and ``check_in_place``
    exist to show that the simulator catches the out-of-bounds accesses and cross-block races
    they prevent; leave them on. ``probe`` (``schedule.feasible``) lowers register-composed copies
    of a body once, with registers for their THREAD indices: it refuses whatever the full lowering
    refuses, but its kernel is not one to run. ``pattern`` is ``resolve_pattern(graph, nodes)``
    where the caller has it. An input mutation (``graph.mutations``) is written in place when
    the update is elementwise; otherwise (a step counter every thread reads) the kernel writes a
    new buffer, which the runtime copies into the input afterwards."""
    nodes = list(nodes)
    if pattern is None:
        pattern = resolve_pattern(graph, nodes)
    if check_in_place and in_place:
        try:
            return lower(graph, nodes, schedule, name=name, vectorize_access=vectorize_access,
                         guard_tails=guard_tails, smem_limit=smem_limit, in_place=True, check_in_place=False,
                         probe=probe, pattern=pattern)._checked()
        except _NotElementwise:
            return lower(graph, nodes, schedule, name=name, vectorize_access=vectorize_access,
                         guard_tails=guard_tails, smem_limit=smem_limit, in_place=False, check_in_place=False,
                         probe=probe, pattern=pattern)
    launch = schedule.launch
    roots = {s.root for s in schedule.schedules}
    for out in pattern.outputs:
        if out.name not in roots:
            raise CodegenError(f"template has no schedule for output {out.name}")
    by_name = {n.name: n for n in pattern.nodes}
    unknown = roots - set(by_name)
    if unknown:
        raise CodegenError(f"template schedules {sorted(unknown)}, which are not nodes of the pattern")

    _check_reduced_dims_in_one_block(schedule, by_name, {o.name for o in pattern.outputs})
    input_layouts = tuple(_input_layout(n) for n in pattern.inputs)
    aliases = _aliases(graph, pattern) if in_place else {}
    output_layouts = tuple(input_layouts[aliases[k]] if k in aliases else Layout.contiguous(o.shape)
                           for k, o in enumerate(pattern.outputs))
    extents = [_extent(n.shape, lay) for n, lay in zip(pattern.inputs, input_layouts)]
    extents += [_extent(n.shape, lay) for n, lay in zip(pattern.outputs, output_layouts)]
    index_type = "i64" if max(extents + [n.size for n in pattern.nodes] + [launch.blocks * launch.threads]) \
        >= 2**31 - 1 else "i32"
    in_names = [f"in{k}" for k in range(len(pattern.inputs))]
    out_names = [f"out{k}" for k in range(len(pattern.outputs))]
    inputs = {id(n): InputBuffer(nm, n, lay.strides) for n, nm, lay in zip(pattern.inputs, in_names, input_layouts)}
    emitter = ValueEmitter(inputs, {id(n) for n in pattern.nodes}, index_type)

    shared: list[K.Buffer] = []
    smem_plan = None
    outputs = {o.name: o for o in pattern.outputs}
    if needs_composition(schedule.schedules, outputs, by_name):
        order = {n.name: k for k, n in enumerate(pattern.nodes)}
        stores_by_root = {o.name: (out_names[k], output_layouts[k]) for k, o in enumerate(pattern.outputs)}
        composer = Composer(emitter, make_groups(schedule.schedules, by_name, stores_by_root, order),
                            launch.threads, launch.blocks, guard_tails, vectorize_access, probe)
        smem_plan = composer.plan_shared(graph, pattern.nodes, smem_limit)
        emitter.reader = composer.read
        body = composer.lower()
        shared = composer.shared
        used = sum(b.extent * _ITEM_BYTES[b.dtype] for b in shared)
        if used > smem_limit:
            raise CodegenError(f"shared memory: the kernel needs {used} bytes "
                               f"({', '.join(f'{b.name} {b.extent * _ITEM_BYTES[b.dtype]}' for b in shared)}) "
                               f"over the {smem_limit}-byte limit")
    else:
        body = _lower_packed(emitter, schedule, pattern, out_names, output_layouts, vectorize_access, guard_tails,
                             probe)

    params = [K.Buffer(nm, o.dtype.value, ext, aligned=True, noalias=k not in aliases)
              for k, (nm, o, ext) in enumerate(zip(out_names, pattern.outputs, extents[len(in_names):]))]
    aliased_inputs = set(aliases.values())
    params += [K.Buffer(nm, n.dtype.value, ext, readonly=k not in aliased_inputs, aligned=True,
                        noalias=k not in aliased_inputs)
               for k, (nm, n, ext) in enumerate(zip(in_names, pattern.inputs, extents))]
    kernel = K.Kernel(name, tuple(params), tuple(body), launch.threads, launch.blocks, tuple(shared),
                      notes=(str(schedule),))
    return LoweredKernel(kernel, pattern, input_layouts, output_layouts, aliases, smem_plan)


def _check_reduced_dims_in_one_block(schedule: KernelSchedule, by_name: dict[str, Node], outputs: set[str]) -> None:
    """A reduction that is stored, or reduced across threads (CTA/WARP on a reduced dim, or ``S``)
    for other groups to read, must be finished by one block: with a reduced dim split across
    blocks (a GRID tile of extent > 1) several blocks would store the same element, or readers
    would get one block's partial result. That takes a split reduction
    (``graph.transforms.split_reduction``) and a second kernel. (A reduction root with no thread
    tile on its reduced dims is recomputed whole by each reader.)"""
    for sched in schedule.schedules:
        root = by_name[sched.root]
        if not is_reduction(root):
            continue
        across = sched.shared or any(t.level in (Level.CTA, Level.WARP) for d in reduced_dims(root)
                                     for t in sched.dims[d])
        if sched.root not in outputs and not across:
            continue
        space = iteration_space(root)
        for d in reduced_dims(root):
            extents = tile_extents(space[d], sched.dims[d])
            if any(t.level == Level.GRID and e > 1 for t, e in zip(sched.dims[d], extents)):
                use = "store each result" if sched.root in outputs else "hold a partial result for its readers"
                raise CodegenError(f"{root.name}: reduced dim {d} is split across blocks (GRID), so several "
                                   f"blocks would {use}; it needs a split reduction")


def _lower_packed(emitter, schedule, pattern, out_names, output_layouts, vectorize_access, guard_tails,
                  probe=False):
    """Thread composition only: one loop nest per group of same-shape roots, packed by block ranges.
    A probe lowers only the first lane of a vector (``_element``)."""
    groups = _group_schedules(schedule, {o.name: o for o in pattern.outputs}, {id(n) for n in pattern.nodes})
    ranges = _block_ranges(groups, schedule.launch.blocks)
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


def _input_layout(node: Node) -> Layout:
    if node.op == "parameter" and node.layout is not None:
        return Layout(node.layout.strides, 0)  # the storage offset is applied to the pointer
    return Layout.contiguous(node.shape)


def _extent(shape: Sequence[int], layout: Layout) -> int:
    if math.prod(shape) == 0:
        return 0
    return 1 + sum((s - 1) * abs(st) for s, st in zip(shape, layout.strides))


def _aliases(graph: Graph, pattern: Pattern) -> dict[int, int]:
    """Outputs that are in-place updates (``graph.mutations``) of a parameter the pattern reads."""
    result = {}
    if not graph.mutations:
        return result
    outputs = {id(out): k for k, out in enumerate(pattern.outputs)}
    inputs = {id(inp): j for j, inp in enumerate(pattern.inputs)}
    for out_index, param_index in graph.mutations.items():
        k = outputs.get(id(graph.outputs[out_index]))
        j = inputs.get(id(graph.parameters[param_index]))
        if k is not None and j is not None:
            result[k] = j
    return result


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


def packed_groups(roots: Sequence[tuple[Schedule, Node]], inside: set[int]) -> list[tuple[Schedule, list[Node]]]:
    """Roots of a packed kernel in loop nests: roots with one iteration space and tiling share a nest
    when they read a common value (an AdamW tensor's new parameter, first and second moments all
    read its gradient: each element is loaded once); unrelated roots keep their own nests, and so
    their own block ranges (AdamW over 147 tensors of one shape in a single nest ran on the blocks
    of one tensor: 3.2× the time of a copy of its bytes on an H100). ``inside``: ids of the
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

    groups: list[tuple[Schedule, list[Node], set[int]]] = []
    alike: dict[tuple, list[int]] = {}  # (tiling, space) → the groups a root of them may join
    for sched, root in roots:
        space = iteration_space(root)
        mine = ancestry(root)
        candidates = alike.setdefault((sched.dims, space), [])
        for k in candidates:
            _, members, theirs = groups[k]
            if (not is_reduction(members[0]) and not is_reduction(root) and not sched.shared
                    and not mine.isdisjoint(theirs)):
                members.append(root)
                theirs |= mine
                break
        else:
            candidates.append(len(groups))
            groups.append((sched, [root], set(mine)))
    return [(sched, members) for sched, members, _ in groups]


def _grid_extent(sched: Schedule, root: Node) -> int:
    space = iteration_space(root)
    return math.prod(e for size, tiles in zip(space, sched.dims) for t, e in zip(tiles, tile_extents(size, tiles))
                     if t.level == Level.GRID)


def _block_ranges(groups: list[tuple[Schedule, list[Node]]], blocks: int) -> list[tuple[int, int]]:
    """Block ranges of packed sub-kernels: proportional to each one's elements, at least one block,
    never more than its GRID space; one sub-kernel takes all blocks."""
    if len(groups) == 1:
        return [(0, blocks)]
    if blocks < len(groups):
        raise CodegenError(f"launch has {blocks} blocks for {len(groups)} packed sub-kernels")
    grids = [_grid_extent(s, members[0]) for s, members in groups]
    work = [math.prod(iteration_space(members[0])) * len(members) for _, members in groups]
    total = sum(work) or 1
    counts = [max(1, min(g, round(blocks * w / total))) for g, w in zip(grids, work)]
    while sum(counts) > blocks:
        largest = max(range(len(counts)), key=lambda k: counts[k])
        counts[largest] -= 1
    ranges, start = [], 0
    for count in counts:
        ranges.append((start, start + count))
        start += count
    return ranges


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
        return _serial(em, kept, lambda: _element(em, stores, factors, space, reduced, red, lane, vectorize_access,
                                                  guard_tails, probe))

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

    It must be the last tile of the last dim, that dim a multiple of the lane count (so one guard
    covers all lanes), no reduction, and every output written with unit stride in that dim.
    """
    last = factors[-1] if factors else None
    if last is None or last.level != Level.THREAD or last.extent < 2 or last.extent > 16 or reduced:
        return None
    if last.dim != len(space) - 1 or space[-1] % last.extent:
        return None
    if any(layout.strides[-1] != 1 for _, _, layout in stores):
        return None
    return last


def _element(em: ValueEmitter, stores, factors: list[Factor], space, reduced, red_factors,
             lane: Factor | None = None, vectorize_access: bool = False,
             guard_tails: bool = True, probe: bool = False) -> list[K.Stmt]:
    """The body at one point of the iteration space (or the lanes of a vector): compute, store.
    A probe lowers the first lane only: every lane computes the same nodes at indices that differ by
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
        if covered > size and d not in reduced and guard_tails:
            guard = K.land(guard, K.lt(index[d], em.idx(size)))
    prefix = em.stmts

    def compute() -> None:
        for j in range(lanes):
            at = index
            if j:
                lane.var = em.idx(j)
                at = point()
            for root, buffer, layout in stores:
                if is_reduction(root) and reduced:
                    value = _reduce_root(em, root, at, factors, space, red_factors)
                    out_index = [at[d] for d in range(len(space)) if d not in reduced]
                else:
                    value = em.value(root, tuple(at))
                    out_index = at
                storage = root.dtype.value
                em.stmts.append(K.Store(buffer, em.linear(out_index, layout.strides),
                                        K.Cast(value, storage) if storage != register_type(root.dtype) else value))

    body, _ = em.nested(lambda: compute())
    if lane is not None and vectorize_access:
        body = pack_lanes(body, em.definitions, lanes)
    em.stmts = saved
    if guard is not None:
        return list(prefix) + [K.If(guard, tuple(body))]
    return list(prefix) + body


def _reduce_root(em: ValueEmitter, root: Node, index, factors, space, red_factors) -> K.Expr:
    kind = reduction_kind(root)
    rtype = register_type(root.dtype)
    acc = em.accumulator("acc", rtype)
    em.stmts.append(K.Let(acc, reduce_identity(kind, root.dtype)))

    def body() -> None:
        dims = reduced_dims(root)
        point = [_dim_index(em, factors, d) if d in dims else index[d] for d in range(len(space))]
        guard = None
        for d in dims:
            if math.prod(f.extent for f in factors if f.dim == d) > space[d]:
                guard = K.land(guard, K.lt(point[d], em.idx(space[d])))
        inner, value = em.nested(lambda: em.term(root, point))
        update = tuple(inner) + (K.Assign(acc, combine(kind, acc, value, rtype)),)
        em.stmts.extend([K.If(guard, update)] if guard is not None else update)

    stmts, _ = em.nested(lambda: _serial_into(em, red_factors, body))
    em.stmts.extend(stmts)
    if root.dtype.is_half:
        return em.let("v", K.Cast(K.Cast(acc, root.dtype.value), "f32"))
    return acc


def _serial_into(em: ValueEmitter, fs: list[Factor], body) -> None:
    def inner() -> list[K.Stmt]:
        stmts, _ = em.nested(body)
        return stmts

    em.stmts.extend(_serial(em, fs, inner))


def _check_in_place(kernel: K.Kernel, aliases: dict[int, int], in_names, out_names) -> None:
    """An in-place output may only overwrite elements its own thread reads: every index at which the
    aliased input is loaded must be an index at which the output is stored (same expression), in
    the same top-level loop nest of the kernel. Loop nests of a kernel are run by different threads
    (packed sub-kernels by different blocks), so a load in another nest could see an element that
    its owner already overwrote (a step counter read by every parameter's update)."""
    if not aliases:
        return
    pairs = {in_names[j]: out_names[k] for k, j in aliases.items()}
    loads: dict[str, set] = {name: set() for name in pairs}
    stores: dict[str, set] = {name: set() for name in pairs.values()}
    for nest, top in enumerate(_nests(kernel.body)):
        for stmt in _walk([top]):
            if isinstance(stmt, K.Store) and stmt.buffer in stores:
                stores[stmt.buffer].add((nest, stmt.index, 1))
            elif isinstance(stmt, K.VecStore) and stmt.buffer in stores:
                stores[stmt.buffer].add((nest, stmt.index, len(stmt.values)))
            elif isinstance(stmt, K.VecLoad) and stmt.buffer in loads:
                loads[stmt.buffer].add((nest, stmt.index, len(stmt.vars)))
            for load in _loads(stmt):
                if load.buffer in loads:
                    loads[load.buffer].add((nest, load.index, 1))
    for name, read in loads.items():
        if not read <= stores[pairs[name]]:
            raise _NotElementwise(f"in-place output {pairs[name]} overwrites {name}, which is also read at another "
                                  "element or by other threads; the update is not elementwise")


def _nests(body: Sequence[K.Stmt]) -> list[K.Stmt]:
    """The top-level loop nests of a kernel body, looking through ``_dispatch``'s block-index tests."""
    nests: list[K.Stmt] = []
    for stmt in body:
        if (isinstance(stmt, K.If) and isinstance(stmt.cond, K.Binary) and stmt.cond.op == "lt"
                and isinstance(stmt.cond.a, K.Special) and stmt.cond.a.name == "bid"):
            nests += _nests(stmt.then) + _nests(stmt.orelse)
        else:
            nests.append(stmt)
    return nests


class _NotElementwise(CodegenError):
    """An in-place update that other threads could observe half done."""


def _walk(body: Sequence[K.Stmt]):
    for stmt in body:
        yield stmt
        if isinstance(stmt, K.For):
            yield from _walk(stmt.body)
        elif isinstance(stmt, K.If):
            yield from _walk(stmt.then)
            yield from _walk(stmt.orelse)


def _loads(stmt: K.Stmt):
    exprs = []
    if isinstance(stmt, (K.Let, K.Assign)):
        exprs = [stmt.value]
    elif isinstance(stmt, K.Store):
        exprs = [stmt.value, stmt.index]
    while exprs:
        e = exprs.pop()
        if isinstance(e, K.Load):
            yield e
        for child in getattr(e, "__dict__", {}).values():
            if isinstance(child, tuple):
                exprs.extend(c for c in child if hasattr(c, "dtype"))
            elif hasattr(child, "dtype") and not isinstance(child, str):
                exprs.append(child)


def contiguous(node: Node) -> tuple[int, ...]:
    return contiguous_strides(node.shape)
