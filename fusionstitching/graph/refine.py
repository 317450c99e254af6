"""Reshapes between elementwise, reduce and broadcast nodes removed by splitting dims.

PyTorch's decompositions reshape freely between the steps of one computation. GroupNorm's backward
computes the SiLU gradient as ``[N, C, H, W]``, sums it per channel through a reshape to
``[N, C, H·W]``, and combines it with per-group statistics through a reshape to
``[N, G, C/G, H·W]``. The three shapes hold the same elements in the same row-major order. A kernel
that holds nodes of all three tiles three iteration spaces of different ranks and must stage the
values that cross from one to another in shared memory; where the tiles do not line up the
schedule refuses the kernel, and the value is written to memory and read back.

Every one of those shapes is a grouping of consecutive dims of one finer shape,
``[N, G, C/G, H, W]``. This pass rewrites each such region in that shape: the reshapes between
its nodes become identities and disappear, and the region's kernels tile one iteration space.

Dims are split, never merged, so every node keeps its elements in row-major order and a reshape
of a boundary tensor (a parameter, a library call's result) to the finer shape is a view of it.
Merging back what is always read together is ``collapse.py``'s work, which runs after this.

The finer shape of a node is given per dim by its cut points: a dim of size ``S`` with cuts
``1 < c_1 < ... < c_k < S``, each dividing the next and ``S``, becomes dims of sizes
``S / c_k, ..., c_2 / c_1, c_1``. Dims that must split alike share their cuts (union-find):

- an elementwise node and an interior operand of its shape, dim for dim;
- a reduce's kept dims and its result's (its reduced dims split freely; the reduce then reduces
  all their parts);
- a broadcast's operand dim and the result dim it becomes where their sizes are equal (a dim of 1
  stretched to ``S`` never splits; the result dim splits freely, the operand's 1 maps to its first
  part).

A reshape ``r`` of an interior node ``x`` that an interior node reads asks for the cuts that make
the two shapes one: each dim boundary of either shape, counted as the number of elements inside
it, becomes a cut of the dim of the other shape that contains it. The reshape is resolved when the
union of both shapes' boundaries and cuts is a chain of divisors (each divides the next) and both
shapes split to the same sequence of sizes; otherwise it stays a reshape, and its cuts are not
added. Cuts only grow, and every reshape is revisited until none changes.

Some dims take no cuts, and a reshape that would split them stays:

- those of nodes whose storage is fixed (outputs written in place into a parameter, outputs or
  nodes with non-contiguous strides);
- those of nodes a gather reads, and of gathers' results: a reshape between a gather and a split
  node would index by loaded data inside the kernel they share, which the schedule cannot place
  (a cross-entropy's picked log-probability would leave its log-softmax kernel). Other readers
  outside the region (transposes, slices, dots, library calls) read the split node through a
  reshape back to its shape, and the region reads them through a split view: reshapes compose
  into one, and a split of a buffer is a view of it.

Splitting is a choice: ``fusion/explore.py`` plans a graph this pass changes both ways and keeps
the plan the latency evaluator estimates faster.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Hashable, Sequence

from fusionstitching.graph.collapse import ShapeBack, UnionFind, _fixed_outputs, _interior
from fusionstitching.graph.graph import Graph, Node
from fusionstitching.graph.transforms import _make, _Names, _rebuilt


class _Cuts(UnionFind):
    """Union-find over dims, each class with its size and cut points, and the frozen classes."""

    def __init__(self) -> None:
        super().__init__()
        self.size: dict[Hashable, int] = {}
        self.cuts: dict[Hashable, frozenset[int]] = {}
        self.frozen: set[Hashable] = set()

    def add(self, key: Hashable, size: int) -> None:
        if key not in self.parent:
            self.parent[key], self.size[key], self.cuts[key] = key, size, frozenset()

    def union(self, a: Hashable, b: Hashable) -> tuple[Hashable, Hashable] | None:
        joined = super().union(a, b)
        if joined is not None:
            ra, rb = joined
            self.cuts[rb] |= self.cuts[ra]
            if ra in self.frozen:
                self.frozen.add(rb)
        return joined

    def freeze(self, key: Hashable) -> None:
        self.frozen.add(self.find(key))

    def parts(self, key: Hashable, extra: frozenset[int] = frozenset()) -> list[int]:
        """The sizes a dim splits into, outermost first."""
        root = self.find(key)
        size = self.size[root]
        points = sorted(self.cuts[root] | extra | {1, size})
        return [points[i + 1] // points[i] for i in range(len(points) - 2, -1, -1)] or [1]


def _chain(points: Sequence[int]) -> bool:
    ordered = sorted(set(points))
    return all(b % a == 0 for a, b in itertools.pairwise(ordered))


def _inner(shape: Sequence[int]) -> list[int]:
    """Per dim, the number of elements inside one step of it (the product of the dims after it)."""
    return [math.prod(shape[d + 1:]) for d in range(len(shape))]


def refine_reshaped_regions(graph: Graph) -> Graph:
    """A copy of ``graph`` whose reshapes between interior nodes are resolved by splitting dims
    (module docstring); ``graph`` itself when none is."""
    interior = {id(n) for n in graph.nodes if _interior(n)}
    readers: dict[int, list[Node]] = {}
    for n in graph.nodes:
        for x in n.operands:
            readers.setdefault(id(x), []).append(n)
    edges = [n for n in graph.nodes if n.op == "reshape" and id(n.operands[0]) in interior
             and any(id(u) in interior for u in readers.get(id(n), ()))]
    if not edges:
        return graph
    cuts = _classes(graph, interior, edges, readers)
    if not _resolve(cuts, edges) or not any(cuts.cuts.values()):
        return graph
    return _rewrite(graph, interior, cuts, {id(r) for r in edges})


def _key(node: Node, k: int, dim: int, interior: set[int], edges: set[int]) -> tuple:
    """The dim ``dim`` of ``node``'s operand ``k``: the operand's own when it is interior or a
    reshape of an interior node, else that of ``node``'s read of it."""
    x = node.operands[k]
    return (id(x), dim) if id(x) in interior or id(x) in edges else ("in", id(node), k, dim)


def _indexed_by_data(node: Node) -> bool:
    """Whether ``node`` indexes its operand by loaded values (a gather). A reshape between it and a
    split node would sit in the kernel they share with its index computed from loaded data, which
    a kernel's block-locality analysis cannot place (``compose.DataDependentRead``), so they would
    no longer share one."""
    return node.op == "gather"


def _classes(graph: Graph, interior: set[int], edges: list[Node], readers: dict[int, list[Node]]) -> _Cuts:
    cuts = _Cuts()
    edge_ids = {id(r) for r in edges}
    for r in edges:
        for d, size in enumerate(r.shape):
            cuts.add((id(r), d), size)
    fixed = _fixed_outputs(graph)
    for n in graph.nodes:
        if id(n) not in interior:
            continue
        for d, size in enumerate(n.shape):
            cuts.add((id(n), d), size)
        for k, x in enumerate(n.operands):
            for d, size in enumerate(x.shape):
                cuts.add(_key(n, k, d, interior, edge_ids), size)
        if (id(n) in fixed or (n.layout is not None and not n.layout.is_contiguous(n.shape))
                or any(_indexed_by_data(u) for u in readers.get(id(n), ()))):
            for d in range(len(n.shape)):
                cuts.freeze((id(n), d))
        for k, x in enumerate(n.operands):
            if _indexed_by_data(x):
                for d in range(len(x.shape)):
                    cuts.freeze(_key(n, k, d, interior, edge_ids))
        if n.op == "reduce":
            reduced = set(n.attrs["dims"])
            kept = [e for e in range(len(n.operands[0].shape)) if e not in reduced]
            for d, e in enumerate(kept):
                cuts.union((id(n), d), _key(n, 0, e, interior, edge_ids))
        elif n.op == "broadcast_in_dim":
            x = n.operands[0]
            for e, d in enumerate(n.attrs["broadcast_dimensions"]):
                if x.shape[e] == n.shape[d]:
                    cuts.union((id(n), d), _key(n, 0, e, interior, edge_ids))
        else:
            for k, x in enumerate(n.operands):
                if x.shape == n.shape:
                    for d in range(len(n.shape)):
                        cuts.union((id(n), d), _key(n, k, d, interior, edge_ids))
    for r in edges:  # a reshape's own layout fixes its storage as an output would
        if id(r) in fixed:
            for d in range(len(r.shape)):
                cuts.freeze((id(r), d))
    return cuts


def _resolve(cuts: _Cuts, edges: list[Node]) -> set[int]:
    """Add the cuts of every reshape that can be resolved, until none changes; the resolved ones."""
    rejected: set[int] = set()
    changed = True
    while changed:
        changed = False
        for r in edges:
            if id(r) in rejected:
                continue
            proposal = _proposal(cuts, r)
            if proposal is None:
                rejected.add(id(r))
                continue
            for root, points in proposal.items():
                if not points <= cuts.cuts[root]:
                    cuts.cuts[root] |= points
                    changed = True
    return {id(r) for r in edges} - rejected


def _proposal(cuts: _Cuts, r: Node) -> dict[Hashable, frozenset[int]] | None:
    """The cuts per class that make ``r`` and its operand split alike, or None where they cannot."""
    x = r.operands[0]
    sides = [(id(x), x.shape), (id(r), r.shape)]
    points: set[int] = set()
    for owner, shape in sides:
        for d, (size, inner) in enumerate(zip(shape, _inner(shape))):
            points.update({inner, inner * size})
            points.update(inner * c for c in cuts.cuts[cuts.find((owner, d))])
    if not _chain(points):
        return None
    proposal: dict[Hashable, set[int]] = {}
    for owner, shape in sides:
        for d, (size, inner) in enumerate(zip(shape, _inner(shape))):
            root = cuts.find((owner, d))
            inside = {g // inner for g in points if inner < g < inner * size}
            new = inside - cuts.cuts[root]
            if new and root in cuts.frozen:
                return None
            proposal.setdefault(root, set()).update(inside)
    merged = {root: frozenset(p) for root, p in proposal.items()}
    if not all(_chain(p | {1, cuts.size[root]}) for root, p in merged.items()):
        return None

    def parts(owner: int, shape: Sequence[int]) -> list[int]:
        return [s for d in range(len(shape)) for s in cuts.parts((owner, d), merged[cuts.find((owner, d))])]

    if parts(*sides[0]) != parts(*sides[1]):  # dims of 1 in different places
        return None
    return merged


def _rewrite(graph: Graph, interior: set[int], cuts: _Cuts, edges: set[int]) -> Graph:
    names = _Names(n.name for n in graph.nodes)
    copies: dict[int, Node] = {id(p): p for p in graph.parameters}
    views: dict[tuple[int, tuple[int, ...]], Node] = {}

    def view(x: Node, shape: tuple[int, ...], name: str) -> Node:
        """``x`` (a copy) as ``shape``: itself, or one reshape of what it reshapes."""
        if x.shape == shape:
            return x
        source = x.operands[0] if x.op == "reshape" else x
        if source.shape == shape:
            return source
        key = (id(source), shape)
        if key not in views:
            views[key] = _make("reshape", [source], names.new(name), shape=shape)
        return views[key]

    back = ShapeBack(names, copies, "unsplit")

    def split(keys: Sequence[Hashable], shape: Sequence[int]) -> list[list[int]]:
        return [cuts.parts(key) if size != 1 else [1] for key, size in zip(keys, shape)]

    for n in graph.nodes:
        if id(n) in copies:
            continue
        if id(n) not in interior:
            if n.op == "reshape" and id(n.operands[0]) in interior:  # a reshape of a reshape is one reshape
                source = copies[id(n.operands[0])]
                copies[id(n)] = source if source.shape == n.shape else _make(
                    "reshape", [source], n.name, shape=n.shape, layout=n.layout)
            else:
                copies[id(n)] = dataclasses.replace(n, operands=tuple(
                    back(x) if id(x) in interior else copies[id(x)] for x in n.operands))
            continue
        own = split([(id(n), d) for d in range(len(n.shape))], n.shape)
        operands, operand_parts = [], []
        for k, x in enumerate(n.operands):
            wanted = split([_key(n, k, d, interior, edges) for d in range(len(x.shape))], x.shape)
            operand_parts.append(wanted)
            shape = tuple(s for p in wanted for s in p)
            operands.append(view(copies[id(x)], shape, f"{x.name}_split"))
        shape = tuple(s for p in own for s in p)
        if shape == n.shape and all(a.shape == x.shape for a, x in zip(operands, n.operands)):
            copies[id(n)] = dataclasses.replace(n, operands=tuple(operands))
            continue
        attrs = dict(n.attrs)
        if n.op == "reduce":
            firsts = _firsts(operand_parts[0])
            attrs["dims"] = tuple(i for d in sorted(n.attrs["dims"])
                                  for i in range(firsts[d], firsts[d] + len(operand_parts[0][d])))
        elif n.op == "broadcast_in_dim":
            firsts = _firsts(own)
            result_dims = []
            for e, d in enumerate(n.attrs["broadcast_dimensions"]):
                count = len(operand_parts[0][e])
                result_dims += range(firsts[d], firsts[d] + count)  # a 1 takes the first part
            attrs["broadcast_dimensions"] = tuple(result_dims)
        layout = n.layout if shape == n.shape else None
        copies[id(n)] = _make(n.op, operands, n.name, shape=shape, dtype=n.dtype, layout=layout, **attrs)
    outputs_back = {id(out): back(out) for out in graph.outputs if out is not None and id(out) in interior}
    return _rebuilt(graph, {**copies, **outputs_back})


def _firsts(parts: list[list[int]]) -> list[int]:
    """Per original dim, the index of its first part in the split shape."""
    firsts, at = [], 0
    for p in parts:
        firsts.append(at)
        at += len(p)
    return firsts
