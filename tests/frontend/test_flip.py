"""``flip`` (a gather of reversed positions per dim; ``fliplr``, ``flipud``, ``rot90`` through it) is
lowered, not a library call, forward and backward, against eager."""

from __future__ import annotations

import warnings

import pytest
import torch

from fusionstitching.frontend.torch_fx import capture


@pytest.mark.parametrize("shape, dims", [((5,), (0,)), ((3, 4), (1,)), ((3, 4), (0, 1)), ((2, 3, 4), (-1, 0)),
                                         ((2, 1, 4), (1,)), ((), ()), ((0, 3), (0,))])
def test_flip_and_its_gradient_match_eager(shape, dims):
    def fn(x):
        return (x.flip(dims) * 2).sin()

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


def test_fliplr_flipud_and_rot90_are_exact():
    def fn(x):
        return torch.fliplr(x) + torch.flipud(x) + torch.rot90(x, 1, (0, 1))

    x = torch.randn(4, 4)
    torch._dynamo.reset()
    assert torch.equal(torch.compile(fn, backend="fusionstitching")(x), fn(x))
