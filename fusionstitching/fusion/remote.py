"""Remote fusion: kernel packing of non-adjacent patterns through a virtual producer [C §5.2, Figure 5].

Paper C adds "a virtual vertex h as the producer for all vertices and appl[ies] PatternReduction";
the candidate patterns of h are fusions of patterns that are not adjacent in the graph, which the
code generator runs as one kernel by kernel packing [C §4.1]. Here the vertices under h are the
kernels of a selected plan (its patterns and the leftover ops that would be single-op kernels), so
this is a plan-seeded generator like ``NeighbourMerging`` (which fuses *adjacent* patterns) and a
generalization of ``SinkPacking`` (which packs the patterns nothing depends on):

- PatternReduction at h divides h's consumers, in graph order, into two groups recursively down to
  single kernels; a group's candidates are its halves' candidates and every union of one candidate
  of each half, of which the ``REMOTE_TOP_K`` best are kept (ranked by what packing gains: the
  union's score minus its parts', since the parts are already in the plan); every legal union found
  on the way goes to the selector;
- a union is proposed only when its parts are independent (no path from one to another, through
  any nodes: a bitmask of the kernels reachable from each one, so the test is two ``&``); a union of
  independent legal patterns contracts without a cycle, so only the schedule stage is asked;
- only kernels of at most ``REMOTE_MAX_OPS`` ops take part, and unions stay within
  ``REMOTE_MAX_KERNELS`` kernels: packing saves a launch and a kernel's fixed memory time, which
  matters for the small kernels (a partial bias-gradient reduce, an attention head transpose), and
  lowering the union is what exploration time is spent on. Lone reshapes and the shape ops that
  ``plan.finalize`` turns into views are no kernels and stay out.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from fusionstitching.fusion.legality import Legality, Roles, blas_layout
from fusionstitching.fusion.patterns import Candidate, PlanSeeded
from fusionstitching.fusion.score import Scorer, counts_as_kernel
from fusionstitching.graph.graph import Graph, Node
from fusionstitching.graph.ops import VIEW_OPS

REMOTE_MAX_OPS = 8
REMOTE_MAX_KERNELS = 8
REMOTE_TOP_K = 3


@dataclass(frozen=True)
class _Pack:
    units: int  # bitmask of kernels
    reach: int  # bitmask of the kernels reachable from them
    nodes: tuple[Node, ...]
    gain: float  # score of the union minus the scores of its kernels
    parts: float  # the scores of its kernels, summed


class RemoteFusion(PlanSeeded):
    """PatternReduction at a virtual producer of every small kernel of a plan (module docstring)."""

    def __init__(self, graph: Graph, roles: Roles, legality: Legality, seen: set[frozenset[Node]],
                 scorer: Scorer) -> None:
        super().__init__(graph, roles, legality, seen)
        self.scorer = scorer
        self.found: list[Candidate] = []

    def run(self, groups: Sequence[Sequence[Node]]) -> list[Candidate]:
        position = self.graph.index.position
        units = sorted((tuple(g) for g in groups if self._small_kernel(g)), key=lambda g: position[g[0]])
        if len(units) < 2:
            return []
        self.units = units
        self.descendants = self._descendants(units)
        self.found = []
        self.scores = [self._score(u) for u in units]
        self._reduce(0, len(units))
        return self.found

    # -- PatternReduction at h ------------------------------------------------------------------
    def _reduce(self, lo: int, hi: int) -> list[_Pack]:
        if hi - lo == 1:
            return [_Pack(1 << lo, self.descendants[lo], self.units[lo], 0.0, self.scores[lo])]
        mid = (lo + hi) // 2
        left, right = self._reduce(lo, mid), self._reduce(mid, hi)
        packs = left + right
        for a in left:
            for b in right:
                if a.reach & b.units or b.reach & a.units:
                    continue  # a path from one to the other
                union = self._union(a, b)
                if union is not None:
                    packs.append(union)
        packs.sort(key=lambda p: -p.gain)
        return packs[:REMOTE_TOP_K]

    def _union(self, a: _Pack, b: _Pack) -> _Pack | None:
        units = a.units | b.units
        if units.bit_count() > REMOTE_MAX_KERNELS:
            return None
        position = self.graph.index.position
        nodes = tuple(sorted(a.nodes + b.nodes, key=position.__getitem__))
        verdict = self.legality.buildable(list(nodes))  # repeated unions are answered by the cache
        if not verdict:
            return None
        score = self.scorer.score(nodes, verdict.schedule).value
        parts = a.parts + b.parts
        key = frozenset(nodes)
        if key not in self.seen:
            self.seen.add(key)
            self.found.append(Candidate(nodes, verdict, "remote fusion: packing of independent kernels"))
        return _Pack(units, a.reach | b.reach, nodes, score - parts, parts)

    # -- helpers --------------------------------------------------------------------------------
    def _descendants(self, units: Sequence[Sequence[Node]]) -> list[int]:
        """For each kernel, the bitmask of the kernels reachable from it through any nodes."""
        unit_of = {node: k for k, unit in enumerate(units) for node in unit}
        users = self.graph.index.users
        reach: dict[Node, int] = {}
        for node in reversed(self.graph.nodes):
            mask = 0
            for user in users[node]:
                mask |= reach[user]
                k = unit_of.get(user)
                if k is not None:
                    mask |= 1 << k
            reach[node] = mask
        descendants = []
        for k, unit in enumerate(units):
            mask = 0
            for node in unit:
                mask |= reach[node]
            descendants.append(mask & ~(1 << k))
        return descendants

    def _score(self, unit: Sequence[Node]) -> float:
        if len(unit) == 1:
            return 0.0
        verdict = self.legality.buildable(list(unit))
        return self.scorer.score(unit, verdict.schedule if verdict else None).value

    def _small_kernel(self, group: Sequence[Node]) -> bool:
        if sum(1 for n in group if counts_as_kernel(n)) == 0 or len(group) > REMOTE_MAX_OPS:
            return False
        return not (len(group) == 1 and self._becomes_view(group[0]))

    def _becomes_view(self, node: Node) -> bool:
        """A leftover shape op that ``plan.finalize`` may run as a view of a library call's operand."""
        if node.op not in VIEW_OPS or not blas_layout(node):
            return False
        users = self.graph.index.users[node]
        return bool(users) and all(u in self.roles.library or u in self.roles.views or u.op in VIEW_OPS
                                   for u in users)


__all__ = ["REMOTE_MAX_KERNELS", "REMOTE_MAX_OPS", "REMOTE_TOP_K", "RemoteFusion"]
