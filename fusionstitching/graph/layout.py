"""Convolutions fed and read channels-last, and transposes sunk through the ops between them.

cuDNN's fast convolution kernels on Hopper read and write NHWC. Given NCHW tensors, cuDNN converts
each input to NHWC and each result back (its ``nchwToNhwcKernel`` and ``nhwcToNchwKernel``), and
some shapes take slower NCHW-specific algorithms. ``channels_last_convolutions`` gives a
convolution its input and weight as NHWC nodes (``transpose(x, (0, 2, 3, 1))``), which the call
receives as permuted views (NCHW sizes, channels-last strides: the operand template's
``"permute"``), and holds its result as the NHWC permutation of what cuDNN returns
(``"permute_result"``), transposed back to NCHW for its readers. The kernels that produce the
input then write it in NHWC, and the kernels that read the result read NHWC.

``sink_transposes`` then moves those transposes past the elementwise ops, broadcasts, reshapes and
reductions between convolutions, so that these run in NHWC and a transpose back to NCHW meets the
next convolution's transpose to NHWC and both vanish (``fold_views``). An elementwise op sinks the
transpose ``p`` when every operand is a transpose by ``p``, a broadcast (a broadcast of a
per-channel vector is a broadcast along another dim) or a function of positions (iotas and
broadcasts through elementwise ops: a max pooling's ``h · W + w``, rebuilt along the permuted dims); a reduce of a transpose reduces the permuted
dims of its operand; a pad or a slice of a transpose pads or slices the permuted dims (a max
pooling's windows); a reshape whose merged or split runs of dims are runs of the source's too (a
GroupNorm's ``[N, groups, C / groups, H * W]``) reshapes the source, and the transpose, of another
permutation, sinks on. Values leave NHWC only where a reader needs NCHW: a graph output, a library
call that is not a convolution, a reshape that mixes dims NHWC keeps apart.

The same holds for the backward ops (``convolution_backward``, the max pooling's backward), whose
NHWC gradients sink alike. A parameter laid out channels-last is read as the NCHW transpose of
its NHWC view. ``_convertible`` decides per call (the activations that become NHWC for free
against the weights a kernel must transpose at every call); ``laid_out_convolutions`` keeps the
result only where the transposes left after sinking are few (``_pays``). A transposed convolution
stays NCHW, as does one that is not 2-D.

A training forward saves tensors for its backward, whose layout no user sees: ``saved_layouts``
promises channels-last strides for those the pass leaves as transposes of NHWC values, so that
they are returned as views and the backward, compiled for those strides (``backend.py`` reports
them to AOTAutograd), reads them NHWC.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from fusionstitching.graph.graph import Graph, Node, verify
from fusionstitching.graph.node import Layout, contiguous_strides
from fusionstitching.graph.ops import VIEW_OPS, is_elementwise
from fusionstitching.graph.transforms import _make, _Names, _rebuilt, fold_views

CONVOLUTION = "aten.convolution.default"
CONVOLUTION_BACKWARD = "aten.convolution_backward.default"
TO_NHWC = (0, 2, 3, 1)
TO_NCHW = (0, 3, 1, 2)


# Library ops given NHWC operands (the positions of their NCHW tensor arguments) that then return
# NHWC results: convolutions and their backward, and the max pooling after ResNet's first
# convolution and its backward.
CHANNELS_LAST_OPS = {CONVOLUTION: (0, 1), CONVOLUTION_BACKWARD: (0, 1, 2),
                     "aten.max_pool2d_with_indices.default": (0,),
                     "aten.max_pool2d_with_indices_backward.default": (0, 1, 7)}
# The positions among those of activations (not weights).
ACTIVATIONS = {CONVOLUTION: (0,), CONVOLUTION_BACKWARD: (0, 1), "aten.max_pool2d_with_indices.default": (0,),
               "aten.max_pool2d_with_indices_backward.default": (0, 1, 7)}
# Where a convolution's ``transposed`` flag is among its arguments.
TRANSPOSED_ARG = {CONVOLUTION: 6, CONVOLUTION_BACKWARD: 7}


def channels_last_convolutions(graph: Graph) -> Graph:
    """A copy of ``graph`` whose 2-D convolutions and max poolings, forward and backward, read and
    write NHWC nodes (module docstring)."""
    promised = _promised(graph)
    chosen = [results for results in _library_calls(graph).values() if _convertible(results, promised)]
    if not chosen:
        return graph
    names = _Names(n.name for n in graph.nodes)
    copies: dict[int, Node] = {id(p): p for p in graph.parameters}
    # A 4-D parameter laid out channels-last (an activation the forward saved NHWC for the backward)
    # is read as the NCHW transpose of its NHWC view: a transpose that sinks as a result's does.
    for p in graph.parameters:
        if len(p.shape) == 4 and p.layout is not None and not p.layout.is_contiguous(p.shape) \
                and _is_channels_last(p.shape, p.layout):
            view = _make("transpose", [p], names.new(f"{p.name}_nhwc"), permutation=TO_NHWC)
            copies[id(p)] = _make("transpose", [view], names.new(f"{p.name}_nchw"), permutation=TO_NCHW)
    calls = {id(r): results for results in chosen for r in results}
    nhwc: dict[int, Node] = {}  # operand → its transpose, one for all calls
    rewritten: dict[int, tuple[dict, tuple[Node, ...]]] = {}  # first result → the call's attrs and operands
    for n in graph.nodes:
        if id(n) in copies:
            continue
        operands = tuple(copies[id(x)] for x in n.operands)
        if id(n) not in calls:
            copies[id(n)] = dataclasses.replace(n, operands=operands)
            continue
        first = id(calls[id(n)][0])
        if first not in rewritten:
            rewritten[first] = _nhwc_call(n, operands, nhwc, names)
        call, permuted = rewritten[first]
        attrs = {**n.attrs, "call": call}
        if len(n.shape) != 4:  # a bias gradient: as it was, from the same call
            copies[id(n)] = dataclasses.replace(n, operands=permuted, attrs=attrs)
            continue
        shape = tuple(n.shape[d] for d in TO_NHWC)
        result = dataclasses.replace(n, name=names.new(f"{n.name}_nhwc"), operands=permuted, shape=shape,
                                     attrs=attrs, layout=None)
        copies[id(n)] = _make("transpose", [result], n.name, permutation=TO_NCHW, layout=n.layout)
    return _rebuilt(graph, copies)


def _nhwc_call(n: Node, operands: tuple[Node, ...], nhwc: dict[int, Node], names: _Names
               ) -> tuple[dict, tuple[Node, ...]]:
    """The call of library node ``n`` given NHWC transposes of its NCHW tensors, and its operands."""
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
    call["permute_result"] = list(TO_NHWC)  # every 4-D result (``reference.library_result``)
    return call, tuple(permuted)


def _library_calls(graph: Graph) -> dict[tuple, list[Node]]:
    """The results of each call of a library op in ``CHANNELS_LAST_OPS``: a multi-output op's
    results are laid out together, as they come from one call."""
    calls: dict[tuple, list[Node]] = {}
    for n in graph.nodes:
        if n.op == "library" and n.attrs["target"] in CHANNELS_LAST_OPS:
            key = (n.attrs["target"], repr(n.attrs["call"]), tuple(id(x) for x in n.operands))
            calls.setdefault(key, []).append(n)
    return calls


def _promised(graph: Graph) -> dict[int, list]:
    """Each graph output node → the layouts promised for it (one per output position)."""
    promised: dict[int, list] = {}
    for out, layout in zip(graph.outputs, graph.output_layouts):
        if out is not None:
            promised.setdefault(id(out), []).append(layout)
    return promised


def _convertible(results: Sequence[Node], promised: dict[int, list]) -> bool:
    """Whether the call whose results are ``results`` is better run channels-last. Given NCHW
    activations, cuDNN converts them itself; channels-last, the kernels around the call write and
    read them NHWC instead, at no cost, except an activation that must stay NCHW (an input image,
    an output promised NCHW): one transposing copy, as cuDNN's conversion. A weight read straight
    from a parameter held NCHW is transposed by a kernel of its own at every call, where cuDNN may
    keep it: worth it while the free activations' elements outnumber such weights' (a batch of
    images, not one image through a wide layer)."""
    node = results[0]
    target = node.attrs["target"]
    call = node.attrs["call"]
    args = call.get("args", [])
    positions = CHANNELS_LAST_OPS[target]
    if call.get("kwargs") or len(args) <= max(positions):
        return False
    if target in TRANSPOSED_ARG and (len(args) <= TRANSPOSED_ARG[target] or args[TRANSPOSED_ARG[target]] is not False):
        return False  # transposed convolutions stay
    if not all(isinstance(args[k], dict) and "operand" in args[k] for k in positions):
        return False
    if any(len(node.operands[args[k]["operand"]].shape) != 4 for k in positions):
        return False
    if any(len(r.shape) not in (1, 4) for r in results) or not any(len(r.shape) == 4 for r in results):
        return False
    activations = {id(x): x for k in ACTIVATIONS[target] for x in [node.operands[args[k]["operand"]]]}
    activations.update({id(r): r for r in results if len(r.shape) == 4})
    weights = {id(x): x for k in positions for x in [node.operands[args[k]["operand"]]] if id(x) not in activations}
    free = sum(x.size for x in activations.values() if not _stays_nchw(x, promised))
    transposed = sum(x.size for x in weights.values() if _stays_nchw(x, promised))
    return free > 0 and free >= transposed


def _stays_nchw(x: Node, promised: dict[int, list]) -> bool:
    """Whether ``x`` must be held NCHW: a parameter laid out so, or an output promised so."""
    if x.op == "parameter" and not (x.layout is not None and _is_channels_last(x.shape, x.layout)):
        return True
    return any(layout is None or not _is_channels_last(x.shape, layout) for layout in promised.get(id(x), ()))


def _is_channels_last(shape: Sequence[int], layout: Layout) -> bool:
    """Whether ``layout`` stores the NCHW ``shape`` as NHWC (dims of size 1 take any stride)."""
    want = _channels_last_strides(shape)
    return layout.offset == 0 and len(layout.strides) == 4 and all(
        size == 1 or have == w for size, have, w in zip(shape, layout.strides, want))


def _channels_last_strides(shape: Sequence[int]) -> list[int]:
    """The strides of an NCHW tensor stored NHWC."""
    _, c, h, w = shape
    return [h * w * c, 1, w * c, c]


def convolution_bias_apart(graph: Graph) -> Graph:
    """A copy of ``graph`` where generated kernels add each convolution's bias and sum each
    convolution backward's bias gradient, and the library calls leave them out: the add is an
    elementwise op the consumers of the convolution fuse, the gradient a reduction of the output
    gradient over every dim but the channels' (1) that the kernels producing that gradient fuse.
    The library adds them in kernels of its own (``at::native::reduce_kernel`` over a channels-last
    gradient reads it strided). ``graph`` itself where no call has a bias."""
    names = _Names(n.name for n in graph.nodes)
    copies: dict[int, Node] = {id(p): p for p in graph.parameters}
    calls: dict[int, dict] = {}  # id of a backward call's first result → its call without the bias gradient
    changed = False
    for n in graph.nodes:
        if id(n) in copies:
            continue
        operands = tuple(copies[id(x)] for x in n.operands)
        target = n.attrs.get("target") if n.op == "library" else None
        call = n.attrs.get("call", {})
        args = call.get("args", [])
        if target == CONVOLUTION and not call.get("kwargs") and len(args) == 9 and isinstance(args[2], dict) \
                and "operand" in args[2] and len(n.shape) >= 3:
            bias = operands[args[2]["operand"]]
            kept, unbiased = _without_operand({**call, "args": [*args[:2], None, *args[3:]]}, operands,
                                              args[2]["operand"])
            conv = dataclasses.replace(n, name=names.new(f"{n.name}_unbiased"), operands=kept,
                                       attrs={**n.attrs, "call": unbiased}, layout=None)
            if bias.dtype != n.dtype:
                bias = _make("convert", [bias], names.new(f"{bias.name}_{n.dtype.value}"), dtype=n.dtype)
            wide = _make("broadcast_in_dim", [bias], names.new(f"{bias.name}_b"), shape=n.shape,
                         broadcast_dimensions=(1,))
            copies[id(n)] = _make("add", [conv, wide], n.name, layout=n.layout)
            changed = True
            continue
        if target == CONVOLUTION_BACKWARD and not call.get("kwargs") and len(args) == 11 \
                and isinstance(args[10], list) and len(args[10]) == 3 and args[10][2] \
                and isinstance(args[0], dict) and "operand" in args[0]:
            if n.attrs["out_index"] == 2:
                gradient = operands[args[0]["operand"]]
                wide = gradient.dtype.compute
                x = gradient if wide == gradient.dtype else _make(
                    "convert", [gradient], names.new(f"{gradient.name}_{wide.value}"), dtype=wide)
                dims = tuple(d for d in range(len(x.shape)) if d != 1)
                total = _make("reduce", [x], names.new(f"{n.name}_sum") if wide != n.dtype else n.name,
                              dims=dims, kind="sum", layout=None if wide != n.dtype else n.layout)
                copies[id(n)] = total if wide == n.dtype else _make("convert", [total], n.name, dtype=n.dtype,
                                                                   layout=n.layout)
            else:
                unbiased = calls.setdefault(id(call), {**call, "args": [*args[:10], [*args[10][:2], False]]})
                copies[id(n)] = dataclasses.replace(n, operands=operands, attrs={**n.attrs, "call": unbiased})
            changed = True
            continue
        copies[id(n)] = dataclasses.replace(n, operands=operands)
    return _rebuilt(graph, copies) if changed else graph


def _without_operand(call: dict, operands: tuple[Node, ...], k: int) -> tuple[tuple[Node, ...], dict]:
    """``operands`` without the ``k``-th and ``call`` with its operand numbers past ``k`` moved down
    (where no argument names operand ``k`` any longer)."""

    def renumber(a):
        if isinstance(a, dict) and "operand" in a:
            return {**a, "operand": a["operand"] - (a["operand"] > k)}
        if isinstance(a, list):
            return [renumber(x) for x in a]
        return a

    return operands[:k] + operands[k + 1:], {**call, "args": renumber(call["args"])}


def laid_out_convolutions(graph: Graph) -> Graph:
    """``graph`` with its convolutions channels-last and the transposes sunk (``fold_views`` of
    ``sink_transposes`` of ``channels_last_convolutions``) where that pays (``_pays``), else
    ``graph`` itself."""
    laid_out = channels_last_convolutions(graph)
    if laid_out is graph:
        return graph
    laid_out = fold_views(sink_transposes(laid_out))
    return laid_out if _pays(laid_out) else graph


def _pays(laid_out: Graph) -> bool:
    """Whether the transposes left between NHWC and NCHW values after sinking are few beside the
    conversions the channels-last calls save. A transpose left is written or read by a kernel
    (a reshape that mixes dims NHWC keeps apart stops the sinking, so that every convolution's
    input and result is transposed around it), and a kernel that reads through a transpose inside a
    reduction runs far below a copy's speed: a UNet block of GroupNorms and convolutions, whose
    transposes left were as many elements as the conversions saved before reshapes sank, ran
    slower channels-last, where ResNet-50, whose transposes left are the input image and the
    weights, ran faster (CHANGELOG.md). Kept while the transposed elements are at most half the
    converted ones."""
    promised = _promised(laid_out)
    users = laid_out.index.users
    converted = transposed = 0
    for results in _library_calls(laid_out).values():
        call = results[0].attrs["call"]
        if "permute_result" not in call:
            continue
        args = call["args"]
        operands = {id(x): x for k in ACTIVATIONS[results[0].attrs["target"]]
                    for x in [results[0].operands[args[k]["operand"]]]}
        converted += sum(x.size for x in operands.values()) + sum(r.size for r in results if len(r.shape) == 4)
    for n in laid_out.nodes:
        if n.op != "transpose" or len(n.shape) != 4 or n.operands[0].op == "parameter":
            continue
        if tuple(n.attrs["permutation"]) not in (TO_NHWC, TO_NCHW):
            continue
        layouts = promised.get(id(n), ())
        if not users[n] and layouts and all(lay is not None and _is_channels_last(n.shape, lay) for lay in layouts):
            continue  # only an output promised channels-last: a view
        transposed += n.size
    return 2 * transposed <= converted


def saved_layouts(graph: Graph, free: Sequence[int]) -> Graph:
    """``graph`` with the layouts of its outputs ``free`` (a training forward's tensors saved for
    its backward, whose layout no user sees) chosen: channels-last where the convolutions' layout
    pass leaves the output a transpose of an NHWC value, or an NCHW value also transposed to NHWC
    (a convolution's input), so that it is returned as a view of that value and the backward reads
    it NHWC; the promised layout elsewhere."""
    free = [k for k in free if graph.outputs[k] is not None and len(graph.outputs[k].shape) == 4]
    if not free:
        return graph
    layouts = list(graph.output_layouts)
    trial = list(layouts)
    for k in free:
        trial[k] = Layout(tuple(_channels_last_strides(graph.outputs[k].shape)))
    candidate = Graph(graph.parameters, graph.outputs, name=graph.name, mutations=graph.mutations,
                      output_layouts=trial)
    laid_out = laid_out_convolutions(convolution_bias_apart(candidate))
    if laid_out is candidate:
        return graph
    changed = False
    users = laid_out.index.users
    for k in free:
        out = laid_out.outputs[k]
        if out.op == "transpose" and tuple(out.attrs["permutation"]) == TO_NCHW or any(
                u.op == "transpose" and tuple(u.attrs["permutation"]) == TO_NHWC for u in users[out]):
            layouts[k] = trial[k]
            changed = True
    if not changed:
        return graph
    result = Graph(graph.parameters, graph.outputs, name=graph.name, mutations=graph.mutations,
                   output_layouts=layouts)
    result.origins, result.checks = graph.origins, graph.checks
    return result


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
    # the transposes that sink: those by one of ``permutations``, and those the sinking made (a
    # reshape of a sinking transpose is a transpose of another permutation)
    sinking = {id(n) for n in graph.nodes if n.op == "transpose" and tuple(n.attrs["permutation"]) in permutations}
    moved = False
    positional = _Positional(names)
    for n in graph.nodes:
        if id(n) in copies:
            continue
        operands = tuple(copies[id(x)] for x in n.operands)
        sunk = None
        if is_elementwise(n.op):
            sunk = _sink_elementwise(n, operands, names, sinking, positional)
        elif n.op in ("reduce", "reshape", *PER_DIM_ATTRS) and id(operands[0]) in sinking:
            sink = {"reduce": _sink_reduce, "reshape": _sink_reshape}.get(n.op, _sink_per_dim)
            sunk = sink(n, operands[0], names)
        if sunk is None:
            copies[id(n)] = dataclasses.replace(n, operands=operands)
            if id(n) in sinking:
                sinking.add(id(copies[id(n)]))
        else:
            copies[id(n)] = sunk
            if sunk.op == "transpose":
                sinking.add(id(sunk))
            moved = True
    return _rebuilt(graph, copies) if moved else graph


def _sink_elementwise(n: Node, operands: Sequence[Node], names: _Names, sinking: set[int],
                      positional: _Positional) -> Node | None:
    permutations = {tuple(x.attrs["permutation"]) for x in operands if x.op == "transpose"}
    if len(permutations) != 1 or not all(id(x) in sinking for x in operands if x.op == "transpose") \
            or not all(x.op == "transpose" or positional(x) for x in operands):
        return None
    (p,) = permutations
    inner = tuple(n.shape[p.index(d)] for d in range(len(p)))  # the shape before the transpose
    new_operands = []
    for x in operands:
        if x.op == "transpose" and tuple(x.attrs["permutation"]) == p:
            new_operands.append(x.operands[0])
            continue
        permuted = positional.permuted(x, p)
        if permuted is None:
            return None
        new_operands.append(permuted)
    inside = dataclasses.replace(n, name=names.new(f"{n.name}_t"), operands=tuple(new_operands), shape=inner,
                                 layout=None)
    return _sunk(inside, p, n)


class _Positional:
    """Functions of positions alone, found and rebuilt in another layout once per node (a max
    pooling's "a valid tap seen yet" grows by an ``or`` per tap, shared by every later tap)."""

    MAX_DEPTH = 64

    def __init__(self, names: _Names) -> None:
        self.names = names
        self.known: dict[int, bool] = {}
        self.rebuilt: dict[tuple[int, tuple[int, ...]], Node | None] = {}

    def __call__(self, x: Node, depth: int = 0) -> bool:
        """Whether ``x`` is a broadcast, or elementwise ops over iotas and broadcasts (a max
        pooling's ``h · W + w``), which the pass may rebuild in any layout. Chains deeper than
        ``MAX_DEPTH`` count as not positional (they stay where they are): the rebuild recurses
        along them."""
        found = self.known.get(id(x))
        if found is None:
            found = x.op in ("broadcast_in_dim", "iota") or (
                depth < self.MAX_DEPTH and is_elementwise(x.op) and bool(x.operands)
                and all(self(o, depth + 1) for o in x.operands))
            self.known[id(x)] = found
        return found

    def permuted(self, x: Node, p: tuple[int, ...]) -> Node | None:
        """``x`` rebuilt with the shape it has before the transpose ``p``: an iota along dim d runs
        along dim ``p[d]``, a broadcast maps its dims alike; None where a broadcast would have to
        transpose its operand."""
        key = (id(x), p)
        if key not in self.rebuilt:
            self.rebuilt[key] = self._permuted(x, p)
        return self.rebuilt[key]

    def _permuted(self, x: Node, p: tuple[int, ...]) -> Node | None:
        inner = tuple(x.shape[p.index(d)] for d in range(len(p)))
        if x.op == "iota":
            return _make("iota", [], self.names.new(x.name), shape=inner, dtype=x.dtype,
                         dimension=p[x.attrs["dimension"]])
        if x.op == "broadcast_in_dim":
            # operand dims of 1 are dropped (a [1, C, 1, 1] scale is a [C] one); the others keep
            # their order, or the broadcast would transpose its operand
            v = x.operands[0]
            kept = [k for k, size in enumerate(v.shape) if size != 1]
            dims = tuple(p[x.attrs["broadcast_dimensions"][k]] for k in kept)
            if list(dims) != sorted(dims):
                return None
            if len(kept) != len(v.shape):
                v = _make("reshape", [v], self.names.new(f"{v.name}_squeezed"), shape=tuple(v.shape[k] for k in kept))
            return _make("broadcast_in_dim", [v], self.names.new(x.name), shape=inner, broadcast_dimensions=dims)
        operands = [self.permuted(o, p) for o in x.operands]
        if any(o is None for o in operands):
            return None
        return dataclasses.replace(x, name=self.names.new(f"{x.name}_t"), operands=tuple(operands), shape=inner,
                                   layout=None)


def _sunk(inside: Node, permutation: tuple[int, ...], n: Node) -> Node:
    """``n`` as the transpose by ``permutation`` of ``inside``, its value computed before the
    transpose: a reshape where the transpose moves only dims of size 1."""
    sized = [d for d in permutation if inside.shape[d] != 1]
    if sized == sorted(sized):
        return _make("reshape", [inside], n.name, shape=n.shape, layout=n.layout)
    return _make("transpose", [inside], n.name, permutation=permutation, layout=n.layout)


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
    return _sunk(inside, p, n)


def _sink_reshape(n: Node, transpose: Node, names: _Names) -> Node | None:
    """A reshape of ``transpose`` as a transpose of a reshape of its source, where each run of dims
    the reshape merges or splits is a run of consecutive source dims in the same order (the NCHW
    activation a GroupNorm splits into ``[N, groups, C / groups, H * W]`` is the NHWC source split
    into ``[N, H * W, groups, C / groups]``); else None. Dims of size 1 take any place."""
    p = tuple(transpose.attrs["permutation"])
    source = transpose.operands[0]
    before, after = transpose.shape, n.shape
    rank = {d: r for r, d in enumerate(d for d in range(len(source.shape)) if source.shape[d] != 1)}
    runs = _reshape_runs([d for d in range(len(before)) if before[d] != 1],
                         [d for d in range(len(after)) if after[d] != 1], before, after)
    if runs is None:
        return None
    placed = []  # (rank of the run's first source dim, the reshape's dims of the run)
    for dims_in, dims_out in runs:
        ranks = [rank[p[d]] for d in dims_in]
        if ranks != list(range(ranks[0], ranks[0] + len(ranks))):
            return None
        placed.append((ranks[0], dims_out))
    order = [d for _, dims_out in sorted(placed) for d in dims_out]
    order += [d for d in range(len(after)) if after[d] == 1]
    if order == list(range(len(after))):
        return _make("reshape", [source], n.name, shape=after, layout=n.layout)
    inside = _make("reshape", [source], names.new(f"{n.name}_t"), shape=tuple(after[d] for d in order))
    return _sunk(inside, _inverse(order), n)


def _reshape_runs(dims_in: list[int], dims_out: list[int], before: Sequence[int], after: Sequence[int]
                  ) -> list[tuple[list[int], list[int]]] | None:
    """The reshape from ``before`` to ``after`` as runs of its dims (``dims_in`` and ``dims_out``, of
    size > 1) with equal products, each as short as can be; None where none fit."""
    runs, i, j = [], 0, 0
    while i < len(dims_in) and j < len(dims_out):
        run_in, run_out = [dims_in[i]], [dims_out[j]]
        size_in, size_out = before[dims_in[i]], after[dims_out[j]]
        i, j = i + 1, j + 1
        while size_in != size_out:
            if size_in < size_out and i < len(dims_in):
                run_in.append(dims_in[i])
                size_in *= before[dims_in[i]]
                i += 1
            elif size_out < size_in and j < len(dims_out):
                run_out.append(dims_out[j])
                size_out *= after[dims_out[j]]
                j += 1
            else:
                return None
        runs.append((run_in, run_out))
    return runs if i == len(dims_in) and j == len(dims_out) else None


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
    return _sunk(inside, tuple(order.index(d) for d in kept), n)


# ----------------------------------------------------------------------------------------------
# Permuted operands and results of other library calls
# ----------------------------------------------------------------------------------------------


def dense_permutation(shape: Sequence[int], strides: Sequence[int], keep_last: bool = True
                      ) -> tuple[int, ...] | None:
    """The permutation ``p`` for which ``strides`` store ``shape`` as the contiguous tensor of shape
    ``[shape[d] for d in p]`` (a permuted view of dense storage) when it is not the identity and,
    with ``keep_last``, keeps the last dim last; else None. Dims of size 1 take any stride and keep
    their place."""
    if len(shape) < 3 or len(strides) != len(shape):
        return None
    order = sorted(range(len(shape)), key=lambda d: (-strides[d] if shape[d] > 1 else 0, d))
    sized = [d for d in order if shape[d] > 1]
    if not sized or keep_last and sized[-1] != len(shape) - 1:
        return None
    # dims of size 1 go back where they were among the sized ones' order: keep them in place
    perm = list(range(len(shape)))
    slots = [d for d in range(len(shape)) if shape[d] > 1]
    for slot, d in zip(slots, sized):
        perm[slot] = d
    perm_t = tuple(perm)
    if perm_t == tuple(range(len(shape))):
        return None
    want = contiguous_strides([shape[d] for d in perm_t])
    have = [strides[d] for d in perm_t]
    if any(size > 1 and h != w for size, h, w in zip((shape[d] for d in perm_t), have, want)):
        return None
    return perm_t


def _inverse(perm: Sequence[int]) -> tuple[int, ...]:
    inverse = [0] * len(perm)
    for i, d in enumerate(perm):
        inverse[d] = i
    return tuple(inverse)


def permuted_library_layouts(graph: Graph) -> Graph:
    """``graph`` with the permuted layouts of library calls held by the graph (``graph/layout.py``'s
    convolution form, for any library op). A library call gets each operand with the strides it had
    when traced (``reference.library_operand``); where those store a permutation of dense storage
    (attention's query, key and value as ``[batch, heads, seq, dim]`` views of ``[batch, seq, heads,
    dim]`` projections), the operand becomes the permuted node, which the kernel producing it writes
    contiguously, and the call receives it as a view (``"permute"``) instead of a copy. A call whose
    results were traced so (attention's output) holds them permuted (``"permute_result"``),
    transposed back for its readers, which read through the transpose instead of a copy to
    contiguous memory. Permutations that move the last dim are left: they make kernels transpose."""
    promised = _promised(graph)
    names = _Names(n.name for n in graph.nodes)
    copies: dict[int, Node] = {id(p): p for p in graph.parameters}
    permuted_operands: dict[tuple[int, tuple[int, ...]], Node] = {}
    changed = False
    calls = _all_library_calls(graph)
    rewritten: dict[int, tuple[dict, tuple[Node, ...], tuple[int, ...] | None]] = {}
    for n in graph.nodes:
        if id(n) in copies:
            continue
        operands = tuple(copies[id(x)] for x in n.operands)
        results = calls.get(id(n))
        if results is None:
            copies[id(n)] = dataclasses.replace(n, operands=operands)
            continue
        first = id(results[0])
        if first not in rewritten:
            rewritten[first] = _permuted_call(results, operands, permuted_operands, names, promised)
        call, new_operands, result_perm = rewritten[first]
        if call is n.attrs["call"] and new_operands == operands:
            copies[id(n)] = dataclasses.replace(n, operands=operands)
            continue
        changed = True
        attrs = {**n.attrs, "call": call}
        if result_perm is None or len(n.shape) != len(result_perm):
            copies[id(n)] = dataclasses.replace(n, operands=new_operands, attrs=attrs)
            continue
        shape = tuple(n.shape[d] for d in result_perm)
        held = dataclasses.replace(n, name=names.new(f"{n.name}_p"), operands=new_operands, shape=shape,
                                   attrs=attrs, layout=None)
        copies[id(n)] = _make("transpose", [held], n.name, permutation=_inverse(result_perm), layout=n.layout)
    return _permuted_outputs(fold_views(_rebuilt(graph, copies)) if changed else graph)


def _permuted_outputs(graph: Graph) -> Graph:
    """``graph`` with each computed output promised in a permutation of dense storage returned as a
    view of the permuted node, which a kernel writes contiguously: the promised strides without a
    copy after the call (``executor._layout_checks``). The permuted node a library operand already
    reads (``permuted_library_layouts``, a convolution's NHWC input) is reused; a new one is made
    only for permutations that keep the last dim last (a training forward's attention operands
    saved for the backward). Built after ``fold_views``, which would fold the
    two transposes back into the node."""
    users = graph.index.users
    names = _Names(n.name for n in graph.nodes)
    outputs = list(graph.outputs)
    changed = False
    for k, (out, layout) in enumerate(zip(graph.outputs, graph.output_layouts)):
        if out is None or layout is None or layout.offset or k in graph.mutations:
            continue
        if out.op in ("parameter", "library", "constant") or out.op in VIEW_OPS:
            continue
        perm = dense_permutation(out.shape, layout.strides, keep_last=False)
        if perm is None:
            continue
        permuted = next((u for u in users[out] if u.op == "transpose" and tuple(u.attrs["permutation"]) == perm), None)
        if permuted is None:
            if perm[-1] != len(perm) - 1:
                continue  # a new transposing write: the copy to the promised strides is no dearer
            permuted = _make("transpose", [out], names.new(f"{out.name}_p"), permutation=perm)
        outputs[k] = _make("transpose", [permuted], names.new(f"{out.name}_v"), permutation=_inverse(perm))
        changed = True
    if not changed:
        return graph
    result = Graph(graph.parameters, outputs, name=graph.name, mutations=graph.mutations,
                   output_layouts=graph.output_layouts)
    verify(result)
    result.origins, result.checks = graph.origins, graph.checks
    return result


def _all_library_calls(graph: Graph) -> dict[int, list[Node]]:
    """Each library node (but those already laid out channels-last) → the results of its call."""
    calls: dict[tuple, list[Node]] = {}
    for n in graph.nodes:
        if n.op == "library":
            call = n.attrs["call"]
            if "permute_result" in call or any("permute" in a for a in call.get("args", []) if isinstance(a, dict)):
                continue
            key = (n.attrs["target"], repr(call), tuple(id(x) for x in n.operands))
            calls.setdefault(key, []).append(n)
    return {id(r): results for results in calls.values() for r in results}


def _permuted_call(results: Sequence[Node], operands: tuple[Node, ...], permuted: dict, names: _Names,
                   promised: dict[int, list]) -> tuple[dict, tuple[Node, ...], tuple[int, ...] | None]:
    """The call of ``results`` with permuted operands where their traced strides are permuted dense
    storage, the operands, and the permutation its results are held in (None: as traced)."""
    node = results[0]
    call = dict(node.attrs["call"])
    args = list(call.get("args", []))
    new_operands = list(operands)
    for position, template in enumerate(args):
        if not isinstance(template, dict) or "operand" not in template or template.get("strides") is None:
            continue
        x = operands[template["operand"]]
        if x.op in ("parameter", "library"):
            continue
        perm = dense_permutation(x.shape, template["strides"])
        if perm is None:
            continue
        key = (id(x), perm)
        if key not in permuted:
            permuted[key] = _make("transpose", [x], names.new(f"{x.name}_p"), permutation=perm)
        new_operands[template["operand"]] = permuted[key]
        args[position] = {**template, "permute": list(_inverse(perm))}
    if args:
        call["args"] = args
    result_perm = _result_permutation(results, promised)
    if result_perm is not None:
        call["permute_result"] = list(result_perm)
    if call == node.attrs["call"]:
        call = node.attrs["call"]
    return call, tuple(new_operands), result_perm


def _result_permutation(results: Sequence[Node], promised: dict[int, list]) -> tuple[int, ...] | None:
    """The one permutation every result of its rank was traced in, where there is one (a result
    traced contiguous of that rank, or one that is a graph output, leaves the call as it is)."""
    perms = set()
    for r in results:
        if r.layout is None:
            continue
        perm = dense_permutation(r.shape, r.layout.strides) if r.layout.offset == 0 else None
        perms.add((len(r.shape), perm))
    candidates = [(rank, p) for rank, p in perms if p is not None]
    if len(candidates) != 1:
        return None
    rank, perm = candidates[0]
    if sum(1 for r_, _ in perms if r_ == rank) != 1:  # another result of that rank traced otherwise
        return None
    if any(id(r) in promised for r in results if len(r.shape) == rank):
        return None
    return perm
