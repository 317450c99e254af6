"""Data-parallel training of GPT-2 small (random weights, synthetic batches) with a compiled model.

    torchrun --nproc-per-node N examples/train_ddp.py --compile {eager,inductor,fusionstitching} \\
        --strategy {ddp,fsdp2} [--steps 20] [--batch 8] [--seq 512] [--tiny] [--json FILE]

Every rank draws its own batches from a generator seeded by rank and step, so that runs with
different compilers see the same data. The model runs under bf16 autocast on GPUs (f32 on the CPU,
where the processes talk through gloo), with AdamW, dropout off. Rank 0 prints each step's loss
(the mean over ranks) and time, then tokens per second over the steps after the first (which
compiles), the first step's time, and on GPUs the kernel counts of one step (torch profiler:
GEMM/convolution/attention library kernels against memory-intensive ones). ``--json`` writes the
same figures, with a checksum of each rank's parameters (equal on every rank under DDP).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

import torch
import torch.distributed as dist


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--compile", choices=("eager", "inductor", "fusionstitching"), default="fusionstitching")
    parser.add_argument("--strategy", choices=("ddp", "fsdp2"), default="ddp")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--batch", type=int, default=8, help="sequences per rank and step")
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--tiny", action="store_true", help="a 1000-token vocabulary, 2 layers of width 64 "
                        "(--layers, --width)")
    parser.add_argument("--layers", type=int, default=2, help="layers of the tiny model")
    parser.add_argument("--width", type=int, default=64, help="hidden size of the tiny model (4 heads)")
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--bucket-mb", type=float, default=25.0,
                        help="DDP's gradient buckets (TorchDynamo splits the graph at their boundaries)")
    parser.add_argument("--json", metavar="FILE", help="write the run's figures (rank 0)")
    return parser.parse_args(argv)


def build_model(tiny: bool, layers: int = 2, width: int = 64) -> torch.nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    size = {"n_layer": layers, "n_embd": width, "n_head": 4, "vocab_size": 1000, "n_positions": 256} if tiny else \
        {"n_layer": 12, "n_embd": 768, "n_head": 12, "vocab_size": 50257, "n_positions": 1024}
    config = GPT2Config(**size, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False)
    config._attn_implementation = "eager"
    torch.manual_seed(0)  # the same initial weights on every rank and in every run
    return GPT2LMHeadModel(config)


def wrap(model: torch.nn.Module, strategy: str, device: torch.device, bucket_mb: float) -> torch.nn.Module:
    if strategy == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        return DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None,
                                       bucket_cap_mb=bucket_mb)
    from torch.distributed.fsdp import fully_shard

    for block in model.transformer.h:
        fully_shard(block)
    fully_shard(model)
    return model


def compiled(model: torch.nn.Module, how: str) -> torch.nn.Module:
    if how == "eager":
        return model
    if how == "fusionstitching":
        import fusionstitching  # noqa: F401 -- registers the backend

        return torch.compile(model, backend="fusionstitching")
    return torch.compile(model)


def batch(rank: int, step: int, size: int, seq: int, vocab: int, device: torch.device) -> torch.Tensor:
    generator = torch.Generator().manual_seed(1_000_003 * rank + step)
    return torch.randint(0, vocab, (size, seq), generator=generator).to(device)


def kernel_counts(step_fn: Any) -> dict[str, float]:
    """Kernels of one step on this rank's GPU and their GPU time (ms): library (GEMM, convolution,
    attention), communication (NCCL) and memory-intensive (the rest), classified as ``bench`` does."""
    from torch.profiler import ProfilerActivity, profile

    from fusionstitching.bench.suite import is_library_kernel

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step_fn()
        torch.cuda.synchronize()
    counts: dict[str, float] = {"kernels": 0, "library": 0, "communication": 0, "memory-intensive": 0,
                                "library ms": 0.0, "communication ms": 0.0, "memory-intensive ms": 0.0}
    for event in prof.events():
        if event.device_type != torch.autograd.DeviceType.CUDA or event.name.startswith(("Memcpy", "Memset")):
            continue
        kind = ("communication" if "nccl" in event.name.lower() else
                "library" if is_library_kernel(event.name) else "memory-intensive")
        counts["kernels"] += 1
        counts[kind] += 1
        counts[f"{kind} ms"] += event.time_range.elapsed_us() / 1e3
    return counts


def checksum(model: torch.nn.Module) -> float:
    total = torch.zeros((), dtype=torch.float64)
    for p in model.parameters():
        local = p.to_local() if hasattr(p, "to_local") else p  # an FSDP2 shard
        total += local.detach().double().sum().cpu()
    return float(total)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    local = int(os.environ.get("LOCAL_RANK", rank))
    device = torch.device("cuda", local) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    model = build_model(args.tiny, args.layers, args.width).to(device)
    vocab, seq = model.config.vocab_size, min(args.seq, model.config.n_positions)
    model = compiled(wrap(model, args.strategy, device, args.bucket_mb), args.compile)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if cuda else torch.autocast("cpu", enabled=False)

    def step(k: int) -> torch.Tensor:
        ids = batch(rank, k, args.batch, seq, vocab, device)
        with autocast:
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.detach()

    losses, times = [], []
    for k in range(args.steps):
        start = time.perf_counter()
        loss = step(k)
        dist.all_reduce(loss)
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
        losses.append(float(loss) / world)
        if rank == 0:
            print(f"step {k:3d}  loss {losses[-1]:.5f}  {1e3 * times[-1]:9.1f} ms", flush=True)
    timed = times[1:] or times
    tokens_per_s = world * args.batch * seq * len(timed) / sum(timed)
    counts = kernel_counts(lambda: step(args.steps)) if cuda else None
    sums = [None] * world
    dist.all_gather_object(sums, checksum(model))
    compiler = None
    if args.compile == "fusionstitching":
        import fusionstitching

        compiler = fusionstitching.stats()  # graphs compiled (one per piece of a split graph), fallbacks
    if rank == 0:
        print(f"{args.compile} {args.strategy} x{world}: {tokens_per_s:,.0f} tokens/s, first step {times[0]:.1f} s")
        if counts:
            print(f"one step: {counts['kernels']} kernels ({counts['library']} library, "
                  f"{counts['communication']} communication, {counts['memory-intensive']} memory-intensive); "
                  f"memory-intensive GPU time {counts['memory-intensive ms']:.2f} ms")
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"compile": args.compile, "strategy": args.strategy, "world": world, "losses": losses,
                           "step_s": times, "tokens_per_s": tokens_per_s, "kernels": counts, "checksums": sums,
                           "compiler": compiler}, f)
    dist.barrier()
    dist.destroy_process_group()
    if rank == 0:
        print("process group destroyed", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
