"""The ATen → IR table: one entry per ATen overload (docs/ops.md lists them with their IR form).

Capture runs AOTAutograd with the core-ATen decompositions plus torch's own decompositions of the
composite ops it would otherwise leave whole (``COMPOSITE_DECOMPOSITIONS``: layer norm, softmax,
log-softmax, GELU, dropout, embedding), so what reaches this table is a small set of
primitive ATen ops. Each lowering receives converted arguments (see ``context.py``) and returns an
IR node, or a tuple of them for multi-result ops. A lowering raises ``Unsupported`` for a case it
does not cover; the converter then keeps the op as a ``library`` node.

Ops whose natural form would be a scatter are expressed without one: ``scatter`` with one index per
row (the cross-entropy gradient) becomes ``select(iota == index, src, self)``; ``index_put`` with
``accumulate=True`` (the embedding gradient) becomes a one-hot ``dot_general``, which planning may
later hand to a library GEMM.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

from fusionstitching.frontend.context import LoweringContext, StorageDependent, Unsupported, to_dtype
from fusionstitching.graph.graph import Node
from fusionstitching.graph.node import contiguous_strides
from fusionstitching.graph.ops import DType
from fusionstitching.options import Options

Lowering = Callable[..., Any]
TABLE: dict[str, Lowering] = {}

# Composite ops that AOTAutograd leaves whole and that capture expands with torch's decompositions.
COMPOSITE_DECOMPOSITIONS = (
    "native_layer_norm", "_softmax", "_log_softmax", "gelu", "native_dropout", "embedding",
    "native_group_norm", "_native_batch_norm_legit", "_native_batch_norm_legit_functional",
    "_native_batch_norm_legit_no_training", "repeat",
)


def lowers(*names: str) -> Callable[[Lowering], Lowering]:
    def register(fn: Lowering) -> Lowering:
        for name in names:
            assert name not in TABLE, name
            TABLE[name] = fn
        return fn

    return register


# ----------------------------------------------------------------------------------------------
# Elementwise
# ----------------------------------------------------------------------------------------------


def _elementwise(op: str) -> Lowering:
    def lower(cx: LoweringContext, *args: Any) -> Node:
        return cx.elementwise(op, *args)

    return lower


for _name, _op in {
    "mul.Tensor": "mul", "mul.Scalar": "mul", "maximum.default": "max", "minimum.default": "min",
    "neg.default": "neg", "abs.default": "abs", "exp.default": "exp", "log.default": "log",
    "log1p.default": "log1p", "expm1.default": "expm1", "tanh.default": "tanh", "erf.default": "erf",
    "sigmoid.default": "sigmoid", "sqrt.default": "sqrt", "rsqrt.default": "rsqrt", "sin.default": "sin",
    "cos.default": "cos", "sign.default": "sign", "floor.default": "floor", "ceil.default": "ceil",
    "bitwise_and.Tensor": "and", "bitwise_and.Scalar": "and", "bitwise_or.Tensor": "or",
    "bitwise_or.Scalar": "or", "bitwise_xor.Tensor": "xor", "logical_and.default": "and",
    "logical_or.default": "or", "logical_xor.default": "xor", "bitwise_not.default": "not",
    "pow.Tensor_Tensor": "pow", "pow.Scalar": "pow",
    "fmod.Tensor": "rem", "fmod.Scalar": "rem",
}.items():
    lowers(f"aten.{_name}")(_elementwise(_op))


@lowers("aten.pow.Tensor_Scalar")
def _pow_scalar(cx: LoweringContext, x: Any, exponent: Any) -> Node:
    """A float tensor to a constant power as torch computes it: the square and the cube as
    products, 0.5 and -0.5 as sqrt and rsqrt, -1 as a reciprocal, any other exponent through pow.
    The result then has eager's bits (a pow of 2 may round differently from x * x), which a value
    compared for equality later (amax's gradient) relies on."""
    if cx.dtype.is_float and isinstance(exponent, (int, float)) and not isinstance(exponent, bool):
        if exponent == 2:
            return cx.elementwise("mul", x, x)
        if exponent == 3:
            return cx.elementwise("mul", cx.elementwise("mul", x, x), x)
        if exponent in (0.5, -0.5):
            return cx.elementwise("sqrt" if exponent > 0 else "rsqrt", x)
        if exponent == -1:
            return cx.elementwise("div", 1, x)
    return cx.elementwise("pow", x, exponent)


@lowers("aten.trunc.default")
def _trunc(cx: LoweringContext, x: Any) -> Node:
    """Toward zero: ``ceil`` below zero, ``floor`` elsewhere (an integer is its own value)."""
    x = cx.lift(x, cx.dtype)
    if not cx.dtype.is_float:
        return x
    negative = cx.b.compare("LT", x, cx.lift(0, cx.dtype, x.shape))
    return cx.b.select(negative, cx.b.unary("ceil", x), cx.b.unary("floor", x))


@lowers("aten.round.default", "aten.round.decimals")
def _round(cx: LoweringContext, x: Any, decimals: int = 0) -> Node:
    """Round half to even (C's ``nearbyint``) as torch computes it, in the compute type: with
    ``decimals`` d > 0 of ``x · 10^d`` then divided by 10^d, with d < 0 of ``x / 10^-d`` then times
    it. An integer input is its own value."""
    if not cx.dtype.is_float:
        return cx.lift(x, cx.dtype)
    compute = cx.dtype.compute
    value = cx.lift(x, compute)
    if decimals:
        scale = cx.lift(float(10.0 ** abs(decimals)), compute, value.shape)
        into, back = ("mul", "div") if decimals > 0 else ("div", "mul")
        value = cx.b.binary(back, _half_to_even(cx, cx.b.binary(into, value, scale)), scale)
    else:
        value = _half_to_even(cx, value)
    return cx.lift(value, cx.dtype, value.shape)


def _half_to_even(cx: LoweringContext, x: Node) -> Node:
    """``nearbyint(x)``: the floor, plus one where the fraction (``x - floor(x)``, exact in binary
    floating point) is above one half, or is one half and the floor is odd; a zero result keeps
    ``x``'s sign (``x · 0``), NaN and the infinities stay as they are."""
    low = cx.b.unary("floor", x)
    fraction = cx.b.binary("sub", x, low)
    half, zero = cx.lift(0.5, x.dtype, x.shape), cx.lift(0, x.dtype, x.shape)
    odd = cx.b.compare("NE", cx.b.binary("rem", low, cx.lift(2, x.dtype, x.shape)), zero)
    up = cx.b.binary("or", cx.b.compare("GT", fraction, half),
                     cx.b.binary("and", cx.b.compare("EQ", fraction, half), odd))
    rounded = cx.b.select(up, cx.b.binary("add", low, cx.lift(1, x.dtype, x.shape)), low)
    return cx.b.select(cx.b.compare("EQ", rounded, zero), cx.b.binary("mul", x, zero), rounded)


@lowers("aten.add.Tensor", "aten.add.Scalar", "aten.sub.Tensor", "aten.sub.Scalar", "aten.rsub.Scalar",
        "aten.rsub.Tensor")
def _add_sub(cx: LoweringContext, a: Any, b: Any, alpha: Any = 1) -> Node:
    name = cx.fx_node.target.__name__
    if name.startswith("rsub"):
        a, b = b, a
    if alpha != 1:
        b = cx.elementwise("mul", b, alpha)
    return cx.elementwise("sub" if "sub" in name else "add", a, b)


@lowers("aten.div.Tensor", "aten.div.Scalar")
def _div(cx: LoweringContext, a: Any, b: Any) -> Node:
    return cx.elementwise("div", a, b)


@lowers("aten.div.Tensor_mode", "aten.div.Scalar_mode")
def _div_mode(cx: LoweringContext, a: Any, b: Any, rounding_mode: str | None = None) -> Node:
    if rounding_mode is None:
        return cx.elementwise("div", a, b)
    q = cx.elementwise("div", a, b)
    if rounding_mode == "trunc":
        if not cx.dtype.is_float:
            return q
        negative = cx.b.compare("LT", q, cx.lift(0, cx.dtype))
        return cx.b.select(negative, cx.b.unary("ceil", q), cx.b.unary("floor", q))
    if cx.dtype.is_float:
        return _floor_divide_float(cx, a, b, q)
    # Integer floor division: truncation, minus one where the remainder is nonzero and signs differ.
    r = cx.elementwise("rem", a, b)
    zero = cx.lift(0, cx.dtype)
    fix = cx.b.binary("and", cx.b.compare("NE", r, zero),
                      cx.b.compare("NE", cx.b.compare("LT", r, zero), cx.b.compare("LT", cx.lift(b, cx.dtype), zero)))
    return cx.b.select(fix, cx.b.binary("sub", q, cx.lift(1, cx.dtype)), q)


def _floor_divide_float(cx: LoweringContext, a: Any, b: Any, q: Node) -> Node:
    """``floor(a / b)`` as torch computes it: the quotient of ``a - fmod(a, b)``, which is b times an
    integer, rounded to that integer (a quotient rounded below an exact integer, 6.9 / 0.69 = 9.99...,
    must not floor to one less); a zero result takes the quotient's sign, a zero divisor gives the
    quotient (inf or NaN)."""
    bb, zero = cx.lift(b, cx.dtype), cx.lift(0, cx.dtype)
    mod = cx.elementwise("rem", a, b)
    d = cx.elementwise("div", cx.elementwise("sub", a, mod), b)
    fix = cx.b.binary("and", cx.b.compare("NE", mod, zero),
                      cx.b.compare("NE", cx.b.compare("LT", bb, zero), cx.b.compare("LT", mod, zero)))
    d = cx.b.select(fix, cx.b.binary("sub", d, cx.lift(1, cx.dtype)), d)
    floored = cx.b.unary("floor", d)
    above = cx.b.compare("GT", cx.b.binary("sub", d, floored), cx.lift(0.5, cx.dtype))
    rounded = cx.b.select(above, cx.b.binary("add", floored, cx.lift(1, cx.dtype)), floored)
    negative = cx.b.compare("LT", cx.elementwise("div", 1, q), zero)  # q < 0 or q = -0 (1/-0 = -inf)
    signed_zero = cx.b.select(negative, cx.lift(-0.0, cx.dtype), zero)
    result = cx.b.select(cx.b.compare("NE", d, zero), rounded, signed_zero)
    return cx.b.select(cx.b.compare("EQ", bb, zero), q, result)


@lowers("aten.__lshift__.Tensor", "aten.__lshift__.Scalar", "aten.bitwise_left_shift.Tensor",
        "aten.bitwise_left_shift.Tensor_Scalar", "aten.bitwise_left_shift.Scalar_Tensor",
        "aten.__rshift__.Tensor", "aten.__rshift__.Scalar", "aten.bitwise_right_shift.Tensor",
        "aten.bitwise_right_shift.Tensor_Scalar", "aten.bitwise_right_shift.Scalar_Tensor")
def _shift(cx: LoweringContext, x: Any, s: Any) -> Node:
    """Integer shifts by eager's rule, without a shift instruction (whose result past the register's
    width is undefined on a GPU): ``x << s`` is the wrapping product ``x · 2^s`` for ``0 <= s <
    width`` and 0 for any other ``s``; ``x >> s`` is the floor quotient ``x / 2^s`` while ``2^s`` is
    positive in the type (``s`` below the width, less the sign bit of a signed type) and the sign
    fill (-1 for a negative ``x``, else 0) for any other ``s``, which is also ``x >> (width - 1)``."""
    dtype = cx.dtype
    if dtype.is_float or dtype == DType.BOOL:
        raise Unsupported(f"a shift of {dtype.value}")  # eager's error, from the library call
    left = "left" in cx.fx_node.target.__name__ or "lshift" in cx.fx_node.target.__name__
    width = 8 * dtype.itemsize
    xs, ss, zero = cx.lift(x, dtype), cx.lift(s, dtype), cx.lift(0, dtype)
    power = cx.b.binary("pow", cx.lift(2, dtype), ss)  # integer pow: wraps as the product does
    limit = width if left or dtype == DType.U8 else width - 1
    inside = cx.b.binary("and", cx.b.compare("GE", ss, zero), cx.b.compare("LT", ss, cx.lift(limit, dtype)))
    if left:
        return cx.b.select(inside, cx.b.binary("mul", xs, power), zero)
    negative = cx.b.compare("LT", xs, zero)
    truncated = cx.b.binary("div", xs, power)  # the divisor is 2^s > 0 where it is used
    inexact = cx.b.compare("NE", cx.b.binary("rem", xs, power), zero)
    floored = cx.b.select(cx.b.binary("and", inexact, negative), cx.b.binary("sub", truncated, cx.lift(1, dtype)),
                          truncated)
    return cx.b.select(inside, floored, cx.b.select(negative, cx.lift(-1, dtype), zero))


@lowers("aten.remainder.Tensor", "aten.remainder.Scalar")
def _remainder(cx: LoweringContext, a: Any, b: Any) -> Node:
    """Python-style modulo: fmod, plus the divisor where the signs of remainder and divisor differ."""
    r = cx.elementwise("rem", a, b)
    bb, zero = cx.lift(b, cx.dtype), cx.lift(0, cx.dtype)
    differ = cx.b.binary("and", cx.b.compare("NE", r, zero),
                         cx.b.compare("NE", cx.b.compare("LT", r, zero), cx.b.compare("LT", bb, zero)))
    return cx.b.select(differ, cx.b.binary("add", r, bb), r)


@lowers("aten.reciprocal.default")
def _reciprocal(cx: LoweringContext, x: Node) -> Node:
    return cx.elementwise("div", 1, x)


@lowers("aten.relu.default")
def _relu(cx: LoweringContext, x: Node) -> Node:
    return cx.elementwise("max", x, 0)


@lowers("aten.clamp.default", "aten.clamp.Tensor", "aten.clamp_min.default", "aten.clamp_max.default",
        "aten.hardtanh.default")
def _clamp(cx: LoweringContext, x: Node, lo: Any = None, hi: Any = None) -> Node:
    name = cx.fx_node.target.__name__
    if name.startswith("clamp_max"):
        lo, hi = None, lo
    if name.startswith("hardtanh"):
        lo = -1.0 if lo is None else lo
        hi = 1.0 if hi is None else hi
    out = cx.lift(x, cx.dtype)
    if lo is not None:
        out = cx.elementwise("max", out, lo)
    if hi is not None:
        out = cx.elementwise("min", out, hi)
    return out


@lowers("prims.fma.default")
def _fma(cx: LoweringContext, a: Any, b: Any, c: Any) -> Node:
    return cx.elementwise("add", cx.elementwise("mul", a, b), c)


def _compare(direction: str) -> Lowering:
    def lower(cx: LoweringContext, a: Any, b: Any) -> Node:
        return cx.b.compare(direction, *(cx.lift(x, cx.common_dtype(a, b)) for x in (a, b)))

    return lower


for _short, _direction in {"eq": "EQ", "ne": "NE", "lt": "LT", "le": "LE", "gt": "GT", "ge": "GE"}.items():
    lowers(f"aten.{_short}.Tensor", f"aten.{_short}.Scalar")(_compare(_direction))


@lowers("aten.logical_not.default")
def _logical_not(cx: LoweringContext, x: Node) -> Node:
    return cx.b.unary("not", cx.lift(x, DType.BOOL))


@lowers("aten.isnan.default")
def _isnan(cx: LoweringContext, x: Node) -> Node:
    return cx.b.compare("NE", x, x)


@lowers("aten.where.self", "aten.where.ScalarSelf", "aten.where.ScalarOther", "aten.where.Scalar")
def _where(cx: LoweringContext, cond: Node, a: Any, b: Any) -> Node:
    return cx.b.select(cx.lift(cond, DType.BOOL), cx.lift(a, cx.dtype), cx.lift(b, cx.dtype))


@lowers("aten._to_copy.default", "prims.convert_element_type.default", "aten.to.dtype")
def _to_copy(cx: LoweringContext, x: Node, *args: Any, **kwargs: Any) -> Node:
    return cx.lift(x, cx.dtype)


@lowers("aten.clone.default", "aten.alias.default", "aten.lift_fresh_copy.default", "aten.detach.default",
        "aten.contiguous.default")
def _identity(cx: LoweringContext, x: Node, *args: Any, **kwargs: Any) -> Node:
    """Value copies and aliases: the IR is functional, so the value itself."""
    return x


@lowers("aten.copy.default")
def _copy(cx: LoweringContext, dst: Node, src: Any, non_blocking: bool = False) -> Node:
    return cx.lift(src, dst.dtype, dst.shape)


# ----------------------------------------------------------------------------------------------
# Creation and randomness
# ----------------------------------------------------------------------------------------------


@lowers("aten.full.default", "aten.full_like.default", "aten.scalar_tensor.default", "aten.zeros.default",
        "aten.ones.default", "aten.zeros_like.default", "aten.ones_like.default", "aten.new_zeros.default",
        "aten.new_ones.default", "aten.new_full.default", "aten.empty.memory_format",
        "aten.empty_like.default", "aten.new_empty.default", "aten.empty_strided.default")
def _full(cx: LoweringContext, *args: Any, **kwargs: Any) -> Node:
    name = cx.fx_node.target.__name__
    if name.startswith(("full", "new_full")):
        value = args[-1] if name.startswith("full.") else args[2] if name.startswith("new_full") else args[1]
    elif name.startswith("scalar_tensor"):
        value = args[0]
    else:
        value = 1 if "ones" in name else 0  # empty: any value is correct, zero is deterministic
    if isinstance(value, Node):
        raise Unsupported("fill value given as a tensor")
    return cx.constant(value, cx.dtype, cx.shape)


@lowers("aten.arange.start_step", "aten.arange.start", "aten.arange.default")
def _arange(cx: LoweringContext, *args: Any, **kwargs: Any) -> Node:
    numbers = [a for a in args if isinstance(a, (int, float))]
    start, step = (0, 1) if len(numbers) == 1 else (numbers[0], numbers[2] if len(numbers) > 2 else 1)
    index = cx.b.iota(cx.shape, 0, DType.I64 if not cx.dtype.is_float else cx.dtype)
    if step != 1:
        index = cx.elementwise("mul", index, step, dtype=index.dtype)
    if start != 0:
        index = cx.elementwise("add", index, start, dtype=index.dtype)
    return cx.lift(index, cx.dtype)


@lowers("aten.rand.default", "aten.rand_like.default")
def _rand(cx: LoweringContext, *args: Any, **kwargs: Any) -> Node:
    return cx.lift(cx.rng.uniform(cx.shape, DType.F32), cx.dtype)


@lowers("aten.bernoulli.p", "aten.bernoulli.default")
def _bernoulli(cx: LoweringContext, x: Node, p: Any = None, generator: Any = None) -> Node:
    probability = x if p is None else p
    u = cx.rng.uniform(cx.shape, DType.F32)
    return cx.lift(cx.b.compare("LT", u, cx.lift(probability, DType.F32)), cx.dtype)


# ----------------------------------------------------------------------------------------------
# Reductions
# ----------------------------------------------------------------------------------------------


def _reduce(cx: LoweringContext, x: Node, dims: Any, keepdim: bool, kind: str, dtype: DType) -> Node:
    dims = cx.normalize_dims(dims, len(x.shape))
    out = cx.b.reduce(cx.lift(x, dtype, x.shape), dims, kind) if dims else cx.lift(x, dtype, x.shape)
    if keepdim:
        out = cx.reshape(out, [1 if i in dims else s for i, s in enumerate(x.shape)])
    return out


@lowers("aten.sum.dim_IntList", "aten.sum.default")
def _sum(cx: LoweringContext, x: Node, dims: Any = None, keepdim: bool = False, dtype: Any = None) -> Node:
    return _reduce(cx, x, dims, keepdim, "sum", cx.dtype)


@lowers("aten.prod.dim_int", "aten.prod.default")
def _prod(cx: LoweringContext, x: Node, dim: Any = None, keepdim: bool = False, dtype: Any = None) -> Node:
    return _reduce(cx, x, dim, keepdim, "prod", cx.dtype)


@lowers("aten.amax.default", "aten.max.default")
def _amax(cx: LoweringContext, x: Node, dims: Any = None, keepdim: bool = False) -> Node:
    return _reduce(cx, x, dims, keepdim, "max", cx.dtype)


@lowers("aten.amin.default", "aten.min.default")
def _amin(cx: LoweringContext, x: Node, dims: Any = None, keepdim: bool = False) -> Node:
    return _reduce(cx, x, dims, keepdim, "min", cx.dtype)


@lowers("aten.max.dim", "aten.min.dim")
def _extreme_with_index(cx: LoweringContext, x: Node, dim: int, keepdim: bool = False) -> tuple[Node, Node]:
    """``torch.max(x, dim)`` / ``torch.min(x, dim)``: the values, and the index of each row's first
    extreme (a NaN, where the row has one, as torch propagates it) (``_arg_extreme``)."""
    kind = "max" if cx.fx_node.target.__name__.startswith("max") else "min"
    d = _reduced_dim(x, dim)
    index = _arg_extreme(cx, x, d, kind, keepdim)
    value = _reduce(cx, x, (d,), keepdim, kind, x.dtype) if x.shape else x
    return value, index


@lowers("aten.argmax.default", "aten.argmin.default")
def _arg_extreme_op(cx: LoweringContext, x: Node, dim: int | None = None, keepdim: bool = False) -> Node:
    kind = "max" if cx.fx_node.target.__name__.startswith("argmax") else "min"
    if x.dtype == DType.BOOL:
        raise Unsupported(f"arg{kind} of a bool tensor (eager rejects it)")
    if dim is None:  # over the flattened tensor; keepdim keeps every dim as 1
        flat = _arg_extreme(cx, cx.reshape(x, (math.prod(x.shape),)), 0, kind, False)
        return cx.reshape(flat, cx.shape)
    return _arg_extreme(cx, x, _reduced_dim(x, dim), kind, keepdim)


def _reduced_dim(x: Node, dim: int) -> int:
    """``dim`` normalized for a reduction returning indices; an empty dim stays torch's op (which
    raises eager's error)."""
    rank = max(len(x.shape), 1)
    if not -rank <= dim < rank:
        raise Unsupported(f"dim {dim} out of range for rank {len(x.shape)}")
    if x.shape and x.shape[dim % rank] == 0:
        raise Unsupported("an index reduction over an empty dim")
    return dim % rank


def _arg_extreme(cx: LoweringContext, x: Node, d: int, kind: str, keepdim: bool) -> Node:
    """The int64 index along ``d`` of each row's first maximum (``kind`` "max") or minimum: the
    smallest position whose element equals the row's extreme, or is NaN where the extreme is
    (torch's rule: NaN beats every number, and the first of equals wins)."""
    if not x.shape:
        return cx.constant(0, DType.I64, ())
    extreme = cx.broadcast_to(_reduce(cx, x, (d,), True, kind, x.dtype), x.shape)
    hit = cx.b.compare("EQ", x, extreme)
    if x.dtype.is_float:
        hit = cx.b.binary("or", hit, cx.b.compare("NE", x, x))
    positions = cx.b.iota(x.shape, d, DType.I64)
    past = cx.lift(x.shape[d], DType.I64, x.shape)
    return _reduce(cx, cx.b.select(hit, positions, past), (d,), keepdim, "min", DType.I64)


@lowers("aten.any.dim", "aten.any.dims", "aten.any.default")
def _any(cx: LoweringContext, x: Node, dims: Any = None, keepdim: bool = False) -> Node:
    return cx.lift(_reduce(cx, _nonzero(cx, x), dims, keepdim, "max", DType.BOOL), cx.dtype)


@lowers("aten.all.dim", "aten.all.dims", "aten.all.default")
def _all(cx: LoweringContext, x: Node, dims: Any = None, keepdim: bool = False) -> Node:
    return cx.lift(_reduce(cx, _nonzero(cx, x), dims, keepdim, "min", DType.BOOL), cx.dtype)


@lowers("aten.linalg_vector_norm.default")
def _vector_norm(cx: LoweringContext, x: Node, ord: Any = 2, dims: Any = None, keepdim: bool = False, *,
                 dtype: Any = None) -> Node:
    """``torch.linalg.vector_norm`` (``F.normalize``, weight norm, gradient norms) as torch computes it:
    the input cast to ``dtype`` where one is given, then |x| reduced in the compute type (f32 for the
    half types, as torch's accumulation type): ord 2 as the square root of the sum of squares, 1 as
    the sum, ±inf as the max / min, 0 as the count of nonzeros, any other p as (Σ|x|^p)^(1/p).
    Integer inputs (which eager rejects) and reductions over an empty dim (where eager rejects ±inf)
    stay torch's op."""
    if not x.dtype.is_float:
        raise Unsupported(f"linalg_vector_norm of {x.dtype.value}: eager rejects a non-float input")
    dims = cx.normalize_dims(dims, len(x.shape))
    if any(x.shape[d] == 0 for d in dims):
        raise Unsupported("linalg_vector_norm over an empty dim")
    if not isinstance(ord, (int, float)) or isinstance(ord, bool):
        raise Unsupported(f"linalg_vector_norm of ord {ord!r}")
    if dtype is not None:
        x = cx.lift(x, cx.dtype, x.shape)
    compute = cx.dtype.compute
    value = cx.lift(x, compute, x.shape)
    if ord == 0:
        out = _reduce(cx, cx.lift(_nonzero(cx, value), compute, x.shape), dims, keepdim, "sum", compute)
    elif ord == 2:
        out = cx.b.unary("sqrt", _reduce(cx, cx.b.binary("mul", value, value), dims, keepdim, "sum", compute))
    else:
        magnitude = cx.b.unary("abs", value)
        if math.isinf(ord):
            out = _reduce(cx, magnitude, dims, keepdim, "max" if ord > 0 else "min", compute)
        elif ord == 1:
            out = _reduce(cx, magnitude, dims, keepdim, "sum", compute)
        else:
            powered = cx.b.binary("pow", magnitude, cx.lift(float(ord), compute, x.shape))
            total = _reduce(cx, powered, dims, keepdim, "sum", compute)
            out = cx.b.binary("pow", total, cx.lift(1.0 / ord, compute, total.shape))
    return cx.lift(out, cx.dtype, out.shape)


# The widest block a scan level sums as a triangle: each element then costs at most this many adds
# over values a warp holds, about what a memory-bound element's time leaves for arithmetic (a GPU
# issues some 20 f32 operations per byte of DRAM traffic), and a warp's width.
_SCAN_BLOCK = 32
# A whole scan is one triangle (one reduction, fused with what reads it) while its work stays within
# a dot that generated kernels run as fast as the GEMM library: a triangle is the product with a
# triangular matrix of ones. The default bound (``Options.small_dot_max_flops``, measured); lowering
# does not see a compilation's options, and either form gives the same values.
_TRIANGLE_FLOPS = Options.small_dot_max_flops


@lowers("aten.cumsum.default", "aten.cumprod.default")
def _cumulative(cx: LoweringContext, x: Node, dim: int, *, dtype: Any = None) -> Node:
    """``cumsum`` / ``cumprod`` along ``dim`` (position ids from a mask, cumulative probabilities)
    in the result's compute type (f32 for the half types, as torch accumulates; an integer or
    bool input sums in int64), as a blocked scan of reductions and broadcasts that fuses with
    the ops around it (``_scan``)."""
    kind = "sum" if cx.fx_node.target.__name__.startswith("cumsum") else "prod"
    compute = cx.dtype.compute if cx.dtype.is_float else cx.dtype
    value = _along_last(cx, cx.lift(x, compute, x.shape), dim, lambda v: _scan(cx, v, kind))
    return cx.lift(value, cx.dtype, x.shape)


def _along_last(cx: LoweringContext, x: Node, dim: int, scan: Callable[[Node], Node]) -> Node:
    """``scan`` (of the last dim) applied along ``dim``: that dim moved last and back; a 0-d
    ``x``, one of no elements or one whose dim has one element is its own scan."""
    if not x.shape:
        return x
    d = cx.normalize_dim(dim, len(x.shape))
    last = len(x.shape) - 1
    if x.shape[d] <= 1 or not math.prod(x.shape):
        return x
    order = [*(i for i in range(len(x.shape)) if i != d), d]
    value = scan(cx.b.transpose(x, order) if d != last else x)
    return cx.b.transpose(value, [order.index(i) for i in range(len(order))]) if d != last else value


def _scan(cx: LoweringContext, x: Node, kind: str) -> Node:
    """The inclusive scan (``kind`` "sum" or "prod") of ``x`` along its last dim, of size n, from
    reductions that read ``x`` itself where they can, so that few kernels result.

    Up to ``_SCAN_BLOCK``, or while its work is that of a small dot (``_TRIANGLE_FLOPS``): a
    triangle, each position reducing the elements at or before it. Longer:
    the dim (padded with the identity) in m blocks of s, a triangle within each block combined with
    what precedes the block. Up to ``_SCAN_BLOCK``² that is one masked reduction of the row per
    block (s ≈ m ≈ √n: about 2√n operations per element, all reading ``x``); longer, the blocks'
    totals scanned the same way (one level per factor of up to ``_SCAN_BLOCK`` in n) and shifted by
    one."""
    *rows, n = x.shape
    r = len(rows)
    unit = 0 if kind == "sum" else 1
    if n <= _SCAN_BLOCK or 2 * math.prod(x.shape) * n <= _TRIANGLE_FLOPS:
        return _triangle(cx, x, kind)
    levels, s, m, padded, blocks = _blocked(cx, x, float(unit))
    zeros = (0,) * len(x.shape)
    if levels == 2:  # before block k: the row's elements j < k·s
        wide = (*rows, m, m * s)
        spread = cx.b.broadcast(padded, wide, (*range(r), r + 1))
        first = cx.b.binary("mul", cx.b.iota(wide, r, DType.I64), cx.lift(s, DType.I64, wide))
        taken = cx.b.compare("LT", cx.b.iota(wide, r + 1, DType.I64), first)
        before = cx.b.reduce(cx.b.select(taken, spread, cx.lift(unit, x.dtype, wide)), (r + 1,), kind)
    else:  # the scan of the blocks' totals, shifted by one block
        totals = _scan(cx, cx.b.reduce(blocks, (r + 1,), kind), kind)
        before = cx.node("pad", _slice_dim(cx, totals, r, 0, m - 1, 1), low=(*zeros[:-1], 1), high=zeros,
                         interior=zeros, value=float(unit))
    out = cx.b.binary("add" if kind == "sum" else "mul", _triangle(cx, blocks, kind),
                      cx.b.broadcast(before, (*rows, m, s), tuple(range(r + 1))))
    return _slice_dim(cx, cx.reshape(out, (*rows, m * s)), r, 0, n, 1)


def _blocked(cx: LoweringContext, x: Node, identity: float) -> tuple[int, int, int, Node, Node]:
    """A scan's blocks of its last dim, n long: the levels (one per factor of up to ``_SCAN_BLOCK``
    in n, at least two), the block length s and count m, the row padded with ``identity`` to m·s,
    and that reshaped to [..., m, s]."""
    *rows, n = x.shape
    levels = max(2, math.ceil(math.log2(n) / math.log2(_SCAN_BLOCK)))
    s = 2 ** math.ceil(math.log2(n) / levels)
    m = -(-n // s)
    zeros = (0,) * len(x.shape)
    padded = x if m * s == n else cx.node("pad", x, low=zeros, high=(*zeros[:-1], m * s - n), interior=zeros,
                                          value=identity)
    return levels, s, m, padded, cx.reshape(padded, (*rows, m, s))


def _triangle(cx: LoweringContext, x: Node, kind: str) -> Node:
    """The scan of ``x`` along its last dim as one reduction: x broadcast over the positions, the
    elements after each position replaced by the identity."""
    *rows, n = x.shape
    square = (*rows, n, n)  # [..., position, element]
    spread = cx.b.broadcast(x, square, (*range(len(rows)), len(rows) + 1))
    taken = cx.b.compare("LE", cx.b.iota(square, len(rows) + 1, DType.I64), cx.b.iota(square, len(rows), DType.I64))
    unit = cx.lift(0 if kind == "sum" else 1, x.dtype, square)
    return cx.b.reduce(cx.b.select(taken, spread, unit), (len(rows) + 1,), kind)


@lowers("aten.logcumsumexp.default")
def _logcumsumexp(cx: LoweringContext, x: Node, dim: int) -> Node:
    """``logcumsumexp`` along ``dim`` in the compute type (f32 for the half types), as a blocked
    scan like ``cumsum``'s (``_log_scan``) whose sums are taken of ``exp(x - shift)``, the shift the
    largest element they combine: no term exceeds 1, so nothing overflows, and the largest term is
    1, so no prefix underflows where its elements are far below the row's maximum. Integer inputs
    stay torch's op (and its error)."""
    if not x.dtype.is_float:
        raise Unsupported(f"logcumsumexp of {x.dtype.name} (eager takes floating types only)")
    value = _along_last(cx, cx.lift(x, cx.dtype.compute, x.shape), dim, lambda v: _log_scan(cx, v))
    return cx.lift(value, cx.dtype, x.shape)


def _log_scan(cx: LoweringContext, x: Node) -> Node:
    """The inclusive log-sum-exp scan of ``x`` along its last dim, in the blocks of ``_scan``: a
    triangle within each block, combined with the log-sum-exp of what precedes the block by
    ``_log_add_exp``."""
    *rows, n = x.shape
    r = len(rows)
    if n <= _SCAN_BLOCK or 2 * math.prod(x.shape) * n <= _TRIANGLE_FLOPS:
        return _log_triangle(cx, x)
    levels, s, m, padded, blocks = _blocked(cx, x, -math.inf)
    zeros = (0,) * len(x.shape)
    if levels == 2:  # before block k: the row's elements j < k·s
        wide = (*rows, m, m * s)
        spread = cx.b.broadcast(padded, wide, (*range(r), r + 1))
        first = cx.b.binary("mul", cx.b.iota(wide, r, DType.I64), cx.lift(s, DType.I64, wide))
        before = _masked_log_sum_exp(cx, spread, cx.b.compare("LT", cx.b.iota(wide, r + 1, DType.I64), first))
    else:  # the scan of the blocks' totals, shifted by one block
        totals = _log_scan(cx, _masked_log_sum_exp(cx, blocks, None))
        before = cx.node("pad", _slice_dim(cx, totals, r, 0, m - 1, 1), low=(*zeros[:-1], 1), high=zeros,
                         interior=zeros, value=-math.inf)
    out = _log_add_exp(cx, _log_triangle(cx, blocks), cx.b.broadcast(before, (*rows, m, s), tuple(range(r + 1))))
    return _slice_dim(cx, cx.reshape(out, (*rows, m * s)), r, 0, n, 1)


def _log_triangle(cx: LoweringContext, x: Node) -> Node:
    """The log-sum-exp scan of ``x`` along its last dim as two reductions of the triangle of
    elements at or before each position."""
    *rows, n = x.shape
    square = (*rows, n, n)  # [..., position, element]
    spread = cx.b.broadcast(x, square, (*range(len(rows)), len(rows) + 1))
    taken = cx.b.compare("LE", cx.b.iota(square, len(rows) + 1, DType.I64), cx.b.iota(square, len(rows), DType.I64))
    return _masked_log_sum_exp(cx, spread, taken)


def _masked_log_sum_exp(cx: LoweringContext, x: Node, taken: Node | None) -> Node:
    """``log Σ exp(x)`` over the last dim of the elements ``taken`` (all where None): the sum is of ``exp(x - shift)``,
    the shift the largest taken element (0 where that is infinite, as torch's logsumexp: -inf where
    nothing is taken or every element is -inf, +inf where one is); a NaN taken is the result."""
    shape, dtype = x.shape, x.dtype
    last = len(shape) - 1

    def masked(values: Node, unit: float) -> Node:
        return values if taken is None else cx.b.select(taken, values, cx.lift(unit, dtype, shape))

    largest = cx.b.reduce(masked(x, -math.inf), (last,), "max")
    infinite = cx.b.compare("EQ", cx.b.unary("abs", largest), cx.lift(math.inf, dtype, largest.shape))
    shift = cx.b.select(infinite, cx.lift(0, dtype, largest.shape), largest)
    terms = cx.b.unary("exp", cx.b.binary("sub", x, cx.b.broadcast(shift, shape, tuple(range(last)))))
    total = cx.b.reduce(masked(terms, 0), (last,), "sum")
    return cx.b.binary("add", cx.b.unary("log", total), shift)


def _log_add_exp(cx: LoweringContext, a: Node, b: Node) -> Node:
    """``log(exp(a) + exp(b))`` as ``hi + log1p(exp(lo - hi))``; ``hi`` itself where it is infinite
    (both -inf, or a +inf), a NaN of either the result."""
    hi, lo = cx.b.binary("max", a, b), cx.b.binary("min", a, b)
    infinite = cx.b.compare("EQ", cx.b.unary("abs", hi), cx.lift(math.inf, hi.dtype, hi.shape))
    combined = cx.b.binary("add", hi, cx.b.unary("log1p", cx.b.unary("exp", cx.b.binary("sub", lo, hi))))
    return cx.b.select(infinite, hi, combined)


@lowers("aten._weight_norm_interface_backward.default")
def _weight_norm_backward(cx: LoweringContext, grad_w: Node, v: Node, g: Node, norms: Node,
                          dim: int) -> tuple[Node, Node]:
    """The gradient of weight norm, ``w = g · v / ‖v‖`` with ‖v‖ over every dim but ``dim``
    (``norms``, saved by the forward): s = Σ grad_w · v over those dims, grad_g = s / ‖v‖ and
    grad_v = g / ‖v‖ · (grad_w − v · s / ‖v‖²), in f32 for half types as torch's kernel. torch's
    kernel takes the first or the last dim only; another stays torch's op (and its error)."""
    rank, d = len(v.shape), dim
    if dim not in (0, rank - 1):  # the rule of the forward's decomposition (``torch_fx._weight_norm_interface``)
        raise Unsupported(f"weight norm over dim {dim} of a rank-{rank} tensor (torch's kernel takes the first or last)")
    compute = v.dtype.compute if v.dtype.is_float else v.dtype
    gw, vv = cx.lift(grad_w, compute, v.shape), cx.lift(v, compute, v.shape)
    product = cx.b.binary("mul", gw, vv)
    others = tuple(k for k in range(rank) if k != d)
    sums = _reduce(cx, product, others, True, "sum", compute) if others else product  # the shape of g
    kept = cx.lift(cx.reshape(norms, sums.shape), compute, sums.shape)
    grad_g = cx.b.binary("div", sums, kept)
    scale = cx.b.binary("div", cx.lift(cx.reshape(g, sums.shape), compute, sums.shape), kept)
    along = cx.b.binary("div", sums, cx.b.binary("mul", kept, kept))
    grad_v = cx.b.binary("mul", cx.broadcast_to(scale, v.shape),
                         cx.b.binary("sub", gw, cx.b.binary("mul", vv, cx.broadcast_to(along, v.shape))))
    return (cx.lift(grad_v, to_dtype(cx.meta_of(0).dtype), v.shape),
            cx.lift(cx.reshape(grad_g, g.shape), to_dtype(cx.meta_of(1).dtype), g.shape))


def _nonzero(cx: LoweringContext, x: Node) -> Node:
    if x.dtype == DType.BOOL:
        return x
    return cx.b.compare("NE", x, cx.lift(0, x.dtype, x.shape))


def _mean(cx: LoweringContext, x: Node, dims: tuple[int, ...], keepdim: bool, dtype: DType) -> Node:
    total = _reduce(cx, x, dims, keepdim, "sum", dtype)
    count = math.prod(x.shape[d] for d in dims)
    return cx.b.binary("div", total, cx.lift(count, dtype, total.shape))


@lowers("aten.mean.dim", "aten.mean.default")
def _mean_op(cx: LoweringContext, x: Node, dims: Any = None, keepdim: bool = False, dtype: Any = None) -> Node:
    compute = cx.dtype.compute
    return cx.lift(_mean(cx, x, cx.normalize_dims(dims, len(x.shape)), keepdim, compute), cx.dtype)


def _shifted_mean(cx: LoweringContext, x: Node, dims: tuple[int, ...], compute: DType) -> Node:
    """The mean over ``dims`` (kept) as ``s + mean(x - s)``, ``s`` the first element of each row."""
    if any(x.shape[d] == 0 for d in dims) or math.prod(x.shape[d] for d in dims) == 1:
        return _mean(cx, x, dims, True, compute)
    shift = x
    for d in dims:
        shift = _slice_dim(cx, shift, d, 0, 1, 1)
    shift = cx.lift(shift, compute, shift.shape)
    centered = cx.b.binary("sub", cx.lift(x, compute, x.shape), cx.broadcast_to(shift, x.shape))
    return cx.b.binary("add", _mean(cx, centered, dims, True, compute), shift)


@lowers("aten.var_mean.correction", "aten.var.correction")
def _var_mean(cx: LoweringContext, x: Node, dims: Any = None, *, correction: Any = None,
              keepdim: bool = False) -> Any:
    """Two-pass variance in the compute type: the mean, then the mean of squared deviations.

    The mean is taken of the data shifted by its first element (``s + mean(x - s)``): a row of
    equal values then has exactly its value as mean and a variance of 0, as eager's Welford
    reduction gives (an unshifted sum rounds, and layer_norm divides the rounding by sqrt(eps)),
    and a row whose mean is large against its spread loses less to cancellation."""
    dims = cx.normalize_dims(dims, len(x.shape))
    correction = 1 if correction is None else correction
    out_dtype = to_dtype((cx.meta_of(0) if isinstance(cx.meta, (tuple, list)) else cx.meta).dtype)
    compute = out_dtype.compute
    mean_kept = _shifted_mean(cx, x, dims, compute)
    deviation = cx.b.binary("sub", cx.lift(x, compute, x.shape), cx.broadcast_to(mean_kept, x.shape))
    squares = _reduce(cx, cx.b.binary("mul", deviation, deviation), dims, keepdim, "sum", compute)
    count = max(math.prod(x.shape[d] for d in dims) - correction, 0)
    var = cx.lift(cx.b.binary("div", squares, cx.lift(count, compute, squares.shape)), out_dtype, squares.shape)
    if "var_mean" not in cx.fx_node.target.__name__:
        return var
    mean = mean_kept if keepdim else cx.reshape(mean_kept, var.shape)
    return var, cx.lift(mean, out_dtype, mean.shape)


# ----------------------------------------------------------------------------------------------
# Shape ops: layout metadata in the IR, index arithmetic in kernels
# ----------------------------------------------------------------------------------------------


@lowers("aten.view.default", "aten._unsafe_view.default", "aten.reshape.default", "aten.view_copy.default",
        "aten.unsqueeze.default", "aten.squeeze.dim", "aten.squeeze.dims", "aten.squeeze.default",
        "aten.flatten.using_ints", "aten.unflatten.int")
def _reshape(cx: LoweringContext, x: Node, *args: Any) -> Node:
    return cx.reshape(x, cx.shape)


def _storage_of(fx_value: Any) -> str:
    """Whose storage an ``as_strided`` of ``fx_value`` reads: ``"input"`` where it is a graph input or
    a view of one (through ops whose result aliases their first operand), ``"view"`` where it is a
    view of a value the graph computes, ``"fresh"`` where it is a computed value itself."""
    import operator

    node, kind = fx_value, "fresh"
    while hasattr(node, "op"):
        if node.op == "placeholder":
            return "input"
        if node.op != "call_function" or not node.args:
            return kind
        if node.target is not operator.getitem and not _aliases_first_operand(node):
            return kind
        node, kind = node.args[0], "view"
    return kind


def _aliases_first_operand(node: Any) -> bool:
    """Whether an FX call's result views its first operand (the schema's return aliases it, and the
    op writes nothing in place)."""
    schema = getattr(node.target, "_schema", None)
    returns = str(schema).split("->")[-1] if schema is not None else ""
    return "(a" in returns and "!" not in returns


def _strided_run(cx: LoweringContext, size: Sequence[int], stride: Sequence[int], storage_offset: Any,
                 what: str) -> tuple[int, int] | None:
    """The run an ``as_strided`` view of the first operand covers in the operand's logical order,
    ``(start, count)``, where the operand is contiguous and the view is a contiguous run within it;
    None where a library call computes it (the operand's own elements, from its first). A storage
    offset is absolute in the operand's storage. AOTAutograd writes a view's omitted offset as the
    traced operand's own, so an offset equal to it is taken as relative to the operand; any other
    offset of a graph input (or of a view of one), whose storage offset varies between calls, and a
    view reading storage past the operand's own elements, are no function of the operand's values:
    ``StorageDependent``, and the graph runs in PyTorch (a library call would see neither: its operand
    is passed without its storage)."""
    source = cx.fx_node.args[0].meta.get("val")
    if source is None:
        raise StorageDependent(f"{cx.fx_node.name}: {what} of an operand with no traced layout; the graph runs in PyTorch")
    owner, traced = _storage_of(cx.fx_node.args[0]), source.storage_offset()
    offset = traced if storage_offset is None else int(storage_offset)
    if owner == "input" and offset != traced:
        raise StorageDependent(f"{cx.fx_node.name}: {what} of a graph input reads its storage at an absolute offset, "
                           "which differs between calls; the graph runs in PyTorch")
    start, count = offset - traced, math.prod(size)
    if not source.is_contiguous():
        if owner == "fresh" and traced == 0 and _dense(source.shape, source.stride()):
            return None  # the library call's operand is laid out in the traced strides: the same storage
        raise StorageDependent(f"{cx.fx_node.name}: {what} of a strided view reads its storage, not its values; "
                           "the graph runs in PyTorch")
    if 0 <= start <= start + count <= source.numel() \
            and all(n <= 1 or s == e for n, s, e in zip(size, stride, contiguous_strides(size))):
        return start, count
    last = start + sum((n - 1) * s for n, s in zip(size, stride) if n > 0)
    if traced == 0 and count and min(stride, default=0) >= 0 and 0 <= start and last < source.numel():
        return None  # within the operand's own elements, at the offset the library call passes
    if count == 0:
        return None
    raise StorageDependent(f"{cx.fx_node.name}: {what} reads storage beyond its operand's elements; "
                       "the graph runs in PyTorch")


def _dense(size: Sequence[int], stride: Sequence[int]) -> bool:
    """Whether strides lay ``size`` out without gaps or overlaps in some order of its dims (a
    permutation of contiguous strides; dims of one element do not count)."""
    expected = 1
    for step, n in sorted((int(s), int(n)) for n, s in zip(size, stride) if n != 1):
        if step != expected:
            return False
        expected *= n
    return True


def _storage_owner(fx_value: Any) -> Any:
    """The FX node whose value owns the storage ``fx_value`` views: the first node up the chain of
    ops whose result aliases their first operand that computes a value (an output of a multi-result
    op included); None where the chain reaches a graph input."""
    import operator

    node = fx_value
    while hasattr(node, "op"):
        if node.op == "placeholder":
            return None
        if node.op != "call_function" or not node.args or node.target is operator.getitem \
                or not _aliases_first_operand(node):
            return node
        node = node.args[0]
    return None


def _gathered_from_storage(cx: LoweringContext, size: tuple[int, ...], stride: Sequence[int],
                           storage_offset: Any) -> Node | None:
    """An ``as_strided`` whose operand views the storage of a value the graph computes (Longformer's
    overlapping chunks of its attention scores): the owner's elements in storage order (transposed
    by its strides: dense, from offset 0, its storage its own) and one gather at ``offset + Σ i·stride``.
    None where the owner is a graph input, its layout is not that, or the window leaves its
    elements."""
    import torch
    from torch.multiprocessing.reductions import StorageWeakRef

    operand = cx.fx_node.args[0]
    owner = _storage_owner(operand)
    value, base = operand.meta.get("val"), getattr(owner, "meta", {}).get("val")
    ir = cx.values.get(owner) if owner is not None else None
    if not isinstance(value, torch.Tensor) or not isinstance(base, torch.Tensor) or not isinstance(ir, Node):
        return None
    if (base.storage_offset() != 0 or not _dense(base.shape, base.stride()) or ir.shape != tuple(base.shape)
            or base.untyped_storage().nbytes() != base.numel() * base.element_size()
            or StorageWeakRef(value.untyped_storage()) != StorageWeakRef(base.untyped_storage())):
        return None
    offset = value.storage_offset() if storage_offset is None else int(storage_offset)
    stride = tuple(int(s) for s in stride)
    if not all(size) or min(stride, default=0) < 0 or offset < 0 \
            or offset + sum((n - 1) * s for n, s in zip(size, stride)) >= base.numel():
        return None
    order = sorted(range(len(ir.shape)), key=lambda d: -int(base.stride()[d]))  # storage order, outermost first
    elements = cx.reshape(cx.b.transpose(ir, order) if order != sorted(order) else ir, (base.numel(),))
    index = cx.lift(offset, DType.I64, size)
    for d, s in enumerate(stride):
        if size[d] > 1 and s:
            index = cx.b.binary("add", index, cx.b.binary("mul", cx.b.iota(size, d, DType.I64),
                                                          cx.lift(s, DType.I64, size)))
    return cx.node("gather", elements, index, axis=0, batch_dims=0)


@lowers("aten.as_strided.default")
def _as_strided(cx: LoweringContext, x: Node, size: Sequence[int], stride: Sequence[int],
                storage_offset: int | None = None) -> Node:
    """An ``as_strided`` that reads a contiguous run of contiguous data (``_strided_run``): the source
    flattened, sliced from the view's first element, reshaped to the view (torch's GroupNorm
    decomposition reshapes its statistics this way; the gradient of ``as_strided_scatter`` takes the
    scattered run). Any other of a computed value is a library call."""
    size = tuple(int(n) for n in size)
    try:
        run = _strided_run(cx, size, stride, storage_offset, "as_strided")
    except StorageDependent:
        gathered = _gathered_from_storage(cx, size, stride, storage_offset)
        if gathered is None:
            raise
        return gathered
    if run is None:
        gathered = _gathered_from_storage(cx, size, stride, storage_offset)
        if gathered is None:
            raise Unsupported("as_strided other than a contiguous run of contiguous data or a window "
                              "of a computed value's storage")
        return gathered
    start, count = run
    if (start, count) == (0, x.size):
        return cx.reshape(x, size)
    return cx.reshape(_slice_dim(cx, cx.reshape(x, (x.size,)), 0, start, start + count, 1), size)


@lowers("aten.permute.default", "aten.permute_copy.default")
def _permute(cx: LoweringContext, x: Node, dims: Sequence[int]) -> Node:
    return cx.b.transpose(x, [cx.normalize_dim(d, len(x.shape)) for d in dims])


@lowers("aten.transpose.int", "aten.t.default")
def _transpose(cx: LoweringContext, x: Node, dim0: int = 0, dim1: int = 1) -> Node:
    perm = list(range(len(x.shape)))
    if len(perm) < 2:
        return x
    a, b = cx.normalize_dim(dim0, len(perm)), cx.normalize_dim(dim1, len(perm))
    perm[a], perm[b] = perm[b], perm[a]
    return cx.b.transpose(x, perm)


@lowers("aten.expand.default", "aten.expand_copy.default")
def _expand(cx: LoweringContext, x: Node, size: Sequence[int], implicit: bool = False) -> Node:
    return cx.broadcast_to(x, cx.shape)


def _slice_dim(cx: LoweringContext, x: Node, dim: int, start: int, stop: int, step: int) -> Node:
    start_, limit, stride = [0] * len(x.shape), list(x.shape), [1] * len(x.shape)
    start_[dim], limit[dim], stride[dim] = start, stop, step
    if (start, stop, step) == (0, x.shape[dim], 1):
        return x
    return cx.node("slice", x, start=tuple(start_), limit=tuple(limit), stride=tuple(stride))


@lowers("aten.slice.Tensor", "aten.slice_copy.Tensor")
def _slice(cx: LoweringContext, x: Node, dim: int = 0, start: Any = None, end: Any = None, step: int = 1) -> Node:
    dim = cx.normalize_dim(dim, len(x.shape))
    r = range(x.shape[dim])[slice(start, end, step)]
    stop = r.start + (len(r) - 1) * step + 1 if len(r) else r.start
    return _slice_dim(cx, x, dim, r.start if len(r) else 0, stop if len(r) else 0, step)


@lowers("aten.select.int", "aten.select_copy.int")
def _select(cx: LoweringContext, x: Node, dim: int, index: int) -> Node:
    dim = cx.normalize_dim(dim, len(x.shape))
    index = index % x.shape[dim]
    return cx.reshape(_slice_dim(cx, x, dim, index, index + 1, 1), cx.shape)


def _scatter_into(cx: LoweringContext, x: Node, src: Node, dim: int, start: int, count: int, step: int) -> Node:
    """``x`` with positions ``start, start + step, ...`` (``count`` of them) along ``dim`` taken
    from ``src``: ``src`` padded to ``x``'s shape (``step - 1`` zeros between its elements), then
    ``select(position hit, padded, x)``. Every output element is one read of either operand, so it
    fuses like any elementwise op (the backward of slicing: rotary embedding's halves)."""
    x = cx.lift(x, cx.dtype, x.shape)
    if count == 0:
        return x
    src = cx.lift(src, cx.dtype, src.shape)
    size, last = x.shape[dim], start + (count - 1) * step
    if (start, count, step) == (0, size, 1):
        return src
    low, high, interior = [0] * len(x.shape), [0] * len(x.shape), [0] * len(x.shape)
    low[dim], high[dim], interior[dim] = start, size - 1 - last, step - 1
    padded = cx.node("pad", src, low=tuple(low), high=tuple(high), interior=tuple(interior), value=0.0)
    position = cx.b.iota(x.shape, dim, DType.I64)
    hit = cx.b.binary("and", cx.b.compare("GE", position, cx.constant(start, DType.I64, x.shape)),
                      cx.b.compare("LE", position, cx.constant(last, DType.I64, x.shape)))
    if step > 1:
        offset = cx.b.binary("sub", position, cx.constant(start, DType.I64, x.shape))
        on_step = cx.b.compare("EQ", cx.b.binary("rem", offset, cx.constant(step, DType.I64, x.shape)),
                               cx.constant(0, DType.I64, x.shape))
        hit = cx.b.binary("and", hit, on_step)
    return cx.b.select(hit, padded, x)


@lowers("aten.slice_scatter.default")
def _slice_scatter(cx: LoweringContext, x: Node, src: Node, dim: int = 0, start: Any = None, end: Any = None,
                   step: int = 1) -> Node:
    dim = cx.normalize_dim(dim, len(x.shape))
    r = range(x.shape[dim])[slice(start, end, step)]
    expected = tuple(len(r) if d == dim else s for d, s in enumerate(x.shape))
    if tuple(src.shape) != expected:
        raise Unsupported(f"slice_scatter of a {list(src.shape)} source into a {list(expected)} slice")
    return _scatter_into(cx, x, src, dim, r.start if len(r) else 0, len(r), step)


@lowers("aten.select_scatter.default")
def _select_scatter(cx: LoweringContext, x: Node, src: Node, dim: int, index: int) -> Node:
    dim = cx.normalize_dim(dim, len(x.shape))
    if not -x.shape[dim] <= index < x.shape[dim]:
        raise Unsupported(f"select_scatter index {index} out of range for dim {dim} of size {x.shape[dim]}")
    shape = tuple(1 if d == dim else s for d, s in enumerate(x.shape))
    return _scatter_into(cx, x, cx.reshape(cx.lift(src, cx.dtype, src.shape), shape), dim,
                         index % x.shape[dim], 1, 1)


@lowers("aten.as_strided_scatter.default")
def _as_strided_scatter(cx: LoweringContext, x: Node, src: Node, size: Sequence[int], stride: Sequence[int],
                        storage_offset: int | None = None) -> Node:
    """A scatter into a contiguous run of a contiguous input (``_strided_run``; the gradient of an
    ``as_strided`` that reshapes, or reads a flat range, as a pooled ``transpose(1, 2)`` gives): the
    input flattened, the run taken from the source flattened (``_scatter_into``), reshaped back. The
    functional op writes into a clone of the input, whose storage is the input's logical order when
    it is contiguous. Any other of a computed value stays a library call."""
    size = tuple(int(n) for n in size)
    run = _strided_run(cx, size, stride, storage_offset, "as_strided_scatter")
    if run is None or tuple(src.shape) != size:
        raise Unsupported("as_strided_scatter other than into a contiguous run of contiguous data")
    start, count = run
    flat = cx.reshape(cx.lift(x, cx.dtype, x.shape), (x.size,))
    piece = cx.reshape(cx.lift(src, cx.dtype, src.shape), (count,))
    return cx.reshape(_scatter_into(cx, flat, piece, 0, start, count, 1), x.shape)


def _diagonal_run(x: Node, offset: int, dim1: int, dim2: int) -> tuple[tuple[int, ...], int, int, int]:
    """Where ``diagonal(x, offset, dim1, dim2)`` lies once ``dim1`` and ``dim2`` are moved last (in
    that order) and flattened into one dim of a · b elements: the permutation, and the run's first
    element, count and step (b + 1)."""
    rank = len(x.shape)
    a, b = x.shape[dim1], x.shape[dim2]
    permutation = (*(d for d in range(rank) if d not in (dim1, dim2)), dim1, dim2)
    count = max(0, min(a, b - offset) if offset >= 0 else min(a + offset, b))
    start = offset if offset >= 0 else -offset * b
    return permutation, (start if count else 0), count, b + 1


@lowers("aten.diagonal.default", "aten.diagonal_copy.default")
def _diagonal(cx: LoweringContext, x: Node, offset: int = 0, dim1: int = 0, dim2: int = 1) -> Node:
    """The diagonal as a strided slice: ``dim1`` and ``dim2`` moved last and flattened, every
    (b + 1)-th element from the offset's first one; the diagonal is the result's last dim, as in torch."""
    dim1, dim2 = cx.normalize_dim(dim1, len(x.shape)), cx.normalize_dim(dim2, len(x.shape))
    if dim1 == dim2:
        raise Unsupported("diagonal of one dim with itself")
    permutation, start, count, step = _diagonal_run(x, offset, dim1, dim2)
    moved = cx.b.transpose(x, permutation)
    outer = moved.shape[:-2]
    flat = cx.reshape(moved, (*outer, moved.shape[-2] * moved.shape[-1]))
    stop = start + (count - 1) * step + 1 if count else 0
    return cx.reshape(_slice_dim(cx, flat, len(outer), start, stop, step), cx.shape)


@lowers("aten.diagonal_scatter.default")
def _diagonal_scatter(cx: LoweringContext, x: Node, src: Node, offset: int = 0, dim1: int = 0,
                      dim2: int = 1) -> Node:
    """``x`` with its diagonal taken from ``src`` (the gradient of ``diagonal``): the same flattened
    run as ``_diagonal``, written by ``_scatter_into``, and the dims moved back."""
    dim1, dim2 = cx.normalize_dim(dim1, len(x.shape)), cx.normalize_dim(dim2, len(x.shape))
    if dim1 == dim2:
        raise Unsupported("diagonal_scatter of one dim with itself")
    permutation, start, count, step = _diagonal_run(x, offset, dim1, dim2)
    moved = cx.b.transpose(cx.lift(x, cx.dtype, x.shape), permutation)
    outer = moved.shape[:-2]
    if tuple(src.shape) != (*outer, count):
        raise Unsupported(f"diagonal_scatter of a {list(src.shape)} source into a {[*outer, count]} diagonal")
    flat = cx.reshape(moved, (*outer, moved.shape[-2] * moved.shape[-1]))
    written = cx.reshape(_scatter_into(cx, flat, src, len(outer), start, count, step), moved.shape)
    return cx.b.transpose(written, tuple(permutation.index(d) for d in range(len(x.shape))))


@lowers("aten.split_with_sizes.default", "aten.split.Tensor", "aten.unbind.int")
def _split(cx: LoweringContext, x: Node, sizes: Any = None, dim: int = 0) -> tuple[Node, ...]:
    name = cx.fx_node.target.__name__
    if name.startswith("unbind"):
        dim = cx.normalize_dim(sizes or 0, len(x.shape))
        return tuple(cx.reshape(_slice_dim(cx, x, dim, i, i + 1, 1), cx.meta_of(i).shape)
                     for i in range(x.shape[dim]))
    dim = cx.normalize_dim(dim, len(x.shape))
    parts, start = [], 0
    for i in range(len(cx.meta)):
        size = int(cx.meta_of(i).shape[dim])
        parts.append(_slice_dim(cx, x, dim, start, start + size, 1))
        start += size
    return tuple(parts)


@lowers("aten.cat.default")
def _cat(cx: LoweringContext, tensors: Sequence[Node], dim: int = 0) -> Node:
    tensors = [t for t in tensors if not (t.shape == (0,) and len(cx.shape) != 1)]  # torch's legacy empties
    dim = cx.normalize_dim(dim, len(cx.shape))
    parts = [cx.lift(t, cx.dtype, t.shape) for t in tensors if t.shape[dim] > 0]
    if not parts:  # every piece is empty along dim: so is the result
        return cx.b.constant(0, cx.dtype, cx.shape)
    if len(parts) == 1:
        return parts[0]
    return cx.b.node("concatenate", parts, dimension=dim)


@lowers("aten.constant_pad_nd.default")
def _pad(cx: LoweringContext, x: Node, pad: Sequence[int], value: Any = 0) -> Node:
    low, high = [0] * len(x.shape), [0] * len(x.shape)
    for i in range(len(pad) // 2):
        low[len(x.shape) - 1 - i], high[len(x.shape) - 1 - i] = pad[2 * i], pad[2 * i + 1]
    return cx.node("pad", x, low=tuple(low), high=tuple(high), interior=(0,) * len(x.shape), value=float(value))


def _pair(v: Any, default: Sequence[int]) -> tuple[int, int]:
    """A pooling argument (an int, or one or two ints; empty: ``default``) as (height, width)."""
    v = tuple(v) if isinstance(v, (list, tuple)) else (v,)
    v = v or tuple(default)
    return (int(v[0]), int(v[-1]))


@lowers("aten.max_pool2d_with_indices.default")
def _max_pool2d(cx: LoweringContext, x: Node, kernel_size: Sequence[int], stride: Sequence[int] = (),
                padding: Any = 0, dilation: Any = 1, ceil_mode: bool = False) -> tuple[Node, Node]:
    """Max pooling as the max of the k × k strided slices of the input padded with -inf, so that it
    fuses with the ops around it (ResNet's stem). The indices (each window's maximum as ``h · W + w``
    in its input plane) are computed only where something reads them (the backward of training),
    window by window in torch's order: a window's first valid position, then each later one that is
    greater or NaN (so the first maximum, or the last NaN). The backward is ``_max_pool2d_backward``."""
    import operator

    if not x.dtype.is_float or len(x.shape) not in (3, 4):
        raise Unsupported(f"max pooling of a {x.dtype.value} tensor of rank {len(x.shape)}")

    (kh, kw), (ph, pw), (dh, dw) = _pair(kernel_size, ()), _pair(padding, (0,)), _pair(dilation, (1,))
    sh, sw = _pair(stride, (kh, kw))
    values_shape = tuple(int(d) for d in cx.meta_of(0).shape)
    ho, wo = values_shape[-2:]
    rank, (h, w) = len(x.shape), x.shape[-2:]
    high_h = max(0, (ho - 1) * sh + (kh - 1) * dh + 1 - h - ph)
    high_w = max(0, (wo - 1) * sw + (kw - 1) * dw + 1 - w - pw)
    lead = (0,) * (rank - 2)
    padded = cx.node("pad", x, low=lead + (ph, pw), high=lead + (high_h, high_w), interior=(0,) * rank,
                     value=float("-inf"))
    windows = []
    for i in range(kh):
        for j in range(kw):
            start = lead + (i * dh, j * dw)
            limit = tuple(x.shape[:-2]) + (i * dh + (ho - 1) * sh + 1, j * dw + (wo - 1) * sw + 1)
            window = cx.node("slice", padded, start=start, limit=limit, stride=(1,) * (rank - 2) + (sh, sw))
            windows.append((i, j, window))
    result = windows[0][2]
    for _, _, window in windows[1:]:
        result = cx.b.binary("max", result, window)
    if not any(u.target is operator.getitem and u.args[1] == 1 and u.users for u in cx.fx_node.users):
        return result, cx.constant(0, DType.I64, values_shape)  # the indices: nothing reads them

    kind = _position_dtype((h + ph + high_h + 1) * (w + pw + high_w + 1))  # bounds |row · W + col|

    def position(dim: int, step: int, offset: int) -> Node:  # the input row (column) of each output
        iota = cx.b.iota(values_shape, dim, kind)
        return cx.b.binary("add", cx.b.binary("mul", iota, cx.lift(step, kind, values_shape)),
                           cx.lift(offset, kind, values_shape))

    def inside(at: Node, size: int) -> Node:
        return cx.b.binary("and", cx.b.compare("GE", at, cx.lift(0, kind, values_shape)),
                           cx.b.compare("LT", at, cx.lift(size, kind, values_shape)))

    best, index, seen = None, cx.constant(0, kind, values_shape), None
    for i, j, window in windows:
        row, col = position(rank - 2, sh, i * dh - ph), position(rank - 1, sw, j * dw - pw)
        valid = cx.b.binary("and", inside(row, h), inside(col, w))
        at = cx.b.binary("add", cx.b.binary("mul", row, cx.lift(w, kind, values_shape)), col)
        if best is None:
            take = valid
        else:
            better = cx.b.binary("or", cx.b.compare("GT", window, best), cx.b.compare("NE", window, window))
            take = cx.b.binary("and", valid, cx.b.binary("or", cx.b.unary("not", seen), better))
        best = window if best is None else cx.b.select(take, window, best)
        index = cx.b.select(take, at, index)
        seen = valid if seen is None else cx.b.binary("or", seen, valid)
    return result, cx.b.convert(index, DType.I64)


def _position_dtype(bound: int) -> DType:
    """The integer type of max pooling's positions ``h · W + w`` inside the pooling lowerings, whose
    arithmetic stays below ``bound`` in magnitude: i32 where that fits (the indices a backward in
    the same graph recomputes are then written and read at half the bytes), i64 otherwise; torch's
    indices are i64, converted from these where they leave the lowering."""
    return DType.I32 if bound < 2 ** 31 else DType.I64


@lowers("aten.max_pool2d_with_indices_backward.default")
def _max_pool2d_backward(cx: LoweringContext, grad: Node, x: Node, kernel_size: Sequence[int],
                         stride: Sequence[int] = (), padding: Any = 0, dilation: Any = 1, ceil_mode: bool = False,
                         indices: Node | None = None) -> Node:
    """The gradient of max pooling: each input position sums the output gradients whose window's
    maximum it was (``indices == h · W + w``). Split by the input position's remainder modulo the
    stride, a class of positions is covered by a fixed set of window taps at fixed output offsets
    (3 × 3 windows of stride 2: 1, 2, 2 and 4 taps for the four classes, 2.25 on average, not 9),
    so each class is an elementwise sum over slices of the output gradient and indices padded at
    the edges (indices with -1, which matches no position), and the classes are interleaved into the
    input grid by interior padding. ``ceil_mode`` only sets the outputs' extent, which the gradient
    has."""
    if indices is None or len(x.shape) not in (3, 4) or not grad.dtype.is_float:
        raise Unsupported("max pooling backward without indices or of rank other than 3 or 4")

    (kh, kw), (ph, pw), (dh, dw) = _pair(kernel_size, ()), _pair(padding, (0,)), _pair(dilation, (1,))
    sh, sw = _pair(stride, (kh, kw))
    rank, (h, w), (ho, wo) = len(x.shape), x.shape[-2:], grad.shape[-2:]
    lead = tuple(x.shape[:-2])
    kind = DType.I64
    source = indices.operands[0] if indices.op == "convert" else None
    if source is not None and source.dtype == DType.I32 and _position_dtype((h + 1) * (w + 1)) == DType.I32:
        indices, kind = source, DType.I32  # computed by ``_max_pool2d`` in this graph
    wide = DType.F32 if grad.dtype in (DType.F16, DType.BF16) else grad.dtype  # torch accumulates in float

    def taps(remainder: int, step: int, pad: int, dil: int, k: int) -> list[int]:
        """The output offsets ``t`` of the taps covering input positions ``step · q + remainder``:
        the window of output ``q + t`` covers it at tap ``j`` where ``step · t = remainder + pad - j · dil``."""
        return [(remainder + pad - j * dil) // step for j in range(k) if (remainder + pad - j * dil) % step == 0]

    def count(remainder: int, step: int, size: int) -> int:  # input positions of the class
        return max(0, -(-(size - remainder) // step))

    result = None
    for a in range(min(sh, h)):
        for b in range(min(sw, w)):
            rows, cols = count(a, sh, h), count(b, sw, w)
            shape = lead + (rows, cols)
            row_taps, col_taps = taps(a, sh, ph, dh, kh), taps(b, sw, pw, dw, kw)
            total = None
            if row_taps and col_taps:
                low = (max(0, -min(row_taps)), max(0, -min(col_taps)))
                high = (max(0, max(row_taps) + rows - ho), max(0, max(col_taps) + cols - wo))
                pads = {"low": (0,) * len(lead) + low, "high": (0,) * len(lead) + high, "interior": (0,) * rank}
                g = cx.node("pad", cx.b.convert(grad, wide), value=0.0, **pads)
                at = cx.node("pad", indices, value=-1.0, **pads)
                row = cx.b.binary("add", cx.b.binary("mul", cx.b.iota(shape, rank - 2, kind),
                                                     cx.lift(sh, kind, shape)), cx.lift(a, kind, shape))
                col = cx.b.binary("add", cx.b.binary("mul", cx.b.iota(shape, rank - 1, kind),
                                                     cx.lift(sw, kind, shape)), cx.lift(b, kind, shape))
                target = cx.b.binary("add", cx.b.binary("mul", row, cx.lift(w, kind, shape)), col)
                zero = cx.constant(0, wide, shape)
                for t in row_taps:
                    for u in col_taps:
                        start = (0,) * len(lead) + (t + low[0], u + low[1])
                        limit = lead + (t + low[0] + rows, u + low[1] + cols)
                        window = {"start": start, "limit": limit, "stride": (1,) * rank}
                        hit = cx.b.compare("EQ", cx.node("slice", at, **window), target)
                        term = cx.b.select(hit, cx.node("slice", g, **window), zero)
                        total = term if total is None else cx.b.binary("add", total, term)
            if total is None:  # a class no window covers (a stride longer than the window)
                continue
            spread = cx.node("pad", total, value=0.0, low=(0,) * len(lead) + (a, b),
                             high=(0,) * len(lead) + (h - a - (rows - 1) * sh - 1, w - b - (cols - 1) * sw - 1),
                             interior=(0,) * len(lead) + (sh - 1, sw - 1))
            result = spread if result is None else cx.b.binary("add", result, spread)
    if result is None:
        return cx.constant(0, grad.dtype, x.shape)
    return cx.b.convert(result, grad.dtype)


# ----------------------------------------------------------------------------------------------
# Indexing
# ----------------------------------------------------------------------------------------------


def _checked(cx: LoweringContext, index: Node, size: int) -> Node:
    """``index`` (as i64) through a gather of the positions ``0..size-1``: the same values, with the
    range check every gather has (an error naming the op where eager raises one), for indices that
    a lowering only compares with positions (a one-hot row, a scatter's ``iota == index``) and that
    would otherwise match nothing and be dropped silently."""
    positions = cx.b.iota((size,), 0, DType.I64)
    return cx.node("gather", positions, index, axis=0, batch_dims=0)


def _wrap_negative(cx: LoweringContext, index: Node, size: int) -> Node:
    """torch indexing accepts -size <= i < 0; map those to i + size."""
    zero, n = cx.lift(0, index.dtype, index.shape), cx.lift(size, index.dtype, index.shape)
    return cx.b.select(cx.b.compare("LT", index, zero), cx.b.binary("add", index, n), index)


@lowers("aten.flip.default")
def _flip(cx: LoweringContext, x: Node, dims: Sequence[int]) -> Node:
    """Each dim of ``dims`` reversed: a gather of the positions ``n - 1 - i`` along it (in bounds by
    construction), which reads like any index arithmetic and fuses."""
    if not x.shape:
        return x
    for d in sorted({cx.normalize_dim(d, len(x.shape)) for d in dims}):
        n = x.shape[d]
        if n > 1:
            positions = cx.b.binary("sub", cx.lift(n - 1, DType.I64, (n,)), cx.b.iota((n,), 0, DType.I64))
            x = cx.node("gather", x, positions, axis=d, batch_dims=0)
    return x


@lowers("aten.index_select.default")
def _index_select(cx: LoweringContext, x: Node, dim: int, index: Node) -> Node:
    """A gather along ``dim``. torch takes a 0-d tensor as one element and a 0-d index as one index
    (of a 0-d tensor, the result is 0-d): both are gathered as shape [1], the bounds check kept."""
    dim = cx.normalize_dim(dim, len(x.shape))
    if x.shape and len(index.shape) == 1:
        return cx.node("gather", x, index, axis=dim, batch_dims=0)
    rows = cx.reshape(x, x.shape or (1,))
    gathered = cx.node("gather", rows, cx.reshape(index, (math.prod(index.shape),)), axis=dim, batch_dims=0)
    return cx.reshape(gathered, cx.shape)


@lowers("aten.index.Tensor")
def _index(cx: LoweringContext, x: Node, indices: Sequence[Node | None]) -> Node:
    """Advanced indexing by adjacent integer index tensors: one gather on the merged dims."""
    positions = [i for i, t in enumerate(indices) if t is not None]
    if not positions or positions != list(range(positions[0], positions[-1] + 1)):
        raise Unsupported("index tensors that are not adjacent")
    if any(indices[i].dtype not in (DType.I32, DType.I64) for i in positions):
        raise Unsupported("boolean-mask indexing (data-dependent shape)")
    first, last = positions[0], positions[-1]
    index_shape = _broadcast_shapes([indices[i].shape for i in positions])
    linear, inside = None, None
    for i in positions:
        idx = cx.broadcast_to(cx.lift(indices[i], DType.I64, indices[i].shape), index_shape)
        idx = _wrap_negative(cx, idx, x.shape[i])
        if len(positions) > 1:  # one index out of range must not land in range once merged
            ok = cx.b.binary("and", cx.b.compare("GE", idx, cx.lift(0, DType.I64, index_shape)),
                             cx.b.compare("LT", idx, cx.lift(x.shape[i], DType.I64, index_shape)))
            inside = ok if inside is None else cx.b.binary("and", inside, ok)
        linear = idx if linear is None else cx.b.binary(
            "add", cx.b.binary("mul", linear, cx.lift(x.shape[i], DType.I64, index_shape)), idx)
    if inside is not None:  # the gather's own check then stops the call
        linear = cx.b.select(inside, linear, cx.lift(-1, DType.I64, index_shape))
    merged = x.shape[:first] + (math.prod(x.shape[first : last + 1]),) + x.shape[last + 1 :]
    return cx.reshape(cx.node("gather", cx.reshape(x, merged), linear, axis=first, batch_dims=0), cx.shape)


def _broadcast_shapes(shapes: Sequence[tuple[int, ...]]) -> tuple[int, ...]:
    rank = max(len(s) for s in shapes)
    out = [1] * rank
    for s in shapes:
        for i, size in enumerate(s):
            j = rank - len(s) + i
            out[j] = size if out[j] == 1 else out[j]
    return tuple(out)


def _move_dim_last(cx: LoweringContext, x: Node, dim: int) -> Node:
    perm = [d for d in range(len(x.shape)) if d != dim] + [dim]
    return cx.b.transpose(x, perm)


def _move_last_to(cx: LoweringContext, x: Node, dim: int) -> Node:
    rank = len(x.shape)
    perm = list(range(rank - 1))
    perm.insert(dim, rank - 1)
    return cx.b.transpose(x, perm)


@lowers("aten.gather.default")
def _gather(cx: LoweringContext, x: Node, dim: int, index: Node, sparse_grad: bool = False) -> Node:
    """torch.gather: ``out[i][j] = x[i][index[i][j]]`` along ``dim``, as a batched IR gather."""
    rank = len(x.shape)
    if rank == 0:
        return x
    dim = cx.normalize_dim(dim, rank)
    # torch allows an index smaller than x in the other dims: read only that corner of x.
    corner = tuple(index.shape[d] if d != dim else x.shape[d] for d in range(rank))
    if corner != x.shape:
        x = cx.node("slice", x, start=(0,) * rank, limit=corner, stride=(1,) * rank)
    gathered = cx.node("gather", _move_dim_last(cx, x, dim), _move_dim_last(cx, index, dim),
                       axis=rank - 1, batch_dims=rank - 1)
    return _move_last_to(cx, gathered, dim)


@lowers("aten.scatter.value", "aten.scatter.src")
def _scatter(cx: LoweringContext, x: Node, dim: int, index: Node, src: Any) -> Node:
    """Scatter with one index per row along ``dim``: ``select(iota == index, src, x)``. A 0-d
    ``x`` (torch takes it as one element, with a 0-d index and source) is scattered as shape [1]."""
    if not x.shape:
        row = _scatter(cx, cx.reshape(x, (1,)), 0, cx.reshape(index, (1,)),
                       cx.reshape(src, (1,)) if isinstance(src, Node) else src)
        return cx.reshape(row, ())
    dim = cx.normalize_dim(dim, len(x.shape))
    expected = tuple(1 if d == dim else s for d, s in enumerate(x.shape))
    if index.shape != expected:
        raise Unsupported(f"scatter with index shape {list(index.shape)}; only {list(expected)} is lowered")
    if isinstance(src, Node) and src.shape != expected:
        src = cx.node("slice", src, start=(0,) * len(src.shape), limit=expected, stride=(1,) * len(src.shape))
    index = _checked(cx, index, x.shape[dim])
    hit = cx.b.compare("EQ", cx.b.iota(x.shape, dim, DType.I64), cx.lift(index, DType.I64, x.shape))
    return cx.b.select(hit, cx.lift(src, cx.dtype, x.shape), cx.lift(x, cx.dtype, x.shape))


ONE_HOT_MAX_ROWS = 4096
# A float one-hot product reads its values in three column blocks (finite values, +inf/NaN and
# -inf/NaN counts, ``_one_hot_sum``), written and read once each; a masked sum per target row reads
# them once per row. Up to this many rows the masked sum moves fewer bytes (token-type embeddings).
MASKED_SUM_MAX_ROWS = 2 * 3


@lowers("aten.index_put.default")
def _index_put(cx: LoweringContext, x: Node, indices: Sequence[Node | None], values: Node,
               accumulate: bool = False) -> Node:
    """Accumulating put along one dim ``d`` (an embedding gradient on dim 0; the gradient of a table
    indexed on a later dim, ``bias[:, idx]``): ``x + onehot(index)^T @ values`` with ``d`` moved to
    the front, for up to ``ONE_HOT_MAX_ROWS`` rows. A longer one-hot row would make the GEMM do
    ``rows`` times the work of the scatter-add (orders of magnitude more on a vocabulary-sized
    table), so that case stays torch's op (a library call), as do several index tensors."""
    given = [k for k, index in enumerate(indices) if index is not None]
    if not accumulate or len(given) != 1 or indices[given[0]].dtype == DType.BOOL:
        raise Unsupported("index_put other than accumulate=True with one integer index")
    d, index = given[0], indices[given[0]]
    rows = x.shape[d]
    if rows > ONE_HOT_MAX_ROWS:
        raise Unsupported(f"index_put into {rows} rows: a scatter-add, not a one-hot GEMM over more than "
                          f"{ONE_HOT_MAX_ROWS} rows")
    if d == 0:
        return _put_rows(cx, x, index, cx.lift(values, cx.dtype, index.shape + x.shape[1:]))
    # A single advanced index keeps its place: ``values`` is [x's dims before d, index dims, the rest].
    rank, k = len(x.shape), len(index.shape)
    front = (d, *range(d), *range(d + 1, rank))
    spread = cx.lift(values, cx.dtype, x.shape[:d] + index.shape + x.shape[d + 1:])
    moved = cx.b.transpose(spread, (*range(d, d + k), *range(d), *range(d + k, rank + k - 1)))
    put = _put_rows(cx, cx.b.transpose(x, front), index, moved)
    return cx.b.transpose(put, tuple(front.index(i) for i in range(rank)))


def _put_rows(cx: LoweringContext, x: Node, index: Node, values: Node) -> Node:
    """``x`` plus, in each row ``r`` of dim 0, the sum of the rows of ``values`` (shaped ``index.shape
    + x.shape[1:]``) whose index is ``r``; indices checked against the rows, negative ones wrapped."""
    rows, rest = x.shape[0], x.shape[1:]
    n = math.prod(index.shape)
    flat_index = _checked(cx, _wrap_negative(cx, cx.reshape(cx.lift(index, DType.I64, index.shape), (n,)), rows), rows)
    flat_values = cx.reshape(values, (n, math.prod(rest)))
    if cx.dtype.is_float and rows <= MASKED_SUM_MAX_ROWS:
        summed = _masked_sum(cx, flat_index, flat_values, rows)
    else:
        hit = cx.b.compare("EQ", cx.b.broadcast(flat_index, (n, rows), (0,)), cx.b.iota((n, rows), 1, DType.I64))
        onehot = cx.b.convert(hit, cx.dtype)
        summed = (_one_hot_sum(cx, onehot, flat_values) if cx.dtype.is_float
                  else _one_hot_product(cx, onehot, flat_values))
    return cx.b.binary("add", cx.lift(x, cx.dtype, x.shape), cx.reshape(summed, x.shape))


def _masked_sum(cx: LoweringContext, index: Node, values: Node, rows: int) -> Node:
    """Per target row, the sum of the value rows whose index names it: a value row the index does not
    name is left out (selected away, not multiplied by 0), so non-finite values stay in their rows."""
    n, width = values.shape
    hit = cx.b.compare("EQ", cx.b.broadcast(index, (rows, n), (1,)), cx.b.iota((rows, n), 0, DType.I64))
    picked = cx.b.select(cx.b.broadcast(hit, (rows, n, width), (0, 1)),
                         cx.b.broadcast(values, (rows, n, width), (1, 2)), cx.lift(0, values.dtype, (rows, n, width)))
    return cx.b.reduce(picked, (1,), "sum")


def _one_hot_product(cx: LoweringContext, onehot: Node, values: Node) -> Node:
    return cx.node("dot_general", onehot, values, lhs_batch=(), rhs_batch=(), lhs_contract=(0,), rhs_contract=(0,))


def _one_hot_sum(cx: LoweringContext, onehot: Node, values: Node) -> Node:
    """``onehot^T @ values`` with eager's scatter-add semantics for non-finite values.

    In a plain product a NaN or an infinity of one value row meets the zeros of every other target
    row (0 * inf is NaN) and spreads to all of them, where eager touches only the rows it indexes.
    So the finite values are summed by the product, and two more column blocks of the same product
    count, per target cell, the values that are +inf or NaN and those that are -inf or NaN: a cell
    with both is NaN, with one of them that infinity, with neither the finite sum."""
    width = values.shape[1]
    nan = cx.b.compare("NE", values, values)
    up = cx.b.binary("or", nan, cx.b.compare("EQ", values, cx.lift(math.inf, values.dtype, values.shape)))
    down = cx.b.binary("or", nan, cx.b.compare("EQ", values, cx.lift(-math.inf, values.dtype, values.shape)))
    finite = cx.b.select(cx.b.binary("or", up, down), cx.lift(0, values.dtype, values.shape), values)
    blocks = cx.b.node("concatenate", [finite, cx.b.convert(up, values.dtype), cx.b.convert(down, values.dtype)],
                       dimension=1)
    product = _one_hot_product(cx, onehot, blocks)
    rows = product.shape[0]

    def block(k: int) -> Node:
        return cx.node("slice", product, start=(0, k * width), limit=(rows, (k + 1) * width), stride=(1, 1))

    zero = cx.lift(0, values.dtype, (rows, width))
    ups, downs = cx.b.compare("GT", block(1), zero), cx.b.compare("GT", block(2), zero)

    def constant(value: float) -> Node:
        return cx.lift(value, values.dtype, (rows, width))

    infinite = cx.b.select(ups, constant(math.inf), constant(-math.inf))
    return cx.b.select(cx.b.binary("and", ups, downs), constant(math.nan),
                       cx.b.select(cx.b.binary("or", ups, downs), infinite, block(0)))


# ----------------------------------------------------------------------------------------------
# Matrix products
# ----------------------------------------------------------------------------------------------


@lowers("aten.mm.default")
def _mm(cx: LoweringContext, a: Node, b: Node) -> Node:
    a, b = cx.lift(a, cx.dtype, a.shape), cx.lift(b, cx.dtype, b.shape)
    return cx.node("dot_general", a, b, lhs_batch=(), rhs_batch=(), lhs_contract=(1,), rhs_contract=(0,))


@lowers("aten.addmm.default")
def _addmm(cx: LoweringContext, bias: Any, a: Node, b: Node, beta: Any = 1, alpha: Any = 1) -> Node:
    """``beta * bias + alpha * (a @ b)`` with the product in the operands' dtype (torch's own
    decomposition computes a bf16 ``addmm`` in f32, which would make cuBLAS run an f32 GEMM
    without tensor cores under autocast: 6x the time of BERT's GEMMs)."""
    a, b = cx.lift(a, cx.dtype, a.shape), cx.lift(b, cx.dtype, b.shape)
    product = cx.node("dot_general", a, b, lhs_batch=(), rhs_batch=(), lhs_contract=(1,), rhs_contract=(0,))
    if alpha != 1:
        product = cx.elementwise("mul", product, alpha)
    if beta == 0:
        return product
    if beta != 1:
        bias = cx.elementwise("mul", bias, beta)
    return cx.elementwise("add", product, bias)


@lowers("aten.bmm.default")
def _bmm(cx: LoweringContext, a: Node, b: Node) -> Node:
    a, b = cx.lift(a, cx.dtype, a.shape), cx.lift(b, cx.dtype, b.shape)
    return cx.node("dot_general", a, b, lhs_batch=(0,), rhs_batch=(0,), lhs_contract=(2,), rhs_contract=(1,))


@lowers("aten.dot.default")
def _dot(cx: LoweringContext, a: Node, b: Node) -> Node:
    return cx.node("dot_general", a, b, lhs_batch=(), rhs_batch=(), lhs_contract=(0,), rhs_contract=(0,))
