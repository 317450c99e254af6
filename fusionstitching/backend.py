"""The ``torch.compile`` backend: ``torch.compile(model, backend="fusionstitching")``.

TorchDynamo hands the backend an FX graph of torch ops; AOTAutograd (with the core-ATen and
composite decompositions of capture, the min-cut partitioner and in-graph input mutations, exactly
as ``torch_fx.capture`` does, entered through TorchDynamo's ``aot_autograd`` wrapper) turns it into ATen forward/backward or inference graphs; each of those
is converted to a ``Graph``, planned (``fusion.explore``) and run by a ``runtime.CompiledGraph``:
generated kernels on a GPU, the NumPy simulator of the same kernels on a CPU.

Shapes. A graph is compiled for the concrete shapes of its example inputs. When TorchDynamo sends
symbolic shapes (it does once a second input shape shows up), compilation waits for the call: the
ATen graph is re-traced with fake tensors of the call's shapes and compiled once per shape
signature (shapes, strides, dtypes), cached. A specialization after the first is planned with the
patterns of one of the graph's explored plans where they all hold at its shapes
(``fusion.explore.transfer``), else explored.

Random numbers. A graph that draws random numbers (dropout) gets two extra inputs, a seed and an
offset; each call draws a fresh seed from torch's default generator, so ``torch.manual_seed``
makes runs repeatable.

Numbers among the inputs (sizes TorchDynamo passes for symbolic shapes, Python scalars) are part of
the shape signature and become constants of that specialization.

``Options(async_compile=True)`` compiles a graph of static shapes in a background thread while its
calls run in PyTorch (``_Pair`` keeps a training step's forward and backward on one path). An
inference graph of symbolic shapes, or one with numbers among its inputs, compiles each new shape
signature in the background likewise (``_Runner._specialization``): the calls of a signature run in
PyTorch until its program is ready. So does a training graph of symbolic shapes, its forward and
backward each per signature: a forward's signature switches to its program once that program and
the backward's program for the signature its backward calls showed are both ready, and each backward
call takes the path of the forward call whose saved tensors it receives (``_Pair.paths``).

``mode="reduce-overhead"`` replays each compiled graph from a CUDA graph after its second call
(``runtime.program.GraphedProgram``); outputs are then overwritten by the next call, as with
Inductor's CUDA graphs.

Failure policy (DESIGN.md). A graph the compiler cannot handle — one the frontend cannot convert (an
input that is neither a tensor nor a number, an unsupported dtype), or an internal error anywhere in
planning, scheduling, lowering, compiling or the first run of a specialization — runs in PyTorch as
AOTAutograd gave it: counted in ``stats()["fallbacks"]`` and announced by a ``FallbackWarning`` that
names the graph, the stage, the node being handled with its ATen op, and the exception.
``Options(strict=True)`` raises ``CompileFailure`` with the same evidence instead. Errors that eager
raises too are the user's and always propagate: an index out of range met by a generated kernel
(``IndexError``), and an error of a library op that the graph raises in PyTorch as well (same type,
same message: torch's own index check in a scatter, say), which then propagates as PyTorch raises it.
A first run of a specialization that fails otherwise runs the graph in PyTorch to tell the two
apart. ``Options.max_specializations`` bounds the shape classes a graph is compiled for (``_admits``):
shapes of further classes run in PyTorch (one warning); a new shape of an admitted class compiles
(it keeps the class's templates and runs its kernels' code). Under ``mode="reduce-overhead"`` as many
specializations replay CUDA graphs, each of which holds a memory pool; later ones launch their
kernels. Library calls inside a plan (GEMMs, ops without a lowering) are counted in
``stats()["library calls"]``.

Threads. Compiling a specialization holds the runner's lock; shapes are propagated through the graph
with ``FakeTensorProp`` (an interpreter), not re-traced with ``make_fx``, whose process-wide tracing
flag made other threads' compiled calls fail meanwhile. ``CompiledGraph`` serializes its own calls.

``stats()`` reads process-wide counters: compiling is a process-wide activity that a user wants
to audit, the one place where this package keeps state across calls.
"""

from __future__ import annotations

import dataclasses
import operator
import sys
import threading
import time
import traceback
import warnings
import weakref
from collections import Counter, OrderedDict
from collections.abc import Callable
from typing import Any

import torch
from torch import fx

from fusionstitching._host import COMPILE_SECONDS, PHASES, add_seconds, timed
from fusionstitching.codegen.size_args import SizeFamilies
from fusionstitching.options import Options

_STATS: Counter[str] = Counter()
_STATS_LOCK = threading.Lock()  # counts come from calls and from the background compile thread
_FALLBACK_LOCK = threading.Lock()  # a graph falls back once, from a call or a background compile
_NUMBERED = [0]  # graphs named so far: graph names are "<kind>_<number>"
_NAME = "fusionstitching name"  # the key of a backward's name, reserved when its forward compiles, in its meta
# The backward graph the partitioner just made, for the forward compiler that AOTAutograd calls next
# (``_partition``): its exploration can start before the backward is compiled.
_PARTITIONED = threading.local()
_PAIR = "fusionstitching pair"  # the key of a backward's ``_Pair`` under async compilation, in its meta
# Background compiles (``Options.async_compile``): one thread, graphs compiled in the order met.
_COMPILER: list[Any] = []  # [the executor], made at the first background compile
_PENDING: list[Any] = []  # futures of the background compiles not finished, for ``wait_for_compiles``
_PENDING_LOCK = threading.Lock()
_PLANS_TRIED = 3  # explored plans of a graph's other specializations tried for a new one (``_Runner.likes``)
# the counts ``stats()`` always reports, 0 until something happens
_COUNTED = ("graphs", "compilations", "plans transferred", "kernels shared across shapes",
            "templates kept across shapes", "kernels", "library calls", "views", "fallbacks",
            "shape specializations",
            "cache hits", "eager while compiling")
# forward calls of a graph of symbolic shapes whose path its backward can still find (``_Pair.paths``):
# more than the forwards a step can run before their backwards, few enough that the forwards whose
# backward never comes (evaluation with gradients on) cost no memory to speak of
_PATHS_KEPT = 1024
_SWITCH_INTERVAL_S = 1e-4  # the interpreter's thread switch interval while a background compile runs


class FallbackWarning(UserWarning):
    """A graph (or part of one) runs in PyTorch instead of generated kernels."""


class CompileFailure(RuntimeError):
    """An internal error while compiling a graph, raised under ``Options(strict=True)``; the message
    names the graph, the stage, the node being handled with its ATen op, and the cause."""


def stats() -> dict[str, Any]:
    """Counts since the process started: compiled graphs, kernels, library calls, views, fallbacks,
    shape specializations and cache hits; ``"compilations"`` (graphs planned and compiled, one per
    specialization); ``"plans transferred"`` (specializations planned with the patterns of the
    graph's first specialization, checked at their shapes, not explored: ``explore.transfer``);
    ``"kernels shared across shapes"`` (kernels of a specialization that run the code of the graph's
    earlier ones, with the sizes as arguments: ``codegen/size_args.py``); ``"templates kept across
    shapes"`` (patterns of a specialization that took the template an earlier one of the same
    shape class ran, refitted, neither re-chosen nor measured: ``_shape_class``);
    ``"eager while compiling"`` (calls run in PyTorch while their graph compiled
    in the background, ``Options.async_compile``); ``"tuned"`` (patterns whose schedules were measured) and
    ``"perflib hits"`` (patterns whose schedule came from the performance library); ``"plan cache
    hits"`` (graphs whose plan was read from the plan cache, ``fusion/plan_cache.py``); ``"surveyed"``
    (patterns whose plan kernel a first call timed to spend its tuning budget); ``"padded
    GEMMs"`` (library GEMMs of unaligned sizes measured faster on zero-padded operands at run time);
    ``"GEMMs timed"`` and ``"GEMM times read"`` (unaligned library GEMM problems timed unaligned and
    padded before planning, or read from the performance library: ``runtime/gemm_timing.py``). Every key
    is there from the start (0 until it happens); every value is an int but ``"compile seconds"``: a dict from compile phase (``_host.PHASES``) to the seconds
    spent in it (``_host.timed``)."""
    from fusionstitching.fusion import plan_cache
    from fusionstitching.runtime.gemm_timing import COUNTS as GEMM_COUNTS
    from fusionstitching.runtime.program import PADDING_CHOICES
    from fusionstitching.runtime.tuner import COUNTS

    result: dict[str, Any] = {key: _STATS[key] for key in _COUNTED}
    result.update(_STATS)
    result["tuned"] = COUNTS["tuned"]
    result["perflib hits"] = COUNTS["perflib hits"]
    result["plan cache hits"] = plan_cache.COUNTS["hits"]
    result["surveyed"] = COUNTS["surveyed"]
    result["padded GEMMs"] = PADDING_CHOICES["padded"]
    result["GEMMs timed"] = GEMM_COUNTS["timed"]
    result["GEMM times read"] = GEMM_COUNTS["read"]
    result["compile seconds"] = {phase: float(COMPILE_SECONDS[phase]) for phase in PHASES}
    return result


def reset_stats() -> None:
    from fusionstitching.fusion import plan_cache
    from fusionstitching.runtime.gemm_timing import COUNTS as GEMM_COUNTS
    from fusionstitching.runtime.program import PADDING_CHOICES
    from fusionstitching.runtime.tuner import COUNTS

    _STATS.clear()
    _NUMBERED[0] = 0
    COUNTS.clear()
    plan_cache.COUNTS.update(hits=0, stored=0)
    COMPILE_SECONDS.clear()
    PADDING_CHOICES.update(measured=0, padded=0)
    GEMM_COUNTS.update(timed=0, read=0)


class _Pair:
    """A training forward and its backward under ``Options.async_compile``, so that a backward
    takes the path its forward took. The forward runs in PyTorch until both graphs have compiled
    (``backward_ready``), counting those calls (``eager_forwards``); then it switches. A backward
    runs in PyTorch until the forward has switched and for as many calls as forwards ran in
    PyTorch (a training step's backward follows its forward), then compiled. If either graph fails
    to compile, both stay in PyTorch. Graphs of symbolic shapes pair up per signature and per
    step (``paths``, ``_Runner._paired_call``)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.eager_forwards = 0
        self.switched = False  # the forward runs compiled from now on
        self.backward_ready = False  # the backward's compile finished (successful or not)
        self.backward_compiled = False  # ... and gave a program
        self.backward_calls = 0
        self.abandoned = False  # one of them does not compile: both run in PyTorch
        self.error: BaseException | None = None  # the backward's compile error, for ``strict``
        # Whether the two graphs compile per signature (``_Runner._paired_call``): the forward's or
        # the backward's inputs have symbolic shapes or numbers among them. Then: how many tensors
        # a forward saves, and the positions of those that are new (not one of its inputs, not
        # empty); each forward call's path, (compiled, forward signature, weak references to the
        # storages of its new saved tensors), under those tensors' addresses (the last
        # ``_PATHS_KEPT``). An entry whose storages died is stale: a saved-tensor hook that copies
        # them frees the forward's, and a later step's copies may take those addresses. The
        # forward signature of each layout of the saved tensors; the backward signature seen after
        # each forward signature; the two runners.
        self.paired = False
        self.saved_tensors: int | None = None
        self.fresh: tuple[int, ...] = ()
        self.paths: OrderedDict[tuple, tuple[bool, tuple, tuple]] = OrderedDict()
        self.signatures: dict[tuple, tuple] = {}
        self.backward_for: dict[tuple, tuple] = {}
        self.forward: _Runner | None = None
        self.backward: _Runner | None = None

    def __deepcopy__(self, memo: dict) -> _Pair:
        """One pair, shared: AOTAutograd hands the backward compiler a deep copy of the graph whose
        metadata holds it."""
        return self


def _background(job: Callable[[], Any]) -> Any:
    """Run ``job`` in the background compile thread; its future. A job not begun when the
    interpreter exits is skipped (the exit waits only for one running)."""
    from concurrent.futures import ThreadPoolExecutor

    def run() -> Any:
        if not threading.main_thread().is_alive():  # the interpreter is exiting
            return None
        # Each PyTorch op the caller's thread runs meanwhile releases the interpreter lock and
        # takes it back, waiting up to the switch interval while this thread holds it, once per
        # op. A short interval while compiling keeps those waits near an op's own host time.
        interval = sys.getswitchinterval()
        sys.setswitchinterval(min(interval, _SWITCH_INTERVAL_S))
        try:
            return job()
        finally:
            sys.setswitchinterval(interval)

    if not _COMPILER:
        _COMPILER.append(ThreadPoolExecutor(max_workers=1, thread_name_prefix="fusionstitching-async"))
    future = _COMPILER[0].submit(run)
    with _PENDING_LOCK:
        _PENDING.append(future)
    future.add_done_callback(_forget)  # a finished compile's program belongs to its runner only
    return future


def _forget(future: Any) -> None:
    with _PENDING_LOCK:
        if future in _PENDING:
            _PENDING.remove(future)


def wait_for_compiles(timeout: float | None = None) -> bool:
    """Wait until the background compiles (``Options(async_compile=True)``) submitted so far have
    finished; whether they all did within ``timeout`` seconds. Their graphs switch to the compiled
    programs at their next calls."""
    from concurrent.futures import wait

    with _PENDING_LOCK:
        pending = list(_PENDING)
    return not wait(pending, timeout=timeout).not_done


def _options(options: Options | dict | None) -> Options:
    if options is None:
        return Options()
    if isinstance(options, Options):
        return options
    return dataclasses.replace(Options(), **options)


def fusionstitching_backend(gm: fx.GraphModule, example_inputs: list[Any], mode: str | None = None,
                            options: Options | dict | None = None) -> Callable[..., Any]:
    """The TorchDynamo backend (registered as "fusionstitching").

    AOTAutograd is entered through TorchDynamo's ``aot_autograd`` wrapper, as Inductor's and
    ``aot_eager``'s are: the wrapper counts the invocation, which is how TorchDynamo's DDP optimizer
    knows that a piece of a graph split at gradient-bucket boundaries went through AOTAutograd, so
    that the piece's first call under fake tensors (shaping the next piece's inputs) returns fake
    outputs and each piece's backward finds its own metadata."""
    from torch._dynamo.backends.common import aot_autograd

    from fusionstitching.frontend.torch_fx import decompositions

    if mode not in (None, "default", "reduce-overhead"):
        raise ValueError(f"fusionstitching: unknown mode {mode!r}; known: None, 'reduce-overhead'")
    opts = _options(options)
    start, inside = time.perf_counter(), sum(COMPILE_SECONDS.values())
    _PARTITIONED.__dict__.pop("backward", None)  # one an earlier graph's failed compile left
    if opts.explore_ahead:
        from fusionstitching.fusion import background

        # started now, it has its imports done by the time AOTAutograd has traced: a backward is
        # explored there ahead (``_Runner._explore_ahead``), or a graph's unsplit plan alongside
        # its split one (``explore``)
        background.start()
    try:
        return aot_autograd(
            fw_compiler=_compiler("forward", opts, mode), bw_compiler=_compiler("backward", opts, mode),
            inference_compiler=_compiler("inference", opts, mode),
            partition_fn=_partition, decompositions=decompositions(),
            keep_inference_input_mutations=True,
        )(gm, example_inputs)
    finally:  # AOTAutograd's tracing: the call but for the phases timed inside it
        add_seconds("tracing", max(0.0, time.perf_counter() - start - (sum(COMPILE_SECONDS.values()) - inside)))


def compile(fn_or_module: Callable[..., Any], options: Options | None = None, mode: str | None = None,
            **kwargs: Any) -> Callable[..., Any]:
    """``torch.compile(fn_or_module, backend="fusionstitching", options=...)``, as one call; ``mode``
    ("reduce-overhead") may come with ``options``, which ``torch.compile`` itself refuses."""
    import functools

    backend = functools.partial(fusionstitching_backend, mode=mode, options=options)
    return torch.compile(fn_or_module, backend=backend, **kwargs)


def _partition(joint: fx.GraphModule, joint_inputs: Any, **kwargs: Any) -> tuple[fx.GraphModule, fx.GraphModule]:
    """``torch_fx.partition``, keeping the backward for the forward compiler called next."""
    from fusionstitching.frontend.torch_fx import partition

    forward, backward = partition(joint, joint_inputs, **kwargs)
    _PARTITIONED.backward = backward
    return forward, backward


def _count(key: str, n: int = 1) -> None:
    with _STATS_LOCK:
        _STATS[key] += n


def _named(kind: str) -> str:
    _NUMBERED[0] += 1
    return f"{kind}_{_NUMBERED[0]}"


def _compiler(kind: str, options: Options, mode: str | None
              ) -> Callable[[fx.GraphModule, list[Any]], Callable[..., Any]]:
    def compile_graph(gm: fx.GraphModule, example_inputs: list[Any]) -> Callable[..., Any]:
        _count("graphs")
        name = gm.meta.get(_NAME) if kind == "backward" else None
        name = name or _named(kind)
        backward = _PARTITIONED.__dict__.pop("backward", None) if kind == "forward" else None
        pair = gm.meta.get(_PAIR) if kind == "backward" else None
        if backward is not None and options.async_compile:
            pair = backward.meta[_PAIR] = _Pair()
            # one rule for both graphs: per signature if either one's inputs vary
            values = [node.meta.get("val") for node in backward.graph.find_nodes(op="placeholder")]
            pair.paired = not (_static_inputs(example_inputs) and _static_inputs(values))
        if backward is not None and options.explore_ahead:
            backward.meta[_NAME] = _named("backward")  # the name its conversion ahead used
        else:
            backward = None
        return _Runner(gm, example_inputs, name, options, mode, _saved_outputs() if kind == "forward" else slice(0, 0),
                       backward, pair, kind)

    return compile_graph


class _Runner:
    """One ATen graph: compiled per shape signature, called with AOTAutograd's boxed arguments."""

    def __init__(self, gm: fx.GraphModule, example_inputs: list[Any], name: str, options: Options,
                 mode: str | None = None, saved: slice = slice(0, 0), backward: fx.GraphModule | None = None,
                 pair: _Pair | None = None, kind: str = "inference") -> None:
        """``backward``: a training forward's backward graph, explored ahead once the layouts of
        the tensors saved for it are chosen (``_explore_ahead``). ``pair``: the forward and backward
        of a training graph under ``Options.async_compile``; ``kind``: "forward", "backward" or
        "inference"."""
        # Called with one list of arguments. An instance attribute, not a class one: TorchDynamo's
        # ``disable`` around a backward compiler's result copies the instance's ``__dict__`` only.
        self._boxed_call = True
        self.gm = gm
        # A lazily generated graph module writes its code into its attributes at its first call;
        # generated now, before a background compile copies it while calls run it.
        real_recompile = getattr(gm, "real_recompile", None)
        if real_recompile is not None:
            real_recompile()
        self.mode = mode
        self.name = name
        self.options = options
        self.outputs = len(gm.graph.output_node().args[0])
        self.compiled: dict[tuple, Any] = {}
        self.fallback: str | None = None
        self.lock = threading.Lock()  # compiling a specialization
        self.over_limit = False  # shapes of more classes than Options.max_specializations were seen
        self.admitted: set[tuple] = set()  # the shape classes whose signatures are compiled (``_admits``)
        self.graphed = 0  # specializations compiled to replay CUDA graphs (``mode="reduce-overhead"``)
        self.graphed_lock = threading.Lock()
        # Outputs that are numbers, not tensors (a size saved for the backward of a symbolic graph),
        # per specialization: {output index: value}.
        self.numbers: dict[tuple, dict[int, Any]] = {}
        self.origins: dict[str, str] = {}  # the converted graph's node origins (for failure evidence)
        # A training forward's outputs saved for the backward, whose layout the compiler may choose
        # (``graph.layout.saved_layouts``, ``fusion.padding.padded_layouts``) where it can tell AOTAutograd before the backward is
        # compiled: at a static compile, inside the forward compiler's call. {output: strides}
        # of those it chose unlike eager; outputs computed by PyTorch are given these strides too.
        self.saved = tuple(range(self.outputs))[saved]
        # Outputs that are views of inputs or of other outputs, made again per call (``_OutputViews``);
        # not those saved for the backward, which the compiler may give layouts of its own.
        self.output_views = _output_views(gm, set(self.saved))
        self.promised: dict[int, tuple[int, ...]] = {}
        # A graph with static shapes and only tensor inputs is called with exactly the example
        # inputs' shapes, strides, dtypes and devices (TorchDynamo's guards and AOTAutograd ensure
        # it): its one specialization needs no signature per call.
        # Its CompiledGraph is kept apart: looking it up by signature would hash ~200 nested tuples
        # per call. Its first call is checked (``_first_run``) before the lean path.
        self.static_key: tuple | None = None
        self.static = None
        self.proven = False  # the static specialization has run once
        # Under ``Options.async_compile``: the background compile of the static specialization, and
        # whether calls still choose between PyTorch and the compiled program (``_compiled_path``).
        self.kind = kind
        self.pair = pair
        self.pending: Any = None
        self.deciding = False
        # Under ``Options.async_compile``, an inference graph's specializations other than the
        # static one: {signature: future of its background compile} until a call takes it.
        self.jobs: dict[tuple, Any] = {}
        # the explored plans of the specializations compiled so far, newest first, for the others
        # (``explore.transfer``); a few, as each one tried costs a check of every pattern
        self.likes: list[Any] = []
        # the kernels of its specializations by skeleton: a later one's kernels that differ from an
        # earlier one's only in constants run one compiled kernel, the sizes its arguments
        self.families = SizeFamilies()
        # the specializations compiled in each shape class (``_shape_class``), in order: a later one
        # keeps the templates they decided, the first's first (``explore.transfer``'s ``kept``)
        self.classes: dict[tuple, list[Any]] = {}
        self.ran: set[tuple] = set()  # signatures run compiled at least once (``_paired_call``)
        tensors_only = all(isinstance(x, torch.Tensor) for x in example_inputs)
        static = _static_inputs(example_inputs)
        # a training graph under Options.async_compile whose signatures compile in the background
        self.paired = pair is not None and pair.paired
        if self.paired:
            if kind == "forward":
                pair.forward = self
            else:
                pair.backward = self
            return
        if options.async_compile and static:
            key = self.static_key = _signature(example_inputs)
            self.deciding = True
            self.pending = _background(lambda: self._compile_in_background(gm, example_inputs, key, backward))
            return
        if pair is not None and kind == "forward":  # compiled at once (or per call): no PyTorch calls to pair up
            pair.switched = True
        elif pair is not None:
            pair.backward_ready = pair.backward_compiled = True
        if options.async_compile and kind == "inference":
            return  # each signature compiles in the background at its first call (``_specialization``)
        if not _symbolic(example_inputs):
            key = _signature(example_inputs)
            self.static = self._compile_static(gm, example_inputs, key, choose_layouts=True, backward=backward)
            _report_output_strides(self.outputs, self.promised)
            if tensors_only:
                self.static_key = key
            else:
                self.static = None

    def _compile_static(self, gm: fx.GraphModule, inputs: list[Any], key: tuple, choose_layouts: bool,
                        backward: fx.GraphModule | None, publish: bool = True):
        """The specialization for the example inputs' shapes (None where the graph runs in PyTorch)."""
        traced, numbers = gm, {}
        if _symbolic_metadata(gm):  # concrete inputs, symbolic sizes in the graph's metadata
            concrete = self._concrete(inputs)
            if concrete is None:
                return None
            traced, numbers = concrete
        self.numbers[key] = numbers
        self.admitted.add(_shape_class(inputs))
        return self._compile(traced, inputs, key, choose_layouts=choose_layouts, backward=backward, publish=publish)

    def _compile_in_background(self, gm: fx.GraphModule, inputs: list[Any], key: tuple,
                               backward: fx.GraphModule | None):
        """The background job of ``Options.async_compile``: the static specialization, its kernels
        compiled for its GPU too. Saved tensors keep eager's layouts (AOTAutograd learns the
        forward's layouts before the backward compiles, which no longer waits for the forward)."""
        from torch._subclasses.fake_tensor import unset_fake_temporarily

        compiled = None
        try:
            # published by the call that takes it (``_take``, ``_specialization``), once prepared
            compiled = self._compile_static(gm, inputs, key, choose_layouts=False, backward=backward, publish=False)
            if compiled is not None and compiled.device is not None and compiled.device.type == "cuda":
                compiled.library_only = True  # the call that takes over measures nothing
                with unset_fake_temporarily(), torch.cuda.device(compiled.device):
                    try:
                        compiled.prepare(compiled.device)
                    except Exception as err:  # noqa: BLE001 -- the failure policy: any internal error
                        self._failed(err, "nvrtc")
                        compiled = None
            return compiled
        except BaseException as err:
            if self.kind == "backward" and self.pair is not None and not self.paired:
                self.pair.error = err
            raise
        finally:
            if self.kind == "backward" and self.pair is not None and not self.paired:
                with self.pair.lock:
                    self.pair.backward_ready, self.pair.backward_compiled = True, compiled is not None

    def _compiled_path(self) -> bool:
        """Under ``Options.async_compile``: whether this call leaves PyTorch for the compiled
        program (``_Pair`` for a training graph's rule); at the first that does, the background
        compile's result is taken (its error raised under ``strict``). A graph whose partner does
        not compile runs in PyTorch from then on, as announced by ``_fall_back``."""
        pair = self.pair
        if pair is not None and self.kind == "backward":
            with pair.lock:
                call, pair.backward_calls = pair.backward_calls, pair.backward_calls + 1
                abandoned = pair.abandoned
                if not abandoned and (not pair.switched or call < pair.eager_forwards):
                    return False
            if abandoned:  # its own compile, done or not, is not waited for
                self.deciding = False
                if self.fallback is None:
                    self._fall_back("its forward runs in PyTorch (Options.async_compile pairs them)")
                return True  # to the fallback's path
        elif pair is not None:
            with pair.lock:
                if not (self.pending.done() and pair.backward_ready):
                    pair.eager_forwards += 1
                    return False
                self.deciding = False
                try:
                    self._take()
                except BaseException:
                    pair.abandoned = True
                    raise
                if self.static is None or not pair.backward_compiled:
                    pair.abandoned = True
                    if pair.error is not None and self.options.strict:
                        raise pair.error
                    if self.fallback is None:
                        self._fall_back("its backward runs in PyTorch (Options.async_compile pairs them)")
                    return True  # to the fallback's path
                pair.switched = True
            return True
        elif not self.pending.done():
            return False
        self.deciding = False
        self._take()
        return True

    def _take(self) -> None:
        if self.pending is not None:
            future, self.pending = self.pending, None
            self.static = future.result()
            if self.static is not None:
                self.compiled[self.static_key] = self.static

    def __call__(self, args: list[Any]) -> list[Any]:
        compiled = self.static
        if compiled is not None and self.proven:
            _count("cache hits")
            tensors = list(args) + _rng_state(args) if len(compiled.graph.parameters) > len(args) else args
            results = compiled.run(tensors, trusted=True)[: self.outputs]
            return results if self.output_views is None else self.output_views.replace(results, args)
        args = list(args)
        if self.paired:
            return self._paired_call(args)
        if self.deciding and not self._compiled_path():
            _count("eager while compiling")
            return self._eager(args)
        if self.fallback is not None:
            return self._eager(args)
        key = self.static_key if self.static_key is not None else _signature(args)
        compiled = self.compiled.get(key)
        first = compiled is not None and compiled is self.static
        if compiled is None:
            with self.lock:
                compiled = self.compiled.get(key)
                if compiled is None and self.static_key is None and self.options.async_compile \
                        and self.kind == "inference":
                    if not self._admits(args):
                        return self._beyond_limit(args)
                    compiled = self._specialization(key, args)
                    if compiled is None:
                        return self._eager(args)
                    first = True
                elif compiled is None:
                    if not self._admits(args):
                        return self._beyond_limit(args)
                    compiled = self._compile_now(key, args)
                    if compiled is None:
                        return self._eager(args)
                    first = True
        return self._run(compiled, key, args, first)

    def _run(self, compiled, key: tuple, args: list[Any], first: bool) -> list[Any]:
        """The call run by the program of signature ``key``; ``first``: its first run (checked)."""
        if not first:
            _count("cache hits")
        if self.static_key is None:  # numbers are constants of the specialization
            tensors = [a for a in args if isinstance(a, torch.Tensor)]
        else:
            tensors = args
        if len(compiled.graph.parameters) > len(tensors):
            tensors = tensors + _rng_state(tensors)
        if first:
            results = self._first_run(compiled, tensors, args)
        else:
            results = compiled.run(tensors, trusted=True)[: self.outputs]
        for k, value in self.numbers.get(key, {}).items():
            results[k] = value
        if self.output_views is not None:
            results = self.output_views.replace(results, args)
        return results

    def _paired_call(self, args: list[Any]) -> list[Any]:
        """A call of a training graph under ``Options.async_compile`` whose forward or backward
        has symbolic shapes or numbers among its inputs (``_Pair.paired``). Each new signature of
        either graph compiles in the background (``_specialization``). A forward call runs its
        signature's program once that program and the backward's program for the signature its
        backward showed are ready (``_backward_ready``), else in PyTorch. Its path is kept under the
        addresses of the tensors it saved for the backward (``_Pair.paths``), which the backward
        receives: a step's backward runs compiled exactly when its forward did, whatever the order
        of steps' backwards (gradient accumulation, ``retain_graph``), its own program made at once
        where its signature is not the one compiled ahead. A backward that falls back takes its
        forward with it, as with static shapes; the saved tensors keep eager's layouts
        (``_compile_in_background``), so either path's backward reads either's."""
        pair = self.pair
        key = _signature(args)
        if self.kind == "forward":
            compiled = self._paired_forward(key, args)
            results = self._eager(args) if compiled is None else self._run_paired(compiled, key, args)
            self._record_path(args, results, key, compiled is not None)
            return results
        tensors = [a for a in args if isinstance(a, torch.Tensor)]
        entry, forward_key = None, None
        with pair.lock:  # the saved tensors come first among the backward's tensors
            saved = tensors[: pair.saved_tensors] if pair.saved_tensors is not None else None
            if saved is not None and len(saved) == pair.saved_tensors:
                if pair.fresh:  # taken: a second backward through a retained graph finds none
                    entry = pair.paths.pop(tuple(saved[i].data_ptr() for i in pair.fresh), None)
                    if entry is not None and any(ref() is None for ref in entry[2]):
                        entry = None  # a later step's copies at the addresses of freed tensors
                forward_key = entry[1] if entry is not None else pair.signatures.get(_saved_layout(saved))
            if forward_key is not None:
                pair.backward_for.setdefault(forward_key, key)
        compiled = self._paired_backward(key, args, entry[0] if entry is not None else None)
        return self._eager(args) if compiled is None else self._run_paired(compiled, key, args)

    def _record_path(self, args: list[Any], results: list[Any], key: tuple, compiled: bool) -> None:
        """Keep a forward call's path for its backward (``_Pair.paths``), under the addresses of
        the tensors it saved that are its own: a saved parameter or input has one address for
        every step. A forward none of whose saved tensors are its own leaves its backward to take
        its program where ready. And the signature its saved tensors' layout comes from, for a
        backward that cannot be told its step (a saved-tensor hook that moves them)."""
        from torch._subclasses.fake_tensor import FakeTensor

        saved = [results[k] for k in self.saved if isinstance(results[k], torch.Tensor)]
        if any(isinstance(t, FakeTensor) for t in saved):  # a call under fake mode (tracing)
            return
        inputs = {a.data_ptr() for a in args if isinstance(a, torch.Tensor)}
        fresh = tuple(i for i, t in enumerate(saved) if t.numel() and t.data_ptr() not in inputs)
        pair = self.pair
        with pair.lock:
            pair.saved_tensors, pair.fresh = len(saved), fresh
            if len(pair.signatures) >= _PATHS_KEPT:
                pair.signatures.clear()
            pair.signatures[_saved_layout(saved)] = key
            if fresh:
                address = tuple(saved[i].data_ptr() for i in fresh)
                pair.paths[address] = (compiled, key, tuple(weakref.ref(saved[i].untyped_storage()) for i in fresh))
                pair.paths.move_to_end(address)
                while len(pair.paths) > _PATHS_KEPT:  # forwards whose backward never came
                    pair.paths.popitem(last=False)

    def _run_paired(self, compiled, key: tuple, args: list[Any]) -> list[Any]:
        results = self._run(compiled, key, args, key not in self.ran)
        self.ran.add(key)  # once its first run passed (``_first_run``)
        return results

    def _paired_forward(self, key: tuple, args: list[Any]):
        """The forward's program for signature ``key`` where this call runs it, else None."""
        backward = self.pair.backward
        if self.fallback is None and backward is not None and backward.fallback is not None:
            self._fall_back("its backward runs in PyTorch (Options.async_compile pairs them)")
        if self.fallback is not None:
            return None
        with self.lock:
            compiled = self.compiled.get(key)
            if compiled is None:
                if not self._admits(args):
                    self._over_the_limit()
                    return None
                compiled = self._specialization(key, args)  # None: counted as a call in PyTorch
                if compiled is None:
                    return None
        ready = self._backward_ready(key)
        if ready:
            return compiled
        backward = self.pair.backward
        if backward is not None and backward.fallback is not None:
            self._fall_back("its backward runs in PyTorch (Options.async_compile pairs them)")
        elif ready is not None:
            _count("eager while compiling")
        return None  # ready is None: past the backward's limit of specializations (announced by it)

    def _backward_ready(self, forward_key: tuple) -> bool | None:
        """Whether the backward's program for the signature that followed ``forward_key`` is
        ready: True, False (not yet, or no backward call yet) or None (it never will be)."""
        pair = self.pair
        with pair.lock:
            backward, key = pair.backward, pair.backward_for.get(forward_key)
        if backward is None or key is None:
            return False
        if backward.fallback is not None:
            return None
        with backward.lock:
            if key in backward.compiled:
                return True
            job = backward.jobs.get(key)
            if job is None:  # past the backward's limit of specializations
                return None
            if not job.done():
                return False
            compiled = job.result()  # the compile's error, raised under strict (the job kept: raised again)
            backward.jobs.pop(key, None)
            if compiled is None:  # announced by the compile (``_failed``)
                return None
            backward.compiled[key] = compiled
            return True

    def _paired_backward(self, key: tuple, args: list[Any], path: bool | None):
        """The backward's program for signature ``key`` where this call runs it, else None.
        ``path``: whether its forward ran compiled; None where that forward is not known (no saved
        tensors, or it is older than ``_PATHS_KEPT`` forwards): the program then runs if ready."""
        forward = self.pair.forward
        if self.fallback is not None or (forward is not None and forward.fallback is not None):
            return None  # the forward announced it
        with self.lock:
            compiled = self.compiled.get(key)
            job = self.jobs.get(key)
            if compiled is None and job is not None and (path or (path is None and job.done())):
                compiled = job.result()  # raised under strict (the job kept: raised again)
                self.jobs.pop(key, None)
                if compiled is None:  # announced by the compile (``_failed``)
                    return None
                self.compiled[key] = compiled
            if path is False or (path is None and compiled is None):
                if compiled is None and job is None:
                    if not self._admits(args):
                        self._over_the_limit()
                        return None
                    self._specialization(key, args)  # submitted; counted as a call in PyTorch
                else:
                    _count("eager while compiling")
                return None
            if compiled is None:  # behind a compiled forward, a signature not compiled ahead
                if not self._admits(args):
                    self._over_the_limit()
                    return None
                compiled = self._compile_now(key, args)
            return compiled

    def _compile_now(self, key: tuple, args: list[Any]):
        """The specialization ``key`` compiled at this call from its concrete arguments (the
        runner's lock held, ``Options.max_specializations`` kept by the caller); None where the
        graph runs in PyTorch."""
        _count("shape specializations")
        concrete = self._concrete(args)
        compiled = self._compile(concrete[0], args, key) if concrete is not None else None
        if compiled is not None:
            self.numbers[key] = concrete[1]
        return compiled

    def _specialization(self, key: tuple, args: list[Any]):
        """Under ``Options.async_compile``, an inference graph's program for the signature ``key``
        (the runner's lock held): the background compile's result once it is done, else None, and
        the call runs in PyTorch (``stats()["eager while compiling"]``). The first call of a new
        signature submits its compile, made from fakes of the call's arguments (their shapes,
        strides, dtypes and devices) and its numbers (the caller keeps ``Options.max_specializations``).
        A compile that fails is reported when a call takes it: under ``strict`` its error is raised
        there, and at every later call of the signature."""
        job = self.jobs.get(key)
        if job is None:
            try:
                fakes = _fakes(args)
            except Exception as err:  # noqa: BLE001 -- the failure policy: any internal error
                self._failed(err, "capture")
                return None
            _count("shape specializations")
            self.jobs[key] = _background(lambda: self._compile_in_background(self.gm, fakes, key, None))
            _count("eager while compiling")
            return None
        if not job.done():
            _count("eager while compiling")
            return None
        compiled = job.result()  # the compile's error, raised under strict (the job kept: raised again)
        self.jobs.pop(key, None)  # a failed compile's fallback may have cleared them
        if compiled is None:  # announced by the compile (``_failed``)
            return None
        self.compiled[key] = compiled
        return compiled

    def _first_run(self, compiled, tensors: list[Any], args: list[Any]) -> list[Any]:
        """The first call of a specialization: an internal error here (a kernel that does not
        compile or simulate) is a compile failure, and the graph runs in PyTorch from then on. The
        graph runs in PyTorch at once to tell: an error it raises too (``_same_error``) is the
        user's, met by a library op, and propagates as PyTorch raised it."""
        try:
            results = compiled.run(tensors, trusted=True)[: self.outputs]
        except IndexError:  # the user's error, raised by eager too
            raise
        except Exception as err:  # noqa: BLE001 -- the failure policy: any internal error
            eager_error = None
            try:
                results = self._eager(args)
            except Exception as eager:  # compared with the compiled run's error
                if _same_error(err, eager):  # the user's error, met by a library op: eager's own
                    raise
                eager_error = eager
            self._failed(err, "run")
            if eager_error is not None:
                raise eager_error from None
            return results
        if compiled is self.static:
            self.proven = True
        return results

    def _admits(self, args: list[Any]) -> bool:
        """Whether a new signature of the call ``args`` may be compiled (the runner's lock held):
        ``Options.max_specializations`` counts shape classes (``_shape_class``), not signatures. A
        signature of a class admitted before is (its specialization keeps the class's templates
        and runs its kernels' code: little to compile, nothing to tune); a new class is while
        fewer than the limit are admitted."""
        shape_class = _shape_class(args)
        if shape_class in self.admitted:
            return True
        if len(self.admitted) >= self.options.max_specializations:
            return False
        self.admitted.add(shape_class)
        return True

    def _beyond_limit(self, args: list[Any]) -> list[Any]:
        self._over_the_limit()
        return self._eager(args)

    def _over_the_limit(self) -> None:
        if not self.over_limit:
            self.over_limit = True
            _count("fallbacks")
            warnings.warn(f"fusionstitching: graph {self.name} was called with shapes of more than "
                          f"{self.options.max_specializations} shape classes (Options.max_specializations); "
                          "shapes of further classes run in PyTorch", FallbackWarning, stacklevel=4)

    def _eager(self, args: list[Any]) -> list[Any]:
        """The graph run by PyTorch, its saved outputs in the strides promised to the backward."""
        from fusionstitching.graph.reference import with_strides

        results = list(self.gm(*args))
        for k, strides in self.promised.items():
            if isinstance(results[k], torch.Tensor) and results[k].stride() != strides:
                results[k] = with_strides(results[k], strides)
        return results

    def _concrete(self, args: list[Any]) -> tuple[fx.GraphModule, dict[int, Any]] | None:
        try:
            return _concrete(self.gm, args)
        except Exception as err:  # noqa: BLE001 -- the failure policy: any internal error
            self._failed(err, "capture")
            return None

    def _compile(self, gm: fx.GraphModule, inputs: list[Any], key: tuple, choose_layouts: bool = False,
                 backward: fx.GraphModule | None = None, publish: bool = True):
        """The specialization ``key`` compiled (None where the graph runs in PyTorch); ``publish``:
        kept in ``self.compiled`` at once, where calls find it."""
        from torch._subclasses.fake_tensor import unset_fake_temporarily

        # AOTAutograd may call the compiler under its fake mode; constants of the graph are real.
        with unset_fake_temporarily():
            try:
                return self._compile_real(gm, inputs, key, choose_layouts, backward, publish)
            except Exception as err:  # noqa: BLE001 -- the failure policy: any internal error
                self._failed(err, None, gm)
                return None

    def _compile_real(self, gm: fx.GraphModule, inputs: list[Any], key: tuple, choose_layouts: bool = False,
                      backward: fx.GraphModule | None = None, publish: bool = True):
        from fusionstitching.frontend.context import Unsupported
        from fusionstitching.frontend.torch_fx import convert
        from fusionstitching.fusion.padding import padded_layouts
        from fusionstitching.graph.layout import saved_layouts
        from fusionstitching.pipeline import compile_graph, with_gemm_timings

        try:
            specs, slots = [], []
            for i, value in enumerate(inputs):
                if isinstance(value, torch.Tensor):
                    slots.append(len(specs))
                    specs.append(_spec(f"arg{i}", value))
                elif isinstance(value, (bool, int, float)):
                    slots.append(torch.tensor(value))  # part of the shape signature: a constant here
                else:
                    raise Unsupported(f"input {i} is a {type(value).__name__}, not a tensor or a number")
            device, output_devices = _devices(gm, inputs)
            with timed("conversion"):
                graph = convert(gm, specs, slots, name=self.name)
            self.origins = graph.origins
        except Unsupported as err:  # a program outside what the compiler takes: announced, not an error
            self._fall_back(str(err))
            return None
        # the unaligned GEMMs timed on this GPU (``runtime/gemm_timing.py``) before the padding pass
        # promises a saved product's layout or plans the graph
        options = with_gemm_timings(graph, self.options, device)
        promised = {}
        if choose_layouts and self.saved:
            chosen = saved_layouts(graph, self.saved) if self.options.channels_last else graph
            chosen = padded_layouts(chosen, [k for k in self.saved if chosen.output_layouts[k] is graph.output_layouts[k]],
                                    options)
            promised = {k: tuple(chosen.output_layouts[k].strides) for k in self.saved
                        if chosen.output_layouts[k] is not graph.output_layouts[k]}
            graph = chosen
        if backward is not None:
            self._explore_ahead(backward, promised)
        shape_class = _shape_class(inputs)
        kept: dict[frozenset[str], str] = {}
        for earlier in self.classes.get(shape_class, ()):
            if earlier.settled:
                kept = {**earlier.kept_templates(), **kept}
        mode = self.mode
        if mode == "reduce-overhead":  # each CUDA graph holds a memory pool: as many as classes admitted
            with self.graphed_lock:  # background compiles run side by side, without the runner's lock
                if self.graphed >= self.options.max_specializations:
                    mode = None  # this specialization launches its kernels one by one
                else:
                    self.graphed += 1
        compiled = compile_graph(graph, options, mode, device=device, output_devices=output_devices,
                                 like=tuple(self.likes), families=self.families, kept=kept or None)
        self.classes.setdefault(shape_class, []).append(compiled)
        _count("compilations")
        _count("kernels shared across shapes", compiled.shared_kernels)
        _count("templates kept across shapes", len(compiled.plan.kept))
        if compiled.plan.transferred:
            _count("plans transferred")
        else:
            self.likes = [compiled.plan, *self.likes][:_PLANS_TRIED]
        if choose_layouts:  # the one compile whose layouts AOTAutograd is told
            self.promised = promised
        plan = compiled.plan
        _count("kernels", plan.kernel_count)
        _count("library calls", plan.library_count)
        _count("views", len(plan.views))
        if publish:
            self.compiled[key] = compiled
        return compiled

    def _explore_ahead(self, backward: fx.GraphModule, promised: dict[int, tuple[int, ...]]) -> None:
        """Convert ``backward`` as its compiler will and have a worker process explore it
        (``fusion/background.py``): AOTAutograd gives the backward compiler the partitioner's
        placeholder values, the saved tensors among them (the first inputs, in the order the forward
        returns them) restrided as this forward promised. A conversion that fails here or differs
        from the compiler's later one (another key) only leaves the backward to be explored then."""
        from fusionstitching.frontend.torch_fx import convert
        from fusionstitching.fusion import background
        from fusionstitching.fusion.explore import DEFAULT_GENERATORS
        from fusionstitching.graph.graph import Layout
        from fusionstitching.pipeline import with_gemm_timings

        values = [node.meta.get("val") for node in backward.graph.find_nodes(op="placeholder")]
        if not values or not all(isinstance(v, torch.Tensor) for v in values) or _symbolic(values):
            return
        try:
            with timed("conversion"), warnings.catch_warnings():
                warnings.simplefilter("ignore")  # the backward's own conversion warns
                specs = []
                for i, value in enumerate(values):
                    spec = _spec(f"arg{i}", value)
                    if i < len(self.saved) and self.saved[i] in promised:
                        spec = dataclasses.replace(spec, layout=Layout(promised[self.saved[i]], spec.layout.offset))
                    specs.append(spec)
                graph = convert(backward, specs, list(range(len(specs))), name=backward.meta[_NAME])
        except Exception:  # noqa: BLE001 -- the backward's compile meets (and reports) the same
            return
        arch = None
        device = next((v.device for v in values if v.device.type == "cuda"), None)
        if device is not None:  # the worker compiles the kernels for this GPU too
            from fusionstitching.runtime.kernel_call import device_arch

            arch = device_arch(_indexed(device))
        options = with_gemm_timings(graph, self.options, device and _indexed(device))  # as its compile will
        with timed("exploration"):  # keying and sending the graph
            background.submit(graph, options, options.generators or DEFAULT_GENERATORS, arch)

    def _failed(self, err: BaseException, stage: str | None, gm: fx.GraphModule | None = None) -> None:
        """An internal error: raised with its evidence under ``Options(strict=True)``, else the graph
        runs in PyTorch from now on."""
        evidence = _evidence(err, gm if gm is not None else self.gm, stage, self.origins)
        if self.options.strict:
            raise CompileFailure(f"fusionstitching: graph {self.name}: {evidence}") from err
        self._fall_back(evidence)

    def _fall_back(self, reason: str) -> None:
        with _FALLBACK_LOCK:  # once per graph, whichever thread comes first
            if self.fallback is not None:
                return
            self.fallback = reason
        self.static = None
        self.jobs.clear()  # programs no call will take (a job still running finishes unread)
        _count("fallbacks")
        warnings.warn(f"fusionstitching: graph {self.name} runs in PyTorch: {reason}", FallbackWarning,
                      stacklevel=4)


def _saved_outputs() -> slice:
    """The outputs of a training forward being compiled that it saves for its backward
    (AOTAutograd's metadata, set before the forward compiler is called); none where unknown."""
    from torch._guards import TracingContext

    context = TracingContext.try_get()
    metadata = getattr(context, "fw_metadata", None)
    try:
        saved = metadata.tensors_saved_for_backwards_slice
    except (AttributeError, AssertionError):
        return slice(0, 0)
    return saved


def _report_output_strides(outputs: int, promised: dict[int, tuple[int, ...]]) -> None:
    """Tell AOTAutograd the strides of the outputs laid out unlike eager, so that it compiles the
    backward for the saved tensors as they come (``TracingContext.report_output_strides``)."""
    from torch._guards import TracingContext

    context = TracingContext.try_get()
    strides = getattr(context, "output_strides", None)
    if strides is None or not promised:
        return
    strides.extend(promised.get(k) for k in range(outputs))


def _same_error(err: BaseException, eager: BaseException) -> bool:
    """Whether the compiled run's ``err`` is the error that the graph raises in PyTorch: ``err`` or
    an exception it wraps (the simulator wraps a library op's) of the same type and message. Then
    a library op met the user's error (an index out of range in a scatter, say), not the compiler's;
    an internal error, such as a CUDA fault of a generated kernel, has another type or message."""
    seen: list[BaseException] = []
    current: BaseException | None = err
    while current is not None and current not in seen:
        if type(current) is type(eager) and str(current) == str(eager):
            return True
        seen.append(current)
        current = current.__cause__
    return False


def _evidence(err: BaseException, gm: fx.GraphModule, stage: str | None, origins: dict[str, str]) -> str:
    """``<stage>, node <name> (from <FX node>: <ATen op>): <exception>``. The stage, unless given, is
    the package of the innermost frame of this package in the traceback; the node is the innermost
    graph or FX node that a frame from the compiler inwards was handling (a local of type ``Node``
    or ``fx.Node``)."""
    from fusionstitching.graph.graph import Node

    node_name, where = None, None
    for frame, _ in traceback.walk_tb(err.__traceback__):
        module = frame.f_globals.get("__name__", "")
        if module.startswith("fusionstitching."):
            where = module.split(".")[1]
        if where is None:  # frames of the caller, outside the compiler
            continue
        for value in frame.f_locals.values():
            if isinstance(value, (Node, fx.Node)):
                node_name = value.name
    stage = stage or where or "compile"
    text = f"{type(err).__name__}: {err}"
    if node_name is None:
        return f"{stage}: {text}"
    origin = origins.get(node_name) or _aten_op(gm, node_name)
    return f"{stage}, node {node_name} (from {origin}): {text}"


def _aten_op(gm: fx.GraphModule, name: str) -> str:
    """The ATen op of the FX node an IR node came from: IR nodes take their FX node's name, nodes a
    lowering or pass adds take it with a suffix (``mul_3_partial``)."""
    nodes = {n.name: n for n in gm.graph.nodes}
    parts = name.split("_")
    for end in range(len(parts), 0, -1):
        fx_node = nodes.get("_".join(parts[:end]))
        if fx_node is not None:
            return f"{fx_node.name}: {fx_node.target if fx_node.op == 'call_function' else fx_node.op}"
    return "no FX node"


def _rng_state(args: list[Any]) -> list[Any]:
    """The seed and offset of a graph's random ops, its last two parameters: a new seed per call."""
    seed = torch.randint(0, 2**62, (), dtype=torch.int64)
    device = next((a.device for a in args if isinstance(a, torch.Tensor)), torch.device("cpu"))
    return [seed.to(device), torch.zeros((), dtype=torch.int64, device=device)]


def _devices(gm: fx.GraphModule, inputs: list[Any]) -> tuple[torch.device, list[torch.device | None]]:
    """Where the graph runs, and the device eager gives each output (None for a number). Values
    carry no device in the IR: a graph that touches a GPU (an input there, a tensor created there,
    an input moved there) runs there, its other inputs are copied to it, and an output that eager
    puts elsewhere (``x.cpu()``, the gradient of a 0-d CPU input) is moved there after the call. A
    graph on several GPUs is not taken."""
    from fusionstitching.frontend.context import Unsupported

    results = gm.graph.output_node().args[0]
    values = [node.meta.get("val") if isinstance(node, fx.Node) else None
              for node in (results if isinstance(results, (list, tuple)) else [results])]
    output_devices = [_indexed(v.device) if isinstance(v, torch.Tensor) else None for v in values]
    seen = [t.device for t in inputs if isinstance(t, torch.Tensor)]
    seen += [d for d in output_devices if d is not None]
    seen += [v.device for node in gm.graph.nodes if isinstance(v := node.meta.get("val"), torch.Tensor)]
    other = sorted({str(d) for d in seen if d.type not in ("cpu", "cuda")})
    if other:
        raise Unsupported(f"it has tensors on {', '.join(other)}; generated kernels run on CUDA devices")
    gpus = sorted({str(_indexed(d)) for d in seen if d.type == "cuda"})
    if len(gpus) > 1:
        raise Unsupported(f"its tensors are on several GPUs ({', '.join(gpus)})")
    return (torch.device(gpus[0]) if gpus else torch.device("cpu")), output_devices


def _indexed(device: torch.device) -> torch.device:
    """``device`` with its index: ``cuda`` is the current GPU."""
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def _spec(name: str, t: torch.Tensor):
    from fusionstitching.frontend.torch_fx import _spec as spec

    return spec(name, t)


def _saved_layout(tensors: list[Any]) -> tuple:
    return tuple((t.dtype, tuple(t.shape), t.stride()) for t in tensors)


def _static_inputs(inputs: list[Any]) -> bool:
    """Tensors only, of static shapes and strides: a graph called with exactly these."""
    return all(isinstance(x, torch.Tensor) for x in inputs) and not _symbolic(inputs)


def _symbolic(inputs: list[Any]) -> bool:
    for value in inputs:
        if isinstance(value, torch.SymInt):
            return True
        if isinstance(value, torch.Tensor) and any(isinstance(s, torch.SymInt) for s in (*value.shape, *value.stride())):
            return True
    return False


def _symbolic_metadata(gm: fx.GraphModule) -> bool:
    """Whether a placeholder's traced value is a symbolic size or has symbolic sizes."""
    return _symbolic([node.meta.get("val") for node in gm.graph.nodes if node.op == "placeholder"])


class _OutputViews:
    """The outputs of an ATen graph that are views of its inputs or of its other outputs (made by
    view ops and size arithmetic only), and a graph module of just those views, which takes the
    call's arguments and then the outputs they view. AOTAutograd rebuilds an output that aliases
    an input from that input: by replaying the view ops where their arguments are not symbolic,
    else by ``as_strided`` with the size, strides and storage offset of the tensor the compiled
    graph returned. A compiled program returns a fresh tensor (a kernel's copy) with the strides
    eager's view has but storage offset 0, so for a symbolic graph whose input starts inside its
    storage (a slice) the rebuilt output read from the wrong place; and a view of another output
    came back as a copy, not sharing that output's storage as eager's does (an in-place update of
    one did not show in the other). These outputs are therefore returned as the views themselves,
    made from the call's inputs and the compiled outputs like eager's."""

    def __init__(self, module: fx.GraphModule, indices: list[int], bases: list[int]) -> None:
        self.module, self.indices, self.bases = module, indices, bases

    def replace(self, results: list[Any], args: list[Any]) -> list[Any]:
        results = list(results)
        for k, view in zip(self.indices, self.module(*args, *(results[j] for j in self.bases))):
            results[k] = view
        return results


# what a view's size arguments are computed with: Python arithmetic on sizes and the size queries
_SIZE_ARITHMETIC = {operator.add, operator.sub, operator.mul, operator.floordiv, operator.mod, operator.neg,
                    operator.truediv, operator.pow, torch.ops.aten.sym_size.int, torch.ops.aten.sym_stride.int,
                    torch.ops.aten.sym_numel.default, torch.ops.aten.sym_storage_offset.default}


def _output_views(gm: fx.GraphModule, skip: set[int]) -> _OutputViews | None:
    """``_OutputViews`` of ``gm``'s outputs that are views of its tensor inputs or of its other
    outputs, or None if there are none. Outputs at ``skip`` (saved for the backward, whose layout
    the compiler may choose) are neither replaced nor viewed."""
    graph = gm.graph
    outputs = graph.output_node().args[0]

    def is_view(node: fx.Node) -> bool:
        target = node.target
        return node.op == "call_function" and (
            (isinstance(target, torch._ops.OpOverload) and target.is_view) or target in _SIZE_ARITHMETIC)

    # the outputs other outputs may view: computed tensors, each at its first index
    bases: dict[fx.Node, int] = {}
    for j, out in enumerate(outputs):
        if (j not in skip and isinstance(out, fx.Node) and out.op == "call_function" and not is_view(out)
                and isinstance(out.meta.get("val"), torch.Tensor)):
            bases.setdefault(out, j)
    pure: dict[fx.Node, bool] = {}
    for node in graph.nodes:
        if node.op == "placeholder" or node in bases:
            pure[node] = True
        else:
            pure[node] = is_view(node) and all(pure.get(a, False) for a in node.all_input_nodes)
    indices = [k for k, out in enumerate(outputs) if k not in skip and isinstance(out, fx.Node)
               and out.op == "call_function" and out not in bases and pure[out]
               and isinstance(out.meta.get("val"), torch.Tensor)]
    if not indices:
        return None
    needed: set[fx.Node] = set()
    stack = [outputs[k] for k in indices]
    while stack:
        node = stack.pop()
        if node not in needed:
            needed.add(node)
            if node not in bases:
                stack.extend(node.all_input_nodes)
    used = [node for node in bases if node in needed]
    views = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for node in graph.nodes:
        if node.op == "placeholder":
            env[node] = views.node_copy(node, lambda n: env[n])
    for node in used:
        env[node] = views.placeholder(f"base_{bases[node]}")
    for node in graph.nodes:
        if node in needed and node not in env:
            env[node] = views.node_copy(node, lambda n: env[n])
    views.output(tuple(env[outputs[k]] for k in indices))
    return _OutputViews(fx.GraphModule(gm, views), indices, [bases[node] for node in used])


def _fakes(args: list[Any]) -> list[Any]:
    """Fake tensors of ``args``' shapes, strides, dtypes and devices (numbers as they are): what a
    background compile needs of a call's arguments, without keeping their memory alive."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode(allow_non_fake_inputs=True):
        return [torch.empty_strided(a.shape, a.stride(), dtype=a.dtype, device=a.device)
                if isinstance(a, torch.Tensor) else a for a in args]


_ALIGNMENT_CLASSES = 16  # the largest power of two whose divisibility tells sizes of one class apart


def size_class(size: int) -> tuple[int, int]:
    """A size's shape class: the power of two at or above it, and the largest power of two up to
    16 that divides it (sizes below 2 are their own class). Divisibility is part of it because
    templates tile dims by powers of two up to 16 (vectors, rows per warp): a tiling that divides
    one size of a class divides every one, so none of them takes a tail the others do not (4 rows
    per warp divide 200 rows; at 250 they leave a tail, where such a template is far slower)."""
    if size <= 1:
        return size, size
    return 1 << (size - 1).bit_length(), min(size & -size, _ALIGNMENT_CLASSES)


def _shape_class(inputs: list[Any]) -> tuple:
    """The shape class of a call's inputs: ``_signature`` with every size and stride bucketed
    (``size_class``). Specializations of one class keep one set of templates (``_Runner.classes``): the
    sizes within a class are less than 2x apart and alike in divisibility, so a template measured at
    one serves the others, refitted to their sizes and checked again there (``schedule.tune.refit``)."""
    key = []
    for value in inputs:
        if isinstance(value, torch.Tensor):
            key.append((tuple(size_class(d) for d in value.shape), tuple(size_class(abs(s)) for s in value.stride()),
                        value.dtype, value.device.type))
        elif isinstance(value, int) and not isinstance(value, bool):
            key.append(("int", size_class(value)))
        else:
            key.append((type(value).__name__, value))
    return tuple(key)


def _signature(inputs: list[Any]) -> tuple:
    key = []
    for value in inputs:
        if isinstance(value, torch.Tensor):
            key.append((tuple(value.shape), tuple(value.stride()), value.dtype, value.device.type))
        else:
            key.append((type(value).__name__, value))
    return tuple(key)


def _concrete(gm: fx.GraphModule, args: list[Any]) -> tuple[fx.GraphModule, dict[int, Any]]:
    """A copy of ``gm`` whose nodes' metadata hold fake values of the call's concrete shapes, and
    the graph's outputs that are numbers (sizes a symbolic forward saves for its backward).
    Propagated by an interpreter (``FakeTensorProp``): no tracing, so no process-wide tracing flag."""
    import copy

    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.passes.fake_tensor_prop import FakeTensorProp

    class _Prop(FakeTensorProp):
        def run_node(self, n: fx.Node) -> Any:
            """FakeTensorProp keeps a node's old metadata when its value is a plain number (some torch
            versions): a size input traced as ``s0`` would stay symbolic. Numbers are recorded too."""
            result = super().run_node(n)
            if isinstance(result, (bool, int, float)):
                n.meta["val"] = result
            return result

    concrete = copy.deepcopy(gm)
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    with mode:  # fakes of the inputs' layouts, whether they are real or another mode's fakes
        fakes = [torch.empty_strided(a.shape, a.stride(), dtype=a.dtype, device=a.device)
                 if isinstance(a, torch.Tensor) else a for a in args]
    _Prop(concrete, mode).propagate_dont_convert_inputs(*fakes)
    numbers = {}
    for k, out in enumerate(concrete.graph.output_node().args[0]):
        value = out.meta.get("val") if isinstance(out, fx.Node) else out
        if isinstance(value, (bool, int, float)):
            numbers[k] = value
    return concrete, numbers


def register() -> None:
    """Register the backend under the name "fusionstitching" (done by ``import fusionstitching``)."""
    from torch._dynamo.backends.registry import _BACKENDS, register_backend

    if "fusionstitching" not in _BACKENDS:
        register_backend(compiler_fn=fusionstitching_backend, name="fusionstitching")
