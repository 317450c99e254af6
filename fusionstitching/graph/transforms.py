"""Graph-to-graph rewrites that run before fusion exploration.

``split_reduction`` turns one reduction that would underfill the GPU into a partial and a final
reduction (DESIGN.md "Fusion exploration"). A bias gradient sums 4096 rows into 768 columns: one
reduce gives 768 threads (or a handful of blocks) a 4096-long loop each. Split in 32 parts, the
partial reduce gives 32 x 768 outputs, each summing a contiguous chunk of 128 rows, and the final
reduce sums 32 values per column. Exploration then counts the two kernels that will really run.

Rule. Of the reduced dims, the largest one ``d`` (ties: the first) is split; its size ``n`` must be
a multiple of ``parts``. The operand is reshaped in place, dim ``d`` becoming ``(parts, n //
parts)`` (row-major, so part ``i`` covers indices ``[i * n // parts, (i + 1) * n // parts)``); the
partial reduce drops every reduced dim but ``parts``; the final reduce drops ``parts``. There is no
transpose, so the shapes read directly off the original:

    partial shape = kept dims before d + (parts,) + kept dims after d
    final shape   = the original reduce's shape

i.e. ``parts`` sits where ``d`` sat among the kept dims: leading for a column reduction (4096x768
over dim 0, parts 32 -> partial (32, 768)), trailing for a row reduction ((64, 1024) over dim 1,
parts 8 -> partial (64, 8)).

Precision. A half-type (f16/bf16) sum or prod is converted to f32 before the reshape, both reduces
run in f32 and one convert rounds back to the original dtype, so the split graph rounds once, as
the reference does for the original reduce (it widens, accumulates in f32 and rounds once). What
remains different is the summation order (chunks of ``n // parts``, then ``parts`` values), which
changes f32 (and thus f16/bf16) sums and prods by rounding error only; integer sums and products
wrap identically, bool reductions (any/all) are exact. Half max/min need no widening: they select
an input value, which the half type represents exactly, so the partial stays in the original dtype.

``duplicate_broadcasts`` gives every user of a ``broadcast_in_dim`` or ``iota`` with several users
its own copy. Such a node only computes an index: a copy per consumer costs no memory traffic, while
a shared one must either be written to memory in full (a broadcast of a scalar to [8,128,768]
becomes 3 MB of traffic) or force all its consumers into one kernel. The first user keeps the
original; copies are named ``<name>_<k>``. XLA makes the same choice when it duplicates cheap
producers into each consumer fusion.

``merge_duplicates`` is common subexpression elimination: nodes with the same op, operands,
attributes, dtype, shape and layout become one (autocast's per-consumer casts of one activation).

Naming. New nodes are named after the original: ``<name>_f32`` (the widening convert),
``<name>_split`` (the reshape), ``<name>_partial``, ``<name>_final`` (only when a convert follows
it); a ``_N`` suffix is added if a name is taken. The node that replaces the original output (the
final reduce, or the convert after it) keeps the original name, shape, dtype and layout, so graph
outputs, mutations and output layouts keep their meaning.

The input graph is not modified. Nodes are immutable and compared by identity, so the result is a
rebuilt graph: parameters are the same objects, in the same order; every other node is a fresh
copy whose operands point at the copies, users of the reduce pointing at its replacement.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import numpy as np

from fusionstitching.graph.graph import Graph, Layout, Node, infer, verify
from fusionstitching.graph.ops import OPS, Category, DType


def split_reduction(graph: Graph, node: Node | str, parts: int) -> Graph:
    """A copy of ``graph`` where reduce ``node`` is a partial reduce over ``parts`` chunks plus a final one.

    Raises ``ValueError`` for an unknown node, a node that is not a reduce, ``parts < 2``, or a
    largest reduced dim whose size is not a multiple of ``parts``.
    """
    return split_reductions(graph, {node: parts})


def split_reductions(graph: Graph, splits: Mapping[Node | str, int],
                     row_blocks: Mapping[Node | str, int] | None = None,
                     row_loops: Mapping[Node | str, int] | None = None,
                     variances: Mapping[Node | str, Node | str] | None = None) -> Graph:
    """``split_reduction`` of several reduces in one rebuild of the graph (same rules, same names).

    ``row_blocks`` maps column reductions (over leading dims, keeping the innermost) to a number
    of rows ``r``: the last reduced dim is split into (size / r, r), the partial reduce sums only
    the ``r`` rows of each block and keeps every other dim, the final reduce sums the rest
    (``fusion/split.stitched_parts``: the partial then tiles its grid like a row reduction's
    warp-per-row kernel over the same tensor).

    ``row_loops`` maps such column reductions to a number of parts ``p``: the leading reduced
    dims are split so that their outermost ``p`` slices are reduced by the partial (``row_loop_dim``),
    which keeps rows ``r``, ``r + n / p``, ... of the ``n`` rows in one output row: the rows a block
    visits in a grid-stride loop of ``n / p`` blocks (``codegen/compose.py``, carried partials).

    ``variances`` maps a reduce summing squared deviations to the reduce of shifted values it is
    paired with (``variance_pairs``), which must be in ``splits``; the first is split as the second: the
    squares are summed per part around the part's own mean, from the partner's partial sums, and
    the parts' sums combined (``_split_variance``), so both partials read the data in one pass."""
    targets: dict[int, tuple[Node, int, int, bool | str]] = {}
    paired: dict[int, Node] = {}
    pairs = variance_pairs(graph) if variances else {}
    split_names = {(n if isinstance(n, str) else n.name) for n in splits}
    for node, partner in (variances or {}).items():
        target, mate = _find(graph, node), _find(graph, partner)
        if pairs.get(target.name) != mate.name or mate.name not in split_names or target.name in split_names:
            raise ValueError(f"split_reductions: {target.name} is no variance paired with {mate.name}, "
                             f"which is split and it not")
        paired[id(target)] = mate
    for node, parts in splits.items():
        target = _find(graph, node)
        targets[id(target)] = (target, split_dim(target, parts), parts, False)
    for node, rows in (row_blocks or {}).items():
        target = _find(graph, node)
        dim = max(target.attrs["dims"])
        size = target.operands[0].shape[dim]
        if size % rows or size == rows:
            raise ValueError(f"split_reductions: {target.name}'s dim {dim} of size {size} is not blocks of {rows} rows")
        targets[id(target)] = (target, dim, size // rows, True)
    for node, parts in (row_loops or {}).items():
        target = _find(graph, node)
        dim, outer = row_loop_dim(target, parts)
        targets[id(target)] = (target, dim, outer, "loops")
    names = _Names(n.name for n in graph.nodes)
    copies: dict[int, Node] = {id(p): p for p in graph.parameters}
    partials: dict[int, list[Node]] = {}
    partners = {id(mate) for mate in paired.values()}
    for old in graph.nodes:
        if id(old) in copies:
            continue
        operands = tuple(copies[id(x)] for x in old.operands)
        if id(old) in paired:
            mate = paired[id(old)]
            copies[id(old)] = _split_variance(old, copies, partials[id(mate)], targets[id(mate)][1], names)
        elif id(old) in partners:
            _, dim, parts, _ = targets[id(old)]
            copies[id(old)] = _split_shifted(old, dim, parts, copies, names, partials.setdefault(id(old), []))
        elif id(old) in targets:
            _, dim, parts, blocks = targets[id(old)]
            copies[id(old)] = _split(old, operands[0], dim, parts, names, blocks)
        else:
            copies[id(old)] = dataclasses.replace(old, operands=operands)
    return _rebuilt(graph, copies)


def reduction_order(node: Node, min_length: int = 32) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    """The reduced dims of ``node`` in two steps, when reducing them so pays: (dims reduced first,
    the rest, numbered as in the first step's result); None otherwise. Both cases need a reduce
    over a trailing run of dims (``run``) and over dims outside it (``others``):

    - a run of at least ``min_length`` elements (a warp's width) is reduced first (BatchNorm's
      statistics over dims (0, 2, 3) of NCHW): the rows are read whole and contiguous, and the
      partial result is at most a 32nd of the operand;
    - a shorter run, with at least ``min_length`` contiguous elements after the last of the other
      dims, goes second (GroupNorm's statistics over dims (1, 3) of an NHWC activation split into
      ``[N, H * W, groups, C / groups]``): the others are reduced first, a column reduction whose
      lanes read that contiguous block, then the run of the far smaller result.

    A reduce over dims that are not contiguous otherwise leaves the code generator a strided loop
    per thread over a few thousand threads (2-10 % of a copy's bandwidth for the BatchNorm
    statistics of ResNet-50)."""
    if node.op != "reduce" or not node.dtype.is_float:
        return None
    shape, dims = node.operands[0].shape, set(node.attrs["dims"])
    run = []
    for d in range(len(shape) - 1, -1, -1):
        if d not in dims:
            break
        run.append(d)
    run.reverse()
    others = tuple(sorted(d for d in dims if d not in run and shape[d] > 1))  # size 1 reduces nothing
    if not run or not others:
        return None
    if math.prod(shape[d] for d in run) >= min_length:
        return tuple(run), tuple(sorted(d for d in dims if d not in run))
    if math.prod(shape[max(others) + 1:]) >= min_length:
        rest = tuple(sorted(d for d in dims if d not in others))
        return others, tuple(d - sum(1 for o in others if o < d) for d in rest)
    return None


def reduce_in_two_steps(graph: Graph) -> tuple[Graph, list[str]]:
    """A copy of ``graph`` where each reduce with a ``reduction_order`` is a reduce of the dims it
    reduces first (in the accumulation type) followed by a reduce of the others over the much
    smaller partial result; and a note per reduce rewritten (its name and the dims of each step)."""
    orders = {id(n): order for n in graph.nodes if (order := reduction_order(n)) is not None}
    if not orders:
        return graph, []
    names = _Names(n.name for n in graph.nodes)
    copies: dict[int, Node] = {id(p): p for p in graph.parameters}
    rewritten = []
    for old in graph.nodes:
        if id(old) in copies:
            continue
        operands = tuple(copies[id(x)] for x in old.operands)
        order = orders.get(id(old))
        if order is None:
            copies[id(old)] = dataclasses.replace(old, operands=operands)
            continue
        first, rest = order
        rewritten.append(f"{old.name}: dims {list(first)} first, then {list(rest)}")
        kind = old.attrs["kind"]
        accumulate = old.dtype.compute if kind in ("sum", "prod") else old.dtype
        x = operands[0]
        if accumulate != x.dtype:
            x = _make("convert", [x], names.new(f"{old.name}_{accumulate.value}"), dtype=accumulate)
        rows = _make("reduce", [x], names.new(f"{old.name}_rows"), dims=first, kind=kind)
        widened = accumulate != old.dtype
        result = _make("reduce", [rows], names.new(f"{old.name}_rest") if widened else old.name, dims=rest,
                       kind=kind, layout=None if widened else old.layout)
        if widened:
            result = _make("convert", [result], old.name, dtype=old.dtype, layout=old.layout)
        copies[id(old)] = result
    return _rebuilt(graph, copies), rewritten


def fold_empty(graph: Graph) -> Graph:
    """A copy of ``graph`` where no node computes on a tensor of zero elements: a node with an empty
    result is an empty constant, a reduction or dot over an empty dim is its identity (0 for sums
    and dots, 1 for products, -inf / +inf or the type's extremes for max / min) broadcast to its
    shape, a pad of an empty operand is its padding value broadcast, and a concatenation drops its
    empty pieces. Kernels and their launch dims then never see an empty extent (a grid of zero
    blocks, a row of zero elements), and eager's results on empty inputs come out exactly."""
    if not any(n.size == 0 for n in graph.nodes):
        return graph
    names = _Names(n.name for n in graph.nodes)

    def rewrite(old: Node, operands: tuple[Node, ...], _copies: dict[int, Node]) -> Node:
        if old.size == 0 and old.op != "library":
            return _make("constant", (), old.name, shape=old.shape, dtype=old.dtype,
                         value=np.zeros(old.shape, old.dtype.numpy))
        if old.op in ("reduce", "dot_general", "pad") and any(x.size == 0 for x in operands[:1]):
            return _filled(old, _empty_result(old), names)
        if old.op == "concatenate" and any(x.size == 0 for x in operands):
            pieces = tuple(x for x in operands if x.size)
            return dataclasses.replace(old, operands=pieces) if len(pieces) > 1 else pieces[0]
        return dataclasses.replace(old, operands=operands)

    return _rewritten(graph, rewrite)


def _rewritten(graph: Graph, rewrite: Callable[[Node, tuple[Node, ...], dict[int, Node]], Node]) -> Graph:
    """``graph`` rebuilt in order, each node replaced by ``rewrite(node, its operands' copies, the
    copies so far by id of the original)``."""
    copies: dict[int, Node] = {id(p): p for p in graph.parameters}
    for old in graph.nodes:
        if id(old) not in copies:
            copies[id(old)] = rewrite(old, tuple(copies[id(x)] for x in old.operands), copies)
    return _rebuilt(graph, copies)


def check_indices(graph: Graph) -> Graph:
    """``graph`` with a check output for every gather whose result is not read in full.

    A kernel checks an index where it computes the gathered element (``codegen.values``), so an
    out-of-range index at a position nothing reads (``emb(ids)[:, 0]``, a gather of a gather) would
    go unnoticed, where eager raises. For such a gather the result gets one more output: the max of
    a gather of the positions themselves (an iota along the gathered dim, every other dim of the
    operand size 1) through the same indices, a scalar that reads every index once. The outputs
    are trailing and counted in ``graph.checks``; the compiled graph does not return them."""
    full = _read_in_full(graph)
    partial = [n for n in graph.nodes if n.op == "gather" and n.size and n not in full]
    if not partial:
        return graph
    names = _Names(n.name for n in graph.nodes)
    checks = []
    for gather in partial:
        x, index = gather.operands
        axis, batch = gather.attrs["axis"], gather.attrs["batch_dims"]
        shape = tuple(s if d < batch or d == axis else 1 for d, s in enumerate(x.shape))
        positions = _make("iota", (), names.new(f"{gather.name}_positions"), shape=shape, dtype=DType.I32,
                          dimension=axis)
        read = _make("gather", (positions, index), names.new(f"{gather.name}_check"), **gather.attrs)
        checks.append(_make("reduce", (read,), names.new(f"{gather.name}_checked"),
                            dims=tuple(range(len(read.shape))), kind="max"))
        graph.origins.setdefault(read.name, graph.origins.get(gather.name, gather.name))
    result = Graph(graph.parameters, graph.outputs + checks, name=graph.name, mutations=graph.mutations,
                   output_layouts=graph.output_layouts + [None] * len(checks))
    verify(result)
    result.origins, result.checks = dict(graph.origins), graph.checks + len(checks)
    return result


def _read_in_full(graph: Graph) -> set[Node]:
    """The nodes whose every element a kernel computes: outputs, and operands of a node read in
    full that it reads all of (not through a slice, a cropping pad or as a gather's operand). A node
    without elements reads nothing (``fold_empty`` makes it a constant)."""
    full = {out for out in graph.outputs if out is not None}
    pieces: dict[Node, list[Node]] = {}  # a node → the slices of it that are read in full
    for node in reversed(graph.nodes):
        if node.size == 0:  # computes no element, so reads none of its operands
            continue
        if node not in full and not _covered(node, pieces.get(node, [])):
            continue
        full.add(node)
        for k, operand in enumerate(node.operands):
            if _reads_all(node, k):
                full.add(operand)
            elif node.op == "slice":
                pieces.setdefault(operand, []).append(node)
    return full


def _covered(node: Node, slices: Sequence[Node]) -> bool:
    """Whether unit-stride slices of ``node`` that differ in one dim only cover it together (the
    column blocks of one product, say)."""
    if not slices or any(any(st != 1 for st in s.attrs["stride"]) for s in slices):
        return False
    varying = {d for s in slices for d, (lo, hi, n) in enumerate(zip(s.attrs["start"], s.attrs["limit"], node.shape))
               if (lo, hi) != (0, n)}
    if len(varying) != 1:
        return False
    (dim,) = varying
    reach = 0
    for lo, hi in sorted((s.attrs["start"][dim], s.attrs["limit"][dim]) for s in slices):
        if lo > reach:
            return False
        reach = max(reach, hi)
    return reach >= node.shape[dim]


def _reads_all(node: Node, k: int) -> bool:
    if node.op == "slice":
        start, limit, stride = (node.attrs[a] for a in ("start", "limit", "stride"))
        return all(s == 0 and e == n and st == 1 for s, e, st, n in zip(start, limit, stride, node.operands[0].shape))
    if node.op == "pad":
        return all(v >= 0 for v in (*node.attrs["low"], *node.attrs["high"]))
    if node.op == "gather":
        return k == 1
    return node.size > 0


def _empty_result(node: Node) -> Any:
    """The value every element of ``node`` takes when its (first) operand has no elements."""
    if node.op == "pad":
        return node.attrs["value"]
    if node.op == "dot_general":
        return 0
    kind, dtype = node.attrs["kind"], node.dtype
    if kind in ("sum", "prod"):
        return int(kind == "prod")
    if dtype == DType.BOOL:
        return kind == "min"
    if dtype.is_float:
        return -np.inf if kind == "max" else np.inf
    info = np.iinfo(dtype.numpy)
    return info.min if kind == "max" else info.max


def _filled(node: Node, value: Any, names: _Names) -> Node:
    scalar = _make("constant", (), names.new(f"{node.name}_empty"), shape=(), dtype=node.dtype,
                   value=np.asarray(value).astype(node.dtype.numpy))
    return _make("broadcast_in_dim", (scalar,), node.name, shape=node.shape, broadcast_dimensions=())


def fold_views(graph: Graph) -> Graph:
    """A copy of ``graph`` where views that change nothing are no nodes at all (users read the
    operand): a transpose of a transpose is one transpose with the composed permutation, or none
    when that is the identity; a reshape to its operand's shape, or back to the shape its operand
    reshaped, is none, unless that leaves a parameter in its place.

    The backward of a linear layer transposes the weight gradient twice (folded, the gradient is
    the GEMM's output itself) and reshapes a bias gradient [n] to [1, n] and back. Each view left
    between kernels or before an output is a host step of its own on every call. Other chains of
    reshapes stay: they are free inside kernels, and folding them changes which nodes the fusion
    search sees (BERT's attention reshapes), not what runs."""
    if not any(_folds(n, n.operands[0]) for n in graph.nodes if n.operands):
        return graph
    copies: dict[int, Node] = {id(p): p for p in graph.parameters}
    for old in graph.nodes:
        if id(old) in copies:
            continue
        operands = tuple(copies[id(x)] for x in old.operands)
        inner = operands[0] if operands else None
        if inner is None or not _folds(old, inner):
            copies[id(old)] = dataclasses.replace(old, operands=operands)
        elif old.op == "transpose":
            permutation = tuple(old.attrs["permutation"])
            source = inner
            if inner.op == "transpose":
                permutation, source = tuple(inner.attrs["permutation"][d] for d in permutation), inner.operands[0]
            if permutation == tuple(range(len(permutation))):
                copies[id(old)] = source
            else:
                copies[id(old)] = dataclasses.replace(old, operands=(source,), attrs={"permutation": permutation})
        else:
            copies[id(old)] = inner if inner.shape == old.shape else inner.operands[0]
    return _rebuilt(graph, copies)


def _folds(node: Node, operand: Node) -> bool:
    """Whether ``fold_views`` changes ``node`` (whose first operand is now ``operand``)."""
    if node.op == "transpose":
        identity = tuple(node.attrs["permutation"]) == tuple(range(len(node.shape)))
        return identity or operand.op == "transpose"
    if node.op == "reshape":
        # Not back to a parameter: torch's reshape of a strided input is a copy, taken before the
        # graph's in-place updates are written back into that input; the parameter is not.
        if operand.shape == node.shape:
            return operand.op != "parameter"
        return operand.op == "reshape" and operand.operands[0].shape == node.shape \
            and operand.operands[0].op != "parameter"
    return False


def widen_dots(graph: Graph) -> Graph:
    """A copy of ``graph`` where a half-type dot whose one user converts it to f32, that convert
    being a graph output, is one dot with an f32 result: the GEMM writes its f32 accumulator and no
    kernel reads the half result back to widen it. Under autocast every weight gradient is such a
    dot (bf16 GEMM, then the f32 gradient of the weight's cast): 6 bytes of memory-intensive traffic
    per parameter and step.

    Precision: the result is the accumulator itself, not its rounding to the half type, so it is
    more precise than the graph asked for by one rounding (at most half an ulp of the half type),
    as XLA's and Inductor's fused kernels keep intermediates in f32. Only graph outputs are widened:
    inside the graph the f32 value would cost its readers twice the bytes of the half one."""
    users = graph.index.users
    outputs = graph.index.output_ids
    widened = {id(n) for n in graph.nodes
               if n.op == "convert" and n.dtype == DType.F32 and id(n) in outputs
               and n.operands[0].op == "dot_general" and n.operands[0].dtype.is_half
               and len(users[n.operands[0]]) == 1 and id(n.operands[0]) not in outputs}
    if not widened:
        return graph
    copies: dict[int, Node] = {id(p): p for p in graph.parameters}
    for old in graph.nodes:
        if id(old) in copies:
            continue
        if id(old) in widened:
            dot = copies[id(old.operands[0])]
            copies[id(old)] = dataclasses.replace(dot, name=old.name, dtype=DType.F32, layout=old.layout)
            continue
        copies[id(old)] = dataclasses.replace(old, operands=tuple(copies[id(x)] for x in old.operands))
    return _rebuilt(graph, copies)


# Ops ``merge_duplicates`` never merges: parameters and constants are inputs, a library call may
# have effects the IR does not see, and random draws stay one node per draw.
UNMERGED_OPS = ("parameter", "constant", "library", "rng_uniform")


def merge_duplicates(graph: Graph) -> Graph:
    """A copy of ``graph`` where nodes that compute the same value are one node (common
    subexpression elimination): same op, dtype, shape, layout and attributes, and the same operands
    after merging. Autocast casts an activation once per consumer: BERT's Q, K and V projections
    each convert the same f32 LayerNorm output to bf16, so a plan without merging writes (or
    recomputes) three identical bf16 tensors per layer, 19 MB of traffic per layer at batch 32.

    The first node of a set in topological order is kept, and its users read it; the result is
    exactly the value the graph computes. Two graph outputs are never merged with each other (the
    caller gets distinct tensors for distinct outputs); a duplicate that is an output is replaced
    by the kept node when that one is not an output yet."""
    copies: dict[int, Node] = {id(p): p for p in graph.parameters}
    outputs = graph.index.output_ids
    kept: dict[tuple, Node] = {}
    kept_is_output: set[int] = set()
    merged = False
    for old in graph.nodes:
        if id(old) in copies:
            continue
        operands = tuple(copies[id(x)] for x in old.operands)
        new = old if operands == old.operands else dataclasses.replace(old, operands=operands)
        key = _merge_key(new)
        twin = kept.get(key) if key is not None else None
        if twin is not None and not (id(old) in outputs and id(twin) in kept_is_output):
            copies[id(old)] = twin
            if id(old) in outputs:
                kept_is_output.add(id(twin))
            merged = True
            continue
        copies[id(old)] = new
        if key is not None and twin is None:
            kept[key] = new
            if id(old) in outputs:
                kept_is_output.add(id(new))
    if not merged:
        return graph
    return _rebuilt(graph, copies)


def _merge_key(node: Node) -> tuple | None:
    """What two nodes must share to compute the same value, or None for a node never merged."""
    if node.op in UNMERGED_OPS:
        return None
    # repr tells -0.0 from 0.0 (a pad value), which == and hash do not.
    attrs = tuple((name, repr(value)) for name, value in sorted(node.attrs.items()))
    return (node.op, node.dtype, node.shape, node.layout, tuple(id(x) for x in node.operands), attrs)


def sum_one_hots(graph: Graph) -> Graph:
    """A copy of ``graph`` where a sum along one dim of a one-hot row is the row's one value.

    A cross-entropy backward sums its loss gradient along the vocabulary: the scatter lowering and
    torch's ``nll_loss_backward`` give ``select(iota_d == index, a, 0) * b``, ``a`` and ``b``
    constant along ``d``. Summed as it stands, that is a pass over every (row, class) element (206
    million for GPT-2's 4096 tokens × 50257 classes) for one value per row. The pass replaces the
    reduce by ``select(0 <= index < n, a, 0) * b + 0 * b`` on the reduced shape, where each operand
    constant along ``d`` is read at position 0 of ``d`` (a slice, then a reshape dropping ``d``).

    The result is exactly the sum: every position but the hit adds ``0 * b``, which is 0 for a
    finite ``b`` and NaN otherwise; the last term keeps that NaN (and, with the index out of range,
    the sum of ``n`` such terms is that term too). One nonzero term is summed without rounding, in
    a half type as well. The select form without ``* b`` is matched too, and the index and its
    iota may stand on either side of the ``==``; anything else is left as it is."""
    found = {id(n): term for n in graph.nodes if n.op == "reduce" and (term := _one_hot_term(n)) is not None}
    if not found:
        return graph
    names = _Names(n.name for n in graph.nodes)

    def rewrite(old: Node, operands: tuple[Node, ...], copies: dict[int, Node]) -> Node:
        if id(old) not in found:
            return dataclasses.replace(old, operands=operands)
        index, value, scale = (None if x is None else copies[id(x)] for x in found[id(old)])
        return _summed_one_hot(old, index, value, scale, names)

    return _rewritten(graph, rewrite)


def _one_hot_term(reduce: Node) -> tuple[Node, Node, Node | None] | None:
    """(index, value, scale or None) when ``reduce`` sums, along one dim ``d``, the one-hot
    ``select(iota_d == index, value, 0)`` (times ``scale``), all three constant along ``d``."""
    if reduce.attrs["kind"] != "sum" or len(reduce.attrs["dims"]) != 1:
        return None
    (d,), term = reduce.attrs["dims"], reduce.operands[0]
    if term.shape[d] < 2:
        return None
    hot, scale = term, None
    if term.op == "mul":
        pairs = (term.operands, term.operands[::-1])
        hot, scale = next(((h, s) for h, s in pairs if h.op == "select" and _constant_along(s, d)), (None, None))
    if hot is None or hot.op != "select" or term.dtype != reduce.dtype:
        return None
    hit, value, zero = hot.operands
    if not (_is_zero(zero) and _constant_along(value, d)) or hit.op != "compare" or hit.attrs["direction"] != "EQ":
        return None
    for iota, index in (hit.operands, hit.operands[::-1]):
        if (iota.op == "iota" and iota.attrs["dimension"] == d and not index.dtype.is_float
                and index.dtype != DType.BOOL and _constant_along(index, d)):
            return index, value, scale
    return None


def _constant_along(node: Node, d: int, depth: int = 0) -> bool:
    """Whether ``node`` has the same value at every position of dim ``d`` (by its structure)."""
    if node.shape[d] == 1:
        return True
    if node.op == "broadcast_in_dim":
        dims = tuple(node.attrs["broadcast_dimensions"])
        return d not in dims or node.operands[0].shape[dims.index(d)] == 1
    if node.op == "iota":
        return node.attrs["dimension"] != d
    if OPS[node.op].category in (Category.LIGHT_ELEMENTWISE, Category.EXPENSIVE_ELEMENTWISE) and depth < 8:
        return all(_constant_along(x, d, depth + 1) for x in node.operands)
    return False


def _is_zero(node: Node) -> bool:
    """A constant 0 (or +-0.0), possibly broadcast."""
    while node.op == "broadcast_in_dim":
        node = node.operands[0]
    if node.op != "constant":
        return False
    value = np.asarray(node.attrs["value"])
    return value.size > 0 and bool(np.all(value == 0))


def _summed_one_hot(reduce: Node, index: Node, value: Node, scale: Node | None, names: _Names) -> Node:
    """The nodes replacing ``reduce`` (``sum_one_hots``); the last keeps its name and layout."""
    (d,) = reduce.attrs["dims"]
    n, shape = reduce.operands[0].shape[d], reduce.shape

    def at_zero(x: Node) -> Node:  # x, constant along d, on the reduced shape
        start, limit = [0] * len(x.shape), list(x.shape)
        limit[d] = 1
        row = _make("slice", [x], names.new(f"{x.name}_row"), start=start, limit=limit, stride=[1] * len(x.shape))
        return _make("reshape", [row], names.new(f"{x.name}_row"), shape=shape)

    def filled(number: float, dtype: DType) -> Node:
        scalar = _make("constant", (), names.new(f"{reduce.name}_c"), dtype=dtype, value=np.asarray(number, dtype.numpy))
        return _make("broadcast_in_dim", [scalar], names.new(f"{reduce.name}_c"), shape=shape, broadcast_dimensions=())

    index = at_zero(index)
    inside = _make("and", [_make("compare", [index, filled(0, index.dtype)], names.new(f"{reduce.name}_low"),
                                 direction="GE"),
                           _make("compare", [index, filled(n, index.dtype)], names.new(f"{reduce.name}_high"),
                                 direction="LT")], names.new(f"{reduce.name}_inside"))
    zero = filled(0, reduce.dtype)
    if scale is None:
        return _make("select", [inside, at_zero(value), zero], reduce.name, layout=reduce.layout)
    scale = at_zero(scale)
    hot = _make("mul", [_make("select", [inside, at_zero(value), zero], names.new(f"{reduce.name}_hot")), scale],
                names.new(f"{reduce.name}_value"))
    rest = _make("mul", [filled(0, reduce.dtype), scale], names.new(f"{reduce.name}_rest"))
    return _make("add", [hot, rest], reduce.name, layout=reduce.layout)


DUPLICATED_OPS = ("broadcast_in_dim", "iota")


def _duplicated(node: Node, computed: bool) -> bool:
    """Whether each user gets its own copy of ``node``: a broadcast or an iota (index arithmetic), or a
    widening convert (``x.float()`` in a norm, ``_widened``): a kernel recomputing it reads the
    narrower value, and two kernels that both need it (a norm's input gradient and its weight
    gradient) no longer force the wider one into memory. Wherever the value converted is computed,
    writing it narrow once and reading it narrow moves fewer bytes than writing and reading the
    converted copy."""
    if node.op in DUPLICATED_OPS:
        return True
    if _widened(node, computed):
        return True
    return _recomputed_size(node, computed) is not None and _source_bytes(node, computed) < node.dtype.itemsize


def _source_bytes(node: Node, computed: bool) -> float:
    """The bytes per element of ``node`` that a user recomputing its chain (``_recomputed_size``)
    reads from values that are in memory only for it: a computed widened value's narrow source, a
    broadcast's operand (per element of ``node``). A graph input is in memory anyway. A LayerNorm's
    normalization ``((x.float() - mean) * rstd * w + b).to(bf16)`` of a computed ``x`` reads as many
    bytes of ``x`` as of its result: recomputed per reader, it reads no fewer and makes ``x`` and
    the statistics be written beside the result."""
    leaves: dict[int, float] = {}
    stack = [node]
    while stack:
        n = stack.pop()
        for x in n.operands:
            if x.op == "broadcast_in_dim":
                leaves[id(x)] = sum(o.size * o.dtype.itemsize for o in x.operands
                                    if o.op != "parameter") / max(1, node.size)
            elif x.op in DUPLICATED_OPS or x.op == "constant":
                continue
            elif _widened(x, computed):
                source = _widened_source(x)
                if source.op != "parameter":
                    leaves[id(x)] = source.size * source.dtype.itemsize / max(1, node.size)
            else:
                stack.append(x)
    return sum(leaves.values())


RECOMPUTED_NODES = 8  # the most light elementwise nodes a user recomputes instead of reading


def _recomputed_size(node: Node, computed: bool, depth: int = 0) -> int | None:
    """The light elementwise nodes above and including ``node`` when every value under them is a
    broadcast, an iota, a constant or a widened value (``_duplicated``), else None. A user
    recomputing them reads only those smaller sources: cross-entropy's one-hot gradient
    ``select(iota == target, -1/n, 0) * weight`` is [tokens, vocabulary] from [tokens] inputs, read
    by its row sum's kernel and by the softmax gradient's; shared, the first kernel wrote it whole
    (800 MB for GPT-2's vocabulary) for the second to read back. BatchNorm's centred input
    ``conv_out.float() - mean`` is read by its variance's kernel and its normalization's; shared, it
    was written in f32 beside the bf16 convolution output. At most ``RECOMPUTED_NODES``."""
    if OPS[node.op].category != Category.LIGHT_ELEMENTWISE or depth >= RECOMPUTED_NODES:
        return None
    total = 1
    for x in node.operands:
        if x.op in DUPLICATED_OPS or x.op == "constant" or _widened(x, computed):
            continue
        below = _recomputed_size(x, computed, depth + 1)
        if below is None:
            return None
        total += below
        if total > RECOMPUTED_NODES:
            return None
    return total


def _widened(node: Node, computed: bool) -> bool:
    """A widening convert, through reshapes on either side (GroupNorm's
    ``x.float().reshape(n, groups, -1)``: the reshape is what its several users read), of a graph
    input, or of any value with ``computed``."""
    source = _widened_source(node)
    return source is not None and (computed or source.op == "parameter")


def _widened_source(node: Node) -> Node | None:
    """The value a widening convert (through reshapes on either side) converts, or None."""
    while node.op == "reshape":
        node = node.operands[0]
    if node.op != "convert" or node.dtype.itemsize < node.operands[0].dtype.itemsize:
        return None
    source = node.operands[0]
    while source.op == "reshape":
        source = source.operands[0]
    return source


def duplicate_broadcasts(graph: Graph, computed: bool = False) -> Graph:
    """A copy of ``graph`` where each broadcast, iota or widening convert of an input
    (``_duplicated``; with ``computed``, a widening convert of any value) that is not an output is
    read by one user only: each further user reads a copy of its own, made with copies of the
    duplicated nodes under it (the copies of an outer broadcast do not share the inner one). One
    pass in graph order: a node's first user takes the node, every later user a new copy."""
    outputs = graph.index.output_ids
    users = graph.index.users
    if not any(_duplicated(n, computed) and len(users[n]) > 1 and id(n) not in outputs for n in graph.nodes):
        return graph
    names = _Names(n.name for n in graph.nodes)
    copies: dict[int, Node] = {id(p): p for p in graph.parameters}  # each node's first copy
    first_user: dict[int, object] = {}  # duplicated node → the user that reads its first copy
    per_user: dict[tuple[int, int], Node] = {}  # (duplicated node, a later user) → that user's copy
    stand_ins: list[object] = []  # kept alive: their ids key ``per_user``

    def use(x: Node, user: object) -> Node:
        """The node ``user`` reads for ``x`` (a user reading ``x`` twice reads one node)."""
        if not _duplicated(x, computed) or id(x) in outputs or first_user.setdefault(id(x), user) is user:
            return copies[id(x)]
        key = (id(x), id(user))
        if key not in per_user:
            copy = object()  # stands for the copy while its operands are chosen
            stand_ins.append(copy)
            operands = tuple(use(o, copy) for o in x.operands)
            per_user[key] = dataclasses.replace(x, name=names.new(x.name), operands=operands)
        return per_user[key]

    for old in graph.nodes:
        if id(old) not in copies:
            copies[id(old)] = dataclasses.replace(old, operands=tuple(use(x, old) for x in old.operands))
    return _rebuilt(graph, copies)


def _rebuilt(graph: Graph, copies: Mapping[int, Node], verified: bool = True) -> Graph:
    """The graph whose outputs are the copies (by id of the original) of ``graph``'s, verified
    unless the caller verifies it later."""
    result = Graph(graph.parameters, [None if out is None else copies[id(out)] for out in graph.outputs],
                   name=graph.name, mutations=graph.mutations, output_layouts=graph.output_layouts)
    if verified:
        verify(result)
    result.origins, result.checks = graph.origins, graph.checks
    return result


def split_dim(node: Node, parts: int) -> int:
    """The reduced dim ``split_reduction`` splits: the largest (ties: the first), checked against ``parts``."""
    if node.op != "reduce":
        raise ValueError(f"split_reduction: node {node.name} is a {node.op}, not a reduce")
    if not isinstance(parts, int) or parts < 2:
        raise ValueError(f"split_reduction of {node.name}: parts must be an int >= 2, found {parts!r}")
    dims = tuple(node.attrs["dims"])
    if not dims:
        raise ValueError(f"split_reduction: reduce {node.name} reduces no dims")
    shape = node.operands[0].shape
    dim = max(dims, key=lambda d: shape[d])  # max keeps the first of equal sizes
    size = shape[dim]
    if size < parts or size % parts != 0:
        raise ValueError(
            f"split_reduction of {node.name}: reduced dim {dim} has size {size}, "
            f"not a multiple of parts={parts} (operand {node.operands[0].name} {list(shape)})"
        )
    return dim


def _find(graph: Graph, node: Node | str) -> Node:
    if isinstance(node, str):
        try:
            return graph.node(node)
        except KeyError:
            raise ValueError(f"split_reduction: graph {graph.name} has no node {node!r}") from None
    if not any(n is node for n in graph.nodes):
        raise ValueError(f"split_reduction: node {node.name} is not a node of graph {graph.name}")
    return node


def row_loop_dim(node: Node, parts: int) -> tuple[int, int]:
    """For ``split_reductions``' ``row_loops``: the dim ``j`` whose outer factor ``q`` completes
    ``parts`` = (product of the dims before ``j``) x ``q``, and ``q``. ``node`` must reduce
    its leading dims only (a column reduction), all of them past ``j``'s split kept in the
    partial's output."""
    if node.op != "reduce":
        raise ValueError(f"split_reductions: node {node.name} is a {node.op}, not a reduce")
    shape, dims = node.operands[0].shape, tuple(sorted(node.attrs["dims"]))
    if not dims or dims != tuple(range(len(dims))) or len(dims) >= len(shape):
        raise ValueError(f"split_reductions: {node.name} does not reduce leading dims only: {list(dims)}")
    before = 1
    for j in dims:
        if parts % before == 0 and shape[j] % (parts // before) == 0 and parts // before < shape[j]:
            return j, parts // before
        before *= shape[j]
    raise ValueError(f"split_reductions: {node.name}'s leading dims {list(shape[:len(dims)])} "
                     f"have no split into {parts} outer parts")


def _split(reduce: Node, operand: Node, dim: int, parts: int, names: _Names, blocks: bool | str = False) -> Node:
    """The nodes replacing ``reduce`` (whose operand copy is ``operand``); returns the replacement.
    With ``blocks`` the partial reduces only the chunk dim (row blocks, see ``split_reductions``);
    with ``blocks == "loops"`` it reduces the dims before ``dim`` and ``dim``'s outer ``parts``
    (row loops)."""
    name, kind, dims = reduce.name, reduce.attrs["kind"], tuple(reduce.attrs["dims"])
    accumulate = reduce.dtype.compute if kind in ("sum", "prod") else reduce.dtype
    x = operand
    if accumulate != x.dtype:
        x = _make("convert", [x], names.new(f"{name}_{accumulate.value}"), dtype=accumulate)
    size = x.shape[dim]
    split_shape = x.shape[:dim] + (parts, size // parts) + x.shape[dim + 1 :]
    x = _make("reshape", [x], names.new(f"{name}_split"), shape=split_shape)
    # In the reshaped operand, dims after ``dim`` move up by one; ``dim`` itself is the parts dim.
    if blocks == "loops":  # the leading dims and the parts; the final sums what the partial keeps of them
        partial_dims, final_dims = tuple(range(dim + 1)), tuple(range(len(dims) - dim))
    elif blocks:
        partial_dims, final_dims = (dim + 1,), dims
    else:
        partial_dims = tuple(d if d < dim else d + 1 for d in dims)
        final_dims = (dim - sum(1 for d in dims if d < dim),)  # the parts' position in the partial
    partial = _make("reduce", [x], names.new(f"{name}_partial"), dims=partial_dims, kind=kind)
    widened = accumulate != reduce.dtype
    final_name = names.new(f"{name}_final") if widened else name
    final_layout = None if widened else reduce.layout
    result = _make("reduce", [partial], final_name, dims=final_dims, kind=kind, layout=final_layout)
    if widened:
        result = _make("convert", [result], name, dtype=reduce.dtype, layout=reduce.layout)
    return result


def _value_key(node: Node, depth: int = 3) -> tuple:
    """Equal for nodes that compute the same value up to ``depth`` levels of operands (copies made
    per user by ``duplicate_broadcasts`` and its kind); beyond, or for a node never merged, identity."""
    if depth == 0 or node.op in UNMERGED_OPS:
        return ("node", id(node))
    attrs = tuple((name, repr(value)) for name, value in sorted(node.attrs.items()))
    return (node.op, node.dtype, node.shape, node.layout, attrs, tuple(_value_key(x, depth - 1) for x in node.operands))


def _deviation(node: Node, dims: Sequence[int]) -> tuple[Node, Node] | None:
    """``(x, b)`` for ``node = x - b`` where ``b`` broadcasts a value constant along ``dims``."""
    if node.op != "sub":
        return None
    x, b = node.operands
    if b.op != "broadcast_in_dim":
        return None
    source = b.operands[0].shape
    if any(source[i] != 1 for i, d in enumerate(b.attrs["broadcast_dimensions"]) if d in dims):
        return None
    return x, b


def _kept_source(broadcast: Node, dims: Sequence[int], names: _Names) -> tuple[Node, list[int]]:
    """The value ``broadcast`` spreads (constant along ``dims``), without the size-1 dims it maps
    onto ``dims`` (a keepdim mean), and the dims of the broadcast's result its dims map to."""
    source, mapped = broadcast.operands[0], list(broadcast.attrs["broadcast_dimensions"])
    keep = [i for i, d in enumerate(mapped) if d not in dims]
    if len(keep) < len(mapped):
        source = _make("reshape", [source], names.new(f"{source.name}_kept"), shape=[source.shape[i] for i in keep])
    return source, [mapped[i] for i in keep]


def variance_pairs(graph: Graph) -> dict[str, str]:
    """The reduces that sum squared deviations, ``sum((x - m)^2)`` over dims D with ``m`` constant
    along D (the variance of frontend ``_var_mean``), each mapped to a reduce summing ``x - s`` over
    the same D, ``s`` constant along D (the shifted sum its mean is made of), by name. Both must be
    float sums that split without widening. ``_split_variance`` computes the first from the
    second's partial sums; the centres ``m`` and ``s`` may be any values."""
    shifted: dict[tuple, Node] = {}
    pairs: dict[str, str] = {}
    for node in graph.nodes:  # the partner comes first (rebuilding the graph copies it first)
        if node.op != "reduce" or node.attrs["kind"] != "sum" or not node.dtype.is_float \
                or node.dtype.compute != node.dtype:
            continue
        dims = tuple(sorted(node.attrs["dims"]))
        operand = node.operands[0]
        if len(dims) != 1:  # a split of one of several dims leaves partials that later rounds split
            continue
        if operand.op == "mul":
            a, b = operand.operands
            found = _deviation(a, dims)
            if found is not None and (a is b or _value_key(a) == _value_key(b)):
                partner = shifted.get((dims, _value_key(found[0])))
                if partner is not None:
                    pairs[node.name] = partner.name
                continue
        found = _deviation(operand, dims)
        if found is not None:
            shifted.setdefault((dims, _value_key(found[0])), node)
    return pairs


def _split_shifted(reduce: Node, dim: int, parts: int, copies: Mapping[int, Node], names: _Names,
                   made: list[Any]) -> Node:
    """The nodes replacing ``reduce`` = sum over D of (x - s), the partner of a variance, split in
    ``parts`` along ``dim``: each part is shifted by its own first element s_p, so that its partial
    needs nothing from outside the part (the variance's partial is summed in the same kernel):

        sum over D of (x - s) = sum over parts p of [ sum over p of (x - s_p) + c (s_p - s) ]

    with c the part's length. A part of equal values sums to exactly 0, so the mean of equal values
    is still exactly their value. ``made`` receives the shifted parts, a maker of the parts' shifts
    (a fresh slice per reader) and the parts' sums."""
    name = reduce.name
    data = copies[id(reduce.operands[0].operands[0])]
    shift = copies[id(reduce.operands[0].operands[1])]
    size = data.shape[dim]
    split_shape = data.shape[:dim] + (parts, size // parts) + data.shape[dim + 1:]
    dims = tuple(reduce.attrs["dims"])
    partial_dims = tuple(d if d < dim else d + 1 for d in dims)
    kept = [j for j in range(len(split_shape)) if j not in partial_dims]
    partial_shape = tuple(split_shape[j] for j in kept)
    x = _make("reshape", [data], names.new(f"{name}_split"), shape=split_shape)

    def part_shift() -> Node:
        # each reader outside the part kernel slices the shifts again (P x C values) from its own
        # copy of the data's view: the kernel keeps both to itself, as it could not write them
        copy = data
        if data.op in VIEW_COPIED_OPS:
            copy = dataclasses.replace(data, name=names.new(f"{data.name}_{name}"))
        parts_view = _make("reshape", [copy], names.new(f"{name}_split"), shape=split_shape)
        first = _make("slice", [parts_view], names.new(f"{name}_part_first"), start=[0] * len(split_shape),
                      limit=[1 if j in partial_dims else n for j, n in enumerate(split_shape)],
                      stride=[1] * len(split_shape))
        return _make("reshape", [first], names.new(f"{name}_part_shift"), shape=partial_shape)

    first = part_shift()
    shifted = _make("sub", [x, _make("broadcast_in_dim", [first], names.new(f"{name}_part_shift_b"),
                                     shape=split_shape, broadcast_dimensions=kept)],
                    names.new(f"{name}_part_shifted"))
    sums = _make("reduce", [shifted], names.new(f"{name}_partial"), dims=partial_dims, kind="sum")
    source = shift.operands[0]
    if source.op in VIEW_COPIED_OPS:
        source = dataclasses.replace(source, name=names.new(f"{source.name}_{name}"))
    source, spread = _kept_source(dataclasses.replace(shift, operands=(source,)), dims, names)
    mapped = [kept.index(k if k < dim else k + 1) for k in spread]
    apart = _make("sub", [part_shift(), _make("broadcast_in_dim", [source], names.new(f"{name}_s_b"), shape=partial_shape,
                                       broadcast_dimensions=mapped)], names.new(f"{name}_part_apart"))
    length = _constant(size // parts, partial_shape, reduce.dtype, f"{name}_length", names)
    total = _make("add", [sums, _make("mul", [apart, length], names.new(f"{name}_part_apart_c"))],
                  names.new(f"{name}_part_total"))
    made[:] = [shifted, part_shift, sums]
    position = kept.index(dim)
    return _make("reduce", [total], name, dims=(position,), kind="sum", layout=reduce.layout)


# Ops whose node the variance split copies rather than share (cheap views of the data): a shared one
# would be an output of a kernel that cannot write a value of its shape.
VIEW_COPIED_OPS = ("reshape", "slice", "convert", "transpose")


def _constant(value: float, shape: Sequence[int], dtype: DType, label: str, names: _Names) -> Node:
    scalar = _make("constant", (), names.new(label), shape=(), dtype=dtype, value=np.asarray(value).astype(dtype.numpy))
    return _make("broadcast_in_dim", [scalar], names.new(f"{label}_b"), shape=shape, broadcast_dimensions=())


def _split_variance(reduce: Node, copies: Mapping[int, Node], made: Sequence[Any], dim: int,
                    names: _Names) -> Node:
    """The nodes replacing ``reduce`` = sum over D of (x - m)^2, given its partner's split
    (``_split_shifted``'s ``made``). Each part's squares are summed around the part's own mean
    (Chan et al.'s parallel variance), from the partner's partial sums, so one kernel reads each part
    once for both sums:

        sum (x - m)^2 = sum over parts p of [ sum over p of (t - d_p)^2 + c (m_p - m)^2 ]

    with t = x - s_p, d_p = (sum over p of t) / c and m_p = s_p + d_p, the part's mean. Exact in
    real arithmetic for any m; each part's deviations are taken from its own mean, as in a two-pass
    variance, and m_p - m rounds as the two-pass x - m does."""
    shifted, part_shift, sums = made
    name = reduce.name
    partial_dims = tuple(sums.attrs["dims"])
    kept = [j for j in range(len(shifted.shape)) if j not in partial_dims]
    position = kept.index(dim)
    length = shifted.shape[dim + 1]
    means = _make("div", [sums, _constant(length, sums.shape, reduce.dtype, f"{name}_length", names)],
                  names.new(f"{name}_part_mean"))
    spread = _make("broadcast_in_dim", [means], names.new(f"{name}_part_mean_b"), shape=shifted.shape,
                   broadcast_dimensions=kept)
    deviation = _make("sub", [shifted, spread], names.new(f"{name}_part_dev"))
    within = _make("reduce", [_make("mul", [deviation, deviation], names.new(f"{name}_part_sq"))],
                   names.new(f"{name}_partial"), dims=partial_dims, kind="sum")
    # the parts' means again, from the partial sums, for the sums over parts: the part kernel keeps
    # its means to itself (a value of the reduced shape is no output a column kernel writes)
    again = _make("div", [sums, _constant(length, sums.shape, reduce.dtype, f"{name}_length", names)],
                  names.new(f"{name}_part_mean"))
    centre, spread = _kept_source(copies[id(reduce.operands[0].operands[0].operands[1])],  # broadcast of m
                                  tuple(reduce.attrs["dims"]), names)
    mapped = [kept.index(k if k < dim else k + 1) for k in spread]
    part_mean = _make("add", [part_shift(), again], names.new(f"{name}_part_centre"))
    apart = _make("sub", [part_mean, _make("broadcast_in_dim", [centre], names.new(f"{name}_m_b"),
                                           shape=sums.shape, broadcast_dimensions=mapped)],
                  names.new(f"{name}_apart"))
    between = _make("reduce", [_make("mul", [apart, apart], names.new(f"{name}_apart_sq"))],
                    names.new(f"{name}_between"), dims=(position,), kind="sum")
    total = _make("reduce", [within], names.new(f"{name}_within"), dims=(position,), kind="sum")
    weight = _constant(length, between.shape, reduce.dtype, f"{name}_weight", names)
    weighted = _make("mul", [between, weight], names.new(f"{name}_between_c"))
    return _make("add", [total, weighted], name, layout=reduce.layout)


def _make(
    op: str,
    operands: Sequence[Node],
    name: str,
    *,
    shape: Sequence[int] = (),
    dtype: DType | None = None,
    layout: Layout | None = None,
    **attrs: Any,
) -> Node:
    """A node whose shape and dtype come from the op's inference rule (the one ``verify`` checks)."""
    out_shape, out_dtype = infer(op, operands, attrs, (tuple(shape), dtype))
    return Node(name, op, tuple(operands), tuple(out_shape), out_dtype, attrs, layout)


class _Names:
    """Unique node names: ``base``, or ``base_N`` with the smallest N >= 1 not taken."""

    def __init__(self, taken: Iterable[str]) -> None:
        self.taken = set(taken)

    def new(self, base: str) -> str:
        name, count = base, 0
        while name in self.taken:
            count += 1
            name = f"{base}_{count}"
        self.taken.add(name)
        return name
