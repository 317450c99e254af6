"""The fuzz run: programs 0..N-1 of a seed, each generated, checked, and shrunk when it fails.

Program k runs with the options ``config_for(k)``: the selectors (ILP, beam) and the generator sets
of ``GENERATOR_SETS`` take turns, so every combination runs every ``len(CONFIGS)`` programs. A
failing program is shrunk (``shrink.py``) and saved as ``DIR/fuzz_S_k.py``; its line names ``S:k``
for ``fusionstitching fuzz --replay S:k``. The last line of a run is
``fuzz: N graphs, M mismatches, K errors``.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

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
DEFAULT_OUT = "fuzz-failures"


def config_for(k: int) -> Config:
    return CONFIGS[k % len(CONFIGS)]


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
    plans: bool = True  # the plan check (capture + compile_graph, every kernel simulated)
    shrink: Budget | None = Budget()  # None: failures are saved as they are
    timeout_s: float | None = 60.0


def fuzz(jobs: Iterable[tuple[int, int]], settings: Settings = Settings(), log: Callable[[str], None] = print,
         verbose: bool = False, progress_every: int = 25) -> Summary:
    """Check program k of seed S for each ``(S, k)`` of ``jobs``; log failures and progress."""
    summary = Summary()
    start = time.perf_counter()
    for seed, k in jobs:
        program = generate(seed, k, settings.features)
        config = config_for(k)
        if verbose:
            log(f"fuzz: program {program.ident} ({config}; {describe(program)}):\n{source(program)}")
        outcome = check(program, config, settings.device, settings.plans, settings.timeout_s)
        summary.graphs += 1
        summary.coverage.add(program, config, outcome)
        if verbose:
            log(f"fuzz: program {program.ident}: {outcome.line() if outcome.status != 'ok' else 'ok'} "
                f"({outcome.seconds:.1f} s, {len(outcome.kernels)} kernels)")
        if outcome.failed:
            summary.mismatches += outcome.status == "mismatch"
            summary.errors += outcome.status == "error"
            failure = _save(program, config, outcome, settings)
            summary.failures.append(failure)
            saved = f"; reproducer {failure.path}" if failure.path else ""
            log(f"fuzz: FAIL {program.ident} ({config}): {outcome.line()}{saved}; "
                f"replay: fusionstitching fuzz --replay {program.ident}")
        if progress_every and summary.graphs % progress_every == 0:
            log(f"fuzz: {summary.graphs} graphs, {len(summary.failures)} failures, "
                f"{time.perf_counter() - start:.0f} s")
    return summary


def _save(program: Program, config: Config, outcome: Outcome, settings: Settings) -> Failure:
    shrunk = program
    if settings.shrink is not None:
        def still_fails(candidate: Program) -> bool:
            found = check(candidate, config, settings.device, settings.plans, settings.timeout_s)
            return found.failed and found.kind == outcome.kind

        shrunk = shrink(program, still_fails, settings.shrink)
    path = None
    if settings.out is not None:
        settings.out.mkdir(parents=True, exist_ok=True)
        path = settings.out / f"fuzz_{program.ident.replace(':', '_')}.py"
        path.write_text(reproducer(shrunk, config, outcome, program.ident))
    return Failure(program.ident, config, outcome, shrunk, path)


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
