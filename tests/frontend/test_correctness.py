"""Model-level correctness checks (``bench/correctness.py``): small sizes through the simulator
here; every check at benchmark size on a GPU (``-m gpu``), where each also prints its row."""

from __future__ import annotations

import math

import pytest
import torch

from fusionstitching.bench import correctness as C

gpu_only = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
CPU = torch.device("cpu")


def test_a_check_fails_on_nan_and_on_a_large_error():
    ref = torch.ones(4)
    assert C.relative_error(torch.tensor([1.0, math.nan, 1.0, 1.0]), ref) == math.inf
    assert not C.Check("x", "y", C.relative_error(ref * 2, ref), 1e-4).passed
    assert C.Check("x", "y", C.relative_error(ref, ref), 1e-4).passed


def test_small_checks_pass_on_cpu():
    results = [C.check_inference("softmax_scale_mask", CPU, {}), C.check_adam(CPU, {}),
               C.check_dropout(CPU, numel=1 << 14)]
    table = C.table(results)
    assert all(c.passed for c in results), table
    assert all(c.kernels >= 1 and c.fallbacks == 0 for c in results), table


@pytest.mark.gpu
@gpu_only
def test_every_check_passes_at_benchmark_size_on_gpu():
    results = C.run_all(torch.device("cuda"))
    print(C.table(results))
    assert all(c.passed for c in results), C.table(results)
    assert all(c.fallbacks == 0 for c in results), C.table(results)
