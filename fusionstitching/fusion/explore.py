"""``explore``: Graph → FusionPlan, the fusion stage's pipeline (DESIGN.md "Fusion exploration").

1. sum one-hot rows as their one value (``graph.transforms.sum_one_hots``: a cross-entropy
   backward's sum of its loss gradient), add a check output for each gather that no kernel
   reads in full, so that every index is range-checked (``graph.transforms.check_indices``; before the next step, which drops a gather
   read only by an empty tensor), replace computations on empty tensors by constants
   (``fold_empty``), fold
   chains of views and views that change nothing (``fold_views``), merge nodes that compute
   the same value (``merge_duplicates``), give every user of a broadcast its own copy
   (``duplicate_broadcasts``), let half GEMMs whose f32 conversion is a
   graph output write f32 (``widen_dots``, when ``Options.widen_dots``), pad the operands of library
   GEMMs whose rows are not whole 16-byte vectors (``padding.py``, when ``Options.pad_gemms``) and
   split the reductions that would underfill the GPU (``split.py``), so the plan counts the
   kernels that will really run;
2. classify nodes (``legality.Roles``): inputs, library calls, fusable;
3. generate candidates with the graph-seeded generators named in ``generators``, each candidate
   checked by ``legality.py``:

   - ``substitution``: substitution fusion with multi-step partition ops [B §4.2.1] (``patterns.py``);
   - ``deep``: span-layer deep fusion and ElementwiseFusion [A §3.2] (``deep.py``);
   - ``exploratory``: exploratory fusion from seed patterns [B §4.2.2] (``exploratory.py``);
   - ``dp``: approximate-DP PatternReduction, top-k per vertex [C §5.2] (``dp.py``);
4. score them (``score.py``, ``Options.score``);
5. select disjoint, jointly acyclic patterns: ``solver="ilp"`` (``select.py``, [B §4.1]) or
   ``solver="beam"`` (``beam.py``, [C §5.3]); then, for up to ``MERGE_ROUNDS`` rounds, run the
   plan-seeded generators named in ``generators`` on the selected plan and select again while they
   find patterns worth having:

   - ``merging``: unions of neighbouring patterns (``patterns.NeighbourMerging``);
   - ``packing``: packing of small patterns that feed only outputs (``patterns.SinkPacking``);
   - ``remote``: remote fusion through a virtual producer [C §5.2, Figure 5] (``remote.py``);
6. finalize (``plan.py``): leftovers become views or single-op kernels; every edge left unfused
   gets its reason. Every selection made on the way (each round's ILP plan; each round's buffer
   sets of the beam search) is finalized, and the latency evaluator (``estimate.py``) picks the final
   plan among them, as paper C picks among the beam's buffer sets [C §5.3]: the delta score the
   selectors maximize is an approximation, so a later round is kept only when it is estimated faster.

[Note: the default generators]
``FUSION_I`` is the set the first version of this stage ran, kept for comparison. ``DEFAULT_GENERATORS``
was chosen by measurement: ``python -m fusionstitching.bench.fusion_table`` explores every workload of
``bench/workloads.py`` and the 12-layer BERT forward and training graphs with every generator set ×
selector; ``bench/fusion_table.md`` has the table, its figures and the reasons. In short: remote
fusion is what pays most, deep fusion adds a little (the lowest estimated time over all graphs of
the sets that explore BERT-12 in seconds); exploratory fusion and the DP add little at several
seconds each; the ILP beats the beam search. The default (ILP) is never worse than Fusion I in
kernels or estimated time on any of those graphs.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Mapping, Sequence

from fusionstitching._host import collector_paused
from fusionstitching.cost.bandwidth import bandwidth_model
from fusionstitching.cost.gpu_spec import gpu_spec
from fusionstitching.fusion import background
from fusionstitching.fusion.beam import select_beam
from fusionstitching.fusion.deep import DeepFusion
from fusionstitching.fusion.dp import PatternReduction
from fusionstitching.fusion.estimate import plan_time_us
from fusionstitching.fusion.exploratory import ExploratoryFusion
from fusionstitching.fusion.gemm_bias import bias_into_gemms
from fusionstitching.fusion.legality import Legality, Roles
from fusionstitching.fusion.padding import pad_unaligned_dots
from fusionstitching.fusion.patterns import Candidate, NeighbourMerging, SinkPacking, SubstitutionFusion
from fusionstitching.fusion.plan import Chosen, FusionPlan, finalize
from fusionstitching.fusion.remote import RemoteFusion
from fusionstitching.fusion.score import Scorer
from fusionstitching.fusion.select import Selection, select_ilp
from fusionstitching.fusion.split import part_kernels, split_underfilled_reductions
from fusionstitching.graph.analysis import in_place_outputs, pattern_structure
from fusionstitching.graph.collapse import collapse_reduced_runs
from fusionstitching.graph.graph import Graph, Node
from fusionstitching.graph.layout import (
    convolution_bias_apart,
    laid_out_convolutions,
    permuted_library_layouts,
)
from fusionstitching.graph.refine import refine_reshaped_regions
from fusionstitching.graph.transforms import (
    check_indices,
    duplicate_broadcasts,
    fold_empty,
    fold_views,
    merge_duplicates,
    reduce_in_two_steps,
    sum_one_hots,
    widen_dots,
)
from fusionstitching.options import Options
from fusionstitching.schedule.tune import canonical, model_choice, refit, renamed

MERGE_ROUNDS = 4
SOLVERS = ("ilp", "beam")
GRAPH_SEEDED = ("substitution", "deep", "exploratory", "dp")
PLAN_SEEDED = ("merging", "packing", "remote")
GENERATORS = GRAPH_SEEDED + PLAN_SEEDED
FUSION_I = ("substitution", "merging", "packing")
logger = logging.getLogger(__name__)
DEFAULT_GENERATORS = ("substitution", "deep", "merging", "packing", "remote")


class _Context:
    """What every generator of one exploration shares: graph, roles, legality, scorer and the set of
    unions already proposed (so that no union is checked twice)."""

    def __init__(self, graph: Graph, roles: Roles, legality: Legality, scorer: Scorer) -> None:
        self.graph = graph
        self.roles = roles
        self.legality = legality
        self.scorer = scorer
        self.seen: set[frozenset[Node]] = set()
        self.rejected = 0

    def graph_seeded(self, name: str) -> list[Candidate]:
        if name == "substitution":
            generator = SubstitutionFusion(self.graph, self.roles, self.legality)
            generator.seen = self.seen
        elif name == "deep":
            generator = DeepFusion(self.graph, self.roles, self.legality, self.seen)
        elif name == "exploratory":
            generator = ExploratoryFusion(self.graph, self.roles, self.legality, self.seen)
        else:
            generator = PatternReduction(self.graph, self.roles, self.legality, self.seen, self.scorer)
        found = generator.run()
        self.rejected += len(getattr(generator, "rejections", ()))
        return found

    def split_seeded(self, kernels: Sequence[Sequence[Node]]) -> list[Candidate]:
        """The kernels the reduction split built to be one (``split.part_kernels``), as candidates
        where legal: the fusable ones of their nodes."""
        found, fusable = [], set(self.roles.fusable)
        for nodes in kernels:
            members = frozenset(n for n in nodes if n in fusable)
            if not members or members in self.seen:
                continue
            self.seen.add(members)
            ordered = tuple(n for n in self.graph.nodes if n in members)
            verdict = self.legality.check(ordered)
            if verdict.legal:
                found.append(Candidate(ordered, verdict, "a variance's partial sums in one pass (split.py)"))
        return found

    def plan_seeded(self, name: str) -> Callable[[Sequence[Sequence[Node]]], list[Candidate]]:
        if name == "merging":
            return NeighbourMerging(self.graph, self.roles, self.legality, self.seen).run
        if name == "packing":
            packing = SinkPacking(self.graph, self.roles, self.legality, self.seen)
            return lambda groups: packing.run(list(groups) + _leftovers(self.roles, groups))
        remote = RemoteFusion(self.graph, self.roles, self.legality, self.seen, self.scorer)
        return lambda groups: remote.run(list(groups) + _leftovers(self.roles, groups))


@collector_paused()
def explore(graph: Graph, solver: str = "ilp", options: Options | None = None,
            generators: Sequence[str] = DEFAULT_GENERATORS) -> FusionPlan:
    """The fusion plan of ``graph`` for ``options.device`` (default: ``Options()``), from the candidates
    of ``generators`` (names in ``GENERATORS``), selected by ``solver`` (``"ilp"`` or ``"beam"``)."""
    options = options or Options()
    start = time.perf_counter()
    _check_arguments(solver, generators)
    checked: dict = {}  # schedule checks by pattern structure, shared by the two explorations
    prepared = _prepared(graph, options)  # the rewrites before reshapes are split, shared too
    refined = refine_reshaped_regions(prepared[0]) if options.split_reshaped_dims else prepared[0]
    split = refined is not prepared[0]
    # Split shapes fuse more, but a reshape they move next to a gather or a dot may fuse less: both
    # plans are explored and the latency evaluator chooses. An idle worker process explores the
    # unsplit one meanwhile, where there is one (``background.submit_unsplit``).
    ticket = background.submit_unsplit(prepared, solver, options, generators) if split else None
    try:
        plan = _explore(prepared, refined, solver, options, generators, checked)
    except BaseException:
        if ticket is not None:
            background.forget_unsplit(ticket)
        raise
    if split:
        unsplit = background.take_unsplit(ticket, options) if ticket is not None else None
        plain = None
        if unsplit is None or unsplit.estimated_us <= plan.estimated_us:  # not decoded unless kept
            plain = unsplit.plan(options) if unsplit is not None else None
            if plain is None:
                plain = _explore(prepared, prepared[0], solver, options, generators, checked)
        plain_us = plain.estimated_us if plain is not None else unsplit.estimated_us
        keep = plan.estimated_us < plain_us
        note = (f"reshapes resolved by splitting dims (graph/refine.py): estimated {plan.estimated_us:.1f} us "
                f"against {plain_us:.1f} us unsplit; kept {'split' if keep else 'unsplit'}")
        plan = plan if keep else plain
        plan.notes.append(note)
    plan = _model_templates(plan, options)
    plan.seconds = time.perf_counter() - start
    return plan


@collector_paused()
def unsplit_plan(prepared: tuple[Graph, tuple[str, ...]], solver: str, options: Options,
                 generators: Sequence[str]) -> FusionPlan:
    """The plan ``explore`` compares with the split one where splitting reshaped dims changes the
    graph: a ``_prepared`` graph (with its notes) explored with reshapes as they are, before the
    model's templates (the worker's half of ``explore``, ``background.submit_unsplit``)."""
    _check_arguments(solver, generators)
    return _explore(prepared, prepared[0], solver, options, generators)


@collector_paused()
def transfer(plan: FusionPlan, graph: Graph, options: Options | None = None,
             kept: Mapping[frozenset[str], str] | None = None) -> FusionPlan | None:
    """The plan of ``graph`` that groups its nodes as ``plan`` grouped those of another graph of
    the same structure (another shape specialization of one ATen graph): ``explore``'s rewrites run
    on ``graph`` (they depend on its shapes), then, where they yield the nodes ``plan.graph`` had,
    each of ``plan``'s patterns is checked again (``Legality.check``: cycles, a template that the
    code generator builds at these shapes) and finalized with its template chosen for these shapes
    (``_model_templates``). None where a node differs or a pattern is not legal here: the graph is
    then explored. Selection only optimizes; any plan of legal patterns computes the graph, so a
    transferred plan is as correct as an explored one, if not always as fast at shapes far apart.

    ``kept``: per pattern (its node names), the ``schedule.tune.form`` of the template a
    specialization of the same shape class ran (tuned or the model's); the pattern takes that
    template refitted to these shapes where it builds here (``schedule.tune.refit``), not the
    model's choice, and is listed in the plan's ``kept``."""
    options = options or Options()
    start = time.perf_counter()
    prepared = _prepared(graph, options)
    names = {n.name for n in plan.graph.nodes}
    for refined in ((refine_reshaped_regions(prepared[0]), prepared[0]) if options.split_reshaped_dims
                    else (prepared[0],)):
        rewritten, notes, _ = _rewritten(prepared, refined, options)
        if {n.name for n in rewritten.nodes} == names:
            break
    else:
        return _not_transferred(plan, graph, "its rewrites made other nodes")
    roles = Roles.of(rewritten, options)
    if not {n.name for n in roles.library} <= set(plan.library):
        return _not_transferred(plan, graph, "a node is a library call here, fused at the plan's shapes")
    legality, scorer = Legality(rewritten, options), Scorer(rewritten, options)
    fusable = set(roles.fusable)
    position = rewritten.index.position
    chosen = []
    for pattern in plan.patterns:
        nodes = tuple(sorted((rewritten.node(name) for name in pattern.nodes), key=position.__getitem__))
        if not fusable.issuperset(nodes):
            return _not_transferred(plan, graph, f"a node of kernel {pattern.nodes[0]} is not fusable here")
        verdict = legality.check(nodes)
        if not verdict.legal:
            return _not_transferred(plan, graph, f"kernel {pattern.nodes[0]}: {verdict.reason}")
        chosen.append(Chosen(nodes, verdict.schedule, pattern.score, pattern.origin))
    if not _jointly_acyclic(rewritten, [c.nodes for c in chosen]):
        return _not_transferred(plan, graph, "its kernels together make a cycle here")
    result = finalize(rewritten, roles, legality, scorer, chosen, plan.strategy, notes)
    if len(result.patterns) != len(plan.patterns):
        return _not_transferred(plan, graph, "a node is left to a kernel of its own or to PyTorch here")
    result.estimated_us = plan_time_us(result, scorer=scorer)
    result.notes.append(f"the patterns of the plan of {plan.graph.name}'s shapes, checked again at these shapes "
                        "(fusion/explore.py transfer)")
    if kept:  # the class's templates first; the model chooses for the other patterns
        result = keep_templates(result, kept, options)
    result = _model_templates(result, options)
    result.transferred = True
    result.seconds = time.perf_counter() - start
    return result


def _not_transferred(plan: FusionPlan, graph: Graph, why: str) -> None:
    logger.debug("the plan of %s is not transferred to %s: %s", plan.graph.name, graph.name, why)


def _jointly_acyclic(graph: Graph, patterns: Sequence[Sequence[Node]]) -> bool:
    """Whether contracting each pattern to one vertex leaves ``graph`` acyclic (Kahn's algorithm on
    the quotient graph), as selection guarantees for the patterns it chooses together."""
    vertex: dict[Node, object] = {}
    for k, nodes in enumerate(patterns):
        for node in nodes:
            vertex[node] = k
    successors: dict[object, set] = {}
    indegree: dict[object, int] = {}
    for node in graph.nodes:
        v = vertex.get(node, node)
        indegree.setdefault(v, 0)
        for operand in node.operands:
            u = vertex.get(operand, operand)
            indegree.setdefault(u, 0)
            if u != v and v not in successors.setdefault(u, set()):
                successors[u].add(v)
                indegree[v] = indegree.get(v, 0) + 1
    ready = [v for v, d in indegree.items() if d == 0]
    seen = 0
    while ready:
        u = ready.pop()
        seen += 1
        for v in successors.get(u, ()):
            indegree[v] -= 1
            if indegree[v] == 0:
                ready.append(v)
    return seen == len(indegree)


def _model_templates(plan: FusionPlan, options: Options) -> FusionPlan:
    """Each pattern takes the template the latency evaluator ranks first where it beats the default
    rule's (``schedule.tune.model_choice``); patterns of one structure and template are decided once.
    The patterns of ``plan.kept`` (``keep_templates``) keep theirs."""
    graph = plan.graph
    spec, bandwidth = gpu_spec(options.device), bandwidth_model(options.device)
    aliased = in_place_outputs(graph)
    position = graph.index.position
    decided: dict[tuple, str] = {}
    patterns, changed = [], 0
    for pattern in plan.patterns:
        if pattern.schedule is None or frozenset(pattern.nodes) in plan.kept:
            patterns.append(pattern)
            continue
        nodes = sorted((graph.node(n) for n in pattern.nodes), key=position.__getitem__)
        key = (pattern_structure(graph, nodes, aliased), canonical(pattern.schedule, nodes))
        text = decided.get(key)
        if text is None:
            text = decided[key] = canonical(model_choice(graph, nodes, pattern.schedule, spec, bandwidth,
                                                         options.smem_limit), nodes)
        if text != key[1]:
            pattern = dataclasses.replace(pattern, schedule=renamed(text, nodes))
            changed += 1
        patterns.append(pattern)
    if changed:
        plan = dataclasses.replace(plan, patterns=tuple(patterns), notes=list(plan.notes))
        plan.notes.append(f"model templates: {changed} pattern(s) take the latency evaluator's first template "
                          "over the default rule's (schedule/tune.py model_choice)")
    return plan


def keep_templates(plan: FusionPlan, kept: Mapping[frozenset[str], str], options: Options) -> FusionPlan:
    """``plan`` (explored, or read from the plan cache) with each pattern of ``kept`` taking the kept
    template refitted to its shapes where it builds (``transfer``'s ``kept``), listed in its
    ``kept``."""
    graph = plan.graph
    position = graph.index.position
    patterns, taken = [], set()
    for pattern in plan.patterns:
        names = frozenset(pattern.nodes)
        if pattern.schedule is not None and names in kept:
            nodes = sorted((graph.node(n) for n in pattern.nodes), key=position.__getitem__)
            template = refit(graph, nodes, kept[names], pattern.schedule, options.smem_limit)
            if template is not None:
                taken.add(names)
                pattern = dataclasses.replace(pattern, schedule=template)
        patterns.append(pattern)
    if not taken:
        return plan
    result = dataclasses.replace(plan, patterns=tuple(patterns), notes=list(plan.notes), kept=frozenset(taken))
    result.notes.append(f"{len(taken)} pattern(s) keep the templates of the shape class (schedule/tune.py refit)")
    return result


def _check_arguments(solver: str, generators: Sequence[str]) -> None:
    if solver not in SOLVERS:
        raise ValueError(f"explore: unknown solver {solver!r}; known: {', '.join(map(repr, SOLVERS))}")
    unknown = [g for g in generators if g not in GENERATORS]
    if unknown or not any(g in GRAPH_SEEDED for g in generators):
        raise ValueError(f"explore: generators {tuple(generators)!r} need one of {GRAPH_SEEDED} and only "
                         f"names of {GENERATORS}")


def _prepared(graph: Graph, options: Options) -> tuple[Graph, tuple[str, ...]]:
    """The rewrites that come before reshapes are split (the same for both explorations), with
    the notes they leave."""
    notes = []
    graph = duplicate_broadcasts(merge_duplicates(fold_views(fold_empty(check_indices(sum_one_hots(graph))))))
    unbiased = convolution_bias_apart(graph)
    if unbiased is not graph:
        graph = unbiased
        notes.append("convolutions' biases added, and their gradients summed, by generated kernels")
    if options.channels_last:
        laid_out = laid_out_convolutions(graph)
        if laid_out is not graph:
            graph = laid_out
            notes.append("convolutions read and write channels-last (NHWC) nodes")
    permuted = permuted_library_layouts(graph)
    if permuted is not graph:
        graph = permuted
        notes.append("library calls get and return permuted layouts as views (graph/layout.py)")
    return graph, tuple(notes)


def _rewritten(prepared: tuple[Graph, tuple[str, ...]], refined: Graph, options: Options
               ) -> tuple[Graph, list[str], list]:
    """The rewrites of a ``_prepared`` graph before its candidates are generated, from ``refined``:
    the prepared graph itself or with reshapes resolved by splitting dims
    (``refine_reshaped_regions``). The graph, the notes, and the reductions split
    (``split.part_kernels``'s argument)."""
    notes, splits = list(prepared[1]), []
    split, graph = refined is not prepared[0], refined
    if options.collapse_dims:
        graph = collapse_reduced_runs(graph, rows=split)
    if options.widen_dots:
        graph = widen_dots(graph)
    # widening converts of computed values, copied per user only now: refine's and widen_dots'
    # rewrites look for one convert with its users
    graph = duplicate_broadcasts(graph, computed=True)
    if options.pad_gemms:
        graph, padded = pad_unaligned_dots(graph, gpu_spec(options.device), options)
        notes += [f"pad {d}" for d in padded]
    if options.gemm_bias:
        graph, folded = bias_into_gemms(graph, options)
        notes += [f"fold {d}" for d in folded]
    if options.split_reductions:
        graph, rewritten = reduce_in_two_steps(graph)
        notes += [f"reduce {note}" for note in rewritten]
        spec = gpu_spec(options.device)
        graph, splits = split_underfilled_reductions(graph, spec, bandwidth_model(options.device),
                                                     options.smem_limit)
        notes += [f"split {d}" for d in splits]
    return graph, notes, splits


def _explore(prepared: tuple[Graph, tuple[str, ...]], refined: Graph, solver: str, options: Options,
             generators: Sequence[str], checked: dict | None = None) -> FusionPlan:
    """``explore`` of a ``_prepared`` graph from ``refined`` (``_rewritten``), before the model's
    templates; ``checked``: schedule checks by pattern structure, shared with another exploration."""
    graph, notes, splits = _rewritten(prepared, refined, options)
    roles = Roles.of(graph, options)
    legality = Legality(graph, options, checked)
    scorer = Scorer(graph, options, legality.structure)
    context = _Context(graph, roles, legality, scorer)
    candidates: list[Candidate] = []
    for name in GRAPH_SEEDED:
        if name in generators:
            candidates += context.graph_seeded(name)
    candidates += context.split_seeded(part_kernels(graph, splits) if splits else [])
    scores = [scorer.score(c.nodes, c.verdict.schedule).value for c in candidates]
    selections = _select(solver, graph, candidates, scores)
    solver_seconds = sum(s.solver_seconds for s in selections)
    plans = [_finalize(graph, roles, legality, scorer, candidates, scores, s, solver, options) for s in selections]
    plan_seeded = [context.plan_seeded(name) for name in PLAN_SEEDED if name in generators]
    for _ in range(MERGE_ROUNDS if plan_seeded else 0):
        groups = [candidates[i].nodes for i in selections[0].chosen]
        found = [c for run in plan_seeded for c in run(groups)]
        found_scores = [scorer.score(c.nodes, c.verdict.schedule).value for c in found]
        if not any(s > 0 for s in found_scores):
            break
        candidates += found
        scores += found_scores
        # candidates are only appended: the cycles found so far stay constraints (select.py)
        selections = _select(solver, graph, candidates, scores, selections[0].cycle_constraints)
        solver_seconds += sum(s.solver_seconds for s in selections)
        plans += [_finalize(graph, roles, legality, scorer, candidates, scores, s, solver, options) for s in selections]
    positive = sum(1 for s in scores if s > 0)
    best = selections[0]
    # The delta score counts no memory round trips; where some candidates recompute reductions one
    # load after another, a second selection charges them that time (``Scorer.recomputation_us``)
    # and the latency evaluator, which counts them for every plan, chooses below.
    recomputing = [scorer.recomputation_us(c.nodes, c.verdict.schedule) for c in candidates]
    if any(recomputing):
        charged = [s - r for s, r in zip(scores, recomputing)]
        recharged = _select(solver, graph, candidates, charged, best.cycle_constraints)
        solver_seconds += sum(s.solver_seconds for s in recharged)
        plans += [_finalize(graph, roles, legality, scorer, candidates, charged, s, solver, options) for s in recharged]
    notes.append(f"generators {', '.join(g for g in GENERATORS if g in generators)}: {len(candidates)} legal "
                 f"candidates ({positive} with a positive {options.score} score, {context.rejected} proposals "
                 f"rejected); {solver} objective {best.objective:.1f} us in {best.rounds} round(s), "
                 f"{len(best.cycle_constraints)} cycle constraint(s); {solver_seconds:.2f} s in the solver")
    plan = min(plans, key=lambda p: (p.estimated_us, p.kernel_count))  # of equals, the earliest
    plan.notes[:0] = notes
    if len(plans) > 1:
        estimates = ", ".join(f"{p.estimated_us:.1f}" for p in plans)
        plan.notes.append(f"candidate plans (rounds x buffer sets, recomputation charged or not) estimated at {estimates} us by the latency "
                          f"evaluator; kept number {plans.index(plan) + 1}")
    plan.notes.append(f"schedule checks: {legality.feasible_calls} lowered, {legality.cache_hits} answered by "
                      "structure from the cache")
    return plan


def _finalize(graph: Graph, roles: Roles, legality: Legality, scorer: Scorer, candidates: Sequence[Candidate],
              scores: Sequence[float], selection: Selection, solver: str, options: Options) -> FusionPlan:
    chosen = [Chosen(candidates[i].nodes, candidates[i].verdict.schedule, scores[i], candidates[i].origin)
              for i in selection.chosen]
    plan = finalize(graph, roles, legality, scorer, chosen, f"fusionstitching ({solver}, {options.device})")
    plan.estimated_us = plan_time_us(plan, scorer=scorer)
    return plan


def _select(solver: str, graph: Graph, candidates: Sequence[Candidate], scores: Sequence[float],
            known_cycles: Sequence[tuple[int, ...]] = ()) -> list[Selection]:
    patterns = [c.nodes for c in candidates]
    if solver == "beam":
        return select_beam(graph, patterns, scores)
    return [select_ilp(graph, patterns, scores, known_cycles=known_cycles)]


def _leftovers(roles: Roles, groups) -> list[tuple]:
    covered = {n for g in groups for n in g}
    return [(n,) for n in roles.fusable if n not in covered]
