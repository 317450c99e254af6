"""runtime/launch.py: prepacked pointer slots and error checks (CPU); real launches (GPU)."""

from __future__ import annotations

import ctypes
import math

import pytest
import torch

from fusionstitching.runtime.launch import CudaError, LoadedKernel, check, host_overhead_us

driver = pytest.importorskip("cuda.bindings.driver")

gpu_only = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

THREADS = 128
N = 1000  # not a multiple of THREADS: the last block is partial

AFFINE = """
extern "C" __global__ void affine(float* y, const float* x) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < N) y[i] = 2.0f * x[i] + 1.0f;
}
"""

# Dynamic shared memory above the 48 KiB default: fails to launch unless the launcher sets
# CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES. Each thread uses a slot at the far end.
SMEM_BYTES = 96 * 1024
SMEM_COPY = """
extern "C" __global__ void smem_copy(float* y, const float* x) {
    extern __shared__ float buf[];
    const int slot = SMEM_FLOATS - blockDim.x + threadIdx.x;
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < N) buf[slot] = x[i];
    __syncthreads();
    if (i < N) y[i] = buf[slot] + 1.0f;
}
"""


def with_sizes(source: str, n: int) -> str:
    return f"#define N {n}\n#define SMEM_FLOATS {SMEM_BYTES // 4}\n{source}"


def blocks_for(n: int) -> int:
    return (n + THREADS - 1) // THREADS


def fake_kernel(num_params: int = 3) -> LoadedKernel:
    return LoadedKernel(b"not a cubin", "fake", num_params, blocks=4, threads=THREADS)


# ---- prepacked buffer (no GPU) ----------------------------------------------------------


def test_pack_rewrites_only_changed_slots():
    kernel = fake_kernel()
    a, b, c, x = 0x7000_0000_1000, 0x7000_0000_2000, 0x7000_0000_3000, 0x7000_0000_9000
    assert kernel._pack([a, b, c]) == 3
    assert list(kernel._values) == [a, b, c]
    # Poke slots 0 and 2 behind the launcher's back: a pack that rewrote them would restore them.
    kernel._values[0] = 1
    kernel._values[2] = 2
    assert kernel._pack([a, x, c]) == 1
    assert list(kernel._values) == [1, x, 2]
    assert kernel._pack([a, x, c]) == 0


def test_params_point_at_the_value_slots():
    kernel = fake_kernel(4)
    pointers = [0x1000 * (i + 1) for i in range(4)]
    kernel._pack(pointers)
    base = ctypes.addressof(kernel._values)
    assert kernel._params_addr == ctypes.addressof(kernel._params)
    for i, pointer in enumerate(pointers):
        assert kernel._params[i] == base + i * ctypes.sizeof(ctypes.c_void_p)
        slot = ctypes.cast(kernel._params[i], ctypes.POINTER(ctypes.c_void_p))
        assert slot.contents.value == pointer
    # The void** array itself, read through its integer address (what cuLaunchKernel gets).
    params = (ctypes.c_void_p * 4).from_address(kernel._params_addr)
    assert list(params) == list(kernel._params)


def test_pack_rejects_wrong_arity():
    with pytest.raises(ValueError, match="takes 3 pointers, got 2"):
        fake_kernel(3)._pack([1, 2])


def test_zero_params_pass_null():
    assert fake_kernel(0)._params_addr == 0


@pytest.mark.parametrize("blocks,threads,smem", [(0, 32, 0), (1, 0, 0), (1, 1025, 0), (1, 32, -1)])
def test_rejects_bad_launch_shape(blocks, threads, smem):
    with pytest.raises(ValueError):
        LoadedKernel(b"", "k", 1, blocks, threads, smem)


def test_launch_tensors_rejects_cpu_tensors_before_loading():
    kernel = fake_kernel(2)
    with pytest.raises(ValueError, match="argument 0 is on cpu"):
        kernel.launch_tensors([torch.zeros(4), torch.zeros(4)])
    assert kernel.device == -1


# ---- check() (no GPU) -------------------------------------------------------------------


def test_check_unwraps_values():
    ok = driver.CUresult.CUDA_SUCCESS
    assert check((ok,), "cuA") is None
    assert check((ok, 7), "cuB") == 7
    assert check((ok, 7, "x"), "cuC") == (7, "x")


def test_check_raises_with_call_and_error_name():
    code = driver.CUresult.CUDA_ERROR_INVALID_VALUE
    with pytest.raises(CudaError, match=r"cuFooBar failed: CUDA_ERROR_INVALID_VALUE \(1\)") as info:
        check((code, None), "cuFooBar")
    assert isinstance(info.value, RuntimeError)
    assert info.value.call == "cuFooBar"
    assert info.value.code == code
    assert info.value.error_name == "CUDA_ERROR_INVALID_VALUE"


def test_test_kernels_compile(tmp_path):
    """The GPU tests' sources compile (NVRTC needs no GPU), so a GPU run fails only on launch."""
    pytest.importorskip("cuda.bindings.nvrtc")
    from fusionstitching.codegen.nvrtc import compile_cuda

    for source, name in [(AFFINE, b"affine"), (SMEM_COPY, b"smem_copy")]:
        module = compile_cuda(with_sizes(source, N), "sm_90", cache_dir=tmp_path)
        assert name in module.cubin


# ---- real launches (GPU) ----------------------------------------------------------------


def device_arch() -> str:
    major, minor = torch.cuda.get_device_capability()
    return f"sm_{major}{minor}"


def build(source: str, name: str, n: int, cache_dir, dynamic_smem: int = 0) -> LoadedKernel:
    from fusionstitching.codegen.nvrtc import compile_cuda

    module = compile_cuda(with_sizes(source, n), device_arch(), cache_dir=cache_dir)
    return LoadedKernel(module.cubin, name, 2, blocks_for(n), THREADS, dynamic_smem)


def poisoned(n: int) -> torch.Tensor:
    return torch.full((n,), math.nan, device="cuda")


@pytest.mark.gpu
@gpu_only
def test_affine_matches_torch(tmp_path):
    kernel = build(AFFINE, "affine", N, tmp_path)
    x = torch.randn(N, device="cuda")
    y = poisoned(N)
    kernel.launch_tensors([y, x])
    torch.cuda.synchronize()
    torch.testing.assert_close(y, 2 * x + 1)
    assert kernel.device == torch.cuda.current_device()


@pytest.mark.gpu
@gpu_only
def test_pointer_rewrite_between_launches(tmp_path):
    kernel = build(AFFINE, "affine", N, tmp_path)
    x1, x2 = torch.randn(N, device="cuda"), torch.randn(N, device="cuda")
    y1, y2 = poisoned(N), poisoned(N)
    kernel.launch_tensors([y1, x1])
    kernel.launch_tensors([y2, x2])  # both slots rewritten
    kernel.launch_tensors([y2, x1])  # only the input slot rewritten
    torch.cuda.synchronize()
    torch.testing.assert_close(y1, 2 * x1 + 1)  # untouched by the later launches
    torch.testing.assert_close(y2, 2 * x1 + 1)


@pytest.mark.gpu
@gpu_only
def test_orders_with_torch_ops_on_a_side_stream(tmp_path):
    kernel = build(AFFINE, "affine", N, tmp_path)
    expected = 2 * (torch.arange(N, dtype=torch.float32) * 0.5) + 1
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        y = poisoned(N)
        torch.cuda._sleep(100_000_000)  # keep the side stream busy: a launch elsewhere would overtake
        x = torch.arange(N, device="cuda", dtype=torch.float32).mul_(0.5)
        kernel.launch_tensors([y, x])
        z = y.clone()
    side.synchronize()
    torch.testing.assert_close(z.cpu(), expected)


@pytest.mark.gpu
@gpu_only
def test_dynamic_shared_memory_above_48k(tmp_path):
    kernel = build(SMEM_COPY, "smem_copy", N, tmp_path, dynamic_smem=SMEM_BYTES)
    x = torch.randn(N, device="cuda")
    y = poisoned(N)
    kernel.launch_tensors([y, x])
    torch.cuda.synchronize()
    torch.testing.assert_close(y, x + 1)


@pytest.mark.gpu
@gpu_only
def test_driver_errors_name_the_call(tmp_path):
    with pytest.raises(CudaError, match="cuModuleLoadData"):
        LoadedKernel(b"garbage", "affine", 2, 1, THREADS).load()
    kernel = build(AFFINE, "affine", N, tmp_path)
    with pytest.raises(ValueError, match="takes 2 pointers"):
        kernel.launch_tensors([poisoned(N)])


@pytest.mark.gpu
@gpu_only
def test_host_overhead_per_launch(tmp_path):
    kernel = build(AFFINE, "affine", N, tmp_path)
    tensors = [poisoned(N), torch.randn(N, device="cuda")]
    overhead = host_overhead_us(kernel, tensors)
    print(f"\nhost overhead per launch_tensors: {overhead:.2f} us ({torch.cuda.get_device_name()})")
    assert overhead < 50
