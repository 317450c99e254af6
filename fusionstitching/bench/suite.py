"""``fusionstitching bench``: every system on the same inputs in one process, one table.

For each workload (``CASES``) and each system (eager PyTorch, TorchInductor, fusionstitching and,
for the micro workloads where JAX is installed, XLA through ``jax.jit``) the bench reports

- the first call in seconds (Dynamo capture + compilation + the call; compile caches are empty:
  Inductor's, Triton's and our NVRTC cache point to a new directory per workload unless
  ``warm_caches``);
- the wall time per call: the median over rounds of (calls of one round / their time, with one
  synchronization at the end of the round), the systems' rounds taken in turn so that a host
  that drifts during the run moves every system alike;
- the GPU time and the kernel count per call from the torch profiler (CUPTI), the kernels split by
  name into GEMM/library (cuBLAS, cuBLASLt, CUTLASS and Triton GEMM templates) and the rest, the
  memory-intensive kernels;
- the largest relative error of the outputs against eager (‖out − ref‖ / ‖ref‖; not for workloads
  that draw random numbers);
- the speedup of each system's wall time against every other system's.

A call is a forward pass (inference: ``torch.no_grad``) or, for training workloads, a forward and
backward pass of the sum of the outputs with the gradients set to None first, as
``optimizer.zero_grad()`` does. Mixed-precision workloads run the forward under ``torch.autocast``.
"""

from __future__ import annotations

import contextlib
import gc
import math
import os
import re
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from fusionstitching.bench import workloads as W

TOP_KERNELS = 20  # kernels kept per result, by GPU time
# "fusionstitching-untuned": the plan's templates, no schedule measured (``Options(tune="off")``);
# "fusionstitching-async": compiled in the background while the first calls run in PyTorch
# (``Options(async_compile=True)``), its first call against "aot_eager"'s (TorchDynamo and
# AOTAutograd, the graphs run by PyTorch); its rounds are timed once its compiles are done;
# "fusionstitching-loop": each GPU program run by the loop over its steps, not written out as one
# function (``Options(unroll=False)``): the host time the unrolled program saves.
SYSTEMS = ("eager", "inductor", "fusionstitching", "fusionstitching-untuned", "fusionstitching-async",
           "fusionstitching-loop", "aot_eager", "xla")
DEFAULT_SYSTEMS = ("eager", "inductor", "fusionstitching")

# Kernels that are not memory-intensive work, by name: GEMMs of cuBLAS (gemm, gemv, nvjet, xmma,
# splitKreduce), CUTLASS and Inductor's Triton templates (triton_tem_*); convolutions of cuDNN and
# PyTorch (fprop/dgrad/wgrad, implicit GEMM, winograd, depthwise and direct kernels); attention
# (flash, memory-efficient fmha, cuDNN's sdpa). A kernel a fusion compiler generated (fs_*, and
# Inductor's pointwise/reduction kernels triton_poi/per/red_*) is memory-intensive whatever op
# names it carries ("triton_poi_fused_convolution_0" is a bias add). One rule for every system.
GEMM_KERNEL = re.compile(r"gemm|gemv|nvjet|xmma|cutlass|cublas|splitkreduce|triton_tem|wgmma|dot_kernel|conv(?!ert)|fprop|"
                         r"dgrad|wgrad|winograd|depthwise|cudnn|fmha|flash|sdpa|attention", re.IGNORECASE)
GENERATED_KERNEL = re.compile(r"^(fs_|triton_(poi|per|red)_)")


def is_library_kernel(name: str) -> bool:
    """Whether a GPU kernel is a GEMM, convolution or attention (not memory-intensive work)."""
    return not GENERATED_KERNEL.match(name) and bool(GEMM_KERNEL.search(name))


@dataclass
class Case:
    """One benchmark workload: what is called, on which inputs, and how a call runs."""

    name: str
    fn: Callable[..., Any]  # a function or an nn.Module
    inputs: tuple[Any, ...]
    train: bool = False
    autocast: torch.dtype | None = None
    random: bool = False  # draws random numbers: outputs are not compared with eager's
    micro: bool = True  # a micro workload (JAX has a version of it)
    notes: str = ""
    extra: dict[str, Any] = field(default_factory=dict)

    def to(self, device: torch.device) -> Case:
        if isinstance(self.fn, torch.nn.Module):
            self.fn = self.fn.to(device)
        self.inputs = tuple(_to(x, device) for x in self.inputs)
        return self


def _to(x: Any, device: torch.device) -> Any:
    if not isinstance(x, torch.Tensor):
        return x
    y = x.detach().to(device)
    return y.requires_grad_(x.requires_grad)


def _layernorm(dtype, train):
    return lambda small: W.layernorm(**({} if small else {"batch": 16384, "hidden": 1024}), train=train,
                                     dtype=dtype)


def _bert(batch: int, train: bool):
    def build(small: bool) -> W.Workload:
        if small:
            return W.bert(batch=2, seq=16, train=train, dropout=0.1 if train else 0.0)
        return W.bert(batch=batch, seq=128, hidden=768, layers=12, heads=12, vocab=30522, train=train,
                      dropout=0.1 if train else 0.0)
    return build


# Arguments that say what a case computes, not how large it is: the small test size keeps them.
_KIND_ARGUMENTS = ("train", "dtype")


def _sized(factory: Callable[..., W.Workload], **real: Any) -> Callable[[bool], W.Workload]:
    kind = {name: value for name, value in real.items() if name in _KIND_ARGUMENTS}
    return lambda small: factory(**kind) if small else factory(**real)


# name → (workload factory taking ``small``, autocast dtype, micro workload, random, description)
CASES: dict[str, tuple[Callable[[bool], W.Workload], torch.dtype | None, bool, bool, str]] = {
    "layernorm": (_layernorm(torch.float32, False), None, True, False, "LayerNorm 16384×1024 f32 forward"),
    "layernorm_bf16": (_layernorm(torch.bfloat16, False), None, True, False, "LayerNorm 16384×1024 bf16 forward"),
    "layernorm_train": (_layernorm(torch.float32, True), None, True, False,
                        "LayerNorm 16384×1024 f32 forward + backward"),
    "layernorm_train_bf16": (_layernorm(torch.bfloat16, True), None, True, False,
                             "LayerNorm 16384×1024 bf16 forward + backward"),
    "rmsnorm": (_sized(W.rmsnorm, batch=8192, hidden=4096), None, True, False,
                "Llama RMSNorm (f32 mean square) 8192×4096 bf16 forward"),
    "rmsnorm_train": (_sized(W.rmsnorm, batch=8192, hidden=4096, train=True), None, True, False,
                      "Llama RMSNorm (f32 mean square) 8192×4096 bf16 forward + backward"),
    "softmax": (_sized(W.softmax_scale_mask, batch=32, heads=12, seq=128), None, True, False,
                "softmax(x·0.125 + mask) 32×12×128×128 f32"),
    "bias_gelu": (_sized(W.bias_gelu, tokens=16384, hidden=3072, dtype=torch.bfloat16), None, True, False,
                  "GELU(x + bias) 16384×3072 bf16"),
    "adam": (_sized(W.adam_step, shapes=W.bert_base_parameter_shapes()), None, True, False,
             "AdamW in place over BERT-base's 199 parameter shapes"),
    "mlp_train": (_sized(W.mlp_train, batch=4096, features=512, hidden=1024, classes=1000), None, True, False,
                  "MLP 512→1024→1000 + cross-entropy, batch 4096, forward + backward"),
    "din_attention": (_sized(W.din_attention, batch=2048, history=50, dim=64), None, True, False,
                      "DIN attention 2048×50×64: bmm, masked softmax, bmm"),
    "bert_layer": (_sized(W.bert_layer, batch=32, seq=128, hidden=768, heads=12), torch.bfloat16, False, False,
                   "one BERT-base encoder layer, batch 32 × 128, bf16 autocast, inference"),
    "bert_infer": (_bert(32, False), torch.bfloat16, False, False,
                   "BERT-base (12 layers) batch 32 × 128, bf16 autocast, inference"),
    "bert_infer_b1": (_bert(1, False), torch.bfloat16, False, False,
                      "BERT-base (12 layers) batch 1 × 128, bf16 autocast, inference"),
    "bert_train": (_bert(32, True), torch.bfloat16, False, True,
                   "BERT-base (12 layers) batch 32 × 128, bf16 autocast, dropout 0.1, forward + backward"),
    # The model zoo's pieces and models (random weights, no downloads).
    "rotary": (_sized(W.rotary, batch=4, heads=32, kv_heads=8, seq=1024, dim=128), None, True, False,
               "rotary embedding of q 4×32×1024×128 and k 4×8×1024×128, bf16"),
    "groupnorm_silu": (_sized(W.groupnorm_silu, batch=16, channels=512, size=64, groups=32), None, True, False,
                       "GroupNorm(32) + SiLU 16×512×64×64 bf16 forward"),
    "groupnorm_silu_train": (_sized(W.groupnorm_silu, batch=8, channels=256, size=64, groups=32,
                                    dtype=torch.float32, train=True), None, True, False,
                             "GroupNorm(32) + SiLU 8×256×64×64 f32 forward + backward"),
    "instancenorm": (_sized(W.instancenorm, batch=32, channels=128, size=64), None, True, False,
                     "InstanceNorm2d (affine) 32×128×64×64 f32 forward"),
    "cross_entropy": (_sized(W.cross_entropy, tokens=8192, vocab=32000), None, True, False,
                      "label-smoothing (0.1) cross-entropy of 8192 × 32000 bf16 logits in f32, forward + backward"),
    "cross_entropy_gpt2": (_sized(W.cross_entropy, tokens=4096, vocab=50257, smoothing=0.0), None, True, False,
                           ("cross-entropy of 4096 × 50257 bf16 logits in f32 (GPT-2's vocabulary: rows of odd "
                            "length), forward + backward")),
    "unet_block_train": (_sized(W.unet_block, batch=8, channels=256, size=64, groups=32), None, False, False,
                         ("UNet block (GroupNorm + SiLU + 3×3 conv, twice, skip) 8×256×64×64 f32, "
                         "forward + backward")),
    "unet_block_train_bf16": (_sized(W.unet_block, batch=8, channels=256, size=64, groups=32,
                                     dtype=torch.bfloat16), None, False, False,
                              "UNet block 8×256×64×64 bf16 weights and activations, forward + backward"),
    "resnet50_infer": (_sized(W.resnet50, batch=32, image=224, depths=(3, 4, 6, 3), widths=(256, 512, 1024, 2048),
                              stem=64), torch.bfloat16, False, False,
                       "ResNet-50 (BatchNorm eval) batch 32 × 224², bf16 autocast, inference"),
    "resnet50_train": (_sized(W.resnet50, batch=32, image=224, depths=(3, 4, 6, 3), widths=(256, 512, 1024, 2048),
                              stem=64, train=True), torch.bfloat16, False, False,
                       "ResNet-50 (BatchNorm training) batch 32 × 224², bf16 autocast, forward + backward"),
    "gpt2_infer": (_sized(W.gpt2, batch=8, seq=512, hidden=768, layers=12, heads=12, vocab=50257),
                   torch.bfloat16, False, False,
                   "GPT-2 small (12 layers, eager attention) batch 8 × 512, bf16 autocast, logits"),
    "gpt2_train": (_sized(W.gpt2, batch=8, seq=512, hidden=768, layers=12, heads=12, vocab=50257, train=True),
                   torch.bfloat16, False, False,
                   "GPT-2 small (12 layers, eager attention) batch 8 × 512, bf16 autocast, LM loss forward + backward"),
    "llama_infer": (_sized(W.llama, batch=4, seq=1024, hidden=2048, layers=4, heads=16, kv_heads=4,
                           intermediate=5632, vocab=32000), torch.bfloat16, False, False,
                    ("Llama-style decoder (hidden 2048, 4 layers, GQA 16/4 sdpa, SwiGLU) batch 4 × 1024, bf16 "
                    "autocast, logits")),
    "llama_train": (_sized(W.llama, batch=4, seq=1024, hidden=2048, layers=4, heads=16, kv_heads=4,
                           intermediate=5632, vocab=32000, train=True), torch.bfloat16, False, False,
                    "Llama-style decoder batch 4 × 1024, bf16 autocast, LM loss forward + backward"),
}
# Rows of whole models, for ``bench --zoo``.
ZOO = ("bert_infer", "bert_train", "gpt2_infer", "gpt2_train", "llama_infer", "llama_train", "unet_block_train",
       "unet_block_train_bf16", "resnet50_infer", "resnet50_train")
MICRO = tuple(name for name, spec in CASES.items() if spec[2])


def make_case(name: str, small: bool = False) -> Case:
    """The benchmark case ``name`` (``small``: the test sizes of ``bench/workloads.py``)."""
    if name not in CASES:
        raise KeyError(f"unknown bench workload {name!r}; known: {', '.join(CASES)}")
    factory, autocast, micro, random, notes = CASES[name]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        workload = factory(small)
    return Case(name, workload.fn, workload.inputs, workload.train, autocast, random, micro, notes, workload.extra)


# ----------------------------------------------------------------------------------------------
# One call of a case
# ----------------------------------------------------------------------------------------------


def _leaves(case: Case) -> list[torch.Tensor]:
    params = list(case.fn.parameters()) if isinstance(case.fn, torch.nn.Module) else []
    return params + [x for x in case.inputs if isinstance(x, torch.Tensor) and x.requires_grad]


def step_function(case: Case, fn: Callable[..., Any]) -> Callable[[], Any]:
    """A zero-argument callable running one call of ``case`` through ``fn``; returns the outputs."""
    leaves = _leaves(case) if case.train else []
    device = next((x.device for x in case.inputs if isinstance(x, torch.Tensor)), torch.device("cpu"))
    autocast = (lambda: torch.autocast(device.type, dtype=case.autocast)) if case.autocast else contextlib.nullcontext

    def step() -> Any:
        if case.train:
            for leaf in leaves:
                leaf.grad = None
            with autocast():
                outs = fn(*case.inputs)
            tensors = _tensors(outs)
            sum(t.float().sum() for t in tensors if t.requires_grad).backward()
            return outs
        with torch.no_grad(), autocast():
            return fn(*case.inputs)

    return step


def _tensors(outs: Any) -> list[torch.Tensor]:
    if isinstance(outs, torch.Tensor):
        return [outs]
    if isinstance(outs, (tuple, list)):
        return [t for o in outs for t in _tensors(o)]
    return []


def relative_error(outs: Any, reference: Any) -> float:
    """The largest ‖out − ref‖ / ‖ref‖ over the outputs (inf on a shape mismatch, NaN if any NaN)."""
    got, want = _tensors(outs), _tensors(reference)
    if len(got) != len(want):
        return math.inf
    worst = 0.0
    for g, w in zip(got, want):
        g, w = g.detach().float().cpu(), w.detach().float().cpu()
        if g.shape != w.shape:
            return math.inf
        norm = float(w.norm())
        error = float((g - w).norm()) / (norm if norm > 0 else 1.0)
        if math.isnan(error):
            return math.nan
        worst = max(worst, error)
    return worst


# ----------------------------------------------------------------------------------------------
# Measurements
# ----------------------------------------------------------------------------------------------


@dataclass
class Result:
    workload: str
    system: str
    wall_ms: float | None = None
    gpu_ms: float | None = None
    mi_ms: float | None = None  # GPU ms of the memory-intensive kernels
    kernels: int | None = None
    gemm_kernels: int | None = None
    mi_kernels: int | None = None
    first_call_s: float | None = None
    error: float | None = None
    skipped: str = ""  # why the system did not run this workload
    speedup: dict[str, float] = field(default_factory=dict)  # other system → its wall / ours
    # (name, µs, launches, bytes moved, a same-size copy's time / the kernel's) per call
    top_kernels: list[tuple] = field(default_factory=list)
    # fusionstitching's first call by compile phase (``stats()["compile seconds"]``, ``_host.PHASES``)
    first_call_phases: dict[str, float] = field(default_factory=dict)


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def wall_ms(step: Callable[[], Any], sync: Callable[[Any], None], rounds: int = 5,
            round_seconds: float = 0.2) -> float:
    """Median over ``rounds`` of the wall time per call; calls per round chosen to last ~``round_seconds``.
    ``sync(outputs)`` waits for the device once per round."""
    return interleaved_wall_ms({"": (step, sync)}, rounds, round_seconds)[""]


def interleaved_wall_ms(steps: dict[str, tuple[Callable[[], Any], Callable[[Any], None]]], rounds: int = 5,
                        round_seconds: float = 0.2) -> dict[str, float]:
    """``wall_ms`` of several systems, their rounds taken in turn (A B C A B C ...): a host that
    slows down or speeds up during the run moves every system's median alike, where timing one
    system after the other would hand the drift to whichever ran in the slow stretch."""
    calls = {}
    for name, (step, sync) in steps.items():
        sync(step())
        start = time.perf_counter()
        sync(step())
        once = time.perf_counter() - start
        calls[name] = max(1, min(1000, int(round_seconds / max(once, 1e-6))))
    times: dict[str, list[float]] = {name: [] for name in steps}
    for _ in range(rounds):
        for name, (step, sync) in steps.items():
            start = time.perf_counter()
            for _ in range(calls[name]):
                outs = step()
            sync(outs)
            times[name].append((time.perf_counter() - start) / calls[name])
    return {name: statistics.median(t) * 1e3 for name, t in times.items()}


def profile_kernels(step: Callable[[], Any], sync: Callable[[Any], None], calls: int = 3,
                    by_name: dict[str, list[float]] | None = None) -> tuple[float, int, int]:
    """(GPU ms, GEMM/library kernels, memory-intensive kernels) per call, from the torch profiler;
    ``by_name`` receives [µs, launches] per call of each kernel name."""
    from torch.profiler import ProfilerActivity, profile

    sync(step())
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            outs = step()
        sync(outs)
    busy, gemm, other = 0.0, 0, 0
    for event in prof.events():
        if event.device_type.name != "CUDA":
            continue
        name = event.name.lower()
        if "memcpy" in name or "memset" in name:
            continue
        busy += event.time_range.elapsed_us()
        if by_name is not None:
            entry = by_name.setdefault(event.name, [0.0, 0.0])
            entry[0] += event.time_range.elapsed_us() / calls
            entry[1] += 1 / calls
        if is_library_kernel(event.name):
            gemm += 1
        else:
            other += 1
    return busy / calls / 1e3, round(gemm / calls), round(other / calls)


@contextlib.contextmanager
def fresh_caches(enabled: bool):
    """Inductor's and Triton's caches in a new empty directory while inside; yields the cache root
    for fusionstitching (``Options.cache_dir``) in that directory, or None when not ``enabled``."""
    if not enabled:
        yield None
        return
    names = ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR")
    saved = {name: os.environ.get(name) for name in names}
    with tempfile.TemporaryDirectory(prefix="fusionstitching-bench-") as root:
        for name in names:
            os.environ[name] = os.path.join(root, name.lower())
        try:
            yield os.path.join(root, "fusionstitching")
        finally:
            for name, value in saved.items():
                if value is None:
                    os.environ.pop(name, None)
                else:
                    os.environ[name] = value


def _compiled(case: Case, system: str, cache_dir: str | None = None, options: dict | None = None) -> Callable[..., Any]:
    if system == "eager":
        return case.fn
    torch._dynamo.reset()
    if system == "inductor":
        return torch.compile(case.fn, backend="inductor")
    if system == "aot_eager":
        return torch.compile(case.fn, backend="aot_eager")
    if system in ("fusionstitching", "fusionstitching-untuned", "fusionstitching-async", "fusionstitching-loop"):
        import fusionstitching  # noqa: F401  (registers the backend)

        chosen = dict(options or {})
        if system == "fusionstitching-untuned":
            chosen["tune"] = "off"
        if system == "fusionstitching-async":
            chosen["async_compile"] = True
        if system == "fusionstitching-loop":
            chosen["unroll"] = False
        if cache_dir is not None:
            chosen["cache_dir"] = cache_dir
        return torch.compile(case.fn, backend="fusionstitching", options=chosen or None)
    raise KeyError(f"unknown system {system!r}; known: {', '.join(SYSTEMS)}")


class Progress:
    """One status line on stderr, rewritten in place on a terminal."""

    def __init__(self, stream=None) -> None:
        self.stream = stream if stream is not None else sys.stderr
        self.tty = hasattr(self.stream, "isatty") and self.stream.isatty()

    def __call__(self, text: str) -> None:
        if self.tty:
            self.stream.write(f"\r\x1b[K{text}")
        else:
            self.stream.write(text + "\n")
        self.stream.flush()

    def done(self) -> None:
        if self.tty:
            self.stream.write("\r\x1b[K")
            self.stream.flush()


def _torch_system(case: Case, system: str, device: torch.device, progress: Callable[[str], None],
                  cache_dir: str | None = None):
    """(step, sync, first-call seconds, comparable outputs of a call) for a PyTorch system."""
    progress(f"{case.name}: {system}: compiling and first call")
    fn = _compiled(case, system, cache_dir)
    start = time.perf_counter()
    step = step_function(case, fn)
    step()
    _synchronize(device)
    first = time.perf_counter() - start
    if system == "fusionstitching-async":  # the rounds time the compiled program
        from fusionstitching import wait_for_compiles

        wait_for_compiles()
    return step, lambda _: _synchronize(device), first, _tensors


def _compile_seconds() -> dict[str, float]:
    from fusionstitching import stats

    return dict(stats()["compile seconds"])


def run_case(case: Case, systems: Sequence[str], device: torch.device, rounds: int = 5,
             warm_caches: bool = False, progress: Callable[[str], None] = lambda _: None) -> list[Result]:
    """Every system on ``case`` (already on ``device``); eager's outputs are the reference.

    Each system compiles with its compile caches empty: one new directory per case, in which
    Inductor/Triton and our NVRTC cache have directories of their own. Every system's compiled
    step stays alive until the case is done (its kept buffers too). The wall times are then taken in interleaved rounds (``interleaved_wall_ms``)
    and the GPU profiles one system after the other."""
    with fresh_caches(not warm_caches) as cache_dir:
        return _run_case(case, systems, device, rounds, progress, cache_dir)


def _run_case(case: Case, systems: Sequence[str], device: torch.device, rounds: int,
              progress: Callable[[str], None], cache_dir: str | None = None) -> list[Result]:
    results: list[Result] = []
    reference: list[torch.Tensor] = []
    steps: dict[str, tuple[Callable[[], Any], Callable[[Any], None]]] = {}
    for system in systems:
        result = Result(case.name, system)
        results.append(result)
        if system == "xla":
            from fusionstitching.bench import jax_cases

            reason = jax_cases.unavailable(case, device)
            if reason:
                result.skipped = reason
                continue
            progress(f"{case.name}: xla: compiling and first call")
            step, sync, first, comparable = jax_cases.system(case)
        else:
            before = _compile_seconds() if system.startswith("fusionstitching") else None
            step, sync, first, comparable = _torch_system(case, system, device, progress, cache_dir)
            if before is not None:
                result.first_call_phases = {phase: round(seconds - before[phase], 3)
                                            for phase, seconds in _compile_seconds().items()}
        result.first_call_s = first
        outs = comparable(step())
        if system == "eager":
            reference = outs
        elif reference and not case.random:
            result.error = relative_error(outs, reference)
        del outs
        steps[system] = (step, sync)
    # Each compile reset TorchDynamo: the first calls here compile the earlier systems again, from
    # the caches their first compile filled.
    progress(f"{case.name}: timing {', '.join(steps)} in turn")
    walls = interleaved_wall_ms(steps, rounds=rounds)
    by_system = {r.system: r for r in results}
    copy_us = _copy_time(device)
    for system, (step, sync) in steps.items():
        result = by_system[system]
        result.wall_ms = walls[system]
        if device.type == "cuda":
            progress(f"{case.name}: {system}: profiling")
            by_name: dict[str, list[float]] = {}
            result.gpu_ms, result.gemm_kernels, result.mi_kernels = profile_kernels(step, sync, by_name=by_name)
            result.mi_ms = sum(us for name, (us, _) in by_name.items() if not is_library_kernel(name)) / 1e3
            ranked = sorted(by_name.items(), key=lambda kv: -kv[1][0])
            result.top_kernels = [_top_entry(name, us, n, copy_us) for name, (us, n) in ranked[:TOP_KERNELS]]
            result.kernels = result.gemm_kernels + result.mi_kernels
    steps.clear()
    gc.collect()
    timed = [r for r in results if r.wall_ms]
    for r in timed:
        r.speedup = {o.system: o.wall_ms / r.wall_ms for o in timed if o is not r}
    return results


def _copy_time(device: torch.device) -> Callable[[int], float] | None:
    """µs a copy moving so many bytes takes on ``device`` (its measured bandwidth curve, L2 cold)."""
    if device.type != "cuda":
        return None
    from fusionstitching.cost.bandwidth import bandwidth_model
    from fusionstitching.cost.gpu_spec import spec_key

    key = spec_key(torch.cuda.get_device_name(device))
    return bandwidth_model(key).time_us if key else None


def _top_entry(name: str, us: float, launches: float, copy_us: Callable[[int], float] | None) -> tuple:
    """(name, µs, launches, bytes moved per launch, a same-size copy's time over the kernel's) per
    call; the last two are known for generated kernels only (None for others)."""
    from fusionstitching.runtime.program import KERNEL_BYTES

    moved = KERNEL_BYTES.get(name)
    fraction = None
    if moved and copy_us and us > 0:
        fraction = round(copy_us(moved) * launches / us, 3)
    return name, round(us, 2), round(launches, 2), moved, fraction


def run(names: Sequence[str], systems: Sequence[str] = DEFAULT_SYSTEMS, device: str | None = None,
        small: bool = False, rounds: int = 5, warm_caches: bool = False,
        progress: Callable[[str], None] | None = None) -> list[Result]:
    """Run ``names`` (bench workloads) on every system; ``device`` defaults to the GPU if any."""
    for system in systems:
        if system not in SYSTEMS:
            raise KeyError(f"unknown system {system!r}; known: {', '.join(SYSTEMS)}")
    try:
        target = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    except RuntimeError as err:
        raise KeyError(f"unknown device {device!r}: {err}") from None
    progress = progress or Progress()
    results: list[Result] = []
    for k, name in enumerate(names):
        prefix = f"[{k + 1}/{len(names)}] "
        progress(f"{prefix}{name}: building inputs")
        case = make_case(name, small=small).to(target)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            results += run_case(case, systems, target, rounds, warm_caches, lambda text, p=prefix: progress(p + text))
        del case
        gc.collect()
        if target.type == "cuda":
            torch.cuda.empty_cache()
    if isinstance(progress, Progress):
        progress.done()
    return results


# ----------------------------------------------------------------------------------------------
# Reporting
# ----------------------------------------------------------------------------------------------


def _number(value: float | None, digits: int) -> str:
    if value is None:
        return "—"
    if math.isnan(value) or math.isinf(value):
        return str(value)
    return f"{value:.{digits}f}"


def format_table(results: Sequence[Result], systems: Sequence[str]) -> str:
    """A markdown table: one row per workload and system."""
    others = [s for s in systems if s != "xla"] + (["xla"] if "xla" in systems else [])
    header = ["workload", "system", "wall ms", "GPU ms (MI)", "kernels (library + MI)", "first call s", "rel. error"]
    header += [f"× {s}" for s in others]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for r in results:
        if r.skipped:
            cells = [r.workload, r.system, f"skipped: {r.skipped}"] + [""] * (len(header) - 3)
        else:
            kernels = "—" if r.kernels is None else f"{r.kernels} ({r.gemm_kernels} + {r.mi_kernels})"
            error = "—" if r.error is None else f"{r.error:.1e}"
            gpu = _number(r.gpu_ms, 3) + ("" if r.mi_ms is None else f" ({r.mi_ms:.3f})")
            cells = [r.workload, r.system, _number(r.wall_ms, 3), gpu, kernels,
                     _number(r.first_call_s, 1), error]
            cells += ["" if s == r.system or s not in r.speedup else f"{r.speedup[s]:.2f}" for s in others]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def format_top_kernels(results: Sequence[Result], count: int) -> str:
    """The ``count`` kernels with the most GPU time per call, for every result."""
    lines = []
    for r in results:
        if not r.top_kernels:
            continue
        lines.append(f"{r.workload} / {r.system}: {r.gpu_ms:.3f} GPU ms per call")
        if r.first_call_phases:
            lines.append(f"  first call {r.first_call_s:.1f} s: " + ", ".join(
                f"{phase} {seconds:.1f} s" for phase, seconds in r.first_call_phases.items()))
        for name, us, launches, *moved in r.top_kernels[:count]:
            nbytes, fraction = (moved + [None, None])[:2]
            size = "" if not nbytes else f"{nbytes / 1e6:9.1f} MB"
            copy = "" if fraction is None else f"{fraction:5.0%} of copy"
            lines.append(f"  {us:9.1f} µs  {launches:6.1f}×  {size:>12}  {copy:>12}  {name[:100]}")
    return "\n".join(lines)


def to_json(results: Sequence[Result]) -> dict[str, Any]:
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    return {"device": device, "torch": torch.__version__, "results": [asdict(r) for r in results]}
