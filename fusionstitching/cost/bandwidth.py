"""M(V): the time to move V bytes through DRAM, the memory term of the model-based score [B §4.3].

[B §4.3] scores a pattern by f(P) = M(V) + (N−1)·phi, where M(V) is "the extrapolated latency
accessing V bytes of memory", read off "a memory bandwidth utilization model collected offline on
the same hardware" (Figure 4): small transfers reach a small fraction of the peak, large ones
approach it. We take the simplest curve with that shape, a time floor plus a bandwidth term,

    M(V) = t0 + V / B        (µs; V in bytes, B in GB/s, i.e. 10^3 bytes per µs)

so the achieved bandwidth V / M(V) rises from 0 towards B, and the efficiency V / M(V) / peak rises
towards B / peak. t0 is the floor of a memory-bound kernel (GPU side, without the host's launch
cost), B the saturated bandwidth a streaming copy reaches. Like the paper we assume consecutive
access (simplification one) and one curve per GPU (simplification two).

The constants come from ``cost/measured.py``, written by ``python -m fusionstitching.bench.bandwidth
--write`` on the GPU (a timed device-to-device copy, sizes 4 KiB to 1 GiB, fitted by ``fit``); for
a GPU without a measurement, a datasheet estimate: B = 0.9 × peak, t0 = 2 µs.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from fusionstitching.cost.gpu_spec import gpu_spec
from fusionstitching.cost.measured import MEASUREMENTS
from fusionstitching.cost.measurement import Measurement

DATASHEET_EFFICIENCY = 0.9  # saturated bandwidth of a streaming kernel, as a fraction of the peak
DATASHEET_FLOOR_US = 2.0
DATASHEET = "datasheet estimate"
BYTES_PER_US_PER_GBS = 1e3  # unit conversion: gigabytes per second to bytes per microsecond


@dataclass(frozen=True)
class BandwidthModel:
    """M(V) for one device: ``time_us(V) = floor_us + V / bandwidth_gbs``; ``launch_us`` is phi."""

    device: str  # a cost.gpu_spec key
    floor_us: float
    bandwidth_gbs: float
    launch_us: float
    measured: str  # "measured on <device name> <date>" or "datasheet estimate"

    def __post_init__(self) -> None:
        if not (self.floor_us >= 0 and self.bandwidth_gbs > 0 and self.launch_us >= 0):
            raise ValueError(
                f"BandwidthModel {self.device}: need floor_us >= 0, bandwidth_gbs > 0, launch_us >= 0; "
                f"found {self.floor_us}, {self.bandwidth_gbs}, {self.launch_us}"
            )

    def time_us(self, nbytes: float) -> float:
        """M(V) in µs for ``nbytes`` moved; nothing to move costs nothing."""
        if nbytes <= 0:
            return 0.0
        return self.floor_us + nbytes / (self.bandwidth_gbs * BYTES_PER_US_PER_GBS)

    def efficiency(self, nbytes: float) -> float:
        """Achieved bandwidth over the datasheet peak: ~0 for tiny transfers, → bandwidth / peak."""
        if nbytes <= 0:
            return 0.0
        return achieved_gbs(nbytes, self.time_us(nbytes)) / gpu_spec(self.device).peak_bandwidth_gbs


def fit(sizes_bytes: Sequence[float], times_us: Sequence[float]) -> tuple[float, float]:
    """Fit t = t0 + V / B to measured points; returns (t0 in µs, B in GB/s).

    Weighted least squares on relative residuals, min Σ ((t0 + V_i·s − t_i) / t_i)² with s = 1/B:
    the sizes span six orders of magnitude, and plain least squares would let the largest
    transfers decide t0 alone. Linear in (t0, s), solved by ``numpy.linalg.lstsq``. Raises
    ``ValueError`` naming the data when it cannot give a meaningful curve (too few distinct sizes,
    non-positive or non-finite values, a negative floor or a non-positive bandwidth).
    """
    sizes = np.asarray(sizes_bytes, dtype=np.float64)
    times = np.asarray(times_us, dtype=np.float64)
    data = f"sizes {list(sizes_bytes)}, times {list(times_us)}"
    if sizes.ndim != 1 or sizes.shape != times.shape:
        raise ValueError(f"fit needs as many sizes as times, one list each; found {data}")
    if len(np.unique(sizes)) < 2:
        raise ValueError(f"fit needs at least two distinct sizes; found {data}")
    if not (np.all(np.isfinite(sizes)) and np.all(np.isfinite(times))):
        raise ValueError(f"fit needs finite sizes and times; found {data}")
    if np.any(sizes <= 0) or np.any(times <= 0):
        raise ValueError(f"fit needs positive sizes and times; found {data}")
    weights = 1.0 / times
    design = np.stack([np.ones_like(sizes), sizes], axis=1) * weights[:, None]
    (floor_us, us_per_byte), *_ = np.linalg.lstsq(design, times * weights, rcond=None)
    if floor_us < 0 or us_per_byte <= 0:
        raise ValueError(
            f"fit gives floor {floor_us:.4g} µs and {us_per_byte:.4g} µs per byte, which is no "
            f"bandwidth curve (need floor >= 0, time growing with size); data: {data}"
        )
    return float(floor_us), float(1.0 / (us_per_byte * BYTES_PER_US_PER_GBS))


def bandwidth_model(device: str, measurements: Mapping[str, Measurement] | None = None) -> BandwidthModel:
    """M(V) for ``device`` (a cost.gpu_spec key): measured constants if recorded, else the datasheet.

    ``measurements`` defaults to the checked-in ``cost/measured.py``; pass another mapping (spec key
    → Measurement) to use other data.
    """
    spec = gpu_spec(device)
    if measurements is None:
        measurements = MEASUREMENTS
    entry = measurements.get(spec.name)
    if entry is None:
        return BandwidthModel(
            device=spec.name,
            floor_us=DATASHEET_FLOOR_US,
            bandwidth_gbs=DATASHEET_EFFICIENCY * spec.peak_bandwidth_gbs,
            launch_us=spec.launch_us,
            measured=DATASHEET,
        )
    if entry.spec_key != spec.name:
        raise ValueError(f"measurement filed under {spec.name} is for {entry.spec_key} ({entry.device_name})")
    return BandwidthModel(
        device=spec.name,
        floor_us=entry.floor_us,
        bandwidth_gbs=entry.bandwidth_gbs,
        launch_us=entry.launch_us,
        measured=f"measured on {entry.device_name} {entry.date}",
    )


def achieved_gbs(nbytes: float, time_us: float) -> float:
    """Bandwidth in GB/s of moving ``nbytes`` in ``time_us``."""
    if time_us <= 0 or not math.isfinite(time_us):
        raise ValueError(f"achieved_gbs needs a positive finite time, found {time_us} µs")
    return nbytes / time_us / BYTES_PER_US_PER_GBS
