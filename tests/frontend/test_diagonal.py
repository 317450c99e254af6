"""``diagonal`` (a strided slice of the two dims flattened) and ``diagonal_scatter`` (its gradient) are
lowered, not library calls, for every offset and pair of dims, against eager."""

from __future__ import annotations

import warnings

import pytest
import torch

from fusionstitching.frontend.torch_fx import capture

CASES = [((4, 4), 0, 0, 1), ((3, 5), 1, 0, 1), ((3, 5), -2, 0, 1), ((5, 3), 2, 0, 1), ((3, 4, 5), 1, 0, 2),
         ((3, 4, 5), -1, 2, 0), ((2, 3, 4, 5), 0, -1, 1), ((3, 4), 7, 0, 1), ((3, 4), -5, 1, 0), ((2, 6, 6), 0, 1, 2)]


@pytest.mark.parametrize("shape, offset, dim1, dim2", CASES)
def test_diagonal_and_its_gradient_match_eager(shape, offset, dim1, dim2):
    def fn(x):
        return (x.diagonal(offset, dim1, dim2) * 2).exp()

    torch.manual_seed(0)
    x = torch.randn(shape)
    a, b = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    want = fn(a)
    torch._dynamo.reset()
    got = torch.compile(fn, backend="fusionstitching")(b)
    torch.testing.assert_close(got, want)
    if want.numel():
        gy = torch.randn_like(want)
        want.backward(gy)
        got.backward(gy)
        torch.testing.assert_close(b.grad, a.grad)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        captured = capture(fn, x.clone().requires_grad_(True), train=True)
    for graph in filter(None, (captured.forward, captured.backward)):
        assert not [n for n in graph.nodes if n.op == "library"], graph.name


def test_diagonal_scatter_and_trace():
    def scatter(x, s):
        return torch.diagonal_scatter(x, s, 1, 0, 1) * 3

    def trace(x):
        return torch.trace(x) + x.diagonal().sum()

    x, s = torch.randn(4, 5), torch.randn(4)
    torch._dynamo.reset()
    assert torch.equal(torch.compile(scatter, backend="fusionstitching")(x, s), scatter(x, s))
    x = torch.randn(5, 5)
    torch._dynamo.reset()
    torch.testing.assert_close(torch.compile(trace, backend="fusionstitching")(x), trace(x))
