"""The reshapes graph/collapse.py adds at a merged region's edges run as views: no kernel writes
a reshaped copy of an input or of a value going to a library call or out of the graph."""

from __future__ import annotations

from fusionstitching.fusion.explore import explore
from fusionstitching.graph.graph import GraphBuilder
from fusionstitching.graph.ops import DType
from fusionstitching.options import Options


def _batchnorm_backward_then_convolution(shape=(8, 16, 28, 28)):
    """BatchNorm backward statistics over N, H, W and dx, which a convolution's backward (a library
    call) reads and which is also returned."""
    b = GraphBuilder("bn")
    x, dy, mean = b.parameter(shape, DType.F32, "x"), b.parameter(shape, DType.F32, "dy"), \
        b.parameter(shape[1:2], DType.F32, "mean")
    centered = b.binary("sub", x, b.broadcast(mean, shape, (1,)))
    sum_dy = b.reduce(dy, (0, 2, 3), "sum")
    sum_dy_xmu = b.reduce(b.binary("mul", dy, centered), (0, 2, 3), "sum")
    dx = b.binary("sub", dy, b.binary("mul", centered, b.broadcast(sum_dy, shape, (1,))))
    call = {"args": [{"operand": 0}]}
    lib = b.node("library", [dx], shape=shape, dtype=DType.F32, target="aten.relu.default", call=call, out_index=-1)
    return b.build([sum_dy, sum_dy_xmu, dx, lib])


def test_edge_reshapes_of_a_merged_region_are_views():
    graph = _batchnorm_backward_then_convolution()
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
