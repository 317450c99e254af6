"""Threads per block of a block per row that reads its row more than once (``grouping._rereading_threads``):
the fewest at which the rows in flight fit in the reference GPU's L2, so the second pass finds
them there."""

from __future__ import annotations

import pytest

from fusionstitching.cost.gpu_spec import gpu_spec
from fusionstitching.cost.latency import occupancy
from fusionstitching.graph.graph import GraphBuilder
from fusionstitching.graph.ops import DType
from fusionstitching.options import Options
from fusionstitching.schedule import feasible

F32, BF16 = DType.F32, DType.BF16


def _statistics(rows: int, length: int, normalized: bool = False, passes: int = 2):
    """Mean and variance around it per row of a bf16 [rows, length] (GroupNorm's statistics), or only
    the sum (``passes=1``); ``normalized`` also writes the normalized rows."""
    b = GraphBuilder("stats")
    x = b.convert(b.parameter((rows, length), BF16, "x"), F32)
    total = b.reduce(x, [1], "sum")
    mean = b.binary("mul", total, b.broadcast(b.constant(1 / length, F32), (rows,), ()))
    outputs = [mean]
    if passes > 1:
        centred = b.binary("sub", x, b.broadcast(mean, (rows, length), (0,)))
        var = b.reduce(b.binary("mul", centred, centred), [1], "sum")
        outputs.append(var)
        if normalized:
            outputs.append(b.convert(b.binary("mul", centred, b.broadcast(var, (rows, length), (0,))), BF16))
    graph = b.build(outputs)
    return graph, [n for n in graph.nodes if n.op != "parameter"]


def _log_sum_exp(rows: int, length: int):
    """A loss's row statistics: max, then the sum of exponentials around it, as one [rows] value."""
    b = GraphBuilder("lse")
    x = b.convert(b.parameter((rows, length), BF16, "x"), F32)
    top = b.reduce(x, [1], "max")
    shifted = b.binary("sub", x, b.broadcast(top, (rows, length), (0,)))
    total = b.reduce(b.unary("exp", shifted), [1], "sum")
    graph = b.build([b.binary("add", b.unary("log", total), top)])
    return graph, [n for n in graph.nodes if n.op != "parameter"]


def _threads(graph, nodes) -> int:
    template = feasible(graph, nodes)
    assert template, template
    return template.launch.threads


def _fits(rows: int, row_bytes: int, threads: int) -> bool:
    spec = gpu_spec(Options.device)
    resident = spec.sms * occupancy(spec, threads)
    return min(rows, resident) * row_bytes <= spec.l2_bytes


@pytest.mark.parametrize("rows,length", [(512, 65536), (128, 65536), (2048, 16384)])
def test_statistics_take_the_fewest_threads_whose_rows_in_flight_fit_in_l2(rows, length):
    threads = _threads(*_statistics(rows, length))
    row_bytes = 2 * length
    assert _fits(rows, row_bytes, threads)
    assert threads == 256 or not _fits(rows, row_bytes, threads // 2)


def test_groupnorm_statistics_over_512_rows_of_128_kb_take_1024_threads():
    assert _threads(*_statistics(512, 65536)) == 1024


def test_a_single_pass_or_whole_rows_written_keep_the_default_block():
    assert _threads(*_statistics(512, 65536, passes=1)) == 256
    assert _threads(*_statistics(512, 65536, normalized=True)) == 256


def test_a_loss_over_8192_rows_of_32000_takes_512_threads():
    assert _threads(*_log_sum_exp(8192, 32000)) == 512
