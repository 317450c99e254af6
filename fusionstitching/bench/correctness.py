"""Model-level correctness: ``torch.compile(..., backend="fusionstitching")`` against eager PyTorch.

``python -m fusionstitching.bench.correctness [--small]`` checks, on the GPU when there is one (with
our kernels launched) and otherwise on the CPU (the simulator runs the same kernels):

- every workload of ``bench/workloads.py`` (benchmark sizes unless ``--small``): inference on three
  fresh random inputs; training steps (forward and backward, every gradient); the AdamW update in
  place;
- BERT (12 layers at benchmark size): inference; a full training step — forward, backward and the
  ``torch.optim.AdamW`` step compiled too — twice, then every parameter; bf16 autocast inference;
  a second input shape (a new specialization, still correct);
- dropout: the rate, the 1/(1-p) scaling, fresh masks per call, repeatable under a seed.

Errors are ‖out − ref‖ / ‖ref‖ (gradients with a floor of 1e-4 of the largest gradient, for those
that are zero in exact arithmetic); a NaN anywhere fails. Before every compiled call the caching
allocator's free memory is filled with NaN (``poison``), so an output element a kernel forgets to
write shows up. Prints a markdown table with the kernels, library calls and fallbacks per check.
"""

from __future__ import annotations

import argparse
import copy
import math
import sys
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import torch

from fusionstitching.backend import reset_stats, stats
from fusionstitching.bench.workloads import REAL_SIZES, dropout, make

F32_TOLERANCE, BF16_TOLERANCE = 1e-4, 2e-2


@dataclass
class Check:
    name: str
    what: str
    error: float
    tolerance: float
    kernels: int = 0
    library: int = 0
    fallbacks: int = 0
    seconds: float = 0.0

    @property
    def passed(self) -> bool:
        return math.isfinite(self.error) and self.error < self.tolerance


def relative_error(out: torch.Tensor, ref: torch.Tensor, floor: float = 0.0) -> float:
    out, ref = out.detach().double().cpu(), ref.detach().double().cpu()
    if torch.isnan(out).any() and not torch.isnan(ref).any():
        return math.inf
    return float((out - ref).norm() / max(float(ref.norm()), floor, 1e-30))


def poison(device: torch.device) -> None:
    """Fill the caching allocator's free blocks with NaN: large blocks through one big tensor,
    small ones (the allocator's small pool, ≤ 1 MiB) through many small tensors."""
    if device.type != "cuda":
        return
    free = torch.cuda.mem_get_info(device)[0]
    big = torch.full((min(free // 8, 2**30) // 4,), math.nan, device=device)
    small = [torch.full((2**16,), math.nan, device=device) for _ in range(128)]
    del big, small


def _tuple(value) -> tuple:
    return value if isinstance(value, tuple) else (value,)


def _inputs(workload, device, seed: int = 0) -> list:
    torch.manual_seed(seed)
    out = []
    for x in workload.inputs:
        if isinstance(x, torch.Tensor):
            x = x.detach().clone()
            if seed and x.is_floating_point():
                x = torch.randn_like(x)
            x = x.to(device).requires_grad_(x.requires_grad)
        out.append(x)
    return out


def _module(workload, device):
    return workload.fn.to(device) if isinstance(workload.fn, torch.nn.Module) else workload.fn


def _counted(name: str, what: str, tolerance: float, body: Callable[[], float]) -> Check:
    reset_stats()
    torch._dynamo.reset()
    start = time.perf_counter()
    error = body()
    counts = stats()
    return Check(name, what, error, tolerance, counts.get("kernels", 0), counts.get("library calls", 0),
                 counts.get("fallbacks", 0), time.perf_counter() - start)


def check_inference(name: str, device, sizes: dict, autocast: torch.dtype | None = None) -> Check:
    workload = make(name, **sizes)
    fn = _module(workload, device)
    tolerance = BF16_TOLERANCE if autocast is not None else F32_TOLERANCE

    def body() -> float:
        compiled = torch.compile(fn, backend="fusionstitching")
        worst = 0.0
        for seed in range(3):
            inputs = _inputs(workload, device, seed)
            with torch.no_grad(), torch.autocast(device.type, dtype=autocast or torch.bfloat16,
                                                 enabled=autocast is not None):
                poison(device)
                outs = _tuple(compiled(*inputs))
                refs = _tuple(fn(*inputs))
            worst = max([worst] + [relative_error(o, r) for o, r in zip(outs, refs)])
        return worst

    what = "inference ×3 inputs" + (f", {str(autocast).split('.')[1]} autocast" if autocast else "")
    return _counted(name, what, tolerance, body)


def check_training(name: str, device, sizes: dict) -> Check:
    workload = make(name, **sizes)
    model = _module(workload, device)
    reference = copy.deepcopy(model)

    def body() -> float:
        compiled = torch.compile(model, backend="fusionstitching")
        poison(device)
        outs = _tuple(compiled(*_inputs(workload, device)))
        refs = _tuple(reference(*_inputs(workload, device)))
        sum(o.float().sum() for o in outs).backward()
        sum(r.float().sum() for r in refs).backward()
        errors = [relative_error(o, r) for o, r in zip(outs, refs)]
        pairs = [(p.grad, q.grad) for p, q in zip(model.parameters(), reference.parameters()) if q.grad is not None]
        largest = max(float(q.norm()) for _, q in pairs)
        errors += [relative_error(p, q, floor=1e-4 * largest) for p, q in pairs]
        return max(errors)

    return _counted(name, "forward + backward, every gradient", F32_TOLERANCE, body)


def check_adam(device, sizes: dict) -> Check:
    workload = make("adam_step", **sizes)

    def body() -> float:
        tensors = [t.detach().clone().to(device) for t in workload.inputs]
        expected = [t.detach().clone().to(device) for t in workload.inputs]
        compiled = torch.compile(workload.fn, backend="fusionstitching")
        poison(device)
        compiled(*tensors)
        workload.fn(*expected)
        return max(relative_error(g, w) for g, w in zip(tensors, expected))

    return _counted("adam_step", f"AdamW in place, {len(workload.inputs) // 4} tensors", F32_TOLERANCE, body)


def check_bert_training_step(device, sizes: dict, steps: int = 2) -> Check:
    """Forward, backward and the AdamW step, all compiled, ``steps`` times: every gradient (floor as
    in ``check_training``) and every parameter after each step. Adam turns a gradient's rounding
    noise into a full step of ±lr where the gradient is zero in exact arithmetic (the key bias), so
    before each optimizer step both models get the reference gradients: parameters then differ
    only by what the compiled optimizer computes."""
    workload = make("bert_train", **sizes)
    model = _module(workload, device)
    reference = copy.deepcopy(model)
    optimizers = [torch.optim.AdamW(m.parameters(), lr=1e-4) for m in (model, reference)]

    def body() -> float:
        compiled = torch.compile(model, backend="fusionstitching")
        step = torch.compile(optimizers[0].step, backend="fusionstitching")
        errors = []
        for k in range(steps):
            inputs = _inputs(workload, device, k)
            for m, opt in ((compiled, optimizers[0]), (reference, optimizers[1])):
                opt.zero_grad()
                poison(device)
                sum(o.float().sum() for o in _tuple(m(*inputs))).backward()
            pairs = [(p, q) for p, q in zip(model.parameters(), reference.parameters()) if q.grad is not None]
            largest = max(float(q.grad.norm()) for _, q in pairs)
            errors += [relative_error(p.grad, q.grad, floor=1e-4 * largest) for p, q in pairs]
            for p, q in pairs:
                p.grad.copy_(q.grad)
            poison(device)
            step()
            optimizers[1].step()
            errors += [relative_error(p, q) for p, q in zip(model.parameters(), reference.parameters())]
        return max(errors)

    return _counted("bert_train", f"forward + backward + AdamW step compiled, {steps} steps: every gradient "
                    "and parameter", F32_TOLERANCE, body)


def check_second_shape(device, sizes: dict) -> Check:
    workload = make("bert", **sizes)
    fn = _module(workload, device)

    def body() -> float:
        compiled = torch.compile(fn, backend="fusionstitching")
        ids, mask = _inputs(workload, device)
        worst = 0.0
        with torch.no_grad():
            for length in (ids.shape[1], ids.shape[1] // 2):
                short = (ids[:, :length].contiguous(), mask[:, :length].contiguous())
                poison(device)
                worst = max([worst] + [relative_error(o, r) for o, r in zip(compiled(*short), fn(*short))])
        return worst

    return _counted("bert", "two sequence lengths (a specialization each)", F32_TOLERANCE, body)


def check_dropout(device, numel: int = 1 << 22, p: float = 0.1) -> Check:
    """Not comparable element by element with eager (other random streams): the error reported is
    the dropped fraction's distance from p in standard deviations (tolerance 5), made infinite when
    a kept value is not 1/(1-p), two calls draw the same mask or a reseeded call a different one."""
    workload = dropout(numel=numel, p=p)

    def body() -> float:
        compiled = torch.compile(workload.fn, backend="fusionstitching")
        x = torch.ones(numel, device=device)
        torch.manual_seed(0)
        poison(device)
        first, second = compiled(x), compiled(x)
        torch.manual_seed(0)
        again = compiled(x)
        kept = first[first != 0]
        z = abs(float((first == 0).float().mean()) - p) / math.sqrt(p * (1 - p) / numel)
        scaled = kept.numel() > 0 and float((kept - 1 / (1 - p)).abs().max()) < 1e-6
        if not scaled or torch.equal(first, second) or not torch.equal(first, again):
            return math.inf
        return z

    return _counted("dropout", f"p={p} over {numel} elements: rate (σ), scale, fresh, repeatable", 5.0, body)


def run_all(device: torch.device, small: bool = False) -> list[Check]:
    def sizes(name: str) -> dict:
        if small:
            return {}
        return dict(REAL_SIZES.get(name, {}))

    bert = {} if small else {"layers": 12, "hidden": 768, "heads": 12, **REAL_SIZES["bert"]}
    checks: list[Callable[[], Check]] = []
    for name in ("layernorm", "softmax_scale_mask", "bias_gelu", "din_attention"):
        checks.append(lambda n=name: check_inference(n, device, sizes(n)))
    for name in ("layernorm_train", "mlp_train"):
        checks.append(lambda n=name: check_training(n, device, sizes(n)))
    checks += [lambda: check_adam(device, sizes("adam_step")),
               lambda: check_inference("bert", device, bert),
               lambda: check_inference("bert", device, bert, autocast=torch.bfloat16),
               lambda: check_second_shape(device, bert),
               lambda: check_training("bert_train", device, bert),
               lambda: check_bert_training_step(device, bert),
               lambda: check_dropout(device, numel=1 << (22 if not small else 16))]
    results = []
    for make_check in checks:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            check = make_check()
        print(f"  {check.name}: {check.what}: error {check.error:.2e} ({'ok' if check.passed else 'FAILED'}, "
              f"{check.seconds:.1f} s)", file=sys.stderr, flush=True)
        results.append(check)
    return results


def table(results: list[Check]) -> str:
    lines = ["| workload | check | error | tolerance | kernels | library calls | fallbacks | result |",
             "|---|---|---|---|---|---|---|---|"]
    for c in results:
        lines.append(f"| {c.name} | {c.what} | {c.error:.1e} | {c.tolerance:.0e} | {c.kernels} | {c.library} | "
                     f"{c.fallbacks} | {'pass' if c.passed else 'FAIL'} |")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--small", action="store_true", help="the workloads' small sizes")
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    name = torch.cuda.get_device_name() if device.type == "cuda" else "CPU (simulated kernels)"
    results = run_all(device, small=args.small or device.type == "cpu")
    print(f"device: {name}")
    print(table(results))
    return 0 if all(c.passed for c in results) else 1


if __name__ == "__main__":
    raise SystemExit(main())
