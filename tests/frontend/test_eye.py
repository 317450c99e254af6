"""``torch.eye`` compiles: torch's decomposition compares ``arange``s of the narrowest integer type
holding the size (uint8 up to 255), which the IR lacked, so a graph with an identity matrix (XLNet's
attention mask) ran in PyTorch whole; capture's own decomposition compares int64 ranges."""

from __future__ import annotations

import warnings

import pytest
import torch

import fusionstitching
from fusionstitching.frontend.torch_fx import capture


@pytest.mark.parametrize(("n", "m", "dtype"), [(5, None, None), (300, 7, torch.float64), (3, 4, torch.bool),
                                               (0, 3, torch.int32), (70000, 2, torch.bfloat16)])
def test_identity_matrices_compile_to_eagers_values(n, m, dtype):
    def fn(x):
        eye = torch.eye(n, dtype=dtype) if m is None else torch.eye(n, m, dtype=dtype)
        return eye, x * 2

    torch._dynamo.reset()
    compiled = torch.compile(fn, backend="fusionstitching", options={"strict": True})
    x = torch.randn(3)
    fallbacks = fusionstitching.stats()["fallbacks"]
    got, want = compiled(x), fn(x)
    assert got[0].dtype == want[0].dtype and torch.equal(got[0], want[0])
    assert fusionstitching.stats()["fallbacks"] == fallbacks


def test_no_narrow_integer_or_library_call_is_left():
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a library call or a fallback is announced by a warning
        captured = capture(lambda x: x - torch.eye(8) * x.diagonal().unsqueeze(0), torch.randn(8, 8))
    assert not [n for n in captured.forward.nodes if n.op == "library"]


def test_a_negative_size_is_eagers_error():
    compiled = torch.compile(lambda x: torch.eye(-1) + x, backend="fusionstitching", options={"strict": True})
    with pytest.raises(RuntimeError, match="must be greater or equal to 0"):
        compiled(torch.randn(1))
