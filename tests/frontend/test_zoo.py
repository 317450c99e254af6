"""The model zoo (``bench/zoo.py``): one tiny BERT through the harness on the CPU (the simulator runs
our kernels; Inductor left out, plain bounds), every model and row on a GPU (``-m gpu``)."""

from __future__ import annotations

import math

import pytest
import torch

from fusionstitching.bench import zoo

gpu_only = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
CPU = torch.device("cpu")
TINY_BERT = zoo.Sizes(layers=1, hidden=32, heads=2, batch=2, seq=8, vocab=64)
INFERENCE_AND_TRAINING = (zoo.Variant("inference", "f32"), zoo.Variant("train", "f32"))


def test_a_row_fails_on_an_error_over_its_bound_and_on_an_exception():
    reference = {"output x": torch.ones(4)}
    assert zoo._errors(zoo.Outcome(tensors={"output x": torch.ones(4) * 2}), reference) == {"output x": 1.0}
    assert zoo._errors(zoo.Outcome(), reference) == {"output x": math.inf}
    failing = zoo.Row("m", "inference", "f32", ours=1e-7, failures=["fusionstitching: X: y"])
    assert not failing.passed and zoo.Row("m", "train", "f32", ours=1e-7).passed
    assert "X: y" in zoo.table([failing])
    try:
        raise ValueError("first line\nsecond line")
    except ValueError as err:
        assert zoo.describe(err) == "ValueError: first line"


def _tiny_bert_rows(model: str) -> list[zoo.Row]:
    case = zoo.build(model, TINY_BERT, CPU)
    return [zoo.run_row(case, v, CPU, systems=("eager", "fusionstitching")) for v in INFERENCE_AND_TRAINING]


def test_tiny_bert_inference_and_training_step_on_cpu():
    """Eager attention: the CPU's scaled_dot_product_attention training is the next test's known issue."""
    rows = _tiny_bert_rows("bert-eager")
    report = zoo.table(rows)
    assert all(row.passed for row in rows), report
    assert all(row.fallbacks == 0 and row.kernels >= 1 for row in rows), report
    assert all(row.inductor is None and row.bound == zoo.F32_TOLERANCE for row in rows), report
    assert rows[1].tensors > 10, report  # the gradients were compared, not only the outputs


def test_tiny_bert_sdpa_training_step_on_cpu():
    """Failed while the CPU flash attention's decomposition fed its backward the probabilities as
    the log-sum-exp."""
    rows = _tiny_bert_rows("bert")
    assert all(row.passed for row in rows), zoo.table(rows)


@pytest.mark.gpu
@gpu_only
def test_every_zoo_row_passes_on_gpu():
    rows = zoo.run_zoo(torch.device("cuda"))
    report = zoo.table(rows)
    print(report)
    assert all(row.passed for row in rows), report
    assert all(row.fallbacks == 0 for row in rows), report


def test_tiny_resnet_inference_and_training_step_on_cpu():
    """Convolutions and BatchNorm: the convolutions run channels-last, forward and backward (the
    tensors the forward saves laid out NHWC), and every gradient is eager's."""
    case = zoo.build("resnet", zoo.Sizes(layers=2, hidden=32, batch=2, image=64), CPU)
    rows = [zoo.run_row(case, v, CPU, systems=("eager", "fusionstitching")) for v in INFERENCE_AND_TRAINING]
    report = zoo.table(rows)
    assert all(row.passed for row in rows), report
    assert all(row.fallbacks == 0 for row in rows), report
    assert rows[1].tensors > 10, report
