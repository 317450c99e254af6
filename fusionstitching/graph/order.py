"""The node order of a Graph: operands before users, free nodes next to their users.

``topological`` is the order ``Graph`` keeps in ``Graph.nodes``: a depth-first walk from the
outputs, then every *free* node (computed from constants and scalar parameters alone: a dropout
mask from a seed and an offset, an iota) moved to just before its first user that is not free.
Fusion's substitution generator cuts graph order into runs, so where a node sits decides which
kernels it can join.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from fusionstitching.graph.node import Node


def topological(parameters: Sequence[Node], outputs: Sequence[Node | None]) -> list[Node]:
    """Operands before users, by an iterative depth-first walk from the outputs; then every *free*
    node (see ``_free_nodes``) moved to just before its first user that is not free."""
    order: list[Node] = list(parameters)
    seen = {id(p) for p in parameters}
    for root in outputs:
        if root is not None:
            _post_order(root, seen, order, lambda operand: True)
    return _sink_free_nodes(order)


def _post_order(root: Node, done: set[int], out: list[Node], follow: Callable[[Node], bool]) -> None:
    """Append ``root`` and the operands it reaches through ``follow`` that are not in ``done`` to
    ``out``, operands first (iterative depth-first walk, operands in order)."""
    if id(root) in done:
        return
    stack = [(root, 0)]
    while stack:
        node, next_operand = stack.pop()
        if next_operand < len(node.operands):
            stack.append((node, next_operand + 1))
            operand = node.operands[next_operand]
            if id(operand) not in done and follow(operand):
                stack.append((operand, 0))
        elif id(node) not in done:
            done.add(id(node))
            out.append(node)


def _free_nodes(order: Sequence[Node]) -> set[int]:
    """Ids of the nodes computed from constants and scalar parameters alone, such as a dropout mask
    (random bits from a seed and an offset, compared with a constant) or an iota."""
    free: set[int] = set()
    for node in order:
        if node.op in ("parameter", "constant"):
            continue
        if all(id(x) in free or x.op == "constant" or (x.op == "parameter" and not x.shape) for x in node.operands):
            free.add(id(node))
    return free


def _sink_free_nodes(order: list[Node]) -> list[Node]:
    """``order`` with each free node just before its first non-free user (direct or through free
    nodes); free nodes without one keep their place. The walk can meet a free subgraph wherever
    a path from an output first needs it (a saved dropout mask: long before the layer that applies
    it); next to its user it lands in the user's run of graph-order segments, which is where fusion
    should consider it."""
    free = _free_nodes(order)
    if not free:
        return order
    needed: set[int] = set()  # free nodes with a non-free user, directly or through free nodes
    for node in reversed(order):
        if id(node) in free and id(node) not in needed:
            continue
        for x in node.operands:
            if id(x) in free:
                needed.add(id(x))
    result: list[Node] = []
    placed: set[int] = set()

    def place(node: Node) -> None:
        _post_order(node, placed, result, lambda operand: id(operand) in free)

    for node in order:
        if id(node) in free:
            if id(node) not in needed:
                place(node)
        else:
            place(node)
    return result
