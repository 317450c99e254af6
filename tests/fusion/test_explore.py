"""``explore`` on small hand-made graphs: kernel counts, library calls, plan invariants, and the
generated kernels of the plan simulated against ``graph/reference.py``."""

from __future__ import annotations

import math

import numpy as np
import pytest

from fusionstitching.codegen.generate import generate
from fusionstitching.fusion import FusionPlan, baseline, explore
from fusionstitching.graph import reference
from fusionstitching.graph.graph import Graph, GraphBuilder, Node
from fusionstitching.graph.ops import DType
from fusionstitching.options import Options
from fusionstitching.pipeline import compile_plan

from .helpers import (
    assert_close,
    check_baseline_rules,
    check_kernels,
    check_plan,
    fusable_names,
    pattern_names,
    random_arrays,
    run_plan,
    same_plan,
)


def _dot(b: GraphBuilder, lhs: Node, rhs: Node, batch: int = 0) -> Node:
    """lhs [..., M, K] x rhs [..., K, N] with ``batch`` leading batch dims."""
    dims = tuple(range(batch))
    return b.node("dot_general", [lhs, rhs], lhs_batch=dims, rhs_batch=dims, lhs_contract=(batch + 1,),
                  rhs_contract=(batch,))


def elementwise_chain() -> Graph:
    b = GraphBuilder("chain")
    x = b.parameter((64, 128), DType.F32, "x")
    y = b.parameter((64, 128), DType.F32, "y")
    h = b.binary("mul", b.unary("exp", x), y)
    h = b.binary("add", b.unary("tanh", h), x)
    return b.build([b.unary("neg", h)])


def layernorm(rows: int = 64, cols: int = 256) -> Graph:
    """mean, variance, normalize, scale and shift over the last dim of x [rows, cols] f32."""
    b = GraphBuilder("layernorm")
    x = b.parameter((rows, cols), DType.F32, "x")
    gamma = b.parameter((cols,), DType.F32, "gamma")
    beta = b.parameter((cols,), DType.F32, "beta")
    inv = b.broadcast(b.constant(1.0 / cols, DType.F32), (rows,), ())
    mean = b.binary("mul", b.reduce(x, (1,), "sum"), inv)
    centered = b.binary("sub", x, b.broadcast(mean, (rows, cols), (0,)))
    var = b.binary("mul", b.reduce(b.binary("mul", centered, centered), (1,), "sum"), inv)
    eps = b.broadcast(b.constant(1e-5, DType.F32), (rows,), ())
    rstd = b.unary("rsqrt", b.binary("add", var, eps))
    y = b.binary("mul", centered, b.broadcast(rstd, (rows, cols), (0,)))
    y = b.binary("mul", y, b.broadcast(gamma, (rows, cols), (1,)))
    return b.build([b.binary("add", y, b.broadcast(beta, (rows, cols), (1,)))])


def softmax(rows: int = 64, cols: int = 128) -> Graph:
    b = GraphBuilder("softmax")
    x = b.parameter((rows, cols), DType.F32, "x")
    m = b.reduce(x, (1,), "max")
    e = b.unary("exp", b.binary("sub", x, b.broadcast(m, (rows, cols), (0,))))
    s = b.reduce(e, (1,), "sum")
    return b.build([b.binary("div", e, b.broadcast(s, (rows, cols), (0,)))])


def bias_gelu(rows: int = 16, cols: int = 96) -> Graph:
    """gelu(x + bias), tanh approximation, written out op by op."""
    b = GraphBuilder("bias_gelu")
    x = b.parameter((rows, cols), DType.F32, "x")
    bias = b.parameter((cols,), DType.F32, "bias")
    shape = (rows, cols)

    def scalar(value: float) -> Node:
        return b.broadcast(b.constant(value, DType.F32), shape, ())

    h = b.binary("add", x, b.broadcast(bias, shape, (1,)))
    cube = b.binary("mul", b.binary("mul", h, h), h)
    inner = b.binary("mul", b.binary("add", h, b.binary("mul", cube, scalar(0.044715))),
                     scalar(math.sqrt(2 / math.pi)))
    out = b.binary("mul", b.binary("mul", h, scalar(0.5)), b.binary("add", b.unary("tanh", inner), scalar(1.0)))
    return b.build([out])


def two_chains() -> Graph:
    b = GraphBuilder("two_chains")
    x = b.parameter((64, 128), DType.F32, "x")
    y = b.parameter((32, 16), DType.F32, "y")
    first = b.unary("neg", b.unary("exp", x))
    second = b.unary("abs", b.unary("tanh", y))
    return b.build([first, second])


def large_dot() -> Graph:
    """neg(x) @ w with a bias-tanh epilogue: the 512 x 512 x 512 dot is a GEMM library call."""
    b = GraphBuilder("large_dot")
    x = b.parameter((512, 512), DType.F32, "x")
    w = b.parameter((512, 512), DType.F32, "w")
    bias = b.parameter((512,), DType.F32, "bias")
    d = _dot(b, b.unary("neg", x), w)
    return b.build([b.unary("tanh", b.binary("add", d, b.broadcast(bias, (512, 512), (1,))))])


def small_batched_dot() -> Graph:
    b = GraphBuilder("small_dot")
    q = b.parameter((64, 1, 16), DType.F32, "q")
    k = b.parameter((64, 16, 20), DType.F32, "k")
    return b.build([b.unary("exp", _dot(b, q, k, batch=1))])


def dot_between_kernels(size: int = 32) -> Graph:
    """exp(x) → dot → tanh(· + x): with a small-dot threshold of zero, two kernels and a library call."""
    b = GraphBuilder("dot_between")
    x = b.parameter((size, size), DType.F32, "x")
    w = b.parameter((size, size), DType.F32, "w")
    d = _dot(b, b.binary("mul", b.unary("exp", x), x), w)
    return b.build([b.unary("tanh", b.binary("add", d, x))])


GRAPHS = {
    "chain": elementwise_chain,
    "layernorm": layernorm,
    "softmax": softmax,
    "bias_gelu": bias_gelu,
    "two_chains": two_chains,
    "large_dot": large_dot,
    "small_batched_dot": small_batched_dot,
    "dot_between": dot_between_kernels,
}

NO_SMALL_DOTS = Options(small_dot_max_flops=0)


def _dot_name(plan: FusionPlan) -> str:
    (name,) = [n.name for n in plan.graph.nodes if n.op == "dot_general"]
    return name


@pytest.mark.parametrize("name", list(GRAPHS))
def test_plan_invariants(name):
    plan = explore(GRAPHS[name]())
    check_plan(plan)
    assert plan.seconds > 0
    assert plan.strategy.startswith("fusionstitching")


@pytest.mark.parametrize("name", list(GRAPHS))
def test_explore_is_deterministic(name):
    graph = GRAPHS[name]()
    first, second = explore(graph), explore(graph)
    assert same_plan(first, second)
    assert [p.score for p in first.patterns] == [p.score for p in second.patterns]
    assert [(e.producer, e.consumer, e.reason) for e in first.unfused] == \
        [(e.producer, e.consumer, e.reason) for e in second.unfused]


@pytest.mark.parametrize("name", ["chain", "layernorm", "softmax", "bias_gelu"])
def test_one_kernel(name):
    plan = explore(GRAPHS[name]())
    assert plan.kernel_count == 1, plan.explain()
    assert plan.library_count == 0 and not plan.views and not plan.unfused
    assert set(plan.patterns[0].nodes) == set(fusable_names(plan.graph))
    assert plan.patterns[0].score > 0


@pytest.mark.parametrize("name", ["layernorm", "softmax"])
def test_baseline_needs_more_kernels_for_reductions(name):
    graph = GRAPHS[name]()
    plan, rules = explore(graph), baseline(graph)
    check_plan(rules)
    check_baseline_rules(rules)
    assert rules.kernel_count > plan.kernel_count == 1, rules.explain()
    assert rules.strategy.startswith("baseline")


def test_two_independent_chains_cover_every_node():
    plan = explore(two_chains())
    covered = [n for p in plan.patterns for n in p.nodes]
    assert sorted(covered) == sorted(fusable_names(plan.graph))
    assert plan.kernel_count <= 2


def test_large_dot_is_a_library_call():
    plan = explore(large_dot())
    dot = _dot_name(plan)
    assert dot in plan.library and "small-dot threshold" in plan.library[dot]
    assert plan.library_count == 1
    assert plan.pattern_of(dot) is None
    assert plan.kernel_count == 2  # neg before the GEMM; bias + tanh after it
    reasons = {(e.producer, e.consumer): e.reason for e in plan.unfused}
    assert "library call" in reasons[(dot, "add")]
    assert f"library {dot}: " in plan.explain()


def test_small_batched_dot_is_fused():
    plan = explore(small_batched_dot())
    dot = _dot_name(plan)
    assert plan.library_count == 0
    assert plan.kernel_count == 1 and dot in plan.patterns[0].nodes


def test_small_dot_threshold_comes_from_options():
    plan = explore(small_batched_dot(), options=NO_SMALL_DOTS)
    check_plan(plan)
    assert _dot_name(plan) in plan.library and plan.kernel_count == 1


def test_unknown_solver_is_refused():
    with pytest.raises(ValueError, match="solver"):
        explore(elementwise_chain(), solver="guess")
    with pytest.raises(ValueError, match="score"):
        Options(score="guess")


def test_column_reduction_is_split_unless_options_say_no():
    b = GraphBuilder("bias_grad")
    dy = b.parameter((4096, 768), DType.F32, "dy")
    graph = b.build([b.reduce(dy, (0,), "sum")])
    plan = explore(graph)
    check_plan(plan)
    assert plan.kernel_count == 2, plan.explain()
    arrays = random_arrays(plan.graph)
    (got,) = compile_plan(plan).run_numpy(arrays)
    assert_close(got, reference.evaluate(plan.graph, arrays)[0], "split bf16 bias gradient")
    assert any(note.startswith("split reduce") for note in plan.notes)
    assert any(note.endswith("s in the solver") for note in plan.notes)  # the selection's HiGHS time
    assert len(plan.graph.nodes) > len(graph.nodes)
    unsplit = explore(graph, options=Options(split_reductions=False))
    assert unsplit.graph is graph and unsplit.kernel_count == 1


# ----------------------------------------------------------------------------------------------
# Generated kernels of the plan against the reference
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["layernorm", "bias_gelu", "softmax", "chain", "small_batched_dot"])
def test_kernels_of_the_plan_simulate_like_the_reference(name):
    sizes = {"layernorm": (8, 256), "softmax": (8, 128), "bias_gelu": (4, 96)}
    graph = GRAPHS[name](*sizes.get(name, ()))
    plan = explore(graph)
    arrays = random_arrays(graph)
    assert check_kernels(plan, arrays) == plan.kernel_count
    (got,) = run_plan(plan, arrays)
    (want,) = reference.evaluate(graph, arrays)
    assert_close(got, want, name)


def test_two_kernel_plan_around_a_library_call_runs_like_the_reference():
    graph = dot_between_kernels()
    plan = explore(graph, options=NO_SMALL_DOTS)
    check_plan(plan)
    assert plan.kernel_count == 2 and plan.library_count == 1, plan.explain()
    arrays = random_arrays(graph, seed=1)
    check_kernels(plan, arrays)
    (got,) = run_plan(plan, arrays)
    (want,) = reference.evaluate(graph, arrays)
    assert_close(got, want, "dot_between")


def test_plan_after_splitting_runs_like_the_reference():
    b = GraphBuilder("bias_grad_small")
    dy = b.parameter((2048, 64), DType.F32, "dy")
    graph = b.build([b.reduce(b.unary("tanh", dy), (0,), "sum")])
    plan = explore(graph)
    check_plan(plan)
    assert any(note.startswith("split reduce") for note in plan.notes) and plan.kernel_count == 2, plan.explain()
    arrays = random_arrays(graph, seed=2)
    (got,) = run_plan(plan, arrays)
    (want,) = reference.evaluate(graph, arrays)
    assert_close(got, want, "split column sum")
    assert np.isfinite(got).all()


def test_pattern_lists_are_identical_across_runs_of_every_graph():
    names = {name: pattern_names(explore(make())) for name, make in GRAPHS.items()}
    assert names == {name: pattern_names(explore(make())) for name, make in GRAPHS.items()}


@pytest.mark.parametrize("shape", [(32, 32), (64, 256)])
def test_row_and_column_reductions_of_one_tensor_simulate_like_the_reference(shape):
    # One kernel for both would tile the column sum's reduced dim (the rows) over the grid of the row
    # reduction: every block would store its partial column sums into the same elements.
    b = GraphBuilder("row_and_column")
    x = b.parameter(shape, DType.F32, "x")
    graph = b.build([b.reduce(x, (1,), "max"), b.reduce(b.unary("exp", x), (0,), "sum")])
    plan = explore(graph)
    check_plan(plan)
    arrays = random_arrays(graph, seed=3)
    check_kernels(plan, arrays)
    for got, want in zip(run_plan(plan, arrays), reference.evaluate(graph, arrays)):
        assert_close(got, want, "row and column reductions")


def _column_sum_epilogue(dtype: DType = DType.F32) -> Graph:
    b = GraphBuilder("column_epilogue")
    x = b.parameter((64, 768), dtype, "x")
    return b.build([b.unary("exp", b.reduce(x, (0,), "sum"))])


def test_a_kernel_exists_for_a_column_sum_with_an_epilogue():
    graph = _column_sum_epilogue()
    nodes = fusable_names(graph)
    kernel = generate(graph, nodes, "reduce[THREAD,GRID-CTA_256]; exp[GRID-CTA_256]; launch(blocks=3,threads=256)")
    arrays = random_arrays(graph)
    (got,) = kernel.simulate(arrays)
    assert_close(got, reference.evaluate(graph, arrays)[0], "column sum + exp")


def test_column_sum_with_an_epilogue_is_one_kernel():
    graph = _column_sum_epilogue()
    plan = explore(graph)
    assert plan.kernel_count == 1, plan.explain()
    arrays = random_arrays(plan.graph)
    (got,) = compile_plan(plan).run_numpy(arrays)
    assert_close(got, reference.evaluate(plan.graph, arrays)[0], "column sum + exp, planned")


def test_split_bf16_bias_gradient_is_two_kernels():
    b = GraphBuilder("bias_grad_bf16")
    dy = b.parameter((4096, 768), DType.BF16, "dy")
    plan = explore(b.build([b.reduce(dy, (0,), "sum")]))
    check_plan(plan)
    assert any(note.startswith("split reduce") for note in plan.notes)
    assert plan.kernel_count == 2, plan.explain()
    arrays = random_arrays(plan.graph)
    (got,) = compile_plan(plan).run_numpy(arrays)
    assert_close(got, reference.evaluate(plan.graph, arrays)[0], "split bf16 bias gradient")


def test_gemm_operands_that_cublas_reads_transposed_are_views():
    b = GraphBuilder("linear_backward")
    x = b.parameter((512, 256), DType.F32, "x")
    dy = b.parameter((512, 256), DType.F32, "dy")
    q = b.parameter((8, 64, 4, 32), DType.F32, "q")
    weight_grad = b.node("dot_general", [b.transpose(dy, (1, 0)), x], lhs_batch=(), rhs_batch=(),
                         lhs_contract=(1,), rhs_contract=(0,))
    heads = b.transpose(q, (0, 2, 1, 3))  # not a cuBLAS layout: a kernel writes it
    scores = b.node("dot_general", [heads, heads], lhs_batch=(0, 1), rhs_batch=(0, 1),
                    lhs_contract=(3,), rhs_contract=(3,))
    plan = explore(b.build([weight_grad, scores]), options=Options(small_dot_max_flops=0))
    transposes = [n.name for n in plan.graph.nodes if n.op == "transpose"]
    assert transposes[0] in plan.views and plan.pattern_of(transposes[0]) is None
    assert transposes[1] not in plan.views and plan.pattern_of(transposes[1]) is not None
    assert plan.library_count == 2


def test_the_split_and_unsplit_explorations_share_their_schedule_checks(monkeypatch):
    """A BERT layer is explored with its reshapes split and unsplit; the second exploration reads the
    first one's answers by pattern structure, lowers fewer patterns than alone, and plans the same."""
    import sys

    from fusionstitching.cli import capture_workload

    explore_module = sys.modules["fusionstitching.fusion.explore"]
    _, captured = capture_workload("bert_layer")
    graph = captured.forward
    lowered = []
    original = explore_module.Legality

    class Counting(original):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            lowered.append(self)

    monkeypatch.setattr(explore_module, "Legality", Counting)
    shared = explore(graph)
    assert any("reshapes resolved" in note for note in shared.notes)
    assert len(lowered) == 2
    with_cache = sum(legality.feasible_calls for legality in lowered)
    lowered.clear()
    options = Options()
    prepared = explore_module._prepared(graph, options)
    alone = [explore_module._explore(prepared, refined, "ilp", options, explore_module.DEFAULT_GENERATORS)
             for refined in (explore_module.refine_reshaped_regions(prepared[0]), prepared[0])]
    without_cache = sum(legality.feasible_calls for legality in lowered)
    assert with_cache < without_cache
    split, unsplit = alone
    assert same_plan(shared, split if split.estimated_us < unsplit.estimated_us else unsplit)


def test_a_kernel_writes_a_value_once_and_its_reshape_is_a_view():
    """A ResNet block's output was written twice by its kernel: flat for the next convolution and
    unflattened as the activation the backward saves (257 MB a training step). A selected pattern
    holding a value it writes anyway and a reshape of it read by nothing inside leaves the reshape
    out (``plan._written_once``): it is a view of the written value, and the values are right."""
    from fusionstitching.fusion.legality import Legality, Roles
    from fusionstitching.fusion.plan import Chosen, finalize

    b = GraphBuilder("block_output")
    x = b.parameter((4096, 256), DType.F32, "x")
    w = b.parameter((256, 256), DType.F32, "w")
    y = b.binary("max", b.binary("mul", x, x), x)
    product = _dot(b, y, w)
    saved = b.reshape(y, (16, 16, 16, 256))
    graph = b.build([product, saved])
    options = Options(small_dot_max_flops=0)
    legality = Legality(graph, options)
    nodes = [n for n in graph.nodes if n.op in ("mul", "max", "reshape")]
    verdict = legality.buildable(nodes)
    assert verdict, verdict
    plan = finalize(graph, Roles.of(graph, options), legality, None,
                    [Chosen(tuple(nodes), verdict.schedule, 0.0, "the block's kernel")], "test")
    check_plan(plan)
    assert plan.library_count == 1 and plan.kernel_count == 1, plan.explain()
    assert saved.name in plan.views and plan.pattern_of(saved.name) is None, plan.explain()
    (pattern,) = plan.patterns
    kernel = generate(plan.graph, [plan.graph.node(n) for n in pattern.nodes], pattern.schedule)
    assert kernel.outputs == [y.name]
    arrays = random_arrays(plan.graph)
    got = compile_plan(plan).run_numpy(arrays)
    for value, want, label in zip(got, reference.evaluate(plan.graph, arrays), ("product", "saved")):
        assert_close(value, want, label)
    # a reshape read inside the kernel, or of a value that is itself a graph output, stays
    kept = b.binary("add", saved, saved)
    graph = b.build([product, kept])
    legality = Legality(graph, options)
    nodes = [n for n in graph.nodes if n.op in ("mul", "max", "reshape", "add")]
    plan = finalize(graph, Roles.of(graph, options), legality, None,
                    [Chosen(tuple(nodes), legality.buildable(nodes).schedule, 0.0, "read inside")], "test")
    assert plan.pattern_of(saved.name) is not None
    graph = b.build([product, saved, y])
    legality = Legality(graph, options)
    nodes = [n for n in graph.nodes if n.op in ("mul", "max", "reshape")]
    plan = finalize(graph, Roles.of(graph, options), legality, None,
                    [Chosen(tuple(nodes), legality.buildable(nodes).schedule, 0.0, "graph output")], "test")
    assert plan.pattern_of(saved.name) is not None  # the kernel writes both
