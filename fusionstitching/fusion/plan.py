"""FusionPlan: disjoint kernel patterns covering every fusable node, with the why of every decision.

A plan is made on a graph (``FusionPlan.graph``, the graph after reduction splitting) and gives
every node one role:

- *kernel*: a member of exactly one pattern; each pattern is one generated kernel with the
  schedule ``schedule.feasible`` chose for it;
- *library*: a GEMM above the small-dot threshold or a library op, run by PyTorch (cuBLAS), and
  any node no kernel can be built for (counted, with the reason, never hidden);
- *view*: a ``reshape`` of contiguous memory, or a transpose/broadcast/reshape chain that only
  feeds library calls (passed to the library as a strided tensor): no kernel runs for it. A
  pattern that would write both a value and a reshape of it (a ResNet block's output, flat for
  the next convolution and unflattened as the activation the backward saves) writes the value
  once and the reshape is a view of it (``_written_once``);
- *input*: parameters and constants.

``finalize`` turns the patterns a selector chose into a plan: every fusable node left over
becomes a view when it can be one, else its own kernel. It then explains every producer→consumer
edge between two different kernels (or a kernel and a library call or view): for two kernels it
asks legality about their union and reports the cycle, the schedule stage's reason, or the scores
that made the selector keep them apart.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from fusionstitching.fusion.legality import Legality, Roles, blas_layout
from fusionstitching.fusion.score import Scorer
from fusionstitching.graph.graph import Graph, Node
from fusionstitching.graph.ops import VIEW_OPS
from fusionstitching.schedule.template import KernelSchedule, format_template


@dataclass(frozen=True)
class FusedPattern:
    """One kernel: its nodes (names of ``FusionPlan.graph``'s nodes, in topological order)."""

    nodes: tuple[str, ...]
    schedule: KernelSchedule | None
    score: float
    origin: str

    def __len__(self) -> int:
        return len(self.nodes)


@dataclass(frozen=True)
class UnfusedEdge:
    producer: str
    consumer: str
    reason: str


@dataclass
class FusionPlan:
    graph: Graph
    patterns: tuple[FusedPattern, ...]
    library: dict[str, str]  # node → why it is a library call
    views: dict[str, str]  # node → why it runs as a view
    edge_reasons: Callable[[], tuple[UnfusedEdge, ...]] = field(repr=False)
    strategy: str
    seconds: float = 0.0
    notes: list[str] = field(default_factory=list)  # pass-level decisions (splits, candidate counts)
    estimated_us: float | None = None  # the latency evaluator's time of the kernels (``estimate.py``)
    transferred: bool = False  # the patterns of another shape's plan (``explore.transfer``), not explored
    # the patterns (their node names) whose templates were taken over from a specialization of the
    # same shape class (``explore.transfer``'s ``kept``): the tuner measures them no more
    kept: frozenset[frozenset[str]] = frozenset()
    _unfused: tuple[UnfusedEdge, ...] | None = field(default=None, repr=False)

    @property
    def unfused(self) -> tuple[UnfusedEdge, ...]:
        """Every producer→consumer edge between different kernels, library calls or views, with the
        reason; worked out on first use (it asks legality about the union of each pair of kernels)."""
        if self._unfused is None:
            self._unfused = self.edge_reasons()
        return self._unfused

    @property
    def kernel_count(self) -> int:
        return len(self.patterns)

    @property
    def library_count(self) -> int:
        return len(self.library)

    def pattern_of(self, name: str) -> FusedPattern | None:
        for pattern in self.patterns:
            if name in pattern.nodes:
                return pattern
        return None

    def explain(self) -> str:
        header = (f"{self.strategy} plan for graph {self.graph.name}: {self.kernel_count} kernels, "
                  f"{self.library_count} library calls, {len(self.views)} views "
                  f"({len(self.graph.nodes)} nodes; planned in {self.seconds:.2f} s)")
        lines = [header]
        if self.estimated_us is not None:
            lines.append(f"  estimated {self.estimated_us:.1f} us for the kernels (latency evaluator, fusion/estimate.py)")
        lines += [f"  {note}" for note in self.notes]
        for k, pattern in enumerate(self.patterns):
            template = format_template(pattern.schedule) if pattern.schedule is not None else "-"
            lines.append(f"kernel {k}: {len(pattern)} ops, score {pattern.score:.2f} us, {pattern.origin}")
            lines.append(f"  nodes: {', '.join(pattern.nodes)}")
            lines.append(f"  template: {template}")
        for name, why in self.library.items():
            lines.append(f"library {name}: {why}")
        for name, why in self.views.items():
            lines.append(f"view {name}: {why}")
        if self.unfused:
            lines.append("edges left unfused:")
            lines += [f"  {e.producer} -> {e.consumer}: {e.reason}" for e in self.unfused]
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.explain()


@dataclass(frozen=True)
class Chosen:
    nodes: tuple[Node, ...]
    schedule: KernelSchedule | None
    score: float
    origin: str


def finalize(graph: Graph, roles: Roles, legality: Legality, scorer: Scorer | None, chosen: Sequence[Chosen],
             strategy: str, notes: Sequence[str] = ()) -> FusionPlan:
    """The plan from the selected patterns: leftovers become views or single-node kernels."""
    library = {n.name: why for n, why in roles.library.items()}
    library_nodes = set(roles.library)
    group: dict[Node, int] = {}
    patterns: list[Chosen] = [_written_once(graph, legality, c) for c in chosen]
    for k, pattern in enumerate(patterns):
        for node in pattern.nodes:
            group[node] = k
    views = {n.name: why for n, why in roles.views.items()}
    views.update(_views(graph, roles, group, library_nodes))
    for node in roles.fusable:
        if node in group or node.name in views:
            continue
        verdict = legality.buildable([node])
        if verdict:
            group[node] = len(patterns)
            patterns.append(Chosen((node,), verdict.schedule, 0.0, "single op (in no selected pattern)"))
        else:
            library[node.name] = f"no kernel can be built for it alone ({verdict.reason}); run by PyTorch"
            library_nodes.add(node)
    position = graph.index.position
    order = sorted(range(len(patterns)), key=lambda k: position[patterns[k].nodes[0]])
    renumber = {old: new for new, old in enumerate(order)}
    group = {node: renumber[k] for node, k in group.items()}
    patterns = [patterns[k] for k in order]
    fused = tuple(FusedPattern(tuple(n.name for n in p.nodes), p.schedule, p.score, p.origin) for p in patterns)
    def edge_reasons() -> tuple[UnfusedEdge, ...]:
        return _unfused_edges(graph, roles, legality, scorer, patterns, group, library_nodes, views)

    return FusionPlan(graph, fused, library, views, edge_reasons, strategy, notes=list(notes))


def _written_once(graph: Graph, legality: Legality, chosen: Chosen) -> Chosen:
    """``chosen`` without the reshapes that would be second copies of its own outputs: a reshape
    of a value the kernel writes anyway, read by no node of the kernel, both contiguous, and the
    value no graph output (two graph outputs sharing storage could surprise their user). Left
    out, the reshape becomes a view of the written value (``_views``) and the kernel writes its
    bytes once. The smaller pattern gets its own schedule; where none builds it stays as chosen."""
    inside = {id(n) for n in chosen.nodes}
    users = graph.index.users
    outputs = graph.index.output_ids
    written = {id(n) for n in chosen.nodes if id(n) in outputs or any(id(u) not in inside for u in users[n])}
    copies = {id(n) for n in chosen.nodes
              if n.op == "reshape" and id(n) in written and id(n.operands[0]) in written
              and id(n.operands[0]) not in outputs and not any(id(u) in inside for u in users[n])
              and _plain(n) and _plain(n.operands[0])}
    if not copies:
        return chosen
    nodes = tuple(n for n in chosen.nodes if id(n) not in copies)
    verdict = legality.buildable(list(nodes))
    if not verdict:
        return chosen
    return Chosen(nodes, verdict.schedule, chosen.score, chosen.origin)


def _plain(node: Node) -> bool:
    """Whether ``node``'s value is stored row-major (no layout asked, or a contiguous one)."""
    return node.layout is None or node.layout.is_contiguous(node.shape)


def edge_reasons_of(graph: Graph, options, patterns: Sequence[FusedPattern], library: dict[str, str],
                    views: dict[str, str]) -> Callable[[], tuple[UnfusedEdge, ...]]:
    """``FusionPlan.edge_reasons`` for a plan not made by ``finalize`` here (one read from the plan
    cache): the roles, legality and scorer it asks are made when the reasons are first asked for."""
    def edge_reasons() -> tuple[UnfusedEdge, ...]:
        roles = Roles.of(graph, options)
        chosen = [Chosen(tuple(graph.node(n) for n in p.nodes), p.schedule, p.score, p.origin) for p in patterns]
        group = {node: k for k, p in enumerate(chosen) for node in p.nodes}
        library_nodes = {graph.node(n) for n in library}
        return _unfused_edges(graph, roles, Legality(graph, options), Scorer(graph, options), chosen, group,
                              library_nodes, views)

    return edge_reasons


def _views(graph: Graph, roles: Roles, group: dict[Node, int], library: set[Node]) -> dict[str, str]:
    """Leftover shape nodes that need no kernel (see the module docstring): first the chains that only
    feed library calls (users first), then reshapes of contiguous tensors (operands first)."""
    views: dict[str, str] = {}
    users = graph.index.users
    fusable = set(roles.fusable)
    leftover = [n for n in graph.nodes if n in fusable and n not in group and n.op in VIEW_OPS]
    for node in reversed(leftover):
        node_users = users[node]
        if node_users and id(node) not in graph.index.output_ids and blas_layout(node) \
                and all(u in library or u.name in views or u in roles.views for u in node_users):
            views[node.name] = "feeds only library calls, which take it as a strided view"
    for node in leftover:
        if node.op == "reshape" and node.name not in views and _contiguous(node.operands[0], views):
            views[node.name] = "reshape of a contiguous tensor"
    return views


def _contiguous(node: Node, views: dict[str, str]) -> bool:
    """Whether ``node``'s value lies in memory contiguously: a kernel's or library's output, a
    contiguous parameter, a constant, or a reshape view of one of those."""
    if node.op == "parameter":
        return node.layout is None or node.layout.is_contiguous(node.shape)
    if node.name in views:
        return node.op == "reshape" and _contiguous(node.operands[0], views)
    return True


def _unfused_edges(graph, roles, legality, scorer, patterns, group, library, views) -> tuple[UnfusedEdge, ...]:
    edges: list[UnfusedEdge] = []
    merged: dict[tuple[int, int], str] = {}
    for consumer in graph.nodes:
        if consumer in roles.inputs:
            continue
        for producer in dict.fromkeys(consumer.operands):
            if producer in roles.inputs:
                continue
            a, b = group.get(producer), group.get(consumer)
            if a is not None and a == b:
                continue
            if producer in library:
                reason = f"producer is a library call ({_library_why(producer, roles)})"
            elif consumer in library:
                reason = f"consumer is a library call ({_library_why(consumer, roles)})"
            elif producer.name in views or consumer.name in views:
                view = producer if producer.name in views else consumer
                reason = f"{view.name} is a view: {views[view.name]}"
            else:
                key = (a, b)
                if key not in merged:
                    merged[key] = _merge_reason(legality, scorer, patterns[a], patterns[b])
                reason = merged[key]
            edges.append(UnfusedEdge(producer.name, consumer.name, reason))
    return tuple(edges)


def _library_why(node: Node, roles: Roles) -> str:
    return roles.library.get(node, "no kernel can be built for it")


def _merge_reason(legality: Legality, scorer: Scorer | None, a: Chosen, b: Chosen) -> str:
    union = list(a.nodes) + list(b.nodes)
    verdict = legality.check(union)
    if not verdict:
        return f"merging their kernels is illegal: {verdict.reason}"
    if scorer is None:
        return "the baseline's rules keep them apart"
    score = scorer.score(union, verdict.schedule).value
    if score <= a.score + b.score:
        return (f"merging is legal but scores {score:.2f} us, not more than the two kernels' "
                f"{a.score:.2f} + {b.score:.2f} us")
    return (f"merging is legal and would score {score:.2f} us (> {a.score:.2f} + {b.score:.2f}), but it "
            "conflicts with the selected patterns or no generator proposed it")
