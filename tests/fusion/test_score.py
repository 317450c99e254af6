"""Pattern scores (``fusion/score.py``): the delta evaluator [C §5.4] and the model-based score [B §4.3]."""

from __future__ import annotations

import pytest

from fusionstitching.fusion import explore
from fusionstitching.fusion.score import Scorer, pattern_bytes, unfused_bytes
from fusionstitching.graph.graph import Graph, GraphBuilder
from fusionstitching.graph.ops import DType
from fusionstitching.options import Options
from fusionstitching.schedule import feasible

ROWS = (8, 64, 1024, 8192)


def _chain(rows: int, cols: int = 1024) -> Graph:
    b = GraphBuilder("chain")
    x = b.parameter((rows, cols), DType.F32, "x")
    return b.build([b.unary("tanh", b.unary("neg", b.unary("exp", x)))])


def _fusable(graph: Graph):
    return [n for n in graph.nodes if n.op != "parameter"]


def _score(graph: Graph, nodes, mode: str = "delta", device: str = "H100"):
    schedule = feasible(graph, nodes)
    assert schedule, schedule
    return Scorer(graph, Options(device=device, score=mode)).score(nodes, schedule)


@pytest.mark.parametrize("mode", ["delta", "model"])
def test_fused_chain_scores_positive_and_grows_with_size(mode):
    values = []
    for rows in ROWS:
        graph = _chain(rows)
        score = _score(graph, _fusable(graph), mode)
        assert score.value > 0, score
        assert score.kernels_replaced == 3
        assert score.saved_bytes == 4 * rows * 1024 * 4  # two intermediates written and read back
        assert score.value == pytest.approx(score.reduced_mem_us + score.reduced_calls_us - score.penalty_us)
        values.append(score.value)
    assert values == sorted(values) and values[0] < values[-1], values


def test_launches_saved_are_counted_once_per_kernel_removed():
    graph = _chain(64)
    nodes = _fusable(graph)
    three, two = _score(graph, nodes), _score(graph, nodes[:2])
    assert three.reduced_calls_us == pytest.approx(2 * two.reduced_calls_us)
    assert two.reduced_calls_us > 0


@pytest.mark.parametrize("mode", ["delta", "model"])
def test_single_op_pattern_scores_zero(mode):
    graph = _chain(1024)
    for node in _fusable(graph):
        score = _score(graph, [node], mode)
        assert score.value == pytest.approx(0.0, abs=1e-9), (node.name, score)
        assert score.saved_bytes == 0


def test_pattern_bytes_count_inputs_once_and_only_escaping_outputs():
    b = GraphBuilder("bytes")
    x = b.parameter((16, 32), DType.F32, "x")
    h = b.binary("mul", x, x)  # x is read once by the fused kernel
    out = b.unary("exp", h)
    graph = b.build([out, h])  # h escapes as a graph output
    nodes = _fusable(graph)
    size = 16 * 32 * 4
    assert pattern_bytes(graph, nodes) == 3 * size
    assert pattern_bytes(graph, nodes[1:]) == 2 * size
    assert unfused_bytes(nodes[0]) == 2 * size  # distinct operands: x once


def test_reshape_costs_nothing_unfused():
    b = GraphBuilder("view")
    x = b.parameter((16, 32), DType.F32, "x")
    r = b.reshape(b.unary("exp", x), (512,))
    graph = b.build([b.unary("neg", r)])
    (node,) = [n for n in graph.nodes if n.op == "reshape"]
    assert unfused_bytes(node) == 0


def test_model_score_option_gives_a_plan():
    graph = _chain(1024)
    delta, model = explore(graph), explore(graph, options=Options(score="model"))
    assert delta.kernel_count == model.kernel_count == 1
    assert model.patterns[0].score > 0
    assert "model score" in model.explain()


def test_scores_follow_the_device():
    graph = _chain(8192)
    nodes = _fusable(graph)
    scores = {device: _score(graph, nodes, device=device).value for device in ("H100", "V100")}
    assert all(v > 0 for v in scores.values())
    assert scores["V100"] != scores["H100"]  # different bandwidth model, same pattern


def test_a_block_walking_down_a_column_moves_a_sector_per_element():
    """``sector_factor``: lanes along the rows of a row-major [rows, 64] bf16 matrix (a BatchNorm's
    statistics over a channels-last tensor, one block per channel) touch a 32-byte sector per
    2-byte element; lanes along the row, or each lane's vector along it, move what they use."""
    from fusionstitching.fusion.score import sector_factor
    from fusionstitching.schedule.template import parse_template

    def factor(text, space, itemsize):
        return sector_factor(parse_template(text + "; launch(blocks=1,threads=256)").schedules[0], space, itemsize)

    assert factor("r[CTA,GRID]", (4096, 64), 2) == 16
    assert factor("r[CTA,GRID]", (4096, 64), 4) == 8
    assert factor("r[CTA,GRID]", (4096, 4), 2) == 1  # neighbouring rows share a sector
    assert factor("r[GRID,GRID-CTA_64]", (4096, 64), 2) == 1
    assert factor("r[GRID,THREAD_2-CTA_256-THREAD_8]", (8192, 4096), 4) == 1  # a vector per lane
    assert factor("r[GRID-CTA_256,THREAD_8]", (4096, 8), 2) == 1  # each lane's whole row


def test_the_estimate_counts_the_sectors_a_schedule_moves():
    """The latency evaluator's memory side charges a column walked by a block's threads its
    sectors (16 per element used here), so that it costs more than two blocks reading along the
    rows, which the evaluator sees as latency-bound."""
    from fusionstitching.fusion.estimate import kernel_time_us
    from fusionstitching.schedule.template import parse_template

    b = GraphBuilder("columns")
    x = b.parameter((65536, 64), DType.BF16, "x")
    r = b.reduce(x, (0,), "sum")
    graph = b.build([r])
    scorer = Scorer(graph, Options())
    down = parse_template("reduce[CTA,GRID]; launch(blocks=64,threads=256)")
    along = parse_template("reduce[THREAD_8-WARP_8,GRID-CTA_32]; launch(blocks=2,threads=256)")
    assert kernel_time_us(scorer, [r], down) > kernel_time_us(scorer, [r], along)


def test_a_kernel_ending_in_a_slice_reads_and_computes_only_the_sliced_elements():
    """BatchNorm's variance shift ``x.float()[0, :, 0, 0]``: a kernel computing it reads 64 of the
    convolution output's elements and converts 64, not the whole [32, 56, 56, 64] tensor (counted
    whole, its one-block kernel was estimated at 48 µs and the slice stayed in the statistics'
    kernel, whose merged template was then refused): a launch and a few µs. Elements read twice
    through two slices are counted once; a slice kernel alone moves its result twice."""
    from fusionstitching.fusion.estimate import kernel_time_us

    b = GraphBuilder("shift")
    x = b.parameter((32, 56, 56, 64), DType.BF16, "x")
    wide = b.convert(x, DType.F32)
    first = b.node("slice", [wide], start=(0, 0, 0, 0), limit=(1, 1, 1, 64), stride=(1, 1, 1, 1))
    graph = b.build([first])
    nodes = [n for n in graph.nodes if n.op not in ("parameter", "constant")]
    assert pattern_bytes(graph, nodes) == 64 * 2 + 64 * 4
    assert unfused_bytes(graph.node(first.name)) == 2 * 64 * 4
    scorer = Scorer(graph, Options())
    assert kernel_time_us(scorer, nodes, feasible(graph, nodes)) < scorer.launch_us + 5.0
    b = GraphBuilder("halves")
    x = b.parameter((64, 128), DType.F32, "x")
    left = b.node("slice", [x], start=(0, 0), limit=(64, 64), stride=(1, 1))
    right = b.node("slice", [x], start=(0, 64), limit=(64, 128), stride=(1, 1))
    graph = b.build([b.binary("add", left, right)])
    nodes = [n for n in graph.nodes if n.op not in ("parameter", "constant")]
    assert pattern_bytes(graph, nodes) == 64 * 128 * 4 + 64 * 64 * 4


def test_recomputed_reductions_are_charged_their_round_trips():
    """``Scorer.recomputation_us``: a packed sub-kernel that reads a reduction computed by another
    sub-kernel recomputes it at each point, 256 loads for each of ``scaled``'s points here, one
    after another, where the other sub-kernel makes one round trip; the same nest reading no
    reduction adds nothing."""
    from tests.recomputing import recomputing_kernel

    graph, nodes, packed = recomputing_kernel()
    scorer = Scorer(graph, Options())
    # 16 runs of 16 loads, less the memory time the kernel takes anyway (its floor)
    charged = scorer.recomputation_us(nodes, packed)
    assert 16 * scorer.spec.memory_latency_us > charged > 8 * scorer.spec.memory_latency_us
    graph, nodes, packed = recomputing_kernel(reads_a_reduction=False)
    assert Scorer(graph, Options()).recomputation_us(nodes, packed) == 0.0


def test_a_plan_recomputing_groupnorms_sums_loses_to_the_charged_selection(monkeypatch):
    """The f32 UNet block's backward (batch 8, 256 channels, 64 × 64, GroupNorm 32): the delta
    score's selection puts GroupNorm's per-channel final sums in one packed kernel with the
    per-group sums and their scaling, whose threads recompute the 32-part channel sums for
    each group's 8 channels, 1024 loads one after another (a 46 µs kernel on an H200). The
    selection charged that time keeps the sums apart, and the latency evaluator keeps it. (The
    schedule's ``resummed`` refusal now keeps such a kernel out of the uncharged selection too:
    its packed template sums the serially summed channel sums again for every point.)"""
    import gzip
    from pathlib import Path

    from fusionstitching.graph.serialize import from_json

    text = gzip.decompress((Path(__file__).parent.parent / "data" / "unet_block_backward.json.gz").read_bytes())
    graph = from_json(text.decode())
    plan = explore(graph, options=Options())
    monkeypatch.setattr(Scorer, "recomputation_us", lambda self, nodes, schedule: 0.0)
    uncharged = explore(graph, options=Options())
    monkeypatch.undo()  # the checks below charge recomputation again
    assert plan.estimated_us <= uncharged.estimated_us, (plan.explain(), uncharged.explain())
    for chosen in (plan, uncharged):
        scorer = Scorer(chosen.graph, Options())
        _no_recomputation(chosen, scorer)


def _no_recomputation(plan, scorer) -> None:
    position = plan.graph.index.position
    for pattern in plan.patterns:
        nodes = sorted((plan.graph.node(n) for n in pattern.nodes), key=position.__getitem__)
        assert scorer.recomputation_us(nodes, pattern.schedule) < 5.0, pattern


def test_a_group_walked_by_a_quarter_of_its_block_is_not_chosen():
    """The bf16 GroupNorm+SiLU forward as torch 2.11 captures it on a GPU ([16, 512, 64, 64], 32
    groups). With its reshapes split, the statistics and the normalization fit one kernel, a block
    per group, whose last group tiles 64 lanes of 256 threads with 1024 points each: 491 µs on an
    H200 against 82 µs for the two kernels of the unsplit plan. Priced by bytes alone it was
    estimated at 59.8 µs and chosen; the round trips of its threads' loops (``loop_rounds``) make
    it the dearer plan."""
    import gzip
    from pathlib import Path

    from fusionstitching.graph.serialize import from_json

    text = gzip.decompress((Path(__file__).parent.parent / "data" / "groupnorm_silu_bf16_gpu_graph.json.gz").read_bytes())
    plan = explore(from_json(text.decode()), options=Options())
    assert plan.kernel_count == 2, plan.explain()
    note = next(n for n in plan.notes if n.startswith("reshapes resolved by splitting dims"))
    assert note.endswith("kept unsplit"), note
