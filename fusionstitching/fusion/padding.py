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
copy: the pass pads a GEMM only where those copies and the padded product's extra arithmetic take
less time than the GEMM's arithmetic at the GPU's datasheet rate, the least that the slow kernel
would lose. A pad goes under a transpose view
(the weight gradient reads the loss gradient transposed: both GEMMs then share one padded buffer).
"""

from __future__ import annotations

import dataclasses
import math

from fusionstitching.cost.gpu_spec import GpuSpec
from fusionstitching.fusion.legality import dot_flops, is_small_dot
from fusionstitching.graph.graph import Graph, Node
from fusionstitching.graph.transforms import _make, _Names, _rebuilt
from fusionstitching.options import Options

VECTOR_BYTES = 16  # the widest load of a GEMM kernel's operand tiles


@dataclasses.dataclass(frozen=True)
class PaddedDot:
    """One dot the pass padded, for the plan's notes."""

    node: str
    before: tuple[tuple[int, ...], tuple[int, ...]]
    after: tuple[tuple[int, ...], tuple[int, ...]]
    copy_us: float
    gemm_us: float

    def __str__(self) -> str:
        return (f"{self.node}: operands {list(self.before[0])} x {list(self.before[1])} padded to "
                f"{list(self.after[0])} x {list(self.after[1])} (cost {self.copy_us:.1f} us, "
                f"GEMM at least {self.gemm_us:.1f} us)")


def pad_unaligned_dots(graph: Graph, spec: GpuSpec, options: Options) -> tuple[Graph, list[PaddedDot]]:
    """A copy of ``graph`` whose library dots with unaligned leading dimensions take padded
    operands (see the module docstring), and what was padded."""
    candidates = [n for n in graph.nodes if n.op == "dot_general" and not is_small_dot(n, options)]
    if not candidates:
        return graph, []
    outputs = graph.index.output_ids
    names = _Names(n.name for n in graph.nodes)
    made: dict[tuple, Node] = {}
    copies: dict[int, Node] = {id(p): p for p in graph.parameters}
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
                verdict = _worth(new, highs, spec, id(old) in outputs)
                if verdict is not None:
                    lhs = _padded(new.operands[0], highs[0], names, made)
                    rhs = _padded(new.operands[1], highs[1], names, made)
                    product = _make("dot_general", [lhs, rhs], names.new(f"{old.name}_padded"), dtype=new.dtype,
                                    **new.attrs)
                    rank = len(new.shape)
                    new = _make("slice", [product], old.name, start=(0,) * rank, limit=new.shape,
                                stride=(1,) * rank, layout=old.layout)
                    done.append(PaddedDot(old.name, (old.operands[0].shape, old.operands[1].shape),
                                          (lhs.shape, rhs.shape), *verdict))
        copies[id(old)] = new
    if not done:
        return graph, []
    return _rebuilt(graph, copies), done


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


def _worth(dot: Node, highs: tuple[list[int], list[int]], spec: GpuSpec, is_output: bool
           ) -> tuple[float, float] | None:
    """(cost µs, GEMM µs) when what padding costs (its copies, and the padded GEMM's extra
    arithmetic) takes less time than the GEMM's arithmetic at the datasheet rate, else None. A pad of a graph input or a library result is a copy (read and
    write); one of a kernel's value costs that kernel's extra write; a graph output sliced back to
    its shape is a copy."""
    rate = spec.peak_half_tflops if dot.operands[0].dtype.is_half else spec.peak_f32_tflops
    if rate <= 0:
        return None
    gemm_us = dot_flops(dot) / (rate * 1e6)
    moved = 0
    for operand, high in zip(dot.operands, highs):
        if not any(high):
            continue
        padded = math.prod(s + h for s, h in zip(operand.shape, high)) * operand.dtype.itemsize
        source = operand
        while source.op in ("transpose", "reshape"):
            source = source.operands[0]
        standalone = source.op in ("parameter", "library", "dot_general", "constant")
        moved += padded + (operand.size * operand.dtype.itemsize if standalone else 0)
    lb, rb, lc, rc = (dot.attrs[k] for k in ("lhs_batch", "rhs_batch", "lhs_contract", "rhs_contract"))
    sliced = any(h for d, h in enumerate(highs[0]) if d not in lb and d not in lc) or \
        any(h for d, h in enumerate(highs[1]) if d not in rb and d not in rc)
    if is_output and sliced:
        moved += 2 * dot.size * dot.dtype.itemsize
    # the padded GEMM's extra arithmetic: contracted dims are padded alike in both operands, so
    # the lhs's dims and the rhs's free dims give the product's growth
    growth = math.prod((s + h) / s for s, h in zip(dot.operands[0].shape, highs[0]))
    growth *= math.prod((s + h) / s for d, (s, h) in enumerate(zip(dot.operands[1].shape, highs[1]))
                        if d not in rb and d not in rc)
    copy_us = moved / (spec.peak_bandwidth_gbs * 1e3) + gemm_us * (growth - 1)
    return (copy_us, gemm_us) if copy_us < gemm_us else None


def _padded(node: Node, high: list[int], names: _Names, made: dict[tuple, Node]) -> Node:
    """``node`` zero-padded by ``high`` at the end of each dim; under a transpose view the pad goes
    to the transposed value, so that readers of either layout share it. One node per padding."""
    if not any(high):
        return node
    key = (id(node), tuple(high))
    if key in made:
        return made[key]
    if node.op == "transpose":
        permutation = list(node.attrs["permutation"])
        inner_high = [0] * len(high)
        for position, dim in enumerate(permutation):
            inner_high[dim] = high[position]
        inner = _padded(node.operands[0], inner_high, names, made)
        result = _make("transpose", [inner], names.new(f"{node.name}_padded"), permutation=tuple(permutation))
    else:
        rank = len(node.shape)
        result = _make("pad", [node], names.new(f"{node.name}_padded"), low=(0,) * rank, high=tuple(high),
                       interior=(0,) * rank, value=0.0)
    made[key] = result
    return result
