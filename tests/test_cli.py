"""The fusionstitching command."""

from __future__ import annotations

import json

from fusionstitching.cli import main
from fusionstitching.graph.serialize import from_json


def test_graph_command_prints_categories_and_writes_json(tmp_path, capsys):
    path = tmp_path / "ln.json"
    assert main(["graph", "layernorm", "--train", "--json", str(path)]) == 0
    out = capsys.readouterr().out
    assert "layernorm_train forward: 32 nodes, fusable fraction 1.00" in out
    assert "reduction" in out and "library ops: none" in out
    forward = from_json(path.read_text())
    backward = from_json((tmp_path / "ln.backward.json").read_text())
    assert len(forward.parameters) == 3 and len(backward.outputs) == 3
    assert json.loads(path.read_text())["format"] == "fusionstitching.graph"


def test_graph_command_rejects_unknown_workloads(capsys):
    assert main(["graph", "no_such_workload"]) == 2
    assert "unknown workload 'no_such_workload'" in capsys.readouterr().err


def test_plan_command_prints_patterns_and_kernel_counts(capsys):
    assert main(["plan", "softmax_scale_mask"]) == 0
    out = capsys.readouterr().out
    assert "softmax_scale_mask forward: 1 kernels" in out
    row = next(line for line in out.splitlines() if line.startswith("| forward"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    unfused, base, fused = int(cells[2]), int(cells[3]), int(cells[4])
    assert fused == 1 and base > fused and unfused > base


def test_plan_command_explains_training_plans(capsys):
    assert main(["plan", "layernorm", "--train", "--explain"]) == 0
    out = capsys.readouterr().out
    assert "plan for graph layernorm_train_backward: 1 kernels" in out and "kernel 0:" in out
    assert main(["plan", "mlp_train", "--explain"]) == 0
    out = capsys.readouterr().out
    assert "edges left unfused:" in out
    edges = out.split("edges left unfused:")[1].split("fusionstitching (")[0].strip().splitlines()
    assert edges and all(" -> " in e and e.split(": ", 1)[1].strip() for e in edges)


def test_explain_command_writes_every_stage_of_every_graph(tmp_path, capsys):
    assert main(["explain", "layernorm", "--train", "--out", str(tmp_path)]) == 0
    assert "layernorm_train_backward: 1 kernels" in capsys.readouterr().out
    for name in ("layernorm_train_forward", "layernorm_train_backward"):
        folder = tmp_path / name
        assert (folder / "1-graph.txt").read_text().startswith(f"graph {name}(")
        assert "kernel 0:" in (folder / "2-explore.txt").read_text()
        (source,) = folder.glob("3-kernel000-*.cu")
        text = source.read_text()
        assert text.startswith("// template: ") and "// shared memory plan:" in text and "__global__" in text
        resources = (folder / "4-resources.txt").read_text().splitlines()
        assert resources[0] == "ptxas resource report per kernel for sm_90:"
        assert len(resources) == 4 and int(resources[3].split("|")[2]) > 0  # registers of the one kernel
        seconds = {row.split("|")[1].strip(): float(row.split("|")[2]) for row in
                   (folder / "5-compile-seconds.txt").read_text().splitlines()[3:]}
        assert set(seconds) == {"exploration", "code generation", "nvrtc", "tuning",
                                "capture (tracing and conversion of every graph of the program)"}
        assert seconds["exploration"] > 0 and seconds["capture (tracing and conversion of every graph of the program)"] > 0


def test_explain_command_rejects_unknown_workloads(tmp_path, capsys):
    assert main(["explain", "no_such_workload", "--out", str(tmp_path)]) == 2
    assert "unknown workload 'no_such_workload'" in capsys.readouterr().err


def test_perflib_command_lists_entries_and_prunes_stale_ones(tmp_path, capsys):
    from fusionstitching.cost.perflib import Measured, PerfLib
    from fusionstitching.runtime.gemm_timing import LIBRARY, library_version
    from fusionstitching.runtime.tuner import generator

    library = PerfLib(tmp_path / "perflib.sqlite")
    library.store("a" * 32, [Measured("n0[GRID]; launch(blocks=1,threads=32)", 10.0),
                             Measured("n0[GRID]; launch(blocks=2,threads=32)", 5.0, model_rank=1)],
                  description="reduce; f32[8, 8]", device="Test GPU", arch="sm_90", generator=generator())
    library.store("b" * 32, [Measured("n0[GRID]; launch(blocks=1,threads=64)", 1.0)], generator="old")
    # a GEMM's times (runtime/gemm_timing.py): listed apart, kept while the GEMM library is current
    for key, version in (("c" * 32, library_version()), ("d" * 32, f"{LIBRARY} torch 0.1 cuda 1.0")):
        library.store(key, [Measured("unaligned", 26.4), Measured("padded", 9.8)], chosen="padded",
                      description="GEMM bf16->bf16 NT batch 96 m 300 k 64 n 300 padded to m 300 k 64 n 304",
                      device="Test GPU", generator=version)
    assert main(["perflib", "--cache-dir", str(tmp_path), "--key", "aaaa"]) == 0
    out = capsys.readouterr().out
    assert "2 patterns" in out and "2 GEMM problems" in out and "| Test GPU | reduce; f32[8, 8] |" in out
    assert "stale" in out
    assert "won by" not in out and "the model's first choice was the measured winner for 1 of 2" in out
    assert "rank 1" in out and "5.0 µs" in out
    assert "| GEMM bf16->bf16 NT batch 96 m 300 k 64 n 300 padded to m 300 k 64 n 304 | 26.4 | 9.8 | yes |" in out
    assert main(["perflib", "--cache-dir", str(tmp_path), "--prune-stale"]) == 0
    assert "2 entries removed" in capsys.readouterr().out
    assert sorted(w.key for w in library.winners()) == ["a" * 32, "c" * 32]


def test_tune_command_needs_a_gpu(capsys):
    import pytest
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is here: the command tunes")
    assert main(["tune", "layernorm"]) == 2
    assert "no CUDA device" in capsys.readouterr().err
