"""Shared-memory planning of schedule/smem.py: liveness, space sharing, shrinking, infeasibility."""

from __future__ import annotations

import itertools

import networkx as nx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fusionstitching.graph.graph import Graph, GraphBuilder
from fusionstitching.graph.ops import DType
from fusionstitching.schedule.smem import (
    Infeasible,
    SmemPlan,
    SmemRequest,
    _Flow,
    plan_shared_memory,
    side_by_side,
)

F32 = DType.F32


def compute_nodes(graph: Graph):
    return [n for n in graph.nodes if n.op != "parameter"]


def chain() -> Graph:
    """x -> a = exp -> b = neg -> c = exp -> d = neg (output)."""
    g = GraphBuilder("chain")
    x = g.parameter([64], F32, name="x")
    a = g.node("exp", [x], name="a")
    b = g.node("neg", [a], name="b")
    c = g.node("exp", [b], name="c")
    d = g.node("neg", [c], name="d")
    return g.build([d])


def diamond() -> Graph:
    """x -> (a = exp, b = log) -> c = add -> d = neg (output)."""
    g = GraphBuilder("diamond")
    x = g.parameter([64], F32, name="x")
    a = g.node("exp", [x], name="a")
    b = g.node("log", [x], name="b")
    c = g.node("add", [a, b], name="c")
    d = g.node("neg", [c], name="d")
    return g.build([d])


def three_exps() -> Graph:
    """x -> e1, e2, e3 (exp) -> s = e1 + e2 -> out = s + e3: all three live at the adds."""
    g = GraphBuilder("three")
    x = g.parameter([64], F32, name="x")
    e1 = g.node("exp", [x], name="e1")
    e2 = g.node("exp", [x], name="e2")
    e3 = g.node("exp", [x], name="e3")
    s = g.node("add", [e1, e2], name="s")
    out = g.node("add", [s, e3], name="out")
    return g.build([out])


def softmax() -> Graph:
    g = GraphBuilder("softmax")
    x = g.parameter([8, 64], F32, name="x")
    m = g.reduce(x, [1], "max")
    sub = g.binary("sub", x, g.broadcast(m, (8, 64), (0,)))
    e = g.unary("exp", sub)
    s = g.reduce(e, [1], "sum")
    out = g.binary("div", e, g.broadcast(s, (8, 64), (0,)))
    return g.build([out])


def packed() -> Graph:
    """Two unrelated branches, computed in this order: sum = reduce(x) -> e1 = exp -> out1 = neg;
    max = reduce(y) -> out2 = neg."""
    g = GraphBuilder("packed")
    x = g.parameter([8, 64], F32, name="x")
    y = g.parameter([8, 64], F32, name="y")
    r1 = g.node("reduce", [x], dims=(1,), kind="sum", name="sum")
    e1 = g.node("exp", [r1], name="e1")
    out1 = g.node("neg", [e1], name="out1")
    r2 = g.node("reduce", [y], dims=(1,), kind="max", name="max")
    out2 = g.node("neg", [r2], name="out2")
    return g.build([out1, out2])


def plan(graph: Graph, sizes: dict[str, int], limit: int = 48 * 1024, costs=None, **kw):
    costs = costs or {}
    requests = [SmemRequest(name, size, costs.get(name, 1.0)) for name, size in sizes.items()]
    return plan_shared_memory(graph, compute_nodes(graph), requests, limit, **kw)


# ----------------------------------------------------------------------------------------------


def test_chain_shares_when_the_middle_is_cached():
    result = plan(chain(), {"a": 1024, "b": 512, "c": 2048})
    assert isinstance(result, SmemPlan)
    assert [(b.name, b.bytes, b.sharers) for b in result.buffers] == [
        ("smem0", 2048, ("a", "c")),
        ("smem1", 512, ("b",)),
    ]
    assert result.placement == {"a": "smem0", "c": "smem0", "b": "smem1"}
    assert result.buffers[1].offset == 2048 and result.total_bytes == 2560


def test_chain_without_the_middle_cached_keeps_a_live_at_c():
    # b is recomputed inside c's group and reads a there, so a is still live when c is written.
    result = plan(chain(), {"a": 1024, "c": 2048})
    assert [b.sharers for b in result.buffers] == [("a",), ("c",)]


def test_diamond_branches_live_at_the_join_do_not_share():
    result = plan(diamond(), {"a": 256, "b": 256, "c": 256})
    assert [b.sharers for b in result.buffers] == [("a",), ("b",), ("c",)]
    assert [b.offset for b in result.buffers] == [0, 256, 512]


def test_unrelated_requests_share_after_a_barrier():
    graph = packed()
    result = plan(graph, {"sum": 32, "e1": 32, "max": 64})
    assert [b.sharers for b in result.buffers] == [("sum", "max"), ("e1",)]
    assert result.buffers[0].bytes == 64


def test_a_reader_recomputed_later_keeps_the_buffer_live():
    # b = neg(a) is not cached: out recomputes it at the end, reading a there. r's barrier after b's
    # own position must not free a's space for q.
    g = GraphBuilder("late")
    x = g.parameter([64], F32, name="x")
    y = g.parameter([64], F32, name="y")
    a = g.node("exp", [x], name="a")
    b = g.node("neg", [a], name="b")
    r = g.node("exp", [y], name="r")
    q = g.node("log", [y], name="q")
    graph = g.build([g.node("add", [b, g.node("add", [r, q], name="s")], name="out")])
    assert [n.name for n in compute_nodes(graph)] == ["a", "b", "r", "q", "s", "out"]
    result = plan(graph, {"a": 64, "r": 64, "q": 64})
    assert [b.sharers for b in result.buffers] == [("a",), ("r",), ("q",)]


def test_no_sharing_without_a_barrier_after_the_last_reader():
    # out1 reads sum (through e1, inline) and writes only global memory: no barrier before max.
    result = plan(packed(), {"sum": 32, "max": 64})
    assert [b.sharers for b in result.buffers] == [("sum",), ("max",)]


def test_softmax_keeps_the_papers_dominance_test():
    # The sum does not post-dominate the max (exp also reaches the divide), so no sharing.
    graph = softmax()
    result = plan(graph, {"reduce": 32, "exp": 2048, "reduce_1": 32})
    assert len(result.buffers) == 3


def test_offsets_are_16_byte_aligned():
    result = plan(diamond(), {"a": 100, "b": 36, "c": 8})
    assert [(b.offset, b.bytes) for b in result.buffers] == [(0, 100), (112, 36), (160, 8)]
    assert result.total_bytes == 168
    assert all(b.offset % 16 == 0 for b in result.buffers)


def test_no_requests_give_an_empty_plan():
    result = plan(chain(), {})
    assert result and result.buffers == () and result.total_bytes == 0 and result.placement == {}


def test_over_the_limit_recomputes_the_cheapest():
    sizes = {"e1": 1024, "e2": 1024, "e3": 1024}
    costs = {"e1": 5.0, "e2": 1.0, "e3": 3.0}
    assert plan(three_exps(), sizes, limit=4096, costs=costs).recomputed == ()
    result = plan(three_exps(), sizes, limit=2048, costs=costs)
    assert result.recomputed == ("e2",)
    assert set(result.placement) == {"e1", "e3"} and result.total_bytes == 2048
    kept = plan(three_exps(), sizes, limit=2048, costs=costs, must_keep={"e2"})
    assert kept.recomputed == ("e3",)


def test_shrinking_follows_the_papers_classes_before_cost():
    # c (light elementwise) goes before a and b (expensive), even though it costs more.
    result = plan(diamond(), {"a": 256, "b": 256, "c": 256}, limit=600, costs={"a": 1.0, "b": 2.0, "c": 9.0})
    assert result.recomputed == ("c",)
    g = GraphBuilder("mixed")
    x = g.parameter([64], F32, name="x")
    light = g.node("neg", [x], name="light")
    heavy = g.node("exp", [x], name="heavy")
    graph = g.build([g.node("add", [light, heavy], name="out")])
    result = plan(graph, {"light": 64, "heavy": 64}, limit=64, costs={"light": 9.0, "heavy": 1.0})
    assert result.recomputed == ("light",)


def test_infeasible_names_buffers_bytes_total_and_limit():
    sizes = {"e1": 1024, "e2": 1024, "e3": 1024}
    result = plan(three_exps(), sizes, limit=1000, must_keep={"e1", "e3"})
    assert isinstance(result, Infeasible) and not result
    assert str(result) == result.reason
    assert result.reason == (
        "shared memory: needs 2048 bytes (smem0 1024: e1; smem1 1024: e3) over the 1000-byte limit, "
        "even after recomputing e2; the rest must stay in shared memory"
    )
    assert result.limit_bytes == 1000 and len(result.requests) == 3
    strict = plan(three_exps(), sizes, limit=1000, allow_recompute=False)
    assert "needs 3072 bytes" in strict.reason and "recomputation not allowed" in strict.reason


def test_plan_prints_a_table():
    result = plan(chain(), {"a": 1024, "b": 512, "c": 2048}, limit=4096)
    text = str(result)
    assert text.splitlines()[0].split() == ["buffer", "offset", "bytes", "sharers"]
    assert "smem0" in text and "2048  a, c" in text and "smem1" in text and "512  b" in text
    assert "recomputed: none" in text and "total 2560 of 4096 bytes" in text
    assert bool(result) is True


def test_bad_requests_are_rejected():
    with pytest.raises(ValueError, match="not in the pattern"):
        plan(chain(), {"x": 4})
    with pytest.raises(ValueError, match="two shared-memory requests for a"):
        graph = chain()
        plan_shared_memory(graph, compute_nodes(graph), [SmemRequest("a", 4)] * 2, 64)


# ----------------------------------------------------------------------------------------------
# Property: no two simultaneously live requests share; the plan fits.
# ----------------------------------------------------------------------------------------------


@st.composite
def random_cases(draw):
    g = GraphBuilder("random")
    nodes = [g.parameter([4], F32, name="p0"), g.parameter([4], F32, name="p1")]
    for i in range(draw(st.integers(2, 16))):
        op = draw(st.sampled_from(["exp", "neg", "add", "mul"]))
        arity = 2 if op in ("add", "mul") else 1
        operands = [nodes[draw(st.integers(0, len(nodes) - 1))] for _ in range(arity)]
        nodes.append(g.node(op, operands, name=f"n{i}"))
    computed = nodes[2:]
    outputs = [n for n in computed if draw(st.integers(0, 3)) == 0] or [computed[-1]]
    graph = g.build(outputs)
    pattern = [n for n in compute_nodes(graph) if draw(st.integers(0, 9)) > 0] or compute_nodes(graph)
    requests = [
        SmemRequest(n.name, draw(st.integers(0, 3000)), draw(st.floats(0.0, 10.0)))
        for n in pattern
        if draw(st.integers(0, 2)) > 0
    ]
    must_keep = {r.node for r in requests if draw(st.integers(0, 3)) == 0}
    limit = draw(st.one_of(st.integers(0, 12000), st.just(1 << 20)))
    return graph, pattern, requests, limit, draw(st.booleans()), must_keep


def read_positions(graph, pattern, cached, name):
    """Positions at which request ``name`` is read, walking through non-cached pattern nodes."""
    position = {n.name: i for i, n in enumerate(n for n in graph.nodes if n in set(pattern))}
    flow = nx.DiGraph()
    flow.add_nodes_from(position)
    for n in pattern:
        for x in n.operands:
            if x.name in position and (x.name == name or x.name not in cached):
                flow.add_edge(x.name, n.name)
    return position, [position[d] for d in nx.descendants(flow, name)]


@settings(max_examples=400, deadline=None)
@given(random_cases())
def test_plan_never_shares_live_requests_and_fits(case):
    graph, pattern, requests, limit, allow, must_keep = case
    result = plan_shared_memory(graph, pattern, requests, limit, allow_recompute=allow, must_keep=must_keep)
    sizes = {r.node: r.bytes for r in requests}
    if not result:
        assert f"over the {limit}-byte limit" in result.reason
        return
    assert result.total_bytes <= limit
    assert set(result.recomputed).isdisjoint(must_keep)
    assert allow or not result.recomputed
    assert set(result.placement) | set(result.recomputed) == set(sizes)
    cached = set(result.placement)
    end = 0
    for buffer in result.buffers:
        assert buffer.offset % 16 == 0 and buffer.offset >= end
        assert buffer.bytes == max(sizes[s] for s in buffer.sharers)
        end = buffer.offset + buffer.bytes
        intervals = []
        for sharer in buffer.sharers:
            position, reads = read_positions(graph, pattern, cached, sharer)
            intervals.append((position[sharer], max(reads, default=position[sharer])))
        for (start_a, last_a), (start_b, _) in itertools.pairwise(intervals):
            assert last_a < start_b  # dead before the next sharer is defined
            barrier = [position[c] for c in cached if last_a <= position[c] < start_b]
            assert barrier, f"no barrier between {buffer.sharers}"
    assert result.total_bytes == end


@settings(max_examples=200, deadline=None)
@given(random_cases())
def test_requests_that_fit_side_by_side_are_planned_without_recomputation(case):
    """The probe lowering of ``feasible`` skips planning when the requests fit unshared; that is
    sound only if the planner then fits them too, recomputing nothing."""
    graph, pattern, requests, limit, allow, must_keep = case
    unshared = side_by_side(requests, limit)
    if unshared is None:
        assert sum(-(-r.bytes // 16) * 16 for r in requests) > limit
        return
    assert unshared.total_bytes <= limit and sorted(unshared.placement) == sorted(r.node for r in requests)
    planned = plan_shared_memory(graph, pattern, requests, limit, allow_recompute=allow, must_keep=must_keep)
    assert planned and not planned.recomputed and planned.total_bytes <= limit


@settings(max_examples=200, deadline=None)
@given(random_cases())
def test_post_dominator_tree_matches_networkx_dominators(case):
    """``_Flow.idom`` (nearest common ancestors in reverse topological order) is the dominator tree
    that ``networkx.immediate_dominators`` gives on the reversed pattern graph with its entry."""
    graph, pattern, *_ = case
    flow = _Flow(graph, pattern)
    reversed_graph = nx.DiGraph()
    reversed_graph.add_node(flow.root)
    reversed_graph.add_nodes_from(flow.nodes)
    reversed_graph.add_edges_from((u, name) for name in flow.nodes for u in flow.users[name])
    reversed_graph.add_edges_from((flow.root, name) for name in flow.leaves)
    expected = nx.immediate_dominators(reversed_graph, flow.root)
    assert flow.idom == {name: expected[name] for name in flow.nodes}
    for name in flow.nodes:
        assert flow.descendants(name) == nx.descendants(reversed_graph.reverse(), name) - {flow.root}
