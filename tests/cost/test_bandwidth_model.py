import itertools

import numpy as np
import pytest

from fusionstitching.cost import BandwidthModel, Measurement, bandwidth_model, fit, gpu_spec
from fusionstitching.cost.measured import MEASUREMENTS

SIZES = [4096 * 2**k for k in range(19)]  # 4 KiB .. 1 GiB


def synthetic(floor_us, bandwidth_gbs, noise=0.0, seed=0):
    rng = np.random.default_rng(seed)
    times = [floor_us + v / (bandwidth_gbs * 1e3) for v in SIZES]
    return [t * (1 + noise * rng.standard_normal()) for t in times]


def test_fit_recovers_exact_constants():
    floor_us, bandwidth_gbs = fit(SIZES, synthetic(3.0, 3000.0))
    assert floor_us == pytest.approx(3.0, rel=1e-9)
    assert bandwidth_gbs == pytest.approx(3000.0, rel=1e-9)


@pytest.mark.parametrize("seed", range(5))
def test_fit_recovers_constants_under_noise(seed):
    floor_us, bandwidth_gbs = fit(SIZES, synthetic(2.5, 4200.0, noise=0.03, seed=seed))
    assert floor_us == pytest.approx(2.5, rel=0.05)
    assert bandwidth_gbs == pytest.approx(4200.0, rel=0.05)


@pytest.mark.parametrize(
    "sizes, times, reason",
    [
        ([4096, 8192], [1.0], "as many sizes as times"),
        ([4096, 4096], [1.0, 1.1], "two distinct sizes"),
        ([4096], [1.0], "two distinct sizes"),
        ([4096, 8192], [1.0, -2.0], "positive"),
        ([0, 8192], [1.0, 2.0], "positive"),
        ([4096, 8192], [1.0, float("nan")], "finite"),
        ([4096, 1 << 30], [10.0, 5.0], "no bandwidth curve"),  # time falls with size
        ([1 << 20, 1 << 30], [1.0, 2000.0], "no bandwidth curve"),  # negative floor
    ],
)
def test_fit_rejects_nonsense_naming_the_data(sizes, times, reason):
    with pytest.raises(ValueError, match=reason) as err:
        fit(sizes, times)
    assert "sizes [" in str(err.value)


def test_time_is_monotone_and_zero_for_nothing():
    model = bandwidth_model("H100", measurements={})
    assert model.time_us(0) == 0.0 and model.time_us(-5) == 0.0
    times = [model.time_us(v) for v in SIZES]
    assert times[0] == pytest.approx(model.floor_us, rel=0.01)
    assert all(a < b for a, b in itertools.pairwise(times))
    assert model.time_us(1e9) == pytest.approx(2.0 + 1e9 / (0.9 * 3350.0 * 1e3))


def test_efficiency_has_the_figure_4_shape():
    """Small transfers use a sliver of the peak; efficiency rises towards bandwidth / peak."""
    model = bandwidth_model("H200", measurements={})
    effs = [model.efficiency(v) for v in SIZES]
    assert model.efficiency(0) == 0.0
    assert effs[0] < 0.01
    assert all(a < b for a, b in itertools.pairwise(effs))
    assert effs[-1] == pytest.approx(0.9, rel=0.01)
    assert effs[-1] < model.bandwidth_gbs / gpu_spec("H200").peak_bandwidth_gbs


def test_falls_back_to_the_datasheet_estimate():
    model = bandwidth_model("a100", measurements={})
    assert model == BandwidthModel(
        device="A100", floor_us=2.0, bandwidth_gbs=0.9 * 2039.0, launch_us=5.0, measured="datasheet estimate"
    )


def test_uses_a_measured_entry_when_present():
    entry = Measurement(
        device_name="NVIDIA H200",
        spec_key="H200",
        date="2025-01-02",
        floor_us=3.1,
        bandwidth_gbs=4100.0,
        launch_us=6.2,
        points=((8192, 3.1), (2 * 1024**3, 527.0)),
    )
    model = bandwidth_model("H200", measurements={"H200": entry})
    assert (model.device, model.floor_us, model.bandwidth_gbs, model.launch_us) == ("H200", 3.1, 4100.0, 6.2)
    assert model.measured == "measured on NVIDIA H200 2025-01-02"
    assert bandwidth_model("H100", measurements={"H200": entry}).measured == "datasheet estimate"


def test_measured_entry_under_the_wrong_key_is_rejected():
    entry = Measurement("NVIDIA H100", "H100", "2025-01-02", 3.0, 3000.0, 5.0, ((8192, 3.0),))
    with pytest.raises(ValueError, match="filed under H200 is for H100"):
        bandwidth_model("H200", measurements={"H200": entry})


def test_default_reads_the_checked_in_measurements(monkeypatch):
    entry = Measurement("NVIDIA V100", "V100", "2025-01-02", 4.0, 800.0, 7.0, ((8192, 4.0),))
    monkeypatch.setitem(MEASUREMENTS, "V100", entry)
    assert bandwidth_model("V100").measured == "measured on NVIDIA V100 2025-01-02"


def test_unknown_device():
    with pytest.raises(KeyError, match="known"):
        bandwidth_model("TPU")


def test_model_rejects_nonsense():
    with pytest.raises(ValueError, match="bandwidth_gbs > 0"):
        BandwidthModel("H100", 2.0, 0.0, 5.0, "datasheet estimate")


def test_checked_in_measurements_are_consistent():
    """Every recorded entry is filed under its spec key and its constants are the fit of its points."""
    for key, entry in MEASUREMENTS.items():
        assert entry.spec_key == key and gpu_spec(key).name == key
        floor_us, bandwidth_gbs = fit([p[0] for p in entry.points], [p[1] for p in entry.points])
        assert entry.floor_us == pytest.approx(floor_us, rel=0.01, abs=0.01)
        assert entry.bandwidth_gbs == pytest.approx(bandwidth_gbs, rel=0.01)
        assert entry.bandwidth_gbs <= gpu_spec(key).peak_bandwidth_gbs
