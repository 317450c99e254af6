"""The comparison table of the fusion generators and selectors (``fusion/explore.py``'s default).

``python -m fusionstitching.bench.fusion_table [--quick] [--workloads a,b] [--sets ...] [--solvers ...]``
captures every workload of ``bench/workloads.py`` at benchmark sizes (``--quick``: test sizes) and
the 12-layer BERT (hidden 768, batch 8, sequence 128) forward and training graphs, explores each
graph with every generator set × selector and prints a markdown table: generated kernels, library
calls, the latency evaluator's estimate of the plan's kernels (``fusion/estimate.py``, H100) and the
exploration seconds (each exploration runs in a forked process and is stopped after ``--limit``
seconds: "> 120 s" in the table). A last table sums every column over the graphs, and checks the
condition the default must meet: no more kernels and no higher estimated time than Fusion I on any
graph.
No GPU is needed.
"""

from __future__ import annotations

import argparse
import multiprocessing
import sys
import warnings
from collections.abc import Sequence
from dataclasses import dataclass

from fusionstitching.fusion.explore import DEFAULT_GENERATORS, FUSION_I, SOLVERS, explore
from fusionstitching.graph.graph import Graph
from fusionstitching.options import Options

GENERATOR_SETS: dict[str, tuple[str, ...]] = {
    "fusion-I": FUSION_I,
    "substitution": ("substitution",),
    "fusion-I+remote": FUSION_I + ("remote",),
    "fusion-I+deep": FUSION_I + ("deep",),
    "fusion-I+exploratory": FUSION_I + ("exploratory",),
    "fusion-I+dp": FUSION_I + ("dp",),
    "fusion-I+remote+deep": FUSION_I + ("remote", "deep"),
    "deep+remote": ("deep", "merging", "packing", "remote"),
    "dp+remote": ("dp", "merging", "packing", "remote"),
    "all": ("substitution", "deep", "exploratory", "dp", "merging", "packing", "remote"),
}


@dataclass(frozen=True)
class Cell:
    kernels: int
    library: int
    estimated_us: float
    seconds: float


def graphs(names: Sequence[str], quick: bool) -> list[tuple[str, Graph]]:
    """(label, graph) of every workload named, forward and backward; ``bert12``/``bert12_train`` are the
    12-layer BERT."""
    from fusionstitching.bench.workloads import make
    from fusionstitching.frontend.torch_fx import capture

    found = []
    for name in names:
        if name.startswith("bert12"):
            workload = make("bert_train" if name.endswith("_train") else "bert", real=True, layers=12, hidden=768,
                            heads=12)
        else:
            workload = make(name, real=not quick)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            captured = capture(workload.fn, *workload.inputs, train=workload.train, name=name)
        found.append((f"{name} fwd" if captured.backward is not None else name, captured.forward))
        if captured.backward is not None:
            found.append((f"{name} bwd", captured.backward))
    return found


def measure(graph: Graph, generators: Sequence[str], solver: str, options: Options, limit_s: float) -> Cell | None:
    """One exploration, in a forked process so that one taking longer than ``limit_s`` can be stopped
    (None then: far too slow for a JIT compiler, whatever plan it would find)."""
    context = multiprocessing.get_context("fork")
    receiver, sender = context.Pipe(duplex=False)
    worker = context.Process(target=_explore_into, args=(sender, graph, generators, solver, options))
    worker.start()
    sender.close()
    cell = receiver.recv() if receiver.poll(limit_s) else None
    if worker.is_alive():
        worker.kill()
    worker.join()
    return cell


def _explore_into(sender, graph: Graph, generators: Sequence[str], solver: str, options: Options) -> None:
    plan = explore(graph, solver=solver, options=options, generators=generators)
    sender.send(Cell(plan.kernel_count, plan.library_count, plan.estimated_us or 0.0, plan.seconds))


def _text(cell: Cell | None, limit_s: float) -> str:
    if cell is None:
        return f"> {limit_s:.0f} s"
    return f"{cell.kernels} / {cell.library} / {cell.estimated_us:.0f} / {cell.seconds:.2f}"


def table(results: dict[tuple[str, str, str], Cell | None], limit_s: float, labels: Sequence[str], sets: Sequence[str],
          solvers: Sequence[str]) -> str:
    lines = ["| graph | generators | " + " | ".join(f"{s}: kernels / library / est. us / s" for s in solvers) + " |",
             "|---|---|" + "---|" * len(solvers)]
    for label in labels:
        for name in sets:
            cells = [results[(label, name, s)] for s in solvers]
            lines.append(f"| {label} | {name} | " + " | ".join(_text(c, limit_s) for c in cells) + " |")
    return "\n".join(lines)


def totals(results: dict[tuple[str, str, str], Cell | None], labels: Sequence[str], sets: Sequence[str],
           solvers: Sequence[str]) -> str:
    lines = ["| generators | selector | kernels | est. us | exploration s | graphs worse than fusion-I (ilp) |",
             "|---|---|---|---|---|---|"]
    for name in sets:
        for solver in solvers:
            cells = [results[(label, name, solver)] for label in labels]
            worse = [label for label in labels if ("fusion-I", "ilp") != (name, solver)
                     and _worse(results[(label, name, solver)], results.get((label, "fusion-I", "ilp")))]
            if any(c is None for c in cells):
                lines.append(f"| {name} | {solver} | - | - | - | {', '.join(worse)} |")
                continue
            lines.append(f"| {name} | {solver} | {sum(c.kernels for c in cells)} | "
                         f"{sum(c.estimated_us for c in cells):.0f} | {sum(c.seconds for c in cells):.1f} | "
                         f"{', '.join(worse) or 'none'} |")
    return "\n".join(lines)


def _worse(cell: Cell | None, reference: Cell | None) -> bool:
    if reference is None:
        return False
    if cell is None:
        return True
    return cell.kernels > reference.kernels or cell.estimated_us > reference.estimated_us + 1e-6


def main(argv: Sequence[str] | None = None) -> int:
    from fusionstitching.bench.workloads import WORKLOADS

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="test sizes for the workloads of bench/workloads.py")
    parser.add_argument("--workloads", default=",".join([*WORKLOADS, "bert12", "bert12_train"]))
    parser.add_argument("--sets", default=",".join(GENERATOR_SETS), help="names of GENERATOR_SETS")
    parser.add_argument("--solvers", default=",".join(SOLVERS))
    parser.add_argument("--device", default="H100")
    parser.add_argument("--limit", type=float, default=120.0, help="seconds one exploration may take")
    args = parser.parse_args(argv)
    sets = args.sets.split(",")
    if "fusion-I" not in sets:
        sets.insert(0, "fusion-I")
    solvers = args.solvers.split(",")
    options = Options(device=args.device)
    results: dict[tuple[str, str, str], Cell | None] = {}
    labels = []
    for label, graph in graphs(args.workloads.split(","), args.quick):
        labels.append(label)
        for name in sets:
            for solver in solvers:
                results[(label, name, solver)] = cell = measure(graph, GENERATOR_SETS[name], solver, options,
                                                                  args.limit)
                print(f"  {label} {name} {solver}: {cell}", file=sys.stderr, flush=True)
        print(f"{label}: done", file=sys.stderr, flush=True)
    print(f"Default generators: {', '.join(DEFAULT_GENERATORS)}\n")
    print(table(results, args.limit, labels, sets, solvers))
    print()
    print(totals(results, labels, sets, solvers))
    return 0


if __name__ == "__main__":
    sys.exit(main())
