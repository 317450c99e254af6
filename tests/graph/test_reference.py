"""The NumPy oracle against independent computations: torch CPU, explicit loops, exact Python ints."""

from __future__ import annotations

import math
from fractions import Fraction

import ml_dtypes
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fusionstitching.graph.graph import GraphBuilder
from fusionstitching.graph.ops import DType
from fusionstitching.graph.reference import (
    EvaluationError,
    evaluate,
)

BF16 = ml_dtypes.bfloat16
RNG = np.random.default_rng(0)


def unary_graph(op, dtype, shape=(7,)):
    b = GraphBuilder(op)
    x = b.parameter(shape, dtype, "x")
    return b.build([b.unary(op, x)])


def binary_graph(op, dtype, shape=(7,)):
    b = GraphBuilder(op)
    x, y = b.parameter(shape, dtype, "x"), b.parameter(shape, dtype, "y")
    return b.build([b.binary(op, x, y)])


def one_node(op, operands_spec, **kwargs):
    """A graph of one ``op`` node over parameters ``[(shape, dtype), ...]``."""
    b = GraphBuilder(op)
    params = [b.parameter(shape, dtype, f"p{i}") for i, (shape, dtype) in enumerate(operands_spec)]
    return b.build([b.node(op, params, **kwargs)])


def run(graph, *inputs):
    (out,) = evaluate(graph, list(inputs))
    return out


# ------------------------------------------------------------------------------------------
# Elementwise ops against torch.
# ------------------------------------------------------------------------------------------

TORCH_UNARY = {
    "neg": torch.neg, "abs": torch.abs, "copy": torch.clone, "sign": torch.sign, "floor": torch.floor,
    "ceil": torch.ceil, "exp": torch.exp, "log": torch.log, "log1p": torch.log1p, "expm1": torch.expm1,
    "tanh": torch.tanh, "erf": torch.erf, "sigmoid": torch.sigmoid, "sqrt": torch.sqrt,
    "rsqrt": torch.rsqrt, "sin": torch.sin, "cos": torch.cos,
}
POSITIVE_ONLY = {"log", "sqrt", "rsqrt"}


@pytest.mark.parametrize("op", sorted(TORCH_UNARY))
@pytest.mark.parametrize("dtype, rtol", [(DType.F64, 1e-13), (DType.F32, 2e-6)])
def test_unary_float_matches_torch(op, dtype, rtol):
    x = RNG.uniform(0.1, 5.0, 64) if op in POSITIVE_ONLY else RNG.uniform(-40.0, 40.0, 64)
    x = x.astype(dtype.numpy)
    out = run(unary_graph(op, dtype, x.shape), x)
    assert out.dtype == dtype.numpy
    np.testing.assert_allclose(out, TORCH_UNARY[op](torch.from_numpy(x)).numpy(), rtol=rtol, atol=1e-30)


TORCH_BINARY = {
    "add": torch.add, "sub": torch.sub, "mul": torch.mul, "max": torch.maximum, "min": torch.minimum,
    "div": torch.div, "pow": torch.pow, "rem": torch.fmod,
}


@pytest.mark.parametrize("op", sorted(TORCH_BINARY))
@pytest.mark.parametrize("dtype, rtol", [(DType.F64, 1e-13), (DType.F32, 2e-6)])
def test_binary_float_matches_torch(op, dtype, rtol):
    x = RNG.uniform(-10, 10, 64).astype(dtype.numpy)
    y = RNG.uniform(-10, 10, 64).astype(dtype.numpy)
    if op == "pow":
        x = np.abs(x)
    out = run(binary_graph(op, dtype, x.shape), x, y)
    assert out.dtype == dtype.numpy
    expected = TORCH_BINARY[op](torch.from_numpy(x), torch.from_numpy(y)).numpy()
    np.testing.assert_allclose(out, expected, rtol=rtol, atol=1e-6 if op == "rem" else 0)


def test_max_min_propagate_nan():
    x = np.array([np.nan, 1.0, 2.0], np.float32)
    y = np.array([0.0, np.nan, 1.0], np.float32)
    np.testing.assert_array_equal(run(binary_graph("max", DType.F32, (3,)), x, y), [np.nan, np.nan, 2.0])
    np.testing.assert_array_equal(run(binary_graph("min", DType.F32, (3,)), x, y), [np.nan, np.nan, 1.0])


def test_sigmoid_is_stable_at_extremes():
    x = np.array([-1000.0, -100.0, 0.0, 100.0, 1000.0], np.float32)
    out = run(unary_graph("sigmoid", DType.F32, x.shape), x)
    assert np.all(np.isfinite(out))
    np.testing.assert_allclose(out, torch.sigmoid(torch.from_numpy(x)).numpy(), rtol=1e-6, atol=1e-38)


@pytest.mark.parametrize("dtype", [DType.F16, DType.BF16])
@pytest.mark.parametrize("op", ["add", "mul", "div", "sub"])
def test_half_binary_computes_in_f32_rounds_once(op, dtype):
    x = RNG.uniform(-4, 4, 256).astype(dtype.numpy)
    y = RNG.uniform(0.5, 4, 256).astype(dtype.numpy)
    out = run(binary_graph(op, dtype, x.shape), x, y)
    f32 = {"add": np.add, "mul": np.multiply, "div": np.divide, "sub": np.subtract}[op]
    expected = f32(x.astype(np.float32), y.astype(np.float32)).astype(dtype.numpy)
    assert out.dtype == dtype.numpy
    np.testing.assert_array_equal(out.view(np.uint16), expected.view(np.uint16))


@pytest.mark.parametrize("dtype", [DType.F16, DType.BF16])
@pytest.mark.parametrize("op", ["exp", "tanh", "sigmoid", "rsqrt"])
def test_half_unary_matches_torch_bits_within_one_ulp(op, dtype):
    x = RNG.uniform(0.1, 3, 256).astype(dtype.numpy)
    out = run(unary_graph(op, dtype, x.shape), x)
    torch_dtype = torch.float16 if dtype == DType.F16 else torch.bfloat16
    expected = TORCH_UNARY[op](torch.from_numpy(x.astype(np.float32)).to(torch_dtype)).float().numpy()
    ulps = np.abs(out.view(np.int16).astype(np.int32) - expected.astype(dtype.numpy).view(np.int16))
    assert ulps.max() <= 1


def test_f16_chain_rounds_at_every_node():
    b = GraphBuilder()
    x, y, z = (b.parameter((), DType.F16, n) for n in "xyz")
    graph = b.build([b.binary("add", b.binary("add", x, y), z)])
    tiny = np.float16(2.0**-11)  # 1 + 2**-11 is a tie: rounds to even, i.e. to 1.0
    out = run(graph, np.float16(1.0), tiny, tiny)
    assert out == np.float16(1.0)  # without rounding the inner sum it would be 1 + 2**-10


def test_f32_is_not_upcast():
    b = GraphBuilder()
    x = b.parameter((3,), DType.F32, "x")
    graph = b.build([b.reduce(x, [0], "sum"), b.unary("rsqrt", x), b.unary("sigmoid", x)])
    data = np.array([1e8, 1.0, -1e8], np.float32)
    total, rsqrt, sigmoid = evaluate(graph, [data])
    assert total.dtype == rsqrt.dtype == sigmoid.dtype == np.float32
    assert total == 0.0  # an f64 sum would give 1.0
    positive = np.array([3.0, 7.0, 11.0], np.float32)
    _, rsqrt, _ = evaluate(graph, [positive])
    np.testing.assert_array_equal(rsqrt, np.float32(1) / np.sqrt(positive))


def test_int_arithmetic_wraps():
    big = np.array([2**31 - 1, -(2**31)], np.int32)
    out = run(binary_graph("add", DType.I32, (2,)), big, np.array([1, -1], np.int32))
    np.testing.assert_array_equal(out, [-(2**31), 2**31 - 1])
    np.testing.assert_array_equal(run(unary_graph("abs", DType.I32, (2,)), big), [2**31 - 1, -(2**31)])


@pytest.mark.parametrize("dtype", [DType.I32, DType.I64])
def test_int_div_rem_truncate_like_c(dtype):
    x = np.array([7, -7, 7, -7, 0, 5, -5, 1], dtype.numpy)
    y = np.array([2, 2, -2, -2, 3, 7, 7, -1], dtype.numpy)
    div = run(binary_graph("div", dtype, x.shape), x, y)
    rem = run(binary_graph("rem", dtype, x.shape), x, y)
    tx, ty = torch.from_numpy(x), torch.from_numpy(y)
    np.testing.assert_array_equal(div, torch.div(tx, ty, rounding_mode="trunc").numpy())
    np.testing.assert_array_equal(rem, torch.fmod(tx, ty).numpy())
    assert div.dtype == rem.dtype == dtype.numpy


def test_int_div_by_zero_and_overflow_follow_xla():
    lo = np.iinfo(np.int32).min
    x = np.array([5, -5, 0, lo], np.int32)
    y = np.array([0, 0, 0, -1], np.int32)
    np.testing.assert_array_equal(run(binary_graph("div", DType.I32, (4,)), x, y), [-1, -1, -1, lo])
    np.testing.assert_array_equal(run(binary_graph("rem", DType.I32, (4,)), x, y), [5, -5, 0, 0])


def test_int64_div_is_exact():
    x = np.array([2**62 + 1, -(2**62) - 3, 2**63 - 1], np.int64)
    y = np.array([3, 7, -2], np.int64)
    div = run(binary_graph("div", DType.I64, (3,)), x, y)
    rem = run(binary_graph("rem", DType.I64, (3,)), x, y)
    assert div.tolist() == [(2**62 + 1) // 3, -((2**62 + 3) // 7), -((2**63 - 1) // 2)]
    assert rem.tolist() == [(2**62 + 1) % 3, -((2**62 + 3) % 7), 1]


def c_divmod(a: int, b: int, bits: int) -> tuple[int, int]:
    """C/XLA integer division on Python ints, wrapped to ``bits``."""
    if b == 0:
        return -1, a
    q = abs(a) // abs(b) * (1 if (a < 0) == (b < 0) else -1)
    r = a - q * b
    wrap = 1 << bits
    q = (q + wrap // 2) % wrap - wrap // 2
    return q, r


@given(st.lists(st.tuples(st.integers(-(2**63), 2**63 - 1), st.integers(-(2**63), 2**63 - 1)), min_size=1,
                max_size=20))
@settings(max_examples=60, deadline=None)
def test_int64_divmod_property(pairs):
    pairs.append((-(2**63), -1))
    x = np.array([a for a, _ in pairs], np.int64)
    y = np.array([b if i % 3 else 0 for i, (_, b) in enumerate(pairs)], np.int64)
    div = run(binary_graph("div", DType.I64, x.shape), x, y)
    rem = run(binary_graph("rem", DType.I64, x.shape), x, y)
    expected = [c_divmod(int(a), int(b), 64) for a, b in zip(x, y)]
    assert div.tolist() == [q for q, _ in expected]
    assert rem.tolist() == [r for _, r in expected]


def test_int_pow_negative_exponent():
    x = np.array([2, 1, -1, -1, 3, 0], np.int32)
    y = np.array([-1, -5, -3, -2, 3, 0], np.int32)
    np.testing.assert_array_equal(run(binary_graph("pow", DType.I32, (6,)), x, y), [0, 1, -1, 1, 27, 1])


def test_logical_and_bitwise_ops():
    a = np.array([True, True, False, False])
    b = np.array([True, False, True, False])
    for op, expected in [("and", a & b), ("or", a | b), ("xor", a ^ b)]:
        np.testing.assert_array_equal(run(binary_graph(op, DType.BOOL, (4,)), a, b), expected)
    np.testing.assert_array_equal(run(unary_graph("not", DType.BOOL, (4,)), a), ~a)
    i = np.array([0, 5, -6], np.int32)
    np.testing.assert_array_equal(run(unary_graph("not", DType.I32, (3,)), i), [-1, -6, 5])
    j = np.array([3, 3, 3], np.int32)
    np.testing.assert_array_equal(run(binary_graph("xor", DType.I32, (3,)), i, j), i ^ j)


def test_float_only_op_on_ints_names_node():
    with pytest.raises(EvaluationError, match=r"node exp \(exp\).*float"):
        run(unary_graph("exp", DType.I32, (2,)), np.array([1, 2], np.int32))


@pytest.mark.parametrize("direction, fn", [("EQ", np.equal), ("NE", np.not_equal), ("LT", np.less),
                                           ("LE", np.less_equal), ("GT", np.greater), ("GE", np.greater_equal)])
def test_compare(direction, fn):
    x = np.array([1, 2, 3, np.nan], np.float16)
    y = np.array([2, 2, 2, np.nan], np.float16)
    out = run(one_node("compare", [((4,), DType.F16)] * 2, direction=direction), x, y)
    assert out.dtype == np.bool_
    np.testing.assert_array_equal(out, fn(x, y))


def test_select():
    graph = one_node("select", [((3,), DType.BOOL), ((3,), DType.BF16), ((3,), DType.BF16)])
    out = run(graph, np.array([True, False, True]), np.ones(3, BF16), np.zeros(3, BF16))
    np.testing.assert_array_equal(out.astype(np.float32), [1, 0, 1])


# ------------------------------------------------------------------------------------------
# convert
# ------------------------------------------------------------------------------------------


def convert(x, source, target):
    b = GraphBuilder()
    p = b.parameter(np.shape(x), source, "x")
    return run(b.build([b.convert(p, target)]), x)


def test_convert_float_to_int_truncates_and_saturates():
    x = np.array([2.7, -2.7, 0.5, -0.5, 1e10, -1e10, np.nan, np.inf, -np.inf], np.float32)
    out = convert(x, DType.F32, DType.I32)
    lo, hi = np.iinfo(np.int32).min, np.iinfo(np.int32).max
    np.testing.assert_array_equal(out, [2, -2, 0, 0, hi, lo, 0, hi, lo])
    big = np.array([9.3e18, -9.3e18, 2.0**62], np.float64)
    np.testing.assert_array_equal(convert(big, DType.F64, DType.I64), [2**63 - 1, -(2**63), 2**62])
    np.testing.assert_array_equal(convert(x[:4].astype(BF16), DType.BF16, DType.I64), [2, -2, 0, 0])


def test_convert_bool():
    np.testing.assert_array_equal(convert(np.array([True, False]), DType.BOOL, DType.F16), [1.0, 0.0])
    np.testing.assert_array_equal(convert(np.array([0.0, -0.0, 0.1, np.nan]), DType.F64, DType.BOOL),
                                  [False, False, True, True])
    np.testing.assert_array_equal(convert(np.array([0, 3, -1], np.int64), DType.I64, DType.BOOL),
                                  [False, True, True])


def test_convert_rounds_once_to_half_types():
    x = np.array([1 + 2.0**-8 + 2.0**-30])  # just above a bf16 tie; through f32 it becomes the tie
    assert convert(x, DType.F64, DType.BF16).astype(np.float64)[0] == 1 + 2.0**-7
    y = np.array([1 + 2.0**-11 + 2.0**-40])
    assert convert(y, DType.F64, DType.F16).astype(np.float64)[0] == 1 + 2.0**-10
    ints = np.array([2**24 + 1, 3], np.int32)
    np.testing.assert_array_equal(convert(ints, DType.I32, DType.F32), [2.0**24, 3.0])
    np.testing.assert_array_equal(convert(np.array([7, -9], np.int64), DType.I64, DType.I32), [7, -9])


@given(st.floats(min_value=-1e38, max_value=1e38, allow_nan=False))
@settings(max_examples=200, deadline=None)
def test_f64_to_bf16_is_correctly_rounded(value):
    r = convert(np.array([value]), DType.F64, DType.BF16)
    bits = int(r.view(np.uint16)[0])
    exact = Fraction(value)
    mine = abs(exact - Fraction(float(r.astype(np.float64)[0])))
    for neighbour in (bits - 1, bits + 1):
        n = np.array([neighbour & 0xFFFF], np.uint16).view(BF16).astype(np.float64)[0]
        if math.isfinite(n):
            other = abs(exact - Fraction(float(n)))
            assert mine < other or (mine == other and bits % 2 == 0)


# ------------------------------------------------------------------------------------------
# Reductions and dot_general
# ------------------------------------------------------------------------------------------


def torch_prod(x, dim):
    for d in sorted(dim, reverse=True):  # torch.prod takes one dim at a time
        x = torch.prod(x, dim=d)
    return x


@pytest.mark.parametrize("kind, fn", [("sum", torch.sum), ("prod", torch_prod), ("max", torch.amax),
                                      ("min", torch.amin)])
@pytest.mark.parametrize("dims", [(0,), (1, 2), (0, 2), (0, 1, 2)])
def test_reduce_matches_torch(kind, fn, dims):
    x = RNG.uniform(0.5, 1.5, (3, 4, 5))
    graph = one_node("reduce", [(x.shape, DType.F64)], dims=dims, kind=kind)
    np.testing.assert_allclose(run(graph, x), fn(torch.from_numpy(x), dim=dims).numpy(), rtol=1e-12)


@pytest.mark.parametrize("dtype, identities", [
    (DType.F32, {"sum": 0.0, "prod": 1.0, "max": -np.inf, "min": np.inf}),
    (DType.I32, {"sum": 0, "prod": 1, "max": -(2**31), "min": 2**31 - 1}),
    (DType.BOOL, {"sum": False, "prod": True, "max": False, "min": True}),
])
def test_empty_reduce_gives_identity(dtype, identities):
    for kind, identity in identities.items():
        graph = one_node("reduce", [((0, 3), dtype)], dims=(0,), kind=kind)
        out = run(graph, np.zeros((0, 3), dtype.numpy))
        assert out.dtype == dtype.numpy and out.shape == (3,)
        np.testing.assert_array_equal(out, [identity] * 3)


def test_bool_reduce_is_any_all():
    x = np.array([[True, False], [True, True]])
    for kind, expected in [("sum", [True, True]), ("max", [True, True]), ("min", [False, True]),
                           ("prod", [False, True])]:
        np.testing.assert_array_equal(run(one_node("reduce", [((2, 2), DType.BOOL)], dims=(1,), kind=kind), x),
                                      expected)


@pytest.mark.parametrize("dtype", [DType.F16, DType.BF16])
def test_half_reduce_accumulates_in_f32(dtype):
    x = np.ones(3000, dtype.numpy)  # an f16 accumulator would stop at 2048
    out = run(one_node("reduce", [((3000,), dtype)], dims=(0,), kind="sum"), x)
    assert out.dtype == dtype.numpy and float(out) == float(np.float32(3000).astype(dtype.numpy))


def dot_graph(lhs_shape, rhs_shape, dtype, lb, rb, lc, rc):
    return one_node("dot_general", [(lhs_shape, dtype), (rhs_shape, dtype)], lhs_batch=lb, rhs_batch=rb,
                    lhs_contract=lc, rhs_contract=rc)


def test_dot_general_batch_and_two_contracting_dims():
    # lhs [k1=3, b=2, m=4, k2=5], rhs [k2=5, n=6, b=2, k1=3] -> [b, m, n]
    lhs, rhs = RNG.normal(size=(3, 2, 4, 5)), RNG.normal(size=(5, 6, 2, 3))
    out = run(dot_graph(lhs.shape, rhs.shape, DType.F64, (1,), (2,), (0, 3), (3, 0)), lhs, rhs)
    assert out.shape == (2, 4, 6)
    np.testing.assert_allclose(out, np.einsum("xbmy,ynbx->bmn", lhs, rhs), rtol=1e-12)


def test_dot_general_matches_torch_matmul_f32():
    lhs = RNG.normal(size=(8, 16)).astype(np.float32)
    rhs = RNG.normal(size=(16, 5)).astype(np.float32)
    out = run(dot_graph(lhs.shape, rhs.shape, DType.F32, (), (), (1,), (0,)), lhs, rhs)
    assert out.dtype == np.float32
    np.testing.assert_allclose(out, (torch.from_numpy(lhs) @ torch.from_numpy(rhs)).numpy(), rtol=1e-5, atol=1e-5)


def test_dot_general_int_and_half_accumulation():
    lhs, rhs = np.ones((1, 3000), np.float16), np.ones((3000, 1), np.float16)
    out = run(dot_graph(lhs.shape, rhs.shape, DType.F16, (), (), (1,), (0,)), lhs, rhs)
    assert out.dtype == np.float16 and float(out[0, 0]) == 3000.0
    a, b = np.arange(6, dtype=np.int64).reshape(2, 3), np.arange(6, dtype=np.int64).reshape(3, 2)
    np.testing.assert_array_equal(run(dot_graph(a.shape, b.shape, DType.I64, (), (), (1,), (0,)), a, b), a @ b)


# ------------------------------------------------------------------------------------------
# Shape ops
# ------------------------------------------------------------------------------------------


def test_broadcast_in_dim_expands_size_one_and_maps_dims():
    x = np.arange(3 * 1, dtype=np.float32).reshape(3, 1)
    graph = one_node("broadcast_in_dim", [((3, 1), DType.F32)], shape=(4, 5, 3), broadcast_dimensions=(2, 0))
    out = run(graph, x)
    expected = np.broadcast_to(x.T[:, None, :], (4, 5, 3))  # operand dim 0 -> out 2, dim 1 (size 1) -> out 0
    np.testing.assert_array_equal(out, expected)
    scalar = run(one_node("broadcast_in_dim", [((), DType.I32)], shape=(2, 2), broadcast_dimensions=()),
                 np.int32(7))
    np.testing.assert_array_equal(scalar, np.full((2, 2), 7))


def test_reshape_transpose_slice_concatenate():
    x = np.arange(24, dtype=np.int32).reshape(2, 3, 4)
    np.testing.assert_array_equal(run(one_node("reshape", [(x.shape, DType.I32)], shape=(4, 6)), x),
                                  x.reshape(4, 6))
    out = run(one_node("transpose", [(x.shape, DType.I32)], permutation=(2, 0, 1)), x)
    np.testing.assert_array_equal(out, torch.from_numpy(x).permute(2, 0, 1).numpy())
    out = run(one_node("slice", [(x.shape, DType.I32)], start=(0, 1, 0), limit=(2, 3, 4), stride=(1, 1, 3)), x)
    np.testing.assert_array_equal(out, x[:, 1:3, ::3])
    graph = one_node("concatenate", [((2, 3, 4), DType.I32), ((2, 1, 4), DType.I32)], dimension=1)
    np.testing.assert_array_equal(run(graph, x, x[:, :1]), np.concatenate([x, x[:, :1]], 1))


def pad_by_loops(x, value, low, high, interior):
    """HLO pad, one output dim at a time: output position o holds x[(o - low) / (interior + 1)]."""
    out = np.asarray(x)
    for d in range(x.ndim):
        size = low[d] + high[d] + x.shape[d] + max(x.shape[d] - 1, 0) * interior[d]
        pieces = []
        for o in range(size):
            p = o - low[d]
            if p >= 0 and p % (interior[d] + 1) == 0 and p // (interior[d] + 1) < x.shape[d]:
                pieces.append(np.take(out, [p // (interior[d] + 1)], axis=d))
            else:
                shape = list(out.shape)
                shape[d] = 1
                pieces.append(np.full(shape, value, out.dtype))
        empty_shape = list(out.shape)
        empty_shape[d] = 0
        out = np.concatenate(pieces, axis=d) if pieces else np.empty(empty_shape, out.dtype)
    return out


@pytest.mark.parametrize("low, high, interior", [
    ((-1, 2), (1, -3), (2, 1)),
    ((0, 0), (0, 0), (0, 0)),
    ((-2, -1), (-1, 0), (0, 3)),
    ((3, 1), (2, 0), (1, 0)),
])
def test_pad_negative_edges_and_interior(low, high, interior):
    x = np.arange(1, 13, dtype=np.float32).reshape(3, 4)
    graph = one_node("pad", [(x.shape, DType.F32)], low=low, high=high, interior=interior, value=-0.5)
    np.testing.assert_array_equal(run(graph, x), pad_by_loops(x, np.float32(-0.5), low, high, interior))


def test_pad_int_value():
    x = np.array([1, 2], np.int32)
    out = run(one_node("pad", [((2,), DType.I32)], low=(1,), high=(0,), interior=(1,), value=-7.0), x)
    np.testing.assert_array_equal(out, [-7, 1, -7, 2])


def test_iota():
    out = run(GraphBuilder().build([GraphBuilder().iota((2, 3), 1, DType.F16)]))
    np.testing.assert_array_equal(out, [[0, 1, 2], [0, 1, 2]])
    assert out.dtype == np.float16
    b = GraphBuilder()
    np.testing.assert_array_equal(run(b.build([b.iota((3, 2), 0, DType.I64)])), [[0, 0], [1, 1], [2, 2]])


def gather_by_loops(x, idx, axis, batch):
    out_shape = x.shape[:axis] + idx.shape[batch:] + x.shape[axis + 1:]
    out = np.empty(out_shape, x.dtype)
    n_idx = idx.ndim - batch
    for o in np.ndindex(*out_shape):
        b, pre = o[:batch], o[batch:axis]
        i, post = o[axis:axis + n_idx], o[axis + n_idx:]
        out[o] = x[b + pre + (idx[b + i],) + post]
    return out


@pytest.mark.parametrize("x_shape, idx_shape, axis, batch", [
    ((5, 3), (4,), 0, 0),               # embedding lookup
    ((2, 3, 6, 4), (2, 5, 2), 2, 1),    # batch dim, a pre dim, two index dims, a post dim
    ((2, 3, 4), (2, 3), 1, 1),          # per-batch index vector
    ((4, 5), (), 1, 0),                 # scalar index
])
def test_gather_matches_loops(x_shape, idx_shape, axis, batch):
    x = RNG.normal(size=x_shape)
    idx = RNG.integers(0, x_shape[axis], idx_shape).astype(np.int32)
    graph = one_node("gather", [(x_shape, DType.F64), (idx_shape, DType.I32)], axis=axis, batch_dims=batch)
    out = run(graph, x, idx)
    np.testing.assert_array_equal(out, gather_by_loops(x, idx, axis, batch))


def test_gather_out_of_range_names_node():
    b = GraphBuilder()
    x, idx = b.parameter((5, 3), DType.F32, "table"), b.parameter((2,), DType.I64, "ids")
    graph = b.build([b.node("gather", [x, idx], axis=0, batch_dims=0, name="lookup")])
    with pytest.raises(EvaluationError, match=r"node lookup \(gather\).*index 5 .*\[0, 5\)"):
        evaluate(graph, [np.zeros((5, 3), np.float32), np.array([1, 5])])
    with pytest.raises(EvaluationError, match="lookup"):
        evaluate(graph, [np.zeros((5, 3), np.float32), np.array([-1, 0])])


# ------------------------------------------------------------------------------------------
# Inputs and outputs
# ------------------------------------------------------------------------------------------


def test_input_validation_names_parameter():
    b = GraphBuilder()
    x, s = b.parameter((2, 3), DType.F32, "x"), b.parameter((), DType.F32, "scale")
    graph = b.build([b.binary("mul", x, b.broadcast(s, (2, 3), ()))])
    with pytest.raises(ValueError, match="takes 2 inputs, found 1"):
        evaluate(graph, [np.zeros((2, 3), np.float32)])
    with pytest.raises(ValueError, match=r"parameter 0 \(x\): expected f32\[2, 3\], found f64\[2, 3\]"):
        evaluate(graph, [np.zeros((2, 3)), np.float32(1)])
    with pytest.raises(ValueError, match=r"parameter 0 \(x\): expected f32\[2, 3\], found f32\[3, 2\]"):
        evaluate(graph, [np.zeros((3, 2), np.float32), np.float32(1)])
    with pytest.raises(ValueError, match=r"parameter 1 \(scale\): expected f32\[\], found Python bool"):
        evaluate(graph, [np.zeros((2, 3), np.float32), True])
    with pytest.raises(ValueError, match=r"parameter 0 \(x\): expected a NumPy array"):
        evaluate(graph, [[[0.0] * 3] * 2, 1.0])


def test_scalars_strided_inputs_and_output_copies():
    b = GraphBuilder()
    x, s = b.parameter((2, 3), DType.F32, "x"), b.parameter((), DType.F32, "scale")
    c = b.constant(np.arange(6).reshape(2, 3), DType.F32, (2, 3))
    graph = b.build([b.binary("mul", x, b.broadcast(s, (2, 3), ())), None, c])
    base = np.arange(12, dtype=np.float32).reshape(3, 4)
    strided = base[::1, 1:3].T[:, ::-1]  # shape (2, 3), non-contiguous
    for scale in (2.0, 2, np.float32(2.0), np.array(2.0, np.float32)):
        out, none, const = evaluate(graph, [strided, scale])
        np.testing.assert_array_equal(out, strided * 2)
        assert none is None and out.flags.c_contiguous
    const[0, 0] = 100.0
    assert evaluate(graph, [strided, 1.0])[2][0, 0] == 0.0  # the graph's constant is untouched


# ------------------------------------------------------------------------------------------
# Property: random elementwise chains against torch in f64.
# ------------------------------------------------------------------------------------------

CHAIN_UNARY = ["neg", "abs", "tanh", "sin", "cos", "sigmoid", "erf"]
CHAIN_BINARY = ["add", "sub", "mul", "max", "min"]


@st.composite
def chains(draw):
    steps = []
    for n in range(draw(st.integers(1, 10))):
        available = 2 + n
        if draw(st.booleans()):
            steps.append((draw(st.sampled_from(CHAIN_UNARY)), (draw(st.integers(0, available - 1)),)))
        else:
            args = (draw(st.integers(0, available - 1)), draw(st.integers(0, available - 1)))
            steps.append((draw(st.sampled_from(CHAIN_BINARY)), args))
    return steps


@given(chains(), st.integers(0, 2**32 - 1))
@settings(max_examples=80, deadline=None)
def test_elementwise_chains_match_torch(steps, seed):
    data = np.random.default_rng(seed).uniform(-3, 3, (2, 3, 4))
    b = GraphBuilder()
    nodes = [b.parameter((3, 4), DType.F64, "x"), b.parameter((3, 4), DType.F64, "y")]
    tensors = [torch.from_numpy(data[0]), torch.from_numpy(data[1])]
    for op, args in steps:
        torch_fn = TORCH_UNARY.get(op) or TORCH_BINARY[op]
        nodes.append(b.node(op, [nodes[a] for a in args]))
        tensors.append(torch_fn(*[tensors[a] for a in args]))
    out = run(b.build([nodes[-1]]), data[0], data[1])
    np.testing.assert_allclose(out, tensors[-1].numpy(), rtol=1e-9, atol=1e-9)
