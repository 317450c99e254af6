"""Max pooling lowered to the max of strided windows of the -inf-padded input; where the backward
reads its indices, they are computed window by window in torch's order, and the backward sums the
output gradients whose index is each input position's, by classes of positions modulo the stride."""

from __future__ import annotations

import warnings

import pytest
import torch

import fusionstitching
from fusionstitching import Options
from fusionstitching.frontend.torch_fx import LibraryFallbackWarning, capture

CASES = {  # kernel, stride, padding, dilation, ceil_mode, input shape
    "resnet_stem": (3, 2, 1, 1, False, (2, 4, 12, 12)),
    "two_by_two": (2, 2, 0, 1, False, (2, 3, 8, 6)),
    "ceil_odd": (3, 2, 0, 1, True, (1, 2, 9, 7)),
    "dilated": (2, 1, 1, 2, False, (2, 2, 7, 7)),
    "rectangular": ((3, 2), (2, 1), (1, 0), 1, False, (3, 5, 6)),  # no batch dim
}


@pytest.mark.parametrize("name", list(CASES))
def test_max_pooling_matches_eager(name):
    kernel, stride, padding, dilation, ceil_mode, shape = CASES[name]
    pool = torch.nn.MaxPool2d(kernel, stride, padding, dilation, ceil_mode=ceil_mode)
    torch.manual_seed(0)
    x = torch.randn(shape)
    x.view(-1)[3] = float("nan")  # a NaN in a window makes its maximum NaN, as in eager
    with warnings.catch_warnings():
        warnings.simplefilter("error", LibraryFallbackWarning)
        graph = capture(lambda t: pool(t).relu(), x).forward
    assert not any(n.op == "library" for n in graph.nodes)
    torch._dynamo.reset()
    compiled = fusionstitching.compile(lambda t: pool(t).relu(), Options(strict=True))
    torch.testing.assert_close(compiled(x), pool(x).relu(), equal_nan=True)


def _awkward(shape, seed: int) -> torch.Tensor:
    """Values with ties (a few levels), -inf and a NaN: the cases where which index is the
    maximum's depends on the scan order."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(-2, 3, shape, generator=g).float()
    flat = x.view(-1)
    flat[torch.randint(0, flat.numel(), (3,), generator=g)] = float("-inf")
    return x


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_max_pooling_indices_and_gradients_match_eager(name, dtype):
    kernel, stride, padding, dilation, ceil_mode, shape = CASES[name]

    def fn(t, scale):
        values, indices = torch.nn.functional.max_pool2d(t, kernel, stride, padding, dilation, ceil_mode,
                                                         return_indices=True)
        return values * scale, indices

    for seed in range(3):
        x = _awkward(shape, seed).to(dtype)
        if seed == 2:
            x.view(-1)[5] = float("nan")  # the last NaN of a window is its index
        scale = torch.randn(1, dtype=dtype)
        with warnings.catch_warnings():
            warnings.simplefilter("error", LibraryFallbackWarning)
            captured = capture(fn, x.clone().requires_grad_(), scale.clone().requires_grad_(), train=True)
        assert not captured.library_ops
        torch._dynamo.reset()
        compiled = fusionstitching.compile(fn, Options(strict=True))
        ours_x, eager_x = x.clone().requires_grad_(), x.clone().requires_grad_()
        ours_s, eager_s = scale.clone().requires_grad_(), scale.clone().requires_grad_()
        ours, eager = compiled(ours_x, ours_s), fn(eager_x, eager_s)
        torch.testing.assert_close(ours[0], eager[0], equal_nan=True)
        assert torch.equal(ours[1], eager[1]), (ours[1] != eager[1]).nonzero()[:5]
        grad = torch.randn(eager[0].shape, dtype=dtype)
        ours[0].backward(grad)
        eager[0].backward(grad)
        if dtype == torch.float32:
            torch.testing.assert_close(ours_x.grad, eager_x.grad, equal_nan=True)
        else:  # a position's taps are summed in float and rounded once, as by eager's CUDA kernel;
            # eager's CPU kernel rounds each partial sum to bf16, which sums of opposite signs show
            from fusionstitching.bench.correctness import BF16_TOLERANCE, relative_error

            assert relative_error(ours_x.grad, eager_x.grad) < BF16_TOLERANCE


def test_every_stride_class_gets_its_taps():
    """Strides longer than the window leave input positions no window covers (their gradient is 0),
    and dilated rectangular windows give each class of positions modulo the stride its own taps:
    the gradient of a sum of squares over random values (distinct maxima) equals eager's."""
    cases = [(2, 3, 0, 1, False, (1, 2, 7, 7)), ((3, 2), (2, 3), (1, 0), (2, 1), False, (2, 3, 9, 13)),
             (3, 1, 1, 1, False, (3, 5, 8))]
    for kernel, stride, padding, dilation, ceil_mode, shape in cases:
        def fn(t, pooling=(kernel, stride, padding, dilation, ceil_mode)):
            return torch.nn.functional.max_pool2d(t, *pooling).square().sum()

        x = torch.randn(shape, generator=torch.Generator().manual_seed(1))
        torch._dynamo.reset()
        compiled = fusionstitching.compile(fn, Options(strict=True))
        ours, eager = x.clone().requires_grad_(), x.clone().requires_grad_()
        compiled(ours).backward()
        fn(eager).backward()
        torch.testing.assert_close(ours.grad, eager.grad)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_resnet_stem_pooling_trains_like_eager_on_the_gpu(dtype):
    """ResNet's stem (BatchNorm, ReLU, 3 × 3 max pooling of stride 2) forward and backward on the
    GPU: the pooled values equal eager CUDA's; the gradients too in f32 (which needs the indices
    exact: the backward compares them with each input position), within bf16's tolerance in bf16."""
    torch.manual_seed(0)
    stem = torch.nn.Sequential(torch.nn.BatchNorm2d(64), torch.nn.ReLU(), torch.nn.MaxPool2d(3, 2, 1))
    stem = stem.cuda().to(dtype)
    x = torch.randn(8, 64, 112, 112, device="cuda", dtype=dtype)
    grad = torch.randn(8, 64, 56, 56, device="cuda", dtype=dtype)
    torch._dynamo.reset()
    compiled = torch.compile(stem, backend="fusionstitching", options={"strict": True})
    results = []
    for run in (compiled, stem):
        xs = x.clone().requires_grad_()
        out = run(xs)
        out.backward(grad)
        results.append((out.detach(), xs.grad, stem[0].weight.grad.clone()))
        stem.zero_grad()
    (ours, ours_dx, ours_dw), (eager, eager_dx, eager_dw) = results
    torch.testing.assert_close(ours, eager)
    if dtype == torch.float32:
        torch.testing.assert_close(ours_dx, eager_dx)
        torch.testing.assert_close(ours_dw, eager_dw, rtol=1e-4, atol=1e-4)  # sums of 100352 terms
    else:  # BatchNorm's backward rounds its intermediates to bf16 in other places than eager's kernel
        from fusionstitching.bench.correctness import BF16_TOLERANCE, relative_error

        assert relative_error(ours_dx, eager_dx) < BF16_TOLERANCE
        assert relative_error(ours_dw, eager_dw) < BF16_TOLERANCE
