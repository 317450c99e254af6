"""``fusion/background.py``: a worker process explores a graph to the plan this process would
find; a training backward compiles with the plan its forward's compile sent ahead; a worker that
dies or a graph never sent leaves exploration to the compile."""

from __future__ import annotations

import time

import pytest
import torch

import fusionstitching
from fusionstitching.fusion import background
from fusionstitching.fusion.explore import DEFAULT_GENERATORS, explore
from fusionstitching.fusion.plan_cache import plan_key
from fusionstitching.options import Options
from fusionstitching.pipeline import compile_graph

pytestmark = pytest.mark.explore_ahead


@pytest.fixture(scope="module")
def graph():
    """LayerNorm's backward: several kernels, reductions, a layout the explorer rewrites."""
    from fusionstitching.cli import capture_workload

    _, captured = capture_workload("layernorm", train=True)
    return captured.backward


def _begun(graph, options) -> None:
    """Wait until the worker has begun ``graph``: ``take`` waits only for a graph already begun."""
    deadline = time.monotonic() + 120
    while not background.started(graph, options, DEFAULT_GENERATORS):
        assert time.monotonic() < deadline, "the worker never began the graph"
        time.sleep(0.01)


def _same_plans(a, b) -> None:
    assert [(p.nodes, str(p.schedule), p.score, p.origin) for p in a.patterns] == \
        [(p.nodes, str(p.schedule), p.score, p.origin) for p in b.patterns]
    assert a.library == b.library and a.views == b.views and a.estimated_us == b.estimated_us
    assert a.graph.to_json() == b.graph.to_json() and a.graph.checks == b.graph.checks


def test_the_worker_finds_the_plan_exploring_here_finds(graph):
    options = Options(strict=True, cache_plans=False)
    assert background.submit(graph, options, DEFAULT_GENERATORS)
    _begun(graph, options)
    taken = background.take(graph, options, DEFAULT_GENERATORS)
    assert taken is not None
    plan, seconds = taken
    assert seconds > 0 and any("explored ahead by a worker process" in note for note in plan.notes)
    _same_plans(plan, explore(graph, solver=options.solver, options=options, generators=DEFAULT_GENERATORS))
    assert background.take(graph, options, DEFAULT_GENERATORS) is None  # taken once


def test_a_graph_not_sent_or_planned_with_other_options_is_not_taken(graph):
    options = Options(strict=True, cache_plans=False)
    assert background.take(graph, options, DEFAULT_GENERATORS) is None
    assert background.submit(graph, options, DEFAULT_GENERATORS)
    other = Options(strict=True, cache_plans=False, solver="beam")
    assert background.take(graph, other, DEFAULT_GENERATORS) is None  # another key: explored where compiled
    _begun(graph, options)
    assert background.take(graph, options, DEFAULT_GENERATORS) is not None


def test_a_dead_worker_leaves_the_graph_to_the_compile_and_a_new_one_starts(graph):
    options = Options(strict=True, cache_plans=False)
    assert background.submit(graph, options, DEFAULT_GENERATORS)
    dead = background._WORKER
    dead.process.kill()
    with dead.lock:  # the reader sees the pipe close
        assert dead.lock.wait_for(lambda: not dead.alive, timeout=60)
    assert background.take(graph, options, DEFAULT_GENERATORS) is None  # killed before its answer
    compiled = compile_graph(graph, options)  # explored here
    assert compiled.plan.kernel_count > 0
    assert background.submit(graph, options, DEFAULT_GENERATORS)
    assert background._WORKER is not dead
    _begun(graph, options)
    assert background.take(graph, options, DEFAULT_GENERATORS) is not None


def test_a_training_backward_compiles_with_the_plan_sent_ahead_and_matches_eager(monkeypatch):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.LayerNorm(128), torch.nn.GELU(),
                                torch.nn.Linear(128, 64), torch.nn.Softmax(-1))
    x = torch.randn(32, 64, requires_grad=True)
    model(x).square().sum().backward()
    expected = [x.grad.clone()] + [p.grad.clone() for p in model.parameters()]
    x.grad = None
    model.zero_grad()
    taken = background.COUNTS["taken"]
    options = {"strict": True, "cache_plans": False}
    take = background.take

    def take_begun(graph, options, generators):  # the small forward compiles faster than the worker starts
        if plan_key(graph, options.solver, generators, options) in background._PENDING:
            _begun(graph, options)
        return take(graph, options, generators)

    monkeypatch.setattr(background, "take", take_begun)
    compiled = fusionstitching.compile(model, options=options)
    compiled(x).square().sum().backward()
    assert background.COUNTS["taken"] == taken + 1
    assert background.pending() == 0
    for got, want in zip([x.grad] + [p.grad for p in model.parameters()], expected):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_explore_ahead_off_sends_nothing():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh())
    x = torch.randn(8, 16, requires_grad=True)
    submitted = background.COUNTS["submitted"]
    compiled = fusionstitching.compile(model, options={"strict": True, "cache_plans": False, "explore_ahead": False})
    compiled(x).sum().backward()
    assert background.COUNTS["submitted"] == submitted


def test_with_an_arch_the_worker_compiles_the_kernels_into_the_nvrtc_cache(graph, tmp_path):
    pytest.importorskip("cuda.bindings")
    from fusionstitching.codegen.nvrtc import compile_cuda

    options = Options(strict=True, cache_plans=False, cache_dir=str(tmp_path))
    assert background.submit(graph, options, DEFAULT_GENERATORS, arch="sm_90")
    _begun(graph, options)
    assert background.take(graph, options, DEFAULT_GENERATORS) is not None
    # the worker takes requests in turn: once a second one is answered, the first's kernels are compiled
    beam = Options(strict=True, cache_plans=False, cache_dir=str(tmp_path), solver="beam")
    assert background.submit(graph, beam, DEFAULT_GENERATORS)
    _begun(graph, beam)
    assert background.take(graph, beam, DEFAULT_GENERATORS) is not None
    kernels = [k for k in compile_graph(graph, options).kernels if k._twin is None]
    modules = [compile_cuda(k.cuda_source, "sm_90", name=f"{k.lowered.kernel.name}.cu", cache_dir=str(tmp_path))
               for k in kernels]
    assert kernels and all(m.cached for m in modules)


def test_sending_more_than_a_pipe_holds_does_not_wait_for_the_worker_to_read(monkeypatch):
    """A worker busy importing reads nothing for seconds; the compile that sends must not wait."""
    import gzip
    import sys
    import threading
    from pathlib import Path

    from fusionstitching.graph.serialize import from_json

    text = gzip.decompress((Path(__file__).parents[1] / "data" / "unet_block_backward.json.gz").read_bytes()).decode()
    big = from_json(text)
    settings = [Options(strict=True, cache_plans=False, smem_limit=(48 - k) * 1024) for k in range(4)]  # 4 keys
    assert len(settings) * len(big.to_json()) > 64 * 1024  # more than a pipe holds
    monkeypatch.setattr(background, "_command", lambda: [sys.executable, "-c", "import time; time.sleep(60)"])
    monkeypatch.setattr(background, "_WORKER", None)
    sent = []
    sender = threading.Thread(target=lambda: sent.extend(background.submit(big, o, DEFAULT_GENERATORS)
                                                         for o in settings), daemon=True)
    sender.start()
    sender.join(timeout=20)
    sleeper = background._WORKER
    try:
        assert not sender.is_alive() and sent == [True] * len(settings)
    finally:
        sleeper.process.kill()
        for options in settings:  # the dead worker answers nothing
            assert background.take(big, options, DEFAULT_GENERATORS) is None


def test_a_graph_the_worker_has_not_begun_is_explored_here_and_its_late_answer_dropped(graph, monkeypatch):
    """A worker still importing cannot answer before exploring here would: ``take`` does not wait."""
    import sys

    options = Options(strict=True, cache_plans=False)
    monkeypatch.setattr(background, "_command", lambda: [sys.executable, "-c", "import time; time.sleep(60)"])
    monkeypatch.setattr(background, "_WORKER", None)
    assert background.submit(graph, options, DEFAULT_GENERATORS)
    sleeper = background._WORKER
    try:
        began = time.perf_counter()
        assert not background.ready() and not background.started(graph, options, DEFAULT_GENERATORS)
        assert background.take(graph, options, DEFAULT_GENERATORS) is None
        assert time.perf_counter() - began < 5  # no wait for the sleeping worker
        assert background.pending() == 0 and sleeper.dropped == {1}
    finally:
        sleeper.process.kill()
    monkeypatch.undo()
    # a real worker, once ready, begins a graph as soon as it is sent
    background.start()
    deadline = time.monotonic() + 120
    while not background.ready():
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert background.submit(graph, options, DEFAULT_GENERATORS)
    _begun(graph, options)
    assert background.take(graph, options, DEFAULT_GENERATORS) is not None


def test_a_worker_whose_parent_has_gone_stops_quietly():
    """The parent exited before the worker said it was ready: the closed pipe ends the worker
    without a traceback."""
    import io

    class Gone(io.RawIOBase):
        def writable(self) -> bool:
            return True

        def write(self, data) -> int:
            raise BrokenPipeError(32, "Broken pipe")

    from fusionstitching import worker

    assert worker._serve(io.BytesIO(), Gone(), None) is None


@pytest.fixture(scope="module")
def split_graph():
    """A BERT layer's forward: splitting its reshaped dims changes it, so it is explored both ways."""
    from fusionstitching.cli import capture_workload

    _, captured = capture_workload("bert_layer")
    return captured.forward


def _idle_worker() -> None:
    background.start()
    deadline = time.monotonic() + 120
    while not background._WORKER.idle():
        assert time.monotonic() < deadline, "the worker never became idle"
        time.sleep(0.01)


def _unsplit_begun(ticket) -> None:
    """Wait until the worker has begun an unsplit job (``take_unsplit`` waits only for one begun)."""
    worker, deadline = ticket.worker, time.monotonic() + 120
    while True:
        with worker.lock:
            if ticket.job in worker.started or ticket.job in worker.results:
                return
        assert time.monotonic() < deadline, "the worker never began the job"
        time.sleep(0.01)


def test_an_idle_worker_explores_the_unsplit_plan_this_process_would(split_graph):
    import sys

    explore_module = sys.modules["fusionstitching.fusion.explore"]
    options = Options(strict=True, cache_plans=False)
    prepared = explore_module._prepared(split_graph, options)
    _idle_worker()
    ticket = background.submit_unsplit(prepared, "ilp", options, DEFAULT_GENERATORS)
    assert ticket is not None
    here = explore_module.unsplit_plan(prepared, "ilp", options, DEFAULT_GENERATORS)
    _unsplit_begun(ticket)
    taken = background.take_unsplit(ticket, options)
    assert taken is not None and taken.estimated_us == here.estimated_us
    there = taken.plan(options)
    assert there is not None and any("unsplit plan explored by a worker process" in n for n in there.notes)
    _same_plans(there, here)


@pytest.mark.parametrize("kept", ["split", "unsplit"])
def test_explore_takes_the_workers_unsplit_plan_and_plans_as_alone(split_graph, kept, monkeypatch):
    """The worker's answer decides as the unsplit plan explored here would, and is decoded only
    where it is kept (the BERT layer keeps one plan; for the other, the split plan's estimate is skewed)."""
    import sys

    explore_module = sys.modules["fusionstitching.fusion.explore"]
    options = Options(strict=True, cache_plans=False)
    alone = explore(split_graph, options=Options(strict=True, cache_plans=False, explore_ahead=False))
    note = next(n for n in alone.notes if "reshapes resolved by splitting dims" in n)
    if not note.endswith(f"kept {kept}"):  # the split plan (explored here) estimated far off
        original = explore_module._explore

        def skewed(prepared, refined, *args, **kwargs):
            plan = original(prepared, refined, *args, **kwargs)
            if refined is not prepared[0]:
                plan.estimated_us *= 0.1 if kept == "split" else 10
            return plan

        monkeypatch.setattr(explore_module, "_explore", skewed)
        alone = explore(split_graph, options=Options(strict=True, cache_plans=False, explore_ahead=False))
        assert next(n for n in alone.notes if "reshapes resolved" in n).endswith(f"kept {kept}")
    _idle_worker()
    submitted, taken = background.COUNTS["unsplit submitted"], background.COUNTS["unsplit taken"]
    alongside = explore(split_graph, options=options)
    assert background.COUNTS["unsplit submitted"] == submitted + 1
    assert background.COUNTS["unsplit taken"] == taken + (kept == "unsplit")  # decoded only when kept
    assert any(f"kept {kept}" in n for n in alongside.notes)
    _same_plans(alongside, alone)


def test_a_busy_worker_or_explore_ahead_off_is_not_asked(split_graph, graph):
    options = Options(strict=True, cache_plans=False)
    _idle_worker()
    assert background.submit_unsplit((split_graph, ()), "ilp", Options(explore_ahead=False), DEFAULT_GENERATORS) is None
    assert background.submit(graph, options, DEFAULT_GENERATORS)  # a backward sent ahead: the worker is busy
    assert background.submit_unsplit((split_graph, ()), "ilp", options, DEFAULT_GENERATORS) is None
    _begun(graph, options)
    assert background.take(graph, options, DEFAULT_GENERATORS) is not None
    _idle_worker()
    ticket = background.submit_unsplit((split_graph, ()), "ilp", options, DEFAULT_GENERATORS)
    assert ticket is not None
    _unsplit_begun(ticket)
    assert background.take_unsplit(ticket, options).plan(options) is not None


def test_an_answer_not_for_the_ticket_is_not_trusted(split_graph):
    """A ticket's answer is its own exploration's: a worker that died and was replaced numbers its
    jobs from 1 again, and another job's plan under the ticket's number must not decide."""
    options = Options(strict=True, cache_plans=False)
    _idle_worker()
    ticket = background.submit_unsplit((split_graph, ()), "ilp", options, DEFAULT_GENERATORS)
    assert ticket is not None
    _unsplit_begun(ticket)
    forged = background.Ticket(ticket.worker, ticket.job, ticket.key + "-another")
    assert background.take_unsplit(forged, options) is None


def test_a_failed_exploration_drops_its_tickets_answer(split_graph, monkeypatch):
    import sys

    explore_module = sys.modules["fusionstitching.fusion.explore"]

    def failing(*args, **kwargs):
        raise RuntimeError("split exploration failed")

    _idle_worker()
    sent = background.COUNTS["unsplit submitted"]
    monkeypatch.setattr(explore_module, "_explore", failing)
    with pytest.raises(RuntimeError, match="split exploration failed"):
        explore(split_graph, options=Options(strict=True, cache_plans=False))
    assert background.COUNTS["unsplit submitted"] == sent + 1
    worker = background._WORKER
    deadline = time.monotonic() + 120
    while not worker.idle():  # the answer comes and is dropped, not kept
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert not worker.results and not worker.dropped


def test_a_worker_sends_nothing_on(split_graph, monkeypatch):
    """Explorations in the worker process itself explore both ways there."""
    _idle_worker()
    monkeypatch.setenv(background.PLANNER_ONLY, "1")
    assert background.submit_unsplit((split_graph, ()), "ilp", Options(), DEFAULT_GENERATORS) is None


def test_the_worker_imports_the_planner_without_pytorch():
    """The worker is ready before the graph it is wanted for has been traced: it imports neither
    PyTorch nor TorchDynamo, and the package still registers the code generator's lowering check."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    code = ("import sys, fusionstitching.worker\n"
            "from fusionstitching.fusion import explore\n"
            "from fusionstitching.schedule import grouping\n"
            "assert 'torch' not in sys.modules, 'torch imported'\n"
            "import fusionstitching\n"
            "try:\n"
            "    fusionstitching.compile\n"
            "except AttributeError as err:\n"
            "    assert 'FUSIONSTITCHING_PLANNER_ONLY=1 is set' in str(err), err\n"
            "else:\n"
            "    raise AssertionError('compile loaded')\n"
            "print('ok', bool(grouping._LOWERING))\n")
    env = {**os.environ, background.PLANNER_ONLY: "1",
           "PYTHONPATH": str(Path(background.__file__).resolve().parents[2])}
    result = subprocess.run([sys.executable, "-c", code], check=False, env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["ok", "True"]
