"""The demo's kernel part: one generated kernel per small workload, compiled, simulated, (GPU) run.

Until fusion planning exists, the whole forward graph of a small workload is one pattern with the
default template, which thread composition can always lower (reductions used inside are
recomputed per element, so only small sizes are sensible here).
"""

from __future__ import annotations

import warnings

import numpy as np

from fusionstitching.bench.check import forward_arrays, relative_error
from fusionstitching.bench.workloads import make
from fusionstitching.codegen import default_template, generate
from fusionstitching.frontend.torch_fx import capture
from fusionstitching.graph import reference

DEMO_WORKLOADS = ("bias_gelu", "softmax_scale_mask", "layernorm", "din_attention", "adam_step")


def kernel_demo(name: str, show_source: bool = False) -> float:
    """Generate, compile (sm_90), simulate and, on a GPU, run one kernel; returns the worst error."""
    workload = make(name)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        captured = capture(workload.fn, *workload.inputs, name=name)
    graph = captured.forward
    nodes = [n for n in graph.nodes if n.op != "parameter"]
    template = default_template(graph, nodes)
    kernel = generate(graph, nodes, template)
    module = kernel.compile("sm_90")
    report = module.resources[kernel.name]
    arrays = forward_arrays(captured, workload.fn, workload.inputs)
    by_name = {p.name: a for p, a in zip(graph.parameters, arrays)}
    got = kernel.simulate([by_name[n] for n in kernel.inputs])
    expected = reference.evaluate(graph, arrays)
    want = {node.name: value for node, value in zip(graph.outputs, expected)}
    error = max(relative_error(g, want[n]) for n, g in zip(kernel.outputs, got))
    print(f"{name}: 1 kernel for {len(nodes)} nodes, {len(kernel.outputs)} outputs; template {template}")
    print(f"  sm_90: {report.registers} registers, {report.spill_stores} spill bytes; "
          f"simulated vs reference: max relative error {error:.1e}")
    if show_source:
        print(kernel.cuda_source.split('extern "C"')[1][:1500])
    _run_on_gpu(kernel, by_name, want, workload)
    return error


def _run_on_gpu(kernel, by_name, want, workload) -> None:
    import torch

    if not torch.cuda.is_available():
        return
    from fusionstitching.bench.kernels import gpu_time_us
    from fusionstitching.frontend.context import DTYPE_TO_TORCH

    tensors = [torch.from_numpy(np.asarray(by_name[n], np.float32)).to(
        DTYPE_TO_TORCH[kernel.lowered.pattern.inputs[i].dtype]).cuda() for i, n in enumerate(kernel.inputs)]
    outputs = kernel(*tensors)
    torch.cuda.synchronize()
    error = max(relative_error(o.float().cpu().numpy(), want[n]) for n, o in zip(kernel.outputs, outputs))
    ours = gpu_time_us(lambda: kernel(*tensors))
    cuda_inputs = [x.cuda() if isinstance(x, torch.Tensor) else x for x in workload.inputs]
    fn = workload.fn.cuda() if isinstance(workload.fn, torch.nn.Module) else workload.fn
    with torch.no_grad():
        eager = gpu_time_us(lambda: fn(*cuda_inputs))
    print(f"  GPU ({torch.cuda.get_device_name()}): max relative error {error:.1e}; {ours:.1f} µs vs eager "
          f"{eager:.1f} µs")
