"""What the cost models know about a GPU: SM count, per-SM residency limits, clock and bandwidth.

The latency evaluator of [C §4.3] needs the residency limits (threads, warps, blocks, registers and
shared memory per SM) to turn a launch into waves, and the clock to turn cycles into time; the
bandwidth model M(V) of [B §4.3] needs the datasheet peak bandwidth as its fallback and as the
denominator of its efficiency curve (Figure 4). Both scores use phi, the cost of one kernel launch.

The numbers are datasheet and CUDA C Programming Guide values (the "Technical Specifications per
Compute Capability" table) for one SKU per product, named in ``source``. ``launch_us`` is one
default for every GPU, of the order of the host cost of one launch. A measured value, once recorded by ``python -m fusionstitching.bench.bandwidth --write``, is carried by
``cost.bandwidth.bandwidth_model(device).launch_us``; the specs here stay the datasheet.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

KIB = 1024


@dataclass(frozen=True)
class GpuSpec:
    """One GPU's limits. Memory sizes in bytes, clock in GHz, bandwidth in GB/s (10^9 bytes/s)."""

    name: str
    sms: int
    max_threads_per_sm: int
    max_blocks_per_sm: int
    max_warps_per_sm: int
    registers_per_sm: int  # 32-bit registers
    registers_per_block: int
    smem_per_sm: int
    smem_per_block_optin: int  # the most a block may use after opting in to dynamic shared memory
    clock_ghz: float  # boost clock
    peak_bandwidth_gbs: float  # datasheet DRAM bandwidth
    source: str
    peak_half_tflops: float = 0.0  # datasheet dense f16/bf16 tensor-core rate (0: unknown)
    peak_f32_tflops: float = 0.0  # datasheet f32 rate without TF32 (torch's default for matmul)
    warp_size: int = 32
    issue_slots_per_sm: int = 4  # warp schedulers per SM, each issuing one warp instruction per cycle (sm_70 to sm_90)
    max_threads_per_block: int = 1024
    smem_per_block: int = 48 * KIB  # static limit, without opt-in
    smem_reserved_per_block: int = 0  # shared memory the driver keeps per resident block (1 KiB from sm_80)
    launch_us: float = 5.0  # phi: host cost of one kernel launch, µs
    l2_bytes: int = 50 * KIB * KIB  # datasheet L2 cache size
    # A load's round trip to DRAM, µs: a thread's dependent loads take at least this each. The
    # Little's-law figure of an H100 (bandwidth × latency ≈ 15 KB in flight per SM).
    memory_latency_us: float = 0.6

    def __post_init__(self) -> None:
        if self.max_warps_per_sm * self.warp_size != self.max_threads_per_sm:
            raise ValueError(
                f"GpuSpec {self.name}: {self.max_warps_per_sm} warps of {self.warp_size} threads "
                f"!= {self.max_threads_per_sm} threads per SM"
            )
        if not self.smem_per_block <= self.smem_per_block_optin <= self.smem_per_sm:
            raise ValueError(
                f"GpuSpec {self.name}: shared memory limits must satisfy static {self.smem_per_block} "
                f"<= opt-in {self.smem_per_block_optin} <= per SM {self.smem_per_sm}"
            )


_H100 = GpuSpec(
    name="H100",
    sms=132,
    max_threads_per_sm=2048,
    max_blocks_per_sm=32,
    max_warps_per_sm=64,
    registers_per_sm=64 * KIB,
    registers_per_block=64 * KIB,
    smem_per_sm=228 * KIB,
    smem_per_block_optin=227 * KIB,
    smem_reserved_per_block=KIB,
    clock_ghz=1.98,
    peak_bandwidth_gbs=3350.0,
    source="H100 SXM5 80GB datasheet; CUDA programming guide, compute capability 9.0",
    peak_half_tflops=989.0,
    peak_f32_tflops=67.0,
)

SPECS: dict[str, GpuSpec] = {
    "H100": _H100,
    # The same GH100 chip and limits as the H100 SXM5, with faster HBM3e.
    "H200": replace(
        _H100,
        name="H200",
        peak_bandwidth_gbs=4800.0,
        source="H200 SXM 141GB datasheet; CUDA programming guide, compute capability 9.0",
    ),
    "A100": GpuSpec(
        name="A100",
        sms=108,
        max_threads_per_sm=2048,
        max_blocks_per_sm=32,
        max_warps_per_sm=64,
        registers_per_sm=64 * KIB,
        registers_per_block=64 * KIB,
        smem_per_sm=164 * KIB,
        smem_per_block_optin=163 * KIB,
        smem_reserved_per_block=KIB,
        clock_ghz=1.41,
        peak_bandwidth_gbs=2039.0,
        source="A100 SXM4 80GB datasheet; CUDA programming guide, compute capability 8.0",
        l2_bytes=40 * KIB * KIB,
        peak_half_tflops=312.0,
        peak_f32_tflops=19.5,
    ),
    "V100": GpuSpec(
        name="V100",
        sms=80,
        max_threads_per_sm=2048,
        max_blocks_per_sm=32,
        max_warps_per_sm=64,
        registers_per_sm=64 * KIB,
        registers_per_block=64 * KIB,
        smem_per_sm=96 * KIB,
        smem_per_block_optin=96 * KIB,
        clock_ghz=1.53,
        peak_bandwidth_gbs=900.0,
        source="V100 SXM2 datasheet; CUDA programming guide, compute capability 7.0",
        l2_bytes=6 * KIB * KIB,
        peak_half_tflops=125.0,
        peak_f32_tflops=15.7,
    ),
}


def gpu_spec(name: str) -> GpuSpec:
    """The spec named ``name`` (case-insensitive: "h100" is "H100")."""
    spec = SPECS.get(name.upper())
    if spec is None:
        raise KeyError(f"unknown GPU {name!r}; known: {', '.join(sorted(SPECS))}")
    return spec


def spec_key(device_name: str) -> str | None:
    """The ``SPECS`` key of a device name as the GPU reports it ("NVIDIA H100 80GB HBM3" → "H100")."""
    upper = device_name.upper()
    for key in SPECS:
        if key in upper:
            return key
    return None
