"""``pipeline.py``: the stages for one graph and ``fusionstitching.explain`` for any callable."""

from __future__ import annotations

import numpy as np
import torch

import fusionstitching


def test_explain_writes_every_stage_of_a_functions_forward_and_backward(tmp_path):
    def scaled_softmax(x, w):
        return torch.softmax(x * w, -1).sum(0)

    files = fusionstitching.explain(scaled_softmax, torch.randn(8, 33, requires_grad=True), torch.randn(33),
                                    out=tmp_path, train=True)
    assert {p.parent.name for p in files} == {"scaled_softmax_forward", "scaled_softmax_backward"}
    for name in ("scaled_softmax_forward", "scaled_softmax_backward"):
        folder = tmp_path / name
        assert (folder / "1-graph.txt").read_text().startswith(f"graph {name}(")
        assert "kernel 0:" in (folder / "2-explore.txt").read_text()
        sources = sorted(folder.glob("3-kernel*.cu"))
        assert sources and all("__global__" in s.read_text() for s in sources)
        report = (folder / "4-resources.txt").read_text().splitlines()
        assert report[0] == "ptxas resource report per kernel for sm_90:" and len(report) == 3 + len(sources)
    assert "exp" in (tmp_path / "scaled_softmax_forward" / "1-graph.txt").read_text()


def test_explain_of_a_module_without_train_writes_its_one_graph(tmp_path):
    module = torch.nn.Sequential(torch.nn.LayerNorm(48), torch.nn.GELU())
    files = fusionstitching.explain(module, torch.randn(4, 48), out=tmp_path, arch=None)
    assert {p.parent.name for p in files} == {"Sequential"}
    assert not (tmp_path / "Sequential" / "4-resources.txt").exists()
    graph = (tmp_path / "Sequential" / "1-graph.txt").read_text()
    assert "rsqrt" in graph and "erf" in graph  # the layer norm and the exact GELU, captured


def test_the_compiled_graph_runs_the_steps_the_pipeline_generated_and_ordered():
    from fusionstitching.cli import capture_workload
    from fusionstitching.fusion import explore
    from fusionstitching.graph import reference
    from fusionstitching.pipeline import STAGES, ordered_steps
    from fusionstitching.runtime.executor import CompiledGraph

    assert STAGES == ("capture", "explore", "generate", "order", "compile", "run")
    _, captured = capture_workload("layernorm", train=True)
    graph = captured.backward
    plan = explore(graph)
    steps = ordered_steps(plan)
    compiled = CompiledGraph(plan, steps)
    assert compiled.steps == steps and all(a.kernel is b.kernel for a, b in zip(compiled.steps, steps))
    produced = set()
    for step in steps:  # every step after the steps making its inputs
        assert all(x in produced or x.op in ("parameter", "constant") for x in step.inputs), step.nodes[0].name
        produced.update(step.outputs)
    rng = np.random.default_rng(0)
    inputs = [rng.standard_normal(p.shape).astype(p.dtype.numpy) for p in graph.parameters]
    for got, want in zip(compiled.run_numpy(inputs), reference.evaluate(graph, inputs)):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


def test_two_layers_dropouts_share_one_kernel_source_and_each_draws_its_own_numbers():
    """Each dropout's stream is an input its kernel reads: the dropouts after two matmuls are one
    source (the second kernel is the first's twin: one generation, one compile), and the simulated
    kernels give the reference's numbers, different for each stream."""
    import torch.nn.functional as F

    from fusionstitching.frontend.torch_fx import capture
    from fusionstitching.graph.reference import evaluate
    from fusionstitching.options import Options
    from fusionstitching.pipeline import compile_graph

    def fn(x, w, v):
        first = F.dropout(x @ w, 0.5, True)
        return first, F.dropout(first @ v, 0.5, True)

    x, w, v = torch.randn(64, 32), torch.randn(32, 32), torch.eye(32)
    graph = capture(fn, x, w, v).forward
    compiled = compile_graph(graph, Options(strict=True))
    one, other = compiled.kernels
    assert other._twin is one and one.cuda_source == other.cuda_source
    tensors = [x, w, v, torch.tensor(-12345678901), torch.tensor(2**40 + 3)]
    assert [p.name for p in graph.parameters][3:] == ["rng_seed", "rng_offset"]
    got = compiled(*tensors)
    want = evaluate(graph, [t.numpy() for t in tensors])
    for g, e in zip(got, want):
        np.testing.assert_allclose(g.numpy(), e, rtol=1e-5, atol=1e-5)
    kept = [(g != 0).numpy() for g in got]
    assert not np.array_equal(kept[0], kept[1])  # v is the identity: equal streams would drop the same


def test_a_graph_planned_for_a_gpu_takes_its_gemm_timings_and_its_plan_is_keyed_by_them(monkeypatch):
    """``pipeline.with_gemm_timings``: on a CUDA device the unaligned GEMMs' measured times join the
    options the graph is planned with (and so the plan cache's key); without a device, or with
    times given, the options stay as they are."""
    from fusionstitching.fusion import plan_cache
    from fusionstitching.fusion.explore import DEFAULT_GENERATORS
    from fusionstitching.graph.graph import GraphBuilder
    from fusionstitching.graph.ops import DType
    from fusionstitching.options import Options
    from fusionstitching.pipeline import with_gemm_timings
    from fusionstitching.runtime import gemm_timing

    b = GraphBuilder("scores")
    q, k = (b.parameter((96, 300, 64), DType.BF16, name) for name in "qk")
    graph = b.build([b.node("dot_general", [q, k], lhs_batch=(0,), rhs_batch=(0,), lhs_contract=(2,),
                            rhs_contract=(2,))])
    timed = []
    monkeypatch.setattr(gemm_timing, "gemm_timings",
                        lambda graph, options, device: timed.append(device) or (("scores problem", 26.4, 9.8),))
    options = Options()
    assert with_gemm_timings(graph, options, None) is options
    assert with_gemm_timings(graph, options, torch.device("cpu")) is options and timed == []
    planned = with_gemm_timings(graph, options, torch.device("cuda", 0))
    assert planned.gemm_timings == (("scores problem", 26.4, 9.8),) and len(timed) == 1
    assert with_gemm_timings(graph, planned, torch.device("cuda", 0)) is planned and len(timed) == 1
    assert plan_cache.plan_key(graph, "ilp", DEFAULT_GENERATORS, planned) != \
        plan_cache.plan_key(graph, "ilp", DEFAULT_GENERATORS, options)
