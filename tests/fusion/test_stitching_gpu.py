"""Norm backward over wide rows on the GPU: the weight gradient's partials carried by the row
kernel's grid loop give eager's gradients (RMSNorm bf16, LayerNorm f32 and f16, 2- and 3-dim rows)."""

from __future__ import annotations

import pytest
import torch

import fusionstitching
from fusionstitching.backend import stats
from fusionstitching.options import Options

gpu_only = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
pytestmark = [pytest.mark.gpu, gpu_only]


def _rmsnorm(x, w):
    wide = x.float()
    return w * (wide * torch.rsqrt(wide.pow(2).mean(-1, keepdim=True) + 1e-6)).to(x.dtype)


@pytest.mark.parametrize("kind, shape, dtype", [
    ("rms", (2048, 4096), torch.bfloat16),
    ("rms", (2, 1000, 2048), torch.bfloat16),
    ("ln", (1024, 3072), torch.float32),
    ("ln", (1536, 2048), torch.float16),
])
def test_wide_norm_backward_matches_eager(kind, shape, dtype):
    torch._dynamo.reset()
    torch.manual_seed(0)
    device = torch.device("cuda")
    x = torch.randn(*shape, device=device, dtype=dtype, requires_grad=True)
    dy = torch.randn(*shape, device=device, dtype=dtype)
    if kind == "rms":
        w = torch.randn(shape[-1], device=device, dtype=dtype, requires_grad=True)
        params = [w]

        def fn(x):
            return _rmsnorm(x, w)
    else:
        module = torch.nn.LayerNorm(shape[-1]).to(device, dtype)
        with torch.no_grad():
            module.weight.normal_()
            module.bias.normal_()
        params = [module.weight, module.bias]
        fn = module

    def grads(f):
        for t in [x, *params]:
            t.grad = None
        f(x).backward(dy)
        return [t.grad.float().clone() for t in [x, *params]]

    want = grads(fn)
    compiled = fusionstitching.compile(fn, Options(strict=True))
    before = stats().get("fallbacks", 0)
    for _ in range(2):  # the first call (tuned) and a lean one
        got = grads(compiled)
        tolerance = 1e-4 if dtype == torch.float32 else 2e-2
        for g, w_ in zip(got, want):
            error = float((g - w_).abs().max() / w_.abs().max().clamp_min(1e-30))
            assert error < tolerance, (kind, shape, dtype, error)
    assert stats().get("fallbacks", 0) == before
