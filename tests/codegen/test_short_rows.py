"""Reductions over rows shorter than their lanes' vector slots (``schedule.grouping._reduced_tiles``:
one vector per lane, the lanes past the row's end idle) and rows with a tail of slots, forward and
backward, through ``torch.compile`` against eager: a masked softmax in bf16, a LayerNorm with its
weight and bias gradients (column sums over the rows), a log-softmax. Few rows take a block per row,
many rows a warp per row."""

from __future__ import annotations

import pytest
import torch

LENGTHS = (36, 100, 250)


def _softmax(x, mask):
    return torch.softmax(x * 0.125 + mask, dim=-1)


def _log_softmax(x, mask):
    return torch.log_softmax(x.float(), dim=-1).to(x.dtype)


@pytest.mark.parametrize("rows", [3, 96])
@pytest.mark.parametrize("cols", LENGTHS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("fn", [_softmax, _log_softmax], ids=["softmax", "log_softmax"])
def test_short_rows_match_eager(fn, dtype, cols, rows):
    torch.manual_seed(cols + rows)
    x = (torch.randn(rows, cols) * 3).to(dtype)
    mask = torch.where(torch.rand(1, cols) < 0.2, -1e4, 0.0).to(dtype)
    torch._dynamo.reset()
    got = torch.compile(fn, backend="fusionstitching")(x, mask)
    tolerance = 1e-2 if dtype == torch.bfloat16 else 1e-5
    torch.testing.assert_close(got.float(), fn(x, mask).float(), rtol=tolerance, atol=tolerance)


@pytest.mark.parametrize("rows", [3, 96])
@pytest.mark.parametrize("cols", LENGTHS)
def test_a_short_layernorm_and_its_gradients_match_eager(cols, rows):
    torch.manual_seed(cols * rows)
    module = torch.nn.LayerNorm(cols)
    with torch.no_grad():
        module.weight.uniform_(0.5, 1.5)
        module.bias.uniform_(-0.5, 0.5)
    reference = torch.nn.LayerNorm(cols)
    reference.load_state_dict(module.state_dict())
    torch._dynamo.reset()
    compiled = torch.compile(module, backend="fusionstitching")
    x = torch.randn(rows, cols) * 2
    x1, x2 = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    want, got = reference(x1), compiled(x2)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    gy = torch.randn_like(want)
    want.backward(gy)
    got.backward(gy)
    torch.testing.assert_close(x2.grad, x1.grad, rtol=1e-4, atol=1e-4)
    for p, q in zip(module.parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-4)
