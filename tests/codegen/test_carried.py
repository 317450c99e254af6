"""Partial column sums carried by a row kernel's grid loop (``schedule/template.grid_carried``,
``codegen/registers._carry``): a norm-backward-like pattern over rows of a block each, with its
column sum split by ``graph.transforms`` row loops, built by ``row_partial_template`` at several
thread counts and dtypes; every kernel compiles with NVRTC and simulates equal to the reference."""

from __future__ import annotations

import numpy as np
import pytest

from fusionstitching.codegen import generate
from fusionstitching.codegen.values import CodegenError
from fusionstitching.graph import reference
from fusionstitching.graph.graph import Graph, GraphBuilder
from fusionstitching.graph.ops import DType
from fusionstitching.graph.pattern import resolve_pattern
from fusionstitching.graph.transforms import split_reductions
from fusionstitching.schedule.grouping import row_partial_template


def _graph(rows: int, cols: int, dtype: DType, parts: int):
    """dx-like rows (a row sum scaling each row) beside dw-like column sums of dy * x, the column
    sum split into ``parts`` row loops."""
    b = GraphBuilder("carried")
    x, dy = b.parameter((rows, cols), dtype, "x"), b.parameter((rows, cols), dtype, "dy")
    w = b.parameter((cols,), dtype, "w")
    xf, dyf = b.convert(x, DType.F32), b.convert(dy, DType.F32)
    wf = b.broadcast(b.convert(w, DType.F32), (rows, cols), (1,))
    row = b.reduce(b.binary("mul", b.binary("mul", xf, dyf), wf), (1,), "sum")
    dx = b.convert(b.binary("add", b.binary("mul", xf, b.broadcast(row, (rows, cols), (0,))), dyf), dtype)
    dw = b.reduce(b.binary("mul", dy, x), (0,), "sum")
    graph = b.build([dx, dw])
    return split_reductions(graph, {}, row_loops={dw.name: parts})


CASES = [  # rows, cols, dtype, parts, threads
    (64, 2048, DType.BF16, 4, 256),
    (64, 2048, DType.BF16, 8, 128),
    (48, 1536, DType.F32, 3, 256),
    (32, 4096, DType.F16, 2, 512),
    (40, 1024, DType.F32, 5, 1024),
]


def _kernel_nodes(graph):
    """Everything but the parameters and the final sum of the partials (with its convert)."""
    final = [n for n in graph.nodes if n.op == "reduce" and n.operands[0].op == "reduce"]
    after = {id(n) for n in final} | {id(n) for n in graph.nodes if n.op == "convert" and n.operands[0] in final}
    return [n for n in graph.nodes if n.op != "parameter" and id(n) not in after]


@pytest.mark.parametrize("rows, cols, dtype, parts, threads", CASES)
def test_carried_partials_simulate_as_the_reference(rows, cols, dtype, parts, threads):
    graph = _graph(rows, cols, dtype, parts)
    nodes = _kernel_nodes(graph)
    template = row_partial_template(resolve_pattern(graph, nodes), threads=threads)
    text = str(template)
    assert f"launch(blocks={rows // parts},threads={threads})" in text and f"GRID_{parts}-GRID" in text, text
    kernel = generate(graph, nodes, template)
    pytest.importorskip("cuda.bindings.nvrtc")
    from fusionstitching.codegen.nvrtc import compile_cuda

    compile_cuda(kernel.cuda_source, "sm_90")
    rng = np.random.default_rng(rows + cols)
    inputs = [rng.standard_normal(p.shape).astype(p.dtype.numpy) for p in graph.parameters]
    by_name = {p.name: a for p, a in zip(graph.parameters, inputs)}
    got = kernel.simulate([by_name[name] for name in kernel.inputs])
    sub = Graph(graph.parameters, [graph.node(name) for name in kernel.outputs], name="outputs")
    want = reference.evaluate(sub, inputs)
    tolerance = 2e-2 if dtype != DType.F32 else 1e-5
    for name, g, w in zip(kernel.outputs, got, want):
        w = np.asarray(w, np.float64)
        np.testing.assert_allclose(np.asarray(g, np.float64), w, rtol=tolerance,
                                   atol=tolerance * max(1.0, float(np.abs(w).max())), err_msg=name)


def test_a_carried_partial_with_a_tail_is_refused():
    """Rows of 1000 f32 take whole vectors with a tail of slots; a carried partial cannot mask them out
    of its registers, so lowering refuses (and the plan keeps the column sum in a kernel of its own)."""
    graph = _graph(16, 1000, DType.F32, 2)
    nodes = _kernel_nodes(graph)
    template = row_partial_template(resolve_pattern(graph, nodes))
    with pytest.raises(CodegenError, match="tail|tiles its kept dims|register body"):
        generate(graph, nodes, template)
