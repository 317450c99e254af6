"""runtime/driver.py and the launcher's use of it, with a stand-in driver (no GPU needed)."""

import gc
import sys

import torch

from fusionstitching.runtime import launch
from fusionstitching.runtime.launch import LoadedKernel


class _Driver:
    """Records the calls the launcher makes; every call succeeds."""

    def __init__(self) -> None:
        self.calls: list[str] = []
        self.current = 0
        self.launch = self._launch

    def __getattr__(self, name):
        def call(*args):
            self.calls.append(name)
            if name == "cuCtxGetCurrent":
                return 0, self.current
            if name == "cuCtxSetCurrent":
                self.current = args[0]
                return (0,)
            if name in ("cuDeviceGet", "cuDevicePrimaryCtxRetain", "cuModuleLoadData", "cuModuleGetFunction"):
                return 0, 1000 + len(self.calls)
            return (0,)

        return call

    def _launch(self, *args):
        self.calls.append("cuLaunchKernel")
        return 0


def test_the_primary_context_is_retained_once_and_modules_unload_with_their_kernels(monkeypatch):
    """A retain per loaded module and no unload: a process compiling graph after graph grew."""
    fake = _Driver()
    monkeypatch.setattr(launch, "_driver", lambda: fake)
    monkeypatch.setattr(launch, "_PRIMARY", {})
    monkeypatch.setattr(torch.cuda, "init", lambda: None)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    kernels = [LoadedKernel(b"cubin", f"k{i}", 1, 1, 32) for i in range(3)]
    twins = [k.twin() for k in kernels]
    for k in kernels + twins:
        k.load()
        k.launch([16], stream=0)
    assert fake.calls.count("cuDevicePrimaryCtxRetain") == 1
    assert fake.calls.count("cuModuleLoadData") == 3
    del kernels
    gc.collect()
    assert fake.calls.count("cuModuleUnload") == 0  # the twins still use the modules
    del twins, k
    gc.collect()
    assert fake.calls.count("cuModuleUnload") == 3


def test_the_launcher_binds_libcuda_by_name(monkeypatch):
    """cuda-bindings' driver module resolves its whole table with cuGetProcAddress on its first
    call; compute-sanitizer reported the entries this driver lacks as 34 API errors per run. The
    launcher binds the functions it calls from the driver library by name instead."""
    from fusionstitching.runtime import driver

    opened = []

    class _Library:
        def __init__(self, name):
            opened.append(name)

        def __getattr__(self, name):
            def function(*args):
                return 0

            return function

        def __getitem__(self, name):  # ctypes: a new function object, without argument types
            return getattr(self, name)

    monkeypatch.setattr(driver.ctypes, "CDLL", _Library)
    driver.driver.cache_clear()
    try:
        bound = launch._driver()
        assert isinstance(bound, driver.Driver)
        assert opened == ["nvcuda.dll" if sys.platform == "win32" else "libcuda.so.1"]
        assert bound.cuModuleUnload(5) == (0,)
    finally:
        driver.driver.cache_clear()


def test_a_launch_with_converted_arguments_reaches_the_driver_as_declared():
    """``Driver.launch_raw`` has no declared argument types: the unrolled program passes handles as
    ``c_void_p``, grid and block sizes as ints and a null ``extra`` as None. A C function with
    cuLaunchKernel's signature (a ctypes callback) receives each value as declared, 64-bit
    handles whole."""
    import ctypes

    received = []
    signature = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, *[ctypes.c_uint] * 7, ctypes.c_void_p,
                                 ctypes.c_void_p, ctypes.c_void_p)
    callback = signature(lambda *args: received.append(args) or 0)
    untyped = ctypes.CFUNCTYPE(ctypes.c_int)(ctypes.cast(callback, ctypes.c_void_p).value)
    function, stream, params = 0x7F12_3456_7890, 0x5555_0000_1234, 0x7FFF_FFFF_FF00
    blocks = 2**31 - 1
    assert untyped(ctypes.c_void_p(function), blocks, 1, 1, 1024, 1, 1, 49152, ctypes.c_void_p(stream),
                   ctypes.c_void_p(params), None) == 0
    assert received == [(function, blocks, 1, 1, 1024, 1, 1, 49152, stream, params, None)]
    received.clear()
    untyped(ctypes.c_void_p(function), 7, 1, 1, 32, 1, 1, 0, ctypes.c_void_p(None), ctypes.c_void_p(params), None)
    assert received == [(function, 7, 1, 1, 32, 1, 1, 0, None, params, None)]
