"""``baseline``: a rule-based, XLA-like fuser used for comparison (DESIGN.md "Fusion exploration").

Producer→consumer thread composition only. Nodes are visited users first; each node not yet in a
pattern starts one (it is the root), which then takes in a producer when

- the producer is light elementwise, a shape op or random number generation: no reduction, no
  expensive op and no dot is ever a producer inside a kernel (their results would have to cross
  threads, or be recomputed at a price);
- every user of the producer is already in the pattern (patterns are disjoint and nothing is
  duplicated);

and the same rules apply to the producer's producers. There is no packing of independent ops and
no splitting of reductions. Broadcasts are duplicated per user first, as in ``explore`` (and XLA). A pattern the schedule stage cannot build, or whose contraction would
make a cycle, is broken up into single-op kernels. Views and library calls follow the same rules
as the explored plan (``plan.finalize``), so kernel counts compare like with like.
"""

from __future__ import annotations

import time

from fusionstitching.fusion.legality import Legality, Roles
from fusionstitching.fusion.plan import Chosen, FusionPlan, finalize
from fusionstitching.graph.graph import Graph, Node
from fusionstitching.graph.ops import Category
from fusionstitching.graph.transforms import (
    duplicate_broadcasts,
    fold_views,
    merge_duplicates,
    widen_dots,
)
from fusionstitching.options import Options

PRODUCER_CATEGORIES = (Category.LIGHT_ELEMENTWISE, Category.SHAPE, Category.RANDOM)


def baseline(graph: Graph, options: Options | None = None) -> FusionPlan:
    options = options or Options()
    start = time.perf_counter()
    graph = duplicate_broadcasts(merge_duplicates(fold_views(graph)))
    if options.widen_dots:
        graph = widen_dots(graph)
    roles = Roles.of(graph, options)
    legality = Legality(graph, options)
    fusable = set(roles.fusable)
    users = graph.index.users
    assigned: set[Node] = set()
    chosen: list[Chosen] = []
    broken = 0
    for root in reversed(roles.fusable):
        if root in assigned:
            continue
        members = {root}
        frontier = [root]
        while frontier:
            node = frontier.pop()
            for producer in dict.fromkeys(node.operands):
                if producer in members or producer in assigned or producer not in fusable:
                    continue
                if producer.category not in PRODUCER_CATEGORIES:
                    continue
                if all(u in members for u in users[producer]):
                    members.add(producer)
                    frontier.append(producer)
        assigned |= members
        if len(members) == 1:
            continue  # finalize makes it a single-op kernel (or a view)
        verdict = legality.check(members)
        if verdict:
            ordered = tuple(sorted(members, key=graph.index.position.__getitem__))
            chosen.append(Chosen(ordered, verdict.schedule, 0.0, "baseline producer-consumer fusion"))
        else:
            broken += 1
    notes = [f"{broken} pattern(s) the schedule stage refused were broken into single ops"] if broken else []
    plan = finalize(graph, roles, legality, None, chosen, "baseline (XLA-like)", notes)
    plan.seconds = time.perf_counter() - start
    return plan
