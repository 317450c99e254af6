"""Which values of a kernel only ever reach half-precision results, and may be computed with the
GPU's approximate instructions.

A bf16 or f16 program computes in f32 registers and rounds to the half type (``values._round``).
An f32 exponential correctly rounded (``expf``, about ten instructions with its range reduction)
and one from the hardware's ``ex2.approx`` (``__expf``: a multiply and one MUFU instruction, a few
f32 ulps, growing with |x|) differ by far less than the 2^-8 relative spacing of bf16, and a
sigmoid as ``1 / (1 + e^-x)`` spends as much again on the IEEE division that ``__fdividef`` does
in two instructions. In a bf16 GroupNorm + SiLU the exact sigmoid made the elementwise kernel
issue-bound rather than bound by its memory traffic.

A value is *half-bound* when its result can reach memory only through a rounding to a half type
and through operations that change a small relative error continuously and by no more than a
small factor (``_CONTINUOUS``): arithmetic, the smooth functions, sums, and the shape ops that
move values. A value read by a comparison, an integer conversion, ``floor``/``sign``/``rem`` (a
flip of one ulp can flip the result), ``sin``/``cos``, ``pow`` or a product (they scale the error
by the argument's size, the exponent or the count), or that the kernel writes in f32 or f64, is
not; nor is one read by a max or min. A max selects one of its operands, and the backward of
``amax`` compares the saved maximum for equality with the operand recomputed in another kernel,
where a comparison reads it and it is exact: an approximate maximum would then match no element.
Only half-bound nodes get the approximate instructions; every other value keeps the exact ones,
so an f32 program's results do not change.
"""

from __future__ import annotations

from fusionstitching.graph.graph import Graph, Node
from fusionstitching.graph.ops import DType
from fusionstitching.graph.pattern import Pattern

# Readers through which a small relative error in an operand stays small in the result.
_CONTINUOUS = frozenset({
    "add", "sub", "mul", "div", "neg", "abs", "copy", "exp", "log", "log1p", "expm1", "tanh", "erf",
    "sigmoid", "sqrt", "rsqrt", "select", "convert", "broadcast_in_dim", "reshape", "transpose", "slice",
    "concatenate", "pad", "gather",
})


def _continuous(reader: Node) -> bool:
    return reader.op in _CONTINUOUS or (reader.op == "reduce" and reader.attrs["kind"] == "sum")


def half_bound(graph: Graph, pattern: Pattern) -> frozenset[int]:
    """The ids of ``pattern``'s nodes that are half-bound (see the module note): f32, bf16 or f16
    nodes that are no f32 output of the kernel, whose every reader in the kernel is a continuous op
    that is itself half-bound, and that are read in the kernel or are a half output of it."""
    index = graph.index
    inside = {id(n) for n in pattern.nodes}
    outputs = {id(n) for n in pattern.outputs}
    bound: set[int] = set()
    for node in sorted(pattern.nodes, key=index.position.__getitem__, reverse=True):  # readers first
        if node.dtype != DType.F32 and not node.dtype.is_half:
            continue
        if id(node) in outputs and not node.dtype.is_half:
            continue
        readers = [u for u in index.users[node] if id(u) in inside]
        if not readers and id(node) not in outputs:
            continue
        if all(_continuous(u) and id(u) in bound for u in readers):
            bound.add(id(node))
    return frozenset(bound)


__all__ = ["half_bound"]
