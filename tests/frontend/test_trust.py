"""Programs outside the project's own workloads: each test failed before the fix it names.

They run through ``torch.compile(..., backend="fusionstitching")`` on the CPU (kernels in the
simulator) in strict mode, so an internal error fails the test instead of falling back.
"""

import importlib
import threading
import warnings

import pytest
import torch

import fusionstitching
from fusionstitching import backend


def _compiled(fn, **options):
    torch._dynamo.reset()
    return torch.compile(fn, backend="fusionstitching", dynamic=False, options=options or None)


def _fallbacks() -> int:
    return fusionstitching.stats().get("fallbacks", 0)


@pytest.mark.parametrize("fn, shape", [
    (lambda x: torch.softmax(x, -1).sum(), (4, 8)),
    (lambda x: torch.log_softmax(x, -1).mean(), (32, 64)),
    (lambda x: (x - x.mean(-1, keepdim=True)).pow(2).sum(), (32, 64)),
    (lambda x: x.amax(-1).sum() + x.sum(), (7, 33)),
    (lambda x: torch.softmax(x, -1).sum(0).max(), (5, 3)),
])
def test_a_reduction_to_a_scalar_after_row_reductions_is_right(fn, shape):
    """Each warp stored its own partial sum into the one output (softmax(x).sum() was 1, not 4)."""
    x = torch.randn(*shape)
    before = _fallbacks()
    torch.testing.assert_close(_compiled(fn)(x), fn(x), rtol=1e-4, atol=1e-4)
    assert _fallbacks() == before


def test_training_on_a_second_input_shape():
    """The forward of a symbolic graph saves a size for its backward; it came back as None."""
    w = torch.randn(16, requires_grad=True)
    f = _compiled(lambda x, w: (x * w).relu().sum())
    f = torch.compile(lambda x, w: (x * w).relu().sum(), backend="fusionstitching")
    for rows in (8, 12, 5):
        x = torch.randn(rows, 16)
        w.grad = None
        f(x, w).backward()
        expected = torch.where(x * w.detach() > 0, x, 0).sum(0)
        torch.testing.assert_close(w.grad, expected)


def test_a_broadcast_output_keeps_its_strides():
    x = torch.randn(1, 5)
    out = _compiled(lambda x: x.expand(3, 5))(x)
    assert out.stride() == (0, 1)
    torch.testing.assert_close(out, x.expand(3, 5))
    out = _compiled(lambda x: (x * 2).expand(4, 2, 5))(x)
    torch.testing.assert_close(out, (x * 2).expand(4, 2, 5))


@pytest.mark.parametrize("fn, shapes", [
    (lambda x: x.sum(-1), [(0, 5)]),
    (lambda x: torch.softmax(x, -1), [(0, 5)]),
    (lambda x: torch.nn.functional.layer_norm(x, (5,)), [(0, 5)]),
    (lambda x: x.sum(0), [(8, 0)]),
    (lambda x: x.sum(1) * 2, [(8, 0)]),
    (lambda x: x.amax(1, keepdim=True) + 1, [(8, 0), ]),
    (lambda x: x.prod(1), [(3, 0)]),
    (lambda x, y: torch.cat([x, y]) * 2, [(0, 5), (3, 5)]),
    (lambda x, y: (x @ y).relu(), [(4, 0), (0, 5)]),
    (lambda x: torch.nn.functional.pad(x, (1, 1), value=3.0), [(3, 0)]),
])
def test_empty_tensors(fn, shapes):
    """Planning and scheduling divided by zero on tensors without elements."""
    args = [torch.randn(*s) for s in shapes]
    try:
        expected = fn(*args)
    except (RuntimeError, IndexError):  # eager rejects it (amax over an empty dim): so must we
        with pytest.raises((RuntimeError, IndexError)):
            _compiled(fn)(*args)
        return
    torch.testing.assert_close(_compiled(fn)(*args), expected)


@pytest.mark.parametrize("fn, args", [
    (lambda x, i: x.index_select(0, i) * 2, (torch.randn(5, 3), torch.tensor([1, 7]))),
    (lambda x, i: x.index_select(0, i) * 2, (torch.randn(5, 3), torch.tensor([1, -1]))),
    (lambda w, i: torch.nn.functional.embedding(i, w) + 1, (torch.randn(5, 3), torch.tensor([1, 2**32 + 1]))),
    (lambda x, i: x.gather(1, i) + 1, (torch.randn(5, 3), torch.tensor([[0], [3], [1], [1], [1]]))),
    (lambda x, i: x[i] + 1, (torch.randn(5, 3), torch.tensor([1, -7]))),
    (lambda x, i, j: x[i, j] * 2, (torch.randn(5, 5), torch.tensor([1, 0]), torch.tensor([5, 1]))),
    (lambda x, t: torch.nn.functional.cross_entropy(x, t), (torch.randn(5, 4), torch.tensor([0, 1, 2, 3, 4]))),
    # lowered as comparisons with positions, which an index out of range matched nowhere: dropped
    (lambda x, i: x.scatter(1, i, 5.0) * 2, (torch.zeros(3, 4), torch.tensor([[1], [7], [0]]))),
    (lambda x, i, v: torch.index_put(x, (i,), v, accumulate=True) * 1.0,
     (torch.zeros(5, 3), torch.tensor([0, -6]), torch.ones(2, 3))),
    # torch's one_hot asserts its class range (aten._assert_async): checked by a gather
    (lambda x, t: (torch.nn.functional.one_hot(t, 4) * x).sum(-1), (torch.randn(3, 4), torch.tensor([0, 4, 1]))),
    (lambda x, t: (torch.nn.functional.one_hot(t, 4) * x).sum(-1), (torch.randn(3, 4), torch.tensor([0, -1, 1]))),
])
def test_an_index_out_of_range_raises_as_in_eager(fn, args):
    """Indices were clamped: a bad token id or label read some valid row."""
    with pytest.raises((IndexError, RuntimeError)):
        fn(*args)
    with pytest.raises(IndexError, match="index out of range in"):
        _compiled(fn)(*args)


def test_one_hot_products_and_their_gradients_are_eagers():
    """``F.one_hot`` under TorchDynamo asserts its class range (``aten._assert_async``): the
    assertions become checks, and the products and the gradient through them are eager's."""
    fn = lambda x, t: (torch.nn.functional.one_hot(t, 5) * x).sum(-1) + x.mean(-1)
    x, t = torch.randn(6, 5, requires_grad=True), torch.tensor([0, 4, 2, 2, 1, 3])
    want = fn(x, t)
    want.sum().backward()
    expected, x.grad = x.grad.clone(), None
    got = _compiled(fn, strict=True)(x, t)
    got.sum().backward()
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(x.grad, expected)


def test_indices_in_range_and_negative_ones_where_torch_allows_them():
    x, i, j = torch.randn(5, 5), torch.tensor([1, 0]), torch.tensor([-1, 1])
    fn = lambda x, i, j: x[i, j] * 2
    torch.testing.assert_close(_compiled(fn)(x, i, j), fn(x, i, j))
    t = torch.tensor([0, 1, 2, -100, 3])
    ce = lambda x, t: torch.nn.functional.cross_entropy(x, t)
    logits = torch.randn(5, 4)
    torch.testing.assert_close(_compiled(ce)(logits, t), ce(logits, t))


def test_outputs_that_are_views_of_one_value_share_its_storage():
    def fn(x):
        y = x * 2
        return y, y.view(-1)

    a, b = _compiled(fn)(torch.randn(3, 4))
    assert a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
    torch.testing.assert_close(b, a.view(-1))


def test_a_lambda_captures_and_its_kernels_compile():
    """Kernels were named ``fs_<lambda>_...``, which NVRTC rejects."""
    from fusionstitching.pipeline import compile_graph

    captured = fusionstitching.capture(lambda x: x.exp() + 1, torch.randn(4, 4))
    compiled = compile_graph(captured.forward)
    for kernel in compiled.kernels:
        assert kernel.name.isidentifier()
        kernel.compile("sm_90")


def test_a_graph_name_is_no_path(tmp_path):
    from fusionstitching.pipeline import compile_graph, dump

    captured = fusionstitching.capture(lambda x: x.exp() + 1, torch.randn(4, 4))
    graph = captured.forward
    graph.name = "../../escape"
    for path in dump(compile_graph(graph), graph, tmp_path):
        assert tmp_path in path.resolve().parents


def _broken_split(graph, *args, **kwargs):
    """Stands for an internal error deep in planning, raised while a node is being handled."""
    for node in graph.nodes:
        if node.op == "mul":
            raise ZeroDivisionError("division by zero")
    raise AssertionError("no mul node")


def test_an_internal_error_falls_back_with_the_evidence(monkeypatch):
    explore = importlib.import_module("fusionstitching.fusion.explore")
    monkeypatch.setattr(explore, "split_underfilled_reductions", _broken_split)
    fn = lambda x: (x * 3).exp()
    x = torch.randn(4, 8)
    before = _fallbacks()
    with pytest.warns(fusionstitching.FallbackWarning) as record:
        out = _compiled(fn, strict=False)(x)
    torch.testing.assert_close(out, fn(x))
    assert _fallbacks() == before + 1
    message = str(record[0].message)
    for evidence in ("graph inference_", "node mul", "aten.mul.Tensor", "ZeroDivisionError", "fusion"):
        assert evidence in message, message


def test_strict_raises_the_same_evidence(monkeypatch):
    explore = importlib.import_module("fusionstitching.fusion.explore")
    monkeypatch.setattr(explore, "split_underfilled_reductions", _broken_split)
    with pytest.raises(Exception, match=r"(?s)CompileFailure.*node mul.*aten.mul.Tensor.*ZeroDivisionError"):
        _compiled(lambda x: (x * 3).exp(), strict=True)(torch.randn(4, 8))


def test_the_limit_counts_shape_classes_and_new_shapes_of_an_admitted_class_compile():
    """With a limit of one class, rows 9, 11 and 13 (one class: at most 16, odd) all compile; 16 rows
    (another class) run in PyTorch, announced once; 15 rows are of the first class again."""
    from fusionstitching.backend import reset_stats, stats

    torch._dynamo.reset()
    reset_stats()
    f = torch.compile(lambda x: x.sin() + 1, backend="fusionstitching", dynamic=True,
                      options={"max_specializations": 1, "strict": True})
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        for rows in (9, 11, 13, 16, 15):
            x = torch.randn(rows, 8)
            torch.testing.assert_close(f(x), x.sin() + 1)
    limit = [w for w in record if issubclass(w.category, fusionstitching.FallbackWarning)]
    assert len(limit) == 1 and "shape classes" in str(limit[0].message) and "max_specializations" in str(limit[0].message)
    assert stats()["compilations"] == 4


def test_two_threads_call_one_compiled_function_while_it_specializes():
    """A new shape was re-traced with make_fx, whose process-wide tracing flag made other threads'
    compiled calls fail meanwhile."""
    torch._dynamo.reset()
    f = torch.compile(lambda x: (x * 2).tanh().sum(-1), backend="fusionstitching", dynamic=True)
    f(torch.randn(3, 8))
    errors = []

    def hammer(seed: int) -> None:
        generator = torch.Generator().manual_seed(seed)
        try:
            for k in range(6):
                x = torch.randn(2 + (seed + k) % 5, 8, generator=generator)
                torch.testing.assert_close(f(x), (x * 2).tanh().sum(-1))
        except Exception as err:  # noqa: BLE001 -- reported below: pytest does not see a thread's exception
            errors.append(err)

    threads = [threading.Thread(target=hammer, args=(s,)) for s in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors


def test_the_backend_keeps_its_public_names():
    assert fusionstitching.Options().strict is False
    assert issubclass(fusionstitching.FallbackWarning, UserWarning)
    assert "fallbacks" in backend.stats() or backend.stats().get("fallbacks", 0) == 0


def test_concrete_example_inputs_of_a_graph_traced_with_symbolic_sizes():
    """AOTAutograd may hand a graph whose metadata holds symbolic sizes (a sequence length marked
    dynamic by an earlier compile) with concrete example inputs: the slice bounds were symbolic
    and the conversion failed (BERT at a second sequence length on a GPU)."""
    from torch.fx.experimental.proxy_tensor import make_fx

    def fn(x, n):
        return ((x[:, :n] * 2).sum(-1),)

    traced = make_fx(fn, tracing_mode="symbolic")(torch.randn(4, 16), 8)
    assert backend._symbolic_metadata(traced)
    x = torch.randn(4, 16)
    runner = backend._Runner(traced, [x, 8], "symbolic_metadata", fusionstitching.Options(strict=True))
    torch.testing.assert_close(runner([x, 8])[0], fn(x, 8)[0])
    torch.testing.assert_close(runner([x, 5])[0], fn(x, 5)[0])
    # torch 2.11's FakeTensorProp left a number input's metadata symbolic (``s53``), which made the
    # bound a tensor constant: every size in the concrete copy is a plain number
    concrete, _ = backend._concrete(traced, [x, 5])
    sizes = [n.meta["val"] for n in concrete.graph.nodes if not isinstance(n.meta.get("val"), torch.Tensor)
             and n.op != "output"]
    assert 5 in sizes and all(type(v) in (bool, int, float) for v in sizes), sizes


@pytest.mark.parametrize("fn", [
    lambda x: (x > 0.5).any(-1, keepdim=True) * (x * 2),
    lambda x: ((x > 0.5) | (x <= 0.5).all(-1, keepdim=True)).float(),
])
def test_bool_any_and_all_reductions(fn):
    """The butterfly's ``acc || shfl(...)`` skipped the shuffle where acc was already true, which a
    GPU answers with undefined values; the simulator now evaluates || and && as C does."""
    x = torch.rand(2, 4, 17, 17)
    before = _fallbacks()
    torch.testing.assert_close(_compiled(fn)(x), fn(x))
    assert _fallbacks() == before


def test_gradients_through_scaled_dot_product_attention_on_the_cpu():
    """The core-ATen decomposition of the CPU flash attention returned the probabilities where its
    log-sum-exp belongs; its backward read them as the log-sum-exp (gradients off by 1 to 25)."""
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 4, 16, 8, requires_grad=True) for _ in range(3))

    def fn(q, k, v):
        return (torch.nn.functional.scaled_dot_product_attention(q, k, v) * 2).sum()

    fn(q, k, v).backward()
    want = [t.grad.clone() for t in (q, k, v)]
    for t in (q, k, v):
        t.grad = None
    _compiled(fn)(q, k, v).backward()
    for t, expected in zip((q, k, v), want):
        torch.testing.assert_close(t.grad, expected, rtol=1e-4, atol=1e-5)


def _in_place_then_reduce(x):
    x.add_(1.0)
    return x + x, x.sum(-1, keepdim=True) * 3


@pytest.mark.parametrize("fn, shapes", [
    # a warp-composed reduction read through a broadcast, a concatenate, a gather: each warp read its
    # own register, which reduced another row (the size-1 dim's only element was assumed shared)
    (lambda x: x.sum(1, keepdim=True).expand(4, 1) + 1, [(1, 3)]),
    (lambda x: torch.cat([x.mean(1, keepdim=True)] * 2, 0), [(1, 3)]),
    (lambda x: torch.index_select(x.softmax(0), 1, torch.tensor([0, 0])), [(1, 1)]),
    # an in-place update read again, updated, by a later group of the same kernel
    (_in_place_then_reduce, [(1, 1)]),
    (_in_place_then_reduce, [(8, 33)]),
    # crashes: a cat of pieces all empty along the cat dim, a transpose whose every dim is a batch
    # dim, a concatenation of 248 pieces (nested guards exhausted the recursion limit)
    (lambda x: torch.cat([x, x], dim=0) + 1, [(0, 1)]),
    (lambda a, b: torch.matmul(torch.expm1(a), b).t() * 2, [(1, 1), (1, 1)]),
    (lambda x: torch.stack(list(x.unbind(1)), 0) * 2, [(4, 248)]),
    # a reduction over a size-1 dim in a register body tiled for a scalar reduction: its output index
    # was the iteration space's first dim, so every thread stored element 0
    (lambda x: (x.amin(), torch.amax(x, dim=-2)), [(1, 750)]),
    (lambda x: torch.cat([torch.nn.functional.layer_norm(x, (1, 256)).std(0, keepdim=True)] * 2, -1), [(1, 256)]),
])
def test_programs_the_fuzzer_found(fn, shapes):
    args = [torch.randn(*s) for s in shapes]
    want = fn(*[a.clone() for a in args])
    got = _compiled(fn)(*[a.clone() for a in args])
    torch.testing.assert_close(got, want, equal_nan=True)


def test_the_gradient_of_a_one_by_one_matmul():
    a, b = torch.randn(1, 1, requires_grad=True), torch.randn(1, 1, requires_grad=True)
    _compiled(lambda a, b: torch.matmul(torch.expm1(a), b))(a, b).sum().backward()
    torch.testing.assert_close(a.grad, (torch.exp(a) * b).detach())


def test_capture_of_a_broadcast_input():
    """capture cloned an expanded input into an overlapping tensor."""
    x = torch.randn(3, 1).expand(3, 4)
    captured = fusionstitching.capture(lambda x: x * 2, x)
    assert captured.forward.parameters[0].layout.strides == (1, 0)


def test_compile_takes_options_and_a_mode():
    """torch.compile refuses options and mode together; fusionstitching.compile passes both."""
    torch._dynamo.reset()
    f = fusionstitching.compile(lambda x: x * 2 + 1, fusionstitching.Options(strict=True), mode="reduce-overhead")
    x = torch.randn(5)
    for _ in range(3):
        torch.testing.assert_close(f(x), x * 2 + 1)


def test_sign_of_nan_is_zero_as_in_torch():
    """torch's sign is (0 < x) - (x < 0): the std of one element (NaN) has sign 0, not NaN."""
    x = torch.tensor([float("nan"), 1.5, -2.0, 0.0])
    torch.testing.assert_close(_compiled(lambda x: torch.sign(x) * 2)(x), torch.sign(x) * 2)
    y = torch.randn(1, 40).to(torch.bfloat16)
    fn = lambda y: torch.sign(y.std(dim=0, correction=1, keepdim=True))
    torch.testing.assert_close(_compiled(fn)(y), fn(y))


def test_a_tail_group_of_a_register_body_loads_only_where_its_elements_exist():
    """The gradient of x2 in ``x1 / (x2.abs() + 1)`` with rows of exactly one warp: the [4, 1] group
    was tiled CTA_32 and loaded x2 at warp + lane before its tail guard (out of bounds on a GPU)."""
    x1, x2 = torch.randn(4, 32, requires_grad=True), torch.randn(4, 1, requires_grad=True)
    _compiled(lambda a, b: a / (b.abs() + 1))(x1, x2).sum().backward()
    g1, g2 = x1.grad, x2.grad
    x1.grad = x2.grad = None
    (x1 / (x2.abs() + 1)).sum().backward()
    torch.testing.assert_close(g1, x1.grad)
    torch.testing.assert_close(g2, x2.grad)


@pytest.mark.parametrize("n", [257, 1000])
def test_layer_norm_of_rows_of_equal_values_is_zero(n):
    """A constant row's mean came out a few ulps off its value (the sum rounds), and layer_norm
    divides that by sqrt(eps): 0.07 where eager (a Welford reduction) gives 0. The mean of the row
    shifted by its first element is exact."""
    rows = torch.randn(3, 1).mul(40).expand(3, n).contiguous()
    weight = torch.randn(n)
    fn = lambda x, w: (torch.nn.functional.layer_norm(x, (n,), w), torch.var_mean(x, -1))
    got, want = _compiled(fn)(rows, weight), fn(rows, weight)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1][0], torch.zeros(3))
    torch.testing.assert_close(got[1][1], want[1][1], rtol=0, atol=0)


def test_non_finite_values_of_an_accumulating_index_put_stay_in_their_rows():
    """The one-hot product spread a NaN or an infinity of one value row to every target row
    (0 * inf); eager's scatter-add touches only the rows it indexes."""
    fn = lambda x, i, v: torch.index_put(x, (i,), v, accumulate=True) * 1.0
    x, i, v = torch.randn(5, 3), torch.tensor([0, 2, 2, 4, 4, 1]), torch.randn(6, 3)
    v[1, 0], v[3, 1], v[4, 2] = float("nan"), float("inf"), float("-inf")
    v[5, 1], v[5, 2] = float("inf"), float("-inf")
    torch.testing.assert_close(_compiled(fn)(x, i, v), fn(x, i, v), equal_nan=True)
    # a table of two rows (a masked sum, not a one-hot product): +inf and -inf meet in one cell
    x, i, v = torch.randn(2, 3), torch.tensor([0, 0, 1]), torch.randn(3, 3)
    v[0, 0], v[1, 0], v[2, 2] = float("inf"), float("-inf"), float("nan")
    got = _compiled(fn)(x, i, v)
    assert got[0, 0].isnan() and got[1, 2].isnan() and got.isfinite().sum() == 4
    torch.testing.assert_close(got, fn(x, i, v), equal_nan=True)
    weight = torch.randn(10, 4, requires_grad=True)
    index, scale = torch.tensor([[1, 3], [3, 7]]), torch.ones(2, 2, 4)
    scale[0, 0, 0] = float("nan")
    loss = lambda w, i, s: (torch.nn.functional.embedding(i, w) * s).sum()
    loss(weight, index, scale).backward()
    want, weight.grad = weight.grad, None
    _compiled(loss)(weight, index, scale).backward()
    torch.testing.assert_close(weight.grad, want, equal_nan=True)


@pytest.mark.parametrize("fn, args", [
    (lambda w, i: torch.nn.functional.embedding(i, w)[:, 0] * 2,
     (torch.randn(10, 4), torch.tensor([[1, 3, 12], [3, 7, 2]]))),
    (lambda x, i, j: torch.gather(torch.gather(x, 1, i), 1, j) + 1,
     (torch.randn(3, 5), torch.tensor([[0, 9], [1, 1], [2, 2]]), torch.tensor([[0], [0], [0]]))),
    # read only by an empty tensor, which fold_empty made a constant (fuzz 1126401:2263)
    (lambda x, i: x[i].unsqueeze(2).expand(1, 1, 0), (torch.randn(1, 1), torch.tensor([1], dtype=torch.int32))),
])
def test_an_out_of_range_index_that_nothing_reads_raises_as_in_eager(fn, args):
    """Kernels check an index where they gather its element: one at a position no output reads
    (the first token's embedding, a gather of a gather) went unchecked."""
    with pytest.raises((IndexError, RuntimeError)):
        fn(*args)
    with pytest.raises(IndexError, match="index out of range"):
        _compiled(fn)(*args)


def test_index_add_with_a_source_of_the_wrong_shape_raises_as_in_eager():
    """torch's decomposition of index_add, which capture applies, skips eager's shape check: a source
    of one row was broadcast into every indexed row."""
    fn = lambda x, i, s: x.index_add(0, i, s) * 2
    args = (torch.zeros(3, 2), torch.tensor([0, 2]), torch.ones(2))
    message = r"source tensor shape must match self tensor shape, excluding the specified dimension"
    with pytest.raises(RuntimeError, match=message):
        fn(*args)
    with pytest.raises(RuntimeError, match=message):
        _compiled(fn, strict=True)(*args)
    good = (torch.zeros(3, 2), torch.tensor([0, 2]), torch.ones(2, 2))
    torch.testing.assert_close(_compiled(fn, strict=True)(*good), fn(*good))


def test_a_library_op_meets_the_users_error_as_eager_raises_it():
    """A scatter with two indices per row is a library call; torch's own check of its index was
    reported under strict as an internal CompileFailure of the first run."""
    fn = lambda x, i, s: x.scatter(0, i, s) * 2
    args = (torch.zeros(3, 5), torch.tensor([[0, 34], [1, 2]]), torch.ones(2, 5))
    with pytest.raises(RuntimeError, match="index 34 is out of bounds") as eager:
        fn(*args)
    with pytest.raises(RuntimeError, match="index 34 is out of bounds") as compiled:
        _compiled(fn, strict=True)(*args)
    assert type(compiled.value) is type(eager.value), compiled.value


def test_an_internal_error_of_a_first_run_is_still_a_compile_failure(monkeypatch):
    """The first run of a specialization compares its error with the graph's in PyTorch: one that
    eager does not raise stays the compiler's."""
    executor = importlib.import_module("fusionstitching.runtime.executor")

    def broken(self, tensors):
        raise RuntimeError("index 1 is out of bounds for dimension 0 with size 1")

    monkeypatch.setattr(executor.CompiledGraph, "_call_on_cpu", broken)
    fn = lambda x: (x * 3).exp()
    with pytest.raises(backend.CompileFailure, match="run: RuntimeError: index 1 is out of bounds"):
        _compiled(fn, strict=True)(torch.randn(4, 8))
    x = torch.randn(4, 8)
    with pytest.warns(fusionstitching.FallbackWarning, match="index 1 is out of bounds"):
        torch.testing.assert_close(_compiled(fn, strict=False)(x), fn(x))


def _read_then_update(x1, x2, x3):
    v2 = torch.minimum(x2, x1.to(torch.int64).unsqueeze(2))
    x2.add_(1)
    return torch.index_select(v2, 1, x3), v2.amin(-2)


def test_a_kernel_reading_an_input_runs_before_the_kernel_updating_it_in_place():
    """The in-place add ran before the kernel reading x2's old value (a GPU fault; the simulator now
    lets an in-place update replace the input's value, as on a GPU, so the CPU sees it too)."""
    args = (torch.randn(4, 31), torch.tensor([-8]), torch.randint(0, 31, (23,)))
    want = _read_then_update(*[a.clone() for a in args])
    got_args = [a.clone() for a in args]
    got = _compiled(_read_then_update, generators=("dp", "merging", "packing", "remote"))(*got_args)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w)
    torch.testing.assert_close(got_args[1], args[1] + 1)


def test_a_reduction_across_warps_beside_a_padded_shared_tile():
    """The warps' partial sums were written at the padded index of a shared tile (rows of 64 cells
    take 65) and read back unpadded: past the end of the buffer (an out-of-bounds shared store on a
    GPU) and from the wrong slots."""
    fn = lambda x0, x2: (x0.mean(1).std(correction=0), torch.gather(x0, 2, x2), torch.amax(x2, dim=(0, 2)))
    generator = torch.Generator().manual_seed(0)
    x0, x2 = torch.randn(11, 2, 64, generator=generator), torch.randint(0, 64, (11, 2, 31), generator=generator)
    for got, want in zip(_compiled(fn, solver="beam", generators=("substitution", "merging", "packing"))(x0, x2),
                         fn(x0, x2)):
        torch.testing.assert_close(got, want)


def test_a_library_ops_user_error_after_the_first_call_is_eagers_error():
    """After the first call, torch's own error of a library op on the CPU arrived wrapped in the
    reference's EvaluationError (a ValueError)."""
    fn = lambda x, i, s: x.scatter(0, i, s) * 2
    compiled = _compiled(fn)
    compiled(torch.zeros(3, 5), torch.tensor([[0, 1], [1, 2]]), torch.ones(2, 5))
    with pytest.raises(RuntimeError, match="index 34 is out of bounds") as raised:
        compiled(torch.zeros(3, 5), torch.tensor([[0, 34], [1, 2]]), torch.ones(2, 5))
    assert type(raised.value) is RuntimeError


def test_the_decomposition_table_does_not_depend_on_what_was_imported():
    """The foreach decompositions were read from ``dir(torch.ops.aten)`` (the ops looked up so far)
    and other namespaces' decompositions came with their modules: importing Inductor changed the
    table, so one program could lower differently in two processes (and docs/opinfo.md's
    fingerprint went stale inside the test suite)."""
    from fusionstitching.frontend.torch_fx import decompositions

    before = {str(k) for k in decompositions()}
    import torch._inductor.compile_fx  # noqa: F401 - registers decompositions and looks up ops

    assert {str(k) for k in decompositions()} == before
    assert "aten._foreach_copy.default" in before


@pytest.mark.parametrize("generators", [("substitution",), ("dp", "remote")])
def test_the_gradient_of_amin_of_a_softmax_is_finite(generators):
    """amin's gradient goes to the elements equal to the saved minimum. The partitioner recomputed the
    softmax in the backward, where a kernel summed in another order: no element was equal, and the
    gradient was 0/0 (fuzz 1126102:2440). Such a value is now saved."""
    def fn(x):
        flat = x.reshape(8, 2)
        return flat / (flat.abs() + 1), torch.amin(torch.softmax(x, dim=1), dim=1, keepdim=True)

    x = torch.randn(2, 4, 2, generator=torch.Generator().manual_seed(56239698062651))
    eager_x, ours_x = x.clone().requires_grad_(), x.clone().requires_grad_()
    seed = torch.Generator().manual_seed(196979344768151)
    tangents = [torch.randn(8, 2, generator=seed), torch.randn(2, 1, 2, generator=seed)]
    torch.autograd.backward(fn(eager_x), tangents)
    torch.autograd.backward(_compiled(fn, solver="ilp", generators=generators)(ours_x), tangents)
    torch.testing.assert_close(ours_x.grad, eager_x.grad, rtol=1e-4, atol=1e-5)


def test_float_floor_division_is_torchs():
    """floor(a * (1/b)) is one off where a / b lands on or near an integer (2.5 // 0.1 is 24 in torch,
    25 that way): found by the OpInfo GPU run in bf16 (floor_divide, div(rounding_mode="floor") and
    remainder's gradient). Signed zeros and zero divisors as in torch."""
    a = torch.tensor([2.5, -1.7, 4.9, 2.4, -3.4, 0.0, -0.0, 1.0, -1.0, 0.0, 7.0, -7.0, 0.3])
    b = torch.tensor([0.1, 0.1, -0.1, -0.8, 0.2, 3.0, 3.0, 0.0, 0.0, 0.0, 2.0, 2.0, -5.0])
    for fn in (torch.floor_divide, lambda x, y: torch.div(x, y, rounding_mode="floor")):
        got, want = _compiled(fn)(a, b), fn(a, b)
        torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True)
        assert torch.equal(torch.signbit(got), torch.signbit(want))
    x, y = a.clone().requires_grad_(), (b + 0.5).requires_grad_()
    torch.remainder(x, y).sum().backward()
    want = y.grad.clone()
    y.grad = None
    _compiled(lambda p, q: torch.remainder(p, q).sum())(x.detach(), y).backward()
    torch.testing.assert_close(y.grad, want)


def _on(device: str):
    """A fake tensor on ``device`` (fake tensors claim a GPU without one)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        return torch.empty(4, 6, device=device)


def _traced_on(function, devices: dict[str, str]):
    """``function`` as an FX graph whose nodes hold fake values on ``devices`` (by node name), and
    its inputs' values."""
    gm = function if isinstance(function, torch.fx.GraphModule) else torch.fx.symbolic_trace(function)
    for node in gm.graph.nodes:
        if node.name in devices:
            node.meta["val"] = _on(devices[node.name])
    return gm, [node.meta["val"] for node in gm.graph.nodes if node.op == "placeholder"]


def _factory_only():
    """``torch.ones(3) * 2`` as ATen: symbolic tracing would fold a graph without inputs."""
    graph = torch.fx.Graph()
    ones = graph.call_function(torch.ops.aten.ones.default, ([3],))
    graph.output((graph.call_function(torch.ops.aten.mul.Tensor, (ones, 2)),))
    return torch.fx.GraphModule({}, graph)


@pytest.mark.parametrize("function, devices, runs_on, outputs", [
    (_factory_only(), {"ones_default": "cuda:0", "mul_tensor": "cuda:0"}, "cuda:0", ["cuda:0"]),
    (lambda x: (x.to("cuda") + 1,), {"x": "cpu", "to": "cuda:0", "add": "cuda:0"}, "cuda:0", ["cuda:0"]),
    (lambda x: ((x * 2).to("cpu"), x - 1), {"x": "cuda:0", "mul": "cuda:0", "to": "cpu", "sub": "cuda:0"},
     "cuda:0", ["cpu", "cuda:0"]),
    (lambda x: (x + torch.arange(6),), {"x": "cpu", "arange": "cpu", "add": "cpu"}, "cpu", ["cpu"]),
])
def test_a_graph_runs_where_its_tensors_are_and_each_output_goes_where_eager_puts_it(
        function, devices, runs_on, outputs):
    """Values carried no device: ``torch.ones(3, device="cuda")`` alone ran on the host, and
    ``x.cpu()`` or ``x.cuda()`` inside a graph was ignored (26 OpInfo factory ops on a GPU)."""
    gm, inputs = _traced_on(function, devices)
    device, output_devices = backend._devices(gm, inputs)
    assert str(device) == runs_on and [str(d) for d in output_devices] == outputs


def test_a_graph_on_two_gpus_is_not_taken():
    from fusionstitching.frontend.context import Unsupported

    gm, inputs = _traced_on(lambda x: (x.to("cuda:1") + 1,), {"x": "cuda:0", "to": "cuda:1", "add": "cuda:1"})
    with pytest.raises(Unsupported, match="several GPUs"):
        backend._devices(gm, inputs)
