"""``torch.linalg.vector_norm`` (behind ``F.normalize``, ``Tensor.norm`` and weight norm) is lowered, not
a library call: every ord torch accepts for real inputs, forward and backward, against eager; an input
eager rejects is rejected with eager's error."""

from __future__ import annotations

import math
import warnings

import pytest
import torch
import torch.nn.functional as F

from fusionstitching.frontend.torch_fx import capture

CASES = {
    "ord2_all": (lambda x: torch.linalg.vector_norm(x), (5, 7), torch.float32),
    "ord2_last_keepdim": (lambda x: torch.linalg.vector_norm(x, dim=-1, keepdim=True), (5, 7), torch.float32),
    "ord1": (lambda x: torch.linalg.vector_norm(x, ord=1, dim=0), (5, 7), torch.float32),
    "inf": (lambda x: torch.linalg.vector_norm(x, ord=math.inf, dim=1), (5, 7), torch.float32),
    "minus_inf": (lambda x: torch.linalg.vector_norm(x, ord=-math.inf, dim=1), (5, 7), torch.float32),
    "p_3.5_two_dims": (lambda x: torch.linalg.vector_norm(x, ord=3.5, dim=(0, 2)), (5, 7, 3), torch.float32),
    "p_minus_1.5": (lambda x: torch.linalg.vector_norm(x, ord=-1.5, dim=1), (5, 7), torch.float32),
    "scalar": (lambda x: torch.linalg.vector_norm(x), (), torch.float32),
    "tensor_norm": (lambda x: x.norm(dim=1), (6, 9), torch.float32),
    "normalize": (lambda x: F.normalize(x, dim=-1), (4, 16), torch.float32),
    "normalize_bf16": (lambda x: F.normalize(x, dim=-1), (4, 16), torch.bfloat16),
    "bf16_to_f32": (lambda x: torch.linalg.vector_norm(x, dim=1, dtype=torch.float32), (4, 16), torch.bfloat16),
}


def _tolerance(dtype: torch.dtype) -> dict[str, float]:
    return {"rtol": 2e-2, "atol": 2e-2} if dtype == torch.bfloat16 else {"rtol": 1e-5, "atol": 1e-6}


@pytest.mark.parametrize("name", list(CASES))
def test_values_and_gradients_match_eager(name):
    fn, shape, dtype = CASES[name]
    torch.manual_seed(0)
    x = torch.randn(shape, dtype=dtype)
    x1, x2 = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    torch._dynamo.reset()
    want, got = fn(x1), torch.compile(fn, backend="fusionstitching")(x2)
    assert got.dtype == want.dtype and got.shape == want.shape
    torch.testing.assert_close(got, want, **_tolerance(dtype))
    gy = torch.randn_like(want)
    want.backward(gy)
    got.backward(gy)
    torch.testing.assert_close(x2.grad, x1.grad, **_tolerance(dtype))


@pytest.mark.parametrize("name", list(CASES))
def test_no_library_call_is_left(name):
    fn, shape, dtype = CASES[name]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        captured = capture(fn, torch.randn(shape, dtype=dtype, requires_grad=True), train=True)
    for graph in filter(None, (captured.forward, captured.backward)):
        left = [n.attrs.get("target") for n in graph.nodes if n.op == "library"]
        assert not left, f"{graph.name}: {left}"


def test_count_of_nonzeros():
    def fn(x):
        return torch.linalg.vector_norm(x, ord=0, dim=1)

    x = torch.randn(6, 8)
    x[x.abs() < 0.5] = 0
    torch._dynamo.reset()
    torch.testing.assert_close(torch.compile(fn, backend="fusionstitching")(x), fn(x))


@pytest.mark.parametrize("ord", [2, 1, math.inf, -math.inf, 3.0])
def test_non_finite_values_as_eager(ord):
    def fn(x):
        return torch.linalg.vector_norm(x, ord=ord, dim=1)

    x = torch.randn(5, 6)
    x[1, 2], x[2, 0], x[3, 4] = math.nan, math.inf, -math.inf
    torch._dynamo.reset()
    torch.testing.assert_close(torch.compile(fn, backend="fusionstitching")(x), fn(x), equal_nan=True)


def test_integer_input_rejected_as_eager_does():
    def fn(x):
        return torch.linalg.vector_norm(x)

    x = torch.arange(6)
    with pytest.raises(RuntimeError) as eager:
        fn(x)
    torch._dynamo.reset()
    with pytest.raises(Exception) as compiled:
        torch.compile(fn, backend="fusionstitching")(x)
    assert "floating point" in str(eager.value) and "floating point" in str(compiled.value)
