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

        def _FuncPtr(self, entry):  # ctypes' function of an entry point, without argument types
            name, _ = entry
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
