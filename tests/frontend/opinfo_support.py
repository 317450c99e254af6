"""Running one OpInfo sample through ``torch.compile(backend="fusionstitching")`` and against eager.

``check_sample`` compiles the sample's call in strict mode with TorchDynamo told to raise rather
than run anything in eager PyTorch (``fullgraph=True``, no suppressed errors, an error on any
recompile and at the recompile limit), and proves that this backend compiled it:
``stats()["graphs"]`` grows by one for the forward (or inference) graph and by one more for the
backward graph once gradients are asked for, ``stats()["fallbacks"]`` stays put, and a
``FallbackWarning`` or ``LibraryFallbackWarning`` is an error (a covered sample lowers with no
library call, docs/opinfo.md). A sample served by the compilation of an earlier one of the same
``reuse_key`` must compile nothing and hit the backend's cache instead. Gradients of outputs that
alias inputs are the one thing that runs outside compiled graphs: AOTAutograd regenerates such
outputs (views of inputs, or the inputs themselves) from the inputs, with their own backward.

Then outputs, inputs that the op writes in place and, where the sample has differentiable inputs
and outputs, the gradients of a random cotangent are compared with eager PyTorch on copies of the
same inputs (same strides and storage offsets), with torch.testing's tolerances for the dtype or
the OpInfo's own where it declares larger ones. Where the two differ, eager in float64 arbitrates
(``Reference``): the compiled value may differ from eager's rounding but not be worse. Random and
uninitialized outputs (eager gives other values under another seed, or the OpInfo says so) are
compared by shape, dtype and device only.
"""

from __future__ import annotations

import functools
import re
import types
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils import _pytree as pytree

import fusionstitching  # noqa: F401 - registers the backend
from fusionstitching.backend import FallbackWarning, stats
from fusionstitching.bench import opinfo_coverage as coverage
from fusionstitching.frontend.torch_fx import LibraryFallbackWarning


@functools.cache
def op_infos() -> dict[str, Any]:
    return {coverage.op_key(op)[0] + (f".{op.variant_test_name}" if op.variant_test_name else ""): op
            for op in coverage.op_db()}


@dataclass(frozen=True)
class Samples:
    op: Any
    samples: tuple[Any, ...]
    digest: str  # docs/opinfo.md lists the digest of the f32 CPU samples


@functools.lru_cache(maxsize=2)
def samples_of(label: str, device: str = "cpu", dtype: torch.dtype = torch.float32) -> Samples:
    op = op_infos()[label]
    samples = tuple(coverage.make_samples(op, device, dtype))
    return Samples(op, samples, coverage.samples_digest(samples, error_inputs_of(label, device)))


@functools.lru_cache(maxsize=2)
def error_inputs_of(label: str, device: str = "cpu") -> tuple[Any, ...]:
    return tuple(coverage.make_error_inputs(op_infos()[label], device))


def check_error_input(op: Any, error_input: Any, options: dict | None = None) -> None:
    """Eager PyTorch rejects ``error_input``; the compiled call (strict) must reject it too, as a
    user error: an exception that is not an internal compiler failure."""
    from fusionstitching.backend import CompileFailure

    call = coverage.as_call(op, error_input.sample_input)
    if not coverage.eager_rejects(op, error_input):
        raise AssertionError("eager PyTorch accepts this error input: regenerate docs/opinfo.md")
    torch._dynamo.reset()
    compiled = torch.compile(_fresh(call.fn), backend="fusionstitching", fullgraph=True, dynamic=False,
                             options={"strict": True, **(options or {})})
    try:
        with _strict_dynamo(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            compiled(*[copy_tensor(t) for t in call.tensors])
    except Exception as err:
        chain = _chain(err)
        internal = next((e for e in chain if isinstance(e, CompileFailure)), None)
        if internal is not None:
            raise AssertionError(f"rejected by an internal compiler error, not as the user's error: "
                                 f"{str(internal).splitlines()[0]}") from err
        return
    raise AssertionError(f"the compiled call accepts it; eager raises {error_input.error_type.__name__}: "
                         f"{error_input.error_regex!r}")


def _chain(err: BaseException) -> list[BaseException]:
    """``err`` and the exceptions it wraps (``__cause__``, TorchDynamo's ``inner_exception``)."""
    chain: list[BaseException] = []
    current: BaseException | None = err
    while current is not None and current not in chain:
        chain.append(current)
        current = getattr(current, "inner_exception", None) or current.__cause__
    return chain


structure = coverage.structure


def tolerances(op: Any, dtype: torch.dtype, device_type: str) -> tuple[float, float]:
    """(rtol, atol): torch.testing's defaults for ``dtype``, widened to the largest override that
    the OpInfo itself declares for ``dtype`` (any test, this device type or all)."""
    from torch.testing._comparison import default_tolerances
    from torch.testing._internal.common_device_type import toleranceOverride

    rtol, atol = default_tolerances(dtype)
    for info in op.decorators:
        if getattr(info, "device_type", None) not in (None, device_type):
            continue
        for decorator in getattr(info, "decorators", ()):
            if isinstance(decorator, toleranceOverride) and dtype in decorator.d:
                rtol = max(rtol, decorator.d[dtype].rtol)
                atol = max(atol, decorator.d[dtype].atol)
    return rtol, atol


def copy_tensor(t: torch.Tensor) -> torch.Tensor:
    """A leaf copy of ``t`` with its own storage and the same sizes, strides and storage offset."""
    storage = t.detach().untyped_storage().clone()
    copy = torch.empty(0, dtype=t.dtype, device=t.device)
    copy.set_(storage, t.storage_offset(), t.size(), t.stride())
    return copy.requires_grad_(t.requires_grad)


class NotCompiled(AssertionError):
    """The sample did not run as graphs compiled by this backend."""


def _graphs() -> int:
    return stats().get("graphs", 0)


def _fallbacks() -> int:
    return stats().get("fallbacks", 0)


def _cache_hits() -> int:
    return stats().get("cache hits", 0)


def _strict_dynamo():
    return torch._dynamo.config.patch(suppress_errors=False, error_on_recompile=True,
                                      fail_on_recompile_limit_hit=True)


def _leaves(value: Any) -> list[Any]:
    return pytree.tree_leaves(value)


def _differentiable(outputs: Any) -> list[torch.Tensor]:
    return [o for o in _leaves(outputs) if isinstance(o, torch.Tensor) and o.requires_grad
            and o.is_floating_point()]


@dataclass(frozen=True)
class Tolerance:
    rtol: float
    atol: float


def _compare(got: Sequence[Any], want: Sequence[Any], what: str, tolerance: Tolerance, values: bool,
             reference: Callable[[], Sequence[Any] | None] | None = None) -> None:
    """``got`` (compiled) against ``want`` (eager, same dtype). Where they differ beyond the
    tolerance, ``reference()`` (eager in float64) arbitrates: the compiled value passes if its error
    against float64 is within the tolerance plus twice eager's largest error on the tensor (the
    compiled graph may round differently from eager, not worse)."""
    if len(got) != len(want):
        raise AssertionError(f"{what}: {len(got)} values, eager gives {len(want)}")
    for i, (g, w) in enumerate(zip(got, want)):
        if isinstance(w, torch.Tensor):
            if not isinstance(g, torch.Tensor):
                raise AssertionError(  # noqa: TRY004 - a test failure, not a type error
                    f"{what} {i}: {type(g).__name__}, eager gives a tensor")
            if (g.shape, g.dtype, g.device) != (w.shape, w.dtype, w.device):
                raise AssertionError(f"{what} {i}: {tuple(g.shape)} {g.dtype} {g.device}, eager gives "
                                     f"{tuple(w.shape)} {w.dtype} {w.device}")
            if not values:
                continue
            try:
                torch.testing.assert_close(g.detach(), w.detach(), rtol=tolerance.rtol, atol=tolerance.atol,
                                           equal_nan=True, msg=lambda m, i=i: f"{what} {i}: {m}")
            except AssertionError as mismatch:
                ref = reference() if reference is not None and g.is_floating_point() else None
                if ref is None or not _as_close_as_eager(g, w, ref[i], tolerance):
                    raise mismatch from None
        elif g != w:
            raise AssertionError(f"{what} {i}: {g!r}, eager gives {w!r}")


def _as_close_as_eager(got: torch.Tensor, want: torch.Tensor, ref: Any, tolerance: Tolerance) -> bool:
    if not isinstance(ref, torch.Tensor) or ref.shape != got.shape:
        return False
    got, want, ref = got.detach().double().cpu(), want.detach().double().cpu(), ref.detach().double().cpu()
    same = (got == want) | (got.isnan() & want.isnan())
    # eager's largest error on the tensor, not its error at each element: where eager happens to be
    # exact (a bf16 gradient element), rounding otherwise is no defect
    eager_error = (want - ref).abs().nan_to_num(nan=0.0, posinf=0.0).max() if want.numel() else 0.0
    allowed = tolerance.atol + tolerance.rtol * ref.abs() + 2 * eager_error
    return bool((same | ((got - ref).abs() <= allowed)).all())


class Reference:
    """Eager PyTorch in float64 on the sample's values (float tensors and float dtype arguments
    widened), with the same cotangents: computed only when compiled and eager disagree."""

    def __init__(self, op: Any, sample: Any) -> None:
        self.op, self.sample = op, sample
        self._run: tuple[list[Any], list[Any], list[Any]] | None = None

    def _widen(self, value: Any) -> Any:
        if isinstance(value, torch.Tensor) and value.is_floating_point():
            return value.detach().double().requires_grad_(value.requires_grad)
        if isinstance(value, torch.dtype) and value.is_floating_point:
            return torch.float64
        return value

    def run(self, cotangents: Sequence[torch.Tensor] = ()) -> tuple[list[Any], list[Any], list[Any]]:
        """(outputs, inputs after the call, gradients of ``cotangents``); empty where float64
        cannot serve (an op without float64)."""
        if self._run is not None and (self._run[2] or not cotangents):
            return self._run
        from torch.testing._internal.opinfo.core import SampleInput

        widened = pytree.tree_map(self._widen, (self.sample.input, self.sample.args, self.sample.kwargs))
        call = coverage.as_call(self.op, SampleInput(widened[0], args=widened[1], kwargs=widened[2]))
        inputs = [copy_tensor(t) for t in call.tensors]
        try:
            outputs = call.fn(*inputs)
            grads: list[Any] = []
            differentiable = _differentiable(self.sample.output_process_fn_grad(outputs))
            leaves = [t for t in inputs if t.requires_grad]
            if cotangents and differentiable and leaves:
                grads = list(torch.autograd.grad(differentiable, leaves, [c.double() for c in cotangents],
                                                 allow_unused=True, materialize_grads=True))
            self._run = (_leaves(outputs), inputs, grads)
        except Exception:  # noqa: BLE001 - an op without float64 support: no arbiter
            self._run = ([], [], [])
        return self._run

    def outputs(self) -> list[Any] | None:
        return self.run()[0] or None

    def inputs(self) -> list[Any] | None:
        return self.run()[1] or None


def _through_compiled_graph(outputs: Sequence[torch.Tensor]) -> bool:
    """Whether the autograd graph of ``outputs`` holds an AOTAutograd-compiled function."""
    seen: set[Any] = set()
    stack = [o.grad_fn for o in outputs]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        if node.name() == "CompiledFunctionBackward":
            return True
        stack.extend(next_node for next_node, _ in node.next_functions)
    return False


def _deterministic(op: Any, call: Any, want: Any) -> bool:
    """Whether eager gives the same values again under other seeds (random ops do not). Several
    seeds: a random op's one-element output repeats under a second seed half the time (bernoulli's
    first CUDA sample did)."""
    # (torch 2.11's OpInfo has no has_nondeterministic_output)
    if getattr(op, "has_nondeterministic_output", False) or getattr(op, "skip_correctness_check_compile_vs_eager", False):
        return False
    try:
        for seed in range(1, 9):
            torch.manual_seed(seed)
            again = call.fn(*[copy_tensor(t) for t in call.tensors])
            if not all(_same(a, b) for a, b in zip(_leaves(again), _leaves(want))):
                return False
        return True
    finally:
        torch.manual_seed(0)


def _same(a: Any, b: Any) -> bool:
    if not isinstance(a, torch.Tensor):
        return a == b
    if torch.equal(a, b):
        return True
    return a.is_floating_point() and a.shape == b.shape and torch.allclose(a, b, equal_nan=True)


@dataclass
class Compiled:
    """A compiled call kept for the next samples of the same description (same non-tensor
    arguments, tensor shapes, dtypes and layouts): TorchDynamo's cache serves them with no new
    graph, so each such sample costs one run instead of one compilation."""

    fn: Any
    backward: bool = False  # its backward graph is compiled too


def reuse_key(sample: Any) -> tuple:
    """Samples with equal keys are served by one compilation."""
    leaves = _leaves((sample.input, sample.args, sample.kwargs))
    layouts = tuple((t.stride(), t.storage_offset()) for t in leaves if isinstance(t, torch.Tensor))
    return coverage.describe(sample), layouts


def check_sample(op: Any, sample: Any, options: dict | None = None, reuse: Compiled | None = None,
                 library_ops: tuple[str, ...] = ()) -> Compiled:
    """Compile ``op`` on ``sample`` with this backend (strict) and compare with eager PyTorch;
    with ``reuse`` (what this returned for a sample of the same ``reuse_key``), call that compiled
    function instead: it must run the graphs compiled then and compile nothing. ``library_ops``:
    ATen ops (name prefixes) that may be kept as library calls."""
    call = coverage.as_call(op, sample)
    device_type = call.tensors[0].device.type if call.tensors else "cpu"
    dtype = next((t.dtype for t in call.tensors if t.is_floating_point()), torch.float32)
    tolerance = Tolerance(*tolerances(op, dtype, device_type))
    reference = Reference(op, sample)

    eager_inputs = [copy_tensor(t) for t in call.tensors]
    compiled_inputs = [copy_tensor(t) for t in call.tensors]
    torch.manual_seed(0)
    want = call.fn(*eager_inputs)
    values = _deterministic(op, call, want)

    graphs, fallbacks, hits = _graphs(), _fallbacks(), _cache_hits()
    if reuse is None:
        compiled = Compiled(torch.compile(_fresh(call.fn), backend="fusionstitching", fullgraph=True,
                                          dynamic=False, options={"strict": True, **(options or {})}))
    else:
        compiled = reuse
    with _strict_dynamo(), warnings.catch_warnings():
        warnings.simplefilter("error", FallbackWarning)
        warnings.simplefilter("error", LibraryFallbackWarning)
        for name in library_ops:
            warnings.filterwarnings("ignore", message=re.escape(name), category=LibraryFallbackWarning)
        got = compiled.fn(*compiled_inputs)
    _expect_compiled("forward", graphs, fallbacks, hits, fresh=reuse is None)

    _compare(_leaves(got), _leaves(want), "output", tolerance, values, reference.outputs)
    _compare(compiled_inputs, eager_inputs, "input after the call", tolerance, values, reference.inputs)

    got_outputs = _differentiable(sample.output_process_fn_grad(got))
    want_outputs = _differentiable(sample.output_process_fn_grad(want))
    got_inputs = [t for t in compiled_inputs if t.requires_grad]
    want_inputs = [t for t in eager_inputs if t.requires_grad]
    if not (got_inputs and want_outputs):
        if got_outputs:
            raise AssertionError(f"{len(got_outputs)} compiled outputs require grad, eager's do not")
        return compiled
    if len(got_outputs) != len(want_outputs):
        raise AssertionError(f"{len(got_outputs)} differentiable outputs, eager gives {len(want_outputs)}")
    generator = torch.Generator(device=device_type).manual_seed(1)
    cotangents = [torch.randn(o.shape, dtype=o.dtype, device=o.device, generator=generator) for o in want_outputs]
    want_grads = torch.autograd.grad(want_outputs, want_inputs, cotangents, allow_unused=True,
                                     materialize_grads=True)
    # AOTAutograd regenerates outputs that alias inputs (views of them, or the inputs themselves)
    # outside its graph: their gradients are the views' own backward, and no backward graph is
    # compiled for them.
    backward = _through_compiled_graph(got_outputs)
    storages = {t.untyped_storage().data_ptr() for t in compiled_inputs}
    if not backward and any(o.untyped_storage().data_ptr() not in storages for o in got_outputs):
        raise NotCompiled("differentiable outputs that alias no input have no compiled backward")
    graphs, hits = _graphs(), _cache_hits()
    with _strict_dynamo(), warnings.catch_warnings():
        warnings.simplefilter("error", FallbackWarning)
        warnings.simplefilter("error", LibraryFallbackWarning)
        for name in library_ops:
            warnings.filterwarnings("ignore", message=re.escape(name), category=LibraryFallbackWarning)
        got_grads = torch.autograd.grad(got_outputs, got_inputs, cotangents, allow_unused=True,
                                        materialize_grads=True)
    if backward:
        _expect_compiled("backward", graphs, fallbacks, hits, fresh=not compiled.backward)
        compiled.backward = True
    _compare(list(got_grads), list(want_grads), "gradient of input", tolerance, values,
             lambda: reference.run(cotangents)[2] or None)
    return compiled


def _expect_compiled(what: str, graphs: int, fallbacks: int, hits: int, fresh: bool) -> None:
    """One new graph compiled by this backend (``fresh``), or none and a cached one run."""
    new_graphs, new_fallbacks, new_hits = _graphs() - graphs, _fallbacks() - fallbacks, _cache_hits() - hits
    if new_fallbacks:
        raise NotCompiled(f"{new_fallbacks} fallbacks to PyTorch in the {what}")
    if fresh and new_graphs != 1:
        raise NotCompiled(f"{new_graphs} graphs compiled by fusionstitching for the {what} (expected 1)")
    if not fresh and (new_graphs or not new_hits):
        raise NotCompiled(f"the {what} of a cached compilation: {new_graphs} new graphs, {new_hits} cache hits "
                          "(expected 0 and at least 1)")


def _fresh(fn: Any) -> Any:
    """A copy of ``fn`` with its own code object: TorchDynamo's per-code cache belongs to this sample."""
    code = fn.__code__.replace(co_name=f"{fn.__code__.co_name}_{id(fn):x}")
    return types.FunctionType(code, fn.__globals__, code.co_name, fn.__defaults__, fn.__closure__)
