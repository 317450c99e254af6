"""The NumPy oracle's random numbers (Philox4x32-10 known answers, layout, statistics) and library calls."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
import torch

from fusionstitching.graph.graph import GraphBuilder
from fusionstitching.graph.ops import DType
from fusionstitching.graph.reference import (
    EvaluationError,
    evaluate,
    philox4x32_10,
    resolve_library_target,
    rng_uniform,
    uniform_from_bits,
)

BF16 = ml_dtypes.bfloat16
RNG = np.random.default_rng(0)


def run(graph, *inputs):
    (out,) = evaluate(graph, list(inputs))
    return out

# ------------------------------------------------------------------------------------------
# Random numbers
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("counter, key, expected", [
    ((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
    ((0xFFFFFFFF,) * 4, (0xFFFFFFFF,) * 2, (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
    ((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0),
     (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1)),
])
def test_philox_known_answers(counter, key, expected):
    out = philox4x32_10(np.array(counter, np.uint32), key)
    assert out.dtype == np.uint32 and tuple(int(v) for v in out) == expected
    batched = philox4x32_10(np.array([[counter, counter]], np.uint32), key)
    assert batched.shape == (1, 2, 4) and tuple(int(v) for v in batched[0, 1]) == expected


def rng_graph(shape, dtype=DType.F32, stream=0):
    b = GraphBuilder()
    seed, offset = b.parameter((), DType.I64, "seed"), b.parameter((), DType.I64, "offset")
    return b.build([b.rng_uniform(seed, offset, stream, shape=shape, dtype=dtype)])


def test_rng_counter_layout():
    seed, offset, stream = -3, 2**40 + 7, 5  # negative seed: its uint64 bit pattern is the key
    out = run(rng_graph((3, 3), stream=stream), np.int64(seed), np.int64(offset))
    key_bits = seed & (2**64 - 1)
    for i, value in enumerate(out.reshape(-1)):
        counter = np.array([i // 4, stream, offset & 0xFFFFFFFF, offset >> 32], np.uint32)
        word = philox4x32_10(counter, (key_bits & 0xFFFFFFFF, key_bits >> 32))[i % 4]
        assert value == np.float32(int(word) >> 8) * np.float32(2.0**-24)


def test_rng_determinism_and_dependence():
    graph = rng_graph((1000,))
    a = run(graph, 1234, 0)
    np.testing.assert_array_equal(a, run(graph, np.int64(1234), np.int64(0)))
    assert not np.array_equal(a, run(graph, 1234, 4))
    assert not np.array_equal(a, run(graph, 1235, 0))
    assert not np.array_equal(a, run(rng_graph((1000,), stream=1), 1234, 0))
    np.testing.assert_array_equal(a, rng_uniform((1000,), 1234, 0))


def test_rng_statistics_and_dtypes():
    values = run(rng_graph((200_000,)), 7, 11)
    assert values.dtype == np.float32 and values.min() >= 0.0 and values.max() < 1.0
    assert abs(values.mean() - 0.5) < 0.005 and abs(values.var() - 1 / 12) < 0.002
    half = run(rng_graph((4, 8), DType.BF16), 7, 11)
    assert half.dtype == BF16
    np.testing.assert_array_equal(half, values[:32].reshape(4, 8).astype(BF16))
    assert uniform_from_bits(np.array([0xFFFFFFFF], np.uint32))[0] == np.float32(1 - 2.0**-24)


# ------------------------------------------------------------------------------------------
# Library nodes
# ------------------------------------------------------------------------------------------


def library_graph(target, call, out_index, in_spec, out_shape, out_dtype):
    b = GraphBuilder()
    params = [b.parameter(s, d, f"p{i}") for i, (s, d) in enumerate(in_spec)]
    node = b.node("library", params, shape=out_shape, dtype=out_dtype, target=target, call=call,
                  out_index=out_index)
    return b.build([node])


def test_library_sort_values_and_indices():
    x = RNG.normal(size=(3, 5)).astype(np.float32)
    call = {"args": [{"operand": 0}], "kwargs": {"dim": 1, "descending": True}}
    values = run(library_graph("aten.sort.default", call, 0, [(x.shape, DType.F32)], x.shape, DType.F32), x)
    indices = run(library_graph("aten.sort.default", call, 1, [(x.shape, DType.F32)], x.shape, DType.I64), x)
    np.testing.assert_array_equal(values, -np.sort(-x, axis=1))
    np.testing.assert_array_equal(np.take_along_axis(x, indices, 1), values)


def test_library_dtype_literal_nested_args_and_bf16():
    x = np.arange(6, dtype=np.float32).reshape(2, 3).astype(BF16)
    call = {"args": [{"operand": 0}, 1], "kwargs": {"dtype": {"dtype": "f64"}}}
    out = run(library_graph("aten.cumsum.default", call, -1, [((2, 3), DType.BF16)], (2, 3), DType.F64), x)
    np.testing.assert_array_equal(out, np.cumsum(x.astype(np.float64), axis=1))
    cat = {"args": [[{"operand": 0}, {"operand": 1}], 0]}
    out = run(library_graph("aten.cat.default", cat, -1, [((2, 3), DType.BF16)] * 2, (4, 3), DType.BF16), x, x)
    assert out.dtype == BF16
    np.testing.assert_array_equal(out, np.concatenate([x, x]))


def test_library_errors_name_target():
    assert resolve_library_target("aten.sort.default") is torch.ops.aten.sort.default
    with pytest.raises(EvaluationError, match="aten.no_such_op.default"):
        resolve_library_target("aten.no_such_op.default")
    graph = library_graph("aten.sort.default", {"args": [{"operand": 0}]}, 0, [((4,), DType.F32)], (4,),
                          DType.F64)
    with pytest.raises(EvaluationError, match=r"aten.sort.default returned torch.float32.*declares f64"):
        run(graph, np.zeros(4, np.float32))
