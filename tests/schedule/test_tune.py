"""The tuning space: its templates lower, are distinct, and compute what the plan's template computes."""

from __future__ import annotations

import dataclasses
import os
import random

import numpy as np
import pytest
import torch

from fusionstitching.cli import capture_workload
from fusionstitching.codegen.generate import generate
from fusionstitching.codegen.simulate import SimulationError
from fusionstitching.cost import bandwidth_model, gpu_spec
from fusionstitching.options import Options
from fusionstitching.pipeline import compile_graph
from fusionstitching.schedule.tune import (
    canonical,
    diverging_classes,
    model_estimate_us,
    ranked_templates,
    renamed,
)

SPEC, BANDWIDTH = gpu_spec("H100"), bandwidth_model("H100")


def _inputs(kernel, rng):
    arrays = []
    for node in kernel.lowered.pattern.inputs:
        dtype = node.dtype.numpy
        if node.dtype.value == "bool":
            arrays.append(rng.random(node.shape) < 0.5)
        elif np.dtype(dtype).kind in "iu":
            arrays.append(rng.integers(0, 3, node.shape).astype(dtype))
        else:
            arrays.append(rng.standard_normal(node.shape).astype(dtype))
    return arrays


def _check_candidates(graph, limit=None) -> int:
    """Every ranked template of every kernel of ``graph``'s plan simulates like the plan's kernel."""
    compiled = compile_graph(graph, Options(strict=True))
    plan_graph, rng, checked = compiled.graph, np.random.default_rng(0), 0
    for kernel in compiled.kernels:
        nodes = sorted(kernel.lowered.pattern.nodes, key=plan_graph.index.position.__getitem__)
        arrays = _inputs(kernel, rng)
        try:
            expected = kernel.simulate(arrays)
        except (SimulationError, IndexError):  # random indices out of range for a gather: nothing to compare
            continue
        templates = ranked_templates(plan_graph, nodes, SPEC, BANDWIDTH, limit=limit)
        assert len(set(templates)) == len(templates)
        for template in templates:
            assert renamed(canonical(template, nodes), nodes) == template
            if template == kernel.template:
                continue
            candidate = generate(plan_graph, nodes, template, in_place=bool(kernel.lowered.aliases))
            for k, (a, b) in enumerate(zip(expected, candidate.simulate(arrays))):
                a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
                scale = max(1.0, float(np.nanmax(np.abs(a), initial=0.0)))
                assert np.allclose(a, b, rtol=1e-4, atol=1e-4 * scale, equal_nan=True), \
                    f"{kernel.name} output {k}: {template} differs from {kernel.template}"
            checked += 1
    return checked


@pytest.mark.parametrize("name", ["layernorm_train", "softmax_scale_mask", "adam_step", "mlp_train", "din_attention"])
def test_every_template_of_the_space_computes_what_the_plans_does(name):
    _workload, captured = capture_workload(name, train=name.endswith("_train"))
    checked = sum(_check_candidates(g) for g in filter(None, (captured.forward, captured.backward)))
    assert checked >= 1


def test_the_space_of_stored_fuzzer_graphs_computes_what_their_plans_do():
    """A fresh sample of the fuzzer's stored graphs each run: the tuner's first candidates (six, the
    default) of each kernel against the plan's kernel."""
    from pathlib import Path

    from fusionstitching.fuzz.fingerprints import read
    from fusionstitching.graph.serialize import from_json

    seed = int(os.environ.get("TUNE_SEED") or random.randrange(1 << 30))
    print(f"tuning-space sample seed: {seed}")
    entries = read(Path(__file__).resolve().parents[1] / "data" / "fingerprints.jsonl.gz")
    sample = random.Random(seed).sample(entries, int(os.environ.get("TUNE_SAMPLE", "25")))
    checked = 0
    for entry in sample:
        checked += _check_candidates(from_json(entry.graph), limit=Options().tune_candidates)
    assert checked >= 5, f"seed {seed}"


def test_a_row_reduction_has_warp_and_block_templates_and_the_plans_among_them():
    _workload, captured = capture_workload("layernorm")
    compiled = compile_graph(captured.forward, Options(strict=True))
    graph = compiled.graph
    kernel = compiled.kernels[0]
    nodes = sorted(kernel.lowered.pattern.nodes, key=graph.index.position.__getitem__)
    templates = ranked_templates(graph, nodes, SPEC, BANDWIDTH)
    texts = [str(t) for t in templates]
    assert kernel.template in templates
    assert any("WARP_1," in t for t in texts) and any("WARP_16" in t for t in texts)
    assert any("WARP" not in t for t in texts)  # block mode
    assert len(ranked_templates(graph, nodes, SPEC, BANDWIDTH, limit=3)) == 3


def test_renamed_refuses_a_root_outside_the_pattern():
    _workload, captured = capture_workload("bias_gelu")
    compiled = compile_graph(captured.forward, Options(strict=True))
    nodes = sorted(compiled.kernels[0].lowered.pattern.nodes, key=compiled.graph.index.position.__getitem__)
    with pytest.raises(ValueError, match="names no node"):
        renamed(f"n{len(nodes)}[GRID]; launch(blocks=1,threads=32)", nodes)


def test_a_norm_over_a_short_trailing_dim_spreads_its_lanes_over_the_image():
    """InstanceNorm of 64 × 64 images: the reduced run is (H, W). Lanes only on W (64 of a block's
    256 threads working, each looping over H) was the old tiling; the template lays the 4096-element
    row's tiling onto both dims, every lane busy, and computes what the graph does."""
    from fusionstitching.bench.workloads import instancenorm
    from fusionstitching.frontend.torch_fx import capture
    from fusionstitching.graph import reference

    workload = instancenorm(batch=2, channels=4, size=64)
    forward = capture(workload.fn, *workload.inputs).forward
    # 64 is a whole number of warps: graph/collapse.py leaves H and W two dims, with or without it
    for collapse in (True, False):
        compiled = compile_graph(forward, Options(strict=True, collapse_dims=collapse))
        (kernel,) = compiled.kernels
        for schedule in kernel.template.schedules:
            lanes = [t.size for dim in schedule.dims[-2:] for t in dim if t.level.value == "CTA"]
            assert lanes == [16, 16], kernel.template
    graph = compiled.graph
    rng = np.random.default_rng(0)
    by_name = {p.name: rng.standard_normal(p.shape).astype(np.float32) for p in graph.parameters}
    arrays = [by_name[n.name] for n in kernel.lowered.pattern.inputs]
    got = kernel.simulate(arrays)
    (want,) = reference.evaluate(graph, [by_name[p.name] for p in graph.parameters])
    np.testing.assert_allclose(got[0].reshape(want.shape), want, rtol=1e-4, atol=1e-4)
    # the old tiling (lanes on W only) computes the same values
    nodes = sorted(kernel.lowered.pattern.nodes, key=graph.index.position.__getitem__)
    old = canonical(kernel.template, nodes)
    for spread in ("THREAD_4-CTA_16,CTA_16-THREAD_4]",):
        assert spread in old, old
    lanes_on_w = renamed(old.replace("THREAD_4-CTA_16,CTA_16-THREAD_4]", "THREAD,CTA]"), nodes)
    for a, b in zip(got, generate(graph, nodes, lanes_on_w).simulate(arrays)):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4)


def _group_norm_flat(x):
    """GroupNorm's statistics as torch 2.11 decomposes them: the mean over each group flattened to
    one dim, the variance over (channels of the group, pixels); two reduction groups of different
    ranks, so a batched template (a block per group)."""
    n, c, h, w = x.shape
    mean = x.reshape(n, 4, -1).mean(-1)
    centred = x.reshape(n, 4, c // 4, h * w) - mean[:, :, None, None]
    var = (centred * centred).mean((2, 3))
    return torch.nn.functional.silu(centred * torch.rsqrt(var + 1e-5)[:, :, None, None])


def test_a_batched_pattern_offers_every_block_size_up_to_its_widest_dim():
    """A block per group and few groups: the threads per block are the knob that fills the GPU (a
    GroupNorm of 256 groups of 32768 elements ran 2.2x faster with 1024 threads than with 256 on an
    H100); the space offers 128 to 1024 threads, each computing what the plan's template does."""
    from fusionstitching.frontend.torch_fx import capture
    from fusionstitching.schedule.grouping import _batched, _crossing

    forward = capture(_group_norm_flat, torch.randn(2, 16, 32, 32)).forward
    compiled = compile_graph(forward, Options(strict=True))
    kernel = max(compiled.kernels, key=lambda k: len(k.lowered.pattern.nodes))
    pattern = kernel.lowered.pattern
    assert _batched(pattern, _crossing(pattern)), kernel.template
    nodes = sorted(pattern.nodes, key=compiled.graph.index.position.__getitem__)
    threads = {t.launch.threads for t in ranked_templates(compiled.graph, nodes, SPEC, BANDWIDTH)}
    assert {128, 256, 512, 1024} <= threads, threads
    assert _check_candidates(forward) >= 3


class _BatchNormReLU(torch.nn.Module):
    """A convolution's output through BatchNorm (eval) and ReLU, channels-last as in a ResNet."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.conv = torch.nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.norm = torch.nn.BatchNorm2d(channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.norm(self.conv(x)))


def test_per_channel_work_is_offered_once_per_thread_for_several_rows():
    """A BatchNorm's scale (a square root and a division of the running variance) is computed for
    every element when a thread takes one vector of channels; the space offers templates whose
    threads take 2, 4 or 8 images of the same channels (``packing.with_rows``), and each computes
    what the plan's does."""
    from fusionstitching.frontend.torch_fx import capture
    from fusionstitching.schedule.packing import invariant_work

    module = _BatchNormReLU(32).eval()
    module.norm.running_var.uniform_(0.5, 2.0)
    forward = capture(module, torch.randn(16, 32, 8, 8)).forward
    compiled = compile_graph(forward, Options(strict=True))
    kernel = next(k for k in compiled.kernels if "sqrt" in {n.op for n in k.lowered.pattern.nodes})
    pattern = kernel.lowered.pattern
    assert invariant_work(pattern)
    nodes = sorted(pattern.nodes, key=compiled.graph.index.position.__getitem__)
    texts = [str(t) for t in ranked_templates(compiled.graph, nodes, SPEC, BANDWIDTH)]
    assert {r for r in (2, 4, 8) if any(f"GRID-THREAD_{r}," in t for t in texts)} == {2, 4, 8}, texts
    assert _check_candidates(forward) >= 3


def _pool_backward_kernel(batch: int, channels: int, size: int):
    from fusionstitching.frontend.torch_fx import capture
    from fusionstitching.schedule.packing import interleave_period

    def pool(x):
        return torch.nn.functional.max_pool2d(torch.relu(x), 3, 2, 1).square().sum()

    x = torch.randn(batch, channels, size, size).to(memory_format=torch.channels_last).requires_grad_()
    backward = capture(pool, x, train=True).backward
    compiled = compile_graph(backward, Options(strict=True, tune="off"))
    kernel = next(k for k in compiled.kernels if interleave_period(k.lowered.pattern) > 1)
    assert interleave_period(kernel.lowered.pattern) == 2
    nodes = sorted(kernel.lowered.pattern.nodes, key=compiled.graph.index.position.__getitem__)
    return backward, compiled, kernel, nodes


def test_reads_of_an_interleaving_are_offered_a_point_of_each_class_per_thread():
    """Max pooling's gradient sums each stride class of input positions and interleaves the classes
    by interior padding: consecutive positions of a row are of different classes, whose guarded
    reads a warp runs one after the other. The space offers templates whose threads take one
    position of each class (``packing.with_neighbours``, ``THREAD_2`` innermost on the positions),
    and each computes what the plan's does."""
    backward, compiled, _, nodes = _pool_backward_kernel(2, 16, 16)
    texts = [str(t) for t in ranked_templates(compiled.graph, nodes, SPEC, BANDWIDTH)]
    assert any("THREAD_2," in t for t in texts), texts
    assert _check_candidates(backward) >= 3


def test_the_model_prices_the_divergence_of_an_interleaving_and_the_plan_avoids_it():
    """At ResNet's stem size the pooling gradient is bound by issue: the model multiplies the issue
    time of templates whose warps hold points of both classes by 2 (``diverging_classes``), so
    the plan takes a template whose threads hold one point of each."""
    _, compiled, kernel, nodes = _pool_backward_kernel(4, 64, 112)
    pattern = kernel.lowered.pattern
    assert "THREAD_2," in str(kernel.template) and diverging_classes(pattern, kernel.template) == 1, kernel.template
    templates = ranked_templates(compiled.graph, nodes, SPEC, BANDWIDTH)
    assert templates[0] == kernel.template
    default = next(t for t in templates if diverging_classes(pattern, t) == 2)
    assert model_estimate_us(pattern, default, SPEC, BANDWIDTH) > 1.5 * model_estimate_us(
        pattern, kernel.template, SPEC, BANDWIDTH)


def _batchnorm_kernel(batch: int = 16, channels: int = 32, size: int = 8, dtype: torch.dtype = torch.float32):
    from fusionstitching.frontend.torch_fx import capture

    module = _BatchNormReLU(channels).eval()
    module.norm.running_var.uniform_(0.5, 2.0)
    x = torch.randn(batch, channels, size, size).to(memory_format=torch.channels_last)
    forward = capture(module.to(dtype), x.to(dtype)).forward
    compiled = compile_graph(forward, Options(strict=True, tune="off"))
    kernel = next(k for k in compiled.kernels if "sqrt" in {n.op for n in k.lowered.pattern.nodes})
    nodes = sorted(kernel.lowered.pattern.nodes, key=compiled.graph.index.position.__getitem__)
    return compiled, kernel, nodes


def test_per_channel_work_is_counted_once_per_point_and_shared_by_thread_tiles():
    """``evaluations``: a per-channel node of a BatchNorm kernel is computed once per point of the
    root (its size times N·H·W), and a template whose threads take r images of the same channels
    computes it r times less often; nodes of the root's shape are computed once."""
    from fusionstitching.graph.pattern import resolve_pattern
    from fusionstitching.schedule.grouping import choose_template
    from fusionstitching.schedule.packing import with_rows
    from fusionstitching.schedule.template import Level, Schedule, Tile
    from fusionstitching.schedule.tune import evaluations

    compiled, _, nodes = _batchnorm_kernel()
    pattern = resolve_pattern(compiled.graph, nodes)
    root = max(pattern.outputs, key=lambda n: n.size)
    sqrt = next(n for n in pattern.nodes if n.op == "sqrt")
    assert sqrt.size == 32 and root.size == 16 * 32 * 8 * 8
    default = choose_template(pattern)
    plain = dataclasses.replace(default, schedules=tuple(
        Schedule(s.root, tuple((Tile(Level.GRID),) for _ in s.dims), s.shared) for s in default.schedules))
    counted = evaluations(pattern, plain)  # one point per thread
    assert counted[id(sqrt)] == pytest.approx(root.size / sqrt.size)
    assert all(counted[id(n)] == pytest.approx(1.0) for n in pattern.nodes if n.shape == root.shape)
    for r in (2, 4, 8):
        schedules = tuple(with_rows(s, root, r) if s.root == root.name else s for s in plain.schedules)
        template = dataclasses.replace(plain, schedules=schedules)
        assert template != plain
        assert evaluations(pattern, template)[id(sqrt)] == pytest.approx(root.size / sqrt.size / r)


def test_the_model_ranks_per_channel_work_shared_first_and_the_plan_takes_it():
    """A bf16 channels-last BatchNorm kernel of ResNet's size is bound by issuing its per-element square roots and
    divisions (``cost.latency.issue_bound_us``), not by memory: the model ranks a template whose
    threads take several images of the same channels first, and exploration's plan takes it
    (``model_choice``); it computes what the default rule's template does."""
    from fusionstitching.fusion import explore
    from fusionstitching.graph.pattern import resolve_pattern
    from fusionstitching.schedule.grouping import choose_template
    from fusionstitching.schedule.tune import model_choice, model_estimate_us

    compiled, kernel, nodes = _batchnorm_kernel(batch=32, channels=256, size=56, dtype=torch.bfloat16)
    graph = compiled.graph
    pattern = resolve_pattern(graph, nodes)
    default = choose_template(pattern)
    chosen = model_choice(graph, nodes, default, SPEC, BANDWIDTH)
    assert chosen != default
    assert "GRID-THREAD_" in str(chosen), chosen
    assert model_estimate_us(pattern, chosen, SPEC, BANDWIDTH) < 0.8 * model_estimate_us(pattern, default, SPEC,
                                                                                         BANDWIDTH)
    assert str(kernel.template) == str(chosen)  # the compiled plan took it
    plan = explore(graph)
    assert any("model templates" in note for note in plan.notes), plan.notes
    small, small_kernel, small_nodes = _batchnorm_kernel(dtype=torch.bfloat16)
    rng = np.random.default_rng(0)
    inputs = _inputs(small_kernel, rng)
    mine = small_kernel.simulate(inputs)
    theirs = generate(small.graph, small_nodes, choose_template(resolve_pattern(small.graph, small_nodes))
                      ).simulate(inputs)
    for a, b in zip(mine, theirs):
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))


def test_a_column_sum_over_many_rows_takes_the_model_template_that_splits_its_rows_over_warps():
    """The default rule sums each part of a long column sum's rows with one thread per column over
    few blocks (a BatchNorm's per-channel sums of [N·H·W, C]); the model ranks splitting the rows
    of each part over the warps of more blocks first, and the plan takes it (``model_choice``
    covers reductions)."""
    from fusionstitching.frontend.torch_fx import capture
    from fusionstitching.graph.pattern import resolve_pattern
    from fusionstitching.schedule.grouping import choose_template
    from fusionstitching.schedule.tune import model_choice, model_estimate_us

    forward = capture(lambda x, y: (x * y).sum(0), torch.randn(100352, 256), torch.randn(100352, 256)).forward
    compiled = compile_graph(forward, Options(strict=True))
    graph = compiled.graph
    kernel = max(compiled.kernels, key=lambda k: k.moved_bytes)
    nodes = sorted(kernel.lowered.pattern.nodes, key=graph.index.position.__getitem__)
    pattern = resolve_pattern(graph, nodes)
    default = choose_template(pattern)
    chosen = model_choice(graph, nodes, default, SPEC, BANDWIDTH)
    assert chosen != default and str(kernel.template) == str(chosen)
    assert "WARP_" in str(chosen) and "WARP_" not in str(default), (chosen, default)
    assert chosen.launch.blocks > default.launch.blocks
    assert model_estimate_us(pattern, chosen, SPEC, BANDWIDTH) < model_estimate_us(pattern, default, SPEC, BANDWIDTH)


def test_a_row_softmax_keeps_the_default_rule_template():
    """The model ranks no template of a softmax's row reductions faster than the default rule's."""
    from fusionstitching.frontend.torch_fx import capture
    from fusionstitching.graph.pattern import resolve_pattern
    from fusionstitching.schedule.grouping import choose_template
    from fusionstitching.schedule.tune import model_choice

    forward = capture(lambda x: torch.softmax(x, -1), torch.randn(256, 512)).forward
    compiled = compile_graph(forward, Options(strict=True))
    kernel = compiled.kernels[0]
    nodes = sorted(kernel.lowered.pattern.nodes, key=compiled.graph.index.position.__getitem__)
    default = choose_template(resolve_pattern(compiled.graph, nodes))
    assert model_choice(compiled.graph, nodes, default, SPEC, BANDWIDTH) == default


def test_elementwise_patterns_without_broadcast_work_keep_one_point_per_thread():
    from fusionstitching.frontend.torch_fx import capture
    from fusionstitching.schedule.packing import invariant_work

    forward = capture(lambda x, y: torch.relu(x) * y, torch.randn(64, 256), torch.randn(64, 256)).forward
    compiled = compile_graph(forward, Options(strict=True))
    assert not invariant_work(compiled.kernels[0].lowered.pattern)


@pytest.mark.parametrize("dtype, widths", [(torch.float32, {2, 4}), (torch.bfloat16, {2, 4, 8})])
def test_column_sums_are_offered_several_adjacent_columns_per_thread(dtype, widths):
    """A column sum's partial (split into parts, a thread per column) and a column sum with an
    epilogue (a bias gradient cast back) are offered templates whose threads take 2, 4 or 8 adjacent
    columns, up to 16 bytes of the summed operand per row, and each computes what the plan's does."""
    from fusionstitching.frontend.torch_fx import capture

    for fn in (lambda x: x.sum(0), lambda x: (x.float().sum(0) * 0.5).to(dtype)):
        forward = capture(fn, torch.randn(2048, 512, dtype=dtype)).forward
        compiled = compile_graph(forward, Options(strict=True))
        offered = set()
        for kernel in compiled.kernels:
            nodes = sorted(kernel.lowered.pattern.nodes, key=compiled.graph.index.position.__getitem__)
            texts = [str(t) for t in ranked_templates(compiled.graph, nodes, SPEC, BANDWIDTH)]
            offered |= {v for v in (2, 4, 8) if any(f"-THREAD_{v}]" in t or f"-THREAD_{v};" in t for t in texts)}
        assert offered == widths, offered
        assert _check_candidates(forward) >= len(widths)


def test_per_row_work_is_offered_a_block_per_row():
    """A cross-entropy backward over rows of a length no vector divides (1001 classes): its loss
    gradient's per-row scale and row statistics are computed per element by a thread per element;
    the space offers templates with a block per row, its threads looping over the row (``row
    loop``), and each computes what the plan's does."""
    from fusionstitching.frontend.torch_fx import capture
    from fusionstitching.schedule.packing import row_invariant_work

    logits = torch.randn(64, 1001, dtype=torch.bfloat16, requires_grad=True)
    targets = torch.randint(0, 1001, (64,))
    backward = capture(lambda x: torch.nn.functional.cross_entropy(x.float(), targets), logits, train=True).backward
    compiled = compile_graph(backward, Options(strict=True))
    kernel = max(compiled.kernels, key=lambda k: max(n.size for n in k.lowered.pattern.nodes))
    pattern = kernel.lowered.pattern
    assert row_invariant_work(pattern)
    nodes = sorted(pattern.nodes, key=compiled.graph.index.position.__getitem__)
    texts = [str(t) for t in ranked_templates(compiled.graph, nodes, SPEC, BANDWIDTH)]
    looping = {t for t in texts if "[GRID,CTA]" in t}
    assert {int(t.split("threads=")[1].rstrip(")")) for t in looping} >= {128, 256, 512}, texts
    assert _check_candidates(backward) >= 3
    assert not row_invariant_work(compile_graph(capture(lambda x, y: torch.relu(x) * y, torch.randn(64, 256),
                                                        torch.randn(64, 256)).forward).kernels[0].lowered.pattern)


def test_evaluations_follow_broadcasts_transposes_and_reshapes_of_dims_of_one():
    """A per-row value reaches the root through a reshape that adds a dim of 1, a broadcast and a
    transpose: it varies along the root's dim 1 only, so THREAD tiles on dim 0 share it; a value of
    the root's shape is computed once per point whatever the tiles; a reshape that regroups dims
    leaves the value varying along every dim (no sharing assumed)."""
    from fusionstitching.graph.graph import GraphBuilder
    from fusionstitching.graph.ops import DType
    from fusionstitching.graph.pattern import resolve_pattern
    from fusionstitching.schedule.template import KernelSchedule, Launch, Level, Schedule, Tile
    from fusionstitching.schedule.tune import evaluations

    b = GraphBuilder("ev")
    x = b.parameter((64, 32), DType.F32, "x")
    v = b.parameter((64,), DType.F32, "v")
    w = b.parameter((8, 4), DType.F32, "w")
    per_row = b.unary("sqrt", v)  # [64]
    tall = b.reshape(per_row, (64, 1))
    spread = b.broadcast(b.reshape(tall, (64,)), (64, 32), (0,))  # varies along dim 0 of [64, 32]
    turned = b.transpose(b.binary("mul", x, spread), (1, 0))  # [32, 64]: the row value varies along dim 1
    regrouped = b.broadcast(b.reshape(b.unary("exp", w), (32,)), (32, 64), (0,))  # [8, 4] -> [32]: dim 0
    root = b.binary("add", turned, regrouped)
    graph = b.build([root])
    nodes = [n for n in graph.nodes if n.op != "parameter"]
    pattern = resolve_pattern(graph, nodes)
    tiles = Schedule(root.name, ((Tile(Level.GRID), Tile(Level.THREAD, 4)), (Tile(Level.CTA),)))
    counted = evaluations(pattern, KernelSchedule((tiles,), Launch(8, 64)))
    assert counted[id(per_row)] == pytest.approx(root.size / per_row.size / 4)
    assert counted[id(root)] == pytest.approx(1.0)
    exp = next(n for n in nodes if n.op == "exp")
    assert counted[id(exp)] == pytest.approx(root.size / exp.size)  # varies along dim 0: nothing shared


def test_partial_column_sums_offer_their_rows_across_warps(tmp_path):
    """A BatchNorm gradient's partial sums ([parts, rows, channels] → [parts, channels], two sums
    of one space): too few rows per part to be reduced across threads by default, so each thread
    loops over a column's rows. The space also offers the column template with 2 to 32 warps per 32
    channels sharing each part's rows (a thread-per-column partial ran at 41% of a copy's bandwidth
    on ResNet-50's sizes); every one computes what the plan's template does."""
    from fusionstitching.frontend.torch_fx import capture
    from fusionstitching.graph.pattern import resolve_pattern
    from fusionstitching.schedule.grouping import _crossing

    def partial_sums(dy, x, mean):
        d = dy.float()
        return (d * (x.float() - mean.float())).reshape(16, 64, 256).sum(1), d.reshape(16, 64, 256).sum(1)

    args = (torch.randn(1024, 256).bfloat16(), torch.randn(1024, 256).bfloat16(), torch.randn(256).bfloat16())
    forward = capture(partial_sums, *args).forward
    compiled = compile_graph(forward, Options(strict=True, tune="off"))
    (kernel,) = compiled.kernels
    nodes = sorted(kernel.lowered.pattern.nodes, key=compiled.graph.index.position.__getitem__)
    assert not _crossing(resolve_pattern(compiled.graph, nodes))
    texts = [str(t) for t in ranked_templates(compiled.graph, nodes, SPEC, BANDWIDTH)]
    warps = {int(part.split("WARP_")[1].split(",")[0]) for t in texts for part in t.split("; ") if "WARP_" in part}
    assert {2, 4, 8}.issubset(warps), texts
    assert _check_candidates(forward) >= 3
    for template in ranked_templates(compiled.graph, nodes, SPEC, BANDWIDTH):
        if "WARP_" in str(template):  # NVRTC builds them without spilling
            module = generate(compiled.graph, nodes, template).compile("sm_90", cache_dir=tmp_path)
            assert all(r.spill_stores == 0 for r in module.resources.values()), template


def test_a_reduction_with_its_own_schedule_is_summed_once_for_its_readers():
    """GroupNorm's statistics kernel sums each group (32768 elements) in the block that owns it, and
    its centring root reads the block's sum from a register. ``evaluations`` counted the sum again
    for each point that reads it (256 times over), and the latency evaluator put the kernel at
    520 µs where a copy of its bytes takes 27 (an H200 ran it in 37). A reduction that is a root of
    the template is counted once."""
    from fusionstitching.graph.graph import GraphBuilder
    from fusionstitching.graph.ops import DType
    from fusionstitching.graph.pattern import resolve_pattern
    from fusionstitching.schedule import feasible
    from fusionstitching.schedule.tune import evaluations, model_estimate_us

    b = GraphBuilder("group_centring")
    x = b.parameter((8, 32, 32768), DType.F32, "x")
    total = b.node("reduce", [x], dims=(2,), kind="sum")
    mean = b.binary("mul", total, b.constant(1 / 32768, DType.F32, (8, 32)))
    centred = b.binary("sub", x, b.node("broadcast_in_dim", [mean], shape=(8, 32, 32768),
                                        broadcast_dimensions=(0, 1)))
    graph = b.build([total, centred])
    nodes = [n for n in graph.nodes if n.op not in ("parameter", "constant")]
    template = feasible(graph, nodes)
    assert template and {s.root for s in template.schedules} >= {total.name, centred.name}, template
    pattern = resolve_pattern(graph, nodes)
    assert evaluations(pattern, template).get(id(total), 1.0) == pytest.approx(1.0)
    spec, bandwidth = gpu_spec("H200"), bandwidth_model("H200")
    moved = sum(n.size * n.dtype.itemsize for n in list(pattern.inputs) + list(pattern.outputs))
    assert model_estimate_us(pattern, template, spec, bandwidth) < 2 * bandwidth.time_us(moved)


def _layernorm_plan(batch: int, hidden: int = 256):
    from fusionstitching.bench.workloads import make
    from fusionstitching.frontend.torch_fx import capture

    workload = make("layernorm", batch=batch, hidden=hidden)
    compiled = compile_graph(capture(workload.fn, *workload.inputs).forward, Options(strict=True))
    kernel = compiled.kernels[0]
    return compiled.graph, kernel, sorted(kernel.lowered.pattern.nodes, key=compiled.graph.index.position.__getitem__)


def test_a_template_refits_to_other_sizes_of_its_form_and_computes_the_same():
    """Every template of a LayerNorm's space at 96 rows, taken to 120 rows (one shape class): where
    ``refit`` finds it, the form is kept, the launch is sized for 120 rows, and the kernel computes
    what the plan's kernel at 120 rows computes; a form outside the space is refused."""
    from fusionstitching.schedule.tune import form, refit

    graph_a, _kernel_a, nodes_a = _layernorm_plan(96)
    graph_b, kernel_b, nodes_b = _layernorm_plan(120)
    arrays = _inputs(kernel_b, np.random.default_rng(0))
    expected = kernel_b.simulate(arrays)
    refitted = 0
    for template in ranked_templates(graph_a, nodes_a, SPEC, BANDWIDTH):
        wanted = form(canonical(template, nodes_a))
        assert "blocks=*" in wanted
        fitted = refit(graph_b, nodes_b, wanted, kernel_b.template)
        if fitted is None:
            continue
        refitted += 1
        assert form(canonical(fitted, nodes_b)) == wanted
        assert fitted in ranked_templates(graph_b, nodes_b, SPEC, BANDWIDTH) or fitted == kernel_b.template
        got = generate(graph_b, nodes_b, fitted).simulate(arrays)
        for a, b in zip(expected, got):
            np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-4, atol=1e-4)
    assert refitted >= 3
    assert refit(graph_b, nodes_b, "n0[THREAD,THREAD]; launch(blocks=*,threads=32)", kernel_b.template) is None


@pytest.mark.parametrize("cols, padded, vectors", [(50257, 50264, False), (50256, 50264, True)])
def test_scalar_reads_take_several_rows_per_thread_where_loads_in_flight_bound_them(cols, padded, vectors):
    """A copy of rows of odd length (a padded GEMM's result unpadded) reads one bf16 per load: at a
    point per thread the GPU holds too few loads in flight to cover DRAM latency (each wave of
    resident threads waits one round trip), so the evaluator ranks first a template whose threads
    take several rows (``GRID-THREAD_<r>``, their loads issued together). Rows read as 16-byte
    vectors are not bound so and keep the default rule's template."""
    from fusionstitching.graph.graph import GraphBuilder
    from fusionstitching.graph.ops import DType
    from fusionstitching.graph.pattern import resolve_pattern
    from fusionstitching.schedule.grouping import choose_template
    from fusionstitching.schedule.tune import model_choice

    b = GraphBuilder("slice")
    x = b.parameter((4096, padded), DType.BF16, "x")
    graph = b.build([b.node("slice", [x], start=(0, 0), limit=(4096, cols), stride=(1, 1))])
    nodes = [n for n in graph.nodes if n.op != "parameter"]
    pattern = resolve_pattern(graph, nodes)
    default = choose_template(pattern)
    chosen = model_choice(graph, nodes, default, SPEC, BANDWIDTH)
    if vectors:
        assert chosen == default
        return
    assert "GRID-THREAD_" in str(chosen).split("[")[1].split(",")[0], chosen
    assert model_estimate_us(pattern, chosen, SPEC, BANDWIDTH) < 0.6 * model_estimate_us(pattern, default, SPEC, BANDWIDTH)
