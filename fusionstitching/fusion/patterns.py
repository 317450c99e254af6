"""Candidate patterns: substitution fusion with multi-step partition ops [B §4.2.1].

Algorithm 1 of paper B walks the graph in topological order and collapses all ops between two
adjacent *partition ops* into one pattern; a partition op starts the pattern that follows it. It is
run once per step of a growing partition set, and every step's patterns go to the selector:

  step 1  library calls (large GEMMs, library ops) — they are never fused, so they only cut;
  step 2  + batched (small) dots;
  step 3  + column reductions (the last dim is kept);
  step 4  + scalar reductions (every dim reduced);
  step 5  + row reductions;
  step 6  + expensive elementwise ops.

A range of a topological order is convex (a path between two of its nodes only visits nodes
between them), so a segment, and each weakly connected component of it, contracts without a
cycle. For each segment the generator proposes the whole segment (kernel packing of its
independent parts) and each of its components; a proposal the schedule stage cannot build is
retried without the ``reshape`` nodes on its boundary (they become views of the kernel's
contiguous input or output, which often lets the rest share one iteration space). Proposals of
one node are not made: every node not covered by a selected pattern becomes its own kernel.

The paper lets a partition op open the pattern that follows it (a GEMM and its epilogue). For
reductions the opposite is as useful (a reduction and the ops that feed it), so every step after
the first is run both ways: partition ops opening runs and partition ops closing them.

The other generators of DESIGN.md live in their own modules and feed the same selectors:
span-layer deep fusion [A §3.2] (``deep.py``), exploratory fusion from seed ops [B Alg. 2]
(``exploratory.py``), approximate-DP PatternReduction [C §5.2] (``dp.py``) and remote fusion
[C Figure 5] (``remote.py``). The two plan-seeded generators here are narrower relatives of two of
them: ``NeighbourMerging`` is exploratory fusion seeded with a selected plan's patterns instead of
single ops and expanded by one neighbouring pattern instead of one op; ``SinkPacking`` is remote
fusion restricted to the patterns nothing depends on (any set of them packs without a cycle).
All of them share ``_propose_union``'s or ``Legality``'s checks and the ``seen`` set.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from fusionstitching.fusion.legality import Legality, Roles, Verdict
from fusionstitching.graph.collapse import UnionFind
from fusionstitching.graph.graph import Graph, Node
from fusionstitching.graph.ops import Category
from fusionstitching.graph.pattern import is_reduction
from fusionstitching.schedule.grouping import is_looped_partial, is_stitched_partial


@dataclass(frozen=True)
class Candidate:
    """A legal pattern proposed by a generator: its nodes in graph order and its schedule."""

    nodes: tuple[Node, ...]
    verdict: Verdict
    origin: str

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(n.name for n in self.nodes)


@dataclass
class Rejection:
    """A proposal that is not legal, kept for the plan's explanations."""

    nodes: tuple[Node, ...]
    reason: str
    origin: str


def _column_reduction(node: Node) -> bool:
    return node.op == "reduce" and len(node.operands[0].shape) - 1 not in node.attrs["dims"] and node.size > 1


def _elementwise_part(partial: Node, fusable: set[Node]) -> set[Node]:
    """``partial`` and its operands' elementwise and shape ops, back to reductions, library calls
    and parameters."""
    part, stack = {partial}, list(partial.operands)
    while stack:
        node = stack.pop()
        if node in part or node not in fusable or is_reduction(node) or node.op == "dot_general":
            continue
        part.add(node)
        stack.extend(node.operands)
    return part


def _same_rows(partial: Node, row: Node) -> bool:
    """Whether a stitched partial sums blocks of the rows that row reduction ``row`` reduces (or,
    carried by a grid loop, the rows its blocks visit)."""
    if is_looped_partial(partial):
        return partial.operands[0].operands[0].shape == row.operands[0].shape
    split, shape = partial.operands[0].shape, row.operands[0].shape
    return (len(split) == len(shape) + 1 and split[:-3] == shape[:-2] and split[-1] == shape[-1]
            and split[-3] * split[-2] == shape[-2])


def _scalar_reduction(node: Node) -> bool:
    return is_reduction(node) and node.op == "reduce" and node.size == 1


def _row_reduction(node: Node) -> bool:
    return node.op == "reduce" and not _column_reduction(node) and not _scalar_reduction(node)


PARTITION_STEPS: tuple[tuple[str, Callable[[Node], bool]], ...] = (
    ("library calls", lambda n: False),
    ("batched dots", lambda n: n.op == "dot_general"),
    ("column reductions", _column_reduction),
    ("scalar reductions", _scalar_reduction),
    ("row reductions", _row_reduction),
    ("expensive ops", lambda n: n.category == Category.EXPENSIVE_ELEMENTWISE),
)


class SubstitutionFusion:
    """Runs Algorithm 1 for every partition step and collects the legal, distinct candidates."""

    def __init__(self, graph: Graph, roles: Roles, legality: Legality) -> None:
        self.graph = graph
        self.roles = roles
        self.legality = legality
        self.candidates: list[Candidate] = []
        self.rejections: list[Rejection] = []
        self.seen: set[frozenset[Node]] = set()

    def run(self) -> list[Candidate]:
        partition: list[Callable[[Node], bool]] = []
        for label, predicate in PARTITION_STEPS:
            partition.append(predicate)
            origin = f"substitution fusion, partition at {label}"
            for closing in (False, True) if len(partition) > 1 else (False,):
                suffix = " (closing runs)" if closing else ""
                for segment in self._segments(partition, closing):
                    self._propose_segment(segment, origin + suffix)
        self._propose_stitched()
        return self.candidates

    def _propose_stitched(self) -> None:
        """Row reductions with the partial column sums over their rows (``fusion/split.py`` splits
        such column reductions into parts of a row kernel's block). A partial's own part is its
        operand's elementwise and shape ops back to reductions, library calls or parameters; it is
        added to every candidate so far that holds a row reduction over the same rows and shares
        an input with it (LayerNorm backward's dgamma/dbeta partials and the dx kernel read dy),
        one partial after another, so the partials ride in the row reductions' kernel."""
        partials = [n for n in self.graph.nodes if is_stitched_partial(n) or is_looped_partial(n)]
        if not partials:
            return
        fusable = set(self.roles.fusable)
        parts = {p: _elementwise_part(p, fusable) for p in partials}
        part_reads = {p: {o for n in part for o in n.operands} for p, part in parts.items()}
        position = self.graph.index.position
        # Most such unions close a cycle (a partial of another layer, or one that reads what the
        # candidate's reduction feeds): the union's closure, the OR of its parts', says so before
        # the union is built, ordered and checked node by node.
        cycles = self.legality.cycles
        part_closures = {p: cycles.closure(part) for p, part in parts.items()}
        origin = "substitution fusion, row reductions stitched with partial column sums"
        for candidate in list(self.candidates):
            rows = [n for n in candidate.nodes if _row_reduction(n)]
            if not rows:
                continue
            union = set(candidate.nodes)
            reads: set[Node] | None = None  # what the union computes or reads, made when first asked
            closure = None  # the union's, made when first asked
            for partial, part in parts.items():
                if partial in union or not any(_same_rows(partial, r) for r in rows):
                    continue
                if reads is None:
                    reads = {o for n in union for o in n.operands} | union
                if part_reads[partial].isdisjoint(reads) and not (part & union):
                    continue
                if part_closures[partial] is not None:
                    closure = closure or cycles.closure(union)
                    if (closure | part_closures[partial]).contracts_cycle():
                        continue
                grown_set = union | part
                if frozenset(grown_set) in self.seen:  # proposed before: no need to order it
                    continue
                grown = sorted(grown_set, key=position.__getitem__)
                found = _propose_union(grown, self.seen, self.legality, origin)
                if found is not None:
                    self.candidates.append(found)
                    union, reads, closure = set(grown), None, None

    # -- Algorithm 1 ----------------------------------------------------------------------------
    def _segments(self, partition: Sequence[Callable[[Node], bool]], closing: bool) -> list[list[Node]]:
        """Runs of fusable nodes in graph order, cut at library calls and at every partition op: before
        it (the op opens the next run, as in the paper) or, with ``closing``, after it (the op ends
        its run, so that a reduction takes in its producers)."""
        segments: list[list[Node]] = []
        current: list[Node] = []
        fusable = set(self.roles.fusable)
        for node in self.graph.nodes:
            if node in self.roles.library:
                if current:
                    segments.append(current)
                current = []
            elif node in fusable:
                cut = any(p(node) for p in partition)
                if cut and not closing and current:
                    segments.append(current)
                    current = []
                current.append(node)
                if cut and closing:
                    segments.append(current)
                    current = []
        if current:
            segments.append(current)
        return segments

    def _propose_segment(self, segment: list[Node], origin: str) -> None:
        components = _components(segment)
        if len(components) > 1:
            self._propose(segment, origin + " (packed)")
        for component in components:
            self._propose(component, origin)

    def _propose(self, nodes: Sequence[Node], origin: str) -> None:
        """Only ``buildable`` is asked: a component of a segment (a run of graph order) cannot close a
        cycle, every path between two of its nodes runs through nodes between them in that order.
        Refused, it is asked again without its boundary reshapes, which then run as views."""
        if len(nodes) < 2 or not first_proposal(self.seen, nodes):
            return
        verdict = self.legality.buildable(list(nodes))
        if verdict:
            self.candidates.append(Candidate(tuple(nodes), verdict, origin))
            return
        trimmed = _strip_boundary_reshapes(nodes, self.graph)
        if len(trimmed) < len(nodes):
            retry = self.legality.buildable(trimmed) if len(trimmed) >= 2 else verdict
            if retry:
                if first_proposal(self.seen, trimmed):
                    self.candidates.append(Candidate(tuple(trimmed), retry, origin + ", boundary reshapes as views"))
                return
        self.rejections.append(Rejection(tuple(nodes), verdict.reason, origin))


def _components(segment: Sequence[Node]) -> list[list[Node]]:
    """Weakly connected components of the segment's own edges, each in graph order."""
    members = {node: i for i, node in enumerate(segment)}
    parent = list(range(len(segment)))

    def find(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    for node, i in members.items():
        for operand in node.operands:
            j = members.get(operand)
            if j is not None:
                a, b = find(i), find(j)
                if a != b:
                    parent[max(a, b)] = min(a, b)
    groups: dict[int, list[Node]] = {}
    for node, i in members.items():
        groups.setdefault(find(i), []).append(node)
    return sorted(groups.values(), key=lambda g: members[g[0]])


def _strip_boundary_reshapes(nodes: Sequence[Node], graph: Graph) -> list[Node]:
    """The nodes without the reshapes that only read from outside or only feed outside, repeatedly
    (a chain of reshapes at the boundary goes as a whole)."""
    users = graph.index.users
    kept = list(nodes)
    while True:
        members = set(kept)
        boundary = {n for n in kept if n.op == "reshape"
                    and (n.operands[0] not in members or all(u not in members for u in users[n]))}
        if not boundary:
            return kept
        kept = [n for n in kept if n not in boundary]


__all__ = ["PARTITION_STEPS", "Candidate", "Rejection", "SubstitutionFusion"]


def _through_reshapes(node: Node) -> Node:
    """The value a chain of reshapes views (reshapes run as views of their operand's memory)."""
    while node.op == "reshape":
        node = node.operands[0]
    return node


def _lone_reshape(group: Sequence[Node]) -> bool:
    """A leftover reshape: it runs as a view of its operand's memory, so merging it gains nothing."""
    return len(group) == 1 and group[0].op == "reshape"


def first_proposal(seen: set[frozenset[Node]], nodes: Iterable[Node]) -> bool:
    """Whether no generator proposed this node set yet (``seen`` is shared between generators: each
    pattern is checked once); marks it proposed."""
    key = frozenset(nodes)
    if key in seen:
        return False
    seen.add(key)
    return True


def _propose_union(union: list[Node], seen: set[frozenset[Node]], legality: Legality, origin: str
                   ) -> Candidate | None:
    """A candidate for ``union`` (nodes in graph order) if it is new and legal (cycles included)."""
    if not first_proposal(seen, union):
        return None
    verdict = legality.check(union)
    return Candidate(tuple(union), verdict, origin) if verdict else None


def _connected_parts(group: Sequence[Node]) -> list[list[Node]]:
    """``group``'s nodes split into the parts its own edges connect (one part for a fused pattern,
    several for a packing of independent ones)."""
    members = {id(n) for n in group}
    sets = UnionFind()
    for node in group:
        for operand in node.operands:
            if id(operand) in members:
                sets.union(id(operand), id(node))
    parts: dict[int, list[Node]] = {}
    for node in group:
        parts.setdefault(sets.find(id(node)), []).append(node)
    return list(parts.values())


class _Seed:
    """A pattern of the selected plan as ``NeighbourMerging``'s helpers ask about it: its nodes (as
    given and in graph order), their set, what they read, the nodes whose values leave it, and its
    connected parts with their node and operand sets."""

    def __init__(self, nodes: Sequence[Node], graph: Graph) -> None:
        users, outputs = graph.index.users, graph.index.output_ids
        self.nodes = nodes
        self.ordered = sorted(nodes, key=graph.index.position.__getitem__)
        self.members = set(nodes)
        self.reads = {x for n in nodes for x in n.operands}
        self.escaping = [n for n in nodes if id(n) in outputs or any(u not in self.members for u in users[n])]
        # the nodes only the seed reads, last first
        escaping = set(self.escaping)
        self.internal = [n for n in reversed(self.ordered) if users[n] and n not in escaping]
        self.parts = _connected_parts(nodes)
        self.part_sets = [set(part) for part in self.parts]
        self.part_reads = [{x for n in part for x in n.operands} for part in self.parts]
        self.proposed: set[int] = set()  # parts ``_unpacking`` proposed alone already


MERGE_MAX_OPS = 64
MERGE_SMALL_OPS = 4


class PlanSeeded:
    """A generator that proposes unions of the patterns of a selected plan; ``seen`` is shared
    with the other generators, so no union is checked twice."""

    def __init__(self, graph: Graph, roles: Roles, legality: Legality, seen: set[frozenset[Node]]) -> None:
        self.graph = graph
        self.roles = roles
        self.legality = legality
        self.seen = seen


class NeighbourMerging(PlanSeeded):
    """Exploratory fusion [B §4.2.2] seeded with a selected plan: each pattern (or leftover node) is
    expanded by one neighbouring pattern along a producer→consumer edge. Substitution fusion never
    fuses across a partition op, so ops that sit between different GEMMs in the topological order
    (a gradient accumulated from two GEMMs' outputs) are only found this way. Patterns that read a
    common value are paired too (sibling fusion: LayerNorm backward's dγ and dβ partial sums both read
    the output gradient, which one kernel then reads once). Each union is checked
    for cycles and by the schedule stage like every candidate. Unions over ``MERGE_MAX_OPS`` ops are
    not proposed, nor sibling unions where both sides have over ``MERGE_SMALL_OPS``: lowering is
    what exploration time is spent on, and what sibling fusion exists for is the small leftovers.
    A producer and its consumer are proposed at any size: a softmax left as two large halves (an
    f32 round trip between them) is found this way. A leftover
    reshape is no seed: it runs as a view."""

    def run(self, groups: Sequence[Sequence[Node]]) -> list[Candidate]:
        fusable = set(self.roles.fusable)
        owner: dict[Node, int] = {}
        seeds = [tuple(g) for g in groups]
        for k, group in enumerate(seeds):
            for node in group:
                owner[node] = k
        for node in self.roles.fusable:
            if node not in owner:
                owner[node] = len(seeds)
                seeds.append((node,))
        pairs: dict[tuple[int, int], None] = {}
        readers: dict[Node, list[int]] = {}  # a value read from outside by several patterns: siblings
        for node in self.roles.fusable:
            for operand in node.operands:
                if operand in fusable and owner[operand] != owner[node]:
                    pairs[(owner[operand], owner[node])] = None
                if operand not in fusable or owner[operand] != owner[node]:
                    readers.setdefault(_through_reshapes(operand), []).append(owner[node])
        for siblings in readers.values():
            siblings = sorted({k for k in siblings if not _lone_reshape(seeds[k])})
            for a, b in itertools.pairwise(siblings):
                pairs[(a, b)] = None
        edges = set(pairs)
        pairs = {(a, b): None for a, b in pairs if not _lone_reshape(seeds[a]) and not _lone_reshape(seeds[b])}
        position = self.graph.index.position
        found = []
        for a, b in pairs:
            if len(seeds[a]) + len(seeds[b]) > MERGE_MAX_OPS:
                continue
            if (a, b) not in edges and min(len(seeds[a]), len(seeds[b])) > MERGE_SMALL_OPS:
                continue
            union = sorted(set(seeds[a]) | set(seeds[b]), key=position.__getitem__)
            candidate = _propose_union(union, self.seen, self.legality, "exploratory fusion of neighbouring patterns")
            if candidate is not None:
                found.append(candidate)
        # A seed meets many neighbours: what the helpers ask of it is made once.
        known: dict[int, _Seed] = {}

        def seed(k: int) -> _Seed:
            if k not in known:
                known[k] = _Seed(seeds[k], self.graph)
            return known[k]

        for a, b in pairs:
            if (a, b) in edges:
                producer, consumer = seed(a), seed(b)
                found += self._evicting(producer, consumer)
                found += self._moving(producer, consumer)
                found += self._unpacking(producer, consumer)
        return found

    def _unpacking(self, producer: _Seed, consumer: _Seed) -> list[Candidate]:
        """The parts of two packed patterns that the edge joins merged, each pattern's other parts
        left packed as they were. A pattern can be a packing of unconnected parts (a softmax's
        division packed with a weight's cast); merged whole with its neighbour, the unconnected part
        can make the union illegal or slow, and the connected parts (a softmax split in two, its
        exponentials written in f32 and read back) stay apart."""
        if len(producer.parts) == len(consumer.parts) == 1:
            return []  # nothing to leave packed
        joined, rest = [], []
        for mine, other in ((producer, consumer), (consumer, producer)):
            if len(mine.parts) == 1:
                joined += mine.parts[0]
                if len(joined) > MERGE_MAX_OPS:
                    return []
                continue
            for k, (part, members, reads) in enumerate(zip(mine.parts, mine.part_sets, mine.part_reads)):
                # the part reads the other pattern's nodes or the other pattern reads the part's
                if not reads.isdisjoint(other.members) or not members.isdisjoint(other.reads):
                    joined.extend(part)
                    if len(joined) > MERGE_MAX_OPS:
                        return []
                else:
                    rest.append((mine, k))
        if not rest or len(joined) > MERGE_MAX_OPS:
            return []
        position = self.graph.index.position
        unions = [sorted(joined, key=position.__getitem__)]
        for seed, k in rest:  # a part left packed is the same for every neighbour: proposed once
            if k not in seed.proposed:
                seed.proposed.add(k)
                unions.append(sorted(seed.parts[k], key=position.__getitem__))
        found = []
        for nodes in unions:
            candidate = _propose_union(nodes, self.seen, self.legality,
                                       "exploratory fusion of neighbouring patterns, unconnected parts left packed")
            if candidate is not None:
                found.append(candidate)
        return found

    def _moving(self, producer: _Seed, consumer: _Seed) -> list[Candidate]:
        """The producer's nodes that only the consumer reads (with the nodes that only feed them)
        moved into the consumer: their values are then never written to memory. A selected plan
        can hold such a node in a pattern packed for another reason (ResNet's backward packed the
        ReLU masks of several layers into one kernel, which wrote each mask as bytes its layer's
        kernel read back); then merging producer and consumer whole is too large or makes a cycle,
        and only moving the nodes lets the consumer compute them."""
        # Moving starts from a node that only the consumer reads: none without an edge between them,
        # and none small enough with a consumer of MERGE_MAX_OPS nodes.
        if len(consumer.nodes) >= MERGE_MAX_OPS or consumer.reads.isdisjoint(producer.members):
            return []
        users = self.graph.index.users
        outputs = self.graph.index.output_ids
        position = self.graph.index.position
        reader = consumer.members
        moved: set[Node] = set()
        for node in reversed(producer.ordered):
            if id(node) not in outputs and users[node] and all(u in reader or u in moved for u in users[node]):
                moved.add(node)
        rest = [n for n in producer.nodes if n not in moved]
        if not moved or not rest or len(moved) + len(consumer.nodes) > MERGE_MAX_OPS:
            return []
        found = []
        for nodes in (rest, sorted(moved | reader, key=position.__getitem__)):
            candidate = _propose_union(list(nodes), self.seen, self.legality,
                                       "exploratory fusion of neighbouring patterns, producer nodes moved")
            if candidate is not None:
                found.append(candidate)
        return found

    def _evicting(self, producer: _Seed, consumer: _Seed) -> list[Candidate]:
        """The producer's side outputs of another shape than what the consumer reads, with the
        nodes that only feed them, moved to a pattern of their own, so that the rest of the producer
        can merge with the consumer. BERT's attention mask [b, 1, s, s] is computed in the first
        layer's scores kernel and kept for the later layers: with it, that kernel's grid differs
        from the softmax's and the first layer's softmax ran as two thread-serial kernels."""
        users = self.graph.index.users
        read_by_consumer = producer.members & consumer.reads
        if len(read_by_consumer) + len(consumer.nodes) > MERGE_MAX_OPS:
            return []  # what the consumer reads always stays with it: the union would be too large
        read = {n.shape for n in read_by_consumer}
        side = {n for n in producer.escaping if n.shape not in read and n not in read_by_consumer}
        if not side:
            return []
        evicted = set(side)
        for node in producer.internal:  # evicted with what it feeds, when that is all evicted
            if node not in evicted and all(u in evicted for u in users[node]):
                evicted.add(node)
        rest = [n for n in producer.nodes if n not in evicted]
        if not rest or len(rest) + len(consumer.nodes) > MERGE_MAX_OPS:
            return []
        position = self.graph.index.position
        found = []
        for nodes in (sorted(evicted, key=position.__getitem__),
                      sorted(consumer.members.union(rest), key=position.__getitem__)):
            candidate = _propose_union(nodes, self.seen, self.legality,
                                       "exploratory fusion of neighbouring patterns, side outputs evicted")
            if candidate is not None:
                found.append(candidate)
        return found


SINK_PACK_MAX_BYTES = 1 << 20
SINK_PACK_MAX_PATTERNS = 32


class SinkPacking(PlanSeeded):
    """Kernel packing of small independent patterns at the ends of the graph (C §4.1's packing
    scheme): the final reduces of split bias and LayerNorm gradients each read a few kilobytes and
    feed only graph outputs (directly or through views). Nothing can depend on such a pattern, so
    any number of them contract into one kernel without a cycle; they are proposed in groups of up
    to ``SINK_PACK_MAX_PATTERNS`` (a bound on kernel parameters) of patterns with the same ops and
    shapes, in graph order (the packed template of the schedule stage handles equal shapes best)."""

    def run(self, groups: Sequence[Sequence[Node]]) -> list[Candidate]:
        by_shape: dict[tuple, list[tuple[Node, ...]]] = {}
        for group in groups:
            if self._is_small_sink(group):
                by_shape.setdefault(tuple((n.op, n.shape, n.dtype) for n in group), []).append(tuple(group))
        chunks = [sinks[start:start + SINK_PACK_MAX_PATTERNS] for sinks in by_shape.values()
                  for start in range(0, len(sinks), SINK_PACK_MAX_PATTERNS)]
        found = []
        for chunk in chunks:
            if len(chunk) < 2:
                continue
            union = sorted({n for g in chunk for n in g}, key=self.graph.index.position.__getitem__)
            candidate = _propose_union(union, self.seen, self.legality, "packing of small patterns that feed only outputs")
            if candidate is not None:
                found.append(candidate)
        return found

    def _is_small_sink(self, group: Sequence[Node]) -> bool:
        members = set(group)
        users = self.graph.index.users
        total = 0
        for node in group:
            total += node.size * node.dtype.itemsize
            for user in users[node]:
                if user not in members and not self._feeds_outputs_only(user):
                    return False
        return total <= SINK_PACK_MAX_BYTES

    def _feeds_outputs_only(self, node: Node) -> bool:
        """A shape op whose value only reaches graph outputs (through more shape ops)."""
        if node.category != Category.SHAPE:
            return False
        return all(self._feeds_outputs_only(u) for u in self.graph.index.users[node])
