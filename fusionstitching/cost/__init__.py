"""Cost models (DESIGN.md, Fusion exploration and Kernel schedules): what a GPU is, what moving V bytes
costs (M(V) of [B §4.3]) and how long a kernel's waves of warps take (the latency evaluator of
[C §4.3], with the fixed-register simplification of [C §5.4])."""

from fusionstitching.cost.bandwidth import BandwidthModel, bandwidth_model, fit
from fusionstitching.cost.gpu_spec import SPECS, GpuSpec, gpu_spec, spec_key
from fusionstitching.cost.latency import (
    CYCLES_PER_ELEMENT,
    instructions_per_thread,
    kernel_latency_us,
    memory_bound_us,
    node_work,
    occupancy,
    waves,
)
from fusionstitching.cost.measurement import Measurement

__all__ = [
    "CYCLES_PER_ELEMENT",
    "SPECS",
    "BandwidthModel",
    "GpuSpec",
    "Measurement",
    "bandwidth_model",
    "fit",
    "gpu_spec",
    "instructions_per_thread",
    "kernel_latency_us",
    "memory_bound_us",
    "node_work",
    "occupancy",
    "spec_key",
    "waves",
]
