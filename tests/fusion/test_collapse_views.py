"""The reshapes graph/collapse.py adds at a merged region's edges run as views: no kernel writes
a reshaped copy of an input or of a value going to a library call or out of the graph."""

from __future__ import annotations

from fusionstitching.fusion.explore import explore
from fusionstitching.options import Options
from tests.graph.test_collapse import batchnorm_backward


def test_edge_reshapes_of_a_merged_region_are_views():
    graph = batchnorm_backward((8, 16, 28, 28), library_reader=True)
    plan = explore(graph, options=Options(device="H100"))
    fused = {name for pattern in plan.patterns for name in pattern.nodes}
    reshapes = [n.name for n in plan.graph.nodes if n.op == "reshape"]
    assert any(name.endswith("_flat") for name in reshapes) and any(name.endswith("_unflat") for name in reshapes)
    for name in reshapes:
        assert name in plan.views and name not in fused, plan.explain()
    # the statistics are row reductions over the merged 28 x 28 image
    rows = [n for n in plan.graph.nodes if n.op == "reduce" and len(n.operands[0].shape) == 3]
    assert rows and all(n.operands[0].shape[-1] == 784 for n in rows)
    unmerged = explore(graph, options=Options(device="H100", collapse_dims=False))
    assert not any(n.op == "reshape" and n.name.endswith("flat") for n in unmerged.graph.nodes)
