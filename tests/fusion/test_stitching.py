"""Row reductions stitched with the partial column sums over their rows (LayerNorm backward), the
vectorized tiling of narrow rows, and bf16 ``addmm`` kept a bf16 GEMM (frontend)."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
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


def _wide_rmsnorm_backward(batch: int, hidden: int):
    from fusionstitching.bench.workloads import rmsnorm

    workload = rmsnorm(batch=batch, hidden=hidden, train=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        captured = capture(workload.fn, *workload.inputs, train=True, name="rms")
    return captured.backward


def test_rows_too_long_for_a_warp_carry_their_column_partials_in_the_grid_loop():
    """RMSNorm backward over 1024 rows of 2048 (a block per row): dw's partial sums ride in the dx
    kernel, each block summing the rows of its grid loop in registers, and the kernel computes
    what the reference does."""
    graph = _wide_rmsnorm_backward(1024, 2048)
    plan = explore(graph)
    assert any("carried by their kernel's grid loop" in note for note in plan.notes), plan.notes
    big = max(plan.patterns, key=len)
    template = str(big.schedule)
    assert "GRID_2-GRID," in template and "_partial[GRID,GRID," in template, template
    assert "launch(blocks=512," in template, template
    assert sum(1 for n in big.nodes if plan.graph.node(n).op == "reduce") == 2, big.nodes
    inputs = _inputs(graph)
    compiled = compile_plan(plan)
    kernel = next(k for k in compiled.kernels if "GRID_2-GRID" in str(k.template))
    body = kernel.cuda_source.split("__global__")[1]
    assert "acc" in body.split("for (")[0]  # the partial sums' registers precede the grid loop
    pytest.importorskip("cuda.bindings.nvrtc")
    from fusionstitching.codegen.nvrtc import compile_cuda

    compile_cuda(kernel.cuda_source, "sm_90")
    got = compiled.run_numpy(inputs)
    want = reference.evaluate(graph, inputs)
    for g, w in zip(got, want):
        assert _relative(g, w) < 2e-2  # bf16 outputs


def test_a_carried_partial_sums_exactly_the_rows_of_its_blocks_grid_loop():
    """The carried partial alone, against numpy: block b stores the sum of rows b, b + n, ... of
    its columns (f32, every element checked), and lowering refuses a launch whose blocks are not
    the kept GRID points (each block would then visit other rows)."""
    from fusionstitching.codegen import generate
    from fusionstitching.codegen.values import CodegenError
    from fusionstitching.schedule.template import parse_template

    b = GraphBuilder("carried")
    x = b.parameter((64, 2048), DType.F32, "x")
    w = b.parameter((64, 1), DType.F32, "w")
    sq = b.binary("mul", x, x)
    rows = b.reduce(sq, (1,), "sum")
    scaled = b.binary("mul", x, b.broadcast(w, (64, 2048), (0, 1)))
    split = b.reshape(scaled, (4, 16, 2048))
    partial = b.reduce(split, (0,), "sum")
    graph = b.build([rows, partial])
    nodes = [n for n in graph.nodes if n.op != "parameter"]
    text = (f"{rows.name}[GRID_4-GRID,CTA_256-THREAD_8]; {partial.name}[GRID,GRID,CTA_256-THREAD_8]; "
            "launch(blocks=16,threads=256)")
    kernel = generate(graph, nodes, parse_template(text))
    inputs = _inputs(graph)
    got_rows, got_partial = kernel.simulate(inputs)
    xs, ws = inputs
    np.testing.assert_allclose(got_rows, (xs * xs).sum(1), rtol=1e-5)
    np.testing.assert_allclose(got_partial, (xs * ws).reshape(4, 16, 2048).sum(0), rtol=1e-5, atol=1e-5)
    with pytest.raises(CodegenError, match="split across blocks"):
        generate(graph, nodes, parse_template(text.replace("blocks=16", "blocks=8")))


def test_layernorm_backward_over_batched_wide_rows_carries_both_partials():
    """LayerNorm backward on [4, 256, 2048] f32: dgamma and dbeta both ride in the dx kernel, their
    split taking half of the batch dim, so the partials keep a batch dim and the final sums the rest."""
    torch.manual_seed(0)
    module = torch.nn.LayerNorm(2048)
    with torch.no_grad():
        module.weight.normal_()
        module.bias.normal_()
    x = torch.randn(4, 256, 2048, requires_grad=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        captured = capture(module, x, train=True, name="lnw")
    graph = captured.backward
    plan = explore(graph)
    assert sum("carried by their kernel's grid loop" in note for note in plan.notes) == 2, plan.notes
    big = max(plan.patterns, key=len)
    template = str(big.schedule)
    assert template.count("_partial[GRID,GRID,GRID,") == 2 and "[GRID_2-GRID,GRID," in template, template
    inputs = _inputs(graph)
    got = compile_plan(plan).run_numpy(inputs)
    want = reference.evaluate(graph, inputs)
    for g, w in zip(got, want):
        assert _relative(g, w) < 1e-5
