"""``runtime/gemm_timing.py``: unaligned library GEMMs timed once per GPU, unaligned and padded,
kept in the performance library, and handed to the planner as ``Options.gemm_timings``."""

from __future__ import annotations

import pytest
import torch

from fusionstitching.cost.gpu_spec import gpu_spec
from fusionstitching.cost.perflib import FILE_NAME, PerfLib
from fusionstitching.fusion.padding import pad_unaligned_dots, unaligned_gemms
from fusionstitching.graph.graph import GraphBuilder
from fusionstitching.graph.ops import DType
from fusionstitching.options import Options
from fusionstitching.runtime import gemm_timing

H200 = gpu_spec("H200")
gpu_only = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _scores(length: int = 300, dtype: DType = DType.BF16):
    """Attention scores q·kᵀ of [96, length, 64] operands: rows of ``length`` elements."""
    b = GraphBuilder("scores")
    q, k = (b.parameter((96, length, 64), dtype, name) for name in "qk")
    return b.build([b.node("dot_general", [q, k], lhs_batch=(0,), rhs_batch=(0,), lhs_contract=(2,),
                           rhs_contract=(2,))])


@pytest.fixture
def fresh(monkeypatch):
    """An empty process-wide table and counts; on a CPU-only torch, a CUDA runtime capturing nothing."""
    monkeypatch.setattr(gemm_timing, "_TIMED", {})
    monkeypatch.setattr(gemm_timing, "COUNTS", {"timed": 0, "read": 0})
    if not torch.cuda.is_available():
        monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)


def test_times_are_measured_once_kept_in_the_library_and_read_by_a_later_process(tmp_path, monkeypatch, fresh):
    measured = []

    def measure(problem, device):
        measured.append(problem.describe())
        return 30.0, 10.0

    monkeypatch.setattr(gemm_timing, "_measure", measure)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Test GPU")
    options = Options(cache_dir=str(tmp_path))
    graph = _scores()
    (problem,) = unaligned_gemms(graph, options)
    timings = gemm_timing.gemm_timings(graph, options, "cuda:0")
    assert timings == ((problem.describe(), 30.0, 10.0),) and measured == [problem.describe()]
    assert gemm_timing.gemm_timings(graph, options, "cuda:0") == timings and len(measured) == 1
    assert gemm_timing.COUNTS == {"timed": 1, "read": 0}
    (winner,) = PerfLib(tmp_path / FILE_NAME).winners()
    assert winner.template == "padded" and winner.description == f"GEMM {problem.describe()}"

    monkeypatch.setattr(gemm_timing, "_TIMED", {})  # a new process: the library's figures, nothing timed
    assert gemm_timing.gemm_timings(graph, options, "cuda:0") == timings and len(measured) == 1
    assert gemm_timing.COUNTS == {"timed": 1, "read": 1}
    _, done = pad_unaligned_dots(graph, H200, Options(gemm_timings=timings))
    assert [d.measured for d in done] == [True]

    # another GPU is timed anew
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Other GPU")
    gemm_timing.gemm_timings(graph, options, "cuda:0")
    assert len(measured) == 2


def test_nothing_is_timed_with_tuning_off_without_the_pass_or_without_unaligned_gemms(tmp_path, monkeypatch, fresh):
    monkeypatch.setattr(gemm_timing, "_measure", lambda problem, device: pytest.fail("measured"))
    for options in (Options(tune="off", cache_dir=str(tmp_path)), Options(pad_gemms=False, cache_dir=str(tmp_path))):
        assert gemm_timing.gemm_timings(_scores(), options, "cuda:0") == ()
    assert gemm_timing.gemm_timings(_scores(length=256), Options(cache_dir=str(tmp_path)), "cuda:0") == ()
    assert not (tmp_path / FILE_NAME).exists()


def test_malformed_gemm_timings_are_refused_with_the_entry_named():
    for bad in (("problem", 1.0), ("problem", -1.0, 2.0), (3, 1.0, 2.0), "problem"):
        with pytest.raises(ValueError, match=r"Options.gemm_timings: each entry is \(GEMM problem"):
            Options(gemm_timings=(bad,))
    assert Options(gemm_timings=(("problem", 26.4, 9.8),)).gemm_timings == (("problem", 26.4, 9.8),)


@pytest.mark.gpu
@gpu_only
def test_padding_an_unaligned_bf16_gemm_is_measured_faster_and_f32_is_measured_no_slower(tmp_path, fresh):
    """On a GPU: the bf16 scores of 300-long rows run the narrow-load kernel, slower than padded to
    304; f32 GEMMs (no TF32) run the same kernels either way, and padding is not taken."""
    device = torch.device("cuda", torch.cuda.current_device())
    options = Options(cache_dir=str(tmp_path))
    state = torch.cuda.get_rng_state(device)
    ((_, unaligned, padded),) = gemm_timing.gemm_timings(_scores(), options, device)
    assert padded < unaligned, (unaligned, padded)
    assert torch.equal(torch.cuda.get_rng_state(device), state)  # torch's generator untouched
    f32 = _scores(length=302, dtype=DType.F32)  # 300 is a whole number of f32 vectors
    timings = gemm_timing.gemm_timings(f32, options, device)
    assert pad_unaligned_dots(f32, H200, Options(gemm_timings=timings))[1] == [], timings
    assert gemm_timing.COUNTS["timed"] == 2
