"""``torch.max(x, dim)``, ``torch.min(x, dim)``, ``argmax`` and ``argmin`` are lowered (the extreme,
then the first position holding it): the indices are eager's bit for bit, NaN rows and ties
included, and an empty dim keeps torch's op and its error."""

from __future__ import annotations

import warnings

import pytest
import torch

from fusionstitching.frontend.torch_fx import capture


def _values() -> torch.Tensor:
    """Ties, two NaNs in a row (the first one's index wins), a row of -0.0 and 0.0."""
    x = torch.randint(-3, 3, (5, 9), generator=torch.Generator().manual_seed(0)).float()
    x[1, 4] = x[1, 7] = float("nan")
    x[2] = 0.0
    x[2, 0] = -0.0
    return x


def _same(got, want) -> None:
    got, want = torch.utils._pytree.tree_leaves(got), torch.utils._pytree.tree_leaves(want)
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert g.dtype == w.dtype and g.shape == w.shape
        assert torch.equal(g.isnan(), w.isnan()) and torch.equal(g.nan_to_num(), w.nan_to_num())


CASES = {
    "max_dim": lambda t: torch.max(t, 1),
    "max_dim_keepdim": lambda t: torch.max(t, 1, keepdim=True),
    "min_dim0": lambda t: torch.min(t, 0),
    "argmax": lambda t: torch.argmax(t, 1),
    "argmin_keepdim": lambda t: torch.argmin(t, -1, keepdim=True),
    "argmax_flat": lambda t: torch.argmax(t),
    "argmin_flat_keepdim": lambda t: torch.argmin(t, keepdim=True),
}


@pytest.mark.parametrize("name", list(CASES))
def test_bit_for_bit_as_eager(name):
    torch._dynamo.reset()
    x = _values()
    _same(torch.compile(CASES[name], backend="fusionstitching")(x), CASES[name](x))


@pytest.mark.parametrize("x", [torch.randint(-3, 3, (4, 7)), torch.randn(4, 7).bfloat16(), torch.tensor(2.0)],
                         ids=["int64", "bf16", "0-d"])
def test_other_types(x):
    torch._dynamo.reset()
    fn = lambda t: (torch.max(t, 0), torch.argmin(t, 0))
    _same(torch.compile(fn, backend="fusionstitching")(x), fn(x))


def test_bool_max_is_eagers_and_bool_argmin_is_rejected_as_eager_rejects_it():
    x = torch.randn(4, 7, generator=torch.Generator().manual_seed(1)) > 0
    torch._dynamo.reset()
    _same(torch.compile(lambda t: torch.max(t, 0), backend="fusionstitching")(x), torch.max(x, 0))
    with pytest.raises(RuntimeError, match="bool"):
        torch.argmin(x, 0)
    torch._dynamo.reset()
    with pytest.raises(Exception, match="bool"):
        torch.compile(lambda t: torch.argmin(t, 0), backend="fusionstitching")(x)


def test_the_gradient_reaches_the_first_maximum_only():
    x = _values()[[0, 3, 4]].requires_grad_(True)
    y = x.detach().clone().requires_grad_(True)
    torch._dynamo.reset()
    torch.compile(lambda t: torch.max(t, 1)[0].sum(), backend="fusionstitching")(x).backward()
    torch.max(y, 1)[0].sum().backward()
    assert torch.equal(x.grad, y.grad)


def test_no_library_call_is_left_and_an_empty_dim_keeps_torchs_error():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        captured = capture(lambda t: torch.max(t, 1)[0] + torch.argmin(t, 0), torch.randn(4, 4, requires_grad=True),
                           train=True)
    for graph in filter(None, (captured.forward, captured.backward)):
        assert not [n.attrs.get("target") for n in graph.nodes if n.op == "library"], graph.name
    torch._dynamo.reset()
    compiled = torch.compile(lambda t: torch.argmax(t, 1), backend="fusionstitching", options={"strict": False})
    with pytest.raises(Exception) as raised:
        compiled(torch.randn(3, 0))
    with pytest.raises(type(raised.value)):
        torch.argmax(torch.randn(3, 0), 1)
