"""CompiledGraph: a whole FusionPlan, run (DESIGN.md "Runtime").

It runs what the pipeline's generate and order stages made (``pipeline.compile_plan``): a list of
steps in an order that respects every dependence of the contracted graph (``order_steps``, Kahn's
algorithm over the steps, with in-place updates after every reader of the old value):

- *kernel*: one generated kernel per pattern (``codegen.generate`` with the schedule the plan
  carries); on a GPU it is launched on the current stream (``runtime/program.py``), on a CPU it
  runs in the NumPy simulator, so CI exercises the same plan and the same kernels;
- *library*: a GEMM above the small-dot threshold (``torch.matmul`` on the operands permuted to
  batch × M × K and batch × K × N, i.e. cuBLAS on a GPU), a library op (its ``torch.ops``
  callable), or a node no kernel could be built for; on a CPU all of them go through
  ``graph.reference``;
- *view*: a reshape, transpose, broadcast or slice executed as layout metadata (``reshape``,
  ``permute``, ``expand``, indexing): no kernel, no copy.

Inputs are the graph's parameters in order; outputs follow ``graph.outputs``. An output that
overwrites an input (``graph.mutations``) is written into that input tensor, unless the kernel
already wrote it in place. Outputs whose value is a view come back with the strides the graph
promised (``graph.output_layouts``), copied into such a tensor when the view's strides differ.

On a GPU the steps run as a ``runtime.program.GpuProgram`` prepared once per device (the lean launch
path), or, with ``mode="reduce-overhead"``, replayed from a CUDA graph (``GraphedProgram``). ``CompiledGraph.counts`` tells how many kernels, library calls and views ran.
"""

from __future__ import annotations

import math
import threading
import time
import warnings
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from fusionstitching._host import timed
from fusionstitching.codegen.generate import GeneratedKernel
from fusionstitching.fusion.plan import FusionPlan
from fusionstitching.graph import reference
from fusionstitching.graph.graph import Graph, Node
from fusionstitching.graph.node import contiguous_strides
from fusionstitching.graph.ops import Category
from fusionstitching.graph.torch_dtypes import DTYPE_TO_TORCH
from fusionstitching.options import Options
from fusionstitching.runtime.library_call import library_function
from fusionstitching.runtime.program import GpuProgram, GraphedProgram, dot_function, view_function


@dataclass(frozen=True)
class Step:
    kind: str  # "kernel", "library" or "view"
    nodes: tuple[Node, ...]
    kernel: GeneratedKernel | None = None

    @property
    def inputs(self) -> tuple[Node, ...]:
        if self.kernel is not None:
            return tuple(self.kernel.lowered.pattern.inputs)
        return tuple(dict.fromkeys(self.nodes[0].operands))

    @property
    def outputs(self) -> tuple[Node, ...]:
        if self.kernel is not None:
            return tuple(self.kernel.lowered.pattern.outputs)
        return self.nodes


class CompiledGraph:
    """The steps of a plan, runnable on NumPy arrays (``run_numpy``) or torch tensors (call)."""

    def __init__(self, plan: FusionPlan, steps: Sequence[Step], mode: str | None = None,
                 options: Options | None = None, device: Any = None,
                 output_devices: Sequence[Any] | None = None) -> None:
        """``steps``: the plan's steps, generated and in an order that ``order_steps`` accepts
        (``pipeline.compile_plan`` makes them). ``device``: where the graph runs (a
        ``torch.device``), whatever its inputs' devices; by default where its inputs with dims are.
        ``output_devices``: per output, the device the caller expects it on (None: where the graph
        runs); an output computed elsewhere is moved there after the call."""
        if mode not in (None, "default", "reduce-overhead"):
            raise ValueError(f"CompiledGraph: unknown mode {mode!r}; known: None, 'reduce-overhead'")
        self.mode = mode
        self.device = device
        self._moves = [(k, d) for k, d in enumerate(output_devices or ())
                       if d is not None and device is not None and d != device]
        self.options = options or Options()
        self._lock = threading.Lock()
        self.plan = plan
        self.graph: Graph = plan.graph
        self.steps = list(steps)
        self._cpu_counts: Counter[str] = Counter()
        self._constants: dict[Any, Any] = {}
        self._programs: dict[Any, GpuProgram | GraphedProgram] = {}
        self._checked: list | None = None
        self._elsewhere: list[int] | None = None  # inputs on another device than the call's (copied there and back)
        self._reusable: set[int] | None = None  # inputs whose device copy a later call may reuse (``_moved``)
        self._kept_moves: dict[int, tuple[Any, Any, Any]] = {}  # input -> (dtype, value, device copy)
        self._library_only: set[int] | None = None  # inputs only library calls read (``_to_move``)
        self._trusted: GpuProgram | GraphedProgram | None = None  # the program of trusted calls
        self.calls = 0  # GPU calls
        self._layout_checks: list[tuple[int, tuple[int, ...], int]] | None = None
        self._old_values = _old_value_outputs(self.graph, self.steps)
        self.compile_seconds = 0.0  # exploration and code generation (set by ``pipeline.compile_graph``)
        self.shared_kernels = 0  # kernels that run another specialization's compiled code (``codegen/size_args.py``)
        self._tuned = False  # whether the first GPU call chose the schedules (``_run_tuning``)
        self._settled = False  # whether the kernels' templates are final (``settled``)
        self.tuning: Any = None  # that call's Tuner: what was measured or read from the library
        # The first GPU call reads the performance library and measures nothing, not even a
        # survey: the call that takes over from a background compile (``Options.async_compile``).
        self.library_only = False
        # Kernels handed to NVRTC as they were generated (``pipeline.compile_plan``): waited for by
        # the first ``prepare``.
        self.compiling: Any = None

    @property
    def counts(self) -> Counter[str]:
        """Steps run so far, by kind (kernel, library, view)."""
        per_call = Counter(step.kind for step in self.steps)
        return self._cpu_counts + Counter({kind: n * self.calls for kind, n in per_call.items()})

    @property
    def kernels(self) -> list[GeneratedKernel]:
        return [s.kernel for s in self.steps if s.kernel is not None]

    @property
    def settled(self) -> bool:
        """Whether the kernels' templates are final: the graph does not run on a GPU with tuning
        on, or its first GPU call has chosen them."""
        on_gpu = self.device is not None and getattr(self.device, "type", None) == "cuda"
        return self._settled or not on_gpu or self.options.tune == "off"

    def kept_templates(self) -> dict[frozenset[str], str]:
        """Per pattern (its node names), the ``schedule.tune.form`` of the template its kernel runs:
        what a specialization of the same shape class keeps (``explore.transfer``). Where the first
        GPU call tuned, only the patterns it decided (measured, read from the library, or kept,
        ``Tuner.decided``): one its budget left to the model, or one passed over at the latency
        floor at these sizes, stays open for the next specialization of the class to judge."""
        from fusionstitching.schedule.tune import canonical, form

        position = self.graph.index.position
        kept = {}
        for kernel in self.kernels:
            if self.tuning is not None and not self.tuning.decided(kernel):
                continue
            nodes = sorted(kernel.lowered.pattern.nodes, key=position.__getitem__)
            kept[frozenset(n.name for n in nodes)] = form(canonical(kernel.template, nodes))
        return kept

    # -- NumPy (CPU: simulated kernels) ------------------------------------------------------
    def run_numpy(self, inputs: Sequence[Any]) -> list[np.ndarray | None]:
        values = self._simulate(inputs)
        returned = self.graph.outputs[: len(self.graph.outputs) - self.graph.checks]
        return [None if out is None else np.array(values[out], order="C") for out in returned]

    def _simulate(self, inputs: Sequence[Any]) -> dict[Node, np.ndarray]:
        """Every node's value: kernels in the simulator, the other steps through the reference."""
        graph = self.graph
        if len(inputs) != len(graph.parameters):
            raise ValueError(f"{graph.name} takes {len(graph.parameters)} inputs, got {len(inputs)}")
        values: dict[Node, np.ndarray] = {p: np.asarray(x) for p, x in zip(graph.parameters, inputs)}
        for node in graph.nodes:
            if node.op == "constant":
                values[node] = np.asarray(node.attrs["value"])
        for step in self.steps:
            self._cpu_counts[step.kind] += 1
            if step.kernel is not None:
                results = step.kernel.simulate([values[x] for x in step.inputs])
                values.update(zip(step.outputs, results))
                # an update written in place replaces the input's value for the steps after it, as
                # on a GPU (a step still reading the old value there reads the new one here too)
                for k, j in step.kernel.lowered.aliases.items():
                    values[step.inputs[j]] = results[k]
            elif len(step.nodes) > 1:  # the outputs of one library call
                results = _op_error(reference.evaluate_library, step.nodes, [values[x] for x in step.inputs])
                values.update(zip(step.nodes, results))
            else:
                node = step.nodes[0]
                with np.errstate(all="ignore"):
                    values[node] = _op_error(reference.evaluate_node, node, [values[x] for x in node.operands])
        return values

    # -- torch tensors -------------------------------------------------------------------------
    def __call__(self, *tensors: Any) -> list[Any]:
        return self.run(tensors)

    def run(self, tensors: Sequence[Any], trusted: bool = False) -> list[Any]:
        """Outputs for ``tensors`` (in ``graph.parameters`` order). On a GPU the prepared program
        runs; its inputs are checked against the parameters' shapes, strides and dtypes when they
        differ from the last checked call, unless the caller vouches for them (``trusted``).
        Calls from several threads run one at a time: the program's kept buffers and each
        kernel's prepacked arguments belong to one call at a time."""
        with self._lock:
            return self._run(tensors, trusted)

    def _run(self, tensors: Sequence[Any], trusted: bool) -> list[Any]:
        outputs = self._run_here(tensors, trusted)
        for k, device in self._moves:
            if outputs[k] is not None:
                outputs[k] = outputs[k].to(device)
        return outputs

    def _run_here(self, tensors: Sequence[Any], trusted: bool) -> list[Any]:
        import torch

        graph = self.graph
        if len(tensors) != len(graph.parameters):
            raise ValueError(f"{graph.name} takes {len(graph.parameters)} inputs, got {len(tensors)}")
        if trusted and self._trusted is not None:  # a trusted caller keeps its devices from call to call
            program = self._trusted
        else:
            # the caller's device, else that of the tensors with dims, else of any CUDA tensor: a
            # graph of 0-d tensors only (the backward of scalar arithmetic) runs on their GPU, not
            # on the host
            device = self.device if self.device is not None else next(
                (t.device for t in tensors if isinstance(t, torch.Tensor) and t.dim() > 0),
                next((t.device for t in tensors if isinstance(t, torch.Tensor) and t.is_cuda),
                     torch.device("cpu")))
            if device.type != "cuda":
                return self._call_on_cpu(tensors)
            if not trusted:
                self._check_inputs(tensors, device)
            elif self._elsewhere is None:
                self._elsewhere = self._to_move(tensors, device)
            program = self.prepare(device)
            if trusted:
                self._trusted = program
        originals = tensors
        if self._elsewhere:  # 0-dim CPU tensors among CUDA ones (e.g. torch.optim's step counts)
            tensors = list(tensors)
            for k in self._elsewhere:
                tensors[k] = self._moved(k, tensors[k], program.device)
        self.calls += 1
        if self._tuned or program.device.type != "cuda" or self.options.tune == "off" \
                or torch.cuda.is_current_stream_capturing():
            return self._finish(originals, program.run(tensors))
        with timed("tuning"):
            outputs = self._run_tuning(program, tensors)
        return self._finish(originals, outputs)

    def prepare(self, device: Any) -> GpuProgram | GraphedProgram:
        """The program for CUDA ``device``, made (its kernels compiled by NVRTC) at the first ask; a
        background compile (``Options.async_compile``) asks before the first call."""
        program = self._programs.get(device)
        if program is None:
            start = time.perf_counter()
            with timed("nvrtc"):
                if self.compiling is not None:  # the kernels compiled while they were generated
                    self.compiling.wait(self.kernels)
                    self.compiling.close()
                    self.compiling = None
                program = GpuProgram(self.graph, self.steps, device, self._constant, _library_function, self.options)
            self.compile_seconds += time.perf_counter() - start  # NVRTC (``precompile``)
            if self.mode == "reduce-overhead":
                program = GraphedProgram(program)
            self._programs[device] = program
        return program

    def _run_tuning(self, program: GpuProgram | GraphedProgram, tensors: Sequence[Any]) -> list[Any]:
        """The first GPU call: each kernel's schedule is chosen as it comes (``runtime/tuner.py``),
        then the steps hold the chosen kernels. A failure of tuning itself (not of a kernel's run)
        leaves the plan's kernels, with a warning, unless the options are strict."""
        import warnings

        from fusionstitching.runtime.tuner import TuningWarning, gpu_tuner

        self._tuned = True
        try:
            characters = sum(len(k.cuda_source) for k in self.kernels if k._twin is None) or 1
            budget_s = 0.0 if self.library_only else \
                max(self.options.tune_budget * self.compile_seconds, self.options.tune_min_seconds)
            tuner = gpu_tuner(self.graph, self.options, program.device, budget_s=budget_s,
                              seconds_per_character=self.compile_seconds / characters, kept=self.plan.kept)
        except Exception as err:
            if self.options.strict:
                raise
            warnings.warn(f"{self.graph.name}: schedule tuning unavailable ({err}); running the plan's "
                          f"templates", TuningWarning, stacklevel=3)
            self._settled = True
            return program.run(tensors)
        tuner.prioritize(program.kernels)
        if not self.library_only and tuner.leaves_out():
            try:
                surveyed = self._survey(program, tensors, tuner)
            except Exception as err:  # the budget then goes by the latency evaluator's order
                if self.options.strict:
                    raise
                warnings.warn(f"{self.graph.name}: the tuning survey failed ({err}); the budget goes by the "
                              f"model's times", TuningWarning, stacklevel=3)
                surveyed = False
            if surveyed:
                tuner.prioritize(program.kernels)
        try:
            outputs = program.run(tensors, tuner)
        finally:
            tuner.finish()
        chosen = iter(program.kernels)
        self.steps = [Step(s.kind, s.nodes, next(chosen)) if s.kernel is not None else s for s in self.steps]
        self.tuning = tuner
        self._settled = True
        return outputs

    def _survey(self, program: GpuProgram | GraphedProgram, tensors: Sequence[Any], tuner: Any) -> bool:
        """Run the program once with ``tuner.survey_kernel`` timing each pattern's kernel, when the
        budget cannot measure every pattern: the budget then goes to the patterns measured furthest
        from a copy's time. The run leaves the call as it was: the parameters the program updates in
        place are scratch copies (no survey where they do not fit in half the free memory) and
        torch's random-number state is restored. Whether the survey ran."""
        import torch

        from fusionstitching.runtime.tuner import Survey

        targets = sorted(set(self.graph.mutations.values()))
        scratch = list(tensors)
        if targets:
            need = sum(tensors[k].numel() * tensors[k].element_size() for k in targets)
            free, _ = torch.cuda.mem_get_info(program.device)
            if 2 * need > free:
                return False
            for k in targets:  # with the strides the kernels were compiled for, views included
                t = tensors[k]
                scratch[k] = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=t.device).copy_(t)
        eager = program.program if isinstance(program, GraphedProgram) else program  # not a call it counts
        with torch.random.fork_rng(devices=[program.device]):
            eager.run(scratch, Survey(tuner))
        return True

    def _moved(self, k: int, tensor: Any, device: Any) -> Any:
        """Input ``k``'s ``tensor`` on ``device``. A 0-d input the graph neither updates nor returns
        whose value (bit for bit) and dtype the last call moved takes that call's copy: the float
        attributes of a model traced with dynamic shapes (an epsilon, a scale) arrive as 0-d CPU
        tensors, and each would otherwise cost a host-to-device copy per call and layer."""
        if tensor.dim() != 0:
            return tensor.to(device)
        if self._reusable is None:
            returned = {id(o) for o in self.graph.outputs if o is not None}
            mutated = set(self.graph.mutations.values())
            self._reusable = {i for i, p in enumerate(self.graph.parameters) if i not in mutated and id(p) not in returned}
        if k not in self._reusable:
            return tensor.to(device)
        value = tensor.item()
        kept = self._kept_moves.get(k)
        if kept is not None and kept[0] == tensor.dtype and _same_number(kept[1], value) and kept[2].device == device:
            return kept[2]
        moved = tensor.to(device)
        self._kept_moves[k] = (tensor.dtype, value, moved)
        return moved

    def _to_move(self, tensors: Sequence[Any], device: Any) -> list[int]:
        """The inputs on another device than the call's that steps need there: all but the 0-d ones
        that only library calls read, which take them where eager has them (torch ops take a 0-d
        CPU tensor among GPU ones; efficient attention's backward reads its dropout seed and
        offset on the host, and a device pointer read there is a segfault)."""
        if self._library_only is None:
            readers: dict[Node, set[str]] = {}
            for step in self.steps:
                for x in step.inputs:
                    readers.setdefault(x, set()).add(step.kind)
            self._library_only = {k for k, p in enumerate(self.graph.parameters) if readers.get(p) == {"library"}}
        return [k for k, t in enumerate(tensors)
                if t.device != device and not (t.dim() == 0 and k in self._library_only)]

    def _check_inputs(self, tensors: Sequence[Any], device: Any) -> None:
        signature = [(tuple(t.shape), t.stride(), t.dtype, t.device) for t in tensors]
        if signature == self._checked:
            return
        self._elsewhere = self._to_move(tensors, device)
        for node, t in zip(self.graph.parameters, tensors):
            expected = DTYPE_TO_TORCH[node.dtype]
            if tuple(t.shape) != node.shape or t.dtype != expected:
                raise ValueError(f"{self.graph.name}: input {node.name} must be {expected}{list(node.shape)}, "
                                 f"got {t.dtype}{list(t.shape)}")
            layout = node.layout
            if layout is not None and t.numel() > 1 and any(
                    size > 1 and a != b for size, a, b in zip(t.shape, t.stride(), layout.strides)):
                raise ValueError(f"{self.graph.name}: input {node.name} has strides {tuple(t.stride())}, the "
                                 f"graph was compiled for {layout.strides}")
        self._checked = signature

    def _call_on_cpu(self, tensors: Sequence[Any]) -> list[Any]:
        import torch

        from fusionstitching.graph.torch_dtypes import DTYPE_TO_TORCH

        arrays = [_to_numpy(t, p) for t, p in zip(tensors, self.graph.parameters)]
        values = self._simulate(arrays)
        views = {step.nodes[0] for step in self.steps if step.kind == "view"}
        made: dict[Node, Any] = dict(zip(self.graph.parameters, tensors))

        def tensor_of(node: Node) -> Any:
            """A view step's value is a view of its operand's tensor, as on the GPU: outputs that
            alias one another (``y, y.view(-1)``) share storage, as eager's do."""
            if node not in made:
                if node in views:
                    made[node] = view_function(node)(tensor_of(node.operands[0]))
                else:
                    value = np.array(values[node], dtype=np.float32 if node.dtype.is_half else values[node].dtype)
                    made[node] = torch.from_numpy(value).to(DTYPE_TO_TORCH[node.dtype])
            return made[node]

        outputs = [None if out is None else tensor_of(out) for out in self.graph.outputs]
        return self._finish(tensors, outputs)

    def _finish(self, tensors: Sequence[Any], outputs: list[Any]) -> list[Any]:
        graph = self.graph
        for k in self._old_values:  # read before the updates below overwrite what they view
            if outputs[k] is not None:
                outputs[k] = outputs[k].clone()
        for out_index, param_index in graph.mutations.items():
            target, value = tensors[param_index], outputs[out_index]
            if value is not None and value is not target:
                target.copy_(value)
            outputs[out_index] = target
        if self._layout_checks is None:
            self._layout_checks = _layout_checks(graph, self.steps)
        for k, strides, offset in self._layout_checks:
            value = outputs[k]
            if value is not None and (value.storage_offset() != offset
                                      or tuple(value.stride()) != strides and value.numel() > 1):
                outputs[k] = reference.with_strides(value, strides, offset)
        return outputs[: len(outputs) - graph.checks]

    def _constant(self, node: Node, device: Any) -> Any:
        key = (node.name, str(device))
        if key not in self._constants:
            self._constants[key] = _from_numpy(np.asarray(node.attrs["value"]), node).to(device)
        return self._constants[key]


def _same_number(a: Any, b: Any) -> bool:
    """Whether two values of ``Tensor.item()`` are the same bits: NaN is never reused, and 0.0 is
    not -0.0."""
    if isinstance(a, float) or isinstance(b, float):
        return a == b and math.copysign(1.0, a) == math.copysign(1.0, b)
    return a == b


def _op_error(evaluate: Callable[..., Any], *args: Any) -> Any:
    """``evaluate(*args)``; an error a library op raised itself (torch's ``RuntimeError`` or ``IndexError``
    on the user's input, as eager raises it) propagates as that error, with the node named in a
    note, not wrapped as the reference's ``EvaluationError``."""
    try:
        return evaluate(*args)
    except reference.EvaluationError as err:
        cause = err.__cause__
        if isinstance(cause, (RuntimeError, IndexError)):
            cause.add_note(str(err))
            raise cause from None
        raise


# ----------------------------------------------------------------------------------------------
# Steps
# ----------------------------------------------------------------------------------------------


def _layout_checks(graph: Graph, steps: Sequence[Step]) -> list[tuple[int, tuple[int, ...], int]]:
    """(output index, promised strides, promised storage offset) of the outputs whose layout a call
    must check: those with a promised layout, except mutations (written into their input) and new
    kernel outputs promised contiguous at offset 0 (every kernel allocates its new outputs so). The
    offset is checked too: an output that aliases an input is rebuilt by AOTAutograd from the
    returned tensor's size, strides and offset. A training graph's forward has a hundred outputs;
    checking each on every call cost a µs apiece."""
    made = {o for s in steps if s.kernel is not None
            for k, o in enumerate(s.outputs) if k not in s.kernel.lowered.aliases}
    checks = []
    for k, (out, layout) in enumerate(zip(graph.outputs, graph.output_layouts)):
        if layout is None or out is None or k in graph.mutations:
            continue
        if layout.offset == 0 and (len(out.shape) < 1 or out in made
                                   and tuple(layout.strides) == contiguous_strides(out.shape)):
            continue
        checks.append((k, tuple(layout.strides), layout.offset))
    return checks


class InPlaceCycle(Exception):
    """In-place updates ``order_steps`` cannot order: the kernels of ``writers`` must write new
    buffers, copied into their inputs after them (``pipeline.ordered_steps`` generates them again)."""

    def __init__(self, writers: frozenset[str], why: str = "in cycles") -> None:
        super().__init__(f"in-place updates {why}: {sorted(writers)}")
        self.writers = writers


def _parameter_bases(graph: Graph, steps: Sequence[Step]) -> dict[Node, Node]:
    """The parameter each parameter and each view step of a parameter shares storage with."""
    base: dict[Node, Node] = {p: p for p in graph.parameters}
    for step in steps:
        if step.kind == "view" and step.nodes[0].operands and step.nodes[0].operands[0] in base:
            base[step.nodes[0]] = base[step.nodes[0].operands[0]]
    return base


def _old_value_outputs(graph: Graph, steps: Sequence[Step]) -> list[int]:
    """Outputs that are an input updated by this graph, or a view of one: in the functional graph they
    are the input's old value (``a.copy_(b); b.mul_(2)`` gives a b's old value), so a call returns
    them read before the updates are copied in."""
    base = _parameter_bases(graph, steps)
    updated = {graph.parameters[p]: p for p in graph.mutations.values()}
    return [k for k, out in enumerate(graph.outputs)
            if out in base and base[out] in updated and graph.mutations.get(k) != updated[base[out]]]


def order_steps(graph: Graph, steps: list[Step]) -> list[Step]:
    """Steps in an order where every step runs after the steps producing its inputs."""
    producer: dict[Node, int] = {}
    for k, step in enumerate(steps):
        for node in step.nodes:
            producer[node] = k
    position = graph.index.position
    needs: list[set[int]] = []
    users: dict[int, list[int]] = {k: [] for k in range(len(steps))}
    for k, step in enumerate(steps):
        deps = {producer[x] for n in step.nodes for x in n.operands if x in producer and producer[x] != k}
        needs.append(deps)
    # A kernel that overwrites a parameter in place runs after every other step that reads the
    # parameter's old value, directly or through a view of it. One whose parameter's old value is
    # itself an output writes a new buffer instead: no step would read that value in time.
    base = _parameter_bases(graph, steps)
    returned = {base[out] for out in graph.outputs if out in base}
    writers, refused = set(), set()
    for w, writer in enumerate(steps):
        if writer.kernel is None:
            continue
        for j in writer.kernel.lowered.aliases.values():
            target = writer.inputs[j]
            if target in returned:
                refused.add(writer.nodes[0].name)
            for r, reader in enumerate(steps):
                if r != w and any(base.get(x) is target for x in reader.inputs):
                    needs[w].add(r)
                    writers.add(writer.nodes[0].name)
    if refused:
        raise InPlaceCycle(frozenset(refused), "whose input's old value is an output")
    for k, deps in enumerate(needs):
        for d in deps:
            users[d].append(k)
    pending = [len(d) for d in needs]
    ready = sorted((k for k in range(len(steps)) if pending[k] == 0), key=lambda k: position[steps[k].nodes[0]])
    order = []
    while ready:
        k = ready.pop(0)
        order.append(steps[k])
        for u in users[k]:
            pending[u] -= 1
            if pending[u] == 0:
                ready.append(u)
    if len(order) != len(steps):
        if writers:  # an in-place update must wait for a reader of the old value that waits for it
            raise InPlaceCycle(frozenset(writers))
        raise RuntimeError(f"plan for {graph.name}: the steps have a cyclic dependence")
    missing = [n.name for n in graph.nodes if n not in producer
               and n.category not in (Category.PARAMETER, Category.CONSTANT)]
    if missing:
        raise RuntimeError(f"plan for {graph.name} leaves nodes without a step: {missing[:5]}")
    return order


# ----------------------------------------------------------------------------------------------
# torch execution of views and library calls
# ----------------------------------------------------------------------------------------------


class HostFallbackWarning(UserWarning):
    """A node of a GPU program runs on the host (NumPy), outside any kernel or library call."""


def _library_function(node: Node, siblings: Sequence[int] = (),
                      transposed: Mapping[int, tuple[int, ...]] | None = None) -> Callable[..., Any]:
    """How a library step runs on a GPU: a GEMM through ``torch.matmul``, a library op through its
    ``torch.ops`` callable, a node no kernel could be built for through the reference (NumPy).
    ``siblings``: the output indices of a multi-output op the step returns (a list of tensors).
    ``transposed``: operands the program would pass through a transpose of this permutation
    (``library_call.library_function``; the returned function's ``undone`` names those it takes
    untransposed)."""
    import torch

    siblings = list(siblings) or [node.attrs.get("out_index", -1)]

    if node.op == "dot_general":
        return dot_function(node)
    if node.op == "library":
        target = reference.resolve_library_target(node.attrs["target"])
        call, index = node.attrs["call"], node.attrs["out_index"]
        fill = _filled_destination(node)
        if fill is not None:
            target = torch.ops.aten.index_put_.default

        return library_function(call, target, len(node.operands), index, siblings, fill, transposed)

    if node.op == "reduce" and node.operands[0].dtype.is_float:
        return _torch_reduce(node)

    warnings.warn(f"{node.name} ({node.op} {list(node.shape)} {node.dtype.value}): no kernel could be built for "
                  "it; it runs on the host through the reference semantics (NumPy), copying its operands "
                  "from the GPU at every call", HostFallbackWarning, stacklevel=2)

    def on_host(*args: Any) -> Any:
        arrays = [_to_numpy(a, x) for a, x in zip(args, node.operands)]
        value = reference.evaluate_node(node, arrays)
        return _from_numpy(value, node).to(args[0].device if args else "cpu")

    on_host.on_host = True  # GraphedProgram: not capturable
    return on_host


def _torch_reduce(node: Node) -> Callable[[Any], Any]:
    """A float reduce no kernel was built for, run by torch on the tensor's device in the reduce's
    compute type (as the reference does), not through NumPy on the host."""
    import torch

    from fusionstitching.graph.torch_dtypes import DTYPE_TO_TORCH

    dims, kind = tuple(node.attrs["dims"]), node.attrs["kind"]
    compute, dtype = DTYPE_TO_TORCH[node.operands[0].dtype.compute], DTYPE_TO_TORCH[node.dtype]
    empty = any(node.operands[0].shape[d] == 0 for d in dims)

    def reduce(x: Any) -> Any:
        x = x.to(compute)
        if not dims:
            out = x.clone()
        elif kind == "sum":
            out = x.sum(dims)
        elif kind == "prod":
            out = x
            for d in sorted(dims, reverse=True):
                out = out.prod(d)
        elif empty:  # the identity of max / min, as the reference's ``initial``
            out = torch.full(node.shape, -math.inf if kind == "max" else math.inf, dtype=compute, device=x.device)
        else:
            out = x.amax(dims) if kind == "max" else x.amin(dims)
        return out.to(dtype)

    return reduce


def _filled_destination(node: Node) -> float | int | bool | None:
    """The scalar whose broadcast an ``index_put`` puts into, when its destination is one (an
    embedding gradient: ``index_put(zeros, [ids], grad, accumulate=True)``). torch's functional
    op first clones its destination; cloning a broadcast runs an elementwise copy from a stride-0
    tensor, where ``torch.full`` writes the same bytes with a vectorized fill and the put then runs
    in place on it."""
    if node.attrs.get("target") != "aten.index_put.default":
        return None
    args = node.attrs["call"].get("args", [])
    if not args or not isinstance(args[0], dict) or args[0].get("operand") != 0 or node.attrs["out_index"] >= 0:
        return None
    dest = node.operands[0]
    while dest.op in ("broadcast_in_dim", "reshape"):
        dest = dest.operands[0]
    if dest.op != "constant" or node.operands[0].op != "broadcast_in_dim":
        return None
    value = np.asarray(dest.attrs["value"])
    return value.item() if value.size == 1 else None


def _to_numpy(tensor: Any, node: Node) -> np.ndarray:
    import torch

    if not isinstance(tensor, torch.Tensor):
        return np.asarray(tensor, dtype=node.dtype.numpy)
    t = tensor.detach().cpu()
    if t.dtype == torch.bfloat16:
        return t.float().numpy().astype(node.dtype.numpy)
    return reference.host_array(t)


def _from_numpy(array: np.ndarray, node: Node) -> Any:
    import torch

    from fusionstitching.graph.torch_dtypes import DTYPE_TO_TORCH

    if node.dtype.is_half:
        return torch.from_numpy(np.asarray(array, dtype=np.float32).copy()).to(DTYPE_TO_TORCH[node.dtype])
    return torch.from_numpy(np.array(array, order="C"))
