"""Single-kernel benchmarks on a GPU: generated kernels vs PyTorch eager, TorchInductor and a copy.

``python -m fusionstitching.bench.kernels [--json FILE]`` prints, per case, the median GPU time
(CUDA events) of our kernel, eager PyTorch, TorchInductor and a device copy of the same bytes
(read + write), measured in the same run, and the ratios; then the wall time of 40 small in-place
updates packed in one kernel vs eager, and the host cost per launch.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time
import warnings
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F

from fusionstitching.codegen import default_template, generate
from fusionstitching.codegen.values import CodegenError
from fusionstitching.frontend.torch_fx import capture
from fusionstitching.graph.pattern import resolve_pattern
from fusionstitching.runtime.kernel_call import allocate_outputs, call_generated


@dataclass
class Row:
    case: str
    ours_us: float
    eager_us: float
    inductor_us: float
    copy_us: float

    @property
    def vs_copy(self) -> float:
        return self.ours_us / self.copy_us

    @property
    def vs_inductor(self) -> float:
        return self.ours_us / self.inductor_us


_FLUSH: list[torch.Tensor] = []


def flush_l2() -> None:
    """Overwrite a buffer larger than any L2 cache, so the next kernel reads from DRAM."""
    if not _FLUSH:
        _FLUSH.append(torch.empty(256 * 2**20, dtype=torch.uint8, device="cuda"))
    _FLUSH[0].zero_()


HOLD_CYCLES = 2_000_000  # about 1 ms: long enough for the host to enqueue any call measured here


def gpu_time_us(fn: Callable[[], object], repeats: int = 50, warmup: int = 5, flush: bool = False) -> float:
    """Median GPU time of one call, by CUDA events around each call (L2 flushed before each if asked).

    A GPU-side sleep precedes each measured call, so the host has enqueued the whole call (every
    kernel of a multi-kernel implementation) before the GPU reaches the start event: the time is
    the kernels' execution, not the host's launch overhead between them.
    """
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        if flush:
            flush_l2()
        torch.cuda._sleep(HOLD_CYCLES)
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        stop.record()
        stop.synchronize()
        times.append(start.elapsed_time(stop) * 1000)
    return statistics.median(times)


def wall_time_us(fn: Callable[[], object], repeats: int = 200, rounds: int = 7) -> float:
    """Median over rounds of the wall time per call, synchronizing at the end of each round."""
    fn()
    torch.cuda.synchronize()
    results = []
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(repeats):
            fn()
        torch.cuda.synchronize()
        results.append((time.perf_counter() - start) / repeats * 1e6)
    return statistics.median(results)


def _kernel_for(fn, inputs, name: str, template: str | None = None):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        graph = capture(fn, *[t.cpu() if t.is_cuda else t for t in inputs], name=name).forward
    nodes = [n for n in graph.nodes if n.op != "parameter"]
    if template is not None:
        template = template.replace("{out}", graph.outputs[0].name)
    kernel = generate(graph, nodes, template or default_template(graph, nodes))
    by_name = {p.name: t for p, t in zip(graph.parameters, inputs)}
    ordered = [by_name[n] for n in kernel.inputs]
    return kernel, ordered


def compare(name: str, fn, inputs, bytes_moved: int, templates: tuple[str | None, ...] = (None,),
            flush: bool = False) -> Row:
    """Our kernel (the fastest of ``templates``; None = the default template) against the others."""
    best = None
    for template in templates:
        try:
            kernel, ordered = _kernel_for(fn, inputs, name, template)
        except CodegenError as err:
            print(f"  {name}: {template} rejected: {err}")
            continue
        outputs = allocate_outputs(kernel, ordered)
        time_us = gpu_time_us(lambda k=kernel, i=ordered, o=outputs: call_generated(k, i, o), flush=flush)
        print(f"  {name}: {kernel.template} {time_us:.1f} µs")
        if best is None or time_us < best[0]:
            best = (time_us, kernel, ordered, outputs)
    ours, kernel, ordered, outputs = best
    got = call_generated(kernel, ordered, outputs)[0]
    want = fn(*inputs)
    tolerance = 1e-2 if want.dtype != torch.float32 else 1e-4
    torch.testing.assert_close(got.float(), want.float(), rtol=tolerance, atol=tolerance)
    eager = gpu_time_us(lambda: fn(*inputs), flush=flush)
    compiled = torch.compile(fn)
    inductor = gpu_time_us(lambda: compiled(*inputs), flush=flush)
    half = bytes_moved // 2
    src = torch.empty(half, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    copy = gpu_time_us(lambda: dst.copy_(src), flush=flush)
    return Row(name, ours, eager, inductor, copy)


def bias_gelu(dtype: torch.dtype) -> Row:
    x = torch.randn(16384, 3072, device="cuda", dtype=dtype)
    b = torch.randn(3072, device="cuda", dtype=dtype)

    def fn(x, b):
        return F.gelu(x + b, approximate="tanh")

    return compare(f"bias_gelu_{str(dtype).split('.')[1]}", fn, [x, b], 2 * x.numel() * x.element_size())


def relu_transpose() -> Row:
    x = torch.randn(4096, 4096, device="cuda")
    y = torch.randn(4096, 4096, device="cuda")

    def fn(x, y):
        return torch.relu(x.t() * y + 1)

    candidates = (None, "{out}[GRID-CTA_32,GRID-CTA_8-THREAD_4]; launch(blocks=16384,threads=256)",
                  "{out}[GRID-CTA_32-THREAD_2,GRID-CTA_8-THREAD_4]; launch(blocks=8192,threads=256)",
                  "{out}[GRID-CTA_16-THREAD_4,GRID-CTA_16-THREAD_4]; launch(blocks=4096,threads=256)",
                  ("transpose[GRID-CTA_32,GRID-WARP_8-THREAD_4]S; {out}[GRID-WARP_8-THREAD_4,GRID-CTA_32]; "
                   "launch(blocks=16384,threads=256)"))
    return compare("relu_t_mul_f32", fn, [x, y], 3 * x.numel() * 4, candidates)


def layernorm(dtype: torch.dtype) -> Row:
    x = torch.randn(16384, 1024, device="cuda", dtype=dtype)
    w = torch.randn(1024, device="cuda", dtype=dtype)
    b = torch.randn(1024, device="cuda", dtype=dtype)

    def fn(x, w, b):
        return F.layer_norm(x, (1024,), w, b, eps=1e-5)

    block = "[GRID,CTA_256-THREAD_4]"
    candidates = (None, f"reduce{block}; reduce_1{block}; {{out}}{block}; launch(blocks=16384,threads=256)",
                  ("reduce[GRID-WARP_4,THREAD_8-CTA_32-THREAD_4]; reduce_1[GRID-WARP_4,THREAD_8-CTA_32-THREAD_4]; "
                   "{out}[GRID-WARP_4,THREAD_8-CTA_32-THREAD_4]; launch(blocks=4096,threads=128)"))
    return compare(f"layernorm_{str(dtype).split('.')[1]}", fn, [x, w, b], 2 * x.numel() * x.element_size(),
                   candidates, flush=True)


def softmax() -> Row:
    x = torch.randn(32, 12, 128, 128, device="cuda")
    mask = torch.where(torch.rand(32, 1, 1, 128, device="cuda") > 0.1, 0.0, -10000.0)

    def fn(x, mask):
        return torch.softmax(x * 0.125 + mask, dim=-1)

    one, four = "[GRID,GRID,GRID-WARP_8,CTA_32-THREAD_4]", "[GRID,GRID,GRID-WARP_8-THREAD_4,CTA_32-THREAD_4]"
    candidates = (None, f"reduce{one}; reduce_1{one}; {{out}}{one}; launch(blocks=6144,threads=256)",
                  f"reduce{four}; reduce_1{four}; {{out}}{four}; launch(blocks=1536,threads=256)")
    return compare("softmax_scale_mask_f32", fn, [x, mask], 2 * x.numel() * 4, candidates, flush=True)


def din_attention() -> Row:
    from fusionstitching.bench.workloads import DINAttention

    batch, history, dim = 256, 50, 36
    query = torch.randn(batch, 1, dim, device="cuda")
    keys = torch.randn(batch, history, dim, device="cuda")
    lengths = torch.randint(1, history + 1, (batch,), device="cuda")
    mask = torch.arange(history, device="cuda")[None, :] < lengths[:, None]
    module = DINAttention()
    moved = (query.numel() + keys.numel() + batch * dim) * 4 + mask.numel()
    return compare("din_attention_256x50x36", module, [query, keys, mask], moved, flush=True)


def layernorm_backward(rows: int = 16384, cols: int = 1024) -> Row:
    """dx with its row reductions and per-block dgamma/dbeta partials in one kernel, then a small
    kernel for the final column sums (``column_partial_kernels``)."""
    def fn(dy, x, mean, rstd, w, b):
        return torch.ops.aten.native_layer_norm_backward(dy, x, [cols], mean, rstd, w, b, [True, True, True])

    x = torch.randn(rows, cols, device="cuda")
    w, b = torch.randn(cols, device="cuda"), torch.randn(cols, device="cuda")
    _, mean, rstd = torch.ops.aten.native_layer_norm(x, [cols], w, b, 1e-5)
    inputs = [torch.randn(rows, cols, device="cuda"), x, mean, rstd, w, b]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        graph = capture(fn, *[t.cpu() for t in inputs], name="layernorm_backward").forward
    graph, kernels = column_partial_kernels(graph)
    values = {p.name: t for p, t in zip(graph.parameters, inputs)}

    def run():
        env = dict(values)
        for k in kernels:
            env.update(zip(k.outputs, call_generated(k, [env[n] for n in k.inputs])))
        return [env[o.name] for o in graph.outputs]

    for got, want in zip(run(), fn(*inputs)):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-3)
    for k in kernels:
        print(f"  layernorm_backward: {k.template}")
    ours = gpu_time_us(run, flush=True)
    eager = gpu_time_us(lambda: fn(*inputs), flush=True)
    compiled = torch.compile(fn)
    inductor = gpu_time_us(lambda: compiled(*inputs), flush=True)
    src = torch.empty(3 * rows * cols * 4 // 2, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    copy = gpu_time_us(lambda: dst.copy_(src), flush=True)
    return Row(f"layernorm_backward_{rows}x{cols} (2 kernels)", ours, eager, inductor, copy)


def column_partial_kernels(graph, warp_rows: int = 8):
    """LayerNorm-backward-like graphs: the first output has row reductions (dx), the others are
    column reductions (dgamma, dbeta). The column reductions are split (``split_reduction``) into
    per-block partials over exactly the rows a block of the first output's kernel handles (a row
    per warp, ``warp_rows`` warps: more rows per block, fewer partials), and reduced across that
    block's warps inside the same kernel; a small second kernel sums the partials (the default
    column-reduction template). Returns the split graph and the two kernels in launch order."""
    from fusionstitching.graph.graph import Graph
    from fusionstitching.graph.transforms import split_reduction
    from fusionstitching.schedule.grouping import _crossing, composed_template
    from fusionstitching.schedule.template import KernelSchedule, Level, Schedule, Tile

    first = Graph(graph.parameters, [graph.outputs[0]], name=graph.name)
    pattern = resolve_pattern(first, [n for n in first.nodes if n.op != "parameter"])
    base = composed_template(pattern, _crossing(pattern), 32 * warp_rows, warp_rows, rows_per_warp=1)
    row, col = base.schedules[0].dims
    if row[0].level != Level.GRID:
        raise ValueError(f"{graph.name}: the row kernel's template does not start with GRID rows: {base}")
    rows_per_block = math.prod(t.size for t in row[1:])
    rows = graph.outputs[0].shape[0]
    for node in [n for n in graph.nodes if n.op == "reduce" and n.attrs["dims"] == (0,)]:
        graph = split_reduction(graph, node.name, rows // rows_per_block)
    partials = [n for n in graph.nodes if n.name.endswith("_partial")]
    finals = graph.outputs[1:]
    fused = Graph(graph.parameters, [graph.outputs[0]] + partials, name=graph.name)
    schedules = list(base.schedules) + [Schedule(p.name, ((Tile(Level.GRID),), tuple(row[1:]), col))
                                        for p in partials]
    kernels = [generate(fused, [n for n in fused.nodes if n.op != "parameter"],
                        KernelSchedule(tuple(schedules), base.launch))]
    last = Graph(graph.parameters, finals, name=graph.name)
    nodes = [n for n in last.nodes if n.op != "parameter" and not any(n is p for p in partials)
             and _after(n, partials)]
    kernels.append(generate(last, nodes, default_template(last, nodes)))
    return graph, kernels


def _after(node, partials) -> bool:
    """Whether ``node`` depends on one of ``partials`` (it belongs to the final reduction)."""
    stack, seen = [node], set()
    while stack:
        n = stack.pop()
        if any(n is p for p in partials):
            return True
        if id(n) not in seen:
            seen.add(id(n))
            stack.extend(n.operands)
    return False


def packed_updates(count: int = 40) -> dict:
    """``p.mul_(0.9).add_(g)`` over ``count`` tensors of 1K–1M elements: one kernel vs eager."""
    generator = torch.Generator().manual_seed(0)
    sizes = [int(1024 * 2 ** (10 * k / (count - 1))) for k in range(count)]
    params = [torch.randn(s, generator=generator) for s in sizes]
    grads = [torch.randn(s, generator=generator) for s in sizes]

    def fn(*tensors):
        n = len(tensors) // 2
        for p, g in zip(tensors[:n], tensors[n:]):
            p.mul_(0.9).add_(g)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        graph = capture(fn, *params, *grads, name="packed_updates").forward
    nodes = [n for n in graph.nodes if n.op != "parameter"]
    kernel = generate(graph, nodes, default_template(graph, nodes))
    cuda = [t.cuda() for t in params + grads]
    by_name = {p.name: t for p, t in zip(graph.parameters, cuda)}
    ordered = [by_name[n] for n in kernel.inputs]
    expected = [p.clone() for p in cuda[:count]]
    fn(*expected, *cuda[count:])
    call_generated(kernel, ordered)
    torch.cuda.synchronize()
    for p, e in zip(cuda[:count], expected):
        torch.testing.assert_close(p, e)
    ours = wall_time_us(lambda: call_generated(kernel, ordered))
    eager = wall_time_us(lambda: fn(*cuda))
    return {"tensors": count, "elements": sum(sizes), "ours_wall_us": ours, "eager_wall_us": eager,
            "ratio": ours / eager, "ours_gpu_us": gpu_time_us(lambda: call_generated(kernel, ordered)),
            "eager_gpu_us": gpu_time_us(lambda: fn(*cuda))}


def host_cost() -> dict:
    from fusionstitching.runtime.kernel_call import _launcher, device_arch
    from fusionstitching.runtime.launch import host_overhead_us

    x = torch.randn(1024, device="cuda")

    def fn(x):
        return x * 2 + 1

    kernel, ordered = _kernel_for(fn, [x], "tiny")
    outputs = allocate_outputs(kernel, ordered)
    call_generated(kernel, ordered, outputs)
    launcher = _launcher(kernel, device_arch())
    driver = host_overhead_us(launcher, list(outputs) + ordered)
    full = wall_time_us(lambda: call_generated(kernel, ordered, outputs), repeats=2000)
    eager = wall_time_us(lambda: fn(x), repeats=2000)
    return {"launch_only_us": driver, "generated_call_us": full, "eager_x*2+1_us": eager}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()
    device = torch.cuda.get_device_name()
    rows = [bias_gelu(torch.float32), bias_gelu(torch.bfloat16), relu_transpose(), layernorm(torch.float32),
            layernorm(torch.bfloat16), softmax(), din_attention(), layernorm_backward()]
    print(f"device: {device}")
    print("| case | ours µs | eager µs | inductor µs | copy µs | ours/copy | ours/inductor |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r.case} | {r.ours_us:.1f} | {r.eager_us:.1f} | {r.inductor_us:.1f} | {r.copy_us:.1f} | "
              f"{r.vs_copy:.3f} | {r.vs_inductor:.3f} |")
    packed = packed_updates()
    print(f"packed updates: {json.dumps(packed)}")
    host = host_cost()
    print(f"host cost: {json.dumps(host)}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": device, "rows": [asdict(r) for r in rows], "packed": packed, "host": host}, f,
                      indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
