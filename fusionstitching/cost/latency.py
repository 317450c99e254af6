"""The latency evaluator of [C §4.3]: L = N_wave × L_warp, for ranking the schedules of one kernel.

    N_wave = ceil(N_warp / (resident warps per SM × SMs))   (waves of warps the GPU runs)
    L_warp = N_instruction × CPI                              (cycles one warp spends)

N_warp comes from the launch (blocks × warps per block). The warps resident per SM come from the
occupancy: how many blocks fit on one SM given their threads, shared memory and registers, with the
CUDA occupancy calculator's rules (warp limit, block limit, registers allocated per warp in units of
256, shared memory in units of 128 bytes plus the driver's per-block reservation). Registers per
thread default to a fixed 16, the simplification of the delta evaluator [C §5.4], which also takes
the largest shared-memory use in the pattern as the kernel's; a caller with a better estimate
passes it.

N_instruction × CPI is estimated per fused pattern by ``instructions_per_thread``: each node's work
in elements times a cycles-per-element weight of its category (``CYCLES_PER_ELEMENT``), summed over
the pattern and spread over all the launched threads. The weights stand in for the per-op CPI
numbers the paper takes from microbenchmark reports; they are rough issue costs of the instructions
one element needs, not measurements.

Simplifications, beyond the paper's: all warps of a wave run concurrently and a wave takes L_warp
(no partial waves); memory traffic is not
in L (the memory side is M(V) of ``cost.bandwidth``; ``memory_bound_us`` gives it, and a
memory-intensive kernel takes about max(L, M(V))). Units: cycles inside, µs out (boost clock).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from types import MappingProxyType

from fusionstitching.cost.bandwidth import BandwidthModel
from fusionstitching.cost.gpu_spec import GpuSpec
from fusionstitching.graph.graph import Node
from fusionstitching.graph.ops import Category

DEFAULT_REGISTERS_PER_THREAD = 16  # [C §5.4]
MAX_REGISTERS_PER_THREAD = 255
REGISTER_ALLOCATION_UNIT = 256  # registers, allocated per warp
SMEM_ALLOCATION_UNIT = 128  # bytes

# Cycles per element of work, by op category (a dot's element of work is one FMA). Parameters and
# constants cost nothing here: reading them is memory traffic, counted by M(V).
CYCLES_PER_ELEMENT = MappingProxyType(
    {
        Category.LIGHT_ELEMENTWISE: 4.0,  # add, mul, compare, select, convert: one or two ALU ops
        Category.EXPENSIVE_ELEMENTWISE: 16.0,  # exp, tanh, div, erf: SFU or multi-instruction sequences
        Category.REDUCTION: 8.0,  # per operand element: accumulate, plus its share of shuffles
        Category.SHAPE: 2.0,  # broadcast, transpose, slice: index arithmetic
        Category.DOT: 2.0,  # per FMA, i.e. one cycle per flop of 2·M·N·K
        Category.RANDOM: 40.0,  # Philox4x32-10: ten rounds of multiplies per four numbers
        Category.PARAMETER: 0.0,
        Category.CONSTANT: 0.0,
    }
)


def occupancy(
    spec: GpuSpec,
    threads_per_block: int,
    smem_bytes: int = 0,
    registers_per_thread: int = DEFAULT_REGISTERS_PER_THREAD,
) -> int:
    """Blocks resident per SM, the least of the warp, block, register and shared-memory limits.

    0 means the block cannot launch at all (too many threads, registers or bytes of shared memory
    for one block; shared memory is checked against the opt-in limit ``smem_per_block_optin``).
    """
    if threads_per_block < 1 or smem_bytes < 0 or registers_per_thread < 1:
        raise ValueError(
            f"occupancy needs threads_per_block >= 1, smem_bytes >= 0, registers_per_thread >= 1; found "
            f"{threads_per_block}, {smem_bytes}, {registers_per_thread}"
        )
    if (
        threads_per_block > spec.max_threads_per_block
        or smem_bytes > spec.smem_per_block_optin
        or registers_per_thread > MAX_REGISTERS_PER_THREAD
    ):
        return 0
    warps = math.ceil(threads_per_block / spec.warp_size)
    registers_per_warp = _round_up(registers_per_thread * spec.warp_size, REGISTER_ALLOCATION_UNIT)
    if registers_per_warp * warps > spec.registers_per_block:
        return 0
    limits = [
        spec.max_blocks_per_sm,
        spec.max_warps_per_sm // warps,
        spec.registers_per_sm // (registers_per_warp * warps),
    ]
    if smem_bytes > 0:
        smem_per_block = _round_up(smem_bytes, SMEM_ALLOCATION_UNIT) + spec.smem_reserved_per_block
        limits.append(spec.smem_per_sm // smem_per_block)
    return min(limits)


def waves(
    spec: GpuSpec,
    blocks: int,
    threads_per_block: int,
    smem_bytes: int = 0,
    registers_per_thread: int = DEFAULT_REGISTERS_PER_THREAD,
) -> int:
    """N_wave = ceil(N_warp / (resident warps per SM × SMs)); 0 when the block cannot launch."""
    if blocks < 1:
        raise ValueError(f"a launch needs at least one block, found {blocks}")
    resident_blocks = occupancy(spec, threads_per_block, smem_bytes, registers_per_thread)
    if resident_blocks == 0:
        return 0
    warps_per_block = math.ceil(threads_per_block / spec.warp_size)
    total_warps = blocks * warps_per_block
    return math.ceil(total_warps / (resident_blocks * warps_per_block * spec.sms))


def kernel_latency_us(
    spec: GpuSpec,
    blocks: int,
    threads_per_block: int,
    instructions_per_thread: float,
    smem_bytes: int = 0,
    registers_per_thread: int = DEFAULT_REGISTERS_PER_THREAD,
) -> float:
    """L = N_wave × L_warp in µs; ``instructions_per_thread`` is L_warp in cycles (N_instruction × CPI).

    A launch that cannot run (occupancy 0) costs ``math.inf``, so a search discards it.
    """
    if instructions_per_thread < 0:
        raise ValueError(f"instructions_per_thread must be >= 0, found {instructions_per_thread}")
    n_wave = waves(spec, blocks, threads_per_block, smem_bytes, registers_per_thread)
    if n_wave == 0:
        return math.inf
    cycles = n_wave * instructions_per_thread
    return cycles / (spec.clock_ghz * 1e3)


def node_work(node: Node) -> int:
    """Elements of work of one node: its size; a reduce's operand size; a dot's multiply-adds."""
    if node.op == "reduce":
        return node.operands[0].size
    if node.op == "dot_general":
        lhs = node.operands[0]
        contracted = math.prod(lhs.shape[d] for d in node.attrs["lhs_contract"])
        return node.size * contracted
    return node.size


def instructions_per_thread(nodes: Iterable[Node], blocks: int, threads_per_block: int,
                            computed: Mapping[int, float] | None = None) -> float:
    """N_instruction × CPI of one thread of a fused pattern's kernel, in cycles.

    Σ over ``nodes`` of work × ``CYCLES_PER_ELEMENT[category]`` (× the fraction of the node the
    kernel computes, ``computed`` by id, where given), divided by blocks × threads; a library call
    cannot be inside a generated kernel and raises ``ValueError``.
    """
    threads = blocks * threads_per_block
    if threads < 1:
        raise ValueError(f"instructions_per_thread needs at least one thread, found {blocks} × {threads_per_block}")
    cycles = 0.0
    for node in nodes:
        weight = CYCLES_PER_ELEMENT.get(node.category)
        if weight is None:
            raise ValueError(f"node {node.name} ({node.op}, {node.category.value}) cannot be part of a kernel")
        cycles += weight * node_work(node) * (computed.get(id(node), 1.0) if computed else 1.0)
    return cycles / threads


def issue_bound_us(spec: GpuSpec, thread_cycles: float) -> float:
    """The time the GPU's schedulers take to issue ``thread_cycles`` (Σ over every thread of the
    kernel of its N_instruction × CPI, ``instructions_per_thread`` × threads): each SM issues
    ``spec.issue_slots_per_sm`` warp instructions, i.e. that many times ``warp_size`` thread
    instructions, per cycle."""
    if thread_cycles < 0:
        raise ValueError(f"thread_cycles must be >= 0, found {thread_cycles}")
    per_cycle = spec.sms * spec.issue_slots_per_sm * spec.warp_size
    return thread_cycles / per_cycle / (spec.clock_ghz * 1e3)


def memory_bound_us(model: BandwidthModel, nbytes: float) -> float:
    """M(V): the time the kernel's DRAM traffic takes alone, the other side of max(L, M(V))."""
    return model.time_us(nbytes)


def _round_up(value: int, unit: int) -> int:
    return -(-value // unit) * unit
