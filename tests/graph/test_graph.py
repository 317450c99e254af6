"""Node, Graph, builder and verifier: shape inference per op and errors that name the node."""

from __future__ import annotations

import numpy as np
import pytest

from fusionstitching.graph.graph import Graph, GraphBuilder, Layout, Node, VerifyError, verify
from fusionstitching.graph.ops import OPS, Category, DType, category


def test_every_op_has_a_category_and_the_design_table_holds():
    assert category("exp") == Category.EXPENSIVE_ELEMENTWISE
    assert category("select") == Category.LIGHT_ELEMENTWISE
    assert category("reduce") == Category.REDUCTION
    assert category("gather") == Category.SHAPE
    assert category("dot_general") == Category.DOT
    assert category("rng_uniform") == Category.RANDOM
    assert category("library") == Category.LIBRARY
    assert all(isinstance(info.category, Category) for info in OPS.values())


def test_builder_infers_shapes():
    b = GraphBuilder("shapes")
    x = b.parameter((2, 3, 4), DType.F32, "x")
    idx = b.parameter((5,), DType.I64, "idx")
    assert b.reduce(x, [2, 0], "sum").shape == (3,)
    assert b.transpose(x, (2, 0, 1)).shape == (4, 2, 3)
    assert b.broadcast(b.reduce(x, [1], "max"), (2, 3, 4), (0, 2)).shape == (2, 3, 4)
    assert b.node("slice", [x], start=(0, 1, 0), limit=(2, 3, 4), stride=(1, 1, 3)).shape == (2, 2, 2)
    assert b.node("gather", [x, idx], axis=1, batch_dims=0).shape == (2, 5, 4)
    assert b.node("concatenate", [x, x], dimension=1).shape == (2, 6, 4)
    assert b.node("pad", [x], low=(1, 0, -1), high=(0, 2, 0), interior=(1, 0, 0), value=0.0).shape == (4, 5, 3)
    y = b.parameter((2, 4, 7), DType.F32, "y")
    dot = b.node("dot_general", [x, y], lhs_batch=(0,), rhs_batch=(0,), lhs_contract=(2,), rhs_contract=(1,))
    assert dot.shape == (2, 3, 7)
    assert b.compare("LT", x, x).dtype == DType.BOOL
    assert b.convert(x, DType.BF16).dtype == DType.BF16


def test_builder_rejects_mismatched_elementwise_operands_naming_them():
    b = GraphBuilder()
    x = b.parameter((2, 3), DType.F32, "x")
    y = b.parameter((3,), DType.F32, "y")
    with pytest.raises(VerifyError, match=r"add operands must have one shape .* x: \[2, 3\], y: \[3\]"):
        b.binary("add", x, y)
    z = b.parameter((2, 3), DType.F16, "z")
    with pytest.raises(VerifyError, match="convert explicitly"):
        b.binary("mul", x, z)


def test_verifier_names_the_node_with_expected_and_found_shape():
    b = GraphBuilder()
    x = b.parameter((4, 8), DType.F32, "x")
    bad = Node("row_sum", "reduce", (x,), (8,), DType.F32, {"dims": (1,), "kind": "sum"})
    graph = Graph([x], [bad])
    with pytest.raises(VerifyError, match=r"node row_sum \(reduce\): expected f32\[4\], found f32\[8\]"):
        verify(graph)


def test_verifier_checks_dtype_and_attributes():
    b = GraphBuilder()
    x = b.parameter((4,), DType.F32, "x")
    wrong_dtype = Node("cmp", "compare", (x, x), (4,), DType.F32, {"direction": "LT"})
    with pytest.raises(VerifyError, match=r"node cmp \(compare\): expected bool\[4\], found f32\[4\]"):
        verify(Graph([x], [wrong_dtype]))
    missing = Node("t", "transpose", (x,), (4,), DType.F32, {})
    with pytest.raises(VerifyError, match=r"node t \(transpose\): transpose needs attribute 'permutation'"):
        verify(Graph([x], [missing]))
    bad_kind = Node("r", "reduce", (x,), (), DType.F32, {"dims": (0,), "kind": "mean"})
    with pytest.raises(VerifyError, match="reduce kind must be one of"):
        verify(Graph([x], [bad_kind]))


def test_verifier_checks_mutations_layouts_and_parameters():
    b = GraphBuilder()
    x = b.parameter((4,), DType.F32, "x")
    y = b.binary("add", x, x)
    with pytest.raises(VerifyError, match="mutation 3 -> 0 is out of range"):
        b.build([y], mutations={3: 0})
    with pytest.raises(VerifyError, match="layout"):
        b.build([y], output_layouts=[Layout((1, 1))])
    stray = Node("p", "parameter", (), (4,), DType.F32, {"index": 1})
    with pytest.raises(VerifyError, match="missing from graph.parameters"):
        verify(Graph([x], [b.binary("add", x, stray)]))
    with pytest.raises(VerifyError, match="constant value has dtype"):
        b.node("constant", shape=(), dtype=DType.F32, value=np.array(1, np.int64))


def test_graph_keeps_topological_order_and_unused_parameters():
    b = GraphBuilder()
    x = b.parameter((3,), DType.F32, "x")
    unused = b.parameter((3,), DType.F32, "unused")
    e = b.unary("exp", x)
    out = b.binary("mul", e, b.unary("neg", e))
    graph = b.build([out, None])
    assert graph.parameters == [x, unused]
    position = {id(n): i for i, n in enumerate(graph.nodes)}
    for node in graph.nodes:
        assert all(position[id(o)] < position[id(node)] for o in node.operands)
    assert graph.outputs[1] is None


def test_layouts():
    assert Layout.contiguous((2, 3, 4)).strides == (12, 4, 1)
    assert Layout((1, 2)).is_contiguous((2, 2)) is False
    assert Layout((4, 1), 0).is_contiguous((1, 4)) is True  # size-1 dims may have any stride
    assert Layout((1, 4), 3).is_contiguous((4, 4)) is False


def test_builder_names_are_unique_even_against_given_names():
    b = GraphBuilder()
    x = b.parameter((2,), DType.F32, "add_1")
    names = {x.name}
    for _ in range(3):
        node = b.binary("add", x, x)
        assert node.name not in names
        names.add(node.name)


def test_nodes_from_constants_and_scalar_parameters_sit_just_before_their_first_user():
    """A dropout mask (random bits from a scalar seed and offset, compared with a constant) that an
    earlier output also needs is placed right before the op that applies it, not where the walk
    from that output met it; the order stays topological."""
    b = GraphBuilder("order")
    x = b.parameter((4, 8), DType.F32, "x")
    seed, offset = b.parameter((), DType.I64, "seed"), b.parameter((), DType.I64, "offset")
    u = b.rng_uniform(seed, offset, 0, shape=(4, 8), dtype=DType.F32)
    keep = b.compare("LT", u, b.broadcast(b.constant(0.9, DType.F32), (4, 8), ()))
    h = b.unary("exp", b.unary("tanh", x))
    dropped = b.select(keep, h, b.broadcast(b.constant(0.0, DType.F32), (4, 8), ()))
    graph = b.build([keep, dropped])  # the saved mask is the first output
    position = graph.index.position
    assert position[u] > position[h] and position[keep] == position[dropped] - 2
    for node in graph.nodes:
        assert all(position[o] < position[node] for o in node.operands)
