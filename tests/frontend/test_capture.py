"""Capture of the workloads and of single ATen ops, checked with graph/reference.py against eager."""

from __future__ import annotations

import math
import warnings

import numpy as np
import pytest
import torch

from fusionstitching import capture
from fusionstitching.bench.check import check_against_eager, forward_arrays, to_numpy
from fusionstitching.bench.workloads import WORKLOADS, dropout, make
from fusionstitching.cli import rows_for
from fusionstitching.frontend.torch_fx import LibraryFallbackWarning
from fusionstitching.graph import reference
from fusionstitching.graph.ops import Category, DType
from fusionstitching.graph.serialize import from_json

F32_TOLERANCE = 1e-5


def _capture_quietly(fn, *inputs, train=False):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        captured = capture(fn, *inputs, train=train)
    fallbacks = [w for w in caught if issubclass(w.category, LibraryFallbackWarning)]
    return captured, fallbacks


# Ops the model workloads keep as library calls: by design (convolutions and attention run in
# cuDNN/cuBLAS kernels), and those not lowered yet, named so that a new one fails the test.
LIBRARY_BY_DESIGN = {"aten.convolution.default", "aten.convolution_backward.default",
                     "aten._scaled_dot_product_flash_attention_for_cpu.default",
                     "aten._scaled_dot_product_flash_attention_for_cpu_backward.default"}
NOT_LOWERED_YET: dict[str, set[str]] = {}


@pytest.mark.parametrize("name", list(WORKLOADS))
def test_workload_captures_without_library_nodes_and_matches_eager(name, capture_table):
    workload = make(name)
    captured, fallbacks = _capture_quietly(workload.fn, *workload.inputs, train=workload.train)
    allowed = LIBRARY_BY_DESIGN | NOT_LOWERED_YET.get(name, set())
    assert {str(w.message).split(" ")[0] for w in fallbacks} <= allowed
    assert set(captured.library_ops) <= allowed
    for graph in (captured.forward, captured.backward):
        if graph is not None:
            assert {n.attrs["target"] for n in graph.nodes if n.category == Category.LIBRARY} <= allowed
    assert (captured.backward is not None) == workload.train
    errors = check_against_eager(captured, workload.fn, workload.inputs, workload.train)
    assert errors.forward or errors.mutations
    assert errors.worst < F32_TOLERANCE, errors
    if workload.train:
        assert errors.backward and max(errors.backward) < F32_TOLERANCE
    capture_table.extend(rows_for(name, captured))


def test_parameter_order_follows_module_state_then_inputs():
    workload = make("layernorm_train")
    captured, _ = _capture_quietly(workload.fn, *workload.inputs, train=True)
    assert captured.parameter_names == ["weight", "bias", "input0"]
    assert [p.name for p in captured.forward.parameters] == ["weight", "bias", "input0"]
    # Backward: saved tensors, then one tangent; one gradient per forward parameter.
    assert len(captured.backward.parameters) == captured.num_saved + 1
    assert len(captured.backward.outputs) == 3
    assert captured.forward.outputs[0].shape == (16, 64)


def test_gradient_of_integer_input_is_none():
    workload = make("mlp_train")
    captured, _ = _capture_quietly(workload.fn, *workload.inputs, train=True)
    names = captured.parameter_names
    grads = dict(zip(names, captured.backward.outputs))
    assert grads["input1"] is None  # integer targets
    assert grads["input0"] is None  # features do not require grad
    assert grads["fc1.weight".replace(".", "_")] is not None


def test_adam_step_in_place_updates_are_mutations():
    workload = make("adam_step")
    captured, _ = _capture_quietly(workload.fn, *workload.inputs)
    graph = captured.forward
    n = len(workload.inputs) // 4
    params = set(range(n)) | set(range(2 * n, 4 * n))  # parameters, first and second moments
    assert sorted(graph.mutations.values()) == sorted(params)
    assert captured.num_user_outputs == 0
    before = [x.clone() for x in workload.inputs]
    errors = check_against_eager(captured, workload.fn, workload.inputs, False)
    assert len(errors.mutations) == 3 * n and errors.worst < F32_TOLERANCE
    assert all(torch.equal(a, b) for a, b in zip(before, workload.inputs)), "capture or check wrote into inputs"


def test_transposed_input_is_read_in_place_without_copy():
    base = torch.randn(6, 4)
    x = base.t()  # (4, 6) with strides (1, 4)

    def fn(x, bias):
        return torch.tanh(x * 2.0 + bias)

    bias = torch.randn(6)
    captured, _ = _capture_quietly(fn, x, bias)
    graph = captured.forward
    param = graph.parameters[0]
    assert param.shape == (4, 6) and param.layout.strides == (1, 4)
    assert not [n for n in graph.nodes if n.op in ("copy", "transpose", "library")]
    got = reference.evaluate(graph, [to_numpy(x), to_numpy(bias)])[0]
    np.testing.assert_allclose(got, fn(x, bias).numpy(), rtol=1e-6)


def test_offset_view_input_keeps_storage_offset():
    base = torch.randn(10, 8)
    x = base[2:6, 1:5]
    captured, _ = _capture_quietly(lambda x: x.exp(), x)
    layout = captured.forward.parameters[0].layout
    assert layout.strides == (8, 1) and layout.offset == 17


def test_output_layout_follows_torch():
    captured, _ = _capture_quietly(lambda x: (x + 1).t(), torch.randn(3, 5))
    assert captured.forward.outputs[0].shape == (5, 3)
    assert captured.forward.output_layouts[0].strides == (1, 5)


def test_type_promotion_inserts_converts_and_scalars_do_not_promote():
    def fn(h, f, i):
        return h + f, h * 2.5, i * 0.5, (i + 1)

    h = torch.randn(8).half()
    f = torch.randn(8)
    i = torch.arange(8)
    captured, _ = _capture_quietly(fn, h, f, i)
    graph = captured.forward
    outs = graph.outputs
    assert [o.dtype for o in outs] == [DType.F32, DType.F16, DType.F32, DType.I64]
    converts = [n for n in graph.nodes if n.op == "convert"]
    assert {(c.operands[0].dtype, c.dtype) for c in converts} >= {(DType.F16, DType.F32), (DType.I64, DType.F32)}
    got = reference.evaluate(graph, [to_numpy(h), to_numpy(f), to_numpy(i)])
    for g, want in zip(got, fn(h, f, i)):
        np.testing.assert_allclose(g.astype(np.float64), want.double().numpy(), rtol=1e-3)


def test_unsupported_op_becomes_library_node_with_one_warning():
    def fn(x):
        return torch.cummax(x, 0).values + torch.cummax(x * 2, 0).values

    x = torch.randn(5, 3)
    captured, fallbacks = _capture_quietly(fn, x)
    assert len(fallbacks) == 1 and "aten.cummax.default" in str(fallbacks[0].message)
    library = [n for n in captured.forward.nodes if n.op == "library"]
    assert len(library) == 2 and captured.library_ops == ["aten.cummax.default"]
    got = reference.evaluate(captured.forward, [to_numpy(x)])[0]
    np.testing.assert_allclose(got, fn(x).numpy(), rtol=1e-6)
    # The library node survives the JSON round trip and still evaluates.
    again = from_json(captured.forward.to_json())
    np.testing.assert_allclose(reference.evaluate(again, [to_numpy(x)])[0], got)


def test_dropout_mask_statistics_and_fresh_masks():
    workload = dropout()
    p = workload.extra["p"]
    captured, _ = _capture_quietly(workload.fn, *workload.inputs)
    graph = captured.forward
    seed_param, offset_param = graph.parameters[-2:]
    assert (seed_param.name, offset_param.name) == ("rng_seed", "rng_offset")
    assert seed_param.dtype == DType.I64 and seed_param.shape == ()
    n = workload.inputs[0].numel()
    first = reference.evaluate(graph, forward_arrays(captured, workload.fn, workload.inputs, seed=7, offset=0))[0]
    second = reference.evaluate(graph, forward_arrays(captured, workload.fn, workload.inputs, seed=7, offset=1))[0]
    for out in (first, second):
        kept = out != 0
        assert np.allclose(out[kept], 1 / (1 - p))
        sigma = math.sqrt(p * (1 - p) / n)
        assert abs(kept.mean() - (1 - p)) < 3 * sigma
    assert np.any((first != 0) != (second != 0)), "two calls gave the same mask"
    repeat = reference.evaluate(graph, forward_arrays(captured, workload.fn, workload.inputs, seed=7, offset=0))[0]
    np.testing.assert_array_equal(first, repeat)


def test_dropout_in_training_saves_the_mask_for_backward():
    def fn(x):
        return torch.nn.functional.dropout(x, 0.5, training=True) * 3

    x = torch.randn(64, requires_grad=True)
    captured, _ = _capture_quietly(fn, x, train=True)
    assert not [n for n in captured.backward.nodes if n.op == "rng_uniform"]
    assert [n for n in captured.forward.nodes if n.op == "rng_uniform"]
    out = reference.evaluate(captured.forward, [to_numpy(x.detach()), np.int64(1), np.int64(2)])
    saved = out[1 : 1 + captured.num_saved]
    tangent = np.ones(64, np.float32)
    (grad,) = reference.evaluate(captured.backward, saved + [tangent])
    np.testing.assert_allclose(grad, np.where(out[0] != 0, 6.0, 0.0), rtol=1e-6)


def test_bert_capture_with_dropout_draws_random_numbers():
    workload = make("bert", dropout=0.1, train=True)
    captured, fallbacks = _capture_quietly(workload.fn, *workload.inputs, train=True)
    assert not fallbacks
    assert sum(n.op == "rng_uniform" for n in captured.forward.nodes) >= 5
    assert captured.forward.parameters[-1].name == "rng_offset"


@pytest.mark.parametrize("name", ["bert_train", "adam_step"])
def test_captured_graphs_round_trip_through_json(name):
    workload = make(name)
    captured, _ = _capture_quietly(workload.fn, *workload.inputs, train=workload.train)
    for graph in (captured.forward, captured.backward):
        if graph is None:
            continue
        again = from_json(graph.to_json())
        assert str(again) == str(graph)
        assert again.to_json() == graph.to_json()
    arrays = forward_arrays(captured, workload.fn, workload.inputs)
    for a, b in zip(reference.evaluate(captured.forward, arrays),
                    reference.evaluate(from_json(captured.forward.to_json()), arrays)):
        np.testing.assert_array_equal(a, b)


class _TableOnALaterDim(torch.nn.Module):
    """A bias table read through an index on its second dim, as LeViT's attention biases are."""

    def __init__(self, heads: int, offsets: int, dims: int = 2) -> None:
        super().__init__()
        self.table = torch.nn.Parameter(torch.randn(heads, offsets, *([3] * (dims - 2))))

    def forward(self, x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        bias = self.table[:, index]
        return x * bias if bias.dim() == x.dim() else x * bias.sum(-1)


@pytest.mark.parametrize("dims, index", [(2, torch.tensor([[0, 3, 9, 3], [1, 1, 2, 9]])),
                                         (3, torch.tensor([[-1, 3], [4, -10]]))])
def test_gradient_of_a_table_indexed_on_a_later_dim_is_lowered(dims, index):
    """``table[:, index]``'s gradient (``index_put`` with the index on dim 1) is the one-hot product
    with the indexed dim moved to the front, not a library call; negative indices wrap."""
    torch.manual_seed(0)
    module = _TableOnALaterDim(4, 10, dims)
    x = torch.randn(4, *index.shape)
    captured, fallbacks = _capture_quietly(module, x, index, train=True)
    assert not [n for g in (captured.forward, captured.backward) for n in g.nodes if n.category == Category.LIBRARY]
    assert not fallbacks
    errors = check_against_eager(captured, module, (x, index), train=True)
    assert max(errors.forward) < 1e-6 and max(errors.backward) < 1e-6


def test_an_accumulating_put_on_a_later_dim_checks_its_indices_as_eager_does():
    def fn(x, i, v):
        return torch.ops.aten.index_put(x, [None, i], v, accumulate=True) * 1.0

    x, v = torch.randn(3, 5), torch.randn(3, 4)
    torch._dynamo.reset()
    compiled = torch.compile(fn, backend="fusionstitching")
    inside = torch.tensor([0, 4, -5, 2])
    torch.testing.assert_close(compiled(x, inside, v), fn(x, inside, v))
    with pytest.raises(IndexError):
        fn(x, torch.tensor([0, 5, 1, 2], dtype=torch.long), v)
    with pytest.raises(IndexError, match="index_put"):
        compiled(x, torch.tensor([0, 5, 1, 2]), v)


def test_large_embedding_gradients_are_a_scatter_add_not_a_one_hot_gemm():
    from fusionstitching.frontend.aten_table import ONE_HOT_MAX_ROWS

    for rows, library in ((ONE_HOT_MAX_ROWS, False), (ONE_HOT_MAX_ROWS + 1, True)):
        table = torch.nn.Embedding(rows, 8)
        ids = torch.tensor([[0, 3, rows - 1, 3]])
        captured, fallbacks = _capture_quietly(table, ids, train=True)
        ops = [n for n in captured.backward.nodes if n.category == Category.LIBRARY]
        dots = [n for n in captured.backward.nodes if n.op == "dot_general"]
        assert (len(ops) == 1 and not dots) if library else (not ops and len(dots) == 1), rows
        assert bool(fallbacks) == library  # the library call is announced
        errors = check_against_eager(captured, table, (ids,), train=True)
        assert max(errors.backward) < 1e-6
