"""Why ``grouping.feasible`` refuses a template before lowering it: too little parallelism,
a reduction folded inline once per element that reads the same result, a serially summed root
that another reduction root would sum again for each of its points, or a column-sum sub-kernel
recomputing another sub-kernel's work. Each check returns a ``Reason`` (falsy, printable) or None.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass

from fusionstitching.graph.graph import Node
from fusionstitching.graph.pattern import is_reduction, reduced_dims
from fusionstitching.graph.pattern import iteration_space as _space
from fusionstitching.schedule.packing import needs_composition, packed_groups, recomputed_work
from fusionstitching.schedule.template import KernelSchedule, Level, tile_extents

MAX_ELEMENTS_PER_THREAD = 1024  # feasible refuses templates that leave a thread more work (``crowded``)
REFOLD_POINTS = 16  # reduced points per result above which ``refolded`` refuses recomputing it


@dataclass(frozen=True)
class Reason:
    """Why a pattern has no schedule; falsy, and printable."""

    message: str

    def __bool__(self) -> bool:
        return False

    def __str__(self) -> str:
        return self.message


def refusal(pattern, template: KernelSchedule) -> Reason | None:
    """The first of the checks below that refuses ``template``, or None."""
    for check in (crowded, recomputed, refolded, resummed):
        reason = check(pattern, template)
        if reason is not None:  # a Reason is falsy: no `or`
            return reason
    return None


def crowded(pattern, template: KernelSchedule) -> Reason | None:
    """A template that leaves some root's threads more than ``MAX_ELEMENTS_PER_THREAD`` points of
    its iteration space each (a reduction's space is its operand's): counted per schedule, since a
    packed root gets only its own tiles' threads. Such a template runs a large result on a sliver
    of the GPU: cross-entropy's [4096, 1000] log-softmax output fused into the one block of its
    scalar loss (twenty times its time in the row kernel), a cast column sum that the
    column template cannot take summed 2048 rows per thread on four blocks, a full sum packed next
    to an elementwise result and computed by one thread. A reduction that a root computes inline
    (one that is no root of the template) multiplies the root's points by its reduced length: a
    weight-gradient cast packed with a bias gradient summed inline over 4096 rows ran on three
    blocks."""
    by_name = {n.name: n for n in pattern.nodes}
    roots = {s.root for s in template.schedules}
    inline = any(is_reduction(n) and n.name not in roots for n in pattern.nodes)
    launched = template.launch.blocks * template.launch.threads
    for sched in template.schedules:
        root = by_name.get(sched.root)
        space = _space(root) if root is not None else ()
        if len(sched.dims) != len(space):
            continue  # lowering reports the mismatch
        parallel = 1
        for size, tiles in zip(space, sched.dims):
            for tile, extent in zip(tiles, tile_extents(size, tiles)):
                if tile.level != Level.THREAD:
                    parallel *= extent
        parallel = min(parallel, launched)
        work = math.prod(space) * (_folded_points(root, roots, by_name) if inline else 1)
        if work > MAX_ELEMENTS_PER_THREAD * parallel:
            return Reason(f"{root.name} has {work} points for {parallel} threads in the template (over "
                          f"{MAX_ELEMENTS_PER_THREAD} each): too little parallelism")
    return None


def refolded(pattern, template: KernelSchedule) -> Reason | None:
    """A template whose root folds a reduction inline for each of several elements that read the
    same result (a softmax output computing its row's max and sum once per element of the row):
    the work grows with the row length squared, and the cost model does not see it. A root that
    reads each result once (the cast of a column sum) is fine. In a packed template a reduction
    another loop nest computes counts as inline too (``_packed_nests``)."""
    by_name = {n.name: n for n in pattern.nodes}
    roots = {s.root for s in template.schedules}
    nest = _packed_nests(pattern, template, by_name)
    for sched in template.schedules:
        root = by_name.get(sched.root)
        if root is None or is_reduction(root):
            continue
        available = roots if nest is None else {r for r in roots if nest.get(r) == nest.get(root.name)}
        for node in _inline_reductions(root, available, by_name):
            folded = _reduced_points(node)
            if folded > REFOLD_POINTS and root.size > node.size:
                return Reason(f"{root.name} would fold {node.name} ({folded} points) again for each of the "
                              f"{root.size // max(node.size, 1)} elements that read one of its results")
    return None


def _packed_nests(pattern, template: KernelSchedule, by_name: dict[str, Node]) -> dict[str, int] | None:
    """Each root's loop nest when the template is packed (``codegen/packed.py``), where a nest
    reads no other nest's values: a root reduction of another nest is recomputed inline (the
    final sums of BatchNorm's statistics, 32 partials each, packed beside the gradient that reads
    them: every element of it summed them again). None for a composed template."""
    outputs = {o.name: o for o in pattern.outputs}
    if any(s.root not in by_name for s in template.schedules) \
            or needs_composition(template.schedules, outputs, by_name):
        return None
    inside = {id(n) for n in pattern.nodes}
    nests = packed_groups([(s, by_name[s.root]) for s in template.schedules], inside)
    return {m.name: k for k, (_, members) in enumerate(nests) for m in members}


def recomputed(pattern, template: KernelSchedule) -> Reason | None:
    why = recomputed_work(pattern, template)
    return None if why is None else Reason(why)


def resummed(pattern, template: KernelSchedule) -> Reason | None:
    """A reduce root that each thread sums serially (THREAD tiles on all its reduced dims) keeps
    its result in no register or shared cell another root's threads can read, so a root that reads
    it computes it again per point; inside another reduction's loop that costs the product of the
    two reduced lengths (a variance's part sums read by its squares' sums: 392 x 392 loads per
    column, at 1 % of a copy's bandwidth). Refused above ``REFOLD_POINTS`` points."""
    by_name = {n.name: n for n in pattern.nodes}
    roots = {s.root for s in template.schedules}
    serial = set()
    for sched in template.schedules:
        root = by_name.get(sched.root)
        if root is None or root.op != "reduce" or sched.shared or len(sched.dims) != len(_space(root)):
            continue  # an S sub-root's result is kept in shared memory; a batched dot's, by its template
        if all(t.level == Level.THREAD for d in reduced_dims(root) for t in sched.dims[d]):
            serial.add(root.name)
    for sched in template.schedules:
        root = by_name.get(sched.root)
        if root is None or not is_reduction(root):
            continue
        stack, seen = list(root.operands), set()
        while stack:
            node = stack.pop()
            if id(node) in seen or by_name.get(node.name) is not node:
                continue
            seen.add(id(node))
            if node.name in serial and node is not root and _reduced_points(node) > REFOLD_POINTS:
                return Reason(f"{root.name} would sum {node.name} ({_reduced_points(node)} points, summed serially "
                              "by another root's threads) again for each of its points")
            if node.name not in roots:
                stack.extend(node.operands)
    return None


def _inline_reductions(root: Node, roots: set[str], by_name: dict[str, Node]) -> Iterator[Node]:
    """The reductions a thread of ``root`` computes inline: those among its pattern operands, read
    through other pattern nodes, that are no root of the template."""
    stack, seen = list(root.operands), set()
    while stack:
        node = stack.pop()
        if id(node) in seen or by_name.get(node.name) is not node or node.name in roots:
            continue
        seen.add(id(node))
        if is_reduction(node):
            yield node
        stack.extend(node.operands)


def _folded_points(root: Node, roots: set[str], by_name: dict[str, Node]) -> int:
    """The points a thread of ``root`` reads per element it computes, through the reductions it
    folds inline: a reduction multiplies its operands' points by its reduced length, so the two
    halves of a split reduction folded together cost their product (a split bias gradient
    recomputed whole by each thread of its cast), and sibling reductions add up (a row's mean and
    variance)."""
    memo: dict[int, int] = {}

    def points(node: Node) -> int:
        if by_name.get(node.name) is not node or node.name in roots:
            return 1  # read from memory: a parameter, another kernel's value or a root's result
        if id(node) not in memo:
            memo[id(node)] = 1  # a cycle cannot happen in a graph; this only guards the recursion
            memo[id(node)] = below(node) * (_reduced_points(node) if is_reduction(node) else 1)
        return memo[id(node)]

    def below(node: Node) -> int:
        return sum(p for p in map(points, node.operands) if p > 1) or 1

    # a reduction root's own reduced points are in its iteration space already
    return below(root)


def _reduced_points(node: Node) -> int:
    space = _space(node)
    return math.prod(space[d] for d in reduced_dims(node))
