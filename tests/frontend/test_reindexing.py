"""``diagonal`` (a strided slice of the two dims flattened), ``diagonal_scatter`` (its gradient) and
``flip`` (a gather of reversed positions per dim; ``fliplr``, ``flipud``, ``rot90`` through it) are
lowered, not library calls, forward and backward, against eager."""

from __future__ import annotations

import warnings

import pytest
import torch

from fusionstitching.frontend.torch_fx import capture


def _check_against_eager(fn, shape):
    """Values and the gradient of ``fn`` at a random input of ``shape``, compiled against eager, and
    no library call in the captured forward and backward graphs."""
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


@pytest.mark.parametrize("shape, offset, dim1, dim2", [
    ((4, 4), 0, 0, 1), ((3, 5), 1, 0, 1), ((3, 5), -2, 0, 1), ((5, 3), 2, 0, 1), ((3, 4, 5), 1, 0, 2),
    ((3, 4, 5), -1, 2, 0), ((2, 3, 4, 5), 0, -1, 1), ((3, 4), 7, 0, 1), ((3, 4), -5, 1, 0), ((2, 6, 6), 0, 1, 2)])
def test_diagonal_and_its_gradient(shape, offset, dim1, dim2):
    _check_against_eager(lambda x: (x.diagonal(offset, dim1, dim2) * 2).exp(), shape)


@pytest.mark.parametrize("shape, dims", [((5,), (0,)), ((3, 4), (1,)), ((3, 4), (0, 1)), ((2, 3, 4), (-1, 0)),
                                         ((2, 1, 4), (1,)), ((), ()), ((0, 3), (0,))])
def test_flip_and_its_gradient(shape, dims):
    _check_against_eager(lambda x: (x.flip(dims) * 2).sin(), shape)


def test_diagonal_scatter_trace_and_flips_are_exact():
    def scatter(x, s):
        return torch.diagonal_scatter(x, s, 1, 0, 1) * 3

    def trace(x):
        return torch.trace(x) + x.diagonal().sum()

    def flips(x):
        return torch.fliplr(x) + torch.flipud(x) + torch.rot90(x, 1, (0, 1))

    x, s = torch.randn(4, 5), torch.randn(4)
    torch._dynamo.reset()
    assert torch.equal(torch.compile(scatter, backend="fusionstitching")(x, s), scatter(x, s))
    for fn in (trace, flips):
        x = torch.randn(5, 5)
        torch._dynamo.reset()
        torch.testing.assert_close(torch.compile(fn, backend="fusionstitching")(x), fn(x), rtol=1e-6, atol=1e-6)
