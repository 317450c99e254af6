"""The compiler's stages, in order (DESIGN.md "Pipeline"); ``STAGES`` names them.

    capture   frontend/torch_fx.py   PyTorch function or module   → Graph (forward, backward)
    explore   fusion/explore.py      Graph                        → FusionPlan: patterns, each with
                                                                    the KernelSchedule the schedule
                                                                    stage chose (``schedule.feasible``)
    generate  codegen/generate.py    pattern + KernelSchedule     → Kernel IR (lower) → CUDA C (render)
    order     runtime/executor.py    kernels, library calls, views → steps in dependence order
    compile   codegen/nvrtc.py       CUDA C                       → CUBIN per device arch (disk cache)
    run       runtime/executor.py    steps + tensors              → outputs (``CompiledGraph``)

``compile_graph`` runs explore, generate and order for one graph and returns the ``CompiledGraph``,
which only runs what it is given (CUBINs are compiled on its first GPU call); ``compile_plan`` starts
from a plan. With ``dump_dir`` (or the ``FUSIONSTITCHING_DUMP_DIR`` environment variable, which only
switches on this debug dump) every stage's output is written as text: the graph (also as JSON, which
``graph.serialize.from_json`` reads back), the plan with its reasons, and each kernel's template,
shared-memory plan and CUDA C. ``explain(fn, *example_inputs,
out=DIR)`` (``fusionstitching.explain``) writes the same for any callable's graphs, and
``fusionstitching explain WORKLOAD --out DIR`` for a workload's, both with ptxas's resource report
of every kernel (the compile stage).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fusionstitching._host import COMPILE_SECONDS, PHASES, collector_paused, timed
from fusionstitching.codegen.generate import GeneratedKernel, generate
from fusionstitching.codegen.size_args import SizeFamilies
from fusionstitching.fusion import background, explore, plan_cache
from fusionstitching.fusion.explore import DEFAULT_GENERATORS, keep_templates, transfer
from fusionstitching.fusion.plan import FusionPlan
from fusionstitching.graph.analysis import in_place_outputs, pattern_structure
from fusionstitching.graph.graph import Graph, Node
from fusionstitching.options import Options
from fusionstitching.runtime.executor import CompiledGraph, InPlaceCycle, Step, order_steps
from fusionstitching.schedule.template import KernelSchedule

if TYPE_CHECKING:
    from fusionstitching.frontend.torch_fx import Captured

STAGES = ("capture", "explore", "generate", "order", "compile", "run")
DUMP_VARIABLE = "FUSIONSTITCHING_DUMP_DIR"
logger = logging.getLogger(__name__)


@collector_paused()
def compile_graph(graph: Graph, options: Options | None = None, mode: str | None = None,
                  dump_dir: str | os.PathLike | None = None, device: Any = None,
                  output_devices: Sequence[Any] | None = None, like: Sequence[FusionPlan] = (),
                  families: SizeFamilies | None = None,
                  kept: Mapping[frozenset[str], str] | None = None) -> CompiledGraph:
    """Plan ``graph`` and generate its kernels; dump every stage's text when asked. ``device`` and
    ``output_devices``: where the graph runs and where its outputs go (``CompiledGraph``). ``like``:
    plans of other shape specializations of the same graph, in the order tried: the first whose
    patterns are all legal at these shapes is taken (``explore.transfer``) instead of exploring; a
    stored plan of this graph, or one a worker explored ahead, comes first. ``families``: the kernel
    families of the graph's other specializations, whose parametric kernels this one's kernels
    take where they can (``codegen/size_args.py``). ``kept``: the templates a specialization of the
    same shape class ran, per pattern, for a transferred plan (``explore.transfer``)."""
    options = with_gemm_timings(graph, options or Options(), device)
    start = time.perf_counter()
    generators = options.generators or DEFAULT_GENERATORS
    waited, ahead = 0.0, 0.0  # waiting for a worker's plan; the seconds the worker explored it
    with timed("exploration"):
        key = plan_cache.key(graph, options.solver, generators, options)
        plan = plan_cache.load(key, graph, options)
        if plan is None:
            began = time.perf_counter()
            taken = background.take(graph, options, generators)
            if taken is not None:
                (plan, ahead), waited = taken, time.perf_counter() - began
            elif (plan := _transferred(like, graph, options, kept)) is not None:
                pass  # not stored: the cache holds explored plans
            else:
                plan = explore(graph, solver=options.solver, options=options, generators=generators)
            if not plan.transferred:
                plan_cache.store(key, graph, options, plan)
        if kept and not plan.transferred:
            plan = keep_templates(plan, kept, options)
    with timed("code generation"):
        # NVRTC compiles each kernel as soon as it is generated, in threads, while the next ones are
        # generated; not where kernels may yet be adopted into a family's parametric kernels.
        compiling = _compile_ahead(device, options) if families is None else None
        compiled = compile_plan(plan, mode=mode, options=options, device=device, output_devices=output_devices,
                                compile_ahead=compiling)
        if families is not None:
            compiled.shared_kernels = families.adopt(compiled.kernels)
    # The graph's compile work (the tuning budget is a multiple of it): a plan explored ahead
    # counts the worker's seconds, not the time spent waiting for it.
    compiled.compile_seconds = time.perf_counter() - start - waited + ahead
    directory = dump_dir if dump_dir is not None else os.environ.get(DUMP_VARIABLE)
    if directory:
        dump(compiled, graph, Path(directory))
    return compiled


def with_gemm_timings(graph: Graph, options: Options, device: Any) -> Options:
    """``options`` with the measured times of ``graph``'s unaligned library GEMMs on CUDA ``device``
    (``runtime/gemm_timing.py``), which the padding pass prefers to its model; ``options`` itself
    where there is nothing to time or no GPU. The seconds count as tuning."""
    if device is None or getattr(device, "type", "cuda") != "cuda" or options.gemm_timings:
        return options
    from fusionstitching.runtime.gemm_timing import gemm_timings

    with timed("tuning"):
        timings = gemm_timings(graph, options, device)
    return dataclasses.replace(options, gemm_timings=timings) if timings else options


def _transferred(like: Sequence[FusionPlan], graph: Graph, options: Options,
                 kept: Mapping[frozenset[str], str] | None = None) -> FusionPlan | None:
    """The first of ``like`` that ``explore.transfer`` moves to ``graph``, or None. Transferring is a
    shortcut: an internal error in it is raised under ``Options.strict`` (a bug to see), else logged
    and the graph explored."""
    for plan in like:
        try:
            moved = transfer(plan, graph, options, kept)
        except Exception:  # exploration plans the graph instead
            if options.strict:
                raise
            logger.warning("transferring the plan of %s to %s failed; exploring it", plan.graph.name, graph.name,
                           exc_info=True)
            continue
        if moved is not None:
            return moved
    return None


def compile_plan(plan: FusionPlan, mode: str | None = None, options: Options | None = None, device: Any = None,
                 output_devices: Sequence[Any] | None = None, compile_ahead: Any = None) -> CompiledGraph:
    """The generate and order stages for ``plan``, handed to the ``CompiledGraph`` that runs them.
    ``compile_ahead``: a ``kernel_call.CompileAhead`` that gets each kernel as it is generated; the
    program waits for it before compiling what is left (``CompiledGraph.prepare``)."""
    generated = compile_ahead.submit_one if compile_ahead is not None else None
    compiled = CompiledGraph(plan, ordered_steps(plan, generated), mode=mode, options=options, device=device,
                             output_devices=output_devices)
    compiled.compiling = compile_ahead
    return compiled


def _compile_ahead(device: Any, options: Options) -> Any:
    """A ``CompileAhead`` for CUDA ``device``'s arch; None elsewhere (CPU: kernels are simulated)."""
    if device is None or getattr(device, "type", None) != "cuda":
        return None
    from fusionstitching.runtime.kernel_call import CompileAhead, device_arch

    return CompileAhead(device_arch(device), cache_dir=options.cache_dir, cache_max_bytes=options.cache_max_bytes)


def ordered_steps(plan: FusionPlan, generated: Callable[[GeneratedKernel], None] | None = None) -> list[Step]:
    """The plan's steps, generated (``generate_steps``) and in dependence order (``order_steps``).
    A kernel whose in-place update no order allows (a reader of the input's old value would have to
    run after it) is generated again to write a new buffer, which the runtime copies into the input
    after the call. ``generated``: called with each kernel generated (not with its twins)."""
    not_in_place: frozenset[str] = frozenset()
    while True:
        try:
            return order_steps(plan.graph, generate_steps(plan, not_in_place, generated))
        except InPlaceCycle as refused:
            if refused.writers <= not_in_place:
                raise RuntimeError(f"plan for {plan.graph.name}: {refused}") from None
            not_in_place |= refused.writers


def generate_steps(plan: FusionPlan, not_in_place: frozenset[str] = frozenset(),
                   generated: Callable[[GeneratedKernel], None] | None = None) -> list[Step]:
    """A step per pattern, library call and view. A pattern with the structure and template of an
    earlier one (up to names) gets that kernel's twin: one lowering, one compile, one module, one
    name; kernels generated apart have names of their own. The patterns whose first node is in
    ``not_in_place`` write their input updates to new buffers."""
    graph = plan.graph
    position = graph.index.position
    aliased = in_place_outputs(graph)
    made: dict[tuple, GeneratedKernel] = {}
    named: dict[str, str] = {}  # kernel name -> the first node of the pattern it was generated for
    steps = []
    for pattern in plan.patterns:
        nodes = sorted((graph.node(n) for n in pattern.nodes), key=position.__getitem__)
        in_place = nodes[0].name not in not_in_place
        key = (pattern_structure(graph, nodes, aliased, scalar_values=True), _template_key(pattern.schedule, nodes),
               in_place)
        first = made.get(key)
        if first is not None:
            kernel = first.twin(graph, nodes, pattern.schedule)
        else:
            kernel = made[key] = generate(graph, nodes, pattern.schedule, in_place=in_place)
            if kernel.name in named:  # the runtime and the tuner tell a program's kernels apart by name
                raise RuntimeError(f"plan for {graph.name}: the kernels of patterns at {named[kernel.name]} "
                                   f"and {nodes[0].name} are both named {kernel.name}")
            named[kernel.name] = nodes[0].name
            if generated is not None:
                generated(kernel)
        steps.append(Step("kernel", tuple(nodes), kernel))
    steps += _library_steps([graph.node(n) for n in plan.library])
    steps += [Step("view", (graph.node(n),)) for n in plan.views]
    return steps


def _library_steps(nodes: Sequence[Node]) -> list[Step]:
    """A step per library call: the outputs of one call of a multi-output op (an attention
    forward's output and log-sum-exp, its backward's three gradients) are one step, so the op runs
    once per graph call, as in eager, not once per output read."""
    calls: dict[tuple, list[Node]] = {}
    for node in nodes:
        if node.op == "library" and node.attrs["out_index"] >= 0:
            key = (node.attrs["target"], repr(node.attrs["call"]), tuple(id(x) for x in node.operands))
        else:
            key = (id(node),)
        calls.setdefault(key, []).append(node)
    return [Step("library", tuple(sorted(group, key=lambda n: n.attrs.get("out_index", -1))))
            for group in calls.values()]


def _template_key(schedule: KernelSchedule, nodes: Sequence[Node]) -> tuple:
    """``schedule`` with each group root named by its position in ``nodes``."""
    local = {node.name: i for i, node in enumerate(nodes)}
    return (tuple((local[s.root], s.dims, s.shared) for s in schedule.schedules), schedule.launch)


def dump(compiled: CompiledGraph, graph: Graph, directory: Path, arch: str | None = None) -> list[Path]:
    """Write the stages' outputs for one graph under ``directory/<graph name>/``; returns the files.
    With ``arch`` (e.g. "sm_90") every kernel is also compiled with NVRTC and ptxas's resource
    report (registers, shared memory, spills) goes to ``4-resources.txt``."""
    # A graph's name comes from user code (a function's ``__name__``) or a JSON file: only its
    # identifier characters name the directory, so it stays under ``directory``.
    safe = "".join(ch if ch.isascii() and (ch.isalnum() or ch in "_-") else "_" for ch in graph.name)
    root = directory / (safe or "graph")
    root.mkdir(parents=True, exist_ok=True)
    files = {"1-graph.txt": str(graph), "1-graph.json": graph.to_json(), "2-explore.txt": compiled.plan.explain()}
    for k, kernel in enumerate(compiled.kernels):
        plan = f"// shared memory plan:\n// {str(kernel.smem_plan).replace(chr(10), chr(10) + '// ')}\n" \
            if kernel.smem_plan is not None else ""
        files[f"3-kernel{k:03d}-{kernel.name}.cu"] = f"// template: {kernel.template}\n{plan}{kernel.cuda_source}"
    if arch is not None:
        lines = [f"ptxas resource report per kernel for {arch}:",
                 "| kernel | registers | shared bytes | spill stores | spill loads | stack bytes |",
                 "|---|---|---|---|---|---|"]
        for kernel in compiled.kernels:
            with timed("nvrtc"):
                module = kernel.compile(arch, cache_dir=compiled.options.cache_dir,
                                        cache_max_bytes=compiled.options.cache_max_bytes)
            report = module.resources.get(kernel.name)
            if report is not None:
                lines.append(f"| {kernel.name} | {report.registers} | {report.shared_bytes} | {report.spill_stores} "
                             f"| {report.spill_loads} | {report.stack_bytes} |")
        files["4-resources.txt"] = "\n".join(lines) + "\n"
    written = []
    for name, text in files.items():
        path = root / name
        path.write_text(text)
        written.append(path)
    return written


def explain(fn: Any, *example_inputs: Any, out: str | os.PathLike, train: bool = False,
            options: Options | None = None, arch: str | None = "sm_90") -> list[Path]:
    """Capture ``fn(*example_inputs)`` (a function or module) and write every stage's output for its
    graphs, forward and, with ``train``, backward, under ``out/<graph name>/``: the files
    ``fusionstitching explain`` writes for a workload. ``arch=None`` skips ptxas's resource report
    (it compiles every kernel with NVRTC). Returns the files written."""
    from fusionstitching.frontend.torch_fx import capture

    start = time.perf_counter()
    captured = capture(fn, *example_inputs, train=train, channels_last=(options or Options()).channels_last)
    seconds = time.perf_counter() - start
    return [path for _, _, files in explain_captured(captured, out, options, arch, seconds) for path in files]


def explain_captured(captured: Captured, out: str | os.PathLike, options: Options | None = None,
                     arch: str | None = "sm_90", capture_seconds: float | None = None
                     ) -> list[tuple[Graph, CompiledGraph, list[Path]]]:
    """``dump`` for each graph of ``captured``: the graph, its compiled form and the files written,
    the last of them ``5-compile-seconds.txt``, where the graph's compile went by phase
    (``_host.PHASES``; NVRTC's share is the resource report's compiles, when ``arch`` asks for them),
    with the capture's ``capture_seconds`` (tracing and conversion of all the graphs) where given."""
    result = []
    for graph in filter(None, (captured.forward, captured.backward)):
        before = dict(COMPILE_SECONDS)
        compiled = compile_graph(graph, options)
        files = dump(compiled, graph, Path(out), arch=arch)
        lines = ["| phase | seconds |", "|---|---|"]
        lines += [f"| {phase} | {COMPILE_SECONDS[phase] - before.get(phase, 0.0):.3f} |" for phase in PHASES
                  if phase not in ("tracing", "conversion")]
        if capture_seconds is not None:
            lines.append(f"| capture (tracing and conversion of every graph of the program) | {capture_seconds:.3f} |")
        path = files[0].parent / "5-compile-seconds.txt"
        path.write_text(f"compile time of {graph.name} by phase:\n" + "\n".join(lines) + "\n")
        result.append((graph, compiled, [*files, path]))
    return result


def _compile_kernels(plan: FusionPlan, options: Options, arch: str) -> None:
    """The plan's kernels generated as ``compile_plan`` generates them and compiled by NVRTC into
    the disk cache for ``arch``, in a thread pool (NVRTC runs without the interpreter lock): the
    explore-ahead worker's step after sending a plan (``fusion/background.py``). The cache's lock on
    a source makes a compile the graph's first call starts meanwhile wait for this one and read it.
    A kernel that fails is left to that call, which reports it."""
    import contextlib
    from concurrent.futures import ThreadPoolExecutor

    from fusionstitching.codegen.nvrtc import compile_cuda

    kernels = [step.kernel for step in ordered_steps(plan) if step.kernel is not None and step.kernel._twin is None]

    def build(kernel: GeneratedKernel) -> None:
        with contextlib.suppress(Exception):
            compile_cuda(kernel.cuda_source, arch, name=f"{kernel.lowered.kernel.name}.cu", cache_dir=options.cache_dir,
                         cache_max_bytes=options.cache_max_bytes)

    with ThreadPoolExecutor(max_workers=min(16, os.cpu_count() or 1, max(1, len(kernels)))) as pool:
        list(pool.map(build, kernels))

