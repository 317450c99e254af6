"""``bias_into_gemms`` (``fusion/gemm_bias.py``): a library GEMM whose bias add must be written to
memory in any plan adds the bias in its epilogue (one ``aten.addmm`` call)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import fusionstitching
from fusionstitching.fusion import explore
from fusionstitching.fusion.gemm_bias import bias_into_gemms
from fusionstitching.fusion.legality import is_gemm_call
from fusionstitching.graph import reference
from fusionstitching.graph.graph import GraphBuilder
from fusionstitching.graph.ops import DType
from fusionstitching.options import Options

from .helpers import random_arrays

DOT = {"lhs_batch": (), "rhs_batch": (), "lhs_contract": (1,), "rhs_contract": (0,)}


def _linear(rows: int = 512, k: int = 256, n: int = 384, dtype: DType = DType.F32, *, bias_first: bool = False,
            relu_only: bool = False, dot_returned: bool = False, bias_dims: tuple[int, ...] = (1,)):
    """x @ w.T + b as the frontend lowers ``addmm``: the weight read through a transpose, the bias
    broadcast along the rows; returned (a saved activation), or only its ReLU."""
    b = GraphBuilder("linear")
    x = b.parameter((rows, k), dtype, "x")
    w = b.parameter((n, k), dtype, "w")
    bias = b.parameter((n if bias_dims == (1,) else rows,), dtype, "bias")
    dot = b.node("dot_general", [x, b.transpose(w, (1, 0))], **DOT)
    row = b.broadcast(bias, (rows, n), bias_dims)
    total = b.binary("add", row, dot) if bias_first else b.binary("add", dot, row)
    relu = b.binary("max", total, b.broadcast(b.constant(0.0, dtype), (rows, n), ()))
    outputs = [relu] if relu_only else [total, relu]
    return b.build(outputs + ([dot] if dot_returned else []))


def _gemm_error_bound(x: np.ndarray, w: np.ndarray, bias: np.ndarray) -> np.ndarray:
    """Per element of ``x @ w.T + bias`` in f32, the forward error bound of a sum of k + 1 products
    in any order, (k + 2)·ε·(|x| @ |w|ᵀ + |bias|): two f32 evaluations of one linear layer (the
    graph's dot and add, the folded addmm) differ by BLAS's summation order, which changes with
    the library's version; a wrong bias or weight layout is off by far more."""
    k = x.shape[1]
    eps = float(np.finfo(np.float32).eps)
    magnitude = np.abs(x).astype(np.float64) @ np.abs(w).astype(np.float64).T + np.abs(bias).astype(np.float64)
    return (k + 2) * eps * magnitude


@pytest.mark.parametrize("bias_first", [False, True])
def test_a_saved_linear_output_is_one_addmm_call_that_reads_the_weight_as_a_view(bias_first: bool):
    graph = _linear(bias_first=bias_first)
    folded, done = bias_into_gemms(graph, Options())
    assert len(done) == 1
    calls = [n for n in folded.nodes if is_gemm_call(n)]
    assert len(calls) == 1 and not any(n.op == "dot_general" for n in folded.nodes)
    assert [x.op for x in calls[0].operands] == ["parameter", "parameter", "transpose"]
    arrays = random_arrays(graph)
    bound = _gemm_error_bound(*arrays[:3])
    for want, got in zip(reference.evaluate(graph, arrays), reference.evaluate(folded, arrays)):
        assert np.all(np.abs(got.astype(np.float64) - want) <= bound), np.abs(got.astype(np.float64) - want).max()
    plan = explore(graph)
    assert any(note.startswith("fold ") for note in plan.notes), plan.explain()
    assert "transpose" in " ".join(plan.views), plan.explain()  # cuBLAS reads the weight transposed
    # the ReLU's kernel reads the sum and writes only the ReLU
    assert plan.kernel_count == 1 and plan.pattern_of(calls[0].name) is None, plan.explain()


def test_a_bias_add_that_fuses_into_a_kernel_is_left_there():
    """Only the ReLU leaves the graph: the add costs nothing in the ReLU's kernel."""
    graph = _linear(relu_only=True)
    assert bias_into_gemms(graph, Options()) == (graph, [])


@pytest.mark.parametrize("case", [{"dot_returned": True}, {"bias_dims": (0,)}, {"dtype": DType.F64}])
def test_other_sums_keep_the_gemm_and_the_add(case: dict):
    """The product read elsewhere too, a bias along the columns, an f64 GEMM."""
    graph = _linear(**case)
    assert bias_into_gemms(graph, Options()) == (graph, [])


def test_a_bias_that_is_one_value_for_every_column_keeps_the_add():
    """x @ w + c with c a scalar broadcast to the row: the library would get a stride-0 bias."""
    b = GraphBuilder("scalar_bias")
    x, w = b.parameter((512, 256), DType.F32, "x"), b.parameter((256, 384), DType.F32, "w")
    c = b.parameter((), DType.F32, "c")
    dot = b.node("dot_general", [x, w], **DOT)
    graph = b.build([b.binary("add", dot, b.broadcast(b.broadcast(c, (384,), ()), (512, 384), (1,)))])
    assert bias_into_gemms(graph, Options()) == (graph, [])


def test_small_dots_and_the_option_off_keep_the_add():
    graph = _linear(rows=16, k=16, n=16)
    assert bias_into_gemms(graph, Options()) == (graph, [])  # a small dot: fused by the code generator
    plan = explore(_linear(), options=Options(gemm_bias=False))
    assert not any(note.startswith("fold ") for note in plan.notes)


class _MLP(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(64, 96)
        self.fc2 = torch.nn.Linear(96, 40)

    def forward(self, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.cross_entropy(self.fc2(torch.relu(self.fc1(x))), target)


def _matches_eager(model: torch.nn.Module, x: torch.Tensor, target: torch.Tensor, options: Options,
                   tolerance: float) -> None:
    """One training step compiled with ``options``: loss and every gradient within ``tolerance`` of eager's."""
    torch._dynamo.reset()
    loss = fusionstitching.compile(model, options=options)(x, target)
    loss.backward()
    got = [loss.detach()] + [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    want_loss = model(x, target)
    want_loss.backward()
    want = [want_loss.detach()] + [p.grad for p in model.parameters()]
    for g, w in zip(got, want):
        torch.testing.assert_close(g.float(), w.float(), rtol=tolerance, atol=tolerance)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_trained_mlp_saves_the_addmm_result_and_matches_eager(dtype: torch.dtype):
    """The logits the backward saves come from ``addmm``; loss and every gradient are eager's."""
    torch.manual_seed(0)
    model = _MLP().to(dtype)
    x, target = torch.randn(128, 64, dtype=dtype), torch.randint(0, 40, (128,))
    _matches_eager(model, x, target, Options(strict=True), 1e-4 if dtype == torch.float32 else 2e-2)
    forward = fusionstitching.capture(model, x, target, train=True).forward
    plan = explore(forward, options=Options())
    assert sum(note.startswith("fold ") for note in plan.notes) == 1, plan.explain()  # fc2; fc1 feeds the ReLU


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_trained_mlp_with_cublaslt_bias_epilogues_matches_eager_on_gpu(dtype: torch.dtype):
    """On the GPU ``addmm`` adds the bias in cuBLASLt's epilogue; loss and gradients are eager's."""
    torch.manual_seed(0)
    model = _MLP().to("cuda", dtype)
    x, target = torch.randn(256, 64, dtype=dtype, device="cuda"), torch.randint(0, 40, (256,), device="cuda")
    _matches_eager(model, x, target, Options(strict=True, tune="off"), 1e-4 if dtype == torch.float32 else 3e-2)
