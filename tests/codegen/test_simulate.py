"""The lockstep simulator on hand-built kernels: values against NumPy, and every hazard it must report."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from fusionstitching.codegen import kernel_ir as K
from fusionstitching.codegen.simulate import SimulationError, describe, simulate
from fusionstitching.graph.reference import philox4x32_10

TID, BID, NTID, NBID, LANE, WARP = (K.Special(s) for s in ("tid", "bid", "ntid", "nbid", "lane", "warp"))


def c(value, dtype="i32"):
    return K.Const(value, dtype)


def b(op, x, y, dtype=None):
    return K.Binary(op, x, y, "bool" if op in K.COMPARE_OPS else (dtype or x.dtype))


def gid():
    return b("add", b("mul", BID, NTID), TID)


def kernel(body, params, threads=32, blocks=1, shared=()):
    return K.Kernel("k", tuple(params), tuple(body), threads, blocks, tuple(shared))


def buf(name, dtype, extent, **kw):
    return K.Buffer(name, dtype, extent, **kw)


# ----------------------------------------------------------------------------------------------
# Values
# ----------------------------------------------------------------------------------------------


def test_grid_stride_elementwise_with_short_tail_matches_numpy():
    n = 2 * 512 + 100  # 4 blocks x 128 threads: the last pass covers less than one block
    i = K.Var("i", "i32")
    x = K.Load("x", i, "f32")
    value = b("add", b("mul", x, c(2.5, "f32")), K.Unary("exp", x, "f32"))
    body = [K.For(i, gid(), c(n), b("mul", NBID, NTID), (K.Store("out", i, value),), kind="grid_stride")]
    k = kernel(body, [buf("x", "f32", n, readonly=True), buf("out", "f32", n)], threads=128, blocks=4)
    xs = np.random.default_rng(0).standard_normal(n).astype(np.float32)
    out = np.zeros(n + 7, dtype=np.float32)  # larger than the extent is fine
    simulate(k, {"x": xs, "out": out})
    np.testing.assert_array_equal(out[:n], xs * np.float32(2.5) + np.exp(xs))
    assert out.dtype == np.float32 and not out[n:].any()


def test_per_thread_trip_counts():
    # out[t] = sum of j for j in [t % 5, t): start and stop differ per thread
    j, acc = K.Var("j", "i32"), K.Var("acc", "i32")
    body = [
        K.Let(acc, c(0)),
        K.For(j, b("rem", TID, c(5)), TID, c(1), (K.Assign(acc, b("add", acc, j)),)),
        K.Store("out", TID, acc),
    ]
    k = kernel(body, [buf("out", "i32", 64)], threads=64)
    out = np.zeros(64, dtype=np.int32)
    simulate(k, {"out": out})
    t = np.arange(64)
    expected = [sum(range(s, e)) for s, e in zip(t % 5, t)]
    np.testing.assert_array_equal(out, expected)


def test_nested_if_predication():
    i = K.Var("i", "i32")
    even, three = b("eq", b("rem", i, c(2)), c(0)), b("eq", b("rem", i, c(3)), c(0))
    inner = K.If(three, (K.Store("out", i, c(1)),), (K.Store("out", i, c(2)),))
    body = [K.Let(i, gid()), K.If(even, (inner,), (K.Store("out", i, c(3)),))]
    k = kernel(body, [buf("out", "i32", 96)], threads=32, blocks=3)
    out = np.zeros(96, dtype=np.int32)
    simulate(k, {"out": out})
    t = np.arange(96)
    np.testing.assert_array_equal(out, np.where(t % 2 == 0, np.where(t % 3 == 0, 1, 2), 3))


def test_let_in_a_nested_scope_shadows_and_ends_with_it():
    x = K.Var("x", "i32")
    body = [
        K.Let(x, c(1)),
        K.If(b("lt", TID, c(16)), (K.Let(x, c(7)), K.Store("a", TID, x))),
        K.Store("b", TID, x),
    ]
    k = kernel(body, [buf("a", "i32", 32), buf("b", "i32", 32)])
    a, bb = np.zeros(32, np.int32), np.zeros(32, np.int32)
    simulate(k, {"a": a, "b": bb})
    assert (a[:16] == 7).all() and (bb == 1).all()


def test_f32_arithmetic_stays_f32():
    x = K.Load("x", TID, "f32")
    body = [
        K.Store("out", TID, b("add", x, c(1.0, "f32"))),
        K.Store("lit", TID, b("add", c(1e8, "f32"), c(1.0, "f32"))),
    ]
    k = kernel(body, [buf("x", "f32", 32), buf("out", "f32", 32), buf("lit", "f32", 32)])
    out, lit = np.zeros(32, np.float32), np.zeros(32, np.float32)
    simulate(k, {"x": np.full(32, 1e8, np.float32), "out": out, "lit": lit})
    assert (out == np.float32(1e8)).all() and (lit == np.float32(1e8)).all()


def test_integer_and_conversion_semantics_match_the_reference():
    a, d = K.Load("a", TID, "i32"), K.Load("d", TID, "i32")
    f = K.Load("f", TID, "f32")
    body = [
        K.Store("q", TID, b("div", a, d)),
        K.Store("r", TID, b("rem", a, d)),
        K.Store("i", TID, K.Cast(f, "i32")),
        K.Store("h", TID, K.Cast(f, "bf16")),
        K.Store("m", TID, b("max", f, c(0.0, "f32"))),
        K.Store("hi", TID, b("mulhi", K.Cast(a, "u32"), c(0x80000000, "u32"))),
    ]
    params = [buf("a", "i32", 32), buf("d", "i32", 32), buf("f", "f32", 32), buf("q", "i32", 32),
              buf("r", "i32", 32), buf("i", "i32", 32), buf("h", "bf16", 32), buf("m", "f32", 32),
              buf("hi", "u32", 32)]
    av = np.array([7, -7, 7, -2**31, 5] + [1] * 27, np.int32)
    dv = np.array([2, 2, 0, -1, 0] + [1] * 27, np.int32)
    fv = np.array([-2.7, 3e10, np.nan, -3e10, 1.00390625] + [0.5] * 27, np.float32)
    arrays = {"a": av, "d": dv, "f": fv, "q": np.zeros(32, np.int32), "r": np.zeros(32, np.int32),
              "i": np.zeros(32, np.int32), "h": np.zeros(32, ml_dtypes.bfloat16), "m": np.zeros(32, np.float32),
              "hi": np.zeros(32, np.uint32)}
    simulate(kernel(body, params), arrays)
    assert arrays["q"][:5].tolist() == [3, -3, -1, -2**31, -1]
    assert arrays["r"][:5].tolist() == [1, -1, 7, 0, 5]
    assert arrays["i"][:4].tolist() == [-2, 2**31 - 1, 0, -2**31]
    expected = fv.astype(ml_dtypes.bfloat16)  # nearest even from f32
    np.testing.assert_array_equal(arrays["h"].astype(np.float32), expected.astype(np.float32))
    assert np.isnan(arrays["m"][2]) and arrays["m"][0] == 0
    assert arrays["hi"][0] == 3 and arrays["hi"][1] == (2**32 - 7) >> 1


def test_philox_word_matches_reference():
    seed = 0x1234_5678_9ABC_DEF0
    counter = (K.Cast(gid(), "u32"), c(3, "u32"), c(11, "u32"), c(0, "u32"))
    key = (c(seed & 0xFFFFFFFF, "u32"), c(seed >> 32, "u32"))
    body = [K.Store(f"w{w}", gid(), K.Philox(counter, key, w)) for w in range(4)]
    k = kernel(body, [buf(f"w{w}", "u32", 128) for w in range(4)], threads=64, blocks=2)
    arrays = {f"w{w}": np.zeros(128, np.uint32) for w in range(4)}
    simulate(k, arrays)
    counters = np.stack([np.arange(128), np.full(128, 3), np.full(128, 11), np.zeros(128)], -1).astype(np.uint32)
    expected = philox4x32_10(counters, (seed & 0xFFFFFFFF, seed >> 32))
    for w in range(4):
        np.testing.assert_array_equal(arrays[f"w{w}"], expected[:, w])


def test_warp_reduction_with_shuffle_down_matches_sum():
    v = K.Var("v", "i32")
    body = [K.Let(v, K.Load("x", gid(), "i32"))]
    for offset in (16, 8, 4, 2, 1):
        body.append(K.Assign(v, b("add", v, K.Shuffle("down", v, c(offset), 32, "i32"))))
    warp_id = b("add", b("mul", BID, c(4)), WARP)
    body.append(K.If(b("eq", LANE, c(0)), (K.Store("out", warp_id, v),)))
    k = kernel(body, [buf("x", "i32", 256, readonly=True), buf("out", "i32", 8)], threads=128, blocks=2)
    xs = np.random.default_rng(1).integers(-1000, 1000, 256).astype(np.int32)
    out = np.zeros(8, np.int32)
    simulate(k, {"x": xs, "out": out})
    np.testing.assert_array_equal(out, xs.reshape(8, 32).sum(axis=1))


@pytest.mark.parametrize("kind, arg, width, source", [
    ("xor", 1, 32, lambda lane: lane ^ 1),
    ("idx", 3, 8, lambda lane: lane // 8 * 8 + 3),
    ("down", 2, 8, lambda lane: np.where(lane % 8 + 2 < 8, lane + 2, lane)),
])
def test_shuffle_kinds(kind, arg, width, source):
    body = [K.Store("out", TID, K.Shuffle(kind, b("mul", TID, c(10)), c(arg), width, "i32"))]
    k = kernel(body, [buf("out", "i32", 64)], threads=64)
    out = np.zeros(64, np.int32)
    simulate(k, {"out": out})
    lane = np.arange(64) % 32
    np.testing.assert_array_equal(out, (np.arange(64) - lane + source(lane)) * 10)


def test_vector_load_and_store():
    names = tuple(K.Var(f"v{i}", "f32") for i in range(4))
    index = b("mul", gid(), c(4))
    body = [K.VecLoad(names, "x", index), K.VecStore("out", index, tuple(reversed(names)))]
    params = [buf("x", "f32", 512, readonly=True, aligned=True), buf("out", "f32", 512, aligned=True)]
    xs = np.arange(512, dtype=np.float32)
    out = np.zeros(512, np.float32)
    simulate(kernel(body, params, threads=64, blocks=2), {"x": xs, "out": out})
    np.testing.assert_array_equal(out, xs.reshape(-1, 4)[:, ::-1].reshape(-1))


def test_buffers_are_checked_by_name():
    k = kernel([K.Store("out", TID, c(1.0, "f32"))], [buf("out", "f32", 32)])
    with pytest.raises(SimulationError, match="buffer out .*float32.*found float64"):
        simulate(k, {"out": np.zeros(32)})
    with pytest.raises(SimulationError, match="buffer out .*found 16"):
        simulate(k, {"out": np.zeros(16, np.float32)})
    with pytest.raises(SimulationError, match="no array given for buffer out"):
        simulate(k, {})


def test_describe_renders_a_store():
    assert describe(K.Store("out", gid(), c(1.0, "f32"))) == "store out[((bid * ntid) + tid)] = 1.0"


# ----------------------------------------------------------------------------------------------
# Hazards
# ----------------------------------------------------------------------------------------------


def test_out_of_bounds_store_names_buffer_index_and_thread():
    k = kernel([K.Store("out", gid(), c(1.0, "f32"))], [buf("out", "f32", 40)], threads=32, blocks=2)
    with pytest.raises(SimulationError, match=r"out\[40\] \(extent 40\); block 1 thread 8; in `store out"):
        simulate(k, {"out": np.zeros(64, np.float32)})


def test_out_of_bounds_index_on_an_inactive_lane_is_fine():
    i = K.Var("i", "i32")
    guarded = K.If(b("lt", i, c(40)), (K.Store("out", i, K.Load("x", i, "f32")),))
    k = kernel([K.Let(i, gid()), guarded], [buf("x", "f32", 40), buf("out", "f32", 40)], threads=32, blocks=2)
    xs, out = np.arange(40, dtype=np.float32), np.zeros(40, np.float32)
    simulate(k, {"x": xs, "out": out})
    np.testing.assert_array_equal(out, xs)


def test_select_loads_only_on_the_lanes_that_take_each_operand():
    i = K.Var("i", "i32")
    inside = b("lt", i, c(40))
    value = K.Select(inside, K.Load("x", i, "f32"), c(-1.0, "f32"), "f32")
    k = kernel([K.Let(i, gid()), K.Store("out", i, value)], [buf("x", "f32", 40), buf("out", "f32", 64)],
               threads=32, blocks=2)
    xs, out = np.arange(40, dtype=np.float32), np.zeros(64, np.float32)
    simulate(k, {"x": xs, "out": out})
    np.testing.assert_array_equal(out, np.concatenate([xs, np.full(24, -1, np.float32)]))


def test_cross_block_read_caught():
    body = [
        K.If(b("eq", BID, c(0)), (K.Store("tmp", TID, c(1.0, "f32")),)),
        K.If(b("eq", BID, c(1)), (K.Store("out", TID, K.Load("tmp", TID, "f32")),)),
    ]
    k = kernel(body, [buf("tmp", "f32", 32), buf("out", "f32", 32)], threads=32, blocks=2)
    arrays = {"tmp": np.zeros(32, np.float32), "out": np.zeros(32, np.float32)}
    with pytest.raises(SimulationError, match=r"cross-block read of tmp\[0\], written by block 0.*block 1 thread 0"):
        simulate(k, arrays)


def test_cross_block_and_intra_statement_write_conflicts_caught():
    params = [buf("out", "i32", 32)]
    one_statement = kernel([K.Store("out", TID, c(1, "i32"))], params, threads=32, blocks=2)
    with pytest.raises(SimulationError, match=r"cross-block write conflict: out\[0\] .* block 1 thread 0"):
        simulate(one_statement, {"out": np.zeros(32, np.int32)})
    in_turn = [K.If(b("eq", BID, c(blk)), (K.Store("out", TID, c(1, "i32")),)) for blk in (0, 1)]
    with pytest.raises(SimulationError, match=r"cross-block write of out\[0\], written by block 0"):
        simulate(kernel(in_turn, params, threads=32, blocks=2), {"out": np.zeros(32, np.int32)})
    same_cell = kernel([K.Store("out", c(0), TID)], [buf("out", "i32", 1)])
    with pytest.raises(SimulationError, match=r"write conflict: out\[0\] stored by two threads"):
        simulate(same_cell, {"out": np.zeros(1, np.int32)})


def _shared_rotate(with_barrier: bool) -> K.Kernel:
    neighbour = b("rem", b("add", TID, c(1)), NTID)
    body = [K.Store("sm", TID, K.Load("x", gid(), "f32"))]
    body += [K.Barrier()] if with_barrier else []
    body += [K.Store("out", gid(), K.Load("sm", neighbour, "f32"))]
    params = [buf("x", "f32", 128, readonly=True), buf("out", "f32", 128)]
    return kernel(body, params, threads=64, blocks=2, shared=[buf("sm", "f32", 64, space="shared")])


def test_shared_memory_race_caught_and_barrier_fixes_it():
    xs, out = np.arange(128, dtype=np.float32), np.zeros(128, np.float32)
    with pytest.raises(SimulationError, match=r"shared-memory race: read of sm\[1\], written by thread 1 since"):
        simulate(_shared_rotate(with_barrier=False), {"x": xs, "out": out})
    simulate(_shared_rotate(with_barrier=True), {"x": xs, "out": out})
    np.testing.assert_array_equal(out, np.roll(xs.reshape(2, 64), -1, axis=1).reshape(-1))


def test_shared_write_after_another_threads_read_caught():
    body = [
        K.Store("sm", TID, c(1.0, "f32")),
        K.Barrier(),
        K.Store("out", TID, K.Load("sm", b("xor", TID, c(1)), "f32")),
        K.Store("sm", TID, c(2.0, "f32")),  # the neighbour may not have read yet
    ]
    k = kernel(body, [buf("out", "f32", 32)], shared=[buf("sm", "f32", 32, space="shared")])
    with pytest.raises(SimulationError, match=r"shared-memory race: write of sm\[0\], read by thread 1"):
        simulate(k, {"out": np.zeros(32, np.float32)})


def test_unwritten_shared_memory_reads_as_nan():
    k = kernel([K.Store("out", TID, K.Load("sm", TID, "f32"))], [buf("out", "f32", 32)],
               shared=[buf("sm", "f32", 32, space="shared")])
    out = np.zeros(32, np.float32)
    simulate(k, {"out": out})
    assert np.isnan(out).all()


def test_barrier_in_divergent_code_caught():
    body = [K.If(b("lt", TID, c(16)), (K.Barrier(),))]
    with pytest.raises(SimulationError, match="barrier reached by 16 of 32 threads.*thread 16; in `barrier`"):
        simulate(kernel(body, []), {})


def test_partial_warp_shuffle_caught():
    shuffle = K.Shuffle("down", TID, c(1), 32, "i32")
    body = [K.If(b("lt", LANE, c(16)), (K.Store("out", TID, shuffle),))]
    with pytest.raises(SimulationError, match="shuffle reached by part of the warp"):
        simulate(kernel(body, [buf("out", "i32", 32)]), {"out": np.zeros(32, np.int32)})


def test_a_shuffle_on_the_short_circuited_side_of_or_is_caught():
    """C's || skips its right side where the left is true: a full-mask shuffle there is reached by
    part of the warp (a bool any-reduction's butterfly returned undefined values on a GPU)."""
    flag = K.Var("flag", "bool")
    body = [K.Let(flag, b("lt", LANE, c(4), "bool")),
            K.Assign(flag, b("or", flag, K.Shuffle("xor", flag, c(1), 32, "bool"), "bool")),
            K.Store("out", TID, flag)]
    with pytest.raises(SimulationError, match="shuffle reached by part of the warp"):
        simulate(kernel(body, [buf("out", "bool", 32)]), {"out": np.zeros(32, bool)})


def test_misaligned_vector_load_caught():
    names = tuple(K.Var(f"v{i}", "f32") for i in range(4))
    index = b("add", b("mul", TID, c(4)), c(1))
    body = [K.VecLoad(names, "x", index)]
    k = kernel(body, [buf("x", "f32", 256, aligned=True)])
    with pytest.raises(SimulationError, match=r"misaligned vector access x\[1\]"):
        simulate(k, {"x": np.zeros(256, np.float32)})


def test_non_positive_loop_step_caught():
    i = K.Var("i", "i32")
    k = kernel([K.For(i, c(0), c(4), c(0), ())], [])
    with pytest.raises(SimulationError, match="loop step 0 is not positive"):
        simulate(k, {})


@pytest.mark.parametrize("dtype", ["u64", "i64", "i32"])
def test_mulhi_is_the_high_half_of_the_exact_product(dtype):
    bits = 64 if dtype.endswith("64") else 32
    np_type = np.dtype(("u" if dtype[0] == "u" else "i") + str(bits // 8))
    rng = np.random.default_rng(2)
    info = np.iinfo(np_type)
    xs, ys = (rng.integers(info.min, info.max, 32, dtype=np_type, endpoint=True) for _ in range(2))
    xs[:2], ys[:2] = info.min, info.max
    body = [K.Store("out", TID, b("mulhi", K.Load("x", TID, dtype), K.Load("y", TID, dtype)))]
    k = kernel(body, [buf("x", dtype, 32), buf("y", dtype, 32), buf("out", dtype, 32)])
    out = np.zeros(32, np_type)
    simulate(k, {"x": xs, "y": ys, "out": out})
    assert out.tolist() == [(int(x) * int(y)) >> bits for x, y in zip(xs, ys)]


def test_params_given_one_array_share_their_history():
    # an in-place reversal: block 0 overwrites elements that block 1 read through the aliased input
    body = [K.Store("dst", gid(), K.Load("src", b("sub", c(63), gid()), "f32"))]
    k = kernel(body, [buf("src", "f32", 64), buf("dst", "f32", 64)], threads=32, blocks=2)
    data = np.arange(64, dtype=np.float32)
    with pytest.raises(SimulationError, match=r"cross-block write of dst\[0\], read by block 1"):
        simulate(k, {"src": data, "dst": data})
    simulate(k, {"src": data.copy(), "dst": data})
    with pytest.raises(SimulationError, match="buffers src and dst overlap at different offsets"):
        base = np.arange(70, dtype=np.float32)
        simulate(k, {"src": base[:64], "dst": base[3:67]})
    restrict = kernel(body, [buf("src", "f32", 64, readonly=True), buf("dst", "f32", 64)], threads=32, blocks=2)
    with pytest.raises(SimulationError, match=r"buffers \['src', 'dst'\] share one array"):
        simulate(restrict, {"src": data, "dst": data})
