"""The graph passes that run before exploration: ``split_underfilled_reductions`` (``fusion/split.py``)
and ``duplicate_broadcasts`` (``graph/transforms.py``)."""

from __future__ import annotations

import numpy as np
import pytest

from fusionstitching.cost.bandwidth import bandwidth_model
from fusionstitching.cost.gpu_spec import gpu_spec
from fusionstitching.fusion import explore
from fusionstitching.fusion.split import split_underfilled_reductions
from fusionstitching.graph import reference
from fusionstitching.graph.graph import Graph, GraphBuilder
from fusionstitching.graph.ops import DType
from fusionstitching.graph.transforms import duplicate_broadcasts

from .helpers import random_arrays


def _split(graph: Graph, device: str = "H100"):
    return split_underfilled_reductions(graph, gpu_spec(device), bandwidth_model(device))


def _reduce_graph(shape, dims, kind: str = "sum", dtype: DType = DType.F32) -> Graph:
    b = GraphBuilder("reduce")
    x = b.parameter(shape, dtype, "x")
    return b.build([b.node("reduce", [b.unary("neg", x)], dims=dims, kind=kind, name="r")])


def _reduces(graph: Graph) -> list[tuple[str, tuple[int, ...]]]:
    return [(n.name, n.shape) for n in graph.nodes if n.op == "reduce"]


def _close(graph: Graph, split: Graph, rtol: float = 1e-4, seed: int = 0) -> None:
    arrays = random_arrays(graph, seed)
    for want, got in zip(reference.evaluate(graph, arrays), reference.evaluate(split, arrays)):
        assert got.shape == want.shape and got.dtype == want.dtype
        scale = max(np.abs(want.astype(np.float64)).max(initial=0.0), 1e-30)
        np.testing.assert_allclose(got.astype(np.float64), want.astype(np.float64), rtol=rtol, atol=rtol * scale)


def test_bias_gradient_column_reduction_is_split():
    graph = _reduce_graph((4096, 768), (0,))
    split, decisions = _split(graph)
    assert [d.node for d in decisions] == ["r"]
    (decision,) = decisions
    assert decision.parts >= 2 and 4096 % decision.parts == 0
    assert decision.after_us < decision.before_us
    assert "split in" in str(decision)
    assert _reduces(split) == [("r_partial", (decision.parts, 768)), ("r", (768,))]
    assert split.outputs[0].name == "r" and split.outputs[0].shape == (768,)
    assert split.parameters == graph.parameters
    _close(graph, split)


def test_row_reduction_is_not_split():
    graph = _reduce_graph((4096, 768), (1,))
    split, decisions = _split(graph)
    assert decisions == [] and split is graph


def test_small_column_reduction_is_not_split():
    graph = _reduce_graph((16, 768), (0,))
    split, decisions = _split(graph)
    assert decisions == [] and split is graph


def test_half_column_reduction_accumulates_in_f32():
    graph = _reduce_graph((4096, 768), (0,), dtype=DType.BF16)
    split, decisions = _split(graph)
    assert len(decisions) == 1
    partial = split.node("r_partial")
    assert partial.dtype == DType.F32
    assert split.outputs[0].dtype == DType.BF16 and split.outputs[0].shape == (768,)
    _close(graph, split, rtol=1e-2)


def test_split_graph_keeps_values_with_several_reductions():
    b = GraphBuilder("two_grads")
    dy = b.parameter((4096, 768), DType.F32, "dy")
    x = b.parameter((4096, 768), DType.F32, "x")
    dbias = b.reduce(dy, (0,), "sum")
    dgamma = b.reduce(b.binary("mul", dy, x), (0,), "sum")
    rows = b.reduce(x, (1,), "max")
    graph = b.build([dbias, dgamma, rows])
    split, decisions = _split(graph)
    assert sorted(d.node for d in decisions) == sorted([dbias.name, dgamma.name])
    assert split.node(rows.name).operands[0] is split.node("x")  # the row max is untouched
    _close(graph, split, seed=3)


@pytest.mark.parametrize("rows,columns,again", [(65536, 256, True), (4096, 768, False)])
def test_the_final_sum_of_stitched_partials_is_split_again_when_it_gains(rows, columns, again):
    """A weight gradient beside a row reduction is summed per 8 rows in the row kernel; the final
    sum of 65536 / 8 partial rows into 256 columns runs alone on 8 blocks of the column template
    and is split again, once; 512 partial rows into 768 columns are not."""
    b = GraphBuilder("norm_grads")
    dy = b.parameter((rows, columns), DType.F32, "dy")
    x = b.parameter((rows, columns), DType.F32, "x")
    dgamma = b.reduce(b.binary("mul", dy, x), (0,), "sum")
    graph = b.build([dgamma, b.reduce(dy, (1,), "sum")])
    split, decisions = _split(graph, "H200")
    assert decisions[0].stitched and decisions[0].node == dgamma.name
    assert len(decisions) == (2 if again else 1), [str(d) for d in decisions]
    if again:
        assert decisions[1].node == dgamma.name and not decisions[1].stitched
        assert decisions[1].after_us < decisions[1].before_us
        assert len([n for n in split.nodes if n.op == "reduce"]) == 4  # rows, two partials, the final
    _close(graph, split, seed=4)


def test_a_reduce_alone_is_estimated_with_the_column_template_threads():
    from fusionstitching.fusion.split import ReductionSplitter, reduction_threads
    from fusionstitching.schedule.grouping import column_warps

    graph = _reduce_graph((8192, 256), (0,))
    assert column_warps(8192) == 32 and column_warps(64) == 8 and column_warps(12) == 1
    assert reduction_threads(graph.node("r")) == 256  # fused: a thread per column
    assert reduction_threads(graph.node("r"), alone=True) == 256 * 32
    narrow = _reduce_graph((8192, 40), (0,))  # 40 columns fill no warp: a thread per column
    assert reduction_threads(narrow.node("r"), alone=True) == 40
    splitter = ReductionSplitter(gpu_spec("H200"), bandwidth_model("H200"))
    for shape, split in (((8192, 256), True), ((512, 768), False), ((2048, 1024), False)):
        decision = splitter.decide(_reduce_graph(shape, (0,)).node("r"), alone=True)
        assert (decision is not None) == split, shape


# ----------------------------------------------------------------------------------------------
# duplicate_broadcasts
# ----------------------------------------------------------------------------------------------


def _users(graph: Graph, name: str) -> list[str]:
    return [u.name for u in graph.index.users[graph.node(name)]]


def _broadcast_users(graph: Graph) -> dict[str, list[str]]:
    return {n.name: _users(graph, n.name) for n in graph.nodes if n.op in ("broadcast_in_dim", "iota")}


def test_each_user_of_a_broadcast_gets_its_own_copy():
    b = GraphBuilder("shared")
    x = b.parameter((8, 32), DType.F32, "x")
    bias = b.parameter((32,), DType.F32, "bias")
    bc = b.broadcast(bias, (8, 32), (1,))
    io = b.iota((8, 32), 1, DType.F32)
    outs = [b.binary("add", x, bc), b.binary("mul", x, bc), b.binary("max", bc, bc), b.binary("sub", io, x),
            b.binary("add", io, bc)]
    graph = b.build(outs)
    assert len(_users(graph, bc.name)) == 4
    dup = duplicate_broadcasts(graph)
    users = _broadcast_users(dup)
    assert all(len(u) == 1 for u in users.values()), users
    assert sum(1 for n in dup.nodes if n.op == "broadcast_in_dim") == 4
    assert sum(1 for n in dup.nodes if n.op == "iota") == 2
    assert _users(dup, bc.name) == [outs[0].name]  # the first user keeps the original
    assert dup.parameters == graph.parameters
    assert [o.name for o in dup.outputs] == [o.name for o in graph.outputs]
    assert len(_users(graph, bc.name)) == 4  # the input graph is not modified
    arrays = random_arrays(graph)
    for want, got in zip(reference.evaluate(graph, arrays), reference.evaluate(dup, arrays)):
        np.testing.assert_array_equal(got, want)


def test_nothing_to_duplicate_returns_the_graph():
    b = GraphBuilder("single")
    x = b.parameter((8, 32), DType.F32, "x")
    bias = b.parameter((32,), DType.F32, "bias")
    graph = b.build([b.binary("add", x, b.broadcast(bias, (8, 32), (1,)))])
    assert duplicate_broadcasts(graph) is graph


def test_broadcast_that_is_an_output_stays_shared():
    b = GraphBuilder("output")
    x = b.parameter((8, 32), DType.F32, "x")
    bc = b.broadcast(b.parameter((32,), DType.F32, "bias"), (8, 32), (1,))
    graph = b.build([bc, b.binary("add", x, bc), b.binary("mul", x, bc)])
    dup = duplicate_broadcasts(graph)
    assert _users(dup, bc.name) == _users(graph, bc.name)
    assert dup.outputs[0].name == bc.name


def test_chained_broadcasts_are_duplicated_all_the_way_down():
    b = GraphBuilder("chain")
    bias = b.parameter((32,), DType.F32, "bias")
    x = b.parameter((2, 8, 32), DType.F32, "x")
    inner = b.broadcast(bias, (8, 32), (1,))
    outer = b.broadcast(inner, (2, 8, 32), (1, 2))
    graph = b.build([b.binary("add", outer, x), b.binary("mul", outer, x)])
    dup = duplicate_broadcasts(graph)
    users = _broadcast_users(dup)
    assert all(len(u) == 1 for u in users.values()), users


def test_no_kernel_writes_a_broadcast_across_a_library_call():
    b = GraphBuilder("chain_around_gemm")
    bias = b.parameter((256,), DType.F32, "bias")
    z = b.parameter((512, 256), DType.F32, "z")
    w = b.parameter((256, 256), DType.F32, "w")
    outer = b.broadcast(b.broadcast(bias, (1, 256), (1,)), (512, 256), (0, 1))
    h = b.binary("add", z, outer)
    d = b.node("dot_general", [h, w], lhs_batch=(), rhs_batch=(), lhs_contract=(1,), rhs_contract=(0,))
    graph = b.build([b.binary("mul", d, outer)])
    plan = explore(graph)
    written = [name for p in plan.patterns for name in p.nodes
               if plan.graph.node(name).op == "broadcast_in_dim"
               and any(plan.pattern_of(u.name) is not p for u in plan.graph.index.users[plan.graph.node(name)])]
    assert written == [], plan.explain()


def test_a_widening_convert_of_an_input_is_copied_per_user_and_a_narrowing_one_is_not():
    b = GraphBuilder("casts")
    x = b.parameter((8, 32), DType.BF16, "x")
    y = b.parameter((8, 32), DType.F32, "y")
    wide = b.convert(x, DType.F32)
    narrow = b.convert(y, DType.BF16)
    outs = [b.binary("mul", wide, wide), b.reduce(wide, (1,), "sum"), b.binary("add", narrow, narrow),
            b.binary("mul", narrow, x)]
    graph = b.build(outs)
    dup = duplicate_broadcasts(graph)
    assert sum(1 for n in dup.nodes if n.op == "convert" and n.dtype == DType.F32) == 2
    assert sum(1 for n in dup.nodes if n.op == "convert" and n.dtype == DType.BF16) == 1
    arrays = random_arrays(graph)
    for want, got in zip(reference.evaluate(graph, arrays), reference.evaluate(dup, arrays)):
        np.testing.assert_array_equal(got, want)


def test_a_reshape_of_a_widened_input_is_copied_per_user_with_its_convert():
    """GroupNorm's ``x.float().reshape(n, groups, -1)``: the reshape is what the statistics and the
    normalization read. Copied per user, with the convert under it, the normalization's kernel reads
    the bf16 input itself instead of an f32 copy the statistics kernel would write."""
    b = GraphBuilder("grouped")
    x = b.parameter((4, 8, 16), DType.BF16, "x")
    grouped = b.reshape(b.convert(x, DType.F32), (4, 2, 64))
    mean = b.reduce(grouped, (2,), "sum")
    graph = b.build([mean, b.binary("sub", grouped, b.broadcast(mean, (4, 2, 64), (0, 1)))])
    dup = duplicate_broadcasts(graph)
    assert sum(1 for n in dup.nodes if n.op == "convert") == 2
    assert all(len(dup.index.users[n]) == 1 for n in dup.nodes if n.op in ("convert", "reshape"))
    arrays = random_arrays(graph)
    for want, got in zip(reference.evaluate(graph, arrays), reference.evaluate(dup, arrays)):
        np.testing.assert_array_equal(got, want)
    from fusionstitching.fusion import explore

    plan = explore(graph)
    assert not [n for n in plan.graph.nodes if n.dtype == DType.F32 and n.shape == (4, 2, 64)
                and plan.pattern_of(n.name) is not None
                and any(plan.pattern_of(u.name) is not plan.pattern_of(n.name) for u in plan.graph.index.users[n])]


def test_a_widened_computed_value_and_its_centred_copy_are_recomputed_by_each_user():
    """BatchNorm under autocast: ``x = relu(a + b)`` in bf16, its statistics and normalization in
    f32 (``x.float() - mean``). Written by one kernel in f32 and read back by the variance's and
    the normalization's kernels, the centred copy moved twice the bytes of the bf16 ``x`` it comes
    from; each user now recomputes it from ``x``, and no f32 tensor of ``x``'s size crosses a kernel
    boundary. At a size where the bytes count: with 4096 rows the kernels are bound by launches and
    loop round trips, and the plans with and without the copy tie within 0.5 %."""
    from fusionstitching.fusion import explore

    rows, channels = 65536, 64
    b = GraphBuilder("batchnorm_bf16")
    a = b.parameter((rows, channels), DType.BF16, "a")
    c = b.parameter((rows, channels), DType.BF16, "c")
    summed = b.binary("add", a, c)
    x = b.binary("max", summed, b.broadcast(b.constant(0.0, DType.BF16), (rows, channels), ()))
    wide = b.convert(x, DType.F32)
    mean = b.binary("div", b.reduce(wide, (0,), "sum"),
                    b.broadcast(b.constant(float(rows), DType.F32), (channels,), ()))
    centred = b.binary("sub", wide, b.broadcast(mean, (rows, channels), (1,)))
    var = b.reduce(b.binary("mul", centred, centred), (0,), "sum")
    scale = b.unary("rsqrt", b.binary("add", var, b.broadcast(b.constant(1e-5, DType.F32), (channels,), ())))
    y = b.convert(b.binary("mul", centred, b.broadcast(scale, (rows, channels), (1,))), DType.BF16)
    graph = b.build([y, mean, var])
    assert sum(1 for n in duplicate_broadcasts(graph).nodes if n.op == "sub") == 1
    dup = duplicate_broadcasts(graph, computed=True)
    assert sum(1 for n in dup.nodes if n.op == "sub") == 2, [n.name for n in dup.nodes]
    arrays = random_arrays(graph)
    for want, got in zip(reference.evaluate(graph, arrays), reference.evaluate(dup, arrays)):
        np.testing.assert_array_equal(got, want)
    plan = explore(graph)
    crossing = [n.name for n in plan.graph.nodes if n.dtype == DType.F32 and n.shape == (rows, channels)
                and plan.pattern_of(n.name) is not None
                and any(plan.pattern_of(u.name) is not plan.pattern_of(n.name) for u in plan.graph.index.users[n])]
    assert crossing == [], plan.explain()


@pytest.mark.parametrize("computed", [True, False])
def test_a_normalization_rounded_to_its_inputs_width_is_shared_by_its_users(computed):
    """BERT's LayerNorm under autocast, ``((x.float() - mean) * rstd * w + b).to(bf16)`` with ``x`` the
    residual sum, read by the next GEMM and by the residual add after it. Recomputed by the
    residual's kernel it reads as many bytes of ``x`` as of the result, and the LayerNorm's kernel
    must write ``x``, its mean and rstd beside the result: the result is read instead. Of a graph
    input, which is in memory anyway, each reader still recomputes it (the result is never
    written)."""
    rows, cols = 256, 768
    b = GraphBuilder("layernorm_bf16")
    x = b.parameter((rows, cols), DType.BF16, "x")
    r = b.parameter((rows, cols), DType.BF16, "r")
    wide = b.convert(b.binary("add", x, r) if computed else x, DType.F32)
    n = b.broadcast(b.constant(float(cols), DType.F32), (rows,), ())
    mean = b.broadcast(b.binary("div", b.reduce(wide, (1,), "sum"), n), (rows, cols), (0,))
    centred = b.binary("sub", wide, mean)
    var = b.binary("div", b.reduce(b.binary("mul", centred, centred), (1,), "sum"), n)
    rstd = b.unary("rsqrt", b.binary("add", var, b.broadcast(b.constant(1e-5, DType.F32), (rows,), ())))
    normed = b.binary("mul", b.binary("sub", wide, mean), b.broadcast(rstd, (rows, cols), (0,)))
    y = b.convert(normed, DType.BF16)
    graph = b.build([b.unary("neg", y), b.binary("add", y, r)])
    dup = duplicate_broadcasts(graph, computed=True)
    copies = sum(1 for n in dup.nodes if n.op == "convert" and n.dtype == DType.BF16)
    assert copies == (1 if computed else 2), [n.name for n in dup.nodes]
    arrays = random_arrays(graph)
    for want, got in zip(reference.evaluate(graph, arrays), reference.evaluate(dup, arrays)):
        np.testing.assert_array_equal(got, want)


def test_a_one_hot_built_from_small_inputs_is_recomputed_by_each_user():
    """Cross-entropy's gradient one-hot ``select(iota == target, -1, 0) * weight``: [rows, vocab]
    made from [rows] inputs. Its row sum and the softmax gradient each recompute it; written once
    and read back, it was the largest tensor of a GPT-2 step's loss."""
    from fusionstitching.fusion import explore

    rows, vocab = 64, 1000
    b = GraphBuilder("one_hot")
    target = b.parameter((rows,), DType.I64, "target")
    weight = b.parameter((rows,), DType.F32, "weight")
    logits = b.parameter((rows, vocab), DType.F32, "logits")
    hit = b.compare("EQ", b.iota((rows, vocab), 1, DType.I64), b.broadcast(target, (rows, vocab), (0,)))
    one_hot = b.select(hit, b.broadcast(b.constant(-1.0, DType.F32), (rows, vocab), ()),
                       b.broadcast(b.constant(0.0, DType.F32), (rows, vocab), ()))
    grad = b.binary("mul", one_hot, b.broadcast(weight, (rows, vocab), (0,)))
    total = b.reduce(grad, (1,), "sum")
    graph = b.build([b.binary("sub", grad, b.binary("mul", b.unary("exp", logits),
                                                    b.broadcast(total, (rows, vocab), (0,))))])
    dup = duplicate_broadcasts(graph)
    assert sum(1 for n in dup.nodes if n.op == "mul" and n.shape == (rows, vocab)) == 3  # grad twice
    arrays = random_arrays(graph)
    for want, got in zip(reference.evaluate(graph, arrays), reference.evaluate(dup, arrays)):
        np.testing.assert_array_equal(got, want)
    plan = explore(graph)
    crossing = [n.name for n in plan.graph.nodes if n.shape == (rows, vocab) and plan.pattern_of(n.name) is not None
                and any(plan.pattern_of(u.name) is not plan.pattern_of(n.name) for u in plan.graph.index.users[n])]
    assert not crossing, plan.explain()


def test_the_rmsnorm_gradients_read_the_input_twice_instead_of_writing_its_f32_copy():
    """Llama's RMSNorm backward, 8192 × 4096 bf16: the input's f32 upcast feeds both the input
    gradient (row reductions) and the weight gradient (a column sum). Shared, it was an output of the
    row kernel (128 MB of f32 written and read back); copied per user, the column sum's kernel reads
    the bf16 input itself."""
    from fusionstitching.bench.workloads import rmsnorm
    from fusionstitching.frontend.torch_fx import capture
    from fusionstitching.fusion import explore

    workload = rmsnorm(batch=8192, hidden=4096, train=True)
    plan = explore(capture(workload.fn, *workload.inputs, train=True).backward)
    graph = plan.graph
    f32_outputs = [n for p in plan.patterns for n in p.nodes
                   if graph.node(n).shape == (8192, 4096) and graph.node(n).dtype == DType.F32
                   and any(u.name not in p.nodes for u in graph.index.users[graph.node(n)])]
    assert not f32_outputs, f32_outputs


def test_a_reduction_no_template_takes_whole_is_split_until_one_does():
    """BatchNorm's statistics of an NCHW tensor: 6.4 million points into 64 channels, over N, H and
    W. No template gives a thread a bounded share of the points; the pass splits it (one reduced dim
    per round) until every reduce is built into a kernel (``explore`` first reduces the innermost
    dims as rows, which avoids this case; the pass is asked directly here)."""
    from fusionstitching.schedule import feasible

    b = GraphBuilder("bn_stats")
    x = b.parameter((32, 64, 56, 56), DType.F32, "x")
    graph = b.build([b.node("reduce", [b.unary("neg", x)], dims=(0, 2, 3), kind="sum", name="r")])
    assert not feasible(graph, [graph.node("r")])
    split, decisions = split_underfilled_reductions(graph, gpu_spec("H100"), bandwidth_model("H100"))
    assert decisions
    assert all(feasible(split, [n]) for n in split.nodes if n.op == "reduce")


@pytest.mark.parametrize("dtype", [DType.F32, DType.BF16])
@pytest.mark.parametrize("kind", ["sum", "max"])
def test_a_reduce_over_strided_dims_reduces_its_contiguous_rows_first(dtype, kind):
    """BatchNorm's statistics of NCHW (dims 0, 2, 3): the innermost run (2, 3) is reduced first as
    rows, then dim 0 of the small partial; the result is the reference's, and every reduce is in a
    kernel. A reduce of the innermost dims only, or with a size-1 dim as its only other one, is left
    alone."""
    from fusionstitching.graph.transforms import reduce_in_two_steps, reduction_order

    b = GraphBuilder("bn_stats")
    x = b.parameter((4, 6, 8, 8), dtype, "x")
    graph = b.build([b.node("reduce", [b.unary("neg", x)], dims=(0, 2, 3), kind=kind, name="r")])
    rewritten, notes = reduce_in_two_steps(graph)
    assert notes == ["r: dims [2, 3] first, then [0]"]
    assert rewritten.node("r").shape == (6,) and rewritten.node("r").dtype == dtype
    assert sorted(n.attrs["dims"] for n in rewritten.nodes if n.op == "reduce") == [(0,), (2, 3)]
    _close(graph, rewritten, rtol=1e-2 if dtype == DType.BF16 else 1e-5)
    plan = explore(graph)
    # explore merges dims 2 and 3 first (``collapse_reduced_runs``)
    assert not plan.library and any(note.startswith("reduce r: dims [2") and note.endswith("first, then [0]")
                                    for note in plan.notes)
    short = GraphBuilder("short")
    y = short.parameter((4, 6, 2, 8), dtype, "y")
    assert reduction_order(short.node("reduce", [y], dims=(2, 3), kind="sum")) is None
    one = short.parameter((1, 6, 8, 8), dtype, "one")  # InstanceNorm through batch norm: N of 1
    assert reduction_order(short.node("reduce", [one], dims=(0, 2, 3), kind="sum")) is None
    narrow = short.parameter((4, 6, 2, 2), dtype, "narrow")  # 24 elements after dim 0: not a warp's
    assert reduction_order(short.node("reduce", [narrow], dims=(0, 2, 3), kind="sum")) is None


@pytest.mark.parametrize("dtype", [DType.F32, DType.BF16])
@pytest.mark.parametrize("kind", ["sum", "max"])
def test_a_reduce_with_a_short_innermost_run_reduces_its_other_dims_first(dtype, kind):
    """GroupNorm's statistics of an NHWC activation, ``[N, H * W, groups, C / groups]`` over dims
    (1, 3) with 4 channels a group: dim 1 first, a column reduction whose lanes read the 32
    contiguous channels, then the group's channels of the partial [N, groups, C / groups]."""
    from fusionstitching.graph.transforms import reduce_in_two_steps, reduction_order

    b = GraphBuilder("gn_stats")
    x = b.parameter((2, 64, 8, 4), dtype, "x")
    graph = b.build([b.node("reduce", [b.unary("neg", x)], dims=(1, 3), kind=kind, name="r")])
    assert reduction_order(graph.node("r")) == ((1,), (2,))
    rewritten, notes = reduce_in_two_steps(graph)
    assert notes == ["r: dims [1] first, then [2]"]
    assert rewritten.node("r").shape == (2, 8) and rewritten.node("r").dtype == dtype
    assert [n.attrs["dims"] for n in rewritten.nodes if n.op == "reduce"] == [(1,), (2,)]
    _close(graph, rewritten, rtol=1e-2 if dtype == DType.BF16 else 1e-5)
    plan = explore(graph)
    assert not plan.library and any("dims [1] first" in note for note in plan.notes)


# ----------------------------------------------------------------------------------------------
# A variance split with its mean: both partial sums from one read of each part
# ----------------------------------------------------------------------------------------------


def _variance_graph(rows: int = 8192, columns: int = 64) -> Graph:
    """The frontend's two-pass variance over dim 0 (``_var_mean``): the mean of the data shifted by
    its first row, then the sum of squared deviations from that mean."""
    b = GraphBuilder("variance")
    x = b.parameter((rows, columns), DType.F32, "x")
    shift = b.reshape(b.node("slice", [x], start=(0, 0), limit=(1, columns), stride=(1, 1)), (columns,))
    shifted = b.reduce(b.binary("sub", x, b.broadcast(shift, (rows, columns), (1,))), (0,), "sum")
    mean = b.binary("add", b.binary("div", shifted, b.constant(rows, DType.F32, (columns,))), shift)
    deviation = b.binary("sub", x, b.broadcast(mean, (rows, columns), (1,)))
    squares = b.reduce(b.binary("mul", deviation, deviation), (0,), "sum")
    return b.build([mean, b.binary("div", squares, b.constant(rows, DType.F32, (columns,)))])


def _variance_inputs(rows: int, columns: int) -> list[np.ndarray]:
    rng = np.random.default_rng(5)
    x = rng.standard_normal((rows, columns)) * rng.uniform(0.01, 10, columns) + rng.uniform(-1e3, 1e3, columns)
    x[:, 0] = 2.5  # equal values: mean exactly 2.5, variance exactly 0
    x[: rows // 2, 1] += 50.0  # two populations: the parts' means differ
    x[rows // 3, 2] = 1e4  # an outlier
    x[:, 3] = np.sort(x[:, 3])  # sorted: each part has its own mean
    return [x.astype(np.float32)]


def test_a_variance_is_split_with_its_mean_and_keeps_its_value():
    graph = _variance_graph()
    split, decisions = _split(graph)
    (decision,) = decisions
    squares = graph.outputs[1].operands[0].name
    assert decision.variance == squares and "around the part's mean" in str(decision)
    arrays = _variance_inputs(8192, 64)
    mean, var = reference.evaluate(split, arrays)
    x = arrays[0].astype(np.float64)
    np.testing.assert_allclose(mean, x.mean(0), rtol=1e-6, atol=1e-6 * np.abs(x).max())
    np.testing.assert_allclose(var, x.var(0), rtol=5e-6, atol=0)
    assert mean[0] == np.float32(2.5) and var[0] == 0.0
    _, unsplit = reference.evaluate(graph, arrays)  # the two passes over all rows: no more accurate
    assert np.abs(var - x.var(0)).max() <= np.abs(unsplit - x.var(0)).max()


def test_the_parts_are_read_once_for_both_partial_sums():
    graph = _variance_graph()
    plan = explore(graph)
    split = plan.graph
    x = split.node("x")
    readers = [p for p in plan.patterns if any(x in split.node(n).operands for n in p.nodes)]
    partials = [n.name for n in split.nodes if n.op == "reduce" and n.name.endswith("_partial")]
    assert len(partials) == 2
    together = [p for p in plan.patterns if set(partials) <= set(p.nodes)]
    assert len(together) == 1 and "variance" in together[0].origin
    # besides the part kernel, x is read only through slices: the parts' first rows and the shift
    users = split.index.users
    assert len(readers) > 1
    for pattern in readers:
        if pattern is together[0]:
            continue
        for name in pattern.nodes:
            node = split.node(name)
            if x not in node.operands:
                continue
            views = [node]
            while views[-1].op == "reshape":
                (user,) = users[views[-1]]
                views.append(user)
            assert views[-1].op == "slice", [v.name for v in views]


def test_no_variance_pair_without_a_shifted_sum_over_the_same_dims():
    b = GraphBuilder("squares")
    x = b.parameter((8192, 64), DType.F32, "x")
    m = b.reduce(x, (0,), "max")  # a centre that is no mean
    d = b.binary("sub", x, b.broadcast(m, (8192, 64), (1,)))
    graph = b.build([b.reduce(b.binary("mul", d, d), (0,), "sum")])
    split, decisions = _split(graph)
    assert decisions and not any(d.variance for d in decisions)
    _close(graph, split)


def test_batchnorm_training_at_a_split_size_matches_eager():
    import torch

    torch.manual_seed(0)
    module = torch.nn.BatchNorm1d(64).train()
    reference_module = torch.nn.BatchNorm1d(64).train()
    torch._dynamo.reset()
    compiled = torch.compile(module, backend="fusionstitching")
    x = (torch.randn(8192, 64) * 3 + 100).requires_grad_(True)
    x2 = x.detach().clone().requires_grad_(True)
    want, got = reference_module(x), compiled(x2)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(module.running_var, reference_module.running_var, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(module.running_mean, reference_module.running_mean, rtol=1e-5, atol=1e-5)


def test_the_part_kernel_keeps_its_column_sums_in_shared_memory_and_computes_the_variance():
    """The part kernel's second sum reads each part's mean from the shared cells the first sum's
    warps left it (``codegen/reductions.py``), not by summing the part again per point; the whole
    program, simulated, gives the graph's values."""
    import torch

    from fusionstitching.options import Options
    from fusionstitching.pipeline import compile_graph

    graph = _variance_graph(rows=4096, columns=64)
    compiled = compile_graph(graph, Options(strict=True))
    (part,) = [k for k in compiled.kernels if "part_dev" in k.cuda_source or "xr_" in k.cuda_source]
    assert "__shared__ __align__(16) float xr_" in part.cuda_source
    second = part.cuda_source.split("// group ")[2]
    assert " = xr_" in second  # the part's mean, read from the first sum's shared cells
    # the part's rows (a THREAD tile of 8, written out point by point), the block's loop over the
    # columns and the warps' fold: no sum of the part inside the rows
    assert second.count("for (") == 2
    arrays = _variance_inputs(4096, 64)
    got = compiled.run([torch.from_numpy(a) for a in arrays])
    x = arrays[0].astype(np.float64)
    np.testing.assert_allclose(got[0].numpy(), x.mean(0), rtol=1e-6, atol=1e-6 * np.abs(x).max())
    np.testing.assert_allclose(got[1].numpy(), x.var(0), rtol=5e-6, atol=0)
    assert got[1][0] == 0.0 and got[0][0] == np.float32(2.5)


@pytest.mark.parametrize("rows,columns", [(6144, 96), (4096, 40), (3000, 128)])
def test_variances_of_other_shapes_compute_their_values(rows, columns):
    """Columns that fill no whole warp (40), rows that split in parts of odd lengths (3000): the
    compiled program, simulated, gives the variance whether or not the pair was split together."""
    import torch

    from fusionstitching.options import Options
    from fusionstitching.pipeline import compile_graph

    graph = _variance_graph(rows=rows, columns=columns)
    arrays = _variance_inputs(rows, columns)
    got = compile_graph(graph, Options(strict=True)).run([torch.from_numpy(a) for a in arrays])
    x = arrays[0].astype(np.float64)
    np.testing.assert_allclose(got[0].numpy(), x.mean(0), rtol=1e-6, atol=1e-6 * np.abs(x).max())
    np.testing.assert_allclose(got[1].numpy(), x.var(0), rtol=3e-5, atol=0)
    assert got[1][0] == 0.0 and got[0][0] == np.float32(2.5)
