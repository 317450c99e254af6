"""The demo: a BERT encoder layer planned and generated (the plan, each kernel's ops, composition
schemes and shared memory, the CUDA C of the largest kernel), checked with the simulator on the
CPU or run on the GPU, and on a GPU timed against eager PyTorch and TorchInductor with the bench
(``bench/suite.py``); then each small workload planned, compiled and checked the same way."""

from __future__ import annotations

import warnings

import numpy as np

from fusionstitching.bench.check import forward_arrays, relative_error
from fusionstitching.bench.workloads import make
from fusionstitching.frontend.torch_fx import capture
from fusionstitching.fusion import baseline, explore
from fusionstitching.graph import reference
from fusionstitching.pipeline import compile_graph, compile_plan
from fusionstitching.runtime.executor import CompiledGraph


def composition(kernel) -> str:
    """The composition schemes a generated kernel uses, read from its CUDA C: thread composition
    always; warp (shuffles); block (shared memory and barriers); packing (several root groups)."""
    source = kernel.cuda_source
    schemes = ["thread"]
    if "__shfl" in source:
        schemes.append("warp")
    if "__syncthreads" in source or "__shared__" in source:
        schemes.append("block")
    return " + ".join(schemes)


def shared_bytes(kernel) -> int:
    """Static shared memory of a generated kernel: its shared buffers (planned ones and reduction scratch)."""
    from fusionstitching.graph.ops import DType

    return sum(b.extent * DType(b.dtype).itemsize for b in kernel.kernel.shared)


def plan_table(compiled: CompiledGraph) -> str:
    """One line per kernel: ops, sub-roots (template roots), composition schemes, shared memory, launch."""
    lines = ["| kernel | ops | roots | composition | shared bytes | blocks × threads | outputs |",
             "|---|---|---|---|---|---|---|"]
    for k, kernel in enumerate(compiled.kernels):
        launch = kernel.template.launch
        lines.append(f"| {k} {kernel.name} | {len(kernel.lowered.pattern.nodes)} | {len(kernel.template.schedules)} | "
                     f"{composition(kernel)} | {shared_bytes(kernel)} | {launch.blocks} × {launch.threads} | "
                     f"{', '.join(kernel.outputs)} |")
    return "\n".join(lines)


def bert_layer_demo() -> float:
    """Plan a BERT-base encoder layer (small sizes without a GPU), print the plan and the largest
    kernel's CUDA C, check it (simulator or GPU) and, on a GPU, bench it; returns the worst error."""
    import torch

    on_gpu = torch.cuda.is_available()
    sizes = {"batch": 32, "seq": 128, "hidden": 768, "heads": 12} if on_gpu else {}
    workload = make("bert_layer", **sizes)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        captured = capture(workload.fn, *workload.inputs, name="bert_layer")
    graph = captured.forward
    compiled = compile_graph(graph)
    plan = compiled.plan
    print(f"BERT encoder layer {tuple(workload.inputs[0].shape)} f32, inference: {len(graph.nodes)} ops -> "
          f"{plan.kernel_count} generated kernels + {plan.library_count} library calls (GEMMs) + "
          f"{len(plan.views)} views; XLA-like baseline {baseline(graph).kernel_count} kernels; "
          f"planned in {plan.seconds:.2f} s")
    print(plan_table(compiled))
    largest = max(compiled.kernels, key=lambda k: len(k.lowered.pattern.nodes))
    print(f"\nCUDA C of the largest kernel, {largest.name} (template {largest.template}):")
    source = largest.cuda_source
    print(source[source.index('extern "C"'):] if 'extern "C"' in source else source)
    arrays = forward_arrays(captured, workload.fn, workload.inputs)
    want = reference.evaluate(graph, arrays)
    if not on_gpu:
        got = compiled.run_numpy(arrays)
        error = max(relative_error(g, w) for g, w in zip(got, want) if w is not None)
        print(f"No GPU here: every kernel run by the simulator; the plan vs the reference semantics: "
              f"max relative error {error:.1e}")
        return error
    from fusionstitching.graph.torch_dtypes import DTYPE_TO_TORCH

    tensors = [torch.from_numpy(np.asarray(a, np.float32)).to(DTYPE_TO_TORCH[p.dtype]).cuda()
               for a, p in zip(arrays, graph.parameters)]
    outputs = compiled(*tensors)
    error = max(relative_error(o.float().cpu().numpy(), w) for o, w in zip(outputs, want) if w is not None)
    print(f"On the GPU ({torch.cuda.get_device_name()}): max relative error {error:.1e} against the reference")
    from fusionstitching.bench import suite

    results = suite.run(["bert_layer"], suite.DEFAULT_SYSTEMS)
    print("\nbench: one BERT-base layer, batch 32 × 128, bf16 autocast (fusionstitching bench bert_layer):")
    print(suite.format_table(results, suite.DEFAULT_SYSTEMS))
    return error


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
    compiled = compile_plan(plan)
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
    from fusionstitching.graph.torch_dtypes import DTYPE_TO_TORCH

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
