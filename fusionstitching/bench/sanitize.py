"""``python -m fusionstitching.bench.sanitize``: compute-sanitizer over compiled workloads.

Runs ``compute-sanitizer`` with each of its memcheck, racecheck and synccheck tools (default
settings, API-error reporting on) over one child process that compiles and calls, twice each, the
micro workloads of the bench at their test sizes and one small model training step (a BERT encoder
layer), all through ``torch.compile(..., backend="fusionstitching")`` in strict mode. Prints one
line per tool with the sanitizer's error count and exits non-zero when any tool reports an error
or the child fails. There are no suppressions: a finding is a finding.

``--tools memcheck`` runs one tool; ``--workloads a,b`` a subset (names of ``bench.suite.CASES``).
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
import time

TOOLS = ("memcheck", "racecheck", "synccheck")
MODEL_STEP = "bert_layer"
# memcheck and synccheck end with "ERROR SUMMARY: N errors", racecheck with "RACECHECK SUMMARY: N hazards
# displayed (E errors, W warnings)": the errors are counted (warnings are hazards racecheck cannot confirm).
_SUMMARY = re.compile(r"ERROR SUMMARY: (\d+) error|RACECHECK SUMMARY: \d+ hazards? displayed \((\d+) error")


def _child(names: list[str]) -> None:
    """Compile and call every workload twice on the GPU (the second call takes the lean path)."""
    import torch

    import fusionstitching  # noqa: F401  (registers the backend)
    from fusionstitching.bench.suite import make_case, step_function

    device = torch.device("cuda")
    for name in names:
        case = make_case(name, small=True).to(device)
        if name == MODEL_STEP:
            case.train = True
        torch._dynamo.reset()
        compiled = torch.compile(case.fn, backend="fusionstitching", options={"strict": True})
        step = step_function(case, compiled)
        step()
        step()
        torch.cuda.synchronize()
        print(f"sanitize: {name} ran", flush=True)


def _sanitize(tool: str, names: list[str], timeout: float) -> tuple[int | None, str]:
    command = ["compute-sanitizer", "--tool", tool, sys.executable, "-m", "fusionstitching.bench.sanitize",
               "--child", ",".join(names)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=timeout, check=False)
    output = done.stdout + done.stderr
    found = _SUMMARY.search(output)
    ran = all(f"sanitize: {name} ran" in output for name in names)
    errors = None if found is None else int(found.group(1) or found.group(2))
    if errors is None or not ran or (done.returncode and not errors):
        return None, output
    return errors, output


def main(argv: list[str] | None = None) -> int:
    from fusionstitching.bench.suite import MICRO

    parser = argparse.ArgumentParser(prog="python -m fusionstitching.bench.sanitize", description=__doc__.split("\n")[0])
    parser.add_argument("--tools", default=",".join(TOOLS))
    parser.add_argument("--workloads", default=",".join((*MICRO, MODEL_STEP)))
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per tool")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        _child(args.child.split(","))
        return 0
    if shutil.which("compute-sanitizer") is None:
        print("sanitize: compute-sanitizer is not on PATH", file=sys.stderr)
        return 2
    names = args.workloads.split(",")
    failed = False
    for tool in args.tools.split(","):
        start = time.perf_counter()
        errors, output = _sanitize(tool, names, args.timeout)
        seconds = time.perf_counter() - start
        if errors is None:
            failed = True
            print(f"sanitize: {tool}: the run failed ({seconds:.0f} s); its last lines:\n" + "\n".join(
                line for line in output.splitlines() if not line.startswith("DEBUG"))[-4000:])
            continue
        failed = failed or errors > 0
        print(f"sanitize: {tool}: {errors} errors over {len(names)} workloads ({seconds:.0f} s)")
        if errors:
            first = output[output.find("========= "):][:4000]
            print(first)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
