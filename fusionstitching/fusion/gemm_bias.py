"""``bias_into_gemms``: a library GEMM adds the bias of a linear layer in its epilogue.

The frontend lowers ``addmm(bias, x, w)`` (every ``nn.Linear`` with a bias, GPT-2's ``Conv1D``) to a
``dot_general`` and an elementwise ``add`` of the broadcast bias, so that the add fuses with what
follows. Where the sum must be written to memory whatever the plan, the add costs a full extra pass
over the product: a generated kernel reads the GEMM's result and writes the sum (the MLP's logits,
which the backward saves: 16 MB read and 16 MB written). cuBLASLt adds a row bias in the GEMM's
epilogue, where the accumulator already is, for the cost of reading the bias once; torch's ``addmm``
takes that path for a contiguous 1-D bias. The pass rewrites such a dot and add into one library
call of ``aten.addmm`` before exploration.

A dot and add are rewritten when

- the dot is a library GEMM (not a small dot the code generator fuses), a plain matrix product
  ``[M, K] x [K, N]`` (no batch dims, contracting the lhs's last dim and the rhs's first), with
  ``M, N, K >= 2`` (torch's epilogue path needs matrices), and the add is its only user;
- the other operand of the add is a 1-D value of length ``N`` broadcast along the rows, of the
  dot's dtype (f32, f16 or bf16), stored densely (not itself a broadcast, which the library would
  get as a stride-0 view: torch's ``addmm`` then copies it into the result before the GEMM), and
  the add has the dot's dtype and row-major layout;
- the sum is materialized in every plan: it is a graph output (a value the backward saves) or every
  user of it is a library call. Elsewhere the add stays in the generated kernels, where it costs
  nothing: the kernel that reads the product would read the sum instead, and the bias is one row.

Precision: the sum is rounded once, from the GEMM's f32 accumulator plus the bias, as eager's
``addmm`` does; the decomposed form rounds the product to the dot's dtype first.
"""

from __future__ import annotations

import dataclasses

from fusionstitching.fusion.legality import GEMM_CALL, is_small_dot
from fusionstitching.graph.graph import Graph, Node
from fusionstitching.graph.ops import DType
from fusionstitching.graph.transforms import _rebuilt
from fusionstitching.options import Options

DTYPES = (DType.F32, DType.F16, DType.BF16)
# torch takes the epilogue path for matrices of at most this extent per dim (cuBLASLt's limit on a
# leading dimension with its heuristics); beyond it addmm copies the bias into the result first
MAX_EXTENT = 65535 * 32


def bias_into_gemms(graph: Graph, options: Options) -> tuple[Graph, list[str]]:
    """A copy of ``graph`` where each dot and bias add the module docstring names is one ``addmm``
    library call (keeping the add's name); the names of the adds rewritten."""
    users = graph.index.users
    outputs = graph.index.output_ids
    chosen: dict[int, tuple[Node, Node]] = {}
    for node in graph.nodes:
        match = _dot_and_bias(node, users, outputs, options)
        if match is not None:
            chosen[id(node)] = match
    if not chosen:
        return graph, []
    copies: dict[int, Node] = {id(p): p for p in graph.parameters}
    for old in graph.nodes:
        if id(old) in copies:
            continue
        if id(old) in chosen:
            dot, bias = chosen[id(old)]
            operands = (copies[id(bias)], copies[id(dot.operands[0])], copies[id(dot.operands[1])])
            call = {"args": [{"operand": 0}, {"operand": 1}, {"operand": 2}], "kwargs": {}}
            copies[id(old)] = Node(old.name, "library", operands, old.shape, old.dtype,
                                   {"target": GEMM_CALL, "call": call, "out_index": -1}, old.layout)
            continue
        copies[id(old)] = dataclasses.replace(old, operands=tuple(copies[id(x)] for x in old.operands))
    return _rebuilt(graph, copies), [f"{old.name}: bias added by the GEMM ({GEMM_CALL})"
                                     for old in graph.nodes if id(old) in chosen]


def _dot_and_bias(add: Node, users, outputs: frozenset[int], options: Options) -> tuple[Node, Node] | None:
    """The (dot, 1-D bias) that ``add`` sums, when the pass rewrites them (module docstring)."""
    if add.op != "add" or len(add.shape) != 2 or add.dtype not in DTYPES:
        return None
    if add.layout is not None and not add.layout.is_contiguous(add.shape):
        return None
    for dot, broadcast in (add.operands, reversed(add.operands)):
        if dot.op != "dot_general" or broadcast.op != "broadcast_in_dim" or dot is broadcast:
            continue
        bias = broadcast.operands[0]
        if not (_plain_matmul(dot, add, options) and len(users[dot]) == 1 and id(dot) not in outputs):
            continue
        if bias.shape != (add.shape[1],) or bias.dtype != add.dtype \
                or tuple(broadcast.attrs["broadcast_dimensions"]) != (1,):
            continue
        if bias.op == "broadcast_in_dim" or (bias.layout is not None and not bias.layout.is_contiguous(bias.shape)):
            continue  # a stride-0 view (one value for every column) would take addmm's copying path
        if id(add) in outputs or (users[add] and all(_library(u, options) for u in users[add])):
            return dot, bias
    return None


def _plain_matmul(dot: Node, add: Node, options: Options) -> bool:
    attrs = dot.attrs
    if attrs["lhs_batch"] or attrs["rhs_batch"] or tuple(attrs["lhs_contract"]) != (1,) \
            or tuple(attrs["rhs_contract"]) != (0,):
        return False
    lhs, rhs = dot.operands
    if dot.dtype != add.dtype or lhs.dtype != dot.dtype or rhs.dtype != dot.dtype or len(lhs.shape) != 2:
        return False
    if dot.layout is not None and not dot.layout.is_contiguous(dot.shape):
        return False
    extents = (*lhs.shape, rhs.shape[1])
    return all(2 <= e <= MAX_EXTENT for e in extents) and not is_small_dot(dot, options)


def _library(node: Node, options: Options) -> bool:
    """A user that reads the sum as a library operand (so some buffer holds it in every plan)."""
    if node.op == "dot_general":
        return not is_small_dot(node, options)
    return node.op == "library"
