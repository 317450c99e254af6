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
