"""Schedule tuning at a graph's first GPU call, with the performance library [A §4.4, C §5.4].

The plan gives every pattern one template, the default rule's (the model's first choice). At the
first call of a graph on a GPU (``CompiledGraph``, unless ``Options(tune="off")``), each kernel of
the program, in program order and with the call's own input values, goes through ``Tuner.kernel_for``:

1. its key (``cost.perflib.entry_key``: the pattern's structure, shapes, dtypes and strides, the GPU,
   the generator's version) is looked up, first among this process's decisions, then in the
   performance library (``perflib.sqlite`` in the cache root): a hit gives the template, and
   nothing is measured;
2. otherwise the candidates are the plan's template and the tuning space's next best by the latency
   model (``schedule.tune.ranked_templates``; ``Options.tune_candidates`` in all, every one with
   ``tune="exhaustive"``). Each is generated and compiled (NVRTC, in parallel; the candidates of
   the patterns the program reaches next are made and compiled in the background meanwhile,
   ``_look_ahead``, so that compiles fill the cores), run once on the call's inputs and checked
   against the plan's kernel within the dtype's tolerance (a candidate that disagrees is dropped
   with a warning, and is an error under ``strict``), then timed: CUDA
   events around single launches, each after a GPU spin (so that the host's launch latency is not
   timed) and an L2 flush (a read of twice its size), candidates interleaved over rounds, the
   median per candidate. The fastest replaces the plan's template only if it beats it by more
   than the noise and, timed against it again with the inputs left in L2 by the launch before (no
   flush, as a kernel often finds them in a program), is no slower there either. Every measurement
   and the winner go to the library.
3. a template other than the plan's, measured or read from the library, is made at once for every
   kernel of the pattern in the program, and those kernels are compiled together: the scalar
   constants they inline may differ (a scale, an epsilon), so each can be a source of its own.

When the budget (``Options.tune_budget``) cannot measure every pattern, the patterns it measures are
the ones with the most to gain. ``prioritize`` orders them first by the latency evaluator's time;
if that leaves some out, a survey runs the program once, timing each pattern's plan kernel alone
(``survey_kernel``), and the order becomes the measured time beyond a same-size copy's.

Tuning never touches the user's tensors: inputs a kernel overwrites in place are replaced by
scratch copies, and outputs are scratch buffers. Kernels draw random numbers from the seed and
offset the graph reads from its inputs, so torch's generator is not advanced either. The program
then runs the chosen kernel for the call itself. A candidate whose in-place updates differ from the
plan's kernel is not considered: the order of the program's steps depends on them.

``COUNTS`` holds this process's ``"tuned"`` (patterns measured), ``"perflib hits"`` (patterns
whose template came from the library) and ``"surveyed"``, read by ``fusionstitching.stats()``.
"""

from __future__ import annotations

import functools
import logging
import statistics
import time
import warnings
from collections import Counter
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from fusionstitching._host import collector_paused
from fusionstitching.codegen.generate import GeneratedKernel, generate
from fusionstitching.cost.bandwidth import bandwidth_model
from fusionstitching.cost.gpu_spec import gpu_spec, spec_key
from fusionstitching.cost.latency import occupancy
from fusionstitching.cost.perflib import FILE_NAME, Measured, PerfLib, entry_key, generator_version
from fusionstitching.graph.analysis import in_place_outputs, pattern_structure
from fusionstitching.graph.graph import Graph, Node
from fusionstitching.options import Options
from fusionstitching.schedule.tune import canonical, iter_ranked_templates, model_estimate_us, renamed

logger = logging.getLogger(__name__)

COUNTS: Counter[str] = Counter()
ROUNDS = 10  # timed launches per candidate, interleaved
# A candidate replaces the plan's template only when it is faster by more than this fraction: the
# spread of medians of interleaved single launches on one GPU, which a choice must exceed to be one.
NOISE = 0.03
RESOLUTION_US = 0.5  # CUDA events' timing resolution
SPACER_CYCLES = 100_000  # a GPU spin before each timed launch: tens of µs, more than a launch takes the host

# (kernels, inputs, flush=True) -> per kernel its median µs, or None when it failed or disagreed;
# flush=False: inputs left in L2 by the launch before
Measure = Callable[..., list[float | None]]


class TuningWarning(UserWarning):
    """A candidate schedule was dropped (it failed to build or disagreed with the plan's kernel)."""


@functools.cache
def generator() -> str:
    """The code generator's version: a hash of the code generation and schedule sources."""
    package = Path(__file__).resolve().parent.parent
    return generator_version([package / "codegen", package / "schedule", package / "graph" / "pattern.py"])


class Tuner:
    """Chooses the template of each kernel of one graph's program (see the module note).
    ``measure`` times candidates (``GpuMeasure`` on a GPU); ``library`` is the performance library
    or None; ``device`` and ``arch`` name the GPU (``torch.cuda.get_device_name``, ``sm_90``)."""

    def __init__(self, graph: Graph, options: Options, device: str, arch: str, measure: Measure,
                 library: PerfLib | None = None, resources: Callable[[GeneratedKernel], tuple[int, int]] | None = None,
                 budget_s: float | None = None, seconds_per_character: float = 0.0,
                 kept: frozenset[frozenset[str]] = frozenset()) -> None:
        self.graph = graph
        self.options = options
        self.device = device
        self.arch = arch
        self.measure = measure
        self.library = library
        self.resources = resources  # kernel -> (registers, shared bytes), from ptxas
        key = spec_key(device) or options.device
        self.spec = gpu_spec(key)
        self.bandwidth = bandwidth_model(key)
        self._aliased = in_place_outputs(graph)
        self._decided: dict[str, str] = {}
        self._made: dict[tuple, GeneratedKernel] = {}
        # patterns (node names) whose templates were kept from a specialization of the same shape
        # class (``FusionPlan.kept``): decided as the plan made them, nothing measured
        self.kept = kept
        self.tuned = 0
        self.hits = 0
        self.kept_hits = 0
        self.model_right = 0
        self.seconds = 0.0
        # seconds of measuring (generating, compiling, timing candidates) allowed; "exhaustive": no limit
        self.budget_s = None if options.tune == "exhaustive" else budget_s
        self.over_budget = 0  # patterns left with the plan's template when the budget was spent
        self.seconds_per_character = seconds_per_character  # a candidate's predicted cost, per character
        self.at_floor = 0  # patterns not measured: their kernels take about the latency floor
        self._floored: set[str] = set()  # their keys (``decided``)
        self._worth: set[str] | None = None  # keys the budget is kept for (``prioritize``); None: all
        self._patterns: list[tuple[str, float, GeneratedKernel]] = []  # (key, worth µs, kernel), in order
        self._plan_us: dict[str, float] = {}  # kernel name -> the latency evaluator's µs (``plan_us``)
        self._keys: dict[str, str] = {}  # kernel name -> its pattern's key (``key``)
        self._surveyed: dict[str, float | None] = {}  # key -> the plan's kernel's measured µs (``survey_kernel``)
        self.surveyed = 0  # patterns timed by the survey
        self._spent = (0.0, 0)  # seconds and characters of the candidates made so far
        self._order: list[tuple[str, GeneratedKernel]] = []  # each pattern's first kernel, in program order
        self._kernels: dict[str, list[GeneratedKernel]] = {}  # key -> the program's kernels of the pattern
        # candidates made ahead (``_look_ahead``): key -> (the kernel they were made for, them, the
        # seconds making them took)
        self._prepared: dict[str, tuple[GeneratedKernel, list[GeneratedKernel], float]] = {}

    def prioritize(self, kernels: Sequence[GeneratedKernel]) -> None:
        """Keep the budget for the patterns with the most to gain: a program's kernels are tuned as
        they run, and in program order a budget spent on the first small kernels never reached a
        ResNet's large BatchNorm kernels. A pattern's worth (``_worth_us``) is its time beyond a
        copy's where the survey measured it, else the latency evaluator's time for its plan's
        template (``plan_us``: its memory time, or longer where its launch or its serial round trips
        bound it), summed over its kernels. Each costs its predicted generation and compilation
        (seconds per character of CUDA C, times the kernel's, for each candidate beyond the plan's);
        patterns are taken most worth per second first (a huge packed kernel's candidates can take
        a budget that a dozen small ones would turn into more µs), while the budget lasts; the others keep
        the plan's template unless the library knows them. The prediction starts from the graph's
        compile seconds per character, which counts exploration too; after each measured pattern
        it is what making its candidates took, and the patterns still ahead are chosen again with
        the budget left (``_choose``)."""
        firsts: dict[str, GeneratedKernel] = {}
        self._kernels = {}
        for kernel in kernels:
            key = self.key(kernel)
            firsts.setdefault(key, kernel)
            self._kernels.setdefault(key, []).append(kernel)
            self._keep(key, kernel)
        self._order = list(firsts.items())  # the order ``_look_ahead`` makes candidates in
        if self.budget_s is None:
            return
        by_key: dict[str, tuple[float, GeneratedKernel]] = {}
        for kernel in kernels:  # a pattern's time over all its kernels: its template serves them all
            key = self.key(kernel)
            total, first = by_key.get(key, (0.0, kernel))
            by_key[key] = (total + self._worth_us(key, kernel), first)
        # most worth per second of making candidates first (their cost grows with the kernel's CUDA C)
        self._patterns = sorted(((key, us, kernel) for key, (us, kernel) in by_key.items()),
                                key=lambda item: -item[1] / max(len(item[2].cuda_source), 1))
        self._choose()

    def decided(self, kernel: GeneratedKernel) -> bool:
        """Whether ``kernel``'s pattern has its template decided for its shape class: measured, read
        from the library or kept from the class; not left to the model for want of budget, nor
        passed over at the latency floor, a judgement of these sizes only (a kernel at the floor
        here may be above it at sizes of the class up to twice these)."""
        key = self.key(kernel)
        return key in self._decided and key not in self._floored

    def _keep(self, key: str, kernel: GeneratedKernel) -> str | None:
        """Where ``kernel``'s pattern is one of ``kept`` and undecided: its template, decided now."""
        if not self.kept or key in self._decided:
            return None
        nodes = self._nodes(kernel)
        if frozenset(n.name for n in nodes) not in self.kept:
            return None
        text = self._decided[key] = canonical(kernel.template, nodes)
        self.kept_hits += 1
        return text

    def _worth_us(self, key: str, kernel: GeneratedKernel) -> float:
        """What tuning ``kernel`` could gain at most, in µs: with a survey measurement, the plan's
        measured time beyond a same-size copy's (``cost.bandwidth``; no template moves its bytes
        faster); without one, the latency evaluator's time for the plan's template."""
        us = self._surveyed.get(key)
        if us is None:
            return self.plan_us(kernel)
        return max(0.0, us - self.bandwidth.time_us(kernel.moved_bytes))

    def leaves_out(self) -> bool:
        """Whether the budget, as ``prioritize`` spent it, leaves an undecided pattern unmeasured."""
        return self._worth is not None and any(key not in self._decided and key not in self._worth
                                               for key, _, _ in self._patterns)

    def survey_kernel(self, kernel: GeneratedKernel, inputs: Sequence[Any]) -> GeneratedKernel:
        """The survey's hook, in ``kernel_for``'s place (``GpuProgram.run``): times ``kernel``, the
        plan's template, alone on this call's inputs once per pattern, as the candidates are timed,
        and keeps it. Patterns the library knows are not timed. The latency evaluator misjudges some
        kernels by several times (few blocks over a long reduction, serial round trips), and its
        ordering let the budget miss them; ``prioritize`` after a survey orders by the measured
        time beyond a copy's instead. Its time counts in the budget."""
        start = time.perf_counter()
        try:
            key = self.key(kernel)
            if key in self._surveyed or key in self._decided:
                return kernel
            if self.library is not None and self.library.winner(key) is not None:
                self._surveyed[key] = None
                return kernel
            times = self.measure([kernel], inputs)
            self._surveyed[key] = times[0]
            if times[0] is not None:
                self.surveyed += 1
                COUNTS["surveyed"] += 1
            return kernel
        finally:
            self.seconds += time.perf_counter() - start

    def _choose(self) -> None:
        """``_worth``: the undecided patterns, in ``prioritize``'s order, whose predicted cost fits
        the budget left (at least the first)."""
        assert self.budget_s is not None
        left = self.budget_s - self.seconds
        self._worth, spent = set(), 0.0
        for key, _, kernel in self._patterns:
            if key in self._decided:
                continue
            if self._at_the_floor(kernel):  # never measured (``_tune``), and counted as such
                self._worth.add(key)
                continue
            cost = self.seconds_per_character * len(kernel.cuda_source) * (self.options.tune_candidates - 1)
            if spent and spent + cost > left:
                continue
            self._worth.add(key)
            spent += cost

    def _nodes(self, kernel: GeneratedKernel) -> list[Node]:
        position = self.graph.index.position
        return sorted(kernel.lowered.pattern.nodes, key=position.__getitem__)

    def key(self, kernel: GeneratedKernel) -> str:
        """The library key of ``kernel``'s pattern on this GPU (the same for every candidate of it)."""
        key = self._keys.get(kernel.name)
        if key is None:
            nodes = self._nodes(kernel)
            structure = repr((pattern_structure(self.graph, nodes, self._aliased),
                              sorted(kernel.lowered.aliases.items())))
            key = self._keys[kernel.name] = entry_key(structure, self.device, self.arch, generator())
        return key

    def kernel_for(self, kernel: GeneratedKernel, inputs: Sequence[Any]) -> GeneratedKernel:
        """The kernel to run for ``kernel``'s pattern: ``kernel`` itself, or one generated with the
        measured or stored template. ``inputs``: the pattern's input tensors for this call."""
        start = time.perf_counter()
        measured = self._spent[1]  # characters of candidates made before this call
        try:
            nodes = self._nodes(kernel)
            key = self.key(kernel)
            text = self._decided.get(key) or self._keep(key, kernel)
            if text is None:
                winner = self.library.winner(key) if self.library is not None else None
                if winner is not None:
                    text = winner.template
                    self.hits += 1
                    COUNTS["perflib hits"] += 1
                elif self.budget_s is not None and (self.seconds + time.perf_counter() - start >= self.budget_s
                                                    or (self._worth is not None and key not in self._worth)):
                    self.over_budget += 1
                    return kernel  # not decided: a later process tunes it
                elif self.library is not None:
                    with self.library.tuning(key):  # another process measuring it: wait for its winner
                        winner = self.library.winner(key)
                        if winner is not None:
                            text = winner.template
                            self.hits += 1
                            COUNTS["perflib hits"] += 1
                        else:
                            text = self._tune_or_keep(key, kernel, nodes, inputs, start)
                else:
                    text = self._tune_or_keep(key, kernel, nodes, inputs, start)
                self._decided[key] = text
                if text != canonical(kernel.template, nodes):
                    self._make_the_others(key, text, kernel)
            if text == canonical(kernel.template, nodes):
                return kernel
            try:
                chosen = self._generate(nodes, renamed(text, nodes), kernel)
            except Exception as err:  # a stored template this code cannot build: keep the plan's
                if self.options.strict:
                    raise
                warnings.warn(f"{kernel.name}: stored template {text} does not build ({err}); running the "
                              f"plan's", TuningWarning, stacklevel=2)
                return kernel
            return chosen if chosen.lowered.aliases == kernel.lowered.aliases else kernel
        finally:
            self.seconds += time.perf_counter() - start
            if self._patterns and self._spent[1] != measured:  # a pattern was measured: its cost per character
                self.seconds_per_character = self._spent[0] / self._spent[1]
                self._choose()

    def _make_the_others(self, key: str, text: str, kernel: GeneratedKernel) -> None:
        """The chosen template's kernels for the pattern's other kernels in the program
        (``prioritize``), generated now and compiled together (``measure.compile``, where it has
        one), while ``kernel_for`` counts the time. Kernels of one structure whose inlined scalar
        constants differ are not twins: each is its own source, and left to their launches they
        would compile one after another, outside the budget. One that does not
        build raises under ``strict``, else is left to ``kernel_for``, which reports it when the
        program reaches it."""
        made = []
        for other in self._kernels.get(key, ()):
            if other is kernel:
                continue
            nodes = self._nodes(other)
            try:
                made.append(self._generate(nodes, renamed(text, nodes), other))
            except Exception:  # reported by ``kernel_for`` at this kernel's turn
                if self.options.strict:
                    raise
        compile_all = getattr(self.measure, "compile", None)
        if made and compile_all is not None:
            compile_all(made)

    def _at_the_floor(self, kernel: GeneratedKernel, inputs: Sequence[Any] | None = None) -> bool:
        """Whether the kernel takes less than twice the GPU's latency floor (the time of the smallest
        copy): such a kernel is bound by latency, not by its schedule, and the few microseconds it
        takes are within the timing's noise (BERT batch 1's kernels). Judged by the kernel's
        measured time where the survey took one; else by the latency evaluator, which can put a
        kernel of few bytes whose threads loop long (a packed sub-kernel recomputing reductions, a
        block looping over a large grid) above the floor but also puts some kernels below it that
        take several times the floor (few blocks each reducing a long row). So with ``inputs`` (the
        pattern is about to be tuned), a kernel the evaluator puts at the floor is timed alone, as
        the survey times it, and judged by that: one launch's measurement, no candidate made."""
        floor = 2 * self.bandwidth.floor_us
        key = self.key(kernel)
        us = self._surveyed.get(key)
        if us is not None:
            return us < floor
        if self.plan_us(kernel) >= floor:
            return False
        if inputs is None:
            return True
        us = self._surveyed[key] = self.measure([kernel], inputs)[0]
        return us is None or us < floor

    def plan_us(self, kernel: GeneratedKernel) -> float:
        """The latency evaluator's µs for ``kernel`` (its pattern under the template it was made
        with, ``schedule.tune.model_estimate_us``)."""
        us = self._plan_us.get(kernel.name)
        if us is None:
            us = self._plan_us[kernel.name] = model_estimate_us(kernel.lowered.pattern, kernel.template, self.spec,
                                                                 self.bandwidth)
        return us

    @collector_paused()  # lowering allocates as planning does (``_host``)
    def _generate(self, nodes: list[Node], template, like: GeneratedKernel) -> GeneratedKernel:
        """The kernel for ``nodes`` under ``template`` (a pattern of the same structure and template
        made earlier in this graph gives its twin: one compile, one module)."""
        in_place = bool(like.lowered.aliases)
        made_key = (pattern_structure(self.graph, nodes, self._aliased, scalar_values=True),
                    canonical(template, nodes), in_place)
        first = self._made.get(made_key)
        if first is not None:
            return first.twin(self.graph, nodes, template)
        kernel = self._made[made_key] = generate(self.graph, nodes, template, name=like.name, in_place=in_place)
        return kernel

    def _tune_or_keep(self, key: str, kernel: GeneratedKernel, nodes: list[Node], inputs: Sequence[Any],
                      start: float) -> str:
        """``_tune``; where tuning itself fails (not the plan's kernel), the plan's template, with a
        warning (an error under ``strict``): a failure to choose never costs the graph its kernels."""
        try:
            return self._tune(key, kernel, nodes, inputs, start)
        except Exception as err:
            if self.options.strict:
                raise
            warnings.warn(f"{kernel.name}: tuning failed ({type(err).__name__}: {err}); the plan's template runs",
                          TuningWarning, stacklevel=3)
            return canonical(kernel.template, nodes)

    def _tune(self, key: str, kernel: GeneratedKernel, nodes: list[Node], inputs: Sequence[Any],
              start: float) -> str:
        """Measure the candidates of ``kernel``'s pattern (``_candidates``, or those ``_look_ahead``
        made while an earlier pattern was measured); store them; the winner's canonical text."""
        current = canonical(kernel.template, nodes)
        if self.options.tune != "exhaustive" and self._at_the_floor(kernel, inputs):
            self.at_floor += 1
            self._floored.add(key)
            return current
        prepared = self._prepared.pop(key, None)
        if prepared is not None:  # made ahead while an earlier pattern was measured
            made_for, made, made_s = prepared
            if made_for is not kernel:  # made for the pattern's first kernel, passed over then
                began = time.perf_counter()
                made = self._retargeted(made, self._nodes(made_for), nodes, kernel)
                made_s += time.perf_counter() - began
            candidates, cut = [kernel, *made], False
        else:
            candidates, cut = self._candidates(kernel, nodes, start)
            made_s = 0.0
        if len(candidates) == 1:  # the only template of the space, or the budget allowed no other
            self.over_budget += cut
            return current
        began = time.perf_counter()
        self._look_ahead(key, candidates[1:], start)
        ahead_s = time.perf_counter() - began  # counted when the patterns made ahead are measured
        times = self.measure(candidates, inputs)
        seconds, characters = self._spent
        self._spent = (seconds + time.perf_counter() - start - ahead_s + made_s,
                       characters + sum(len(c.cuda_source) for c in candidates[1:]))
        by_text = {canonical(c.template, nodes): c for c in candidates}
        measured = []
        for rank, (candidate, us) in enumerate(zip(candidates, times)):
            if us is None:
                continue
            registers, shared = self.resources(candidate) if self.resources is not None else (0, 0)
            blocks = occupancy(self.spec, candidate.template.launch.threads, shared, max(registers, 1)) \
                if registers else 0
            measured.append(Measured(canonical(candidate.template, nodes), float(us), registers, shared, blocks, rank))
        if not measured or times[0] is None:
            return current
        self.tuned += 1
        COUNTS["tuned"] += 1
        best = min(measured, key=lambda m: m.us)
        within_noise = measured[0].us <= best.us * (1 + NOISE) + RESOLUTION_US
        if within_noise or not self._faster_warm(by_text[best.template], kernel, inputs, kernel.name):
            best = measured[0]  # the model's choice
        if best.template == current:
            self.model_right += 1
            COUNTS["model first won"] += 1
        if len(candidates) > 1 and self.library is not None:
            self.library.store(key, measured, chosen=best.template, description=_describe(nodes),
                               device=self.device, arch=self.arch, generator=generator())
        logger.info("tuned %s: %d candidates, %s %.1f µs (plan's %.1f µs)", kernel.name, len(measured),
                    best.template, best.us, measured[0].us)
        return best.template

    @collector_paused()  # the ranked templates' lowering checks and the candidates' lowering
    def _candidates(self, kernel: GeneratedKernel, nodes: list[Node], start: float | None = None
                    ) -> tuple[list[GeneratedKernel], bool]:
        """``kernel`` and the tuning space's next best templates for its pattern, generated, and
        whether the budget cut them short. With ``start`` (when this pattern's tuning began), a
        candidate is made only while the budget lasts, counting each one's generation time for the
        next (a huge packed kernel's alternatives cost seconds each); without, ``_choose`` has
        already fitted the pattern's candidates in the budget."""
        current = canonical(kernel.template, nodes)
        limit = None if self.options.tune == "exhaustive" else self.options.tune_candidates
        ranked = iter_ranked_templates(self.graph, nodes, self.spec, self.bandwidth, self.options.smem_limit)
        candidates: list[GeneratedKernel] = [kernel]
        last_began = start
        while limit is None or len(candidates) < limit:
            began = time.perf_counter()
            if start is not None and last_began is not None and self.budget_s is not None:
                predicted = max(began - last_began, self.seconds_per_character * len(kernel.cuda_source))
                if began - start + self.seconds + predicted >= self.budget_s:
                    return candidates, True  # one more (as long as the last took, or as compiling one costs) overruns
            last_began = began
            template = next(ranked, None)  # its lowering check counts as part of its time
            if template is None:
                break
            if canonical(template, nodes) == current:
                continue
            made = self._candidate(nodes, template, kernel)
            if made is not None:
                candidates.append(made)
        return candidates, False

    def _candidate(self, nodes: list[Node], template, kernel: GeneratedKernel) -> GeneratedKernel | None:
        """``kernel``'s pattern generated with ``template``; None where it does not build (a warning,
        an error under ``strict``) or updates other inputs in place than ``kernel`` (the program's
        order of steps depends on them)."""
        try:
            made = self._generate(nodes, template, kernel)
        except Exception as err:
            if self.options.strict:
                raise
            warnings.warn(f"{kernel.name}: candidate {template} does not build ({err})", TuningWarning, stacklevel=5)
            return None
        return made if made.lowered.aliases == kernel.lowered.aliases else None

    def _look_ahead(self, key: str, candidates: Sequence[GeneratedKernel], start: float) -> None:
        """Where ``measure`` compiles in the background (``GpuMeasure.compile_ahead``): start
        compiling this pattern's candidates, then make the candidates of the patterns the program
        reaches next that the budget keeps (``_choose``) and start theirs, until the compiles in
        flight fill the threads or the budget is spent (``start``: when this pattern's tuning
        began). Measuring a pattern then finds its candidates compiled, or being compiled, instead
        of compiling a handful on as many cores. The time spent making them counts when they are
        measured (``_spent``)."""
        ahead = getattr(self.measure, "compile_ahead", None)
        if ahead is None:
            return
        ahead(candidates)
        keys = [k for k, _ in self._order]
        if key not in keys:
            return
        for later, kernel in self._order[keys.index(key) + 1:]:
            if self.measure.room_ahead() <= 0:
                break
            if self.budget_s is not None and self.seconds + time.perf_counter() - start >= self.budget_s:
                break
            if later in self._decided or later in self._prepared or (self._worth is not None and later not in self._worth):
                continue
            if self._at_the_floor(kernel) or (self.library is not None and self.library.winner(later) is not None):
                continue
            began = time.perf_counter()
            made, _ = self._candidates(kernel, self._nodes(kernel))
            self._prepared[later] = (kernel, made[1:], time.perf_counter() - began)
            ahead(made[1:])

    def _retargeted(self, made: Sequence[GeneratedKernel], made_nodes: list[Node], nodes: list[Node],
                    kernel: GeneratedKernel) -> list[GeneratedKernel]:
        """Candidates made for another kernel of the pattern (``made_nodes``), made again for
        ``kernel``'s ``nodes`` with the same templates (twins of them where their values agree)."""
        again = (self._candidate(nodes, renamed(canonical(c.template, made_nodes), nodes), kernel) for c in made)
        return [c for c in again if c is not None]

    def finish(self) -> None:
        """Tuning is over: background compiles not begun are dropped."""
        close = getattr(self.measure, "close", None)
        if close is not None:
            close()
        self._prepared.clear()

    def _faster_warm(self, candidate: GeneratedKernel, plan: GeneratedKernel, inputs: Sequence[Any],
                     name: str) -> bool:
        """Whether ``candidate``, faster than the plan's kernel with the caches flushed, is no slower
        than it with its inputs in L2 (each launch right after the last, nothing flushed). In a
        program a kernel's inputs are often still in L2, written by the kernel before it; a choice
        must hold at both ends, or the plan's template stays."""
        times = self.measure([plan, candidate], inputs, flush=False)
        if times[0] is None or times[1] is None:
            return False
        if times[1] > times[0] * (1 + NOISE) + RESOLUTION_US:
            logger.info("%s: %s is faster cold but slower warm (%.1f against the plan's %.1f µs); plan kept",
                        name, candidate.template, times[1], times[0])
            return False
        return True


def _describe(nodes: Sequence[Node]) -> str:
    """A short human description of a pattern for ``fusionstitching perflib``'s listing."""
    ops = Counter(n.op for n in nodes)
    shapes = sorted({n.shape for n in nodes if n.op == "reduce"} or {nodes[-1].shape}, key=len)
    text = ", ".join(f"{op}×{n}" if n > 1 else op for op, n in ops.most_common(6))
    return f"{text}; {nodes[-1].dtype.value}{list(shapes[-1])}"


# ----------------------------------------------------------------------------------------------
# On a GPU
# ----------------------------------------------------------------------------------------------


def gpu_tuner(graph: Graph, options: Options, device: Any, budget_s: float | None = None,
              seconds_per_character: float = 0.0, kept: frozenset[frozenset[str]] = frozenset()) -> Tuner:
    """The Tuner of ``graph`` on CUDA ``device``, with the library in the cache root, measuring for
    at most ``budget_s`` seconds (None: no limit); ``seconds_per_character``: what generating and
    compiling a kernel cost for this graph, per character of CUDA C; ``kept``: ``FusionPlan.kept``."""
    import torch

    from fusionstitching.options import cache_root
    from fusionstitching.runtime.kernel_call import device_arch

    arch = device_arch(device)
    name = torch.cuda.get_device_name(device)
    library = PerfLib(cache_root(options.cache_dir) / FILE_NAME)
    cache = {"cache_dir": options.cache_dir, "cache_max_bytes": options.cache_max_bytes}

    def resources(kernel: GeneratedKernel) -> tuple[int, int]:
        """(registers per thread, static shared bytes) from ptxas's report (NVRTC's disk cache)."""
        report = kernel.compile(arch, **cache).resources.get(kernel.name)
        return (report.registers, report.shared_bytes) if report is not None else (0, 0)

    return Tuner(graph, options, name, arch, GpuMeasure(device, options), library, resources, budget_s,
                 seconds_per_character, kept)


class Survey:
    """The hook ``GpuProgram.run`` asks for each kernel during the survey (``Tuner.survey_kernel``)."""

    def __init__(self, tuner: Tuner) -> None:
        self.tuner = tuner

    def kernel_for(self, kernel: GeneratedKernel, inputs: Sequence[Any]) -> GeneratedKernel:
        return self.tuner.survey_kernel(kernel, inputs)


class GpuMeasure:
    """Times candidate kernels of one pattern on ``device`` (see the module note)."""

    def __init__(self, device: Any, options: Options, rounds: int = ROUNDS) -> None:
        self.device = device
        self.options = options
        self.rounds = rounds
        self._flush: Any = None
        self._ahead: Any = None  # kernel_call.CompileAhead, made on first use

    def compile_ahead(self, kernels: Sequence[GeneratedKernel]) -> None:
        """Start compiling ``kernels`` (candidates to be measured later) in the background."""
        from fusionstitching.runtime.kernel_call import CompileAhead, device_arch

        if self._ahead is None:
            self._ahead = CompileAhead(device_arch(self.device), cache_dir=self.options.cache_dir,
                                       cache_max_bytes=self.options.cache_max_bytes)
        self._ahead.submit(kernels)

    def compile(self, kernels: Sequence[GeneratedKernel]) -> None:
        """Compile ``kernels`` now, in parallel (the chosen template's kernels for a pattern's
        other kernels, ``Tuner._make_the_others``)."""
        from fusionstitching.runtime.kernel_call import device_arch, precompile

        precompile(kernels, device_arch(self.device), cache_dir=self.options.cache_dir,
                   cache_max_bytes=self.options.cache_max_bytes)

    def room_ahead(self) -> int:
        """How many more compiles would keep the background compiles' threads busy."""
        if self._ahead is None:
            import os

            return min(16, os.cpu_count() or 1)
        return max(0, self._ahead.workers - self._ahead.in_flight())

    def close(self) -> None:
        """Drop the background compiles not begun (tuning is over)."""
        if self._ahead is not None:
            self._ahead.close()
            self._ahead = None

    def __call__(self, kernels: Sequence[GeneratedKernel], inputs: Sequence[Any],
                 flush: bool = True) -> list[float | None]:
        import torch

        from fusionstitching.runtime.kernel_call import (
            allocate_outputs,
            call_generated,
        )

        cache = {"cache_dir": self.options.cache_dir, "cache_max_bytes": self.options.cache_max_bytes}
        if self._ahead is not None:
            self._ahead.wait(kernels)
        self.compile(kernels)
        aliased = sorted(set(kernels[0].lowered.aliases.values()))
        scratch = list(inputs)
        for j in aliased:  # inputs overwritten in place: copies, never the user's tensors
            scratch[j] = inputs[j].clone()
        outputs = allocate_outputs(kernels[0], scratch)
        ok: list[bool] = []
        reference: list[Any] = []
        for k, kernel in enumerate(kernels):
            for j in aliased:
                scratch[j].copy_(inputs[j])
            try:
                results = call_generated(kernel, scratch, outputs, **cache)
                torch.cuda.synchronize(self.device)
            except Exception as err:
                if k == 0 or self.options.strict:
                    raise
                warnings.warn(f"{kernel.name}: candidate {kernel.template} failed to run ({err})", TuningWarning,
                              stacklevel=3)
                ok.append(False)
                continue
            if k == 0:
                reference = [r.clone() for r in results]
                ok.append(True)
                continue
            bad = next((n for n, (r, x) in enumerate(zip(reference, results)) if not _close(r, x)), None)
            if bad is not None:
                message = (f"{kernel.name}: candidate {kernel.template} disagrees with the plan's template "
                           f"{kernels[0].template} on output {bad}")
                if self.options.strict:
                    raise RuntimeError(message)
                warnings.warn(message + "; dropped", TuningWarning, stacklevel=3)
            ok.append(bad is None)
        live = [k for k, good in enumerate(ok) if good]
        samples: dict[int, list[float]] = {k: [] for k in live}
        buffer = self._flush_buffer() if flush else None
        for _ in range(self.rounds):
            for k in live:
                if buffer is not None:
                    buffer.sum()
                else:  # warm: the inputs in L2 from a launch of this same kernel
                    call_generated(kernels[k], scratch, outputs, **cache)
                # the GPU kept busy while the host enqueues the launch: the events time the kernel,
                # not the host's launch latency
                torch.cuda._sleep(SPACER_CYCLES)
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                call_generated(kernels[k], scratch, outputs, **cache)
                end.record()
                samples[k].append((start, end))
        torch.cuda.synchronize(self.device)
        times: list[float | None] = [None] * len(kernels)
        for k in live:
            times[k] = statistics.median(1e3 * s.elapsed_time(e) for s, e in samples[k])
        return times

    def _flush_buffer(self) -> Any:
        """A buffer twice the L2 cache: reading it evicts what a previous launch left in L2. It is
        read, not written: writing it would leave the L2 full of dirty lines, whose write-back then
        falls inside the timed kernel (up to the L2's size of extra traffic, more for a kernel that
        moves more bytes, which skews the ranking)."""
        import torch

        if self._flush is None:
            size = getattr(torch.cuda.get_device_properties(self.device), "L2_cache_size", 50 << 20)
            self._flush = torch.zeros(2 * max(size, 1 << 20) // 4, dtype=torch.float32, device=self.device)
        return self._flush


def _close(expected: Any, actual: Any) -> bool:
    """Whether two candidates' outputs agree within the dtype's tolerance (NaN where NaN; integers
    and booleans exactly). Reductions in another order differ by rounding, relative to the
    output's scale."""
    import torch

    if expected.dtype in (torch.bool, torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8):
        return bool(torch.equal(expected, actual))
    a, b = expected.double(), actual.double()
    nan = torch.isnan(a)
    if not torch.equal(nan, torch.isnan(b)):
        return False
    a, b = a[~nan], b[~nan]
    if a.numel() == 0:
        return True
    inf = torch.isinf(a)
    if not torch.equal(a[inf], b[inf]):
        return False
    a, b = a[~inf], b[~inf]
    if a.numel() == 0:
        return True
    rtol = 1e-4 if expected.dtype in (torch.float32, torch.float64) else 2e-2
    scale = max(1.0, float(a.abs().max()))
    return bool(((a - b).abs() <= rtol * b.abs() + rtol * scale).all())
