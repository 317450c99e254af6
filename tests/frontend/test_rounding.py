"""``trunc``, ``round`` (half to even, with ``decimals`` too) and ``frac`` are lowered, not library calls,
and give eager's values: bit for bit without ``decimals`` (ties, signed zeros, values past 2^23, NaN
and the infinities included), within the 1.5 ulp of the kernels' division with them."""

from __future__ import annotations

import math
import warnings

import pytest
import torch

from fusionstitching.frontend.torch_fx import capture

SPECIAL = [0.5, 1.5, 2.5, -0.5, -1.5, -2.5, -0.3, 0.3, -0.0, 0.0, 2.0 ** 23 + 1, -(2.0 ** 23) - 1, 8388607.5,
           4194303.5, math.inf, -math.inf, math.nan, 1e30, -1e-30, 0.49999997, 0.50000006, 3.0, -987.654321]


def _values(dtype: torch.dtype) -> torch.Tensor:
    torch.manual_seed(0)
    return torch.cat([torch.tensor(SPECIAL), torch.randn(200) * 10, torch.randn(100) * 1e4]).to(dtype)


def _compiled(fn):
    torch._dynamo.reset()
    return torch.compile(fn, backend="fusionstitching")


def _same_bits(got: torch.Tensor, want: torch.Tensor) -> bool:
    bits = torch.int32 if got.dtype == torch.float32 else torch.int16
    return bool(((got.view(bits) == want.view(bits)) | (got.isnan() & want.isnan())).all())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("name, fn", [("trunc", lambda t: t.trunc() * 1), ("round", lambda t: t.round() * 1),
                                      ("frac", lambda t: t.frac() * 1)])
def test_bit_for_bit_as_eager(name, fn, dtype):
    x = _values(dtype)
    assert _same_bits(_compiled(fn)(x), fn(x)), name


@pytest.mark.parametrize("decimals", [1, 3, -1, -2])
def test_round_to_decimals_as_eager_within_the_division_s_rounding(decimals):
    def fn(t):
        return torch.round(t, decimals=decimals)

    x = _values(torch.float32)
    torch.testing.assert_close(_compiled(fn)(x), fn(x), rtol=3e-7, atol=0, equal_nan=True)


def test_integers_are_their_own_rounding():
    def fn(t):
        return t.round() + t.trunc()

    x = torch.randint(-9, 9, (10,))
    assert torch.equal(_compiled(fn)(x), fn(x))


@pytest.mark.parametrize("fn", [lambda t: t.trunc(), lambda t: t.round(), lambda t: torch.round(t, decimals=2),
                                lambda t: t.frac()])
def test_no_library_call_is_left(fn):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        captured = capture(lambda t: fn(t) * t, torch.randn(8, requires_grad=True), train=True)
    for graph in filter(None, (captured.forward, captured.backward)):
        assert not [n for n in graph.nodes if n.op == "library"], graph.name
