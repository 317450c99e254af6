"""``explore`` on the project's workloads (``bench/workloads.py``), captured at their real sizes.

Capture traces the model with TorchDynamo and AOTAutograd; it does not run kernels, and each
workload is captured once per module (module-scoped fixtures). Kernel counts are compared with the
XLA-like ``baseline``; the kernels of small captures are generated and simulated against the
reference evaluator, each on the reference values of its inputs, and the whole plan end to end.
"""

from __future__ import annotations

import functools
import warnings

import numpy as np
import pytest
import torch

from fusionstitching import capture
from fusionstitching.bench.check import forward_arrays
from fusionstitching.bench.workloads import make
from fusionstitching.cli import capture_workload
from fusionstitching.fusion import FusionPlan, baseline, explore
from fusionstitching.graph import reference
from fusionstitching.graph.serialize import from_json
from fusionstitching.options import Options

from .helpers import (
    assert_close,
    check_baseline_rules,
    check_kernels,
    check_plan,
    kernel_of,
    run_plan,
    same_plan,
)

H100 = Options(device="H100")


def _capture(workload):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return capture(workload.fn, *workload.inputs, train=workload.train, name=workload.name)


@pytest.fixture(scope="module")
def real():
    """``real(name)``: the capture of the workload at its benchmark sizes, made on first use (the
    workload's tensors are not kept: Adam's are 1.7 GB)."""
    return functools.cache(lambda name: capture_workload(name, real=True)[1])


@pytest.fixture(scope="module")
def plans(real):
    """``plans(name)``: the explored and the baseline plan of the real-size forward graph."""
    def make_plans(name: str) -> tuple[FusionPlan, FusionPlan]:
        graph = real(name).forward
        return explore(graph, options=H100), baseline(graph, H100)

    return functools.cache(make_plans)


@pytest.fixture(scope="module")
def bert():
    """``bert(train)``: BERT with two layers of BERT-base (hidden 768, 12 heads), batch 8, sequence 128."""
    return functools.cache(lambda train: _capture(make("bert_train" if train else "bert", real=True, layers=2,
                                                       hidden=768, heads=12)))


@pytest.mark.parametrize("name", ["layernorm", "softmax_scale_mask", "bias_gelu", "din_attention"])
def test_memory_intensive_subgraph_is_one_kernel(name, plans):
    plan, rules = plans(name)
    check_plan(plan)
    assert plan.kernel_count == 1, plan.explain()
    assert plan.library_count == 0
    assert rules.kernel_count >= plan.kernel_count


@pytest.mark.parametrize("name", ["layernorm", "softmax_scale_mask"])
def test_baseline_needs_more_kernels(name, plans):
    plan, rules = plans(name)
    check_plan(rules)
    assert rules.kernel_count > plan.kernel_count, (rules.kernel_count, plan.kernel_count)


def test_layernorm_training(real):
    captured = real("layernorm_train")
    forward, backward = explore(captured.forward, options=H100), explore(captured.backward, options=H100)
    for plan in (forward, backward):
        check_plan(plan)
    assert forward.kernel_count == 1
    rules = baseline(captured.backward, H100)
    assert backward.kernel_count < rules.kernel_count, backward.explain()


def test_adam_step_over_bert_base_parameters(real, plans):
    graph = real("adam_step").forward
    assert len(graph.mutations) == 3 * 199  # params, first and second moments, in place
    plan, rules = plans("adam_step")
    check_plan(plan)
    assert plan.kernel_count <= 4, f"{plan.kernel_count} kernels for 199 AdamW updates"
    assert rules.kernel_count >= 199
    check_plan(rules, check_feasible=False)


def test_bert_forward_needs_at_most_half_the_baseline_kernels(bert):
    graph = bert(False).forward
    plan, rules = explore(graph, options=H100), baseline(graph, H100)
    check_plan(plan)
    check_plan(rules)
    check_baseline_rules(rules)
    assert plan.library_count == rules.library_count > 0  # the GEMMs
    message = f"BERT forward: fusionstitching {plan.kernel_count} kernels, baseline {rules.kernel_count}"
    assert plan.kernel_count <= 0.5 * rules.kernel_count, message


def test_bert_training_needs_at_most_half_the_baseline_kernels(bert):
    captured = bert(True)
    ours, theirs = [], []
    for graph in (captured.forward, captured.backward):
        plan = explore(graph, options=H100)
        check_plan(plan)
        for k in range(plan.kernel_count):  # schedules renamed from the structural cache generate too
            kernel_of(plan, k)
        rules = baseline(graph, H100)
        check_baseline_rules(rules)
        ours.append(plan.kernel_count)
        theirs.append(rules.kernel_count)
    message = (f"BERT training: fusionstitching {ours[0]} + {ours[1]} = {sum(ours)} kernels, "
               f"baseline {theirs[0]} + {theirs[1]} = {sum(theirs)}")
    assert sum(ours) <= 0.5 * sum(theirs), message


# ----------------------------------------------------------------------------------------------
# Small captures: every kernel of the plan simulated against the reference
# ----------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def small_bert():
    workload = make("bert")
    captured = _capture(workload)
    arrays = forward_arrays(captured, workload.fn, workload.inputs)
    return captured, arrays, explore(captured.forward)


def test_small_bert_plan(small_bert):
    captured, _, plan = small_bert
    check_plan(plan)
    assert same_plan(plan, explore(from_json(captured.forward.to_json())))  # a copy: same plan
    assert plan.kernel_count < baseline(captured.forward).kernel_count


def test_small_bert_kernels_simulate_like_the_reference(small_bert):
    captured, arrays, plan = small_bert
    outputs = run_plan(plan, arrays, rtol=1e-4)  # each kernel checked against the reference as it runs
    for k, (got, want) in enumerate(zip(outputs, reference.evaluate(captured.forward, arrays))):
        assert_close(got, want, f"BERT output {k}")


def _backward_arrays(captured, workload, seed: int = 0) -> list[np.ndarray]:
    """Saved tensors from the reference forward, then random tangents."""
    outputs = reference.evaluate(captured.forward, forward_arrays(captured, workload.fn, workload.inputs))
    saved = outputs[captured.num_user_outputs:captured.num_user_outputs + captured.num_saved]
    rng = np.random.default_rng(seed)
    tangents = [rng.standard_normal(p.shape).astype(p.dtype.numpy)
                for p in captured.backward.parameters[len(saved):]]
    return list(saved) + tangents


@pytest.mark.parametrize("name", ["layernorm_train", "mlp_train", "adam_step", "din_attention",
                                  "softmax_scale_mask", "bias_gelu"])
def test_small_workload_plans_run_like_the_reference(name):
    workload = make(name)
    captured = _capture(workload)
    runs = [(captured.forward, forward_arrays(captured, workload.fn, workload.inputs))]
    if captured.backward is not None:
        runs.append((captured.backward, _backward_arrays(captured, workload)))
    for graph, arrays in runs:
        plan = explore(graph)
        check_plan(plan)
        outputs = run_plan(plan, arrays, rtol=1e-4)
        for k, (got, want) in enumerate(zip(outputs, reference.evaluate(graph, arrays))):
            if want is not None:
                assert_close(got, want, f"{graph.name} output {k}")


def test_layernorm_backward_on_several_blocks_simulates_like_the_reference():
    # At 32 x 128 no reduction is split: dgamma and dbeta sum over the rows that the dx kernel spreads
    # over two blocks, so the column sums must not be stored by that kernel (each block would store a
    # partial sum into the same element).
    workload = make("layernorm_train", batch=32, hidden=128)
    captured = _capture(workload)
    plan = explore(captured.backward)
    check_plan(plan)
    check_kernels(plan, _backward_arrays(captured, workload))


def test_groupnorm_silu_backward_reads_the_silu_gradient_in_one_shape():
    """GroupNorm's backward reshapes the SiLU gradient to [N, C, H·W] for its per-channel sums and
    to [N, G, C/G, H·W] for dx; in one finer shape (graph/refine.py) the sums share the kernel that
    computes the gradient, and the plan has two kernels instead of three."""
    workload = make("groupnorm_silu", train=True, dtype=torch.float32)
    captured = _capture(workload)
    plan = explore(captured.backward, options=Options(split_reshaped_dims=True))
    check_plan(plan)
    assert plan.kernel_count == 2, plan.explain()
    assert any("kept split" in note for note in plan.notes), plan.notes  # both plans estimated
    reduces = [n for n in plan.graph.nodes if n.op == "reduce" and n.operands[0].size == workload.inputs[0].numel()]
    assert reduces and all(len(n.attrs["dims"]) == 1 for n in reduces), "rows merged back into one dim"
    unsplit = explore(captured.backward, options=Options(split_reshaped_dims=False))
    assert unsplit.kernel_count == 3, unsplit.explain()
    outputs = run_plan(plan, _backward_arrays(captured, workload), rtol=1e-4)
    for k, (got, want) in enumerate(zip(outputs, reference.evaluate(captured.backward,
                                                                      _backward_arrays(captured, workload)))):
        if want is not None:
            assert_close(got, want, f"groupnorm backward output {k}")
