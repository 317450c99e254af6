"""The estimated time of a whole plan, by the latency evaluator [C §4.3] (DESIGN.md "Fusion exploration").

Paper C picks the final plan among the beam search's candidates "with the more accurate cost model
latency-evaluator" [C §5.3]; the comparison table of the generators uses the same number. A kernel
of a plan costs

    T(P) = max(L(P), M(V(P))) + φ

with L = N_wave × L_warp (``cost/latency.py``, launch dims of the schedule the plan carries; at
least N_wave × the round trips to memory the busiest block of a packed kernel makes in sequence,
``schedule.packing.serial_rounds``), M(V)
the memory time of the bytes the kernel reads and writes (``cost/bandwidth.py``, the same ``V`` as
the delta evaluator's ``pattern_bytes``, scaled by the sectors its schedule's accesses move per
byte used, ``score.access_factor``) and φ the launch cost. The plan's time is the sum over its
generated kernels: kernels of one stream run one after the other. Library calls are left out: every
plan of one graph makes the same library calls (``legality.Roles``), so they add the same constant
to every candidate; views cost nothing.

Simplifications, those of ``cost/latency.py``: 16 registers per thread and no shared-memory term in
the occupancy; L and M overlap perfectly.
"""

from __future__ import annotations

from collections.abc import Sequence

from fusionstitching.fusion.plan import FusionPlan
from fusionstitching.fusion.score import (
    Scorer,
    access_factor,
    counts_as_kernel,
    pattern_bytes,
)
from fusionstitching.graph.graph import Graph, Node
from fusionstitching.options import Options
from fusionstitching.schedule.template import KernelSchedule


def kernel_time_us(scorer: Scorer, nodes: Sequence[Node], schedule: KernelSchedule | None) -> float:
    """T(P) of one generated kernel (see the module docstring); a lone reshape is a copy kernel."""
    memory = scorer.memory.time_us(pattern_bytes(scorer.graph, nodes) * access_factor(scorer.graph, schedule))
    latency = 0.0
    if schedule is not None and any(counts_as_kernel(n) for n in nodes):
        latency = scorer.latency_us(nodes, schedule)
    return max(latency, memory) + scorer.launch_us


def plan_time_us(plan: FusionPlan, options: Options | None = None, scorer: Scorer | None = None) -> float:
    """Σ T(P) over the plan's kernels, in µs, for ``options.device``."""
    graph: Graph = plan.graph
    scorer = scorer or Scorer(graph, options or Options())
    known = scorer.kernel_times if scorer.graph is graph else {}
    total = 0.0
    for pattern in plan.patterns:
        key = (pattern.nodes, pattern.schedule)
        us = known.get(key)
        if us is None:
            us = known[key] = kernel_time_us(scorer, [graph.node(name) for name in pattern.nodes], pattern.schedule)
        total += us
    return total


__all__ = ["kernel_time_us", "plan_time_us"]
