"""Block footprints: A's split_dim/sword view, Table 1's rules, and agreement with lowering.

``check_block_locality`` is a pre-check before lowering, so what matters most is that it never
refuses a template that lowering accepts: on the code-generation cases, the workloads' fused
patterns, seeded mutations of their templates and random patterns, every refusal is also a
``CodegenError`` of ``generate``. A reduction split across GRID and read by another group would
give its readers partial results: both refuse it.
"""

from __future__ import annotations

import functools
import random
import timeit
import warnings

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fusionstitching.codegen import default_template, generate
from fusionstitching.codegen.lower import resolve_pattern
from fusionstitching.codegen.values import CodegenError
from fusionstitching.graph.graph import GraphBuilder
from fusionstitching.graph.ops import DType
from fusionstitching.schedule import KernelSchedule, Launch, Level, Schedule, Tile, feasible, parse_template
from fusionstitching.schedule.grouping import Reason, _candidate_templates
from fusionstitching.schedule.propagate import (
    Footprint,
    LocalityReason,
    block_footprint,
    check_block_locality,
    propagate,
    schedule_view,
)
from tests.codegen import cases as C
from tests.codegen import test_compose as TC

F32 = DType.F32


def _nodes(graph):
    return [n for n in graph.nodes if n.op not in ("parameter", "constant")]


def _view(text: str, space):
    (sched,) = parse_template(f"{text}; launch(blocks=1,threads=32)").schedules
    return schedule_view(sched, space)


def _refused_by_lowering(graph, nodes, template) -> bool:
    try:
        generate(graph, nodes, template, vectorize=False)
    except CodegenError:
        return True
    return False


# ----------------------------------------------------------------------------------------------
# A's view of a template
# ----------------------------------------------------------------------------------------------


def test_row_and_column_views_of_hand_written_templates():
    view = _view("r[GRID,WARP,WARP,CTA]S", (64, 4, 8, 1024))  # DESIGN.md's example
    assert str(view.paper) == "Row(split_dim=0, sword=64)"
    assert [d.kind for d in view.dims] == ["grid-split", "whole", "whole", "whole"]
    assert (view.dims[0].blocks, view.dims[0].extent, view.dims[3].extent) == (64, 1, 1024)
    assert str(_view("m[GRID,GRID_4-CTA_64]", (8, 256)).paper) == "Row(split_dim=1, sword=4)"
    assert str(_view("m[GRID,GRID,CTA]", (4, 6, 32)).paper) == "Row(split_dim=1, sword=6)"
    assert str(_view("m[CTA,GRID]", (32, 8)).paper) == "Column(split_dim=1, sword=8)"
    assert str(_view("m[CTA,GRID_2-THREAD,GRID]", (32, 8, 5)).paper) == "Column(split_dim=1, sword=2)"
    assert str(_view("m[]", ()).paper) == "Row(split_dim=0, sword=1)"
    one_block = _view("m[CTA,THREAD]", (32, 8))
    assert str(one_block.paper) == "Row(split_dim=0, sword=1)"
    assert all(d.kind == "whole" for d in one_block.dims)


def test_views_that_one_split_dim_and_sword_cannot_express_say_why():
    strided = _view("m[CTA_4-GRID,CTA]", (32, 8))
    assert strided.paper is None and strided.dims[0].kind == "interleaved"
    assert "strided subset" in strided.note
    both = _view("m[GRID_2-CTA,GRID_2-CTA]", (8, 8))
    assert both.paper is None and "dims [0, 1]" in both.note
    tail = _view("m[GRID-CTA_256]", (1000,))
    assert tail.paper is None and "Row(split_dim=0, sword=4)" in tail.note and "evenly" in tail.note
    assert str(tail.dims[0]) == "grid-split(4x256 of 1000)"


def test_block_footprint_of_a_root_follows_its_tiles():
    (sched,) = parse_template("m[GRID,GRID_4-CTA_64]; launch(blocks=1,threads=64)").schedules
    assert str(block_footprint(sched, (8, 256))) == "[b0 in [0,8), 64*b1+[0,64) in [0,256)]"
    (sched,) = parse_template("m[CTA_4-GRID]; launch(blocks=1,threads=32)").schedules
    assert str(block_footprint(sched, (30,))) == "[b0+8*[0,4) in [0,30)]"


# ----------------------------------------------------------------------------------------------
# Table 1, rule by rule, on hand-made graphs
# ----------------------------------------------------------------------------------------------


def _graph(build, shape=(8, 8)):
    """x (a parameter), e = exp(x), then ``build(b, x, e)`` gives the output."""
    b = GraphBuilder("rules")
    x = b.parameter(shape, F32, "x")
    e = b.node("exp", [x], name="e")
    return b.build([build(b, x, e)])


def _template(text: str) -> KernelSchedule:
    return parse_template(text if "launch" in text else f"{text}; launch(blocks=8,threads=32)")


def _check(graph, text):
    template = _template(text)
    return check_block_locality(graph, _nodes(graph), template), template


def _refused(graph, text, producer, consumer, rule, dims):
    reason, template = _check(graph, text)
    assert isinstance(reason, LocalityReason) and not reason, reason
    consumers = {consumer} if isinstance(consumer, str) else consumer
    assert (reason.producer, reason.rule, reason.dims) == (producer, rule, dims), reason
    assert reason.consumer in consumers, reason
    assert f"{producer} → {reason.consumer}" in str(reason)
    assert _refused_by_lowering(graph, _nodes(graph), template)
    return reason


def _accepted(graph, text):
    reason, _ = _check(graph, text)
    assert reason is None, reason


def test_elementwise_passes_the_footprint():
    graph = _graph(lambda b, x, e: b.select(b.compare("GT", e, x), b.node("neg", [e], name="out"), x))
    _accepted(graph, "e[GRID,CTA]S; select[GRID,CTA]")
    generate(graph, _nodes(graph), _template("e[GRID,CTA]S; select[GRID,CTA]"))
    _refused(graph, "e[GRID,CTA]S; select[CTA,GRID]", "e", {"compare", "out", "select"},
             "elementwise", (0,))


def test_transpose_permutes_the_split_dim():
    graph = _graph(lambda b, x, e: b.node("neg", [b.transpose(e, (1, 0))], name="out"))
    _accepted(graph, "e[GRID,CTA]S; out[CTA,GRID]")  # A's Row → Column
    _refused(graph, "e[GRID,CTA]S; out[GRID,CTA]", "e", "transpose", "transpose", (0,))


def test_reduce_needs_its_reduced_dims_whole_in_the_block():
    def row_scaled(dim):
        return lambda b, x, e: b.binary("mul", e, b.broadcast(b.reduce(e, [dim], "sum"), (8, 8), (1 - dim,)))

    rows, columns = _graph(row_scaled(1)), _graph(row_scaled(0))
    _accepted(rows, "e[GRID,CTA]S; mul[GRID,CTA]")
    # Column sums recomputed by every row's block need all of e's rows.
    _refused(columns, "e[GRID,CTA]S; mul[GRID,CTA]", "e", "reduce", "reduce", (0,))


def test_a_reduction_split_across_grid_holds_no_complete_result():
    b = GraphBuilder("split")
    x = b.parameter((4, 64), F32, "x")
    m = b.reduce(x, [1], "max")
    out = b.unary("exp", b.binary("sub", x, b.broadcast(m, (4, 64), (0,))))
    graph = b.build([out])
    nodes = _nodes(graph)
    _accepted(graph, "reduce[GRID,CTA_64]; exp[GRID,CTA_64]; launch(blocks=4,threads=64)")
    split = _template("reduce[GRID,GRID_2-CTA_32]; exp[GRID,GRID_2-CTA_32]")
    reason = propagate(graph, nodes, split)["reduce"]
    assert isinstance(reason, LocalityReason) and (reason.consumer, reason.rule, reason.dims) == \
        ("(its readers)", "reduce", (1,)), reason
    assert "no block holds a complete result" in str(reason)
    # Each block would subtract the max of its own half row: lowering refuses it, and so does the pre-check.
    assert check_block_locality(graph, nodes, split) is not None
    with pytest.raises(CodegenError, match="partial result"):
        generate(graph, nodes, split)
    stored = _graph(lambda b, x, e: b.reduce(e, [1], "sum"), (4, 64))
    _refused(stored, "e[GRID,GRID_2-CTA_32]S; reduce[GRID,GRID_2-CTA_32]",
             "reduce", "(kernel output)", "reduce", (1,))


def test_dot_general_may_split_batch_and_free_dims_not_contracting_ones():
    b = GraphBuilder("dot")
    q = b.parameter((4, 2, 8), F32, "q")
    k = b.parameter((4, 8, 16), F32, "k")
    d = b.node("dot_general", [q, k], lhs_batch=(0,), rhs_batch=(0,), lhs_contract=(2,), rhs_contract=(1,))
    graph = b.build([b.unary("exp", d)])
    _accepted(graph, "dot_general[GRID,THREAD,CTA,THREAD]S; exp[GRID,THREAD,CTA]")
    # A allows batch dims only; our dots compute each element in one thread, so a free dim may be split.
    _accepted(graph, "dot_general[GRID,GRID,CTA,THREAD]S; exp[GRID,GRID,CTA]")
    split = _template("dot_general[GRID,THREAD,CTA,GRID_2-THREAD]S; exp[GRID,THREAD,GRID_2-CTA]")
    reason = propagate(graph, _nodes(graph), split)["dot_general"]
    assert (reason.consumer, reason.rule, reason.dims) == ("(its readers)", "dot_general", (3,)), reason
    assert "contracting dims [3]" in str(reason) and check_block_locality(graph, _nodes(graph), split) is not None
    with pytest.raises(CodegenError, match="partial result"):  # partial sums
        generate(graph, _nodes(graph), split)


def test_reshape_transforms_split_dim_and_sword():
    graph = _graph(lambda b, x, e: b.node("neg", [b.reshape(e, (32,))], name="out"), (4, 8))
    _accepted(graph, "e[GRID,CTA]S; out[GRID-CTA_8]")
    reason = _refused(graph, "e[GRID,CTA]S; out[CTA_8-GRID]",
                      "e", "reshape", "reshape", (0,))
    # every row, strided columns
    assert "needs e[all(4), b0+4*[0,2) in [0,8)] but holds e[b0 in [0,4), all(8)]" in str(reason)
    merged = _graph(lambda b, x, e: b.node("neg", [b.reshape(e, (4, 8))], name="out"), (32,))
    _accepted(merged, "e[GRID-CTA_8]S; out[GRID,CTA]")
    _refused(merged, "e[GRID-CTA_8]S; out[CTA,GRID_4-THREAD]",
             "e", "reshape", "reshape", (0,))


def test_broadcast_drops_and_adds_dims():
    b = GraphBuilder("bcast")
    x = b.parameter((8, 8), F32, "x")
    mean = b.reduce(x, [1], "sum")
    out = b.binary("sub", x, b.broadcast(mean, (8, 8), (0,)))
    graph = b.build([out])
    _accepted(graph, "reduce[GRID,CTA]; sub[GRID,CTA]")
    _refused(graph, "reduce[GRID,CTA]; sub[CTA,GRID]",
             "reduce", "broadcast_in_dim", "broadcast", (0,))


def test_slice_concatenate_and_pad_shift_the_footprint():
    def roll(dim):
        def build(b, x, e):
            head = b.node("slice", [e], start=(1, 0) if dim == 0 else (0, 1), limit=(8, 8), stride=(1, 1))
            tail = b.node("slice", [e], start=(0, 0), limit=(1, 8) if dim == 0 else (8, 1), stride=(1, 1))
            return b.node("concatenate", [head, tail], dimension=dim)  # rows (dim 0) or columns rolled by 1
        return build

    _accepted(_graph(roll(1)), "e[GRID,CTA]S; concatenate[GRID,CTA]")
    _refused(_graph(roll(0)), "e[GRID,CTA]S; concatenate[GRID,CTA]",
             "e", {"slice", "slice_1"}, "slice", (0,))

    def shift(dim):
        low, high = [0, 0], [0, 0]
        low[dim], high[dim] = 1, -1
        return lambda b, x, e: b.node("pad", [e], low=low, high=high, interior=(0, 0), value=0.0)

    _accepted(_graph(shift(1)), "e[GRID,CTA]S; pad[GRID,CTA]")
    _refused(_graph(shift(0)), "e[GRID,CTA]S; pad[GRID,CTA]", "e", "pad", "pad", (0,))


def test_gathered_dims_are_unknown_and_never_refused():
    b = GraphBuilder("gather")
    table = b.parameter((10, 8), F32, "table")
    idx = b.parameter((3,), DType.I64, "idx")
    e = b.node("exp", [table], name="e")
    out = b.unary("neg", b.node("gather", [e, idx], axis=0, batch_dims=0))
    graph = b.build([out])
    template = _template("e[CTA,GRID]S; neg[CTA,GRID]")
    assert check_block_locality(graph, _nodes(graph), template) is None
    footprints = propagate(graph, _nodes(graph), template)
    assert str(footprints["gather"]) == "[all(3), b0 in [0,8)]"
    assert str(footprints["e"]) == "[all(10), b0 in [0,8)]"  # what the block holds; its need of row 0 is '?'
    # Lowering cannot prove the gathered read local either: it recomputes e at the gathered row
    # from the table instead of reading the shared copy.
    kernel = generate(graph, _nodes(graph), template)
    table_data = np.arange(80, dtype=np.float32).reshape(10, 8) / 40
    indices = np.array([7, 0, 3], dtype=np.int64)
    inputs = {"table": table_data, "idx": indices}
    got = kernel.simulate([inputs[name] for name in kernel.inputs])[0]
    np.testing.assert_allclose(got, -np.exp(table_data[indices]), rtol=1e-6)


def _outputs_across(graph, nodes, template: KernelSchedule) -> KernelSchedule:
    """Row x column patterns: the inner groups a row per block, the outputs a column per block."""
    outputs = {o.name for o in resolve_pattern(graph, nodes).outputs}
    rows, columns = ((Tile(Level.GRID),), (Tile(Level.CTA),)), ((Tile(Level.CTA),), (Tile(Level.GRID),))
    return KernelSchedule(tuple(Schedule(s.root, columns if s.root in outputs else rows, s.shared)
                                for s in template.schedules), template.launch)


def test_propagate_gives_every_node_its_need_and_the_refused_producer_its_reason():
    graph = TC.layernorm("f32", 32, 32).graph
    nodes = _nodes(graph)
    template = default_template(graph, nodes)
    footprints = propagate(graph, nodes, template)
    assert set(footprints) == {n.name for n in nodes}
    assert all(isinstance(f, Footprint) for f in footprints.values()), footprints
    assert str(footprints[template.schedules[0].root]).startswith("[8*b0+[0,8) in [0,32)")  # 8 rows a block
    footprints = propagate(graph, nodes, _outputs_across(graph, nodes, template))
    refused = {name: v for name, v in footprints.items() if isinstance(v, Reason)}
    assert refused and all(not r and graph.node(name).op == "reduce" for name, r in refused.items()), refused
    assert all(isinstance(v, Footprint) for name, v in footprints.items() if name not in refused)


# ----------------------------------------------------------------------------------------------
# Agreement with lowering
# ----------------------------------------------------------------------------------------------


_TILINGS = [(Tile(Level.GRID),), (Tile(Level.CTA),), (Tile(Level.THREAD),),
            (Tile(Level.GRID, 2), Tile(Level.CTA)), (Tile(Level.CTA, 2), Tile(Level.GRID)),
            (Tile(Level.GRID), Tile(Level.CTA, 32)), (Tile(Level.GRID), Tile(Level.THREAD, 2))]


def _mutations(template: KernelSchedule, rng: random.Random, count: int) -> list[KernelSchedule]:
    """Templates differing from ``template`` in one or two dims' tiles (or two dims swapped) or ``S``
    marks."""
    result = []
    for _ in range(count):
        schedules = list(template.schedules)
        for _ in range(rng.randint(1, 2)):
            k = rng.randrange(len(schedules))
            s = schedules[k]
            dims = list(s.dims)
            if len(dims) >= 2 and rng.random() < 0.3:  # swap two dims: same GRID extents on square shapes
                i, j = rng.sample(range(len(dims)), 2)
                dims[i], dims[j] = dims[j], dims[i]
            elif dims:
                dims[rng.randrange(len(dims))] = rng.choice(_TILINGS)
            schedules[k] = Schedule(s.root, tuple(dims), s.shared != (rng.random() < 0.25))
        # The same tiling on every group keeps the grid shared, so the footprints themselves decide.
        if rng.random() < 0.5 and all(len(s.dims) == len(schedules[0].dims) for s in schedules):
            schedules = [Schedule(s.root, schedules[0].dims, s.shared) for s in schedules]
        result.append(KernelSchedule(tuple(schedules), template.launch))
    return result


def _codegen_cases():
    cases = [C.bias_gelu("f32", 37, 70), C.relu_transpose("f32", 64, 32), C.strided_inputs("f32"),
             C.one_element_dims("f32"), C.slice_cat_pad("f32"), C.gather_reshape_iota("f32"),
             C.softmax_rows("f32", 16, 128)]
    cases += [C.hand_built(F32, name) for name in ("rng", "int_ops", "pad_interior", "column_sum",
                                                   "packed_shapes")]
    for shape in ((5, 20), (37, 70), (3, 1500), (32, 32)):
        cases += [TC.softmax("f32", *shape), TC.layernorm("f32", *shape), TC.row_sum("f32", *shape)]
    cases.append(TC.din_attention("f32", 4, 50))
    return [(case.name, case.graph, _nodes(case.graph), case.templates) for case in cases]


@functools.cache
def _workload_patterns():
    from fusionstitching.cli import capture_workload
    from fusionstitching.fusion import explore

    found = []
    for name in ("layernorm_train", "softmax_scale_mask", "bias_gelu", "mlp_train", "din_attention"):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            _, captured = capture_workload(name)
        for graph in (captured.forward, captured.backward):
            if graph is None:
                continue
            plan = explore(graph)  # the plan's graph: reductions may have been split
            for k, pattern in enumerate(plan.patterns):
                found.append((f"{name}/{graph.name}/{k}", plan.graph, list(pattern.nodes),
                              [str(pattern.schedule)]))
    return found


def _agreement(patterns, mutations: int, seed: int) -> tuple[int, int]:
    rng = random.Random(seed)
    refused = checked = 0
    for name, graph, nodes, texts in patterns:
        pattern = resolve_pattern(graph, nodes)
        base = [parse_template(t) for t in texts]
        for make in _candidate_templates(pattern):
            try:
                base.append(make())
            except ValueError:
                pass
        templates = base + [m for t in base for m in _mutations(t, rng, mutations)]
        for template in templates:
            reason = check_block_locality(graph, nodes, template)
            checked += 1
            if reason is not None:
                refused += 1
                assert _refused_by_lowering(graph, nodes, template), f"{name}: {template}: {reason}"
    return refused, checked


def test_every_refusal_on_the_codegen_cases_is_one_of_lowering():
    refused, checked = _agreement(_codegen_cases(), mutations=6, seed=0)
    print(f"pre-check refused {refused} of {checked} templates")
    assert refused >= 20


def test_every_refusal_on_the_workloads_fused_patterns_is_one_of_lowering():
    patterns = _workload_patterns()
    assert len(patterns) >= 8
    refused, checked = _agreement(patterns, mutations=6, seed=1)
    print(f"pre-check refused {refused} of {checked} templates")
    assert refused >= 5


def test_deliberately_non_local_templates_are_refused_by_both():
    for rows, cols in ((8, 8), (32, 32)):
        for case in (TC.softmax("f32", rows, cols), TC.layernorm("f32", rows, cols)):
            graph, nodes = case.graph, _nodes(case.graph)
            across = _outputs_across(graph, nodes, default_template(graph, nodes))
            reason = check_block_locality(graph, nodes, across)
            assert reason is not None and reason.rule in ("broadcast", "reshape"), reason
            assert reason.dims == (0,) and reason.producer.startswith("reduce"), reason
            with pytest.raises(CodegenError, match="block locality"):
                generate(graph, nodes, across)


def test_candidates_that_lower_are_never_refused():
    for name, graph, nodes, _ in _codegen_cases() + _workload_patterns():
        for make in _candidate_templates(resolve_pattern(graph, nodes)):
            try:
                template = make()
                generate(graph, nodes, template, vectorize=False)
            except (CodegenError, ValueError):
                continue
            assert check_block_locality(graph, nodes, template) is None, (name, str(template))


_SQUARE = 8


@st.composite
def _random_kernels(draw):
    """A random n x n pattern (exp, transpose, row/column sums broadcast back, a roll, a reshape round
    trip) and a template whose groups share one GRID extent but not necessarily the same dims."""
    b = GraphBuilder("random")
    n = _SQUARE
    x = b.parameter((n, n), F32, "x")
    values = [x]
    for _ in range(draw(st.integers(1, 5))):
        a = draw(st.sampled_from(values))
        kind = draw(st.sampled_from(["exp", "add", "transpose", "rowsum", "colsum", "roll", "reshape"]))
        if kind == "exp":
            values.append(b.unary("exp", a))
        elif kind == "add":
            values.append(b.binary("add", a, draw(st.sampled_from(values))))
        elif kind == "transpose":
            values.append(b.unary("neg", b.transpose(a, (1, 0))))
        elif kind in ("rowsum", "colsum"):
            dim = 1 if kind == "rowsum" else 0
            values.append(b.binary("mul", a, b.broadcast(b.reduce(a, [dim], "sum"), (n, n), (1 - dim,))))
        elif kind == "roll":
            dim = draw(st.integers(0, 1))
            lo = tuple(1 if d == dim else 0 for d in range(2))
            head = b.node("slice", [a], start=lo, limit=(n, n), stride=(1, 1))
            tail = b.node("slice", [a], start=(0, 0), limit=tuple(1 if d == dim else n for d in range(2)),
                          stride=(1, 1))
            values.append(b.node("concatenate", [head, tail], dimension=dim))
        else:
            values.append(b.unary("abs", b.reshape(b.reshape(a, (n // 2, 2 * n)), (n, n))))
    graph = b.build([values[-1]])
    nodes = _nodes(graph)
    pattern = resolve_pattern(graph, nodes)
    outputs = {o.name for o in pattern.outputs}
    inner = [v.name for v in pattern.nodes if v.op in ("exp", "reduce") and v.name not in outputs]
    chosen = set(draw(st.lists(st.sampled_from(inner)))) if inner else set()
    roots = [v for v in pattern.nodes if v.name in outputs or v.name in chosen]
    tilings = [((Tile(Level.GRID),), (Tile(Level.CTA),)), ((Tile(Level.CTA),), (Tile(Level.GRID),)),
               ((Tile(Level.GRID),), (Tile(Level.THREAD),)), ((Tile(Level.THREAD),), (Tile(Level.GRID),))]
    schedules = [Schedule(r.name, draw(st.sampled_from(tilings)), r.op == "exp" and draw(st.booleans()))
                 for r in roots]
    return graph, nodes, KernelSchedule(tuple(schedules), Launch(n, 32))


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_random_kernels())
def test_random_templates_are_refused_only_when_lowering_refuses(sample):
    graph, nodes, template = sample
    reason = check_block_locality(graph, nodes, template)
    if reason is not None:
        assert str(reason).startswith("block locality:")
        assert _refused_by_lowering(graph, nodes, template), f"{template}: {reason}"


# ----------------------------------------------------------------------------------------------
# Cost, and use in feasible
# ----------------------------------------------------------------------------------------------


def test_the_check_is_cheap_on_a_layernorm_pattern():
    graph = TC.layernorm("f32", 64, 256).graph
    nodes = _nodes(graph)
    pattern = resolve_pattern(graph, nodes)
    assert 15 <= len(nodes) <= 40

    def ms(call) -> float:
        return min(timeit.repeat(call, number=200, repeat=5)) / 200 * 1000

    for make in list(_candidate_templates(pattern)):
        try:
            template = make()
        except ValueError:
            continue
        given = ms(functools.partial(check_block_locality, graph, nodes, template, pattern=pattern))
        resolving = ms(functools.partial(check_block_locality, graph, nodes, template))
        print(f"check_block_locality: {given:.3f} ms ({resolving:.3f} ms resolving the pattern), "
              f"{len(nodes)} nodes, {template}")
        assert given < 0.5


def test_feasible_refuses_with_the_pre_check_and_still_builds_what_it_returns():
    b = GraphBuilder("rowcol")
    x = b.parameter((16, 40), F32, "x")
    rows = b.reduce(x, [1], "sum")
    cols = b.reduce(x, [0], "sum")
    graph = b.build([b.binary("add", b.broadcast(rows, (16, 40), (0,)), b.broadcast(cols, (16, 40), (1,)))])
    nodes = _nodes(graph)
    answer = feasible(graph, nodes)
    assert answer and check_block_locality(graph, nodes, answer) is None
    generate(graph, nodes, answer)
    for make in _candidate_templates(resolve_pattern(graph, nodes)):
        try:
            template = make()
        except ValueError:
            continue
        if check_block_locality(graph, nodes, template) is not None:
            with pytest.raises(CodegenError):
                generate(graph, nodes, template)
