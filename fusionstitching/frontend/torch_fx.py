"""PyTorch capture: a function or ``nn.Module`` → forward (and backward) ``Graph``.

How a graph is obtained (DESIGN.md "Training graphs"):
1. TorchDynamo traces the Python code (``fullgraph=True``, static shapes) — it resolves the
   data-dependent Python that models contain (Hugging Face mask checks, ``.all()`` guards) against
   the example inputs. Module parameters and buffers are passed as explicit inputs through
   ``torch.func.functional_call`` on detached clones, so capture never writes into the user's
   tensors.
2. AOTAutograd functionalizes the graph and applies the core-ATen decompositions plus torch's
   decompositions of the composite ops it would leave whole (``aten_table.COMPOSITE_DECOMPOSITIONS``).
   Input mutations stay in the inference graph as ``copy_`` (``keep_inference_input_mutations``).
   For training the joint graph is split by the min-cut rematerialization partitioner — the same
   one Inductor uses — and the split is recorded when it happens, so no forward or backward runs:
   the compiled stand-ins return empty tensors of the recorded shapes.
3. ``convert`` walks each ATen FX graph and lowers every node through ``aten_table.TABLE``. An op
   without an entry becomes a ``library`` node that keeps the torch callable, so the graph stays
   complete and runnable, and a ``LibraryFallbackWarning`` names it once per capture.

Calling convention of the result: forward parameters = [module parameters and buffers, tensor
user inputs, rng seed and offset (only when the graph draws random numbers)]; forward outputs =
[user outputs, saved tensors, then new values of mutated inputs (``graph.mutations``)]; backward
parameters = [saved tensors, tangents]; backward outputs = one gradient per forward parameter
other than the rng ones, ``None`` where there is none.
"""

from __future__ import annotations

import contextlib
import operator
import types
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import fx

from fusionstitching.frontend import aten_table
from fusionstitching.frontend.context import (
    DTYPE_TO_TORCH,
    CaptureError,
    LoweringContext,
    RngState,
    StorageDependent,
    Unsupported,
    layout_of,
    to_dtype,
)
from fusionstitching.graph.graph import Graph, GraphBuilder, Layout, Node, VerifyError, verify
from fusionstitching.graph.ops import DType


class LibraryFallbackWarning(UserWarning):
    """An ATen op with no IR lowering was kept as a library call."""


@dataclass(frozen=True)
class ParamSpec:
    name: str
    shape: tuple[int, ...]
    dtype: DType
    layout: Layout


@dataclass
class Captured:
    """The graphs of one capture and how their inputs and outputs line up."""

    forward: Graph
    backward: Graph | None
    parameter_names: list[str]
    num_user_outputs: int
    num_saved: int = 0
    library_ops: list[str] = field(default_factory=list)


# ----------------------------------------------------------------------------------------------
# FX graph → Graph
# ----------------------------------------------------------------------------------------------

_IGNORED_KWARGS = ("device", "pin_memory", "layout", "memory_format", "non_blocking", "generator")


def convert(
    gm: fx.GraphModule,
    params: Sequence[ParamSpec],
    placeholder_slots: Sequence[int | torch.Tensor],
    *,
    name: str = "graph",
    output_order: Sequence[int] | None = None,
    output_mutations: dict[int, int] | None = None,
    warned: set[str] | None = None,
) -> Graph:
    """Lower an ATen FX graph to a verified ``Graph``.

    ``placeholder_slots[i]`` is the parameter index the i-th placeholder becomes, or a tensor to be
    embedded as a constant. ``output_order`` picks and orders the FX outputs; ``output_mutations``
    maps an FX output index to the parameter it overwrites (such outputs go last).
    """
    builder = GraphBuilder(name)
    for spec in params:
        builder.parameter(spec.shape, spec.dtype, name=spec.name, layout=spec.layout)
    rng = RngState(builder)
    warned = set() if warned is None else warned
    values: dict[fx.Node, Any] = {}
    mutated: dict[int, Node] = {}  # parameter index → its new value (from in-graph copy_)
    placeholder_index = 0
    fx_outputs: list[Any] = []
    checks: list[Node] = []  # one output per runtime assertion (``_assertion``), trailing
    for fx_node in gm.graph.nodes:
        if fx_node.op == "placeholder":
            slot = placeholder_slots[placeholder_index]
            placeholder_index += 1
            if isinstance(slot, int):
                values[fx_node] = builder.parameters[slot]
            elif _is_number(fx_node.meta.get("val")):  # a size or scalar of this specialization
                values[fx_node] = fx_node.meta["val"]
            elif isinstance(fx_node.meta.get("val"), (torch.SymInt, torch.SymFloat, torch.SymBool)):
                values[fx_node] = slot.item()  # the same, where the metadata stayed symbolic
            else:
                values[fx_node] = _constant(builder, slot)
        elif fx_node.op == "get_attr":
            values[fx_node] = _constant(builder, getattr(gm, fx_node.target))
        elif fx_node.op == "call_function" and _is_number(fx_node.meta.get("val")):
            values[fx_node] = fx_node.meta["val"]  # size arithmetic, concrete in a specialization
        elif fx_node.op == "call_function" and str(fx_node.target) in ASSERTIONS:
            builder.origin = f"{fx_node.name}: {fx_node.target}"
            checks += _assertion(builder, values[fx_node.args[0]], fx_node)
            values[fx_node] = None
            builder.origin = None
        elif fx_node.op == "call_function":
            builder.origin = f"{fx_node.name}: {fx_node.target}"
            values[fx_node] = _call(builder, rng, fx_node, values, mutated, warned)
            builder.origin = None
        elif fx_node.op == "output":
            fx_outputs = list(fx_node.args[0])
    out_values = [values[o] if isinstance(o, fx.Node) and isinstance(values[o], Node) else None for o in fx_outputs]
    out_metas = [o.meta.get("val") if isinstance(o, fx.Node) else None for o in fx_outputs]
    order = list(range(len(fx_outputs))) if output_order is None else list(output_order)
    outputs = [out_values[i] for i in order]
    layouts = [layout_of(out_metas[i]) if isinstance(out_metas[i], torch.Tensor) else None for i in order]
    mutations = {}
    for fx_index, param in (output_mutations or {}).items():
        mutated[param] = out_values[fx_index]
    for param, value in sorted(mutated.items()):
        mutations[len(outputs)] = param
        outputs.append(value)
        layouts.append(builder.parameters[param].layout)
    try:
        graph = builder.build(outputs + checks, mutations=mutations, output_layouts=layouts + [None] * len(checks))
    except VerifyError as err:
        raise CaptureError(f"graph {name}: {err}") from None
    graph.checks = len(checks)
    return graph


# Runtime assertions torch's decompositions insert (``F.one_hot``'s class range): a condition that
# eager raises on when it is false.
ASSERTIONS = ("aten._assert_async.msg", "aten._assert_async.default")


def _assertion(builder: GraphBuilder, condition: Any, fx_node: fx.Node) -> list[Node]:
    """A check output that stops the call where ``condition`` is false, as eager raises: a gather
    from one position at index 0 when it holds and 1 when not, so that the gather's range check
    (in a kernel, or the simulator's) fails. A condition known at capture needs no check."""
    if not isinstance(condition, Node):
        if not condition:
            raise CaptureError(f"FX node {fx_node.name} ({fx_node.target}): the assertion fails: "
                               f"{fx_node.args[1] if len(fx_node.args) > 1 else ''}")
        return []
    if condition.size != 1:
        raise CaptureError(f"FX node {fx_node.name} ({fx_node.target}): a condition of {condition.size} elements")
    holds = builder.reshape(condition, (1,))
    zero, one = builder.constant([0], DType.I32, (1,)), builder.constant([1], DType.I32, (1,))
    index = builder.select(holds, zero, one)
    positions = builder.node("iota", shape=(1,), dtype=DType.I32, name=f"{fx_node.name}_holds", dimension=0)
    read = builder.node("gather", [positions, index], axis=0, batch_dims=0)
    return [builder.reduce(read, (0,), "max")]


def _constant(builder: GraphBuilder, tensor: torch.Tensor) -> Node:
    dtype = to_dtype(tensor.dtype, " (embedded tensor)")
    array = tensor.detach().cpu().to(DTYPE_TO_TORCH[dtype])
    if dtype == DType.BF16:
        value = array.float().numpy().astype(dtype.numpy)
    else:
        value = array.numpy()
    return builder.node("constant", shape=value.shape, dtype=dtype, name="const", value=value.copy())


def _is_number(value: Any) -> bool:
    return isinstance(value, (bool, int, float)) and not isinstance(value, torch.SymInt)


def _call(builder, rng, fx_node: fx.Node, values, mutated, warned) -> Any:
    target = fx_node.target
    args = fx.node.map_arg(fx_node.args, lambda a: values[a])
    kwargs = {k: v for k, v in fx.node.map_arg(fx_node.kwargs, lambda a: values[a]).items()
              if k not in _IGNORED_KWARGS}
    if target is operator.getitem:
        return args[0][args[1]]
    op_name = str(target)
    if target is torch.ops.aten.copy_.default:
        dst, src = args[0], args[1]
        if not (isinstance(dst, Node) and dst.op == "parameter"):
            raise CaptureError(f"FX node {fx_node.name} ({op_name}): copy_ into a non-input")
        cx = LoweringContext(builder, fx_node, rng)
        value = cx.lift(src, dst.dtype, dst.shape)
        mutated[dst.attrs["index"]] = value
        return value
    lowering = aten_table.TABLE.get(op_name)
    if lowering is not None:
        try:
            return lowering(LoweringContext(builder, fx_node, rng, values), *args, **kwargs)
        except Unsupported as why:
            reason = str(why)
        except StorageDependent as err:
            raise StorageDependent(f"FX node {fx_node.name} ({op_name}): {err}") from err
        except Exception as err:
            raise CaptureError(f"FX node {fx_node.name} ({op_name}): {type(err).__name__}: {err}") from err
    else:
        reason = "no lowering"
    if op_name not in warned:
        warned.add(op_name)
        warnings.warn(f"{op_name} is kept as a library call ({reason})", LibraryFallbackWarning, stacklevel=3)
    return _library(builder, fx_node, op_name, fx_node.args, fx_node.kwargs, values)


def _library(builder: GraphBuilder, fx_node: fx.Node, op_name: str, raw_args, raw_kwargs, values) -> Any:
    operands: list[Node] = []

    def encode(a: Any) -> Any:
        if isinstance(a, fx.Node):
            operands.append(values[a])
            meta = a.meta.get("val")
            if isinstance(meta, torch.Tensor):  # the call gets the layout it had when traced
                encoded = {"operand": len(operands) - 1, "strides": [int(st) for st in meta.stride()]}
                if meta.device.type == "cpu":  # a host tensor among GPU ones (a seed an op reads on the host)
                    encoded["host"] = True
                return encoded
            return {"operand": len(operands) - 1}
        if isinstance(a, torch.dtype):
            return {"dtype": to_dtype(a).value}
        if isinstance(a, (list, tuple)):
            return [encode(x) for x in a]
        if a is None or isinstance(a, (bool, int, float, str)):
            return a
        raise CaptureError(f"FX node {fx_node.name} ({op_name}): argument {a!r} cannot be kept for a library call")

    call = {"args": [encode(a) for a in raw_args],
            "kwargs": {k: encode(v) for k, v in raw_kwargs.items() if k not in _IGNORED_KWARGS}}
    meta = fx_node.meta.get("val")

    def result(value: torch.Tensor, index: int) -> Node:
        dtype = to_dtype(value.dtype, f" (result of library op {op_name})")
        return builder.node("library", operands, shape=tuple(value.shape), dtype=dtype, name=fx_node.name,
                            layout=layout_of(value), target=op_name, call=call, out_index=index)

    if isinstance(meta, torch.Tensor):
        return result(meta, -1)
    if isinstance(meta, (tuple, list)):
        return tuple(result(v, i) if isinstance(v, torch.Tensor) else None for i, v in enumerate(meta))
    raise CaptureError(f"FX node {fx_node.name} ({op_name}): no tensor result to keep")


def decompositions() -> dict:
    from torch._decomp import core_aten_decompositions, get_decompositions

    # ATen's own ops only: other namespaces (``quantized_decomposed``) register decompositions into
    # the same global table when their modules are imported, which would make the table depend on
    # the import history
    table = {k: v for k, v in core_aten_decompositions().items() if str(k).startswith("aten.")}
    composites = [getattr(torch.ops.aten, name) for name in aten_table.COMPOSITE_DECOMPOSITIONS]
    table.update(get_decompositions(composites))
    table.update(foreach_decompositions())
    for name in KEPT_WHOLE:
        overload = getattr(torch.ops.aten, name, None)
        for key in [key for key in table if key is overload or getattr(key, "overloadpacket", None) is overload]:
            del table[key]
    for key in [key for key in table if getattr(key, "overloadpacket", None) in _INDEX_ADD]:
        table[key] = _checked_index_add(table[key])
    for key in [key for key in table if getattr(key, "overloadpacket", None) is torch.ops.aten._weight_norm_interface]:
        table[key] = _weight_norm_interface
    for key in (torch.ops.aten.eye.default, torch.ops.aten.eye.m):
        if key in table:
            table[key] = _eye(table[key])
    return table


def _eye(original: Callable[..., Any]) -> Callable[..., Any]:
    """torch's decomposition of ``eye`` compares two ``arange``s of the narrowest integer type that
    holds the size: uint16 from 256 on, a type the IR does not have (nor torch's CPU ``arange``), so
    the whole graph would run in PyTorch; here the ranges are int64 (the same comparison, the same
    result). Other layouts keep torch's decomposition."""

    def eye(n: int, m: int | None = None, *, dtype: Any = None, layout: Any = None, device: Any = None,
            pin_memory: bool | None = False) -> torch.Tensor:
        if layout not in (torch.strided, None) or pin_memory:
            return original(n, m, dtype=dtype, layout=layout, device=device, pin_memory=pin_memory)
        m = n if m is None else m
        torch._check(n >= 0, lambda: f"n must be greater or equal to 0, got {n}")
        torch._check(m >= 0, lambda: f"m must be greater or equal to 0, got {m}")
        rows = torch.arange(n, dtype=torch.int64, device=device)
        columns = torch.arange(m, dtype=torch.int64, device=device)
        return (rows.unsqueeze(-1) == columns).to(dtype or torch.get_default_dtype())

    return eye


def _weight_norm_interface(v: torch.Tensor, g: torch.Tensor, dim: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Weight norm's fused op, ``w = g · v / ‖v‖`` with ‖v‖ over every dim but ``dim`` (torch's
    kernel takes the first or the last), and the norms (f32 for a bf16 ``g``, as its kernel). torch's
    decomposition takes the norm over every dim when no other dim is left (a 1-d ``v``: its norms are
    then the elements' magnitudes), which gave a wrong ``w``; this one keeps the kernel's rule."""
    if dim not in (0, v.ndim - 1):  # eager's check, raised while tracing
        raise RuntimeError(f"aten._weight_norm_interface over dim {dim} of a rank-{v.ndim} tensor: "
                           "fused kernels can only be applied for first or last dim")
    others = tuple(i for i in range(v.ndim) if i != dim)
    norm_dtype = torch.float if g.dtype == torch.bfloat16 else None
    if others:
        norm = v.norm(2, others, keepdim=True, dtype=norm_dtype)
    else:
        norm = (v if norm_dtype is None else v.to(norm_dtype)).abs()
    return v * (g / norm.to(g.dtype)), norm


_INDEX_ADD = (torch.ops.aten.index_add, torch.ops.aten.index_add_)


def _checked_index_add(decomposition: Callable[..., Any]) -> Callable[..., Any]:
    """torch's decomposition of ``index_add`` with the shape check of eager's kernel, which it
    skips: ``source`` must have ``self``'s shape apart from ``dim`` (the decomposition's
    ``index_put`` would broadcast a smaller one). The same ``RuntimeError`` as eager's, raised
    while tracing."""

    def index_add(x: torch.Tensor, dim: int, index: torch.Tensor, source: torch.Tensor, *args: Any,
                  **kwargs: Any) -> Any:
        from torch._prims_common import canonicalize_dim

        x_sizes, source_sizes = list(x.shape), list(source.shape)
        if x.ndim and source.ndim:
            axis = canonicalize_dim(x.ndim, dim)
            torch._check(axis < source.ndim, lambda: (
                f"index_add_(): Indexing dim {axis} is out of bounds of the source tensor with dim {source.ndim}"))
            del x_sizes[axis], source_sizes[axis]
        torch._check(x_sizes == source_sizes, lambda: (
            "source tensor shape must match self tensor shape, excluding the specified dimension. "
            f"Got self.shape = {list(x.shape)} source.shape = {list(source.shape)}"))
        return decomposition(x, dim, index, source, *args, **kwargs)

    return index_add


# Ops whose core-ATen decomposition does not match the op they pair with. The CPU flash attention's
# decomposition returns the attention probabilities where its log-sum-exp belongs, and its backward
# (no decomposition) then reads them as the log-sum-exp: gradients through
# ``scaled_dot_product_attention`` on a CPU were wrong. Kept as library calls, forward and backward
# agree, as in eager.
KEPT_WHOLE = ("_scaled_dot_product_flash_attention_for_cpu",)


# Per-index tensors of scalars (one scalar per list element as a 1-D tensor): not expanded here.
_FOREACH_KEPT = {"_foreach_addcmul.Tensor", "_foreach_addcdiv.Tensor"}


def foreach_decompositions() -> dict:
    """``aten._foreach_<op>`` (the multi-tensor ops of torch.optim's ``foreach`` implementations) as
    one ``aten.<op>`` per list element, so that fusion sees every tensor's update (and may pack them
    all into one kernel) instead of one opaque library call per list. Arguments that are lists of
    the same length (tensors, or scalars for ``ScalarList`` overloads) are indexed; others are
    passed to every element's op."""
    table = {}
    # every registered op, not ``dir(torch.ops.aten)``: that lists the ops some code has looked up
    # so far, so the table would depend on what was imported before (Inductor looks up more)
    names = sorted({op.split("::", 1)[1].split(".")[0] for op in torch._C._dispatch_get_all_op_names()
                    if op.startswith("aten::_foreach_")})
    for name in names:
        if name.endswith("_"):
            continue
        single = getattr(torch.ops.aten, name[len("_foreach_"):], None)
        if single is None:
            continue
        packet = getattr(torch.ops.aten, name)
        for overload in packet.overloads():
            if f"{name}.{overload}" not in _FOREACH_KEPT:
                table[getattr(packet, overload)] = _per_element(single)
    return table


def _per_element(single: Any) -> Callable[..., list]:
    """The foreach op's trailing positional arguments beyond what ``single`` takes positionally are
    its keyword-only parameters (``_foreach_addcmul(self, t1, t2, value)`` → ``addcmul(..., value=)``)."""
    schemas = [getattr(single, o)._schema for o in single.overloads() if not o.startswith("out")]
    positional = max(sum(1 for a in s.arguments if not a.kwarg_only) for s in schemas)
    keywords = next(([a.name for a in s.arguments if a.kwarg_only and a.name != "out"] for s in schemas
                     if any(a.kwarg_only and a.name != "out" for a in s.arguments)), [])

    def decomposed(*args: Any, **kwargs: Any) -> list:
        count = len(next(a for a in args if isinstance(a, (list, tuple))))
        results = []
        for i in range(count):
            each = [a[i] if isinstance(a, (list, tuple)) and len(a) == count else a for a in args]
            named = dict(kwargs, **dict(zip(keywords, each[positional:])))
            results.append(single(*each[:positional], **named))
        return results

    return decomposed


# ----------------------------------------------------------------------------------------------
# Capture
# ----------------------------------------------------------------------------------------------


@dataclass
class _Recording:
    dynamo_inputs: list[Any] = field(default_factory=list)
    inference: fx.GraphModule | None = None
    forward: fx.GraphModule | None = None
    backward: fx.GraphModule | None = None
    num_fwd_outputs: int = 0
    metadata: Any = None
    calls: int = 0


# Ops whose result does not depend on the order the work is done in: a recomputation gives the
# forward's bits. Reductions that add or multiply, scans and products of matrices may not (another
# kernel's schedule sums in another order).
_ORDER_FREE = frozenset({"amax", "amin", "max", "min", "argmax", "argmin", "any", "all"})


def _order_free(node: fx.Node) -> bool:
    target = node.target
    if node.op != "call_function" or target is operator.getitem:
        return True
    if not isinstance(target, torch._ops.OpOverload):
        return False
    return (torch.Tag.pointwise in target.tags or target.is_view
            or target.overloadpacket.__name__ in _ORDER_FREE)


def partition(joint: fx.GraphModule, joint_inputs: Any, **kwargs: Any) -> tuple[fx.GraphModule, fx.GraphModule]:
    """The min-cut rematerialization partitioner, except that a forward value the backward tests for
    equality (the gradient of amax, amin and max routes to the elements equal to the saved result)
    is saved, not recomputed, when recomputing it could round otherwise: a softmax recomputed by a
    kernel that sums in another order equals its saved minimum nowhere, and the gradient is 0/0.
    Max pooling's indices may be recomputed in the backward (the partitioner's list of
    recomputable ops lacks it): its backward reads the pooled input anyway, and from it the indices
    are elementwise work in the backward's kernel, where saving them cost 8 bytes per output written
    by the forward, plus the windows the forward wrote to compute them. The pooled values stay
    saved: the forward writes them anyway. The recomputed indices are the forward's: the same
    windows of the same saved input, in the same order."""
    from torch._functorch import config as functorch_config
    from torch._functorch.compile_utils import fx_graph_cse
    from torch._functorch.partitioners import min_cut_rematerialization_partition
    from torch.utils.checkpoint import CheckpointPolicy

    if functorch_config.cse:  # before the copies below, which the partitioner's own CSE would merge
        joint.graph = fx_graph_cse(joint.graph)
    backward: set[fx.Node] = set()
    ordered: set[fx.Node] = set()  # forward values that depend on an order-dependent op
    for node in joint.graph.nodes:
        inputs = node.all_input_nodes
        if node.op == "placeholder":
            if node.name.startswith("tangents"):
                backward.add(node)
            continue
        if any(x in backward for x in inputs):
            backward.add(node)
        elif not _order_free(node) or any(x in ordered for x in inputs):
            ordered.add(node)
    for node in list(joint.graph.nodes):
        if node.op == "call_function" and node.target is torch.ops.aten.max_pool2d_with_indices.default \
                and node not in backward:
            _recompute_indices(joint.graph, node, backward)
        if node.op == "call_function" and getattr(node.target, "overloadpacket", None) in (
                torch.ops.aten.eq, torch.ops.aten.ne):
            for x in node.all_input_nodes:
                if x in ordered:
                    x.meta["recompute"] = CheckpointPolicy.MUST_SAVE
    with functorch_config.patch(cse=False):
        return min_cut_rematerialization_partition(joint, joint_inputs, **kwargs)


def _recompute_indices(graph: fx.Graph, pool: fx.Node, backward: set[fx.Node]) -> None:
    """Let the backward recompute max pooling's indices from the input it saves, while the pooled
    values, which the forward writes for its own readers, stay saved: the indices' readers move to
    a copy of the pooling op that the partitioner prefers to recompute, with the indices taken from
    it (the partitioner recomputes all outputs of one op or none). Indices the forward also returns
    stay saved."""
    import operator

    from torch.utils.checkpoint import CheckpointPolicy

    readers = [u for u in pool.users if u.target is operator.getitem and u.args[1] == 1 and u.users
               and all(r in backward for r in u.users)]
    if not readers:
        return
    with graph.inserting_after(pool):
        twin = graph.call_function(pool.target, pool.args, pool.kwargs)
    twin.meta.update(pool.meta)
    twin.meta["recompute"] = CheckpointPolicy.PREFER_RECOMPUTE
    for reader in readers:
        reader.replace_input_with(pool, twin)
        reader.meta["recompute"] = CheckpointPolicy.PREFER_RECOMPUTE


def _stand_in(gm: fx.GraphModule) -> Callable[..., Any]:
    """A compiled function that returns empty tensors shaped like ``gm``'s outputs."""
    from torch._functorch.aot_autograd import make_boxed_func

    metas = [o.meta.get("val") if isinstance(o, fx.Node) else None for o in gm.graph.output_node().args[0]]

    def run(*args: Any) -> list[Any]:
        return [torch.empty_strided(m.shape, m.stride(), dtype=m.dtype, device=m.device)
                if isinstance(m, torch.Tensor) else None for m in metas]

    return make_boxed_func(run)


def _metadata() -> Any:
    from torch._guards import TracingContext

    context = TracingContext.try_get()
    return None if context is None else context.fw_metadata


def _backend(recording: _Recording) -> Callable[..., Any]:
    from torch._functorch.aot_autograd import aot_module_simplified

    def partitioned(joint: fx.GraphModule, joint_inputs: Any, **kwargs: Any):
        fw, bw = partition(joint, joint_inputs, **kwargs)
        recording.forward, recording.backward = fw, bw
        recording.num_fwd_outputs = kwargs["num_fwd_outputs"]
        recording.metadata = _metadata()
        return fw, bw

    def inference(gm: fx.GraphModule, example_inputs: Any):
        recording.inference = gm
        recording.metadata = _metadata()
        return _stand_in(gm)

    def backend(gm: fx.GraphModule, example_inputs: list[Any]):
        recording.calls += 1
        recording.dynamo_inputs = list(example_inputs)
        return aot_module_simplified(
            gm, example_inputs, fw_compiler=lambda g, _: _stand_in(g), bw_compiler=lambda g, _: _stand_in(g),
            inference_compiler=inference, partition_fn=partitioned, decompositions=decompositions(),
            keep_inference_input_mutations=True,
        )

    return backend


def _fresh(fn: Callable[..., Any]) -> Callable[..., Any]:
    """A copy of ``fn`` with its own code object, so TorchDynamo's per-code cache never hits."""
    code = fn.__code__.replace(co_name=f"{fn.__code__.co_name}_{id(fn):x}")
    return types.FunctionType(code, fn.__globals__, code.co_name, fn.__defaults__, fn.__closure__)


def _spec(name: str, t: torch.Tensor) -> ParamSpec:
    return ParamSpec(name, tuple(t.shape), to_dtype(t.dtype, f" (input {name})"), layout_of(t))


def capture(fn_or_module: Callable[..., Any], *example_inputs: Any, train: bool = False,
            name: str | None = None, channels_last: bool = True) -> Captured:
    """Capture ``fn_or_module(*example_inputs)`` as IR graphs (forward, and backward when ``train``).
    ``channels_last`` (``Options.channels_last``): the tensors a training forward saves are laid out
    as the backend lays them out (``graph.layout.saved_layouts``), the backward converted for them."""
    module = fn_or_module if isinstance(fn_or_module, torch.nn.Module) else None
    if name is None:
        name = type(module).__name__ if module is not None else getattr(fn_or_module, "__name__", "graph")
    state = list(module.named_parameters()) + list(module.named_buffers()) if module is not None else []
    state_names = [n for n, _ in state]

    def clone(t: Any) -> Any:
        if not isinstance(t, torch.Tensor):
            return t
        # A broadcast input (stride 0) keeps its layout: one copy of its distinct elements, expanded.
        broadcast = [d for d, (size, stride) in enumerate(zip(t.shape, t.stride())) if stride == 0 and size > 1]
        compact = t.detach()
        for d in broadcast:
            compact = compact.narrow(d, 0, 1)
        copy = torch.empty_strided(compact.shape, t.stride(), dtype=t.dtype, device=t.device)
        copy.copy_(compact)
        if broadcast:
            copy = copy.expand(t.shape)
        return copy.requires_grad_(train and t.requires_grad)

    state_clones = [clone(t) for _, t in state]
    input_clones = [clone(x) for x in example_inputs]
    slots: dict[int, int] = {}
    specs: list[ParamSpec] = []
    originals = [t for _, t in state] + list(example_inputs)
    labels = state_names + [f"input{i}" for i in range(len(example_inputs))]
    for label, original, copy in zip(labels, originals, state_clones + input_clones):
        if isinstance(copy, torch.Tensor):
            slots[id(copy)] = len(specs)
            specs.append(_spec(label.replace(".", "_"), original))  # the caller's layout, offset included

    if module is not None:
        def run(*flat: Any) -> Any:
            return torch.func.functional_call(module, dict(zip(state_names, flat[: len(state_names)])),
                                              tuple(flat[len(state_names):]))
    else:
        def run(*flat: Any) -> Any:
            return fn_or_module(*flat)

    recording = _Recording()
    compiled = torch.compile(_fresh(run), backend=_backend(recording), fullgraph=True, dynamic=False)
    with torch.no_grad() if not train else contextlib.nullcontext():
        compiled(*state_clones, *input_clones)
    if recording.calls != 1:
        raise CaptureError(f"capture of {name}: TorchDynamo produced {recording.calls} graphs, expected 1")
    placeholder_slots = [slots.get(id(t), t) for t in recording.dynamo_inputs]
    return _convert_recording(recording, specs, placeholder_slots, name, channels_last)


def _mutation_outputs(metadata: Any, placeholder_slots: Sequence[int | torch.Tensor]) -> dict[int, int]:
    """AOTAutograd returns mutated inputs it did not keep in-graph as the first outputs."""
    if metadata is None:
        return {}
    if getattr(metadata, "num_intermediate_bases", 0):
        raise CaptureError("outputs that alias graph intermediates are not supported")
    result = {}
    for position, input_index in enumerate(metadata.mutated_inp_runtime_indices):
        slot = placeholder_slots[input_index]
        if not isinstance(slot, int):
            raise CaptureError(f"graph mutates input {input_index}, which is not a parameter")
        result[position] = slot
    return result


def _convert_recording(recording: _Recording, specs: list[ParamSpec],
                       placeholder_slots: list[int | torch.Tensor], name: str, channels_last: bool = True) -> Captured:
    warned: set[str] = set()
    names = [s.name for s in specs]
    if recording.backward is None:
        gm = recording.inference or recording.forward
        mutations = _mutation_outputs(recording.metadata, placeholder_slots)
        n_out = len(gm.graph.output_node().args[0])
        order = [i for i in range(n_out) if i not in mutations]
        forward = convert(gm, specs, placeholder_slots, name=name, output_order=order,
                          output_mutations=mutations, warned=warned)
        return Captured(forward, None, names, len(order), 0, sorted(warned))

    fw, bw = recording.forward, recording.backward
    mutations = _mutation_outputs(recording.metadata, placeholder_slots)
    fw_out = list(fw.graph.output_node().args[0])
    n_user = recording.num_fwd_outputs - len(mutations)
    saved = fw_out[recording.num_fwd_outputs:]
    order = list(range(len(mutations), recording.num_fwd_outputs)) + list(
        range(recording.num_fwd_outputs, len(fw_out)))
    forward = convert(fw, specs, placeholder_slots, name=f"{name}_forward", output_order=order,
                      output_mutations=mutations, warned=warned)

    bw_placeholders = [n for n in bw.graph.nodes if n.op == "placeholder"]
    saved_names = [s.name for s in saved]
    if [p.name for p in bw_placeholders[: len(saved)]] != saved_names:
        raise CaptureError(f"backward of {name}: saved tensors {saved_names} do not lead its inputs")
    bw_specs = [_spec(p.name, p.meta["val"]) for p in bw_placeholders]
    # The saved tensors' layouts the backend chooses (``graph.layout.saved_layouts``): the forward
    # returns them so, and the backward is converted for them, as AOTAutograd compiles it. (The
    # backend also promises padded GEMM products their padded layout, ``fusion.padding``, a
    # decision of the fusion stage that capture leaves to it.)
    from fusionstitching.graph.layout import saved_layouts

    chosen = saved_layouts(forward, range(n_user, n_user + len(saved))) if channels_last else forward
    for k in range(len(saved)):
        layout = chosen.output_layouts[n_user + k]
        if layout is not forward.output_layouts[n_user + k]:
            bw_specs[k] = replace(bw_specs[k], layout=layout)
    forward = chosen
    # Gradients come in AOTAutograd's input order; put them in forward-parameter order.
    grad_of = {slot: i for i, slot in enumerate(placeholder_slots) if isinstance(slot, int)}
    bw_order = [grad_of.get(p, -1) for p in range(len(specs))]
    backward = _convert_backward(bw, bw_specs, bw_order, f"{name}_backward", warned)
    return Captured(forward, backward, names, n_user, len(saved), sorted(warned))


def _convert_backward(bw: fx.GraphModule, specs: list[ParamSpec], order: list[int], name: str,
                      warned: set[str]) -> Graph:
    """The backward graph with one gradient per forward parameter (``order[p]`` = its FX output)."""
    full = convert(bw, specs, list(range(len(specs))), name=name, warned=warned)
    checks = len(full.outputs) - full.checks
    outputs = [full.outputs[i] if i >= 0 else None for i in order] + full.outputs[checks:]
    layouts = [full.output_layouts[i] if i >= 0 else None for i in order] + full.output_layouts[checks:]
    graph = Graph(full.parameters, outputs, name=name, output_layouts=layouts)
    verify(graph)
    graph.origins, graph.checks = full.origins, full.checks
    return graph
