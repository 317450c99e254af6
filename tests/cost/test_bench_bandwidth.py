import importlib.util
import itertools
import subprocess
import sys

import pytest
import torch

from fusionstitching.bench import bandwidth as bench
from fusionstitching.cost import Measurement, bandwidth_model
from fusionstitching.cost.measured import MEASUREMENTS

ENTRY = Measurement(
    device_name="NVIDIA H200",
    spec_key="H200",
    date="2025-01-02",
    floor_us=2.5,
    bandwidth_gbs=4300.0,
    launch_us=6.1,
    points=((8192, 2.502), (2 * 1024**3, 502.0)),
)


def test_help_works_without_a_gpu():
    done = subprocess.run(
        [sys.executable, "-m", "fusionstitching.bench.bandwidth", "--help"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode == 0
    assert "--write" in done.stdout


def test_main_without_cuda_exits_with_a_clear_message(monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert bench.main([]) != 0
    err = capsys.readouterr().err
    assert "needs a CUDA GPU" in err and "nothing measured" in err


def test_too_few_repetitions_are_refused():
    with pytest.raises(SystemExit):
        bench.main(["--reps", "5"])


def test_sizes_are_powers_of_two_from_4_kib_to_1_gib():
    sizes = bench.tensor_sizes()
    assert sizes[0] == 4096 and sizes[-1] == 1024**3 and len(sizes) == 19
    assert all(b == 2 * a for a, b in itertools.pairwise(sizes))


def test_checked_in_file_is_what_the_script_writes():
    assert bench.measured_path().read_text() == bench.render_measurements(MEASUREMENTS)


def test_written_file_round_trips_and_merges(tmp_path):
    older = Measurement("NVIDIA A100-SXM4-80GB", "A100", "2024-12-01", 3.0, 1800.0, 6.0, ((8192, 3.0),))
    stale = Measurement("NVIDIA H200", "H200", "2024-12-01", 9.0, 1000.0, 9.0, ((8192, 9.0),))
    path = tmp_path / "measured.py"
    bench.write_measurement(ENTRY, path, {"A100": older, "H200": stale})
    text = path.read_text()
    assert all(len(line) <= 110 for line in text.splitlines())
    spec = importlib.util.spec_from_file_location("written_measurements", path)
    written = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(written)
    assert written.MEASUREMENTS == {"A100": older, "H200": ENTRY}
    assert bandwidth_model("H200", written.MEASUREMENTS).floor_us == 2.5


def test_unknown_spec_key_is_not_recorded():
    with pytest.raises(KeyError, match="known"):
        bench.merge({}, Measurement("Some GPU", "", "2025-01-02", 1.0, 1.0, 1.0, ()))


def test_json_report():
    text = bench.to_json(ENTRY)
    assert '"spec_key": "H200"' in text and '"peak_bandwidth_gbs": 4800.0' in text
    assert '"launch_us": 6.1' in text and '"median_us": 502.0' in text


class FakeTorch:
    """A stand-in for torch on a GPU whose ops take t0 + bytes / B on a simulated clock."""

    float32 = "float32"

    def __init__(self, floor_us=2.0, bandwidth_gbs=4000.0):
        self.clock_us = 0.0
        self.floor_us, self.bandwidth_gbs = floor_us, bandwidth_gbs
        self.cuda = self.Cuda(self)

    def run(self, nbytes):
        self.clock_us += self.floor_us + nbytes / (self.bandwidth_gbs * 1e3)

    def empty(self, n, dtype=None, device=None):
        assert device == "cuda" and dtype in (None, "float32")
        return FakeTensor(self, n)

    ones = zeros = empty

    def empty_like(self, t):
        return FakeTensor(self, t.n)

    class Cuda:
        def __init__(self, torch):
            self.torch = torch

        def Event(self, enable_timing=False):  # torch.cuda.Event
            assert enable_timing
            return FakeEvent(self.torch)

        def synchronize(self):
            pass

        def get_device_name(self):
            return "NVIDIA H200"


class FakeTensor:
    def __init__(self, torch, n):
        self.torch, self.n = torch, n

    def copy_(self, src):
        self.torch.run(8 * self.n)

    def zero_(self):
        self.torch.run(4 * self.n)

    def add_(self, value):
        self.torch.run(8 * self.n)


class FakeEvent:
    def __init__(self, torch):
        self.torch, self.at_us = torch, None

    def record(self):
        self.at_us = self.torch.clock_us

    def elapsed_time(self, end):
        return (end.at_us - self.at_us) / 1e3


def test_measure_on_a_simulated_gpu():
    fake = FakeTorch(floor_us=2.0, bandwidth_gbs=4000.0)
    m = bench.measure(fake, reps=20, flush=True, max_bytes=1 << 24)
    assert (m.device_name, m.spec_key) == ("NVIDIA H200", "H200")
    assert [p[0] for p in m.points] == [2 * s for s in bench.tensor_sizes(4096, 1 << 24)]
    assert m.floor_us == pytest.approx(2.0, abs=0.01) and m.bandwidth_gbs == pytest.approx(4000.0, rel=1e-3)
    assert m.launch_us > 0
    assert bandwidth_model("H200", {"H200": m}).measured.startswith("measured on NVIDIA H200 ")


def test_json_round_trips():
    assert bench.from_json(bench.to_json(ENTRY)) == ENTRY


def test_record_a_printed_result_without_a_gpu(tmp_path, monkeypatch, capsys):
    printed = tmp_path / "h200.json"
    printed.write_text(bench.to_json(ENTRY))
    target = tmp_path / "measured.py"
    monkeypatch.setattr(bench, "measured_path", lambda: target)
    assert bench.main(["--record", str(printed)]) == 0
    assert target.read_text() == bench.render_measurements({**MEASUREMENTS, "H200": ENTRY})
    assert "recorded H200" in capsys.readouterr().err


def test_record_refuses_an_unknown_gpu(tmp_path, monkeypatch, capsys):
    target = tmp_path / "measured.py"
    monkeypatch.setattr(bench, "measured_path", lambda: target)
    unknown = Measurement("NVIDIA GeForce RTX 4090", "", "2025-01-02", 2.0, 900.0, 5.0, ((8192, 2.0),))
    assert bench.record(unknown) == 1
    assert not target.exists()
    assert "matches no cost.gpu_spec key" in capsys.readouterr().err
