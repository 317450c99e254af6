"""Dims reduced together merged into one (graph/collapse.py): shapes, what forbids a merge, and
values equal to the original graph's under the reference, on random graphs with a printed seed."""

from __future__ import annotations

import random

import numpy as np

from fusionstitching.graph.collapse import collapse_reduced_runs
from fusionstitching.graph.graph import GraphBuilder, Layout
from fusionstitching.graph.ops import DType
from fusionstitching.graph.reference import evaluate


def _values(graph, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(p.shape).astype(p.dtype.numpy) for p in graph.parameters]


def _same_values(a, b, seed=0):
    inputs = _values(a, seed)
    for x, y in zip(evaluate(a, inputs), evaluate(b, inputs)):
        assert x.shape == y.shape and x.dtype == y.dtype
        np.testing.assert_allclose(y.astype(np.float64), x.astype(np.float64), rtol=1e-5, atol=1e-5)


def batchnorm_backward(shape=(2, 3, 5, 7), library_reader: bool = False):
    """The statistics of a BatchNorm backward over NCHW: sums over N, H, W of dy and dy * (x - mean),
    and dx; with ``library_reader`` a library call (a stand-in for a convolution) also reads dx."""
    b = GraphBuilder("bn")
    x, dy, mean = b.parameter(shape, DType.F32, "x"), b.parameter(shape, DType.F32, "dy"), \
        b.parameter(shape[1:2], DType.F32, "mean")
    centered = b.binary("sub", x, b.broadcast(mean, shape, (1,)))
    sum_dy = b.reduce(dy, (0, 2, 3), "sum")
    sum_dy_xmu = b.reduce(b.binary("mul", dy, centered), (0, 2, 3), "sum")
    scale = b.broadcast(sum_dy, shape, (1,))
    dx = b.binary("sub", dy, b.binary("mul", centered, scale))
    if not library_reader:
        return b.build([sum_dy, sum_dy_xmu, dx])
    reader = b.node("library", [dx], shape=shape, dtype=DType.F32, target="aten.relu.default",
                    call={"args": [{"operand": 0}]}, out_index=-1)
    return b.build([sum_dy, sum_dy_xmu, dx, reader])


def test_batchnorm_statistics_reduce_one_row_of_h_times_w():
    graph = batchnorm_backward()
    merged = collapse_reduced_runs(graph)
    reduces = [n for n in merged.nodes if n.op == "reduce"]
    assert {n.operands[0].shape for n in reduces} == {(2, 3, 35)}
    assert all(tuple(n.attrs["dims"]) == (0, 2) for n in reduces)
    assert [o.shape for o in merged.outputs] == [(3,), (3,), (2, 3, 5, 7)]
    # the inputs are read through one reshape each, the output dx reshaped back
    reshapes = [n for n in merged.nodes if n.op == "reshape"]
    assert sorted(n.operands[0].name for n in reshapes if n.operands[0].op == "parameter") == ["dy", "x"]
    assert len(reshapes) == 3
    _same_values(graph, merged)


def test_nothing_merges_without_dims_reduced_together():
    b = GraphBuilder("rows")
    x = b.parameter((2, 3, 5, 7), DType.F32, "x")
    r = b.reduce(b.unary("exp", x), (3,), "sum")
    graph = b.build([r])
    assert collapse_reduced_runs(graph) is graph


def test_a_broadcast_along_one_of_the_dims_forbids_the_merge():
    """A per-H scale ([5] broadcast along dim 2 only) cannot be read in the merged H·W dim."""
    b = GraphBuilder("per_h")
    shape = (2, 3, 5, 7)
    x, h = b.parameter(shape, DType.F32, "x"), b.parameter((5,), DType.F32, "h")
    r = b.reduce(b.binary("mul", x, b.broadcast(h, shape, (2,))), (2, 3), "sum")
    graph = b.build([r])
    assert collapse_reduced_runs(graph) is graph


def test_a_reduce_keeping_one_dim_of_the_pair_forbids_it_elsewhere():
    """The same product reduced over (2, 3) and over (3,) alone: H and W stay apart for both."""
    b = GraphBuilder("mixed")
    x = b.parameter((2, 3, 5, 7), DType.F32, "x")
    y = b.unary("exp", x)
    graph = b.build([b.reduce(y, (2, 3), "sum"), b.reduce(y, (3,), "max")])
    assert collapse_reduced_runs(graph) is graph


def test_outputs_written_in_place_or_strided_keep_their_shape():
    b = GraphBuilder("kept")
    shape = (2, 3, 5, 7)
    x = b.parameter(shape, DType.F32, "x")
    y = b.unary("exp", x)
    r = b.reduce(y, (2, 3), "sum")
    strided = Layout((105, 1, 21, 3))  # channels-last strides: H and W are not one run
    graph = b.build([r, y], output_layouts=[None, strided])
    assert collapse_reduced_runs(graph) is graph
    b = GraphBuilder("in_place")
    x = b.parameter(shape, DType.F32, "x")
    y = b.unary("exp", x)
    graph = b.build([b.reduce(y, (2, 3), "sum"), y], mutations={1: 0})
    assert collapse_reduced_runs(graph) is graph


def test_boundary_readers_get_the_original_shape():
    """A transpose (not merged itself) reads the merged value reshaped back."""
    b = GraphBuilder("boundary")
    shape = (2, 3, 4, 6)
    x = b.parameter(shape, DType.F32, "x")
    y = b.unary("exp", x)
    t = b.transpose(y, (0, 1, 3, 2))
    graph = b.build([b.reduce(y, (2, 3), "sum"), t])
    merged = collapse_reduced_runs(graph)
    transpose = next(n for n in merged.nodes if n.op == "transpose")
    assert transpose.operands[0].op == "reshape" and transpose.operands[0].shape == shape
    _same_values(graph, merged)


# ------------------------------------------------------------------------------------------
# Random graphs: elementwise ops, broadcasts of per-dim vectors, reductions over random dims
# ------------------------------------------------------------------------------------------


def _random_graph(rng: random.Random):
    rank = rng.randint(2, 5)
    shape = tuple(rng.choice([1, 1, 2, 3, 4, 5, 7]) for _ in range(rank))
    b = GraphBuilder("random")
    values = [b.parameter(shape, DType.F32, "x0")]
    outputs = []
    for k in range(rng.randint(2, 8)):
        choice = rng.random()
        if choice < 0.35:
            values.append(b.binary(rng.choice(["add", "mul", "sub", "max"]), rng.choice(values), rng.choice(values)))
        elif choice < 0.55:
            kept = sorted(rng.sample(range(rank), rng.randint(0, rank)))
            # an operand dim is the result's or 1, stretched (a per-channel [1, C, 1, 1] vector)
            source = b.parameter(tuple(shape[d] if rng.random() < 0.7 else 1 for d in kept), DType.F32, f"v{k}")
            values.append(b.broadcast(source, shape, tuple(kept)))
        elif choice < 0.65:
            values.append(b.unary("exp", b.binary("mul", rng.choice(values), b.broadcast(
                b.constant(0.1, DType.F32), shape, ()))))
        else:
            dims = sorted(rng.sample(range(rank), rng.randint(1, rank)))
            r = b.reduce(rng.choice(values), tuple(dims), rng.choice(["sum", "max"]))
            outputs.append(r)
            kept = [d for d in range(rank) if d not in dims]
            if rng.random() < 0.5:  # read back at full shape, as a norm's statistics are
                values.append(b.binary("sub", rng.choice(values), b.broadcast(r, shape, tuple(kept))))
    outputs.append(values[-1])
    if rng.random() < 0.3:
        outputs.append(b.transpose(values[-1], tuple(reversed(range(rank)))))
    return b.build(outputs)


def test_random_graphs_keep_their_values():
    seed = random.randrange(2**32)
    print(f"COLLAPSE_SEED={seed}")
    rng = random.Random(seed)
    merged_any = 0
    for case in range(300):
        graph = _random_graph(rng)
        for rows in (False, True):
            merged = collapse_reduced_runs(graph, rows=rows)
            merged_any += merged is not graph
            try:
                _same_values(graph, merged, seed=case)
            except AssertionError as err:
                raise AssertionError(f"COLLAPSE_SEED={seed} case {case} rows={rows}: {err}") from None
    assert merged_any > 0


def test_an_inner_dim_of_whole_warps_asks_for_nothing():
    """A bias gradient sums [batch, sequence, hidden] over batch and sequence: 64 tokens a sequence
    take a warp's lanes evenly, so the region keeps its shapes."""
    b = GraphBuilder("bias_grad")
    x = b.parameter((2, 64, 8), DType.F32, "x")
    graph = b.build([b.reduce(b.unary("exp", x), (0, 1), "sum")])
    assert collapse_reduced_runs(graph) is graph
    b = GraphBuilder("bias_grad_short")
    x = b.parameter((2, 56, 8), DType.F32, "x")
    graph = b.build([b.reduce(b.unary("exp", x), (0, 1), "sum")])
    merged = collapse_reduced_runs(graph)
    assert next(n for n in merged.nodes if n.op == "reduce").operands[0].shape == (112, 8)
    _same_values(graph, merged)


def test_a_run_of_three_never_mixes_a_stretched_dim_with_a_kept_one():
    """Fuzzer program 2024:77: [1, 1, 5] reduced whole and broadcast to [63, 1, 5]. Pairwise, dims
    (0, 1) are both 1 in the operand and (1, 2) are both kept, but the run of all three would
    broadcast [5] to [315]."""
    b = GraphBuilder("stretch")
    x = b.parameter((1, 1, 5), DType.F32, "x")
    y = b.parameter((63, 1, 5), DType.F32, "y")
    e = b.unary("exp", x)
    graph = b.build([b.reduce(e, (0, 1, 2), "max"), b.binary("max", y, b.broadcast(e, (63, 1, 5), (0, 1, 2)))])
    merged = collapse_reduced_runs(graph)
    broadcast = next(n for n in merged.nodes if n.op == "broadcast_in_dim")
    assert broadcast.shape == (63, 5) and broadcast.operands[0].shape == (1, 5)
    _same_values(graph, merged)


def test_rows_merge_a_row_of_whole_warps_and_new_dims_beside_a_stretched_one():
    """With ``rows`` (after graph/refine.py split GroupNorm's rows): the row [8, 64, 64] is one dim,
    and a per-row statistic [R, 1] broadcast to [R, 64, 64] merges into [R, 4096]."""
    b = GraphBuilder("rows")
    x = b.parameter((4, 8, 64, 64), DType.F32, "x")
    mean = b.parameter((4, 8, 1), DType.F32, "mean")
    e = b.unary("exp", x)
    centered = b.binary("sub", e, b.broadcast(mean, (4, 8, 64, 64), (0, 1, 2)))
    graph = b.build([b.reduce(centered, (1, 2, 3), "sum"), b.reduce(centered, (2, 3), "sum")])
    assert collapse_reduced_runs(graph) is graph
    merged = collapse_reduced_runs(graph, rows=True)
    shapes = {n.operands[0].shape for n in merged.nodes if n.op == "reduce"}
    assert shapes == {(4, 8, 4096)}, shapes
    broadcast = next(n for n in merged.nodes if n.op == "broadcast_in_dim")
    assert broadcast.shape == (4, 8, 4096) and broadcast.operands[0].shape == (4, 8, 1)
    _same_values(graph, merged)


def test_rows_never_take_two_stretched_dims_into_one():
    """[3, 1, 1] broadcast to [3, 4, 5, 6] with dims (0, 1, 3): dims 1 and 3 are stretched from 1
    with the new dim 2 between them; merging 1..3 would map two operand dims to one."""
    b = GraphBuilder("two_stretched")
    x = b.parameter((3, 4, 5, 6), DType.F32, "x")
    v = b.parameter((3, 1, 1), DType.F32, "v")
    y = b.binary("add", x, b.broadcast(v, (3, 4, 5, 6), (0, 1, 3)))
    graph = b.build([b.reduce(y, (1, 2, 3), "sum")])
    merged = collapse_reduced_runs(graph, rows=True)
    _same_values(graph, merged)
