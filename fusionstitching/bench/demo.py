"""The demo's plan part: each small workload planned, its kernels generated and compiled, the whole
plan simulated against the reference and, on a GPU, run and timed against eager PyTorch."""

from __future__ import annotations

import warnings

import numpy as np

from fusionstitching.bench.check import forward_arrays, relative_error
from fusionstitching.bench.workloads import make
from fusionstitching.frontend.torch_fx import capture
from fusionstitching.fusion import baseline, explore
from fusionstitching.graph import reference
from fusionstitching.runtime.executor import CompiledGraph

DEMO_WORKLOADS = ("bias_gelu", "softmax_scale_mask", "layernorm", "din_attention", "adam_step", "mlp_train")


def plan_demo(name: str, show_source: bool = False) -> float:
    """Plan, generate, compile (sm_90), simulate and, on a GPU, run one workload's forward graph;
    returns the worst relative error of the simulated plan against the reference."""
    workload = make(name)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        captured = capture(workload.fn, *workload.inputs, train=workload.train, name=name)
    graph = captured.forward
    plan = explore(graph)
    compiled = CompiledGraph(plan)
    registers = []
    for kernel in compiled.kernels:
        module = kernel.compile("sm_90")
        registers.append(module.resources[kernel.name].registers)
    arrays = forward_arrays(captured, workload.fn, workload.inputs)
    got = compiled.run_numpy(arrays)
    want = reference.evaluate(graph, arrays)
    error = max(relative_error(g, w) for g, w in zip(got, want) if w is not None)
    print(f"{name}: {len(graph.nodes)} nodes -> {plan.kernel_count} kernels (baseline {baseline(graph).kernel_count}),"
          f" {plan.library_count} library calls; sm_90 registers {registers}; simulated plan vs reference: "
          f"max relative error {error:.1e}")
    if show_source:
        print(compiled.kernels[0].cuda_source.split('extern "C"')[1][:1500])
    _run_on_gpu(compiled, arrays, want, workload)
    return error


def _run_on_gpu(compiled: CompiledGraph, arrays, want, workload) -> None:
    import torch

    if not torch.cuda.is_available():
        return
    from fusionstitching.bench.kernels import gpu_time_us
    from fusionstitching.frontend.context import DTYPE_TO_TORCH

    tensors = [torch.from_numpy(np.asarray(a, np.float32)).to(DTYPE_TO_TORCH[p.dtype]).cuda()
               for a, p in zip(arrays, compiled.graph.parameters)]
    outputs = compiled(*tensors)
    torch.cuda.synchronize()
    error = max(relative_error(o.float().cpu().numpy(), w) for o, w in zip(outputs, want) if w is not None)
    ours = gpu_time_us(lambda: compiled(*tensors))
    cuda_inputs = [x.cuda() if isinstance(x, torch.Tensor) else x for x in workload.inputs]
    fn = workload.fn.cuda() if isinstance(workload.fn, torch.nn.Module) else workload.fn
    with torch.no_grad():
        eager = gpu_time_us(lambda: fn(*cuda_inputs))
    print(f"  GPU ({torch.cuda.get_device_name()}): max relative error {error:.1e}; {ours:.1f} µs vs eager "
          f"{eager:.1f} µs")
