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
for cycles once more, for safety. A node fused by an earlier root counts as given up. Library calls
need no such care (they lie on LC-layers, outside the range walked), nor do views of GEMM operands
(they feed only GEMMs).

Cost. The walk visits only the producers of the fused set (the others would land in ``giveup``,
which the test "every fusable user inside the range is fused" reproduces), and the producers one
layer admits are checked together first, one at a time only when the schedule stage refuses them
together. Patterns (packs included) stop at ``DEEP_MAX_OPS`` ops: without library calls (an
optimizer step of hundreds of independent updates) the range is the whole graph, and each check
lowers the whole pattern.
"""

from __future__ import annotations

from collections.abc import Sequence

from fusionstitching.fusion.legality import Legality, Roles
from fusionstitching.fusion.patterns import Candidate, Rejection, first_proposal
from fusionstitching.graph.graph import Graph, Node

ELEMENTWISE_MAX_BYTES = 64 << 20
DEEP_MAX_OPS = 64


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
                 footprint: int = ELEMENTWISE_MAX_BYTES, max_ops: int = DEEP_MAX_OPS) -> None:
        self.graph = graph
        self.roles = roles
        self.legality = legality
        self.seen = seen
        self.footprint = footprint
        self.max_ops = max_ops
        self.fusable = set(roles.fusable)
        self.candidates: list[Candidate] = []
        self.rejections: list[Rejection] = []

    def run(self) -> list[Candidate]:
        span = spans(self.graph)
        layers: dict[int, list[Node]] = {}
        for node in self.graph.nodes:
            if node in self.fusable:
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
                fused = self._subgraph_fusion(root, level, roof, span, fused_anywhere)
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
                if pack and (size + footprint > self.footprint or len(pack) == self.max_ops):
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
    def _subgraph_fusion(self, root: Sequence[Node], level: int, roof: int, span: dict[Node, int],
                         fused_anywhere: set[Node]) -> set[Node]:
        """Algorithm 1 from ``root`` (see the module docstring), walking only the producers of the fused
        set: a node of the range with no user in ``fused`` lands in ``giveup`` in the paper, so a
        producer passes the giveup test exactly when each of its fusable users inside the range is in
        ``fused``. The producers a layer admits are tried together first (one schedule check), then
        one at a time when the schedule stage refuses them together."""
        users = self.graph.index.users
        fusable = self.fusable
        position = self.graph.index.position
        fused: set[Node] = set(root)
        frontier: dict[int, set[Node]] = {}
        for node in root:
            self._push_operands(node, frontier, span, level, roof)
        while frontier and len(fused) < self.max_ops:
            layer = min(frontier)
            admitted = []
            for hlo in sorted(frontier.pop(layer), key=position.__getitem__):
                if hlo in fused_anywhere or hlo in fused:
                    continue
                inside = [u for u in users[hlo] if u in fusable and level < span[u] < roof]
                if all(u in fused for u in inside):
                    admitted.append(hlo)
            admitted = admitted[: self.max_ops - len(fused)]
            if not admitted:
                continue
            if len(admitted) > 1 and self.legality.buildable(sorted(fused.union(admitted), key=position.__getitem__)):
                accepted = admitted
            else:
                accepted = []
                for hlo in admitted:
                    trial = sorted(fused.union(accepted, (hlo,)), key=position.__getitem__)
                    if self.legality.buildable(trial):
                        accepted.append(hlo)
            fused.update(accepted)
            for hlo in accepted:
                self._push_operands(hlo, frontier, span, level, roof)
        return fused

    def _push_operands(self, node: Node, frontier: dict[int, set[Node]], span: dict[Node, int], level: int,
                       roof: int) -> None:
        for operand in node.operands:
            if operand in self.fusable and level < span[operand] < roof:
                frontier.setdefault(span[operand], set()).add(operand)

    def _propose(self, nodes: set[Node], origin: str) -> None:
        """``check``, cycles included: a deep pattern spans graph order wherever its paths lead."""
        if len(nodes) < 2 or not first_proposal(self.seen, nodes):
            return
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


__all__ = ["DEEP_MAX_OPS", "ELEMENTWISE_MAX_BYTES", "DeepFusion", "spans"]
