"""Property tests: ``explore`` on random small DAGs of elementwise ops and row reductions.

Every plan is disjoint, covers every fusable node (in a kernel or a view), contracts to a DAG, is
the same on a second run (and on a copy of the graph), and every kernel is accepted by ``schedule.feasible``; run on the
simulator, the plan computes what the reference computes.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fusionstitching.fusion import baseline, explore
from fusionstitching.graph import reference
from fusionstitching.graph.graph import Graph, GraphBuilder
from fusionstitching.graph.ops import DType
from fusionstitching.graph.serialize import from_json

from .helpers import assert_close, check_baseline_rules, check_plan, fusable_names, run_plan, same_plan

SHAPE = (8, 32)
BINARY = ("add", "mul", "max")


@st.composite
def random_graphs(draw) -> Graph:
    """1-3 parameters of SHAPE, then 2-10 steps: exp, a binary op, or a reduction over the last dim
    (sum or max) broadcast back to SHAPE. Outputs: every node nobody uses, plus a few others."""
    b = GraphBuilder("random")
    values = [b.parameter(SHAPE, DType.F32, f"p{i}") for i in range(draw(st.integers(1, 3)))]
    for _ in range(draw(st.integers(2, 10))):
        kind = draw(st.sampled_from(["exp", "binary", "binary", "reduce"]))
        if kind == "exp":
            values.append(b.unary("exp", draw(st.sampled_from(values))))
        elif kind == "binary":
            x, y = draw(st.sampled_from(values)), draw(st.sampled_from(values))
            values.append(b.binary(draw(st.sampled_from(BINARY)), x, y))
        else:
            r = b.reduce(draw(st.sampled_from(values)), (1,), draw(st.sampled_from(["sum", "max"])))
            values.append(b.broadcast(r, SHAPE, (0,)))
    computed = values[sum(1 for v in values if v.op == "parameter"):]
    used = {id(o) for v in computed for o in v.operands}
    outputs = [v for v in computed if id(v) not in used]
    extra = draw(st.lists(st.sampled_from(computed), max_size=2, unique_by=id))
    outputs += [v for v in extra if all(v is not o for o in outputs)]
    return b.build(outputs)


def _arrays(graph: Graph) -> list[np.ndarray]:
    rng = np.random.default_rng(0)
    return [rng.uniform(-1.0, 1.0, p.shape).astype(np.float32) for p in graph.parameters]


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(random_graphs())
def test_plans_are_disjoint_covering_acyclic_feasible_and_deterministic(graph):
    plan = explore(graph)
    check_plan(plan)
    covered = {n for p in plan.patterns for n in p.nodes} | set(plan.views)
    assert covered == set(fusable_names(plan.graph)), plan.explain()  # no library calls here
    assert same_plan(plan, explore(graph))
    assert same_plan(plan, explore(from_json(graph.to_json())))  # fresh node objects, same plan
    rules = baseline(graph)
    check_plan(rules)
    check_baseline_rules(rules)
    assert same_plan(rules, baseline(graph))


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(random_graphs())
def test_plans_compute_what_the_reference_computes(graph):
    plan = explore(graph)
    arrays = _arrays(graph)
    for k, (got, want) in enumerate(zip(run_plan(plan, arrays), reference.evaluate(graph, arrays))):
        assert_close(got, want, f"output {k} of\n{graph}\n{plan.explain()}", rtol=1e-3)


GENERATOR_SETS = (("substitution",), ("deep",), ("exploratory",), ("dp",), ("deep", "merging", "remote"),
                  ("substitution", "merging", "packing", "remote"),
                  ("substitution", "deep", "exploratory", "dp", "merging", "packing", "remote"))


@pytest.mark.parametrize("solver", ["ilp", "beam"])
@pytest.mark.parametrize("generators", GENERATOR_SETS, ids=lambda g: "+".join(g))
@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(graph=random_graphs())
def test_every_generator_and_selector_gives_valid_deterministic_plans(generators, solver, graph):
    plan = explore(graph, solver=solver, generators=generators)
    check_plan(plan)
    covered = {n for p in plan.patterns for n in p.nodes} | set(plan.views)
    assert covered == set(fusable_names(plan.graph)), plan.explain()
    assert same_plan(plan, explore(from_json(graph.to_json()), solver=solver, generators=generators))
    assert plan.estimated_us is not None and plan.estimated_us > 0
    arrays = _arrays(graph)
    for k, (got, want) in enumerate(zip(run_plan(plan, arrays), reference.evaluate(graph, arrays))):
        assert_close(got, want, f"output {k} of\n{graph}\n{plan.explain()}", rtol=1e-3)
