"""Channels-last convolutions and transpose sinking (graph/layout.py): the rewritten graphs compute
what the originals do (the reference runs the library calls through torch on the CPU), and the
transposes left are those of the inputs, the weights and values that leave NHWC."""

from __future__ import annotations

import numpy as np
import torch

from fusionstitching.frontend.torch_fx import capture
from fusionstitching.graph.graph import GraphBuilder
from fusionstitching.graph.layout import TO_NCHW, channels_last_convolutions, sink_transposes
from fusionstitching.graph.ops import DType
from fusionstitching.graph.reference import evaluate
from fusionstitching.graph.transforms import fold_views


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


def test_training_keeps_convolutions_whose_tensors_are_saved():
    model = _block().train()
    graph = capture(model, torch.randn(2, 3, 10, 10, requires_grad=True), train=True).forward
    assert channels_last_convolutions(graph) is graph


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
    strided, depthwise, grouped and dilated convolutions; a transposed one stays NCHW, and so does one
    whose result is the graph's output."""
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
            expected = 0 if name == "transposed" else 1  # the last one's result is the graph's output
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
    assert channels_last_convolutions(small) is small
    assert channels_last_convolutions(large) is not large
