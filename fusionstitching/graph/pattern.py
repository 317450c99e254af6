"""The vocabulary shared by schedule, fusion and codegen about what a kernel computes: the pattern
of nodes one kernel computes (``resolve_pattern``: its inputs and outputs), which nodes are
reductions (``reduce`` and ``dot_general``, a sum over its contracting dims), the dims they reduce,
and the iteration space a root's schedule tiles."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from fusionstitching.graph.graph import Graph, Node
from fusionstitching.graph.ops import Category

_NOT_COMPUTED = (Category.PARAMETER, Category.LIBRARY)


class PatternError(ValueError):
    """Nodes that are no kernel's pattern (not of the graph, not computable, no output); names the
    node. Code generation's own refusals (``codegen.values.CodegenError``) are a kind of it."""


@dataclass(frozen=True)
class Pattern:
    """The nodes a kernel computes, its external inputs and its outputs, in graph order."""

    nodes: tuple[Node, ...]
    inputs: tuple[Node, ...]
    outputs: tuple[Node, ...]


def resolve_pattern(graph: Graph, nodes: Iterable[Node | str]) -> Pattern:
    index = graph.index
    chosen: set[Node] = set()
    for item in nodes:
        node = index.by_name.get(item) if isinstance(item, str) else item
        if node is None or index.by_name.get(node.name) is not node:
            raise PatternError(f"{item!r} is not a node of graph {graph.name}")
        if node.category in _NOT_COMPUTED:
            raise PatternError(f"node {node.name} ({node.op}) cannot be computed inside a kernel")
        chosen.add(node)
    if not chosen:
        raise PatternError("empty pattern")
    ordered = sorted(chosen, key=index.position.__getitem__)
    used_outside = {id(n) for n in ordered
                    if id(n) in index.output_ids or any(u not in chosen for u in index.users[n])}
    inputs: list[Node] = []
    seen: set[int] = set()
    for node in ordered:
        for operand in node.operands:
            if operand in chosen or id(operand) in seen:
                continue
            if operand.op == "constant" and operand.attrs["value"].ndim == 0:
                continue  # scalar constants are inlined
            inputs.append(operand)
            seen.add(id(operand))
    outputs = [n for n in ordered if id(n) in used_outside]
    if not outputs:
        raise PatternError("the pattern has no output")
    return Pattern(tuple(ordered), tuple(inputs), tuple(outputs))


def is_reduction(node: Node) -> bool:
    """Reductions in the wide sense: ``reduce``, and ``dot_general`` (a sum over its contracting dims)."""
    return node.op in ("reduce", "dot_general")


def reduction_space(node: Node) -> tuple[int, ...]:
    """The iteration space of a reduction: the operand's dims for a reduce; for a dot, its output dims
    followed by its contracting dims."""
    if node.op == "reduce":
        return node.operands[0].shape
    lhs = node.operands[0]
    return node.shape + tuple(lhs.shape[d] for d in node.attrs["lhs_contract"])


def reduced_dims(node: Node) -> tuple[int, ...]:
    if node.op == "reduce":
        return tuple(node.attrs["dims"])
    return tuple(range(len(node.shape), len(node.shape) + len(node.attrs["lhs_contract"])))


def reduction_kind(node: Node) -> str:
    return node.attrs["kind"] if node.op == "reduce" else "sum"


def iteration_space(node: Node) -> tuple[int, ...]:
    """The dims a root's schedule tiles: its output dims, or ``reduction_space`` for a reduction."""
    return reduction_space(node) if is_reduction(node) else node.shape
