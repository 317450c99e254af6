"""Packing in ``schedule.feasible``: outputs that share no node as sub-kernels with blocks of their
own (packed final sums of bias gradients), inline reductions counted as a thread's work, and no
column-sum sub-kernel recomputing another sub-kernel's work."""

from __future__ import annotations

import math
import re

import ml_dtypes
import numpy as np
import pytest

from fusionstitching.codegen import generate
from fusionstitching.graph import reference
from fusionstitching.graph.graph import GraphBuilder
from fusionstitching.graph.ops import DType
from fusionstitching.schedule import feasible


def _final_sums(count: int, shared: bool = False):
    """``count`` final column sums [64, 768] → [768] with their casts (bias gradients after a split
    reduction), optionally all scaled by one shared elementwise node."""
    b = GraphBuilder("finals")
    scale = b.parameter((64, 768), DType.F32, "scale") if shared else None
    common = b.unary("exp", scale) if shared else None
    outs = []
    for k in range(count):
        x = b.parameter((64, 768), DType.F32, f"p{k}")
        if common is not None:
            x = b.binary("mul", x, common)
        total = b.reshape(b.reshape(b.reduce(x, [0], "sum"), (1, 768)), (768,))
        outs.append(b.convert(b.convert(total, DType.BF16), DType.F32))
    graph = b.build(outs)
    return graph, [n for n in graph.nodes if n.op != "parameter"]


def test_independent_final_sums_are_packed_with_a_block_range_each():
    """Outputs that share no node are sub-kernels with blocks of their own, each thread reducing its
    column inline (30 bias-gradient sums: 90 blocks, not the 3 of one output); with a node shared
    between them (here an exp) they keep the thread-serial template, which computes it once."""
    graph, nodes = _final_sums(30)
    answer = feasible(graph, nodes)
    assert answer and answer.launch.blocks == 90, answer
    assert all(s.root.startswith("convert") for s in answer.schedules)
    graph, nodes = _final_sums(3)
    kernel = generate(graph, nodes, feasible(graph, nodes))
    assert kernel.cuda_source.count("sub-kernel") == 3
    data = [np.random.default_rng(k).standard_normal((64, 768)).astype(np.float32) for k in range(3)]
    for got, x in zip(kernel.simulate(data), data):
        want = x.sum(0).astype(ml_dtypes.bfloat16).astype(np.float32)
        np.testing.assert_allclose(got, want, rtol=1e-2, atol=1e-2)
    graph, nodes = _final_sums(3, shared=True)
    answer = feasible(graph, nodes)
    assert answer and answer.launch.blocks == 3 and any(s.root.startswith("reduce") for s in answer.schedules)


def test_feasible_counts_inline_reductions_as_work_per_thread():
    """A bias gradient summed over 4096 rows inline, packed next to a weight-gradient cast, would
    leave each of the sum's 768 threads 4096 × 4 points: refused for too little parallelism."""
    b = GraphBuilder("cast_and_sum")
    w = b.parameter((3072, 768), DType.BF16, "w")
    g = b.parameter((4096, 3072), DType.BF16, "g")
    total = b.reduce(b.convert(g, DType.F32), [0], "sum")
    graph = b.build([b.convert(w, DType.F32), b.convert(b.convert(total, DType.BF16), DType.F32)])
    answer = feasible(graph, [n for n in graph.nodes if n.op != "parameter"])
    assert not answer and "too little parallelism" in str(answer), answer


def _softmax(b: GraphBuilder, rows: int, cols: int):
    x = b.parameter((rows, cols), DType.F32, "x")
    e = b.unary("exp", b.binary("sub", x, b.broadcast(b.reduce(x, [1], "max"), (rows, cols), (0,))))
    return b.binary("div", e, b.broadcast(b.reduce(e, [1], "sum"), (rows, cols), (0,)))


def test_feasible_refuses_folding_a_row_reduction_once_per_element_of_the_row():
    """A softmax packed with an unrelated weight cast: the packed template would have each thread
    of the softmax output fold its row's max and sum (128 points) for every element it holds, 64
    times per row; refused with the reason. Alone, the softmax keeps its row template."""
    b = GraphBuilder("softmax_and_cast")
    y = _softmax(b, 256, 64)
    w = b.parameter((512, 512), DType.F32, "w")
    graph = b.build([y, b.convert(w, DType.BF16)])
    answer = feasible(graph, [n for n in graph.nodes if n.op != "parameter"])
    assert not answer, answer
    b = GraphBuilder("softmax")
    graph = b.build([_softmax(b, 256, 64)])
    answer = feasible(graph, [n for n in graph.nodes if n.op != "parameter"])
    assert answer and any(s.root.startswith("reduce") for s in answer.schedules), answer


def _gelu_backward_with_partial_sums(share: bool = True):
    """GELU's backward dy·gelu'(h) in bf16, and the partial column sums of a bias gradient (16 parts
    of 32 rows): of that gradient (``share``), or of an unrelated input."""
    b = GraphBuilder("gelu_backward")
    dy = b.parameter((512, 768), DType.BF16, "dy")
    h = b.parameter((512, 768), DType.BF16, "h")
    x = b.convert(h, DType.F32)
    cdf = b.unary("erf", b.binary("mul", x, b.broadcast(b.constant(0.7071, DType.F32), (512, 768), ())))
    pdf = b.unary("exp", b.binary("mul", b.binary("mul", x, x),
                                  b.broadcast(b.constant(-0.5, DType.F32), (512, 768), ())))
    grad = b.convert(b.binary("mul", b.convert(dy, DType.F32), b.binary("add", cdf, pdf)), DType.BF16)
    summed = grad if share else b.parameter((512, 768), DType.BF16, "other")
    parts = b.reduce(b.reshape(b.convert(summed, DType.F32), (16, 32, 768)), [1], "sum")
    graph = b.build([grad, parts])
    return graph, [n for n in graph.nodes if n.op not in ("parameter", "constant")]


def test_packed_partial_sums_do_not_recompute_the_elementwise_work_they_sum():
    """Sub-kernels share no registers: a partial sum packed with the GELU backward it sums would
    re-read dy and h and recompute erf and exp in its 32-row loop. That template is refused (the
    plan then keeps the two apart, or stitches the sum into the rows' own kernel); partial sums of
    an unrelated input are packed as before."""
    from fusionstitching.schedule.packing import recomputed_work

    graph, nodes = _gelu_backward_with_partial_sums()
    answer = feasible(graph, nodes)
    assert not answer or recomputed_work(*_pattern_and(graph, nodes, answer)) is None, answer
    from fusionstitching.schedule import refusals

    saved = refusals.recomputed
    try:  # without the rule, the packed template that recomputes is what feasible answers
        refusals.recomputed = lambda pattern, template: None
        packed = feasible(graph, nodes)
    finally:
        refusals.recomputed = saved
    assert packed and "recompute" in recomputed_work(*_pattern_and(graph, nodes, packed))
    graph, nodes = _gelu_backward_with_partial_sums(share=False)
    answer = feasible(graph, nodes)
    assert answer and len(answer.schedules) == 2, answer


def _pattern_and(graph, nodes, template):
    from fusionstitching.codegen.lower import resolve_pattern

    return resolve_pattern(graph, nodes), template


def _row_then_scale(shape, dims):
    """``x - mean`` written out beside ``sum((x - mean)²)`` over ``dims`` (BatchNorm's variance)."""
    b = GraphBuilder("variance")
    x = b.parameter(shape, DType.F32, "x")
    kept = tuple(d for d in range(len(shape)) if d not in dims)
    mean = b.reduce(x, list(dims), "sum")
    centered = b.binary("sub", x, b.broadcast(mean, shape, kept))
    graph = b.build([centered, b.reduce(b.binary("mul", centered, centered), list(dims), "sum")])
    return graph, [n for n in graph.nodes if n.op not in ("parameter", "constant")]


@pytest.mark.parametrize("shape, dims, offered", [
    ((64, 56, 56), (1, 2), False),  # rows of 3136 floats: lanes along the channel dim, a sector each
    ((64, 3136), (1,), False),
    ((4096, 4), (1,), True),  # rows of 16 bytes: a warp's lanes still share sectors
    ((3136, 64), (0,), True),  # a column sum: lanes along the contiguous kept dim
])
def test_thread_serial_rows_are_offered_only_where_lanes_share_sectors(shape, dims, offered):
    from fusionstitching.codegen.lower import resolve_pattern
    from fusionstitching.schedule.grouping import _candidate_templates, _crossing, thread_serial_template
    from fusionstitching.schedule.template import format_template

    graph, nodes = _row_then_scale(shape, dims)
    pattern = resolve_pattern(graph, nodes)
    serial = format_template(thread_serial_template(pattern, _crossing(pattern)))
    made = []
    for make in _candidate_templates(pattern):
        try:
            made.append(format_template(make()))
        except ValueError:
            continue
    assert (serial in made) == offered


def test_feasible_multiplies_nested_inline_reductions():
    """A split bias gradient (4096 rows as 32 partial sums of 128) folded whole into its cast's
    threads, packed next to a weight-gradient cast: each of the cast's threads would sum 32 × 128
    rows of its columns, not 32 + 128. Refused for too little parallelism."""
    b = GraphBuilder("cast_and_split_sum")
    w = b.parameter((3072, 768), DType.BF16, "w")
    g = b.parameter((4096, 2304), DType.BF16, "g")
    parts = b.reduce(b.reshape(b.convert(g, DType.F32), (32, 128, 2304)), [1], "sum")
    total = b.reduce(parts, [0], "sum")
    graph = b.build([b.convert(w, DType.F32), b.convert(b.convert(total, DType.BF16), DType.F32)])
    answer = feasible(graph, [n for n in graph.nodes if n.op != "parameter"])
    assert not answer and "too little parallelism" in str(answer), answer


def test_a_reduction_root_counts_its_own_points_once():
    """A LayerNorm weight gradient's final sum over [8, 16] blocks with the 8-row partial sums folded
    inline: each of the 768 threads reads 8 × 16 × 8 points. The root's own reduction is its
    iteration space already; only the folded partial multiplies it."""
    from fusionstitching.graph.pattern import resolve_pattern
    from fusionstitching.schedule.refusals import crowded
    from fusionstitching.schedule.template import KernelSchedule, Launch, Level, Schedule, Tile

    b = GraphBuilder("final_with_partial")
    x = b.parameter((8, 16, 8, 768), DType.F32, "x")
    partial = b.reduce(x, [2], "sum")
    total = b.reduce(partial, [0, 1], "sum")
    graph = b.build([total])
    pattern = resolve_pattern(graph, [partial, total])
    serial = (Tile(Level.THREAD),)
    template = KernelSchedule((Schedule(total.name, (serial, serial, (Tile(Level.GRID), Tile(Level.CTA, 256)))),),
                              Launch(3, 256))
    assert crowded(pattern, template) is None
    deeper = b.reduce(b.reshape(x, (8, 16, 4, 2, 768)), [3], "sum")  # a third level: 8 × 16 × 4 × 2
    graph = b.build([b.reduce(b.reduce(deeper, [2], "sum"), [0, 1], "sum")])
    nodes = [n for n in graph.nodes if n.op in ("reduce", "reshape")]
    root = graph.outputs[0]
    template = KernelSchedule((Schedule(root.name, (serial, serial, (Tile(Level.GRID), Tile(Level.CTA, 256)))),),
                              Launch(3, 256))
    assert crowded(resolve_pattern(graph, nodes), template) is None  # 1024 points per thread: the limit


def test_a_root_of_other_dims_is_not_tiled_as_column_sums():
    """The final sums of two column reductions [49, 1024] → [1024] beside a weight's cast
    [256, 1024, 1, 1] and its NHWC transpose: the thread-serial template would tile the cast as
    the sums' kept dim, its lanes on a dim of size 1 and its grid the sums' four blocks (13.6 ms
    on an H100 in ResNet-50's forward). Whatever template the pattern gets puts its lanes on a
    dim longer than one."""
    from fusionstitching.graph.graph import GraphBuilder
    from fusionstitching.graph.layout import TO_NHWC
    from fusionstitching.graph.ops import DType
    from fusionstitching.schedule import feasible
    from fusionstitching.schedule.template import Level, tile_extents

    b = GraphBuilder("finals")
    sums = [b.reduce(b.parameter((49, 1024), DType.F32, f"p{k}"), (0,), "sum") for k in range(2)]
    cast = b.convert(b.parameter((256, 1024, 1, 1), DType.F32, "w"), DType.BF16)
    graph = b.build(sums + [cast, b.transpose(cast, TO_NHWC)])
    template = feasible(graph, [n for n in graph.nodes if n.op != "parameter"])
    if not template:  # refused: the cast runs in a kernel of its own
        return
    schedule = template.schedule(cast.name)
    lanes = [size for size, tiles in zip(cast.shape, schedule.dims)
             for tile, extent in zip(tiles, tile_extents(size, tiles)) if tile.level == Level.CTA and extent > 1]
    assert lanes and all(size > 1 for size in lanes), str(template)


def test_a_packed_nest_does_not_refold_another_nests_column_sums():
    """BatchNorm's backward channels-last: the final sums of the statistics (32 partials per
    channel) packed beside the gradient that reads them. Packed nests share no values, so every
    element of the gradient would sum its channel's 32 partials again (225 µs for 26 MB on an
    H100): ``refolded`` refuses the packed template, as it does for a reduction left inline."""
    from fusionstitching.graph.graph import GraphBuilder
    from fusionstitching.graph.ops import DType
    from fusionstitching.graph.pattern import resolve_pattern
    from fusionstitching.schedule.packing import _packed_template
    from fusionstitching.schedule.refusals import refolded

    b = GraphBuilder("finals_and_gradient")
    sums = b.reduce(b.parameter((32, 2048), DType.F32, "partials"), (0,), "sum")
    x = b.parameter((1568, 2048), DType.F32, "x")
    gradient = b.binary("mul", x, b.broadcast(sums, (1568, 2048), (1,)))
    graph = b.build([sums, gradient])
    pattern = resolve_pattern(graph, [n for n in graph.nodes if n.op != "parameter"])
    assert refolded(pattern, _packed_template(pattern, 256)) is not None


def test_thread_serial_lanes_fill_the_block_over_a_packed_casts_small_dims():
    """A BatchNorm statistic split in 256 parts of 392 rows over 64 channels, packed beside a
    [64, 64, 3, 3] weight cast: the cast's lanes cover its 3 × 3 window and 28 input channels
    (tiled over its last dim alone, 253 of each block's 256 lanes were idle, and it ran 12288 block
    iterations on the 2 blocks its element count earned it), the sum keeps a block per part, and the
    cast's blocks are sized by its steps. Simulated equal to the reference."""
    from fusionstitching.codegen.lower import resolve_pattern
    from fusionstitching.schedule.grouping import _crossing, thread_serial_template
    from fusionstitching.schedule.template import Level, tile_extents

    b = GraphBuilder("split_stat_and_cast")
    x = b.parameter((256, 392, 64), DType.BF16, "x")
    w = b.parameter((64, 64, 3, 3), DType.F32, "w")
    partial = b.reduce(b.convert(x, DType.F32), [1], "sum")
    cast = b.convert(w, DType.BF16)
    graph = b.build([partial, cast])
    nodes = [n for n in graph.nodes if n.op not in ("parameter", "constant")]
    pattern = resolve_pattern(graph, nodes)
    template = thread_serial_template(pattern, _crossing(pattern))
    assert template.launch.blocks == 256
    sched = next(s for s in template.schedules if s.root == cast.name)
    space = (64, 64, 3, 3)
    busy = math.prod(min(size, math.prod(e for t, e in zip(tiles, tile_extents(size, tiles)) if t.level == Level.CTA))
                     for size, tiles in zip(space, sched.dims))
    assert busy >= 0.9 * template.launch.threads, sched
    kernel = generate(graph, nodes, template)
    ranges = re.findall(r"sub-kernel (\w+): blocks \[(\d+), (\d+)\)", kernel.cuda_source)
    assert {name: int(stop) - int(start) for name, start, stop in ranges}[cast.name] == 1, ranges
    rng = np.random.default_rng(0)
    data = [rng.standard_normal((256, 392, 64)).astype(ml_dtypes.bfloat16),
            rng.standard_normal((64, 64, 3, 3)).astype(np.float32)]
    got = dict(zip((n.name for n in kernel.lowered.pattern.outputs), kernel.simulate(data)))
    for node, want in zip(graph.outputs, reference.evaluate(graph, data)):
        np.testing.assert_allclose(np.asarray(got[node.name], np.float32), np.asarray(want, np.float32),
                                   rtol=1e-5, atol=1e-3)


def test_packed_sub_kernels_get_blocks_by_their_steps_not_their_elements():
    """A [64, 64, 3, 3] cast tiled ``GRID-CTA_256`` over its last dim (3 busy lanes a block, 12288
    block iterations) beside a partial sum of 256 × 392 × 64 elements (256 block iterations of 392
    serial points): by elements the cast got 2 of 256 blocks, 6144 iterations each; by steps
    (iterations × serial points) it gets 28, as long as the sum's blocks take."""
    from fusionstitching.schedule.packing import block_ranges
    from fusionstitching.schedule.template import Level, Schedule, Tile

    b = GraphBuilder("ranges")
    partial = b.reduce(b.parameter((256, 392, 64), DType.F32, "x"), [1], "sum")
    cast = b.convert(b.parameter((64, 64, 3, 3), DType.F32, "w"), DType.BF16)
    b.build([partial, cast])
    grid, wide = (Tile(Level.GRID),), (Tile(Level.GRID), Tile(Level.CTA, 256))
    groups = [(Schedule(partial.name, (grid, (Tile(Level.THREAD),), wide)), [partial]),
              (Schedule(cast.name, (grid, grid, grid, wide)), [cast])]
    (s0, e0), (s1, e1) = block_ranges(groups, 256)
    assert (e0 - s0, e1 - s1) == (228, 28)
    assert 12288 / (e1 - s1) <= 2 * 392 * 256 / (e0 - s0)


def test_a_packed_kernel_costs_the_round_trips_of_its_busiest_block():
    """The latency evaluator charges a packed kernel the memory round trips its busiest block makes
    in sequence (``serial_rounds``): a sub-kernel with one block and 256 grid iterations costs 256
    round trips, whatever its few bytes, and a nest that recomputes a reduction it reads from
    elsewhere in the kernel loads that reduction's whole length at each of its points."""
    from fusionstitching.cost.gpu_spec import gpu_spec
    from fusionstitching.fusion.estimate import kernel_time_us
    from fusionstitching.fusion.score import Scorer
    from fusionstitching.options import Options
    from fusionstitching.schedule.packing import serial_rounds
    from fusionstitching.schedule.template import KernelSchedule, Launch, Level, Schedule, Tile

    b = GraphBuilder("rounds")
    big = b.reduce(b.parameter((2048, 512, 256), DType.F32, "x"), [1], "sum")
    small = b.reduce(b.parameter((256, 8, 8), DType.F32, "y"), [1], "sum")
    graph = b.build([big, small])
    grid, thread, lanes = (Tile(Level.GRID),), (Tile(Level.THREAD),), (Tile(Level.CTA),)
    schedule = KernelSchedule((Schedule(big.name, (grid, thread, lanes)), Schedule(small.name, (grid, thread, lanes))),
                              Launch(256, 256))
    outputs = {n.name: n for n in graph.outputs}
    # the small reduction's 256 rows get one of 256 blocks: 256 iterations of one round each; the
    # large one's 2048 rows, 255 blocks: 9 iterations of 512 / 16 rounds each
    assert serial_rounds(schedule, graph.nodes, outputs) == max(256, 9 * 32)
    spread = KernelSchedule(schedule.schedules, Launch(2304, 256))
    assert serial_rounds(spread, graph.nodes, outputs) < 64
    scorer = Scorer(graph, Options())
    slow, fast = (kernel_time_us(scorer, graph.nodes, s) for s in (schedule, spread))
    # spread over more blocks, each thread still walks 512 points of its row (``loop_rounds``)
    assert slow >= 288 * gpu_spec("H100").memory_latency_us and fast < slow / 2

    r = GraphBuilder("recomputed")
    sums = r.reduce(r.parameter((64, 256), DType.F32, "z"), [1], "sum")
    scaled = r.binary("mul", sums, r.parameter((64,), DType.F32, "s"))
    other = r.reduce(r.parameter((64, 256), DType.F32, "u"), [1], "sum")
    graph = r.build([scaled, other])
    schedule = KernelSchedule((Schedule(scaled.name, ((Tile(Level.GRID), Tile(Level.CTA, 32)),)),
                               Schedule(other.name, (grid, thread))), Launch(66, 256))
    outputs = {n.name: n for n in graph.outputs}
    assert serial_rounds(schedule, graph.nodes, outputs) >= 256 // 16  # each point of ``scaled`` sums 256


def test_an_nhwc_value_read_as_nchw_is_tiled_over_channels_and_width():
    """An elementwise root reading a transpose by (0, 3, 1, 2) (a convolution's NHWC result read
    as NCHW) reads its input contiguously along the channels: its 32 × 32 tiles are over the
    channels and the width, not the height before the last dim."""
    from fusionstitching.schedule.packing import _packed_template
    from fusionstitching.schedule.template import Level

    b = GraphBuilder("nhwc_read")
    x = b.parameter((2, 16, 32, 64), DType.F32, "x")
    y = b.parameter((2, 64, 16, 32), DType.F32, "y")
    out = b.binary("add", b.transpose(x, (0, 3, 1, 2)), y)
    graph = b.build([out])
    nodes = [n for n in graph.nodes if n.op != "parameter"]
    pattern, _ = _pattern_and(graph, nodes, None)
    (schedule,) = _packed_template(pattern, 256).schedules
    assert any(t.level == Level.CTA and t.size == 32 for t in schedule.dims[1]), schedule
    assert all(t.level == Level.GRID for t in schedule.dims[2]), schedule
    kernel = generate(graph, nodes, _packed_template(pattern, 256))
    rng = np.random.default_rng(0)
    data = [rng.standard_normal(p.shape).astype(np.float32) for p in graph.parameters]
    (got,) = kernel.simulate(data)
    np.testing.assert_allclose(got, reference.evaluate(graph, data)[0], rtol=1e-6)


def test_a_serially_summed_root_is_not_summed_again_by_another_reduction_root():
    """Column sums of parts read by a second sum over the same parts: a thread-serial template
    would have each point of the second sum the first again (``refusals.resummed``); the column
    template, whose warps leave their sums in shared memory, is the one offered."""
    from fusionstitching.graph.pattern import resolve_pattern
    from fusionstitching.schedule.grouping import thread_serial_template
    from fusionstitching.schedule.refusals import resummed

    b = GraphBuilder("parts")
    x = b.parameter((64, 392, 256), DType.F32, "x")
    sums = b.reduce(x, [1], "sum")
    mean = b.binary("div", sums, b.constant(392.0, DType.F32, (64, 256)))
    deviation = b.binary("sub", x, b.broadcast(mean, (64, 392, 256), (0, 2)))
    squares = b.reduce(b.binary("mul", deviation, deviation), [1], "sum")
    graph = b.build([sums, squares])
    nodes = [n for n in graph.nodes if n.op not in ("parameter", "constant")]
    pattern = resolve_pattern(graph, nodes)
    serial = thread_serial_template(pattern, [sums, squares])
    assert "392 points" in str(resummed(pattern, serial))
    answer = feasible(graph, nodes)
    assert answer, answer
    assert all(any(t.level.value == "WARP" for t in s.dims[1]) for s in answer.schedules)


def test_a_thread_walking_a_long_loop_costs_its_round_trips():
    """``loop_rounds``: the groups of a composed template run one after another in a block, and
    each thread walks its share of a group's points with a few loads in flight. A block per row of
    65536 points: the sum's 256 threads take 256 points each, the elementwise root tiled over 64
    lanes leaves 192 threads idle and gives the others 1024 points each; vectors of 8 unrolled
    points cut the round trips by 8 (a normalization group as one block, 8x slower on an H200 than
    the estimate without these round trips)."""
    from fusionstitching.cost.gpu_spec import gpu_spec
    from fusionstitching.fusion.estimate import kernel_time_us
    from fusionstitching.fusion.score import Scorer
    from fusionstitching.options import Options
    from fusionstitching.schedule.packing import LOOP_LOADS_IN_FLIGHT, loop_rounds
    from fusionstitching.schedule.template import KernelSchedule, Launch, Level, Schedule, Tile

    b = GraphBuilder("group")
    x = b.parameter((512, 65536), DType.F32, "x")
    total = b.reduce(x, [1], "sum")
    centred = b.binary("sub", x, b.broadcast(total, (512, 65536), (0,)))
    graph = b.build([centred])
    grid = (Tile(Level.GRID),)
    walked = KernelSchedule((Schedule(total.name, (grid, (Tile(Level.CTA),))),
                             Schedule(centred.name, (grid, (Tile(Level.THREAD), Tile(Level.CTA, 64))))),
                            Launch(512, 256))
    outputs = {centred.name: centred}
    assert loop_rounds(walked, graph.nodes, outputs) == (256 + 1024) // LOOP_LOADS_IN_FLIGHT
    vectors = KernelSchedule((walked.schedules[0], Schedule(centred.name, (
        grid, (Tile(Level.THREAD), Tile(Level.CTA, 256), Tile(Level.THREAD, 8))))), Launch(512, 256))
    assert loop_rounds(vectors, graph.nodes, outputs) == 256 // LOOP_LOADS_IN_FLIGHT + 256 // 8
    scorer = Scorer(graph, Options())
    latency = gpu_spec("H100").memory_latency_us
    assert kernel_time_us(scorer, graph.nodes, walked) >= 320 * latency
    assert kernel_time_us(scorer, graph.nodes, vectors) < kernel_time_us(scorer, graph.nodes, walked)


@pytest.mark.parametrize("interior,period", [((0, 1, 0), 2), ((0, 2, 0), 3), ((0, 0, 1), 1), ((1, 0, 0), 1)])
def test_only_interior_padding_of_the_dim_before_the_last_makes_neighbouring_lanes_diverge(interior, period):
    """A read of a pad with interior padding along the dim before the last alternates between
    classes from one point of that dim to the next (``packing.interleave_period``); interior padding
    of the last dim stays inside a thread's vector, and that of an outer dim inside a warp's rows."""
    from fusionstitching.graph.pattern import resolve_pattern
    from fusionstitching.schedule.packing import interleave_period, with_neighbours

    b = GraphBuilder("interleave")
    x = b.parameter((4, 8, 16), DType.F32, "x")
    spread = b.node("pad", [x], low=(0, 0, 0), high=(0, interior[1], 0), interior=interior, value=0.0)
    out = b.unary("exp", spread)
    graph = b.build([out])
    pattern = resolve_pattern(graph, [n for n in graph.nodes if n.op != "parameter"])
    assert interleave_period(pattern) == period
    template = feasible(graph, [n for n in graph.nodes if n.op != "parameter"])
    sched = with_neighbours(template.schedule(out.name), out, 2)  # rows of 16 or 24 points
    assert sched.dims[-2][-1].level.value == "THREAD" and sched.dims[-2][-1].size == 2, sched
