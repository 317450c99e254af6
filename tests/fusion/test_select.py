"""The selection ILP of [B §4.1] on hand-made graphs whose best plan is known.

Paper B's Figure 3: two candidate patterns, each acyclic when contracted alone, can close a cycle
when both are contracted (a path leaves one, enters the other and comes back). The selector must
then add the constraint that excludes that pair and solve again.
"""

from __future__ import annotations

import itertools
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fusionstitching.fusion.select import (
    CYCLES_PER_ROUND,
    Selection,
    _PairCycles,
    _tightest,
    closing_pairs,
    contracted_cycle,
    select_ilp,
)
from fusionstitching.graph.graph import GraphBuilder
from fusionstitching.graph.ops import DType

SHAPE = (4, 8)


def _chain(length: int):
    """x → n0 → n1 → ... (unary ops), returning the graph and its non-parameter nodes."""
    b = GraphBuilder("chain")
    x = b.parameter(SHAPE, DType.F32, "x")
    node = x
    for i in range(length):
        node = b.node(("exp", "neg", "abs", "tanh")[i % 4], [node], name=f"n{i}")
    graph = b.build([node])
    return graph, [graph.node(f"n{i}") for i in range(length)]


def _crossed():
    """Figure 3's shape: a1 = exp(x) → b1 = abs(a1) and b2 = neg(x) → a2 = tanh(b2).

    P = {a1, a2} and Q = {b1, b2} each pack two independent ops; contracted together they form the
    cycle P → Q (a1 → b1) → P (b2 → a2). R = {a1, b1} and S = {b2, a2} are the two chains."""
    b = GraphBuilder("crossed")
    x = b.parameter(SHAPE, DType.F32, "x")
    a1 = b.node("exp", [x], name="a1")
    b2 = b.node("neg", [x], name="b2")
    b1 = b.node("abs", [a1], name="b1")
    a2 = b.node("tanh", [b2], name="a2")
    graph = b.build([b1, a2])
    return graph, {"P": [a1, a2], "Q": [b1, b2], "R": [a1, b1], "S": [b2, a2]}


def _diamond():
    """A → B → C plus A → C: {A, C} with B outside contracts into a cycle on its own."""
    b = GraphBuilder("diamond")
    x = b.parameter(SHAPE, DType.F32, "x")
    a = b.node("exp", [x], name="A")
    bb = b.node("neg", [a], name="B")
    c = b.node("add", [a, bb], name="C")
    graph = b.build([c])
    return graph, a, bb, c


def test_overlapping_patterns_the_higher_score_wins():
    graph, (a, b, c) = _chain(3)
    selection = select_ilp(graph, [[a, b], [b, c]], [3.0, 5.0])
    assert selection.chosen == [1]
    assert selection.objective == pytest.approx(5.0)
    assert selection.rounds == 1 and selection.cycle_constraints == []
    assert selection.solver_seconds > 0  # reported in the plan's notes (explore.py)


def test_ilp_is_exact_where_greedy_is_not():
    # Greedy by score takes {a, b, c} (7); the optimum is {a, b} + {c} (8).
    graph, (a, b, c) = _chain(3)
    selection = select_ilp(graph, [[a, b, c], [a, b], [c]], [7.0, 4.0, 4.0])
    assert selection.chosen == [1, 2]
    assert selection.objective == pytest.approx(8.0)
    # Two overlapping pairs plus a leftover single: {b, c} + {a} (6) beats {a, b} + {c} (4).
    selection = select_ilp(graph, [[a, b], [b, c], [c], [a]], [3.0, 5.0, 1.0, 1.0])
    assert selection.chosen == [1, 3]


def test_each_pattern_of_figure_3_is_acyclic_alone_but_not_together():
    graph, p = _crossed()
    assert contracted_cycle(graph, [p["P"]]) is None
    assert contracted_cycle(graph, [p["Q"]]) is None
    assert contracted_cycle(graph, [p["P"], p["Q"]]) == [0, 1]
    assert contracted_cycle(graph, [p["R"], p["S"]]) is None
    assert contracted_cycle(graph, []) is None


def test_cycle_of_two_patterns_gets_a_constraint_and_the_plan_is_acyclic():
    graph, p = _crossed()
    patterns = [p["P"], p["Q"]]
    selection = select_ilp(graph, patterns, [5.0, 4.0])
    assert selection.cycle_constraints == [(0, 1)]
    assert selection.rounds == 2
    assert selection.chosen == [0] and selection.objective == pytest.approx(5.0)
    assert contracted_cycle(graph, [patterns[i] for i in selection.chosen]) is None


def test_the_last_round_breaks_the_cycles_left(monkeypatch):
    """Out of rounds, the last solution is repaired into an acyclic plan (it raised before: a
    1×1 layer norm's backward in f16 needed more than 100 rounds, fuzz 1126102:3902)."""
    from fusionstitching.fusion import select

    monkeypatch.setattr(select, "MAX_CYCLE_ROUNDS", 1)
    graph, p = _crossed()
    patterns = [p["P"], p["Q"]]
    selection = select_ilp(graph, patterns, [5.0, 4.0])
    assert selection.rounds == 1 and selection.repaired == 1
    assert selection.chosen == [0]
    assert contracted_cycle(graph, [patterns[i] for i in selection.chosen]) is None


def test_after_the_cycle_constraint_the_next_best_plan_is_found():
    # P + Q (9) closes a cycle; of the rest, R + S (6) beats P alone (5).
    graph, p = _crossed()
    patterns = [p["P"], p["Q"], p["R"], p["S"]]
    selection = select_ilp(graph, patterns, [5.0, 4.0, 3.0, 3.0])
    assert selection.cycle_constraints == [(0, 1)]
    assert selection.chosen == [2, 3]
    assert selection.objective == pytest.approx(6.0)


def test_a_cycle_is_cut_by_the_pair_of_its_patterns_that_closes_one_alone():
    """Of a cycle through P, Q and a third pattern, P and Q close one by themselves: the constraint
    is "not both P and Q", which also cuts every plan that holds them with other patterns."""
    graph, p = _crossed()
    lone = graph.node("a2").operands[0]  # b2: a pattern of its own, with a1 and b1 in others
    patterns = [[p["P"][0]], [p["Q"][0]], [lone]]
    pairs = _PairCycles(graph)
    assert _tightest([p["P"], p["Q"], [lone]], [0, 1, 2], pairs) == [[0, 1]]
    assert _tightest(patterns, [0, 1, 2], pairs) == [[0, 1, 2]]  # no pair closes one: all three


def test_known_cycles_are_constraints_from_the_first_solve():
    graph, p = _crossed()
    patterns = [p["P"], p["Q"], p["R"], p["S"]]
    fresh = select_ilp(graph, patterns, [5.0, 4.0, 3.0, 3.0])
    seeded = select_ilp(graph, patterns, [5.0, 4.0, 3.0, 3.0], known_cycles=fresh.cycle_constraints)
    assert fresh.rounds == 2 and seeded.rounds == 1
    assert seeded.chosen == fresh.chosen and seeded.cycle_constraints == fresh.cycle_constraints


def test_a_pattern_cyclic_on_its_own_is_excluded():
    graph, a, b, c = _diamond()
    assert contracted_cycle(graph, [[a, c]]) == [0]
    assert contracted_cycle(graph, [[a, b, c]]) is None
    selection = select_ilp(graph, [[a, c], [b, c]], [10.0, 2.0])
    assert selection.cycle_constraints == [(0,)]
    assert selection.chosen == [1]


def test_chain_with_interleaved_patterns():
    # x → a → b → c → d with {a, c} and {b, d}: contracting both makes a cycle (and each alone
    # already has one through the node between its members), so neither can be chosen.
    graph, (a, b, c, d) = _chain(4)
    patterns = [[a, c], [b, d]]
    assert contracted_cycle(graph, patterns) is not None
    selection = select_ilp(graph, patterns, [4.0, 3.0])
    assert selection.cycle_constraints
    assert contracted_cycle(graph, [patterns[i] for i in selection.chosen]) is None
    assert selection.chosen == []
    # With the convex pairs available as well, those are chosen.
    patterns += [[a, b], [c, d]]
    selection = select_ilp(graph, patterns, [4.0, 3.0, 2.0, 2.0])
    assert selection.chosen == [2, 3]


def test_negative_and_zero_scores_are_never_chosen():
    graph, (a, b, c) = _chain(3)
    selection = select_ilp(graph, [[a], [b], [c]], [-1.0, 0.0, 2.0])
    assert selection.chosen == [2]
    selection = select_ilp(graph, [[a, b], [b, c]], [-3.0, -0.5])
    assert selection == Selection([], 0.0, 0)
    assert select_ilp(graph, [], []) == Selection([], 0.0, 0)


def test_selection_is_deterministic():
    graph, p = _crossed()
    patterns = [p["P"], p["Q"], p["R"], p["S"]]
    scores = [3.0, 3.0, 3.0, 3.0]  # ties everywhere
    first = select_ilp(graph, patterns, scores)
    for _ in range(3):
        assert select_ilp(graph, patterns, scores) == first
    assert contracted_cycle(graph, [patterns[i] for i in first.chosen]) is None


def _brute_force(graph, patterns, scores) -> float:
    best = 0.0
    for size in range(1, len(patterns) + 1):
        for subset in itertools.combinations(range(len(patterns)), size):
            nodes = [n for i in subset for n in patterns[i]]
            if len(nodes) != len(set(nodes)) or any(scores[i] <= 0 for i in subset):
                continue
            if contracted_cycle(graph, [patterns[i] for i in subset]) is None:
                best = max(best, sum(scores[i] for i in subset))
    return best


def _random_dag(rng: random.Random, size: int):
    b = GraphBuilder("random")
    nodes = [b.parameter(SHAPE, DType.F32, "x")]
    for i in range(size):
        if i > 0 and rng.random() < 0.5:
            x, y = rng.sample(nodes, 2)
            nodes.append(b.node(rng.choice(["add", "mul", "max"]), [x, y], name=f"v{i}"))
        else:
            nodes.append(b.node(rng.choice(["exp", "neg", "tanh"]), [rng.choice(nodes)], name=f"v{i}"))
    graph = b.build(nodes[1:])
    return graph, [graph.node(f"v{i}") for i in range(size)]


@pytest.mark.parametrize("seed", range(12))
def test_ilp_matches_brute_force_on_random_candidates(seed):
    rng = random.Random(seed)
    graph, nodes = _random_dag(rng, 7)
    patterns = [rng.sample(nodes, rng.randint(1, 3)) for _ in range(9)]
    scores = [round(rng.uniform(-1.0, 5.0), 2) for _ in patterns]
    selection = select_ilp(graph, patterns, scores)
    chosen = [patterns[i] for i in selection.chosen]
    assert len({n for p in chosen for n in p}) == sum(len(p) for p in chosen)  # disjoint
    assert contracted_cycle(graph, chosen) is None
    assert all(scores[i] > 0 for i in selection.chosen)
    assert selection.objective == pytest.approx(sum(scores[i] for i in selection.chosen))
    assert selection.objective == pytest.approx(_brute_force(graph, patterns, scores))
    assert select_ilp(graph, patterns, scores) == selection


def _drawn_dag(data, most: int):
    """A random DAG of 2 to ``most`` neg/add nodes over one or two parameters, every sink an output."""
    g = GraphBuilder("random")
    nodes = [g.parameter([2], DType.F32, name="p") for _ in range(data.draw(st.integers(1, 2)))]
    for _ in range(data.draw(st.integers(2, most))):
        picks = data.draw(st.lists(st.sampled_from(nodes), min_size=1, max_size=2))
        nodes.append(g.node("add" if len(picks) == 2 else "neg", picks))
    used = {id(x) for node in nodes for x in node.operands}
    return g.build([node for node in nodes if id(node) not in used])


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_a_pair_of_acyclic_patterns_closes_a_cycle_exactly_when_each_reaches_the_other(data):
    """On random DAGs, two disjoint node sets that are each acyclic when contracted: the bit-set
    answer (``_PairCycles``) is the contracted graph's, and the search's for a graph too large for
    bit sets."""
    from fusionstitching.graph import analysis

    graph = _drawn_dag(data, 14)
    chosen = data.draw(st.lists(st.sampled_from(graph.nodes), min_size=2, max_size=8, unique_by=id))
    cut = data.draw(st.integers(1, len(chosen) - 1))
    a, b = chosen[:cut], chosen[cut:]
    if analysis.creates_cycle(graph, a) or analysis.creates_cycle(graph, b):
        return  # candidates are acyclic alone
    expected = contracted_cycle(graph, [a, b]) is not None
    assert _PairCycles(graph)(a, b) == expected
    original = analysis.CycleChecker.BITSET_NODES
    try:
        analysis.CycleChecker.BITSET_NODES = 0
        assert _PairCycles(graph)(a, b) == expected
    finally:
        analysis.CycleChecker.BITSET_NODES = original


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_contracted_cycle_answers_as_networkx_and_names_patterns_on_a_cycle(data):
    """Random DAGs and random disjoint patterns: a cycle is found exactly when the contracted graph
    (networkx) has one, and the patterns named close a cycle by themselves."""
    import networkx as nx

    graph = _drawn_dag(data, 16)
    chosen = data.draw(st.lists(st.sampled_from(graph.nodes), min_size=1, max_size=10, unique_by=id))
    cuts = sorted(set(data.draw(st.lists(st.integers(1, len(chosen)), max_size=4))) | {len(chosen)})
    patterns, start = [], 0
    for cut in cuts:
        if cut > start:
            patterns.append(chosen[start:cut])
            start = cut
    group = {node: k for k, pattern in enumerate(patterns) for node in pattern}
    contracted = nx.DiGraph()
    contracted.add_nodes_from(("p", group[n]) if n in group else n for n in graph.nodes)
    for user in graph.nodes:
        for operand in user.operands:
            u = ("p", group[operand]) if operand in group else operand
            v = ("p", group[user]) if user in group else user
            if u != v:
                contracted.add_edge(u, v)
    found = contracted_cycle(graph, patterns)
    assert (found is None) == nx.is_directed_acyclic_graph(contracted)
    if found is not None:
        assert found and contracted_cycle(graph, [patterns[k] for k in found]) is not None


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_closing_pairs_are_the_disjoint_acyclic_pairs_whose_contraction_has_a_cycle(data):
    """On random DAGs and random patterns, each acyclic alone: ``closing_pairs`` names exactly the
    disjoint pairs whose contraction has a cycle, and none for a graph too large for bit sets."""
    from fusionstitching.graph import analysis

    graph = _drawn_dag(data, 14)
    patterns = []
    for _ in range(data.draw(st.integers(2, 7))):
        nodes = data.draw(st.lists(st.sampled_from(graph.nodes), min_size=1, max_size=4, unique_by=id))
        if not analysis.creates_cycle(graph, nodes):
            patterns.append(nodes)
    expected = [(a, b) for a, b in itertools.combinations(range(len(patterns)), 2)
                if not {id(n) for n in patterns[a]} & {id(n) for n in patterns[b]}
                and contracted_cycle(graph, [patterns[a], patterns[b]]) is not None]
    assert closing_pairs(graph, patterns) == expected
    original = analysis.CycleChecker.BITSET_NODES
    try:
        analysis.CycleChecker.BITSET_NODES = 0
        assert closing_pairs(graph, patterns) == []
    finally:
        analysis.CycleChecker.BITSET_NODES = original


def _crossed_layers(count: int):
    """``count`` copies of Figure 3's shape side by side: each copy's P and Q close a cycle."""
    b = GraphBuilder("layers")
    x = b.parameter(SHAPE, DType.F32, "x")
    outputs, patterns = [], []
    for k in range(count):
        a1 = b.node("exp", [x], name=f"a1_{k}")
        b2 = b.node("neg", [x], name=f"b2_{k}")
        b1 = b.node("abs", [a1], name=f"b1_{k}")
        a2 = b.node("tanh", [b2], name=f"a2_{k}")
        outputs += [b1, a2]
        patterns += [[a1, a2], [b1, b2]]
    graph = b.build(outputs)
    return graph, [[graph.node(n.name) for n in p] for p in patterns]


def test_once_a_solve_closes_a_cycle_every_closing_pair_is_a_constraint():
    """More independent copies of a cycle-closing pair than a round's cycle search reports
    (``CYCLES_PER_ROUND``): the first solution holds all of them, the second round has a constraint
    per pair and is acyclic."""
    count = CYCLES_PER_ROUND + 4
    graph, patterns = _crossed_layers(count)
    scores = [5.0, 4.0] * count
    selection = select_ilp(graph, patterns, scores)
    assert selection.rounds == 2
    assert sorted(selection.cycle_constraints) == [(2 * k, 2 * k + 1) for k in range(count)]
    assert selection.chosen == [2 * k for k in range(count)]
    assert contracted_cycle(graph, [patterns[i] for i in selection.chosen]) is None


_HIGHS_SCRIPT = """
import numpy as np, warnings
from scipy.optimize import Bounds, LinearConstraint, milp
from fusionstitching.fusion import select
from fusionstitching.graph.graph import GraphBuilder
from fusionstitching.graph.ops import DType

def probe(threads):  # a solve naming a thread count: None where HiGHS's workers run at another
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return milp(-np.ones(2), integrality=np.ones(2), bounds=Bounds(0, 1), options={"threads": threads}).x

if {first} is not None:
    assert probe({first}) is not None  # another user of HiGHS starts its workers first
b = GraphBuilder("chain")
x = b.parameter([8], DType.F32, "x")
u = b.node("exp", [x])
v = b.node("neg", [u])
w = b.node("abs", [v])
g = b.build([w])
chosen = select.select_ilp(g, [(u, v), (v, w)], [1.0, 2.0]).chosen
assert chosen == [1], chosen
print("threads left", select._THREADS, "one thread", probe(1) is not None)
"""


@pytest.mark.parametrize("first", [None, 3])
def test_the_ilp_runs_on_one_highs_thread_or_on_the_count_another_user_started(first):
    """Selection asks HiGHS for one thread (its default is half the host's CPUs, not this process's);
    where another user of HiGHS in the process started its workers at another count, a solve naming
    a count fails, and selection solves with the running count instead."""
    import os
    import pathlib
    import subprocess
    import sys

    root = pathlib.Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": str(root)}
    done = subprocess.run([sys.executable, "-c", _HIGHS_SCRIPT.replace("{first}", str(first))],
                          check=False, capture_output=True,
                          text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    if first is None:
        assert "threads left {'threads': 1} one thread True" in done.stdout
    else:
        assert "threads left {} one thread False" in done.stdout


def test_a_callers_filter_that_makes_warnings_errors_does_not_fail_the_ilp():
    """milp warns about the ``threads`` option it hands to HiGHS; under a caller's error filter
    (``-W error``, pytest's ``filterwarnings = error``) selection still solves."""
    import warnings

    graph, (a, b, c) = _chain(3)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert select_ilp(graph, [[a, b], [b, c]], [3.0, 5.0]).chosen == [1]
