"""Lowering: a pattern of graph nodes + a KernelSchedule → one Kernel IR kernel.

The pattern's outputs (nodes used outside it, or graph outputs) are the roots; each has a schedule
in the template. Every other node is recomputed inside the thread that needs it (thread
composition, ``values.py``). A root's loop nest follows its schedule (see the tiling note in
``schedule/template.py``): a grid-stride loop over the GRID space, a block-stride loop over the
CTA space (or warp/lane loops when there are WARP tiles), serial loops over THREAD factors, dim
indices rebuilt mixed-radix and tails predicated off.

Roots that no other group reads are packed (``packed.py``: loop nests per shape, sub-kernels by
block ranges); reductions across threads and results other groups read take warp or block
composition (``compose.py``). Index arithmetic is 32-bit unless a buffer or a loop extent needs
64 bits.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from fusionstitching.codegen import kernel_ir as K
from fusionstitching.codegen.compose import Composer
from fusionstitching.codegen.groups import make_groups
from fusionstitching.codegen.packed import lower_packed
from fusionstitching.codegen.precision import half_bound
from fusionstitching.codegen.values import (
    CodegenError,
    InputBuffer,
    ValueEmitter,
    is_reduction,
    reduced_dims,
)
from fusionstitching.codegen.vectorize import ITEM_BYTES as _ITEM_BYTES
from fusionstitching.graph.graph import Graph, Layout, Node
from fusionstitching.graph.node import contiguous_strides
from fusionstitching.graph.ops import VIEW_OPS
from fusionstitching.graph.pattern import Pattern, iteration_space, resolve_pattern
from fusionstitching.schedule.packing import needs_composition
from fusionstitching.schedule.template import KernelSchedule, Level, grid_carried, tile_extents


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

    _check_reduced_dims_in_one_block(schedule, by_name, {o.name for o in pattern.outputs}, launch.blocks)
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
    emitter = ValueEmitter(inputs, {id(n) for n in pattern.nodes}, index_type, origins=graph.origins,
                           approximate=half_bound(graph, pattern))

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
        body = lower_packed(emitter, schedule, pattern, out_names, output_layouts, vectorize_access, guard_tails,
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


def _check_reduced_dims_in_one_block(schedule: KernelSchedule, by_name: dict[str, Node], outputs: set[str],
                                     blocks: int) -> None:
    """A reduction that is stored, or reduced across threads (CTA/WARP on a reduced dim, or ``S``)
    for other groups to read, must be finished by one block: with a reduced dim split across
    blocks (a GRID tile of extent > 1) several blocks would store the same element, or readers
    would get one block's partial result. That takes a split reduction
    (``graph.transforms.split_reduction``) and a second kernel. (A reduction root with no thread
    tile on its reduced dims is recomputed whole by each reader.) The exception is an output whose
    reduced GRID tiles are the iterations of one block's grid-stride loop (``template.grid_carried``):
    the block that stores an element has visited all of its points."""
    for sched in schedule.schedules:
        root = by_name[sched.root]
        if not is_reduction(root):
            continue
        across = sched.shared or any(t.level in (Level.CTA, Level.WARP) for d in reduced_dims(root)
                                     for t in sched.dims[d])
        if sched.root not in outputs and not across:
            continue
        space = iteration_space(root)
        if sched.root in outputs and not sched.shared and root.op == "reduce" \
                and grid_carried(sched, space, reduced_dims(root), blocks):
            continue
        for d in reduced_dims(root):
            extents = tile_extents(space[d], sched.dims[d])
            if any(t.level == Level.GRID and e > 1 for t, e in zip(sched.dims[d], extents)):
                use = "store each result" if sched.root in outputs else "hold a partial result for its readers"
                raise CodegenError(f"{root.name}: reduced dim {d} is split across blocks (GRID), so several "
                                   f"blocks would {use}; it needs a split reduction")


def _input_layout(node: Node) -> Layout:
    if node.op == "parameter" and node.layout is not None:
        return Layout(node.layout.strides, 0)  # the storage offset is applied to the pointer
    return Layout.contiguous(node.shape)


def _extent(shape: Sequence[int], layout: Layout) -> int:
    if math.prod(shape) == 0:
        return 0
    return 1 + sum((s - 1) * abs(st) for s, st in zip(shape, layout.strides))


def _aliases(graph: Graph, pattern: Pattern) -> dict[int, int]:
    """Outputs that are in-place updates (``graph.mutations``) of a parameter the pattern reads. A
    parameter is not written in place where
    - it is laid out other than contiguously: the update would have the parameter's strides where
      the kernels reading it expect a new output's (contiguous) ones;
    - the pattern also reads a view of it (reshape, transpose, broadcast): that input is the same
      memory under another name, read by other threads (a packed sub-kernel) that the update may
      overtake."""
    result = {}
    if not graph.mutations:
        return result
    outputs = {id(out): k for k, out in enumerate(pattern.outputs)}
    inputs = {id(inp): j for j, inp in enumerate(pattern.inputs)}
    for out_index, param_index in graph.mutations.items():
        param = graph.parameters[param_index]
        k = outputs.get(id(graph.outputs[out_index]))
        j = inputs.get(id(param))
        if k is None or j is None or not (param.layout is None or param.layout.is_contiguous(param.shape)):
            continue
        if any(_view_base(inp) is param for inp in pattern.inputs if inp is not param):
            continue
        result[k] = j
    return result


def _view_base(node: Node) -> Node:
    """The node whose memory ``node`` may share: through reshapes, transposes and broadcasts."""
    while node.op in VIEW_OPS and node.operands:
        node = node.operands[0]
    return node


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
        for stmt in _walk([top]):  # in program order: a statement's loads happen before its store
            read = [(load.buffer, load.index, 1) for load in _loads(stmt) if load.buffer in loads]
            if isinstance(stmt, K.VecLoad) and stmt.buffer in loads:
                read.append((stmt.buffer, stmt.index, len(stmt.vars)))
            for name, index, width in read:
                if (nest, index, width) in stores[pairs[name]]:
                    # The thread stored this element already: a later group of a composed kernel
                    # would read the updated value (x.add_(1) read again by a reduction of x).
                    raise _NotElementwise(f"in-place output {pairs[name]} overwrites {name}, which is read "
                                          "again after its update")
                loads[name].add((nest, index, width))
            if isinstance(stmt, K.Store) and stmt.buffer in stores:
                stores[stmt.buffer].add((nest, stmt.index, 1))
            elif isinstance(stmt, K.VecStore) and stmt.buffer in stores:
                stores[stmt.buffer].add((nest, stmt.index, len(stmt.values)))
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
