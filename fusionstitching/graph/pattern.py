"""The vocabulary shared by schedule, fusion and codegen about what a kernel computes: which nodes
are reductions (``reduce`` and ``dot_general``, a sum over its contracting dims), the dims they
reduce, and the iteration space a root's schedule tiles."""

from __future__ import annotations

from fusionstitching.graph.graph import Node


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
