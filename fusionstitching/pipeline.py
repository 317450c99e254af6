"""The compiler's stages, in order (DESIGN.md "Pipeline").

    capture   frontend/torch_fx.py     PyTorch function or module   → Graph (forward, backward)
    explore   fusion/explore.py        Graph                        → FusionPlan
    schedule  schedule/grouping.py     pattern                      → KernelSchedule (asked by explore)
    lower     codegen/lower.py         pattern + KernelSchedule     → Kernel IR
    render    codegen/cuda_c.py        Kernel IR                    → CUDA C
    compile   codegen/nvrtc.py         CUDA C                       → CUBIN (disk cache)
    run       runtime/executor.py      CUBINs + tensors             → outputs (CompiledGraph)

``compile_graph`` runs explore → schedule → lower → render for one graph and returns the
``CompiledGraph`` (CUBINs are compiled on the first GPU call). With ``dump_dir`` (or the
``FUSIONSTITCHING_DUMP_DIR`` environment variable, which only switches on this debug dump) every
stage's output is written as text: the graph, the plan with its reasons, and each kernel's template,
shared-memory plan and CUDA C. ``explain(fn, *example_inputs, out=DIR)`` (``fusionstitching.explain``)
writes the same for any callable's graphs, and ``fusionstitching explain WORKLOAD --out DIR`` for a
workload's, both with ptxas's resource report of every kernel.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fusionstitching._host import collector_paused
from fusionstitching.fusion import explore
from fusionstitching.fusion.explore import DEFAULT_GENERATORS
from fusionstitching.graph.graph import Graph
from fusionstitching.options import Options
from fusionstitching.runtime.executor import CompiledGraph

if TYPE_CHECKING:
    from fusionstitching.frontend.torch_fx import Captured

STAGES = ("capture", "explore", "schedule", "lower", "render", "compile", "run")
DUMP_VARIABLE = "FUSIONSTITCHING_DUMP_DIR"


@collector_paused()
def compile_graph(graph: Graph, options: Options | None = None, mode: str | None = None,
                  dump_dir: str | os.PathLike | None = None, device: Any = None,
                  output_devices: Sequence[Any] | None = None) -> CompiledGraph:
    """Plan ``graph`` and generate its kernels; dump every stage's text when asked. ``device`` and
    ``output_devices``: where the graph runs and where its outputs go (``CompiledGraph``)."""
    options = options or Options()
    plan = explore(graph, solver=options.solver, options=options,
                   generators=options.generators or DEFAULT_GENERATORS)
    compiled = CompiledGraph(plan, mode=mode, options=options, device=device, output_devices=output_devices)
    directory = dump_dir if dump_dir is not None else os.environ.get(DUMP_VARIABLE)
    if directory:
        dump(compiled, graph, Path(directory))
    return compiled


def dump(compiled: CompiledGraph, graph: Graph, directory: Path, arch: str | None = None) -> list[Path]:
    """Write the stages' outputs for one graph under ``directory/<graph name>/``; returns the files.
    With ``arch`` (e.g. "sm_90") every kernel is also compiled with NVRTC and ptxas's resource
    report (registers, shared memory, spills) goes to ``4-resources.txt``."""
    # A graph's name comes from user code (a function's ``__name__``) or a JSON file: only its
    # identifier characters name the directory, so it stays under ``directory``.
    safe = "".join(ch if ch.isascii() and (ch.isalnum() or ch in "_-") else "_" for ch in graph.name)
    root = directory / (safe or "graph")
    root.mkdir(parents=True, exist_ok=True)
    files = {"1-graph.txt": str(graph), "2-explore.txt": compiled.plan.explain()}
    for k, kernel in enumerate(compiled.kernels):
        plan = f"// shared memory plan:\n// {str(kernel.smem_plan).replace(chr(10), chr(10) + '// ')}\n" \
            if kernel.smem_plan is not None else ""
        files[f"3-kernel{k:03d}-{kernel.name}.cu"] = f"// template: {kernel.template}\n{plan}{kernel.cuda_source}"
    if arch is not None:
        lines = [f"ptxas resource report per kernel for {arch}:",
                 "| kernel | registers | shared bytes | spill stores | spill loads | stack bytes |",
                 "|---|---|---|---|---|---|"]
        for kernel in compiled.kernels:
            report = kernel.compile(arch, cache_dir=compiled.options.cache_dir,
                                    cache_max_bytes=compiled.options.cache_max_bytes).resources.get(kernel.name)
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

    return [path for _, _, files in explain_captured(capture(fn, *example_inputs, train=train), out, options, arch)
            for path in files]


def explain_captured(captured: Captured, out: str | os.PathLike, options: Options | None = None,
                     arch: str | None = "sm_90") -> list[tuple[Graph, CompiledGraph, list[Path]]]:
    """``dump`` for each graph of ``captured``: the graph, its compiled form and the files written."""
    result = []
    for graph in filter(None, (captured.forward, captured.backward)):
        compiled = compile_graph(graph, options)
        result.append((graph, compiled, dump(compiled, graph, Path(out), arch=arch)))
    return result
