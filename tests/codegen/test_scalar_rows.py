"""Copies of rows that no vector divides (a padded GEMM's result unpadded) take several rows per
thread, so that each thread has several loads in flight (``schedule/tune.py``, the "rows" family;
``codegen/packed.py`` tests a column tail once, before the thread's loop): the plan's template and
its values, on the CPU and, where there is one, on the GPU."""

from __future__ import annotations

import pytest
import torch

from fusionstitching.fusion import explore
from fusionstitching.graph.graph import GraphBuilder
from fusionstitching.graph.ops import DType
from fusionstitching.options import Options
from fusionstitching.pipeline import compile_plan

DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA device")])]
CASES = [(2048, 3001, 3008, DType.BF16), (96 * 300, 300, 304, DType.BF16), (4096, 4095, 4096, DType.F32)]


def _unpadded(rows: int, cols: int, padded: int, dtype: DType):
    b = GraphBuilder("unpad")
    x = b.parameter((rows, padded), dtype, "x")
    return b.build([b.node("slice", [x], start=(0, 0), limit=(rows, cols), stride=(1, 1))])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("rows, cols, padded, dtype", CASES)
def test_unpadding_copies_take_several_rows_per_thread_and_copy_exactly(rows, cols, padded, dtype, device):
    plan = explore(_unpadded(rows, cols, padded, dtype), options=Options(device="H200"))
    (pattern,) = plan.patterns
    first_dim = str(pattern.schedule).split("[", 1)[1].split(",", 1)[0]
    assert first_dim.startswith("GRID-THREAD_"), pattern.schedule
    compiled = compile_plan(plan, options=Options(strict=True))
    x = torch.randn(rows, padded, dtype=torch.bfloat16 if dtype == DType.BF16 else torch.float32, device=device)
    (got,) = compiled(x)
    assert torch.equal(got, x[:, :cols])
