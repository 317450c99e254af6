"""What a fuzz run covered: per program its op categories, dtypes and shape classes (from the program)
and the composition schemes of the kernels of its plans (from the plan check); totals over a run.

Shape classes count the dim sizes of every value: 0, 1, primes (> 2), 2^k ± 1, and the extents that
reductions (softmax and norms included) reduce: shorter than a warp, up to a block, longer than a
block. Composition schemes are those of ``check.kernel_info``. The run's headline is the share of
graphs with a kernel of at least ``BIG_KERNEL_OPS`` ops: fusion that stitches, not only packs.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field

from fusionstitching.fuzz.check import Config, Outcome
from fusionstitching.fuzz.programs import Program, concrete
from fusionstitching.schedule.template import MAX_THREADS, WARP_SIZE

BIG_KERNEL_OPS = 3
BIG_KERNEL_TARGET = 0.5
REDUCING = ("reduce", "reduce_all", "softmax", "norm")


def shape_classes(program: Program) -> set[str]:
    sizes = program.size_map
    found = set()
    for item in program.inputs + program.steps:
        for n in concrete(item.shape, sizes):
            if n == 0:
                found.add("size 0")
            elif n == 1:
                found.add("size 1")
            elif n > 2 and all(n % p for p in range(2, math.isqrt(n) + 1)):
                found.add("prime")
            if n > 2 and ((n - 1) & (n - 2) == 0 or (n + 1) & n == 0):
                found.add("2^k±1")
    for step in program.steps:
        if step.category not in REDUCING:
            continue
        operand = concrete(program.shape_of(step.operands[0]), sizes)
        result = concrete(step.shape, sizes)
        extent = math.prod(operand) // max(1, math.prod(result)) if math.prod(result) else 0
        if step.category == "softmax" or step.category == "norm":
            extent = operand[-1] if operand else 1
        if extent < WARP_SIZE:
            found.add("row < 32")
        elif extent <= MAX_THREADS:
            found.add("row 32-1024")
        else:
            found.add("row > 1024")
    return found


def special_cases(program: Program) -> set[str]:
    """The generator's special cases that the program contains."""
    found = set()
    reduced: set[str] = set()
    for step in program.steps:
        if step.category == "reduce_all" and step.operands[0] in reduced:
            found.add("scalar after a row reduction")
        if step.category in REDUCING or any(o in reduced for o in step.operands):
            reduced.add(step.name)
    if any(s.op == "expand" and s.name in program.outputs for s in program.steps):
        found.add("expand() output")
    if program.expect_error:
        found.add("out-of-range index")
    if program.backward:
        found.add("backward")
    return found


@dataclass
class Coverage:
    """Counts over a run; most count graphs (programs) that have the thing at least once."""

    graphs: int = 0
    dtypes: Counter[str] = field(default_factory=Counter)
    categories: Counter[str] = field(default_factory=Counter)
    ops: Counter[str] = field(default_factory=Counter)
    shapes: Counter[str] = field(default_factory=Counter)
    special: Counter[str] = field(default_factory=Counter)
    schemes: Counter[str] = field(default_factory=Counter)
    kernel_ops: Counter[str] = field(default_factory=Counter)  # IR ops inside generated kernels
    configs: Counter[str] = field(default_factory=Counter)
    planned: int = 0  # graphs whose plans were built (the plan check ran)
    big_kernel: int = 0  # ... with a kernel of BIG_KERNEL_OPS ops or more
    kernels: int = 0
    library_calls: int = 0
    fallbacks: int = 0
    timeouts: list[str] = field(default_factory=list)
    seconds: float = 0.0

    def add(self, program: Program, config: Config, outcome: Outcome) -> None:
        self.graphs += 1
        self.seconds += outcome.seconds
        dtypes = {i.dtype for i in program.inputs} | {s.dtype for s in program.steps}
        self.dtypes.update(program.dtype if d == "float" else d for d in dtypes)
        self.categories.update({s.category for s in program.steps})
        self.ops.update({s.op for s in program.steps})
        self.shapes.update(shape_classes(program))
        self.special.update(special_cases(program))
        self.configs[f"solver {config.solver}"] += 1
        self.configs[f"generators {config.label}"] += 1
        if outcome.status == "timeout":
            self.timeouts.append(program.ident)
        self.fallbacks += outcome.fallbacks
        if not outcome.planned:
            return
        self.planned += 1
        self.library_calls += outcome.library_calls
        self.kernels += len(outcome.kernels)
        self.schemes.update({s for k in outcome.kernels for s in k.schemes})
        self.kernel_ops.update({op for k in outcome.kernels for op in k.ir_ops})
        self.big_kernel += any(k.ops >= BIG_KERNEL_OPS for k in outcome.kernels)

    def lines(self) -> list[str]:
        n = max(self.graphs, 1)
        share = self.big_kernel / max(self.planned, 1)
        verdict = "met" if share >= BIG_KERNEL_TARGET else "NOT met"
        plans = [
            (f"  plans of {self.planned} graphs: {self.kernels} kernels, {self.library_calls} library calls, "
             f"{self.fallbacks} fallbacks"),
            "  composition schemes and tiling attributes: " + _counts(self.schemes),
            "  IR ops inside kernels: " + _counts(self.kernel_ops),
            (f"  graphs with a kernel of >= {BIG_KERNEL_OPS} ops: {self.big_kernel}/{self.planned} "
             f"({100 * share:.0f}%; target >= {100 * BIG_KERNEL_TARGET:.0f}%: {verdict})"),
        ] if self.planned else ["  plans: none built (the plan check was off)"]
        lines = [
            (f"coverage over {self.graphs} graphs ({self.seconds:.0f} s, {self.seconds / n:.2f} s per graph); "
             "counts are graphs with the item:"),
            "  dtypes (of any value): " + _counts(self.dtypes),
            "  op categories: " + _counts(self.categories),
            "  ops: " + _counts(self.ops),
            "  shapes: " + _counts(self.shapes),
            "  special cases: " + _counts(self.special),
            "  options: " + _counts(self.configs),
            *plans,
        ]
        if self.timeouts:
            lines.append(f"  timed out (not failures; replay with --replay): {', '.join(self.timeouts)}")
        return lines


def _counts(counter: Counter[str] | Iterable[tuple[str, int]]) -> str:
    items = counter.most_common() if isinstance(counter, Counter) else list(counter)
    return ", ".join(f"{name} {count}" for name, count in items) or "none"
