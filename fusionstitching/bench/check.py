"""Check a capture against eager PyTorch, with ``graph/reference.py`` as the evaluator.

Forward outputs and the new values of mutated inputs are compared with what eager PyTorch computes
(and writes in place); for training, the backward graph is evaluated on the reference forward's
saved tensors and random tangents and compared with ``torch.autograd.grad``.

Errors are relative to the largest magnitude of the expected tensor. Gradients that are zero in
exact arithmetic (a key bias under softmax is one) are pure rounding noise in both evaluators, so
for gradients the scale has a floor of 1e-4 of the largest gradient of the graph.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from fusionstitching.frontend.torch_fx import Captured
from fusionstitching.graph import reference
from fusionstitching.graph.ops import DType

GRADIENT_SCALE_FLOOR = 1e-4


def to_numpy(t: torch.Tensor) -> np.ndarray:
    t = t.detach().cpu()
    if t.dtype == torch.bfloat16:
        return t.float().numpy().astype(DType.BF16.numpy)
    return t.numpy()


def state_tensors(fn: Any) -> list[torch.Tensor]:
    if isinstance(fn, torch.nn.Module):
        return [t for _, t in fn.named_parameters()] + [t for _, t in fn.named_buffers()]
    return []


def forward_arrays(captured: Captured, fn: Any, inputs: Sequence[Any], seed: int = 0,
                   offset: int = 0) -> list[Any]:
    """Arrays in ``captured.forward.parameters`` order: state, tensor inputs, then rng seed/offset."""
    arrays: list[Any] = [to_numpy(t) for t in state_tensors(fn) + [x for x in inputs if isinstance(x, torch.Tensor)]]
    extra = len(captured.forward.parameters) - len(arrays)
    if extra not in (0, 2):
        raise ValueError(f"{extra} forward parameters beyond the tensors; only rng seed/offset may follow")
    if extra:
        arrays += [np.int64(seed), np.int64(offset)]
    return arrays


def relative_error(got: np.ndarray, want: np.ndarray, floor: float = 0.0) -> float:
    got64, want64 = np.asarray(got, np.float64), np.asarray(want, np.float64)
    if got64.shape != want64.shape:
        return float("inf")
    same = (got64 == want64) | (np.isnan(got64) & np.isnan(want64))
    diff = np.where(same, 0.0, np.abs(got64 - want64))
    finite = np.abs(want64[np.isfinite(want64)])
    scale = max(finite.max(initial=0.0), floor, 1e-30)
    return float(diff.max(initial=0.0) / scale)


@dataclass
class Errors:
    forward: list[float] = field(default_factory=list)
    mutations: list[float] = field(default_factory=list)
    backward: list[float] = field(default_factory=list)

    @property
    def worst(self) -> float:
        return max(self.forward + self.mutations + self.backward, default=0.0)


def check_against_eager(captured: Captured, fn: Any, inputs: Sequence[Any], train: bool,
                        seed: int = 0) -> Errors:
    errors = Errors()
    graph = captured.forward
    outputs = reference.evaluate(graph, forward_arrays(captured, fn, inputs))
    eager_inputs = [x.detach().clone().requires_grad_(x.requires_grad) if isinstance(x, torch.Tensor) else x
                    for x in inputs]
    state = state_tensors(fn)
    with torch.enable_grad() if train else torch.no_grad():
        eager = fn(*eager_inputs)
    eager_outputs = [t for t in torch.utils._pytree.tree_leaves(eager) if isinstance(t, torch.Tensor)]
    if len(eager_outputs) != captured.num_user_outputs:
        raise AssertionError(f"{len(eager_outputs)} eager outputs, {captured.num_user_outputs} captured")
    for got, want in zip(outputs, eager_outputs):
        errors.forward.append(relative_error(got, to_numpy(want)))
    written = state + [x for x in eager_inputs if isinstance(x, torch.Tensor)]
    for out_index, param_index in graph.mutations.items():
        errors.mutations.append(relative_error(outputs[out_index], to_numpy(written[param_index])))
    if captured.backward is not None:
        errors.backward = _backward_errors(captured, outputs, eager_outputs, written, seed)
    return errors


def _backward_errors(captured: Captured, outputs: list[Any], eager_outputs: list[torch.Tensor],
                     wrt: list[torch.Tensor], seed: int) -> list[float]:
    first = captured.num_user_outputs
    saved = outputs[first : first + captured.num_saved]
    differentiable = [e for e in eager_outputs if e.requires_grad]
    generator = torch.Generator().manual_seed(seed)
    tangents = [torch.randn(e.shape, generator=generator).to(e.dtype) for e in differentiable]
    grads = reference.evaluate(captured.backward, list(saved) + [to_numpy(t) for t in tangents])
    needs = [w for w in wrt if w.requires_grad]
    wanted = dict(zip(map(id, needs), torch.autograd.grad(differentiable, needs, tangents, allow_unused=True)))
    expected = [wanted.get(id(w)) for w in wrt]
    floor = GRADIENT_SCALE_FLOOR * max((float(e.abs().max()) for e in expected if e is not None), default=0.0)
    errors = []
    for index, (got, want) in enumerate(zip(grads, expected)):
        if want is None:
            if got is not None and np.any(got):
                raise AssertionError(f"backward output {index}: a nonzero gradient where eager has none")
            continue
        if got is None:
            raise AssertionError(f"backward output {index}: no gradient where eager has one")
        errors.append(relative_error(got, to_numpy(want), floor))
    return errors
