"""Plan selection by beam search of width 3 [C §5.3], the second selector beside the ILP.

Paper C: every candidate pattern belongs to a vertex (here: its first node in graph order, its
"producer vertex"); the search keeps ``BEAM_WIDTH`` buffer sets, each a partial plan of disjoint
patterns, traverses the vertices from producers to consumers and tries to append each candidate
pattern of the vertex to each buffer set "if it introduces no overlapping"; of the sets this gives
(the old ones included: a set may skip a vertex's patterns), the ``BEAM_WIDTH`` with the highest
accumulated score f are kept. After the last vertex every buffer set is a candidate plan, and the
latency evaluator picks the final one (``explore`` finalizes each and compares ``estimate.plan_time_us``).

Like the ILP, only patterns with a positive score take part. Two patterns can be disjoint and
still close a cycle together (paper B Figure 3); checking the contracted graph on every append
would cost a graph traversal per append, so each final buffer set is checked once, and while it has
a cycle the pattern on the cycle with the lowest score is dropped (a repair step the paper does not
describe: it discards cyclic patterns during pattern search, which covers single patterns only).
Sets are node bitmasks (Python ints), which makes the overlap test one ``&``. Ties are broken by
candidate order, so the search is deterministic.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from fusionstitching.fusion.select import Selection, break_cycles
from fusionstitching.graph.graph import Graph, Node

BEAM_WIDTH = 3


@dataclass(frozen=True)
class _Buffer:
    score: float
    chosen: tuple[int, ...]
    covered: int  # bitmask of node positions


def select_beam(graph: Graph, patterns: Sequence[Sequence[Node]], scores: Sequence[float],
                width: int = BEAM_WIDTH) -> list[Selection]:
    """The ``width`` buffer sets of the beam search, best accumulated score first, each acyclic."""
    position = graph.index.position
    masks: dict[int, int] = {}
    by_vertex: dict[int, list[int]] = {}
    for i, (nodes, score) in enumerate(zip(patterns, scores)):
        if score <= 0 or not nodes:
            continue
        mask = 0
        for node in nodes:
            mask |= 1 << position[node]
        masks[i] = mask
        by_vertex.setdefault(min(position[n] for n in nodes), []).append(i)
    beam = [_Buffer(0.0, (), 0)]
    for vertex in sorted(by_vertex):
        expanded: dict[tuple[int, ...], _Buffer] = {}
        for buffer in beam:
            expanded.setdefault(buffer.chosen, buffer)
            for i in by_vertex[vertex]:
                if buffer.covered & masks[i]:
                    continue
                grown = _Buffer(buffer.score + scores[i], buffer.chosen + (i,), buffer.covered | masks[i])
                expanded.setdefault(grown.chosen, grown)
        beam = sorted(expanded.values(), key=lambda b: -b.score)[:width]
    selections = []
    seen: set[tuple[int, ...]] = set()
    for buffer in beam:
        chosen, dropped = break_cycles(graph, patterns, scores, list(buffer.chosen))
        key = tuple(sorted(chosen))
        if key in seen:
            continue
        seen.add(key)
        selections.append(Selection(list(key), sum(scores[i] for i in key), 1, [tuple(dropped)] if dropped else []))
    return selections


__all__ = ["BEAM_WIDTH", "select_beam"]
