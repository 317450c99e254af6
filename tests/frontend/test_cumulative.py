"""``cumsum`` and ``cumprod`` are lowered (a blocked scan of reductions and broadcasts), not library
calls: values and gradients against eager on both sides of every block boundary and at several
levels of blocks, along any dim, for integer, bool, bf16 and f64 results; and the kernels of a
scan over several levels compile with NVRTC and simulate equal to the IR reference."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch

from fusionstitching.frontend import aten_table
from fusionstitching.frontend.torch_fx import capture
from fusionstitching.fusion import explore
from fusionstitching.graph import reference
from fusionstitching.pipeline import compile_plan

BLOCK = aten_table._SCAN_BLOCK
# lengths: one element, inside one triangle, its edge, one past it, two and three levels of blocks
LENGTHS = (1, 2, 7, BLOCK, BLOCK + 1, 100, BLOCK * BLOCK, BLOCK * BLOCK + 1, 2 * BLOCK * BLOCK + 3)


def _compiled(fn):
    torch._dynamo.reset()
    return torch.compile(fn, backend="fusionstitching")


def _check(fn, x: torch.Tensor, tolerance: dict[str, float] | None = None) -> None:
    got, want = _compiled(fn)(x), fn(x)
    assert got.dtype == want.dtype and got.shape == want.shape
    if want.dtype.is_floating_point:
        torch.testing.assert_close(got, want, **(tolerance or {"rtol": 1e-5, "atol": 1e-5}))
    else:
        assert torch.equal(got, want)


@pytest.fixture(params=["triangle", "blocks"])
def form(request, monkeypatch):
    """Small scans are one triangle (``_TRIANGLE_FLOPS``); with no such budget, every scan past one
    block takes the blocked form."""
    if request.param == "blocks":
        monkeypatch.setattr(aten_table, "_TRIANGLE_FLOPS", 0)
    return request.param


@pytest.mark.parametrize("n", LENGTHS)
def test_cumsum_of_every_length_matches_eager(n, form):
    torch.manual_seed(n)
    # sums of n standard normals grow like sqrt(n): the tolerance follows f32's rounding of them
    _check(lambda x: torch.cumsum(x, -1), torch.randn(3, n), {"rtol": 1e-5, "atol": 1e-6 * max(1, n) ** 0.5})


@pytest.mark.parametrize("n", (1, BLOCK + 1, BLOCK * BLOCK + 1))
def test_integer_and_bool_sums_are_exact_int64(n, form):
    mask = torch.randint(0, 2, (4, n), generator=torch.Generator().manual_seed(n))
    _check(lambda m: m.cumsum(-1) * m - 1, mask)  # position ids from an attention mask
    _check(lambda m: torch.cumsum(m > 0, 1), mask)
    _check(lambda m: torch.cumsum(m.int(), 1, dtype=torch.int32), mask)


@pytest.mark.parametrize("dim", (0, 1, -1))
def test_any_dim(dim, form):
    _check(lambda x: torch.cumsum(x, dim) * 2, torch.randn(40, 3, 37, generator=torch.Generator().manual_seed(3)))


def test_result_types():
    x = torch.randn(4, 300, generator=torch.Generator().manual_seed(4))
    _check(lambda x: torch.cumsum(x, 1, dtype=torch.float64), x)
    _check(lambda x: torch.cumsum(x, 1), x.bfloat16(), {"rtol": 2e-2, "atol": 2e-2})  # summed in f32
    _check(lambda x: torch.cumsum(x, 0), torch.tensor(3.0))
    _check(lambda x: torch.cumsum(x, 1), torch.randn(0, 5))


def test_cumprod_with_zeros_and_across_blocks(form):
    _check(lambda x: torch.cumprod(x, 1), 1 + 0.01 * torch.randn(4, 300, generator=torch.Generator().manual_seed(5)))
    _check(lambda x: torch.cumprod(x, 1), torch.randint(-2, 3, (4, 50), generator=torch.Generator().manual_seed(6)).float())
    _check(lambda x: torch.cumprod(x, 1), torch.randint(-2, 3, (4, 50), generator=torch.Generator().manual_seed(7)))


@pytest.mark.parametrize("op", (torch.cumsum, torch.cumprod))
def test_gradients_match_eager(op):
    x = (1 + 0.1 * torch.randn(6, 77, generator=torch.Generator().manual_seed(8))).requires_grad_(True)
    y = x.detach().clone().requires_grad_(True)
    weights = torch.randn(6, 77, generator=torch.Generator().manual_seed(9))
    (_compiled(lambda t: op(t, 1))(x) * weights).sum().backward()
    (op(y, 1) * weights).sum().backward()
    torch.testing.assert_close(x.grad, y.grad, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("op", (torch.cumsum, torch.cumprod))
def test_no_library_call_is_left(op):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        captured = capture(lambda x: op(x, 1), torch.randn(4, 100, requires_grad=True), train=True)
    for graph in filter(None, (captured.forward, captured.backward)):
        left = [n.attrs.get("target") for n in graph.nodes if n.op == "library"]
        assert not left, f"{graph.name}: {left}"


def _compiled_plan(graph):
    """``graph`` (no library call left) planned and generated, each kernel compiled by NVRTC."""
    assert not [n for n in graph.nodes if n.op == "library"]
    compiled = compile_plan(explore(graph))
    pytest.importorskip("cuda.bindings.nvrtc")
    from fusionstitching.codegen.nvrtc import compile_cuda

    for kernel in compiled.kernels:
        compile_cuda(kernel.cuda_source, "sm_90")
    return compiled


def test_a_scans_kernels_compile_and_simulate_as_the_reference(form):
    """One triangle, or three levels of blocks, fused with the ops around it (a mask's position ids
    feeding a gather)."""
    table = torch.randn(4096, 8, generator=torch.Generator().manual_seed(10))

    def positions(mask):
        ids = mask.cumsum(-1) * mask
        return table[ids] * mask.unsqueeze(-1)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        captured = capture(positions, torch.randint(0, 2, (2, 2 * BLOCK * BLOCK + 3 if form == "blocks" else 300)))
    graph = captured.forward
    compiled = _compiled_plan(graph)
    rng = np.random.default_rng(0)
    inputs = [rng.integers(0, 2, p.shape).astype(p.dtype.numpy) if not p.dtype.is_float
              else rng.standard_normal(p.shape).astype(p.dtype.numpy) for p in graph.parameters]
    for got, want in zip(compiled.run_numpy(inputs), reference.evaluate(graph, inputs)):
        np.testing.assert_allclose(np.asarray(got, np.float64), np.asarray(want, np.float64), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("n", LENGTHS)
def test_logcumsumexp_of_every_length_matches_eager(n, form):
    torch.manual_seed(n)
    _check(lambda x: torch.logcumsumexp(x, -1), 3 * torch.randn(3, n), {"rtol": 1e-5, "atol": 1e-5})


def test_logcumsumexp_keeps_prefixes_far_below_the_rows_maximum(form):
    """Each prefix is shifted by its own largest element: a prefix 200 below the row's maximum does
    not underflow (one shift per row would give -inf there); infinities and NaN as torch."""
    x = torch.cat([torch.randn(2, 100) - 200, torch.randn(2, 100) + 200], 1)
    _check(lambda x: torch.logcumsumexp(x, 1), x, {"rtol": 1e-5, "atol": 1e-4})
    special = torch.randn(5, 90, generator=torch.Generator().manual_seed(11))
    special[0] = -torch.inf
    special[1, 40:] = -torch.inf
    special[2, 50] = torch.inf
    special[3, 10] = torch.nan
    special[4, 60:] = torch.inf
    _check(lambda x: torch.logcumsumexp(x, 1), special, {"rtol": 1e-5, "atol": 1e-5, "equal_nan": True})


def test_logcumsumexp_types_dims_and_gradient(form):
    x = torch.randn(40, 3, 37, generator=torch.Generator().manual_seed(12))
    for dim in (0, 1, -1):
        _check(lambda t, dim=dim: torch.logcumsumexp(t, dim) * 2, x)
    _check(lambda t: torch.logcumsumexp(t, 1), x[0].bfloat16(), {"rtol": 2e-2, "atol": 2e-2})  # in f32
    _check(lambda t: torch.logcumsumexp(t, 0), torch.tensor(3.0))
    _check(lambda t: torch.logcumsumexp(t, 1), torch.randn(0, 5))
    a = torch.randn(6, 77, generator=torch.Generator().manual_seed(13)).requires_grad_(True)
    b = a.detach().clone().requires_grad_(True)
    weights = torch.randn(6, 77, generator=torch.Generator().manual_seed(14))
    (_compiled(lambda t: torch.logcumsumexp(t, 1))(a) * weights).sum().backward()
    (torch.logcumsumexp(b, 1) * weights).sum().backward()
    torch.testing.assert_close(a.grad, b.grad, rtol=1e-5, atol=1e-5)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        captured = capture(lambda t: torch.logcumsumexp(t, 1), torch.randn(4, 100, requires_grad=True), train=True)
    for graph in filter(None, (captured.forward, captured.backward)):
        left = [n.attrs.get("target") for n in graph.nodes if n.op == "library"]
        assert not left, f"{graph.name}: {left}"


def test_a_log_scans_kernels_compile_and_simulate_as_the_reference(form):
    """The log-sum-exp scan over one triangle or three levels of blocks, with -inf and +inf among
    the elements (the shifts of ``_masked_log_sum_exp``, the combine of ``_log_add_exp``)."""
    n = 2 * BLOCK * BLOCK + 3 if form == "blocks" else 300
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        captured = capture(lambda x: torch.logcumsumexp(x * 2, -1) - x, torch.randn(2, n))
    graph = captured.forward
    compiled = _compiled_plan(graph)
    x = np.random.default_rng(1).standard_normal((2, n)).astype(np.float32)
    x[0, : n // 3] = -np.inf
    x[1, n // 2] = np.inf
    for got, want in zip(compiled.run_numpy([x]), reference.evaluate(graph, [x])):
        np.testing.assert_allclose(np.asarray(got, np.float64), np.asarray(want, np.float64), rtol=1e-6, atol=1e-6)
