"""``schedule.feasible`` asks the code generator last, through a registered check: schedule stands
below codegen and cannot import it (``tests/test_layers.py``)."""

from __future__ import annotations

from fusionstitching.codegen.generate import generate, lowering_refusal
from fusionstitching.graph.graph import GraphBuilder
from fusionstitching.graph.ops import DType
from fusionstitching.schedule import grouping
from fusionstitching.schedule.grouping import Reason, feasible
from fusionstitching.schedule.template import format_template


def _softmax_rows():
    b = GraphBuilder("softmax_rows")
    x = b.parameter((8, 1024), DType.F32, "x")
    top = b.reduce(x, [1], "max")
    e = b.unary("exp", b.binary("sub", x, b.broadcast(top, (8, 1024), [0])))
    y = b.binary("div", e, b.broadcast(b.reduce(e, [1], "sum"), (8, 1024), [0]))
    graph = b.build([y])
    return graph, [n for n in graph.nodes if n.op != "parameter"]


def test_the_package_registers_the_code_generators_check():
    assert grouping._LOWERING, "importing fusionstitching registers codegen's LoweringCheck"
    graph, nodes = _softmax_rows()
    schedule_only = feasible(graph, nodes, 64, lowers=lambda *args: None)
    assert lowering_refusal(graph, nodes, grouping.resolve_pattern(graph, nodes), schedule_only, 64) is not None
    chosen = feasible(graph, nodes, 64)  # 64 bytes of shared memory: the default's cross-warp sums do not fit
    assert chosen and format_template(chosen) != format_template(schedule_only)
    assert generate(graph, nodes, chosen, smem_limit=64).cuda_source


def test_a_refusal_of_the_check_passes_over_each_candidate_and_the_first_reason_stands():
    graph, nodes = _softmax_rows()
    asked: list[str] = []

    def refuse(graph, nodes, pattern, template, smem_limit):
        asked.append(format_template(template))
        return Reason(f"refused {len(asked)}")

    answer = feasible(graph, nodes, lowers=refuse)
    assert not answer and str(answer) == "refused 1"
    assert len(asked) >= 2 and len(set(asked)) == len(asked)  # every candidate template asked once
