"""torch.compile(..., backend="fusionstitching") end to end: inference, training, shapes, fallbacks.

On a CPU the plans' kernels run in the simulator; on a GPU (``-m gpu``) they are launched, at the
workloads' benchmark sizes. Outputs are compared with eager PyTorch by relative error
‖out − ref‖ / ‖ref‖; gradients that are exactly zero in theory (the key bias under softmax) are
compared with a floor of 1e-4 of the largest gradient.
"""

from __future__ import annotations

import copy
import math
import warnings

import pytest
import torch

import fusionstitching
from fusionstitching.backend import FallbackWarning, reset_stats
from fusionstitching.bench.workloads import make

gpu_only = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def relative_error(out: torch.Tensor, ref: torch.Tensor, floor: float = 0.0) -> float:
    out, ref = out.detach().double().cpu(), ref.detach().double().cpu()
    assert not torch.isnan(out).any(), "NaN in the compiled result"
    return float((out - ref).norm() / max(float(ref.norm()), floor, 1e-30))


def _as_tuple(value):
    return value if isinstance(value, tuple) else (value,)


def _inputs(workload, device: str):
    return [x.detach().clone().to(device).requires_grad_(x.requires_grad) if isinstance(x, torch.Tensor) else x
            for x in workload.inputs]


def _check_inference(name: str, device: str = "cpu", tolerance: float = 1e-5, **sizes) -> None:
    workload = make(name, **sizes)
    fn = workload.fn.to(device) if isinstance(workload.fn, torch.nn.Module) else workload.fn
    torch._dynamo.reset()
    compiled = torch.compile(fn, backend="fusionstitching")
    for seed in range(3):  # three fresh inputs, the compiled graph reused
        torch.manual_seed(seed)
        inputs = _inputs(workload, device)
        inputs = [torch.randn_like(x) if isinstance(x, torch.Tensor) and x.is_floating_point() and seed else x
                  for x in inputs]
        with torch.no_grad():
            outs, refs = _as_tuple(compiled(*inputs)), _as_tuple(fn(*inputs))
        for out, ref in zip(outs, refs):
            assert relative_error(out, ref) < tolerance, (name, seed)


def _check_training_step(name: str, device: str = "cpu", tolerance: float = 1e-4, **sizes) -> None:
    workload = make(name, **sizes)
    model = workload.fn.to(device)
    reference = copy.deepcopy(model)
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="fusionstitching")
    inputs = _inputs(workload, device)
    outs = _as_tuple(compiled(*inputs))
    refs = _as_tuple(reference(*_inputs(workload, device)))
    sum(o.float().sum() for o in outs).backward()
    sum(r.float().sum() for r in refs).backward()
    for out, ref in zip(outs, refs):
        assert relative_error(out, ref) < tolerance
    grads = [(p.grad, q.grad) for p, q in zip(model.parameters(), reference.parameters()) if q.grad is not None]
    largest = max(float(q.norm()) for _, q in grads)
    for got, want in grads:
        assert relative_error(got, want, floor=1e-4 * largest) < tolerance


@pytest.mark.parametrize("name", ["layernorm", "softmax_scale_mask", "bias_gelu", "din_attention"])
def test_inference_matches_eager_on_cpu(name):
    _check_inference(name)


def test_bert_inference_matches_eager_on_cpu():
    _check_inference("bert", tolerance=1e-4)


@pytest.mark.parametrize("name", ["mlp_train", "layernorm_train"])
def test_training_step_matches_eager_on_cpu(name):
    _check_training_step(name)


def test_bert_training_step_matches_eager_on_cpu():
    _check_training_step("bert_train")


def test_adamw_update_in_place_matches_eager_on_cpu():
    workload = make("adam_step")
    tensors = [t.detach().clone() for t in workload.inputs]
    expected = [t.detach().clone() for t in workload.inputs]
    torch._dynamo.reset()
    torch.compile(workload.fn, backend="fusionstitching")(*tensors)
    workload.fn(*expected)
    for got, want in zip(tensors, expected):
        assert relative_error(got, want) < 1e-5


def test_dropout_draws_fresh_masks_from_torchs_generator():
    from fusionstitching.bench.workloads import dropout

    workload = dropout(numel=20000, p=0.3)
    torch._dynamo.reset()
    compiled = torch.compile(workload.fn, backend="fusionstitching")
    x = torch.ones(20000)
    torch.manual_seed(0)
    first, second = compiled(x), compiled(x)
    torch.manual_seed(0)
    again = compiled(x)
    assert abs(float((first == 0).float().mean()) - 0.3) < 0.02
    assert torch.allclose(first[first != 0], torch.full_like(first[first != 0], 1 / 0.7))
    assert not torch.equal(first, second) and torch.equal(first, again)


@pytest.mark.parametrize("foreach", [False, True])
def test_a_compiled_adamw_step_matches_eager(foreach):
    """Both torch.optim implementations: per tensor, and multi-tensor (``foreach``, the default on
    GPUs), whose ``aten._foreach_*`` ops become one op per tensor, planned like the rest (no
    library call); the step counts' in-place updates, read by every thread, go through a buffer."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    reference = copy.deepcopy(model)
    data = torch.randn(8, 16)
    optimizers = [torch.optim.AdamW(m.parameters(), lr=1e-2, foreach=foreach) for m in (model, reference)]
    reset_stats()
    torch._dynamo.reset()
    step = torch.compile(optimizers[0].step, backend="fusionstitching")
    for _ in range(2):
        for m in (model, reference):
            m.zero_grad()
            m(data).square().sum().backward()
        step()
        optimizers[1].step()
    for p, q in zip(model.parameters(), reference.parameters()):
        assert relative_error(p, q) < 1e-5
    counts = fusionstitching.stats()
    assert counts["library calls"] == 0 and counts["kernels"] == 1 and counts.get("fallbacks", 0) == 0, counts


def test_bf16_autocast_inference_matches_eager():
    workload = make("bert")
    torch._dynamo.reset()
    compiled = torch.compile(workload.fn, backend="fusionstitching")
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        for out, ref in zip(compiled(*workload.inputs), workload.fn(*workload.inputs)):
            assert relative_error(out, ref) < 2e-2


def test_a_second_shape_compiles_a_specialization_and_stays_correct():
    reset_stats()
    workload = make("bert")
    torch._dynamo.reset()
    compiled = torch.compile(workload.fn, backend="fusionstitching")
    ids, mask = workload.inputs
    with torch.no_grad():
        for length in (ids.shape[1], ids.shape[1] // 2):
            shorter = (ids[:, :length].contiguous(), mask[:, :length].contiguous())
            for out, ref in zip(compiled(*shorter), workload.fn(*shorter)):
                assert relative_error(out, ref) < 1e-4
    stats = fusionstitching.stats()
    assert stats.get("fallbacks", 0) == 0 and stats["kernels"] > 0


def test_fusionstitching_compile_is_torch_compile_with_the_backend():
    workload = make("bias_gelu")
    torch._dynamo.reset()
    out = fusionstitching.compile(workload.fn, options=fusionstitching.Options(device="H200"))(*workload.inputs)
    assert relative_error(out, workload.fn(*workload.inputs)) < 1e-5


def test_a_graph_that_cannot_be_converted_falls_back_visibly():
    def fn(x):
        return torch.cumsum(x, 0).to(torch.complex64).real * 2  # complex values: no IR dtype

    reset_stats()
    torch._dynamo.reset()
    x = torch.randn(8)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = torch.compile(fn, backend="fusionstitching")(x)
    assert torch.allclose(out, fn(x))
    assert fusionstitching.stats()["fallbacks"] == 1
    assert any(issubclass(w.category, FallbackWarning) and "runs in PyTorch" in str(w.message) for w in caught)


# -- on a GPU: the kernels launched, benchmark sizes -----------------------------------------------

REAL = {"layernorm": {"batch": 16384, "hidden": 768}, "softmax_scale_mask": {"batch": 32, "heads": 12, "seq": 128},
        "bias_gelu": {"tokens": 16384, "hidden": 3072}, "din_attention": {"batch": 2048, "history": 50, "dim": 64}}


@pytest.mark.gpu
@gpu_only
@pytest.mark.parametrize("name", sorted(REAL))
def test_inference_matches_eager_on_gpu(name):
    _check_inference(name, device="cuda", **REAL[name])


@pytest.mark.gpu
@gpu_only
def test_bert_inference_matches_eager_on_gpu():
    _check_inference("bert", device="cuda", tolerance=1e-4, layers=12, hidden=768, heads=12, batch=8, seq=128,
                     vocab=30522)


@pytest.mark.gpu
@gpu_only
def test_bert_training_step_matches_eager_on_gpu():
    _check_training_step("bert_train", device="cuda", layers=12, hidden=768, heads=12, batch=8, seq=128,
                         vocab=30522)


@pytest.mark.gpu
@gpu_only
@pytest.mark.parametrize("name", ["layernorm", "softmax_scale_mask"])
def test_reduce_overhead_mode_replays_a_cuda_graph_correctly(name):
    workload = make(name, **REAL[name])
    fn = workload.fn.cuda() if isinstance(workload.fn, torch.nn.Module) else workload.fn
    torch._dynamo.reset()
    compiled = torch.compile(fn, backend="fusionstitching", mode="reduce-overhead")
    for seed in range(4):  # eager, capture, then replays with new inputs
        torch.manual_seed(seed)
        inputs = [torch.randn_like(x) if x.is_floating_point() else x for x in _inputs(workload, "cuda")]
        with torch.no_grad():
            out, ref = compiled(*inputs), fn(*inputs)
        assert relative_error(out, ref) < 1e-5, seed


def test_reduce_overhead_replays_cuda_graphs_for_as_many_specializations_as_the_limit(monkeypatch):
    """Each CUDA graph holds a memory pool: under ``mode="reduce-overhead"`` a graph's first
    ``max_specializations`` specializations are compiled to replay one, and later ones (of admitted
    shape classes) launch their kernels."""
    from fusionstitching import pipeline

    modes = []
    plain = pipeline.compile_graph

    def recorded(graph, options, mode=None, **kwargs):
        modes.append(mode)
        return plain(graph, options, mode, **kwargs)

    monkeypatch.setattr(pipeline, "compile_graph", recorded)
    torch._dynamo.reset()
    compiled = fusionstitching.compile(lambda x: x.cos() * 2, mode="reduce-overhead", dynamic=True,
                                       options={"max_specializations": 2, "strict": True})
    for rows in (9, 11, 13, 16):
        x = torch.randn(rows, 8)
        torch.testing.assert_close(compiled(x), x.cos() * 2)
    assert modes == ["reduce-overhead", "reduce-overhead", None, None]


def test_the_torch_dynamo_entry_point_names_the_backend_function():
    """``torch.compile(backend="fusionstitching")`` without importing the package goes through the
    entry point in pyproject.toml: it must name the backend function where it lives."""
    import importlib
    from pathlib import Path

    import tomllib

    project = tomllib.loads((Path(__file__).resolve().parent.parent / "pyproject.toml").read_text())
    target = project["project"]["entry-points"]["torch_dynamo_backends"]["fusionstitching"]
    module, _, name = target.partition(":")
    assert getattr(importlib.import_module(module), name) is fusionstitching.backend.fusionstitching_backend


def test_inputs_and_parameters_keep_resizable_storage():
    """A compiled call leaves its inputs' storage resizable, as eager does: FSDP2 frees its unsharded
    parameters between forward and backward by resizing their storage to 0 and back."""
    torch._dynamo.reset()
    layer = torch.nn.Sequential(torch.nn.LayerNorm(32), torch.nn.Linear(32, 32), torch.nn.GELU())
    x = torch.randn(8, 32, requires_grad=True)
    compiled = torch.compile(layer, backend="fusionstitching")
    compiled(x).sum().backward()
    for tensor in [x, *layer.parameters()]:
        storage = tensor.untyped_storage()
        assert storage.resizable()
        size = storage.nbytes()
        storage.resize_(0)
        storage.resize_(size)


def test_the_backend_enters_aotautograd_through_dynamos_wrapper():
    """TorchDynamo's DDP optimizer tells a piece that went through AOTAutograd (whose first call on
    fake tensors then returns fake outputs) by the wrapper's invocation count."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    before = counters["aot_autograd"]["total"]
    torch.compile(lambda a: (a * 2).sin(), backend="fusionstitching")(torch.randn(4))
    assert counters["aot_autograd"]["total"] == before + 1


def test_stats_report_the_seconds_of_each_compile_phase():
    """``stats()["compile seconds"]``: seconds per phase of compiling (a dict, the one value that is
    not an int); a CPU graph has no NVRTC or tuning phase, and its tracing, conversion, exploration
    and code generation took time."""
    from fusionstitching._host import PHASES

    reset_stats()
    torch._dynamo.reset()
    compiled = torch.compile(lambda x, y: torch.relu(x * y).sum(-1), backend="fusionstitching")
    x, y = torch.randn(8, 64), torch.randn(8, 64)
    assert relative_error(compiled(x, y), torch.relu(x * y).sum(-1)) < 1e-5
    stats = fusionstitching.stats()
    seconds = stats["compile seconds"]
    assert set(seconds) == set(PHASES)
    assert all(isinstance(v, float) and v >= 0 for v in seconds.values())
    for phase in ("tracing", "conversion", "exploration", "code generation"):
        assert seconds[phase] > 0, seconds
    assert seconds["nvrtc"] == 0 and seconds["tuning"] == 0
    assert all(type(v) is int for k, v in stats.items() if k != "compile seconds"), stats
    reset_stats()
    assert sum(fusionstitching.stats()["compile seconds"].values()) == 0


def _view_of_input(x):
    """An output that is a view of the input (a broadcast of a transpose of a flattening), and one
    that is computed."""
    return x.flatten(1, 2).transpose(0, 1).contiguous().unsqueeze(0).expand(2, 4, 1), x * 2


@pytest.mark.parametrize("async_compile", [False, True])
@pytest.mark.parametrize("dynamic", [False, True])
@pytest.mark.parametrize("offset", [0, 3])
def test_an_output_that_views_an_input_inside_its_storage_reads_where_eagers_view_does(dynamic, async_compile, offset):
    """Fuzz program 1809252159:274: AOTAutograd rebuilds an output that aliases an input from the
    input, with the compiled output's storage offset where the views are symbolic; a kernel's copy
    has offset 0, so an input sliced from its storage (offset 3) gave the storage's first elements.
    Every call of each configuration matches eager and aliases the input as eager's output does."""
    torch._dynamo.reset()
    compiled = fusionstitching.compile(_view_of_input, options={"strict": True, "async_compile": async_compile},
                                       dynamic=dynamic)
    for call in range(3):
        base = torch.arange(100, 108 + offset, dtype=torch.int32) + call
        x = base[offset:offset + 4].view(1, 2, 2)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            got = compiled(x)
        fusionstitching.backend.wait_for_compiles(300)
        want = _view_of_input(x)
        for g, w in zip(got, want):
            assert torch.equal(g, w), (call, g.flatten().tolist(), w.flatten().tolist())
        assert got[0].untyped_storage().data_ptr() == x.untyped_storage().data_ptr()
        assert got[0].storage_offset() == want[0].storage_offset()


def _norm_and_softmax(x, w):
    h = torch.nn.functional.layer_norm(x, x.shape[-1:], w, None, 1e-5)
    return torch.softmax(h @ h.transpose(-1, -2) / 8, dim=-1), torch.nn.functional.gelu(h) * w


def test_specializations_of_one_shape_class_keep_the_first_ones_templates():
    """Lengths 100 and 116 are one shape class (the power of two above them, 128, and the largest
    power of two dividing them, 4): the second keeps the templates the first ran, refitted to its
    sizes (``schedule.tune.refit``); 120 (divisible by 8) is another class and chooses its own.
    Every call matches eager."""
    from fusionstitching.backend import _shape_class

    w = torch.randn(64)
    assert _shape_class([torch.randn(2, 100, 64), w]) == _shape_class([torch.randn(2, 116, 64), w])
    assert _shape_class([torch.randn(2, 100, 64), w]) != _shape_class([torch.randn(2, 120, 64), w])
    assert _shape_class([torch.randn(2, 100, 64), w]) != _shape_class([torch.randn(2, 196, 64), w])
    torch._dynamo.reset()
    reset_stats()
    compiled = fusionstitching.compile(_norm_and_softmax, options={"strict": True}, dynamic=True)
    kept = []
    for length in (100, 116, 120):
        x = torch.randn(2, length, 64)
        for got, want in zip(compiled(x, w), _norm_and_softmax(x, w)):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        kept.append(fusionstitching.stats()["templates kept across shapes"])
    assert fusionstitching.stats()["compilations"] == 3
    assert kept[0] == 0 and kept[1] >= 2 and kept[2] == kept[1], kept


def _views_of_a_mutated_input(x):
    """Views of ``x`` at nonzero storage offsets, returned after ``x`` is updated in place: eager's
    outputs alias ``x`` and show the update."""
    flat = x.unbind(2)[-1].reshape(-1)  # a view where the middle dims allow it
    corner = x[1:, 2:]
    element = x[-1, -1, -1]
    x.add_(1)
    return flat, corner, element


@pytest.mark.parametrize("dynamic", [False, True])
@pytest.mark.parametrize("shape", [(1, 2, 3), (3, 4, 5), (2, 1, 7)])
def test_views_of_an_input_mutated_in_place_read_the_update_at_eagers_offset(dynamic, shape):
    """Fuzz program 1415440681:110: the graph computes such an output from the updated value, and
    AOTAutograd rebuilds it on the input from the returned tensor's size, strides and storage
    offset; the kernel's output had offset 0, so the rebuilt view read the input's first elements."""
    torch._dynamo.reset()
    compiled = fusionstitching.compile(_views_of_a_mutated_input, options={"strict": True}, dynamic=dynamic)
    for call in range(2):
        x = torch.arange(math.prod(shape), dtype=torch.int64).view(shape) * (call + 2)
        ref = x.clone()
        got, want = compiled(x), _views_of_a_mutated_input(ref)
        assert torch.equal(x, ref)
        for g, w in zip(got, want):
            assert torch.equal(g, w), (call, g.flatten().tolist(), w.flatten().tolist())
            assert g._is_view() == w._is_view() and g.storage_offset() == w.storage_offset()


def test_a_training_output_that_views_an_input_gets_eagers_gradient():
    """The same with gradients: the view output's gradient flows to the sliced input."""
    def fn(x):
        return x.t().unsqueeze(0).expand(3, -1, -1), (x * x).sum()

    torch._dynamo.reset()
    compiled = fusionstitching.compile(fn, options={"strict": True}, dynamic=True)
    for rows in (4, 6, 8):
        base = torch.randn(rows + 2, 5)
        x, ref = base[2:].clone().requires_grad_(True), base[2:].clone().requires_grad_(True)
        got, want = compiled(x[1:]), fn(ref[1:])
        torch.testing.assert_close(got[0], want[0])
        (got[0].sum() * 2 + got[1]).backward()
        (want[0].sum() * 2 + want[1]).backward()
        torch.testing.assert_close(x.grad, ref.grad)


def _views_of_an_output(x):
    """A computed output, a view of it inside its storage, and a view of that view."""
    y = x * 2 + 1
    z = y[1:].t()
    return y, z, z.unsqueeze(0)


@pytest.mark.parametrize("async_compile", [False, True])
@pytest.mark.parametrize("dynamic", [False, True])
def test_an_output_that_views_another_output_shares_its_storage_as_eagers_does(dynamic, async_compile):
    """Eager's ``y[1:].t()`` shares ``y``'s storage at offset ``y.size(1)``: an in-place update of
    ``y`` shows in it. A kernel's copy of it had the right values in storage of its own. Each call
    matches eager, in values, storage offsets, strides and aliasing, before and after ``y.add_``."""
    torch._dynamo.reset()
    compiled = fusionstitching.compile(_views_of_an_output, options={"strict": True, "async_compile": async_compile},
                                       dynamic=dynamic)
    for rows in (4, 6, 6, 8):
        x = torch.randn(rows, 3)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            got = compiled(x)
        fusionstitching.backend.wait_for_compiles(300)
        want = _views_of_an_output(x)
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w)
            assert g.stride() == w.stride() and g.storage_offset() == w.storage_offset()
            assert g.untyped_storage().data_ptr() == got[0].untyped_storage().data_ptr()
        got[0].add_(1)
        want[0].add_(1)
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w)


def test_a_training_output_that_views_another_output_gets_eagers_gradient():
    """A view of a computed training output shares its storage, and gradients through both reach
    the input as eager's do."""
    torch._dynamo.reset()
    compiled = fusionstitching.compile(_views_of_an_output, options={"strict": True})
    x = torch.randn(5, 3, requires_grad=True)
    ref = x.detach().clone().requires_grad_(True)
    got, want = compiled(x), _views_of_an_output(ref)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w)
    assert got[1].untyped_storage().data_ptr() == got[0].untyped_storage().data_ptr()
    assert got[1].storage_offset() == want[1].storage_offset()
    weights = [torch.randn(w.shape) for w in want]
    sum((g * k).sum() for g, k in zip(got, weights)).backward()
    sum((w * k).sum() for w, k in zip(want, weights)).backward()
    torch.testing.assert_close(x.grad, ref.grad)


class _Encoder(torch.nn.Module):
    """One attention layer with a padding mask, LayerNorms and a GELU MLP, and a mean-square loss."""

    def __init__(self, hidden: int = 32, heads: int = 2) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = torch.nn.Linear(hidden, 3 * hidden)
        self.out = torch.nn.Linear(hidden, hidden)
        self.norm1, self.norm2 = torch.nn.LayerNorm(hidden), torch.nn.LayerNorm(hidden)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(hidden, 2 * hidden), torch.nn.GELU(),
                                       torch.nn.Linear(2 * hidden, hidden))

    def forward(self, x: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, self.heads, h // self.heads).permute(2, 0, 3, 1, 4)
        masked = torch.arange(s)[None, :] >= lengths[:, None]
        scores = (q @ k.transpose(-1, -2)) / math.sqrt(h // self.heads)
        scores = scores.masked_fill(masked[:, None, None, :], -1e4)
        y = self.norm1(x + self.out((scores.softmax(-1) @ v).transpose(1, 2).reshape(b, s, h)))
        y = self.norm2(y + self.mlp(y))
        return y.pow(2).mean()


def test_a_training_loop_over_varying_batch_sizes_and_lengths_matches_eagers_gradients():
    """Batches of 32, 32, 32 and 17 at lengths varying per step, compiled with dynamic shapes: each
    step's loss and every gradient as eager's."""
    torch.manual_seed(0)
    model = _Encoder()
    twin = copy.deepcopy(model)
    compiled = fusionstitching.compile(twin, options={"strict": True}, dynamic=True)
    reset_stats()
    for step, (batch, length) in enumerate(((32, 24), (32, 40), (32, 17), (17, 33), (32, 24))):
        x = torch.randn(batch, length, 32)
        lengths = torch.randint(1, length + 1, (batch,))
        model.zero_grad(set_to_none=True)
        twin.zero_grad(set_to_none=True)
        want = model(x, lengths)
        want.backward()
        got = compiled(x, lengths)
        got.backward()
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6, msg=f"step {step}")
        for (name, p), q in zip(model.named_parameters(), twin.parameters()):
            torch.testing.assert_close(q.grad, p.grad, rtol=1e-4, atol=1e-6, msg=f"step {step}: {name}")
    counts = fusionstitching.stats()
    assert counts["fallbacks"] == 0 and counts["compilations"] >= 2  # a forward and a backward at least
