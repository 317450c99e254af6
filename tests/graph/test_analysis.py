"""Users, orders, work/span layers, dominators and cycle checks of graph/analysis.py."""

from __future__ import annotations

import itertools

import networkx as nx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fusionstitching.graph import analysis
from fusionstitching.graph.graph import Graph, GraphBuilder, Node
from fusionstitching.graph.ops import DType

F32 = DType.F32


def diamond(extra_output: bool = False) -> tuple[Graph, dict[str, Node]]:
    """x -> (a = neg, b = exp) -> c = add -> d = neg; optionally a is an output too."""
    b = GraphBuilder("diamond")
    x = b.parameter([4], F32, name="x")
    a = b.node("neg", [x], name="a")
    e = b.node("exp", [x], name="b")
    c = b.node("add", [a, e], name="c")
    d = b.node("neg", [c], name="d")
    graph = b.build([d, a] if extra_output else [d])
    return graph, {n.name: n for n in graph.nodes}


def spans_graph() -> tuple[Graph, dict[str, Node]]:
    """x -> a -> b -> c -> d, y -> c, a -> d; outputs d and b; z unused."""
    g = GraphBuilder("spans")
    x = g.parameter([4], F32, name="x")
    y = g.parameter([4], F32, name="y")
    g.parameter([4], F32, name="z")
    a = g.node("neg", [x], name="a")
    b = g.node("exp", [a], name="b")
    c = g.node("add", [b, y], name="c")
    d = g.node("mul", [a, c], name="d")
    graph = g.build([d, b])
    return graph, {n.name: n for n in graph.nodes}


def chain() -> tuple[Graph, dict[str, Node]]:
    g = GraphBuilder("chain")
    x = g.parameter([4], F32, name="x")
    a = g.node("neg", [x], name="a")
    b = g.node("exp", [a], name="b")
    c = g.node("abs", [b], name="c")
    side = g.node("sin", [x], name="side")
    graph = g.build([c, side])
    return graph, {n.name: n for n in graph.nodes}


def names(nodes):
    return [n.name for n in nodes]


# ----------------------------------------------------------------------------------------------
# Users and orders
# ----------------------------------------------------------------------------------------------


def test_users_are_distinct_and_in_graph_order():
    g = GraphBuilder()
    x = g.parameter([2], F32, name="x")
    sq = g.node("mul", [x, x], name="sq")
    out = g.node("add", [sq, x], name="out")
    graph = g.build([out])
    found = analysis.users(graph)
    assert {k.name: names(v) for k, v in found.items()} == {"x": ["sq", "out"], "sq": ["out"], "out": []}


def test_topological_order_keeps_a_valid_order():
    graph, _ = spans_graph()
    assert analysis.topological_order(graph) == graph.nodes


def test_topological_order_raises_on_a_cycle():
    graph, n = chain()
    object.__setattr__(n["a"], "operands", (n["c"],))  # hand-made cycle a -> b -> c -> a
    with pytest.raises(ValueError, match="has a cycle through a, b, c"):
        analysis.topological_order(graph)


def test_to_networkx_edges_go_from_operand_to_user():
    graph, _ = diamond()
    digraph = analysis.to_networkx(graph)
    assert set(digraph.nodes) == set(graph.nodes)
    edges = {(u.name, v.name) for u, v in digraph.edges}
    assert edges == {("x", "a"), ("x", "b"), ("a", "c"), ("b", "c"), ("c", "d")}


# ----------------------------------------------------------------------------------------------
# Work / span
# ----------------------------------------------------------------------------------------------


def test_span_layers_by_hand():
    graph, _ = spans_graph()
    span = {k.name: v for k, v in analysis.span_layers(graph).items()}
    # d has no users; c feeds d; b feeds c (and is an output); a feeds b and d; z is unused.
    assert span == {"d": 0, "c": 1, "b": 2, "y": 2, "a": 3, "x": 4, "z": 0}
    assert [names(layer) for layer in analysis.layers(graph)] == [["z", "d"], ["c"], ["y", "b"], ["a"], ["x"]]


def test_work_depth_by_hand():
    graph, _ = spans_graph()
    depth = {k.name: v for k, v in analysis.work_depth(graph).items()}
    assert depth == {"x": 0, "y": 0, "z": 0, "a": 1, "b": 2, "c": 3, "d": 4}


def test_span_decreases_along_every_edge():
    graph, _ = diamond()
    span, depth = analysis.span_layers(graph), analysis.work_depth(graph)
    for node in graph.nodes:
        for operand in node.operands:
            assert span[operand] > span[node] and depth[operand] < depth[node]


# ----------------------------------------------------------------------------------------------
# Dominators
# ----------------------------------------------------------------------------------------------


def _named(mapping):
    return {k.name: (None if v is None else v.name) for k, v in mapping.items()}


def test_dominators_of_a_diamond():
    graph, _ = diamond()
    assert _named(analysis.dominators(graph)) == {"x": None, "a": "x", "b": "x", "c": "x", "d": "c"}


def test_dominators_with_two_sources():
    graph, _ = spans_graph()
    idom = _named(analysis.dominators(graph))
    assert idom["c"] is None  # reached from x and from y
    assert idom["b"] == "a" and idom["a"] == "x" and idom["z"] is None


def test_post_dominators_of_a_diamond():
    graph, _ = diamond()
    assert _named(analysis.post_dominators(graph)) == {"x": "c", "a": "c", "b": "c", "c": "d", "d": None}


def test_an_output_with_users_is_post_dominated_by_the_exit_only():
    graph, _ = diamond(extra_output=True)
    pdom = _named(analysis.post_dominators(graph))
    assert pdom["a"] is None and pdom["x"] is None
    assert pdom["b"] == "c"


# ----------------------------------------------------------------------------------------------
# Cycle checks
# ----------------------------------------------------------------------------------------------


def test_creates_cycle_on_a_chain():
    graph, n = chain()
    assert analysis.creates_cycle(graph, [n["a"], n["c"]])
    assert analysis.creates_cycle(graph, [n["x"], n["c"]])
    assert not analysis.creates_cycle(graph, [n["a"], n["b"]])
    assert not analysis.creates_cycle(graph, [n["a"], n["b"], n["c"]])
    assert not analysis.creates_cycle(graph, [n["b"]])
    assert not analysis.creates_cycle(graph, [])


def test_independent_nodes_do_not_create_a_cycle():
    graph, n = chain()
    assert not analysis.creates_cycle(graph, [n["side"], n["c"]])
    assert not analysis.creates_cycle(graph, [n["side"], n["a"]])
    diamond_graph, m = diamond()
    assert not analysis.creates_cycle(diamond_graph, [m["a"], m["b"]])
    assert analysis.creates_cycle(diamond_graph, [m["a"], m["d"]])


def test_cycle_witness_gives_the_path_outside_the_set():
    graph, n = chain()
    assert names(analysis.cycle_witness(graph, [n["x"], n["c"]])) == ["x", "a", "b", "c"]
    assert names(analysis.cycle_witness(graph, [n["a"], n["c"]])) == ["a", "b", "c"]
    assert analysis.cycle_witness(graph, [n["a"], n["b"]]) is None


def test_cycle_checker_refuses_foreign_nodes():
    graph, _ = chain()
    _, other = diamond()
    with pytest.raises(ValueError, match="node a is not in graph chain"):
        analysis.creates_cycle(graph, [other["a"]])


@st.composite
def dags_and_sets(draw):
    """A random DAG of neg/add nodes over one or two parameters, every sink an output, and a node set."""
    g = GraphBuilder("random")
    nodes = [g.parameter([2], F32, name="p") for _ in range(draw(st.integers(1, 2)))]
    for _ in range(draw(st.integers(1, 14))):
        picks = draw(st.lists(st.sampled_from(nodes), min_size=1, max_size=2))
        op = "add" if len(picks) == 2 else "neg"
        nodes.append(g.node(op, picks))
    used = {id(x) for node in nodes for x in node.operands}
    graph = g.build([node for node in nodes if id(node) not in used])
    chosen = draw(st.lists(st.sampled_from(graph.nodes), max_size=6, unique_by=id))
    return graph, chosen


def _brute_force_cycle(graph: Graph, chosen: list[Node]) -> bool:
    merged = "merged"
    members = set(chosen)
    contracted = nx.DiGraph()
    contracted.add_nodes_from(merged if n in members else n for n in graph.nodes)
    for user in graph.nodes:
        for operand in user.operands:
            u = merged if operand in members else operand
            v = merged if user in members else user
            if u is not v:
                contracted.add_edge(u, v)
    return not nx.is_directed_acyclic_graph(contracted)


@settings(max_examples=300, deadline=None)
@given(dags_and_sets())
def test_creates_cycle_matches_brute_force(case):
    graph, chosen = case
    expected = _brute_force_cycle(graph, chosen)
    assert analysis.creates_cycle(graph, chosen) == expected
    witness = analysis.cycle_witness(graph, chosen)
    assert (witness is not None) == expected
    if witness is not None:
        members = set(chosen)
        assert witness[0] in members and witness[-1] in members
        assert len(witness) >= 3 and not any(n in members for n in witness[1:-1])
        for operand, user in itertools.pairwise(witness):
            assert operand in user.operands


@settings(max_examples=300, deadline=None)
@given(dags_and_sets(), st.integers(0, 6))
def test_the_closure_of_a_union_is_the_or_of_its_parts(case, cut):
    """``Closure``: split a node set in two; the OR of the halves' closures is the whole set's, and
    it contracts into a cycle exactly when the contracted graph has one. No closure for a graph
    too large for bit sets."""
    graph, chosen = case
    checker = analysis.CycleChecker(graph)
    whole = checker.closure(chosen)
    assert (checker.closure(chosen[:cut]) | checker.closure(chosen[cut:])) == whole
    assert whole.contracts_cycle() == _brute_force_cycle(graph, chosen)
    original = analysis.CycleChecker.BITSET_NODES
    try:
        analysis.CycleChecker.BITSET_NODES = 0
        assert analysis.CycleChecker(graph).closure(chosen) is None
    finally:
        analysis.CycleChecker.BITSET_NODES = original


@settings(max_examples=300, deadline=None)
@given(dags_and_sets())
def test_the_bit_sets_answer_as_the_search_does(case):
    """Graphs above ``BITSET_NODES`` nodes are searched every time: both ways give the same answer
    and a path that leaves the set and returns."""
    graph, chosen = case
    with_bits = analysis.CycleChecker(graph)
    original = analysis.CycleChecker.BITSET_NODES
    try:
        analysis.CycleChecker.BITSET_NODES = 0
        searching = analysis.CycleChecker(graph)
    finally:
        analysis.CycleChecker.BITSET_NODES = original
    assert with_bits._below is not None and searching._below is None
    expected = _brute_force_cycle(graph, chosen)
    assert with_bits.creates_cycle(chosen) == searching.creates_cycle(chosen) == expected
    members = set(chosen)
    for witness in (with_bits.witness(chosen), searching.witness(chosen)):
        assert (witness is not None) == expected
        if witness is not None:  # leaves the set and comes back, through nodes outside it
            assert witness[0] in members and witness[-1] in members
            assert len(witness) >= 3 and not any(n in members for n in witness[1:-1])
            for operand, user in itertools.pairwise(witness):
                assert operand in user.operands


def test_pattern_structure_is_names_free_and_tells_scalar_constants_apart():
    """x*0.5+1 and y*0.25+1: one structure up to names, two when scalar values count (kernels
    inline scalar constants, so only equal values may share a kernel)."""
    from fusionstitching.graph.analysis import pattern_structure

    b = GraphBuilder("scalars")
    x, y = b.parameter((64, 32), DType.F32, "x"), b.parameter((64, 32), DType.F32, "y")

    def affine(v, scale):
        s = b.broadcast(b.constant(scale, DType.F32), (64, 32), ())
        one = b.broadcast(b.constant(1.0, DType.F32), (64, 32), ())
        m = b.binary("mul", v, s)
        return [s, one, m, b.binary("add", m, one)]

    first, second, third = affine(x, 0.5), affine(y, 0.25), affine(y, 0.5)
    graph = b.build([first[-1], second[-1], third[-1]])
    assert pattern_structure(graph, first) == pattern_structure(graph, second)
    assert pattern_structure(graph, first, scalar_values=True) != pattern_structure(graph, second, scalar_values=True)
    assert pattern_structure(graph, first, scalar_values=True) == pattern_structure(graph, third, scalar_values=True)


def test_dropout_streams_are_inputs_not_structure_nor_inlined_values():
    """Two dropout masks that differ only in their random stream: one structure, with the scalar
    values too (the stream is an input the kernel reads, ``tests/test_pipeline.py``)."""
    from fusionstitching.graph.analysis import pattern_structure

    b = GraphBuilder("streams")
    seed, offset = b.parameter((), DType.I64, "seed"), b.parameter((), DType.I64, "offset")
    x = b.parameter((64, 32), DType.F32, "x")

    def dropout(stream):
        u = b.rng_uniform(seed, offset, stream, shape=(64, 32), dtype=DType.F32)
        half = b.broadcast(b.constant(0.5, DType.F32), (64, 32), ())
        keep = b.compare("GE", u, half)
        return [u, half, keep, b.select(keep, x, b.broadcast(b.constant(0.0, DType.F32), (64, 32), ()))]

    first, second = dropout(1), dropout(2)
    graph = b.build([first[-1], second[-1]])
    assert pattern_structure(graph, first) == pattern_structure(graph, second)
    assert pattern_structure(graph, first, scalar_values=True) == pattern_structure(graph, second, scalar_values=True)
