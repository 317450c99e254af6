"""Legality of a fusion pattern: yes or no, with the reason (DESIGN.md "Fusion exploration").

A pattern is legal when contracting it keeps the graph acyclic (``graph.analysis.CycleChecker``)
and the schedule stage can build it (``schedule.feasible``, which lowers the pattern under its
default template [C §4.1]). Legality says nothing about whether fusing pays off; that is
``score.py``'s question.

Exploration asks about thousands of candidates, many of them copies of each other (the twelve
layers of a transformer give twelve identical LayerNorm patterns), so answers of ``feasible`` are
cached by the pattern's *structure* (``graph.analysis.pattern_structure``). Two patterns with one
structure lower to the same kernel up to names, so a cached schedule is renamed onto the new
pattern's nodes and a cached reason has its node names substituted.

``Roles`` is the classification every plan starts from: graph inputs (parameters, constants),
library calls (``library`` nodes and dots above the small-dot threshold of ``Options``, which run
in the GEMM library), the shape nodes that only feed GEMMs and reach them as strided views
(``gemm_operand_views``), and the fusable rest.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from fusionstitching.graph.analysis import CycleChecker, in_place_outputs, pattern_structure
from fusionstitching.graph.graph import Graph, Node
from fusionstitching.graph.node import contiguous_strides
from fusionstitching.graph.ops import Category
from fusionstitching.options import Options
from fusionstitching.schedule.grouping import Reason, feasible
from fusionstitching.schedule.template import KernelSchedule


@dataclass(frozen=True)
class Verdict:
    """Whether a pattern is legal; ``schedule`` when it is, ``reason`` when it is not."""

    legal: bool
    reason: str = ""
    schedule: KernelSchedule | None = None

    def __bool__(self) -> bool:
        return self.legal


# ----------------------------------------------------------------------------------------------
# Roles of nodes
# ----------------------------------------------------------------------------------------------


def dot_flops(node: Node) -> int:
    """2·M·N·K of a ``dot_general``: twice the output size times the contracted length."""
    lhs = node.operands[0]
    contract = math.prod(lhs.shape[d] for d in node.attrs["lhs_contract"])
    return 2 * node.size * contract


def is_small_dot(node: Node, options: Options) -> bool:
    """Whether a ``dot_general`` is fused by the code generator (Options' small-dot threshold)."""
    lhs = node.operands[0]
    batch = math.prod(lhs.shape[d] for d in node.attrs["lhs_batch"])
    contract = math.prod(lhs.shape[d] for d in node.attrs["lhs_contract"])
    per_batch = node.size // max(batch, 1)
    return (dot_flops(node) <= options.small_dot_max_flops and per_batch <= options.small_dot_max_output
            and contract <= options.small_dot_max_contract)


@dataclass(frozen=True)
class Roles:
    """Which nodes are graph inputs, which are library calls (with why), which are operand views of
    GEMMs (with why), and which are fusable."""

    inputs: frozenset[Node]
    library: dict[Node, str]
    fusable: tuple[Node, ...]  # in graph order
    views: dict[Node, str] = field(default_factory=dict)

    @staticmethod
    def of(graph: Graph, options: Options) -> Roles:
        inputs, library = set(), {}
        for node in graph.nodes:
            if node.category in (Category.PARAMETER, Category.CONSTANT):
                inputs.add(node)
            elif node.category == Category.LIBRARY:
                library[node] = f"library op {node.attrs['target']}"
            elif node.op == "dot_general" and not is_small_dot(node, options):
                library[node] = (f"dot of {dot_flops(node) / 1e6:.1f} MFLOP is above the small-dot threshold "
                                 "(GEMM library)")
        views = gemm_operand_views(graph, library)
        views.update(output_views(graph, library, views))
        views.update(sliced_output_views(graph, library, views))
        views.update(permuted_input_views(graph, views))
        views.update(merged_input_views(graph, inputs, library, views))
        views.update(restored_shape_views(graph, inputs, library, views))
        fusable = tuple(n for n in graph.nodes if n not in inputs and n not in library and n not in views)
        return Roles(frozenset(inputs), library, fusable, views)


GEMM_CALL = "aten.addmm.default"  # the library GEMM with a bias epilogue (``fusion/gemm_bias.py``)


def is_gemm_call(node: Node) -> bool:
    """Whether ``node`` is a library ``addmm``: its matrix operands reach cuBLAS as a ``dot_general``'s
    do, transposed views included."""
    return node.op == "library" and node.attrs.get("target") == GEMM_CALL


def blas_layout(node: Node) -> bool:
    """Whether a shape node's result can reach the GEMM library as a strided view: a reshape or a
    broadcast (stride 0), or a transpose of a matrix or of the last two dims of a batch of them
    (cuBLAS reads those transposed in place); other permutations would make torch copy."""
    if node.op in ("reshape", "broadcast_in_dim"):
        return True
    if node.op != "transpose":
        return False
    permutation = tuple(node.attrs["permutation"])
    rank = len(permutation)
    return permutation[: max(rank - 2, 0)] == tuple(range(max(rank - 2, 0)))


def gemm_operand_views(graph: Graph, library: dict[Node, str]) -> dict[Node, str]:
    """Transposes, reshapes and broadcasts whose users are all GEMM library calls (directly or
    through more such nodes) and that the library can read as strided views: no kernel runs for
    them, and they are kept out of fusion so that no kernel writes a transposed copy for nothing."""
    users = graph.index.users
    views: dict[Node, str] = {}
    for node in reversed(graph.nodes):
        if not blas_layout(node) or id(node) in graph.index.output_ids or not users[node]:
            continue
        if all((u in library and (u.op == "dot_general" or is_gemm_call(u))) or u in views for u in users[node]):
            views[node] = "operand of GEMM library calls, passed as a strided view"
    return views


def output_views(graph: Graph, library: dict[Node, str], views: dict[Node, str]) -> dict[Node, str]:
    """Transposes and reshapes that are graph outputs whose promised layout (``graph.output_layouts``)
    is that of a view of their operand, used by nothing but GEMM library calls and views. AOTAutograd
    saves such values for the backward graph (BERT's attention saves the transposes of its batched
    GEMMs' operands, with the strides of a view): as views they cost nothing, while a kernel would
    write them contiguously and the runtime would copy them into the promised strides."""
    users = graph.index.users
    promised = {id(o): graph.output_layouts[k] for k, o in enumerate(graph.outputs)
                if o is not None and k not in graph.mutations}
    found: dict[Node, str] = {}
    for node in reversed(graph.nodes):
        layout = promised.get(id(node))
        if node.op not in ("transpose", "reshape") or layout is None or node in views:
            continue
        if not all((u in library and u.op == "dot_general") or u in views or u in found for u in users[node]):
            continue
        strides = _view_strides(node, {**views, **found, node: ""})
        if strides is not None and _same_strides(node.shape, strides, layout.strides):
            found[node] = "graph output promised in the layout of a view of its operand"
    return found


def sliced_output_views(graph: Graph, library: dict[Node, str], views: dict[Node, str]) -> dict[Node, str]:
    """Slices from the origin of a library result, read by nothing, that are graph outputs promised
    in that result's layout: a padded GEMM's product saved for the backward (``padding.py``). As
    views they cost nothing; a kernel would copy them out of the padded buffer."""
    users = graph.index.users
    found: dict[Node, str] = {}
    for k, node in enumerate(graph.outputs):
        layout = graph.output_layouts[k]
        if node is None or node.op != "slice" or layout is None or k in graph.mutations or users[node] \
                or node in views or node.operands[0] not in library or layout.offset != 0:
            continue
        if any(node.attrs["start"]) or any(s != 1 for s in node.attrs["stride"]):
            continue
        if _same_strides(node.shape, contiguous_strides(node.operands[0].shape), layout.strides):
            found[node] = "graph output promised in the layout of the library result it is a slice of"
    return found


def permuted_input_views(graph: Graph, views: dict[Node, str]) -> dict[Node, str]:
    """Transposes of a parameter whose result is contiguous in the parameter's storage (the NHWC
    view of a tensor a training forward saved channels-last, ``graph/layout.py``): views, so that
    the kernels reading them read a contiguous input. Inside a kernel the same read looked like a
    transpose of the input's innermost dim, which the templates tile through shared memory."""
    found: dict[Node, str] = {}
    for node in _unviewed(graph, "transpose", views):
        x = node.operands[0]
        if x.op != "parameter" or x.layout is None or x.layout.offset != 0:
            continue
        strides = tuple(x.layout.strides[p] for p in node.attrs["permutation"])
        if _same_strides(node.shape, strides, contiguous_strides(node.shape)):
            found[node] = "transpose of an input laid out so that the result is contiguous"
    return found


def _unviewed(graph: Graph, op: str, views: dict[Node, str]) -> list[Node]:
    """The nodes of ``op`` that are no view yet and no graph output."""
    outputs = graph.index.output_ids
    return [n for n in graph.nodes if n.op == op and n not in views and id(n) not in outputs]


def merged_input_views(graph: Graph, inputs: set[Node], library: dict[Node, str],
                       views: dict[Node, str]) -> dict[Node, str]:
    """Reshapes that only merge adjacent dims of a contiguous input, of a contiguous view of one or
    of a library call's output (``graph/collapse.py`` reads a BatchNorm's saved activations and
    its convolutions' outputs with H x W as one dim), read by no graph output: views, so that the kernels reading them take
    the buffer in the merged shape and no kernel writes a reshaped copy for the others."""
    found: dict[Node, str] = {}
    for node in _unviewed(graph, "reshape", views):
        x = node.operands[0]
        contiguous = x in library or (x in inputs and (x.op == "constant" or x.layout is None
                                                       or x.layout.is_contiguous(x.shape))) \
            or (x in views and x.op == "transpose" and _view_strides(x, views) is not None
                and _same_strides(x.shape, _view_strides(x, views), contiguous_strides(x.shape)))
        if contiguous and _merges_only(x.shape, node.shape):
            found[node] = "reshape merging dims of a contiguous input or library output"
    return found


def restored_shape_views(graph: Graph, inputs: set[Node], library: dict[Node, str],
                         views: dict[Node, str]) -> dict[Node, str]:
    """Reshapes that only split dims of a computed value back apart and go to library calls or
    out of the graph (``graph/collapse.py``'s reshapes back to a BatchNorm output's NCHW shape,
    read by the next convolution and saved for the backward): views of the kernel's contiguous
    output. In a kernel, the reshaped copy would be written besides the value itself wherever
    other kernels read the value."""
    users = graph.index.users
    promised = {id(o): graph.output_layouts[k] for k, o in enumerate(graph.outputs)
                if o is not None and k not in graph.mutations}
    mutated = {id(graph.outputs[k]) for k in graph.mutations if graph.outputs[k] is not None}
    found: dict[Node, str] = {}
    for node in graph.nodes:
        x = node.operands[0] if node.operands else None
        if node.op != "reshape" or node in views or x in inputs or id(node) in mutated \
                or not _merges_only(node.shape, x.shape):
            continue
        layout = promised.get(id(node))
        if layout is not None and not layout.is_contiguous(node.shape):
            continue
        if (users[node] or id(node) in promised) and all(u in library for u in users[node]):
            found[node] = "reshape back of a computed value, read by library calls or as an output"
    return found


def _merges_only(before: Sequence[int], after: Sequence[int]) -> bool:
    """Whether ``after`` is ``before`` with runs of adjacent dims multiplied together."""
    k = 0
    for size in after:
        if k == len(before):
            return False
        product, k = before[k], k + 1
        while product < size and k < len(before):
            product, k = product * before[k], k + 1
        if product != size:
            return False
    return all(d == 1 for d in before[k:])


def _view_strides(node: Node, views) -> tuple[int, ...] | None:
    """The strides ``node`` has when the views among its producers are views of materialized
    (contiguous) tensors or parameters; None where torch would have to copy (a reshape of
    non-contiguous memory) or the op is not a transpose or reshape."""
    if node not in views:
        if node.op == "parameter" and node.layout is not None:
            return tuple(node.layout.strides)
        return contiguous_strides(node.shape)
    operand = _view_strides(node.operands[0], views)
    if operand is None:
        return None
    if node.op == "transpose":
        return tuple(operand[p] for p in node.attrs["permutation"])
    if node.op == "reshape" and _same_strides(node.operands[0].shape, operand, contiguous_strides(node.operands[0].shape)):
        return contiguous_strides(node.shape)
    return None


def _same_strides(shape, a, b) -> bool:
    """Equal strides over the dims that have more than one element (the others are never used)."""
    return all(x == y for size, x, y in zip(shape, a, b) if size > 1)


# ----------------------------------------------------------------------------------------------
# The legality checker
# ----------------------------------------------------------------------------------------------


class Legality:
    """Answers "can these nodes be one kernel?" for one graph, caching ``feasible`` by structure."""

    def __init__(self, graph: Graph, options: Options | None = None,
                 cache: dict[tuple, tuple[tuple[str, ...], KernelSchedule | Reason]] | None = None) -> None:
        """``cache``: answers by structure to share with other graphs planned with the same options
        (``explore`` plans a graph with its reshapes split and unsplit: most patterns are in both)."""
        self.graph = graph
        self.options = options or Options()
        self.cycles = CycleChecker(graph)
        self.index = graph.index
        self._cache = cache if cache is not None else {}
        self._aliases = in_place_outputs(graph)
        self._structures: dict[tuple[str, ...], tuple] = {}  # by node names, in their order
        self.feasible_calls = 0
        self.cache_hits = 0

    def check(self, nodes: Iterable[Node]) -> Verdict:
        members = sorted(set(nodes), key=self.index.position.__getitem__)
        witness = self.cycles.witness(members)
        if witness is not None:
            path = " -> ".join(n.name for n in witness)
            return Verdict(False, f"contracting the pattern creates a cycle through {path}")
        return self.buildable(members)

    def buildable(self, members: Sequence[Node]) -> Verdict:
        """``schedule.feasible`` for ``members`` (sorted in graph order), through the cache."""
        names = tuple(n.name for n in members)
        key = self.structure(members, names)
        cached = self._cache.get(key)
        if cached is None:
            self.feasible_calls += 1
            result = feasible(self.graph, members, self.options.smem_limit)
            self._cache[key] = (names, result)
        else:
            self.cache_hits += 1
            result = _rename(cached[1], dict(zip(cached[0], names)))
        if isinstance(result, Reason):
            return Verdict(False, str(result))
        return Verdict(True, schedule=result)

    def structure(self, members: Sequence[Node], names: tuple[str, ...] | None = None) -> tuple:
        """``pattern_structure`` of ``members`` in their order, computed once per node list: the
        scorer asks it of the patterns checked here (``Scorer(structures=...)``)."""
        names = names if names is not None else tuple(n.name for n in members)
        found = self._structures.get(names)
        if found is None:
            found = self._structures[names] = pattern_structure(self.graph, members, self._aliases)
        return found


def _rename(result: KernelSchedule | Reason, names: dict[str, str]) -> KernelSchedule | Reason:
    """A cached answer for a structurally identical pattern, with its node names replaced."""
    if all(old == new for old, new in names.items()):
        return result
    if isinstance(result, Reason):
        pattern = re.compile(r"\b(" + "|".join(re.escape(n) for n in sorted(names, key=len, reverse=True)) + r")\b")
        return Reason(pattern.sub(lambda m: names[m.group(1)], result.message))
    schedules = tuple(dataclasses.replace(s, root=names[s.root]) for s in result.schedules)
    return dataclasses.replace(result, schedules=schedules)


__all__ = ["Legality", "Roles", "Verdict", "dot_flops", "is_small_dot"]
