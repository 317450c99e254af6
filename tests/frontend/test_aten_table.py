"""Each ATen lowering, captured from a small torch function and checked against eager PyTorch."""

from __future__ import annotations

import re
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from fusionstitching import capture
from fusionstitching.bench.check import to_numpy
from fusionstitching.frontend import aten_table
from fusionstitching.frontend.torch_fx import LibraryFallbackWarning
from fusionstitching.graph import reference


def _r(*shape, seed=0, dtype=torch.float32):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def _i(high, *shape, seed=0):
    return torch.randint(0, high, shape, generator=torch.Generator().manual_seed(seed))


CASES = {
    "arith_alpha": (lambda x, y: torch.add(x, y, alpha=2) - torch.sub(y, x, alpha=0.5) * x / (y.abs() + 1),
                    lambda: (_r(3, 4), _r(4, seed=1))),
    "rsub_reciprocal": (lambda x: 1 - x + torch.reciprocal(x.abs() + 1), lambda: (_r(5),)),
    "unary_math": (lambda x: x.exp() + (x.abs() + 1).log() + x.log1p().nan_to_num(0) + x.expm1() + x.tanh()
                   + x.erf() + x.sigmoid() + x.abs().sqrt() + (x.abs() + 1).rsqrt() + x.sin() + x.cos()
                   + x.sign() + x.floor() + x.ceil(), lambda: (_r(4, 6),)),
    "pow_forms": (lambda x: x.abs().pow(1.5) + torch.pow(2.0, x) + x.abs().pow(x), lambda: (_r(7),)),
    "clamp_relu": (lambda x: F.relu(x) + x.clamp(-0.5, 0.5) + x.clamp(min=0.1) + x.clamp(max=0.2)
                   + F.hardtanh(x), lambda: (_r(9),)),
    "min_max_where": (lambda x, y: torch.where(x > y, torch.maximum(x, y), torch.minimum(x, y) * 2),
                      lambda: (_r(4, 4), _r(4, 4, seed=1))),
    "compare_logic": (lambda x, y: ((x >= 0) & (y < 0.5)) | ~(x == y) ^ (x != 0.25),
                      lambda: (_r(6), _r(6, seed=1))),
    "int_division": (lambda a, b: (torch.div(a, b, rounding_mode="floor"), torch.div(a, b, rounding_mode="trunc"),
                                   a % b, torch.fmod(a, b), a // 3),
                     lambda: (torch.tensor([7, -7, 7, -7, 0, 5]), torch.tensor([2, 2, -2, -2, 3, -1]))),
    "float_division_modes": (lambda a, b: (torch.div(a, b, rounding_mode="floor"),
                                           torch.div(a, b, rounding_mode="trunc"), torch.remainder(a, b)),
                             lambda: (_r(8) * 5, _r(8, seed=1) + 3)),
    "reductions": (lambda x: (x.sum(), x.sum(1), x.sum([0, 2], keepdim=True), x.amax(-1), x.amin(0),
                              x.mean(1), x.mean(), x.prod(2), x.var(1), x.std(0, correction=0)),
                   lambda: (_r(3, 4, 5),)),
    "var_mean": (lambda x: torch.var_mean(x, dim=-1, keepdim=True, correction=0), lambda: (_r(6, 10),)),
    "any_all": (lambda x: ((x > 0).any(1), (x > -2).all(), (x > 0).any()), lambda: (_r(5, 3),)),
    "integer_sum": (lambda x: (x.sum(0), (x > 1).sum(1)), lambda: (_i(4, 3, 5),)),
    "views": (lambda x: (x.view(4, 6).t().reshape(-1), x.permute(2, 0, 1) * 1, x.unsqueeze(1).squeeze(1) + 1,
                         x.transpose(0, 2).flatten()), lambda: (_r(2, 3, 4),)),
    "expand_broadcast": (lambda x, y: x.expand(3, 4, 5) * y, lambda: (_r(4, 1), _r(3, 1, 5, seed=1))),
    "slice_select": (lambda x: (x[1:, ::2], x[:, -1], x[-2], x[..., 1:4:2], x[0:0]), lambda: (_r(5, 6),)),
    "split_unbind": (lambda x: (*torch.split(x, [1, 3], 1), *x.unbind(0), *torch.chunk(x, 2, 0)),
                     lambda: (_r(4, 4),)),
    "cat_stack": (lambda x, y: (torch.cat([x, y * 2], 0), torch.stack([x, y], 1), torch.cat([x, y.int()], 1)),
                  lambda: (_r(2, 3), _r(2, 3, seed=1))),
    "pad": (lambda x: (F.pad(x, (1, 2)), F.pad(x, (1, 0, 0, 2), value=3.5), F.pad(x, (-1, 1))),
            lambda: (_r(3, 4),)),
    "full_arange": (lambda x: (x + torch.full((3, 4), 2.5), torch.arange(4) * 2, torch.arange(2, 11, 3),
                               torch.zeros_like(x) + torch.ones(3, 4), x.new_full((2,), 7.0),
                               torch.arange(0.5, 3.0, 0.5)), lambda: (_r(3, 4),)),
    "embedding": (lambda w, idx: F.embedding(idx, w), lambda: (_r(10, 4), _i(10, 2, 3, seed=1))),
    "index_negative": (lambda x, idx: x[idx] + x[:, idx].sum(), lambda: (_r(6, 6), torch.tensor([0, -1, 3, -6]))),
    "index_two_tensors": (lambda x, i, j: x[i, j], lambda: (_r(4, 5, 3), torch.tensor([0, 3, 1]),
                                                             torch.tensor([4, 0, 2]))),
    "index_select": (lambda x, idx: torch.index_select(x, 1, idx), lambda: (_r(3, 5), torch.tensor([4, 0, 0]))),
    "gather": (lambda x, idx: (torch.gather(x, 1, idx), torch.gather(x, 0, idx[:2])),
               lambda: (_r(4, 5), _i(4, 4, 3, seed=2))),
    "scatter_one_per_row": (lambda x, idx: (x.scatter(1, idx, 2.0), x.scatter(1, idx, x[:, :1] * 5)),
                            lambda: (_r(4, 6), _i(6, 4, 1, seed=3))),
    # torch takes a 0-d tensor as one element: reducing it over dim 0 or -1 reduces nothing, it is
    # index_select's source or destination of one row, and scatter's of one element.
    # the backward of slicing (rotary embedding's halves): a padded source selected by position
    "slice_select_scatter": (lambda x, s, t, r: (torch.slice_scatter(x, s, 1, 1, 6, 2), torch.slice_scatter(x, t, 0, -2),
                                                 torch.select_scatter(x, r, 1, -1),
                                                 torch.slice_scatter(x.int(), (s * 4).int(), 1, 1, 6, 2),
                                                 torch.slice_scatter(x, x[:, 2:5] * 3, 1, 2, 5),
                                                 torch.slice_scatter(x, x * 2, 1)),
                             lambda: (_r(4, 7), _r(4, 3, seed=1), _r(2, 7, seed=2), _r(4, seed=3))),
    "zero_dim_reductions": (lambda x: (x.sum(0), x.sum(-1, keepdim=True), x.amax(0), x.amin(-1), x.mean(0),
                                       x.prod(0), torch.logsumexp(x, 0), torch.softmax(x, -1), (x > 0).any(0),
                                       x.sum(0, dtype=torch.float64), x.var(0, correction=0)),
                            lambda: (_r(1).reshape(()),)),
    "zero_dim_index_select": (lambda x, y, i, j: (torch.index_select(x, 0, i), torch.index_select(x, -1, j),
                                                  torch.index_select(y, 0, j) * 2),
                              lambda: (_r(1).reshape(()), _r(5, seed=1), torch.tensor([0]), torch.tensor(0))),
    "zero_dim_scatter": (lambda x, i, s: (x.scatter(0, i, s), x.scatter(-1, i, 2.5)),
                         lambda: (_r(1).reshape(()), torch.tensor(0), _r(1, seed=1).reshape(()))),
    "matmuls": (lambda a, b, c: (a @ b, torch.bmm(c, c.transpose(1, 2)), torch.addmm(b[0], a, b),
                                 torch.dot(a[0], a[1]), torch.einsum("bij,bkj->bik", c, c)),
                lambda: (_r(3, 4), _r(4, 5, seed=1), _r(2, 3, 4, seed=2))),
    "half_softmax_layernorm": (lambda x, w: (torch.softmax(x, -1), F.layer_norm(x, (8,), w, w)),
                               lambda: (_r(4, 8, dtype=torch.float16), _r(8, seed=1, dtype=torch.float16))),
    "bf16_gelu_erf": (lambda x: F.gelu(x), lambda: (_r(16, dtype=torch.bfloat16),)),
    "log_softmax_nll": (lambda x, t: F.cross_entropy(x, t, reduction="none"),
                        lambda: (_r(5, 7), _i(7, 5, seed=4))),
    "to_copy_casts": (lambda x: (x.to(torch.float16), x.to(torch.int32), (x > 0).float(), x.double() * 2),
                      lambda: (_r(6) * 3,)),
    "copy_into_input": (lambda x, y: x.copy_(y * 2), lambda: (_r(3, 3), _r(3, seed=1))),
    "silu_mse": (lambda x, y: (F.silu(x), F.mse_loss(x, y)), lambda: (_r(6), _r(6, seed=1))),
}

TOLERANCE = {torch.float16: 1e-2, torch.bfloat16: 1e-2}


@pytest.mark.parametrize("case", list(CASES))
def test_lowering_matches_eager(case):
    fn, make_inputs = CASES[case]
    inputs = make_inputs()
    with warnings.catch_warnings():
        warnings.simplefilter("error", LibraryFallbackWarning)
        captured = capture(fn, *[x.clone() for x in inputs])
    graph = captured.forward
    got = reference.evaluate(graph, [to_numpy(x) for x in inputs])
    eager_inputs = [x.clone() for x in inputs]
    want = fn(*eager_inputs)
    want = list(want) if isinstance(want, (tuple, list)) else [want]
    assert len(got) >= len(want)
    for g, w in zip(got, want):
        assert g.shape == tuple(w.shape)
        assert g.dtype == to_numpy(w).dtype
        np.testing.assert_allclose(g.astype(np.float64), w.double().numpy(), rtol=TOLERANCE.get(w.dtype, 1e-5),
                                   atol=TOLERANCE.get(w.dtype, 1e-6))
    for out_index, param_index in graph.mutations.items():
        np.testing.assert_allclose(got[out_index], to_numpy(eager_inputs[param_index]), rtol=1e-6)


def test_every_table_entry_is_documented():
    documented = set(re.findall(r"`((?:aten|prims)\.[\w.]+)`", (Path(__file__).resolve().parents[2] / "docs" / "ops.md").read_text()))
    missing = sorted(set(aten_table.TABLE) - documented)
    assert not missing, f"docs/ops.md lacks {missing}"
    handled_elsewhere = {"aten.copy_.default"} | {f"aten.{n}.default" for n in
                                                    aten_table.COMPOSITE_DECOMPOSITIONS}
    stale = sorted(documented - set(aten_table.TABLE) - handled_elsewhere)
    assert not stale, f"docs/ops.md lists ops with no entry: {stale}"
