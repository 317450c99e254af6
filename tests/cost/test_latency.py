import math

import pytest

from fusionstitching.cost import (
    CYCLES_PER_ELEMENT,
    bandwidth_model,
    gpu_spec,
    instructions_per_thread,
    kernel_latency_us,
    memory_bound_us,
    node_work,
    occupancy,
    waves,
)
from fusionstitching.graph.graph import GraphBuilder
from fusionstitching.graph.ops import Category, DType

H100 = gpu_spec("H100")
V100 = gpu_spec("V100")


def test_occupancy_limited_by_threads():
    assert occupancy(H100, 256) == 8  # 64 warps / 8 warps per block
    assert occupancy(H100, 1024) == 2
    assert occupancy(H100, 1000) == 2  # whole warps
    assert occupancy(H100, 1025) == 0  # more than a block may have


def test_occupancy_limited_by_blocks():
    assert occupancy(H100, 32) == 32  # 64 warps would allow 64 blocks
    assert occupancy(H100, 1) == 32


def test_occupancy_limited_by_registers():
    assert occupancy(H100, 256, registers_per_thread=16) == 8
    assert occupancy(H100, 256, registers_per_thread=64) == 4  # 65536 / (256 * 64)
    assert occupancy(H100, 256, registers_per_thread=128) == 2
    assert occupancy(H100, 256, registers_per_thread=33) == 6  # 33 * 32 = 1056 -> 1280 per warp
    assert occupancy(H100, 1024, registers_per_thread=128) == 0  # 131072 > 65536 per block
    assert occupancy(H100, 32, registers_per_thread=256) == 0  # over 255 per thread


def test_occupancy_limited_by_shared_memory():
    assert occupancy(H100, 128, smem_bytes=48 * 1024) == 4  # 228 KiB / (48 + 1) KiB
    assert occupancy(H100, 128, smem_bytes=57 * 1024) == 3  # the 1 KiB reservation decides
    assert occupancy(V100, 128, smem_bytes=48 * 1024) == 2  # no reservation before sm_80
    assert occupancy(H100, 128, smem_bytes=100) == 16  # 128-byte units + 1 KiB: 228 KiB / 1152 B = 202
    assert occupancy(H100, 128, smem_bytes=227 * 1024) == 1
    assert occupancy(H100, 128, smem_bytes=227 * 1024 + 1) == 0


def test_occupancy_rejects_nonsense():
    with pytest.raises(ValueError, match="threads_per_block >= 1"):
        occupancy(H100, 0)
    with pytest.raises(ValueError):
        occupancy(H100, 128, smem_bytes=-1)


def test_one_wave_then_more():
    full_wave = 8 * H100.sms  # blocks of 256 threads
    assert waves(H100, 1, 256) == 1
    assert waves(H100, full_wave, 256) == 1
    assert waves(H100, full_wave + 1, 256) == 2
    assert waves(H100, full_wave, 256, smem_bytes=100 * 1024) == 4  # 2 blocks per SM


def test_latency_grows_with_waves():
    full_wave = 8 * H100.sms
    one = kernel_latency_us(H100, full_wave, 256, 100.0)
    assert one == pytest.approx(100.0 / (H100.clock_ghz * 1e3))
    assert kernel_latency_us(H100, 1, 256, 100.0) == one  # a partial wave costs a wave
    assert kernel_latency_us(H100, 2 * full_wave, 256, 100.0) == pytest.approx(2 * one)
    assert kernel_latency_us(H100, 4 * full_wave, 256, 100.0) == pytest.approx(4 * one)


def test_lower_occupancy_costs_more_waves():
    blocks = 8 * H100.sms
    fast = kernel_latency_us(H100, blocks, 256, 50.0)
    assert kernel_latency_us(H100, blocks, 256, 50.0, registers_per_thread=128) == pytest.approx(4 * fast)
    assert kernel_latency_us(H100, blocks, 256, 50.0, smem_bytes=100 * 1024) == pytest.approx(4 * fast)


def test_latency_of_a_kernel_that_cannot_launch_is_infinite():
    assert kernel_latency_us(H100, 10, 2048, 10.0) == math.inf
    assert kernel_latency_us(H100, 10, 128, 10.0, smem_bytes=300 * 1024) == math.inf
    with pytest.raises(ValueError, match="at least one block"):
        kernel_latency_us(H100, 0, 128, 10.0)


def test_instructions_per_thread_of_a_small_pattern():
    b = GraphBuilder()
    x = b.parameter((64, 128), DType.F32)
    y = b.unary("exp", x)
    r = b.reduce(y, (1,), "sum")
    z = b.binary("add", r, r)
    cycles = 64 * 128 * 16.0 + 64 * 128 * 8.0 + 64 * 4.0  # exp, reduce over its operand, add
    assert instructions_per_thread([x, y, r, z], blocks=64, threads_per_block=128) == pytest.approx(
        cycles / (64 * 128)
    )
    assert instructions_per_thread([y], blocks=1, threads_per_block=128) == pytest.approx(64 * 16.0)


def test_work_of_shape_random_and_dot_nodes():
    b = GraphBuilder()
    x = b.parameter((8, 16), DType.F32)
    w = b.parameter((16, 4), DType.F32)
    t = b.transpose(x, (1, 0))
    d = b.node("dot_general", [x, w], lhs_batch=(), rhs_batch=(), lhs_contract=(1,), rhs_contract=(0,))
    assert d.shape == (8, 4)
    assert node_work(t) == 128
    assert node_work(d) == 8 * 4 * 16  # one FMA per output element per contracted element
    assert instructions_per_thread([t, d], 1, 32) == pytest.approx((128 * 2.0 + 512 * 2.0) / 32)


def test_cycle_table_covers_the_kernel_categories():
    for category in (
        Category.LIGHT_ELEMENTWISE,
        Category.EXPENSIVE_ELEMENTWISE,
        Category.REDUCTION,
        Category.SHAPE,
        Category.DOT,
        Category.RANDOM,
    ):
        assert CYCLES_PER_ELEMENT[category] > 0
    assert CYCLES_PER_ELEMENT[Category.EXPENSIVE_ELEMENTWISE] > CYCLES_PER_ELEMENT[Category.LIGHT_ELEMENTWISE]
    with pytest.raises(TypeError):
        CYCLES_PER_ELEMENT[Category.DOT] = 1.0


def test_memory_bound_is_m_of_v():
    model = bandwidth_model("H100", measurements={})
    assert memory_bound_us(model, 1 << 20) == model.time_us(1 << 20)


def test_the_issue_bound_is_every_threads_cycles_over_the_schedulers_of_all_sms():
    """Each SM issues ``issue_slots_per_sm`` (4) warp instructions per cycle: one cycle of every thread of a
    full H100 (132 SMs × 2048 threads) takes 2048 / (4 × 32) = 16 cycles of the whole GPU."""
    from fusionstitching.cost.gpu_spec import gpu_spec
    from fusionstitching.cost.latency import issue_bound_us

    spec = gpu_spec("H100")
    threads = spec.sms * spec.max_threads_per_sm
    assert spec.issue_slots_per_sm == 4
    cycles = spec.max_threads_per_sm / (spec.issue_slots_per_sm * spec.warp_size)
    assert issue_bound_us(spec, threads) == pytest.approx(cycles / (spec.clock_ghz * 1e3))
    assert issue_bound_us(spec, 2 * threads) == pytest.approx(2 * issue_bound_us(spec, threads))
    assert issue_bound_us(spec, 0) == 0
    with pytest.raises(ValueError):
        issue_bound_us(spec, -1)
