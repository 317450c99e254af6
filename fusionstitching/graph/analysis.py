"""Structural analyses of a Graph: users, orders, work/span layers, dominators, cycle checks.

Work/span layers follow [A §3.1]: a root (here: any node without users) has span 0, every other
node has the maximum span of its users plus one. Nodes of one span form a layer with no data
dependence among them, and the largest span is the length of the critical path. The paper splits
graphs with while loops into frame contexts first; our graphs are acyclic, so no such step is needed.
``work_depth`` is the mirror image, measured from the sources.

Dominators serve the shared-memory planner's space sharing [B Alg. 4]. They are computed by
``networkx.immediate_dominators`` on the data-flow graph with a virtual entry feeding every node
without operands (post-dominators: the reversed graph with a virtual exit fed by every output and
every sink); a node whose immediate dominator is the virtual node maps to ``None``.

A fusion pattern is legal only if contracting it into one node keeps the graph acyclic, i.e. no
path leaves the pattern and comes back to it (DESIGN.md "Fusion exploration"). ``CycleChecker``
answers that by walking forward from the pattern's outside users and pruning every node whose
topological position is past the pattern's last node, since such a node cannot reach the pattern.
Exploration asks this question many times per graph, so the checker precomputes users and
positions once.

``pattern_structure`` is a pattern up to names: each node's op, shape, dtype, layout, attributes and
operands (inside the pattern by position, outside by input number, shape, dtype and layout), which
nodes are outputs and which outputs overwrite an input in place. Two patterns with one structure
lower to the same kernel up to names (the twelve layers of a transformer give twelve copies of each
of its patterns); with ``scalar_values`` the values of the scalar constants a kernel inlines are part
of it too, so that equal structures also compute equal values. A random op's stream (the counter
word that keeps each dropout's numbers apart) is an input of shape [1], read by the kernel, not a
value it inlines: the twelve dropout layers of a transformer are one structure, and one kernel
source.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import networkx as nx
import numpy as np

from fusionstitching.graph.graph import Graph, Node
from fusionstitching.graph.ops import Category


def users(graph: Graph) -> dict[Node, list[Node]]:
    """Each node's distinct users, in graph order (a node using an operand twice is listed once)."""
    return {node: list(u) for node, u in graph.index.users.items()}


def topological_order(graph: Graph) -> list[Node]:
    """Kahn's algorithm over ``graph.nodes``; ties go to the node listed first. Raises on a cycle."""
    position = {node: i for i, node in enumerate(graph.nodes)}
    missing = 0
    pending: dict[Node, int] = {}
    for node in graph.nodes:
        distinct = {id(x): x for x in node.operands}
        for operand in distinct.values():
            if operand not in position:
                raise ValueError(f"node {node.name}: operand {operand.name} is not in graph {graph.name}")
        pending[node] = len(distinct)
        missing += len(distinct)
    user_map = users(graph)
    ready = [position[node] for node in graph.nodes if pending[node] == 0]
    heapq.heapify(ready)
    order: list[Node] = []
    while ready:
        node = graph.nodes[heapq.heappop(ready)]
        order.append(node)
        for user in user_map[node]:
            pending[user] -= 1
            if pending[user] == 0:
                heapq.heappush(ready, position[user])
    if len(order) != len(graph.nodes):
        stuck = [node.name for node in graph.nodes if pending[node] > 0]
        raise ValueError(f"graph {graph.name} has a cycle through {', '.join(stuck[:8])}")
    return order


def to_networkx(graph: Graph) -> nx.DiGraph:
    """The data-flow graph: one vertex per Node, an edge from each operand to its user."""
    digraph = nx.DiGraph()
    digraph.add_nodes_from(graph.nodes)
    for node in graph.nodes:
        for operand in node.operands:
            digraph.add_edge(operand, node)
    return digraph


# ----------------------------------------------------------------------------------------------
# Work / span [A §3.1]
# ----------------------------------------------------------------------------------------------


def span_layers(graph: Graph) -> dict[Node, int]:
    """Span of every node: 0 for nodes without users, else the max span of its users plus one."""
    user_map = users(graph)
    span: dict[Node, int] = {}
    for node in reversed(topological_order(graph)):
        span[node] = max((span[u] + 1 for u in user_map[node]), default=0)
    return span


def layers(graph: Graph) -> list[list[Node]]:
    """Nodes grouped by span: ``layers(g)[s]`` holds the nodes of span ``s``, in graph order."""
    span = span_layers(graph)
    result: list[list[Node]] = [[] for _ in range(max(span.values(), default=-1) + 1)]
    for node in graph.nodes:
        result[span[node]].append(node)
    return result


def work_depth(graph: Graph) -> dict[Node, int]:
    """Longest path from a source: 0 for nodes without operands, else max operand depth plus one."""
    depth: dict[Node, int] = {}
    for node in topological_order(graph):
        depth[node] = max((depth[x] + 1 for x in node.operands), default=0)
    return depth


# ----------------------------------------------------------------------------------------------
# Dominators
# ----------------------------------------------------------------------------------------------


class _Virtual:
    """The virtual entry or exit vertex added for the dominator computations."""

    def __repr__(self) -> str:
        return "<virtual>"


def _immediate(digraph: nx.DiGraph, start: _Virtual, nodes: list[Node]) -> dict[Node, Node | None]:
    idom = nx.immediate_dominators(digraph, start)
    result: dict[Node, Node | None] = {}
    for node in nodes:
        parent = idom[node]
        result[node] = None if parent is start else parent
    return result


def dominators(graph: Graph) -> dict[Node, Node | None]:
    """Immediate dominator of every node; ``None`` when only the virtual entry dominates it."""
    digraph = to_networkx(graph)
    entry = _Virtual()
    digraph.add_edges_from((entry, node) for node in graph.nodes if not node.operands)
    return _immediate(digraph, entry, graph.nodes)


def post_dominators(graph: Graph) -> dict[Node, Node | None]:
    """Immediate post-dominator of every node; ``None`` when only the virtual exit post-dominates it.

    Every output and every node without users feeds the virtual exit, so a value that leaves the
    graph is post-dominated by nothing but the exit, even when it also has users inside.
    """
    reversed_graph = to_networkx(graph).reverse(copy=True)
    exit_ = _Virtual()
    user_map = users(graph)
    sinks = [node for node in graph.nodes if not user_map[node]]
    outputs = [node for node in graph.outputs if node is not None]
    reversed_graph.add_edges_from((exit_, node) for node in outputs + sinks)
    return _immediate(reversed_graph, exit_, graph.nodes)


# ----------------------------------------------------------------------------------------------
# Cycle checks for contracting a node set
# ----------------------------------------------------------------------------------------------


class Closure(NamedTuple):
    """Bit sets over a graph's topological positions (``CycleChecker.closure``): a node set, its
    descendants and its ancestors. The closure of a union is the OR of its parts' closures."""

    inside: int
    below: int
    above: int

    def __or__(self, other: Closure) -> Closure:  # type: ignore[override]
        return Closure(self.inside | other.inside, self.below | other.below, self.above | other.above)

    def contracts_cycle(self) -> bool:
        """Whether contracting the set into one node creates a cycle: some node outside it both
        descends from it and leads to it."""
        return bool(self.below & self.above & ~self.inside)


class CycleChecker:
    """Answers "would contracting this node set into one node create a cycle?" for one graph.

    Contracting a set S makes a cycle exactly when some node outside S is both a descendant and an
    ancestor of nodes of S. For graphs of up to ``BITSET_NODES`` nodes each node's descendants and
    ancestors are kept as bit sets (Python ints, a bit per topological position), so that a query
    is a few ORs over S and one AND; the depth-first search that finds the path runs only for a set
    that has one. Larger graphs (the bit sets take nodes² / 4 bytes) search every time. Planning
    asks this of every candidate pattern: thousands of sets per graph, most of them legal, each of
    which the search walked from the set's users up to its last node."""

    BITSET_NODES = 8192

    def __init__(self, graph: Graph) -> None:
        self.graph = graph
        self.users = users(graph)
        order = topological_order(graph)
        self.position = {node: i for i, node in enumerate(order)}
        self._at = {id(node): i for i, node in enumerate(order)}  # by id: no Python-level hash per lookup
        self._below: list[int] | None = None  # per position: the positions of its descendants
        self._above: list[int] | None = None  # per position: the positions of its ancestors
        self._order = order
        if len(order) <= self.BITSET_NODES:
            self._below, self._above = [0] * len(order), [0] * len(order)
            for node in reversed(order):
                i, mask = self.position[node], 0
                for user in self.users[node]:
                    j = self.position[user]
                    mask |= self._below[j] | (1 << j)
                self._below[i] = mask
            for node in order:
                i, mask = self.position[node], 0
                for operand in set(node.operands):
                    j = self.position[operand]
                    mask |= self._above[j] | (1 << j)
                self._above[i] = mask

    def reaches(self, a: Iterable[Node], b: Iterable[Node]) -> bool:
        """Whether some node of ``b`` descends from some node of ``a``."""
        if self._below is not None:
            _, below, _ = self._masks(a)
            inside, _, _ = self._masks(b)
            return bool(below & inside)
        targets = set(b)
        stack, seen = list(a), set()
        while stack:
            for user in self.users[stack.pop()]:
                if user in targets:
                    return True
                if user not in seen:
                    seen.add(user)
                    stack.append(user)
        return False

    def creates_cycle(self, nodes: Iterable[Node]) -> bool:
        if self._below is not None:
            inside, below, above = self._masks(nodes)
            return bool(below & above & ~inside)
        return self._search(self._members(nodes)) is not None

    def closure(self, nodes: Iterable[Node]) -> Closure | None:
        """The bit sets of ``nodes``, of their descendants and of their ancestors, for asking
        ``Closure.contracts_cycle`` about unions of several sets without walking their nodes again;
        ``None`` for a graph over ``BITSET_NODES`` nodes."""
        return Closure(*self._masks(nodes)) if self._below is not None else None

    def witness(self, nodes: Iterable[Node]) -> list[Node] | None:
        """A path ``[inside, outside..., inside]`` that leaves the set and returns, or ``None``."""
        if self._below is None:
            return self._search(self._members(nodes))
        inside, below, above = self._masks(nodes)
        between = below & above & ~inside
        if not between:
            return None
        # The first node outside the set that descends from it and leads back to it: walk to the
        # set along operands that descend from it and along users that lead to it. Every step finds
        # such a neighbour (the walk's node lies on some path between members), and positions only
        # decrease (increase), so neither walk backtracks.
        at = self._at
        middle = self._order[(between & -between).bit_length() - 1]
        back, node = [], middle
        while not inside >> at[id(node)] & 1:
            node = next(x for x in node.operands if (inside | below) >> at[id(x)] & 1)
            back.append(node)
        ahead, node = [], middle
        while not inside >> at[id(node)] & 1:
            node = next(u for u in self.users[node] if (inside | above) >> at[id(u)] & 1)
            ahead.append(node)
        return back[::-1] + [middle] + ahead

    def _masks(self, nodes: Iterable[Node]) -> tuple[int, int, int]:
        """The bit sets of ``nodes``, of their descendants and of their ancestors."""
        assert self._below is not None and self._above is not None
        inside = below = above = 0
        at = self._at
        for node in nodes:
            i = at.get(id(node))
            if i is None:
                raise ValueError(f"node {node.name} is not in graph {self.graph.name}")
            inside |= 1 << i
            below |= self._below[i]
            above |= self._above[i]
        return inside, below, above

    def _search(self, members: set[Node]) -> list[Node] | None:
        if not members:
            return None
        last = max(self.position[node] for node in members)
        parent: dict[Node, Node] = {}
        stack: list[Node] = []
        for node in members:
            for user in self.users[node]:
                if user not in members and user not in parent and self.position[user] < last:
                    parent[user] = node
                    stack.append(user)
        while stack:
            node = stack.pop()
            for user in self.users[node]:
                if user in members:
                    return self._path(parent, node, user)
                if user not in parent and self.position[user] < last:
                    parent[user] = node
                    stack.append(user)
        return None

    def _members(self, nodes: Iterable[Node]) -> set[Node]:
        members = set(nodes)
        for node in members:
            if node not in self.position:
                raise ValueError(f"node {node.name} is not in graph {self.graph.name}")
        return members

    @staticmethod
    def _path(parent: dict[Node, Node], outside: Node, target: Node) -> list[Node]:
        path = [target, outside]
        while path[-1] in parent:
            path.append(parent[path[-1]])
        return path[::-1]


def creates_cycle(graph: Graph, nodes: Iterable[Node]) -> bool:
    """Whether contracting ``nodes`` into one node makes the graph cyclic: some path leaves the set
    and comes back to it through nodes outside. For many queries on one graph use ``CycleChecker``."""
    return CycleChecker(graph).creates_cycle(nodes)


def cycle_witness(graph: Graph, nodes: Iterable[Node]) -> list[Node] | None:
    """The path ``[inside, outside..., inside]`` that contracting ``nodes`` would turn into a cycle."""
    return CycleChecker(graph).witness(nodes)


@dataclass(frozen=True)
class GraphSummary:
    """Node counts by category, the fusable fraction and the library ops of one graph.

    The fusable fraction counts elementwise, reduction, shape and random nodes over all nodes that
    compute (parameters and constants excluded); dots are counted apart, since planning decides
    which of them stay library GEMMs.
    """

    nodes: int
    by_category: dict[str, int]
    fusable_fraction: float
    library_ops: dict[str, int]


def summarize(graph: Graph) -> GraphSummary:
    by_category: dict[str, int] = {}
    library: dict[str, int] = {}
    for node in graph.nodes:
        by_category[node.category.value] = by_category.get(node.category.value, 0) + 1
        if node.category == Category.LIBRARY:
            target = node.attrs["target"]
            library[target] = library.get(target, 0) + 1
    computing = [n for n in graph.nodes if n.category not in (Category.PARAMETER, Category.CONSTANT)]
    fusable = [n for n in computing if n.category.fusable and n.category != Category.DOT]
    fraction = len(fusable) / len(computing) if computing else 0.0
    return GraphSummary(len(graph.nodes), by_category, fraction, library)


def in_place_outputs(graph: Graph) -> dict[Node, Node]:
    """Graph outputs that overwrite a parameter in place → that parameter."""
    return {graph.outputs[o]: graph.parameters[p] for o, p in graph.mutations.items() if graph.outputs[o] is not None}


def pattern_structure(graph: Graph, members: Sequence[Node], aliased: Mapping[Node, Node] | None = None,
                      scalar_values: bool = False) -> tuple:
    """``members`` (in graph order) up to names; see the module note. ``aliased`` is
    ``in_place_outputs(graph)``, passed by callers that ask for many patterns of one graph."""
    index = graph.index
    if aliased is None:
        aliased = in_place_outputs(graph)
    local = {node: i for i, node in enumerate(members)}
    inputs: dict[Node, int] = {}
    items = []
    for node in members:
        operands = []
        for operand in node.operands:
            if operand in local:
                operands.append(local[operand])
                continue
            number = inputs.setdefault(operand, len(inputs))
            scalar = operand.op == "constant" and operand.attrs["value"].ndim == 0
            if scalar and scalar_values:
                scalar = ("value", _frozen(operand.attrs["value"]))
            operands.append(("in", number, operand.shape, operand.dtype, operand.layout, scalar))
        output = id(node) in index.output_ids or any(u not in local for u in index.users[node])
        alias = aliased.get(node)
        alias_key = inputs.get(alias, -1) if alias is not None else None
        items.append((node.op, node.shape, node.dtype, _frozen_attrs(node.attrs), tuple(operands), output,
                      alias_key, node.layout))
    return tuple(items)


def _frozen(value):
    if isinstance(value, np.ndarray):
        return (value.dtype.str, value.shape, value.tobytes())
    if isinstance(value, list):
        return tuple(value)
    return value


def _frozen_attrs(attrs) -> tuple:
    return tuple((key, _frozen(attrs[key])) for key in sorted(attrs))
