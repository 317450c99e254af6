"""The differential fuzzer (``fusionstitching/fuzz/``): its generator and shrinker, and a CI run of
``FUZZ_GRAPHS`` random programs with a fresh seed that must show no mismatch and no error."""

from __future__ import annotations

import dataclasses
import random
import re
import runpy
import sys

import numpy as np
import pytest
import torch

from fusionstitching.cli import main
from fusionstitching.fuzz import run
from fusionstitching.fuzz.check import (
    EPSILON,
    Config,
    Outcome,
    _compare,
    _Failure,
    _Rounding,
    check,
    relative_error,
)
from fusionstitching.fuzz.coverage import shape_classes, special_cases
from fusionstitching.fuzz.generate import FAMILIES, FEATURES, generate
from fusionstitching.fuzz.programs import build, source
from fusionstitching.fuzz.shrink import Budget, reproducer, shrink

FUZZ_GRAPHS = 200
FUZZ_WORKERS = 2  # CI's two cores
FUZZ_TIMEOUT_S = 15.0  # a program still running is reported, not failed (the simulator on a mostly idle grid)


def test_program_k_of_a_seed_is_the_same_on_every_run():
    first = [generate(11, k) for k in range(40)]
    again = [generate(11, k) for k in range(40)]
    assert first == again
    assert [source(p) for p in first] == [source(p) for p in again]
    assert len({source(p) for p in first}) == len(first)  # and the programs differ
    inputs = build(first[3]).make_inputs()
    assert all(torch.equal(a, b) for a, b in zip(inputs, build(again[3]).make_inputs()))


def test_generator_covers_shapes_op_families_dtypes_and_special_cases():
    programs = [generate(5, k) for k in range(400)]
    shapes = set().union(*map(shape_classes, programs))
    assert {"size 0", "size 1", "prime", "2^k±1", "row < 32", "row 32-1024", "row > 1024"} <= shapes
    assert set(FAMILIES) <= {s.category for p in programs for s in p.steps}
    assert {"float32", "bfloat16", "float16"} <= {p.dtype for p in programs}
    assert {"int32", "int64", "bool"} <= {i.dtype for p in programs for i in p.inputs}
    special = set().union(*map(special_cases, programs))
    assert {"scalar after a row reduction", "expand() output", "out-of-range index", "backward"} <= special
    ops = {s.op for p in programs for s in p.steps}
    assert {"exp", "log", "tanh", "erf", "sigmoid", "sqrt", "rsqrt", "pow", "where", "sum", "mean", "amax",
            "amin", "prod", "var", "softmax", "log_softmax", "layer_norm", "index_select", "gather", "embedding",
            "index", "matmul", "cat", "pad", "transpose", "slice", "reshape"} <= ops


def test_features_switch_special_cases_off():
    off = {"empty", "scalar_after_row", "expand_output", "out_of_range"}
    programs = [generate(5, k, set(FEATURES) - off) for k in range(300)]
    assert "size 0" not in set().union(*map(shape_classes, programs))
    assert not set().union(*map(special_cases, programs)) & {"scalar after a row reduction", "expand() output",
                                                              "out-of-range index"}
    # switching the out-of-range case off (as a GPU run does) leaves every other program as it was
    for k in range(100):
        program = generate(5, k)
        assert program.expect_error or generate(5, k, set(FEATURES) - {"out_of_range"}) == program


def test_with_a_backward_no_input_is_updated_in_place_after_an_op_read_it():
    """Eager refuses a value saved for the backward (a where's mask) that changed in place: the CPU
    fuzz run's programs 1126202:416 and 5014 were invalid."""
    updates = 0
    for k in range(10000):  # until three updates are seen: they are rare in programs with a backward
        program = generate(1126202, k)
        if not program.backward:
            continue
        for n, step in enumerate(program.steps):
            if step.mutates:
                updates += 1
                target = step.operands[0]
                assert all(target not in earlier.operands for earlier in program.steps[:n]), source(program)
        if updates >= 3:
            break
    assert updates >= 3


def test_no_embedding_table_of_width_zero():
    """torch's CUDA embedding backward reads a null pointer for such a table (pytorch/pytorch#189668):
    a GPU run's worker died in eager, before the compiled program ran."""
    embeddings = 0
    for seed in (1126101, 5):
        for k in range(600):
            program = generate(seed, k)
            sizes = dict(program.sizes)
            shapes = {i.name: i.shape for i in program.inputs} | {s.name: s.shape for s in program.steps}
            for step in program.steps:
                if step.op == "embedding":
                    embeddings += 1
                    table = shapes[step.operands[0]]
                    assert table[1].size(sizes) > 0, source(program)
    assert embeddings > 20


@pytest.mark.filterwarnings(r"ignore:(var|std)\(\)")
def test_generated_programs_run_eagerly():
    for k in range(150):
        program = generate(8, k)
        built = build(program)
        try:
            built.fn(*built.make_inputs())
        except (IndexError, RuntimeError):
            assert program.expect_error, source(program)
        else:
            assert not program.expect_error, source(program)


def test_shrinker_keeps_the_failure_and_drops_the_rest():
    program = next(p for p in (generate(2, k) for k in range(200))
                   if len(p.steps) >= 6 and any(s.op == "exp" for s in p.steps) and max(p.size_map.values()) > 4)

    def still_fails(candidate):
        return any(s.op == "exp" for s in candidate.steps)

    small = shrink(program, still_fails, Budget(checks=500, seconds=60))
    assert [s.op for s in small.steps] == ["exp"]
    assert set(small.size_map.values()) <= {1}
    assert not small.backward and small.dtype == "float32"
    built = build(small)
    built.fn(*built.make_inputs())  # still a valid program


def test_reproducer_runs_standalone(tmp_path, capsys):
    program = next(p for p in (generate(3, k) for k in range(100)) if p.backward and not p.expect_error
                   and max(p.numels()) <= 64)
    config = run.config_for(0)
    path = tmp_path / "repro.py"
    path.write_text(reproducer(program, config, Outcome("mismatch", "output 0", "made up", "mismatch"), "3:0"))
    runpy.run_path(str(path), run_name="__main__")
    assert "largest difference from eager" in capsys.readouterr().out


def test_comparison_flags_wrong_values_and_spares_rounding():
    """Floats within the dtype's tolerance pass; beyond it, the float64 run decides: a result as close
    to it as eager's passes, a wrong one fails; integers must be equal."""
    want = torch.linspace(-1, 1, 64)
    exact = torch.linspace(-1, 1, 64, dtype=torch.float64)
    _compare("out", want + 1e-6, want, "float32", lambda: exact)
    with pytest.raises(_Failure, match="error 0.5"):
        _compare("out", want * 1.5, want, "float32", lambda: exact)
    half = want.bfloat16()
    _compare("out", (want + 0.03).bfloat16(), half, "bfloat16", lambda: want.double() + 0.03)  # eager is off too
    with pytest.raises(_Failure, match="1 of 3 elements"):
        _compare("out", torch.tensor([1, 2, 4]), torch.tensor([1, 2, 3]), "float32", lambda: exact)


def test_rounding_noise_is_large_only_where_the_result_is_ill_conditioned():
    """The arbiter's float64 runs with rounding errors added: a sum of layer-normed rows (exactly 0,
    so only rounding is left, repeated rows adding theirs up) is all noise; a softmax is not. A
    wrong value still fails against a small noise (fuzz 1126102:4127: a difference like eager's own
    where eager happened to round closer)."""
    def noise(fn, x, salt=0):
        with _Rounding(EPSILON["float32"], salt):
            noisy = fn(x.double())
        return relative_error(noisy.numpy(), fn(x.double()).numpy())

    rows = torch.randn(4, 1, 3, generator=torch.Generator().manual_seed(3)).expand(4, 17, 3)
    summed = lambda x: torch.nn.functional.layer_norm(x, (3,)).sum()
    assert noise(summed, rows) > 1e-5
    smooth = lambda x: torch.softmax(x, -1)
    x = torch.randn(8, 33, generator=torch.Generator().manual_seed(4))
    assert 0 < noise(smooth, x) < 1e-5 and noise(smooth, x, 1) < 1e-5  # the tolerance is 1e-4
    exact = smooth(x.double())
    with _Rounding(EPSILON["float32"], 0):
        perturbed = smooth(x.double())
    with pytest.raises(_Failure, match="rounding noise"):
        _compare("out", smooth(x) * 1.01, smooth(x), "float32", lambda: exact, lambda: [perturbed])
    # the layer norm sum: 10x eager's distance from float64, within the noise
    want = summed(rows)
    got = want + 3e-6
    _compare("out", got, want, "float32", lambda: summed(rows.double()),
             lambda: [summed(rows.double()) + 2e-5])


def test_the_sign_of_a_value_at_its_rows_mean_is_noise():
    """Fuzz 735125102:138: the sign of a layer norm of integers is 0 where an element equals the
    row's mean exactly, but eager's layer norm (f32 and f64) rounds the mean and gives ±1 there; a
    compiled mean that is exact must pass. The layer norm's result near zero is as uncertain as a
    typical normalized value, and one salt of each pair moves it across zero. Where no element is at
    its row's mean, the signs are no rounding matter and a wrong one still fails."""
    row = torch.tensor([[0.0, 1.0, 0.0, 1.0, -1.0, -1.0, 1.0, -3.0, 0.0, -2.0, 1.0, 1.0, 0.0, 1.0, 0.0, -1.0, 2.0]])
    assert float(row.sum()) == 0.0
    signed = lambda x: torch.sign(torch.nn.functional.layer_norm(x, (17,), eps=1e-3))
    exact = torch.sign(row)  # the mean is 0 exactly, and so the centered row is the row
    noisy = []
    for salt in range(2):
        with _Rounding(EPSILON["float32"], salt):
            noisy.append(signed(row.double()))
    assert relative_error(noisy[0].numpy(), noisy[1].numpy()) == 2.0  # one of the pair crossed zero
    want = signed(row)
    _compare("out", exact, want, "float32", lambda: signed(row.double()), lambda: noisy)
    shifted = row.clone()
    shifted[0, -1] = 2.5  # the mean is 1/34, no element is within 1/34 of it
    noisy = []
    for salt in range(2):
        with _Rounding(EPSILON["float32"], salt):
            noisy.append(signed(shifted.double()))
    want = signed(shifted)
    wrong = want.clone()
    wrong[0, 0] = -wrong[0, 0]
    with pytest.raises(_Failure, match="rounding noise 0"):
        _compare("out", wrong, want, "float32", lambda: signed(shifted.double()), lambda: noisy)


def test_the_plan_check_holds_f32_results_of_half_type_values_to_the_half_tolerance():
    """A kernel keeps f32 where the reference rounds each f16 value, so its f32 result (a layer
    norm's gradient sum) differed by f16 rounding: 1.1e-4 > 1e-4 on a GPU (fuzz 1126201:693). An
    all-f32 kernel keeps the f32 tolerance."""
    from types import SimpleNamespace

    from fusionstitching.fuzz.check import _check_kernel
    from fusionstitching.graph.graph import GraphBuilder
    from fusionstitching.graph.ops import DType

    def kernel(dtype, error):
        b = GraphBuilder("k")
        x = b.parameter((64,), dtype, "x")
        out = b.convert(b.binary("mul", x, x), DType.F32)
        pattern = SimpleNamespace(inputs=[x], outputs=[out], nodes=[x, out.operands[0], out])
        want = np.linspace(-1, 1, 64).astype(np.float32)
        fake = SimpleNamespace(name="k", template="t", lowered=SimpleNamespace(pattern=pattern),
                               simulate=lambda arrays: [want * (1 + error)])
        return fake, {x: want.astype(dtype.numpy), out: want}

    _check_kernel("forward", *kernel(DType.F16, 3e-4))
    with pytest.raises(_Failure, match="error 0.0003"):
        _check_kernel("forward", *kernel(DType.F32, 3e-4))
    # beyond the tolerance but within the reference's own noise on inputs a few ulps away (a sum
    # that cancels: GPU fuzz 1126301:897); a wrong value is not
    fake, values = kernel(DType.F32, 3e-4)
    out = fake.lowered.pattern.outputs[0]
    _check_kernel("forward", fake, values, lambda: [{out: values[out] * (1 + 2e-4)}])
    with pytest.raises(_Failure):
        _check_kernel("forward", fake, values, lambda: [{out: values[out] * (1 + 1e-6)}])


def test_fuzz_command_prints_the_seed_and_ends_with_the_summary(tmp_path, capsys):
    status = main(["fuzz", "--count", "2", "--out", str(tmp_path), "--plans", "off", "--no-shrink"])
    lines = capsys.readouterr().out.strip().splitlines()
    assert re.fullmatch(r"fuzz: seed \d+", lines[0])
    last = re.fullmatch(r"fuzz: 2 graphs, (\d+) mismatches, (\d+) errors", lines[-1])
    assert last, lines[-1]
    failures = int(last[1]) + int(last[2])
    assert status == (1 if failures else 0)
    assert len(list(tmp_path.glob("fuzz_*.py"))) == failures  # a reproducer per failing program


def test_a_deadline_stops_the_run_and_counts_what_was_checked():
    lines: list[str] = []
    settings = dataclasses.replace(run.Settings(), out=None, shrink=None, plans="off")
    summary = run.fuzz(run.programs(5, 4), settings, log=lines.append, progress_every=0, deadline_s=0)
    assert summary.graphs == 0
    assert lines == ["fuzz: deadline of 0 s reached after 0 graphs"]


def test_every_selector_and_generator_set_takes_turns():
    configs = {run.config_for(k) for k in range(len(run.CONFIGS))}
    assert {c.solver for c in configs} == {"ilp", "beam"}
    assert {c.label for c in configs} == {label for label, _ in run.GENERATOR_SETS}
    assert all(isinstance(c, Config) for c in configs)


def test_a_worker_past_the_time_limit_is_replaced_and_its_program_reported_as_timed_out():
    """The limit is kept by the parent, which kills the worker: an exception raised into a worker
    mid-trace can leave torch's dispatch-mode state inconsistent (GPU fuzz 1126601:1766 aborted)."""
    settings = dataclasses.replace(run.Settings(), out=None, shrink=None, plans="off", timeout_s=0.05)

    class Counted(run._Workers):
        started = 0

        def _start(self):
            Counted.started += 1
            return super()._start()

    results = list(Counted(2, settings).run(run.programs(7, 3)))
    assert [r.outcome.status for r in results] == ["timeout"] * 3
    assert [r.program.ident for r in results] == [f"7:{k}" for k in range(3)]
    assert Counted.started == 4  # two, and one for each program timed out while another waited


def test_with_a_time_limit_even_one_worker_checks_programs_in_a_process_of_its_own(monkeypatch):
    """``--jobs 1`` (the default) with a time limit: the limit is kept by killing the worker, never
    by a signal in this process; only a single program (a replay) runs here."""
    def here(job, settings, **kwargs):
        raise AssertionError(f"program {job} checked in the parent process")

    monkeypatch.setattr(run, "_one", here)
    settings = dataclasses.replace(run.Settings(), out=None, shrink=None, plans="off", timeout_s=0.05)
    summary = run.fuzz(run.programs(7, 2), settings, log=lambda line: None, progress_every=0, workers=1)
    assert summary.graphs == 2 and summary.coverage.timeouts == ["7:0", "7:1"]


def test_random_programs_compile_to_the_values_of_eager():
    """The CI fuzz run: FUZZ_GRAPHS programs of a fresh seed (printed: replay one failing program with
    ``fusionstitching fuzz --replay S:k``, the whole run with ``fusionstitching fuzz --seed S --count N``)."""
    seed = random.SystemRandom().randrange(1 << 31)
    print(f"fuzz: seed {seed}")
    settings = dataclasses.replace(run.Settings(), out=None, shrink=None, timeout_s=FUZZ_TIMEOUT_S)
    lines: list[str] = []
    summary = run.fuzz(run.programs(seed, FUZZ_GRAPHS), settings, log=lines.append, progress_every=0,
                       workers=FUZZ_WORKERS)
    run.report(summary, log=lines.append)
    print("\n".join(lines))
    assert summary.graphs == FUZZ_GRAPHS
    failures = "\n".join(f.ident + ": " + f.outcome.line() for f in summary.failures)
    assert summary.mismatches + summary.errors == 0, f"fuzz seed {seed}: {summary.last_line()}\n{failures}"


def test_the_second_round_of_configurations_runs_symbolic_shapes(tmp_path, capsys):
    """Program k keeps ``CONFIGS[k % len(CONFIGS)]``'s selector and generators; the second round
    compiles under TorchDynamo's symbolic shapes, through the backend's per-call specialization,
    and its reproducer says so."""
    from fusionstitching.backend import reset_stats, stats

    n = len(run.CONFIGS)
    for k in (0, n - 1):
        static, dynamic = run.config_for(k), run.config_for(k + n)
        assert (static.solver, static.generators, static.dynamic) == (dynamic.solver, dynamic.generators, False)
        assert dynamic.dynamic and not dynamic.async_compile and str(dynamic).endswith(", dynamic")
    k = next(k for k in range(n, 2 * n) if not generate(5, k).expect_error)
    program = generate(5, k)
    reset_stats()
    assert check(program, run.config_for(k)).status == "ok"
    assert stats()["shape specializations"] >= 1  # compiled per call from a symbolic graph
    path = tmp_path / "repro.py"
    path.write_text(reproducer(program, run.config_for(k), Outcome("mismatch", "output 0", "made up", "mismatch"), "5:k"))
    assert "dynamic=True" in path.read_text()


def test_the_third_round_compiles_symbolic_shapes_in_the_background(tmp_path):
    """The third round adds ``Options(async_compile=True)``: the check's first call runs in
    PyTorch, then it waits for the compiles and checks the compiled calls; the reproducer does the
    same."""
    from fusionstitching.backend import reset_stats, stats

    n = len(run.CONFIGS)
    config = run.config_for(2 * n)
    assert config.dynamic and config.async_compile and str(config).endswith(", dynamic, async")
    assert config.options()["async_compile"] is True
    k = next(k for k in range(2 * n, 3 * n) if not generate(5, k).expect_error and generate(5, k).backward)
    program = generate(5, k)
    reset_stats()
    assert check(program, run.config_for(k)).status == "ok"
    counts = stats()
    assert counts["eager while compiling"] >= 1 and counts["compilations"] >= 1 and counts["fallbacks"] == 0
    text = reproducer(program, run.config_for(k), Outcome("mismatch", "output 0", "made up", "mismatch"), "5:k")
    assert "'async_compile': True" in text and "wait_for_compiles(300)" in text
    compile(text, "repro.py", "exec")


def test_a_symbolic_program_is_called_again_within_and_outside_its_shape_classes(monkeypatch):
    """``other_sizes``: every size of 3 or more that the program uses moved within its shape class,
    then one moved out of it; a symbolic configuration's check calls the compiled function at them
    against eager there, which compiles more specializations of its graphs."""
    from fusionstitching.backend import reset_stats, size_class, stats
    from fusionstitching.fuzz.check import other_sizes

    n = len(run.CONFIGS)
    found = 0
    for k in range(n, 2 * n):
        program = generate(9, k)
        if program.expect_error:
            continue
        moves = other_sizes(program)
        if not moves:
            continue
        sizes = program.size_map
        *within, outside = moves
        for moved in within:
            changed = [s for s in sizes if moved[s] != sizes[s]]
            assert changed and all(size_class(moved[s]) == size_class(sizes[s]) for s in changed)
        changed = [s for s in sizes if outside[s] != sizes[s]]
        assert len(changed) == 1 and size_class(outside[changed[0]]) != size_class(sizes[changed[0]])
        other = build(program.with_sizes(outside), suffix="_test")
        if other.text.split("def make_inputs")[0] != build(program).text.split("def make_inputs")[0]:
            continue  # sizes spelled out in the code: another function at other sizes
        module = sys.modules["fusionstitching.fuzz.check"]
        with monkeypatch.context() as patch:  # the program's own sizes only
            patch.setattr(module, "_at_other_sizes", lambda *args: None)
            reset_stats()
            assert check(program, run.config_for(k), plans="off").status == "ok"
            alone = stats()["shape specializations"]
        reset_stats()
        assert check(program, run.config_for(k), plans="off").status == "ok"
        assert stats()["shape specializations"] > alone, program.ident
        found += 1
        if found == 2:
            break
    assert found == 2
