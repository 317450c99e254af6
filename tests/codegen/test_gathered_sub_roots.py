"""Shared-memory sub-roots beyond floats: a bool mask stored as 0/1, and a sub-root read at an
index loaded from memory (a gather), which is recomputed from the kernel's inputs."""

from __future__ import annotations

import re

import pytest
import torch
import torch.nn.functional as F

from fusionstitching.codegen.lower import resolve_pattern
from fusionstitching.schedule import format_template
from fusionstitching.schedule.grouping import composed_template, sub_roots

from .test_compose import _case, _rand, check_template


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("nvrtc")


def test_bool_sub_root_in_shared_memory_and_a_gathered_sub_root_recomputed(cache_dir):
    """A cross-entropy row kernel with the ignore mask (bool) and the biased logits in shared
    memory: the mask is stored as 0/1 floats and read back as ``!= 0``; the gather of the target's
    logit reads at an index loaded from memory, where no footprint can be proven, and recomputes
    that logit from the kernel's inputs instead of refusing the template."""

    def fn(h, bias, target):
        return F.cross_entropy(h + bias, target, reduction="none"), target != -100

    rows, cols = 37, 200
    target = torch.randint(0, cols, (rows,), generator=torch.Generator().manual_seed(3))
    target[[3, 17]] = -100
    case = _case("cross_entropy_rows", fn, [_rand((rows, cols), "f32"), _rand((cols,), "f32", 1), target])
    pattern = resolve_pattern(case.graph, case.nodes)
    reductions = sub_roots(pattern) + [o for o in pattern.outputs if o.op == "reduce"]
    template = composed_template(pattern, reductions, 128, warp_rows=None, shared=["compare", "add"])
    assert "compare[GRID]S" in format_template(template)
    source = check_template(case, template, cache_dir, "mask and logits shared").cuda_source
    assert re.search(r"smem_\w+\[[^;]*\] = \(\(float\)\(v\d+\)\);", source), source
    assert re.search(r"bool s\d+ = \(smem_\w+\[[^;]*\] != 0\);", source), source
    # The gathered sub-root may also read the row's reductions (``sub`` = logits - row max): its
    # recomputation takes them from the thread's registers.
    shifted = composed_template(pattern, reductions, 128, warp_rows=None, shared=["compare", "sub"])
    check_template(case, shifted, cache_dir, "shifted logits shared")


def test_a_buffer_read_by_a_gathers_recomputation_outlives_the_gather(cache_dir):
    """A layer norm's normalized rows are gathered: the gather recomputes them from the mean and the
    rsqrt it reads from shared memory, but the plan released the mean's buffer after the normalized
    rows were stored and let ``sin`` (a later sub-root) overwrite it; every gathered element was
    wrong (GPU fuzz 1126505:1715, also under the simulator)."""

    def fn(x, floor, ids):
        normalized = F.layer_norm(x, (17,))
        return normalized, torch.minimum(floor, torch.sin(x).prod(1)), torch.gather(normalized, 1, ids)

    ids = torch.randint(0, 17, (11, 7), generator=torch.Generator().manual_seed(5))
    case = _case("gathered_layer_norm", fn, [_rand((11, 17), "f32"), _rand((1,), "f32", 1), ids])
    template = ("reduce_1[GRID,CTA]; add[GRID,CTA]S; reduce_2[GRID,CTA]; rsqrt[GRID,CTA]S; mul_1[GRID,CTA]S; "
                "sin[GRID,CTA]S; reduce[GRID,CTA]; min[GRID]; gather[GRID,CTA]; launch(blocks=11,threads=32)")
    check_template(case, template, cache_dir, "gathered layer norm")


def test_a_stored_sub_root_too_long_for_shared_memory_is_written_and_recomputed(cache_dir):
    """GPT-2's loss: a row of logits sliced out of a padded GEMM result is saved for the backward
    and also reduced over and gathered from. The row (20011 floats) does not fit in shared memory;
    the kernel still writes the slice, and its readers recompute it from the input instead of the
    pattern being refused (which split the loss into two kernels and stored the shifted logits)."""
    from fusionstitching.schedule import feasible
    from fusionstitching.schedule.template import KernelSchedule

    vocab = 20011

    def fn(padded, target):
        logits = padded[:, :vocab]
        return logits, F.cross_entropy(logits.float(), target, reduction="none")

    target = torch.randint(0, vocab, (3,), generator=torch.Generator().manual_seed(4))
    case = _case("sliced_logits_loss", fn, [_rand((3, vocab + 5), "bf16"), target])
    template = feasible(case.graph, case.nodes)
    assert isinstance(template, KernelSchedule), template
    kernel = check_template(case, template, cache_dir, "sliced logits")
    assert sum(b.extent for b in kernel.kernel.shared) * 4 < 48 * 1024
    stored = [o for o in kernel.outputs if case.graph.node(o).shape == (3, vocab)]
    assert stored  # the slice is written
