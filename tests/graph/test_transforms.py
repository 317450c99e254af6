"""split_reduction: shapes of the partial and final reduce, values against the reference, errors."""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np
import pytest

from fusionstitching.graph.graph import GraphBuilder, Layout
from fusionstitching.graph.ops import DType
from fusionstitching.graph.reference import evaluate
from fusionstitching.graph.serialize import from_json
from fusionstitching.graph.transforms import check_indices, split_dim, split_reduction, sum_one_hots

RNG = np.random.default_rng(0)


def reduce_graph(shape, dims, kind="sum", dtype=DType.F32, name="r"):
    """x -> (x * y) -> reduce; the multiply checks that nodes before the reduce are copied too."""
    b = GraphBuilder("g")
    x, y = b.parameter(shape, dtype, "x"), b.parameter(shape, dtype, "y")
    r = b.node("reduce", [b.binary("mul", x, y)], dims=dims, kind=kind, name=name)
    return b.build([r])


def inputs_for(graph, low=0.0, high=1.0):
    values = []
    for p in graph.parameters:
        if p.dtype.is_float:
            values.append(RNG.uniform(low, high, p.shape).astype(p.dtype.numpy))
        else:
            values.append(RNG.integers(-1000, 1000, p.shape).astype(p.dtype.numpy))
    return values


def compare(original, split, rtol, low=0.0, high=1.0):
    inputs = inputs_for(original, low, high)
    expected, found = evaluate(original, inputs), evaluate(split, inputs)
    assert len(expected) == len(found)
    for e, f in zip(expected, found):
        if e is None:
            assert f is None
            continue
        assert f.dtype == e.dtype and f.shape == e.shape
        if rtol == 0:
            np.testing.assert_array_equal(f, e)
        else:
            np.testing.assert_allclose(f.astype(np.float64), e.astype(np.float64), rtol=rtol, atol=0)


def ops(graph):
    return [(n.op, n.name, n.shape, n.dtype) for n in graph.nodes if n.op in ("reshape", "reduce", "convert")]


# ------------------------------------------------------------------------------------------
# Shapes: partial = kept dims before d + (parts,) + kept dims after d.
# ------------------------------------------------------------------------------------------


def test_bias_gradient_column_sum():
    graph = reduce_graph((4096, 768), (0,), name="db")
    split = split_reduction(graph, "db", 32)
    assert ops(split) == [
        ("reshape", "db_split", (32, 128, 768), DType.F32),
        ("reduce", "db_partial", (32, 768), DType.F32),
        ("reduce", "db", (768,), DType.F32),
    ]
    assert split.node("db_partial").attrs["dims"] == (1,)
    assert split.node("db").attrs["dims"] == (0,)
    assert split.outputs[0].name == "db"
    compare(graph, split, rtol=1e-5)


def test_row_reduction_puts_parts_last():
    graph = reduce_graph((64, 1024), (1,))
    split = split_reduction(graph, "r", 8)
    assert split.node("r_split").shape == (64, 8, 128)
    assert split.node("r_partial").shape == (64, 8)
    assert split.node("r_partial").attrs["dims"] == (2,)
    assert split.node("r").attrs["dims"] == (1,) and split.node("r").shape == (64,)
    compare(graph, split, rtol=1e-5)


def test_multi_dim_reduction_splits_the_largest_dim():
    graph = reduce_graph((16, 6, 64), (0, 2))
    split = split_reduction(graph, graph.outputs[0], 4)
    assert split_dim(graph.outputs[0], 4) == 2
    assert split.node("r_split").shape == (16, 6, 4, 16)
    assert split.node("r_partial").attrs["dims"] == (0, 3)
    assert split.node("r_partial").shape == (6, 4)
    assert split.node("r").attrs["dims"] == (1,) and split.node("r").shape == (6,)
    compare(graph, split, rtol=1e-5)


def test_multi_dim_tie_splits_the_first_dim():
    graph = reduce_graph((8, 3, 8, 5), (0, 2))
    split = split_reduction(graph, "r", 2)
    assert split.node("r_split").shape == (2, 4, 3, 8, 5)
    assert split.node("r_partial").attrs["dims"] == (1, 3)
    assert split.node("r_partial").shape == (2, 3, 5)
    assert split.node("r").shape == (3, 5)
    compare(graph, split, rtol=1e-5)


def test_reduction_to_scalar():
    graph = reduce_graph((32, 48), (0, 1))
    split = split_reduction(graph, "r", 6)
    assert split.node("r_split").shape == (32, 6, 8)
    assert split.node("r_partial").shape == (6,)
    assert split.node("r").shape == ()
    compare(graph, split, rtol=1e-5)


# ------------------------------------------------------------------------------------------
# Kinds and types.
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["max", "min"])
@pytest.mark.parametrize("dtype", [DType.F32, DType.BF16, DType.F16, DType.I32])
def test_max_min_are_exact(kind, dtype):
    graph = reduce_graph((256, 40), (0,), kind=kind, dtype=dtype)
    split = split_reduction(graph, "r", 16)
    assert not any(n.op == "convert" for n in split.nodes)  # selecting a value needs no widening
    assert split.node("r_partial").dtype == dtype
    compare(graph, split, rtol=0, low=-2.0, high=2.0)


def test_prod():
    graph = reduce_graph((128, 24), (0,), kind="prod")
    split = split_reduction(graph, "r", 8)
    compare(graph, split, rtol=1e-5, low=0.9, high=1.1)


def test_integer_sum_is_exact():
    graph = reduce_graph((512, 10), (0,), dtype=DType.I32)
    split = split_reduction(graph, "r", 4)
    assert not any(n.op == "convert" for n in split.nodes)
    compare(graph, split, rtol=0)


@pytest.mark.parametrize("dtype", [DType.BF16, DType.F16])
@pytest.mark.parametrize("kind", ["sum", "prod"])
def test_half_accumulates_in_f32_and_rounds_once(dtype, kind):
    graph = reduce_graph((4096, 768), (0,), kind=kind, dtype=dtype, name="db")
    split = split_reduction(graph, "db", 32)
    assert ops(split) == [
        ("convert", "db_f32", (4096, 768), DType.F32),
        ("reshape", "db_split", (32, 128, 768), DType.F32),
        ("reduce", "db_partial", (32, 768), DType.F32),
        ("reduce", "db_final", (768,), DType.F32),
        ("convert", "db", (768,), dtype),
    ]
    assert split.outputs[0] is split.node("db")
    low, high = (0.0, 1.0) if kind == "sum" else (0.999, 1.001)
    # One rounding in both graphs; only the f32 summation order differs: at most one half-type ulp.
    eps = float(ml_dtypes.finfo(dtype.numpy).eps)
    compare(graph, split, rtol=eps, low=low, high=high)


def test_bool_reductions():
    b = GraphBuilder("g")
    x = b.parameter((64, 3), DType.F32, "x")
    positive = b.compare("GT", x, b.constant(0.5, DType.F32, (64, 3)))
    any_ = b.node("reduce", [positive], dims=(0,), kind="max", name="any")
    all_ = b.node("reduce", [positive], dims=(0,), kind="min", name="all")
    graph = b.build([any_, all_])
    split = split_reduction(split_reduction(graph, "any", 4), "all", 8)
    for value in (np.full((64, 3), 0.9, np.float32), RNG.uniform(0, 1, (64, 3)).astype(np.float32)):
        for e, f in zip(evaluate(graph, [value]), evaluate(split, [value])):
            np.testing.assert_array_equal(f, e)


# ------------------------------------------------------------------------------------------
# Rebuilding: users, outputs, mutations, layouts, parameters, names, the original graph.
# ------------------------------------------------------------------------------------------


def shared_graph():
    """r feeds two users and is output 0, which overwrites parameter ``acc``, with a layout."""
    b = GraphBuilder("shared")
    x = b.parameter((256, 12), DType.F32, "x")
    acc = b.parameter((12,), DType.F32, "acc")
    r = b.reduce(b.unary("exp", x), (0,), "sum")
    total = b.binary("add", r, acc)
    scaled = b.binary("mul", r, r)
    layout = Layout.contiguous((12,))
    return b.build([r, total, None, scaled], mutations={0: 1}, output_layouts=[layout, None, None, None])


def test_several_users_and_graph_output():
    graph = shared_graph()
    split = split_reduction(graph, "reduce", 16)
    r = split.node("reduce")
    assert r.shape == (12,) and r.operands[0].name == "reduce_partial"
    assert split.outputs[0] is r and split.outputs[2] is None
    assert split.node("add").operands[0] is r
    assert split.node("mul").operands == (r, r)
    assert split.mutations == {0: 1}
    assert split.output_layouts == graph.output_layouts
    compare(graph, split, rtol=1e-5)


def test_parameters_kept_other_nodes_copied():
    graph = shared_graph()
    split = split_reduction(graph, "reduce", 16)
    assert split.parameters == graph.parameters
    assert all(a is b for a, b in zip(split.parameters, graph.parameters))
    old = {id(n) for n in graph.nodes if n.op != "parameter"}
    assert not any(id(n) in old for n in split.nodes)


def test_original_graph_unchanged():
    graph = shared_graph()
    before, nodes = graph.to_json(), list(graph.nodes)
    split_reduction(graph, "reduce", 4)
    assert graph.to_json() == before
    assert all(a is b for a, b in zip(graph.nodes, nodes)) and len(graph.nodes) == len(nodes)


def test_new_names_avoid_existing_ones():
    b = GraphBuilder("g")
    x = b.parameter((64, 8), DType.F32, "x")
    taken = b.unary("neg", x)
    taken = b.node("abs", [taken], name="r_partial")
    r = b.node("reduce", [taken], dims=(0,), kind="sum", name="r")
    graph = b.build([r, taken])
    split = split_reduction(graph, "r", 4)
    assert split.node("r").operands[0].name == "r_partial_1"
    assert split.node("r_partial").op == "abs"
    compare(graph, split, rtol=1e-5)


def test_json_round_trip():
    graph = shared_graph()
    split = split_reduction(graph, "reduce", 8)
    text = split.to_json()
    again = from_json(text)
    assert again.to_json() == text
    inputs = inputs_for(graph)
    for e, f in zip(evaluate(split, inputs), evaluate(again, inputs)):
        if e is None:
            assert f is None
        else:
            np.testing.assert_array_equal(f, e)


# ------------------------------------------------------------------------------------------
# Errors.
# ------------------------------------------------------------------------------------------


def test_not_divisible_names_node_dim_and_size():
    graph = reduce_graph((100, 7), (0,), name="db")
    with pytest.raises(ValueError, match=r"db.*dim 0 has size 100.*parts=32"):
        split_reduction(graph, "db", 32)


def test_parts_larger_than_dim():
    graph = reduce_graph((4, 7), (0,))
    with pytest.raises(ValueError, match="size 4"):
        split_reduction(graph, "r", 8)


def test_not_a_reduce():
    graph = reduce_graph((64, 7), (0,))
    with pytest.raises(ValueError, match="mul is a mul, not a reduce"):
        split_reduction(graph, "mul", 4)


@pytest.mark.parametrize("parts", [1, 0, -2])
def test_parts_below_two(parts):
    graph = reduce_graph((64, 7), (0,))
    with pytest.raises(ValueError, match="parts must be an int >= 2"):
        split_reduction(graph, "r", parts)


def test_unknown_node():
    graph = reduce_graph((64, 7), (0,))
    with pytest.raises(ValueError, match="no node 'nope'"):
        split_reduction(graph, "nope", 4)
    other = reduce_graph((64, 7), (0,))
    with pytest.raises(ValueError, match="not a node of graph"):
        split_reduction(graph, other.outputs[0], 4)


def test_fold_views_composes_permutations_and_drops_identities():
    from fusionstitching.graph.transforms import fold_views

    b = GraphBuilder("transposes")
    x = b.parameter((2, 3, 4), DType.F32, "x")
    back = b.transpose(b.transpose(x, (1, 0, 2)), (1, 0, 2))  # identity
    rotated = b.transpose(b.transpose(x, (1, 2, 0)), (1, 2, 0))  # one transpose (2, 0, 1)
    graph = b.build([back, rotated])
    folded = fold_views(graph)
    assert folded.outputs[0] is folded.parameters[0]
    assert folded.outputs[1].op == "transpose" and folded.outputs[1].operands[0] is folded.parameters[0]
    assert tuple(folded.outputs[1].attrs["permutation"]) == (2, 0, 1)
    data = np.random.default_rng(0).standard_normal((2, 3, 4)).astype(np.float32)
    for got, want in zip(evaluate(folded, [data]), evaluate(graph, [data])):
        np.testing.assert_array_equal(got, want)
    assert fold_views(folded) is folded


def test_fold_views_drops_reshape_round_trips_and_identity_reshapes():
    from fusionstitching.graph.transforms import fold_views

    b = GraphBuilder("reshapes")
    x = b.parameter((4, 6), DType.F32, "x")
    total = b.reduce(x, (0,), "sum")  # [6]
    back = b.reshape(b.reshape(total, (1, 6)), (6,))  # a bias gradient's round trip: no node
    regrouped = b.reshape(b.reshape(x, (24,)), (3, 8))  # a chain that changes the shape: kept
    same = b.reshape(b.unary("neg", x), (4, 6))
    kept = b.reshape(b.reshape(x, (24,)), (4, 6))  # back to a parameter: a copy of it in torch, kept
    graph = b.build([back, regrouped, same, kept])
    folded = fold_views(graph)
    assert folded.outputs[0].op == "reduce"
    assert [n.op for n in (folded.outputs[1], folded.outputs[1].operands[0])] == ["reshape", "reshape"]
    assert folded.outputs[2].op == "neg"
    assert folded.outputs[3].op == "reshape" and folded.outputs[3] is not folded.parameters[0]
    data = np.random.default_rng(0).standard_normal((4, 6)).astype(np.float32)
    for got, want in zip(evaluate(folded, [data]), evaluate(graph, [data])):
        np.testing.assert_array_equal(got, want)
    assert fold_views(folded) is folded


def _gradient_graph(extra_user: bool = False, output_convert: bool = True):
    """dW = xᵀ·dy in bf16, widened to f32 as autocast's weight gradient; ``extra_user``: the bf16
    product is also read by another node; ``output_convert``: the f32 value is a graph output."""
    b = GraphBuilder("weight_grad")
    x = b.parameter((64, 32), DType.BF16, "x")
    dy = b.parameter((64, 16), DType.BF16, "dy")
    dot = b.node("dot_general", [x, dy], lhs_batch=(), rhs_batch=(), lhs_contract=(0,), rhs_contract=(0,))
    wide = b.convert(dot, DType.F32)
    outputs = [wide] if output_convert else [b.binary("add", wide, wide)]
    if extra_user:
        outputs.append(b.binary("mul", dot, dot))
    return b.build(outputs)


def test_widen_dots_writes_the_f32_accumulator_of_a_widened_gradient():
    from fusionstitching.graph.transforms import widen_dots

    graph = _gradient_graph()
    widened = widen_dots(graph)
    (out,) = widened.outputs
    assert out.op == "dot_general" and out.dtype == DType.F32 and out.name == graph.outputs[0].name
    assert out.operands == tuple(graph.parameters)
    rng = np.random.default_rng(0)
    inputs = [rng.standard_normal(p.shape).astype(ml_dtypes.bfloat16) for p in graph.parameters]
    (want,), (got,) = evaluate(graph, inputs), evaluate(widened, inputs)
    x, dy = (a.astype(np.float32) for a in inputs)
    np.testing.assert_allclose(got, x.T @ dy, rtol=1e-5, atol=1e-5)  # the unrounded accumulator
    np.testing.assert_allclose(got, want, rtol=2 ** -8, atol=1e-6)  # within one bf16 rounding
    assert not np.array_equal(got, want)  # and really not rounded


@pytest.mark.parametrize("extra_user, output_convert", [(True, True), (False, False)])
def test_widen_dots_leaves_a_dot_read_elsewhere_or_widened_inside_the_graph(extra_user, output_convert):
    from fusionstitching.graph.transforms import widen_dots

    graph = _gradient_graph(extra_user, output_convert)
    assert widen_dots(graph) is graph


def _autocast_projections():
    """An f32 activation cast to bf16 once per consumer, as autocast does before Q, K and V."""
    b = GraphBuilder("projections")
    x = b.parameter((8, 16), DType.F32, "x")
    ws = [b.parameter((16, 4), DType.BF16, f"w{k}") for k in range(3)]
    outs = []
    for w in ws:
        cast = b.convert(x, DType.BF16)
        outs.append(b.node("dot_general", [b.reshape(cast, (2, 4, 16)), w], lhs_batch=(), rhs_batch=(),
                           lhs_contract=(2,), rhs_contract=(0,)))
    return b.build(outs)


def test_merge_duplicates_keeps_one_cast_and_one_view_per_value():
    from fusionstitching.graph.transforms import merge_duplicates

    graph = _autocast_projections()
    merged = merge_duplicates(graph)
    assert [n.op for n in graph.nodes].count("convert") == 3
    assert [n.op for n in merged.nodes].count("convert") == 1
    assert [n.op for n in merged.nodes].count("reshape") == 1  # the casts' views merge in turn
    assert merged.parameters == graph.parameters
    rng = np.random.default_rng(0)
    inputs = [rng.standard_normal(p.shape).astype(np.float32 if p.dtype == DType.F32 else ml_dtypes.bfloat16)
              for p in graph.parameters]
    for got, want in zip(evaluate(merged, inputs), evaluate(graph, inputs)):
        np.testing.assert_array_equal(got, want)
    assert merge_duplicates(merged) is merged


def test_merge_duplicates_leaves_distinct_values_outputs_and_draws_apart():
    from fusionstitching.graph.transforms import merge_duplicates

    b = GraphBuilder("apart")
    x = b.parameter((4, 8), DType.F32, "x")
    seed = b.parameter((), DType.I64, "seed")
    offset = b.parameter((), DType.I64, "offset")
    draws = [b.rng_uniform(seed, offset, 0, shape=(4, 8), dtype=DType.F32) for _ in range(2)]
    pads = [b.node("pad", [x], low=(0, 0), high=(1, 0), interior=(0, 0), value=v) for v in (0.0, -0.0)]
    sums = [b.reduce(x, (1,), "sum"), b.reduce(x, (0,), "sum"), b.reduce(x, (1,), "max")]
    twin_outputs = [b.unary("exp", x), b.unary("exp", x)]  # distinct outputs stay distinct tensors
    inner = b.binary("add", b.unary("exp", x), b.unary("neg", x))
    inner_twin = b.unary("neg", x)  # an output that duplicates an inner node: the output reads the kept one
    graph = b.build([*draws, *pads, *sums, *twin_outputs, inner, inner_twin])
    merged = merge_duplicates(graph)
    out = merged.outputs
    assert out[0] is not out[1]  # two draws, not one
    assert out[2] is not out[3]  # a 0.0 pad and a -0.0 pad
    assert len({id(o) for o in out[4:7]}) == 3  # other dims, other kind
    assert out[7] is not out[8]
    assert out[7] in out[9].operands  # the inner exp is the first output's
    assert out[10] in out[9].operands  # the neg output is the inner neg
    assert len(merged.nodes) == len(graph.nodes) - 2


def _gathered(*reads):
    """x[i] gathered along dim 0 of a [5, 6] table, then read by ``reads(b, gathered)``."""
    b = GraphBuilder("g")
    x, i = b.parameter((5, 6), DType.F32, "x"), b.parameter((4,), DType.I32, "i")
    gathered = b.node("gather", [x, i], axis=0, batch_dims=0, name="gathered")
    return b.build([read(b, gathered) for read in reads])


def _cols(lo, hi):
    return lambda b, g: b.node("slice", [g], start=(0, lo), limit=(4, hi), stride=(1, 1))


def test_a_gather_read_in_part_gets_a_check_output_and_one_read_in_full_none():
    partial = check_indices(_gathered(_cols(0, 2)))
    assert partial.checks == 1 and len(partial.outputs) == 2
    (check,) = partial.outputs[1:]
    assert check.shape == () and check.op == "reduce" and check.operands[0].op == "gather"
    assert check.operands[0].operands[0].shape == (5, 1)  # positions, not the table's rows
    for whole in (_gathered(lambda b, g: b.unary("exp", g)), _gathered(_cols(0, 2), _cols(2, 6))):
        assert check_indices(whole).checks == 0  # read in full, by one consumer or by slices together
    assert check_indices(_gathered(_cols(0, 2), _cols(3, 6))).checks == 1  # column 2 is never read


# ------------------------------------------------------------------------------------------
# sum_one_hots: the sum of a one-hot row is its one value.
# ------------------------------------------------------------------------------------------


def one_hot_sum(rows=6, classes=9, dim=1, dtype=DType.F32, scaled=True, index_first=False, value_along=False):
    """``sum_dim(select(iota_dim == index, value, 0) [* scale])``, a cross-entropy backward's form;
    ``value_along``: the value varies along the summed dim (not a one-hot row's one value)."""
    b = GraphBuilder("g")
    shape = (rows, classes) if dim == 1 else (classes, rows)
    index = b.parameter((rows,), DType.I64, "index")
    scale = b.parameter((rows,), dtype, "scale")
    kept = 1 - dim
    hit = b.iota(shape, dim, DType.I64)
    spread = b.broadcast(index, shape, (kept,))
    hit = b.compare("EQ", spread, hit) if index_first else b.compare("EQ", hit, spread)
    value = b.parameter(shape, dtype, "value") if value_along else b.broadcast(b.constant(-1.0, dtype), shape, ())
    term = b.select(hit, value, b.broadcast(b.constant(0.0, dtype), shape, ()))
    if scaled:
        term = b.binary("mul", term, b.broadcast(scale, shape, (kept,)))
    total = b.reduce(term, (dim,), "sum")
    return b.build([total, term])


def one_hot_inputs(graph, index):
    values = []
    for p in graph.parameters:
        if p.name == "index":
            values.append(np.asarray(index, np.int64))
        else:
            scale = np.array([0.5, np.inf, -2.0, np.nan, 3.0, -np.inf][: p.shape[0]] + [1.25] * (p.shape[0] - 6))
            values.append((scale if p.shape == (len(index),) else RNG.uniform(-1, 1, p.shape)).astype(p.dtype.numpy))
    return values


@pytest.mark.parametrize("dim", [0, 1])
@pytest.mark.parametrize("dtype", [DType.F32, DType.BF16])
@pytest.mark.parametrize("scaled", [True, False])
@pytest.mark.parametrize("index_first", [True, False])
def test_one_hot_sum_is_its_value(dim, dtype, scaled, index_first):
    graph = one_hot_sum(dim=dim, dtype=dtype, scaled=scaled, index_first=index_first)
    rewritten = sum_one_hots(graph)
    assert [n.op for n in rewritten.nodes].count("reduce") == 0
    assert rewritten.outputs[0].name == graph.outputs[0].name
    # in range, the last class, out of range on both sides; scales with inf and NaN (0 * inf is NaN
    # at every position but the hit, so is the sum)
    inputs = one_hot_inputs(graph, [3, 8, -1, 0, 9, 2])
    for expected, found in zip(evaluate(graph, inputs), evaluate(rewritten, inputs)):
        assert found.dtype == expected.dtype and found.shape == expected.shape
        np.testing.assert_array_equal(found.astype(np.float64), expected.astype(np.float64))


def test_sum_of_values_along_the_dim_is_kept():
    graph = one_hot_sum(value_along=True)
    assert sum_one_hots(graph) is graph


def test_one_hot_sum_in_a_compiled_graph_simulates_like_the_reference():
    """Through the whole pipeline (explore, codegen, the simulator): the reduce is gone from the plan."""
    from fusionstitching.options import Options
    from fusionstitching.pipeline import compile_graph

    graph = one_hot_sum(rows=8, classes=37)
    compiled = compile_graph(graph, Options(strict=True))
    assert not any(n.op == "reduce" for n in compiled.plan.graph.nodes)
    inputs = one_hot_inputs(graph, [3, 36, 0, 0, 5, 2, 1, 7])
    for expected, found in zip(evaluate(graph, inputs), compiled(*inputs)):
        np.testing.assert_array_equal(np.asarray(found), expected)


@pytest.mark.parametrize("shape, parts, split_shape, partial_shape", [
    ((64, 32), 4, (4, 16, 32), (16, 32)),  # rows r, r + 16, r + 32, r + 48 in one partial row
    ((2, 64, 32), 4, (2, 2, 32, 32), (32, 32)),  # all of dim 0 and the outer half of dim 1
    ((4, 8, 32), 4, (4, 1, 8, 32), (8, 32)),  # exactly dim 0
])
def test_row_loops_sum_the_outer_parts_of_the_leading_dims(shape, parts, split_shape, partial_shape):
    from fusionstitching.graph.transforms import split_reductions

    dims = tuple(range(len(shape) - 1))
    graph = reduce_graph(shape, dims, dtype=DType.BF16)
    split = split_reductions(graph, {}, row_loops={"r": parts})
    partial = next(n for n in split.nodes if n.name == "r_partial")
    assert partial.operands[0].shape == split_shape and partial.shape == partial_shape
    assert tuple(partial.attrs["dims"]) == tuple(range(len(split_shape) - len(partial_shape)))
    assert split.outputs[0].dtype == DType.BF16 and split.outputs[0].shape == (shape[-1],)
    compare(graph, split, rtol=1e-2)


def test_row_loops_refuse_parts_the_leading_dims_do_not_split_into():
    from fusionstitching.graph.transforms import split_reductions

    with pytest.raises(ValueError, match="no split into 3 outer parts"):
        split_reductions(reduce_graph((64, 32), (0,)), {}, row_loops={"r": 3})
    with pytest.raises(ValueError, match="leading dims only"):
        split_reductions(reduce_graph((64, 32), (1,)), {}, row_loops={"r": 4})


def test_row_loops_property_every_split_the_leading_dims_allow_sums_the_same():
    """Every number of parts that ``row_loop_dim`` accepts, over leading dims of random sizes: the
    split graph sums what the original does, and its partial keeps the rows past the split."""
    from hypothesis import given, settings
    from hypothesis import strategies as st

    from fusionstitching.graph.transforms import row_loop_dim, split_reductions

    @settings(max_examples=60, deadline=None)
    @given(st.lists(st.sampled_from([1, 2, 3, 4, 6, 8]), min_size=1, max_size=3), st.integers(2, 48))
    def check(leading, parts):
        shape = (*leading, 8)
        graph = reduce_graph(shape, tuple(range(len(leading))))
        try:
            dim, outer = row_loop_dim(graph.node("r"), parts)
        except ValueError:
            return
        assert math.prod(leading[:dim]) * outer == parts
        split = split_reductions(graph, {}, row_loops={"r": parts})
        partial = next(n for n in split.nodes if n.name == "r_partial")
        assert math.prod(partial.shape[:-1]) * parts == math.prod(leading)
        compare(graph, split, rtol=1e-5)

    check()
