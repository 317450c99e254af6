"""Load CUBINs into torch's CUDA context and launch them with a prepacked argument buffer.

[Note: calling convention] The code generator emits
``extern "C" __global__ void NAME(T0* p0, const T1* p1, ...)``: every parameter is a
device pointer and every size is a compile-time constant, so a launch needs only the
pointers, a 1-D grid (``blocks`` x ``threads``) and the dynamic shared-memory bytes.

[Note: prepacked arguments] Per-launch host cost matters as much as kernel time for the
small memory-bound kernels a fusion compiler emits. A generic argument-marshalling call
(``cuLaunchKernel`` with ``((values...), (types...))``, or ``cuda.core``'s ``launch``)
converts and allocates every argument on every call: tens of µs in Python. Instead each
``LoadedKernel`` owns two ctypes arrays built once:
    ``_values``: ``num_params`` x ``void*``, the pointer values themselves;
    ``_params``: ``num_params`` x ``void*``, ``_params[i] == &_values[i]`` (the driver's
                 ``void** kernelParams``).
A launch compares the new pointers with the last ones (one list comparison in C when
nothing changed), rewrites only the slots that differ, and calls ``cuLaunchKernel`` with
the *integer address* of ``_params`` through ``ctypes`` (``runtime/driver.py``: declared argument
types, no packing). The CUfunction is cached too, so the steady state allocates only the list of
``data_ptr()`` values. The driver copies parameter values at launch (and into the
graph node under stream capture), so rewriting a slot afterwards never affects a launch
already issued. A ``LoadedKernel`` is therefore not thread-safe: one buffer per kernel.

[Note: context] torch uses each device's primary context. The first load on a device retains
its primary context once for the process (one retain per device, not per module) and every load
makes it current if it is not already (``cuCtxGetCurrent``), then ``cuModuleLoadData``. A kernel
is bound to the device it was first launched on; ``launch_tensors`` rejects tensors elsewhere.
A module is unloaded when the kernel that loaded it (and every twin sharing it) is garbage: a
process that compiles graph after graph keeps only the modules of graphs still alive.

The driver library is opened on the first load, so importing this module works without it.
"""

from __future__ import annotations

import ctypes
import statistics
import threading
import time
import weakref
from collections.abc import Sequence

import torch

from fusionstitching.runtime.driver import CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES

_POINTER_SIZE = ctypes.sizeof(ctypes.c_void_p)
_MAX_THREADS_PER_BLOCK = 1024
_MAX_GRID_X = 2**31 - 1
# torch's CUDA builds expose the raw current stream as an int without building a
# torch.cuda.Stream object (Inductor's ``get_raw_stream``); CPU builds lack it.
_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)


def _driver():
    from fusionstitching.runtime.driver import driver

    return driver()


class CudaError(RuntimeError):
    """A CUDA driver call failed; carries the call name and the driver's error name/string."""

    def __init__(self, call: str, code: int):
        self.call = call
        self.code = code
        self.error_name, self.description = _describe(code)
        super().__init__(f"{call} failed: {self.error_name} ({int(code)}): {self.description}")


def _describe(code: int) -> tuple[str, str]:
    """The driver's name and description of an error code; the enum name where the driver can't say."""
    fallback = getattr(code, "name", f"CUresult {int(code)}")
    try:
        driver = _driver()
        err, name = driver.cuGetErrorName(code)
        err2, text = driver.cuGetErrorString(code)
    except (ImportError, RuntimeError, OSError):  # no driver library here: report what we know
        return fallback, "no description (CUDA driver unavailable)"
    name = name.decode() if not err and name else fallback
    text = text.decode() if not err2 and text else "no description"
    return name, text


def check(result: tuple, call: str):
    """Unwrap a cuda-bindings ``(err, *values)`` tuple: None, the one value, or a tuple of values."""
    err = result[0]
    if err:  # CUresult is an int enum and CUDA_SUCCESS == 0
        raise CudaError(call, err)
    if len(result) == 1:
        return None
    if len(result) == 2:
        return result[1]
    return tuple(result[1:])


def _current_stream(device: int) -> int:
    if _raw_stream is not None:
        return _raw_stream(device)
    return torch.cuda.current_stream(device).cuda_stream


_PRIMARY: dict[int, int] = {}  # device → its primary context, retained once for the process
_PRIMARY_LOCK = threading.Lock()


def _ensure_primary_context(driver, device: int):
    """Make ``device``'s primary context (the one torch uses) current on this thread."""
    with _PRIMARY_LOCK:
        primary = _PRIMARY.get(device)
        if primary is None:
            check(driver.cuInit(0), "cuInit")
            handle = check(driver.cuDeviceGet(device), "cuDeviceGet")
            primary = _PRIMARY[device] = check(driver.cuDevicePrimaryCtxRetain(handle), "cuDevicePrimaryCtxRetain")
    current = check(driver.cuCtxGetCurrent(), "cuCtxGetCurrent")
    if int(current) != int(primary):
        check(driver.cuCtxSetCurrent(primary), "cuCtxSetCurrent")
    return primary


def _unload(driver, context: int, module: int) -> None:
    """Unload a module of a kernel that is garbage (a ``weakref.finalize`` callback). The driver may
    already be shut down at interpreter exit: then there is nothing left to free."""
    try:
        if check(driver.cuCtxGetCurrent(), "cuCtxGetCurrent") != context:
            check(driver.cuCtxSetCurrent(context), "cuCtxSetCurrent")
        check(driver.cuModuleUnload(module), "cuModuleUnload")
    except (CudaError, OSError):
        pass


class LoadedKernel:
    """One generated kernel: its CUBIN, launch shape and prepacked pointer arguments."""

    def __init__(
        self, cubin: bytes, name: str, num_params: int, blocks: int, threads: int, dynamic_smem: int = 0,
        scalars: Sequence[int] = (),
    ):
        if num_params < 0:
            raise ValueError(f"{name}: num_params must be >= 0, got {num_params}")
        if not 1 <= threads <= _MAX_THREADS_PER_BLOCK:
            raise ValueError(f"{name}: threads must be in [1, {_MAX_THREADS_PER_BLOCK}], got {threads}")
        if not 1 <= blocks <= _MAX_GRID_X:
            raise ValueError(f"{name}: blocks must be in [1, {_MAX_GRID_X}], got {blocks}")
        if dynamic_smem < 0:
            raise ValueError(f"{name}: dynamic_smem must be >= 0, got {dynamic_smem}")
        self.cubin = bytes(cubin)
        self.name = name
        self.num_params = num_params
        self.blocks = blocks
        self.threads = threads
        self.dynamic_smem = dynamic_smem
        # the pointers' slots, then the scalar arguments' (``codegen/size_args.py``), written once:
        # each slot holds an argument's bytes, and the kernel reads as many as its type has
        self.scalars = tuple(scalars)
        slots = num_params + len(self.scalars)
        self._values = (ctypes.c_void_p * slots)(*([None] * num_params), *self.scalars)
        base = ctypes.addressof(self._values)
        self._params = (ctypes.c_void_p * slots)(*[base + i * _POINTER_SIZE for i in range(slots)])
        self._params_addr = ctypes.addressof(self._params) if slots else 0
        self._last = [0] * num_params  # Python mirror of _values: compared without reading ctypes
        self._device = -1
        self._context = None
        self._module = None
        self._function = None
        self._launch = None
        self._original: LoadedKernel | None = None

    def twin(self) -> LoadedKernel:
        """A launcher of the same function with its own prepacked arguments: the module is loaded
        once (by whichever of the two launches first) and shared."""
        return self.bound(self.blocks, self.scalars)

    def bound(self, blocks: int, scalars: Sequence[int]) -> LoadedKernel:
        """A twin launched with its own grid and scalar arguments: a kernel shared across shapes."""
        twin = LoadedKernel(self.cubin, self.name, self.num_params, blocks, self.threads, self.dynamic_smem, scalars)
        twin._original = self
        return twin

    def __repr__(self) -> str:
        return (
            f"LoadedKernel({self.name!r}, params={self.num_params}, blocks={self.blocks}, "
            f"threads={self.threads}, dynamic_smem={self.dynamic_smem}, device={self._device})"
        )

    @property
    def device(self) -> int:
        """The CUDA device index the module is loaded on; -1 before the first launch."""
        return self._device

    def _pack(self, pointers: Sequence[int]) -> int:
        """Write the pointers that changed since the last pack into the slots; return how many."""
        if len(pointers) != self.num_params:
            raise ValueError(f"{self.name} takes {self.num_params} pointers, got {len(pointers)}")
        last = self._last
        values = self._values
        rewritten = 0
        for i, pointer in enumerate(pointers):
            if pointer != last[i]:
                values[i] = pointer
                last[i] = pointer
                rewritten += 1
        return rewritten

    def repack(self, pointers: list[int], alignment: int = 0) -> bool:
        """Write ``pointers`` into the prepacked arguments, unless ``alignment`` is given and one of
        them is not a multiple of it (the kernel's scalar variant runs then). Whether written."""
        if alignment and any(p & (alignment - 1) for p in pointers):
            return False
        self._pack(pointers)
        return True

    def load(self) -> None:
        """Load the CUBIN into the current device's primary context (done by the first launch)."""
        if self._function is not None:
            return
        if self._original is not None:
            original = self._original
            original.load()
            self._device, self._context, self._module = original._device, original._context, original._module
            self._launch = original._launch
            self._function = original._function
            return
        driver = _driver()
        torch.cuda.init()
        device = torch.cuda.current_device()
        context = _ensure_primary_context(driver, device)
        module = check(driver.cuModuleLoadData(self.cubin), f"cuModuleLoadData({self.name})")
        function = check(
            driver.cuModuleGetFunction(module, self.name.encode()), f"cuModuleGetFunction({self.name})"
        )
        weakref.finalize(self, _unload, driver, context, module)
        if self.dynamic_smem > 0:
            check(
                driver.cuFuncSetAttribute(function, CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, self.dynamic_smem),
                f"cuFuncSetAttribute({self.name}, MAX_DYNAMIC_SHARED_SIZE_BYTES={self.dynamic_smem})",
            )
        self._device, self._context, self._module = device, context, module
        self._launch = driver.launch
        self._function = function

    def launch(self, pointers: Sequence[int], stream: int) -> None:
        """Launch on the raw CUDA stream handle ``stream`` with these device pointers."""
        if self._function is None:
            self.load()
        if pointers != self._last:
            self._pack(pointers)
        err = self._launch(  # f, grid x/y/z, block x/y/z, dynamic smem, stream, kernelParams, extra
            self._function,
            self.blocks,
            1,
            1,
            self.threads,
            1,
            1,
            self.dynamic_smem,
            stream,
            self._params_addr,
            None,
        )
        if err:
            raise CudaError(f"cuLaunchKernel({self.name})", err)

    def launch_tensors(self, tensors: Sequence[torch.Tensor]) -> None:
        """Launch with each tensor's ``data_ptr()`` on torch's current stream of the kernel's device."""
        if self._function is None:
            _require_cuda(self.name, tensors, None)
            self.load()
        device = self._device
        pointers = [t.data_ptr() for t in tensors if t.get_device() == device]
        if len(pointers) != len(tensors):
            _require_cuda(self.name, tensors, device)
        self.launch(pointers, _current_stream(device))


def _require_cuda(name: str, tensors: Sequence[torch.Tensor], device: int | None) -> None:
    """Raise naming the first tensor not on CUDA (or not on ``device`` when given)."""
    for i, t in enumerate(tensors):
        if not t.is_cuda:
            raise ValueError(f"{name}: argument {i} is on {t.device}, not on a CUDA device")
        if device is not None and t.get_device() != device:
            raise ValueError(f"{name}: argument {i} is on {t.device}, the kernel is loaded on cuda:{device}")


def host_overhead_us(kernel: LoadedKernel, tensors: Sequence[torch.Tensor], repeats: int = 2000) -> float:
    """Host (CPU) cost per ``launch_tensors`` call in µs: median over 5 batches of ``repeats``.

    Each batch is timed from its first call to its last return; the device is synchronized
    after the clock stops, once per batch. Use a tiny kernel, so that the GPU keeps up and
    the launch queue never fills (a full queue would make launches wait on the GPU).
    """
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    launch = kernel.launch_tensors
    launch(tensors)  # loads the module and packs the pointers
    torch.cuda.synchronize()
    per_call = []
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(repeats):
            launch(tensors)
        elapsed = time.perf_counter() - start
        torch.cuda.synchronize()
        per_call.append(elapsed / repeats * 1e6)
    return statistics.median(per_call)
