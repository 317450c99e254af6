"""The ``fusionstitching`` command.

``fusionstitching graph WORKLOAD [--train] [--real] [--json FILE] [--text]`` captures a workload
and prints its node count by category, the fusable fraction and the library ops by name.
``fusionstitching plan WORKLOAD [--train] [--real] [--solver ilp|beam] [--generators a,b] [--device H100]
[--explain]`` plans
the captured graphs: the patterns with their ops, the kernel counts of fusionstitching, of the
XLA-like baseline and unfused, and the exploration time.
``fusionstitching bench [WORKLOAD...] [--systems eager,inductor,fusionstitching[,xla]] [--json FILE]``
times the bench workloads (``bench/suite.py``) on every system in one process and prints a table.
``fusionstitching demo`` plans a BERT encoder layer and prints the plan (ops, composition schemes
and shared memory per kernel) and the CUDA C of its largest kernel, checks the plan with the
simulator (no GPU) or on the GPU, and on a GPU prints the bench table against eager and Inductor;
then it plans each small workload, compiles every kernel with NVRTC and checks the simulated plan.
``fusionstitching fuzz --count N [--seed S] [--device cpu|cuda] [--out DIR] [--replay S:k] [--skip ...]``
runs the differential fuzzer (``fuzz/``); its last line is ``fuzz: N graphs, M mismatches, K errors``.
``fusionstitching tune WORKLOAD... [--exhaustive] [--candidates K]`` runs each bench workload's first
call on the GPU with schedule tuning, filling the performance library (``runtime/tuner.py``);
``fusionstitching perflib [--key K] [--prune-stale] [--older-than DAYS] [--device NAME]`` lists or
prunes it.
"""

from __future__ import annotations

import argparse
import sys
import time
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from fusionstitching.graph.analysis import GraphSummary, summarize


@dataclass
class Row:
    workload: str
    graph: str
    summary: GraphSummary


def capture_workload(name: str, train: bool = False, real: bool = False):
    """The workload and its capture; ``train`` picks the ``_train`` variant or makes inputs require grad."""
    import torch

    from fusionstitching.bench.workloads import WORKLOADS, make
    from fusionstitching.frontend.torch_fx import capture

    if train and not name.endswith("_train") and f"{name}_train" in WORKLOADS:
        name = f"{name}_train"
    workload = make(name, real=real)
    if train and not workload.train:
        workload.train = True
        workload.inputs = tuple(x.detach().requires_grad_(True) if isinstance(x, torch.Tensor)
                                and x.is_floating_point() else x for x in workload.inputs)
    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        captured = capture(workload.fn, *workload.inputs, train=workload.train, name=workload.name)
    return workload, captured


def rows_for(name: str, captured) -> list[Row]:
    rows = [Row(name, "forward", summarize(captured.forward))]
    if captured.backward is not None:
        rows.append(Row(name, "backward", summarize(captured.backward)))
    return rows


def format_table(rows: Sequence[Row]) -> str:
    lines = ["| workload | graph | nodes | fusable fraction | library ops |", "|---|---|---|---|---|"]
    for row in rows:
        library = ", ".join(f"{op} x{n}" for op, n in sorted(row.summary.library_ops.items())) or "none"
        lines.append(f"| {row.workload} | {row.graph} | {row.summary.nodes} | "
                     f"{row.summary.fusable_fraction:.2f} | {library} |")
    return "\n".join(lines)


def _graph_command(args: argparse.Namespace) -> int:
    workload, captured = capture_workload(args.workload, train=args.train, real=args.real)
    for row in rows_for(workload.name, captured):
        s = row.summary
        print(f"{workload.name} {row.graph}: {s.nodes} nodes, fusable fraction {s.fusable_fraction:.2f}")
        for category, count in sorted(s.by_category.items(), key=lambda kv: -kv[1]):
            print(f"  {category:22s} {count}")
        library = ", ".join(f"{op} x{n}" for op, n in sorted(s.library_ops.items())) or "none"
        print(f"  library ops: {library}")
    if args.text:
        print(captured.forward)
        if captured.backward is not None:
            print(captured.backward)
    if args.json:
        path = Path(args.json)
        path.write_text(captured.forward.to_json())
        print(f"forward graph written to {path}")
        if captured.backward is not None:
            back = path.with_name(path.stem + ".backward" + path.suffix)
            back.write_text(captured.backward.to_json())
            print(f"backward graph written to {back}")
    return 0


def unfused_op_count(graph) -> int:
    """Kernels the graph runs with no fusion: every op but parameters, constants and reshapes (views)."""
    from fusionstitching.graph.ops import Category

    return sum(1 for n in graph.nodes
               if n.category not in (Category.PARAMETER, Category.CONSTANT) and n.op != "reshape")


def _plan_command(args: argparse.Namespace) -> int:
    from fusionstitching.fusion import baseline, explore
    from fusionstitching.options import Options

    workload, captured = capture_workload(args.workload, train=args.train, real=args.real)
    from fusionstitching.fusion.explore import DEFAULT_GENERATORS

    options = Options(device=args.device)
    generators = tuple(args.generators.split(",")) if args.generators else DEFAULT_GENERATORS
    graphs = [("forward", captured.forward)]
    if captured.backward is not None:
        graphs.append(("backward", captured.backward))
    header = ("| graph | ops | unfused kernels | baseline kernels | fusionstitching kernels | library calls "
              "| exploration s |")
    lines = [header, "|---|---|---|---|---|---|---|"]
    for label, graph in graphs:
        plan = explore(graph, solver=args.solver, options=options, generators=generators)
        base = baseline(graph, options)
        if args.explain:
            print(plan.explain())
        else:
            print(f"{workload.name} {label}: {plan.kernel_count} kernels")
            for k, pattern in enumerate(plan.patterns):
                print(f"  kernel {k} ({len(pattern)} ops): {', '.join(pattern.nodes)}")
        lines.append(f"| {label} | {len(graph.nodes)} | {unfused_op_count(graph)} | {base.kernel_count} "
                     f"| {plan.kernel_count} | {plan.library_count} | {plan.seconds:.2f} |")
    print()
    print("\n".join(lines))
    return 0


def _explain_command(args: argparse.Namespace) -> int:
    """Every stage's output for a workload's graphs under ``args.out`` (``pipeline.explain_captured``)."""
    from fusionstitching.options import Options
    from fusionstitching.pipeline import explain_captured

    start = time.perf_counter()
    _, captured = capture_workload(args.workload, train=args.train, real=args.real)
    seconds = time.perf_counter() - start
    for graph, compiled, files in explain_captured(captured, args.out, Options(device=args.device), args.arch,
                                                   seconds):
        print(f"{graph.name}: {compiled.plan.kernel_count} kernels, {compiled.plan.library_count} library calls; "
              f"{len(files)} files in {files[0].parent}")
    return 0


def _bench_command(args: argparse.Namespace) -> int:
    """``fusionstitching bench``: the table of ``bench/suite.py`` and, with ``--json``, the same as JSON."""
    import json

    from fusionstitching.bench import suite

    names = list(args.workloads) + (list(suite.ZOO) if args.zoo else [])
    names = names or list(suite.MICRO)
    systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    results = suite.run(names, systems, device=args.device, small=args.small, rounds=args.rounds,
                        warm_caches=args.warm_caches)
    device = suite.to_json(results)["device"]
    print(f"device: {device}; wall and GPU ms per call (median), kernels per call, × = that system's wall / this one's")
    print(suite.format_table(results, systems))
    if args.top:
        print()
        print(suite.format_top_kernels(results, args.top))
    if args.json:
        Path(args.json).write_text(json.dumps(suite.to_json(results), indent=1))
        print(f"results written to {args.json}")
    return 0


def _demo_command(args: argparse.Namespace) -> int:
    from fusionstitching.bench.demo import DEMO_WORKLOADS, bert_layer_demo, plan_demo

    worst = bert_layer_demo()
    print("\nSmall workloads (forward graphs): planned, every kernel compiled with NVRTC, the plan simulated:")
    for name in DEMO_WORKLOADS:
        worst = max(worst, plan_demo(name))
    return 0 if worst < 1e-5 else 1


def _fuzz_command(args: argparse.Namespace) -> int:
    """``fusionstitching fuzz``: the differential fuzzer (``fuzz/run.py``); exit status 1 on a failure."""
    from fusionstitching.fuzz.run import command

    return command(args)


def _tune_command(args: argparse.Namespace) -> int:
    """``fusionstitching tune``: run each workload's first call on the GPU with tuning on, which
    measures every pattern the performance library does not know and stores the winners."""

    import torch

    from fusionstitching.bench import suite
    from fusionstitching.runtime.tuner import COUNTS

    if not torch.cuda.is_available():
        print("fusionstitching tune: no CUDA device; tuning measures kernels on the GPU", file=sys.stderr)
        return 2
    options = {"tune": "exhaustive" if args.exhaustive else "measure", "tune_candidates": args.candidates,
               "tune_budget": float("inf")}
    if args.cache_dir:
        options["cache_dir"] = args.cache_dir
    for name in args.workloads:
        case = suite.make_case(name, small=args.small).to(torch.device("cuda"))
        before = dict(COUNTS)
        start = time.perf_counter()
        suite.step_function(case, suite._compiled(case, "fusionstitching", options=options))()
        torch.cuda.synchronize()
        seconds = time.perf_counter() - start
        tuned = COUNTS["tuned"] - before.get("tuned", 0)
        hits = COUNTS["perflib hits"] - before.get("perflib hits", 0)
        right = COUNTS["model first won"] - before.get("model first won", 0)
        print(f"{name}: {tuned} patterns measured ({right} won by the model's first choice), {hits} from the "
              f"library, first call {seconds:.1f} s")
    return 0


def _perflib_command(args: argparse.Namespace) -> int:
    """``fusionstitching perflib``: list the performance library's entries, or prune them."""
    from fusionstitching.cost.perflib import FILE_NAME, PerfLib
    from fusionstitching.options import cache_root
    from fusionstitching.runtime.gemm_timing import is_gemm_entry, library_version
    from fusionstitching.runtime.tuner import generator

    library = PerfLib(cache_root(args.cache_dir) / FILE_NAME)
    if args.prune_stale or args.older_than is not None or args.device:
        removed = library.prune(generator=(generator(), library_version()) if args.prune_stale else None,
                                older_than_s=None if args.older_than is None else args.older_than * 86400,
                                device=args.device)
        print(f"{library.path}: {removed} entries removed")
        return 0
    everything = library.winners()
    winners = [w for w in everything if not is_gemm_entry(w.generator)]
    gemms = [w for w in everything if is_gemm_entry(w.generator)]
    print(f"{library.path}: {len(winners)} patterns (generator {generator()}), {len(gemms)} GEMM problems")
    if winners:
        print("| key | GPU | pattern | chosen template | µs | model's µs | candidates | current |")
        print("|---|---|---|---|---|---|---|---|")
        for w in winners:
            print(f"| {w.key[:12]} | {w.device} | {w.description} | {w.template} | {w.us:.1f} | {w.model_us:.1f} "
                  f"| {w.candidates} | {'yes' if w.generator == generator() else 'stale'} |")
        right = sum(w.model_was_right for w in winners)
        print(f"the model's first choice was the measured winner for {right} of {len(winners)} patterns")
    if gemms:  # runtime/gemm_timing.py: unaligned GEMMs timed as they are and padded
        print("| key | GPU | GEMM | µs unaligned | µs padded | current |")
        print("|---|---|---|---|---|---|")
        for w in gemms:
            times = {m.template: m.us for m in library.measurements(w.key)}
            print(f"| {w.key[:12]} | {w.device} | {w.description} | {times.get('unaligned', float('nan')):.1f} "
                  f"| {times.get('padded', float('nan')):.1f} | {'yes' if w.generator == library_version() else 'stale'} |")
    if args.key:
        for m in library.measurements(next((w.key for w in winners if w.key.startswith(args.key)), args.key)):
            print(f"  {m.us:9.1f} µs  rank {m.model_rank}  {m.registers} registers  {m.shared_bytes} B shared  "
                  f"{m.occupancy} blocks/SM  {m.template}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="fusionstitching", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    graph = sub.add_parser("graph", help="capture a workload and summarize its graphs")
    graph.add_argument("workload")
    graph.add_argument("--train", action="store_true", help="capture forward and backward")
    graph.add_argument("--real", action="store_true", help="benchmark sizes instead of small test sizes")
    graph.add_argument("--json", metavar="FILE", help="write the forward graph (and FILE.backward) as JSON")
    graph.add_argument("--text", action="store_true", help="print the graphs as text")
    graph.set_defaults(run=_graph_command)
    plan = sub.add_parser("plan", help="plan a workload's fusion and compare with the baseline")
    plan.add_argument("workload")
    plan.add_argument("--train", action="store_true", help="plan forward and backward")
    plan.add_argument("--real", action="store_true", help="benchmark sizes instead of small test sizes")
    plan.add_argument("--solver", default="ilp", choices=["ilp", "beam"], help="plan selection (default: ilp)")
    plan.add_argument("--generators", default=None,
                      help="comma-separated candidate generators (fusion/explore.py GENERATORS; default: the default set)")
    plan.add_argument("--device", default="H100", help="GPU the plan is made for (cost model)")
    plan.add_argument("--explain", action="store_true", help="print every decision of the plan")
    plan.set_defaults(run=_plan_command)
    explain = sub.add_parser("explain", help="write every stage's output for a workload's graphs to a directory")
    explain.add_argument("workload")
    explain.add_argument("--out", required=True, help="directory for the files (one folder per graph)")
    explain.add_argument("--train", action="store_true", help="forward and backward graphs")
    explain.add_argument("--real", action="store_true", help="benchmark sizes instead of small test sizes")
    explain.add_argument("--device", default="H100", help="GPU the plan is made for (cost model)")
    explain.add_argument("--arch", default="sm_90", help="NVRTC target for the resource report")
    explain.set_defaults(run=_explain_command)
    bench = sub.add_parser("bench", help="time workloads on eager PyTorch, Inductor, fusionstitching (and XLA)")
    bench.add_argument("workloads", nargs="*",
                       help="bench workloads (bench/suite.py CASES; default: the micro workloads)")
    bench.add_argument("--zoo", action="store_true",
                       help="also the whole models (BERT, GPT-2, Llama-style, UNet block, ResNet-50)")
    bench.add_argument("--systems", default="eager,inductor,fusionstitching",
                       help=("comma-separated: eager, inductor, fusionstitching, fusionstitching-untuned, "
                             "fusionstitching-async, fusionstitching-loop, aot_eager, xla (JAX, micro workloads)"))
    bench.add_argument("--json", metavar="FILE", help="also write the results as JSON")
    bench.add_argument("--top", type=int, default=0, metavar="N",
                       help="also print each system's N kernels with the most GPU time per call (with the "
                            "bytes a generated kernel moves, and a same-size copy's time over its time)")
    bench.add_argument("--rounds", type=int, default=5, help="timing rounds (the median is reported)")
    bench.add_argument("--small", action="store_true", help="the small test sizes instead of benchmark sizes")
    bench.add_argument("--device", default=None, help="torch device (default: cuda if there is one, else cpu)")
    bench.add_argument("--warm-caches", action="store_true",
                       help="keep the compile caches (default: empty ones, so first calls compile)")
    bench.set_defaults(run=_bench_command)
    demo = sub.add_parser("demo", help="plan a BERT layer, show its kernels, check them and (on a GPU) bench them")
    demo.set_defaults(run=_demo_command)
    fuzz = sub.add_parser("fuzz", help="differential fuzzing: random programs compiled vs eager PyTorch")
    fuzz.add_argument("--count", type=int, default=100, help="programs to run (default 100)")
    fuzz.add_argument("--seed", type=int, default=None, help="run seed (default: a fresh one, printed first)")
    fuzz.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="where programs run (default cpu)")
    fuzz.add_argument("--out", default="fuzz-failures", help="directory for shrunk reproducers")
    fuzz.add_argument("--replay", metavar="S:k[,S:k]", help="run these programs only, printing their source")
    fuzz.add_argument("--skip", metavar="FEATURES", help="comma-separated generator parts to leave out "
                      "(fuzz/generate.py FEATURES, e.g. empty,scalar_after_row,expand_output,out_of_range)")
    fuzz.add_argument("--plans", default="auto", choices=["auto", "off", "compile", "simulate"],
                      help="the plan check: capture and plan each program (compile), and simulate every kernel "
                      "against the reference (simulate); auto: simulate on cuda, compile on cpu")
    fuzz.add_argument("--no-shrink", action="store_true", help="save failing programs unshrunk")
    fuzz.add_argument("--shrink-checks", type=int, default=40, help="candidates the shrinker may try")
    fuzz.add_argument("--jobs", type=int, default=1, help="worker processes (programs run in parallel)")
    fuzz.add_argument("--deadline", type=float, default=None,
                      help="seconds after which no further program is taken; the summary counts those checked")
    fuzz.add_argument("--timeout", type=float, default=30.0,
                      help="seconds per program (0: none); one still running is reported, not failed")
    fuzz.set_defaults(run=_fuzz_command)
    tune = sub.add_parser("tune", help="measure the schedules of workloads' kernels on the GPU into the performance library")
    tune.add_argument("workloads", nargs="+", help="bench workloads (bench/suite.py CASES)")
    tune.add_argument("--exhaustive", action="store_true", help="time every template of the tuning space")
    tune.add_argument("--candidates", type=int, default=6, help="templates timed per pattern (default 6)")
    tune.add_argument("--small", action="store_true", help="the small test sizes instead of benchmark sizes")
    tune.add_argument("--cache-dir", default=None, help="cache root (default: Options.cache_dir's default)")
    tune.set_defaults(run=_tune_command)
    perflib = sub.add_parser("perflib", help="list or prune the performance library")
    perflib.add_argument("--cache-dir", default=None, help="cache root (default: Options.cache_dir's default)")
    perflib.add_argument("--key", default=None, help="also list every measurement of the entry with this key prefix")
    perflib.add_argument("--prune-stale", action="store_true", help="remove entries of other generator versions")
    perflib.add_argument("--older-than", type=float, default=None, metavar="DAYS", help="remove entries older than this")
    perflib.add_argument("--device", default=None, help="remove the entries of this GPU name")
    perflib.set_defaults(run=_perflib_command)
    args = parser.parse_args(argv)
    try:
        return args.run(args)
    except KeyError as err:
        print(f"fusionstitching: {err.args[0]}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
