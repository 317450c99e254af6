"""Reductions over rows shorter than their lanes' vector slots (``schedule.grouping._reduced_tiles``:
one vector per lane, the lanes past the row's end idle) and rows with a tail of slots, forward and
backward, through ``torch.compile`` against eager: a masked softmax and a log-softmax in bf16 and
f32. Few rows and many rows (one or two rows per warp). LayerNorms of such rows, with their weight
and bias gradients, are cases of tests/frontend/test_norms.py."""

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
