"""Span-layer deep fusion: Algorithm 1 of [A §3.2] between library-call layers, with ElementwiseFusion.

Work/Span analysis [A §3.1]: a node nobody uses has span 0, every other node one more than the
largest span of its users; nodes of one span form a *layer* and have no edges between them (an
edge lowers the span by at least one). A layer holding a library call is an *LC-layer*; fusion
never crosses one. Starting at each LC-layer (and at span 0), for every layer up to the next
LC-layer (the *roof*), taken as the *root layer* in order:

1. ElementwiseFusion: the layer's unfused nodes, grouped by output shape and dtype (the schedule
   compatibility of the paper: one group shares an iteration space), are packed into kernels of at
   most ``ELEMENTWISE_MAX_BYTES`` of memory footprint (the paper's tunable threshold against
   "extra large elementwise computations with too many outputs"); a packed group the schedule stage
   cannot build stays single nodes. Nodes of one layer are independent, so no pack has a cycle.
2. Algorithm 1 from each fusion root of the layer (a pack or a single node): for each layer l from
   the root's span + 1 up to the roof − 1 and each unfused node ``hlo`` of that layer, in graph
   order, ``SchdConsistent`` decides: no user of ``hlo`` is in the ``giveup`` set (else a path
   through a given-up node could close a cycle), some user is in the ``fused`` set (producer/
   consumer fusion only; independent nodes are ElementwiseFusion's business), and the schedule stage
   can build ``fused ∪ {hlo}`` (``Legality.buildable``). ``hlo`` joins ``fused`` or ``giveup``.

As in XLA, where the algorithm runs, a fused node is consumed: later roots do not see it, so the
generator's patterns are disjoint and form a plan of their own; each one (and each pack) is
proposed to the selector, which may mix them with other generators' patterns. The giveup rule makes
the pattern acyclic (a path from ``hlo`` back into ``fused`` runs through a user of ``hlo`` whose
span lies in the range walked, which was either fused or given up); the final pattern is checked
for cycles once more, for safety. A node fused by an earlier root counts as given up. Library calls need no such care (they
lie on LC-layers, outside the range walked), nor do views of GEMM operands (they feed only GEMMs).
"""

from __future__ import annotations

from collections.abc import Sequence

from fusionstitching.fusion.legality import Legality, Roles
from fusionstitching.fusion.patterns import Candidate, Rejection
from fusionstitching.graph.graph import Graph, Node

ELEMENTWISE_MAX_BYTES = 64 << 20


def spans(graph: Graph) -> dict[Node, int]:
    """The span of every node: 0 with no users, else one more than its users' largest."""
    users = graph.index.users
    span: dict[Node, int] = {}
    for node in reversed(graph.nodes):
        span[node] = 1 + max((span[u] for u in users[node]), default=-1)
    return span


class DeepFusion:
    """Algorithm 1 of [A §3.2] with ElementwiseFusion (see the module docstring)."""

    def __init__(self, graph: Graph, roles: Roles, legality: Legality, seen: set[frozenset[Node]],
                 footprint: int = ELEMENTWISE_MAX_BYTES) -> None:
        self.graph = graph
        self.roles = roles
        self.legality = legality
        self.seen = seen
        self.footprint = footprint
        self.candidates: list[Candidate] = []
        self.rejections: list[Rejection] = []

    def run(self) -> list[Candidate]:
        span = spans(self.graph)
        fusable = set(self.roles.fusable)
        layers: dict[int, list[Node]] = {}
        for node in self.graph.nodes:
            if node in fusable:
                layers.setdefault(span[node], []).append(node)
        lc_layers = sorted({span[n] for n in self.roles.library})
        top = max(span.values(), default=0) + 1
        fused_anywhere: set[Node] = set()
        for level in sorted(layers):
            roof = next((s for s in lc_layers if s > level), top)
            layer = [n for n in layers[level] if n not in fused_anywhere]
            for root in self._elementwise_fusion(layer):
                if any(n in fused_anywhere for n in root):
                    continue
                fused = self._subgraph_fusion(root, level, roof, layers, fused_anywhere)
                fused_anywhere |= fused
                self._propose(fused, "span-layer deep fusion [A Alg. 1]")
        return self.candidates

    # -- ElementwiseFusion ----------------------------------------------------------------------
    def _elementwise_fusion(self, layer: Sequence[Node]) -> list[list[Node]]:
        """The layer's fusion roots: packs of same-shape nodes within the footprint, and singles."""
        by_shape: dict[tuple, list[Node]] = {}
        for node in layer:
            by_shape.setdefault((node.shape, node.dtype), []).append(node)
        roots: list[list[Node]] = []
        for nodes in by_shape.values():
            pack: list[Node] = []
            size = 0
            for node in nodes:
                footprint = _footprint(node)
                if pack and size + footprint > self.footprint:
                    roots += self._pack(pack)
                    pack, size = [], 0
                pack.append(node)
                size += footprint
            roots += self._pack(pack)
        position = self.graph.index.position
        return sorted(roots, key=lambda r: position[r[0]])

    def _pack(self, pack: list[Node]) -> list[list[Node]]:
        if len(pack) < 2:
            return [pack] if pack else []
        verdict = self.legality.buildable(pack)
        if verdict:
            self._propose(set(pack), "ElementwiseFusion of a span layer [A §3.2]")
            return [pack]
        self.rejections.append(Rejection(tuple(pack), verdict.reason, "ElementwiseFusion"))
        return [[n] for n in pack]

    # -- Algorithm 1 ----------------------------------------------------------------------------
    def _subgraph_fusion(self, root: Sequence[Node], level: int, roof: int, layers: dict[int, list[Node]],
                         fused_anywhere: set[Node]) -> set[Node]:
        users = self.graph.index.users
        fused: set[Node] = set(root)
        giveup: set[Node] = set()
        position = self.graph.index.position
        for span in range(level + 1, roof):
            for hlo in layers.get(span, ()):
                hlo_users = users[hlo]
                if hlo in fused_anywhere or any(u in giveup for u in hlo_users) \
                        or not any(u in fused for u in hlo_users):
                    giveup.add(hlo)
                    continue
                trial = sorted(fused | {hlo}, key=position.__getitem__)
                if self.legality.buildable(trial):
                    fused.add(hlo)
                else:
                    giveup.add(hlo)
        return fused

    def _propose(self, nodes: set[Node], origin: str) -> None:
        if len(nodes) < 2:
            return
        key = frozenset(nodes)
        if key in self.seen:
            return
        self.seen.add(key)
        ordered = sorted(nodes, key=self.graph.index.position.__getitem__)
        verdict = self.legality.check(ordered)
        if verdict:
            self.candidates.append(Candidate(tuple(ordered), verdict, origin))
        else:
            self.rejections.append(Rejection(tuple(ordered), verdict.reason, origin))


def _footprint(node: Node) -> int:
    """Bytes a node reads and writes as its own kernel."""
    operands = {id(o): o for o in node.operands}
    return node.size * node.dtype.itemsize + sum(o.size * o.dtype.itemsize for o in operands.values())


__all__ = ["ELEMENTWISE_MAX_BYTES", "DeepFusion", "spans"]
