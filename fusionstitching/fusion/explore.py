"""``explore``: Graph → FusionPlan, the fusion stage's pipeline (DESIGN.md "Fusion exploration").

1. fold transposes of transposes (``graph.transforms.fold_transposes``), give every user of a
   broadcast its own copy (``duplicate_broadcasts``) and
   split the reductions that would underfill the GPU (``split.py``), so the plan counts the
   kernels that will really run;
2. classify nodes (``legality.Roles``): inputs, library calls, fusable;
3. generate candidates (``patterns.py``: substitution fusion), each checked by ``legality.py``;
4. score them (``score.py``, ``Options.score``);
5. select disjoint, jointly acyclic patterns (``select.py``, the ILP with HiGHS); then, for up to
   ``MERGE_ROUNDS`` rounds, propose the unions of neighbouring selected patterns (exploratory
   fusion seeded with the plan) and select again while that finds patterns worth having;
6. finalize (``plan.py``): leftovers become views or single-op kernels; every edge left unfused
   gets its reason.
"""

from __future__ import annotations

import dataclasses
import time

from fusionstitching.cost.bandwidth import bandwidth_model
from fusionstitching.cost.gpu_spec import gpu_spec
from fusionstitching.fusion.legality import Legality, Roles
from fusionstitching.fusion.patterns import NeighbourMerging, SinkPacking, SubstitutionFusion
from fusionstitching.fusion.plan import Chosen, FusionPlan, finalize
from fusionstitching.fusion.score import Scorer
from fusionstitching.fusion.select import select_ilp
from fusionstitching.fusion.split import split_underfilled_reductions
from fusionstitching.graph.graph import Graph
from fusionstitching.graph.transforms import duplicate_broadcasts, fold_transposes
from fusionstitching.options import Options

MERGE_ROUNDS = 3


def explore(graph: Graph, solver: str = "ilp", options: Options | None = None) -> FusionPlan:
    """The fusion plan of ``graph`` for ``options.device`` (default: ``Options()``)."""
    options = options or Options()
    if solver != options.solver:
        options = dataclasses.replace(options, solver=solver)
    start = time.perf_counter()
    notes = []
    graph = duplicate_broadcasts(fold_transposes(graph))
    if options.split_reductions:
        spec = gpu_spec(options.device)
        graph, splits = split_underfilled_reductions(graph, spec, bandwidth_model(options.device))
        notes += [f"split {d}" for d in splits]
    roles = Roles.of(graph, options)
    legality = Legality(graph, options)
    generator = SubstitutionFusion(graph, roles, legality)
    candidates = generator.run()
    scorer = Scorer(graph, options)
    scores = [scorer.score(c.nodes, c.verdict.schedule) for c in candidates]
    selection = select_ilp(graph, [c.nodes for c in candidates], [s.value for s in scores])
    merging = NeighbourMerging(graph, roles, legality, generator.seen)
    packing = SinkPacking(graph, roles, legality, generator.seen)
    for _ in range(MERGE_ROUNDS):
        groups = [candidates[i].nodes for i in selection.chosen]
        found = merging.run(groups) + packing.run(groups + _leftovers(roles, groups))
        found_scores = [scorer.score(c.nodes, c.verdict.schedule) for c in found]
        if not any(s.value > 0 for s in found_scores):
            break
        candidates += found
        scores += found_scores
        selection = select_ilp(graph, [c.nodes for c in candidates], [s.value for s in scores])
    chosen = [Chosen(candidates[i].nodes, candidates[i].verdict.schedule, scores[i].value, candidates[i].origin)
              for i in selection.chosen]
    positive = sum(1 for s in scores if s.value > 0)
    notes.append(f"{len(candidates)} legal candidates ({positive} with a positive {options.score} score, "
                 f"{len(generator.rejections)} proposals rejected); ILP objective {selection.objective:.1f} us "
                 f"in {selection.rounds} round(s), {len(selection.cycle_constraints)} cycle constraint(s)")
    plan = finalize(graph, roles, legality, scorer, chosen, f"fusionstitching ({options.solver}, {options.device})",
                    notes)
    notes.append(f"schedule checks: {legality.feasible_calls} lowered, {legality.cache_hits} answered by "
                 "structure from the cache")
    plan.seconds = time.perf_counter() - start
    return plan


def _leftovers(roles: Roles, groups) -> list[tuple]:
    covered = {n for g in groups for n in g}
    return [(n,) for n in roles.fusable if n not in covered]
