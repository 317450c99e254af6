"""What every fusion plan must satisfy, and how to run a plan's kernels on the CPU simulator.

``check_plan`` asserts the invariants of DESIGN.md "Fusion exploration": disjoint patterns whose
nodes are listed in graph order, every fusable node in exactly one pattern, view or library call,
an acyclic contracted graph, schedules the schedule stage accepts, an explanation that names every
kernel, and a reason on every edge left between two kernels.

``check_kernels`` generates each pattern's kernel with the schedule the plan chose and simulates
it on the reference values of its inputs; ``run_plan`` executes the whole plan (kernels simulated,
library calls and views by the reference evaluator) and returns the graph's outputs.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from fusionstitching.codegen.generate import GeneratedKernel, generate
from fusionstitching.fusion import FusionPlan
from fusionstitching.fusion.select import contracted_cycle
from fusionstitching.graph import reference
from fusionstitching.graph.graph import Graph, GraphBuilder, Node
from fusionstitching.graph.ops import Category, DType
from fusionstitching.schedule import feasible

INPUT_OPS = ("parameter", "constant")
# the plan's view steps: graph.ops.VIEW_OPS, and the slice of a padded GEMM product saved for the
# backward in the product's layout (fusion/padding.py)
VIEW_OPS = ("reshape", "transpose", "broadcast_in_dim", "slice")
BASELINE_PRODUCERS = (Category.LIGHT_ELEMENTWISE, Category.SHAPE, Category.RANDOM)


def fusable_names(graph: Graph) -> list[str]:
    return [n.name for n in graph.nodes if n.op not in INPUT_OPS]


def pattern_names(plan: FusionPlan) -> list[tuple[str, ...]]:
    return [p.nodes for p in plan.patterns]


def check_plan(plan: FusionPlan, check_feasible: bool = True) -> None:
    """Assert the invariants every plan has (see the module docstring)."""
    graph = plan.graph
    position = graph.index.position
    owner: dict[str, int] = {}
    for k, pattern in enumerate(plan.patterns):
        assert pattern.nodes, f"kernel {k} is empty"
        for name in pattern.nodes:
            assert name not in owner, f"{name} is in kernels {owner[name]} and {k}"
            owner[name] = k
        nodes = [graph.node(n) for n in pattern.nodes]
        assert [position[n] for n in nodes] == sorted(position[n] for n in nodes), \
            f"kernel {k} is not in graph order: {pattern.nodes}"
        assert all(n.op not in INPUT_OPS for n in nodes), f"kernel {k} computes an input: {pattern.nodes}"
        assert pattern.schedule is not None, f"kernel {k} has no schedule"
    assert plan.kernel_count == len(plan.patterns)
    assert plan.library_count == len(plan.library)
    for name in fusable_names(graph):
        roles = [name in owner, name in plan.views, name in plan.library]
        assert sum(roles) == 1, f"{name}: in a kernel {roles[0]}, a view {roles[1]}, a library call {roles[2]}"
    for name, why in list(plan.views.items()) + list(plan.library.items()):
        assert graph.node(name).op not in INPUT_OPS and why.strip(), (name, why)
    for name in plan.views:
        assert graph.node(name).op in VIEW_OPS, f"view {name} is a {graph.node(name).op}"
    groups = [[graph.node(n) for n in p.nodes] for p in plan.patterns]
    assert contracted_cycle(graph, groups) is None, "the contracted graph has a cycle"
    if check_feasible:
        for k, nodes in enumerate(groups):
            verdict = feasible(graph, nodes)
            assert verdict, f"kernel {k} {plan.patterns[k].nodes}: {verdict}"
    text = plan.explain()
    for k, pattern in enumerate(plan.patterns):
        assert f"kernel {k}: " in text and f"nodes: {', '.join(pattern.nodes)}" in text
    _check_unfused_edges(plan, owner)


def _check_unfused_edges(plan: FusionPlan, owner: dict[str, int]) -> None:
    """Every producer→consumer edge between two different kernels (or a kernel and a library call or
    view) is explained, with a reason, once; no other edge is."""
    graph = plan.graph
    expected = set()
    for consumer in graph.nodes:
        if consumer.op in INPUT_OPS:
            continue
        for producer in consumer.operands:
            if producer.op in INPUT_OPS:
                continue
            a, b = owner.get(producer.name), owner.get(consumer.name)
            if a is None or a != b:
                expected.add((producer.name, consumer.name))
    listed = [(e.producer, e.consumer) for e in plan.unfused]
    assert len(listed) == len(set(listed)), "an edge is explained twice"
    assert set(listed) == expected
    for edge in plan.unfused:
        assert edge.reason.strip(), f"{edge.producer} -> {edge.consumer} has no reason"


def check_baseline_rules(plan: FusionPlan) -> None:
    """The XLA-like rules of ``baseline``: inside a kernel, only light elementwise, shape and random
    ops are producers, and a producer's users are all in its kernel."""
    graph = plan.graph
    for pattern in plan.patterns:
        members = set(pattern.nodes)
        for name in pattern.nodes:
            users = [u.name for u in graph.index.users[graph.node(name)]]
            inside = [u for u in users if u in members]
            if not inside:
                continue
            assert graph.node(name).category in BASELINE_PRODUCERS, f"{name} is a producer inside {pattern.nodes}"
            assert len(inside) == len(users), f"{name} has users outside its kernel {pattern.nodes}"


def same_plan(a: FusionPlan, b: FusionPlan) -> bool:
    return (pattern_names(a) == pattern_names(b) and a.library == b.library and a.views == b.views
            and [p.schedule for p in a.patterns] == [p.schedule for p in b.patterns])


# ----------------------------------------------------------------------------------------------
# Running plans on the simulator
# ----------------------------------------------------------------------------------------------


def node_values(graph: Graph, arrays: Sequence) -> dict[str, np.ndarray]:
    """The reference value of every node of ``graph`` for ``arrays`` (in parameter order)."""
    everything = Graph(graph.parameters, list(graph.nodes), name=graph.name)
    values = reference.evaluate(everything, arrays)
    return {node.name: value for node, value in zip(everything.outputs, values)}


def kernel_of(plan: FusionPlan, k: int) -> GeneratedKernel:
    pattern = plan.patterns[k]
    return generate(plan.graph, pattern.nodes, pattern.schedule)


def assert_close(got: np.ndarray, want: np.ndarray, what: str, rtol: float = 1e-4) -> None:
    assert got.shape == want.shape and got.dtype == want.dtype, \
        f"{what}: {got.dtype}{list(got.shape)} vs {want.dtype}{list(want.shape)}"
    got64, want64 = got.astype(np.float64), want.astype(np.float64)
    finite = np.abs(want64[np.isfinite(want64)])
    scale = max(finite.max(initial=0.0), 1.0)
    np.testing.assert_allclose(got64, want64, rtol=rtol, atol=rtol * scale, err_msg=what)


def check_kernels(plan: FusionPlan, arrays: Sequence, rtol: float = 1e-4) -> int:
    """Simulate every kernel of ``plan`` on the reference values of its inputs and compare its
    outputs with the reference; returns the number of kernels checked."""
    values = node_values(plan.graph, arrays)
    for k in range(plan.kernel_count):
        kernel = kernel_of(plan, k)
        got = kernel.simulate([values[name] for name in kernel.inputs])
        assert kernel.outputs, f"kernel {k} has no outputs"
        for name, value in zip(kernel.outputs, got):
            assert_close(value, values[name], f"kernel {k} ({plan.patterns[k].nodes}) output {name}", rtol)
    return plan.kernel_count


def run_plan(plan: FusionPlan, arrays: Sequence, rtol: float | None = None) -> list[np.ndarray | None]:
    """The graph's outputs computed the way the plan runs: each kernel simulated once all its inputs
    exist, every other node (library calls, views) by the reference evaluator. With ``rtol``, every
    kernel's outputs are also compared with the reference values of those nodes as they come."""
    graph = plan.graph
    expected = node_values(graph, arrays) if rtol is not None else {}
    values: dict[Node, np.ndarray] = {p: np.asarray(a) for p, a in zip(graph.parameters, arrays)}
    owner = {graph.node(name): k for k, p in enumerate(plan.patterns) for name in p.nodes}
    kernels = {k: kernel_of(plan, k) for k in range(plan.kernel_count)}
    done: set[int] = set()
    pending = [n for n in graph.nodes if n not in values]
    while pending:
        remaining = []
        for node in pending:
            k = owner.get(node)
            if k is None:
                if all(o in values for o in node.operands):
                    values[node] = _evaluate_alone(node, [values[o] for o in node.operands])
                else:
                    remaining.append(node)
            elif k not in done:
                kernel = kernels[k]
                inputs = [graph.node(name) for name in kernel.inputs]
                if all(i in values or i.op == "constant" for i in inputs):
                    args = [values[i] if i in values else i.attrs["value"] for i in inputs]
                    for name, value in zip(kernel.outputs, kernel.simulate(args)):
                        values[graph.node(name)] = value
                        if rtol is not None:
                            assert_close(value, expected[name], f"kernel {k} {plan.patterns[k].nodes} output {name}",
                                         rtol)
                    done.add(k)
                else:
                    remaining.append(node)
        assert len(remaining) < len(pending), f"the plan cannot make progress at {remaining[:5]}"
        pending = remaining
    assert done == set(kernels), "some kernels never ran"
    return [None if out is None else values[out] for out in graph.outputs]


def _evaluate_alone(node: Node, operands: list[np.ndarray]) -> np.ndarray:
    """The reference value of one node given its operands' values (a one-node graph)."""
    b = GraphBuilder("one")
    params = [b.parameter(o.shape, o.dtype, f"in{i}") for i, o in enumerate(node.operands)]
    copy = Node(node.name, node.op, tuple(params), node.shape, node.dtype, node.attrs)
    (value,) = reference.evaluate(b.build([copy]), operands)
    return value


def random_arrays(graph: Graph, seed: int = 0) -> list[np.ndarray]:
    """Random inputs for ``graph``'s parameters (floats standard normal, ints small, bools random)."""
    rng = np.random.default_rng(seed)
    arrays = []
    for p in graph.parameters:
        if p.dtype.is_float:
            arrays.append(rng.standard_normal(p.shape).astype(p.dtype.numpy))
        elif p.dtype == DType.BOOL:
            arrays.append(rng.random(p.shape) < 0.5)
        else:
            arrays.append(rng.integers(0, 4, p.shape).astype(p.dtype.numpy))
    return arrays
