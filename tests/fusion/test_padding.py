"""``pad_unaligned_dots`` (``fusion/padding.py``): library GEMMs with a leading dimension that is not
a whole number of 16-byte vectors take operands padded by the kernels that produce them."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fusionstitching.cost.gpu_spec import gpu_spec
from fusionstitching.fusion import explore
from fusionstitching.fusion.padding import pad_unaligned_dots, unaligned_gemms
from fusionstitching.graph import reference
from fusionstitching.graph.graph import GraphBuilder
from fusionstitching.graph.ops import DType
from fusionstitching.options import Options
from fusionstitching.pipeline import compile_graph

from .helpers import random_arrays

H100 = gpu_spec("H100")
gpu_only = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _gradient_gemms(rows: int = 2048, vocab: int = 1001, hidden: int = 2048):
    """A loss gradient [rows, vocab] made by a kernel, multiplied by a weight (contracting the
    vocabulary) and, transposed, by an activation (the weight's gradient, vocab rows)."""
    b = GraphBuilder("lm_head_gradients")
    logits = b.parameter((rows, vocab), DType.BF16, "logits")
    weight = b.parameter((vocab, hidden), DType.BF16, "weight")
    hidden_in = b.parameter((rows, hidden), DType.BF16, "hidden")
    grad = b.unary("exp", logits)
    dot = {"lhs_batch": (), "rhs_batch": ()}
    d_hidden = b.node("dot_general", [grad, b.unary("neg", weight)], lhs_contract=(1,), rhs_contract=(0,), **dot)
    d_weight = b.node("dot_general", [b.transpose(grad, (1, 0)), hidden_in], lhs_contract=(1,), rhs_contract=(0,),
                      **dot)
    return b.build([d_hidden, d_weight])


def test_unaligned_gemms_take_padded_operands_that_one_kernel_writes():
    graph = _gradient_gemms()
    padded, done = pad_unaligned_dots(graph, H100, Options())
    assert len(done) == 2
    pads = [n for n in padded.nodes if n.op == "pad"]
    # the gradient is padded once, under the transpose the weight gradient reads it through
    assert sorted(p.shape for p in pads) == [(1008, 2048), (2048, 1008)]
    dots = [n for n in padded.nodes if n.op == "dot_general"]
    assert all(x.shape[-1] % 8 == 0 for d in dots for x in d.operands if x.op != "transpose")
    assert [o.shape for o in padded.outputs] == [o.shape for o in graph.outputs]
    arrays = random_arrays(graph)
    for want, got in zip(reference.evaluate(graph, arrays), reference.evaluate(padded, arrays)):
        np.testing.assert_allclose(got.astype(np.float32), want.astype(np.float32), rtol=2e-2, atol=2e-2)
    plan = explore(graph)
    assert any(note.startswith("pad ") for note in plan.notes), plan.explain()
    gradient_pad = next(p for p in plan.graph.nodes if p.op == "pad" and p.operands[0].op == "exp")
    owner = plan.pattern_of(gradient_pad.name)
    assert owner is not None and any(n == gradient_pad.operands[0].name for n in owner.nodes), plan.explain()


def test_padded_gemms_compute_what_the_graph_does():
    graph = _gradient_gemms(rows=1024, vocab=1001, hidden=1024)
    options = Options(strict=True)
    assert len(pad_unaligned_dots(graph, H100, options)[1]) == 2
    arrays = random_arrays(graph)
    compiled = compile_graph(graph, options)
    got = compiled.run([torch.from_numpy(a.astype(np.float32)).to(torch.bfloat16) for a in arrays])
    for want, out in zip(reference.evaluate(graph, arrays), got):
        np.testing.assert_allclose(out.float().numpy(), want.astype(np.float32), rtol=3e-2, atol=3e-2)


def test_a_gemm_whose_arithmetic_is_cheaper_than_the_copies_is_left_alone():
    """A weight [1001, 64] padded by a copy per call, for a GEMM of 64 rows: the copy would take
    longer than the GEMM's arithmetic."""
    b = GraphBuilder("small")
    x = b.parameter((64, 64), DType.BF16, "x")
    w = b.parameter((64, 1001), DType.BF16, "w")
    graph = b.build([b.node("dot_general", [x, w], lhs_batch=(), rhs_batch=(), lhs_contract=(1,),
                            rhs_contract=(0,))])
    padded, done = pad_unaligned_dots(graph, H100, Options(small_dot_max_flops=0))
    assert done == [] and padded is graph


def _attention(length: int = 300, heads: int = 96):
    """Scores q·kᵀ of a [heads, length, 64] query and key, and probabilities (a kernel's value) by
    the values: the first product's rows and the second's contracted dim are ``length`` long."""
    b = GraphBuilder("attention")
    q, k, v = (b.parameter((heads, length, 64), DType.BF16, name) for name in "qkv")
    dims = {"lhs_batch": (0,), "rhs_batch": (0,)}
    scores = b.node("dot_general", [q, k], lhs_contract=(2,), rhs_contract=(2,), **dims)
    context = b.node("dot_general", [b.unary("exp", scores), v], lhs_contract=(2,), rhs_contract=(1,), **dims)
    return b.build([context])


def test_unaligned_gemms_are_described_as_the_library_sees_them():
    """What the GPU times: batch, M, K, N, each operand's layout (K innermost or not) and the padded
    sizes, the same for any graph whose dots are that problem."""
    described = sorted(p.describe() for p in unaligned_gemms(_attention(), Options()))
    assert described == ["bf16->bf16 NN batch 96 m 300 k 300 n 64 padded to m 300 k 304 n 64",
                         "bf16->bf16 NT batch 96 m 300 k 64 n 300 padded to m 300 k 64 n 304"]
    assert unaligned_gemms(_attention(length=256), Options()) == []


def test_measured_times_decide_where_the_model_would_not():
    """A GEMM the model leaves alone (its arithmetic is cheaper than a copy of the weight) is padded
    when its times say the padded GEMM saves more than the copy costs; GEMMs the model pads are left
    alone when padding is measured to save nothing (f32 without TF32 on an H200)."""
    b = GraphBuilder("small")
    x = b.parameter((64, 64), DType.BF16, "x")
    w = b.parameter((64, 1001), DType.BF16, "w")
    small = b.build([b.node("dot_general", [x, w], lhs_batch=(), rhs_batch=(), lhs_contract=(1,),
                            rhs_contract=(0,))])
    options = Options(small_dot_max_flops=0)
    assert pad_unaligned_dots(small, H100, options)[1] == []
    (problem,) = unaligned_gemms(small, options)
    timed = Options(small_dot_max_flops=0, gemm_timings=((problem.describe(), 20.0, 5.0),))
    padded, done = pad_unaligned_dots(small, H100, timed)
    assert [d.measured for d in done] == [True] and 0 < done[0].copy_us < done[0].saved_us == 15.0
    assert "saves measured 15.0 us" in str(done[0])
    arrays = random_arrays(small)
    np.testing.assert_allclose(reference.evaluate(padded, arrays)[0].astype(np.float32),
                               reference.evaluate(small, arrays)[0].astype(np.float32), rtol=2e-2, atol=2e-2)
    # the copy's floor counts against a measured saving: a microsecond saved does not pay for it
    slight = Options(small_dot_max_flops=0, gemm_timings=((problem.describe(), 6.0, 5.0),))
    assert pad_unaligned_dots(small, H100, slight)[1] == []

    graph = _gradient_gemms()
    assert len(pad_unaligned_dots(graph, H100, Options())[1]) == 2
    even = tuple((p.describe(), 100.0, 100.0) for p in unaligned_gemms(graph, Options()))
    assert pad_unaligned_dots(graph, H100, Options(gemm_timings=even)) == (graph, [])
    plan = explore(graph, options=Options(gemm_timings=even))
    assert not any(n.op == "pad" for n in plan.graph.nodes)


def test_a_pad_under_a_reshape_is_written_by_the_kernel_that_computes_the_reshaped_value():
    """Attention probabilities computed over [batch, heads, L, L] and multiplied as [batch x heads,
    L, L]: the pad goes under the reshape, so the softmax kernel writes its rows padded (one kernel,
    as without padding) instead of a kernel of its own re-reading them."""
    b = GraphBuilder("softmax_by_values")
    shape = (8, 12, 300, 300)
    x = b.parameter(shape, DType.BF16, "x")
    v = b.parameter((96, 300, 64), DType.BF16, "v")
    f = b.convert(x, DType.F32)
    e = b.unary("exp", b.binary("sub", f, b.broadcast(b.reduce(f, (3,), "max"), shape, (0, 1, 2))))
    p = b.binary("div", e, b.broadcast(b.reduce(e, (3,), "sum"), shape, (0, 1, 2)))
    probs = b.reshape(b.convert(p, DType.BF16), (96, 300, 300))
    graph = b.build([b.node("dot_general", [probs, v], lhs_batch=(0,), rhs_batch=(0,), lhs_contract=(2,),
                            rhs_contract=(1,))])
    timed = Options(gemm_timings=tuple((q.describe(), 30.0, 10.0) for q in unaligned_gemms(graph, Options())))
    padded, done = pad_unaligned_dots(graph, H100, timed)
    assert len(done) == 1
    (pad,) = [n for n in padded.nodes if n.op == "pad" and n.operands[0].op != "parameter"]
    assert pad.shape == (8, 12, 300, 304) and pad.operands[0].op == "convert"
    arrays = random_arrays(graph)
    np.testing.assert_allclose(reference.evaluate(padded, arrays)[0].astype(np.float32),
                               reference.evaluate(graph, arrays)[0].astype(np.float32), rtol=2e-2, atol=2e-2)
    plan = explore(graph, options=timed)
    owner = plan.pattern_of(next(n.name for n in plan.graph.nodes if n.op == "pad" and n.shape == pad.shape))
    assert owner is not None and {"reduce", "exp"} <= {plan.graph.node(n).op for n in owner.nodes}, plan.explain()
    # and two copies: v padded, and the graph's output sliced out of the padded product
    assert plan.kernel_count == explore(graph).kernel_count + 2, plan.explain()


def test_aligned_gemms_are_left_alone_and_the_option_turns_the_pass_off():
    graph = _gradient_gemms(vocab=1024)
    assert pad_unaligned_dots(graph, H100, Options()) == (graph, [])
    plan = explore(_gradient_gemms(), options=Options(pad_gemms=False))
    assert not any(n.op == "pad" for n in plan.graph.nodes)


def test_random_dots_padded_compute_what_the_graph_does():
    """Random dots (batch dims, several contracted dims, operands read through transposes, f32 and
    bf16), every unaligned one padded (a GPU slow enough that padding always pays): the padded graph
    evaluates to the original's values."""
    import dataclasses
    import os
    import random

    seed = int(os.environ.get("PADDING_SEED") or random.randrange(1 << 30))
    print(f"padding seed: {seed}")
    rng = random.Random(seed)
    slow = dataclasses.replace(H100, peak_half_tflops=1e-9, peak_f32_tflops=1e-9)
    options = Options(small_dot_max_flops=0)
    padded_any = 0
    for case in range(40):
        dtype = rng.choice([DType.F32, DType.BF16])
        batch = [rng.choice([1, 2, 3]) for _ in range(rng.randint(0, 1))]
        contract = [rng.randint(9, 90) for _ in range(rng.randint(1, 2))]
        m, n = rng.randint(9, 90), rng.randint(9, 90)
        b = GraphBuilder(f"dot{case}")
        lhs_dims = batch + [m] + contract
        rhs_dims = batch + contract + [n]
        lhs = b.parameter(tuple(lhs_dims), dtype, "lhs")
        rhs = b.parameter(tuple(rhs_dims), dtype, "rhs")
        nb, nc = len(batch), len(contract)
        if rng.random() < 0.5:  # the lhs read through a transpose of a stored [.., K.., M] value
            order = list(range(nb)) + [nb + 1 + k for k in range(nc)] + [nb]
            stored = b.parameter(tuple(lhs_dims[d] for d in order), dtype, "stored")
            lhs = b.transpose(b.unary("neg", stored), tuple(order.index(d) for d in range(len(order))))
        dot = b.node("dot_general", [lhs, b.unary("abs", rhs)], lhs_batch=tuple(range(nb)),
                     rhs_batch=tuple(range(nb)), lhs_contract=tuple(nb + 1 + k for k in range(nc)),
                     rhs_contract=tuple(nb + k for k in range(nc)))
        graph = b.build([dot])
        padded, done = pad_unaligned_dots(graph, slow, options)
        padded_any += bool(done)
        arrays = random_arrays(graph, seed=case)
        (want,), (got,) = reference.evaluate(graph, arrays), reference.evaluate(padded, arrays)
        assert got.shape == want.shape and got.dtype == want.dtype, f"seed {seed} case {case}"
        np.testing.assert_allclose(got.astype(np.float32), want.astype(np.float32), rtol=2e-2, atol=2e-2,
                                   err_msg=f"seed {seed} case {case}")
    assert padded_any >= 10, f"seed {seed}"


def test_padding_that_would_add_more_arithmetic_than_it_saves_is_left_alone():
    """A bf16 product of 9 × 9 by 9 × 9: K and N padded to 16 would be 3.2 times the arithmetic,
    more than the slow kernel could lose, even on a GPU whose copies cost nothing next to it."""
    import dataclasses

    b = GraphBuilder("tiny")
    x = b.parameter((9, 9), DType.BF16, "x")
    w = b.parameter((9, 9), DType.BF16, "w")
    graph = b.build([b.node("dot_general", [b.unary("neg", x), b.unary("neg", w)], lhs_batch=(), rhs_batch=(),
                            lhs_contract=(1,), rhs_contract=(0,))])
    slow = dataclasses.replace(H100, peak_half_tflops=1e-9)
    assert pad_unaligned_dots(graph, slow, Options(small_dot_max_flops=0)) == (graph, [])
    b = GraphBuilder("one_dim")  # only K unaligned, 9 -> 16: 1.8 times, worth it there
    x = b.parameter((64, 9), DType.BF16, "x")
    w = b.parameter((9, 64), DType.BF16, "w")
    graph = b.build([b.node("dot_general", [b.unary("neg", x), b.unary("neg", w)], lhs_batch=(), rhs_batch=(),
                            lhs_contract=(1,), rhs_contract=(0,))])
    assert len(pad_unaligned_dots(graph, slow, Options(small_dot_max_flops=0))[1]) == 1


def _saved_logits(rows: int = 1024, hidden: int = 1024, vocab: int = 1001):
    """An LM head's logits, saved for the backward (output 1), and their row maxima (output 0)."""
    b = GraphBuilder("lm_head")
    x = b.parameter((rows, hidden), DType.BF16, "x")
    w = b.parameter((hidden, vocab), DType.BF16, "w")
    logits = b.node("dot_general", [b.unary("neg", x), b.unary("neg", w)], lhs_batch=(), rhs_batch=(),
                    lhs_contract=(1,), rhs_contract=(0,))
    return b.build([b.reduce(logits, (1,), "max"), logits])


def test_a_saved_padded_product_is_returned_as_a_view_of_the_padded_buffer():
    """The saved logits are promised the padded product's strides, come back as a view of it (no
    kernel copies 1001 of every 1008 columns out) and hold the graph's values; the kernel reading
    them reads the padded buffer."""
    from fusionstitching.fusion.padding import padded_layouts

    graph = _saved_logits()
    options = Options(strict=True)
    assert padded_layouts(graph, [], options) is graph
    assert padded_layouts(graph, [1], Options(pad_gemms=False)) is graph
    laid_out = padded_layouts(graph, [1], options)
    assert laid_out.output_layouts[0] is graph.output_layouts[0]
    assert laid_out.output_layouts[1].strides == (1008, 1)
    compiled = compile_graph(laid_out, options)
    assert compiled.plan.views.get("dot_general", "").startswith("graph output promised"), compiled.plan.explain()
    assert compiled.plan.pattern_of("dot_general") is None, compiled.plan.explain()
    arrays = random_arrays(graph)
    got = compiled.run([torch.from_numpy(a.astype(np.float32)).to(torch.bfloat16) for a in arrays])
    assert got[1].stride() == (1008, 1) and got[1].shape == (1024, 1001)
    for want, out in zip(reference.evaluate(graph, arrays), got):
        np.testing.assert_allclose(out.float().numpy(), want.astype(np.float32), rtol=3e-2, atol=3e-2)
    # without the promise the output is the kernel's contiguous copy
    plain = compile_graph(graph, options)
    assert "dot_general" not in plain.plan.views
    assert plain.run([torch.from_numpy(a.astype(np.float32)).to(torch.bfloat16) for a in arrays])[1].is_contiguous()


def test_an_empty_product_is_not_padded():
    """A dot over an empty dim, saved: ``padded_layouts`` runs before empty values are folded, and
    leaves it alone."""
    from fusionstitching.fusion.padding import padded_layouts

    b = GraphBuilder("empty")
    x, w = b.parameter((2047, 0), DType.F32, "x"), b.parameter((0, 1001), DType.F32, "w")
    graph = b.build([b.node("dot_general", [x, w], lhs_batch=(), rhs_batch=(), lhs_contract=(1,), rhs_contract=(0,))])
    assert padded_layouts(graph, [0], Options(small_dot_max_flops=0)) is graph


def test_an_output_also_returned_to_the_user_is_not_promised_padded():
    """The same product as a user output and a saved one: the user's layout is eager's, so the
    saved one shares the materialized slice and keeps its layout."""
    from fusionstitching.fusion.padding import padded_layouts
    from fusionstitching.graph.graph import Graph

    graph = _saved_logits()
    both = Graph(graph.parameters, [graph.outputs[1], graph.outputs[0], graph.outputs[1]], name="both")
    assert padded_layouts(both, [2], Options()) is both


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, gpu_only])])
def test_training_through_the_backend_saves_the_padded_logits_and_matches_eager(monkeypatch, device):
    """A bf16 LM head and cross-entropy trained through the backend (strict): the forward
    promises AOTAutograd the padded strides for the logits it saves, the backward reads them so
    (on a GPU, its kernel reads them through those strides), and loss and gradients are eager's."""
    import fusionstitching
    from fusionstitching import backend

    made = []
    init = backend._Runner.__init__
    monkeypatch.setattr(backend._Runner, "__init__", lambda self, *a, **k: init(self, *a, **k) or made.append(self))
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(1024, 1024, generator=generator).bfloat16().to(device)
    targets = torch.randint(0, 1001, (1024,), generator=generator).to(device)
    w0 = (torch.randn(1024, 1001, generator=generator) * 0.05).bfloat16().to(device)

    def loss_of(w):
        return torch.nn.functional.cross_entropy((x @ w).float(), targets)

    w_eager, w_ours = w0.clone().requires_grad_(True), w0.clone().requires_grad_(True)
    want = loss_of(w_eager)
    want.backward()
    torch._dynamo.reset()
    compiled = fusionstitching.compile(loss_of, fusionstitching.Options(strict=True))
    got = compiled(w_ours)
    got.backward()
    torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(w_ours.grad.float(), w_eager.grad.float(), rtol=2e-2, atol=2e-3)
    forward, backward = made
    assert (1008, 1) in forward.promised.values(), forward.promised
    first = forward.saved[0]
    k = next(k for k, strides in forward.promised.items() if strides == (1008, 1))
    assert backward.static.graph.parameters[k - first].layout.strides == (1008, 1)
