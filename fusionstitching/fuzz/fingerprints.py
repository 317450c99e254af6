"""Plan and CUDA fingerprints of fuzzer graphs: the net under a restructuring that must not change
what the compiler produces.

    python -m fusionstitching.fuzz.fingerprints --write FILE [--seed S] [--count N]
    python -m fusionstitching.fuzz.fingerprints --check FILE [--limit N]
    python -m fusionstitching.fuzz.fingerprints --update FILE

``--write`` captures programs 0..N-1 of seed S (the fuzzer's programs, each with the options its
index gets in a fuzz run), and stores each graph as IR JSON with the fingerprints of its plan and
of its kernels' CUDA C (gzip-compressed JSON lines). ``--check`` plans the stored graphs again and
reports every graph whose plan or CUDA differs; the check needs no TorchDynamo, so it does not
depend on the torch version that captured the graphs. ``--update`` stores the fingerprints of
today's plans and kernels for the graphs already stored (a change meant to alter plans keeps the
same graphs, where ``--write`` would capture them again with today's fuzzer and torch). Programs that do not capture or plan (the
ones the fuzzer expects to raise) are left out when writing.
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import json
import sys
import time
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class Entry:
    """One stored graph: which program it came from, its IR, its options and its fingerprints."""

    program: str  # "S:k"
    part: str  # "forward" or "backward"
    solver: str
    generators: tuple[str, ...]
    graph: str  # IR JSON
    plan: str  # sha256 of the plan's kernels (template and nodes), library calls and views
    cuda: str  # sha256 of the kernels' CUDA C


def fingerprints(graph: Any, solver: str, generators: Sequence[str]) -> tuple[str, str]:
    """(plan, CUDA) fingerprints of ``graph`` planned with ``solver`` and ``generators``."""
    from fusionstitching.codegen.cuda_c import PRELUDE
    from fusionstitching.options import Options
    from fusionstitching.pipeline import compile_graph
    from fusionstitching.schedule.template import format_template

    compiled = compile_graph(graph, Options(strict=True, solver=solver, generators=tuple(generators)))
    plan = compiled.plan
    lines = [f"{format_template(p.schedule) if p.schedule is not None else '-'} | {','.join(p.nodes)}"
             for p in plan.patterns]
    lines += [f"library {n}" for n in sorted(plan.library)]
    lines += [f"view {n}" for n in sorted(plan.views)]
    # the kernels without the prelude of helpers every kernel carries: a change to a helper is not
    # a change to 1,400 plans' kernels (the helpers are compiled and run by the codegen tests)
    cuda = "\n".join(kernel.cuda_source.replace(PRELUDE.strip(), "") for kernel in compiled.kernels)
    return _sha(lines), _sha([cuda])


def _sha(parts: Sequence[str]) -> str:
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:20]


def collect(seed: int, count: int) -> Iterator[Entry]:
    """The entries of programs 0..count-1 of ``seed``."""
    from fusionstitching.frontend.torch_fx import capture
    from fusionstitching.fuzz.generate import generate
    from fusionstitching.fuzz.programs import build
    from fusionstitching.fuzz.run import config_for
    from fusionstitching.graph.serialize import from_json

    for k in range(count):
        program = generate(seed, k)
        config = config_for(k)
        try:
            built = build(program)
            args = [x.detach().requires_grad_(program.backward and i.dtype == "float" and i.index_bound is None)
                    for x, i in zip(built.make_inputs("cpu"), program.inputs)]
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                captured = capture(built.fn, *args, train=program.backward, name=f"fuzz_{seed}_{k}")
            parts = [("forward", captured.forward), ("backward", captured.backward)]
            entries = []
            for part, graph in parts:
                if graph is None:
                    continue
                text = graph.to_json()  # fingerprinted as the check reads it back (no FX origins)
                plan, cuda = fingerprints(from_json(text), config.solver, config.generators)
                entries.append(Entry(program.ident, part, config.solver, tuple(config.generators), text, plan, cuda))
        except Exception:  # noqa: BLE001, S112 -- programs that do not compile are not part of the net
            continue
        yield from entries


def write(path: str | Path, entries: Sequence[Entry]) -> None:
    with gzip.open(path, "wt", encoding="utf-8") as out:
        for e in entries:
            out.write(json.dumps({**e.__dict__, "generators": list(e.generators)}) + "\n")


def read(path: str | Path) -> list[Entry]:
    with gzip.open(path, "rt", encoding="utf-8") as f:
        return [Entry(**{**json.loads(line), "generators": tuple(json.loads(line)["generators"])}) for line in f]


def check(entries: Sequence[Entry]) -> list[str]:
    """One line per stored graph whose plan or CUDA differs now (or that no longer compiles)."""
    from fusionstitching.graph.serialize import from_json

    changed = []
    for e in entries:
        try:
            plan, cuda = fingerprints(from_json(e.graph), e.solver, e.generators)
        except Exception as err:  # noqa: BLE001 -- reported, not raised: the check lists every change
            changed.append(f"{e.program} {e.part}: {type(err).__name__}: {err}")
            continue
        if plan != e.plan:
            changed.append(f"{e.program} {e.part}: the plan differs")
        elif cuda != e.cuda:
            changed.append(f"{e.program} {e.part}: the CUDA C differs")
    return changed


def _updated(entry: Entry) -> Entry:
    """``entry`` with the fingerprints of its graph's plan and kernels today."""
    from fusionstitching.graph.serialize import from_json

    plan, cuda = fingerprints(from_json(entry.graph), entry.solver, entry.generators)
    return Entry(**{**entry.__dict__, "plan": plan, "cuda": cuda})


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fusionstitching.fuzz.fingerprints",
                                     description=__doc__.split("\n")[0])
    action = parser.add_mutually_exclusive_group(required=True)
    action.add_argument("--write", metavar="FILE")
    action.add_argument("--check", metavar="FILE")
    action.add_argument("--update", metavar="FILE")
    parser.add_argument("--seed", type=int, default=2024)
    parser.add_argument("--count", type=int, default=1000, help="programs to capture (--write)")
    parser.add_argument("--limit", type=int, default=0, help="check only the first N graphs (--check)")
    args = parser.parse_args(argv)
    start = time.perf_counter()
    if args.write:
        entries = []
        for entry in collect(args.seed, args.count):
            entries.append(entry)
            if len(entries) % 50 == 0:
                print(f"fingerprints: {len(entries)} graphs, {time.perf_counter() - start:.0f} s", flush=True)
        write(args.write, entries)
        print(f"fingerprints: wrote {len(entries)} graphs of {args.count} programs (seed {args.seed}) to {args.write}")
        return 0
    if args.update:
        entries = read(args.update)
        write(args.update, [_updated(e) for e in entries])
        print(f"fingerprints: {len(entries)} stored graphs fingerprinted again in {args.update}, "
              f"{time.perf_counter() - start:.0f} s")
        return 0
    entries = read(args.check)
    if args.limit:
        entries = entries[: args.limit]
    changed = check(entries)
    for line in changed:
        print(line)
    print(f"fingerprints: {len(entries)} graphs checked, {len(changed)} changed, {time.perf_counter() - start:.0f} s")
    return 1 if changed else 0


if __name__ == "__main__":
    sys.exit(main())
