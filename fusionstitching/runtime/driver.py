"""The CUDA driver entry points the launcher needs, called through ``ctypes`` on ``libcuda``.

Each method has cuda-bindings' shape: it returns ``(CUresult, *values)``. Why not cuda-bindings'
``driver`` module: its first driver call resolves every entry point of its table with
``cuGetProcAddress``, and the ones this driver lacks come back CUDA_ERROR_INVALID_VALUE — 34 API
errors that compute-sanitizer reports on every run, so that a real finding no longer stands out.
The launcher needs eleven functions; binding them by name reports nothing, and a ctypes call with
declared argument types is also the cheapest launch path from Python.
"""

from __future__ import annotations

import ctypes
import functools
import sys

_CUresult = ctypes.c_int
_HANDLE = ctypes.c_void_p


class Driver:
    """``libcuda`` (``nvcuda.dll`` on Windows) with the argument types of the calls used here."""

    def __init__(self, library: ctypes.CDLL) -> None:
        self.lib = library
        signatures = {
            "cuInit": [ctypes.c_uint],
            "cuDeviceGet": [ctypes.POINTER(ctypes.c_int), ctypes.c_int],
            "cuDevicePrimaryCtxRetain": [ctypes.POINTER(_HANDLE), ctypes.c_int],
            "cuCtxGetCurrent": [ctypes.POINTER(_HANDLE)],
            "cuCtxSetCurrent": [_HANDLE],
            "cuModuleLoadData": [ctypes.POINTER(_HANDLE), ctypes.c_char_p],
            "cuModuleUnload": [_HANDLE],
            "cuModuleGetFunction": [ctypes.POINTER(_HANDLE), _HANDLE, ctypes.c_char_p],
            "cuFuncSetAttribute": [_HANDLE, ctypes.c_int, ctypes.c_int],
            "cuGetErrorName": [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)],
            "cuGetErrorString": [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)],
            # f, grid x/y/z, block x/y/z, dynamic shared bytes, stream, kernelParams, extra
            "cuLaunchKernel": [_HANDLE] + [ctypes.c_uint] * 7 + [_HANDLE, ctypes.c_void_p, ctypes.c_void_p],
        }
        for name, argtypes in signatures.items():
            function = getattr(library, name)
            function.argtypes = argtypes
            function.restype = _CUresult
        self.launch = library.cuLaunchKernel  # called as is on the hot path: returns the CUresult
        # The same entry point without declared argument types, for callers that pass arguments
        # already converted (``ctypes.c_void_p`` handles, ints that fit a C int, None): ctypes then
        # converts nothing per call (``runtime/unrolled.py``).
        self.launch_raw = library["cuLaunchKernel"]  # indexing makes a new function object
        self.launch_raw.restype = _CUresult

    def cuInit(self, flags: int) -> tuple:
        return (self.lib.cuInit(flags),)

    def cuDeviceGet(self, ordinal: int) -> tuple:
        device = ctypes.c_int()
        return self.lib.cuDeviceGet(ctypes.byref(device), ordinal), device.value

    def cuDevicePrimaryCtxRetain(self, device: int) -> tuple:
        context = _HANDLE()
        return self.lib.cuDevicePrimaryCtxRetain(ctypes.byref(context), device), context.value or 0

    def cuCtxGetCurrent(self) -> tuple:
        context = _HANDLE()
        return self.lib.cuCtxGetCurrent(ctypes.byref(context)), context.value or 0

    def cuCtxSetCurrent(self, context: int) -> tuple:
        return (self.lib.cuCtxSetCurrent(context),)

    def cuModuleLoadData(self, image: bytes) -> tuple:
        module = _HANDLE()
        return self.lib.cuModuleLoadData(ctypes.byref(module), image), module.value or 0

    def cuModuleUnload(self, module: int) -> tuple:
        return (self.lib.cuModuleUnload(module),)

    def cuModuleGetFunction(self, module: int, name: bytes) -> tuple:
        function = _HANDLE()
        return self.lib.cuModuleGetFunction(ctypes.byref(function), module, name), function.value or 0

    def cuFuncSetAttribute(self, function: int, attribute: int, value: int) -> tuple:
        return (self.lib.cuFuncSetAttribute(function, attribute, value),)

    def cuGetErrorName(self, code: int) -> tuple:
        text = ctypes.c_char_p()
        return self.lib.cuGetErrorName(int(code), ctypes.byref(text)), text.value

    def cuGetErrorString(self, code: int) -> tuple:
        text = ctypes.c_char_p()
        return self.lib.cuGetErrorString(int(code), ctypes.byref(text)), text.value


CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES = 8


@functools.cache
def driver() -> Driver:
    """The process's driver binding; ``OSError`` where there is no CUDA driver library."""
    name = "nvcuda.dll" if sys.platform == "win32" else "libcuda.so.1"
    return Driver(ctypes.CDLL(name))
