"""``pad_unaligned_dots``: library GEMMs fed operands whose rows are whole 16-byte vectors.

cuBLAS takes its fast kernels (16-byte loads) only where every operand's leading dimension (the
innermost dim of its storage) and the result's are multiples of 16 bytes; otherwise it runs a
kernel of 2- or 4-byte loads (CUTLASS "align1"/"align2"), several times slower: a GPT-2 LM head and
its two gradients (vocabulary 50257). The pass rewrites such a dot in the graph, before
exploration, so that the fused kernels around it do the padding at no extra pass:

- an unaligned contracted dim is zero-padded in both operands (the zeros add nothing);
- an unaligned free dim is zero-padded in its operand, and the result is sliced back.

A pad of a value computed by a kernel is written by that kernel (the loss gradient's kernel writes
the padded gradient); a slice is read by the kernels that consume the product. Only pads of graph
inputs or library results (a weight), and slices that must be materialized (a graph output), cost a
copy: the pass pads a GEMM only where those copies take less time than the slow kernel loses.
What it loses is measured on the GPU where there is one (``Options.gemm_timings``: the GEMM timed
unaligned and padded, ``runtime/gemm_timing.py``); without a measurement, the least it could lose
is taken: the padded product's extra arithmetic subtracted from the GEMM's arithmetic at the GPU's
datasheet rate. The unaligned kernels lose far more than that where they are memory-bound
(their stores are 2- to 8-byte wide), which only a measurement sees. A pad goes under a transpose
view (the weight gradient reads the loss gradient transposed: both GEMMs then share one padded
buffer) and under a reshape that keeps the padded dims (attention probabilities computed over
[batch, heads, L, L] are padded there, by the softmax kernel).

A product that a training forward saves for its backward (GPT-2's logits, 412 MB in bf16 at batch
8 × 512) need not be copied out of the padded buffer: no user sees a saved tensor's layout, so
``padded_layouts`` promises it the padded product's strides (the backend tells AOTAutograd before
the backward is compiled, as for ``graph.layout.saved_layouts``). The pass then gives the output a
slice of its own, which the plan runs as a view of the product (``legality.sliced_output_views``),
while the kernels reading the value read the product through another slice.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

from fusionstitching.cost.bandwidth import DATASHEET_FLOOR_US, bandwidth_model
from fusionstitching.cost.gpu_spec import SPECS, GpuSpec, gpu_spec
from fusionstitching.fusion.legality import dot_flops, is_small_dot
from fusionstitching.graph.graph import Graph, Node, verify
from fusionstitching.graph.node import Layout, contiguous_strides
from fusionstitching.graph.transforms import _make, _Names, _rebuilt
from fusionstitching.options import Options

VECTOR_BYTES = 16  # the widest load of a GEMM kernel's operand tiles


@dataclasses.dataclass(frozen=True)
class GemmProblem:
    """A library GEMM as ``runtime.program.dot_function`` hands it to cuBLAS: ``batch`` products of
    an ``m`` x ``k`` by a ``k`` x ``n`` matrix, each operand stored with the contracted dim
    innermost or not, and the sizes the padding pass would pad them to."""

    dtype: str  # the operands'
    out_dtype: str
    batch: int
    m: int
    k: int
    n: int
    lhs_k_inner: bool  # lhs stored m x k (else k x m)
    rhs_k_inner: bool  # rhs stored n x k (else k x n)
    padded: tuple[int, int, int]  # (m, k, n) of the padded operands

    def describe(self) -> str:
        """The problem as one line, the key of its measurement."""
        layout = ("N" if self.lhs_k_inner else "T") + ("T" if self.rhs_k_inner else "N")
        m, k, n = self.padded
        return (f"{self.dtype}->{self.out_dtype} {layout} batch {self.batch} m {self.m} k {self.k} n {self.n} "
                f"padded to m {m} k {k} n {n}")


@dataclasses.dataclass(frozen=True)
class PaddedDot:
    """One dot the pass padded, for the plan's notes."""

    node: str
    before: tuple[tuple[int, ...], tuple[int, ...]]
    after: tuple[tuple[int, ...], tuple[int, ...]]
    copy_us: float  # what the pads and slices cost
    saved_us: float  # what the padded GEMM saves: measured, or the least the model expects
    measured: bool = False

    def __str__(self) -> str:
        saved = "measured" if self.measured else "at least"
        return (f"{self.node}: operands {list(self.before[0])} x {list(self.before[1])} padded to "
                f"{list(self.after[0])} x {list(self.after[1])} (copies {self.copy_us:.1f} us, "
                f"saves {saved} {self.saved_us:.1f} us)")


def pad_unaligned_dots(graph: Graph, spec: GpuSpec, options: Options, free: Sequence[int] = ()
                       ) -> tuple[Graph, list[PaddedDot]]:
    """A copy of ``graph`` whose library dots with unaligned leading dimensions take padded
    operands (see the module docstring), and what was padded. A padded dot that is an output
    promised the padded product's layout, or one of the outputs ``free`` (whose layout the caller
    will choose), costs no copy and gets a slice of its own."""
    candidates = _candidates(graph, options)
    if not candidates:
        return graph, []
    outputs: dict[int, int] = {}
    for k, out in enumerate(graph.outputs):
        if out is not None:
            outputs.setdefault(id(out), k)
    names = _Names(n.name for n in graph.nodes)
    made: dict[tuple, Node] = {}
    copies: dict[int, Node] = {id(p): p for p in graph.parameters}
    viewed: dict[int, Node] = {}  # output index → its own slice of the padded product
    done: list[PaddedDot] = []
    chosen = {id(n) for n in candidates}
    for old in graph.nodes:
        if id(old) in copies:
            continue
        operands = tuple(copies[id(x)] for x in old.operands)
        new = old if operands == old.operands else dataclasses.replace(old, operands=operands)
        if id(old) in chosen:
            highs = _paddings(new)
            if highs is not None:
                k = outputs.get(id(old))
                laid_out = k is not None and k not in graph.mutations and (
                    k in free or _promised_padded(graph.output_layouts[k], new, highs))
                verdict = _worth(new, highs, spec, options, k is not None and not laid_out)
                if verdict is not None:
                    lhs = _padded(new.operands[0], highs[0], names, made)
                    rhs = _padded(new.operands[1], highs[1], names, made)
                    product = _make("dot_general", [lhs, rhs], names.new(f"{old.name}_padded"), dtype=new.dtype,
                                    **new.attrs)
                    rank = len(new.shape)
                    window = {"start": (0,) * rank, "limit": new.shape, "stride": (1,) * rank}
                    if laid_out:
                        viewed[k] = _make("slice", [product], old.name, layout=old.layout, **window)
                        new = _make("slice", [product], names.new(f"{old.name}_read"), **window)
                    else:
                        new = _make("slice", [product], old.name, layout=old.layout, **window)
                    done.append(PaddedDot(old.name, (old.operands[0].shape, old.operands[1].shape),
                                          (lhs.shape, rhs.shape), *verdict))
        copies[id(old)] = new
    if not done:
        return graph, []
    if not viewed:
        return _rebuilt(graph, copies), done
    result = Graph(graph.parameters, [None if out is None else viewed.get(k, copies[id(out)])
                                      for k, out in enumerate(graph.outputs)],
                   name=graph.name, mutations=graph.mutations, output_layouts=graph.output_layouts)
    verify(result)
    result.origins, result.checks = graph.origins, graph.checks
    return result, done


def unaligned_gemms(graph: Graph, options: Options) -> list[GemmProblem]:
    """The GEMM problems of ``graph``'s library dots that the pass would pad, each once, for
    ``runtime/gemm_timing.py`` to time before the graph is planned."""
    problems: dict[str, GemmProblem] = {}
    for dot in _candidates(graph, options):
        highs = _paddings(dot)
        if highs is not None:
            problem = gemm_problem(dot, highs)
            problems.setdefault(problem.describe(), problem)
    return list(problems.values())


def gemm_problem(dot: Node, highs: tuple[list[int], list[int]]) -> GemmProblem:
    """``dot`` as the GEMM library sees it, with operands padded by ``highs`` (``_paddings``)."""
    lhs, rhs = dot.operands
    lb, rb, lc, rc = (list(dot.attrs[k]) for k in ("lhs_batch", "rhs_batch", "lhs_contract", "rhs_contract"))
    lfree = [d for d in range(len(lhs.shape)) if d not in lb + lc]
    rfree = [d for d in range(len(rhs.shape)) if d not in rb + rc]

    def size(node: Node, dims: list[int], high: list[int] | None = None) -> int:
        return math.prod(node.shape[d] + (high[d] if high else 0) for d in dims)

    return GemmProblem(lhs.dtype.value, dot.dtype.value, size(lhs, lb), size(lhs, lfree), size(lhs, lc),
                       size(rhs, rfree), _storage_inner(lhs) in lc, _storage_inner(rhs) in rc,
                       (size(lhs, lfree, highs[0]), size(lhs, lc, highs[0]), size(rhs, rfree, highs[1])))


def _candidates(graph: Graph, options: Options) -> list[Node]:
    """The library dots of ``graph``. Empty products are folded to constants before exploration
    (``fold_empty``); a caller that runs before it (``padded_layouts``) has nothing to pad there."""
    return [n for n in graph.nodes if n.op == "dot_general" and not is_small_dot(n, options)
            and all(x.size for x in n.operands) and n.size]


def padded_layouts(graph: Graph, free: Sequence[int], options: Options) -> Graph:
    """``graph`` with the outputs ``free`` (a training forward's saved tensors) that
    ``pad_unaligned_dots`` pads promised the layout of their padded product: the backward reads
    them there, and no kernel copies them out of it. ``graph`` itself where there is none."""
    if not options.pad_gemms or not free:
        return graph
    padded, _ = pad_unaligned_dots(graph, gpu_spec(options.device), options, free)
    layouts = list(graph.output_layouts)
    for k in free:
        out, before = padded.outputs[k], graph.outputs[k]
        if before is not None and before.op == "dot_general" and out.op == "slice" \
                and out.operands[0].op == "dot_general" and sum(o is out for o in padded.outputs) == 1:
            layouts[k] = Layout(contiguous_strides(out.operands[0].shape))
    if layouts == list(graph.output_layouts):
        return graph
    result = Graph(graph.parameters, graph.outputs, name=graph.name, mutations=graph.mutations,
                   output_layouts=layouts)
    result.origins, result.checks = graph.origins, graph.checks
    return result


def _product_shape(dot: Node, highs: tuple[list[int], list[int]]) -> tuple[int, ...]:
    """The shape of ``dot`` on operands padded by ``highs``: batch, lhs free, rhs free dims."""
    lhs, rhs = dot.operands
    lb, rb, lc, rc = (list(dot.attrs[k]) for k in ("lhs_batch", "rhs_batch", "lhs_contract", "rhs_contract"))
    lfree = [d for d in range(len(lhs.shape)) if d not in lb + lc]
    rfree = [d for d in range(len(rhs.shape)) if d not in rb + rc]
    return tuple([lhs.shape[d] + highs[0][d] for d in lb + lfree] + [rhs.shape[d] + highs[1][d] for d in rfree])


def _promised_padded(layout: Layout | None, dot: Node, highs: tuple[list[int], list[int]]) -> bool:
    """Whether an output's promised ``layout`` is that of the padded product (a view of it): the
    product's own contiguous layout."""
    return layout is not None and layout.is_contiguous(_product_shape(dot, highs))


def _vector(node: Node) -> int:
    return max(1, VECTOR_BYTES // node.dtype.itemsize)


def _storage_inner(node: Node) -> int:
    """The dim of ``node`` that is innermost in memory: the last, unless ``node`` is a transpose
    view, whose innermost dim is its operand's, permuted."""
    if node.op == "transpose":
        return list(node.attrs["permutation"]).index(_storage_inner(node.operands[0]))
    return len(node.shape) - 1


def _paddings(dot: Node) -> tuple[list[int], list[int]] | None:
    """How much to pad each dim of the two operands (``high`` of a pad), or None if nothing is
    unaligned. A contracted dim is padded alike in both operands."""
    lhs, rhs = dot.operands
    if not lhs.shape or not rhs.shape:
        return None
    lb, rb, lc, rc = (list(dot.attrs[k]) for k in ("lhs_batch", "rhs_batch", "lhs_contract", "rhs_contract"))
    lfree = [d for d in range(len(lhs.shape)) if d not in lb + lc]
    rfree = [d for d in range(len(rhs.shape)) if d not in rb + rc]
    highs = ([0] * len(lhs.shape), [0] * len(rhs.shape))
    shapes = (lhs.shape, rhs.shape)
    vectors = (_vector(lhs), _vector(rhs))

    def pad(side: int, dim: int, vector: int) -> None:
        highs[side][dim] = max(highs[side][dim], -shapes[side][dim] % vector)

    for side, inner, contract, other in ((0, _storage_inner(lhs), lc, rc), (1, _storage_inner(rhs), rc, lc)):
        if inner in contract:  # both operands' contracted dims grow alike
            vector = max(vectors)
            j = contract.index(inner)
            pad(side, inner, vector)
            pad(1 - side, other[j], vector)
        elif inner in (lfree, rfree)[side]:
            pad(side, inner, vectors[side])
    out_side, out_free = (1, rfree) if rfree else (0, lfree)
    if out_free:
        pad(out_side, out_free[-1], _vector(dot))
    if not any(highs[0]) and not any(highs[1]):
        return None
    return highs


def _worth(dot: Node, highs: tuple[list[int], list[int]], spec: GpuSpec, options: Options, is_output: bool
           ) -> tuple[float, float, bool] | None:
    """(copies µs, saved µs, measured) when what padding costs takes less time than the padded GEMM
    saves, else None. A pad of a graph input or a library result is a copy (read and write); one of
    a kernel's value costs that kernel's extra write; a graph output sliced back to its shape is a
    copy. The saving is measured (``Options.gemm_timings``), and then each copy also costs a
    kernel's floor; without a measurement it is the least the model can promise: the GEMM's
    arithmetic at the datasheet rate less the padded product's extra arithmetic."""
    bandwidth = spec.peak_bandwidth_gbs * 1e3  # bytes per µs
    floor_us = bandwidth_model(spec.name).floor_us if spec.name in SPECS else DATASHEET_FLOOR_US
    moved, copies = 0, 0
    for operand, high in zip(dot.operands, highs):
        if not any(high):
            continue
        padded = math.prod(s + h for s, h in zip(operand.shape, high)) * operand.dtype.itemsize
        source = operand
        while source.op in ("transpose", "reshape"):
            source = source.operands[0]
        standalone = source.op in ("parameter", "library", "dot_general", "constant")
        moved += padded + (operand.size * operand.dtype.itemsize if standalone else 0)
        copies += standalone
    lb, rb, lc, rc = (dot.attrs[k] for k in ("lhs_batch", "rhs_batch", "lhs_contract", "rhs_contract"))
    sliced = any(h for d, h in enumerate(highs[0]) if d not in lb and d not in lc) or \
        any(h for d, h in enumerate(highs[1]) if d not in rb and d not in rc)
    if is_output and sliced:
        moved += 2 * dot.size * dot.dtype.itemsize
        copies += 1
    copy_us = moved / bandwidth
    timings = {problem: (unaligned, padded) for problem, unaligned, padded in options.gemm_timings}
    timed = timings.get(gemm_problem(dot, highs).describe())
    if timed is not None:  # GPU times on both sides: each copy a kernel, with its floor
        copy_us += copies * floor_us
        saved_us = timed[0] - timed[1]
    else:  # throughput terms on both sides
        rate = spec.peak_half_tflops if dot.operands[0].dtype.is_half else spec.peak_f32_tflops
        if rate <= 0:
            return None
        gemm_us = dot_flops(dot) / (rate * 1e6)
        # contracted dims are padded alike in both operands, so the lhs's dims and the rhs's free
        # dims give the padded product's growth
        growth = math.prod((s + h) / s for s, h in zip(dot.operands[0].shape, highs[0]))
        growth *= math.prod((s + h) / s for d, (s, h) in enumerate(zip(dot.operands[1].shape, highs[1]))
                            if d not in rb and d not in rc)
        saved_us = gemm_us * (2 - growth)
    return (copy_us, saved_us, timed is not None) if copy_us < saved_us else None


def _kept_by_reshape(node: Node) -> int:
    """How many trailing dims a reshape keeps as they are (it merges or splits only dims before
    them)."""
    before, after, kept = node.operands[0].shape, node.shape, 0
    while kept < min(len(before), len(after)) and before[len(before) - 1 - kept] == after[len(after) - 1 - kept]:
        kept += 1
    return kept


def _padded(node: Node, high: list[int], names: _Names, made: dict[tuple, Node]) -> Node:
    """``node`` zero-padded by ``high`` at the end of each dim; under a transpose view the pad goes
    to the transposed value, so that readers of either layout share it, and under a reshape that
    keeps the padded dims to the reshaped value. One node per padding."""
    if not any(high):
        return node
    key = (id(node), tuple(high))
    if key in made:
        return made[key]
    kept = _kept_by_reshape(node) if node.op == "reshape" else 0
    if node.op == "transpose":
        permutation = list(node.attrs["permutation"])
        inner_high = [0] * len(high)
        for position, dim in enumerate(permutation):
            inner_high[dim] = high[position]
        inner = _padded(node.operands[0], inner_high, names, made)
        result = _make("transpose", [inner], names.new(f"{node.name}_padded"), permutation=tuple(permutation))
    elif kept and not any(high[:len(high) - kept]):
        # only dims the reshape keeps are padded: the pad goes to its operand, which then lies in
        # the iteration space of the kernel computing it (a softmax over [batch, heads, L, L] that
        # the GEMM reads as [batch x heads, L, L] writes its rows padded)
        source = node.operands[0]
        inner_high = [0] * (len(source.shape) - kept) + high[len(high) - kept:]
        inner = _padded(source, inner_high, names, made)
        result = _make("reshape", [inner], names.new(f"{node.name}_padded"),
                       shape=tuple(s + h for s, h in zip(node.shape, high)))
    else:
        rank = len(node.shape)
        result = _make("pad", [node], names.new(f"{node.name}_padded"), low=(0,) * rank, high=tuple(high),
                       interior=(0,) * rank, value=0.0)
    made[key] = result
    return result
