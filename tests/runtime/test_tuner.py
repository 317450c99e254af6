"""The tuner's decisions (CPU, with a stand-in for the GPU's timing): the fastest candidate wins, the
library keeps it, a second tuner (or process) reads it and measures nothing."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from fusionstitching.cli import capture_workload
from fusionstitching.cost.perflib import FILE_NAME, Measured, PerfLib
from fusionstitching.options import Options
from fusionstitching.pipeline import compile_graph
from fusionstitching.runtime.tuner import COUNTS, Tuner, TuningWarning
from fusionstitching.schedule.tune import canonical

ROOT = Path(__file__).resolve().parents[2]


class LastIsFastest:
    """Times candidates so that the last one wins (with the caches flushed and, unless
    ``slower_warm``, with the inputs in L2 too); counts the patterns it was asked to time cold."""

    def __init__(self, slower_warm: bool = False) -> None:
        self.calls: list[list[str]] = []
        self.warm_calls: list[list[str]] = []
        self.slower_warm = slower_warm

    def __call__(self, kernels, inputs, flush=True):
        (self.calls if flush else self.warm_calls).append([str(k.template) for k in kernels])
        if not flush and self.slower_warm:
            return [5.0] + [10.0] * (len(kernels) - 1)
        return [10.0 + k for k in range(len(kernels) - 1)] + [5.0]


def _never(kernels, inputs, flush=True):
    raise AssertionError("a library hit must measure nothing")


def _layernorm(batch: int = 4096, hidden: int = 1024):
    """A LayerNorm large enough to be worth measuring (above the latency floor)."""
    from fusionstitching.bench.workloads import make
    from fusionstitching.frontend.torch_fx import capture

    workload = make("layernorm", batch=batch, hidden=hidden)
    return compile_graph(capture(workload.fn, *workload.inputs).forward, Options(strict=True))


def test_a_candidate_faster_cold_but_slower_with_warm_inputs_leaves_the_plans_template(tmp_path):
    compiled = _layernorm()
    kernel = compiled.kernels[0]
    library = PerfLib(tmp_path / FILE_NAME)
    measure = LastIsFastest(slower_warm=True)
    tuner = Tuner(compiled.graph, Options(strict=True), "Test GPU", "sm_90", measure, library)
    assert tuner.kernel_for(kernel, []) is kernel
    assert len(measure.calls) == 1 and len(measure.warm_calls) == 1
    nodes = sorted(kernel.lowered.pattern.nodes, key=compiled.graph.index.position.__getitem__)
    assert library.winner(tuner.key(kernel)).template == canonical(kernel.template, nodes)
    assert tuner.tuned == 1 and tuner.model_right == 1


def test_the_fastest_candidate_wins_and_a_second_tuner_reads_it_from_the_library(tmp_path):
    compiled = _layernorm()
    kernel = compiled.kernels[0]
    library = PerfLib(tmp_path / FILE_NAME)
    before = COUNTS["tuned"], COUNTS["perflib hits"]
    measure = LastIsFastest()
    tuner = Tuner(compiled.graph, Options(strict=True), "Test GPU", "sm_90", measure, library)
    chosen = tuner.kernel_for(kernel, [])
    assert len(measure.calls) == 1 and len(measure.calls[0]) == Options().tune_candidates
    assert measure.calls[0][0] == str(kernel.template)  # the plan's template is the model's first choice
    assert str(chosen.template) == measure.calls[0][-1] != str(kernel.template)
    assert measure.warm_calls == [[str(kernel.template), str(chosen.template)]]  # confirmed with warm inputs
    assert chosen.lowered.pattern.outputs == kernel.lowered.pattern.outputs
    assert (COUNTS["tuned"], COUNTS["perflib hits"]) == (before[0] + 1, before[1])
    assert tuner.tuned == 1 and tuner.model_right == 0
    winner = library.winner(tuner.key(kernel))
    nodes = sorted(kernel.lowered.pattern.nodes, key=compiled.graph.index.position.__getitem__)
    assert winner.template == canonical(chosen.template, nodes)
    assert winner.model_template == canonical(kernel.template, nodes) and winner.us == 5.0

    again = _layernorm()  # a new graph object: same structure, same key
    second = Tuner(again.graph, Options(strict=True), "Test GPU", "sm_90", _never, PerfLib(tmp_path / FILE_NAME))
    assert str(second.kernel_for(again.kernels[0], []).template) == str(chosen.template)
    assert second.hits == 1 and COUNTS["perflib hits"] == before[1] + 1


def test_a_pattern_kept_from_its_shape_class_is_decided_as_planned_and_measures_nothing(tmp_path):
    """``FusionPlan.kept``: a specialization took the template an earlier one of its shape class
    ran; the tuner neither measures it nor surveys it, even where the library knows nothing."""
    compiled = _layernorm()
    kernel = compiled.kernels[0]
    kept = frozenset({frozenset(n.name for n in kernel.lowered.pattern.nodes)})
    tuner = Tuner(compiled.graph, Options(strict=True), "Test GPU", "sm_90", _never, PerfLib(tmp_path / FILE_NAME),
                  budget_s=1.0, kept=kept)
    tuner.prioritize(compiled.kernels)
    assert not tuner.leaves_out()
    assert tuner.kernel_for(kernel, []) is kernel
    assert (tuner.kept_hits, tuner.tuned, tuner.hits) == (1, 0, 0)
    measure = LastIsFastest()  # without it, the same pattern is measured
    Tuner(compiled.graph, Options(strict=True), "Test GPU", "sm_90", measure, None).kernel_for(kernel, [])
    assert len(measure.calls) == 1


def test_another_gpu_or_no_library_measures_again(tmp_path):
    compiled = _layernorm()
    library = PerfLib(tmp_path / FILE_NAME)
    Tuner(compiled.graph, Options(), "GPU A", "sm_90", LastIsFastest(), library).kernel_for(compiled.kernels[0], [])
    measure = LastIsFastest()
    Tuner(compiled.graph, Options(), "GPU B", "sm_90", measure, library).kernel_for(compiled.kernels[0], [])
    assert len(measure.calls) == 1
    measure = LastIsFastest()
    Tuner(compiled.graph, Options(), "GPU A", "sm_90", measure, None).kernel_for(compiled.kernels[0], [])
    assert len(measure.calls) == 1


def test_patterns_of_one_structure_are_measured_once_per_graph(tmp_path):
    _workload, captured = capture_workload("bert_layer")
    compiled = compile_graph(captured.forward, Options(strict=True))
    measure = LastIsFastest()
    tuner = Tuner(compiled.graph, Options(), "Test GPU", "sm_90", measure, PerfLib(tmp_path / FILE_NAME))
    chosen = [tuner.kernel_for(k, []) for k in compiled.kernels]
    keys = {tuner.key(k) for k in compiled.kernels}
    assert len(measure.calls) <= len(keys)  # a key with one candidate is not timed
    assert len(chosen) == len(compiled.kernels)
    assert all(c.lowered.pattern.outputs == k.lowered.pattern.outputs for c, k in zip(chosen, compiled.kernels))


def test_the_plans_template_stays_when_it_is_fastest_or_the_only_one(tmp_path):
    compiled = _layernorm()
    kernel = compiled.kernels[0]

    def first_wins(kernels, inputs, flush=True):
        return [1.0] + [2.0] * (len(kernels) - 1)

    tuner = Tuner(compiled.graph, Options(), "Test GPU", "sm_90", first_wins, PerfLib(tmp_path / FILE_NAME))
    assert tuner.kernel_for(kernel, []) is kernel and tuner.model_right == 1

    def plan_failed(kernels, inputs, flush=True):
        return [None] + [1.0] * (len(kernels) - 1)

    other = Tuner(compiled.graph, Options(), "Other GPU", "sm_90", plan_failed, PerfLib(tmp_path / FILE_NAME))
    assert other.kernel_for(kernel, []) is kernel and other.tuned == 0


def test_exhaustive_times_the_whole_space(tmp_path):
    compiled = _layernorm()
    measure = LastIsFastest()
    Tuner(compiled.graph, Options(tune="exhaustive"), "Test GPU", "sm_90", measure, None).kernel_for(
        compiled.kernels[0], [])
    assert len(measure.calls[0]) > Options().tune_candidates


def test_a_stored_template_this_code_cannot_build_keeps_the_plans(tmp_path):
    compiled = _layernorm()
    kernel = compiled.kernels[0]
    library = PerfLib(tmp_path / FILE_NAME)
    tuner = Tuner(compiled.graph, Options(), "Test GPU", "sm_90", _never, library)
    library.store(tuner.key(kernel), [Measured("n0[GRID]; launch(blocks=1,threads=32)", 1.0)])
    with pytest.warns(UserWarning, match="does not build"):
        assert tuner.kernel_for(kernel, []) is kernel


def test_options_tune_is_checked():
    with pytest.raises(ValueError, match="Options.tune"):
        Options(tune="fast")
    with pytest.raises(ValueError, match="tune_candidates"):
        Options(tune_candidates=0)


def test_a_second_process_takes_the_winner_from_the_library_and_measures_nothing(tmp_path):
    """Process one tunes (a stand-in timer) and stores; process two reads the winner: its stats count
    a perflib hit and no tuned pattern."""
    script = f"""
import sys
sys.path.insert(0, {str(ROOT)!r})
from fusionstitching.cost.perflib import PerfLib
from fusionstitching.options import Options
from fusionstitching.pipeline import compile_graph
from fusionstitching.runtime.tuner import Tuner
import fusionstitching
def timer(kernels, inputs, flush=True):
    if sys.argv[1] == "second":
        raise SystemExit("measured in the second process")
    return [10.0] * (len(kernels) - 1) + [1.0]
from fusionstitching.bench.workloads import make
from fusionstitching.frontend.torch_fx import capture
w = make("layernorm", batch=4096, hidden=1024)
g = compile_graph(capture(w.fn, *w.inputs).forward, Options(strict=True))
k = Tuner(g.graph, Options(), "Test GPU", "sm_90", timer, PerfLib(sys.argv[2])).kernel_for(g.kernels[0], [])
s = fusionstitching.stats()
print(k.template, s["tuned"], s["perflib hits"])
"""
    path = str(tmp_path / FILE_NAME)
    runs = [subprocess.run([sys.executable, "-c", script, which, path], capture_output=True, text=True, cwd=ROOT,
                           check=True).stdout.split() for which in ("first", "second")]
    assert runs[0][0] == runs[1][0]
    assert runs[0][-2:] == ["1", "0"] and runs[1][-2:] == ["0", "1"]


def test_a_candidate_within_the_timing_noise_does_not_replace_the_plans(tmp_path):
    from fusionstitching.runtime.tuner import NOISE

    compiled = _layernorm()
    kernel = compiled.kernels[0]

    def barely(kernels, inputs, flush=True):
        return [10.0] + [10.0 / (1 + NOISE / 2)] * (len(kernels) - 1)

    library = PerfLib(tmp_path / FILE_NAME)
    tuner = Tuner(compiled.graph, Options(), "Test GPU", "sm_90", barely, library)
    assert tuner.kernel_for(kernel, []) is kernel
    assert library.winner(tuner.key(kernel)).model_was_right


def test_a_spent_budget_leaves_the_plans_template_undecided(tmp_path):
    compiled = _layernorm()
    kernel = compiled.kernels[0]
    measure = LastIsFastest()
    tuner = Tuner(compiled.graph, Options(), "Test GPU", "sm_90", measure, PerfLib(tmp_path / FILE_NAME),
                  budget_s=0.0)
    assert tuner.kernel_for(kernel, []) is kernel
    assert not measure.calls and tuner.over_budget == 1 and tuner.tuned == 0
    assert PerfLib(tmp_path / FILE_NAME).winner(tuner.key(kernel)) is None
    # undecided: a specialization of the same shape class does not keep it but measures it
    assert not tuner.decided(kernel)
    compiled.tuning = tuner
    assert compiled.kept_templates() == {}
    unlimited = Tuner(compiled.graph, Options(tune="exhaustive"), "Test GPU", "sm_90", measure, None, budget_s=0.0)
    assert unlimited.kernel_for(kernel, []) is not kernel
    assert unlimited.decided(kernel)
    compiled.tuning = unlimited
    assert len(compiled.kept_templates()) == 1


def test_a_candidate_predicted_to_overrun_the_budget_is_not_made(tmp_path):
    """A huge kernel (BERT's AdamW step: one packed kernel over 199 tensors, 30 s to generate and
    compile) is not tuned at a first call whose budget one candidate would overrun."""
    compiled = _layernorm()
    kernel = compiled.kernels[0]
    measure = LastIsFastest()
    slow = Tuner(compiled.graph, Options(), "Test GPU", "sm_90", measure, None, budget_s=10.0,
                 seconds_per_character=20.0 / len(kernel.cuda_source))
    assert slow.kernel_for(kernel, []) is kernel and not measure.calls
    assert slow.tuned == 0 and slow.over_budget == 1
    fast = Tuner(compiled.graph, Options(), "Test GPU", "sm_90", measure, None, budget_s=10.0,
                 seconds_per_character=0.1 / len(kernel.cuda_source))
    assert fast.kernel_for(kernel, []) is not kernel and len(measure.calls[0]) == Options().tune_candidates


def test_a_budget_for_one_pattern_goes_to_the_one_that_moves_the_most_bytes(tmp_path):
    """The smaller softmax runs first, but the budget, enough for one pattern's candidates, is kept
    for the LayerNorm that moves 8 times its bytes; the softmax (above the latency floor) keeps the
    plan's template."""
    import torch

    from fusionstitching.frontend.torch_fx import capture

    def fn(a, b):
        return torch.softmax(a, -1), torch.nn.functional.layer_norm(b, (1024,))

    compiled = compile_graph(capture(fn, torch.randn(4096, 1024), torch.randn(32768, 1024)).forward,
                             Options(strict=True))
    small, large = compiled.kernels
    assert "reduce" in small.name and len(compiled.kernels) == 2
    measure = LastIsFastest()
    per_candidate = 10.0  # predicted seconds to make one candidate of the large kernel
    tuner = Tuner(compiled.graph, Options(), "Test GPU", "sm_90", measure, None,
                  budget_s=per_candidate * (Options().tune_candidates - 1) * 1.01,
                  seconds_per_character=per_candidate / len(large.cuda_source))
    tuner.prioritize(compiled.kernels)
    assert not tuner._at_the_floor(small)
    assert tuner.kernel_for(small, []) is small and not measure.calls and tuner.over_budget == 1
    assert tuner.kernel_for(large, []) is not large and tuner.tuned == 1
    assert measure.calls[0][0] == str(large.template)


class ByName:
    """Times each kernel as ``us`` gives it by name (the survey asks for one kernel at a time)."""

    def __init__(self, us: dict[str, float]) -> None:
        self.us = us
        self.calls: list[list[str]] = []

    def __call__(self, kernels, inputs, flush=True):
        self.calls.append([k.name for k in kernels])
        return [self.us[k.name] for k in kernels]


def test_a_survey_gives_the_budget_to_the_pattern_measured_furthest_from_a_copy():
    """The model keeps a one-pattern budget for the LayerNorm that moves 8 times the softmax's bytes;
    timed alone, the LayerNorm runs at a copy's speed and the softmax at a tenth of it, so after the
    survey the budget goes to the softmax. The survey times each pattern once and decides nothing."""
    import torch

    from fusionstitching.cost.bandwidth import bandwidth_model
    from fusionstitching.frontend.torch_fx import capture

    def fn(a, b):
        return torch.softmax(a, -1), torch.nn.functional.layer_norm(b, (1024,))

    compiled = compile_graph(capture(fn, torch.randn(4096, 1024), torch.randn(32768, 1024)).forward,
                             Options(strict=True))
    small, large = compiled.kernels
    copy = bandwidth_model("H100")
    measure = ByName({small.name: 10 * copy.time_us(small.moved_bytes), large.name: copy.time_us(large.moved_bytes)})
    per_candidate = 10.0
    tuner = Tuner(compiled.graph, Options(), "Test GPU", "sm_90", measure, None,
                  budget_s=per_candidate * (Options().tune_candidates - 1) * 1.01,
                  seconds_per_character=per_candidate / len(large.cuda_source))
    tuner.prioritize(compiled.kernels)
    assert tuner._worth == {tuner.key(large)} and tuner.leaves_out()
    for kernel in (small, large, small):
        assert tuner.survey_kernel(kernel, []) is kernel
    assert measure.calls == [[small.name], [large.name]] and tuner.surveyed == 2 and tuner.tuned == 0
    tuner.prioritize(compiled.kernels)
    assert tuner._worth == {tuner.key(small)}


def test_the_budget_goes_first_to_the_most_worth_per_second_of_candidates():
    """The LayerNorm is measured further from a copy's time than the softmax, but its candidates
    (a CUDA C source twenty times as long, as a packed kernel's) would take the budget that the
    softmax's turn into more µs per second."""
    import dataclasses

    import torch

    from fusionstitching.cost.bandwidth import bandwidth_model
    from fusionstitching.frontend.torch_fx import capture

    def fn(a, b):
        return torch.softmax(a, -1), torch.nn.functional.layer_norm(b, (1024,))

    compiled = compile_graph(capture(fn, torch.randn(4096, 1024), torch.randn(32768, 1024)).forward,
                             Options(strict=True))
    small, large = compiled.kernels
    large = dataclasses.replace(large, cuda_source=large.cuda_source * 20)
    copy = bandwidth_model("H100")
    measure = ByName({small.name: 10 * copy.time_us(small.moved_bytes), large.name: 3 * copy.time_us(large.moved_bytes)})
    per_candidate = 1.0  # predicted seconds to make one candidate of the softmax
    tuner = Tuner(compiled.graph, Options(), "Test GPU", "sm_90", measure, None,
                  budget_s=per_candidate * (Options().tune_candidates - 1) * 1.5,
                  seconds_per_character=per_candidate / len(small.cuda_source))
    for kernel in (small, large):
        tuner.survey_kernel(kernel, [])
    tuner.prioritize([small, large])
    assert tuner._worth_us(tuner.key(large), large) > tuner._worth_us(tuner.key(small), small)
    assert tuner._worth == {tuner.key(small)}


def test_a_survey_skips_what_the_library_knows_and_judges_the_floor_by_its_measurement(tmp_path):
    """A pattern the library holds is not timed; one the model puts above the latency floor but
    measured at it is not tuned."""
    from fusionstitching.cost.bandwidth import bandwidth_model

    compiled = _layernorm()
    kernel = compiled.kernels[0]
    library = PerfLib(tmp_path / FILE_NAME)
    measure = ByName({kernel.name: bandwidth_model("H100").floor_us})
    tuner = Tuner(compiled.graph, Options(), "Test GPU", "sm_90", measure, library, budget_s=10.0)
    assert not tuner._at_the_floor(kernel)
    assert tuner.survey_kernel(kernel, []) is kernel and tuner._at_the_floor(kernel)
    library.store(tuner.key(kernel), [Measured(canonical(kernel.template, tuner._nodes(kernel)), 1.0)])
    other = Tuner(compiled.graph, Options(), "Test GPU", "sm_90", measure, library, budget_s=10.0)
    other.survey_kernel(kernel, [])
    assert len(measure.calls) == 1 and other.surveyed == 0


def test_the_budget_is_chosen_again_at_the_cost_the_first_pattern_measured():
    """The first prediction (a pattern's candidates at 2 s each) keeps the budget for the larger
    LayerNorm alone; making its candidates takes far less, and the softmax after it is then chosen
    and tuned with the budget left."""
    import torch

    from fusionstitching.frontend.torch_fx import capture

    def fn(b, a):
        return torch.nn.functional.layer_norm(b, (1024,)), torch.softmax(a, -1)

    compiled = compile_graph(capture(fn, torch.randn(32768, 1024), torch.randn(4096, 1024)).forward,
                             Options(strict=True))
    large, small = compiled.kernels
    assert "slice" in large.name and len(compiled.kernels) == 2
    measure = LastIsFastest()
    tuner = Tuner(compiled.graph, Options(), "Test GPU", "sm_90", measure, None, budget_s=15.0,
                  seconds_per_character=2.0 / len(large.cuda_source))
    tuner.prioritize(compiled.kernels)
    assert tuner._worth == {tuner.key(large)}
    assert tuner.kernel_for(large, []) is not large
    assert tuner.seconds_per_character < 1.0 / len(large.cuda_source)  # as measured
    assert tuner.kernel_for(small, []) is not small
    assert tuner.tuned == 2 and tuner.over_budget == 0 and len(measure.calls) == 2


def test_a_prioritized_pattern_at_the_latency_floor_counts_as_such_not_as_over_budget():
    from fusionstitching.cost.bandwidth import bandwidth_model

    compiled = _layernorm(batch=16, hidden=64)
    kernel = compiled.kernels[0]
    measure = ByName({kernel.name: bandwidth_model("H100").floor_us})
    tuner = Tuner(compiled.graph, Options(), "Test GPU", "sm_90", measure, None, budget_s=10.0)
    tuner.prioritize(compiled.kernels)
    assert tuner.kernel_for(kernel, []) is kernel and measure.calls == [[kernel.name]]
    assert tuner.at_floor == 1 and tuner.over_budget == 0


def test_a_kernel_at_the_latency_floor_is_timed_alone_and_no_candidate_made(tmp_path):
    from fusionstitching.cost.bandwidth import bandwidth_model

    compiled = _layernorm(batch=16, hidden=64)
    kernel = compiled.kernels[0]
    measure = ByName({kernel.name: bandwidth_model("H100").floor_us})
    tuner = Tuner(compiled.graph, Options(), "Test GPU", "sm_90", measure, PerfLib(tmp_path / FILE_NAME))
    assert tuner.plan_us(kernel) < 2 * tuner.bandwidth.floor_us  # the model puts it at the floor
    assert tuner.kernel_for(kernel, []) is kernel
    assert measure.calls == [[kernel.name]] and tuner.at_floor == 1 and tuner.tuned == 0
    # a judgement of these sizes: not kept for the shape class, whose larger sizes judge it again
    assert not tuner.decided(kernel)
    compiled.tuning = tuner
    assert compiled.kept_templates() == {}


def test_a_kernel_the_model_puts_at_the_floor_but_measured_above_it_is_tuned(tmp_path):
    """The latency evaluator puts some kernels below the floor that take several times it (a
    softmax of few long rows); the plan's kernel timed alone decides, and such a one is tuned."""
    from fusionstitching.cost.bandwidth import bandwidth_model

    compiled = _layernorm(batch=16, hidden=64)
    kernel = compiled.kernels[0]
    floor = bandwidth_model("H100").floor_us

    class Slow(LastIsFastest):  # the plan's kernel takes over 3 floors, the last candidate 5/3
        def __call__(self, kernels, inputs, flush=True):
            times = super().__call__(kernels, inputs, flush)
            return [10 * floor / 3] if len(kernels) == 1 else [t * floor / 3 for t in times]

    measure = Slow()
    tuner = Tuner(compiled.graph, Options(), "Test GPU", "sm_90", measure, PerfLib(tmp_path / FILE_NAME))
    assert tuner.plan_us(kernel) < 2 * tuner.bandwidth.floor_us
    assert tuner.kernel_for(kernel, []) is not kernel
    assert len(measure.calls) == 2 and len(measure.calls[0]) == 1 and len(measure.calls[1]) > 1
    assert tuner.at_floor == 0 and tuner.tuned == 1


def _tune_after(barrier, results, path: str) -> None:
    import time

    compiled = _layernorm()
    measured = []

    def slow(kernels, inputs, flush=True):  # long enough for the other process to reach the same pattern
        if flush:  # the cold timing (a choice is then confirmed with warm inputs)
            measured.append(len(kernels))
        time.sleep(1.0)
        return [10.0] * (len(kernels) - 1) + [1.0]

    tuner = Tuner(compiled.graph, Options(), "Test GPU", "sm_90", slow, PerfLib(path))
    barrier.wait()
    chosen = tuner.kernel_for(compiled.kernels[0], [])
    results.put((len(measured), tuner.hits, str(chosen.template)))


def test_processes_meeting_a_pattern_at_once_measure_it_once(tmp_path):
    """The ranks of a data-parallel job meet the same patterns at once: one measures, the others
    wait for its lock and take its winner, so every rank runs the same kernel."""
    from tests.concurrency import at_once

    outcomes = at_once(_tune_after, (str(tmp_path / FILE_NAME),), 2)
    assert [(m, h) for m, h, _ in outcomes] == [(0, 1), (1, 0)]
    assert outcomes[0][2] == outcomes[1][2]
    assert not list((tmp_path / f"{FILE_NAME}.locks").glob("*.lock"))


def test_a_kernel_of_few_bytes_that_loops_long_is_not_at_the_floor():
    """The latency floor is judged by the latency evaluator, not by bytes alone: a packed kernel of
    66 KB whose sub-kernel recomputes a 256-long sum at each point (16 runs of 16 loads, one after
    another; the UNet block's GroupNorm sums took 46 µs on an H200 at 0.5 MB) is measured."""
    from fusionstitching.codegen.generate import generate
    from tests.recomputing import recomputing_kernel

    graph, nodes, packed = recomputing_kernel()
    kernel = generate(graph, nodes, packed)
    tuner = Tuner(graph, Options(), "Test GPU", "sm_90", LastIsFastest(), None)
    assert tuner.bandwidth.time_us(66 * 1024) < 2 * tuner.bandwidth.floor_us  # by its bytes, at the floor
    assert tuner.plan_us(kernel) >= 16 * tuner.spec.memory_latency_us
    assert not tuner._at_the_floor(kernel)


def test_a_survey_runs_the_eager_program_and_is_no_call_of_a_cuda_graph(monkeypatch):
    """Under ``mode="reduce-overhead"`` the program's second call captures a CUDA graph: the survey
    runs the program inside it, so the tuning run after it is still the graph's first call."""
    import contextlib

    import torch

    from fusionstitching.runtime.program import GraphedProgram
    from fusionstitching.runtime.tuner import Survey

    class Eager:
        device = torch.device("cpu")

        def __init__(self) -> None:
            self.hooks: list = []

        def run(self, tensors, tuner=None):
            self.hooks.append(tuner)
            return []

    monkeypatch.setattr(torch.random, "fork_rng", lambda **kwargs: contextlib.nullcontext())
    compiled = _layernorm(batch=16, hidden=64)
    graphed = GraphedProgram(Eager())
    assert compiled._survey(graphed, [], tuner=None)
    assert graphed.calls == 0 and len(graphed.program.hooks) == 1 and isinstance(graphed.program.hooks[0], Survey)


def test_the_survey_runs_on_scratch_copies_with_the_strides_of_the_updated_inputs(monkeypatch):
    """An input updated in place that is a strided view (a parameter inside a flat buffer) is copied
    for the survey with its own strides, which the kernels were compiled for; the user's tensor is
    not what the survey's run writes."""
    import contextlib

    import torch

    from fusionstitching.frontend.torch_fx import capture
    from fusionstitching.runtime.program import GraphedProgram

    def step(p, g):
        p.add_(g)
        return p.sum(-1)

    flat = torch.randn(64, 32)
    p, g = flat[:, ::2], torch.randn(64, 16)
    compiled = compile_graph(capture(step, p.clone(), g).forward, Options(strict=True))
    assert compiled.graph.mutations

    class Eager:
        device = torch.device("cpu")

        def __init__(self) -> None:
            self.seen: list = []

        def run(self, tensors, tuner=None):
            self.seen.append(list(tensors))
            return []

    monkeypatch.setattr(torch.random, "fork_rng", lambda **kwargs: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (1 << 40, 1 << 40))
    program = GraphedProgram(Eager())
    position = next(iter(compiled.graph.mutations.values()))
    tensors = [p, g] if position == 0 else [g, p]
    assert compiled._survey(program, tensors, tuner=None)
    (scratch,) = program.program.seen
    copy, original = scratch[position], tensors[position]
    assert copy is not original and copy.stride() == original.stride() and torch.equal(copy, original)


class CompilesAhead(LastIsFastest):
    """``LastIsFastest`` with ``GpuMeasure``'s background compiles, logging what it was handed."""

    def __init__(self) -> None:
        super().__init__()
        self.log: list[tuple[str, list[str]]] = []
        self.closed = False

    def __call__(self, kernels, inputs, flush=True):
        if flush:
            self.log.append(("measure", [str(k.template) for k in kernels]))
        return super().__call__(kernels, inputs, flush)

    def compile_ahead(self, kernels):
        self.log.append(("compile", [str(k.template) for k in kernels]))

    def room_ahead(self):
        return 16

    def close(self):
        self.closed = True


def test_the_next_patterns_candidates_are_made_and_compiled_while_one_is_measured():
    """With a measure that compiles in the background, the later pattern's candidates are made and
    handed over before the first pattern is measured; both patterns are measured on the candidates,
    and reach the choices, a tuner without it has."""
    import torch

    from fusionstitching.frontend.torch_fx import capture

    def fn(a, b):
        return torch.softmax(a, -1), torch.nn.functional.layer_norm(b, (1024,))

    compiled = compile_graph(capture(fn, torch.randn(4096, 1024), torch.randn(32768, 1024)).forward,
                             Options(strict=True))
    small, large = compiled.kernels
    plain, ahead = LastIsFastest(), CompilesAhead()
    chosen = {}
    for measure in (plain, ahead):
        tuner = Tuner(compiled.graph, Options(strict=True), "Test GPU", "sm_90", measure, None)
        tuner.prioritize(compiled.kernels)
        chosen[measure] = [str(tuner.kernel_for(k, []).template) for k in (small, large)]
        tuner.finish()
        assert tuner.tuned == 2 and not tuner._prepared
    assert chosen[plain] == chosen[ahead] and ahead.calls == plain.calls
    kinds = [kind for kind, _ in ahead.log]
    assert kinds == ["compile", "compile", "measure", "compile", "measure"]
    assert ahead.log[1][1] == plain.calls[1][1:]  # the LayerNorm's candidates, before the softmax is measured
    assert ahead.log[0][1] == plain.calls[0][1:] and ahead.closed


def test_candidates_made_ahead_for_a_patterns_first_kernel_serve_another_kernel_of_it():
    """The candidates ``_look_ahead`` made for a pattern's first kernel, which the budget passed
    over, are made again for the kernel of the pattern tuned later (its own nodes): no template
    names another kernel's nodes, and the choice is the one a tuner without them makes."""
    import torch

    from fusionstitching.frontend.torch_fx import capture

    def fn(a, b, c):
        return torch.nn.functional.layer_norm(c, (1024,)), torch.softmax(a, -1), torch.softmax(b, -1)

    compiled = compile_graph(capture(fn, torch.randn(4096, 1024), torch.randn(4096, 1024),
                                     torch.randn(32768, 1024)).forward, Options(strict=True))
    first, one, other = compiled.kernels
    ahead = CompilesAhead()
    tuner = Tuner(compiled.graph, Options(strict=True), "Test GPU", "sm_90", ahead, None)
    tuner.prioritize(compiled.kernels)
    assert tuner.key(one) == tuner.key(other) != tuner.key(first)
    tuner.kernel_for(first, [])
    assert tuner.key(one) in tuner._prepared  # made for ``one``, which is now passed over
    chosen = tuner.kernel_for(other, [])
    measure = LastIsFastest()
    expected = Tuner(compiled.graph, Options(strict=True), "Test GPU", "sm_90", measure, None).kernel_for(other, [])
    assert chosen is not other and str(chosen.template) == str(expected.template)
    assert set(chosen.lowered.pattern.nodes) == set(other.lowered.pattern.nodes)
    assert ahead.calls[-1] == measure.calls[0]  # the same candidates, named after ``other``'s nodes


def test_a_failure_of_tuning_itself_keeps_the_plans_template_with_a_warning_or_raises_when_strict():
    compiled = _layernorm()
    kernel = compiled.kernels[0]

    def broken(kernels, inputs, flush=True):
        raise KeyError("a bug in choosing")

    tuner = Tuner(compiled.graph, Options(), "Test GPU", "sm_90", broken, None)
    tuner._tune = lambda *args: broken([], [])
    with pytest.warns(TuningWarning, match="tuning failed"):
        assert tuner.kernel_for(kernel, []) is kernel
    strict = Tuner(compiled.graph, Options(strict=True), "Test GPU", "sm_90", broken, None)
    strict._tune = lambda *args: broken([], [])
    with pytest.raises(KeyError):
        strict.kernel_for(kernel, [])


def test_nothing_is_made_ahead_once_the_budget_is_spent():
    """A budget spent while a pattern is measured makes no candidates for the patterns after it."""
    import time

    import torch

    from fusionstitching.frontend.torch_fx import capture

    def fn(a, b):
        return torch.softmax(a, -1), torch.nn.functional.layer_norm(b, (1024,))

    compiled = compile_graph(capture(fn, torch.randn(4096, 1024), torch.randn(32768, 1024)).forward,
                             Options(strict=True))
    small, large = compiled.kernels
    ahead = CompilesAhead()
    tuner = Tuner(compiled.graph, Options(strict=True), "Test GPU", "sm_90", ahead, None, budget_s=1000.0)
    tuner.prioritize(compiled.kernels)
    tuner._worth = {tuner.key(small), tuner.key(large)}
    tuner._look_ahead(tuner.key(small), [], start=-1e9)  # began long ago: the budget is spent
    assert not tuner._prepared
    tuner._look_ahead(tuner.key(small), [], start=time.perf_counter())
    assert tuner.key(large) in tuner._prepared


class CompilesChosen(LastIsFastest):
    """``LastIsFastest`` that logs the kernels handed to ``compile`` (``GpuMeasure.compile``)."""

    def __init__(self) -> None:
        super().__init__()
        self.compiled: list[list] = []

    def compile(self, kernels):
        self.compiled.append(list(kernels))


def test_a_winner_is_made_and_compiled_at_once_for_the_patterns_kernels_whose_scalars_differ(tmp_path):
    """Two softmaxes of one structure, scaled by different constants: their kernels are not twins.
    Once the first is decided for another template than the plan's, the second's kernel with that
    template is made and handed to ``compile`` together (not compiled alone at its launch), and
    the second's turn returns a twin of it; a second tuner reading the winner from the library
    does the same and measures nothing."""
    import torch

    from fusionstitching.frontend.torch_fx import capture

    def fn(a, w, v):
        return torch.softmax((torch.softmax((a @ w) * 2.0, -1) @ v) * 3.0, -1)

    compiled = compile_graph(capture(fn, torch.randn(4096, 1024), torch.randn(1024, 1024),
                                     torch.randn(1024, 1024)).forward, Options(strict=True))
    first, second = compiled.kernels
    assert second._twin is None and first.cuda_source != second.cuda_source
    for measure in (CompilesChosen(), CompilesChosen()):
        tuner = Tuner(compiled.graph, Options(strict=True), "Test GPU", "sm_90", measure, PerfLib(tmp_path / FILE_NAME))
        assert tuner.key(first) == tuner.key(second)
        tuner.prioritize(compiled.kernels)
        chosen = tuner.kernel_for(first, [])
        assert str(chosen.template) != str(first.template)
        [made] = measure.compiled
        assert len(made) == 1 and made[0].lowered.pattern.outputs == second.lowered.pattern.outputs
        assert canonical(made[0].template, tuner._nodes(second)) == canonical(chosen.template, tuner._nodes(first))
        later = tuner.kernel_for(second, [])
        assert later._twin is made[0] and later.cuda_source == made[0].cuda_source != chosen.cuda_source
        assert measure.compiled == [made]  # nothing more to compile at the second's turn
    assert len(measure.calls) == 0 and tuner.hits == 1



def test_candidates_are_made_with_the_cyclic_collector_paused_and_it_is_back_on_after(tmp_path, monkeypatch):
    """Lowering allocates expression trees with cycles; with the collector on, its full collections
    walk the whole process again and again (``_host``). The tuner makes its candidates with it off
    and leaves it on."""
    import gc

    import fusionstitching.runtime.tuner as tuner_module

    states = []
    made = tuner_module.generate

    def recording(*args, **kwargs):
        states.append(gc.isenabled())
        return made(*args, **kwargs)

    monkeypatch.setattr(tuner_module, "generate", recording)
    compiled = _layernorm()
    tuner = Tuner(compiled.graph, Options(strict=True), "Test GPU", "sm_90", LastIsFastest(),
                  PerfLib(tmp_path / FILE_NAME))
    was = gc.isenabled()
    gc.enable()
    try:
        assert tuner.kernel_for(compiled.kernels[0], []) is not compiled.kernels[0]
        assert states and not any(states)
        assert gc.isenabled()
    finally:
        if not was:
            gc.disable()
