"""Where a batched dot stops being "small": our generated kernel against cuBLAS (``torch.bmm``).

``python -m fusionstitching.bench.small_dots`` (GPU) times ``bmm(a, b)`` for batched shapes from
DIN-style attention ([B,1,K]×[B,K,N]) to square tiles, both as one generated kernel (the dot alone,
default template) and through cuBLAS, with the L2 flushed, and prints the table the small-dot
threshold of ``Options`` is chosen from. Fused into a kernel with its producers and consumers a dot
also saves their memory traffic, so the threshold is where the generated dot alone stays within
2x of cuBLAS.
"""

from __future__ import annotations

import sys

SHAPES = (  # batch, M, K, N
    (2048, 1, 64, 50), (2048, 50, 64, 1), (256, 1, 36, 50), (2048, 16, 64, 16), (2048, 32, 64, 32),
    (1024, 64, 64, 64), (512, 128, 64, 128), (96, 128, 64, 128), (96, 128, 128, 128),
)


def _row(batch: int, m: int, k: int, n: int) -> str:
    import torch

    from fusionstitching.bench.kernels import _kernel_for, gpu_time_us
    from fusionstitching.codegen.values import CodegenError
    from fusionstitching.runtime.kernel_call import allocate_outputs, call_generated

    a = torch.randn(batch, m, k, device="cuda")
    b = torch.randn(batch, k, n, device="cuda")
    mflop = 2 * batch * m * k * n / 1e6
    try:
        kernel, ordered = _kernel_for(torch.bmm, [a, b], f"bmm_{batch}_{m}_{k}_{n}")
    except (CodegenError, ValueError) as err:  # a shape the generator refuses is part of the answer
        return f"| {batch} | {m} | {k} | {n} | {mflop:.1f} | refused: {err} | | |"
    outputs = allocate_outputs(kernel, ordered)
    got = call_generated(kernel, ordered, outputs)[0]
    torch.testing.assert_close(got, torch.bmm(a, b), rtol=1e-3, atol=1e-3)
    ours = gpu_time_us(lambda: call_generated(kernel, ordered, outputs), flush=True)
    cublas = gpu_time_us(lambda: torch.bmm(a, b), flush=True)
    return f"| {batch} | {m} | {k} | {n} | {mflop:.1f} | {ours:.1f} | {cublas:.1f} | {ours / cublas:.2f} |"


def main() -> int:
    import torch

    if not torch.cuda.is_available():
        print("small_dots: needs a CUDA GPU", file=sys.stderr)
        return 2
    print(f"device: {torch.cuda.get_device_name()}")
    print("| batch | M | K | N | MFLOP | generated us | cuBLAS us | ratio |")
    print("|---|---|---|---|---|---|---|---|")
    for batch, m, k, n in SHAPES:
        print(_row(batch, m, k, n))
    return 0


if __name__ == "__main__":
    sys.exit(main())
