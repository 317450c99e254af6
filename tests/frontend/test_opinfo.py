"""Covered OpInfo samples through ``torch.compile(backend="fusionstitching")``, against eager.

The covered samples are those of docs/opinfo.md (``python -m fusionstitching.bench.opinfo_coverage``
writes it): samples of ``op_db`` whose forward and backward graphs lower completely through the
ATen table of docs/ops.md. On the CPU, in f32 through the kernel simulator, each OpInfo runs up to
``CPU_SAMPLES`` (24) of them (``cpu_share``): all covered samples of the nine in ten OpInfos that
have at most 24, and 24 spread evenly over the list of those that have more (masked reductions,
linspace, logspace, padding, losses), about half of all covered samples; each listed error input
must be rejected. Under ``-m gpu`` each covered OpInfo runs all its samples on the GPU in f32 and
bf16.
``opinfo_support.check_sample`` says what one sample asserts: compiled in strict mode by this
backend (counted graphs, no fallback, no eager run), outputs, in-place updates and gradients as
eager's. Samples of one description share one compilation (``reuse_key``).

Known defects are listed in ``XFAIL`` by sample, each naming its defect; the entries are strict
(a fixed defect fails the test until its entries go).
"""

from __future__ import annotations

import re
import sys
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch

from fusionstitching.bench import opinfo_coverage as coverage
from fusionstitching.bench.zoo import describe
from fusionstitching.frontend import torch_fx
from tests.frontend.opinfo_support import (
    Compiled,
    check_error_input,
    check_sample,
    error_inputs_of,
    reuse_key,
    samples_of,
    structure,
)

PAGE = Path(__file__).resolve().parents[2] / "docs" / "opinfo.md"
STAMP, LISTED = coverage.parse(PAGE.read_text())
# Covered samples per OpInfo that the CPU test runs (``cpu_share``): the simulator makes a sample
# cost 0.1 to 5 s, and a few OpInfos have hundreds of near-identical samples (logspace: 1201); the
# share keeps this file within its CI budget, 15 minutes on a 2-core machine (CHANGELOG.md has the
# measured time). The GPU test runs every covered sample.
CPU_SAMPLES = 24

# Failing samples: (OpInfo label as in docs/opinfo.md, sample index) → the defect, named with where
# it comes from. Strict: an entry whose sample passes fails the test until it is removed.
XFAIL: dict[tuple[str, int], str] = {}
# Defects seen in bf16 on the GPU only.
XFAIL_BF16: dict[tuple[str, int], str] = {}
# Error inputs (OpInfo label, index among its error inputs) that the compiled call does not reject
# as the user's error.
XFAIL_ERRORS: dict[tuple[str, int], str] = {}


def _label(listed: coverage.Listed) -> str:
    return f"{listed.name}.{listed.variant}" if listed.variant else listed.name


def cpu_share(label: str, covered: tuple[int, ...]) -> list[int]:
    """The covered samples that the CPU test runs: all of them up to ``CPU_SAMPLES``, else that
    many spread evenly over the list (first and last included), plus every sample of ``XFAIL``."""
    if len(covered) <= CPU_SAMPLES:
        return list(covered)
    chosen = {covered[round(i * (len(covered) - 1) / (CPU_SAMPLES - 1))] for i in range(CPU_SAMPLES)}
    chosen |= {i for (name, i) in XFAIL if name == label and i in covered}
    return sorted(chosen)


def _params():
    for listed in LISTED:
        label = _label(listed)
        for index in cpu_share(label, listed.covered):
            marks = ()
            reason = XFAIL.get((label, index))
            if reason is not None:
                marks = (pytest.mark.xfail(strict=True, reason=reason),)
            yield pytest.param(label, index, id=f"{label}-{index}", marks=marks)


@pytest.fixture(scope="module", autouse=True)
def decompositions_once():
    """The backend builds ``torch_fx.decompositions()`` on every call, most of a small sample's
    compile time; the table does not change within a process, so it is built once here."""
    table = torch_fx.decompositions()
    original = torch_fx.decompositions
    torch_fx.decompositions = lambda: table
    yield
    torch_fx.decompositions = original


def _error_params():
    for listed in LISTED:
        label = _label(listed)
        for index in listed.errors:
            reason = XFAIL_ERRORS.get((label, index))
            marks = (pytest.mark.xfail(strict=True, reason=reason),) if reason is not None else ()
            yield pytest.param(label, index, id=f"{label}-error{index}", marks=marks)


def test_the_committed_list_is_current():
    current = coverage.fingerprint()
    assert STAMP == current, f"docs/opinfo.md is stale: regenerate it with `{coverage.REGENERATE}`"


def test_every_xfail_entry_names_a_listed_sample():
    samples = {(_label(x), i) for x in LISTED for i in x.covered}
    errors = {(_label(x), i) for x in LISTED for i in x.errors}
    unknown = (set(XFAIL) | set(XFAIL_BF16)) - samples | set(XFAIL_ERRORS) - errors
    assert not unknown, sorted(unknown)


@dataclass
class _Reuse:
    """Compilations of the current OpInfo's samples by ``reuse_key``; TorchDynamo is reset when the
    next OpInfo starts."""

    label: str = ""
    compiled: dict[tuple, Compiled] = field(default_factory=dict)

    def of(self, label: str) -> dict[tuple, Compiled]:
        if label != self.label:
            torch._dynamo.reset()
            self.label, self.compiled = label, {}
        return self.compiled


_REUSE = _Reuse()


@pytest.mark.parametrize(("label", "index"), list(_params()))
def test_opinfo_sample_f32_cpu(label: str, index: int):
    found = samples_of(label)
    listed = next(x for x in LISTED if _label(x) == label)
    assert found.digest == listed.digest, f"{label}'s samples changed: regenerate `{coverage.REGENERATE}`"
    sample = found.samples[index]
    compiled = _REUSE.of(label)
    key = reuse_key(sample)
    compiled[key] = check_sample(found.op, sample, reuse=compiled.get(key))


@pytest.mark.parametrize(("label", "index"), list(_error_params()))
def test_opinfo_error_input_cpu(label: str, index: int):
    check_error_input(samples_of(label).op, error_inputs_of(label)[index])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("label", [_label(x) for x in LISTED])
def test_opinfo_samples_gpu(label: str, dtype: torch.dtype):
    """The covered samples of one OpInfo on the GPU; those of ``XFAIL`` (and ``XFAIL_BF16`` for
    bf16) must fail, the others pass."""
    listed = next(x for x in LISTED if _label(x) == label)
    other_torch = not STAMP.startswith(f"torch {torch.__version__.split('+')[0]},")
    try:
        cpu = samples_of(label)
    except KeyError:
        if other_torch:
            pytest.skip(f"{label} is not an OpInfo of torch {torch.__version__} (the page lists torch's {STAMP.split(',')[0]})")
        raise
    if other_torch and cpu.digest != listed.digest:
        pytest.skip(f"{label}'s samples differ in torch {torch.__version__}: the page's classification is of "
                    f"{STAMP.split(',')[0]}'s")
    assert cpu.digest == listed.digest, f"{label}'s samples changed: regenerate `{coverage.REGENERATE}`"
    if dtype not in cpu.op.supported_dtypes("cuda"):
        pytest.skip(f"{label} has no {dtype} on CUDA")
    found = samples_of(label, "cuda", dtype)
    matched = match_samples(cpu.samples, listed.covered, found.samples)
    absent = [i for i in listed.covered if i not in matched]
    if not matched:
        pytest.skip(f"none of {label}'s covered CPU samples has a CUDA {dtype} sample of the same structure")
    if absent:
        warnings.warn(f"{label} {dtype}: covered CPU samples {absent} have no CUDA sample of the same structure",
                      stacklevel=1)
    torch._dynamo.reset()
    compiled: dict[tuple, Compiled] = {}
    failures = {}
    for index, sample in matched.items():
        key = reuse_key(sample)
        try:
            compiled[key] = check_sample(found.op, sample, reuse=compiled.get(key), library_ops=CUDA_LIBRARY_OPS)
        except Exception as err:  # noqa: BLE001 - every sample runs; the set of failures is compared
            failures[index] = describe(err)
    expected = {i for (name, i) in XFAIL if name == label}
    if dtype == torch.bfloat16:
        expected |= {i for (name, i) in XFAIL_BF16 if name == label}
    unexpected = {i: why for i, why in failures.items() if i not in expected}
    fixed = sorted((expected & set(matched)) - set(failures))
    assert not unexpected and not fixed, f"failed: {unexpected}; listed as failing but passed: {fixed}"


# CUDA's fused attention kernels, which the dispatcher picks on a GPU where the CPU decomposes
# attention into covered ops: kept as library calls, as in the model zoo. Their backward with a
# bias that requires grad slices the bias's padded gradient back with ``slice_scatter``, which has
# no lowering yet.
CUDA_LIBRARY_OPS = (*(f"aten._scaled_dot_product_{kind}_attention" for kind in ("efficient", "cudnn", "flash")),
                    "aten.slice_scatter")


def _loose(sample) -> str:
    """A sample's structure with its float scalars unnamed: OpInfos draw some scalars from random
    tensors (``threshold``'s), and a GPU's generator draws others than the CPU's."""
    return re.sub(r"-?\d+\.\d+(?:e[-+]?\d+)?", "<float>", structure(sample))


def match_samples(cpu: Sequence, covered: Sequence[int], found: Sequence) -> dict[int, object]:
    """For each covered CPU sample, the GPU sample of its structure (``_loose``): the one at its
    index if that matches, else the first unclaimed one that does. Sample lists differ by device
    and dtype (some OpInfos add or drop samples for CUDA or for bf16)."""
    keys = [_loose(s) for s in found]
    claimed: set[int] = set()
    matched = {}
    for index in covered:
        want = _loose(cpu[index])
        if index < len(found) and keys[index] == want and index not in claimed:
            position = index
        else:
            position = next((k for k, key in enumerate(keys) if key == want and k not in claimed), None)
        if position is not None:
            claimed.add(position)
            matched[index] = found[position]
    return matched


def test_a_gpu_sample_is_matched_by_structure_whatever_its_index_or_random_scalars():
    from torch.testing._internal.opinfo.core import SampleInput

    def sample(shape, *args):
        return SampleInput(torch.empty(shape), args=args)

    cpu = [sample((2,), -1.7658), sample((3,), 0), sample((4,), 1)]
    found = [sample((2,), -1.7656), sample((5,), 0), sample((4,), 1), sample((3,), 0)]
    matched = match_samples(cpu, [0, 1, 2], found)
    assert [matched[i] for i in (0, 1, 2)] == [found[0], found[3], found[2]]
    assert match_samples(cpu, [1], found[:3]) == {}


def test_a_factory_samples_structure_does_not_name_its_device():
    """The GPU test matched zeros', arange's and 15 more factory OpInfos' CUDA samples against the CPU
    ones by structure, and their device argument differed."""
    from torch.testing._internal.opinfo.core import SampleInput

    def sample(device, dtype):
        return SampleInput((2, 3), kwargs={"device": device, "dtype": dtype})

    assert structure(sample("cuda", torch.bfloat16)) == structure(sample("cpu", torch.float32))
    assert structure(sample("cuda:0", torch.float32)) == structure(sample("cpu", torch.float32))
    assert structure(sample(torch.device("cuda", 0), torch.float32)) == structure(sample(torch.device("cpu"), torch.float32))
    assert structure(sample("cuda", torch.float32)) != structure(sample("cuda", torch.int64))


def test_the_float64_arbiter_takes_eagers_largest_error_on_the_tensor():
    """A bf16 gradient element where eager happened to be exact set a zero bar there (std_mean's
    sample 6 in bf16: ours 0.011 from float64 at worst, eager 0.006); a wrong value still fails."""
    from tests.frontend.opinfo_support import Tolerance, _as_close_as_eager

    ref = torch.tensor([1.0, 0.5, 0.25], dtype=torch.float64)
    want = torch.tensor([1.006, 0.5, 0.25])  # eager: off at one element, exact at the others
    tolerance = Tolerance(rtol=0.0, atol=1e-5)
    assert _as_close_as_eager(torch.tensor([1.0, 0.51, 0.25]), want, ref, tolerance)
    assert not _as_close_as_eager(torch.tensor([1.0, 0.55, 0.25]), want, ref, tolerance)


def test_a_missing_testing_dependency_fails_every_call_at_once_naming_the_remedy(monkeypatch):
    """torch's testing helpers import ``expecttest``; without it each OpInfo test fails at once with
    the remedy instead of retrying the import (an offline GPU image lacks it)."""
    monkeypatch.setattr(coverage, "_MISSING", [])
    monkeypatch.setitem(sys.modules, "torch.testing._internal.common_methods_invocations", None)
    for _ in range(2):
        with pytest.raises(ModuleNotFoundError, match="pip install expecttest"):
            coverage.op_db()
    assert len(coverage._MISSING) == 1
