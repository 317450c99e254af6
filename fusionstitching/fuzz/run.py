"""The fuzz run: programs 0..N-1 of a seed, each generated, checked, and shrunk when it fails.

Program k runs with the options ``config_for(k)``: the selectors (ILP, beam) and the generator sets
of ``GENERATOR_SETS`` take turns, so every combination runs every ``len(CONFIGS)`` programs, every
other round with TorchDynamo's symbolic shapes (on a GPU, every third round with CUDA-graph replay). A failing program is shrunk (``shrink.py``) and saved as
``DIR/fuzz_S_k.py``; its line names ``S:k`` and the command that replays it
(``fusionstitching fuzz --replay S:k``, with the run's ``--skip`` and ``--device``). Programs may run
in worker processes (``workers``, ``--jobs``); what is reported does not depend on how many. The
last line of a run is ``fuzz: N graphs, M mismatches, K errors``.
"""

from __future__ import annotations

import argparse
import dataclasses
import multiprocessing
import random
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fusionstitching.fusion.explore import DEFAULT_GENERATORS, FUSION_I, GENERATORS, SOLVERS
from fusionstitching.fuzz.check import Config, Outcome, check
from fusionstitching.fuzz.coverage import Coverage
from fusionstitching.fuzz.generate import FEATURES, generate
from fusionstitching.fuzz.programs import Program, describe, source
from fusionstitching.fuzz.shrink import Budget, reproducer, shrink

GENERATOR_SETS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("default", DEFAULT_GENERATORS),
    ("fusion-I", FUSION_I),
    ("substitution", ("substitution",)),
    ("deep+remote", ("deep", "merging", "packing", "remote")),
    ("exploratory", ("exploratory", "merging", "packing")),
    ("dp+remote", ("dp", "merging", "packing", "remote")),
    ("all", GENERATORS),
)
CONFIGS = tuple(Config(solver, generators, label) for label, generators in GENERATOR_SETS for solver in SOLVERS)
# Rounds of the configurations take turns: static shapes, symbolic shapes (``dynamic=True``),
# symbolic shapes compiled in the background (``async_compile``), and on a GPU also CUDA-graph replay
# (mode="reduce-overhead"). Program k's selector and generators are those of
# ``CONFIGS[k % len(CONFIGS)]`` whichever the round.
CPU_CONFIGS = CONFIGS + tuple(dataclasses.replace(c, dynamic=True) for c in CONFIGS) \
    + tuple(dataclasses.replace(c, dynamic=True, async_compile=True) for c in CONFIGS)
GPU_CONFIGS = CPU_CONFIGS + tuple(dataclasses.replace(c, mode="reduce-overhead") for c in CONFIGS)
DEFAULT_OUT = "fuzz-failures"


def config_for(k: int, device: str = "cpu") -> Config:
    configs = GPU_CONFIGS if device == "cuda" else CPU_CONFIGS
    return configs[k % len(configs)]


def fresh_seed() -> int:
    return random.SystemRandom().randrange(1 << 31)


@dataclass
class Failure:
    ident: str
    config: Config
    outcome: Outcome
    shrunk: Program
    path: Path | None


@dataclass
class Summary:
    graphs: int = 0
    mismatches: int = 0
    errors: int = 0
    failures: list[Failure] = field(default_factory=list)
    coverage: Coverage = field(default_factory=Coverage)

    def last_line(self) -> str:
        return f"fuzz: {self.graphs} graphs, {self.mismatches} mismatches, {self.errors} errors"

    def distinct(self) -> list[str]:
        """One line per kind of failure, with the programs that showed it."""
        kinds: dict[str, list[Failure]] = {}
        for failure in self.failures:
            kinds.setdefault(failure.outcome.kind, []).append(failure)
        lines = []
        for kind, found in kinds.items():
            idents = ", ".join(f.ident for f in found[:8]) + (" ..." if len(found) > 8 else "")
            lines.append(f"  {kind}: {len(found)} program(s): {idents}; e.g. {found[0].outcome.line()}")
        return lines


@dataclass(frozen=True)
class Settings:
    device: str = "cpu"
    out: Path | None = Path(DEFAULT_OUT)  # None: failures are not saved
    features: frozenset[str] = frozenset(FEATURES)
    plans: str = "auto"  # the plan check (check.PLAN_CHECKS): auto, off, compile or simulate
    shrink: Budget | None = field(default_factory=Budget)  # None: failures are saved as they are
    timeout_s: float | None = 30.0


def fuzz(jobs: Iterable[tuple[int, int]], settings: Settings = Settings(), log: Callable[[str], None] = print,
         verbose: bool = False, progress_every: int = 25, workers: int = 1, deadline_s: float | None = None) -> Summary:
    """Check program k of seed S for each ``(S, k)`` of ``jobs`` (in ``workers`` processes); log
    failures and progress in the order of ``jobs``. Past ``deadline_s`` seconds no further result
    is taken: the summary counts the programs checked until then."""
    summary = Summary()
    start = time.perf_counter()
    for result in _results(list(jobs), settings, workers):
        if deadline_s is not None and time.perf_counter() - start > deadline_s:
            log(f"fuzz: deadline of {deadline_s:.0f} s reached after {summary.graphs} graphs")
            break
        program, config, outcome = result.program, result.config, result.outcome
        if verbose:
            log(f"fuzz: program {program.ident} ({config}; {describe(program)}):\n{source(program)}")
            log(f"fuzz: program {program.ident}: {outcome.line() if outcome.status != 'ok' else 'ok'} "
                f"({outcome.seconds:.1f} s, {len(outcome.kernels)} kernels)")
        summary.graphs += 1
        summary.coverage.add(program, config, outcome)
        if result.failure is not None:
            summary.mismatches += outcome.status == "mismatch"
            summary.errors += outcome.status == "error"
            summary.failures.append(result.failure)
            saved = f"; reproducer {result.failure.path}" if result.failure.path else ""
            log(f"fuzz: FAIL {program.ident} ({config}): {outcome.line()}{saved}; "
                f"replay: {replay_command(program.ident, settings)}"
                + (f"\n    plan check: {outcome.diagnosis}" if outcome.diagnosis else ""))
        if progress_every and summary.graphs % progress_every == 0:
            log(f"fuzz: {summary.graphs} graphs, {len(summary.failures)} failures, "
                f"{time.perf_counter() - start:.0f} s")
    return summary


@dataclass
class _Result:
    program: Program
    config: Config
    outcome: Outcome
    failure: Failure | None


def _results(jobs: Sequence[tuple[int, int]], settings: Settings, workers: int) -> Iterator[_Result]:
    """Checked in this process only for a single program (a replay, where a traceback helps) or
    with no time limit: a limit is kept by killing a worker (``_Workers``), so that even one worker
    runs in a process of its own."""
    if len(jobs) <= 1 or (workers <= 1 and not settings.timeout_s):
        yield from (_one(job, settings) for job in jobs)
        return
    yield from _Workers(max(1, workers), settings).run(jobs)


class _Workers:
    """Worker processes that check one program at a time, results in the order of the jobs.

    A worker that dies (a crash in a kernel, the allocator, the interpreter) costs only the program it
    was checking, which is reported as an error, and is replaced. A worker whose CUDA context a
    program left unusable (an illegal address, a trap: every later call would fail too) reports that
    program and exits, and a fresh one takes the next. Spawned, not forked: a forked copy of a process
    that has run TorchDynamo and torch's thread pools is unsafe.

    The time limit of a program is kept here: a worker still checking one after ``timeout_s`` is
    killed, the program is reported as timed out and a fresh worker takes the next. An exception
    raised into the worker at an arbitrary point (a signal) can land inside torch's bookkeeping of
    its dispatch modes and leave the process to abort on a consistency check.
    Shrinking a failure is not limited as a whole: the worker reports the failure first (``checked``),
    which lifts the limit, and its candidates are limited one by one in the worker."""

    def __init__(self, count: int, settings: Settings) -> None:
        self.count, self.settings = count, settings
        self.context = multiprocessing.get_context("spawn")

    def _start(self) -> tuple[Any, Any]:
        parent, child = self.context.Pipe()
        process = self.context.Process(target=_worker, args=(child, self.settings), daemon=True)
        process.start()
        child.close()
        return process, parent

    def run(self, jobs: Sequence[tuple[int, int]]) -> Iterator[_Result]:
        from multiprocessing.connection import wait

        pending = list(enumerate(jobs))[::-1]
        done: dict[int, _Result] = {}
        busy: dict[Any, _Busy] = {}  # connection → its worker
        limit = self.settings.timeout_s
        next_index = 0

        def retire(connection: Any, worker: _Busy, result: _Result | None) -> None:
            if worker.index is not None and worker.index not in done:
                done[worker.index] = result or _died(jobs[worker.index], self.settings,
                                                     worker.process.exitcode, worker.found)
            del busy[connection]
            connection.close()
            if pending:
                process, fresh = self._start()
                busy[fresh] = _Busy(process)

        try:
            for _ in range(min(self.count, len(jobs))):
                process, connection = self._start()
                busy[connection] = _Busy(process)
            while next_index < len(jobs):
                for connection, worker in list(busy.items()):
                    if worker.ready and worker.index is None and pending:
                        k, job = pending.pop()
                        try:
                            connection.send(job)
                        except OSError:  # the worker is gone before it took the job: another will
                            pending.append((k, job))
                            continue
                        worker.index, worker.found = k, None
                        worker.until = time.monotonic() + limit if limit else None
                deadlines = [w.until for w in busy.values() if w.until is not None]
                wait_s = max(0.0, min(deadlines) - time.monotonic()) if deadlines else None
                ready = wait(list(busy) + [w.process.sentinel for w in busy.values()], wait_s)
                for connection, worker in list(busy.items()):
                    if connection in ready and connection.poll():
                        try:
                            kind, payload = connection.recv()
                        except EOFError:
                            kind, payload = "eof", None
                        if kind == "ready":  # started: the time of its first job counts from here
                            worker.ready = True
                            continue
                        if kind == "checked":  # a failure being shrunk: no time limit for the whole
                            worker.found, worker.until = payload, None
                            continue
                        going = True
                        if kind == "result":
                            result, going = payload
                            done[worker.index] = result
                            worker.index, worker.found, worker.until = None, None, None
                        if not going:
                            continue
                        worker.process.join()
                    if worker.process.sentinel in ready or not worker.process.is_alive():
                        worker.process.join()
                        retire(connection, worker, None)
                    elif worker.until is not None and time.monotonic() >= worker.until:
                        worker.process.kill()
                        worker.process.join()
                        retire(connection, worker, _timed_out(jobs[worker.index], self.settings))
                while next_index in done:
                    yield done.pop(next_index)
                    next_index += 1
        finally:  # a consumer that stops early (a deadline) leaves the programs not started
            for connection, worker in busy.items():
                worker.process.kill()
                worker.process.join()
                connection.close()


@dataclass
class _Busy:
    """A worker process, the index of the job it checks, when that job's time is up, and the failure
    it reported before shrinking it."""
    process: Any
    ready: bool = False
    index: int | None = None
    until: float | None = None
    found: Outcome | None = None


def _worker(connection: Any, settings: Settings) -> None:
    """Check the jobs the parent sends. The parent keeps the time limit (``_Workers``), so the
    program itself runs without one; the candidates of a shrink are limited here."""
    connection.send(("ready", None))
    while True:
        try:
            job = connection.recv()
        except EOFError:
            return
        result = _one(job, settings, limited=False, found=lambda outcome: connection.send(("checked", outcome)))
        going = _context_lost(result.outcome)
        connection.send(("result", (result, going)))
        if going:
            return


# CUDA errors after which a process's context stays unusable: every later call fails the same way.
STICKY_CUDA_ERRORS = ("illegal memory access", "device-side assert", "unspecified launch failure",
                      "illegal instruction", "misaligned address", "an illegal address")


def _context_lost(outcome: Outcome) -> bool:
    return outcome.status == "error" and any(e in f"{outcome.message} {outcome.diagnosis}" for e in STICKY_CUDA_ERRORS)


def _died(job: tuple[int, int], settings: Settings, exitcode: int | None, found: Outcome | None = None) -> _Result:
    """The result of a job whose worker died; ``found`` is the failure it was shrinking, if any."""
    seed, k = job
    program = generate(seed, k, features_for(settings))
    config = config_for(k, settings.device)
    outcome = Outcome(status="error", where="worker", kind="worker died",
                      message=f"the worker process checking it died (exit code {exitcode})")
    if found is not None:
        outcome = dataclasses.replace(found, message=f"{found.message} (the worker died shrinking it, "
                                                     f"exit code {exitcode}: saved unshrunk)")
    failure = _save(program, config, outcome, dataclasses.replace(settings, shrink=None))
    return _Result(program, config, outcome, failure)


def _timed_out(job: tuple[int, int], settings: Settings) -> _Result:
    seed, k = job
    outcome = Outcome("timeout", message=f"still running after {settings.timeout_s:g} s",
                      seconds=settings.timeout_s or 0.0)
    return _Result(generate(seed, k, features_for(settings)), config_for(k, settings.device), outcome, None)


def _one(job: tuple[int, int], settings: Settings, limited: bool = True,
         found: Callable[[Outcome], None] | None = None) -> _Result:
    """Program k of seed S generated, checked and, when it fails, shrunk and saved. ``limited``:
    the check itself runs under ``settings.timeout_s`` (a worker's parent keeps it otherwise);
    ``found`` hears of a failure before it is shrunk."""
    seed, k = job
    program = generate(seed, k, features_for(settings))
    config = config_for(k, settings.device)
    outcome = check(program, config, settings.device, settings.plans, settings.timeout_s if limited else None)
    if not outcome.failed:
        return _Result(program, config, outcome, None)
    if found is not None:
        found(outcome)
    if _context_lost(outcome):  # the context is gone: every shrinking candidate would "fail" alike
        settings = dataclasses.replace(settings, shrink=None)
    return _Result(program, config, outcome, _save(program, config, outcome, settings))


def _save(program: Program, config: Config, outcome: Outcome, settings: Settings) -> Failure:
    shrunk, shown = program, outcome
    if settings.shrink is not None:
        def still_fails(candidate: Program) -> bool:
            found = check(candidate, config, settings.device, settings.plans, settings.timeout_s, diagnose=False)
            return found.failed and found.kind == outcome.kind

        shrunk = shrink(program, still_fails, settings.shrink)
        if shrunk != program:
            shown = check(shrunk, config, settings.device, settings.plans, settings.timeout_s)
    path = None
    if settings.out is not None:
        settings.out.mkdir(parents=True, exist_ok=True)
        path = settings.out / f"fuzz_{program.ident.replace(':', '_')}.py"
        path.write_text(reproducer(shrunk, config, shown, program.ident, replay_command(program.ident, settings)))
    return Failure(program.ident, config, outcome, shrunk, path)


def features_for(settings: Settings) -> frozenset[str]:
    """The generator parts a run uses. An out-of-range index traps a CUDA kernel, eager's as well as a
    compiled one, and a trap leaves the process's CUDA context unusable: on a GPU that case is left
    out (the other programs stay the same, ``generate.chance``)."""
    if settings.device == "cuda":
        return settings.features - {"out_of_range"}
    return settings.features


def replay_command(ident: str, settings: Settings) -> str:
    """The command that runs program ``ident`` again as this run did (same generator parts and device)."""
    skipped = sorted(set(FEATURES) - features_for(settings))
    return (f"fusionstitching fuzz --replay {ident}" + (f" --skip {','.join(skipped)}" if skipped else "")
            + (f" --device {settings.device}" if settings.device != "cpu" else ""))


def parse_replay(text: str) -> list[tuple[int, int]]:
    """``"S:k,S:k2"`` → [(S, k), (S, k2)]."""
    jobs = []
    for item in text.split(","):
        seed, _, k = item.strip().partition(":")
        if not seed.isdigit() or not k.isdigit():
            raise ValueError(f"--replay takes S:k[,S:k...], found {item!r}")
        jobs.append((int(seed), int(k)))
    return jobs


def parse_features(skip: str | None) -> frozenset[str]:
    names = {s.strip() for s in (skip or "").split(",") if s.strip()}
    unknown = names - set(FEATURES)
    if unknown:
        raise ValueError(f"--skip: unknown {', '.join(sorted(unknown))}; known: {', '.join(FEATURES)}")
    return frozenset(FEATURES) - names


def report(summary: Summary, log: Callable[[str], None] = print) -> None:
    """The coverage report, the distinct failures and, last, the summary line."""
    for line in summary.coverage.lines():
        log(line)
    if summary.failures:
        log("distinct failures:")
        for line in summary.distinct():
            log(line)
    log(summary.last_line())


def programs(seed: int, count: int) -> Sequence[tuple[int, int]]:
    return [(seed, k) for k in range(count)]


def command(args: argparse.Namespace) -> int:
    """``fusionstitching fuzz`` (arguments in ``cli.py``): the seed first when it is fresh, the failures
    as they come, then the report; 1 when a program failed, 2 for arguments it cannot use."""
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            print("fusionstitching fuzz: --device cuda, but torch sees no CUDA device", file=sys.stderr)
            return 2
    try:
        features = parse_features(args.skip)
        jobs = parse_replay(args.replay) if args.replay else None
    except ValueError as err:
        print(f"fusionstitching fuzz: {err}", file=sys.stderr)
        return 2
    if jobs is None:
        seed = args.seed
        if seed is None:
            seed = fresh_seed()
            print(f"fuzz: seed {seed}", flush=True)
        jobs = programs(seed, args.count)
    settings = Settings(device=args.device, out=Path(args.out), features=features, plans=args.plans,
                        shrink=None if args.no_shrink else Budget(checks=args.shrink_checks),
                        timeout_s=args.timeout or None)
    summary = fuzz(jobs, settings, log=lambda line: print(line, flush=True), verbose=bool(args.replay),
                   workers=args.jobs, deadline_s=args.deadline)
    report(summary)
    return 1 if summary.mismatches + summary.errors else 0
