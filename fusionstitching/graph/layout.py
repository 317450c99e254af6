"""Convolutions fed and read channels-last, and transposes sunk through the ops between them.

cuDNN's fast convolution kernels on Hopper read and write NHWC. Given NCHW tensors, cuDNN converts
each input to NHWC and each result back (its ``nchwToNhwcKernel`` and ``nhwcToNchwKernel``), and
some shapes take slower NCHW-specific algorithms. ``channels_last_convolutions`` gives a
convolution its input and weight as NHWC nodes (``transpose(x, (0, 2, 3, 1))``), which the call
receives as permuted views (NCHW sizes, channels-last strides: the operand template's
``"permute"``), and holds its result as the NHWC permutation of what cuDNN returns
(``"permute_result"``), transposed back to NCHW for its readers. The kernels that produce the
input then write it in NHWC, and the kernels that read the result read NHWC.

``sink_transposes`` then moves those transposes past the elementwise ops, broadcasts and reductions
between convolutions, so that these run in NHWC and a transpose back to NCHW meets the next
convolution's transpose to NHWC and both vanish (``fold_views``). An elementwise op sinks the
transpose ``p`` when every operand is a transpose by ``p`` or a broadcast (a broadcast of a
per-channel vector is a broadcast along another dim); a reduce of a transpose reduces the permuted
dims of its operand; a pad or a slice of a transpose pads or slices the permuted dims (a max
pooling's windows). Values leave NHWC only where a reader needs NCHW: a graph output, a library
call that is not a convolution, a reshape.

A convolution is left as it is where its input or its result is a graph output: a training
forward saves both for the backward in NCHW, so that an NHWC copy would be written besides them;
and where it is transposed, grouped in a way torch does not take channels-last, or not 2-D.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from fusionstitching.graph.graph import Graph, Node
from fusionstitching.graph.ops import is_elementwise
from fusionstitching.graph.transforms import _make, _Names, _rebuilt

CONVOLUTION = "aten.convolution.default"
TO_NHWC = (0, 2, 3, 1)
TO_NCHW = (0, 3, 1, 2)


# Library ops given NHWC operands (the positions of their NCHW tensor arguments) that then return
# NHWC results: convolutions, and the max pooling after ResNet's first convolution.
CHANNELS_LAST_OPS = {CONVOLUTION: (0, 1), "aten.max_pool2d_with_indices.default": (0,)}


def channels_last_convolutions(graph: Graph) -> Graph:
    """A copy of ``graph`` whose 2-D convolutions (and max poolings) read and write NHWC nodes
    (module docstring)."""
    outputs = graph.index.output_ids
    chosen = {id(n) for n in graph.nodes if _convertible(n, outputs)}
    if not chosen:
        return graph
    names = _Names(n.name for n in graph.nodes)
    copies: dict[int, Node] = {id(p): p for p in graph.parameters}
    nhwc: dict[int, Node] = {}  # operand → its transpose, one for all calls (and outputs of a call)
    for n in graph.nodes:
        if id(n) in copies:
            continue
        operands = tuple(copies[id(x)] for x in n.operands)
        if id(n) not in chosen:
            copies[id(n)] = dataclasses.replace(n, operands=operands)
            continue
        call = dict(n.attrs["call"])
        args = list(call["args"])
        permuted = list(operands)
        for position in CHANNELS_LAST_OPS[n.attrs["target"]]:
            template = dict(args[position])
            k = template["operand"]
            x = operands[k]
            if id(x) not in nhwc:
                nhwc[id(x)] = _make("transpose", [x], names.new(f"{x.name}_nhwc"), permutation=TO_NHWC)
            permuted[k] = nhwc[id(x)]
            template["permute"] = list(TO_NCHW)
            template["strides"] = _channels_last_strides(x.shape)
            args[position] = template
        call["args"] = args
        call["permute_result"] = list(TO_NHWC)
        shape = tuple(n.shape[d] for d in TO_NHWC)
        result = dataclasses.replace(n, name=names.new(f"{n.name}_nhwc"), operands=tuple(permuted), shape=shape,
                                     attrs={**n.attrs, "call": call}, layout=None)
        copies[id(n)] = _make("transpose", [result], n.name, permutation=TO_NCHW, layout=n.layout)
    return _rebuilt(graph, copies)


def _convertible(node: Node, outputs: set[int]) -> bool:
    if node.op != "library" or node.attrs["target"] not in CHANNELS_LAST_OPS or len(node.shape) != 4:
        return False
    call = node.attrs["call"]
    args = call.get("args", [])
    positions = CHANNELS_LAST_OPS[node.attrs["target"]]
    if call.get("kwargs") or len(args) <= max(positions):
        return False
    if node.attrs["target"] == CONVOLUTION and (len(args) < 9 or args[6] is not False):
        return False  # transposed convolutions stay
    if not all(isinstance(args[k], dict) and "operand" in args[k] for k in positions):
        return False
    tensors = [node.operands[args[k]["operand"]] for k in positions]
    if any(len(x.shape) != 4 for x in tensors):
        return False
    if id(node) in outputs or id(tensors[0]) in outputs:
        return False
    # A weight read straight from a parameter is transposed by a kernel of its own at every call,
    # where cuDNN would convert the activations instead: worth it while the activations' elements
    # outnumber the weight's (a batch of images, not one image through a wide layer).
    weights = sum(x.size for x in tensors[1:] if x.op == "parameter")
    return tensors[0].size + node.size >= weights


def _channels_last_strides(shape: Sequence[int]) -> list[int]:
    """The strides of an NCHW tensor stored NHWC."""
    _, c, h, w = shape
    return [h * w * c, 1, w * c, c]


# ----------------------------------------------------------------------------------------------
# Transpose sinking
# ----------------------------------------------------------------------------------------------


def sink_transposes(graph: Graph, permutations: Sequence[tuple[int, ...]] = (TO_NCHW,)) -> Graph:
    """A copy of ``graph`` where transposes by one of ``permutations`` move past the elementwise
    ops, broadcasts and reduces that read them (module docstring); ``graph`` itself where none
    moves."""
    permutations = {tuple(p) for p in permutations}
    names = _Names(n.name for n in graph.nodes)
    copies: dict[int, Node] = {id(p): p for p in graph.parameters}
    moved = False
    for n in graph.nodes:
        if id(n) in copies:
            continue
        operands = tuple(copies[id(x)] for x in n.operands)
        sunk = None
        if is_elementwise(n.op):
            sunk = _sink_elementwise(n, operands, names, permutations)
        elif n.op == "reduce" and operands[0].op == "transpose" \
                and tuple(operands[0].attrs["permutation"]) in permutations:
            sunk = _sink_reduce(n, operands[0], names)
        elif n.op in PER_DIM_ATTRS and operands[0].op == "transpose" \
                and tuple(operands[0].attrs["permutation"]) in permutations:
            sunk = _sink_per_dim(n, operands[0], names)
        if sunk is None:
            copies[id(n)] = dataclasses.replace(n, operands=operands)
        else:
            copies[id(n)] = sunk
            moved = True
    return _rebuilt(graph, copies) if moved else graph


def _sink_elementwise(n: Node, operands: Sequence[Node], names: _Names, sunk: set) -> Node | None:
    permutations = {tuple(x.attrs["permutation"]) for x in operands if x.op == "transpose"}
    if len(permutations) != 1 or not permutations <= sunk \
            or not all(x.op in ("transpose", "broadcast_in_dim") for x in operands):
        return None
    (p,) = permutations
    inner = tuple(n.shape[p.index(d)] for d in range(len(p)))  # the shape before the transpose
    new_operands = []
    for x in operands:
        if x.op == "transpose" and tuple(x.attrs["permutation"]) == p:
            new_operands.append(x.operands[0])
            continue
        # operand dims of 1 are dropped (a [1, C, 1, 1] scale is a [C] one); the others keep
        # their order, or the broadcast would transpose its operand
        v = x.operands[0]
        kept = [k for k, size in enumerate(v.shape) if size != 1]
        dims = tuple(p[x.attrs["broadcast_dimensions"][k]] for k in kept)
        if list(dims) != sorted(dims):
            return None
        if len(kept) != len(v.shape):
            v = _make("reshape", [v], names.new(f"{v.name}_squeezed"), shape=tuple(v.shape[k] for k in kept))
        new_operands.append(_make("broadcast_in_dim", [v], names.new(x.name), shape=inner,
                                  broadcast_dimensions=dims))
    inside = dataclasses.replace(n, name=names.new(f"{n.name}_t"), operands=tuple(new_operands), shape=inner,
                                 layout=None)
    return _make("transpose", [inside], n.name, permutation=p, layout=n.layout)


# Shape ops whose attributes hold one entry per dim: they commute with a transpose whose entries
# are permuted alike (a max pooling's -inf padding and strided windows).
PER_DIM_ATTRS = {"pad": ("low", "high", "interior"), "slice": ("start", "limit", "stride")}


def _sink_per_dim(n: Node, transpose: Node, names: _Names) -> Node:
    p = tuple(transpose.attrs["permutation"])
    attrs = dict(n.attrs)
    for key in PER_DIM_ATTRS[n.op]:
        values = [0] * len(p)
        for i, v in enumerate(n.attrs[key]):
            values[p[i]] = v
        attrs[key] = tuple(values)
    source = transpose.operands[0]
    inside = _make(n.op, [source], names.new(f"{n.name}_t"), shape=tuple(n.shape[p.index(d)] for d in range(len(p))),
                   dtype=n.dtype, **attrs)
    return _make("transpose", [inside], n.name, permutation=p, layout=n.layout)


def _sink_reduce(n: Node, transpose: Node, names: _Names) -> Node:
    p = tuple(transpose.attrs["permutation"])
    source = transpose.operands[0]
    reduced = tuple(sorted(p[d] for d in n.attrs["dims"]))
    kept = [p[d] for d in range(len(p)) if d not in set(n.attrs["dims"])]  # source dims, in n's order
    order = sorted(kept)
    if kept == order:
        return dataclasses.replace(n, operands=(source,), attrs={**n.attrs, "dims": reduced})
    inside = dataclasses.replace(n, name=names.new(f"{n.name}_t"), operands=(source,),
                                 shape=tuple(source.shape[d] for d in order),
                                 attrs={**n.attrs, "dims": reduced}, layout=None)
    return _make("transpose", [inside], n.name, permutation=tuple(order.index(d) for d in kept), layout=n.layout)
