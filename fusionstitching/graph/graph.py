"""Node, Graph, the builder and the verifier of the tensor-op graph IR.

A ``Node`` is a small frozen record: name, op, operands, shape, dtype, attributes and, for tensors
crossing the graph boundary, a ``Layout`` (strides and storage offset, in elements). Nodes are
compared by identity. A ``Graph`` lists its nodes in topological order, its parameters in calling
order, its outputs (``None`` for a gradient that does not exist) and its input mutations.

Shapes and dtypes are computed once, by ``infer`` (one rule per op); the builder uses it to make
nodes and ``verify`` uses it to check nodes made any other way, naming the node that disagrees.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from fusionstitching.graph.node import Layout, Node, Shape
from fusionstitching.graph.ops import (
    BINARY_ELEMENTWISE,
    COMPARE_DIRECTIONS,
    OPS,
    REDUCE_KINDS,
    UNARY_ELEMENTWISE,
    DType,
    op_info,
)
from fusionstitching.graph.order import topological
from fusionstitching.graph.text import to_json, to_text


class VerifyError(ValueError):
    """A node whose shape, dtype, operands or attributes break its op's rules."""


class Graph:
    """A static-shape dataflow graph.

    ``nodes`` is in topological order and holds only nodes that reach an output (parameters are
    kept even when unused, since they fix the calling convention). ``mutations`` maps an output
    index to the index of the parameter whose storage that output overwrites.
    """

    def __init__(
        self,
        parameters: Sequence[Node],
        outputs: Sequence[Node | None],
        *,
        name: str = "graph",
        mutations: Mapping[int, int] | None = None,
        output_layouts: Sequence[Layout | None] | None = None,
    ) -> None:
        self.name = name
        self.parameters = list(parameters)
        self.outputs = list(outputs)
        self.mutations = dict(mutations or {})
        self.output_layouts = list(output_layouts) if output_layouts is not None else [None] * len(outputs)
        self.nodes = topological(self.parameters, self.outputs)
        self.origins: dict[str, str] = {}  # node name → where it came from (``GraphBuilder.origin``)
        # Trailing outputs computed only for the checks they run (``transforms.check_indices``), not
        # returned by the compiled graph.
        self.checks = 0

    def __str__(self) -> str:
        return to_text(self)

    def to_json(self) -> str:
        """The graph as JSON (``graph.serialize.from_json`` rebuilds it)."""
        return to_json(self)

    def node(self, name: str) -> Node:
        node = self.index.by_name.get(name)
        if node is None:
            raise KeyError(f"graph {self.name} has no node {name!r}")
        return node

    @functools.cached_property
    def index(self) -> GraphIndex:
        """Positions, names and users of the nodes, computed once: stages that ask many questions
        of one graph (fusion exploration, lowering) need them without rescanning the graph."""
        return GraphIndex.of(self)


@dataclass(frozen=True)
class GraphIndex:
    """Lookups over one graph's nodes: ``position`` in ``Graph.nodes``, ``by_name``, each node's
    distinct ``users`` in graph order, and the ids of the graph's outputs."""

    position: Mapping[Node, int]
    by_name: Mapping[str, Node]
    users: Mapping[Node, tuple[Node, ...]]
    output_ids: frozenset[int]

    @staticmethod
    def of(graph: Graph) -> GraphIndex:
        users: dict[Node, list[Node]] = {node: [] for node in graph.nodes}
        for node in graph.nodes:
            seen: set[int] = set()
            for operand in node.operands:
                if id(operand) not in seen:
                    seen.add(id(operand))
                    users[operand].append(node)
        return GraphIndex(
            position={node: i for i, node in enumerate(graph.nodes)},
            by_name={node.name: node for node in graph.nodes},
            users={node: tuple(u) for node, u in users.items()},
            output_ids=frozenset(id(o) for o in graph.outputs if o is not None),
        )


# ----------------------------------------------------------------------------------------------
# Shape and dtype inference: one rule per op.
# ----------------------------------------------------------------------------------------------


def infer(op: str, operands: Sequence[Node], attrs: Mapping[str, Any], declared: tuple[Shape, DType]):
    """The (shape, dtype) a node of ``op`` must have, or raise ``VerifyError`` with the reason.

    ``declared`` is the node's own shape and dtype; ops whose result is fixed by attributes alone
    (parameter, constant, iota, reshape, convert, broadcast, library, rng) check against it.
    """
    info = op_info(op)
    if info.arity is not None and len(operands) != info.arity:
        raise VerifyError(f"{op} takes {info.arity} operands, found {len(operands)}")
    for key, kind in info.attrs.items():
        if key not in attrs:
            raise VerifyError(f"{op} needs attribute {key!r} ({kind})")
    rule = _RULES.get(op)
    if rule is None:
        rule = _unary if op in UNARY_ELEMENTWISE else _binary
    return rule(op, operands, attrs, declared)


def _same_shapes(op: str, operands: Sequence[Node]) -> None:
    shapes = {x.shape for x in operands}
    if len(shapes) > 1:
        found = ", ".join(f"{x.name}: {list(x.shape)}" for x in operands)
        raise VerifyError(f"{op} operands must have one shape (broadcast explicitly), found {found}")


def _same_dtypes(op: str, operands: Sequence[Node]) -> None:
    dtypes = {x.dtype for x in operands}
    if len(dtypes) > 1:
        found = ", ".join(f"{x.name}: {x.dtype.value}" for x in operands)
        raise VerifyError(f"{op} operands must have one dtype (convert explicitly), found {found}")


def _unary(op, operands, attrs, declared):
    (x,) = operands
    if op == "not" and x.dtype.is_float:
        raise VerifyError(f"not needs a bool or integer operand, found {x.dtype.value}")
    return x.shape, x.dtype


def _binary(op, operands, attrs, declared):
    _same_shapes(op, operands)
    _same_dtypes(op, operands)
    if op in ("and", "or", "xor") and operands[0].dtype.is_float:
        raise VerifyError(f"{op} needs bool or integer operands, found {operands[0].dtype.value}")
    return operands[0].shape, operands[0].dtype


def _compare(op, operands, attrs, declared):
    _same_shapes(op, operands)
    _same_dtypes(op, operands)
    if attrs["direction"] not in COMPARE_DIRECTIONS:
        raise VerifyError(f"compare direction must be one of {COMPARE_DIRECTIONS}, found {attrs['direction']!r}")
    return operands[0].shape, DType.BOOL


def _select(op, operands, attrs, declared):
    pred, on_true, on_false = operands
    _same_shapes(op, operands)
    if pred.dtype != DType.BOOL:
        raise VerifyError(f"select predicate {pred.name} must be bool, found {pred.dtype.value}")
    _same_dtypes(op, [on_true, on_false])
    return on_true.shape, on_true.dtype


def _convert(op, operands, attrs, declared):
    return operands[0].shape, declared[1]


def _reduce(op, operands, attrs, declared):
    (x,) = operands
    dims = tuple(attrs["dims"])
    if attrs["kind"] not in REDUCE_KINDS:
        raise VerifyError(f"reduce kind must be one of {REDUCE_KINDS}, found {attrs['kind']!r}")
    if len(set(dims)) != len(dims) or any(not 0 <= d < len(x.shape) for d in dims):
        raise VerifyError(f"reduce dims {list(dims)} invalid for rank {len(x.shape)}")
    return tuple(s for i, s in enumerate(x.shape) if i not in dims), x.dtype


def _broadcast(op, operands, attrs, declared):
    (x,) = operands
    shape, dims = declared[0], tuple(attrs["broadcast_dimensions"])
    if len(dims) != len(x.shape) or len(set(dims)) != len(dims):
        raise VerifyError(f"broadcast_dimensions {list(dims)} must name {len(x.shape)} distinct dims")
    for i, d in enumerate(dims):
        if not 0 <= d < len(shape) or x.shape[i] not in (1, shape[d]):
            raise VerifyError(f"operand dim {i} (size {x.shape[i]}) cannot broadcast to dim {d} of {list(shape)}")
    return shape, x.dtype


def _reshape(op, operands, attrs, declared):
    (x,) = operands
    if math.prod(declared[0]) != x.size:
        raise VerifyError(f"reshape of {list(x.shape)} to {list(declared[0])} changes the element count")
    return declared[0], x.dtype


def _transpose(op, operands, attrs, declared):
    (x,) = operands
    perm = tuple(attrs["permutation"])
    if sorted(perm) != list(range(len(x.shape))):
        raise VerifyError(f"permutation {list(perm)} is not a permutation of rank {len(x.shape)}")
    return tuple(x.shape[p] for p in perm), x.dtype


def _slice(op, operands, attrs, declared):
    (x,) = operands
    start, limit, stride = (tuple(attrs[k]) for k in ("start", "limit", "stride"))
    if not len(start) == len(limit) == len(stride) == len(x.shape):
        raise VerifyError(f"slice start/limit/stride need {len(x.shape)} entries each")
    shape = []
    for size, lo, hi, st in zip(x.shape, start, limit, stride):
        if not (0 <= lo <= hi <= size and st >= 1):
            raise VerifyError(f"slice [{lo}:{hi}:{st}] out of range for a dim of size {size}")
        shape.append((hi - lo + st - 1) // st)
    return tuple(shape), x.dtype


def _concatenate(op, operands, attrs, declared):
    if not operands:
        raise VerifyError("concatenate needs at least one operand")
    dim = attrs["dimension"]
    first = operands[0]
    if not 0 <= dim < len(first.shape):
        raise VerifyError(f"concatenate dimension {dim} out of range for rank {len(first.shape)}")
    _same_dtypes(op, operands)
    for x in operands:
        if len(x.shape) != len(first.shape) or any(
            a != b for i, (a, b) in enumerate(zip(x.shape, first.shape)) if i != dim
        ):
            raise VerifyError(f"concatenate operand {x.name} {list(x.shape)} does not match {list(first.shape)}")
    shape = list(first.shape)
    shape[dim] = sum(x.shape[dim] for x in operands)
    return tuple(shape), first.dtype


def _pad(op, operands, attrs, declared):
    (x,) = operands
    low, high, interior = (tuple(attrs[k]) for k in ("low", "high", "interior"))
    if not len(low) == len(high) == len(interior) == len(x.shape) or any(i < 0 for i in interior):
        raise VerifyError(f"pad low/high/interior need {len(x.shape)} entries, interior >= 0")
    shape = tuple(lo + hi + s + max(s - 1, 0) * it for s, lo, hi, it in zip(x.shape, low, high, interior))
    if any(s < 0 for s in shape):
        raise VerifyError(f"pad gives a negative size {list(shape)}")
    return shape, x.dtype


def _iota(op, operands, attrs, declared):
    if not 0 <= attrs["dimension"] < len(declared[0]):
        raise VerifyError(f"iota dimension {attrs['dimension']} out of range for {list(declared[0])}")
    if declared[1] == DType.BOOL:
        raise VerifyError("iota cannot be bool")
    return declared


def _gather(op, operands, attrs, declared):
    x, idx = operands
    axis, batch = attrs["axis"], attrs["batch_dims"]
    if idx.dtype not in (DType.I32, DType.I64):
        raise VerifyError(f"gather indices {idx.name} must be i32 or i64, found {idx.dtype.value}")
    if not 0 <= batch <= axis < len(x.shape) or batch > len(idx.shape):
        raise VerifyError(f"gather axis {axis} / batch_dims {batch} invalid for ranks {len(x.shape)}, {len(idx.shape)}")
    if x.shape[:batch] != idx.shape[:batch]:
        raise VerifyError(f"gather batch dims differ: {list(x.shape[:batch])} vs {list(idx.shape[:batch])}")
    return x.shape[:axis] + idx.shape[batch:] + x.shape[axis + 1 :], x.dtype


def _dot_general(op, operands, attrs, declared):
    lhs, rhs = operands
    lb, rb, lc, rc = (tuple(attrs[k]) for k in ("lhs_batch", "rhs_batch", "lhs_contract", "rhs_contract"))
    _same_dtypes(op, operands)
    if len(lb) != len(rb) or len(lc) != len(rc):
        raise VerifyError("dot_general needs as many lhs as rhs batch and contracting dims")
    for a, b, what in [(d, e, "batch") for d, e in zip(lb, rb)] + [(d, e, "contracting") for d, e in zip(lc, rc)]:
        if not (0 <= a < len(lhs.shape) and 0 <= b < len(rhs.shape)) or lhs.shape[a] != rhs.shape[b]:
            raise VerifyError(f"dot_general {what} dims lhs {a} / rhs {b} do not match in {lhs.shape} x {rhs.shape}")
    if len(set(lb + lc)) != len(lb + lc) or len(set(rb + rc)) != len(rb + rc):
        raise VerifyError("dot_general dims repeat")
    lhs_free = [s for i, s in enumerate(lhs.shape) if i not in lb + lc]
    rhs_free = [s for i, s in enumerate(rhs.shape) if i not in rb + rc]
    # A half-type dot may keep its f32 accumulator as its result (XLA's preferred element type):
    # ``graph.transforms.widen_dots`` makes such dots.
    widened = lhs.dtype.is_half and declared[1] == DType.F32
    return tuple([lhs.shape[d] for d in lb] + lhs_free + rhs_free), DType.F32 if widened else lhs.dtype


def _rng(op, operands, attrs, declared):
    """Operands: the seed and offset (i64 scalars) and the stream, an i64 of shape [1] (a kernel
    input, not an inlined constant: the dropouts of a model's layers, which differ only in their
    streams, share one kernel source)."""
    for x, shape in zip(operands, ((), (), (1,))):
        if x.shape != shape or x.dtype != DType.I64:
            raise VerifyError(f"rng_uniform operand {x.name} must be i64{list(shape)}, found {x.dtype.value}{list(x.shape)}")
    if declared[1] not in (DType.F32, DType.F64, DType.F16, DType.BF16):
        raise VerifyError(f"rng_uniform gives floats, declared {declared[1].value}")
    return declared


def _constant(op, operands, attrs, declared):
    value = attrs["value"]
    if not isinstance(value, np.ndarray) or value.shape != declared[0]:
        raise VerifyError(f"constant value must be an array of shape {list(declared[0])}")
    if value.dtype not in [d.numpy for d in DType] or DType.from_numpy(value.dtype) != declared[1]:
        raise VerifyError(f"constant value has dtype {value.dtype}, node declares {declared[1].value}")
    return declared


def _declared(op, operands, attrs, declared):
    return declared


_RULES = {
    "compare": _compare,
    "select": _select,
    "convert": _convert,
    "reduce": _reduce,
    "broadcast_in_dim": _broadcast,
    "reshape": _reshape,
    "transpose": _transpose,
    "slice": _slice,
    "concatenate": _concatenate,
    "pad": _pad,
    "iota": _iota,
    "gather": _gather,
    "dot_general": _dot_general,
    "rng_uniform": _rng,
    "constant": _constant,
    "parameter": _declared,
    "library": _declared,
}
assert set(_RULES) | set(UNARY_ELEMENTWISE) | set(BINARY_ELEMENTWISE) == set(OPS)


def verify(graph: Graph) -> None:
    """Check every node's shape, dtype and attributes; the error names the node, expected vs found."""
    names: set[str] = set()
    for node in graph.nodes:
        if node.name in names:
            raise VerifyError(f"node name {node.name!r} is used twice")
        names.add(node.name)
        try:
            shape, dtype = infer(node.op, node.operands, node.attrs, (node.shape, node.dtype))
        except VerifyError as err:
            raise VerifyError(f"node {node.name} ({node.op}): {err}") from None
        if tuple(shape) != tuple(node.shape) or dtype != node.dtype:
            raise VerifyError(
                f"node {node.name} ({node.op}): expected {dtype.value}{list(shape)}, "
                f"found {node.dtype.value}{list(node.shape)}"
            )
        if node.layout is not None and len(node.layout.strides) != len(node.shape):
            raise VerifyError(f"node {node.name}: layout has {len(node.layout.strides)} strides for rank {len(node.shape)}")
    for i, p in enumerate(graph.parameters):
        if p.op != "parameter" or p.attrs["index"] != i:
            raise VerifyError(f"parameter {i} is node {p.name} ({p.op}, index {p.attrs.get('index')})")
    listed = {id(p) for p in graph.parameters}
    for node in graph.nodes:
        if node.op == "parameter" and id(node) not in listed:
            raise VerifyError(f"node {node.name} is a parameter missing from graph.parameters")
    if len(graph.output_layouts) != len(graph.outputs):
        raise VerifyError(f"{len(graph.output_layouts)} output layouts for {len(graph.outputs)} outputs")
    for i, (out, layout) in enumerate(zip(graph.outputs, graph.output_layouts)):
        if layout is not None and (out is None or len(layout.strides) != len(out.shape)):
            raise VerifyError(f"output {i}: layout {layout} does not fit the output")
    for out, param in graph.mutations.items():
        if not (0 <= out < len(graph.outputs) and 0 <= param < len(graph.parameters)):
            raise VerifyError(f"mutation {out} -> {param} is out of range")
        target, source = graph.parameters[param], graph.outputs[out]
        if source is None or source.shape != target.shape or source.dtype != target.dtype:
            raise VerifyError(f"mutation output {out} does not match parameter {target.name}")


# ----------------------------------------------------------------------------------------------
# Builder
# ----------------------------------------------------------------------------------------------


class GraphBuilder:
    """Makes nodes with inferred shapes and unique names; ``build`` returns the verified Graph."""

    def __init__(self, name: str = "graph") -> None:
        self.name = name
        self.parameters: list[Node] = []
        self._counts: dict[str, int] = {}
        self._used: set[str] = set()
        # Where each node came from (the FX node and ATen op a frontend was converting when it made
        # the node; set ``origin`` before making nodes): named in compile-failure messages.
        self.origin: str | None = None
        self.origins: dict[str, str] = {}

    def unique(self, base: str) -> str:
        """``base``, or ``base_N`` with the smallest N not taken yet."""
        count = self._counts.get(base, 0)
        name = base if count == 0 else f"{base}_{count}"
        while name in self._used:
            count += 1
            name = f"{base}_{count}"
        self._counts[base] = count + 1
        self._used.add(name)
        return name

    def node(
        self,
        op: str,
        operands: Iterable[Node] = (),
        *,
        shape: Sequence[int] | None = None,
        dtype: DType | None = None,
        name: str | None = None,
        layout: Layout | None = None,
        **attrs: Any,
    ) -> Node:
        operands = tuple(operands)
        for key, kind in op_info(op).attrs.items():
            if kind == "ints" and key in attrs:
                attrs[key] = tuple(int(v) for v in attrs[key])
        declared = (tuple(shape) if shape is not None else (), dtype)
        try:
            out_shape, out_dtype = infer(op, operands, attrs, declared)
        except VerifyError as err:
            raise VerifyError(f"building {name or op}: {err}") from None
        if out_dtype is None:
            raise VerifyError(f"building {name or op}: {op} needs an explicit dtype")
        node = Node(self.unique(name or op), op, operands, tuple(out_shape), out_dtype, attrs, layout)
        if self.origin is not None:
            self.origins[node.name] = self.origin
        return node

    def parameter(self, shape: Sequence[int], dtype: DType, name: str | None = None, layout: Layout | None = None) -> Node:
        node = self.node("parameter", shape=shape, dtype=dtype, name=name or "p", layout=layout,
                         index=len(self.parameters))
        self.parameters.append(node)
        return node

    def constant(self, value: Any, dtype: DType, shape: Sequence[int] = ()) -> Node:
        array = np.broadcast_to(np.asarray(value).astype(dtype.numpy), tuple(shape)).copy()
        return self.node("constant", shape=array.shape, dtype=dtype, name="c", value=array)

    def rng_uniform(self, seed: Node, offset: Node, stream: int, shape: Sequence[int], dtype: DType) -> Node:
        """Uniforms in [0, 1) of ``stream`` (its own numbers for one seed and offset); the stream
        is a constant input of shape [1] (``graph._rng``)."""
        return self.node("rng_uniform", [seed, offset, self.constant([stream], DType.I64, (1,))],
                         shape=tuple(shape), dtype=dtype)

    def build(
        self,
        outputs: Sequence[Node | None],
        mutations: Mapping[int, int] | None = None,
        output_layouts: Sequence[Layout | None] | None = None,
    ) -> Graph:
        graph = Graph(self.parameters, outputs, name=self.name, mutations=mutations, output_layouts=output_layouts)
        verify(graph)
        graph.origins = dict(self.origins)
        return graph

    # Convenience constructors for the common ops; everything else goes through ``node``.
    def unary(self, op: str, x: Node) -> Node:
        return self.node(op, [x])

    def binary(self, op: str, x: Node, y: Node) -> Node:
        return self.node(op, [x, y])

    def compare(self, direction: str, x: Node, y: Node) -> Node:
        return self.node("compare", [x, y], direction=direction)

    def select(self, pred: Node, on_true: Node, on_false: Node) -> Node:
        return self.node("select", [pred, on_true, on_false])

    def convert(self, x: Node, dtype: DType) -> Node:
        return x if x.dtype == dtype else self.node("convert", [x], dtype=dtype)

    def reduce(self, x: Node, dims: Sequence[int], kind: str) -> Node:
        return self.node("reduce", [x], dims=tuple(sorted(dims)), kind=kind)

    def broadcast(self, x: Node, shape: Sequence[int], dims: Sequence[int]) -> Node:
        if tuple(shape) == x.shape and tuple(dims) == tuple(range(len(shape))):
            return x
        return self.node("broadcast_in_dim", [x], shape=shape, broadcast_dimensions=tuple(dims))

    def reshape(self, x: Node, shape: Sequence[int]) -> Node:
        return x if tuple(shape) == x.shape else self.node("reshape", [x], shape=shape)

    def transpose(self, x: Node, permutation: Sequence[int]) -> Node:
        if tuple(permutation) == tuple(range(len(x.shape))):
            return x
        return self.node("transpose", [x], permutation=tuple(permutation))

    def iota(self, shape: Sequence[int], dimension: int, dtype: DType) -> Node:
        return self.node("iota", shape=shape, dtype=dtype, dimension=dimension)
