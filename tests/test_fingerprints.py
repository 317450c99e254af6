"""The net under restructurings: the plans and the CUDA C of the graphs of 1,000 fuzzer programs
(tests/data/fingerprints.jsonl.gz, IR JSON with their fingerprints) stay what they were.

A change that means to keep what the compiler produces must keep them. A change that means to
alter plans or kernels regenerates the file and says so in its commit:

    python -m fusionstitching.fuzz.fingerprints --update tests/data/fingerprints.jsonl.gz
"""

from __future__ import annotations

from pathlib import Path

from fusionstitching.fuzz.fingerprints import check, read

DATA = Path(__file__).parent / "data" / "fingerprints.jsonl.gz"


def test_the_plans_and_kernels_of_the_stored_fuzzer_graphs_are_unchanged():
    entries = read(DATA)
    assert len({e.program for e in entries}) >= 900 and len(entries) >= 1000
    changed = check(entries)
    assert not changed, f"{len(changed)} of {len(entries)} graphs changed, e.g. {changed[:5]}"


def test_the_check_sees_a_changed_kernel():
    entry = read(DATA)[0]
    altered = type(entry)(**{**entry.__dict__, "cuda": "0" * 20})
    assert check([altered]) == [f"{entry.program} {entry.part}: the CUDA C differs"]


def test_a_graph_gets_one_plan_in_every_process():
    """Program 2024:52's backward graph needs 30 rounds of cycle constraints. With the rounds bounded
    in seconds, and nodes hashed by address, it got three different plans in three processes."""
    import os
    import subprocess
    import sys

    script = ("from fusionstitching.fuzz.fingerprints import read, fingerprints\n"
              "from fusionstitching.graph.serialize import from_json\n"
              f"e = next(x for x in read({str(DATA)!r}) if x.program == '2024:52' and x.part == 'backward')\n"
              "print(*fingerprints(from_json(e.graph), e.solver, e.generators))\n")
    root = Path(__file__).resolve().parent.parent
    runs = [subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True, cwd=root,
                           env={**os.environ, "PYTHONPATH": str(root), "PYTHONHASHSEED": seed}).stdout.split()[-2:]
            for seed in ("0", "1")]
    stored = next(e for e in read(DATA) if e.program == "2024:52" and e.part == "backward")
    assert runs[0] == runs[1] == [stored.plan, stored.cuda]
