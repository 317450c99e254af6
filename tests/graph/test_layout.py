"""Channels-last convolutions and transpose sinking (graph/layout.py): the rewritten graphs compute
what the originals do (the reference runs the library calls through torch on the CPU), and the
transposes left are those of the inputs, the weights and values that leave NHWC."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch

from fusionstitching.frontend.torch_fx import capture
from fusionstitching.graph.graph import GraphBuilder
from fusionstitching.graph.layout import (
    TO_NCHW,
    channels_last_convolutions,
    laid_out_convolutions,
    sink_transposes,
)
from fusionstitching.graph.ops import DType
from fusionstitching.graph.reference import evaluate
from fusionstitching.graph.transforms import _Names, fold_views

gpu_only = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _same_values(a, b, rtol=1e-5):
    rng = np.random.default_rng(0)
    inputs = [rng.uniform(0.5, 1.5, p.shape).astype(p.dtype.numpy) for p in a.parameters]
    for x, y in zip(evaluate(a, inputs), evaluate(b, inputs)):
        assert x.shape == y.shape
        np.testing.assert_allclose(y, x, rtol=rtol, atol=1e-5)


def _block():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.BatchNorm2d(8), torch.nn.ReLU(),
                               torch.nn.MaxPool2d(2), torch.nn.Conv2d(8, 16, 1), torch.nn.BatchNorm2d(16),
                               torch.nn.ReLU(), torch.nn.AdaptiveAvgPool2d(1)).eval()


def test_inference_runs_nhwc_between_the_convolutions():
    with torch.no_grad():
        graph = capture(_block(), torch.randn(2, 3, 10, 10)).forward
    laid_out = fold_views(sink_transposes(channels_last_convolutions(graph)))
    calls = [n for n in laid_out.nodes if n.op == "library"]
    assert calls and all("permute_result" in n.attrs["call"] for n in calls)
    for n in laid_out.nodes:  # transposes only of inputs and weights, and the pooled result's
        if n.op == "transpose":
            assert n.operands[0].op == "parameter" or n.attrs["permutation"] == TO_NCHW, n.name
    assert sum(1 for n in laid_out.nodes if n.op == "transpose" and n.operands[0].op != "parameter") <= 1
    _same_values(graph, laid_out)


def test_training_keeps_convolutions_whose_tensors_are_saved_nchw():
    """Saved tensors promised NCHW (``capture(channels_last=False)``, eager's layouts) keep their
    convolutions NCHW: converting would write an NHWC copy besides each."""
    torch.manual_seed(0)
    # a strided convolution where _block pools: max pooling's output is not saved (the backward
    # recomputes the pooling, ``torch_fx.partition``), so the next convolution's input would not be
    # a saved tensor
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.BatchNorm2d(8), torch.nn.ReLU(),
                                torch.nn.Conv2d(8, 8, 2, stride=2), torch.nn.Conv2d(8, 16, 1),
                                torch.nn.BatchNorm2d(16), torch.nn.ReLU(), torch.nn.AdaptiveAvgPool2d(1)).train()
    graph = capture(model, torch.randn(2, 3, 10, 10, requires_grad=True), train=True, channels_last=False).forward
    assert channels_last_convolutions(graph) is graph


def test_capture_lays_out_the_saved_tensors_as_the_backend_does():
    """``capture`` of a training step promises the saved tensors the backend lays out channels-last,
    and its backward reads them so: what ``fusionstitching explain`` shows is what compiles."""
    model = _block().train()
    captured = capture(model, torch.randn(2, 3, 10, 10, requires_grad=True), train=True)
    first = captured.num_user_outputs
    promised = {k - first: lay for k, lay in enumerate(captured.forward.output_layouts)
                if k >= first and lay is not None and len(lay.strides) == 4 and lay.strides[1] == 1
                and captured.forward.outputs[k].shape[1] > 1}
    assert promised
    for k, layout in promised.items():
        assert captured.backward.parameters[k].layout == layout
    assert channels_last_convolutions(captured.forward) is not captured.forward


def test_a_max_poolings_indices_run_nhwc():
    """The indices of a training max pooling (``h · W + w`` from iotas, chosen window by window)
    are recomputed by the backward from the saved input (``torch_fx.partition``: the forward saves
    neither them nor the windows, but the pooled values it writes anyway, which the backward does
    not compute again), where they sink like the values: the backward computes them NHWC
    and compares them NHWC with its positions (iotas), and the laid-out graphs compute what the
    NCHW ones do."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.BatchNorm2d(8), torch.nn.ReLU(),
                                torch.nn.MaxPool2d(3, 2, 1), torch.nn.Conv2d(8, 16, 1)).train()  # ResNet's stem
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        captured = capture(model, torch.randn(2, 3, 10, 10, requires_grad=True), train=True)
    forward = laid_out_convolutions(captured.forward)
    assert not any(n.op == "iota" for n in captured.forward.nodes)
    assert not [o for o in forward.outputs if o is not None and o.dtype == DType.I64 and len(o.shape) == 4]
    for n in forward.nodes:
        if n.op == "transpose":  # of the inputs and weights, or leaving NHWC as an output
            assert n.operands[0].op == "parameter" or any(n is o for o in forward.outputs), n.name
    assert all(n.shape[-1] == 8 for n in forward.nodes if n.op == "iota")  # NHWC: channels last
    assert not any(n.op == "max" for n in captured.backward.nodes)
    assert [p for p in captured.backward.parameters if p.shape == (2, 8, 5, 5)]  # the pooled values, saved
    assert all(n.dtype == DType.I32 for n in captured.backward.nodes if n.op == "iota")  # positions fit i32
    backward = laid_out_convolutions(captured.backward)
    assert not [n for n in backward.nodes if n.op == "library" and "max_pool" in n.attrs["target"]]
    assert any(n.op == "iota" for n in backward.nodes)
    assert all(n.shape[-1] == 8 for n in backward.nodes if n.op == "iota")  # NHWC: channels last
    for n in backward.nodes:
        if n.op == "transpose":  # of the inputs, or of the convolutions' gradients (library calls)
            assert n.operands[0].op in ("parameter", "library"), n.name
    rng = np.random.default_rng(0)
    for graph, laid_out in ((captured.forward, forward), (captured.backward, backward)):
        inputs = [rng.integers(-3, 4, p.shape).astype(p.dtype.numpy) for p in graph.parameters]  # ties
        for x, y in zip(evaluate(graph, inputs), evaluate(laid_out, inputs)):
            if x is None:
                continue
            if x.dtype.kind in "iu":
                np.testing.assert_array_equal(y, x)
            else:  # ties stay ties: the gradient goes to the same position
                np.testing.assert_allclose(y, x, rtol=1e-4, atol=1e-4)


def _transposed_statistics(dims, broadcast_dims=(1,)):
    b = GraphBuilder("stats")
    x = b.parameter((2, 5, 6, 3), DType.F32, "x")  # NHWC
    v = b.parameter(tuple((2, 3, 5, 6)[d] for d in broadcast_dims), DType.F32, "v")
    t = b.transpose(x, TO_NCHW)
    y = b.binary("mul", t, b.broadcast(v, (2, 3, 5, 6), broadcast_dims))
    return b.build([b.reduce(y, dims, "sum"), y])


def test_a_reduce_of_a_transpose_reduces_the_permuted_dims():
    graph = _transposed_statistics((0, 2, 3))
    sunk = sink_transposes(graph)
    reduce = next(n for n in sunk.nodes if n.op == "reduce")
    assert reduce.operands[0].shape == (2, 5, 6, 3) and tuple(reduce.attrs["dims"]) == (0, 1, 2)
    _same_values(graph, sunk)
    kept_reordered = _transposed_statistics((0,))  # [C, H, W] kept: the NHWC reduce gives [H, W, C]
    sunk = sink_transposes(kept_reordered)
    assert next(n for n in sunk.nodes if n.op == "reduce").shape == (5, 6, 3)
    _same_values(kept_reordered, sunk)


def test_a_broadcast_that_would_transpose_its_operand_stops_the_transpose():
    graph = _transposed_statistics((0, 2, 3), broadcast_dims=(1, 2))  # a [C, H] operand: [H, C] in NHWC
    assert sink_transposes(graph) is graph


def _conv_net(conv):
    torch.manual_seed(0)
    return torch.nn.Sequential(conv, torch.nn.GELU(), torch.nn.Conv2d(conv.out_channels, 4, 1)).eval()


CONVOLUTIONS = {
    "strided_padded_with_bias": lambda: torch.nn.Conv2d(3, 8, 3, stride=2, padding=1),
    "depthwise": lambda: torch.nn.Conv2d(6, 6, 3, padding=1, groups=6, bias=False),
    "grouped_dilated": lambda: torch.nn.Conv2d(4, 8, 3, padding=2, dilation=2, groups=2),
    "transposed": lambda: torch.nn.ConvTranspose2d(3, 8, 2, stride=2),
}


def test_convolutions_of_every_kind_compute_what_eager_does():
    """Through the whole backend on the CPU (strict: no fallback): the channels-last layout for
    strided, depthwise, grouped and dilated convolutions; a transposed one stays NCHW. The last one,
    whose result is the graph's output, is channels-last too: its input is written NHWC for free,
    and a kernel transposes its result back as cuDNN would have."""
    import fusionstitching
    from fusionstitching import Options

    x = torch.randn(2, 3, 9, 9)
    for name, make in CONVOLUTIONS.items():
        conv = make()
        model = _conv_net(conv)
        inputs = torch.randn(2, conv.in_channels, 9, 9) if conv.in_channels != 3 else x
        with torch.no_grad():
            graph = capture(model, inputs).forward
            laid_out = channels_last_convolutions(graph)
            calls = [n for n in laid_out.nodes if n.op == "library"]
            expected = 1 if name == "transposed" else 2
            assert sum("permute_result" in n.attrs["call"] for n in calls) == expected, name
            torch._dynamo.reset()
            compiled = fusionstitching.compile(model, Options(strict=True))
            torch.testing.assert_close(compiled(inputs), model(inputs), rtol=1e-4, atol=1e-4, msg=name)


def test_a_weight_larger_than_the_activations_stays_nchw():
    """One 4 × 4 image through a 256 → 256 3 × 3 convolution (f32, the weight a parameter): the
    transposed weight would cost more than the activations' conversions."""
    model = torch.nn.Sequential(torch.nn.Conv2d(256, 256, 3, padding=1), torch.nn.ReLU(),
                                torch.nn.Conv2d(256, 8, 1)).eval()
    with torch.no_grad():
        small = capture(model, torch.randn(1, 256, 4, 4)).forward
        large = capture(model, torch.randn(8, 256, 32, 32)).forward

    def channels_last(graph):  # the weight's input channels of each convolution run channels-last
        return sorted(n.operands[1].shape[-1] for n in channels_last_convolutions(graph).nodes
                      if n.op == "library" and "permute_result" in n.attrs["call"])

    assert channels_last(small) == [256]  # the 1 × 1 one: its 256 × 8 weight is smaller than its input
    assert channels_last(large) == [256, 256]


def _runners(monkeypatch):
    """The backend's graph runners made from now on, in order."""
    from fusionstitching import backend

    made = []
    init = backend._Runner.__init__

    def record(self, *args, **kwargs):
        init(self, *args, **kwargs)
        made.append(self)

    monkeypatch.setattr(backend._Runner, "__init__", record)
    return made


def _exact_convolutions(device):
    """No TF32 in cuDNN's convolutions on a GPU, where eager's NCHW and our NHWC calls take
    different algorithms (a context manager: torch's test utilities may forbid setting the flags)."""
    import contextlib

    if device != "cuda":
        return contextlib.nullcontext()
    return torch.backends.cudnn.flags(enabled=True, allow_tf32=False)


def _train_step(model, x):
    model.zero_grad(set_to_none=True)
    out = model(x)
    out.square().mean().backward()
    return out, [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, gpu_only])])
def test_training_saves_the_convolutions_tensors_channels_last(monkeypatch, device):
    """Through the whole backend (strict): the forward returns the tensors it saves around its
    convolutions and pooling as views of NHWC values, tells AOTAutograd their strides, and the
    backward, given them so, runs every convolution and pooling backward channels-last too; the
    gradients are eager's (on a GPU, the generated kernels read the saved tensors through the
    strides promised)."""
    import fusionstitching
    from fusionstitching import Options

    runners = _runners(monkeypatch)
    model = _block().train().to(device)
    eager = _block().train().to(device)
    x = torch.randn(4, 3, 10, 10).to(device)
    torch._dynamo.reset()
    compiled = fusionstitching.compile(model, Options(strict=True))
    for _ in range(2):  # the second step runs the compiled graphs on their lean path
        with _exact_convolutions(device):
            out, grads = _train_step(compiled, x)
            want, wanted = _train_step(eager, x)
        torch.testing.assert_close(out, want, rtol=1e-4, atol=1e-4)
        for g, w in zip(grads, wanted):
            torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-4)
    forward, backward = runners
    assert forward.name.startswith("forward") and backward.name.startswith("backward")
    assert forward.promised and all(strides[1] == 1 for strides in forward.promised.values())
    for runner in runners:
        calls = [n for n in runner.static.plan.graph.nodes if n.op == "library"]
        assert calls and all("permute_result" in n.attrs["call"] for n in calls), runner.name
    first = forward.saved[0]  # the saved tensors lead the backward's inputs, in order
    for k, strides in forward.promised.items():
        assert backward.static.graph.parameters[k - first].layout.strides == strides


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, gpu_only])])
def test_a_forward_run_by_pytorch_returns_its_saved_tensors_as_promised(monkeypatch, device):
    """The forward's first run fails (an internal error, not strict): PyTorch computes it, and the
    tensors it saves are laid out as the backward was compiled for, so that gradients stay right."""
    import warnings

    import fusionstitching
    from fusionstitching import Options, backend
    from fusionstitching.runtime.executor import CompiledGraph

    runners = _runners(monkeypatch)
    run = CompiledGraph.run

    def failing(self, *args, **kwargs):
        if self.graph.name.startswith("forward"):
            raise RuntimeError("an internal error")
        return run(self, *args, **kwargs)

    monkeypatch.setattr(CompiledGraph, "run", failing)
    returned = []
    call = backend._Runner.__call__
    monkeypatch.setattr(backend._Runner, "__call__", lambda self, args: returned.append(call(self, args)) or returned[-1])
    model = _block().train().to(device)
    eager = _block().train().to(device)
    x = torch.randn(4, 3, 10, 10).to(device)
    torch._dynamo.reset()
    compiled = fusionstitching.compile(model, Options(strict=False))
    with warnings.catch_warnings(), _exact_convolutions(device):
        warnings.simplefilter("ignore")
        out, grads = _train_step(compiled, x)
        want, wanted = _train_step(eager, x)
    assert runners[0].fallback is not None and runners[0].promised
    for k, strides in runners[0].promised.items():  # on a GPU the backward reads them through these strides
        assert returned[0][k].stride() == strides
    torch.testing.assert_close(out, want, rtol=1e-4, atol=1e-4)
    for g, w in zip(grads, wanted):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("name", sorted(CONVOLUTIONS))
def test_training_of_every_kind_of_convolution_matches_eager(name, monkeypatch):
    """Strided, depthwise, grouped, dilated and transposed convolutions with BatchNorm and a
    bias-free 1 × 1 one after them, trained through the whole backend on the CPU (strict): every
    gradient is eager's, whichever calls went channels-last, and with an input that needs its own
    gradient (the backward's input gradient of the first convolution is computed, not None)."""
    import fusionstitching
    from fusionstitching import Options

    runners = _runners(monkeypatch)

    def make():
        torch.manual_seed(0)
        conv = CONVOLUTIONS[name]()
        return torch.nn.Sequential(conv, torch.nn.BatchNorm2d(conv.out_channels), torch.nn.ReLU(),
                                   torch.nn.Conv2d(conv.out_channels, 6, 1, bias=False)).train()

    model, eager = make(), make()
    channels = model[0].in_channels
    x = torch.randn(4, channels, 9, 9, generator=torch.Generator().manual_seed(1))
    x_compiled, x_eager = x.clone().requires_grad_(), x.clone().requires_grad_()
    torch._dynamo.reset()
    compiled = fusionstitching.compile(model, Options(strict=True))
    for _ in range(2):
        for m, inp in ((compiled, x_compiled), (eager, x_eager)):
            inp.grad = None
            m.zero_grad(set_to_none=True)
            m(inp).square().mean().backward()
        torch.testing.assert_close(x_compiled.grad, x_eager.grad, rtol=1e-4, atol=1e-5)
        for p, q in zip(model.parameters(), eager.parameters()):
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-5)
    backward = [r for r in runners if r.name.startswith("backward")][-1]
    converted = [n for n in backward.static.plan.graph.nodes
                 if n.op == "library" and "permute_result" in n.attrs["call"]]
    assert converted or name == "transposed", name


def test_a_model_and_input_in_channels_last_memory_format_train_as_eager():
    """``model.to(memory_format=torch.channels_last)`` with a channels-last input: the weights and
    the image are parameters laid out NHWC, read through their NHWC views; the gradients are
    eager's."""
    import fusionstitching
    from fusionstitching import Options

    def make():
        return _block().train().to(memory_format=torch.channels_last)

    model, eager = make(), make()
    x = torch.randn(4, 3, 10, 10).to(memory_format=torch.channels_last)
    torch._dynamo.reset()
    compiled = fusionstitching.compile(model, Options(strict=True))
    for _ in range(2):
        out, grads = _train_step(compiled, x)
        want, wanted = _train_step(eager, x)
        torch.testing.assert_close(out, want, rtol=1e-4, atol=1e-4)
        for g, w in zip(grads, wanted):
            torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-4)


def test_a_dense_permutation_keeps_the_last_dim_last():
    from fusionstitching.graph.layout import dense_permutation

    # [batch, heads, seq, dim] viewed from [batch, seq, heads, dim] storage
    assert dense_permutation((2, 4, 8, 16), (512, 16, 64, 1)) == (0, 2, 1, 3)
    assert dense_permutation((2, 4, 8, 16), (512, 128, 16, 1)) is None  # contiguous
    assert dense_permutation((2, 4, 8, 16), (512, 1, 64, 4)) is None  # the last dim moves
    assert dense_permutation((2, 4, 8, 16), (512, 16, 64, 2)) is None  # not dense
    assert dense_permutation((2, 1, 8, 16), (128, 7, 16, 1)) is None  # a size-1 dim's stride is free


def _attention(q_proj, k_proj, v_proj, x):
    b, s, _ = x.shape
    q = q_proj(x).view(b, s, 2, 8).transpose(1, 2) * 1.5 + 0.25  # computed in the transposed layout,
    k = k_proj(x).view(b, s, 2, 8).transpose(1, 2) * 0.5 - 0.25  # as rotary embedding's q and k
    v = v_proj(x).view(b, s, 2, 8).transpose(1, 2)
    out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    return out.transpose(1, 2).reshape(b, s, 16)


def test_attention_gets_its_permuted_operands_and_result_as_views():
    """Attention's query, key and value traced as transposed views of projections: the call gets
    them as views of permuted nodes its producers write (no copy to the traced strides), its
    result is held permuted, and the forward returns the query and key it saves for the backward
    as views of those nodes, in the strides it promised; values and gradients stay eager's."""
    from fusionstitching.fusion import explore

    torch.manual_seed(0)
    projections = [torch.nn.Linear(16, 16) for _ in range(3)]
    x = torch.randn(2, 6, 16, requires_grad=True)

    def fn(x):
        return _attention(*projections, x)

    captured = capture(fn, x, train=True)
    for graph in (captured.forward, captured.backward):
        plan = explore(graph)
        assert any("permuted layouts" in note for note in plan.notes), plan.notes
        calls = [n for n in plan.graph.nodes if n.op == "library" and "attention" in n.attrs["target"]]
        assert calls and any("permute" in a for n in calls for a in n.attrs["call"]["args"] if isinstance(a, dict))
    saved = [o for o, layout in zip(explore(captured.forward).graph.outputs, captured.forward.output_layouts)
             if o is not None and layout is not None and not layout.is_contiguous(o.shape) and len(o.shape) == 4]
    # every one is a view now (the query and key of the permuted nodes; the value of its projection)
    # or the call's own result
    assert all(o.op in ("transpose", "library") for o in saved), saved
    assert sum(o.op == "transpose" and o.operands[0].op == "transpose" for o in saved) == 2, saved
    compiled = torch.compile(fn, backend="fusionstitching")
    torch._dynamo.reset()
    want = fn(x)
    (want_grad,) = torch.autograd.grad(want.square().sum(), x)
    got = compiled(x)
    (got_grad,) = torch.autograd.grad(got.square().sum(), x)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got_grad, want_grad, rtol=1e-5, atol=1e-6)


def test_a_permuted_result_leaves_other_outputs_alone():
    """Flash attention also returns integer sequence lengths and a rank-3 log-sum-exp: only the
    tensors of the permutation's rank are permuted."""
    from fusionstitching.graph.reference import library_result

    out = library_result({"permute_result": [0, 2, 1, 3]}, (torch.zeros(2, 3, 4, 5), 7, None, torch.zeros(2, 3, 4)))
    assert out[0].shape == (2, 4, 3, 5) and out[1] == 7 and out[2] is None and out[3].shape == (2, 3, 4)


def test_a_reshape_of_a_transpose_sinks_where_its_runs_of_dims_stay_together():
    """NCHW split into groups, ``[N, G, C / G, H * W]``, of an NHWC value is the NHWC value split
    into ``[N, H * W, G, C / G]``, transposed: the statistics then reduce the NHWC value. A reshape
    that merges the channels with the height (not neighbours in NHWC) stays a reshape of the
    transpose."""
    from fusionstitching.graph.layout import _sink_reshape

    b = GraphBuilder("groups")
    x = b.parameter((2, 4, 5, 8), DType.F32, "x")  # NHWC
    t = b.transpose(x, TO_NCHW)
    grouped = b.reshape(t, (2, 2, 4, 20))
    graph = b.build([b.reduce(grouped, (2, 3), "sum"), grouped])
    sunk = fold_views(sink_transposes(graph))
    reduce = next(n for n in sunk.nodes if n.op == "reduce")
    assert reduce.operands[0].op == "reshape" and reduce.operands[0].operands[0].op == "parameter"
    assert reduce.operands[0].shape == (2, 20, 2, 4) and tuple(reduce.attrs["dims"]) == (1, 3)
    _same_values(graph, sunk)
    c = GraphBuilder("merged")
    t = c.transpose(c.parameter((2, 4, 5, 8), DType.F32, "x"), TO_NCHW)
    merged = c.reshape(t, (2, 32, 5))
    c.build([merged])
    assert _sink_reshape(merged, t, _Names(["x"])) is None


def _groupnorm_block():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Conv2d(3, 16, 3, padding=1), torch.nn.GroupNorm(4, 16), torch.nn.SiLU(),
                               torch.nn.Conv2d(16, 16, 3, padding=1), torch.nn.GroupNorm(4, 16), torch.nn.SiLU(),
                               torch.nn.Conv2d(16, 16, 3, padding=1))


def _reads_through_transposes(graph) -> list[str]:
    """The reduces that read a transpose of a computed value through views and elementwise ops."""
    found = []
    for n in graph.nodes:
        if n.op != "reduce":
            continue
        stack, seen = [n.operands[0]], set()
        while stack:
            x = stack.pop()
            if id(x) in seen or x.op in ("parameter", "library", "constant", "reduce"):
                continue
            seen.add(id(x))
            if x.op == "transpose" and x.operands[0].op != "parameter":
                found.append(n.name)
                break
            stack.extend(x.operands)
    return found


@pytest.mark.parametrize("train", [False, True])
def test_groupnorms_between_convolutions_run_nhwc(train):
    """UNet blocks (convolution, GroupNorm, SiLU, twice, and a convolution): the group statistics
    reduce NHWC values (their reshapes into groups sink), so the convolutions run channels-last and
    no reduction reads through a transpose, forward and backward."""
    from fusionstitching.graph.layout import laid_out_convolutions

    x = torch.randn(2, 3, 12, 12, requires_grad=train)  # activations outnumber the weights
    if train:
        captured = capture(_groupnorm_block(), x, train=True)
        graphs = [captured.forward, captured.backward]
    else:
        with torch.no_grad():
            graphs = [capture(_groupnorm_block().eval(), x).forward]
    for graph in graphs:
        laid_out = laid_out_convolutions(graph)
        assert laid_out is not graph, graph.name
        calls = [n for n in laid_out.nodes if n.op == "library"]
        assert calls and all("permute_result" in n.attrs["call"] for n in calls), graph.name
        assert not _reads_through_transposes(laid_out), graph.name
        # sums in another order, over arbitrary saved statistics (gradients up to 1e4)
        _same_values(graph, laid_out, rtol=1e-3)


def test_convolution_biases_are_added_and_summed_by_generated_kernels():
    """``convolution_bias_apart``: the convolution is called without its bias, which an add after it
    applies; the backward's bias gradient is a sum of the output gradient over every dim but the
    channels, and the call computes the other two gradients only. Same values, forward and
    backward."""
    from fusionstitching.graph.layout import CONVOLUTION, CONVOLUTION_BACKWARD, convolution_bias_apart

    model = _conv_net(torch.nn.Conv2d(3, 8, 3, padding=1)).train()
    captured = capture(model, torch.randn(2, 3, 6, 6, requires_grad=True), train=True, channels_last=False)
    forward, backward = (convolution_bias_apart(g) for g in (captured.forward, captured.backward))
    convolutions = [n for n in forward.nodes if n.op == "library" and n.attrs["target"] == CONVOLUTION]
    assert len(convolutions) == 2 and all(n.attrs["call"]["args"][2] is None for n in convolutions)
    assert all(len(n.operands) == 2 for n in convolutions)
    backwards = [n for n in backward.nodes if n.op == "library" and n.attrs["target"] == CONVOLUTION_BACKWARD]
    assert backwards and all(n.attrs["call"]["args"][10][2] is False for n in backwards)
    assert all(n.attrs["out_index"] != 2 for n in backwards)
    _same_values(captured.forward, forward, rtol=1e-4)
    _same_values(captured.backward, backward, rtol=1e-4)


@pytest.mark.parametrize("seed", range(6))
def test_sinking_a_transpose_through_reshapes_keeps_every_value(seed):
    """Random transposes of 3- to 5-D values (dims of size 1 among them) reshaped by merging or
    splitting random runs of dims: wherever ``_sink_reshape`` moves the transpose, the values stay
    the reference's, and where it declines the graph is unchanged."""
    from fusionstitching.graph.layout import _sink_reshape

    rng = np.random.default_rng(seed)
    sunk_any = False
    for _ in range(40):
        rank = int(rng.integers(3, 6))
        shape = tuple(int(rng.choice([1, 2, 3, 4])) for _ in range(rank))
        perm = tuple(int(d) for d in rng.permutation(rank))
        if perm == tuple(range(rank)):
            continue
        b = GraphBuilder("sink")
        x = b.parameter(shape, DType.F32, "x")
        t = b.transpose(x, perm)
        sizes = list(t.shape)
        # merge a random run of neighbours, then split a random dim in two where it factors
        start = int(rng.integers(0, len(sizes) - 1))
        stop = int(rng.integers(start + 1, len(sizes) + 1))
        merged = sizes[:start] + [int(np.prod(sizes[start:stop]))] + sizes[stop:]
        k = int(rng.integers(0, len(merged)))
        if merged[k] % 2 == 0 and merged[k] > 2:
            merged = merged[:k] + [2, merged[k] // 2] + merged[k + 1:]
        y = b.reshape(t, tuple(merged))
        graph = b.build([b.unary("neg", y)])
        moved = _sink_reshape(y, t, _Names(n.name for n in graph.nodes))
        sunk = fold_views(sink_transposes(graph, (perm,)))
        reads_transpose = [n for n in sunk.nodes if n.op == "reshape" and n.operands[0].op == "transpose"]
        if moved is None:
            assert reads_transpose or sunk is graph
            continue
        sunk_any = True
        assert moved.shape == y.shape
        assert not reads_transpose  # the reshape reads the source; a transpose left comes after it
        _same_values(graph, sunk)
    assert sunk_any


def test_a_long_chain_of_positions_stays_where_it_is():
    """A function of positions thousands of ops deep beside a transposed value: the pass neither
    recurses along it nor changes what the graph computes (the transpose stays before the add)."""
    b = GraphBuilder("chain")
    x = b.parameter((2, 3, 4, 5), DType.F32, "x")
    t = b.transpose(x, TO_NCHW)
    position = b.convert(b.iota(t.shape, 3, DType.I32), DType.F32)
    for _ in range(3000):
        position = b.binary("add", position, b.broadcast(b.constant(1.0, DType.F32), t.shape, ()))
    graph = b.build([b.binary("add", t, position)])
    sunk = sink_transposes(graph)
    _same_values(graph, sunk)
    short = GraphBuilder("short")
    x = short.parameter((2, 3, 4, 5), DType.F32, "x")
    t = short.transpose(x, TO_NCHW)
    position = short.convert(short.iota(t.shape, 3, DType.I32), DType.F32)
    graph = short.build([short.binary("mul", t, position)])
    assert sink_transposes(graph).outputs[0].op == "transpose"  # a short one sinks the transpose
