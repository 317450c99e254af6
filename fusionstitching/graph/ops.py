"""Op kinds of the graph IR, their categories and their attribute schemas.

The op set follows XLA HLO semantics (DESIGN.md "Graph IR"): elementwise ops take operands of
identical shape (capture inserts explicit ``broadcast_in_dim`` and ``convert`` nodes), shape ops
are pure index arithmetic, reductions drop the reduced dims. The category of an op is its role in
fusion: light elementwise ops are recomputed freely, expensive ones may become sub-roots whose
results are shared through shuffles or shared memory, reductions always are sub-roots [C §4.2].

Each op lists its attributes with a kind, which the verifier and the JSON reader use to check them:
``int``, ``ints`` (tuple of ints), ``str``, ``float``, ``bool``, ``dtype``, ``array`` (a NumPy
constant), ``call`` (a library call's argument template).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import ml_dtypes
import numpy as np


class DType(str, enum.Enum):
    """Element types of the IR. The value is the short name used in printed IR and JSON."""

    F32 = "f32"
    F16 = "f16"
    BF16 = "bf16"
    F64 = "f64"
    I32 = "i32"
    I64 = "i64"
    U8 = "u8"
    I8 = "i8"
    I16 = "i16"
    BOOL = "bool"

    @property
    def numpy(self) -> np.dtype:
        return _NUMPY_DTYPES[self]

    @property
    def is_float(self) -> bool:
        return self in (DType.F32, DType.F16, DType.BF16, DType.F64)

    @property
    def is_half(self) -> bool:
        """f16 and bf16: computed in f32 inside a kernel and rounded once on store."""
        return self in (DType.F16, DType.BF16)

    @property
    def is_narrow(self) -> bool:
        """u8, i8 and i16: integers computed in i32 inside a kernel and wrapped to their width after
        every op (two's complement, as PyTorch's arithmetic on them wraps)."""
        return self in (DType.U8, DType.I8, DType.I16)

    @property
    def compute(self) -> DType:
        """The type arithmetic on this type is carried out in."""
        if self.is_half:
            return DType.F32
        return DType.I32 if self.is_narrow else self

    @property
    def widened(self) -> bool:
        """Stored narrower than computed (half types and narrow integers): a value is rounded or
        wrapped to this type where an op produces it."""
        return self.compute != self

    @property
    def itemsize(self) -> int:
        return self.numpy.itemsize

    @staticmethod
    def from_numpy(dtype: np.dtype) -> DType:
        for kind, np_dtype in _NUMPY_DTYPES.items():
            if np.dtype(dtype) == np_dtype:
                return kind
        raise ValueError(f"unsupported NumPy dtype {np.dtype(dtype)}")


_NUMPY_DTYPES = {
    DType.F32: np.dtype(np.float32),
    DType.F16: np.dtype(np.float16),
    DType.BF16: np.dtype(ml_dtypes.bfloat16),
    DType.F64: np.dtype(np.float64),
    DType.I32: np.dtype(np.int32),
    DType.I64: np.dtype(np.int64),
    DType.U8: np.dtype(np.uint8),
    DType.I8: np.dtype(np.int8),
    DType.I16: np.dtype(np.int16),
    DType.BOOL: np.dtype(np.bool_),
}


class Category(str, enum.Enum):
    LIGHT_ELEMENTWISE = "light elementwise"
    EXPENSIVE_ELEMENTWISE = "expensive elementwise"
    REDUCTION = "reduction"
    SHAPE = "shape"
    DOT = "dot"
    RANDOM = "random"
    PARAMETER = "parameter"
    CONSTANT = "constant"
    LIBRARY = "library"

    @property
    def fusable(self) -> bool:
        """Whether ops of this category can be part of a generated kernel."""
        return self not in (Category.PARAMETER, Category.CONSTANT, Category.LIBRARY)


@dataclass(frozen=True)
class OpInfo:
    name: str
    category: Category
    arity: int | None  # None: any number of operands (concatenate, library)
    attrs: dict[str, str] = field(default_factory=dict)


COMPARE_DIRECTIONS = ("EQ", "NE", "LT", "LE", "GT", "GE")
REDUCE_KINDS = ("sum", "max", "min", "prod")
# ops whose result may be a view of their operand's memory (a plan's view steps)
VIEW_OPS = ("reshape", "transpose", "broadcast_in_dim")

_LIGHT_UNARY = ("neg", "abs", "not", "copy", "sign", "floor", "ceil")
_LIGHT_BINARY = ("add", "sub", "mul", "max", "min", "and", "or", "xor")
_EXPENSIVE_UNARY = (
    "exp", "log", "log1p", "expm1", "tanh", "erf", "sigmoid", "sqrt", "rsqrt", "sin", "cos",
)
_EXPENSIVE_BINARY = ("div", "pow", "rem")

UNARY_ELEMENTWISE = _LIGHT_UNARY + _EXPENSIVE_UNARY
BINARY_ELEMENTWISE = _LIGHT_BINARY + _EXPENSIVE_BINARY


def _table() -> dict[str, OpInfo]:
    light, expensive = Category.LIGHT_ELEMENTWISE, Category.EXPENSIVE_ELEMENTWISE
    infos = [OpInfo(name, light, 1) for name in _LIGHT_UNARY]
    infos += [OpInfo(name, light, 2) for name in _LIGHT_BINARY]
    infos += [OpInfo(name, expensive, 1) for name in _EXPENSIVE_UNARY]
    infos += [OpInfo(name, expensive, 2) for name in _EXPENSIVE_BINARY]
    shape = Category.SHAPE
    infos += [
        OpInfo("compare", light, 2, {"direction": "str"}),
        OpInfo("select", light, 3),
        OpInfo("convert", light, 1),
        OpInfo("reduce", Category.REDUCTION, 1, {"dims": "ints", "kind": "str"}),
        OpInfo("broadcast_in_dim", shape, 1, {"broadcast_dimensions": "ints"}),
        OpInfo("reshape", shape, 1),
        OpInfo("transpose", shape, 1, {"permutation": "ints"}),
        OpInfo("slice", shape, 1, {"start": "ints", "limit": "ints", "stride": "ints"}),
        OpInfo("concatenate", shape, None, {"dimension": "int"}),
        OpInfo("pad", shape, 1, {"low": "ints", "high": "ints", "interior": "ints", "value": "float"}),
        OpInfo("iota", shape, 0, {"dimension": "int"}),
        OpInfo("gather", shape, 2, {"axis": "int", "batch_dims": "int"}),
        OpInfo(
            "dot_general",
            Category.DOT,
            2,
            {"lhs_batch": "ints", "rhs_batch": "ints", "lhs_contract": "ints", "rhs_contract": "ints"},
        ),
        OpInfo("rng_uniform", Category.RANDOM, 3, {}),
        OpInfo("parameter", Category.PARAMETER, 0, {"index": "int"}),
        OpInfo("constant", Category.CONSTANT, 0, {"value": "array"}),
        OpInfo("library", Category.LIBRARY, None, {"target": "str", "call": "call", "out_index": "int"}),
    ]
    return {info.name: info for info in infos}


OPS: dict[str, OpInfo] = _table()


def op_info(op: str) -> OpInfo:
    try:
        return OPS[op]
    except KeyError:
        raise ValueError(f"unknown op {op!r}") from None


def category(op: str) -> Category:
    return op_info(op).category


def is_elementwise(op: str) -> bool:
    return op_info(op).category in (Category.LIGHT_ELEMENTWISE, Category.EXPENSIVE_ELEMENTWISE)
