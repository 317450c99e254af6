"""Approximate dynamic programming over fusion patterns: PatternReduction [C §5.2, Figure 4].

The candidate patterns of a vertex V_i are patterns whose producer (most upstream node) is V_i.
They are made in post-order, from the last node of a topological order to the first, so that the
candidate patterns of every consumer exist when V_i is reached:

    P_i = PatternReduction(C_i)          C_i: the consumers of V_i

PatternReduction appends V_i to combinations of its consumers' candidate patterns, and keeps the
top ``DP_TOP_K`` (k = 3 in the paper) by the score f. Enumerating the combinations over all
consumers at once is exponential, so the consumers are divided into groups: for a group of at most
``DP_GROUP`` consumers every combination is enumerated (for each consumer: nothing, the consumer
alone, or one of its candidate patterns — in the paper's example two consumers with three
patterns each give 15 non-empty combinations, here 24 with the consumers alone), V_i is appended
and the top k kept; a larger group is halved recursively, and a group's top k are the top k of its
halves' results. The candidates of all groups compete for V_i's top k.

Every pattern is checked like any other (``Legality.check``: cycles [C Figure 6] and the schedule
stage, so only patterns the code generator can build are kept). Lowering is the expensive part,
so a group's combinations are first ranked by the score without the latency penalty (no schedule
is needed for it) and checked in that order until k are legal or ``DP_MAX_CHECKS`` were tried;
patterns above ``DP_MAX_OPS`` ops are not formed. Every legal pattern found goes to the selector,
not only the top k of each vertex.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

from fusionstitching.fusion.legality import Legality, Roles, Verdict
from fusionstitching.fusion.patterns import Candidate
from fusionstitching.fusion.score import Scorer
from fusionstitching.graph.graph import Graph, Node

DP_TOP_K = 3
DP_GROUP = 2
DP_MAX_CHECKS = 6
DP_MAX_OPS = 64

Pattern = tuple[float, frozenset[Node]]  # (score, nodes)


class PatternReduction:
    """Candidate patterns of every fusable vertex by PatternReduction (see the module docstring)."""

    def __init__(self, graph: Graph, roles: Roles, legality: Legality, seen: set[frozenset[Node]],
                 scorer: Scorer, top_k: int = DP_TOP_K) -> None:
        self.graph = graph
        self.roles = roles
        self.legality = legality
        self.seen = seen
        self.scorer = scorer
        self.top_k = top_k
        self.candidates: list[Candidate] = []
        self.patterns: dict[Node, list[Pattern]] = {}  # a vertex's top k, best first
        self._verdicts: dict[frozenset[Node], Verdict] = {}

    def run(self) -> list[Candidate]:
        fusable = set(self.roles.fusable)
        users = self.graph.index.users
        for vertex in reversed(self.roles.fusable):
            consumers = list(dict.fromkeys(u for u in users[vertex] if u in fusable))
            self.patterns[vertex] = self._reduce(vertex, consumers) if consumers else []
        return self.candidates

    def _reduce(self, vertex: Node, consumers: Sequence[Node]) -> list[Pattern]:
        if len(consumers) <= DP_GROUP:
            return self._combine(vertex, consumers)
        half = (len(consumers) + 1) // 2  # [V5, V6, V7] -> [V5, V6], [V7] as in Figure 4
        merged = self._reduce(vertex, consumers[:half]) + self._reduce(vertex, consumers[half:])
        return _top(merged, self.top_k)

    def _combine(self, vertex: Node, consumers: Sequence[Node]) -> list[Pattern]:
        """V_i appended to every combination of its consumers' options; the top k legal ones."""
        options = [[frozenset(), frozenset((c,))] + [nodes for _, nodes in self.patterns[c]] for c in consumers]
        unions: dict[frozenset[Node], None] = {}
        for parts in itertools.product(*options):
            union = frozenset((vertex,)).union(*parts)
            if len(union) >= 2 and len(union) <= DP_MAX_OPS:
                unions[union] = None
        position = self.graph.index.position
        ordered = {u: sorted(u, key=position.__getitem__) for u in unions}
        ranked = sorted(unions, key=lambda u: -self.scorer.score(ordered[u], None).value)
        found: list[Pattern] = []
        for union in ranked[:DP_MAX_CHECKS]:
            verdict = self._check(union, ordered[union])
            if verdict:
                found.append((self.scorer.score(ordered[union], verdict.schedule).value, union))
                if len(found) == self.top_k:
                    break
        return _top(found, self.top_k)

    def _check(self, union: frozenset[Node], nodes: list[Node]) -> Verdict:
        verdict = self._verdicts.get(union)
        if verdict is None:
            verdict = self.legality.check(nodes)
            self._verdicts[union] = verdict
            if verdict and union not in self.seen:
                self.seen.add(union)
                self.candidates.append(Candidate(tuple(nodes), verdict, "approximate-DP PatternReduction"))
        return verdict


def _top(patterns: list[Pattern], k: int) -> list[Pattern]:
    """The k best distinct patterns, best first (ties in the order found)."""
    unique: dict[frozenset[Node], float] = {}
    for score, nodes in patterns:
        unique.setdefault(nodes, score)
    ranked = sorted(unique.items(), key=lambda item: -item[1])
    return [(score, nodes) for nodes, score in ranked[:k]]


__all__ = ["DP_GROUP", "DP_MAX_CHECKS", "DP_MAX_OPS", "DP_TOP_K", "PatternReduction"]
