"""Every common normalization is lowered, forward and backward, and matches eager: GroupNorm,
BatchNorm (training, with its running statistics, and eval), InstanceNorm, RMSNorm (torch's module
and the hand-written Llama form), LayerNorm. No library call is left for any of them."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch

from fusionstitching.frontend import aten_table
from fusionstitching.frontend.torch_fx import capture


def _modules():
    return {
        "groupnorm_silu": (lambda: torch.nn.Sequential(torch.nn.GroupNorm(4, 16), torch.nn.SiLU()), (2, 16, 6, 5)),
        "groupnorm_one_group": (lambda: torch.nn.GroupNorm(1, 8, affine=False), (3, 8, 4, 4)),
        "batchnorm_train": (lambda: torch.nn.BatchNorm2d(16).train(), (4, 16, 5, 5)),
        "batchnorm_eval": (lambda: _eval_batchnorm(), (4, 16, 5, 5)),
        "batchnorm1d_train": (lambda: torch.nn.BatchNorm1d(12).train(), (8, 12)),
        "instancenorm": (lambda: torch.nn.InstanceNorm2d(16, affine=True), (2, 16, 6, 6)),
        "rmsnorm_module": (lambda: torch.nn.RMSNorm(32), (4, 7, 32)),
        "layernorm": (lambda: torch.nn.LayerNorm(24), (5, 24)),
        # rows shorter than a warp's vector slots, one vector per lane, and rows with a tail of slots
        **{f"layernorm_rows_{rows}x{cols}": (lambda cols=cols: torch.nn.LayerNorm(cols), (rows, cols))
           for cols in (36, 100, 250) for rows in (3, 96)},
    }


def _eval_batchnorm():
    module = torch.nn.BatchNorm2d(16)
    with torch.no_grad():
        module.running_mean.uniform_(-1, 1)
        module.running_var.uniform_(0.5, 2)
    return module.eval()


@pytest.mark.parametrize("name", list(_modules()))
def test_no_library_call_is_left(name):
    make, shape = _modules()[name]
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        captured = capture(make(), torch.randn(shape, requires_grad=True), train=True)
    for graph in filter(None, (captured.forward, captured.backward)):
        left = [n.attrs.get("target") for n in graph.nodes if n.op == "library"]
        assert not left, f"{graph.name}: {left}"


@pytest.mark.parametrize("name", list(_modules()))
def test_forward_backward_and_running_statistics_match_eager(name):
    make, shape = _modules()[name]
    torch.manual_seed(0)
    module = make()
    for p in module.parameters():
        with torch.no_grad():
            p.uniform_(0.5, 1.5)
    reference = copy.deepcopy(module)
    torch._dynamo.reset()
    compiled = torch.compile(module, backend="fusionstitching")
    x = torch.randn(shape)
    x1, x2 = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    want, got = reference(x1), compiled(x2)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    gy = torch.randn_like(want)
    want.backward(gy)
    got.backward(gy)
    torch.testing.assert_close(x2.grad, x1.grad, rtol=1e-4, atol=1e-4)
    for (n, p), q in zip(module.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-4, msg=n)
    for (n, b), c in zip(module.named_buffers(), reference.buffers()):
        torch.testing.assert_close(b, c, rtol=1e-5, atol=1e-5, msg=n)  # running statistics, step count


@pytest.mark.parametrize("fn, shape", [
    (lambda x: torch.as_strided(x * 1, (3, 3), (1, 3)) * 2, (9,)),  # a transposed window
    (lambda x: torch.as_strided((x * 2)[:, ::2], (2, 3), (1, 1)) + 1, (3, 4)),  # overlapping, of a strided view
    (lambda x: torch.as_strided(x.t() * 2, (3, 2), (2, 1)) + 1, (2, 3)),  # of transposed storage
    (lambda x: torch.as_strided((x + 1).view(2, 4, 6)[1], (2, 3, 4), (8, 6, 1), 24) * 3, (8, 6)),  # chunks, at an offset
])
def test_as_strided_of_a_computed_value_gathers_from_its_storage(fn, shape):
    """An ``as_strided`` that is not a run reads the storage of the value the graph computed (its
    elements in the order of its strides) by one gather: Longformer's overlapping chunks."""
    torch._dynamo.reset()
    x = torch.randn(shape)
    fresh = x.clone().requires_grad_(True)
    got = torch.compile(fn, backend="fusionstitching", options={"strict": True})(fresh)
    torch.testing.assert_close(got, fn(x))
    captured = capture(fn, x)
    assert not [n for n in captured.forward.nodes if n.op == "library"]
    got.sum().backward()
    want = x.clone().requires_grad_(True)
    fn(want).sum().backward()
    torch.testing.assert_close(fresh.grad, want.grad)



def test_as_strided_of_a_computed_value_in_transposed_strides():
    """An elementwise op of a transposed input keeps its strides: the result is dense but not
    contiguous, and an ``as_strided`` of it reads that storage. Capture checks the layout itself:
    the torch helper it once imported is gone from some torch versions, and the ImportError failed
    the graph (Longformer's chunked attention)."""
    def fn(x):
        return torch.as_strided(x.t() * 2, (3, 2), (2, 1)) + 1

    torch._dynamo.reset()
    x = torch.randn(2, 3)
    torch.testing.assert_close(torch.compile(fn, backend="fusionstitching", options={"strict": True})(x), fn(x))
    assert aten_table._dense((2, 3), (1, 2)) and aten_table._dense((4, 1, 3), (1, 7, 4))
    assert not aten_table._dense((2, 3), (1, 3)) and not aten_table._dense((2, 2), (1, 1))

@pytest.mark.parametrize("window", [((2, 2), (2, 1), 3), ((2, 2), (1, 2), 3)])
def test_as_strided_of_an_input_at_an_absolute_offset_runs_in_pytorch(window):
    """``as_strided`` reads its operand's storage from an absolute offset: of a graph input, which may
    come at any storage offset, it is no function of the input's values, so the graph runs in
    PyTorch (announced), and every call gives eager's result. Compiled, a slice of a buffer at
    offsets 2 and 4 read the run of the traced offset 1, both as a kernel and as a library call."""
    from fusionstitching.backend import FallbackWarning

    def fn(x):
        return torch.as_strided(x, *window) * 1.0

    base = torch.arange(20.0)
    torch._dynamo.reset()
    compiled = torch.compile(fn, backend="fusionstitching", options={"strict": False})
    with pytest.warns(FallbackWarning, match="absolute offset"):
        compiled(base[1:9])
    for offset in (1, 2, 4):
        x = base[offset:offset + 8]
        assert torch.equal(compiled(x), fn(x)), offset


@pytest.mark.parametrize("fn, shapes", [
    (lambda x, s: torch.as_strided_scatter(x * 1, s, (2, 32), (32, 1), 0) * 2, ((64,), (2, 32))),
    # a run from the sixth element; size-1 dims take any stride
    (lambda x, s: torch.as_strided_scatter(x * 1, s, (3, 4), (4, 1), 5) + 1, ((4, 5), (3, 4))),
    (lambda x, s: torch.as_strided_scatter(x * 1, s, (3, 1, 4), (4, 7, 1), 2) + 1, ((20,), (3, 1, 4))),
    (lambda x: torch.as_strided(x * 1, (2, 3), (3, 1), 4) * 3, ((3, 4),)),
    (lambda x: torch.as_strided(x, (2, 3), (3, 1)) * 3, ((6,),)),  # no storage offset: from x's first element
])
def test_views_and_scatters_of_a_contiguous_run_are_lowered(fn, shapes):
    torch.manual_seed(0)
    args = [torch.randn(s) for s in shapes]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        captured = capture(fn, *args)
    assert not [n for n in captured.forward.nodes if n.op == "library"]
    torch._dynamo.reset()
    torch.testing.assert_close(torch.compile(fn, backend="fusionstitching")(*args), fn(*args), rtol=0, atol=0)


def test_the_gradient_of_a_pooled_transpose_is_lowered():
    """Swin's pooler, ``adaptive_avg_pool1d(x.transpose(1, 2), 1).flatten(1)``: its gradient scatters
    a [2, 32] view into the 64 elements of a computed value (``as_strided_scatter``)."""
    def fn(x):
        return torch.nn.functional.adaptive_avg_pool1d(x.transpose(1, 2), 1).flatten(1) * 2

    torch.manual_seed(0)
    x = torch.randn(2, 5, 32)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        captured = capture(fn, x.clone().requires_grad_(True), train=True)
    for graph in filter(None, (captured.forward, captured.backward)):
        assert not [n for n in graph.nodes if n.op == "library"], graph.name
    a, b = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    torch._dynamo.reset()
    got, want = torch.compile(fn, backend="fusionstitching")(a), fn(b)
    torch.testing.assert_close(got, want)
    gy = torch.randn_like(want)
    got.backward(gy)
    want.backward(gy)
    torch.testing.assert_close(a.grad, b.grad)


def test_a_scatter_into_a_strided_view_stays_a_library_call():
    def fn(x, s):
        return torch.as_strided_scatter(x * 1, s, (3, 3), (1, 3), 0) + 1  # a transposed window

    torch._dynamo.reset()
    x, s = torch.randn(9), torch.randn(3, 3)
    torch.testing.assert_close(torch.compile(fn, backend="fusionstitching")(x, s), fn(x, s))
    captured = capture(fn, x, s)
    assert any(n.op == "library" and "as_strided_scatter" in n.attrs.get("target", "") for n in captured.forward.nodes)
