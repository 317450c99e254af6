"""Reshapes between interior nodes resolved by splitting dims (graph/refine.py): GroupNorm's
backward in one shape, what keeps a reshape, and values equal to the original graph's under the
reference on random graphs with a printed seed."""

from __future__ import annotations

import math
import random

import numpy as np

from fusionstitching.graph.collapse import _interior
from fusionstitching.graph.graph import GraphBuilder, Layout
from fusionstitching.graph.ops import DType
from fusionstitching.graph.reference import evaluate
from fusionstitching.graph.refine import refine_reshaped_regions


def _same_values(a, b, seed=0):
    rng = np.random.default_rng(seed)
    inputs = [rng.standard_normal(p.shape).astype(p.dtype.numpy) for p in a.parameters]
    for x, y in zip(evaluate(a, inputs), evaluate(b, inputs)):
        assert x.shape == y.shape and x.dtype == y.dtype
        np.testing.assert_allclose(y.astype(np.float64), x.astype(np.float64), rtol=1e-5, atol=1e-5)


def _interior_reshapes(graph):
    """Reshapes between two interior nodes."""
    readers = {id(x): n for n in graph.nodes for x in n.operands}
    return [n for n in graph.nodes if n.op == "reshape" and _interior(n.operands[0])
            and id(n) in readers and _interior(readers[id(n)])]


def groupnorm_backward(n=2, c=6, groups=3, h=4, w=5):
    """As PyTorch decomposes it: the gradient in [N, C, H, W], per-channel sums through [N, C, H·W],
    per-group sums through [N, G, C/G], and dx computed in [N, G, C/G, H·W]."""
    b = GraphBuilder("gn")
    shape = (n, c, h, w)
    x, dy = b.parameter(shape, DType.F32, "x"), b.parameter(shape, DType.F32, "dy")
    rstd = b.parameter((n, groups, 1), DType.F32, "rstd")
    grad = b.binary("mul", dy, b.unary("sigmoid", x))  # the SiLU gradient's part
    sums = b.reduce(b.reshape(grad, (n, c, h * w)), (2,), "sum")
    sums_x = b.reduce(b.reshape(b.binary("mul", grad, x), (n, c, h * w)), (2,), "sum")
    group_sums = b.reduce(b.reshape(b.binary("add", sums, sums_x), (n, groups, c // groups)), (2,), "sum")
    scale = b.binary("mul", group_sums, b.reshape(rstd, (n, groups)))
    spread = b.broadcast(scale, (n, groups, c // groups, h * w), (0, 1))
    dx = b.binary("sub", b.reshape(grad, (n, groups, c // groups, h * w)), spread)
    return b.build([b.reshape(dx, shape), b.reduce(sums, (0,), "sum")])


def test_groupnorm_backward_is_computed_in_one_finer_shape():
    graph = groupnorm_backward()
    assert len(_interior_reshapes(graph)) == 4
    refined = refine_reshaped_regions(graph)
    assert _interior_reshapes(refined) == []
    big = {n.shape for n in refined.nodes if _interior(n) and math.prod(n.shape) == 2 * 6 * 4 * 5}
    assert big == {(2, 3, 2, 4, 5)}
    sums = [n for n in refined.nodes if n.op == "reduce" and n.operands[0].shape == (2, 3, 2, 4, 5)]
    assert len(sums) == 2 and all(tuple(n.attrs["dims"]) == (3, 4) for n in sums)
    # the inputs are read as views in the finer shape; the outputs come back in their own shapes
    assert [o.shape for o in refined.outputs] == [(2, 6, 4, 5), (6,)]
    _same_values(graph, refined)


def test_a_reshape_with_no_common_finer_shape_stays():
    b = GraphBuilder("transposed_sizes")
    x = b.parameter((6, 4), DType.F32, "x")
    y = b.unary("exp", b.reshape(b.unary("neg", x), (4, 6)))  # 6 | 24 and 4 | 24, but 4 ∤ 6
    graph = b.build([y])
    assert refine_reshaped_regions(graph) is graph


def test_reshapes_moving_dims_of_one_stay():
    b = GraphBuilder("ones")
    x = b.parameter((3, 4), DType.F32, "x")
    y = b.unary("exp", b.reshape(b.unary("neg", x), (3, 1, 4)))
    graph = b.build([y])
    assert refine_reshaped_regions(graph) is graph


def test_an_output_with_fixed_strides_takes_no_cuts():
    b = GraphBuilder("strided")
    shape = (2, 6, 3, 3)
    x = b.parameter(shape, DType.F32, "x")
    y = b.unary("exp", x)
    r = b.reduce(b.reshape(y, (2, 3, 2, 9)), (3,), "sum")
    channels_last = Layout((54, 1, 18, 6))
    graph = b.build([r, y], output_layouts=[None, channels_last])
    assert refine_reshaped_regions(graph) is graph
    graph = b.build([r, y])
    refined = refine_reshaped_regions(graph)
    assert _interior_reshapes(refined) == []
    _same_values(graph, refined)


def test_a_gathered_node_keeps_its_shape_and_a_transposed_one_is_reshaped_back():
    """A cross-entropy picks one log-probability per row with a gather: the log-softmax it reads
    stays in the gather's shape. A transpose reads its split operand through a reshape back."""
    b = GraphBuilder("pick")
    logits = b.parameter((2, 3, 8), DType.F32, "logits")
    target = b.parameter((6, 1), DType.I64, "target")
    shifted = b.unary("exp", logits)
    rows = b.reshape(shifted, (6, 8))
    log = b.unary("log", rows)
    picked = b.node("gather", [log, target], axis=1, batch_dims=1)
    graph = b.build([picked, b.reduce(rows, (1,), "sum")])
    assert refine_reshaped_regions(graph) is graph
    b = GraphBuilder("transposed")
    x = b.parameter((2, 3, 8), DType.F32, "x")
    rows = b.unary("neg", b.reshape(b.unary("exp", x), (6, 8)))
    graph = b.build([b.transpose(rows, (1, 0)), b.reduce(rows, (1,), "sum")])
    refined = refine_reshaped_regions(graph)
    assert _interior_reshapes(refined) == []
    transpose = next(n for n in refined.nodes if n.op == "transpose")
    assert transpose.operands[0].op == "reshape" and transpose.operands[0].shape == (6, 8)
    _same_values(graph, refined)


# ------------------------------------------------------------------------------------------
# Random graphs: elementwise chains read through random regroupings of one finer shape
# ------------------------------------------------------------------------------------------

def _grouping(rng: random.Random, fine: tuple[int, ...]) -> tuple[int, ...]:
    """``fine`` with runs of adjacent dims multiplied together at random."""
    shape = [fine[0]]
    for size in fine[1:]:
        if rng.random() < 0.5:
            shape[-1] *= size
        else:
            shape.append(size)
    return tuple(shape)


def _random_graph(rng: random.Random):
    fine = tuple(rng.choice([1, 2, 3, 4, 5]) for _ in range(rng.randint(2, 5)))
    b = GraphBuilder("random")
    values = [b.parameter(_grouping(rng, fine), DType.F32, "x0")]
    outputs = []
    for k in range(rng.randint(2, 9)):
        choice = rng.random()
        x = rng.choice(values)
        if choice < 0.3:  # read in another grouping
            values.append(b.unary(rng.choice(["exp", "neg", "tanh"]), b.reshape(x, _grouping(rng, fine))))
        elif choice < 0.55:
            y = rng.choice(values)
            y = y if y.shape == x.shape else b.reshape(y, x.shape)
            values.append(b.binary(rng.choice(["add", "mul", "max"]), x, y))
        elif choice < 0.7:
            kept = sorted(rng.sample(range(len(x.shape)), rng.randint(0, len(x.shape))))
            source = b.parameter(tuple(x.shape[d] if rng.random() < 0.7 else 1 for d in kept), DType.F32, f"v{k}")
            values.append(b.binary("add", x, b.broadcast(source, x.shape, tuple(kept))))
        else:
            dims = sorted(rng.sample(range(len(x.shape)), rng.randint(1, len(x.shape))))
            r = b.reduce(x, tuple(dims), rng.choice(["sum", "max"]))
            outputs.append(r)
            kept = [d for d in range(len(x.shape)) if d not in dims]
            if rng.random() < 0.6:  # read back at full shape, as a norm's statistics are
                values.append(b.binary("sub", x, b.broadcast(r, x.shape, tuple(kept))))
    outputs.append(values[-1])
    if rng.random() < 0.3:
        last = values[-1]
        outputs.append(b.transpose(last, tuple(reversed(range(len(last.shape))))))
    return b.build(outputs)


def test_random_graphs_keep_their_values():
    seed = random.randrange(2**32)
    print(f"REFINE_SEED={seed}")
    rng = random.Random(seed)
    refined_any = resolved = 0
    for case in range(300):
        graph = _random_graph(rng)
        refined = refine_reshaped_regions(graph)
        refined_any += refined is not graph
        resolved += len(_interior_reshapes(graph)) - len(_interior_reshapes(refined))
        try:
            _same_values(graph, refined, seed=case)
        except AssertionError as err:
            raise AssertionError(f"REFINE_SEED={seed} case {case}: {err}") from None
    assert refined_any > 50 and resolved > 50, (refined_any, resolved)
