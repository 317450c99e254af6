"""The record of one device's measured bandwidth curve (``cost/measured.py`` holds the recorded
ones; ``cost.bandwidth.bandwidth_model`` reads them)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Measurement:
    """One device's recorded bandwidth curve: the fitted constants and the points they came from.

    ``points`` are (bytes moved, median µs) of a device-to-device copy; ``launch_us`` is the host
    wall time per launch of a tiny kernel launched back to back.
    """

    device_name: str  # as the GPU reports it, e.g. "NVIDIA H200"
    spec_key: str  # the cost.gpu_spec key, e.g. "H200"
    date: str  # ISO date of the measurement
    floor_us: float
    bandwidth_gbs: float
    launch_us: float
    points: tuple[tuple[int, float], ...]
