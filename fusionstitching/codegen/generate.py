"""``generate``: pattern + template → a GeneratedKernel that can be printed, simulated, compiled, run."""

from __future__ import annotations

import dataclasses
import hashlib
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from fusionstitching.codegen import cuda_c
from fusionstitching.codegen.lower import LoweredKernel, lower
from fusionstitching.codegen.simulate import simulate
from fusionstitching.codegen.values import CodegenError, FootprintError
from fusionstitching.graph.graph import Graph, Layout, Node
from fusionstitching.graph.pattern import Pattern, resolve_pattern
from fusionstitching.schedule.refusals import Reason
from fusionstitching.schedule.template import KernelSchedule, parse_template


@dataclass(eq=False)
class GeneratedKernel:
    """A pattern's kernel: its lowered Kernel IR, the template it was lowered with and its CUDA C;
    ``simulate`` runs it on NumPy, ``compile`` makes a CUBIN. Launching it on tensors, and what that
    keeps per kernel, is the runtime's (``runtime/kernel_call.py``). Kernels compare by identity."""

    lowered: LoweredKernel
    template: KernelSchedule
    cuda_source: str
    _scalar_variant: GeneratedKernel | None = field(default=None, repr=False)
    _twin: GeneratedKernel | None = field(default=None, repr=False)  # the kernel whose code this one shares
    # A kernel of a symbolic graph's specialization launched as its family's parametric kernel
    # (``codegen/size_args.py``): (that kernel, its scalar arguments packed, their values).
    _shared: tuple | None = field(default=None, repr=False)

    def twin(self, graph: Graph, nodes: Iterable[Node], template: KernelSchedule) -> GeneratedKernel:
        """This kernel for another pattern of ``graph`` with the same structure and scalar constants
        (``graph.analysis.pattern_structure``) and the same template up to names: the same CUDA
        source, so one compile and one module, with the other pattern's nodes, inputs and outputs.
        Lowering is skipped: the twelve layers of a transformer lower each of their kernels once."""
        lowered = dataclasses.replace(self.lowered, pattern=resolve_pattern(graph, nodes))
        scalar = self._scalar_variant.twin(graph, nodes, template) if self._scalar_variant is not None else None
        return GeneratedKernel(lowered, template, self.cuda_source, scalar, _twin=self)

    @property
    def name(self) -> str:
        return self.lowered.kernel.name

    @property
    def inputs(self) -> list[str]:
        return [n.name for n in self.lowered.pattern.inputs]

    @property
    def outputs(self) -> list[str]:
        return [n.name for n in self.lowered.pattern.outputs]

    @property
    def moved_bytes(self) -> int:
        """The bytes the kernel has to move: its inputs read once and its outputs written once."""
        pattern = self.lowered.pattern
        return sum(n.size * n.dtype.itemsize for n in list(pattern.inputs) + list(pattern.outputs))

    @property
    def kernel(self):
        return self.lowered.kernel

    @property
    def smem_plan(self):
        """The shared-memory plan of a composed kernel (``schedule/smem.py``), or None."""
        return self.lowered.smem_plan

    def simulate(self, arrays: Sequence[np.ndarray], poison: bool = True) -> list[np.ndarray]:
        """Run the kernel on NumPy: ``arrays`` in ``.inputs`` order (logical values, any strides)."""
        pattern, kernel = self.lowered.pattern, self.lowered.kernel
        if len(arrays) != len(pattern.inputs):
            raise ValueError(f"{self.name} takes {len(pattern.inputs)} inputs, got {len(arrays)}")
        buffers: dict[str, np.ndarray] = {}
        for k, (node, array, layout) in enumerate(zip(pattern.inputs, arrays, self.lowered.input_layouts)):
            array = np.asarray(array)
            if array.shape != node.shape or array.dtype != node.dtype.numpy:
                raise ValueError(f"input {node.name}: expected {node.dtype.value}{list(node.shape)}, "
                                 f"got {array.dtype}{list(array.shape)}")
            buffers[f"in{k}"] = _to_storage(array, layout, kernel.buffer(f"in{k}").extent)
        for k, (node, layout) in enumerate(zip(pattern.outputs, self.lowered.output_layouts)):
            if k in self.lowered.aliases:
                buffers[f"out{k}"] = buffers[f"in{self.lowered.aliases[k]}"]
                continue
            storage = np.empty(kernel.buffer(f"out{k}").extent, node.dtype.numpy)
            storage[...] = _poison(node.dtype.numpy) if poison else 0
            buffers[f"out{k}"] = storage
        simulate(kernel, buffers)
        return [_from_storage(buffers[f"out{k}"], node.shape, layout)
                for k, (node, layout) in enumerate(zip(pattern.outputs, self.lowered.output_layouts))]

    def compile(self, arch: str = "sm_90", **kwargs: Any):
        """CUDA C → CUBIN with NVRTC: a CompiledModule with ``.cubin`` and ``.resources``. Launching
        on tensors is the runtime's (``runtime.kernel_call.call_generated``)."""
        from fusionstitching.codegen.nvrtc import compile_cuda

        return compile_cuda(self.cuda_source, arch, name=f"{self.name}.cu", **kwargs)


def _poison(dtype: np.dtype) -> Any:
    if np.issubdtype(dtype, np.floating) or dtype.name == "bfloat16":
        return np.nan
    if dtype == np.bool_:
        return True
    return np.iinfo(dtype).min + 7


def _to_storage(array: np.ndarray, layout: Layout, extent: int) -> np.ndarray:
    storage = np.zeros(max(extent, 1), array.dtype)
    if array.size:
        view = np.lib.stride_tricks.as_strided(storage, array.shape, [s * array.itemsize for s in layout.strides])
        view[...] = array
    return storage


def _from_storage(storage: np.ndarray, shape, layout: Layout) -> np.ndarray:
    if math.prod(shape) == 0:
        return np.zeros(shape, storage.dtype)
    view = np.lib.stride_tricks.as_strided(storage, shape, [s * storage.itemsize for s in layout.strides])
    return np.array(view)


def generate(graph: Graph, nodes: Iterable[Node | str], template: str | KernelSchedule, *,
             name: str | None = None, vectorize: bool = True, **debug: bool) -> GeneratedKernel:
    """The kernel computing ``nodes`` of ``graph`` as ``template`` says (``debug``: see ``lower``)."""
    schedule = parse_template(template) if isinstance(template, str) else template
    nodes = list(nodes)
    lowered = lower(graph, nodes, schedule, name=name or _kernel_name(graph, nodes), vectorize_access=vectorize,
                    **debug)
    kernel = GeneratedKernel(lowered, schedule, cuda_c.render(lowered.kernel))
    if vectorize and _has_vector_access(lowered.kernel.body):
        scalar = lower(graph, nodes, schedule, name=lowered.kernel.name, vectorize_access=False)
        kernel._scalar_variant = GeneratedKernel(scalar, schedule, cuda_c.render(scalar.kernel))
    return kernel


def _has_vector_access(body) -> bool:
    from fusionstitching.codegen import kernel_ir as K

    for stmt in body:
        if isinstance(stmt, (K.VecLoad, K.VecStore)):
            return True
        if isinstance(stmt, K.For) and _has_vector_access(stmt.body):
            return True
        if isinstance(stmt, K.If) and (_has_vector_access(stmt.then) or _has_vector_access(stmt.orelse)):
            return True
    return False


_NAME_LIMIT = 60


def _kernel_name(graph: Graph, nodes: list) -> str:
    """``fs_<graph>_<first node>``, every character outside [A-Za-z0-9_] replaced by ``_`` (a graph
    named after a lambda, ``<lambda>``, is no C identifier), at most ``_NAME_LIMIT`` characters. A
    name that had to be shortened or changed ends in a hash of the whole text instead: a program's
    kernels are told apart by name, and the first nodes of two patterns can share a long prefix
    (an attention backward's outputs, ``..._attention_backward_1`` and ``..._backward_1_3``)."""
    first = nodes[0] if isinstance(nodes[0], str) else nodes[0].name
    text = f"fs_{graph.name}_{first}"
    name = _identifier(text)
    if name == text and len(name) <= _NAME_LIMIT:
        return name
    digest = hashlib.sha256(text.encode()).hexdigest()[:8]
    return f"{name[:_NAME_LIMIT - len(digest) - 1]}_{digest}"


def _identifier(text: str) -> str:
    return "".join(ch if ch.isascii() and (ch.isalnum() or ch == "_") else "_" for ch in text)


def default_template(graph: Graph, nodes: Iterable[Node | str]) -> KernelSchedule:
    """A valid template for the pattern (``schedule/grouping.py`` documents the rule)."""
    from fusionstitching.schedule.grouping import choose_template

    return choose_template(resolve_pattern(graph, nodes))


def lowering_refusal(graph: Graph, nodes: list[Node], pattern: Pattern, template: KernelSchedule,
                     smem_limit: int) -> Reason | None:
    """Why ``generate`` would refuse ``template`` for the pattern (its ``CodegenError``), or None:
    the ``schedule.grouping.LoweringCheck`` the package registers. A probe lowering (the
    register-composed copies of a body lowered once, symbolically) goes first: what it accepts, the
    full lowering accepts. Its refusals of ops, dtypes, tilings and shared memory do not depend on
    the copies' indices and stand; a read it cannot prove inside the footprint (``FootprintError``:
    an index that may be affine only once the THREAD indices are constants) is confirmed by the
    full lowering."""
    try:
        try:
            lower(graph, nodes, template, vectorize_access=False, smem_limit=smem_limit, probe=True, pattern=pattern)
        except FootprintError:
            lower(graph, nodes, template, vectorize_access=False, smem_limit=smem_limit, pattern=pattern)
    except CodegenError as err:
        return Reason(str(err))
    return None
