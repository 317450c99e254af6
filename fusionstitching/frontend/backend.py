"""The ``torch.compile`` backend: ``torch.compile(model, backend="fusionstitching")``.

TorchDynamo hands the backend an FX graph of torch ops; AOTAutograd (with the core-ATen and
composite decompositions of capture, the min-cut partitioner and in-graph input mutations, exactly
as ``torch_fx.capture`` does) turns it into ATen forward/backward or inference graphs; each of those
is converted to a ``Graph``, planned (``fusion.explore``) and run by a ``runtime.CompiledGraph``:
generated kernels on a GPU, the NumPy simulator of the same kernels on a CPU.

Shapes. A graph is compiled for the concrete shapes of its example inputs. When TorchDynamo sends
symbolic shapes (it does once a second input shape shows up), compilation waits for the call: the
ATen graph is re-traced with fake tensors of the call's shapes and compiled once per shape
signature (shapes, strides, dtypes), cached.

Random numbers. A graph that draws random numbers (dropout) gets two extra inputs, a seed and an
offset; each call draws a fresh seed from torch's default generator, so ``torch.manual_seed``
makes runs repeatable.

Numbers among the inputs (sizes TorchDynamo passes for symbolic shapes, Python scalars) are part of
the shape signature and become constants of that specialization.

``mode="reduce-overhead"`` replays each compiled graph from a CUDA graph after its second call
(``runtime.program.GraphedProgram``); outputs are then overwritten by the next call, as with
Inductor's CUDA graphs.

Fallbacks. A graph the frontend cannot convert (an input that is neither a tensor nor a number, an
unsupported dtype) runs in PyTorch as AOTAutograd gave it: counted in ``stats()["fallbacks"]`` and announced by
a ``FallbackWarning`` that names the graph and the reason. Library calls inside a plan (GEMMs,
ops without a lowering) are counted in ``stats()["library calls"]``.

``stats()`` reads process-wide counters: compiling is a process-wide activity that a user wants
to audit, the one place where this package keeps state across calls.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections import Counter
from collections.abc import Callable
from typing import Any

import torch
from torch import fx

from fusionstitching.options import Options

_STATS: Counter[str] = Counter()


class FallbackWarning(UserWarning):
    """A graph (or part of one) runs in PyTorch instead of generated kernels."""


def stats() -> dict[str, int]:
    """Counts since the process started: compiled graphs, kernels, library calls, views, fallbacks,
    shape specializations and cache hits."""
    return dict(_STATS)


def reset_stats() -> None:
    _STATS.clear()


def _options(options: Options | dict | None) -> Options:
    if options is None:
        return Options()
    if isinstance(options, Options):
        return options
    return dataclasses.replace(Options(), **options)


def fusionstitching_backend(gm: fx.GraphModule, example_inputs: list[Any], mode: str | None = None,
                            options: Options | dict | None = None) -> Callable[..., Any]:
    """The TorchDynamo backend (registered as "fusionstitching")."""
    from torch._functorch.aot_autograd import aot_module_simplified
    from torch._functorch.partitioners import min_cut_rematerialization_partition

    from fusionstitching.frontend.torch_fx import decompositions

    if mode not in (None, "default", "reduce-overhead"):
        raise ValueError(f"fusionstitching: unknown mode {mode!r}; known: None, 'reduce-overhead'")
    opts = _options(options)
    return aot_module_simplified(
        gm, example_inputs,
        fw_compiler=_compiler("forward", opts, mode), bw_compiler=_compiler("backward", opts, mode),
        inference_compiler=_compiler("inference", opts, mode),
        partition_fn=min_cut_rematerialization_partition, decompositions=decompositions(),
        keep_inference_input_mutations=True,
    )


def compile(fn_or_module: Callable[..., Any], options: Options | None = None, **kwargs: Any) -> Callable[..., Any]:
    """``torch.compile(fn_or_module, backend="fusionstitching", options=...)``, as one call."""
    opts = dataclasses.asdict(options) if options is not None else None
    return torch.compile(fn_or_module, backend="fusionstitching", options=opts, **kwargs)


def _compiler(kind: str, options: Options, mode: str | None
              ) -> Callable[[fx.GraphModule, list[Any]], Callable[..., Any]]:
    def compile_graph(gm: fx.GraphModule, example_inputs: list[Any]) -> Callable[..., Any]:
        _STATS["graphs"] += 1
        name = f"{kind}_{_STATS['graphs']}"
        return _Runner(gm, example_inputs, name, options, mode)

    return compile_graph


class _Runner:
    """One ATen graph: compiled per shape signature, called with AOTAutograd's boxed arguments."""

    _boxed_call = True

    def __init__(self, gm: fx.GraphModule, example_inputs: list[Any], name: str, options: Options,
                 mode: str | None = None) -> None:
        self.gm = gm
        self.mode = mode
        self.name = name
        self.options = options
        self.outputs = len(gm.graph.output_node().args[0])
        self.compiled: dict[tuple, Any] = {}
        self.fallback: str | None = None
        # A graph with static shapes and only tensor inputs is called with exactly the example
        # inputs' shapes, strides, dtypes and devices (TorchDynamo's guards and AOTAutograd ensure
        # it): its one specialization needs no signature per call (0.5 ms for BERT's 200 inputs).
        # Its CompiledGraph is kept apart: looking it up by signature would hash ~200 nested tuples
        # per call (7 µs for BERT).
        self.static_key: tuple | None = None
        self.static = None
        if not _symbolic(example_inputs):
            key = _signature(example_inputs)
            self.static = self._compile(gm, example_inputs, key)
            if all(isinstance(x, torch.Tensor) for x in example_inputs):
                self.static_key = key
            else:
                self.static = None

    def __call__(self, args: list[Any]) -> list[Any]:
        compiled = self.static
        if compiled is not None:
            _STATS["cache hits"] += 1
            if len(compiled.graph.parameters) > len(args):
                args = list(args) + _rng_state(args)
            return compiled.run(args, trusted=True)[: self.outputs]
        args = list(args)
        if self.fallback is not None:
            return list(self.gm(*args))
        key = self.static_key if self.static_key is not None else _signature(args)
        compiled = self.compiled.get(key)
        if compiled is None:
            _STATS["shape specializations"] += 1
            compiled = self._compile(_concrete(self.gm, args), args, key)
            if compiled is None:
                return list(self.gm(*args))
        else:
            _STATS["cache hits"] += 1
        if self.static_key is None:  # numbers are constants of the specialization
            args = [a for a in args if isinstance(a, torch.Tensor)]
        if len(compiled.graph.parameters) > len(args):
            args += _rng_state(args)
        return compiled.run(args, trusted=True)[: self.outputs]

    def _compile(self, gm: fx.GraphModule, inputs: list[Any], key: tuple):
        from torch._subclasses.fake_tensor import unset_fake_temporarily

        # AOTAutograd may call the compiler under its fake mode; constants of the graph are real.
        with unset_fake_temporarily():
            return self._compile_real(gm, inputs, key)

    def _compile_real(self, gm: fx.GraphModule, inputs: list[Any], key: tuple):
        from fusionstitching.frontend.context import CaptureError, Unsupported
        from fusionstitching.frontend.torch_fx import convert
        from fusionstitching.pipeline import compile_graph

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
            graph = convert(gm, specs, slots, name=self.name)
        except (CaptureError, Unsupported, ValueError) as err:
            self.fallback = str(err)
            _STATS["fallbacks"] += 1
            warnings.warn(f"fusionstitching: graph {self.name} runs in PyTorch: {err}", FallbackWarning,
                          stacklevel=2)
            return None
        compiled = compile_graph(graph, self.options, self.mode)
        plan = compiled.plan
        _STATS["kernels"] += plan.kernel_count
        _STATS["library calls"] += plan.library_count
        _STATS["views"] += len(plan.views)
        self.compiled[key] = compiled
        return compiled


def _rng_state(args: list[Any]) -> list[Any]:
    """The seed and offset of a graph's random ops, its last two parameters: a new seed per call."""
    seed = torch.randint(0, 2**62, (), dtype=torch.int64)
    device = next((a.device for a in args if isinstance(a, torch.Tensor)), torch.device("cpu"))
    return [seed.to(device), torch.zeros((), dtype=torch.int64, device=device)]


def _spec(name: str, t: torch.Tensor):
    from fusionstitching.frontend.torch_fx import _spec as spec

    return spec(name, t)


def _symbolic(inputs: list[Any]) -> bool:
    for value in inputs:
        if isinstance(value, torch.SymInt):
            return True
        if isinstance(value, torch.Tensor) and any(isinstance(s, torch.SymInt) for s in (*value.shape, *value.stride())):
            return True
    return False


def _signature(inputs: list[Any]) -> tuple:
    key = []
    for value in inputs:
        if isinstance(value, torch.Tensor):
            key.append((tuple(value.shape), tuple(value.stride()), value.dtype, value.device.type))
        else:
            key.append((type(value).__name__, value))
    return tuple(key)


def _concrete(gm: fx.GraphModule, args: list[Any]) -> fx.GraphModule:
    """``gm`` re-traced with fake tensors of the call's shapes: every node's metadata concrete."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.proxy_tensor import make_fx

    mode = FakeTensorMode(allow_non_fake_inputs=True)
    fakes = [mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args]
    with mode:
        return make_fx(gm, tracing_mode="real")(*fakes)


def register() -> None:
    """Register the backend under the name "fusionstitching" (done by ``import fusionstitching``)."""
    from torch._dynamo.backends.registry import _BACKENDS, register_backend

    if "fusionstitching" not in _BACKENDS:
        register_backend(compiler_fn=fusionstitching_backend, name="fusionstitching")
