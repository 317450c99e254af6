"""A packed kernel whose sub-kernel recomputes a reduction: ``sums`` (64 rows of 256) is read by
``scaled``, which runs in its own lanes and so sums each row again at each point, beside a small
independent sum of 64 rows of 16. Shared by the exploration and tuner tests."""

from __future__ import annotations

from fusionstitching.graph.graph import Graph, GraphBuilder, Node
from fusionstitching.graph.ops import DType
from fusionstitching.schedule.template import KernelSchedule, Launch, Level, Schedule, Tile


def recomputing_kernel(reads_a_reduction: bool = True) -> tuple[Graph, list[Node], KernelSchedule]:
    """(graph, nodes, packed schedule); without ``reads_a_reduction`` ``scaled`` multiplies two
    inputs instead, and nothing is recomputed."""
    b = GraphBuilder("recomputed" if reads_a_reduction else "read")
    if reads_a_reduction:
        first = b.reduce(b.parameter((64, 256), DType.F32, "z"), [1], "sum")
    else:
        first = b.parameter((64,), DType.F32, "t")
    scaled = b.binary("mul", first, b.parameter((64,), DType.F32, "s"))
    other = b.reduce(b.parameter((64, 16), DType.F32, "u"), [1], "sum")
    graph = b.build([scaled, other])
    nodes = [n for n in graph.nodes if n.op != "parameter"]
    lanes, grid, thread = (Tile(Level.GRID), Tile(Level.CTA, 32)), (Tile(Level.GRID),), (Tile(Level.THREAD),)
    packed = KernelSchedule((Schedule(scaled.name, (lanes,)), Schedule(other.name, (grid, thread))), Launch(66, 256))
    return graph, nodes, packed
