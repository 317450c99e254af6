"""Plan selection: the ILP of [B §4.1], solved with HiGHS through ``scipy.optimize.milp``.

One binary variable X_i per candidate pattern P_i with a positive score f(P_i):

    maximize    Σ_i f(P_i) X_i
    subject to  Σ_{i : v ∈ P_i} X_i ≤ 1     for every node v covered by two or more candidates

Every candidate is acyclic on its own, but two chosen together can close a cycle (paper B
Figure 3: a path leaves one chosen pattern, passes through another and comes back). After
each solve the contracted graph is checked; for a cycle through chosen patterns P_a..P_k the
constraint X_a + ... + X_k ≤ k − 1 is added and the ILP solved again [B §4.1, Figure 3(c)(d)],
until the contracted graph is a DAG. Each round adds the constraints of up to ``CYCLES_PER_ROUND``
disjoint cycles (the patterns of a cycle found are left out and the contracted graph searched
again): packs of independent kernels can close many cycles at once, and one per solve would take
as many solves. A cycle's constraint is tightened to the pairs of its patterns that close a cycle by
themselves ("not both" cuts many more plans than "not all k"), and the cycles found by an earlier
selection over the same first candidates are constraints from the first solve (``known_cycles``),
which saves most of the solves on graphs of many layers (CHANGELOG.md has the figures). Most cycles
close through two patterns, and a solution shows only the few it holds: after the first solve that
closes a cycle, every pair of candidates that closes one (``closing_pairs``, from the candidates'
descendant and ancestor bit sets) becomes a constraint at once. A selection whose first solution
is acyclic pays nothing for that scan. HiGHS
is deterministic for a given model, the model is built in candidate order, and cycles are walked in
a fixed order, so the plan is the same on every run.

Compile time is bounded: after ``MAX_CYCLE_ROUNDS`` rounds the last solution is made acyclic by
leaving out, cycle after cycle, the lowest-scoring pattern on it (``Selection.repaired`` counts them;
the plan is valid, possibly not optimal). The bound counts rounds, not seconds, so that a plan does
not depend on the speed or the load of the machine (with a bound in seconds, one fuzzer graph got
three different plans in three runs). The project's workloads take one to three rounds; random
graphs of many small independent chains can take dozens.

[Note: one HiGHS thread]
HiGHS's default worker count is half the CPUs the host has online
(``std::thread::hardware_concurrency``), so the same solve runs with another number of workers on
every machine. The selection ILPs are solved at their root node in milliseconds, where workers
bring nothing, so ``_milp`` asks for one thread: the same solver path everywhere. HiGHS fixes its
worker count at its first solve in a process: where another user of HiGHS in the process started
it with another count first, a solve that names a count fails, and ``_milp`` solves again without
one, as it does from then on.
"""

from __future__ import annotations

import bisect
import time
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
from scipy.optimize import Bounds, LinearConstraint, milp
from scipy.sparse import csr_matrix

from fusionstitching.graph.analysis import CycleChecker
from fusionstitching.graph.graph import Graph, Node

_THREADS: dict[str, int] = {"threads": 1}  # emptied once HiGHS refuses the count (see the note)

MAX_CYCLE_ROUNDS = 32
CYCLES_PER_ROUND = 16
MAX_PAIRED_CYCLE = 5  # cycles of up to this many patterns are searched for pairs that close one alone


class SelectionError(RuntimeError):
    pass


@dataclass
class Selection:
    chosen: list[int]  # indices into the candidate list, ascending
    objective: float
    rounds: int
    cycle_constraints: list[tuple[int, ...]] = field(default_factory=list)
    repaired: int = 0  # patterns left out to break cycles once the rounds were spent
    solver_seconds: float = field(default=0.0, compare=False)  # in HiGHS, over the rounds


def select_ilp(graph: Graph, patterns: Sequence[Sequence[Node]], scores: Sequence[float],
               time_limit: float = 30.0,
               known_cycles: Sequence[tuple[int, ...]] = ()) -> Selection:
    """The best set of disjoint, jointly acyclic patterns among those with a positive score.
    ``known_cycles``: sets of candidates (indices) already known to close a cycle together, from an
    earlier selection over a prefix of the same candidates; they are constraints from the first
    solve on (contracting more patterns keeps every path, so such a set closes a cycle in any plan
    that holds it)."""
    usable = [i for i, s in enumerate(scores) if s > 0]
    if not usable:
        return Selection([], 0.0, 0)
    rows, cols = [], []
    covering: dict[Node, list[int]] = {}
    for k, i in enumerate(usable):
        for node in patterns[i]:
            covering.setdefault(node, []).append(k)
    row = 0
    # nodes covered by the same candidates give the same row: one of them is enough
    for ks in dict.fromkeys(tuple(ks) for ks in covering.values() if len(ks) > 1):
        rows += [row] * len(ks)
        cols += ks
        row += 1
    upper = [1.0] * row
    cycles: list[tuple[int, ...]] = []
    position = {i: k for k, i in enumerate(usable)}
    constrained: set[tuple[int, ...]] = set()

    def constrain(members: tuple[int, ...]) -> None:
        """At most ``len(members) - 1`` of these (positions in ``usable``) are chosen."""
        if members not in constrained:
            constrained.add(members)
            cycles.append(members)
            rows.extend([len(upper)] * len(members))
            cols.extend(members)
            upper.append(float(len(members) - 1))

    for known in known_cycles:
        if all(i in position for i in known):  # a pattern with no positive score is never chosen
            constrain(tuple(position[i] for i in known))
    scanned = False  # whether every pair of candidates that closes a cycle is a constraint
    objective = -np.asarray([scores[i] for i in usable], dtype=float)
    pairs = _PairCycles(graph)
    solving = 0.0
    for rounds in range(1, MAX_CYCLE_ROUNDS + 1):
        constraints = []
        if upper:
            matrix = csr_matrix((np.ones(len(rows)), (rows, cols)), shape=(len(upper), len(usable)))
            constraints.append(LinearConstraint(matrix, -np.inf, np.asarray(upper)))
        began = time.perf_counter()
        result = _milp(objective, constraints, time_limit)
        solving += time.perf_counter() - began
        if result.x is None:
            raise SelectionError(f"HiGHS found no plan: {result.message}")
        chosen = [k for k in range(len(usable)) if result.x[k] > 0.5]
        found = _cycles(graph, [patterns[usable[k]] for k in chosen], pairs)
        if not found:
            return Selection(sorted(usable[k] for k in chosen), -float(result.fun), rounds,
                             [tuple(usable[k] for k in c) for c in cycles], solver_seconds=solving)
        if rounds == MAX_CYCLE_ROUNDS:
            kept, _ = break_cycles(graph, patterns, scores, [usable[k] for k in chosen])
            return Selection(sorted(kept), sum(scores[i] for i in kept), rounds,
                             [tuple(usable[k] for k in c) for c in cycles], len(chosen) - len(kept), solving)
        if not scanned:
            # Cycles through two patterns are the usual kind, and each round of solving finds only
            # the few the last solution holds: once there is one, every pair is constrained.
            for pair in closing_pairs(graph, [patterns[i] for i in usable], pairs.checker):
                constrain(pair)
            scanned = True
        for cycle in found:
            constrain(tuple(sorted(chosen[j] for j in cycle)))
    raise AssertionError("unreachable: the last round breaks the cycles left")


def _milp(objective: np.ndarray, constraints: list, time_limit: float):
    """The binary program ``objective`` under ``constraints``, solved by HiGHS on one thread where
    HiGHS's workers are not started yet with another count (see the note on one HiGHS thread)."""
    def solve(threads: dict[str, int]):
        with warnings.catch_warnings():
            # milp hands options it does not know (``threads``) to HiGHS with a RuntimeWarning; a
            # filter of the caller's that turns warnings into errors must not fail the solve
            warnings.filterwarnings("ignore", message="Unrecognized options detected", category=RuntimeWarning)
            return milp(objective, integrality=np.ones(len(objective)), bounds=Bounds(0, 1),
                        constraints=constraints, options={"time_limit": time_limit, **threads})

    result = solve(_THREADS)
    if result.x is None and _THREADS:
        retry = solve({})
        if retry.x is not None:  # HiGHS's workers run at another count: take it from now on
            _THREADS.clear()
        result = retry
    return result


def closing_pairs(graph: Graph, patterns: Sequence[Sequence[Node]], checker: CycleChecker | None = None
                  ) -> list[tuple[int, int]]:
    """The pairs of disjoint patterns (positions in ``patterns``, ascending) that close a cycle when
    both are contracted: each reaches the other. Such a pair needs each pattern's nodes both before
    and after some of the other's, so only patterns whose spans of graph positions overlap are
    tested, by their closures (``CycleChecker.closure``). Empty for a graph too large for bit sets:
    the solve rounds find those cycles instead. ``checker``: the graph's, if made already."""
    checker = checker or CycleChecker(graph)
    closures = [checker.closure(p) for p in patterns]
    if any(c is None for c in closures):
        return []
    position = graph.index.position
    inside = [c.inside for c in closures]
    below = [c.below for c in closures]
    last = [max(position[n] for n in p) for p in patterns]
    first = [min(position[n] for n in p) for p in patterns]
    order = sorted(range(len(patterns)), key=first.__getitem__)
    starts = [first[k] for k in order]
    found = []
    for x, a in enumerate(order):
        # the patterns after ``a`` in this order that start before it ends
        for b in order[x + 1:bisect.bisect_left(starts, last[a], x + 1)]:
            if below[a] & inside[b] and below[b] & inside[a] and not inside[a] & inside[b]:
                found.append((a, b) if a < b else (b, a))
    return sorted(found)


def break_cycles(graph: Graph, patterns: Sequence[Sequence[Node]], scores: Sequence[float], chosen: list[int]
                 ) -> tuple[list[int], list[int]]:
    """``chosen`` (candidate indices) less the lowest-scoring pattern of each cycle of the contracted
    graph (ties: the first candidate), until it is a DAG; and the patterns left out."""
    kept, dropped = list(chosen), []
    while True:
        cycle = contracted_cycle(graph, [patterns[i] for i in kept])
        if cycle is None:
            return kept, dropped
        worst = min((kept[j] for j in cycle), key=lambda i: (scores[i], i))
        kept.remove(worst)
        dropped.append(worst)


class _PairCycles:
    """Whether two disjoint patterns, each acyclic when contracted alone (every candidate is), close a
    cycle together: exactly when each reaches the other, which the graph's descendant bit sets
    (``CycleChecker.reaches``, made at the first question) answer without contracting the graph."""

    def __init__(self, graph: Graph) -> None:
        self.graph = graph
        self._checker: CycleChecker | None = None

    @property
    def checker(self) -> CycleChecker:
        if self._checker is None:
            self._checker = CycleChecker(self.graph)
        return self._checker

    def __call__(self, a: Sequence[Node], b: Sequence[Node]) -> bool:
        return self.checker.reaches(a, b) and self.checker.reaches(b, a)


def _cycles(graph: Graph, patterns: Sequence[Sequence[Node]], pairs: _PairCycles) -> list[list[int]]:
    """Up to ``CYCLES_PER_ROUND`` disjoint cycles of the contracted graph (positions in ``patterns``):
    after each cycle found, its patterns are left out and the rest is searched again."""
    remaining = list(range(len(patterns)))
    found = []
    while len(found) < CYCLES_PER_ROUND:
        cycle = contracted_cycle(graph, [patterns[j] for j in remaining])
        if cycle is None:
            break
        members = [remaining[j] for j in cycle]
        found += _tightest(patterns, members, pairs)
        left_out = set(members)
        remaining = [j for j in remaining if j not in left_out]
    return found


def _tightest(patterns: Sequence[Sequence[Node]], members: list[int], pairs: _PairCycles) -> list[list[int]]:
    """The pairs of a cycle's patterns that close a cycle by themselves, or else the whole cycle: "not
    both of these two" cuts every plan holding the pair, where "not all k" cuts only those holding all
    k (and is implied by the pair's)."""
    if len(members) <= 2 or len(members) > MAX_PAIRED_CYCLE:
        return [members]
    closing = [[a, b] for k, a in enumerate(members) for b in members[k + 1:] if pairs(patterns[a], patterns[b])]
    return closing or [members]


def contracted_cycle(graph: Graph, patterns: Sequence[Sequence[Node]]) -> list[int] | None:
    """The patterns (positions in ``patterns``) on a cycle of the graph contracted by them, or None.

    Kahn's algorithm on the contracted graph; when vertices remain, every one of them has a
    predecessor among the remaining ones, so walking predecessors from any of them closes a cycle.
    Vertices are numbers: pattern ``k`` is ``k``, a node outside the patterns ``len(patterns)`` plus
    its graph position, so the walk's choices (the smallest vertex) take patterns by number, then
    nodes by position: the same plan on every run.
    """
    position = graph.index.position
    count = len(patterns)
    vertex = list(range(count, count + len(graph.nodes)))  # per node position: its vertex
    for k, nodes in enumerate(patterns):
        for node in nodes:
            vertex[position[node]] = k
    size = count + len(graph.nodes)
    successors: list[set[int]] = [set() for _ in range(size)]
    predecessors: list[set[int]] = [set() for _ in range(size)]
    for i, node in enumerate(graph.nodes):
        target = vertex[i]
        for operand in node.operands:
            source = vertex[position[operand]]
            if source != target:
                successors[source].add(target)
                predecessors[target].add(source)
    pending = [len(p) for p in predecessors]
    ready = [v for v in range(size) if not pending[v]]
    while ready:
        for user in successors[ready.pop()]:
            pending[user] -= 1
            if not pending[user]:
                ready.append(user)
    remaining = {v for v in range(size) if pending[v]}
    if not remaining:
        return None
    walk: list[int] = []
    seen: dict[int, int] = {}
    at = min(remaining)
    while at not in seen:
        seen[at] = len(walk)
        walk.append(at)
        at = min(p for p in predecessors[at] if p in remaining)
    return sorted(v for v in walk[seen[at]:] if v < count)
