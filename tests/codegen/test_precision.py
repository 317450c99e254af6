"""Half-bound values (``codegen/precision.py``): exp and sigmoid take the approximate instructions
only where every use of the value ends in a half-precision result through continuous ops."""

from __future__ import annotations

from fusionstitching.codegen import default_template, generate
from fusionstitching.codegen.precision import half_bound
from fusionstitching.graph.graph import GraphBuilder
from fusionstitching.graph.ops import DType
from fusionstitching.graph.pattern import resolve_pattern

from . import cases as C

F32, BF16 = DType.F32, DType.BF16


def _bound_ops(graph) -> set[str]:
    nodes = [n for n in graph.nodes if n.op != "parameter"]
    bound = half_bound(graph, resolve_pattern(graph, nodes))
    return {n.name for n in nodes if id(n) in bound}


def _source(graph) -> str:
    nodes = [n for n in graph.nodes if n.op != "parameter"]
    return generate(graph, nodes, default_template(graph, nodes)).cuda_source


def _silu(out_dtype: DType):
    b = GraphBuilder("silu")
    x = b.parameter((4, 64), BF16, "x")
    up = b.convert(x, F32)
    s = b.unary("sigmoid", up)
    y = b.binary("mul", up, s)
    return b, s, y if out_dtype == F32 else b.convert(y, out_dtype)


def test_a_sigmoid_rounded_to_bf16_is_approximate_and_one_kept_in_f32_is_exact():
    b, s, out = _silu(BF16)
    graph = b.build([out])
    assert s.name in _bound_ops(graph)
    source = _source(graph)
    assert "__fdividef(1.0f, 1.0f + __expf(" in source and "expf(-" not in source.replace("__expf(-", "")

    b, s, out = _silu(F32)
    graph = b.build([out])
    assert _bound_ops(graph) == set()
    source = _source(graph)
    assert "__expf" not in source and "__fdividef" not in source and "expf(" in source


def test_a_value_that_a_comparison_or_an_f32_output_reads_is_exact():
    for reader in ("compare", "f32 output", "sin", "floor", "max"):
        b = GraphBuilder("mixed")
        x = b.parameter((4, 64), BF16, "x")
        e = b.unary("exp", b.convert(x, F32))
        half = b.convert(e, BF16)
        if reader == "compare":
            other = b.select(b.compare("GT", e, b.broadcast(b.constant(1.0, F32), (4, 64), ())), x, half)
        elif reader == "f32 output":
            other = b.reduce(e, [1], "sum")
        elif reader == "max":  # amax's backward compares the maximum with a recomputed exact value
            other = b.convert(b.reduce(e, [1], "max"), BF16)
        else:
            other = b.convert(b.unary(reader, e), BF16)
        graph = b.build([half, other])
        assert e.name not in _bound_ops(graph), reader
        assert "__expf" not in _source(graph), reader


def test_a_bf16_softmax_exponential_is_approximate_through_its_sum_and_division():
    case = C.softmax_rows("bf16", 5, 40)
    exps = [n.name for n in case.graph.nodes if n.op == "exp"]
    assert exps and set(exps) <= _bound_ops(case.graph)
    assert "__expf" in _source(case.graph)
    assert "__expf" not in _source(C.softmax_rows("f32", 5, 40).graph)
