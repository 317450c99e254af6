"""Exploratory fusion from seed patterns: Algorithm 2 of [B §4.2.2].

``Explore(graph, seed_pattern)`` puts every fusible producer and consumer of the pattern into
``candidates`` (ProducerExpansion, ConsumerExpansion), and for each candidate op ``p`` records
``fusion = Fuse(seed_pattern, p)`` and explores from ``fusion`` recursively. An op is fusible when
it is an elementwise op, a (small, batched) dot or a reduction — here also a shape op (reshape,
broadcast, transpose, slice...), which the paper's XLA graphs fold into their neighbours but ours
keep as nodes — and fusing it makes no cycle. Differences from the paper's text, each for the
same reason, the size of the search:

- a fusion the schedule stage cannot build is recorded as rejected and not explored further (the
  paper leaves it to the score: "a negative score means we can not generate a kernel");
- a fusion already seen (from this seed or another, or from another generator) is not explored
  again, and patterns stop growing at ``EXPLORE_MAX_OPS`` ops.

Seeds, the paper's two heuristics: single ops with at most ``EXPLORE_MAX_OPERANDS`` (10) operands,
of the elementwise, dot or reduction kinds, with large tensors (an operand or the result at least
``EXPLORE_LARGE_FRACTION`` of the largest fusable tensor of the graph). Substitution fusion stays
the base strategy and this one a supplement, as in the paper.

The time budget: "if the exploration still takes long time, we simply give up further
exploration". Plans must not depend on the speed of the machine, so the budget is counted in
proposals (each is a cycle check and, when acyclic, a schedule check): ``EXPLORE_PER_SEED`` per
seed and ``EXPLORE_BUDGET`` in all; ``seconds`` adds a wall-clock limit for callers who prefer one.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

from fusionstitching.fusion.legality import Legality, Roles
from fusionstitching.fusion.patterns import Candidate, Rejection
from fusionstitching.graph.graph import Graph, Node
from fusionstitching.graph.ops import Category

EXPLORE_MAX_OPERANDS = 10
EXPLORE_LARGE_FRACTION = 1 / 16
EXPLORE_MAX_OPS = 32
EXPLORE_PER_SEED = 24
EXPLORE_BUDGET = 3000

SEED_CATEGORIES = (Category.LIGHT_ELEMENTWISE, Category.EXPENSIVE_ELEMENTWISE, Category.REDUCTION, Category.DOT)
FUSIBLE_CATEGORIES = SEED_CATEGORIES + (Category.SHAPE, Category.RANDOM)


class ExploratoryFusion:
    """Algorithm 2 of [B §4.2.2] from the seeds its heuristics pick (see the module docstring)."""

    def __init__(self, graph: Graph, roles: Roles, legality: Legality, seen: set[frozenset[Node]],
                 budget: int = EXPLORE_BUDGET, seconds: float | None = None) -> None:
        self.graph = graph
        self.roles = roles
        self.legality = legality
        self.seen = seen
        self.budget = budget
        self.deadline = None if seconds is None else time.perf_counter() + seconds
        self.fusible = {n for n in roles.fusable if n.category in FUSIBLE_CATEGORIES}
        self.candidates: list[Candidate] = []
        self.rejections: list[Rejection] = []
        self.proposals = 0

    def seeds(self) -> list[Node]:
        """The paper's seed heuristics: few operands, the right kinds, large tensors."""
        largest = max((n.size for n in self.fusible), default=0)
        threshold = largest * EXPLORE_LARGE_FRACTION
        return [n for n in self.roles.fusable
                if n.category in SEED_CATEGORIES and len(n.operands) <= EXPLORE_MAX_OPERANDS
                and max([n.size] + [o.size for o in n.operands]) >= threshold]

    def run(self) -> list[Candidate]:
        for seed in self.seeds():
            if self._exhausted():
                break
            self._left_for_seed = EXPLORE_PER_SEED
            self._explore((seed,))
        return self.candidates

    def _exhausted(self) -> bool:
        return self.proposals >= self.budget or (self.deadline is not None and time.perf_counter() > self.deadline)

    def _explore(self, pattern: Sequence[Node]) -> None:
        if len(pattern) >= EXPLORE_MAX_OPS:
            return
        for op in self._expansion(pattern):
            if self._left_for_seed <= 0 or self._exhausted():
                return
            fusion = tuple(sorted((*pattern, op), key=self.graph.index.position.__getitem__))
            key = frozenset(fusion)
            if key in self.seen:
                continue
            self.seen.add(key)
            self.proposals += 1
            self._left_for_seed -= 1
            verdict = self.legality.check(fusion)
            if not verdict:
                self.rejections.append(Rejection(fusion, verdict.reason, "exploratory fusion"))
                continue
            self.candidates.append(Candidate(fusion, verdict, "exploratory fusion [B Alg. 2]"))
            self._explore(fusion)

    def _expansion(self, pattern: Sequence[Node]) -> list[Node]:
        """ProducerExpansion and ConsumerExpansion: the fusible neighbours of the pattern, in graph order."""
        members = set(pattern)
        users = self.graph.index.users
        found: dict[Node, None] = {}
        for node in pattern:
            for operand in node.operands:
                if operand in self.fusible and operand not in members:
                    found[operand] = None
            for user in users[node]:
                if user in self.fusible and user not in members:
                    found[user] = None
        return sorted(found, key=self.graph.index.position.__getitem__)


__all__ = ["EXPLORE_BUDGET", "EXPLORE_MAX_OPERANDS", "EXPLORE_PER_SEED", "ExploratoryFusion"]
