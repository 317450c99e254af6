"""Host cost of running compiled graphs on a GPU (``python -m fusionstitching.bench.host``).

Measures, in one process, with tiny kernels so that the GPU never holds the host back:

- the bare prepacked launch: ``LoadedKernel.launch_tensors`` of one generated kernel;
- per kernel inside a CompiledGraph: a chain of ``N`` exps planned by the baseline (an expensive
  op is never fused as a producer there, so the plan is ``N`` kernels), wall time per call / N, run
  as the unrolled program (``runtime/unrolled.py``) and by the loop over its steps;
- the same with ``mode="reduce-overhead"`` (CUDA-graph replay);
- the fixed cost per call: a one-kernel CompiledGraph, and ``torch.compile`` of ``x * 2 + 1``
  through this backend, Inductor and eager (guards, AOTAutograd wrappers, output allocation).
"""

from __future__ import annotations

import functools
import sys

CHAIN = 64


def _chain_graph(length: int, size: int = 256):
    from fusionstitching.graph.graph import GraphBuilder
    from fusionstitching.graph.ops import DType

    b = GraphBuilder(f"exp_chain_{length}")
    x = b.parameter((size,), DType.F32, "x")
    for _ in range(length):
        x = b.unary("exp", b.unary("neg", x))
    return b.build([x])


def _per_call_us(fn, repeats: int = 300) -> float:
    from fusionstitching.bench.kernels import wall_time_us

    return wall_time_us(fn, repeats=repeats, rounds=7)


def main() -> int:
    import torch

    if not torch.cuda.is_available():
        print("host: needs a CUDA GPU", file=sys.stderr)
        return 2
    import fusionstitching  # registers the backend
    from fusionstitching.fusion import baseline, explore
    from fusionstitching.options import Options
    from fusionstitching.pipeline import compile_plan
    from fusionstitching.runtime.kernel_call import loaded
    from fusionstitching.runtime.launch import host_overhead_us

    x = torch.randn(256, device="cuda")
    single = compile_plan(explore(_chain_graph(1)))
    single.run([x])
    kernel = single.kernels[0]
    launcher = loaded(kernel).launchers[x.device]
    out = torch.empty_like(x)
    bare = host_overhead_us(launcher, [out, x])
    chain = compile_plan(baseline(_chain_graph(CHAIN)))
    kernels = chain.plan.kernel_count
    per_kernel = _per_call_us(functools.partial(chain.run, [x], True)) / kernels
    looped = compile_plan(baseline(_chain_graph(CHAIN)), options=Options(unroll=False))
    per_kernel_looped = _per_call_us(functools.partial(looped.run, [x], True)) / kernels
    graphed = compile_plan(baseline(_chain_graph(CHAIN)), mode="reduce-overhead")
    per_kernel_graphed = _per_call_us(functools.partial(graphed.run, [x], True)) / kernels
    one = _per_call_us(functools.partial(single.run, [x], True))

    def fn(t):
        return t * 2 + 1

    rows = [("bare prepacked launch (per kernel)", bare),
            (f"CompiledGraph, {kernels} kernels (per kernel)", per_kernel),
            (f"CompiledGraph, {kernels} kernels, Options(unroll=False) (per kernel)", per_kernel_looped),
            (f"CompiledGraph reduce-overhead, {kernels} kernels (per kernel)", per_kernel_graphed),
            ("CompiledGraph, one kernel (per call)", one)]
    for backend in ("fusionstitching", "inductor", "eager"):
        torch._dynamo.reset()
        compiled = fn if backend == "eager" else torch.compile(fn, backend=backend)
        rows.append((f"x * 2 + 1 through {backend} (per call)", _per_call_us(functools.partial(compiled, x))))
    print(f"device: {torch.cuda.get_device_name()}")
    print("| what | host us |")
    print("|---|---|")
    for label, value in rows:
        print(f"| {label} | {value:.2f} |")
    print(f"per kernel / bare launch: {per_kernel / bare:.2f}x")
    print(fusionstitching.stats())
    return 0


if __name__ == "__main__":
    sys.exit(main())
