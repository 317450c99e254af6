"""examples/train_ddp.py under torchrun: data-parallel training with the compiled model gives eager's
losses, and DDP keeps every rank's parameters identical. On the CPU (gloo, the tiny model) in CI;
GPT-2 small on two GPUs under ``-m multigpu``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


def _run(tmp_path, compile_with: str, strategy: str, *extra: str, nproc: int = 2) -> dict:
    out = tmp_path / f"{compile_with}-{strategy}.json"
    command = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}", "--standalone",
               str(ROOT / "examples" / "train_ddp.py"), "--compile", compile_with, "--strategy", strategy,
               "--json", str(out), *extra]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=900, check=False)
    if done.returncode != 0 and out.exists() and _aborted_at_exit(done.stdout, done.stderr):
        # Every rank finished its steps and rank 0 wrote the results; a gloo thread then aborted the
        # interpreter's shutdown (seen on the eager run too). The results are what the test checks.
        print(f"{compile_with} {strategy}: a rank aborted after the process group was destroyed")
    else:
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
    return json.loads(out.read_text())


def _aborted_at_exit(stdout: str, stderr: str) -> bool:
    """Whether the run's only failure is the C++ runtime's abort at interpreter exit ("terminate
    called without an active exception", SIGABRT) after rank 0 destroyed its process group. The
    launcher then reports the failed child with a traceback of its own (``ChildFailedError``); a
    traceback of any other kind is a rank's error."""
    tracebacks = stderr.split("Traceback (most recent call last):")[1:]
    return ("process group destroyed" in stdout and "terminate called without an active exception" in stderr
            and "SIGABRT" in stderr and all("ChildFailedError" in t for t in tracebacks))


TINY = ("--tiny", "--steps", "3", "--batch", "2", "--seq", "32")


def _close(a: list[float], b: list[float], tolerance: float) -> bool:
    return all(abs(x - y) <= tolerance * abs(y) for x, y in zip(a, b)) and len(a) == len(b)


def test_ddp_matches_eager_on_the_cpu(tmp_path):
    eager = _run(tmp_path, "eager", "ddp", *TINY)
    ours = _run(tmp_path, "fusionstitching", "ddp", *TINY)
    assert _close(ours["losses"], eager["losses"], 1e-4), (ours["losses"], eager["losses"])
    assert len(set(ours["checksums"])) == 1  # every rank's parameters identical
    assert ours["checksums"][0] == pytest.approx(eager["checksums"][0], rel=1e-5)


def test_ddp_with_graphs_split_at_bucket_boundaries_matches_eager_on_the_cpu(tmp_path):
    """TorchDynamo's DDP optimizer splits the graph at gradient-bucket boundaries and runs each
    compiled piece once on fake tensors to shape the next piece's inputs; every piece compiles,
    and its backward finds its own metadata."""
    split = ("--layers", "4", "--width", "128", "--bucket-mb", "1")  # 3.8 MB of gradients in 1 MB buckets
    eager = _run(tmp_path, "eager", "ddp", *TINY, *split)
    ours = _run(tmp_path, "fusionstitching", "ddp", *TINY, *split)
    assert _close(ours["losses"], eager["losses"], 1e-4), (ours["losses"], eager["losses"])
    assert len(set(ours["checksums"])) == 1
    assert ours["checksums"][0] == pytest.approx(eager["checksums"][0], rel=1e-5)
    assert ours["compiler"].get("fallbacks", 0) == 0
    one_bucket = _run(tmp_path, "fusionstitching", "ddp", *TINY, "--layers", "4", "--width", "128")
    assert ours["compiler"]["graphs"] > one_bucket["compiler"]["graphs"]  # the pieces were compiled


def test_fsdp2_matches_eager_on_the_cpu(tmp_path):
    """FSDP2 frees its unsharded parameters by resizing their storage to 0 after each forward and
    backward: reading them must leave their storage resizable."""
    eager = _run(tmp_path, "eager", "fsdp2", *TINY)
    ours = _run(tmp_path, "fusionstitching", "fsdp2", *TINY)
    assert _close(ours["losses"], eager["losses"], 1e-4), (ours["losses"], eager["losses"])
    # Each rank holds its own shard: rank by rank, the shards match eager's.
    assert ours["checksums"] == pytest.approx(eager["checksums"], rel=1e-5)
    assert ours["compiler"].get("fallbacks", 0) == 0


@pytest.mark.multigpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs of one host")
@pytest.mark.parametrize("strategy", ["ddp", "fsdp2"])
def test_gpt2_small_on_two_gpus_matches_eager(tmp_path, strategy):
    """GPT-2 small, 20 steps, bf16 autocast, dropout off: losses within 2e-2 of eager's per step."""
    args = ("--steps", "20", "--batch", "8", "--seq", "512")
    eager = _run(tmp_path, "eager", strategy, *args)
    ours = _run(tmp_path, "fusionstitching", strategy, *args)
    assert _close(ours["losses"], eager["losses"], 2e-2), (ours["losses"], eager["losses"])
    if strategy == "ddp":
        assert len(set(ours["checksums"])) == 1
