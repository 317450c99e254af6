"""Which of PyTorch's OpInfos (``op_db``) this compiler lowers completely: the list in docs/opinfo.md.

``python -m fusionstitching.bench.opinfo_coverage [--out docs/opinfo.md] [--check] [--jobs N] [--ops a,b]``
(``--check`` compares the page's fingerprint only; ``--ops`` prints the classification of the named
OpInfos instead of writing the page.)

A sample of an OpInfo is *covered* when every ATen op of its graphs has an entry in
``aten_table.TABLE`` and the entry lowers it: nothing of it would become a ``library`` node. The
graphs are the ones the backend compiles: each f32 CPU sample (``requires_grad`` where the OpInfo
supports autograd) is traced by AOTAutograd with ``torch_fx.decompositions()``, the min-cut
partitioner and in-graph input mutations, exactly as ``backend.py`` asks for them, and
every resulting graph (inference, or forward and backward) is converted with ``torch_fx.convert``;
a ``LibraryFallbackWarning`` or an unsupported dtype makes the sample uncovered, with that op as the
reason. An internal error of the conversion does not: the sample stays covered, so that
tests/frontend/test_opinfo.py (which compiles every covered sample with
``torch.compile(backend="fusionstitching")`` in strict mode) reports it.

The samples are traced by AOTAutograd alone (``aot_function``): it sees the same dispatcher-level
ops as behind TorchDynamo, and all ~15,000 samples of ``op_db`` are traced. Only a sample that lowers
completely is then also captured by TorchDynamo (``fullgraph=True``, a pass-through backend), and
one that TorchDynamo does not capture as one graph (a ``warnings.warn`` inside the op, say) is not
covered either: the test asserts that every covered sample is compiled whole.

Random OpInfos call their op through OpInfo's ``wrapper_set_seed``, which reseeds torch's generator
in a way TorchDynamo cannot trace; ``as_call`` calls the op directly instead.

Error inputs (``op.error_inputs``) of covered OpInfos are listed when eager PyTorch rejects them on
the CPU and so does ``torch.compile(backend="aot_eager")`` (without it, no backend could: an
``out=`` of a wrong dtype, a Python-level type error); the test asserts that the compiled call
rejects them too.

The generated page lists the covered OpInfos (all samples, or the covered subset by index, and the
error inputs), the excluded ones with the first op that is not lowered, and the TABLE overloads that
no covered sample reaches. Its first line holds a fingerprint of what classification depends on that can be computed
in a second (torch's version, TABLE's keys, the decomposition table's keys, op_db's names and
flags); the test recomputes it. A change inside a lowering (a new case it refuses or accepts) is
not in the fingerprint: regenerate the page after such a change.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import logging
import multiprocessing
import operator
import re
import sys
import types
import warnings
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import fx
from torch.utils import _pytree as pytree

DEFAULT_OUT = Path(__file__).resolve().parents[2] / "docs" / "opinfo.md"
REGENERATE = "python -m fusionstitching.bench.opinfo_coverage"
SEED = 0  # torch.manual_seed before an OpInfo's samples are made: their values are reproducible
# Handled by the converter itself (an input mutation), not by a TABLE entry.
CONVERTER_OPS = frozenset({"aten.copy_.default"})


_MISSING: list[str] = []  # the testing helpers' missing dependency, once an import has failed


def op_db() -> list[Any]:
    """torch's OpInfo database. torch's testing helpers import ``expecttest``, which a machine
    without the test extras lacks (an offline GPU image): the first failed import is remembered and
    every later call fails at once with the remedy, instead of retrying a partial import."""
    if _MISSING:
        raise ModuleNotFoundError(_MISSING[0])
    try:
        from torch.testing._internal.common_methods_invocations import op_db as ops
    except ModuleNotFoundError as err:
        _MISSING.append(f"torch's OpInfo database cannot be imported: {err}. Install the test extras "
                        f"(pip install expecttest); offline, put its wheel on PYTHONPATH "
                        f"(a pure-Python wheel imports from the .whl file)")
        raise ModuleNotFoundError(_MISSING[0]) from err
    return list(ops)


def op_key(op: Any) -> tuple[str, str]:
    return op.name, op.variant_test_name


# ----------------------------------------------------------------------------------------------
# Samples as calls
# ----------------------------------------------------------------------------------------------


def wants_grad(op: Any, device: str, dtype: torch.dtype) -> bool:
    return bool(op.supports_autograd) and dtype in op.supported_backward_dtypes(torch.device(device).type)


# OpInfos whose sample generator iterates a set of strings (meshgrid: ``product(cases, {'xy', 'ij'})``):
# their order follows Python's string hash seed, another in every process. ``make_samples`` puts
# them in the order of their structures, so that indices and digests hold from run to run (which
# values each sample draws still varies).
HASH_ORDERED = frozenset({"meshgrid"})


def make_samples(op: Any, device: str = "cpu", dtype: torch.dtype = torch.float32) -> list[Any]:
    """The OpInfo's samples, with the same values every time (seeded; ``HASH_ORDERED`` aside)."""
    torch.manual_seed(SEED)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        samples = list(op.sample_inputs(device, dtype, requires_grad=wants_grad(op, device, dtype)))
    if op.name in HASH_ORDERED:
        samples.sort(key=structure)
    return samples


@dataclass(frozen=True)
class SampleCall:
    """One sample as ``fn(*tensors)``: the tensors of the sample are the arguments, the rest of it
    (numbers, dtypes, lists) is closed over and becomes constants of the compiled graph. ``fn``
    holds no tensor, so TorchDynamo guards on no tensor of the sample: a compiled ``fn`` serves
    every sample of the same description."""

    fn: Callable[..., Any]
    tensors: tuple[torch.Tensor, ...]


def as_call(op: Any, sample: Any) -> SampleCall:
    leaves, spec = pytree.tree_flatten((sample.input, sample.args, sample.kwargs))
    positions = [i for i, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor)]
    tensors = tuple(leaves[i] for i in positions)
    constants = [None if isinstance(leaf, torch.Tensor) else leaf for leaf in leaves]
    function = _traceable(op.op)

    def fn(*tensors: torch.Tensor) -> Any:
        filled = list(constants)
        for position, tensor in zip(positions, tensors):
            filled[position] = tensor
        inp, args, kwargs = pytree.tree_unflatten(filled, spec)
        return function(inp, *args, **kwargs)

    return SampleCall(fn, tensors)


def _call(op: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    return op(*args, **kwargs)


def _traceable(function: Callable[..., Any]) -> Callable[..., Any]:
    """``function`` without OpInfo's ``wrapper_set_seed`` (random ops reseed torch's generator
    inside ``freeze_rng_state``, which TorchDynamo cannot trace): the op is called as it is. Their
    values are random either way; the test compares only their shapes and dtypes."""
    code = getattr(function, "__code__", None)
    if code is None or "wrapper_set_seed" not in code.co_names:
        return function
    scope = dict(function.__globals__, wrapper_set_seed=_call)
    return types.FunctionType(code, scope, function.__name__, function.__defaults__, function.__closure__)


def describe(sample: Any) -> str:
    """A short, stable description of a sample's structure (not its values)."""

    def one(value: Any) -> str:
        if isinstance(value, torch.Tensor):
            dims = ",".join(str(s) for s in value.shape)
            if value.layout != torch.strided:
                flags = f" {str(value.layout).removeprefix('torch.')}"
            else:
                flags = "" if value.is_contiguous() else " noncontig"
            flags += " grad" if value.requires_grad else ""
            return f"{str(value.dtype).removeprefix('torch.')}[{dims}]{flags}"
        if isinstance(value, (list, tuple)):
            inner = ", ".join(one(v) for v in value)
            return f"[{inner}]" if isinstance(value, list) else f"({inner})"
        if isinstance(value, dict):
            return "{" + ", ".join(f"{k}={one(v)}" for k, v in value.items()) + "}"
        if callable(value) and hasattr(value, "__name__"):
            return value.__name__
        text = repr(value)
        return re.sub(r" at 0x[0-9a-f]+", "", text)

    parts = [one(sample.input)] + [one(a) for a in sample.args]
    parts += [f"{k}={one(v)}" for k, v in sample.kwargs.items()]
    name = f" '{sample.name}'" if getattr(sample, "name", "") else ""
    return f"({', '.join(parts)}){name}"


def structure(sample: Any) -> str:
    """A sample's description with its float dtype named "float" and its device the CPU: the samples
    of one OpInfo in f32 and bf16, on the CPU and a GPU, are the same calls when their structures
    are equal."""
    text = describe(sample)
    for name in ("float32", "bfloat16", "float16"):
        text = text.replace(name, "float")
    # a factory op's samples name the device they were made for
    text = re.sub(r"device\(type='cuda'(, index=\d+)?\)", "device(type='cpu')", text)
    return re.sub(r"'cuda(:\d+)?'", "'cpu'", text)


def digest(descriptions: Iterable[str]) -> str:
    return hashlib.sha1("\n".join(descriptions).encode()).hexdigest()[:10]


# ----------------------------------------------------------------------------------------------
# Tracing and classification
# ----------------------------------------------------------------------------------------------


def trace(call: SampleCall, decompositions: dict) -> list[fx.GraphModule]:
    """The ATen graphs the backend would compile for ``call``: inference, or forward and backward."""
    from torch._functorch.aot_autograd import aot_function
    from torch._functorch.partitioners import min_cut_rematerialization_partition

    graphs: list[fx.GraphModule] = []

    def record(gm: fx.GraphModule, example_inputs: Any) -> fx.GraphModule:
        return gm

    def partition(joint: fx.GraphModule, joint_inputs: Any, **kwargs: Any):
        forward, backward = min_cut_rematerialization_partition(joint, joint_inputs, **kwargs)
        graphs.extend([forward, backward])
        return forward, backward

    def inference(gm: fx.GraphModule, example_inputs: Any) -> fx.GraphModule:
        graphs.append(gm)
        return gm

    def flat(*tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return tuple(x for x in pytree.tree_leaves(call.fn(*tensors)) if isinstance(x, torch.Tensor))

    compiled = aot_function(flat, fw_compiler=record, bw_compiler=record, inference_compiler=inference,
                            partition_fn=partition, decompositions=decompositions,
                            keep_inference_input_mutations=True)
    compiled(*call.tensors)
    if not graphs:  # no tensor input requires grad, so no partition either
        raise RuntimeError("AOTAutograd compiled no graph")
    return graphs


def aten_ops(graphs: Sequence[fx.GraphModule]) -> list[str]:
    """ATen ops of ``graphs`` in node order, each once."""
    seen: dict[str, None] = {}
    for gm in graphs:
        for node in gm.graph.nodes:
            if node.op == "call_function" and node.target is not operator.getitem:
                seen.setdefault(str(node.target), None)
    return list(seen)


def first_unlowered(graphs: Sequence[fx.GraphModule]) -> str | None:
    """Why a sample's graphs would not be lowered completely (None: they would be)."""
    from fusionstitching.frontend import aten_table
    from fusionstitching.frontend.context import CaptureError, StorageDependent, Unsupported
    from fusionstitching.frontend.torch_fx import LibraryFallbackWarning, convert

    for op in aten_ops(graphs):
        if op not in aten_table.TABLE and op not in CONVERTER_OPS:
            return op
    for gm in graphs:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", LibraryFallbackWarning)
            try:
                convert(gm, _param_specs(gm), list(range(len(_placeholders(gm)))), name="opinfo")
            except Unsupported as why:
                return f"unsupported: {why}"
            except StorageDependent as why:  # runs in PyTorch by design
                return f"runs in PyTorch: {str(why).split(': ', 2)[-1]}"
            except (CaptureError, ValueError, TypeError):
                pass  # an internal error: the test reports it
        for warning in caught:
            if issubclass(warning.category, LibraryFallbackWarning):
                return str(warning.message).replace(" is kept as a library call", " → library")
    return None


def dynamo_problem(call: SampleCall) -> str | None:
    """Why TorchDynamo would not capture ``call`` as one graph (None: it does)."""

    def backend(gm: fx.GraphModule, example_inputs: Any) -> Callable[..., Any]:
        return gm.forward

    torch._dynamo.reset()
    try:
        with torch._dynamo.config.patch(suppress_errors=False), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            torch.compile(call.fn, backend=backend, fullgraph=True, dynamic=False)(*call.tensors)
    except Exception as err:  # noqa: BLE001 - whatever stops TorchDynamo excludes the sample
        lines = str(err).strip().splitlines() or [""]
        explanation = next((line.strip().removeprefix("Explanation: ") for line in lines
                            if line.strip().startswith("Explanation:")), "")
        detail = f" ({explanation.split('. ')[0][:100]})" if explanation else ""
        return f"TorchDynamo: {lines[0][:80]}{detail}"
    return None


def _placeholders(gm: fx.GraphModule) -> list[fx.Node]:
    return [n for n in gm.graph.nodes if n.op == "placeholder"]


def _param_specs(gm: fx.GraphModule) -> list[Any]:
    from fusionstitching.frontend.torch_fx import _spec

    return [_spec(p.name, p.meta["val"]) for p in _placeholders(gm)]


@dataclass(frozen=True)
class OpCoverage:
    """One OpInfo: its samples, which are covered, and why the others are not."""

    name: str
    variant: str
    samples: int
    covered: tuple[int, ...]
    reason: str  # the first sample's reason among the uncovered ones; "" when all are covered
    reached: frozenset[str]  # TABLE overloads that the covered samples' graphs use
    digest: str  # of the samples' descriptions: the test checks that they did not change
    errors: tuple[int, ...] = ()  # error inputs (CPU) rejected by eager and aot_eager; tested when covered

    @property
    def label(self) -> str:
        return f"{self.name}.{self.variant}" if self.variant else self.name


def classify(op: Any, decompositions: dict) -> OpCoverage:
    name, variant = op_key(op)
    if torch.float32 not in op.supported_dtypes("cpu"):
        return OpCoverage(name, variant, 0, (), "no float32 on the CPU", frozenset(), "")
    try:
        samples = make_samples(op)
    except Exception as err:  # noqa: BLE001 - a broken sample generator excludes the OpInfo
        return OpCoverage(name, variant, 0, (), f"sample_inputs: {_short(err)}", frozenset(), "")
    covered: list[int] = []
    reasons: list[str] = []
    reached: set[str] = set()
    for index, sample in enumerate(samples):
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                graphs = trace(as_call(op, sample), decompositions)
        except Exception as err:  # noqa: BLE001 - whatever stops tracing excludes the sample
            reasons.append(f"tracing: {_short(err)}")
            continue
        ops = aten_ops(graphs)
        if not ops:
            reasons.append("no ATen op to compile")
            continue
        why = first_unlowered(graphs) or dynamo_problem(as_call(op, sample))
        if why is not None:
            reasons.append(why)
            continue
        covered.append(index)
        reached.update(ops)
    error_inputs = make_error_inputs(op) if covered else []
    errors = tuple(i for i, e in enumerate(error_inputs) if rejected(op, e))
    reason = reasons[0] if reasons else ""
    return OpCoverage(name, variant, len(samples), tuple(covered), reason, frozenset(reached) - CONVERTER_OPS,
                      samples_digest(samples, error_inputs), errors)


def samples_digest(samples: Sequence[Any], error_inputs: Sequence[Any]) -> str:
    """Of the samples' and error inputs' descriptions: the test checks that they did not change."""
    descriptions = [describe(s) for s in samples]
    descriptions += [f"error: {describe(e.sample_input)}" for e in error_inputs]
    return digest(descriptions)


def make_error_inputs(op: Any, device: str = "cpu") -> list[Any]:
    """The OpInfo's error inputs (calls that eager PyTorch rejects, some only on other devices)."""
    torch.manual_seed(SEED)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            return list(op.error_inputs(torch.device(device)))
        except Exception:  # noqa: BLE001 - a broken error-input generator: no error inputs
            return []


def eager_rejects(op: Any, error_input: Any, backend: str | None = None) -> bool:
    """Whether eager PyTorch (or ``torch.compile`` with ``backend``) raises on the error input."""
    call = as_call(op, error_input.sample_input)
    fn = call.fn
    if backend is not None:
        torch._dynamo.reset()
        fn = torch.compile(fn, backend=backend, fullgraph=True, dynamic=False)
    try:
        with warnings.catch_warnings(), torch._dynamo.config.patch(suppress_errors=False):
            warnings.simplefilter("ignore")
            fn(*call.tensors)
    except Exception:  # noqa: BLE001 - any error is the rejection the error input asks for
        return True
    return False


def rejected(op: Any, error_input: Any) -> bool:
    """Eager PyTorch rejects the error input, and so does TorchDynamo with AOTAutograd and no
    decompositions (``aot_eager``): where that accepts it, the compiled call cannot reject it
    whatever the backend does (``out=`` of a wrong dtype, Python-level type errors)."""
    return eager_rejects(op, error_input) and eager_rejects(op, error_input, backend="aot_eager")


def _short(err: BaseException) -> str:
    first = (str(err).strip().splitlines() or [""])[0]
    return f"{type(err).__name__}: {first[:100]}"


# ----------------------------------------------------------------------------------------------
# Fingerprint, rendering, parsing
# ----------------------------------------------------------------------------------------------


def fingerprint(ops: Sequence[Any] | None = None) -> str:
    """What classification depends on, in a second: torch, TABLE's keys, the decompositions, op_db."""
    from fusionstitching.frontend import aten_table
    from fusionstitching.frontend.torch_fx import decompositions

    ops = op_db() if ops is None else ops
    table = digest(sorted(aten_table.TABLE))
    decomps = digest(sorted(str(k) for k in decompositions()))
    infos = digest(f"{op.name}|{op.variant_test_name}|{op.supports_autograd}|"
                   f"{torch.float32 in op.supported_dtypes('cpu')}" for op in ops)
    return f"torch {torch.__version__.split('+')[0]}, TABLE {table}, decompositions {decomps}, op_db {infos}"


def ranges(indices: Sequence[int]) -> str:
    """[0, 1, 2, 5, 7, 8] → "0-2,5,7-8"."""
    parts: list[str] = []
    start = previous = None
    for i in list(indices) + [None]:
        if previous is not None and i == previous + 1:
            previous = i
            continue
        if start is not None:
            parts.append(str(start) if start == previous else f"{start}-{previous}")
        start = previous = i
    return ",".join(parts)


def parse_ranges(text: str) -> tuple[int, ...]:
    result: list[int] = []
    for part in filter(None, text.split(",")):
        low, _, high = part.partition("-")
        result.extend(range(int(low), int(high or low) + 1))
    return tuple(result)


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def render(coverage: Sequence[OpCoverage], stamp: str) -> str:
    from fusionstitching.frontend import aten_table

    full = [c for c in coverage if c.covered and len(c.covered) == c.samples]
    partial = [c for c in coverage if c.covered and len(c.covered) < c.samples]
    excluded = [c for c in coverage if not c.covered]
    reached = set().union(*(c.reached for c in coverage))
    unreached = sorted(set(aten_table.TABLE) - reached)
    tested = sum(len(c.covered) for c in coverage)
    lines = [
        f"<!-- fingerprint: {stamp} -->",
        "# OpInfo coverage",
        "",
        f"Generated by `{REGENERATE}`; do not edit.",
        "tests/frontend/test_opinfo.py compiles every covered sample with",
        "`torch.compile(backend=\"fusionstitching\")` in strict mode and compares it with eager",
        "PyTorch (outputs, and gradients where the OpInfo supports autograd); it fails when this page is",
        "stale. A sample is covered when every ATen op of its AOTAutograd graphs (f32 on the CPU, forward",
        "and backward) is lowered by an entry of docs/ops.md, with no library call, and TorchDynamo",
        "captures it as one graph. The error inputs listed (those that eager PyTorch and TorchDynamo with",
        "AOTAutograd, `aot_eager`, reject on the CPU) must be rejected by the compiled call too, not by an",
        "internal compiler error.",
        "",
        (f"{len(full) + len(partial)} of {len(coverage)} OpInfos, {tested} samples: {len(full)} with every "
         f"sample, {len(partial)} with some; {len(excluded)} excluded."),
        "",
        f"## Covered: every sample ({len(full)})",
        "",
        "| OpInfo | variant | samples | tested | error inputs | sample digest | reason |",
        "|---|---|---|---|---|---|---|",
    ]
    for c in full:
        lines.append(f"| {c.name} | {c.variant} | {c.samples} | all | {ranges(c.errors)} | {c.digest} | |")
    lines += [
        "",
        f"## Covered: some samples ({len(partial)})",
        "",
        "The others' first op that is not lowered is in the last column.",
        "",
        "| OpInfo | variant | samples | tested | error inputs | sample digest | reason |",
        "|---|---|---|---|---|---|---|",
    ]
    for c in partial:
        lines.append(f"| {c.name} | {c.variant} | {c.samples} | {ranges(c.covered)} | {ranges(c.errors)} | "
                     f"{c.digest} | {_cell(c.reason)} |")
    lines += [
        "",
        f"## Excluded ({len(excluded)})",
        "",
        "The first sample's first op that is not lowered (or why no sample could be traced).",
        "",
        "| OpInfo | variant | samples | reason |",
        "|---|---|---|---|",
    ]
    for c in excluded:
        lines.append(f"| {c.name} | {c.variant} | {c.samples} | {_cell(c.reason)} |")
    lines += [
        "",
        f"## docs/ops.md overloads that no covered sample reaches ({len(unreached)} of {len(aten_table.TABLE)})",
        "",
    ]
    lines += [f"- `{name}`" for name in unreached]
    return "\n".join(lines) + "\n"


@dataclass(frozen=True)
class Listed:
    """A covered OpInfo as the page lists it."""

    name: str
    variant: str
    samples: int
    covered: tuple[int, ...]
    errors: tuple[int, ...]
    digest: str


def parse(text: str) -> tuple[str, list[Listed]]:
    """The fingerprint and the covered OpInfos of a generated page."""
    stamp = re.match(r"<!-- fingerprint: (.*) -->", text)
    if stamp is None:
        raise ValueError("no fingerprint on the page's first line")
    listed: list[Listed] = []
    section = ""
    for line in text.splitlines():
        if line.startswith("## "):
            section = line
        if not section.startswith("## Covered") or not line.startswith("| ") or line.startswith("| OpInfo"):
            continue
        cells = [c.strip() for c in re.split(r"(?<!\\)\|", line)[1:-1]]
        name, variant, samples, tested, errors, sample_digest = cells[:6]
        count = int(samples)
        covered = tuple(range(count)) if tested == "all" else parse_ranges(tested)
        listed.append(Listed(name, variant, count, covered, parse_ranges(errors), sample_digest))
    return stamp.group(1), listed


# ----------------------------------------------------------------------------------------------
# Command line
# ----------------------------------------------------------------------------------------------

_WORKER_DECOMPOSITIONS: dict | None = None


def _classify_index(index: int) -> OpCoverage:
    global _WORKER_DECOMPOSITIONS
    from fusionstitching.frontend.torch_fx import decompositions

    if _WORKER_DECOMPOSITIONS is None:
        torch.set_num_threads(1)
        _WORKER_DECOMPOSITIONS = decompositions()
    return classify(op_db()[index], _WORKER_DECOMPOSITIONS)


def generate(jobs: int = 1, names: Sequence[str] = (), progress: bool = False) -> list[OpCoverage]:
    ops = op_db()
    indices = [i for i, op in enumerate(ops) if not names or op.name in names]
    results: list[OpCoverage] = []
    context = multiprocessing.get_context("fork") if jobs > 1 else None
    with context.Pool(jobs, maxtasksperchild=40) if context else contextlib.nullcontext() as pool:
        mapped = pool.imap(_classify_index, indices) if pool else map(_classify_index, indices)
        for done, coverage in enumerate(mapped, 1):
            results.append(coverage)
            if progress:
                print(f"[{done}/{len(indices)}] {coverage.label}: {len(coverage.covered)}/{coverage.samples}",
                      file=sys.stderr, flush=True)
    return results


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--check", action="store_true", help="only compare the fingerprint with --out's")
    parser.add_argument("--jobs", type=int, default=max(1, (multiprocessing.cpu_count() or 1)))
    parser.add_argument("--ops", default="", help="comma-separated OpInfo names: print their classification")
    parser.add_argument("--quiet", action="store_true")
    args = parser.parse_args(argv)
    # Fake tensors log every error input that their meta function rejects, at ERROR level.
    logging.getLogger("torch._subclasses.fake_tensor").setLevel(logging.CRITICAL)
    if args.check:
        stamp, _ = parse(args.out.read_text())
        current = fingerprint()
        print("current" if stamp == current else f"stale: page has {stamp!r}, now {current!r}")
        return 0 if stamp == current else 1
    if args.ops:
        for c in generate(1, args.ops.split(",")):
            print(f"{c.label}: samples {ranges(c.covered) or '-'} of {c.samples}, error inputs "
                  f"{ranges(c.errors) or '-'}; {c.reason or 'all covered'}; reaches {sorted(c.reached)}")
        return 0
    coverage = generate(args.jobs, progress=not args.quiet)
    args.out.write_text(render(coverage, fingerprint()))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
