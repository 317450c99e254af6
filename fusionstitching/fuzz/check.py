"""One fuzz program checked: compiled against eager, and every kernel of its plans against the reference.

``check(program, config, device)`` runs

1. eager PyTorch on the program's inputs (and, for a backward, ``torch.autograd.grad`` of the float
   outputs with seeded random tangents);
2. ``torch.compile(fn, backend="fusionstitching", dynamic=False, options={"strict": True, "solver":
   ..., "generators": ...})`` on the same inputs, after ``torch._dynamo.reset()``, compared with (1);
3. the plan check (``plans``): ``fusionstitching.capture`` of the program and ``pipeline.compile_graph``
   of its forward and backward graphs with the same options (``"compile"``: where the coverage of
   composition schemes is read), and with ``"simulate"`` every kernel simulated
   (``GeneratedKernel.simulate``) on the reference values of its inputs and compared with the
   reference values of its outputs (``graph/reference.py``). On the CPU (2) runs every kernel in the
   simulator already, so ``"auto"`` only compiles there and simulates on a GPU, where this is the
   simulator's check; ``"simulate"`` on the CPU adds the reference as a second oracle and names the
   failing kernel. The simulator can take a minute for a kernel whose threads mostly idle.

Tolerances. Integers and bools must be equal. Floats: the largest difference relative to the
largest magnitude of the expected tensor (at least ``SCALE_FLOOR``) must stay under ``TOLERANCE``
of the dtype. Compiled half-type kernels compute in f32 between stores where eager rounds every
op, so a difference above the tolerance is judged by a float64 run of the same program (``DT =
torch.float64``): the compiled result passes when its distance from float64 is at most the
tolerance plus ``ARBITER_FACTOR`` times eager's (after the accuracy check of TorchDynamo's minifier,
``same(..., fp64_ref=...)``; a decomposed backward rounds half types more often than eager's fused
kernels do, and an ill-conditioned result, a layer norm of two elements, is noise in both). One
sample of eager's error can be lucky (the CPU's var accumulates in f64, a cancelling sum may round
closer by chance), so a result also passes within the tolerance plus ``ARBITER_FACTOR`` times the
rounding noise: the largest distance from float64 of ``NOISE_RUNS`` float64 runs with the dtype's
rounding errors added to every op's result (``_Rounding``). The noise is small where the result is
well conditioned, so a wrong value still fails there. The
plan check has no float64 twin: its scale is at least the largest magnitude among the kernel's
inputs; beyond the tolerance, a result passes within ``ARBITER_FACTOR`` times the spread of the
reference's own results on inputs moved by a few units in the last place (a result that cancels is
judged by its rounding noise); and a kernel with half-type values (its f32 results too) is held to
the half types' tolerance and passes when at most ``HALF_OUTLIERS`` of its elements differ by more
than that (a routing decision of a gradient, ``x > 0`` on a value the kernel holds in f32 and the
reference rounds, may flip there).
"""

from __future__ import annotations

import contextlib
import functools
import math
import re
import signal
import threading
import time
import traceback
import warnings
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.utils._python_dispatch
import torch.utils._pytree

from fusionstitching.fuzz.programs import Built, Program, build, used_symbols

TOLERANCE = {"float32": 1e-4, "bfloat16": 2e-2, "float16": 2e-2, "float64": 1e-9}
SCALE_FLOOR = 0.1  # inputs are O(1): a result smaller than this is a cancellation, judged in absolute terms
HALF_OUTLIERS = 0.01
ARBITER_FACTOR = 3.0
# The rounding-noise arbiter: runs of the float64 program with rounding errors of the program's dtype
# added to every result (``_Rounding``); the largest distance of those runs from float64 is the noise
# an implementation in that dtype may show. Salts 2j and 2j + 1 are one draw of those errors and
# its mirror image.
NOISE_RUNS = 3
EPSILON = {"float32": 2.0 ** -24, "bfloat16": 2.0 ** -9, "float16": 2.0 ** -12, "float64": 2.0 ** -53}
ACCUMULATION_EPSILON = 2.0 ** -24


@dataclass(frozen=True)
class Config:
    """The compiler options a program runs with: a selector and a set of candidate generators."""

    solver: str
    generators: tuple[str, ...]
    label: str  # the generator set's name in reports
    mode: str | None = None  # torch.compile's mode: "reduce-overhead" replays CUDA graphs on a GPU
    # TorchDynamo's symbolic shapes from the first call (``dynamic=True``): the backend compiles
    # the call's concrete shapes from a symbolic graph, its sizes among the inputs
    dynamic: bool = False
    # ``Options(async_compile=True)``: the first call runs in PyTorch while the graphs compile in
    # the background; the check waits for them, then calls the compiled program
    async_compile: bool = False

    def options(self) -> dict[str, Any]:
        options = {"strict": True, "solver": self.solver, "generators": self.generators}
        if self.async_compile:
            options["async_compile"] = True
        return options

    def __str__(self) -> str:
        return f"{self.solver}, {self.label}" + (f", {self.mode}" if self.mode else "") \
            + (", dynamic" if self.dynamic else "") + (", async" if self.async_compile else "")


@dataclass
class KernelInfo:
    """What the coverage report counts of one generated kernel."""

    ops: int
    schemes: frozenset[str]
    ir_ops: frozenset[str]


@dataclass
class Outcome:
    """The verdict on one program: ``ok``, ``mismatch``, ``error`` or ``timeout`` (not a failure: the
    simulator can take minutes for a large grid of mostly idle threads); ``kind`` groups failures (the
    shrinker keeps a candidate only when it fails with the same kind)."""

    status: str = "ok"
    where: str = ""
    message: str = ""
    kind: str = ""
    location: str = ""
    diagnosis: str = ""  # after a failure against eager: what the plan check says of the kernels
    planned: bool = False  # the plan check built the plans (``kernels`` counts their kernels)
    kernels: list[KernelInfo] = field(default_factory=list)
    library_calls: int = 0
    fallbacks: int = 0
    seconds: float = 0.0

    @property
    def failed(self) -> bool:
        return self.status in ("mismatch", "error")

    def line(self) -> str:
        where = f"{self.where}: " if self.where else ""
        at = f" (at {self.location})" if self.location else ""
        return f"{self.status}: {where}{self.message}{at}"

    def report(self) -> str:
        """``line()`` and, when there is one, the plan check's diagnosis."""
        return self.line() + (f"\n    plan check: {self.diagnosis}" if self.diagnosis else "")


class _Failure(Exception):
    """A mismatch or error found on the way; carries the outcome."""

    def __init__(self, outcome: Outcome) -> None:
        super().__init__(outcome.line())
        self.outcome = outcome


class _Timeout(BaseException):
    """The program ran past its time limit (a BaseException, so that no ``except Exception`` of the
    compiler or of torch takes it for the compiler's own error)."""


PLAN_CHECKS = ("auto", "off", "compile", "simulate")


def check(program: Program, config: Config, device: str = "cpu", plans: str = "auto",
          timeout_s: float | None = None, diagnose: bool = True) -> Outcome:
    """Run ``program`` eagerly and compiled (and check its plans); the verdict with what was counted.
    With ``timeout_s`` (main thread only), a program still running after that many seconds is
    stopped and reported with status ``timeout``. With ``diagnose``, a failure against eager is
    followed by the plan check with every kernel simulated, to name the kernel at fault."""
    from fusionstitching.backend import stats

    if plans not in PLAN_CHECKS:
        raise ValueError(f"check: plans={plans!r}; known: {', '.join(PLAN_CHECKS)}")
    if plans == "auto":
        plans = "simulate" if device == "cuda" else "compile"
    start = time.perf_counter()
    before = stats()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            with _time_limit(timeout_s):
                outcome = _checked(program, config, device, plans, diagnose)
        except _Timeout:
            outcome = Outcome("timeout", message=f"still running after {timeout_s:g} s")
        finally:
            torch._dynamo.reset()
    after = stats()
    outcome.fallbacks = after.get("fallbacks", 0) - before.get("fallbacks", 0)
    outcome.seconds = time.perf_counter() - start
    return outcome


def _checked(program: Program, config: Config, device: str, plans: str, diagnose: bool) -> Outcome:
    outcome = Outcome()
    try:
        built = build(program)
        try:
            _against_eager(program, built, config, device)
        except _Failure as failure:
            if diagnose and plans != "off" and not program.expect_error:
                failure.outcome.diagnosis = _diagnose(program, built, config, device)
            raise
        if plans != "off" and not program.expect_error:
            _plans(program, built, config, device, outcome, simulate=plans == "simulate")
            outcome.planned = True
    except _Failure as failure:
        found = failure.outcome
        found.kernels, found.library_calls = outcome.kernels, outcome.library_calls
        return found
    return outcome


@contextlib.contextmanager
def _time_limit(seconds: float | None) -> Iterator[None]:
    if not seconds or threading.current_thread() is not threading.main_thread():
        yield
        return

    def expire(signum: int, frame: Any) -> None:
        raise _Timeout()

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds, 1.0)  # again each second: a signal raised in a weakref callback is dropped
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


# -- eager vs compiled --------------------------------------------------------------------------

@dataclass
class _Run:
    outputs: list[torch.Tensor]
    grads: list[torch.Tensor | None]
    inputs: list[torch.Tensor]  # after the call


def _against_eager(program: Program, built: Built, config: Config, device: str) -> None:
    inputs = functools.partial(built.make_inputs, device)  # fresh tensors, in their layouts, per run
    try:
        eager = _run(built.fn, inputs, program)
    except Exception as err:
        if program.expect_error:
            _compiled_must_raise(built, inputs, program, config)
            return
        raise _Failure(_error("eager", err, "the program is invalid (a fuzzer bug)")) from err
    if program.expect_error:
        raise _Failure(Outcome("error", "eager", "an out-of-range index that eager accepts (a fuzzer bug)",
                               "fuzzer"))
    torch._dynamo.reset()
    compiled_fn = compile_with(built.fn, config)
    # CUDA graphs are replayed from the third call on
    calls = program.calls if config.mode is None else max(program.calls, 3)
    if config.async_compile:  # a first call in PyTorch, then the compiled program's calls
        calls += 1
    for call in range(calls):
        if config.async_compile and call == 1:
            from fusionstitching.backend import wait_for_compiles

            wait_for_compiles(300)
        try:
            compiled = _run(compiled_fn, inputs, program)
        except Exception as err:
            raise _Failure(_error("torch.compile" + (f", call {call + 1}" if call else ""), err)) from err
        # outputs of a CUDA-graph replay are overwritten by the next call: compared before it
        _compare_runs(program, built, inputs, compiled, eager, f"call {call + 1}: " if call else "")
    if config.dynamic and config.mode is None:
        _at_other_sizes(program, built, config, device, compiled_fn)


def _at_other_sizes(program: Program, built: Built, config: Config, device: str,
                    compiled_fn: Callable[..., Any]) -> None:
    """The program compiled with symbolic shapes, called again at other sizes (``other_sizes``):
    every size moved within its shape class (``backend.size_class``: the specialization keeps the
    templates of the first one of the class, refitted) and one size moved out of it (a new class,
    whose kernels may run the first specialization's code with the sizes as arguments). A program
    that spells sizes out in its code is another function at other sizes, and one that eager
    rejects there is not run. Under ``Options.async_compile`` a new size's first call runs in
    PyTorch while it compiles; the compiles are waited for and the size called again, and none is
    left running when the check goes on (a capture beside a background compile trips functorch's
    interpreter stack)."""
    from fusionstitching.backend import wait_for_compiles

    head = built.text.split("def make_inputs")[0]
    for k, sizes in enumerate(other_sizes(program)):
        other = program.with_sizes(sizes)
        if not other.valid_sizes(sizes):
            continue
        rebuilt = build(other, suffix=f"_sizes{k}")
        if rebuilt.text.split("def make_inputs")[0] != head:
            continue
        inputs = functools.partial(rebuilt.make_inputs, device)
        eager = _eager_or_none(rebuilt.fn, inputs, other)
        if eager is None:  # not a program at these sizes
            continue
        label = "sizes " + ", ".join(f"{name}={value}" for name, value in sorted(sizes.items())
                                     if value != program.size_map[name]) + ": "
        for call in range(2 if config.async_compile else 1):
            wait_for_compiles(300)
            try:
                compiled = _run(compiled_fn, inputs, other)
            except Exception as err:
                raise _Failure(_error(f"torch.compile at {label[:-2]}", err)) from err
            _compare_runs(other, rebuilt, inputs, compiled, eager, label + (f"call {call + 1}: " if call else ""))
    wait_for_compiles(300)


def _eager_or_none(fn: Callable[..., Any], inputs: Callable[[], list[torch.Tensor]], program: Program) -> _Run | None:
    try:
        return _run(fn, inputs, program)
    except Exception:  # noqa: BLE001 -- any error: eager rejects the program at these sizes
        return None


def other_sizes(program: Program) -> list[dict[str, int]]:
    """Sizes to call a program compiled with symbolic shapes at again: each size of 3 or more that
    the program uses moved to the nearest other size of its shape class (where there is one), and
    the first such size moved to twice itself plus one, outside its class."""
    from fusionstitching.backend import size_class

    sizes = program.size_map
    used = sorted(s for s in used_symbols(program) if sizes[s] >= 3)
    within = {}
    for name in used:
        value = sizes[name]
        top = size_class(value)[0]
        near = sorted(range(top // 2 + 1, top + 1), key=lambda w: (abs(w - value), w))
        same = next((w for w in near if w != value and size_class(w) == size_class(value)), None)
        if same is not None:
            within[name] = same
    result = [{**sizes, **within}] if within else []
    if used:
        result.append({**sizes, used[0]: 2 * sizes[used[0]] + 1})
    return result


def _compare_runs(program: Program, built: Built, inputs: Callable[[], list[torch.Tensor]], compiled: _Run,
                  eager: _Run, label: str) -> None:
    reference: list[_Run] = []

    def float64() -> _Run:
        if not reference:
            wide = [x.double() if x.is_floating_point() else x for x in inputs()]
            reference.append(_run(built.fn64, lambda: wide, program, tangent_dtype=_torch_dtype(program.dtype)))
        return reference[0]

    noisy: list[_Run] = []

    def perturbed() -> list[_Run]:
        if not noisy:
            tangent_dtype = _torch_dtype(program.dtype)
            for salt in range(NOISE_RUNS):
                wide = [x.double() if x.is_floating_point() else x for x in inputs()]  # fresh: a run may update them
                with _Rounding(EPSILON[program.dtype], salt):
                    noisy.append(_run(built.fn64, lambda wide=wide: wide, program, tangent_dtype=tangent_dtype))
        return noisy

    if len(compiled.outputs) != len(eager.outputs):
        raise _Failure(Outcome("mismatch", "outputs", f"{len(compiled.outputs)} outputs, eager has "
                               f"{len(eager.outputs)}", "mismatch"))
    for k, (got, want) in enumerate(zip(compiled.outputs, eager.outputs)):
        _compare(f"{label}output {k}", got, want, program.dtype, lambda k=k: float64().outputs[k],
                 lambda k=k: [r.outputs[k] for r in perturbed()])
    for k, (item, got, want) in enumerate(zip(program.inputs, compiled.inputs, eager.inputs)):
        _compare(f"{label}input {item.name} after the call", got, want, program.dtype,
                 lambda k=k: float64().inputs[k], lambda k=k: [r.inputs[k] for r in perturbed()])
    if len(compiled.grads) != len(eager.grads):
        raise _Failure(Outcome("mismatch", "gradients", f"{len(compiled.grads)} gradients, eager has "
                               f"{len(eager.grads)}", "mismatch"))
    names = [i.name for i in program.inputs if i.dtype == "float" and i.index_bound is None]
    for name, k, got, want in zip(names, range(len(names)), compiled.grads, eager.grads):
        if got is None and want is None:
            continue
        got = torch.zeros_like(want) if got is None else got
        want = torch.zeros_like(got) if want is None else want
        _compare(f"{label}gradient of {name}", got, want, program.dtype,
                 lambda k=k, want=want: _or_zeros(float64().grads[k], want),
                 lambda k=k, want=want: [_or_zeros(r.grads[k], want) for r in perturbed()])


def compile_with(fn: Callable[..., Any], config: Config) -> Callable[..., Any]:
    """``torch.compile(fn, backend="fusionstitching", dynamic=config.dynamic, options=...)``; with a
    mode, ``fusionstitching.compile`` (``torch.compile`` takes a mode or options, not both)."""
    if config.mode is None:
        return torch.compile(fn, backend="fusionstitching", dynamic=config.dynamic, options=config.options())
    from fusionstitching.backend import compile as compile_fused
    from fusionstitching.options import Options

    return compile_fused(fn, Options(**config.options()), mode=config.mode, dynamic=config.dynamic)


def _compiled_must_raise(built: Built, inputs: Callable[[], list[torch.Tensor]], program: Program,
                         config: Config) -> None:
    torch._dynamo.reset()
    compiled_fn = compile_with(built.fn, config)
    try:
        outputs = _run(compiled_fn, inputs, program).outputs
        if outputs and outputs[0].is_cuda:
            torch.cuda.synchronize()
    except Exception:  # noqa: BLE001 -- any error is a rejection (an IndexError in eager, a trap on a GPU)
        return
    raise _Failure(Outcome("mismatch", "out-of-range index", "eager raises, the compiled program returns values",
                           "mismatch"))


def _run(fn: Callable[..., Any], inputs: Callable[[], list[torch.Tensor]], program: Program,
         tangent_dtype: torch.dtype | None = None) -> _Run:
    """Outputs of ``fn`` on fresh ``inputs()``, the inputs after the call (in-place ops) and, for a
    backward, the gradients of the float inputs (``None`` where an input gets none) for tangents drawn
    from the program's data seed."""
    grad_inputs = [i.dtype == "float" and i.index_bound is None and program.backward for i in program.inputs]
    args = [x.detach().requires_grad_(g) for x, g in zip(inputs(), grad_inputs)]
    outputs = list(fn(*args))
    grads: list[torch.Tensor | None] = []
    if program.backward:
        differentiable = [o for o in outputs if o.requires_grad]
        wrt = [a for a, g in zip(args, grad_inputs) if g]
        grads = [None] * len(wrt)
        if differentiable:
            tangents = _tangents(differentiable, program.data_seed, tangent_dtype)
            grads = list(torch.autograd.grad(differentiable, wrt, tangents, allow_unused=True))
    return _Run([o.detach() for o in outputs], [None if g is None else g.detach() for g in grads],
                [a.detach() for a in args])


def _tangents(outputs: Sequence[torch.Tensor], seed: int, dtype: torch.dtype | None) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed + 1)
    return [torch.randn(tuple(o.shape), generator=generator).to(dtype or o.dtype).to(o.dtype).to(o.device)
            for o in outputs]


def _or_zeros(value: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor:
    return torch.zeros_like(like, dtype=torch.float64) if value is None else value


def _torch_dtype(name: str) -> torch.dtype:
    return getattr(torch, name)


def _compare(what: str, got: torch.Tensor, want: torch.Tensor, dtype: str,
             float64: Callable[[], torch.Tensor],
             perturbed: Callable[[], list[torch.Tensor]] | None = None) -> None:
    if tuple(got.shape) != tuple(want.shape) or got.dtype != want.dtype:
        raise _Failure(Outcome("mismatch", what, f"{got.dtype}{list(got.shape)}, eager has "
                               f"{want.dtype}{list(want.shape)}", "mismatch"))
    got_np, want_np = _numpy(got), _numpy(want)
    if not want.is_floating_point():
        wrong = int(np.sum(got_np != want_np))
        if wrong:
            raise _Failure(Outcome("mismatch", what, f"{wrong} of {want_np.size} elements differ from eager "
                                   f"({want.dtype})", "mismatch"))
        return
    tolerance = TOLERANCE[dtype]
    error = relative_error(got_np, want_np)
    if error <= tolerance:
        return
    truth = _numpy(float64())
    compiled_error, eager_error = relative_error(got_np, truth), relative_error(want_np, truth)
    if compiled_error <= tolerance + ARBITER_FACTOR * eager_error:
        return
    noise = 0.0
    if perturbed is not None:
        noise = max((relative_error(_numpy(r), truth) for r in perturbed()), default=0.0)
        if compiled_error <= tolerance + ARBITER_FACTOR * noise:
            return
    raise _Failure(Outcome("mismatch", what, f"error {error:.3g} against eager > {tolerance:g} ({dtype}); "
                           f"against float64 {compiled_error:.3g}, eager's {eager_error:.3g}, "
                           f"rounding noise {noise:.3g}", "mismatch"))


class _Rounding(torch.utils._python_dispatch.TorchDispatchMode):
    """Rounding errors of the dtype, added to the float results of a float64 run. An elementwise
    op's result moves by up to ``epsilon × |result|`` (a sum or difference: ``epsilon × max(|result|,
    mean |operand|)``, as uncertain as its terms when they cancel); a reduction's by up to
    ``epsilon_f32 × sqrt(k) × max(|result|, term) + epsilon × |result|``, ``k`` the operand elements
    combined into one result element (accumulated in f32, the result rounded to the dtype), ``term``
    a typical term's size: ``sqrt(k) × mean |operand|`` for a sum or a product of matrices (and the
    gradients of ops), that over k for a mean or a variance, the mean |result| for a layer, group or
    batch norm (``x - mean`` cancels where x is near its mean: a normalized value near zero is as
    uncertain as a typical normalized value), none for a softmax. Ops that only move data do not
    round. The direction is a hash of the value (and ``salt``), so equal values computed alike move
    alike, as equal rounding errors add up in a sum of repeated terms; an odd salt moves every value
    against the even salt below it, so that a result at a discontinuity (the sign of a cancelled
    difference) is moved across it by one of the pair."""

    def __init__(self, epsilon: float, salt: int) -> None:
        super().__init__()
        self.epsilon, self.salt = epsilon, salt

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        result = func(*args, **kwargs)
        name = func.overloadpacket.__name__
        summing = name in _SUMMING or name.endswith(("_backward", "_backward_data"))
        reduces = summing or name in _AVERAGING or name in _NORMALIZING
        if not (reduces or torch.Tag.pointwise in func.tags) or func.is_view or name in _EXACT:
            return result
        operands = [a for a in torch.utils._pytree.tree_leaves((args, kwargs))
                    if isinstance(a, torch.Tensor) and a.is_floating_point() and a.numel() > 0]
        results = [r for r in torch.utils._pytree.tree_leaves(result)
                   if isinstance(r, torch.Tensor) and r.dtype == torch.float64 and r.numel() > 0]
        if not operands or not results:
            return result
        widest = max(operands, key=lambda a: a.numel())
        k = 1.0
        if reduces:
            k = max(1.0, widest.numel() / min(r.numel() for r in results))
            dim = kwargs.get("dim", args[1] if len(args) > 1 else None)
            if k == 1.0 and isinstance(dim, int) and -widest.dim() <= dim < widest.dim():
                k = float(widest.shape[dim])
        magnitude = 0.0  # the size of a typical term: a result that cancels is as uncertain as its terms
        if summing:
            magnitude = float(widest.detach().abs().mean()) * math.sqrt(k)
        elif name in _AVERAGING:
            magnitude = float(widest.detach().abs().mean()) / math.sqrt(k)
        elif name in ("add", "sub", "rsub"):
            magnitude = float(widest.detach().abs().mean())
        elif name in _CENTERING:
            magnitude = float(results[0].detach().abs().mean())
        # a reduction accumulates in f32 whatever the dtype, then rounds its result to the dtype
        step = min(self.epsilon, ACCUMULATION_EPSILON) * math.sqrt(k) if reduces else self.epsilon
        store = self.epsilon if reduces else 0.0

        def moved(r: Any) -> Any:
            if not isinstance(r, torch.Tensor) or r.dtype != torch.float64 or r.numel() == 0:
                return r
            with torch.no_grad():
                draw = self.salt // 2 + 1
                direction = torch.frac(torch.sin(r * 12.9898 + 78.233 * draw) * 43758.5453) * 2 - 1
                if self.salt % 2:
                    direction = -direction
                shift = (step * torch.clamp(r.abs(), min=magnitude) + store * r.abs()) * direction
                return r + torch.nan_to_num(shift, nan=0.0, posinf=0.0, neginf=0.0)

        return torch.utils._pytree.tree_map(moved, result)


# Elementwise ops whose result is exact (no rounding: a sign, a floor, a choice between operands).
_EXACT = frozenset({
    "sign", "sgn", "floor", "ceil", "round", "trunc", "frac", "neg", "abs", "relu", "where", "maximum",
    "minimum", "fmax", "fmin", "clamp", "clamp_min", "clamp_max", "copy", "clone", "_to_copy", "fill",
    "masked_fill", "fmod", "remainder", "heaviside", "nan_to_num", "isnan", "isinf", "signbit",
})
# Ops whose result element combines many operand elements: sums (the ``_backward`` ops too), means
# (a sum over k), and normalizations (a row divided by its sum or its deviation).
_SUMMING = frozenset({
    "sum", "prod", "cumsum", "cumprod", "mm", "bmm", "addmm", "baddbmm", "dot", "mv", "matmul",
    "embedding_dense_backward", "index_add", "index_put", "scatter_add", "scatter_reduce",
})
_AVERAGING = frozenset({"mean", "var", "std", "var_mean", "std_mean", "norm", "linalg_vector_norm", "logsumexp",
                        "logcumsumexp"})
_CENTERING = frozenset({"native_layer_norm", "native_group_norm", "native_batch_norm",
                        "_native_batch_norm_legit", "_native_batch_norm_legit_no_training"})
_NORMALIZING = frozenset({"_softmax", "_log_softmax"}) | _CENTERING


def _numpy(t: torch.Tensor) -> np.ndarray:
    t = t.detach().cpu()
    if t.dtype in (torch.bfloat16, torch.float16):
        t = t.float()
    return t.numpy()


def relative_error(got: np.ndarray, want: np.ndarray) -> float:
    """The largest difference relative to the largest finite magnitude of ``want`` (at least
    ``SCALE_FLOOR``); equal values, NaN against NaN and equal infinities are no difference."""
    diff = _differences(got, want)
    return float(diff.max(initial=0.0) / _scale(want))


def _differences(got: np.ndarray, want: np.ndarray) -> np.ndarray:
    got64, want64 = np.asarray(got, np.float64), np.asarray(want, np.float64)
    same = (got64 == want64) | (np.isnan(got64) & np.isnan(want64))
    with np.errstate(invalid="ignore"):
        diff = np.abs(got64 - want64)
    return np.where(same, 0.0, np.where(np.isnan(diff), np.inf, diff))


def _scale(want: np.ndarray) -> float:
    want64 = np.asarray(want, np.float64)
    finite = np.abs(want64[np.isfinite(want64)])
    return max(float(finite.max(initial=0.0)), SCALE_FLOOR)


# -- plans: every kernel against the reference ------------------------------------------------------

def _plans(program: Program, built: Built, config: Config, device: str, outcome: Outcome,
           simulate: bool) -> None:
    from fusionstitching.bench.check import forward_arrays
    from fusionstitching.frontend.torch_fx import capture
    from fusionstitching.options import Options
    from fusionstitching.pipeline import compile_graph

    options = Options(**config.options())
    args = [x.detach().requires_grad_(program.backward and i.dtype == "float" and i.index_bound is None)
            for x, i in zip(built.make_inputs(device), program.inputs)]
    try:
        captured = capture(built.fn, *args, train=program.backward, name=f"fuzz_{program.ident.replace(':', '_')}")
    except Exception as err:
        raise _Failure(_error("capture", err)) from err
    forward = forward_arrays(captured, built.fn, args)
    compiled_forward = None
    for label, graph in (("forward", captured.forward), ("backward", captured.backward)):
        if graph is None:
            continue
        try:
            compiled = compile_graph(graph, options)
        except Exception as err:
            raise _Failure(_error(f"compile_graph ({label})", err)) from err
        outcome.library_calls += compiled.plan.library_count
        outcome.kernels += [kernel_info(kernel) for kernel in compiled.kernels]
        if label == "forward":
            compiled_forward = compiled
        if not simulate:
            continue
        try:
            arrays = forward if label == "forward" else _backward_arrays(captured, compiled_forward, forward,
                                                                         program.data_seed)
            values = _all_values(compiled.graph, arrays)
        except Exception as err:
            raise _Failure(_error(f"reference of the planned {label} graph", err)) from err
        noisy: list[dict[Any, np.ndarray]] = []

        def perturbed(graph: Any = compiled.graph, arrays: Any = arrays, noisy: list = noisy) -> list[dict]:
            if not noisy:
                noisy.extend(_all_values(graph, _perturbed_inputs(arrays, salt)) for salt in range(NOISE_RUNS))
            return noisy

        for kernel in compiled.kernels:
            _check_kernel(label, kernel, values, perturbed)


def _backward_arrays(captured: Any, compiled_forward: Any, forward: Sequence[Any], seed: int) -> list[Any]:
    """The backward graph's inputs: the saved tensors of the compiled forward (simulated), and random
    tangents. The compiled forward's, not the reference's: a backward may test a value it recomputes
    for equality with a saved one (amax's gradient), and the kernels compute both alike where the
    reference may round differently (a reciprocal, a pow)."""
    first = captured.num_user_outputs
    saved = compiled_forward.run_numpy(forward)[first: first + captured.num_saved]
    rng = np.random.default_rng(seed)
    tangents = [rng.standard_normal(p.shape).astype(p.dtype.numpy) for p in captured.backward.parameters[len(saved):]]
    return list(saved) + tangents


def _diagnose(program: Program, built: Built, config: Config, device: str) -> str:
    """The plan check with every kernel simulated, run after a failure against eager to name the
    kernel at fault; an empty answer means every kernel matches the reference on reference inputs
    (the fault is then in capture, the graph's semantics or the runtime)."""
    try:
        _plans(program, built, config, device, Outcome(), simulate=True)
    except _Failure as failure:
        return failure.outcome.line()
    return "every kernel of the plans matches the reference on reference inputs"


def _perturbed_inputs(arrays: Sequence[Any], salt: int) -> list[Any]:
    """The float inputs moved by a few units in their last place (integers and bools as they are):
    the reference on them rounds otherwise, and the spread of its results is the rounding noise of a
    result that cancels (a sum of layer-normed values)."""
    rng = np.random.default_rng(salt)
    moved = []
    for a in arrays:
        a = np.asarray(a)
        if a.dtype.kind == "f" or a.dtype.name == "bfloat16":
            wide = a.astype(np.float64)
            step = float(np.finfo(np.float32).eps) * 4 if a.dtype.itemsize >= 4 else 2.0 ** -7
            a = (wide * (1 + step * rng.uniform(-1, 1, a.shape))).astype(a.dtype)
        moved.append(a)
    return moved


def _all_values(graph: Any, arrays: Sequence[Any]) -> dict[Any, np.ndarray]:
    """The reference value of every node of ``graph`` (what ``reference.evaluate`` computes on the way)."""
    from fusionstitching.graph import reference

    if len(arrays) != len(graph.parameters):
        raise ValueError(f"{graph.name} takes {len(graph.parameters)} inputs, got {len(arrays)}")
    values = {p: np.asarray(a) for p, a in zip(graph.parameters, arrays)}
    with np.errstate(all="ignore"):
        for node in graph.nodes:
            if node not in values:
                values[node] = reference.evaluate_node(node, [values[x] for x in node.operands])
    return values


def _check_kernel(label: str, kernel: Any, values: dict[Any, np.ndarray],
                  perturbed: Callable[[], list[dict[Any, np.ndarray]]] | None = None) -> None:
    pattern = kernel.lowered.pattern
    where = f"{label} kernel {kernel.name} [{kernel.template}]"
    try:
        with np.errstate(all="ignore"):
            results = kernel.simulate([np.array(values[n]) for n in pattern.inputs])
    except Exception as err:
        raise _Failure(_error(where, err)) from err
    # Rounding differences grow with the magnitudes a kernel computes from, not only with its results
    # (a sum that cancels to a small value): the scale is at least the largest input magnitude.
    floats = [values[n] for n in pattern.inputs if n.dtype.is_float]
    input_scale = max((_scale(a) for a in floats), default=SCALE_FLOOR)
    # the kernel keeps f32 where the reference rounds each half-type value: an f32 result computed
    # from half-type values differs by their rounding
    half = any(n.dtype.is_half for n in pattern.nodes)
    for node, got in zip(pattern.outputs, results):
        want = values[node]
        dtype = node.dtype
        if not dtype.is_float:
            wrong = int(np.sum(np.asarray(got) != np.asarray(want)))
            if wrong:
                raise _Failure(Outcome("mismatch", where, f"{node.name}: {wrong} of {np.size(want)} elements "
                                       f"differ from the reference ({dtype.value})", "mismatch"))
            continue
        tolerance = TOLERANCE["bfloat16" if half else {"f32": "float32", "f64": "float64"}[dtype.value]]
        scale = max(_scale(want), input_scale)
        diff = _differences(got, want) / scale
        beyond = int(np.sum(diff > tolerance))
        allowed = int(HALF_OUTLIERS * diff.size) if half else 0
        if beyond > allowed and perturbed is not None:  # within the reference's own rounding noise?
            noise = np.zeros(np.shape(want))
            for other in perturbed():
                noise = np.maximum(noise, _differences(other[node], want) / scale)
            beyond = int(np.sum(diff > tolerance + ARBITER_FACTOR * noise.max(initial=0.0)))
        if beyond > allowed:
            raise _Failure(Outcome("mismatch", where, f"{node.name}: error {float(diff.max()):.3g} > {tolerance:g} "
                                   f"against the reference at {beyond} of {diff.size} elements", "mismatch"))


def kernel_info(kernel: Any) -> KernelInfo:
    """Ops, composition schemes and tiling attributes of a generated kernel (for the coverage report).

    Schemes: ``thread`` (producers recomputed in the consumer's thread: a kernel of more than one op),
    ``warp`` (``__shfl`` in its CUDA C), ``block`` (``__syncthreads``), ``S sub-root`` (a root cached
    in shared memory), ``sub-root`` (a template root that is not a kernel output), ``packed``
    (several roots, no composition between them); ``tile:LEVEL`` for every tiling attribute of its
    template and ``multi-level tile`` for a dim split over several levels."""
    from fusionstitching.schedule.packing import needs_composition

    pattern = kernel.lowered.pattern
    schedules = kernel.template.schedules
    source = kernel.cuda_source
    outputs = {o.name: o for o in pattern.outputs}
    schemes = set()
    if len(pattern.nodes) > 1:
        schemes.add("thread")
    if "__shfl" in source:
        schemes.add("warp")
    if "__syncthreads" in source:
        schemes.add("block")
    if any(s.shared for s in schedules):
        schemes.add("S sub-root")
    if any(s.root not in outputs for s in schedules):
        schemes.add("sub-root")
    if len(schedules) > 1 and not needs_composition(schedules, outputs, {n.name: n for n in pattern.nodes}):
        schemes.add("packed")
    for schedule in schedules:
        for tiles in schedule.dims:
            schemes.update(f"tile:{t.level.value}" for t in tiles)
            if len(tiles) > 1:
                schemes.add("multi-level tile")
    return KernelInfo(len(pattern.nodes), frozenset(schemes), frozenset(n.op for n in pattern.nodes))


# -- errors ------------------------------------------------------------------------------------------

def _error(where: str, err: BaseException, message: str | None = None) -> Outcome:
    root = root_cause(err)
    text = message or f"{type(root).__name__}: {_first_line(root)}"
    location = _location(root)
    kind = f"{type(root).__name__} at {location.split(':')[0] if location else where}"
    return Outcome("error", where, text, kind, location)


def root_cause(err: BaseException) -> BaseException:
    """The exception under TorchDynamo's and AOTAutograd's wrappers."""
    seen = set()
    while id(err) not in seen:
        seen.add(id(err))
        inner = getattr(err, "inner_exception", None) or err.__cause__
        if inner is None:
            break
        err = inner
    return err


def _first_line(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    line = text[0] if text else ""
    return line if len(line) <= 300 else line[:300] + "..."


def _location(err: BaseException) -> str:
    """``module.function:line`` of the innermost frame of the compiler (not the fuzzer) in the traceback;
    for a RecursionError, of its most frequent frame (the recursion, not where the stack ran out)."""
    frames = []
    for frame in traceback.extract_tb(err.__traceback__):
        path = frame.filename.replace("\\", "/")
        if "/fusionstitching/" in path and "/fuzz/" not in path:
            module = re.sub(r"\.py$", "", path.split("/fusionstitching/")[-1]).replace("/", ".")
            frames.append(f"{module}.{frame.name}:{frame.lineno}")
    if not frames:
        return ""
    if isinstance(err, RecursionError):
        return Counter(frames).most_common(1)[0][0]
    return frames[-1]
