"""Schedule tuning on a GPU: the first call measures, the library is reused by a second process,
user tensors are untouched, and a measured choice beats the model's first choice somewhere."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import fusionstitching
from fusionstitching.backend import reset_stats
from fusionstitching.options import Options

ROOT = Path(__file__).resolve().parents[2]
gpu_only = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
pytestmark = [pytest.mark.gpu, gpu_only]


def _rmsnorm(x, w):
    wide = x.float()
    return w * (wide * torch.rsqrt(wide.pow(2).mean(-1, keepdim=True) + 1e-6)).to(x.dtype)


_SECOND = """
import sys, torch
sys.path.insert(0, sys.argv[2])
import fusionstitching
from tests.runtime.test_tuner_gpu import _rmsnorm
x = torch.randn(4096, 2048, device="cuda", dtype=torch.bfloat16)
w = torch.randn(2048, device="cuda", dtype=torch.bfloat16)
f = torch.compile(_rmsnorm, backend="fusionstitching", options={"cache_dir": sys.argv[1], "strict": True})
torch.testing.assert_close(f(x, w), _rmsnorm(x, w), rtol=2e-2, atol=2e-2)
s = fusionstitching.stats()
print(s["tuned"], s["perflib hits"])
"""


def test_the_first_call_tunes_and_a_second_process_reads_the_library(tmp_path):
    torch._dynamo.reset()
    reset_stats()
    x = torch.randn(4096, 2048, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(2048, device="cuda", dtype=torch.bfloat16)
    f = torch.compile(_rmsnorm, backend="fusionstitching", options={"cache_dir": str(tmp_path)})
    torch.testing.assert_close(f(x, w), _rmsnorm(x, w), rtol=2e-2, atol=2e-2)
    assert fusionstitching.stats()["tuned"] >= 1
    assert (tmp_path / "perflib.sqlite").exists()
    out = subprocess.run([sys.executable, "-c", _SECOND, str(tmp_path), str(ROOT)], capture_output=True, check=False,
                         text=True, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert out.returncode == 0, out.stderr[-3000:]
    tuned, hits = map(int, out.stdout.split()[-2:])
    assert tuned == 0 and hits >= 1


def test_tuning_leaves_user_tensors_as_one_eager_call_leaves_them(tmp_path):
    """An in-place update (a momentum step) is applied exactly once by the tuned first call: the
    candidates ran on scratch copies."""
    def step(p, m, g):
        m.mul_(0.9).add_(g)
        p.add_(m, alpha=-0.1)
        return p.sum(-1)

    torch._dynamo.reset()
    gen = torch.Generator(device="cuda").manual_seed(0)
    p, m, g = (torch.randn(2048, 1024, device="cuda", generator=gen) for _ in range(3))
    want = [t.clone() for t in (p, m, g)]
    expected = step(*want)
    f = torch.compile(step, backend="fusionstitching", options={"cache_dir": str(tmp_path), "tune": "exhaustive"})
    got = f(p, m, g)
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)  # sums of 1024 in another order
    for a, b in zip((p, m, g), want):
        torch.testing.assert_close(a, b)


def test_dropout_after_tuning_keeps_the_generator_as_eager_does(tmp_path):
    def fn(x):
        return torch.nn.functional.dropout(x, 0.5, training=True) * 2

    torch._dynamo.reset()
    x = torch.randn(1024, 1024, device="cuda")
    f = torch.compile(fn, backend="fusionstitching", options={"cache_dir": str(tmp_path)})
    torch.manual_seed(1)
    f(x)
    after_first = torch.cuda.get_rng_state()
    torch.manual_seed(1)
    f(x)
    assert torch.equal(after_first, torch.cuda.get_rng_state())  # tuning drew nothing extra


def test_a_survey_leaves_user_tensors_and_the_generator_as_eager_does(tmp_path):
    """With no tuning budget the first call surveys (times every pattern's plan kernel on a run of
    its own): the in-place updates still happen once, and torch's generator advances as in a call
    without it."""
    def step(p, m, g, x, w):  # the GEMM parts the kernels: at least two patterns, one beyond the budget
        m.mul_(0.9).add_(g)
        p.add_(m, alpha=-0.1)
        return p.sum(-1), torch.softmax(torch.nn.functional.dropout(x, 0.5, training=True) @ w, -1)

    torch._dynamo.reset()
    reset_stats()
    gen = torch.Generator(device="cuda").manual_seed(0)
    p, m, g, x, w = (torch.randn(4096, 2048, device="cuda", generator=gen) for _ in range(5))
    w = w[:2048]
    want = [t.clone() for t in (p, m, g)]
    m_want = want[1].mul(0.9).add(want[2])
    p_want = want[0].add(m_want, alpha=-0.1)
    options = {"cache_dir": str(tmp_path), "tune_budget": 0.0, "tune_min_seconds": 0.0, "strict": True}
    f = torch.compile(step, backend="fusionstitching", options=options)
    torch.manual_seed(1)
    total, _ = f(p, m, g, x, w)
    after_first = torch.cuda.get_rng_state()
    torch.testing.assert_close(total, p_want.sum(-1), rtol=1e-4, atol=1e-3)
    torch.testing.assert_close(m, m_want)
    torch.testing.assert_close(p, p_want)
    assert fusionstitching.stats()["surveyed"] >= 2, fusionstitching.stats()
    torch.manual_seed(1)
    f(p, m, g, x, w)
    assert torch.equal(after_first, torch.cuda.get_rng_state())


def _group_norm_flat(x):
    """GroupNorm(32) + SiLU with the statistics over each group flattened (torch 2.11's
    decomposition): one batched pattern, a block per group, 256 blocks."""
    n, c, h, w = x.shape
    mean = x.reshape(n, 32, -1).mean(-1)
    centred = x.reshape(n, 32, c // 32, h * w) - mean[:, :, None, None]
    var = (centred * centred).mean((2, 3))
    return torch.nn.functional.silu(centred * torch.rsqrt(var + 1e-5)[:, :, None, None])


def _channel_sums(grad, x):
    return (grad.float() * x.float()).sum(0), grad.float().sum(0)


def test_a_measured_choice_beats_the_models_first_choice(tmp_path):
    """Exhaustive tuning of row reductions of several shapes, a batched GroupNorm and BatchNorm
    backward's channel sums, then each winner and the plan's kernel timed again, interleaved: where
    the tuner picked another template than the model's first choice, it is no slower than the
    model's beyond the noise of two measurements (the tuner's, which a switch must beat by ``NOISE``, and this one; plus the events'
    resolution), and at least one is faster by more than that. Prints the table and how often the
    model's first choice was the measured winner."""
    from fusionstitching.frontend.torch_fx import capture
    from fusionstitching.graph.torch_dtypes import DTYPE_TO_TORCH
    from fusionstitching.pipeline import compile_graph
    from fusionstitching.runtime.tuner import NOISE, RESOLUTION_US, GpuMeasure

    cases = {
        "rmsnorm bf16 8192x4096": (_rmsnorm, (torch.randn(8192, 4096, dtype=torch.bfloat16),
                                             torch.randn(4096, dtype=torch.bfloat16))),
        "softmax f32 4096x1000": (lambda x: torch.softmax(x, -1), (torch.randn(4096, 1000),)),
        "softmax f32 2048x3000": (lambda x: torch.softmax(x, -1), (torch.randn(2048, 3000),)),
        "layernorm f32 256x8192": (lambda x: torch.nn.functional.layer_norm(x, (8192,)), (torch.randn(256, 8192),)),
        "sum f32 65536x96": (lambda x: x.sum(-1) * 2, (torch.randn(65536, 96),)),
        "groupnorm+silu f32 8x256x64x64": (_group_norm_flat, (torch.randn(8, 256, 64, 64),)),
        # BatchNorm backward's per-channel sums over ResNet-50's 32 × 56² rows (two kernels: the
        # partial sums, then the final ones)
        "batchnorm-backward sums bf16 100352x256": (_channel_sums, (torch.randn(100352, 256, dtype=torch.bfloat16),
                                                                    torch.randn(100352, 256, dtype=torch.bfloat16))),
    }
    options = Options(cache_dir=str(tmp_path), tune="exhaustive", strict=True)
    slower, faster, right, total = [], [], 0, 0
    for name, (fn, inputs) in cases.items():
        graph = capture(fn, *inputs).forward
        untuned = compile_graph(graph, Options(tune="off"))
        tuned = compile_graph(graph, options)
        cuda_inputs = [t.cuda() for t in inputs]
        expected = fn(*cuda_inputs)
        for got, want in zip(tuned(*cuda_inputs), expected if isinstance(expected, tuple) else (expected,)):
            torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)
        total += tuned.tuning.tuned
        right += tuned.tuning.model_right
        position = {p: k for k, p in enumerate(untuned.graph.parameters)}
        assert len(untuned.kernels) == len(tuned.kernels)
        for k, (plan, chosen) in enumerate(zip(untuned.kernels, tuned.kernels)):
            if str(plan.template) == str(chosen.template):
                print(f"{name} [{k}]: the plan's template won ({plan.template})")
                continue
            # the graph's inputs, or (an earlier kernel's output) values of the same shape
            kernel_inputs = [cuda_inputs[position[x]] if x in position else
                             torch.randn(x.shape, device="cuda").to(DTYPE_TO_TORCH[x.dtype])
                             for x in plan.lowered.pattern.inputs]
            plan_us, chosen_us = GpuMeasure(torch.device("cuda"), options, rounds=30)([plan, chosen], kernel_inputs)
            print(f"{name} [{k}]: plan {plan_us:.1f} µs {plan.template}\n    tuned {chosen_us:.1f} µs {chosen.template}")
            if chosen_us > plan_us * (1 + 2 * NOISE) + 2 * RESOLUTION_US:
                slower.append(f"{name} [{k}]: tuned {chosen_us:.1f} µs against the plan's {plan_us:.1f} µs")
            if chosen_us * (1 + 2 * NOISE) + 2 * RESOLUTION_US < plan_us:
                faster.append(name)
    print(f"the model's first choice won {right} of {total} tuned patterns")
    assert total > 0 and 0 <= right <= total
    assert not slower, slower
    # at least one measured choice beats the model's (CHANGELOG.md names them: the batched
    # GroupNorm's block size on an H100, the channel sums' partial kernel's on an H200)
    assert faster, "no tuned template beat the plan's"


def test_a_winner_over_the_plans_template_runs_in_every_kernel_of_its_pattern(tmp_path, monkeypatch):
    """Two kernels of one structure whose inlined scalars differ (not twins): when tuning picks
    another template than the plan's for the first, both kernels are made with it and compiled
    together (``GpuMeasure.compile``), and the call gives eager's values. The timing is replaced
    so that the plan's template loses; the candidates are built, compiled and run for real."""
    from fusionstitching.runtime import tuner as T

    real = T.GpuMeasure.__call__

    def plan_loses(self, kernels, inputs, flush=True):
        times = real(self, kernels, inputs, flush)
        return [None if t is None else (1000.0 if k == 0 else 1.0 + k) for k, t in enumerate(times)]

    compiled_together: list[int] = []  # kernels per compile made for a winner's other kernels
    compile_all, make_the_others = T.GpuMeasure.compile, T.Tuner._make_the_others
    inside = [False]

    def counting(self, kernels):
        if inside[0]:
            compiled_together.append(len(kernels))
        return compile_all(self, kernels)

    def recording(self, *args):
        inside[0] = True
        try:
            return make_the_others(self, *args)
        finally:
            inside[0] = False

    monkeypatch.setattr(T.GpuMeasure, "__call__", plan_loses)
    monkeypatch.setattr(T.GpuMeasure, "compile", counting)
    monkeypatch.setattr(T.Tuner, "_make_the_others", recording)

    def fn(a, w, v):
        return torch.softmax((torch.softmax((a @ w) * 2.0, -1) @ v) * 3.0, -1)

    torch._dynamo.reset()
    a, w, v = (torch.randn(4096, 1024, device="cuda"), torch.randn(1024, 1024, device="cuda") / 32,
               torch.randn(1024, 1024, device="cuda") / 32)
    f = torch.compile(fn, backend="fusionstitching",
                      options={"cache_dir": str(tmp_path), "strict": True, "tune_budget": float("inf")})
    torch.testing.assert_close(f(a, w, v), fn(a, w, v), rtol=1e-4, atol=1e-5)
    assert compiled_together == [1]  # the second softmax's kernel, made with the first's winner
    torch.testing.assert_close(f(a, w, v), fn(a, w, v), rtol=1e-4, atol=1e-5)
