"""The GPU path of a CompiledGraph: its steps prepared once per device, run as a short loop.

Lean launch path (DESIGN.md "Runtime"). Preparing a program numbers every value (parameters,
constants, step outputs) with a slot, and turns each step into a small callable object holding
what does not change between calls: its input and output slots, the shapes and dtypes of the
outputs it allocates, and, for a kernel, its loaded launcher. A call then only

- reads the pointers of this call's tensors and rewrites the ones that changed in the launcher's
  prepacked argument array (``LoadedKernel.launch``);
- allocates the outputs that leave the call from the torch caching allocator (outputs used only
  inside the call keep their buffers from one call to the next, so their pointers never change);
- launches on the stream that was current when the call began.

Preparing also compiles every kernel not yet compiled, in parallel (``kernel_call.precompile``).
The first call of each kernel goes through ``GeneratedKernel.__call__`` (full input checks, module
load); later calls skip the checks, which is sound because the
program's inputs are checked once per call by ``CompiledGraph`` (or guaranteed by the backend's
shape signature) and every other value is produced by the program itself. A kernel with 16-byte
vector accesses falls back to its scalar variant when a pointer is misaligned, as
``call_generated`` does.
"""

from __future__ import annotations

import ctypes
import math
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch

from fusionstitching.graph.graph import Graph, Node
from fusionstitching.graph.node import contiguous_strides
from fusionstitching.graph.torch_dtypes import DTYPE_TO_TORCH
from fusionstitching.options import Options
from fusionstitching.runtime import unrolled
from fusionstitching.runtime.kernel_call import call_generated, loaded
from fusionstitching.runtime.launch import _current_stream as current_stream

_ALIGNMENT_MASK = 15

# torch's CUDA builds allocate a tensor on the current device without parsing Python arguments
# (Inductor's generated code allocates with it; it is cheaper than ``torch.empty``);
# CPU builds lack the device query, and then every allocation goes through ``torch.empty``.
try:
    from torch._C._dynamo.guards import _empty_strided_cuda
except ImportError:
    _empty_strided_cuda = None
_current_device = getattr(torch._C, "_cuda_getDevice", None)


# The bytes each generated kernel has to move, by kernel name: every input read once and every
# output written once. Reports (``bench --top``) set them against a copy of the same size. None
# where kernels of one name move different amounts.
KERNEL_BYTES: dict[str, int | None] = {}


def record_bytes(kernel: Any) -> None:
    moved = kernel.moved_bytes
    KERNEL_BYTES[kernel.name] = moved if KERNEL_BYTES.get(kernel.name, moved) == moved else None


class OutputSpec(NamedTuple):
    """How a kernel's output is made: a new contiguous tensor of ``shape``, ``strides`` and
    ``dtype``, or, where ``alias`` >= 0, the input at that position, written in place."""

    shape: tuple[int, ...]
    strides: tuple[int, ...]
    dtype: torch.dtype
    alias: int


class KernelOp:
    """One generated kernel of the program."""

    kind = "kernel"

    def __init__(self, kernel, in_slots: list[int], out_slots: list[int], contiguous: list[int],
                 device: torch.device, kept: set[int] = frozenset(),
                 reshaped: dict[int, tuple[int, ...]] | None = None, options: Options | None = None) -> None:
        self.kernel = kernel
        options = options or Options()
        self.cache = {"cache_dir": options.cache_dir, "cache_max_bytes": options.cache_max_bytes}
        self.in_slots = in_slots
        # Inputs read through a reshape view without a step of its own (``_kernel_reshapes``): the
        # slot holds the view's operand, made contiguous before the launch, so its pointer is the
        # view's. Only the checked paths (first call, scalar variant) see the view's shape.
        self.reshaped = reshaped or {}
        self.out_slots = out_slots
        self.contiguous = contiguous  # input positions produced by library calls or views: checked
        self.device = device
        aliases = kernel.lowered.aliases
        self.outputs = [OutputSpec(tuple(n.shape), contiguous_strides(n.shape), DTYPE_TO_TORCH[n.dtype],
                                   aliases.get(k, -1)) for k, n in enumerate(kernel.lowered.pattern.outputs)]
        self.kept = [slot in kept and aliases.get(k, -1) < 0 for k, slot in enumerate(out_slots)]
        self.buffers: list[Any] = [None] * len(out_slots)  # kept outputs, allocated once
        self.fixed: list[Any] | None = None  # the outputs, once every one is a kept buffer
        self.launcher = None
        self.has_scalar_variant = kernel._scalar_variant is not None
        record_bytes(kernel)

    def __call__(self, slots: list[Any], stream: int, here: bool = False) -> None:
        """Run on ``stream``; ``here``: the program's device is the current one (allocate there
        without naming it)."""
        inputs = [slots[i] for i in self.in_slots]
        for k in self.contiguous:
            if not inputs[k].is_contiguous():
                inputs[k] = inputs[k].contiguous()
        launcher = self.launcher
        if launcher is None:
            outputs = call_generated(self.kernel, self._viewed(inputs), **self.cache)
            self.launcher = loaded(self.kernel).launchers.get(self.device)
        else:
            outputs = self.fixed if self.fixed is not None else self._outputs(inputs, here)
            pointers = [t.data_ptr() for t in outputs] + [t.data_ptr() for t in inputs]
            # Pointers equal to the last launch's were aligned then (the usual case: kept buffers).
            if self.has_scalar_variant and pointers != launcher._last and any(p & _ALIGNMENT_MASK for p in pointers):
                self.misaligned(inputs, outputs)
            else:
                launcher.launch(pointers, stream)
        for slot, tensor in zip(self.out_slots, outputs):
            slots[slot] = tensor

    def misaligned(self, inputs: list[Any], outputs: list[Any]) -> None:
        """Run on ``inputs`` into ``outputs`` where a pointer is not 16-byte aligned: the kernel's
        scalar variant (``call_generated`` chooses it)."""
        call_generated(self.kernel, self._viewed(inputs), outputs, **self.cache)

    def retune(self, tuner: Any, slots: list[Any]) -> None:
        """Let ``tuner`` (``runtime.tuner.Tuner``) choose this op's kernel with this call's inputs."""
        inputs = [slots[i] for i in self.in_slots]
        for k in self.contiguous:
            if not inputs[k].is_contiguous():
                inputs[k] = inputs[k].contiguous()
        chosen = tuner.kernel_for(self.kernel, self._viewed(inputs))
        if chosen is not self.kernel:
            self.kernel = chosen
            self.launcher = None
            self.has_scalar_variant = chosen._scalar_variant is not None
            record_bytes(chosen)

    def _viewed(self, inputs: list[Any]) -> list[Any]:
        return [x.reshape(self.reshaped[k]) if k in self.reshaped else x for k, x in enumerate(inputs)]

    def _outputs(self, inputs: list[Any], here: bool) -> list[Any]:
        """This call's output tensors: the inputs they overwrite, kept buffers, fresh allocations."""
        device, buffers = self.device, self.buffers
        outputs = []
        for k, (shape, strides, dtype, alias) in enumerate(self.outputs):
            if alias >= 0:
                outputs.append(inputs[alias])
            elif buffers[k] is not None:
                outputs.append(buffers[k])
            else:
                if here:
                    tensor = _empty_strided_cuda(shape, strides, dtype)
                else:
                    tensor = torch.empty(shape, dtype=dtype, device=device)
                if self.kept[k]:
                    buffers[k] = tensor
                outputs.append(tensor)
        if all(self.kept):  # every output kept: the same tensors from now on
            self.fixed = outputs
        return outputs


class CallOp:
    """A library call or a view: ``fn`` applied to the input slots' tensors.

    An input may first go through views folded into the call (``views[k]``, one callable applying
    the chain): no step of its own per view. When that input is a kept buffer (``stable[k]``: the
    same tensor on every lean call, never resized or given new storage) its view is made once and
    reused while the buffer is the same object."""

    kind = "call"

    def __init__(self, fn: Callable[..., Any], in_slots: list[int], out_slot: int | list[int],
                 views: list[Callable[[Any], Any] | None] | None = None, stable: list[bool] | None = None,
                 label: str = "call") -> None:
        self.fn = fn
        self.label = label  # what the step runs, for the unrolled program's source (``runtime/unrolled.py``)
        self.in_slots = in_slots
        self.out_slot = out_slot
        self.views = views if views and any(v is not None for v in views) else None
        self.stable = stable if stable is not None else [False] * len(in_slots)
        self.seen: list[Any] = [None] * len(in_slots)  # the buffer each cached view was made from
        self.viewed: list[Any] = [None] * len(in_slots)

    def __call__(self, slots: list[Any], stream: int, here: bool = False) -> None:
        if self.views is None:
            self._store(slots, self.fn(*[slots[i] for i in self.in_slots]))
            return
        args = []
        for k, i in enumerate(self.in_slots):
            x = slots[i]
            view = self.views[k]
            if view is not None:
                if x is self.seen[k]:
                    x = self.viewed[k]
                else:
                    source, x = x, view(x)
                    if self.stable[k]:
                        self.seen[k], self.viewed[k] = source, x
            args.append(x)
        self._store(slots, self.fn(*args))

    def _store(self, slots: list[Any], result: Any) -> None:
        if isinstance(self.out_slot, int):
            slots[self.out_slot] = result
        else:  # the outputs of one call of a multi-output op
            for k, value in zip(self.out_slot, result):
                slots[k] = value


class GpuProgram:
    """A CompiledGraph's steps for one CUDA device; ``run(tensors)`` returns the graph's outputs."""

    def __init__(self, graph: Graph, steps: Sequence[Any], device: torch.device,
                 constant: Callable[[Node, Any], Any], library: Callable[[Node], Callable[..., Any]],
                 options: Options | None = None) -> None:
        options = options or Options()
        self.graph = graph
        self.device = device
        self.stream: int | None = None  # the stream of the last run (kept buffers were last used there)
        self.device_index = device.index if device.index is not None or device.type != "cuda" else torch.cuda.current_device()
        slot: dict[Node, int] = {p: k for k, p in enumerate(graph.parameters)}
        self.constants: list[tuple[int, Any]] = []
        for node in graph.nodes:
            if node.op == "constant":
                slot[node] = len(slot)
                self.constants.append((slot[node], constant(node, device)))
        for step in steps:
            for out in step.outputs:
                if out not in slot:
                    slot[out] = len(slot)
        escaping = _escaping(graph, steps)
        kept = _kept_nodes(steps, escaping)
        kept_slots = {slot[n] for n in kept}
        self.folded = _folded_views(steps, escaping)
        self.reshapes = _kernel_reshapes(steps, escaping)
        produced_by_call: set[Node] = set()
        self.ops: list[Any] = []
        for step in steps:
            if step.kernel is not None:
                sources = []
                for x in step.inputs:
                    while x in self.reshapes:
                        x = x.operands[0]
                    sources.append(x)
                reshaped = {k: tuple(x.shape) for k, x in enumerate(step.inputs) if x in self.reshapes}
                checked = [k for k, x in enumerate(sources) if x in produced_by_call or k in reshaped]
                self.ops.append(KernelOp(step.kernel, [slot[x] for x in sources], [slot[o] for o in step.outputs],
                                         checked, device, kept_slots, reshaped, options))
            elif step.nodes[0] not in self.folded and step.nodes[0] not in self.reshapes:
                node = step.nodes[0]
                sources, chains = [], []
                for x in node.operands:
                    chain = []
                    while x in self.folded:
                        chain.append(x)
                        x = x.operands[0]
                    sources.append(x)
                    chains.append(chain[::-1])
                # An operand folded from one transpose that the library call permutes back (a
                # channels-last convolution's NHWC weight or saved activation, held NCHW by its
                # parameter): the call takes the transpose's operand as it is (``library_call``).
                transposed = {k: tuple(chain[0].attrs["permutation"]) for k, chain in enumerate(chains)
                              if len(chain) == 1 and chain[0].op == "transpose"} if node.op == "library" else {}
                siblings = [n.attrs["out_index"] for n in step.nodes] if len(step.nodes) > 1 else []
                if step.kind == "view":
                    fn = view_function(node)
                elif transposed:
                    fn = library(node, siblings, transposed=transposed)
                elif siblings:  # one call of a multi-output op
                    fn = library(node, siblings)
                else:
                    fn = library(node)
                undone = getattr(fn, "undone", frozenset())  # the transposes the call permutes back
                views = [None if k in undone or not chain else _chained([view_function(v) for v in chain])
                         for k, chain in enumerate(chains)]
                out = slot[node] if len(step.nodes) == 1 else [slot[n] for n in step.nodes]
                label = f"{step.kind} {node.name} ({node.attrs.get('target', node.op)})"
                self.ops.append(CallOp(fn, [slot[x] for x in sources], out, views, [x in kept for x in sources], label))
                produced_by_call.update(step.nodes)
        from fusionstitching.runtime.kernel_call import device_arch, precompile

        if device.type == "cuda":
            precompile([op.kernel for op in self.ops if isinstance(op, KernelOp)], device_arch(device),
                       cache_dir=options.cache_dir, cache_max_bytes=options.cache_max_bytes)
        self.size = len(slot)
        # a step evaluated on the host cannot be captured into a CUDA graph
        self.capturable = not any(getattr(getattr(op, "fn", None), "on_host", False) for op in self.ops)
        self.output_slots = [None if out is None else slot[out] for out in graph.outputs]
        self.kinds = [step.kind for step in steps]
        # the run written out as one function once every kernel is loaded and every kept buffer
        # allocated (``runtime/unrolled.py``), and its source
        self.unrolled: Callable[..., list[Any]] | None = None
        self.unroll = options.unroll
        self.source = ""
        self._stream_argument = ctypes.c_void_p(None)

    def run(self, tensors: Sequence[Any], tuner: Any = None) -> list[Any]:
        """The graph's outputs for ``tensors``. With ``tuner`` (``runtime.tuner.Tuner``, at the first
        call) each kernel is chosen by it, with the call's inputs, just before it runs."""
        stream = current_stream(self.device_index) if self.device.type == "cuda" else 0
        if stream != self.stream:
            self._follow(stream)
        here = _empty_strided_cuda is not None and _current_device is not None \
            and _current_device() == self.device_index
        if tuner is None and self.unrolled is not None:
            return self.unrolled(tensors, self._stream_argument, _empty_strided_cuda if here else self._allocate)
        slots: list[Any] = [None] * self.size
        slots[: len(tensors)] = tensors
        for k, value in self.constants:
            slots[k] = value
        if tuner is None:
            for op in self.ops:
                op(slots, stream, here)
        else:
            self.unrolled = None  # the kernels may change
            for op in self.ops:
                if isinstance(op, KernelOp):
                    op.retune(tuner, slots)
                op(slots, stream, here)
        outputs = [None if k is None else slots[k] for k in self.output_slots]
        if tuner is None and self.unroll and self.device.type == "cuda" and unrolled.ready(self):
            from fusionstitching.runtime.driver import driver

            self.unrolled, self.source = unrolled.unroll(self, driver().launch_raw)
        return outputs

    def _allocate(self, shape: tuple[int, ...], strides: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """A new tensor on the program's device when it is not the current one."""
        return torch.empty_strided(shape, strides, dtype=dtype, device=self.device)

    @property
    def kernels(self) -> list[Any]:
        """The generated kernel each kernel step runs, in step order."""
        return [op.kernel for op in self.ops if isinstance(op, KernelOp)]


    def _follow(self, stream: int) -> None:
        """A run on another stream than the last one waits for the last one's work: both reuse the
        kept buffers (and a kernel's output may still be read there)."""
        # Under CUDA-graph capture the capturing stream may depend on captured work only; the
        # capture itself is ordered after the warm-up run (``GraphedProgram._capture``).
        if self.stream is not None and self.device.type == "cuda" and not torch.cuda.is_current_stream_capturing():
            torch.cuda.ExternalStream(stream, device=self.device).wait_stream(
                torch.cuda.ExternalStream(self.stream, device=self.device))
        self.stream = stream
        self._stream_argument = ctypes.c_void_p(stream or None)


def _escaping(graph: Graph, steps: Sequence[Any]) -> set[Node]:
    """Graph outputs and the values they are views of."""
    views = {step.nodes[0]: step.nodes[0].operands[0] for step in steps if step.kind == "view"}
    escaping: set[Node] = set()
    for out in graph.outputs:
        while out is not None and out not in escaping:
            escaping.add(out)
            out = views.get(out)
    return escaping


def _kept_nodes(steps: Sequence[Any], escaping: set[Node]) -> set[Node]:
    """Kernel outputs that never leave a call: not graph outputs, not seen through a view that is
    one. Their buffers are allocated on the first lean call and reused by every later call (calls
    of one program run one after another on the stream). ``escaping``: see ``_escaping``."""
    return {o for step in steps if step.kernel is not None for o in step.outputs if o not in escaping}


def _folded_views(steps: Sequence[Any], escaping: set[Node]) -> set[Node]:
    """Views evaluated inside the library calls reading them instead of as steps of their own
    (BERT's weight transposes and activation reshapes before each GEMM: two of every three host
    steps of an inference call): every reader is a library call or another folded view, and the
    value is no graph output (``escaping``)."""
    return _views_read_only_by(steps, escaping, "library")


def _kernel_reshapes(steps: Sequence[Any], escaping: set[Node]) -> set[Node]:
    """Reshape views that need no step: every reader is a kernel (or another such reshape) and
    the value is no graph output (``escaping``). A kernel takes a pointer and reads its input
    row-major, which a reshape does not change: given the operand's buffer, made contiguous where
    it is not, it reads the view's elements (the split reductions' [n] -> [parts, n / parts]
    reshapes and a loss's [rows] -> [rows, 1]: each a host step before). Kernels write in place
    only into parameters (``lower._aliases``), never into a reshape."""
    return _views_read_only_by(steps, escaping, "kernel", "reshape")


def _views_read_only_by(steps: Sequence[Any], escaping: set[Node], kind: str, op: str | None = None) -> set[Node]:
    """The view steps (of ``op``, when given) whose every reader is a step of ``kind`` or another
    view of the set, and whose value is no graph output."""
    readers: dict[Node, list[Any]] = {}
    for step in steps:
        for x in step.inputs:
            readers.setdefault(x, []).append(step)
    chosen: set[Node] = set()
    for step in reversed(steps):  # readers before the views they read
        node = step.nodes[0]
        if step.kind != "view" or (op is not None and node.op != op) or node in escaping or node not in readers:
            continue
        if all(r.kind == kind or (r.kind == "view" and r.nodes[0] in chosen) for r in readers[node]):
            chosen.add(node)
    return chosen


def _chained(functions: list[Callable[[Any], Any]]) -> Callable[[Any], Any]:
    if len(functions) == 1:
        return functions[0]

    def chain(x: Any) -> Any:
        for fn in functions:
            x = fn(x)
        return x

    return chain


def view_function(node: Node) -> Callable[[Any], Any]:
    """The torch view op for a reshape, transpose, broadcast or slice node (layout metadata only)."""
    if node.op == "slice":
        window = tuple(slice(a, b, s) for a, b, s in zip(node.attrs["start"], node.attrs["limit"], node.attrs["stride"]))
        return lambda x: x[window]
    if node.op == "reshape":
        shape = tuple(node.shape)
        return lambda x: x.reshape(shape)
    if node.op == "transpose":
        permutation = tuple(node.attrs["permutation"])
        return lambda x: x.permute(permutation)
    if node.op == "broadcast_in_dim":
        dims = node.attrs["broadcast_dimensions"]
        target = tuple(node.shape)

        def broadcast(x: Any) -> Any:
            shape = [1] * len(target)
            for d, size in zip(dims, x.shape):
                shape[d] = size
            return x.reshape(shape).expand(target)

        return broadcast
    raise ValueError(f"{node.name} ({node.op}) is not a view op")


def dot_function(node: Node) -> Callable[[Any, Any], Any]:
    """``dot_general`` as one ``torch.matmul`` (cuBLAS): operands permuted to batch x M x K and
    batch x K x N (views where the layout allows), the permutations worked out once."""
    lhs_shape, rhs_shape = node.operands[0].shape, node.operands[1].shape
    lb, rb, lc, rc = (list(node.attrs[k]) for k in ("lhs_batch", "rhs_batch", "lhs_contract", "rhs_contract"))
    lfree = [d for d in range(len(lhs_shape)) if d not in lb + lc]
    rfree = [d for d in range(len(rhs_shape)) if d not in rb + rc]
    batch = math.prod(lhs_shape[d] for d in lb)
    m, k = math.prod(lhs_shape[d] for d in lfree), math.prod(lhs_shape[d] for d in lc)
    n = math.prod(rhs_shape[d] for d in rfree)
    lhs_perm, rhs_perm = tuple(lb + lfree + lc), tuple(rb + rc + rfree)
    lhs_to = (m, k) if batch == 1 else (batch, m, k)
    rhs_to = (k, n) if batch == 1 else (batch, k, n)
    shape, dtype = tuple(node.shape), DTYPE_TO_TORCH[node.dtype]
    # Host time matters here (hundreds of GEMMs per training step): no identity permutes, torch.mm /
    # torch.bmm rather than torch.matmul's dispatch, no reshape or cast that would change nothing.
    lhs_moves, rhs_moves = lhs_perm != tuple(range(len(lhs_shape))), rhs_perm != tuple(range(len(rhs_shape)))
    product = torch.mm if batch == 1 else torch.bmm
    final = shape != (lhs_to[:-1] + rhs_to[-1:])
    lhs_fold = tuple(lhs_shape[d] for d in lhs_perm) != lhs_to
    rhs_fold = tuple(rhs_shape[d] for d in rhs_perm) != rhs_to

    # A widened half dot (``graph.transforms.widen_dots``) has cuBLAS write its f32 accumulator,
    # where torch's CUDA build offers that (``out_dtype``); elsewhere the half result is widened.
    widened = node.operands[0].dtype.is_half and dtype == torch.float32
    accumulate = [widened]
    # GEMM kernels load 16 bytes at a time only where M, K and N are multiples of 16 bytes' worth of
    # elements; otherwise cuBLAS takes a kernel of 2- or 4-byte loads (CUTLASS "align1"/"align2"),
    # several times slower on a large GEMM (a GPT-2 LM head, vocabulary 50257). Zero-padding the
    # operands to such multiples and slicing the product costs a copy of each. Which is faster is
    # measured at the first call on a GPU, for this GEMM (``_padding_pays``).
    per_vector = 16 // max(1, torch.empty((), dtype=DTYPE_TO_TORCH[node.operands[0].dtype]).element_size())
    padded_mkn = tuple(-(-d // per_vector) * per_vector for d in (m, k, n))
    padding = [None if padded_mkn != (m, k, n) else False]  # None: not measured yet

    def multiply(a: Any, b: Any) -> Any:
        if accumulate[0] and a.is_cuda:
            try:
                return product(a, b, out_dtype=dtype)
            except (TypeError, RuntimeError, NotImplementedError):
                accumulate[0] = False
        return product(a, b)

    def multiply_padded(a: Any, b: Any) -> Any:
        mp, kp, np_ = padded_mkn
        a = torch.nn.functional.pad(a, (0, kp - k, 0, mp - m))
        b = torch.nn.functional.pad(b, (0, np_ - n, 0, kp - k))
        out = multiply(a, b)
        return out[..., :m, :n].contiguous() if (mp, np_) != (m, n) else out

    def dot(lhs: Any, rhs: Any) -> Any:
        a = lhs.permute(lhs_perm) if lhs_moves else lhs
        b = rhs.permute(rhs_perm) if rhs_moves else rhs
        a = a.reshape(lhs_to) if lhs_fold else a
        b = b.reshape(rhs_to) if rhs_fold else b
        if padding[0] is None and a.is_cuda:
            if torch.cuda.is_current_stream_capturing():
                padding[0] = False
            else:
                padding[0] = _padding_pays(multiply, multiply_padded, a, b)
        out = multiply_padded(a, b) if padding[0] else multiply(a, b)
        if final:
            out = out.reshape(shape)
        return out if out.dtype == dtype else out.to(dtype)

    dot.padding = padding  # [None | bool], for tests
    return dot


def _padding_pays(plain: Callable[[Any, Any], Any], padded: Callable[[Any, Any], Any], a: Any, b: Any,
                  repeats: int = 5) -> bool:
    """Whether ``padded(a, b)`` is faster than ``plain(a, b)`` on the GPU: CUDA events around each
    call, the two alternating, the median of ``repeats`` each after one untimed call. Padding has to
    win by more than 3 %, the timing's noise (``runtime.tuner.NOISE``)."""
    import statistics

    times: dict[Any, list[float]] = {plain: [], padded: []}
    for fn in (plain, padded):
        fn(a, b)
    for _ in range(repeats):
        for fn in (plain, padded):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn(a, b)
            end.record()
            end.synchronize()
            times[fn].append(start.elapsed_time(end))
    PADDING_CHOICES["measured"] += 1
    faster = statistics.median(times[padded]) < 0.97 * statistics.median(times[plain])
    PADDING_CHOICES["padded"] += faster
    return faster


# GEMMs whose padding was measured in this process, and those that run padded.
PADDING_CHOICES = {"measured": 0, "padded": 0}


class GraphedProgram:
    """A GpuProgram replayed from a CUDA graph (``mode="reduce-overhead"``), as Inductor's CUDA-graph
    mode does: the first call runs the program eagerly (loading every kernel), the second captures
    it into a ``torch.cuda.CUDAGraph`` reading static input buffers, and every later call copies the
    inputs whose storage moved into those buffers and replays. Outputs live in the graph's memory
    pool and are overwritten by the next replay; the caller keeps what it needs."""

    def __init__(self, program: GpuProgram) -> None:
        self.program = program
        self.device = program.device
        self.graph: Any = None
        self.static_inputs: list[Any] = []
        self.static_outputs: list[Any] = []
        self.calls = 0

    @property
    def kernels(self) -> list[Any]:
        return self.program.kernels

    def run(self, tensors: Sequence[Any], tuner: Any = None) -> list[Any]:
        self.calls += 1
        if self.calls == 1 or not self.program.capturable:
            return self.program.run(tensors, tuner)
        if self.graph is None:
            self._capture(tensors)
        for static, tensor in zip(self.static_inputs, tensors):
            if static.data_ptr() != tensor.data_ptr():
                _span(static).copy_(_span(tensor))
        self.graph.replay()
        return list(self.static_outputs)

    def _capture(self, tensors: Sequence[Any]) -> None:
        # each static input has its tensor's strides (a clone of a slice or an expanded tensor would
        # be contiguous, and the kernels read the layout they were generated for)
        self.static_inputs = [_like(t) for t in tensors]
        for static, tensor in zip(self.static_inputs, tensors):
            _span(static).copy_(_span(tensor))
        stream = torch.cuda.Stream(self.program.device)
        stream.wait_stream(torch.cuda.current_stream(self.program.device))
        with torch.cuda.stream(stream):
            self.program.run(self.static_inputs)  # warm-up on the capture stream
        torch.cuda.current_stream(self.program.device).wait_stream(stream)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.static_outputs = self.program.run(self.static_inputs)


def _extent(t: torch.Tensor) -> int:
    """Elements of storage that ``t``'s shape and strides reach from its offset."""
    if t.numel() == 0:
        return 0
    return 1 + sum((n - 1) * abs(st) for n, st in zip(t.shape, t.stride()))


def _like(t: torch.Tensor) -> torch.Tensor:
    """A new tensor with ``t``'s shape, strides, dtype and device (an overlapping layout included)."""
    storage = torch.empty(_extent(t), dtype=t.dtype, device=t.device)
    return storage.as_strided(t.shape, t.stride())


def _span(t: torch.Tensor) -> torch.Tensor:
    """The storage ``t`` reaches, as one dense 1-D tensor: copying spans copies every element of a
    layout, whether or not its elements overlap."""
    return t.as_strided((_extent(t),), (1,), t.storage_offset())
