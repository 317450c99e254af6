"""Library calls written out from their templates (``runtime/library_call.py``): the op gets the
arguments the template says, operands laid out as traced, constant parts built once."""

from __future__ import annotations

import pytest
import torch

from fusionstitching.graph.layout import TO_NCHW, TO_NHWC
from fusionstitching.runtime.library_call import _written, library_function


class Recording:
    """A target that records what it was called with and returns ``result``."""

    def __init__(self, result=None) -> None:
        self.calls = []
        self.result = result

    def __call__(self, *args, **kwargs):
        self.calls.append((args, kwargs, torch.is_grad_enabled()))
        return self.result


def test_operands_are_placed_and_constants_shared():
    template = [{"operand": 1, "permute": list(TO_NCHW), "strides": [48, 1, 16, 4]},
                {"operand": 0, "strides": [3, 1]}, [1, 1], [0, 0], False, {"dtype": "bf16"}, None, 2.5, 2**40]
    target = Recording()
    call = library_function({"args": template, "kwargs": {}}, target, 2)
    nhwc = torch.arange(96.0).reshape(2, 3, 4, 4)
    strided = torch.arange(6.0).reshape(3, 2).t()  # [2, 3] with strides (1, 2): copied as traced
    call(strided, nhwc)
    call(strided, nhwc)
    (first, _, _), (second, _, _) = target.calls
    assert first[0].shape == (2, 4, 3, 4) and first[0].stride() == (48, 1, 16, 4)
    assert first[0].data_ptr() == nhwc.data_ptr()  # a view, not a copy
    assert first[1].stride() == (3, 1) and torch.equal(first[1], strided)
    assert list(first[2:]) == [[1, 1], [0, 0], False, torch.bfloat16, None, 2.5, 2**40]
    assert first[2] is second[2]  # built once


def test_raw_operands_keywords_and_nested_operands():
    target = Recording()
    x = torch.ones(2, 2).t()
    y = torch.zeros(3)
    call = library_function({"args": [[{"operand": 1}, {"operand": 1}]],
                             "kwargs": {"dim": [1], "keepdim": True, "out_dtype": {"dtype": "f32"},
                                        "pair": ({"operand": 1}, 3)}}, target, 2)
    call(x, y)
    (args, kwargs, _), = target.calls
    assert args[0][0] is y and args[0][1] is y
    assert kwargs == {"dim": [1], "keepdim": True, "out_dtype": torch.float32, "pair": (y, 3)}
    put = Recording()
    fill = library_function({"args": [{"operand": 0, "strides": [2, 1]}, {"operand": 1}]}, put, 2, fill=0.0)
    fill(x, y)
    (args, _, _), = put.calls
    assert args[0].shape == x.shape and args[0].dtype == x.dtype and bool((args[0] == 0).all())
    assert args[0] is not x and args[1] is y


def test_results_are_permuted_and_indexed_as_the_node_says():
    nchw = torch.arange(24.0).reshape(1, 2, 3, 4)
    target = Recording((nchw, torch.ones(2), nchw))
    call = {"args": [{"operand": 0}], "permute_result": list(TO_NHWC)}
    whole = library_function(call, target, 1)(nchw)
    assert whole[0].shape == (1, 3, 4, 2) and whole[1].shape == (2,)
    assert library_function(call, target, 1, index=1)(nchw).shape == (2,)
    pair = library_function(call, target, 1, index=0, siblings=[0, 2])(nchw)
    assert [t.shape for t in pair] == [(1, 3, 4, 2), (1, 3, 4, 2)]


def test_the_op_runs_without_autograd_history():
    target = Recording()
    call = library_function({"args": [{"operand": 0}]}, target, 1)
    with torch.enable_grad():
        call(torch.ones(1))
    with torch.no_grad():
        call(torch.ones(1))
    assert [grad for _, _, grad in target.calls] == [False, False]


def test_the_source_builds_only_operands():
    template = [{"operand": 0, "permute": list(TO_NCHW), "strides": [48, 1, 16, 4]}, None, [1, 1], False, 1]
    _, source = _written({"args": template}, torch.ops.aten.convolution.default, 1, -1, (), None)
    body = source.splitlines()[1:]
    assert sum("permute" in line for line in body) == 1 and not any("[1, 1]" in line for line in body)
    assert "_target(o0, None, _c" in source and ", False, 1)" in source


def test_a_convolution_through_its_template_matches_eager():
    x = torch.randn(2, 3, 8, 8).to(memory_format=torch.channels_last)
    w = torch.randn(4, 3, 3, 3).to(memory_format=torch.channels_last)
    call = {"args": [{"operand": 0, "permute": list(TO_NCHW), "strides": list(x.stride())},
                     {"operand": 1, "permute": list(TO_NCHW), "strides": list(w.stride())},
                     None, [1, 1], [1, 1], [1, 1], False, [0, 0], 1],
            "kwargs": {}, "permute_result": list(TO_NHWC)}
    conv = library_function(call, torch.ops.aten.convolution.default, 2)
    got = conv(x.permute(TO_NHWC), w.permute(TO_NHWC))
    want = torch.nn.functional.conv2d(x, w, padding=1)
    torch.testing.assert_close(got, want.permute(TO_NHWC))


def _channels_last_convolutions():
    """A training capture whose convolutions run channels-last: their operands are held NHWC and
    permuted for the call, their results permuted back (``graph/layout.py``)."""
    from fusionstitching.frontend.torch_fx import capture

    model = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.ReLU(),
                                torch.nn.Conv2d(8, 4, 1, stride=2)).to(memory_format=torch.channels_last)
    x = torch.randn(2, 3, 8, 8).to(memory_format=torch.channels_last).requires_grad_()
    return capture(model, x, train=True)


@pytest.mark.parametrize("workload", ["channels_last", "resnet50_train", "unet_block_train", "llama_train"])
def test_every_library_node_of_a_workload_gives_the_references_value(workload):
    """The written-out call of each library node (convolutions and their backwards, in channels-last
    layouts too, multi-output attention and its backward) against the reference's own torch call."""
    import numpy as np

    from fusionstitching.cli import capture_workload
    from fusionstitching.fusion import explore
    from fusionstitching.graph import reference
    from fusionstitching.graph.torch_dtypes import DTYPE_TO_TORCH
    from fusionstitching.runtime.executor import _library_function, _to_numpy

    captured = _channels_last_convolutions() if workload == "channels_last" else capture_workload(workload)[1]
    graphs = [g for g in (captured.forward, captured.backward) if g is not None]
    if workload == "channels_last":  # planning holds the convolutions' operands NHWC
        graphs = [explore(g).graph for g in graphs]
        assert any(n.op == "library" and n.attrs["call"].get("permute_result") for g in graphs for n in g.nodes)
    generator = torch.Generator().manual_seed(0)
    seen = set()
    for graph in graphs:
        for node in graph.nodes:
            if node.op != "library":
                continue
            key = (node.attrs["target"], node.attrs["out_index"], tuple(x.shape for x in node.operands))
            if key in seen:
                continue
            seen.add(key)
            tensors = []
            for x in node.operands:
                dtype = DTYPE_TO_TORCH[x.dtype]
                if x.dtype.is_float:
                    tensors.append(torch.randn(x.shape, generator=generator).to(dtype))
                else:
                    tensors.append(torch.zeros(x.shape, dtype=dtype))
            want = reference.evaluate_node(node, [_to_numpy(t, x) for t, x in zip(tensors, node.operands)])
            got = _library_function(node)(*tensors)
            np.testing.assert_allclose(_to_numpy(got, node).astype(np.float64), np.asarray(want, np.float64),
                                       rtol=1e-5, atol=1e-5, err_msg=node.name)
    assert seen


def test_an_operand_the_call_permutes_back_is_taken_untransposed():
    """A channels-last convolution's weight and saved activation reach its call as transposes of
    parameters held NCHW; the call's template permutes them back. The program passes the parameter
    itself: no view step, no permute, the same values."""
    from fusionstitching.fusion import explore
    from fusionstitching.runtime.executor import _library_function
    from fusionstitching.runtime.program import GpuProgram

    captured = _channels_last_convolutions()
    undone_anywhere = 0
    generator = torch.Generator().manual_seed(0)
    for graph in (captured.forward, captured.backward):
        plan = explore(graph)
        program = GpuProgram(plan.graph, _steps(plan), torch.device("cpu"), lambda node, device: None,
                             _library_function)
        for op in program.ops:
            if op.kind != "call" or not getattr(op.fn, "undone", None):
                continue
            undone_anywhere += len(op.fn.undone)
            node = next(n for n in plan.graph.nodes if op.label.startswith(f"library {n.name} "))
            for k in op.fn.undone:
                assert op.views is None or op.views[k] is None
                assert node.operands[k].op == "transpose" and plan.graph.parameters.count(node.operands[k].operands[0])
            held = [torch.randn(x.shape, generator=generator) for x in node.operands]  # as the graph holds them
            given = [x.operands[0] if k in op.fn.undone else x for k, x in enumerate(node.operands)]
            untransposed = [t.permute(*_inverse(x.attrs["permutation"])) if k in op.fn.undone else t
                            for k, (t, x) in enumerate(zip(held, node.operands))]
            assert [tuple(t.shape) for t in untransposed] == [tuple(x.shape) for x in given]
            want = _library_function(node)(*held)
            got = op.fn(*untransposed)
            for w, g in zip(want if isinstance(want, list) else [want], got if isinstance(got, list) else [got]):
                torch.testing.assert_close(g, w)
    assert undone_anywhere >= 3  # the forward's weights, the backward's weights and saved inputs


def _inverse(permutation):
    inverse = [0] * len(permutation)
    for i, p in enumerate(permutation):
        inverse[p] = i
    return inverse


def _steps(plan):
    from fusionstitching.pipeline import ordered_steps

    return ordered_steps(plan)
