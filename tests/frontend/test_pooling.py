"""Max pooling lowered to the max of strided windows of the -inf-padded input where nothing reads
its indices; kept as a library call where the backward reads them."""

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


def test_training_keeps_the_pooling_whose_indices_the_backward_reads():
    pool = torch.nn.MaxPool2d(3, 2, 1)
    x = torch.randn(2, 3, 8, 8, requires_grad=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        captured = capture(lambda t: pool(t).sum(), x, train=True)
    assert "aten.max_pool2d_with_indices.default" in captured.library_ops
