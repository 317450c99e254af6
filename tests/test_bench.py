"""The bench (``fusionstitching bench``, ``bench/suite.py``) and the demo's plan table."""

from __future__ import annotations

import io
import json
import math
import warnings

import pytest
import torch

from fusionstitching.bench import demo, suite
from fusionstitching.cli import main

gpu_only = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def test_library_kernels_are_told_from_memory_intensive_ones_by_name():
    """GEMMs, convolutions and attention are library work for every system; what a fusion compiler
    generated is memory-intensive whatever op names its kernel carries."""
    library = ["nvjet_tst_128x64_64x8_1x2_h_bz_coopA_TNN", "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize",
               "ampere_sgemm_128x64_tn", "cutlass::Kernel2<cutlass_80_tensorop_s1688gemm>", "gemv2T_kernel_val",
               "splitKreduce_kernel", "triton_tem_fused_mm_0",
               "sm90_xmma_fprop_implicit_gemm_bf16bf16_bf16f32_f32_nhwckrsc_nhwc_tilesize128x128x64",
               "void cudnn::engines_precompiled::nchwToNhwcKernel<float>", "sm80_xmma_dgrad_implicit_gemm",
               "void at::native::conv_depthwise2d_forward_kernel<float>",
               "void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<128, 128>>",
               "fmha_cutlassB_bf16_aligned_64x64_k128_sm80", "cudnn_generated_fort_native_sdpa_sm90_flash_fprop"]
    memory = ["triton_per_fused_native_layer_norm_0", "fs_bert_forward_1_add_7", "triton_poi_fused_convolution_0",
              "fs_din_attention_forward_0_bmm_softmax", "triton_red_fused__scaled_dot_product_attention_1",
              "void at::native::vectorized_elementwise_kernel<4>", "void at::native::reduce_kernel<512, 1>",
              "void at::native::unrolled_elementwise_kernel<convert_to_float>"]
    assert all(suite.is_library_kernel(name) for name in library)
    assert not any(suite.is_library_kernel(name) for name in memory)


def test_top_kernels_give_the_bytes_a_generated_kernel_moves_against_a_copy():
    from fusionstitching.runtime.program import KERNEL_BYTES

    KERNEL_BYTES["fs_test_top_0"] = 64_000_000
    name, us, launches, moved, fraction = suite._top_entry("fs_test_top_0", 100.0, 2.0, lambda n: n / 1.6e6)
    assert (name, us, launches, moved) == ("fs_test_top_0", 100.0, 2.0, 64_000_000)
    assert fraction == pytest.approx(0.8)  # two launches of a 40 µs copy's bytes in 100 µs
    assert suite._top_entry("triton_poi_fused_add_0", 5.0, 1.0, lambda n: 1.0)[3:] == (None, None)
    result = suite.Result("w", "fusionstitching", gpu_ms=0.1,
                          top_kernels=[(name, us, launches, moved, fraction), ("k", 1.0, 1.0)])
    text = suite.format_top_kernels([result], 2)
    assert "64.0 MB" in text and "80% of copy" in text and text.rstrip().endswith("k")
    del KERNEL_BYTES["fs_test_top_0"]


def test_relative_error_compares_every_output():
    a, b = torch.ones(4), torch.ones(4)
    assert suite.relative_error((a, [b]), (a, [b])) == 0.0
    assert suite.relative_error(a + 1, a) == pytest.approx(1.0)
    assert suite.relative_error((a,), (a, b)) == math.inf
    assert math.isnan(suite.relative_error(a * math.nan, a))


def test_cases_build_at_small_sizes_and_say_what_they_are():
    for name in ("layernorm_train_bf16", "adam", "din_attention", "bert_layer"):
        case = suite.make_case(name, small=True)
        assert case.notes and case.inputs
    assert suite.make_case("bert_layer", small=True).autocast is torch.bfloat16
    assert suite.make_case("layernorm_train", small=True).train
    assert suite.make_case("adam", small=True).extra["lr"] == 1e-3
    assert "bert_train" not in suite.MICRO and "adam" in suite.MICRO
    # the small size keeps what a case computes: a training case trains, a bf16 one is bf16
    assert suite.make_case("rmsnorm_train", small=True).train
    assert suite.make_case("groupnorm_silu_train", small=True).inputs[0].dtype == torch.float32
    assert suite.make_case("unet_block_train_bf16", small=True).inputs[0].dtype == torch.bfloat16
    assert set(suite.ZOO) <= set(suite.CASES) and not set(suite.ZOO) & set(suite.MICRO)
    with pytest.raises(KeyError, match="unknown bench workload 'nope'"):
        suite.make_case("nope")


def test_a_small_run_on_the_cpu_times_and_checks_every_system():
    lines = io.StringIO()
    results = suite.run(["layernorm_train", "adam"], ("eager", "fusionstitching", "xla"), device="cpu", small=True,
                        rounds=1, progress=suite.Progress(lines))
    assert [(r.workload, r.system) for r in results] == [
        ("layernorm_train", "eager"), ("layernorm_train", "fusionstitching"), ("layernorm_train", "xla"),
        ("adam", "eager"), ("adam", "fusionstitching"), ("adam", "xla")]
    ours = results[1]
    assert ours.wall_ms > 0 and ours.first_call_s > 0 and ours.error < 1e-5
    from fusionstitching._host import PHASES

    assert list(ours.first_call_phases) == list(PHASES) and not results[0].first_call_phases
    assert 0 < ours.first_call_phases["exploration"] < ours.first_call_s  # planned at this first call
    assert ours.speedup["eager"] == pytest.approx(results[0].wall_ms / ours.wall_ms)
    assert ours.gpu_ms is None and ours.kernels is None  # no profiler kernels without a GPU
    assert results[2].skipped  # no GPU (or no JAX) here: the row says why
    assert results[4].error is None  # adam returns nothing: its updates are in place
    assert "[2/2] adam: timing eager, fusionstitching in turn" in lines.getvalue()
    table = suite.format_table(results, ("eager", "fusionstitching", "xla"))
    assert table.count("\n") == 2 + len(results) - 1 and "skipped:" in table


def test_the_async_system_is_timed_compiled_against_aot_eagers_first_call():
    from fusionstitching import stats

    before = stats()["compilations"]
    results = suite.run(["layernorm_train"], ("eager", "aot_eager", "fusionstitching-async"), device="cpu",
                        small=True, rounds=1, progress=lambda _: None)
    _, aot, ours = results
    assert aot.error == 0.0 and aot.first_call_s > 0
    assert ours.first_call_s > 0 and ours.error < 1e-5  # the compared call runs after the compiles
    assert stats()["compilations"] - before == 2  # forward and backward, in the background


ZOO_PIECES = ("rotary", "groupnorm_silu_train", "instancenorm", "cross_entropy", "resnet50_train", "resnet50_infer", "gpt2_train",
              "llama_train", "llama_infer")


@pytest.mark.parametrize("name", ZOO_PIECES)
def test_model_zoo_rows_match_eager_at_small_sizes_on_the_cpu(name):
    """The zoo's rows compile (strict: no internal error falls back) and give eager's outputs; the
    UNet block is covered by the norm tests (GroupNorm, SiLU) and is slow on the CPU."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        results = suite.run([name], ("eager", "fusionstitching"), device="cpu", small=True, rounds=1,
                            progress=lambda _: None)
    ours = results[1]
    case = suite.make_case(name, small=True)
    bf16 = case.autocast is torch.bfloat16 or any(
        isinstance(x, torch.Tensor) and x.dtype == torch.bfloat16 for x in case.inputs)
    assert ours.error < (2e-2 if bf16 else 1e-5)


def test_bench_command_prints_the_table_and_writes_json(tmp_path, capsys):
    path = tmp_path / "bench.json"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert main(["bench", "softmax", "--small", "--device", "cpu", "--rounds", "1",
                     "--systems", "eager,fusionstitching", "--json", str(path)]) == 0
    out = capsys.readouterr().out
    assert "| softmax | fusionstitching |" in out and "× eager" in out
    data = json.loads(path.read_text())
    assert data["device"] and [r["system"] for r in data["results"]] == ["eager", "fusionstitching"]
    assert data["results"][1]["error"] < 1e-5


def test_bench_command_rejects_unknown_workloads_and_systems(capsys):
    assert main(["bench", "nope", "--small", "--device", "cpu"]) == 2
    assert "unknown bench workload 'nope'" in capsys.readouterr().err
    assert main(["bench", "softmax", "--small", "--device", "cpu", "--systems", "eager,tvm"]) == 2
    assert "unknown system 'tvm'" in capsys.readouterr().err
    assert main(["bench", "softmax", "--small", "--device", "tpu0"]) == 2
    assert "unknown device 'tpu0'" in capsys.readouterr().err


def test_demo_plan_table_shows_composition_and_shared_memory(capsys):
    from fusionstitching.cli import capture_workload
    from fusionstitching.pipeline import compile_graph

    _, captured = capture_workload("din_attention")
    compiled = compile_graph(captured.forward)
    table = demo.plan_table(compiled)
    kernel = compiled.kernels[0]
    assert "block" in demo.composition(kernel) and demo.shared_bytes(kernel) > 0
    assert table.count("\n") == 1 + len(compiled.kernels)


@pytest.mark.gpu
@gpu_only
def test_bench_on_the_gpu_counts_kernels_and_runs_xla_where_installed():
    results = suite.run(["layernorm", "din_attention"], suite.SYSTEMS, small=True, rounds=1,
                        progress=lambda _: None)
    by = {(r.workload, r.system): r for r in results}
    for name in ("layernorm", "din_attention"):
        ours, eager = by[name, "fusionstitching"], by[name, "eager"]
        assert ours.kernels == ours.mi_kernels == 1 and ours.gpu_ms > 0
        assert eager.kernels >= 1 and ours.error < 1e-5
        xla = by[name, "xla"]
        assert xla.skipped or (xla.kernels >= 1 and xla.error < 1e-4)


def test_interleaved_wall_times_take_the_systems_rounds_in_turn():
    """Rounds alternate between systems, each system keeps its own calls per round, and the
    median is per system."""
    calls: list[str] = []
    syncs: list[str] = []

    def system(name):
        return (lambda: calls.append(name), lambda _: syncs.append(name))

    walls = suite.interleaved_wall_ms({"a": system("a"), "b": system("b")}, rounds=3, round_seconds=0.0)
    assert set(walls) == {"a", "b"} and all(w >= 0 for w in walls.values())
    # two calls each to size the rounds, then one call per round (round_seconds 0), in turn
    assert calls == ["a", "a", "b", "b", "a", "b", "a", "b", "a", "b"]
    assert syncs == calls



def _bench_json(path, device, rows):
    fields = ("workload", "system", "wall_ms", "gpu_ms", "mi_ms", "kernels", "gemm_kernels", "mi_kernels")
    results = [dict(zip(fields, row), first_call_s=1.0, error=None, skipped="", speedup={}, top_kernels=[["k", 1.0, 1.0]])
               for row in rows]
    path.write_text(json.dumps({"device": device, "torch": "2.11.0", "results": results}))
    return path


def test_the_performance_page_is_rendered_from_bench_json(tmp_path):
    from fusionstitching.bench import report

    h100 = _bench_json(tmp_path / "a.json", "NVIDIA H100 80GB HBM3", [
        ("bert_infer", "inductor", 6.95, 2.881, 1.517, 342, 97, 245),
        ("bert_infer", "fusionstitching", 4.42, 2.438, 1.088, 183, 97, 86)])
    h200 = _bench_json(tmp_path / "b.json", "NVIDIA H200", [("layernorm", "fusionstitching", 0.09, 0.02, 0.02, 1, 0, 1)])
    page = tmp_path / "performance.md"
    page.write_text(f"# Performance\n\nmethod\n\n{report.BEGIN}\nold tables\n{report.END}\n\nafter\n")
    report.main([str(h100), str(h200), "--write", str(page)])
    text = page.read_text()
    assert "old tables" not in text and text.startswith("# Performance\n\nmethod") and text.endswith("after\n")
    assert "## NVIDIA H100 80GB HBM3" in text and "## NVIDIA H200" in text
    assert "| bert_infer | fusionstitching | 4.420 | 2.438 (1.088) | 183 (97 + 86) |" in text
    assert "fusionstitching / Inductor: bert_infer 0.72." in text
    with pytest.raises(ValueError, match="markers"):
        report.write(tmp_path / "a.json", [h100])


def test_the_performance_page_is_what_the_report_renders_from_the_kept_runs():
    """docs/performance.md's tables are generated, never edited: they equal ``bench.report``'s
    rendering of the ``bench --json`` files in docs/bench."""
    from pathlib import Path

    from fusionstitching.bench import report

    docs = Path(__file__).resolve().parent.parent / "docs"
    runs = sorted((docs / "bench").glob("*.json"))
    assert runs
    page = (docs / "performance.md").read_text()
    generated = page.split(report.BEGIN, 1)[1].split(report.END, 1)[0]
    assert generated.strip() == report.render(runs).strip()
