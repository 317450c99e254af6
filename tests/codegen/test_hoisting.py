"""Values computed before a padded read's guard (``ValueEmitter._hoisted``): a max pooling's nine
padded window reads of a BatchNorm share its per-channel scale, computed once per thread before the
guards, while every read of a padded position stays inside its guard. The kernels compile with
NVRTC and simulate like the reference, padding included."""

from __future__ import annotations

import re

import numpy as np
import pytest

from fusionstitching.codegen.generate import default_template, generate
from fusionstitching.graph import reference
from fusionstitching.graph.graph import GraphBuilder
from fusionstitching.graph.ops import DType


def _pooled_batchnorm():
    """relu((x - mean) / sqrt(var + eps)) over NHWC [2, 8, 8, 16], then a 3 × 3 max pooling of
    stride 2 with -inf padding: nine slices of the padded tensor."""
    b = GraphBuilder("pooled_bn")
    x = b.parameter((2, 8, 8, 16), DType.F32, "x")
    mean, var = b.parameter((16,), DType.F32, "mean"), b.parameter((16,), DType.F32, "var")
    def scalar(value, shape):
        return b.broadcast(b.constant(value, DType.F32), shape, ())

    scale = b.binary("div", scalar(1.0, (16,)), b.unary("sqrt", b.binary("add", var, scalar(1e-5, (16,)))))
    shape = (2, 8, 8, 16)
    centered = b.binary("sub", x, b.broadcast(mean, shape, (3,)))
    y = b.binary("max", b.binary("mul", centered, b.broadcast(scale, shape, (3,))), scalar(0.0, shape))
    padded = b.node("pad", [y], low=(0, 1, 1, 0), high=(0, 0, 0, 0), interior=(0, 0, 0, 0), value=float("-inf"))
    taps = [b.node("slice", [padded], start=(0, i, j, 0), limit=(2, 7 + i, 7 + j, 16), stride=(1, 2, 2, 1))
            for i in range(3) for j in range(3)]
    out = taps[0]
    for tap in taps[1:]:
        out = b.binary("max", out, tap)
    return b.build([out])


def test_a_pooled_batchnorm_computes_its_scale_once_and_reads_padding_inside_guards(tmp_path):
    graph = _pooled_batchnorm()
    nodes = [n for n in graph.nodes if n.op not in ("parameter",)]
    kernel = generate(graph, nodes, default_template(graph, nodes))
    source = kernel.cuda_source
    body = source[source.index("__global__"):]
    guards = body.count("if (") - body.count("sub-kernel")
    assert guards >= 9, source
    lanes = 16 // 4  # a thread's vector of channels
    assert body.count("sqrtf(") <= lanes, source  # once per channel a thread holds, not per window tap
    # every load of x (in0) sits inside a guard: after the first ``if (`` of the taps
    first_guard = body.index("if ((")
    assert all(m.start() > first_guard for m in re.finditer(r"\bin0\[", body)), source
    kernel.compile("sm_90", cache_dir=tmp_path)
    rng = np.random.default_rng(0)
    data = {"x": rng.standard_normal((2, 8, 8, 16)).astype(np.float32),
            "mean": rng.standard_normal(16).astype(np.float32), "var": rng.uniform(0.5, 2.0, 16).astype(np.float32)}
    (got,) = kernel.simulate([data[n.name] for n in kernel.lowered.pattern.inputs])
    want = reference.evaluate(graph, [data[p.name] for p in graph.parameters])[0]
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("seed", range(4))
def test_random_padded_reads_of_broadcast_values_simulate_like_the_reference(seed):
    """Pads of random low, high and interior padding on random dims of ``x * sqrt(v)`` (``v``
    broadcast along one dim), read by two slices: the hoisted square roots and every guarded read
    of ``x`` give the reference's values, and the simulator finds no access out of bounds."""
    rng = np.random.default_rng(seed)
    for _ in range(6):
        shape = tuple(int(rng.integers(2, 6)) for _ in range(3))
        along = int(rng.integers(0, 3))
        b = GraphBuilder("padded")
        x = b.parameter(shape, DType.F32, "x")
        v = b.parameter((shape[along],), DType.F32, "v")
        y = b.binary("mul", x, b.broadcast(b.unary("sqrt", v), shape, (along,)))
        low = tuple(int(rng.integers(0, 3)) if d != along else 0 for d in range(3))
        high = tuple(int(rng.integers(0, 3)) if d != along else 0 for d in range(3))
        interior = tuple(int(rng.integers(0, 2)) if d != along else 0 for d in range(3))
        padded = b.node("pad", [y], low=low, high=high, interior=interior, value=-1.0)
        size = padded.shape
        first = b.node("slice", [padded], start=(0, 0, 0), limit=size, stride=(1, 1, 1))
        second = b.node("slice", [padded], start=tuple(min(1, s - 1) for s in size), limit=size, stride=(1, 1, 1))
        cut = tuple(min(a, c) for a, c in zip(first.shape, second.shape))
        a = b.node("slice", [first], start=(0, 0, 0), limit=cut, stride=(1, 1, 1))
        c = b.node("slice", [second], start=(0, 0, 0), limit=cut, stride=(1, 1, 1))
        graph = b.build([b.binary("add", a, c)])
        nodes = [n for n in graph.nodes if n.op != "parameter"]
        kernel = generate(graph, nodes, default_template(graph, nodes))
        data = {"x": rng.standard_normal(shape).astype(np.float32),
                "v": rng.uniform(0.5, 2.0, shape[along]).astype(np.float32)}
        (got,) = kernel.simulate([data[n.name] for n in kernel.lowered.pattern.inputs])
        want = reference.evaluate(graph, [data[p.name] for p in graph.parameters])[0]
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)


def test_a_hoisted_gather_index_bound_inside_the_guard_too_closes_its_scopes():
    """A padded read of a gathered row's LayerNorm (the fuzzer's program 1851208609:144): inside the
    guard the gather binds its clamped index, then the hoist of a value outside the guard binds the
    same index in the scope around it. Each scope, when it closes, takes back what it bound once
    (the inner one restores the hoisted binding), so lowering finishes and the kernel computes what
    eager does."""
    import torch
    import torch.nn.functional as F

    import fusionstitching  # noqa: F401  (registers the backend)

    def fn(x0, x1):
        v1 = x0[x1] * x0[x1]
        return v1 * 0.5, F.pad(F.layer_norm(v1, (2,)) + 1.25, (0, 2), value=0.5)

    x0 = torch.randn(256, 2, generator=torch.Generator().manual_seed(0))
    x1 = torch.randint(0, 256, (5,), generator=torch.Generator().manual_seed(1), dtype=torch.int32)
    torch._dynamo.reset()
    compiled = torch.compile(fn, backend="fusionstitching", options={"strict": True})
    for got, want in zip(compiled(x0, x1), fn(x0, x1)):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_a_value_read_through_a_concatenation_inside_a_pad_stays_in_its_piece():
    """pad(concat([x, x * rs], rows)) with ``rs`` a per-row scale (an RMSNorm's): ``rs`` is read at
    ``row - 23`` in the second piece, which the pad's guard on the columns does not reach. Hoisting it
    before that guard took it out of the concatenation's branch too, and rows of the first piece
    read ``rs[-23]`` (found by the fuzzer); it is computed inside the piece's branch now."""
    b = GraphBuilder("pad_concat")
    x = b.parameter((23, 3), DType.F32, "x")
    rs = b.parameter((23,), DType.F32, "rs")
    scale = b.unary("rsqrt", b.binary("add", rs, b.broadcast(b.constant(1e-5, DType.F32), (23,), ())))
    joined = b.node("concatenate", [x, b.binary("mul", x, b.broadcast(scale, (23, 3), (0,)))], dimension=0)
    inner = b.node("pad", [joined], low=(0, 1), high=(1, 2), interior=(0, 0), value=0.5)
    outer = b.node("pad", [inner], low=(0, 0), high=(0, 3), interior=(0, 0), value=0.5)
    graph = b.build([b.unary("neg", outer)])
    nodes = [n for n in graph.nodes if n.op not in ("parameter", "constant")]
    kernel = generate(graph, nodes, default_template(graph, nodes))
    rng = np.random.default_rng(0)
    data = {"x": rng.standard_normal((23, 3)).astype(np.float32), "rs": rng.uniform(0.5, 2.0, 23).astype(np.float32)}
    (got,) = kernel.simulate([data[n.name] for n in kernel.lowered.pattern.inputs])  # bounds-checked reads
    want = reference.evaluate(graph, [data[p.name] for p in graph.parameters])[0]
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)


def test_no_read_of_a_padded_position_leaves_its_guard():
    """A Mamba block's backward (its sequential scan's gradient: strided pads of the state slices,
    reshaped into blocks), cut down to the pads that went wrong: two reads were computed before
    their guards and read past the end of their buffer (the simulator's out-of-bounds error; on a
    GPU, a read past an allocation). One guard's positions were constants (an unrolled copy's), so
    no index could mention them; another read's index was a guarded position rewritten by a
    reshape's index arithmetic. Now a constant position is decided when the kernel is made, and an
    index made of the registers a guarded position is made of stays inside the guard."""
    import gzip
    from pathlib import Path

    from fusionstitching.fusion import explore
    from fusionstitching.graph.serialize import from_json
    from fusionstitching.pipeline import compile_plan

    text = gzip.decompress((Path(__file__).parents[1] / "data" / "mamba_backward_pads.json.gz").read_bytes()).decode()
    graph = from_json(text)
    compiled = compile_plan(explore(graph))
    rng = np.random.default_rng(0)
    inputs = [rng.integers(0, 2, p.shape).astype(p.dtype.numpy) if not p.dtype.is_float
              else rng.standard_normal(p.shape).astype(p.dtype.numpy) for p in graph.parameters]
    for got, want in zip(compiled.run_numpy(inputs), reference.evaluate(graph, inputs)):
        want = np.asarray(want, np.float64)  # sums of products of normals: f32's rounding relative to the largest
        np.testing.assert_allclose(np.asarray(got, np.float64), want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
    pytest.importorskip("cuda.bindings.nvrtc")
    from fusionstitching.codegen.nvrtc import compile_cuda

    for kernel in compiled.kernels:
        compile_cuda(kernel.cuda_source, "sm_90")
