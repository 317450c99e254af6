"""``Options(async_compile=True)``: a graph's calls run in PyTorch while it compiles in the
background, then the compiled program takes over; a training forward and its backward take one
path per step; a graph whose partner does not compile stays in PyTorch, announced. Compiles are
held back by an event (``_held``) so that each test decides when they finish.

On a CPU the compiled programs run in the simulator; on a GPU (``-m gpu``) their kernels are
compiled in the background thread too and launched.
"""

from __future__ import annotations

import copy
import threading
import warnings

import pytest
import torch

import fusionstitching
from fusionstitching import pipeline
from fusionstitching.backend import CompileFailure, FallbackWarning, reset_stats, stats, wait_for_compiles

_EVENTS: list[threading.Event] = []  # released at each test's end, whatever happened


def _held(monkeypatch, which: str | None = "", fail: str | None = None) -> threading.Event:
    """Make compiles of graphs whose name starts with ``which`` (every graph: "") wait for the
    returned event; those whose name starts with ``fail`` then raise."""
    release = threading.Event()
    _EVENTS.append(release)
    plain = pipeline.compile_graph

    def compile_graph(graph, *args, **kwargs):
        if which is not None and graph.name.startswith(which):
            assert release.wait(300), "the test never released the compile"
        if fail is not None and graph.name.startswith(fail):
            raise RuntimeError(f"injected failure compiling {graph.name}")
        return plain(graph, *args, **kwargs)

    monkeypatch.setattr(pipeline, "compile_graph", compile_graph)
    return release


def _model(device: str = "cpu") -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 96), torch.nn.GELU(), torch.nn.LayerNorm(96)).to(device)


# a loss whose gradient through the LayerNorm is not zero (a sum of squares of its rows would be)
_WEIGHTS = torch.randn(32, 96, generator=torch.Generator().manual_seed(1))


def _step(fn, model: torch.nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A training step of ``fn`` (``model`` or its compiled form): output, input and weight gradients."""
    x = x.detach().clone().requires_grad_(True)
    model.zero_grad()
    y = fn(x)
    (y * _WEIGHTS).sum().backward()
    return y.detach(), x.grad, model[0].weight.grad.clone()


def _close(got, want) -> None:
    """Each tensor within 1e-5 of eager's in relative norm (f32; sums in another order)."""
    for a, b in zip(got, want):
        a, b = a.detach().double().cpu(), b.detach().double().cpu()
        assert float((a - b).norm()) <= 1e-5 * float(b.norm()), float((a - b).norm() / b.norm())


def _both_fell_back(caught) -> None:
    """The backward's injected compile failure and its forward's fallback, each announced once."""
    messages = [str(w.message) for w in caught if issubclass(w.category, FallbackWarning)]
    assert any("injected failure" in m for m in messages), messages
    assert any("its backward runs in PyTorch" in m for m in messages), messages
    assert stats()["fallbacks"] == 2


def _eager_calls() -> int:
    return stats()["eager while compiling"]


@pytest.fixture(autouse=True)
def fresh():
    torch._dynamo.reset()
    reset_stats()
    yield
    for event in _EVENTS:
        event.set()
    _EVENTS.clear()
    wait_for_compiles(300)
    torch._dynamo.reset()


def _run_inference(monkeypatch, device: str) -> None:
    release = _held(monkeypatch)
    model = _model(device)
    compiled = fusionstitching.compile(model, options={"async_compile": True})
    with torch.no_grad():
        for k in range(3):  # the compile waits: every call runs in PyTorch (its ATen graph)
            x = torch.randn(32, 64, device=device)
            _close([compiled(x)], [model(x)])
        assert _eager_calls() == 3 and stats()["compilations"] == 0
        release.set()
        assert wait_for_compiles(300)
        assert stats()["compilations"] == 1 and stats()["fallbacks"] == 0
        for k in range(2):  # the compiled program from now on
            x = torch.randn(32, 64, device=device)
            _close([compiled(x)], [model(x)])
        assert _eager_calls() == 3 and stats()["cache hits"] >= 1


def test_an_inference_graph_runs_in_pytorch_until_its_background_compile_is_done(monkeypatch):
    _run_inference(monkeypatch, "cpu")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_the_gpu_the_background_compile_builds_the_kernels_and_they_take_over(monkeypatch):
    _run_inference(monkeypatch, "cuda")


def test_a_forward_waits_for_its_backward_and_each_backward_takes_its_forwards_path(monkeypatch):
    release = _held(monkeypatch, which="backward")
    model, reference = _model(), _model()
    compiled = fusionstitching.compile(model, options={"async_compile": True})
    xs = [torch.randn(32, 64) for _ in range(4)]
    _close(_step(compiled, model, xs[0]), _step(reference, reference, xs[0]))
    assert _eager_calls() == 2  # the forward and the backward, both in PyTorch
    # the forward's compile is done, the backward's is held: the forward stays in PyTorch
    import time
    deadline = time.monotonic() + 300
    while stats()["compilations"] < 1 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert stats()["compilations"] == 1
    first = xs[1].clone().requires_grad_(True)
    model.zero_grad()
    y1 = compiled(first)  # in PyTorch: its backward has not compiled
    assert _eager_calls() == 3
    release.set()
    assert wait_for_compiles(300) and stats()["compilations"] == 2
    second = xs[2].clone().requires_grad_(True)
    y2 = compiled(second)  # both compiled: the forward switches
    assert _eager_calls() == 3
    # the backward of the forward that ran in PyTorch runs in PyTorch, the other's compiled,
    # whatever their order
    (y2 * _WEIGHTS).sum().backward()
    (y1 * _WEIGHTS).sum().backward()
    assert _eager_calls() == 4
    ref1, ref2 = xs[1].clone().requires_grad_(True), xs[2].clone().requires_grad_(True)
    reference.zero_grad()
    r1, r2 = reference(ref1), reference(ref2)
    (r2 * _WEIGHTS).sum().backward()
    (r1 * _WEIGHTS).sum().backward()
    _close((y1, y2, first.grad, second.grad, model[0].weight.grad),
           (r1, r2, ref1.grad, ref2.grad, reference[0].weight.grad))
    _close(_step(compiled, model, xs[3]), _step(reference, reference, xs[3]))  # steps compiled from now on
    assert _eager_calls() == 4 and stats()["fallbacks"] == 0


def test_a_backward_that_does_not_compile_keeps_its_forward_in_pytorch_announced(monkeypatch):
    _held(monkeypatch, which=None, fail="backward")
    model, reference = _model(), _model()
    compiled = fusionstitching.compile(model, options={"async_compile": True, "strict": False})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _close(_step(compiled, model, torch.ones(32, 64)), _step(reference, reference, torch.ones(32, 64)))
        assert wait_for_compiles(300)
        for k in range(3):
            x = torch.randn(32, 64)
            _close(_step(compiled, model, x), _step(reference, reference, x))
    _both_fell_back(caught)


def test_under_strict_a_background_compiles_error_is_raised_at_a_call(monkeypatch):
    release = _held(monkeypatch, fail="inference")
    model = _model()
    compiled = fusionstitching.compile(model, options={"async_compile": True})
    with torch.no_grad():
        x = torch.randn(32, 64)
        _close([compiled(x)], [model(x)])  # in PyTorch while the compile waits
        release.set()
        wait_for_compiles(300)
        with pytest.raises(CompileFailure, match="injected failure"):
            compiled(x)
        with pytest.raises(CompileFailure, match="injected failure"):  # again, not a half-switched runner's error
            compiled(x)


def test_compilations_count_each_shape_specialization():
    model = copy.deepcopy(_model())
    compiled = torch.compile(model, backend="fusionstitching", dynamic=False)
    with torch.no_grad():
        for rows in (8, 16, 16, 8):
            compiled(torch.randn(rows, 64))
    assert stats()["compilations"] == 2 and stats()["eager while compiling"] == 0


@pytest.mark.parametrize("dynamic", [False, True])
def test_a_dropouts_backward_uses_the_mask_its_forward_drew_on_either_path(monkeypatch, dynamic):
    """Dropout draws its mask in the forward (in PyTorch from torch's generator, compiled from a
    seed drawn from it): the gradient of each step is its own forward's mask, before, across and
    after the switch; with symbolic shapes too."""
    release = _held(monkeypatch)

    def fn(x):
        return torch.nn.functional.dropout(x * 3.0, 0.5, training=True)

    compiled = fusionstitching.compile(fn, options={"async_compile": True}, dynamic=dynamic)
    for step in range(6):
        if step == 2:
            release.set()
            assert wait_for_compiles(300)
        x = (torch.rand(64, 256) + 0.5).requires_grad_(True)
        y = compiled(x)
        y.sum().backward()
        kept = y.detach() != 0
        assert 0.3 < kept.float().mean() < 0.7
        torch.testing.assert_close(y.detach(), torch.where(kept, x.detach() * 6.0, 0.0))
        torch.testing.assert_close(x.grad, kept.float() * 6.0)
    assert _eager_calls() == 4 and stats()["compilations"] == 2


def test_stats_report_every_count_from_the_start():
    counts = stats()
    for key in ("graphs", "compilations", "plans transferred", "kernels", "library calls", "views", "fallbacks",
                "shape specializations", "cache hits", "eager while compiling", "tuned", "perflib hits"):
        assert counts[key] == 0, key


def test_a_finished_compile_is_not_kept_by_the_pending_list(monkeypatch):
    from fusionstitching import backend

    model = _model()
    compiled = fusionstitching.compile(model, options={"async_compile": True})
    with torch.no_grad():
        compiled(torch.randn(32, 64))
    assert wait_for_compiles(300)
    assert backend._PENDING == []  # the program lives in its runner only (freed with it)


def _dynamic(model: torch.nn.Module, **options):
    """``model`` compiled with its first dim dynamic from the first call (TorchDynamo's symbolic shapes)."""
    return fusionstitching.compile(model, options={"async_compile": True, **options}, dynamic=True)


def _run_symbolic(monkeypatch, device: str) -> None:
    release = _held(monkeypatch)
    model = _model(device)
    compiled = _dynamic(model)
    with torch.no_grad():
        for rows in (8, 16, 8):  # both signatures' compiles wait: every call runs in PyTorch
            x = torch.randn(rows, 64, device=device)
            _close([compiled(x)], [model(x)])
        assert _eager_calls() == 3 and stats()["compilations"] == 0
        assert stats()["shape specializations"] == 2  # one compile per signature, not per call
        release.set()
        assert wait_for_compiles(300)
        assert stats()["compilations"] == 2
        for rows in (8, 16, 16, 8):  # compiled from now on
            x = torch.randn(rows, 64, device=device)
            _close([compiled(x)], [model(x)])
        assert _eager_calls() == 3
        x = torch.randn(24, 64, device=device)  # a third shape: in PyTorch at its first call, then compiled
        _close([compiled(x)], [model(x)])
        assert _eager_calls() == 4
        assert wait_for_compiles(300)
        _close([compiled(x)], [model(x)])
    assert _eager_calls() == 4 and stats()["compilations"] == 3 and stats()["fallbacks"] == 0


def test_each_new_shape_of_a_symbolic_graph_compiles_in_the_background(monkeypatch):
    _run_symbolic(monkeypatch, "cpu")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_the_gpu_each_new_shapes_kernels_are_built_in_the_background(monkeypatch):
    _run_symbolic(monkeypatch, "cuda")


def test_past_the_limit_a_symbolic_graphs_new_shapes_run_in_pytorch_announced(monkeypatch):
    model = _model()
    compiled = _dynamic(model, max_specializations=2)
    with torch.no_grad(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for rows in (8, 16, 24, 24):
            x = torch.randn(rows, 64)
            _close([compiled(x)], [model(x)])
            wait_for_compiles(300)
    messages = [str(w.message) for w in caught if issubclass(w.category, FallbackWarning)]
    assert len(messages) == 1 and "Options.max_specializations" in messages[0], messages
    assert stats()["compilations"] == 2


def test_under_strict_a_symbolic_graphs_failed_compile_is_raised_at_the_call_that_takes_it(monkeypatch):
    release = _held(monkeypatch, fail="inference")
    model = _model()
    compiled = _dynamic(model)
    with torch.no_grad():
        x = torch.randn(8, 64)
        _close([compiled(x)], [model(x)])
        release.set()
        assert wait_for_compiles(300)
        with pytest.raises(CompileFailure, match="injected failure"):
            compiled(x)
        with pytest.raises(CompileFailure, match="injected failure"):  # at every call of the signature
            compiled(x)
    assert stats()["shape specializations"] == 1


def test_past_the_limit_a_call_runs_in_pytorch_once():
    """A graph that updates its input in place (kept in the inference graph) updates it once per
    call, whichever path the call takes."""
    def fn(x):
        x.add_(1.0)
        return x.sum(-1)

    compiled = fusionstitching.compile(fn, options={"async_compile": True, "max_specializations": 1},
                                       dynamic=True)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for rows in (8, 8, 16, 16, 24):
            x = torch.zeros(rows, 4)
            torch.testing.assert_close(compiled(x), torch.full((rows,), 4.0))
            torch.testing.assert_close(x, torch.ones(rows, 4))
            wait_for_compiles(300)
    assert stats()["compilations"] == 1


def test_an_internal_error_transferring_a_plan_explores_the_graph_or_is_raised_under_strict(monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("injected transfer failure")

    monkeypatch.setattr(pipeline, "transfer", broken)
    model = _model()
    for strict in (False, True):
        torch._dynamo.reset()
        compiled = fusionstitching.compile(model, options={"strict": strict}, dynamic=True)
        with torch.no_grad():
            _close([compiled(torch.ones(8, 64))], [model(torch.ones(8, 64))])
            if strict:
                with pytest.raises(CompileFailure, match="injected transfer failure"):
                    compiled(torch.ones(16, 64))
            else:
                _close([compiled(torch.ones(16, 64))], [model(torch.ones(16, 64))])
    assert stats()["fallbacks"] == 0 and stats()["plans transferred"] == 0


def test_a_symbolic_graphs_failed_compile_leaves_it_in_pytorch_announced(monkeypatch):
    _held(monkeypatch, which=None, fail="inference")
    model = _model()
    compiled = _dynamic(model, strict=False)
    with torch.no_grad(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for rows in (8, 8, 16):
            x = torch.randn(rows, 64)
            _close([compiled(x)], [model(x)])
            wait_for_compiles(300)
    messages = [str(w.message) for w in caught if issubclass(w.category, FallbackWarning)]
    assert any("injected failure" in m for m in messages), messages
    assert stats()["compilations"] == 0


def _training_step(compiled, model, reference, rows: int) -> None:
    """One step of ``rows`` rows through ``compiled`` and ``reference`` (on ``model``'s device):
    outputs and gradients equal."""
    device = model[0].weight.device
    weights = _WEIGHTS[:rows].to(device)
    x = torch.randn(rows, 64, device=device)
    got, want = [], []
    for fn, m, out in ((compiled, model, got), (reference, reference, want)):
        xi = x.clone().requires_grad_(True)
        m.zero_grad()
        y = fn(xi)
        (y * weights).sum().backward()
        out += [y.detach(), xi.grad, m[0].weight.grad.clone()]
    _close(got, want)


def _run_symbolic_training(monkeypatch, device: str) -> None:
    """Each new signature of a symbolic training graph runs its step in PyTorch (forward and
    backward) while both graphs compile for it; then its steps run compiled."""
    release = _held(monkeypatch)
    model, reference = _model(device), _model(device)
    compiled = _dynamic(model)
    for rows in (32, 17):  # the compiles wait: both steps in PyTorch, each submitting two compiles
        _training_step(compiled, model, reference, rows)
    assert _eager_calls() == 4 and stats()["compilations"] == 0
    release.set()
    assert wait_for_compiles(300) and stats()["compilations"] == 4
    for rows in (32, 17, 32, 17):  # compiled from now on
        _training_step(compiled, model, reference, rows)
    assert _eager_calls() == 4
    _training_step(compiled, model, reference, 24)  # a new size: in PyTorch while it compiles
    assert wait_for_compiles(300) and _eager_calls() == 6
    for rows in (24, 32):
        _training_step(compiled, model, reference, rows)
    assert _eager_calls() == 6 and stats()["compilations"] == 6 and stats()["fallbacks"] == 0


def test_a_symbolic_training_graphs_shapes_compile_in_the_background_one_path_per_step(monkeypatch):
    _run_symbolic_training(monkeypatch, "cpu")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_the_gpu_a_symbolic_training_graphs_shapes_compile_in_the_background(monkeypatch):
    _run_symbolic_training(monkeypatch, "cuda")


def _recording_eager(monkeypatch) -> list[tuple[str, set[int]]]:
    """(graph kind, addresses of the tensors among its arguments and results) of each call run in
    PyTorch by a runner."""
    from fusionstitching import backend

    calls: list[tuple[str, set[int]]] = []
    plain = backend._Runner._eager

    def eager(self, args):
        results = plain(self, args)
        calls.append((self.kind, {t.data_ptr() for t in [*args, *results] if isinstance(t, torch.Tensor)
                                  and not isinstance(t, torch.nn.Parameter)}))
        return results

    monkeypatch.setattr(backend._Runner, "_eager", eager)
    return calls


def test_a_symbolic_backward_takes_the_path_of_its_own_forward(monkeypatch):
    """Each backward call finds its forward's path under the tensors that forward saved, whatever
    the order of the backwards; a forward switches once both graphs compiled for its signature."""
    release = _held(monkeypatch)
    model, reference = _model(), _model()
    compiled = _dynamic(model)
    _training_step(compiled, model, reference, 32)  # in PyTorch; both graphs' compiles wait
    calls = _recording_eager(monkeypatch)
    xs = [torch.randn(32, 64) for _ in range(3)]
    inputs = [x.clone().requires_grad_(True) for x in xs]
    model.zero_grad()
    ys = [compiled(inputs[0])]  # in PyTorch: not compiled yet
    release.set()
    assert wait_for_compiles(300)
    ys += [compiled(x) for x in inputs[1:]]  # compiled
    assert _eager_calls() == 3 and [kind for kind, _ in calls] == ["forward"]
    for y in reversed(ys):  # the last step's backward first
        (y * _WEIGHTS).sum().backward()
    assert _eager_calls() == 4 and [kind for kind, _ in calls] == ["forward", "backward"]
    assert calls[1][1] & calls[0][1]  # the backward in PyTorch read what the forward in PyTorch saved
    ref_inputs = [x.clone().requires_grad_(True) for x in xs]
    reference.zero_grad()
    for y in reversed([reference(x) for x in ref_inputs]):
        (y * _WEIGHTS).sum().backward()
    _close([*ys, *(x.grad for x in inputs), model[0].weight.grad],
           [*(reference(x) for x in xs), *(x.grad for x in ref_inputs), reference[0].weight.grad])


def test_summed_losses_keep_each_backward_on_its_forwards_path(monkeypatch):
    """Gradient accumulation over two sizes with one backward of the summed losses (autograd runs
    the later step's backward first): every backward of a compiled forward runs compiled."""
    model, reference = _model(), _model()
    compiled = _dynamic(model)
    for rows in (32, 17):  # both sizes compile (in PyTorch meanwhile)
        _training_step(compiled, model, reference, rows)
    assert wait_for_compiles(300)
    eager = _eager_calls()
    xs = [torch.randn(32, 64), torch.randn(17, 64)]
    got, want = [], []
    for fn, m, out in ((compiled, model, got), (reference, reference, want)):
        inputs = [x.clone().requires_grad_(True) for x in xs]
        m.zero_grad()
        loss = sum((fn(x) * _WEIGHTS[: len(x)]).sum() for x in inputs)
        loss.backward()
        out += [*(x.grad for x in inputs), m[0].weight.grad.clone()]
    _close(got, want)
    assert _eager_calls() == eager and stats()["fallbacks"] == 0


def test_a_symbolic_backward_that_does_not_compile_keeps_its_forward_in_pytorch_announced(monkeypatch):
    _held(monkeypatch, which=None, fail="backward")
    model, reference = _model(), _model()
    compiled = fusionstitching.compile(model, options={"async_compile": True, "strict": False}, dynamic=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for rows in (32, 32, 17, 32):
            _training_step(compiled, model, reference, rows)
            assert wait_for_compiles(300)
    _both_fell_back(caught)


def test_under_strict_a_symbolic_backwards_failed_compile_is_raised_at_its_forwards_call(monkeypatch):
    release = _held(monkeypatch, fail="backward")
    model, reference = _model(), _model()
    compiled = _dynamic(model)
    _training_step(compiled, model, reference, 32)
    release.set()
    assert wait_for_compiles(300)
    for _ in range(2):  # at every forward call of the signature
        with pytest.raises(CompileFailure, match="injected failure"):
            compiled(torch.randn(32, 64, requires_grad=True))


def test_a_symbolic_graphs_later_shapes_take_an_explored_plans_patterns(monkeypatch):
    """Specializations after the first are planned with an explored plan's patterns, each checked
    at their shapes (``explore.transfer``), and give eager's values; one whose patterns do not all
    hold there is explored (BERT's 48 tokens against its 32), and later ones may take that plan."""
    from fusionstitching.bench import workloads as W

    workload = W.bert(batch=2, seq=32, hidden=64, layers=2, heads=2)
    model = workload.fn
    explored = []
    plain = pipeline.explore

    def explore(graph, *args, **kwargs):
        explored.append(graph.name)
        return plain(graph, *args, **kwargs)

    monkeypatch.setattr(pipeline, "explore", explore)
    compiled = torch.compile(model, backend="fusionstitching", dynamic=True, options={"strict": True})
    with torch.no_grad():
        for seq in (32, 17, 48, 24, 40):
            ids = torch.randint(0, 1000, (2, seq), generator=torch.Generator().manual_seed(seq))
            mask = torch.ones(2, seq, dtype=torch.long)
            mask[0, seq // 2:] = 0
            _close(compiled(ids, mask), model(ids, mask))
    assert stats()["compilations"] == 5 and stats()["plans transferred"] == 3
    assert len(explored) == 2  # 32 and 48 tokens


def test_saved_tensors_moved_by_a_hook_still_let_the_forward_switch(monkeypatch):
    """A saved-tensor hook that copies what a step saves (offloading does) hides the forward's
    addresses from its backward: the backward is still matched to its forward's signature by the
    saved tensors' layout, and the forward switches once both graphs compiled. The forward's own
    saved tensors are freed at its end and a later step's copies often take their addresses: the
    path recorded under them counts only while their storages live, so that many steps of two
    sizes after both compiled all run compiled."""
    model, reference = _model(), _model()
    compiled = _dynamic(model)
    with torch.autograd.graph.saved_tensors_hooks(lambda t: t.clone(), lambda t: t):
        for rows in (32, 17):
            _training_step(compiled, model, reference, rows)
        assert wait_for_compiles(300)
        eager = _eager_calls()
        for rows in (32, 17) * 6:
            _training_step(compiled, model, reference, rows)
    assert _eager_calls() == eager == 4 and stats()["fallbacks"] == 0
