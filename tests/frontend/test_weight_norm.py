"""Weight norm (``torch._weight_norm``, ``nn.utils.weight_norm``, wav2vec 2.0's positional
convolution): its fused op and that op's backward are lowered, forward and backward against eager,
and the 1-d case, where torch's decomposition took the norm over the whole tensor, gives eager's
values."""

from __future__ import annotations

import warnings

import pytest
import torch

from fusionstitching.frontend.torch_fx import capture


def _compiled(fn):
    torch._dynamo.reset()
    return torch.compile(fn, backend="fusionstitching")


def test_a_1d_weight_norm_is_per_element_as_eagers():
    """``w = g · v / |v|`` element by element: each w is ±g (the old decomposition divided by the
    norm of the whole v)."""
    v = torch.randn(7, generator=torch.Generator().manual_seed(0))
    g = torch.randn(7, generator=torch.Generator().manual_seed(1))
    got = _compiled(lambda v, g: torch._weight_norm(v, g, 0))(v, g)
    torch.testing.assert_close(got, torch._weight_norm(v, g, 0))
    torch.testing.assert_close(got.abs(), g.abs())


@pytest.mark.parametrize("dim", [0, 2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_values_and_gradients_match_eager(dim, dtype):
    shape = (6, 4, 5)
    gen = torch.Generator().manual_seed(dim)
    v = torch.randn(shape, generator=gen).to(dtype)
    g = torch.randn([n if k == dim else 1 for k, n in enumerate(shape)], generator=gen).to(dtype)
    weights = torch.randn(shape, generator=gen).to(dtype)
    results = []
    for fn in (lambda v, g: torch._weight_norm(v, g, dim), _compiled(lambda v, g: torch._weight_norm(v, g, dim))):
        v1, g1 = v.clone().requires_grad_(True), g.clone().requires_grad_(True)
        w = fn(v1, g1)
        (w.float() * weights.float()).sum().backward()
        results.append((w, v1.grad, g1.grad))
    tolerance = {"rtol": 2e-2, "atol": 2e-2} if dtype == torch.bfloat16 else {"rtol": 1e-5, "atol": 1e-6}
    for got, want in zip(results[1], results[0]):
        assert got.dtype == want.dtype
        torch.testing.assert_close(got, want, **tolerance)


def test_a_weight_normed_convolution_trains_without_library_calls_but_the_convolution():
    torch.manual_seed(0)  # the weights do not depend on the tests run before this one
    conv = torch.nn.utils.weight_norm(torch.nn.Conv1d(4, 4, 3, padding=1, groups=2), name="weight", dim=2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        captured = capture(conv, torch.randn(2, 4, 10, requires_grad=True), train=True)
    for graph in (captured.forward, captured.backward):
        left = {n.attrs.get("target") for n in graph.nodes if n.op == "library"}
        assert left <= {"aten.convolution.default", "aten.convolution_backward.default"}, left
    x = torch.randn(2, 4, 10, generator=torch.Generator().manual_seed(3))
    compiled = _compiled(conv)
    compiled(x).square().sum().backward()
    got = [p.grad.clone() for p in conv.parameters()]
    conv.zero_grad()
    conv(x).square().sum().backward()
    # f32 gradients through the norm's sums, summed in another order than eager's: the f32 tolerance
    # of the model checks (``bench/correctness.py``)
    for a, b in zip(got, (p.grad for p in conv.parameters())):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def test_the_fused_op_over_a_middle_dim_is_rejected_as_eager_rejects_it():
    v, g = torch.randn(3, 4, 5), torch.randn(1, 4, 1)
    with pytest.raises(RuntimeError, match="first or last dim"):
        torch.ops.aten._weight_norm_interface(v, g, 1)
    with pytest.raises(Exception, match="_weight_norm_interface over dim 1 .*first or last dim"):
        _compiled(lambda v, g: torch.ops.aten._weight_norm_interface(v, g, 1))(v, g)
