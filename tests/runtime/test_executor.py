"""CompiledGraph: whole plans run against the reference (CPU: simulated kernels; GPU: launched)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fusionstitching.cli import capture_workload
from fusionstitching.fusion import explore
from fusionstitching.graph import reference
from fusionstitching.graph.graph import GraphBuilder, Layout
from fusionstitching.graph.ops import DType
from fusionstitching.pipeline import compile_plan
from fusionstitching.runtime.program import dot_function, view_function

gpu_only = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _inputs(graph, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    arrays = []
    for p in graph.parameters:
        if p.dtype.is_float:
            # Positive (valid under log and sqrt) and small: with |N(0,1)| weights an MLP's logits are
            # ~100, and log-softmax loses five digits to cancellation whatever the summation order.
            arrays.append(np.asarray(0.1 * np.abs(rng.standard_normal(p.shape)), dtype=p.dtype.numpy))
        elif p.dtype == DType.BOOL:
            arrays.append(np.asarray(rng.random(p.shape) > 0.3))
        else:
            arrays.append(np.asarray(rng.integers(0, 2, p.shape), dtype=p.dtype.numpy))
    return arrays


def _relative(got: np.ndarray, want: np.ndarray) -> float:
    got, want = got.astype(np.float64), want.astype(np.float64)
    return float(np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-30))


@pytest.mark.parametrize("name", ["layernorm_train", "mlp_train", "din_attention", "adam_step", "bert"])
def test_whole_plans_match_the_reference_on_cpu(name):
    _, captured = capture_workload(name)
    for graph in filter(None, (captured.forward, captured.backward)):
        compiled = compile_plan(explore(graph))
        inputs = _inputs(graph)
        got, want = compiled.run_numpy(inputs), reference.evaluate(graph, inputs)
        for g, w in zip(got, want):
            if w is not None:
                assert _relative(g, w) < 1e-5, graph.name
        assert compiled.counts["kernel"] == compiled.plan.kernel_count


def test_steps_respect_dependences_and_cover_every_node():
    _, captured = capture_workload("bert")
    compiled = compile_plan(explore(captured.forward))
    done = set(compiled.graph.parameters)
    done |= {n for n in compiled.graph.nodes if n.op == "constant"}
    for step in compiled.steps:
        assert all(x in done for n in step.nodes for x in n.operands if x not in step.nodes)
        done |= set(step.nodes)
    assert done == set(compiled.graph.nodes)
    kinds = {s.kind for s in compiled.steps}
    assert kinds == {"kernel", "library", "view"}


def test_torch_call_on_cpu_writes_mutations_in_place():
    b = GraphBuilder("update")
    p = b.parameter((64,), DType.F32, "p")
    g = b.parameter((64,), DType.F32, "g")
    half = b.broadcast(b.constant(0.5, DType.F32), (64,), ())
    new = b.binary("sub", p, b.binary("mul", g, half))
    graph = b.build([new], mutations={0: 0})
    compiled = compile_plan(explore(graph))
    params, grads = torch.randn(64), torch.randn(64)
    expected = params - 0.5 * grads
    (out,) = compiled(params, grads)
    assert out is params and torch.allclose(params, expected)


def _swap_graph(view: bool):
    """``a.copy_(b); b.copy_(2 * b)`` as functionalized: a's new value is b's old one (b itself, or a
    view of it), b's is computed. Both updates must read b before it is overwritten. The updates
    come in parameter order, b's first."""
    b = GraphBuilder("swap")
    pb = b.parameter((6, 8), DType.I64, "b")
    pa = b.parameter((6, 8), DType.I64, "a")
    old = b.transpose(b.transpose(pb, (1, 0)), (1, 0)) if view else pb
    doubled = b.binary("mul", pb, b.broadcast(b.constant(2, DType.I64), (6, 8), ()))
    del pa
    return b.build([doubled, old], mutations={0: 0, 1: 1})


@pytest.mark.parametrize("view", [False, True], ids=["parameter", "view"])
def test_an_update_reads_the_old_value_of_an_input_updated_in_the_same_call(view):
    """Found by the fuzzer (torch 2.11: ``x1.copy_(x0); ...; x0.copy_(2 * x1)``): a's new value is
    b's old value, but b was overwritten first (by a kernel in place or by the copy back), so a got
    2 × b."""
    _check_swap(view, "cpu")


@pytest.mark.gpu
@gpu_only
@pytest.mark.parametrize("view", [False, True], ids=["parameter", "view"])
def test_an_update_reads_the_old_value_of_an_input_updated_in_the_same_call_on_gpu(view):
    _check_swap(view, "cuda")


def _check_swap(view: bool, device: str) -> None:
    for chooser in ("ilp", "beam"):
        compiled = compile_plan(explore(_swap_graph(view), solver=chooser))
        a = torch.zeros(6, 8, dtype=torch.int64, device=device)
        b0 = torch.arange(48, device=device).reshape(6, 8)
        b = b0.clone()
        outs = compiled(b, a)
        assert torch.equal(a, b0) and torch.equal(b, 2 * b0), chooser
        assert outs[0] is b and outs[1] is a
        # on a GPU a kernel writing b in place would overwrite the old value before a is written
        assert not any(s.kernel.lowered.aliases for s in compiled.steps if s.kernel is not None)
    in_place = compile_plan(explore(_plain_update()))
    assert any(s.kernel.lowered.aliases for s in in_place.steps if s.kernel is not None)


def _plain_update():
    """b.copy_(2 * b) alone: written in place."""
    b = GraphBuilder("update")
    pb = b.parameter((6, 8), DType.I64, "b")
    doubled = b.binary("mul", pb, b.broadcast(b.constant(2, DType.I64), (6, 8), ()))
    return b.build([doubled], mutations={0: 0})


def _strided_update(layout):
    """x.mul_(0.5) on an input of ``layout``, the update read again by a product."""
    b = GraphBuilder("strided_update")
    x = b.parameter((256, 512), DType.F32, "x", layout=layout)
    w = b.parameter((512, 256), DType.F32, "w")
    half = b.binary("mul", x, b.broadcast(b.constant(0.5, DType.F32), (256, 512), ()))
    product = b.node("dot_general", [half, w], lhs_batch=(), rhs_batch=(), lhs_contract=(1,), rhs_contract=(0,))
    return b.build([half, product], mutations={0: 0})


def test_an_input_laid_out_other_than_contiguously_is_not_updated_in_place():
    """Written in place, the update had the input's strides where the kernel reading it was generated
    for a new output's: a GPU call raised "input mul has strides (4, 1, 2), the kernel was
    generated for (4, 2, 1)" (fuzz 1126201:819, ``x.mul_(0.5)`` on a transposed input). The
    simulator gives each value its own array, so only a GPU shows the crash."""
    def in_place(layout):
        compiled = compile_plan(explore(_strided_update(layout)))
        return any(s.kernel.lowered.aliases for s in compiled.steps if s.kernel is not None)

    assert not in_place(Layout((1, 256)))
    assert in_place(None) and in_place(Layout((512, 1)))


@pytest.mark.gpu
@gpu_only
def test_an_update_of_a_transposed_input_on_gpu():
    compiled = compile_plan(explore(_strided_update(Layout((1, 256)))))
    x, w = torch.randn(512, 256, device="cuda").t(), torch.randn(512, 256, device="cuda")
    want = x * 0.5
    updated, product = compiled(x, w)
    assert updated is x and torch.equal(x, want)
    # a sum of 512 products of magnitude ~1: rounding differs from torch's GEMM by ~1e-5 absolute
    torch.testing.assert_close(product, want @ w, atol=1e-4, rtol=1e-5)


def test_an_output_goes_to_the_device_its_caller_expects():
    """``output_devices``: an output that eager puts on another device than the graph runs on
    (``x.cpu()`` in a GPU graph) is moved there after the call."""
    b = GraphBuilder("moved")
    x = b.parameter((3, 4), DType.F32, "x")
    doubled = b.binary("mul", x, b.broadcast(b.constant(2.0, DType.F32), (3, 4), ()))
    graph = b.build([doubled, x])
    compiled = compile_plan(explore(graph), device=torch.device("cpu"),
                             output_devices=[torch.device("meta"), None])
    moved, kept = compiled(torch.ones(3, 4))
    assert moved.device.type == "meta" and moved.shape == (3, 4) and kept.device.type == "cpu"


def test_view_and_dot_functions_match_the_reference():
    b = GraphBuilder("views")
    x = b.parameter((4, 6, 8), DType.F32, "x")
    w = b.parameter((4, 8, 5), DType.F32, "w")
    t = b.transpose(x, (1, 0, 2))
    r = b.reshape(x, (24, 8))
    bc = b.broadcast(b.parameter((8,), DType.F32, "v"), (3, 8), (1,))
    d = b.node("dot_general", [x, w], lhs_batch=(0,), rhs_batch=(0,), lhs_contract=(2,), rhs_contract=(1,))
    m = b.parameter((24, 8), DType.F32, "m")
    k = b.parameter((5, 8), DType.F32, "k")
    plain = b.node("dot_general", [m, b.parameter((8, 5), DType.F32, "n")], lhs_batch=(), rhs_batch=(),
                   lhs_contract=(1,), rhs_contract=(0,))
    nt = b.node("dot_general", [m, k], lhs_batch=(), rhs_batch=(), lhs_contract=(1,), rhs_contract=(1,))
    free2 = b.node("dot_general", [x, k], lhs_batch=(), rhs_batch=(), lhs_contract=(2,), rhs_contract=(1,))
    rng = np.random.default_rng(1)
    xv, wv, vv, mv, kv, nv = (rng.standard_normal(s).astype(np.float32)
                              for s in ((4, 6, 8), (4, 8, 5), (8,), (24, 8), (5, 8), (8, 5)))
    for node, fn, args in ((t, view_function(t), [xv]), (r, view_function(r), [xv]), (bc, view_function(bc), [vv]),
                           (d, dot_function(d), [xv, wv]), (plain, dot_function(plain), [mv, nv]),
                           (nt, dot_function(nt), [mv, kv]), (free2, dot_function(free2), [xv, kv])):
        want = reference.evaluate_node(node, args)
        got = fn(*[torch.from_numpy(a) for a in args]).numpy()
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
        if node.op == "dot_general":  # M, K, N not multiples of 4 f32: the zero-padded product too
            assert fn.padding == [None]  # measured at the first call on a GPU only
            fn.padding[0] = True
            padded = fn(*[torch.from_numpy(a) for a in args])
            assert padded.shape == node.shape and padded.is_contiguous()
            np.testing.assert_allclose(padded.numpy(), want, rtol=1e-5, atol=1e-5)


@pytest.mark.gpu
@gpu_only
def test_unaligned_gemms_are_padded_where_measured_faster():
    """A GPT-2-like LM head (N = 50257) is measured once: padded or not, the product is the plain
    one's, and the choice holds for later calls."""
    from fusionstitching.runtime.program import PADDING_CHOICES

    b = GraphBuilder("head")
    h = b.parameter((4096, 768), DType.BF16, "h")
    w = b.parameter((50257, 768), DType.BF16, "w")
    node = b.node("dot_general", [h, w], lhs_batch=(), rhs_batch=(), lhs_contract=(1,), rhs_contract=(1,))
    fn = dot_function(node)
    hv = torch.randn(4096, 768, device="cuda", dtype=torch.bfloat16)
    wv = torch.randn(50257, 768, device="cuda", dtype=torch.bfloat16)
    before = dict(PADDING_CHOICES)
    got = fn(hv, wv)
    assert fn.padding[0] in (True, False) and PADDING_CHOICES["measured"] == before["measured"] + 1
    want = hv @ wv.T  # another kernel, K summed in another order: the bf16 results differ by rounding
    assert float((got.float() - want.float()).norm() / want.float().norm()) < 1e-2
    assert torch.equal(fn(hv, wv), got)
    assert PADDING_CHOICES["measured"] == before["measured"] + 1


@pytest.mark.gpu
@gpu_only
@pytest.mark.parametrize("name", ["layernorm_train", "mlp_train", "din_attention", "bert"])
def test_whole_plans_match_the_reference_on_gpu(name):
    _, captured = capture_workload(name)
    for graph in filter(None, (captured.forward, captured.backward)):
        compiled = compile_plan(explore(graph))
        inputs = _inputs(graph)
        want = reference.evaluate(graph, inputs)
        tensors = [torch.from_numpy(np.asarray(a)).cuda() for a in inputs]
        # the first call loads the kernels, the second takes the lean loop (and allocates the kept
        # buffers), later calls run the unrolled program (``runtime/unrolled.py``): on the same
        # inputs and on copies of them at other addresses
        for call in range(5):
            got = compiled(*(tensors if call % 2 == 0 else [t.clone() for t in tensors]))
            for g, w in zip(got, want):
                if w is not None:
                    assert _relative(g.cpu().numpy(), w) < 1e-5, (graph.name, call)
        assert compiled.counts["kernel"] == 5 * compiled.plan.kernel_count
        (program,) = compiled._programs.values()
        assert program.unrolled is not None and program.source.count("_launch(") == compiled.plan.kernel_count


@pytest.mark.gpu
@gpu_only
def test_reduce_overhead_replays_the_plan_with_new_inputs():
    _, captured = capture_workload("mlp_train")
    graph = captured.forward
    compiled = compile_plan(explore(graph), mode="reduce-overhead")
    for seed in range(4):
        inputs = _inputs(graph, seed)
        want = reference.evaluate(graph, inputs)
        got = compiled(*[torch.from_numpy(np.asarray(a)).cuda() for a in inputs])
        for g, w in zip(got, want):
            if w is not None:
                assert _relative(g.cpu().numpy(), w) < 1e-5, seed


def test_gpu_program_numbers_every_value_and_keeps_only_call_internal_buffers():
    """The program's preparation needs no GPU: slots for every value, buffers kept across calls only
    for kernel outputs that neither are graph outputs nor reach one through views."""
    from fusionstitching.runtime.program import CallOp, GpuProgram, KernelOp

    _, captured = capture_workload("bert")
    compiled = compile_plan(explore(captured.forward))
    program = GpuProgram(compiled.graph, compiled.steps, torch.device("cpu"),
                         lambda node, device: torch.from_numpy(np.asarray(node.attrs["value"])),
                         lambda node: (lambda *args: None))
    kernels = [op for op in program.ops if isinstance(op, KernelOp)]
    assert len(kernels) == compiled.plan.kernel_count
    views = {s.nodes[0] for s in compiled.steps if s.kind == "view"}
    read_by_kernels = {x for s in compiled.steps if s.kind == "kernel" for x in s.inputs}
    assert program.folded <= views and len(program.folded) > len(views) / 2  # most feed GEMMs only
    assert not program.folded & (read_by_kernels | set(compiled.graph.outputs))
    assert program.reshapes <= views and not program.reshapes & (program.folded | set(compiled.graph.outputs))
    assert len(program.ops) == len(compiled.steps) - len(program.folded) - len(program.reshapes)
    assert all(isinstance(op, (KernelOp, CallOp)) for op in program.ops)
    outputs = {k for k in program.output_slots if k is not None}
    for op in kernels:
        for slot, kept in zip(op.out_slots, op.kept):
            assert not (kept and slot in outputs)
    assert any(any(op.kept) for op in kernels)


def test_views_fold_into_the_library_calls_reading_them():
    """A chain of views read only by GEMMs runs inside the GEMM's step. On a CPU device a program
    without kernels runs through torch."""
    from fusionstitching.runtime.executor import _library_function
    from fusionstitching.runtime.program import GpuProgram

    b = GraphBuilder("folded")
    x = b.parameter((4, 64, 256), DType.F32, "x")
    w = b.parameter((512, 256), DType.F32, "w")  # a GEMM above the small-dot threshold: a library call
    flat = b.transpose(b.reshape(x, (256, 256)), (1, 0))
    wt = b.transpose(w, (1, 0))
    d = b.node("dot_general", [flat, wt], lhs_batch=(), rhs_batch=(), lhs_contract=(1,), rhs_contract=(0,))
    graph = b.build([d])
    compiled = compile_plan(explore(graph))
    program = GpuProgram(graph, compiled.steps, torch.device("cpu"), lambda node, device: None, _library_function)
    assert program.folded == {flat, flat.operands[0], wt}
    assert len(program.ops) == 1
    rng = np.random.default_rng(0)
    inputs = [rng.standard_normal(p.shape).astype(np.float32) for p in graph.parameters]
    want = reference.evaluate(graph, inputs)
    for _ in range(2):
        got = program.run([torch.from_numpy(a) for a in inputs])
        for g, w_ in zip(got, want):
            np.testing.assert_allclose(g.numpy(), w_, rtol=1e-4, atol=1e-4)


def _split_column_sum():
    """A column sum split into partial and final kernels: the partial kernel reads the input
    through a reshape view ([4096, 512] -> [parts, rows, 512])."""
    b = GraphBuilder("split_sum")
    x = b.parameter((4096, 512), DType.F32, "x")
    graph = b.build([b.reduce(x, (0,), "sum")])
    return graph, compile_plan(explore(graph))


def test_reshape_views_read_only_by_kernels_take_no_step():
    from fusionstitching.runtime.executor import _library_function
    from fusionstitching.runtime.program import GpuProgram, KernelOp

    _, compiled = _split_column_sum()
    views = [s.nodes[0] for s in compiled.steps if s.kind == "view"]
    assert [v.op for v in views] == ["reshape"]
    program = GpuProgram(compiled.graph, compiled.steps, torch.device("cpu"), lambda node, device: None,
                         _library_function)
    assert program.reshapes == set(views)
    assert all(isinstance(op, KernelOp) for op in program.ops) and len(program.ops) == 2
    partial = program.ops[0]
    assert partial.in_slots == [0] and partial.reshaped == {0: views[0].shape}
    assert 0 in partial.contiguous  # a strided operand is made contiguous before the launch


@pytest.mark.gpu
@gpu_only
def test_kernel_reads_a_reshape_view_through_its_operand():
    graph, compiled = _split_column_sum()
    rng = np.random.default_rng(0)
    data = rng.standard_normal((4096, 512)).astype(np.float32)
    want = reference.evaluate(graph, [data])[0]
    contiguous = torch.from_numpy(data).cuda()
    strided = torch.from_numpy(np.ascontiguousarray(data.T)).cuda().t()  # same values, transposed storage
    for x in (contiguous, strided, contiguous):
        got = compiled.run([x], trusted=True)[0]
        np.testing.assert_allclose(got.cpu().numpy(), want, rtol=1e-4, atol=1e-3)


def test_folded_view_of_a_kept_buffer_is_made_once_per_buffer():
    from fusionstitching.runtime.program import CallOp

    made = []

    def transpose(t):
        made.append(t)
        return t.t()

    op = CallOp(torch.mm, [0, 1], 2, [None, transpose], [False, True])
    a, kept = torch.randn(3, 4), torch.randn(5, 4)
    slots = [a, kept, None]
    for _ in range(3):
        op(slots, 0)
        torch.testing.assert_close(slots[2], a @ kept.t())
    assert len(made) == 1
    slots[1] = other = torch.randn(5, 4)  # another buffer: its own view
    op(slots, 0)
    torch.testing.assert_close(slots[2], a @ other.t())
    assert len(made) == 2
    loose = CallOp(torch.mm, [0, 1], 2, [None, transpose], [False, False])  # not kept: a view per call
    for _ in range(2):
        loose(slots, 0)
    assert len(made) == 4


def test_pipeline_dumps_every_stage_as_text(tmp_path):
    from fusionstitching.pipeline import compile_graph

    _, captured = capture_workload("layernorm")
    compiled = compile_graph(captured.forward, dump_dir=tmp_path)
    files = sorted(p.name for p in (tmp_path / captured.forward.name).iterdir())
    assert files[:3] == ["1-graph.json", "1-graph.txt", "2-explore.txt"]
    from fusionstitching.graph.serialize import from_json
    assert str(from_json((tmp_path / captured.forward.name / "1-graph.json").read_text())) == str(captured.forward)
    kernels = [f for f in files if f.startswith("3-kernel")]
    assert len(kernels) == compiled.plan.kernel_count == 1
    source = (tmp_path / captured.forward.name / kernels[0]).read_text()
    assert source.startswith("// template: ") and "__global__" in source
    assert "plan for graph layernorm" in (tmp_path / captured.forward.name / "2-explore.txt").read_text()


def test_pipeline_takes_the_selector_and_generators_from_options():
    from fusionstitching.fusion.explore import FUSION_I
    from fusionstitching.options import Options
    from fusionstitching.pipeline import compile_graph

    _, captured = capture_workload("mlp_train")
    for options, expected in ((Options(), "generators substitution, deep, merging, packing, remote"),
                              (Options(solver="beam", generators=FUSION_I), "generators substitution, merging, packing")):
        plan = compile_graph(captured.backward, options).plan
        notes = "\n".join(plan.notes)
        assert expected + ":" in notes, notes
        assert plan.strategy.startswith(f"fusionstitching ({options.solver},"), plan.strategy
    with pytest.raises(ValueError, match="unknown solver 'guess'"):
        Options(solver="guess")
    with pytest.raises(ValueError, match="Options.split_reshaped_dims must be True or False, got 'yes'"):
        Options(split_reshaped_dims="yes")


def test_structurally_equal_patterns_share_one_kernel_and_keep_their_own_nodes():
    """The two layers of the small BERT give kernels that differ only in names: the second layer's
    are twins (one source, no second lowering), each with its own pattern; the plan still
    simulates to the reference (test_whole_plans_match_the_reference_on_cpu)."""
    _, captured = capture_workload("bert", train=True)
    compiled = compile_plan(explore(captured.backward))
    twins = [k for k in compiled.kernels if k._twin is not None]
    assert twins and len(twins) < len(compiled.kernels)
    for kernel in twins:
        original = kernel._twin
        assert original._twin is None and kernel.cuda_source == original.cuda_source
        assert set(kernel.lowered.pattern.nodes).isdisjoint(original.lowered.pattern.nodes)
        assert [n.shape for n in kernel.lowered.pattern.inputs] == [n.shape for n in original.lowered.pattern.inputs]
    sources = {k.cuda_source for k in compiled.kernels}
    assert len(sources) == len(compiled.kernels) - len(twins)


def test_precompile_compiles_each_distinct_source_once(monkeypatch):
    from fusionstitching.codegen import nvrtc
    from fusionstitching.runtime import kernel_call

    _, captured = capture_workload("bert", train=True)
    compiled = compile_plan(explore(captured.backward))
    seen = []
    real = nvrtc.compile_cuda

    def counting(source, arch, **kwargs):
        seen.append(source)
        return real(source, arch, **kwargs)

    monkeypatch.setattr(nvrtc, "compile_cuda", counting)
    kernel_call.precompile(compiled.kernels, "sm_90", workers=2)
    assert len(seen) == len(set(seen)) == len({k.cuda_source for k in compiled.kernels})
    assert all("sm_90" in kernel_call.loaded(k).modules for k in compiled.kernels if k._twin is None)
    kernel_call.precompile(compiled.kernels, "sm_90")
    assert len(seen) == len(set(seen))  # nothing compiled twice


def test_compile_ahead_compiles_in_the_background_each_source_once_and_precompile_finds_them(monkeypatch, tmp_path):
    """``CompileAhead`` (the tuner's background compiles): each distinct source once, twins with
    their original; after ``wait`` the kernels hold their modules and ``precompile`` compiles
    nothing; after ``close`` nothing is left in flight."""

    from fusionstitching.runtime import kernel_call

    _, captured = capture_workload("layernorm", train=True)
    compiled = compile_plan(explore(captured.backward))
    seen, threads = _counted_compiles(monkeypatch)
    ahead = kernel_call.CompileAhead("sm_90", workers=2, cache_dir=tmp_path)
    ahead.submit(compiled.kernels)
    ahead.submit(compiled.kernels)  # handed again: not compiled again
    ahead.wait(compiled.kernels)
    assert ahead.in_flight() == 0
    assert len(seen) == len(set(seen)) == len({k.cuda_source for k in compiled.kernels})
    assert all(name.startswith("fusionstitching-compile") for name in threads)
    assert all("sm_90" in kernel_call.loaded(k).modules for k in compiled.kernels if k._twin is None)
    kernel_call.precompile(compiled.kernels, "sm_90", cache_dir=tmp_path)
    assert len(seen) == len(set(seen))
    ahead.close()


@pytest.mark.parametrize("shape", [(), (5,), (3, 4), (2, 0, 7), (1, 1, 9), (4, 3, 2, 8)])
def test_preallocated_outputs_have_torch_contiguous_strides(shape):
    """Outputs allocated by strides (``_empty_strided_cuda``) match ``torch.empty``'s layout."""
    from fusionstitching.graph.node import contiguous_strides

    assert contiguous_strides(shape) == torch.empty(shape).stride()


@pytest.mark.parametrize("rows", [64, 8192])  # a dot fused in a generated kernel; a library GEMM
def test_widened_weight_gradient_runs_as_its_f32_accumulator(rows):
    """A bf16 GEMM converted to f32 as a graph output (autocast's weight gradient) is planned as one
    dot with an f32 result, whether the code generator fuses it or the GEMM library runs it."""
    import ml_dtypes

    from fusionstitching.codegen.nvrtc import compile_cuda
    from fusionstitching.graph.transforms import widen_dots

    b = GraphBuilder("weight_grad")
    x = b.parameter((rows, 32), DType.BF16, "x")
    dy = b.parameter((rows, 16), DType.BF16, "dy")
    dot = b.node("dot_general", [x, dy], lhs_batch=(), rhs_batch=(), lhs_contract=(0,), rhs_contract=(0,))
    graph = b.build([b.convert(dot, DType.F32)])
    from fusionstitching.options import Options

    assert [n.op for n in compile_plan(explore(graph, options=Options(widen_dots=False))).plan.graph.nodes
            if n.op in ("dot_general", "convert")] == ["dot_general", "convert"]
    compiled = compile_plan(explore(graph))
    assert [n.op for n in compiled.plan.graph.nodes if n.op in ("dot_general", "convert")] == ["dot_general"]
    rng = np.random.default_rng(0)
    inputs = [rng.standard_normal(p.shape).astype(ml_dtypes.bfloat16) for p in graph.parameters]
    (want,) = reference.evaluate(widen_dots(graph), inputs)
    (got,) = compiled.run_numpy(inputs)
    assert got.dtype == np.float32 and _relative(got, want) < 1e-6
    for kernel in compiled.kernels:
        compile_cuda(kernel.cuda_source, "sm_90")
    if rows > 64:
        assert compiled.counts["library"] == 1
        fn = dot_function(compiled.plan.graph.outputs[0])
        tensors = [torch.from_numpy(a.astype(np.float32)).to(torch.bfloat16) for a in inputs]
        out = fn(*tensors)  # torch's CPU GEMM has no f32 result for bf16: the bf16 result, widened
        assert out.dtype == torch.float32 and _relative(out.numpy(), want) < 2 ** -8
        if torch.cuda.is_available():  # cuBLAS writes the f32 accumulator
            out = fn(*[t.cuda() for t in tensors])
            assert out.dtype == torch.float32 and _relative(out.cpu().numpy(), want) < 1e-5


def _embedding_gradient_graph(rows: int = 5000):
    """``index_put(zeros, [ids], grad, accumulate=True)`` into more rows than the one-hot GEMM
    takes: a library call whose destination is a broadcast constant."""
    import warnings

    from fusionstitching import capture

    def fn(ids, grad):
        return torch.ops.aten.index_put.default(torch.zeros(rows, 8), [ids], grad, True)

    ids = torch.randint(0, rows, (64,), generator=torch.Generator().manual_seed(0))
    ids[:8] = 7  # repeated rows accumulate
    grad = torch.randn(64, 8, generator=torch.Generator().manual_seed(1))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        graph = capture(fn, ids, grad, name="embedding_grad").forward
    return graph, (ids, grad), fn(ids, grad)


def test_index_put_into_a_broadcast_fills_a_new_tensor_and_puts_in_place(monkeypatch):
    from fusionstitching.graph import reference as reference_module
    from fusionstitching.runtime.executor import _filled_destination, _library_function

    graph, (ids, grad), want = _embedding_gradient_graph()
    (put,) = [n for n in graph.nodes if n.op == "library"]
    assert _filled_destination(put) == 0.0
    zeros = torch.zeros(()).reshape(1, 1).expand(5000, 8)  # the broadcast view the call receives
    laid_out = []  # the broadcast was first copied into its traced layout, then replaced by the fill
    original = reference_module.library_operand
    monkeypatch.setattr(reference_module, "library_operand",
                        lambda template, t: laid_out.append(t.stride()) or original(template, t))
    got = _library_function(put)(zeros, ids, grad)
    assert (0, 0) not in laid_out
    assert got.is_contiguous() and not torch.equal(got, zeros)
    torch.testing.assert_close(got, want)
    assert float(zeros.sum()) == 0.0  # the broadcast is not written


def test_index_put_into_a_computed_destination_keeps_the_functional_op():
    from fusionstitching.runtime.executor import _filled_destination, _library_function

    b = GraphBuilder("put")
    x = b.parameter((5000, 8), DType.F32, "x")
    ids = b.parameter((64,), DType.I64, "ids")
    values = b.parameter((64, 8), DType.F32, "values")
    call = {"args": [{"operand": 0}, [{"operand": 1}], {"operand": 2}, True], "kwargs": {}}
    put = b.node("library", [x, ids, values], shape=(5000, 8), dtype=DType.F32, name="index_put",
                 target="aten.index_put.default", call=call, out_index=-1)
    assert _filled_destination(put) is None
    dest = torch.randn(5000, 8)
    before = dest.clone()
    index = torch.arange(64)
    got = _library_function(put)(dest, index, torch.ones(64, 8))
    torch.testing.assert_close(got[:64], before[:64] + 1)
    assert torch.equal(dest, before)  # the destination is an input: not written


def test_a_library_operand_traced_as_a_broadcast_is_passed_as_one():
    """Efficient attention's bias, an attention mask expanded over batch and heads, was passed
    contiguous; the kernel requires the head stride it had in eager (a multiple of 8, here 0) and
    raised "attn_bias is not correctly aligned (strideH)" (OpInfo sdpa bf16 sample 24 on a GPU)."""
    from fusionstitching.graph.reference import library_operand

    mask = torch.randn(3, 6)
    computed = mask.expand(4, 4, 3, 6).contiguous()  # what a kernel hands over
    passed = library_operand({"operand": 0, "strides": [0, 0, 8, 1]}, computed)
    assert passed.stride() == (0, 0, 8, 1) and torch.equal(passed, computed)


def test_a_library_operand_traced_on_the_host_is_passed_there():
    """Efficient attention's backward reads its dropout seed and offset (0-d CPU tensors in eager)
    on the host; a GPU program had moved them to the GPU, and the call read a device pointer on
    the host (a segfault in the OpInfo sdpa f32 GPU run)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from fusionstitching.graph.reference import library_operand

    with FakeTensorMode():
        seed = torch.empty((), dtype=torch.int64, device="cuda")
        assert library_operand({"operand": 0, "strides": [], "host": True}, seed).device.type == "cpu"
        assert library_operand({"operand": 0, "strides": []}, seed).device.type == "cuda"


def test_a_0d_input_only_library_calls_read_stays_where_the_caller_has_it():
    """A GPU call copied every input on another device to the GPU; efficient attention's backward
    then read its dropout seed (a 0-d CPU tensor in eager) through a device pointer on the host."""
    b = GraphBuilder("seed")
    x = b.parameter((4,), DType.F32, "x")
    seed = b.parameter((), DType.I64, "seed")
    scale = b.parameter((), DType.F32, "scale")
    call = {"args": [{"operand": 0}, {"operand": 1}], "kwargs": {}}
    shifted = b.node("library", [x, seed], shape=(4,), dtype=DType.F32, name="shifted",
                     target="aten.add.Tensor", call=call, out_index=-1)
    out = b.binary("mul", shifted, b.broadcast(scale, (4,), ()))
    compiled = compile_plan(explore(b.build([out])))
    tensors = [torch.ones(4), torch.tensor(3), torch.tensor(2.0)]
    assert compiled._to_move(tensors, torch.device("meta")) == [0, 2]


@pytest.mark.parametrize("kind", ["sum", "prod", "max", "min"])
@pytest.mark.parametrize("shape, dims", [((4, 6, 5), (0, 2)), ((3, 0, 2), (1,)), ((3, 4), ())])
def test_a_reduce_no_kernel_takes_runs_in_torch_as_the_reference(kind, shape, dims):
    from fusionstitching.runtime.executor import _library_function

    b = GraphBuilder("r")
    x = b.parameter(shape, DType.BF16, "x")
    node = b.node("reduce", [x], dims=dims, kind=kind)
    fn = _library_function(node)
    assert not getattr(fn, "on_host", False)
    value = torch.randn(shape).to(torch.bfloat16)
    want = reference.evaluate_node(node, [value.float().numpy()])
    got = fn(value)
    assert got.dtype == torch.bfloat16 and tuple(got.shape) == tuple(node.shape)
    np.testing.assert_allclose(got.float().numpy(), np.asarray(want, dtype=np.float32), rtol=1e-2, atol=1e-2)


def test_a_node_run_on_the_host_is_announced():
    from fusionstitching.runtime.executor import HostFallbackWarning, _library_function

    b = GraphBuilder("r")
    x = b.parameter((4, 6), DType.I32, "x")
    node = b.node("reduce", [x], dims=(1,), kind="sum")
    with pytest.warns(HostFallbackWarning, match=r"reduce \[4\] i32\): no kernel could be built"):
        fn = _library_function(node)
    assert fn.on_host
    got = fn(torch.arange(24, dtype=torch.int32).reshape(4, 6))
    assert got.tolist() == [15, 51, 87, 123]


@pytest.mark.gpu
@gpu_only
def test_a_0d_cpu_input_moved_to_the_gpu_is_reused_while_its_value_stays():
    """A model's float attribute traced with dynamic shapes arrives as a 0-d CPU tensor each call:
    its device copy is reused while the value is the same bits (not for -0.0 after 0.0, nor NaN),
    and a new value is moved again."""
    b = GraphBuilder("scaled")
    x = b.parameter((1024,), DType.F32, "x")
    s = b.parameter((), DType.F64, "s")
    scale = b.node("convert", [s], dtype=DType.F32)
    out = b.node("mul", [x, b.node("broadcast_in_dim", [scale], shape=(1024,), broadcast_dimensions=())])
    compiled = compile_plan(explore(b.build([out])))
    x = torch.randn(1024, device="cuda")
    first = compiled(x, torch.tensor(0.5, dtype=torch.float64))[0]
    copy = compiled._kept_moves[1][2]
    torch.testing.assert_close(first, x * 0.5)
    compiled(x, torch.tensor(0.5, dtype=torch.float64))
    assert compiled._kept_moves[1][2] is copy  # the same value: no new copy
    for value in (0.0, -0.0, float("nan"), 2.0):
        got = compiled(x, torch.tensor(value, dtype=torch.float64))[0]
        torch.testing.assert_close(got, x * value, equal_nan=True)
        assert torch.equal(torch.signbit(got), torch.signbit(x * value))


def test_kernels_compile_while_the_next_are_generated_and_the_first_prepare_waits_for_them(monkeypatch, tmp_path):
    """``compile_plan`` with a ``CompileAhead`` hands it each kernel as it is generated (twins
    not again); the first ``prepare`` waits for those compiles and closes the pool, and the
    program then compiles nothing. Off a GPU nothing compiles ahead."""

    from fusionstitching.pipeline import _compile_ahead
    from fusionstitching.runtime import executor, kernel_call

    _, captured = capture_workload("bert", train=True)
    plan = explore(captured.backward)
    seen, threads = _counted_compiles(monkeypatch)
    ahead = kernel_call.CompileAhead("sm_90", workers=2, cache_dir=tmp_path)
    compiled = compile_plan(plan, compile_ahead=ahead)
    assert compiled.compiling is ahead
    kernels = compiled.kernels
    assert any(k._twin is not None for k in kernels)  # BERT's layers: twins of one kernel
    made = []

    class Program:
        def __init__(self, graph, steps, device, constant, library, options):
            made.append(device)
            kernel_call.precompile([s.kernel for s in steps if s.kernel is not None], "sm_90", cache_dir=tmp_path)

    monkeypatch.setattr(executor, "GpuProgram", Program)
    compiled.prepare(torch.device("cuda", 0))
    assert made and compiled.compiling is None and ahead.in_flight() == 0
    assert all(name.startswith("fusionstitching-compile") for name in threads)
    assert len(seen) == len(set(seen)) == len({k.cuda_source for k in kernels})
    assert all("sm_90" in kernel_call.loaded(k).modules for k in kernels if k._twin is None)
    assert _compile_ahead(None, compiled.options) is None
    assert _compile_ahead(torch.device("cpu"), compiled.options) is None


def test_compile_graph_for_a_gpu_compiles_its_kernels_ahead(monkeypatch, tmp_path):
    from fusionstitching import pipeline
    from fusionstitching.options import Options
    from fusionstitching.runtime import kernel_call

    _, captured = capture_workload("layernorm", train=True)
    monkeypatch.setattr(kernel_call, "device_arch", lambda device=None: "sm_90")
    monkeypatch.setattr(pipeline, "with_gemm_timings", lambda graph, options, device: options)
    options = Options(strict=True, cache_dir=str(tmp_path), cache_plans=False)
    compiled = pipeline.compile_graph(captured.backward, options, device=torch.device("cuda", 0))
    assert isinstance(compiled.compiling, kernel_call.CompileAhead) and compiled.compile_seconds > 0
    compiled.compiling.wait(compiled.kernels)
    assert all("sm_90" in kernel_call.loaded(k).modules for k in compiled.kernels if k._twin is None)
    compiled.compiling.close()


def _counted_compiles(monkeypatch) -> tuple[list[str], set[str]]:
    """NVRTC compiles counted from here on: the sources compiled and the threads that compiled them."""
    import threading

    from fusionstitching.codegen import nvrtc

    seen, threads = [], set()
    real = nvrtc.compile_cuda

    def counting(source, arch, **kwargs):
        seen.append(source)
        threads.add(threading.current_thread().name)
        return real(source, arch, **kwargs)

    monkeypatch.setattr(nvrtc, "compile_cuda", counting)
    return seen, threads
