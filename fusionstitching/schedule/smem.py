"""Shared-memory planning for one kernel: size requests in, buffers with offsets out.

Lowering decides which sub-roots are cached in shared memory (block composition) and how many
bytes one thread block needs for each: the size requirements of [A §5.1.1]. Reductions and dots
that are not the root must be cached (direct allocation); elementwise ops are cached for reuse and
may instead be recomputed by every consuming thread. This module packs the requests into as little
space as it safely can and, over the limit, turns some of them back into recomputation.

[Note: the kernel's timeline and liveness]
The kernel runs the pattern's groups in the order of ``graph.nodes`` (topological) restricted to
the pattern; a node's *position* is its index in that order. A group whose root is cached writes its
buffer and ends with ``__syncthreads()``. Every other node is computed in registers wherever it is
used (thread composition), so it reads the cached values it depends on wherever *it* is recomputed.
Request r is thus read at the positions of R(r): r's users in the pattern and, through each user
that is not itself a request, that user's users, and so on; a request stops the walk, since its
consumers read its buffer, not r. Users outside the pattern read global memory and do not count.
r's buffer is live from pos(r) to its *release*: the first cached group at or after the last
position in R(r) (r itself when nothing in the pattern reads it), because only that group's barrier
guarantees all threads are done reading before the space is overwritten; with no such group it
stays live to the end of the kernel. Two requests may share a buffer only if the earlier one is
released strictly before the later one is defined, so a request never reuses the space of a value
it reads. This is conservative: a node that is both an output and recomputed inline counts at every
place it is evaluated, and no barrier is assumed that the timeline above does not have. A gather
reads its data operand at an index loaded from memory, where no footprint can be proven: codegen
then recomputes the operand from its own operands (``codegen/values.py``), down to what it can
read, so every request upstream of a gather's data operand is also read at the gather.

[Note: space sharing, B Alg. 4 and A §5.1.3]
Requests are visited in order; each takes an existing buffer whose current occupant o is released
before it (above) and passes the paper's dominance test, else a new buffer. Both papers test "inst
dominates prev_inst" on a dominance tree built "starting from the root instruction" [A §5.1.3], the
later op dominating the earlier (Reduce.2 dominates Reduce.1): in data-flow terms the new request q
post-dominates o, every path from o to the pattern's results passes through q. The tree is the
dominator tree of the reversed pattern graph, whose virtual entry stands for the root and feeds
every pattern node that is a graph output, has users outside the pattern, or has none inside; on
this acyclic graph a node's immediate post-dominator is the entry if the entry feeds it, else the
nearest common ancestor of its users in the tree, built in reverse topological order (``_Flow.idom``).
Departures: (1) the paper lets a consumer reuse its operand's space in place (Divide.1 takes
Exponential.1's buffer); we never do, since a block-composed consumer may read elements that other
threads are overwriting, so the liveness test always applies; (2) Alg. 4 only considers allocations
flowing into q through its operands; we also let unrelated requests share (no path from o to q, e.g.
packed sub-kernels), which liveness makes safe. The dominance test is stricter than liveness: in
softmax the sum does not take the max's space, since exp also flows to the divide around the sum.
Among eligible buffers the best fit wins: least growth, then least waste, then the oldest. A
buffer's size is the max of its sharers'; offsets are 16-byte aligned, in buffer creation order.

[Note: size shrinking, A §5.1.2]
Over the limit, and if allowed, requests are dropped one at a time (the node becomes thread-composed
and is recomputed by its consumers) and the whole plan is redone, since dropping r lengthens the live
ranges of the requests r reads. The order is the paper's: light elementwise and shape ops first,
then expensive elementwise ops, then expensive ops that a dot in the pattern uses transitively, and
reductions and dots (direct allocations) last; within a class the lowest ``recompute_cost`` first,
then larger bytes, then closest to the root by span [A §3.1]. Requests in ``must_keep`` are never
dropped. If it still does not fit, the result is ``Infeasible`` and fusion must choose another
pattern (DESIGN.md, "Kernel schedules").
"""

from __future__ import annotations

import functools
from collections.abc import Collection, Sequence
from dataclasses import dataclass

from fusionstitching.graph.graph import Graph, Node
from fusionstitching.graph.ops import Category

ALIGNMENT = 16


@dataclass(frozen=True)
class SmemRequest:
    node: str  # the sub-root whose result is cached in shared memory (block composition)
    bytes: int  # its per-block size requirement [A §5.1.1]
    recompute_cost: float = 1.0  # relative cost of recomputing it instead (thread composition)


@dataclass(frozen=True)
class SmemBuffer:
    name: str
    offset: int  # byte offset in the kernel's shared memory, 16-byte aligned
    bytes: int  # max size over its sharers
    sharers: tuple[str, ...]  # nodes that use this space, in allocation order


@dataclass(frozen=True)
class SmemPlan:
    buffers: tuple[SmemBuffer, ...]
    placement: dict[str, str]  # node -> buffer name
    recomputed: tuple[str, ...]  # requests dropped to fit the limit, in drop order
    total_bytes: int
    limit_bytes: int

    def __bool__(self) -> bool:
        return True

    def __str__(self) -> str:
        rows = [("buffer", "offset", "bytes", "sharers")]
        rows += [(b.name, str(b.offset), str(b.bytes), ", ".join(b.sharers)) for b in self.buffers]
        w = [max(len(row[i]) for row in rows) for i in range(3)]
        lines = [f"{r[0]:<{w[0]}}  {r[1]:>{w[1]}}  {r[2]:>{w[2]}}  {r[3]}" for r in rows]
        lines.append("recomputed: " + (", ".join(self.recomputed) or "none"))
        lines.append(f"total {self.total_bytes} of {self.limit_bytes} bytes")
        return "\n".join(lines)


@dataclass(frozen=True)
class Infeasible:
    reason: str  # names the buffers, their bytes, the total and the limit
    requests: tuple[SmemRequest, ...]
    limit_bytes: int

    def __bool__(self) -> bool:
        return False

    def __str__(self) -> str:
        return self.reason


def plan_shared_memory(
    graph: Graph,
    pattern: Sequence[Node],
    requests: Sequence[SmemRequest],
    limit_bytes: int,
    *,
    allow_recompute: bool = True,
    must_keep: Collection[str] = (),
) -> SmemPlan | Infeasible:
    """Place ``requests`` in shared memory of at most ``limit_bytes``, sharing space between requests
    whose live ranges are disjoint and recomputing droppable ones when over the limit (module notes).
    """
    if not requests:
        return SmemPlan((), {}, (), 0, limit_bytes)
    flow = _Flow(graph, pattern)
    by_name = _check_requests(flow, requests)
    keep = set(must_keep)
    active = sorted(by_name, key=flow.pos.__getitem__)
    dropped: list[str] = []
    while True:
        buffers = _share_space(flow, [by_name[name] for name in active])
        total = max((b.offset + b.bytes for b in buffers), default=0)
        if total <= limit_bytes:
            placement = {name: b.name for b in buffers for name in b.sharers}
            return SmemPlan(tuple(buffers), placement, tuple(dropped), total, limit_bytes)
        droppable = [name for name in active if name not in keep]
        if not allow_recompute or not droppable:
            reason = _reason(buffers, total, limit_bytes, dropped, allow_recompute)
            return Infeasible(reason, tuple(requests), limit_bytes)
        victim = min(droppable, key=lambda name: flow.drop_key(by_name[name]))
        active.remove(victim)
        dropped.append(victim)


def side_by_side(requests: Sequence[SmemRequest], limit_bytes: int) -> SmemPlan | None:
    """Each request in a buffer of its own, or None when their 16-byte aligned sizes do not fit in
    ``limit_bytes`` together. When they fit, ``plan_shared_memory`` fits as well (sharing only merges
    buffers, and nothing is recomputed within the limit): a caller that only needs to know that a
    plan exists, with a place for every request (the probe lowering of ``schedule.feasible``), can
    skip the planning."""
    if sum(_align(r.bytes) for r in requests) > limit_bytes:
        return None
    buffers, offset = [], 0
    for i, request in enumerate(requests):
        buffers.append(SmemBuffer(f"smem{i}", offset, request.bytes, (request.node,)))
        offset = _align(offset + request.bytes)
    total = max((b.offset + b.bytes for b in buffers), default=0)
    return SmemPlan(tuple(buffers), {b.sharers[0]: b.name for b in buffers}, (), total, limit_bytes)


# ----------------------------------------------------------------------------------------------
# The pattern's data flow
# ----------------------------------------------------------------------------------------------


class _Root:
    """The virtual entry of the reversed pattern graph: the pattern's root instruction."""

    def __repr__(self) -> str:
        return "<root>"


class _Flow:
    """Positions, users inside the pattern, post-dominators and spans of one pattern, by node name."""

    def __init__(self, graph: Graph, pattern: Sequence[Node]) -> None:
        index = graph.index.position
        for node in pattern:
            if node not in index:
                raise ValueError(f"pattern node {node.name} is not in graph {graph.name}")
        order = sorted(set(pattern), key=index.__getitem__)
        members = set(order)
        all_users = graph.index.users
        outputs = graph.index.output_ids
        self.nodes = {node.name: node for node in order}
        self.pos = {node.name: i for i, node in enumerate(order)}
        self.end = len(order)
        self.users = {node.name: [u.name for u in all_users[node] if u in members] for node in order}
        self.leaves = [node.name for node in order
                       if id(node) in outputs or any(u not in members for u in all_users[node])
                       or not self.users[node.name]]
        self.root = _Root()
        self._descendants: dict[str, set[str]] = {}

    @functools.cached_property
    def span(self) -> dict[str, int]:
        """Longest path to a leaf of the pattern, per node (only shrinking asks)."""
        span: dict[str, int] = {}
        for name in sorted(self.nodes, key=self.pos.__getitem__, reverse=True):
            span[name] = max((span[u] + 1 for u in self.users[name]), default=0)
        return span

    # The tree is built on first use: most patterns request no shared memory at all.
    @functools.cached_property
    def idom(self) -> dict:
        """Immediate post-dominator of every node (the root's entry for leaves; module note)."""
        idom: dict = {}
        depth = {self.root: 0}
        leaves = set(self.leaves)
        for name in sorted(self.nodes, key=self.pos.__getitem__, reverse=True):
            if name in leaves:
                parent = self.root
            else:
                parent = self.users[name][0]
                for other in self.users[name][1:]:
                    parent = _common_ancestor(idom, depth, parent, other)
            idom[name] = parent
            depth[name] = depth[parent] + 1
        return idom

    def descendants(self, name: str) -> set[str]:
        """The pattern nodes reachable from ``name`` through its users."""
        if name not in self._descendants:
            seen: set[str] = set()
            stack = list(self.users[name])
            while stack:
                user = stack.pop()
                if user not in seen:
                    seen.add(user)
                    stack.extend(self.users[user])
            self._descendants[name] = seen
        return self._descendants[name]

    def post_dominates(self, q: str, o: str) -> bool:
        """Whether every path from ``o`` to the pattern's root passes through ``q``."""
        x = self.idom.get(o)
        while x is not None and x is not self.root:
            if x == q:
                return True
            x = self.idom.get(x)
        return False

    def may_share(self, occupant: str, q: str) -> bool:
        """The dominance test of B Alg. 4, widened to unrelated requests (module note)."""
        return self.post_dominates(q, occupant) or q not in self.descendants(occupant)

    @functools.cached_property
    def gathered(self) -> dict[str, int]:
        """Per node, the last position of a gather in whose gathered operand it is (module note):
        codegen reads a cached value at an index loaded from memory by recomputing it from its
        operands, so each value upstream may be read, from its buffer or recomputed, at the gather."""
        result: dict[str, int] = {}
        for name, node in self.nodes.items():
            if node.op != "gather":
                continue
            seen: set[str] = set()
            stack = [node.operands[0]]
            while stack:
                x = stack.pop()
                if x.name in seen or self.nodes.get(x.name) is not x:
                    continue
                seen.add(x.name)
                result[x.name] = max(result.get(x.name, -1), self.pos[name])
                stack.extend(x.operands)
        return result

    def releases(self, active: set[str]) -> dict[str, int]:
        """Position of the barrier after which each request's buffer is free (module note)."""
        barriers = sorted(self.pos[name] for name in active)
        result: dict[str, int] = {}
        for name in active:
            last, seen, stack = max(self.pos[name], self.gathered.get(name, -1)), set(), list(self.users[name])
            while stack:
                user = stack.pop()
                if user in seen:
                    continue
                seen.add(user)
                last = max(last, self.pos[user])
                if user not in active:
                    stack.extend(self.users[user])
            result[name] = next((p for p in barriers if p >= last), self.end)
        return result

    def shrink_class(self, name: str) -> int:
        """0 light elementwise/shape, 1 expensive, 2 expensive feeding a dot, 3 direct [A §5.1.2]."""
        category = self.nodes[name].category
        if category in (Category.REDUCTION, Category.DOT, Category.LIBRARY):
            return 3
        if category not in (Category.EXPENSIVE_ELEMENTWISE, Category.RANDOM):
            return 0
        feeds_dot = any(self.nodes[d].category == Category.DOT for d in self.descendants(name))
        return 2 if feeds_dot else 1

    def drop_key(self, request: SmemRequest) -> tuple:
        name = request.node
        return (self.shrink_class(name), request.recompute_cost, -request.bytes, self.span[name], -self.pos[name])


def _common_ancestor(parent: dict, depth: dict, a, b):
    """The nearest common ancestor of ``a`` and ``b`` in the tree given by ``parent``."""
    while a != b:
        if depth[a] >= depth[b]:
            a = parent[a]
        else:
            b = parent[b]
    return a


def _check_requests(flow: _Flow, requests: Sequence[SmemRequest]) -> dict[str, SmemRequest]:
    by_name: dict[str, SmemRequest] = {}
    for request in requests:
        if request.node not in flow.pos:
            raise ValueError(f"shared-memory request for {request.node}, which is not in the pattern")
        if request.node in by_name:
            raise ValueError(f"two shared-memory requests for {request.node}")
        if request.bytes < 0:
            raise ValueError(f"shared-memory request for {request.node} has {request.bytes} bytes")
        by_name[request.node] = request
    return by_name


# ----------------------------------------------------------------------------------------------
# Space sharing and layout
# ----------------------------------------------------------------------------------------------


def _share_space(flow: _Flow, requests: list[SmemRequest]) -> list[SmemBuffer]:
    """Greedy best-fit sharing in position order, then 16-byte aligned offsets in creation order."""
    release = flow.releases({r.node for r in requests})
    sizes: list[int] = []
    sharers: list[list[str]] = []
    for request in requests:
        q, size = request.node, request.bytes
        fits = [
            i
            for i, names in enumerate(sharers)
            if release[names[-1]] < flow.pos[q] and flow.may_share(names[-1], q)
        ]
        if fits:
            best = min(fits, key=lambda i: (max(0, size - sizes[i]), max(0, sizes[i] - size), i))
            sizes[best] = max(sizes[best], size)
            sharers[best].append(q)
        else:
            sizes.append(size)
            sharers.append([q])
    buffers, offset = [], 0
    for i, (size, names) in enumerate(zip(sizes, sharers)):
        buffers.append(SmemBuffer(f"smem{i}", offset, size, tuple(names)))
        offset = _align(offset + size)
    return buffers


def _align(n: int) -> int:
    return (n + ALIGNMENT - 1) // ALIGNMENT * ALIGNMENT


def _reason(buffers: list[SmemBuffer], total: int, limit: int, dropped: list[str], allowed: bool) -> str:
    parts = "; ".join(f"{b.name} {b.bytes}: {', '.join(b.sharers)}" for b in buffers)
    text = f"shared memory: needs {total} bytes ({parts}) over the {limit}-byte limit"
    if not allowed:
        return text + " (recomputation not allowed)"
    if dropped:
        text += f", even after recomputing {', '.join(dropped)}"
    return text + "; the rest must stay in shared memory"
