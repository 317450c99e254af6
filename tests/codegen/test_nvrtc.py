"""NVRTC compilation to CUBIN, resource reports, the disk cache and error messages (no GPU needed)."""

import subprocess
import sys

import pytest

pytest.importorskip("cuda.bindings.nvrtc")

from fusionstitching.codegen import nvrtc
from fusionstitching.codegen.nvrtc import (
    NvrtcError,
    ResourceReport,
    compile_cuda,
    numbered_source,
    parse_ptxas_info,
    supported_archs,
)

AXPY = """\
extern "C" __global__ void __launch_bounds__(128)
k(float* __restrict__ y, const float* __restrict__ x, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) y[i] = 2.0f * x[i] + y[i];
}
"""

SHARED = """\
extern "C" __global__ void __launch_bounds__(128) rev(float* y, const float* x) {
    __shared__ float tile[128];
    tile[threadIdx.x] = x[blockIdx.x * 128 + threadIdx.x];
    __syncthreads();
    y[blockIdx.x * 128 + threadIdx.x] = tile[127 - threadIdx.x];
}
"""

LOCAL_ARRAY = """\
extern "C" __global__ void __launch_bounds__(1024, 2) local(float* y, int n) {
    float a[32];
    for (int j = 0; j < 32; j++) a[j] = y[j * n];
    float s = 0.0f;
    for (int j = 0; j < 32; j++) s += a[j] * a[(j * 7 + n) % 32];
    y[threadIdx.x] = s;
}
"""

HALF_PTX = """\
__device__ __forceinline__ unsigned short f32_to_f16(float f) {
    unsigned short h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
    return h;
}
__device__ __forceinline__ unsigned short f32_to_bf16(float f) {
    unsigned short h;
    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(h) : "f"(f));
    return h;
}
__device__ __forceinline__ float f16_to_f32(unsigned short h) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
}
extern "C" __global__ void cast(unsigned short* h, unsigned short* b, const unsigned short* x, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) {
        float v = f16_to_f32(x[i]) * 2.0f;
        h[i] = f32_to_f16(v);
        b[i] = f32_to_bf16(v);
    }
}
"""

BROKEN = """\
extern "C" __global__ void k(float* y) {
    y[0] = 1.0f;
    y[1] = undefined_name;
}
"""

ELF_MAGIC = b"\x7fELF"


def test_version_and_archs():
    assert nvrtc.nvrtc_version() >= (12, 0)
    archs = supported_archs()
    assert {"sm_80", "sm_90"} <= set(archs)
    assert all(a.startswith("sm_") for a in archs)


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_compiles_tiny_kernel_to_cubin(arch, tmp_path):
    module = compile_cuda(AXPY, arch, cache_dir=tmp_path)
    assert module.cubin[:4] == ELF_MAGIC
    assert module.arch == arch
    assert not module.cached
    assert set(module.resources) == {"k"}
    report = module.resources["k"]
    assert report.registers > 0
    assert report.spill_stores == report.spill_loads == report.stack_bytes == 0
    assert "ptxas info" in module.log


@pytest.mark.parametrize("arch", ["sm_86", "sm_89", "sm_100", "sm_90a"])
def test_other_archs_when_supported(arch, tmp_path):
    if arch.rstrip("a") not in supported_archs():
        pytest.skip(f"this NVRTC does not know {arch}")
    module = compile_cuda(AXPY, arch, cache_dir=tmp_path)
    assert module.cubin[:4] == ELF_MAGIC
    assert module.resources["k"].registers > 0


def test_unknown_arch_is_rejected(tmp_path):
    with pytest.raises(ValueError, match="sm_12345"):
        compile_cuda(AXPY, "sm_12345", cache_dir=tmp_path)
    with pytest.raises(ValueError, match="compute_90"):
        compile_cuda(AXPY, "compute_90", cache_dir=tmp_path)


def test_static_shared_memory_and_barriers(tmp_path):
    report = compile_cuda(SHARED, "sm_90", cache_dir=tmp_path).resources["rev"]
    assert report.shared_bytes == 128 * 4
    assert report.barriers == 1


def test_local_array_shows_stack_and_spills(tmp_path):
    plain = compile_cuda(LOCAL_ARRAY, "sm_90", cache_dir=tmp_path).resources["local"]
    assert plain.stack_bytes >= 32 * 4  # the dynamically indexed array lives in local memory
    squeezed = compile_cuda(LOCAL_ARRAY, "sm_90", ["--maxrregcount=16"], cache_dir=tmp_path)
    report = squeezed.resources["local"]
    assert report.spill_stores > 0 and report.spill_loads > 0
    assert report.registers <= 32


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_inline_ptx_half_conversions(arch, tmp_path):
    module = compile_cuda(HALF_PTX, arch, cache_dir=tmp_path)
    assert module.cubin[:4] == ELF_MAGIC
    assert set(module.resources) == {"cast"}


def test_cache_hit_returns_identical_cubin(tmp_path):
    first = compile_cuda(AXPY, "sm_90", cache_dir=tmp_path)
    second = compile_cuda(AXPY, "sm_90", cache_dir=tmp_path)
    assert not first.cached and second.cached
    assert second.cubin == first.cubin
    assert second.resources == first.resources
    assert second.log == first.log
    assert len(list((tmp_path / "nvrtc").glob("*.entry"))) == 1
    assert not list((tmp_path / "nvrtc").glob("*.tmp"))


def test_cache_key_covers_options_arch_and_source(tmp_path):
    compile_cuda(AXPY, "sm_90", cache_dir=tmp_path)
    assert not compile_cuda(AXPY, "sm_90", ["--use_fast_math"], cache_dir=tmp_path).cached
    assert not compile_cuda(AXPY, "sm_80", cache_dir=tmp_path).cached
    assert not compile_cuda(AXPY + "\n", "sm_90", cache_dir=tmp_path).cached
    assert len(list((tmp_path / "nvrtc").glob("*.entry"))) == 4
    assert compile_cuda(AXPY, "sm_90", ["--use_fast_math"], cache_dir=tmp_path).cached


@pytest.mark.parametrize("damage", ["garbage", "truncated", "empty"])
def test_corrupt_cache_entry_is_recompiled(damage, tmp_path):
    good = compile_cuda(AXPY, "sm_90", cache_dir=tmp_path)
    (entry,) = (tmp_path / "nvrtc").glob("*.entry")
    data = entry.read_bytes()
    entry.write_bytes({"garbage": b"\x00not json\n" + data, "truncated": data[:-100], "empty": b""}[damage])
    again = compile_cuda(AXPY, "sm_90", cache_dir=tmp_path)
    assert not again.cached
    assert again.cubin == good.cubin
    assert entry.read_bytes().endswith(good.cubin)  # rewritten
    assert compile_cuda(AXPY, "sm_90", cache_dir=tmp_path).cached


def test_unwritable_cache_still_compiles(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    module = compile_cuda(AXPY, "sm_90", cache_dir=blocker / "cache")
    assert module.cubin[:4] == ELF_MAGIC and not module.cached


def test_cache_root_follows_xdg(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert nvrtc.cache_root(None) == tmp_path / "fusionstitching"
    monkeypatch.setenv("XDG_CACHE_HOME", "relative/dir")  # the XDG spec says to ignore it
    assert nvrtc.cache_root(None).parts[-2:] == (".cache", "fusionstitching")
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert nvrtc.cache_root(None) == nvrtc.Path.home() / ".cache" / "fusionstitching"
    assert nvrtc.cache_root(tmp_path / "mine") == tmp_path / "mine"
    assert nvrtc.cache_root(str(tmp_path)) == tmp_path


def test_syntax_error_shows_numbered_source_and_log(tmp_path):
    with pytest.raises(NvrtcError) as info:
        compile_cuda(BROKEN, "sm_80", ["--use_fast_math"], name="broken.cu", cache_dir=tmp_path)
    text = str(info.value)
    assert ">   3 | " not in text  # widths follow the source length (4 lines: one digit)
    assert "> 3 |     y[1] = undefined_name;" in text
    assert "  2 |     y[0] = 1.0f;" in text
    assert 'identifier "undefined_name" is undefined' in text
    assert "broken.cu(3): error" in text
    assert "sm_80" in text and "--use_fast_math" in text
    assert info.value.arch == "sm_80"
    assert "undefined_name" in info.value.log
    assert not list(tmp_path.rglob("*.entry"))  # failures are not cached


def test_numbered_source_aligns_widths():
    source = "\n".join(f"line{i}" for i in range(1, 13))
    rows = numbered_source(source, frozenset({12})).splitlines()
    assert rows[0] == "   1 | line1"
    assert rows[11] == "> 12 | line12"


def test_parse_ptxas_info_multiple_entries_and_device_functions():
    log = """\
ptxas info    : 0 bytes gmem
ptxas info    : Function properties for helper
ptxas         .     48 bytes stack frame, 4 bytes spill stores, 8 bytes spill loads
ptxas info    : Compiling entry function 'a' for 'sm_80'
ptxas info    : Function properties for a
ptxas         .     16 bytes stack frame, 12 bytes spill stores, 20 bytes spill loads
ptxas info    : Used 40 registers, used 1 barriers, 64 bytes cumulative stack size, 1024 bytes smem, \
372 bytes cmem[0], 8 bytes cmem[2]
ptxas info    : Compile time = 2.000 ms
ptxas info    : Compiling entry function '_Z1bPf' for 'sm_80'
ptxas info    : Function properties for _Z1bPf
ptxas         .     0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 8 registers, used 0 barriers
"""
    reports = parse_ptxas_info(log)
    assert reports == {
        "a": ResourceReport(
            registers=40,
            shared_bytes=1024,
            spill_stores=12,
            spill_loads=20,
            stack_bytes=64,
            constant_bytes=380,
            barriers=1,
        ),
        "_Z1bPf": ResourceReport(registers=8),
    }
    assert parse_ptxas_info("") == {}


def test_options_must_not_be_a_bare_string(tmp_path):
    with pytest.raises(TypeError):
        compile_cuda(AXPY, "sm_90", "--use_fast_math", cache_dir=tmp_path)


def test_missing_cuda_bindings_names_the_packages(monkeypatch, tmp_path):
    nvrtc.nvrtc_version()  # warm the cached version so only the import fails below
    monkeypatch.setitem(sys.modules, "cuda.bindings", None)
    with pytest.raises(ImportError, match="cuda-bindings.*nvidia-cuda-nvrtc"):
        compile_cuda(AXPY, "sm_90", cache_dir=tmp_path)


def test_module_imports_without_cuda_bindings():
    code = "import sys; sys.modules['cuda'] = None; import fusionstitching.codegen.nvrtc"
    subprocess.run(
        [sys.executable, "-c", code], check=True, cwd=nvrtc.__file__.rsplit("/fusionstitching/", 1)[0]
    )


def _compile_after(barrier, results, source: str, cache_dir: str) -> None:
    barrier.wait()
    results.put(compile_cuda(source, "sm_90", cache_dir=cache_dir).cached)


def test_processes_missing_the_same_entry_compile_it_once(tmp_path):
    """The ranks of a data-parallel job miss the same kernels at once: one compiles, the others
    wait for its lock and read its entry."""
    from tests.concurrency import at_once

    source = "\n".join(AXPY.replace("\nk(", f"\nk{k}(") for k in range(40))  # 40 kernels: a compile takes a while
    assert at_once(_compile_after, (source, str(tmp_path)), 3, timeout=60) == [False, True, True]
    assert len(list((tmp_path / "nvrtc").glob("*.entry"))) == 1
