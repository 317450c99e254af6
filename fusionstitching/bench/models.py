"""Whole models through ``torch.compile``: eager, Inductor and fusionstitching on a GPU.

``python -m fusionstitching.bench.models`` runs BERT (12 layers, hidden 768, batch 8 × 128, eager
attention, random weights) inference and a training step (forward + backward), and reports the
wall time per call (median of rounds) and the number of GPU kernels per call counted with the torch
profiler, for each of the three, plus the relative error of the compiled outputs against eager.
"""

from __future__ import annotations

import functools
import sys


def _kernels(fn) -> int:
    import torch
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return sum(1 for e in prof.events() if e.device_type.name == "CUDA" and "memcpy" not in e.name.lower()
               and "memset" not in e.name.lower())


def _step(fn, inputs, train: bool):
    import torch

    if train:
        outs = fn(*inputs)
        sum(o.float().sum() for o in outs).backward()
        return outs
    with torch.no_grad():
        return fn(*inputs)


def main() -> int:
    import torch

    if not torch.cuda.is_available():
        print("models: needs a CUDA GPU", file=sys.stderr)
        return 2
    import fusionstitching  # registers the backend
    from fusionstitching.bench.kernels import wall_time_us
    from fusionstitching.bench.workloads import make

    sizes = {"layers": 12, "hidden": 768, "heads": 12, "batch": 8, "seq": 128, "vocab": 30522}
    print(f"device: {torch.cuda.get_device_name()}")
    print("| model | backend | wall us per call | GPU kernels per call | rel. error |")
    print("|---|---|---|---|---|")
    for train in (False, True):
        workload = make("bert_train" if train else "bert", **sizes)
        model = workload.fn.cuda()
        inputs = [x.cuda() for x in workload.inputs]
        reference = _step(model, inputs, train)
        for backend in ("eager", "inductor", "fusionstitching"):
            torch._dynamo.reset()
            fn = model if backend == "eager" else torch.compile(model, backend=backend)
            outs = _step(fn, inputs, train)
            error = max(float((o.float() - r.float()).norm() / r.float().norm()) for o, r in zip(outs, reference))
            wall = wall_time_us(functools.partial(_step, fn, inputs, train), repeats=10, rounds=5)
            kernels = _kernels(functools.partial(_step, fn, inputs, train))
            label = "BERT-12 train step" if train else "BERT-12 inference"
            print(f"| {label} | {backend} | {wall:.0f} | {kernels} | {error:.1e} |")
    print(fusionstitching.stats())
    return 0


if __name__ == "__main__":
    sys.exit(main())
