"""Scores of fusion patterns: how much time fusing them saves (DESIGN.md "Fusion exploration").

Both scores compare the pattern run as one kernel with its ops run unfused, one kernel each
(a ``reshape`` is a view of contiguous memory and costs nothing unfused).

Delta evaluator [C §5.4]: ``f = T_reduced_mem + T_reduced_calls − T_penalty``, where

- ``T_reduced_mem = Σ_ops M(bytes(op)) − M(bytes(P))``: the memory time of the unfused kernels
  minus the fused kernel's, M being the bandwidth model of ``cost/bandwidth.py`` (which charges
  every kernel its floor, so small kernels cost more than their bytes); bytes(P) counts the
  sectors the schedule's accesses move (``access_factor``: a block of threads walking down a
  column moves a sector per element);
- ``T_reduced_calls = (N − 1) φ``: launches saved, φ from the GPU spec (N = ops that would be
  kernels);
- ``T_penalty = max(0, L(P) − M(bytes(P)))``: how much longer than its memory time the fused
  kernel is expected to run, by the simplified latency evaluator (``cost/latency.py``: fixed 16
  registers per thread, launch dims of the schedule ``feasible`` chose, no shared-memory term;
  ``Scorer.recomputation_us`` is not part of it).
  This is what rejects, for example, a reduction whose composition leaves most of the GPU idle.

Model-based score [B §4.3]: ``f = M(V) + (N − 1) φ`` with V the off-chip bytes saved.

Patterns with a score ≤ 0 are dropped by the selector.

A score is a function of the pattern's structure (``graph.analysis.pattern_structure``: ops,
shapes, dtypes, layouts, attributes, which inputs it shares and which nodes are read outside) and
of its schedule with roots named by position: the repeated layers of a model propose the same
patterns once per layer, and ``Scorer.score`` computes each structure's score once.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from fusionstitching.cost.bandwidth import BandwidthModel, bandwidth_model
from fusionstitching.cost.gpu_spec import GpuSpec, gpu_spec
from fusionstitching.cost.latency import instructions_per_thread, kernel_latency_us, waves
from fusionstitching.graph.analysis import in_place_outputs, pattern_structure
from fusionstitching.graph.graph import Graph, Node
from fusionstitching.graph.ops import OPS, Category
from fusionstitching.graph.pattern import is_reduction, iteration_space
from fusionstitching.options import Options
from fusionstitching.schedule.grouping import SECTOR_BYTES
from fusionstitching.schedule.packing import loop_rounds, serial_rounds
from fusionstitching.schedule.template import KernelSchedule, Level, Schedule, tile_extents


def _bytes(node: Node) -> int:
    return node.size * node.dtype.itemsize


def _is_scalar_constant(node: Node) -> bool:
    return node.op == "constant" and node.size == 1


def unfused_bytes(node: Node) -> int:
    """Global-memory bytes of ``node`` run as its own kernel: distinct operands read, result written
    (a slice reads only the elements it keeps)."""
    if node.op == "reshape":
        return 0
    if node.op == "slice":
        return 2 * _bytes(node)
    operands = {id(o): o for o in node.operands if not _is_scalar_constant(o)}
    return _bytes(node) + sum(_bytes(o) for o in operands.values())


def counts_as_kernel(node: Node) -> bool:
    return node.op != "reshape"


def pattern_bytes(graph: Graph, nodes: Sequence[Node]) -> int:
    """Bytes the fused kernel reads (inputs from outside, once) and writes (outputs used outside).
    An input is read in the fraction of its elements the kernel needs (``computed_fractions``):
    all of it, unless what reads it ends in slices."""
    members = set(nodes)
    index = graph.index
    inputs: dict[int, Node] = {}
    total = 0
    for node in nodes:
        for operand in node.operands:
            if operand not in members and not _is_scalar_constant(operand):
                inputs[id(operand)] = operand
        if id(node) in index.output_ids or any(u not in members for u in index.users[node]):
            total += _bytes(node)
    needed = computed_fractions(graph, nodes)
    if needed is None:
        return total + sum(_bytes(o) for o in inputs.values())
    return total + sum(round(_bytes(o) * _read_fraction(o, needed, index.users[o], members))
                       for o in inputs.values())


_SAME_INDEX_OPS = ("reshape", "transpose", "reduce")  # a fraction of the result needs that fraction


def _passed_on(user: Node, operand: Node, fraction: float) -> float:
    """The fraction of ``operand``'s elements that ``user`` needs when ``fraction`` of its own are
    needed: a slice takes its share, an op computing each result from the operand's elements at
    the same index (elementwise ops, views, reductions) the same fraction, anything else (a
    broadcast, a gather, a pad) all of them."""
    if fraction <= 0.0:
        return 0.0
    if user.op == "slice":
        return fraction * user.size / max(operand.size, 1)
    category = OPS[user.op].category
    if user.op in _SAME_INDEX_OPS or (category in (Category.LIGHT_ELEMENTWISE, Category.EXPENSIVE_ELEMENTWISE)
                                      and user.shape == operand.shape):
        return fraction
    return 1.0


def _read_fraction(node: Node, needed: dict[int, float], users: Sequence[Node], members: set[Node]) -> float:
    total = sum(_passed_on(u, node, needed[id(u)]) for u in dict.fromkeys(users) if u in members)
    return min(1.0, total)


def computed_fractions(graph: Graph, nodes: Sequence[Node]) -> dict[int, float] | None:
    """The fraction of each member's elements the kernel computes, by id: all of an output's; of a
    node read only inside, what its readers need of it (BatchNorm's shift ``x.float()[0, :, 0, 0]``
    needs 64 elements of the converted input, not all of it). None where no member is a slice:
    then the kernel computes every member whole."""
    if not any(n.op == "slice" for n in nodes):
        return None
    members = set(nodes)
    index = graph.index
    needed: dict[int, float] = {}
    for node in sorted(nodes, key=index.position.__getitem__, reverse=True):
        if id(node) in index.output_ids or any(u not in members for u in index.users[node]):
            needed[id(node)] = 1.0
        else:
            needed[id(node)] = _read_fraction(node, needed, index.users[node], members)
    return needed


def sector_factor(schedule: Schedule, space: Sequence[int], itemsize: int) -> float:
    """Bytes moved per byte used by the accesses of one root's schedule over its row-major
    iteration space ``space``. Neighbouring lanes of a warp take neighbouring indices of the
    innermost CTA factor (``schedule/template.py``); where the elements between them span a
    sector or more, each lane's access is a sector of its own, of which it uses its contiguous
    run: the THREAD factors after its CTA one (a vector), and of the dims after its own. A column
    of a row-major matrix read by the threads of one block (``reduce[CTA,GRID]`` over a
    channels-last [N·H·W, C]) moves 16 bytes per 2-byte element used."""
    lane = None
    for d, tiles in enumerate(schedule.dims):
        for k, tile in enumerate(tiles):
            if tile.level == Level.CTA:
                lane = (d, k)
    if lane is None:
        return 1.0
    d, k = lane
    inner = tile_extents(space[d], schedule.dims[d])[k + 1:]
    stride = math.prod(inner) * math.prod(space[d + 1:])
    if stride * itemsize < SECTOR_BYTES:
        return 1.0
    run = 1  # the elements a lane reads one after the other: the THREAD factors after its CTA one
    if all(t.level == Level.THREAD for t in schedule.dims[d][k + 1:]):
        run = math.prod(inner)
        for size, tiles in zip(space[d + 1:], schedule.dims[d + 1:]):
            if size > 1 and any(t.level != Level.THREAD for t in tiles):
                break
            run *= size
    return max(1.0, min(SECTOR_BYTES, stride * itemsize) / min(SECTOR_BYTES, run * itemsize))


def access_factor(graph: Graph, schedule: KernelSchedule | None) -> float:
    """``sector_factor`` over a kernel's roots, weighted by their iteration spaces' sizes. A
    transpose root is left out: its iteration space is not the order of the memory it reads
    (the shared-memory transpose template reads along the input's innermost dim)."""
    if schedule is None:
        return 1.0
    total = weighted = 0.0
    for s in schedule.schedules:
        node = graph.index.by_name.get(s.root)
        if node is None or node.op == "transpose":
            continue
        space = iteration_space(node)
        if len(space) != len(s.dims):
            continue
        itemsize = (node.operands[0] if is_reduction(node) else node).dtype.itemsize
        size = math.prod(space)
        total += size
        weighted += size * sector_factor(s, space, itemsize)
    return weighted / total if total else 1.0


@dataclass(frozen=True)
class Score:
    value: float
    reduced_mem_us: float
    reduced_calls_us: float
    penalty_us: float
    saved_bytes: int
    kernels_replaced: int

    def __str__(self) -> str:
        return (f"f={self.value:.2f}us (memory {self.reduced_mem_us:.2f} + launches {self.reduced_calls_us:.2f}"
                f" - penalty {self.penalty_us:.2f}; {self.saved_bytes} bytes saved, "
                f"{self.kernels_replaced} kernels -> 1)")


class Scorer:
    """Scores patterns of one graph for one device (``Options.device``) with ``Options.score``."""

    def __init__(self, graph: Graph, options: Options,
                 structures: Callable[[Sequence[Node]], tuple] | None = None) -> None:
        """``structures``: ``pattern_structure`` of a node list, from a cache shared with the
        legality checker (``Legality.structure``), which has asked it of every candidate."""
        self.graph = graph
        self.options = options
        self.spec: GpuSpec = gpu_spec(options.device)
        self.memory: BandwidthModel = bandwidth_model(self.spec.name)
        self.launch_us = self.memory.launch_us
        # T(P) of the patterns of plans of this graph, by (node names, schedule): ``explore`` estimates
        # several plans that share most of their patterns (``estimate.plan_time_us``)
        self.kernel_times: dict[tuple, float] = {}
        self._scores: dict[tuple, Score] = {}  # by structure and schedule (module note)
        aliased = in_place_outputs(graph)
        self._structures = structures or (lambda nodes: pattern_structure(graph, nodes, aliased))

    def score(self, nodes: Sequence[Node], schedule: KernelSchedule | None) -> Score:
        key = self._structure(nodes, schedule)
        found = self._scores.get(key)
        if found is None:
            found = self._scores[key] = self._score(nodes, schedule)
        return found

    def _structure(self, nodes: Sequence[Node], schedule: KernelSchedule | None) -> tuple:
        """What a score depends on: the pattern's structure, which of its outside operands are
        one-element constants (read for free), and its schedule with roots named by position."""
        position = {node.name: k for k, node in enumerate(nodes)}
        inside = set(position)
        free = tuple(o.name not in inside and _is_scalar_constant(o) for n in nodes for o in n.operands)
        template = None if schedule is None else (
            tuple((position.get(s.root, s.root), s.dims, s.shared) for s in schedule.schedules), schedule.launch)
        return self._structures(nodes), free, template

    def _score(self, nodes: Sequence[Node], schedule: KernelSchedule | None) -> Score:
        kernels = sum(1 for n in nodes if counts_as_kernel(n))
        fused = round(pattern_bytes(self.graph, nodes) * access_factor(self.graph, schedule))
        unfused = sum(unfused_bytes(n) for n in nodes)
        calls = max(kernels - 1, 0) * self.launch_us
        if self.options.score == "model":
            saved = max(unfused - fused, 0)
            memory = self.memory.time_us(saved)
            return Score(memory + calls, memory, calls, 0.0, saved, kernels)
        memory = sum(self.memory.time_us(unfused_bytes(n)) for n in nodes if counts_as_kernel(n))
        memory -= self.memory.time_us(fused)
        penalty = self.penalty_us(nodes, schedule, fused)
        return Score(memory + calls - penalty, memory, calls, penalty, unfused - fused, kernels)

    def penalty_us(self, nodes: Sequence[Node], schedule: KernelSchedule | None, fused_bytes: int) -> float:
        """The fused kernel's latency beyond its memory time: its launch's N_wave × L_warp, or the
        round trips its threads make one after another in their loops (``loop_rounds``: a few
        threads walking a long loop), whichever is longer."""
        if schedule is None:
            return 0.0
        rounds = loop_rounds(schedule, nodes, kernel_outputs(self.graph, nodes))
        return max(0.0, self._latency_with_rounds_us(nodes, schedule, rounds) - self.memory.time_us(fused_bytes))

    def recomputation_us(self, nodes: Sequence[Node], schedule: KernelSchedule | None) -> float:
        """The time the memory round trips of a packed kernel's recomputed reductions add, one after
        another, beyond what the kernel takes anyway: a sub-kernel reading a reduction another
        sub-kernel computes recomputes it at each of its points (``serial_rounds``), where its ops
        run unfused read it from memory once. The delta score leaves it out (the unfused side's
        own loops are not counted either); ``explore`` selects a second plan with it subtracted,
        and the latency evaluator, which counts every round trip, keeps the faster plan."""
        if schedule is None or not _reads_own_reduction(self.graph, nodes):
            return 0.0
        outputs = kernel_outputs(self.graph, nodes)
        rounds = serial_rounds(schedule, nodes, outputs)
        if not rounds:
            return 0.0
        blocks, threads = schedule.launch.blocks, schedule.launch.threads
        per_round = waves(self.spec, blocks, threads) * self.spec.memory_latency_us
        memory = self.memory.time_us(pattern_bytes(self.graph, nodes) * access_factor(self.graph, schedule))
        anyway = max(self._launch_latency_us(nodes, schedule), memory,
                     serial_rounds(schedule, nodes, outputs, recomputed=False) * per_round)
        return max(0.0, rounds * per_round - anyway)

    def latency_us(self, nodes: Sequence[Node], schedule: KernelSchedule) -> float:
        """L(P) of ``nodes`` run with ``schedule``: N_wave × L_warp of its launch (``cost/latency.py``),
        and at least N_wave × the round trips to memory the busiest block of a packed kernel makes
        one after another (``schedule.packing.serial_rounds``) or a thread makes in its loops
        (``schedule.packing.loop_rounds``)."""
        outputs = kernel_outputs(self.graph, nodes)
        rounds = max(serial_rounds(schedule, nodes, outputs), loop_rounds(schedule, nodes, outputs))
        return self._latency_with_rounds_us(nodes, schedule, rounds)

    def _latency_with_rounds_us(self, nodes: Sequence[Node], schedule: KernelSchedule, rounds: int) -> float:
        """The launch's N_wave × L_warp, or N_wave × ``rounds`` memory round trips if longer."""
        latency = self._launch_latency_us(nodes, schedule)
        if rounds:
            blocks, threads = schedule.launch.blocks, schedule.launch.threads
            latency = max(latency, waves(self.spec, blocks, threads) * rounds * self.spec.memory_latency_us)
        return latency

    def _launch_latency_us(self, nodes: Sequence[Node], schedule: KernelSchedule) -> float:
        blocks, threads = schedule.launch.blocks, schedule.launch.threads
        work = instructions_per_thread(list(nodes), blocks, threads, computed_fractions(self.graph, nodes))
        return kernel_latency_us(self.spec, blocks, threads, work)


def _reads_own_reduction(graph: Graph, nodes: Sequence[Node]) -> bool:
    """Whether a node of the kernel reads a reduction the kernel computes (what a packed sub-kernel
    can recompute)."""
    inside = {id(n) for n in nodes}
    users = graph.index.users
    return any(n.op == "reduce" and any(id(u) in inside for u in users[n]) for n in nodes)


def kernel_outputs(graph: Graph, nodes: Sequence[Node]) -> dict[str, Node]:
    """The nodes of a kernel read outside it: graph outputs and nodes with users elsewhere."""
    inside = {id(n) for n in nodes}
    index = graph.index
    returned, users = index.output_ids, index.users
    return {n.name: n for n in nodes if id(n) in returned or any(id(u) not in inside for u in users[n])}
