"""``explore.transfer``: another shape specialization of a graph planned with the patterns of an
explored plan, each checked again at the new shapes; None where that does not hold."""

from __future__ import annotations

import warnings

import numpy as np
import pytest

from fusionstitching.bench import workloads as W
from fusionstitching.frontend.torch_fx import capture
from fusionstitching.fusion.explore import DEFAULT_GENERATORS, explore, transfer
from fusionstitching.options import Options
from tests.fusion.helpers import check_plan, random_arrays, run_plan


def _bert(seq: int):
    workload = W.bert(batch=2, seq=seq, hidden=64, layers=2, heads=2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return capture(workload.fn, *workload.inputs, name="bert").forward


@pytest.fixture(scope="module")
def planned():
    return explore(_bert(32), options=Options(), generators=DEFAULT_GENERATORS)


def test_a_plan_transfers_to_another_sequence_length_and_computes_its_graph(planned):
    graph = _bert(17)
    moved = transfer(planned, graph, Options())
    assert moved is not None and moved.transferred and not planned.transferred
    check_plan(moved)
    assert [p.nodes for p in moved.patterns] == [p.nodes for p in planned.patterns]
    assert {n.shape for n in moved.graph.nodes} != {n.shape for n in planned.graph.nodes}  # its own shapes
    # every kernel against the reference; token ids and types 0 (in range of any table)
    arrays = [a if a.dtype.kind == "f" else np.zeros_like(a) for a in random_arrays(moved.graph)]
    run_plan(moved, arrays, rtol=1e-4)
    explored = explore(graph, options=Options(), generators=DEFAULT_GENERATORS)
    assert moved.kernel_count == explored.kernel_count
    assert moved.estimated_us == pytest.approx(explored.estimated_us, rel=0.05)


def test_a_pattern_that_is_not_legal_at_the_new_shapes_refuses_the_transfer(planned):
    """At 48 tokens one of the 32-token plan's patterns has no template the schedule accepts (its
    groups' grid tilings no longer agree): exploration plans that shape instead."""
    assert transfer(planned, _bert(48), Options()) is None


def test_a_graph_of_another_structure_refuses_the_transfer(planned):
    workload = W.bert(batch=2, seq=32, hidden=64, layers=3, heads=2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        other = capture(workload.fn, *workload.inputs, name="bert").forward
    assert transfer(planned, other, Options()) is None
