"""Adjacent dims a reduction reduces together, merged into one dim wherever the graph allows.

A BatchNorm over an NCHW activation reduces ``[N, C, H, W]`` over ``{0, 2, 3}``; ResNet's H × W
images are 56², 28², 14² and 7², so the innermost dim alone is 56, 28, 14 or 7 elements long. A
kernel tiles each dim on its own: lanes along a 28-long W idle 4 of 32 threads, 16-byte vectors do
not divide it, and a 7-long row leaves most of a warp idle. H and W are reduced together and every
other node reading them treats them alike, so they are one row of H·W contiguous elements: 784
elements take a warp's 32 lanes with 16-byte vectors. Inductor merges such dims in its loop bodies
for the same reason.

Which dims merge. Each interior node (elementwise, ``reduce``, ``broadcast_in_dim``,
``rng_uniform``) has one variable per pair of adjacent dims (``d``, ``d + 1``): merged or not.
Nodes that must agree share a variable (union-find):

- an elementwise node and its interior operands, dim for dim (operands have its shape);
- a reduce and its operand where both dims are kept; where both are reduced the pair may merge
  (and this is what asks for merging, below); where one is reduced and the other kept it may not;
  a result pair whose operand dims are not adjacent (a reduced dim between them) may not merge;
- a broadcast and its operand where both result dims come from adjacent operand dims that the
  broadcast either both keeps or both stretches from 1 (a kept dim of 1 counts as kept, so that a
  run of three never mixes the two); two new dims may merge freely; a new dim and an operand dim
  of 1 that the broadcast stretches may with ``rows`` (the merged dim is stretched from that 1) unless the run
  would reach a second such dim past more new dims; a new dim and any other operand dim may not,
  nor may operand dims whose result dims are not adjacent;
- an ``rng_uniform`` draws by row-major position, which merging keeps: no constraint.

Every other node (parameters, constants, library calls, dots, reshapes, transposes, slices, ...)
keeps its shape. An interior node reading one reads a reshape of it to the merged shape (one per
merged shape; between kernels a reshape of a contiguous buffer is no step; a reshape of a reshape
is one reshape), and it reads an interior node through a reshape back to the original shape (a
reshape reader reshapes the merged node directly); graph outputs are reshaped back too.
A pair of a graph output stored with strides that do not merge, or of an output written in place
into a parameter, is not merged.

A set of variables tied together is merged when nothing forbids it and it holds at least one
pair that a reduction reduces together whose inner dim is not a whole number of warps (32), or,
with ``rows``, that ends a row (the reduced dims run to the innermost one): a kernel lays a warp's lanes along
the innermost reduced dim, and where that dim is a multiple of 32 they tile it alone as well as
the merged run of a column reduction (a bias gradient's batch × sequence), while merging would
change the shapes of a whole region and add reshapes at its edges for nothing; a row of several
dims is one contiguous run, which the row templates read as one (GroupNorm's rows of C/G × H × W
after ``refine.py`` split them out of one dim). The values are unchanged: each merged node
holds the same elements in the same row-major order.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Hashable, Sequence

from fusionstitching.graph.graph import Graph, Node
from fusionstitching.graph.ops import is_elementwise
from fusionstitching.graph.transforms import _make, _Names, _rebuilt

INTERIOR_OPS = ("reduce", "broadcast_in_dim", "rng_uniform")
WARP_SIZE = 32  # a warp's lanes tile a reduced dim whose size is a multiple of this as well alone


def _interior(node: Node) -> bool:
    return node.op in INTERIOR_OPS or is_elementwise(node.op)


class UnionFind:
    """Union-find over hashable keys (a key is its own set until joined)."""

    def __init__(self) -> None:
        self.parent: dict[Hashable, Hashable] = {}

    def find(self, key: Hashable) -> Hashable:
        root = self.parent.setdefault(key, key)
        while root != self.parent[root]:
            root = self.parent[root]
        while key != root:  # path compression
            self.parent[key], key = root, self.parent[key]
        return root

    def union(self, a: Hashable, b: Hashable) -> tuple[Hashable, Hashable] | None:
        """Join the sets of ``a`` and ``b``: (the root joined, the root kept), or None if one already."""
        ra, rb = self.find(a), self.find(b)
        if ra == rb:
            return None
        self.parent[ra] = rb
        return ra, rb


class _Pairs(UnionFind):
    """Union-find over pair variables, with the sets that may not merge and those that ask to."""

    def __init__(self) -> None:
        super().__init__()
        self.forbidden: set[Hashable] = set()
        self.wanted: set[Hashable] = set()

    def forbid(self, key: Hashable) -> None:
        self.forbidden.add(key)

    def want(self, key: Hashable) -> None:
        self.wanted.add(key)

    def merged(self) -> set[Hashable]:
        forbidden = {self.find(k) for k in self.forbidden}
        wanted = {self.find(k) for k in self.wanted}
        return {k for k in self.parent if self.find(k) in wanted and self.find(k) not in forbidden}


def collapse_reduced_runs(graph: Graph, rows: bool = False) -> Graph:
    """A copy of ``graph`` where adjacent dims reduced together are one dim (see the module
    docstring); ``graph`` itself when no pair merges. ``rows`` also merges the dims of every row
    and new dims beside stretched ones: what ``refine.py`` split for one region's sake."""
    interior = {id(n) for n in graph.nodes if _interior(n)}
    pairs = _constraints(graph, interior, rows)
    if not pairs.wanted:
        return graph
    merged = pairs.merged()
    if not merged:
        return graph
    return _rewrite(graph, interior, merged)


def _key(node: Node, k: int, dim: int, interior: set[int]) -> tuple:
    """The variable of pair ``dim`` of ``node``'s operand ``k``: the operand's own when it is
    interior, else that of the reshape ``node`` reads it through."""
    x = node.operands[k]
    return (id(x), dim) if id(x) in interior else ("in", id(node), k, dim)


def _constraints(graph: Graph, interior: set[int], rows: bool = False) -> _Pairs:
    pairs = _Pairs()
    kept_shape = _fixed_outputs(graph)
    for n in graph.nodes:
        if id(n) not in interior:
            continue
        rank = len(n.shape)
        for d in range(rank - 1):
            pairs.find((id(n), d))
            if id(n) in kept_shape:
                pairs.forbid((id(n), d))
        if n.op == "reduce":
            _reduce_pairs(n, pairs, interior, rows)
        elif n.op == "broadcast_in_dim":
            _broadcast_pairs(n, pairs, interior, rows)
        else:  # elementwise (operands of its shape) or rng_uniform (scalar operands)
            for k, x in enumerate(n.operands):
                if x.shape == n.shape:
                    for d in range(rank - 1):
                        pairs.union((id(n), d), _key(n, k, d, interior))
    return pairs


def _fixed_outputs(graph: Graph) -> set[int]:
    """Outputs whose pairs may not merge: written in place into a parameter, or stored with
    strides under which a pair is not one run."""
    fixed = {id(graph.outputs[k]) for k in graph.mutations if graph.outputs[k] is not None}
    for out, layout in zip(graph.outputs, graph.output_layouts):
        if out is not None and layout is not None and not layout.is_contiguous(out.shape):
            fixed.add(id(out))
    return fixed


def _reduce_pairs(n: Node, pairs: _Pairs, interior: set[int], rows: bool = False) -> None:
    reduced = set(n.attrs["dims"])
    x_shape = n.operands[0].shape
    rank = len(x_shape)
    kept = [e for e in range(rank) if e not in reduced]
    for e in range(rank - 1):
        key = _key(n, 0, e, interior)
        if e in reduced and e + 1 in reduced:
            if x_shape[e + 1] % WARP_SIZE or (rows and all(d in reduced for d in range(e, rank))):
                pairs.want(key)  # lanes do not tile the inner dim alone evenly, or a row is one run
            else:
                pairs.find(key)  # may merge along with others, asks for nothing
        elif (e in reduced) != (e + 1 in reduced):
            pairs.forbid(key)
        else:
            pairs.union(key, (id(n), kept.index(e)))
    for k in range(len(kept) - 1):
        if kept[k + 1] != kept[k] + 1:
            pairs.forbid((id(n), k))


def _broadcast_pairs(n: Node, pairs: _Pairs, interior: set[int], rows: bool = False) -> None:
    x, dims = n.operands[0], tuple(n.attrs["broadcast_dimensions"])
    source = {d: e for e, d in enumerate(dims)}
    tied: set[int] = set()
    for d in range(len(n.shape) - 1):
        a, b = source.get(d), source.get(d + 1)
        if a is None and b is None:
            continue  # two new dims
        if rows and a is None and _stretched(x.shape[b], n.shape[d + 1]) and not _stretched_beyond(n, x, source, d, -1):
            continue  # a new dim beside an operand dim of 1 stretched: the merged dim is stretched from 1
        if rows and b is None and _stretched(x.shape[a], n.shape[d]) and not _stretched_beyond(n, x, source, d + 1, 1):
            continue
        if a is not None and b == a + 1 and _expands(x.shape[a], n.shape[d]) == _expands(x.shape[b], n.shape[d + 1]):
            pairs.union((id(n), d), _key(n, 0, a, interior))
            tied.add(a)
        else:
            pairs.forbid((id(n), d))
    for e in range(len(x.shape) - 1):
        if e not in tied:
            pairs.forbid(_key(n, 0, e, interior))


def _stretched(before: int, after: int) -> bool:
    return before == 1 and after != 1


def _stretched_beyond(n: Node, x: Node, source: dict[int, int], d: int, step: int) -> bool:
    """Whether, past the new dims next to ``d`` in direction ``step``, another stretched operand dim
    comes: a run holding both would take two operand dims into one."""
    e = d + step
    while 0 <= e < len(n.shape) and source.get(e) is None:
        e += step
    return 0 <= e < len(n.shape) and _stretched(x.shape[source[e]], n.shape[e])


def _expands(before: int, after: int) -> bool:
    """Whether a broadcast stretches an operand dim of ``before`` elements to ``after``: a pair of
    one stretched dim and one kept (a dim of 1 kept as 1 included) is no single dim of either."""
    return before != after


def _groups(rank: int, merged: set, prefix: tuple) -> list[list[int]]:
    """Dims ``0..rank-1`` in runs, dims d and d + 1 joined where the pair ``(*prefix, d)`` merges."""
    groups: list[list[int]] = []
    for d in range(rank):
        if d > 0 and (*prefix, d - 1) in merged:
            groups[-1].append(d)
        else:
            groups.append([d])
    return groups


def _shape(shape: Sequence[int], groups: list[list[int]]) -> tuple[int, ...]:
    return tuple(math.prod(shape[d] for d in g) for g in groups)


class ShapeBack:
    """A rewritten node's value in its original shape, for readers outside the rewritten region and
    for outputs: its copy, or one reshape of the copy per node (named ``<node>_<suffix>``)."""

    def __init__(self, names: _Names, copies: dict[int, Node], suffix: str) -> None:
        self.names, self.copies, self.suffix = names, copies, suffix
        self.restored: dict[int, Node] = {}

    def __call__(self, x: Node) -> Node:
        new = self.copies[id(x)]
        if new.shape == x.shape:
            return new
        if id(x) not in self.restored:
            self.restored[id(x)] = _make("reshape", [new], self.names.new(f"{x.name}_{self.suffix}"),
                                         shape=x.shape, layout=x.layout)
        return self.restored[id(x)]


def _rewrite(graph: Graph, interior: set[int], merged: set) -> Graph:
    names = _Names(n.name for n in graph.nodes)
    copies: dict[int, Node] = {id(p): p for p in graph.parameters}
    groups: dict[int, list[list[int]]] = {}  # interior node → its dims' runs
    flat_inputs: dict[tuple[int, tuple[int, ...]], Node] = {}  # (boundary node, merged shape) → reshape
    back = ShapeBack(names, copies, "unflat")

    for n in graph.nodes:
        if id(n) in copies:
            continue
        if id(n) not in interior:
            if n.op == "reshape" and id(n.operands[0]) in interior:  # reshapes compose: no reshape back
                copies[id(n)] = dataclasses.replace(n, operands=(copies[id(n.operands[0])],))
            else:
                copies[id(n)] = dataclasses.replace(n, operands=tuple(
                    back(x) if id(x) in interior else copies[id(x)] for x in n.operands))
            continue
        runs = _groups(len(n.shape), merged, (id(n),))
        groups[id(n)] = runs
        operands, operand_runs = [], []
        for k, x in enumerate(n.operands):
            if id(x) in interior:
                operands.append(copies[id(x)])
                operand_runs.append(groups[id(x)])
                continue
            x_runs = _groups(len(x.shape), merged, ("in", id(n), k))
            operand_runs.append(x_runs)
            shape = _shape(x.shape, x_runs)
            if shape == x.shape:
                operands.append(copies[id(x)])
                continue
            source = x.operands[0] if x.op == "reshape" else x  # reshapes compose
            key = (id(source), shape)
            if copies[id(source)].shape == shape:
                flat_inputs[key] = copies[id(source)]
            elif key not in flat_inputs:
                flat_inputs[key] = _make("reshape", [copies[id(source)]], names.new(f"{x.name}_flat"), shape=shape)
            operands.append(flat_inputs[key])
        shape = _shape(n.shape, runs)
        if shape == n.shape and all(x.shape == y.shape for x, y in zip(n.operands, operands)):
            copies[id(n)] = dataclasses.replace(n, operands=tuple(operands))
            continue
        attrs = dict(n.attrs)
        if n.op == "reduce":
            reduced = set(n.attrs["dims"])
            attrs["dims"] = tuple(i for i, run in enumerate(operand_runs[0]) if run[0] in reduced)
        elif n.op == "broadcast_in_dim":
            dims = n.attrs["broadcast_dimensions"]
            attrs["broadcast_dimensions"] = tuple(
                next(i for i, g in enumerate(runs) if dims[run[0]] in g) for run in operand_runs[0])
        layout = n.layout if shape == n.shape else None  # a changed node's layout goes to its reshape back
        copies[id(n)] = dataclasses.replace(n, operands=tuple(operands), shape=shape, attrs=attrs, layout=layout)
    outputs_back = {id(out): back(out) for out in graph.outputs if out is not None and id(out) in interior}
    final = {**copies, **outputs_back}
    return _rebuilt(graph, final)

