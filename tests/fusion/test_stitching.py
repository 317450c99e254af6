"""Row reductions stitched with the partial column sums over their rows (LayerNorm backward), the
vectorized tiling of narrow rows, and bf16 ``addmm`` kept a bf16 GEMM (frontend)."""

from __future__ import annotations

import warnings

import numpy as np
import torch

from fusionstitching.bench.workloads import layernorm
from fusionstitching.codegen import default_template
from fusionstitching.frontend.torch_fx import capture
from fusionstitching.fusion import explore
from fusionstitching.graph import reference
from fusionstitching.graph.graph import GraphBuilder
from fusionstitching.graph.ops import DType
from fusionstitching.pipeline import compile_plan


def _inputs(graph, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(p.shape).astype(p.dtype.numpy) for p in graph.parameters]


def _relative(got, want) -> float:
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return float(np.abs(got - want).max() / max(np.abs(want).max(), 1e-30))


def test_layernorm_backward_is_dx_with_stitched_partials_and_a_final_sum():
    workload = layernorm(batch=2048, hidden=128, train=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        captured = capture(workload.fn, *workload.inputs, train=True, name="ln")
    graph = captured.backward
    plan = explore(graph)
    assert plan.kernel_count == 2, plan.explain()
    assert any("blocks of 8 rows" in note for note in plan.notes), plan.notes
    big = max(plan.patterns, key=len)
    template = str(big.schedule)
    assert "_partial[GRID,WARP_8," in template and "GRID-WARP_8" in template, template
    inputs = _inputs(graph)
    got = compile_plan(plan).run_numpy(inputs)
    want = reference.evaluate(graph, inputs)
    for g, w in zip(got, want):
        assert _relative(g, w) < 1e-5


def test_small_column_sums_stay_one_kernel():
    workload = layernorm(batch=16, hidden=64, train=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        captured = capture(workload.fn, *workload.inputs, train=True, name="ln")
    plan = explore(captured.backward)
    assert plan.kernel_count == 1 and not any("rows" in note for note in plan.notes if note.startswith("split"))


def test_narrow_rows_get_vector_accesses_with_several_rows_per_block():
    b = GraphBuilder("narrow")
    x, y = b.parameter((50, 768), DType.F32, "x"), b.parameter((50, 768), DType.F32, "y")
    out = b.binary("add", b.binary("mul", x, y), y)
    graph = b.build([out])
    nodes = [n for n in graph.nodes if n.op not in ("parameter",)]
    template = str(default_template(graph, nodes))
    assert "[GRID-CTA_4,GRID-CTA_64-THREAD_4]" in template, template
    from fusionstitching.codegen import generate

    kernel = generate(graph, nodes, default_template(graph, nodes))
    assert "float4" in kernel.cuda_source
    inputs = _inputs(graph)
    got = kernel.simulate(inputs)[0]
    np.testing.assert_allclose(got, inputs[0] * inputs[1] + inputs[1], rtol=1e-6)


def test_bf16_addmm_is_a_bf16_dot():
    linear = torch.nn.Linear(32, 16).to(torch.bfloat16)
    x = torch.randn(8, 32).to(torch.bfloat16)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        graph = capture(linear, x, name="linear").forward
    dots = [n for n in graph.nodes if n.op == "dot_general"]
    assert len(dots) == 1 and dots[0].dtype == DType.BF16
    assert all(o.dtype == DType.BF16 for o in dots[0].operands)
    inputs = [np.asarray(t.detach().float().numpy()).astype(DType.BF16.numpy)
              for t in (linear.weight, linear.bias, x)]
    got = reference.evaluate(graph, inputs)[0]
    want = linear(x).float().detach().numpy()
    assert _relative(got, want) < 2e-2
