"""Calling a GeneratedKernel with torch tensors: checks, output allocation, compile and launch.

The kernel's parameters are its outputs, then its inputs. Inputs must have the shapes, dtypes
and strides the kernel was generated for (strided inputs are read in place; the storage offset is
already in ``data_ptr``). Outputs are new contiguous tensors, except in-place outputs, which are
the input tensor whose storage they overwrite. A kernel with vector accesses runs only when every
pointer is 16-byte aligned; otherwise its scalar variant runs. CUBINs are compiled once per
device arch and cached on disk by ``nvrtc.py``, under the cache root the caller passes
(``Options.cache_dir`` and ``Options.cache_max_bytes``, given to ``precompile`` and ``call_generated``).

What the runtime keeps per kernel (its loaded module per arch, its launcher per device, the input
metadata of the last checked call) lives here, in a table keyed weakly by the kernel (``loaded``):
the generated kernel itself holds code, not runtime state.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from os import PathLike
from typing import Any

from fusionstitching.graph.torch_dtypes import DTYPE_TO_TORCH
from fusionstitching.options import Options

_ALIGNMENT = 16


class Loaded:
    """The runtime's state of one generated kernel: ``modules`` (arch → its LoadedKernel, compiled or
    read from the disk cache), ``launchers`` (device → the LoadedKernel, its module loaded in that
    device's context) and ``signature`` (the inputs' metadata at the last call that passed the full
    check)."""

    __slots__ = ("launchers", "modules", "signature")

    def __init__(self) -> None:
        self.modules: dict[str, Any] = {}
        self.launchers: dict[Any, Any] = {}
        self.signature: list | None = None


_LOADED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def loaded(kernel: Any) -> Loaded:
    """The runtime's state of ``kernel`` (made on first use, dropped with the kernel)."""
    state = _LOADED.get(kernel)
    if state is None:
        state = _LOADED[kernel] = Loaded()
    return state


def device_arch(device: Any = None) -> str:
    import torch

    major, minor = torch.cuda.get_device_capability(device)
    return f"sm_{major}{minor}"


def _launcher(kernel, arch: str, cache_dir: str | PathLike | None, cache_max_bytes: int):
    """The kernel's LoadedKernel for ``arch``: compiled (or read from the disk cache under
    ``cache_dir``) on first use; a twin (``GeneratedKernel.twin``) shares its original's module and
    has its own arguments."""
    from fusionstitching.codegen.nvrtc import compile_cuda
    from fusionstitching.runtime.launch import LoadedKernel

    modules = loaded(kernel).modules
    launcher = modules.get(arch)
    if launcher is None:
        if kernel._twin is not None:
            launcher = _launcher(kernel._twin, arch, cache_dir, cache_max_bytes).twin()
        elif kernel._shared is not None:  # its family's parametric kernel, with its grid and sizes
            shared, scalars, _ = kernel._shared
            launcher = _launcher(shared, arch, cache_dir, cache_max_bytes).bound(kernel.lowered.kernel.blocks, scalars)
        else:
            ir = kernel.lowered.kernel
            module = compile_cuda(kernel.cuda_source, arch, name=f"{ir.name}.cu", cache_dir=cache_dir,
                                  cache_max_bytes=cache_max_bytes)
            launcher = LoadedKernel(module.cubin, ir.name, len(ir.params), ir.blocks, ir.threads)
        modules[arch] = launcher
    return launcher


def code_owner(kernel: Any) -> Any:
    """The kernel whose source ``kernel`` runs: through twins (``GeneratedKernel.twin``) and kernels
    shared across shapes (``codegen/size_args.py``)."""
    while True:
        if kernel._twin is not None:
            kernel = kernel._twin
        elif kernel._shared is not None:
            kernel = kernel._shared[0]
        else:
            return kernel


def precompile(kernels: Sequence[Any], arch: str, workers: int | None = None, *,
               cache_dir: str | PathLike | None = None,
               cache_max_bytes: int = Options.cache_max_bytes) -> None:
    """Compile the kernels' CUDA sources for ``arch`` in a thread pool (NVRTC runs without the
    interpreter lock), each distinct source once, so that their first calls find their modules.
    Scalar variants are left to the first misaligned call that needs them. ``cache_dir`` and
    ``cache_max_bytes``: ``Options.cache_dir`` and ``Options.cache_max_bytes`` (``nvrtc.compile_cuda``)."""
    import os
    from concurrent.futures import ThreadPoolExecutor

    originals = {}
    for kernel in kernels:
        kernel = code_owner(kernel)
        if arch not in loaded(kernel).modules:  # made here, not in the pool's threads
            originals[id(kernel)] = kernel
    if not originals:
        return
    workers = workers or min(16, os.cpu_count() or 1, len(originals))
    with ThreadPoolExecutor(max_workers=workers) as pool:
        list(pool.map(lambda k: _launcher(k, arch, cache_dir, cache_max_bytes), originals.values()))


class CompileAhead:
    """Compiles kernels for ``arch`` in a thread pool while the caller goes on (NVRTC runs without
    the interpreter lock): the tuner hands it the candidates of the patterns it will measure next,
    so that their compiles overlap the measuring of the ones before and use every core, where
    ``precompile`` of one pattern's few candidates leaves most cores idle. ``wait`` before calling
    a kernel submitted here; a compile that fails is left to that call, which reports it."""

    def __init__(self, arch: str, workers: int | None = None, *, cache_dir: str | PathLike | None = None,
                 cache_max_bytes: int = Options.cache_max_bytes) -> None:
        import os
        from concurrent.futures import ThreadPoolExecutor

        self.arch = arch
        self.workers = workers or min(16, os.cpu_count() or 1)
        self._cache = (cache_dir, cache_max_bytes)
        self._pool = ThreadPoolExecutor(max_workers=self.workers, thread_name_prefix="fusionstitching-compile")
        self._futures: dict[int, tuple[Any, Any]] = {}  # id of an original kernel -> (it, its compile)

    def submit(self, kernels: Sequence[Any]) -> None:
        for kernel in kernels:
            kernel = code_owner(kernel)
            if id(kernel) in self._futures or self.arch in loaded(kernel).modules:  # made here, not in a thread
                continue
            self._futures[id(kernel)] = (kernel, self._pool.submit(self._compile, kernel))

    def submit_one(self, kernel: Any) -> None:
        self.submit([kernel])

    def _compile(self, kernel: Any) -> None:
        import contextlib

        with contextlib.suppress(Exception):  # the kernel's call compiles it again and reports the error
            _launcher(kernel, self.arch, *self._cache)

    def in_flight(self) -> int:
        """Compiles submitted and not finished."""
        return sum(not future.done() for _, future in self._futures.values())

    def wait(self, kernels: Sequence[Any]) -> None:
        """Until the compiles of ``kernels`` submitted here are done."""
        for kernel in kernels:
            kernel = code_owner(kernel)
            _, future = self._futures.pop(id(kernel), (None, None))
            if future is not None and not future.cancelled():
                future.result()

    def close(self) -> None:
        """Drop the compiles not begun; the ones running finish in their threads."""
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._futures.clear()


def check_inputs(kernel, tensors: Sequence[Any]) -> None:
    pattern, layouts = kernel.lowered.pattern, kernel.lowered.input_layouts
    if len(tensors) != len(pattern.inputs):
        raise ValueError(f"{kernel.name} takes {len(pattern.inputs)} tensors ({', '.join(kernel.inputs)}), "
                         f"got {len(tensors)}")
    for node, t, layout in zip(pattern.inputs, tensors, layouts):
        expected = DTYPE_TO_TORCH[node.dtype]
        if tuple(t.shape) != node.shape or t.dtype != expected:
            raise ValueError(f"{kernel.name}: input {node.name} must be {expected}{list(node.shape)}, "
                             f"got {t.dtype}{list(t.shape)}")
        if t.numel() > 1 and any(size > 1 and s != e for size, s, e in zip(t.shape, t.stride(), layout.strides)):
            raise ValueError(f"{kernel.name}: input {node.name} has strides {tuple(t.stride())}, the kernel "
                             f"was generated for {layout.strides}")
        if not t.is_cuda:
            raise ValueError(f"{kernel.name}: input {node.name} is not on a CUDA device")


def allocate_outputs(kernel, tensors: Sequence[Any]) -> list[Any]:
    import torch

    device = tensors[0].device if tensors else torch.device("cuda")
    outputs = []
    for k, node in enumerate(kernel.lowered.pattern.outputs):
        if k in kernel.lowered.aliases:
            outputs.append(tensors[kernel.lowered.aliases[k]])
        else:
            outputs.append(torch.empty(node.shape, dtype=DTYPE_TO_TORCH[node.dtype], device=device))
    return outputs


def _signature(tensors: Sequence[Any]) -> list:
    return [(t.shape, t.stride(), t.dtype, t.device) for t in tensors]


def call_generated(kernel, tensors: Sequence[Any], outputs: Sequence[Any] | None = None, *,
                   cache_dir: str | PathLike | None = None,
                   cache_max_bytes: int = Options.cache_max_bytes) -> list[Any]:
    """Launch ``kernel`` on the current stream; ``outputs`` may be given (e.g. poisoned buffers).
    A kernel (or scalar variant) not yet compiled for the device's arch is compiled here, with the
    disk cache under ``cache_dir`` (as ``precompile``).

    The host path is kept short (DESIGN.md "Runtime"): the inputs' (shape, strides, dtype, device)
    are compared in one list comparison with those of the last call that passed the full check.
    """
    signature = _signature(tensors)
    state = loaded(kernel)
    if signature != state.signature:
        check_inputs(kernel, tensors)
        state.signature = signature
    if outputs is None:
        outputs = allocate_outputs(kernel, tensors)
    arguments = list(outputs) + list(tensors)
    pointers = [t.data_ptr() for t in arguments]
    variant = kernel
    if kernel._scalar_variant is not None and any(p & (_ALIGNMENT - 1) for p in pointers):
        variant = kernel._scalar_variant
    device = arguments[0].device
    launchers = loaded(variant).launchers
    launcher = launchers.get(device)
    if launcher is None:
        launcher = _launcher(variant, device_arch(device), cache_dir, cache_max_bytes)
        launcher.launch_tensors(arguments)  # loads the module in the device's context
        launchers[device] = launcher
        return list(outputs)
    launcher.launch(pointers, _current_stream(device.index))
    return list(outputs)


def _current_stream(device: int) -> int:
    from fusionstitching.runtime.launch import _current_stream as current

    return current(device)
