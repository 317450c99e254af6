"""NumPy meaning of every op of the graph IR: the oracle all tests compare against.

``evaluate(graph, inputs)`` runs ``graph.nodes`` in order, one small function per op (the table
``_EVALUATORS``), and returns the graph outputs (``None`` stays ``None``). It never writes into its
inputs; ``graph.mutations`` is the caller's business. Semantics follow XLA HLO:

Precision. A node computes in ``DType.compute`` of its operands' type: f16/bf16 values are widened
to f32, computed, and rounded once to the node's dtype when the value is stored; f32 stays f32 (no
Python float constants that could widen it), f64 stays f64. Reductions and dot_general on half
types accumulate in f32; dot_general on f32 accumulates in f32 (BLAS ``matmul``). Rounding to bf16
from f64 (or from an integer) is done directly, by round-to-odd through f32 (``ml_dtypes`` would
round twice). erf on f32 is SciPy's, which may be more accurate than an f32 computation.

Integers wrap around (two's complement). Integer div truncates toward zero and rem takes the sign
of the dividend (C semantics), computed exactly without floats. Like XLA's elemental emitter:
``x / 0 == -1``, ``x % 0 == x``, ``INT_MIN / -1 == INT_MIN``, ``INT_MIN % -1 == 0``. Integer pow
with a negative exponent gives 0, except for bases 1 (1) and -1 (+-1).

convert: float -> int truncates toward zero and saturates at the type's bounds, NaN -> 0 (CUDA's
``cvt.rzi``), except to the narrow integers (u8, i8, i16, computed in i32 and wrapped after every
op), which go through i64 and wrap as PyTorch's conversion to uint8 does; number -> bool is ``x != 0``; bool -> number is 0/1. max/min propagate NaN
(``np.maximum``; note CUDA's ``fmaxf`` does not). Float-only ops (exp, log, ..., sqrt) on integers
and arithmetic that has no meaning on bool (neg, sign, sub, div, rem, pow) are errors.

rng_uniform is counter-based Philox4x32-10 (Random123): element ``i`` (row-major) uses word
``i % 4`` of the block for counter ``(i // 4, stream, offset lo, offset hi)`` under key ``(seed lo,
seed hi)``; its value is ``float32((w >> 8) * 2**-24)`` in [0, 1), then converted to the node dtype
(for f16/bf16 this rounding can give exactly 1.0). CUDA code generation reproduces these bits.

library nodes run through PyTorch (CPU): ``attrs["target"]`` names a ``torch.ops`` overload and
``attrs["call"]`` is the argument template, ``{"operand": k}`` standing for operand ``k``.

Every error names the node (or parameter) and carries expected vs. found.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import ml_dtypes
import numpy as np
import scipy.special

from fusionstitching.graph.graph import Graph, Node
from fusionstitching.graph.ops import DType


class EvaluationError(ValueError):
    """An input that does not fit the graph, or a node whose value cannot be computed."""


def evaluate(graph: Graph, inputs: Sequence[Any]) -> list[np.ndarray | None]:
    """The values of ``graph.outputs`` for ``inputs`` given in ``graph.parameters`` order."""
    values: dict[Node, np.ndarray] = dict(zip(graph.parameters, _check_inputs(graph, inputs)))
    with np.errstate(all="ignore"):
        for node in graph.nodes:
            if node in values:
                continue
            values[node] = _evaluate_node(node, [values[x] for x in node.operands])
    return [None if out is None else np.array(values[out], order="C") for out in graph.outputs]


def evaluate_node(node: Node, args: list[np.ndarray]) -> np.ndarray:
    """The value of one node given its operands' values (what ``evaluate`` does per node)."""
    return _evaluate_node(node, args)


def _evaluate_node(node: Node, args: list[np.ndarray]) -> np.ndarray:
    evaluator = _EVALUATORS.get(node.op)
    try:
        if evaluator is None:
            raise EvaluationError("no reference semantics for this op")
        value = np.asarray(evaluator(node, args))
    except Exception as err:
        raise EvaluationError(f"node {node.name} ({node.op}): {err}") from err
    if value.shape != node.shape or value.dtype != node.dtype.numpy:
        raise EvaluationError(
            f"node {node.name} ({node.op}): reference computed {value.dtype}{list(value.shape)}, "
            f"node declares {node.dtype.value}{list(node.shape)}"
        )
    return value


def _check_inputs(graph: Graph, inputs: Sequence[Any]) -> list[np.ndarray]:
    if len(inputs) != len(graph.parameters):
        raise EvaluationError(f"graph {graph.name} takes {len(graph.parameters)} inputs, found {len(inputs)}")
    return [_check_input(i, param, value) for i, (param, value) in enumerate(zip(graph.parameters, inputs))]


def _check_input(index: int, param: Node, value: Any) -> np.ndarray:
    where = f"parameter {index} ({param.name})"
    expected = f"{param.dtype.value}{list(param.shape)}"
    if isinstance(value, (bool, int, float)) and param.shape == ():
        if not _python_scalar_fits(value, param.dtype):
            raise EvaluationError(f"{where}: expected {expected}, found Python {type(value).__name__} {value!r}")
        try:
            return np.asarray(value, dtype=param.dtype.numpy)
        except OverflowError:
            raise EvaluationError(f"{where}: expected {expected}, found {value} (out of range)") from None
    if not isinstance(value, (np.ndarray, np.generic)):
        raise EvaluationError(f"{where}: expected a NumPy array {expected}, found {type(value).__name__}")
    array = np.asarray(value)
    if array.shape != param.shape or array.dtype != param.dtype.numpy:
        try:
            found = DType.from_numpy(array.dtype).value
        except ValueError:
            found = str(array.dtype)
        raise EvaluationError(f"{where}: expected {expected}, found {found}{list(array.shape)}")
    return array


def _python_scalar_fits(value: float, dtype: DType) -> bool:
    """bool only for bool; int for any number type; float for float types."""
    if isinstance(value, bool) or dtype == DType.BOOL:
        return isinstance(value, bool) and dtype == DType.BOOL
    return dtype.is_float or isinstance(value, int)


# ----------------------------------------------------------------------------------------------
# Storing values: one rounding to the node dtype.
# ----------------------------------------------------------------------------------------------


def _store(value: Any, dtype: DType) -> np.ndarray:
    """``value`` converted to ``dtype`` by the rules of ``convert`` (rounded once for floats)."""
    value = np.asarray(value)
    if value.dtype == dtype.numpy:
        return value
    if dtype == DType.BOOL:
        return value != 0
    if value.dtype == np.bool_:
        return value.astype(dtype.numpy)
    if dtype.is_float:
        if dtype == DType.BF16 and value.dtype not in (np.float32, np.float16):
            return _f64_to_bf16(value.astype(np.float64))
        return value.astype(dtype.numpy)
    if np.issubdtype(value.dtype, np.integer):
        return value.astype(dtype.numpy)
    if dtype.is_narrow:  # through i64 and wrapped, as PyTorch converts to uint8 (and x86 to int8/int16)
        return _float_to_int(value.astype(np.float64), np.dtype(np.int64)).astype(dtype.numpy)
    return _float_to_int(value.astype(np.float64), dtype.numpy)


def _f64_to_bf16(x: np.ndarray) -> np.ndarray:
    """Round f64 to bf16 once: round to odd into f32 (24 bits >= 8 + 2), then to nearest even."""
    y = x.astype(np.float32)
    y = np.where(np.abs(y.astype(np.float64)) > np.abs(x), np.nextafter(y, np.float32(0)), y)
    inexact = (y.astype(np.float64) != x) & ~np.isnan(x)
    bits = y.view(np.uint32) | inexact.astype(np.uint32)
    return bits.view(np.float32).astype(ml_dtypes.bfloat16)


def _float_to_int(x: np.ndarray, target: np.dtype) -> np.ndarray:
    """Truncate toward zero, saturate at the bounds, NaN -> 0."""
    info = np.iinfo(target)
    low, high = float(info.min), -float(info.min)  # -2**(n-1) and 2**(n-1): exact in f64
    t = np.trunc(np.where(np.isnan(x), 0.0, x))
    result = np.where((t >= low) & (t < high), t, 0.0).astype(target)
    result = np.where(t >= high, info.max, result)
    return np.where(t < low, info.min, result).astype(target)


# ----------------------------------------------------------------------------------------------
# Elementwise ops: operands widened to the compute type, result rounded once to the node dtype.
# ----------------------------------------------------------------------------------------------

_FLOAT_ONLY = {"exp", "log", "log1p", "expm1", "tanh", "erf", "sigmoid", "sqrt", "rsqrt", "sin", "cos"}
_NOT_FOR_BOOL = {"neg", "sub", "div", "rem", "pow", "sign"}


def _elementwise(node: Node, args: list[np.ndarray]) -> np.ndarray:
    dtype = node.operands[0].dtype
    if node.op in _FLOAT_ONLY and not dtype.is_float:
        raise EvaluationError(f"{node.op} needs a float operand, found {dtype.value}")
    if node.op in _NOT_FOR_BOOL and dtype == DType.BOOL:
        raise EvaluationError(f"{node.op} is not defined for bool")
    compute = dtype.compute.numpy
    xs = [a.astype(compute, copy=False) for a in args]
    return _store(_ELEMENTWISE[node.op](*xs), node.dtype)


def _floor(x: np.ndarray) -> np.ndarray:
    return np.floor(x) if np.issubdtype(x.dtype, np.floating) else x


def _ceil(x: np.ndarray) -> np.ndarray:
    return np.ceil(x) if np.issubdtype(x.dtype, np.floating) else x


def _not(x: np.ndarray) -> np.ndarray:
    return np.logical_not(x) if x.dtype == np.bool_ else np.invert(x)


def _sigmoid(x: np.ndarray) -> np.ndarray:
    one = x.dtype.type(1)
    e = np.exp(-np.abs(x))  # in (0, 1]: never overflows
    return np.where(x >= 0, one / (one + e), e / (one + e))


def _rsqrt(x: np.ndarray) -> np.ndarray:
    return x.dtype.type(1) / np.sqrt(x)


def _int_divmod(a: np.ndarray, b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """C quotient and remainder, exact; XLA's results for b == 0 and INT_MIN / -1."""
    zero, minus_one = b == 0, b == -1
    safe = np.where(zero | minus_one, np.ones_like(b), b)
    rem = np.fmod(a, safe)  # sign of the dividend
    quot = (a - rem) // safe  # exact division; a - rem moves toward zero, cannot overflow
    quot = np.where(minus_one, np.negative(a), np.where(zero, -np.ones_like(a), quot))
    rem = np.where(minus_one, np.zeros_like(a), np.where(zero, a, rem))
    return quot, rem


def _div(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """An f32 quotient is the product with the divisor's correctly rounded reciprocal (within 1.5 ulp
    of the quotient), as every generated kernel computes it: a value recomputed from a saved one
    then has the same bits in the reference as in the kernels (amax's gradient compares the two).
    A divisor under the smallest normal f32 is scaled by 2^64 first, the dividend with it."""
    if a.dtype == np.float32:
        tiny = np.abs(b) < np.float32(2.0 ** -126)
        scale = np.where(tiny, np.float32(2.0 ** 64), np.float32(1.0)).astype(np.float32)
        with np.errstate(all="ignore"):
            return (a * scale) * np.reciprocal(b * scale)
    return np.true_divide(a, b) if np.issubdtype(a.dtype, np.floating) else _int_divmod(a, b)[0]


def _rem(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return np.fmod(a, b) if np.issubdtype(a.dtype, np.floating) else _int_divmod(a, b)[1]


def _pow(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    if np.issubdtype(a.dtype, np.floating):
        return np.power(a, b)
    negative = b < 0
    result = np.power(a, np.where(negative, np.zeros_like(b), b))
    one = np.ones_like(a)
    odd = (b & 1) == 1
    small = np.where(a == 1, one, np.where(a == -1, np.where(odd, -one, one), np.zeros_like(a)))
    return np.where(negative, small, result)


def _sign(x: np.ndarray) -> np.ndarray:
    """torch's sign: (0 < x) - (x < 0), so sign(NaN) is 0 (NumPy's is NaN)."""
    x = np.asarray(x)
    return ((x > 0).astype(np.int8) - (x < 0).astype(np.int8)).astype(x.dtype)


_ELEMENTWISE: dict[str, Callable[..., np.ndarray]] = {
    "neg": np.negative,
    "abs": np.abs,
    "not": _not,
    "copy": np.copy,
    "sign": _sign,
    "floor": _floor,
    "ceil": _ceil,
    "exp": np.exp,
    "log": np.log,
    "log1p": np.log1p,
    "expm1": np.expm1,
    "tanh": np.tanh,
    "erf": scipy.special.erf,
    "sigmoid": _sigmoid,
    "sqrt": np.sqrt,
    "rsqrt": _rsqrt,
    "sin": np.sin,
    "cos": np.cos,
    "add": np.add,
    "sub": np.subtract,
    "mul": np.multiply,
    "max": np.maximum,
    "min": np.minimum,
    "and": np.bitwise_and,  # logical on bool
    "or": np.bitwise_or,
    "xor": np.bitwise_xor,
    "div": _div,
    "pow": _pow,
    "rem": _rem,
}

_COMPARISONS = {
    "EQ": np.equal,
    "NE": np.not_equal,
    "LT": np.less,
    "LE": np.less_equal,
    "GT": np.greater,
    "GE": np.greater_equal,
}


def _compare(node: Node, args: list[np.ndarray]) -> np.ndarray:
    compute = node.operands[0].dtype.compute.numpy
    return _COMPARISONS[node.attrs["direction"]](args[0].astype(compute), args[1].astype(compute))


def _select(node: Node, args: list[np.ndarray]) -> np.ndarray:
    pred, on_true, on_false = args
    return np.where(pred, on_true, on_false)


def _convert(node: Node, args: list[np.ndarray]) -> np.ndarray:
    (x,) = args
    if node.operands[0].dtype == DType.BF16:
        x = x.astype(np.float32)  # exact; avoids relying on ml_dtypes casts to other types
    return _store(x, node.dtype)


# ----------------------------------------------------------------------------------------------
# Reductions and dot.
# ----------------------------------------------------------------------------------------------


def _reduce(node: Node, args: list[np.ndarray]) -> np.ndarray:
    dtype = node.operands[0].dtype
    x, dims, kind = args[0].astype(dtype.compute.numpy), tuple(node.attrs["dims"]), node.attrs["kind"]
    if dtype == DType.BOOL:
        return (np.any if kind in ("sum", "max") else np.all)(x, axis=dims)
    if kind == "sum":
        return _store(np.sum(x, axis=dims, dtype=x.dtype), node.dtype)
    if kind == "prod":
        return _store(np.prod(x, axis=dims, dtype=x.dtype), node.dtype)
    if dtype.is_float:
        lowest, highest = x.dtype.type(-np.inf), x.dtype.type(np.inf)
    else:  # the bounds of the operand's own type (a narrow integer is computed in i32)
        lowest, highest = np.iinfo(dtype.numpy).min, np.iinfo(dtype.numpy).max
    if kind == "max":
        return _store(np.max(x, axis=dims, initial=lowest), node.dtype)
    return _store(np.min(x, axis=dims, initial=highest), node.dtype)


def _dot_general(node: Node, args: list[np.ndarray]) -> np.ndarray:
    """Batch dims, then lhs free dims, then rhs free dims; a batched matmul in the compute type."""
    compute = node.operands[0].dtype.compute.numpy
    lhs, rhs = (a.astype(compute) for a in args)
    lb, rb, lc, rc = (list(node.attrs[k]) for k in ("lhs_batch", "rhs_batch", "lhs_contract", "rhs_contract"))
    lfree = [d for d in range(lhs.ndim) if d not in lb + lc]
    rfree = [d for d in range(rhs.ndim) if d not in rb + rc]
    batch = math.prod(lhs.shape[d] for d in lb)
    m, k = math.prod(lhs.shape[d] for d in lfree), math.prod(lhs.shape[d] for d in lc)
    n = math.prod(rhs.shape[d] for d in rfree)
    lhs3 = np.transpose(lhs, lb + lfree + lc).reshape(batch, m, k)
    rhs3 = np.transpose(rhs, rb + rc + rfree).reshape(batch, k, n)
    out = np.matmul(lhs3, rhs3)
    return _store(out.reshape(node.shape), node.dtype)


# ----------------------------------------------------------------------------------------------
# Shape ops: pure index arithmetic, no rounding.
# ----------------------------------------------------------------------------------------------


def _broadcast_in_dim(node: Node, args: list[np.ndarray]) -> np.ndarray:
    (x,) = args
    dims = list(node.attrs["broadcast_dimensions"])
    order = sorted(range(x.ndim), key=lambda i: dims[i])  # operand dims in output order
    shape = [1] * len(node.shape)
    for i in order:
        shape[dims[i]] = x.shape[i]
    return np.broadcast_to(np.transpose(x, order).reshape(shape), node.shape).copy()


def _reshape(node: Node, args: list[np.ndarray]) -> np.ndarray:
    return np.reshape(args[0], node.shape)


def _transpose(node: Node, args: list[np.ndarray]) -> np.ndarray:
    return np.transpose(args[0], node.attrs["permutation"])


def _slice(node: Node, args: list[np.ndarray]) -> np.ndarray:
    attrs = node.attrs
    return args[0][tuple(slice(*s) for s in zip(attrs["start"], attrs["limit"], attrs["stride"]))]


def _concatenate(node: Node, args: list[np.ndarray]) -> np.ndarray:
    return np.concatenate(args, axis=node.attrs["dimension"])


def _pad(node: Node, args: list[np.ndarray]) -> np.ndarray:
    """HLO pad: ``interior`` fill elements between neighbours, then edges (negative ones crop)."""
    (x,) = args
    value = _store(np.float64(node.attrs["value"]), node.dtype)
    low, high, interior = (node.attrs[k] for k in ("low", "high", "interior"))
    spread_shape = [s + max(s - 1, 0) * it for s, it in zip(x.shape, interior)]
    spread = np.full(spread_shape, value, dtype=x.dtype)
    spread[tuple(slice(None, None, it + 1) for it in interior)] = x
    widths = [(max(lo, 0), max(hi, 0)) for lo, hi in zip(low, high)]
    padded = np.pad(spread, widths, constant_values=value) if x.ndim else spread
    crop = tuple(slice(max(-lo, 0), size - max(-hi, 0)) for lo, hi, size in zip(low, high, padded.shape))
    return padded[crop]


def _iota(node: Node, args: list[np.ndarray]) -> np.ndarray:
    dim = node.attrs["dimension"]
    shape = [1] * len(node.shape)
    shape[dim] = node.shape[dim]
    values = _store(np.arange(node.shape[dim], dtype=np.int64).reshape(shape), node.dtype)
    return np.broadcast_to(values, node.shape).copy()


def _gather(node: Node, args: list[np.ndarray]) -> np.ndarray:
    """out[b.., pre.., i.., post..] = x[b.., pre.., idx[b.., i..], post..]."""
    x, idx = args
    axis, batch = node.attrs["axis"], node.attrs["batch_dims"]
    bad = (idx < 0) | (idx >= x.shape[axis])
    if np.any(bad):
        where = tuple(int(i) for i in np.argwhere(bad)[0])
        raise EvaluationError(
            f"index {int(idx[where])} at {list(where)} out of range [0, {x.shape[axis]}) for axis {axis} "
            f"of operand {node.operands[0].name} {list(x.shape)}"
        )
    lead = axis + idx.ndim - batch  # rank of the advanced-index grid: batch, pre, index dims
    grid = []
    for d in range(axis):  # batch and pre dims: an arange along their output position
        shape = [1] * lead
        shape[d] = x.shape[d]
        grid.append(np.arange(x.shape[d]).reshape(shape))
    idx_shape = list(idx.shape[:batch]) + [1] * (axis - batch) + list(idx.shape[batch:])
    grid.append(idx.astype(np.int64).reshape(idx_shape))
    return x[tuple(grid)]


# ----------------------------------------------------------------------------------------------
# Random numbers: Philox4x32-10.
# ----------------------------------------------------------------------------------------------

_MASK32 = np.uint64(0xFFFFFFFF)
_PHILOX_M0, _PHILOX_M1 = np.uint64(0xD2511F53), np.uint64(0xCD9E8D57)
_PHILOX_W0, _PHILOX_W1 = 0x9E3779B9, 0xBB67AE85


def philox4x32_10(counters: np.ndarray, key: tuple[int, int]) -> np.ndarray:
    """Random123's Philox4x32 with 10 rounds: ``counters[..., 4]`` uint32 -> ``[..., 4]`` uint32."""
    counters = np.asarray(counters)
    if counters.shape[-1:] != (4,):
        raise ValueError(f"philox counters need a last dim of 4, found shape {list(counters.shape)}")
    c0, c1, c2, c3 = (counters[..., i].astype(np.uint32).astype(np.uint64) for i in range(4))
    k0, k1 = int(key[0]) & 0xFFFFFFFF, int(key[1]) & 0xFFFFFFFF
    for _ in range(10):
        p0, p1 = _PHILOX_M0 * c0, _PHILOX_M1 * c2  # 32 x 32 -> 64 bit products: (hi, lo) pairs
        c0, c1, c2, c3 = (
            (p1 >> np.uint64(32)) ^ c1 ^ np.uint64(k0),
            p1 & _MASK32,
            (p0 >> np.uint64(32)) ^ c3 ^ np.uint64(k1),
            p0 & _MASK32,
        )
        k0, k1 = (k0 + _PHILOX_W0) & 0xFFFFFFFF, (k1 + _PHILOX_W1) & 0xFFFFFFFF
    return np.stack([c0, c1, c2, c3], axis=-1).astype(np.uint32)


def uniform_from_bits(bits: np.ndarray) -> np.ndarray:
    """The f32 in [0, 1) a 32-bit Philox word stands for: its top 24 bits times 2**-24."""
    return (np.asarray(bits, dtype=np.uint32) >> np.uint32(8)).astype(np.float32) * np.float32(2.0**-24)


def rng_uniform(shape: Sequence[int], seed: int, offset: int, stream: int = 0) -> np.ndarray:
    """f32 uniforms in [0, 1) of an ``rng_uniform`` node; seed and offset as i64 (bit patterns)."""
    seed, offset = int(seed) & 0xFFFFFFFFFFFFFFFF, int(offset) & 0xFFFFFFFFFFFFFFFF
    count = math.prod(shape)
    blocks = (count + 3) // 4
    counters = np.empty((blocks, 4), dtype=np.uint32)
    counters[:, 0] = (np.arange(blocks, dtype=np.uint64) & _MASK32).astype(np.uint32)
    counters[:, 1] = stream & 0xFFFFFFFF
    counters[:, 2] = offset & 0xFFFFFFFF
    counters[:, 3] = offset >> 32
    bits = philox4x32_10(counters, (seed & 0xFFFFFFFF, seed >> 32)).reshape(-1)[:count]
    return uniform_from_bits(bits).reshape(tuple(shape))


def _rng_uniform(node: Node, args: list[np.ndarray]) -> np.ndarray:
    seed, offset, stream = int(args[0]), int(args[1]), int(np.asarray(args[2]).reshape(-1)[0])
    return _store(rng_uniform(node.shape, seed, offset, stream), node.dtype)


# ----------------------------------------------------------------------------------------------
# Leaves and library calls.
# ----------------------------------------------------------------------------------------------


def _constant(node: Node, args: list[np.ndarray]) -> np.ndarray:
    return np.asarray(node.attrs["value"])


def _parameter(node: Node, args: list[np.ndarray]) -> np.ndarray:
    raise EvaluationError("parameter node is not in graph.parameters")


def resolve_library_target(name: str) -> Callable[..., Any]:
    """The ``torch.ops`` overload named like ``"aten.sort.default"``."""
    import torch

    target: Any = torch.ops
    for part in name.split("."):
        try:
            target = getattr(target, part)
        except (AttributeError, RuntimeError):
            raise EvaluationError(f"library target {name!r}: torch.ops has no {part!r} there") from None
    if not callable(target):
        raise EvaluationError(f"library target {name!r} is not callable")
    return target


def _torch_dtypes() -> dict[DType, Any]:
    from fusionstitching.graph.torch_dtypes import DTYPE_TO_TORCH

    return DTYPE_TO_TORCH


def _to_torch(array: np.ndarray) -> Any:
    import torch

    if array.dtype == ml_dtypes.bfloat16:
        return torch.from_numpy(np.array(array, dtype=np.float32, order="C")).to(torch.bfloat16)
    return torch.from_numpy(np.array(array, order="C"))  # a copy: the call may write into it


def library_operand(template: Mapping, tensor: Any) -> Any:
    """The tensor a library call gets for the operand ``template`` names (``{"operand": k,
    "strides": [...]}``): laid out with the strides it had when the program was traced. Library ops
    may depend on layouts (cuDNN attention's backward assumed its output gradient laid out as its
    output: compiled graphs hand it a contiguous one and got wrong gradients), so each gets the
    layouts eager gives it. An operand traced on the host (``"host": true``) is passed there:
    efficient attention's backward reads its dropout seed and offset on the host, and a GPU
    program had moved those 0-d inputs to the GPU."""
    return operand_function({**template, "operand": 0})([tensor])


def operand_function(template: Mapping) -> Any:
    """``library_operand`` for the operand ``template`` names, as a function of a call's operands
    with the template read once (the runtime's library calls)."""
    k = template["operand"]
    host = bool(template.get("host"))
    permutation = tuple(template["permute"]) if "permute" in template else None
    strides = tuple(template["strides"]) if template.get("strides") is not None else None

    def operand(args: Sequence[Any]) -> Any:
        tensor = args[k]
        if host and tensor.device.type != "cpu":
            tensor = tensor.cpu()
        if permutation is not None:  # an operand the graph holds permuted (``graph/layout.py``): a view
            tensor = tensor.permute(permutation)
        if strides is None or tensor.stride() == strides:
            return tensor
        return traced_layout(tensor, strides)

    return operand


def traced_layout(tensor: Any, strides: tuple[int, ...]) -> Any:
    """``tensor`` laid out with the ``strides`` it was traced with, where its strides differ in a dim
    of more than one element (a copy then; ``tensor`` itself otherwise)."""
    if tensor.dim() != len(strides) or all(
            size <= 1 or have == want for size, have, want in zip(tensor.shape, tensor.stride(), strides)):
        return tensor
    return with_strides(tensor, strides)


def library_result(call: Mapping, result: Any) -> Any:
    """A library call's result as the graph holds it: permuted where the call says
    (``"permute_result"``, ``graph/layout.py``: a channels-last convolution's NCHW result, whose
    NHWC permutation is contiguous; of a multi-output op, each result of the permutation's rank)."""
    permutation = call.get("permute_result")
    if permutation is None:
        return result
    if isinstance(result, (tuple, list)):  # every tensor output of its rank (not a convolution's bias
        # gradient, nor flash attention's integer sequence lengths)
        return type(result)(r.permute(*permutation) if hasattr(r, "dim") and r.dim() == len(permutation) else r
                            for r in result)
    return result.permute(*permutation)


def with_strides(value: Any, strides: Sequence[int], offset: int = 0) -> Any:
    """A copy of the tensor ``value`` laid out with ``strides`` at element ``offset`` of its storage.
    A dim of stride 0 (a broadcast, ``x.expand(3, 5)``; an attention mask expanded over batch and
    heads) is stored once and expanded: no tensor can be written through strides that overlap.
    The offset matters where the caller rebuilds the output from its metadata: AOTAutograd
    regenerates an output that aliases an input as ``input.as_strided(size, stride, offset)``."""
    import torch

    broadcast = [d for d, (size, stride) in enumerate(zip(value.shape, strides)) if stride == 0 and size > 1]
    compact = value
    for d in broadcast:
        compact = compact.narrow(d, 0, 1)
    if offset:
        span = 1 + sum((size - 1) * abs(stride) for size, stride in zip(compact.shape, strides)) \
            if compact.numel() else 0
        storage = torch.empty(offset + span, dtype=value.dtype, device=value.device)
        strided = storage.as_strided(compact.shape, tuple(strides), offset)
    else:
        strided = torch.empty_strided(compact.shape, tuple(strides), dtype=value.dtype, device=value.device)
    strided.copy_(compact)
    return strided.expand(value.shape) if broadcast else strided


def _call_value(template: Any, args: list[np.ndarray]) -> Any:
    """Fill an argument template: ``{"operand": k}`` -> tensor, ``{"dtype": "f32"}`` -> torch dtype."""
    if isinstance(template, Mapping):
        if "operand" in template:
            return library_operand(template, _to_torch(args[template["operand"]]))
        if set(template) == {"dtype"}:
            return _torch_dtypes()[DType(template["dtype"])]
        return {key: _call_value(value, args) for key, value in template.items()}
    if isinstance(template, (list, tuple)):
        return type(template)(_call_value(value, args) for value in template)
    return template


def evaluate_library(nodes: Sequence[Node], args: list[np.ndarray]) -> list[np.ndarray]:
    """The values of the outputs ``nodes`` of one call of a multi-output library op (the same
    target, call and operands): the op runs once."""
    result = _library_call(nodes[0], args)
    return [_library_result(node, result[node.attrs["out_index"]]) for node in nodes]


def _library_call(node: Node, args: list[np.ndarray]) -> Any:
    import torch

    target = resolve_library_target(node.attrs["target"])
    call = node.attrs["call"]
    positional = _call_value(call.get("args", []), args)
    keywords = {key: _call_value(value, args) for key, value in call.get("kwargs", {}).items()}
    with torch.no_grad():
        return library_result(call, target(*positional, **keywords))


def _library(node: Node, args: list[np.ndarray]) -> np.ndarray:
    result = _library_call(node, args)
    if node.attrs["out_index"] >= 0:
        result = result[node.attrs["out_index"]]
    return _library_result(node, result)


def _library_result(node: Node, result: Any) -> np.ndarray:
    import torch

    if not isinstance(result, torch.Tensor):
        raise EvaluationError(f"{node.attrs['target']} returned {type(result).__name__}, not a tensor")
    expected = _torch_dtypes()[node.dtype]
    if result.dtype != expected or tuple(result.shape) != node.shape:
        raise EvaluationError(
            f"{node.attrs['target']} returned {result.dtype}{list(result.shape)}, "
            f"node declares {node.dtype.value}{list(node.shape)}"
        )
    result = result.detach().cpu()
    if result.dtype == torch.bfloat16:
        return result.float().numpy().astype(ml_dtypes.bfloat16)
    return np.array(host_array(result), order="C")  # result may view an input: keep it resizable


def host_array(t: Any) -> np.ndarray:
    """A NumPy view of the CPU tensor ``t`` that leaves its storage resizable. ``Tensor.numpy()``
    marks the storage unresizable for good, and FSDP2 frees and reallocates its unsharded
    parameters by resizing their storage: a graph that read them through ``numpy()`` broke the
    next reshard. DLPack shares the memory without that mark; a tensor DLPack cannot describe
    (a lazily negated view) is copied first."""
    import torch

    if t.is_neg() or t.is_conj():
        t = t.resolve_neg().resolve_conj()
    try:
        return np.from_dlpack(t)
    except (BufferError, RuntimeError, TypeError):
        return torch.clone(t).numpy()


_EVALUATORS: dict[str, Callable[[Node, list[np.ndarray]], np.ndarray]] = {
    **{op: _elementwise for op in _ELEMENTWISE},
    "compare": _compare,
    "select": _select,
    "convert": _convert,
    "reduce": _reduce,
    "dot_general": _dot_general,
    "broadcast_in_dim": _broadcast_in_dim,
    "reshape": _reshape,
    "transpose": _transpose,
    "slice": _slice,
    "concatenate": _concatenate,
    "pad": _pad,
    "iota": _iota,
    "gather": _gather,
    "rng_uniform": _rng_uniform,
    "constant": _constant,
    "parameter": _parameter,
    "library": _library,
}
