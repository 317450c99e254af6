"""Kernel IR: a small structured imperative IR for one CUDA kernel (DESIGN.md "Kernel IR").

Two consumers read it and nothing else: ``cuda_c.py`` prints it as CUDA C and ``simulate.py`` runs
it on NumPy with every thread of every block in lockstep. It is designed for all four composition
schemes: global and shared buffers, barriers and warp shuffles are part of it from the start.

Types are strings (``KTYPES``): the graph dtypes plus ``u32``/``u64`` for the random-number code.
``f16``/``bf16`` exist only as storage: a ``Load`` of a half buffer yields the storage type and
lowering wraps it in a ``Cast`` to ``f32``; arithmetic on half types never appears. The narrow
integers ``u8``/``i8``/``i16`` are storage too: computed in ``i32``, each value wrapped to its width
by a ``Cast`` there and back.

Expressions are pure. Special values (``Special``) are the thread's coordinates: ``tid``
(threadIdx.x), ``bid`` (blockIdx.x), ``ntid`` (blockDim.x), ``nbid`` (gridDim.x), ``lane`` and
``warp`` (tid % 32, tid / 32), all ``i32``. Statements are a tree: ``For`` and ``If`` own their
bodies. Every node is a frozen dataclass; a kernel is a value and can be printed, simulated,
hashed and compared. The nodes that lowering builds by the hundred per kernel (``schedule.feasible``
lowers thousands of candidate kernels while fusion explores) have an ``__init__`` that fills the
instance dict directly: a frozen dataclass's generated one sets each field through
``object.__setattr__``, several times slower.
"""

from __future__ import annotations

from dataclasses import dataclass, field

KTYPES = ("f32", "f64", "f16", "bf16", "i32", "i64", "u32", "u64", "u8", "i8", "i16", "bool")
FLOAT_TYPES = ("f32", "f64", "f16", "bf16")
INT_TYPES = ("i32", "i64", "u32", "u64", "u8", "i8", "i16")

UNARY_OPS = (
    "neg", "abs", "not", "sign", "floor", "ceil", "exp", "log", "log1p", "expm1", "tanh", "erf",
    "sigmoid", "sqrt", "rsqrt", "sin", "cos", "isnan", "rcp",
    "exp_approx", "sigmoid_approx",  # f32 only: ``__expf`` and ``__fdividef`` (``codegen/precision.py``)
)
BINARY_OPS = (
    "add", "sub", "mul", "div", "rem", "pow", "max", "min", "and", "or", "xor", "shl", "shr",
    "eq", "ne", "lt", "le", "gt", "ge", "mulhi",
)
COMPARE_OPS = ("eq", "ne", "lt", "le", "gt", "ge")
SPECIALS = ("tid", "bid", "ntid", "nbid", "lane", "warp", "nwarp")
SHUFFLES = ("down", "xor", "idx")


# ----------------------------------------------------------------------------------------------
# Expressions
# ----------------------------------------------------------------------------------------------


def _hash_once(cls):
    """Compound expressions are hashed often (values are cached by index expression) and never
    change: keep the dataclass hash, computed once per object."""
    plain = cls.__hash__

    def __hash__(self) -> int:
        cached = self.__dict__.get("_hash")
        if cached is None:
            cached = plain(self)
            object.__setattr__(self, "_hash", cached)
        return cached

    cls.__hash__ = __hash__
    return cls


@dataclass(frozen=True)
class Const:
    value: int | float | bool
    dtype: str

    def __init__(self, value: float | bool, dtype: str) -> None:
        d = self.__dict__
        d["value"], d["dtype"] = value, dtype


@dataclass(frozen=True)
class Var:
    name: str
    dtype: str

    def __init__(self, name: str, dtype: str) -> None:
        d = self.__dict__
        d["name"], d["dtype"] = name, dtype


@dataclass(frozen=True)
class Param:
    """A scalar argument of the kernel (``Kernel.scalars``): a size of the shape class a kernel
    shared across shapes is launched with (``codegen/size_args.py``). Integer ones are positive."""

    name: str
    dtype: str


@dataclass(frozen=True)
class Special:
    name: str
    dtype: str = "i32"


@_hash_once
@dataclass(frozen=True)
class Unary:
    op: str
    x: Expr
    dtype: str

    def __init__(self, op: str, x: Expr, dtype: str) -> None:
        d = self.__dict__
        d["op"], d["x"], d["dtype"] = op, x, dtype


@_hash_once
@dataclass(frozen=True)
class Binary:
    op: str
    a: Expr
    b: Expr
    dtype: str  # bool for comparisons

    def __init__(self, op: str, a: Expr, b: Expr, dtype: str) -> None:
        d = self.__dict__
        d["op"], d["a"], d["b"], d["dtype"] = op, a, b, dtype


@_hash_once
@dataclass(frozen=True)
class Select:
    cond: Expr
    a: Expr
    b: Expr
    dtype: str

    def __init__(self, cond: Expr, a: Expr, b: Expr, dtype: str) -> None:
        d = self.__dict__
        d["cond"], d["a"], d["b"], d["dtype"] = cond, a, b, dtype


@_hash_once
@dataclass(frozen=True)
class Cast:
    x: Expr
    dtype: str

    def __init__(self, x: Expr, dtype: str) -> None:
        d = self.__dict__
        d["x"], d["dtype"] = x, dtype


@_hash_once
@dataclass(frozen=True)
class Load:
    """``buffer[index]``: a global or shared element, in the buffer's storage type."""

    buffer: str
    index: Expr
    dtype: str

    def __init__(self, buffer: str, index: Expr, dtype: str) -> None:
        d = self.__dict__
        d["buffer"], d["index"], d["dtype"] = buffer, index, dtype


@_hash_once
@dataclass(frozen=True)
class Philox:
    """Word ``word`` (0..3) of Philox4x32-10 on counter (c0..c3) and key (k0, k1); all ``u32``."""

    counter: tuple[Expr, Expr, Expr, Expr]
    key: tuple[Expr, Expr]
    word: int
    dtype: str = "u32"


@_hash_once
@dataclass(frozen=True)
class Shuffle:
    """``__shfl_{kind}_sync(full mask, value, arg, width)``: a value from another lane of the warp."""

    kind: str
    value: Expr
    arg: Expr
    width: int
    dtype: str


Expr = Const | Var | Param | Special | Unary | Binary | Select | Cast | Load | Philox | Shuffle


# ----------------------------------------------------------------------------------------------
# Statements
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Let:
    """Declare register ``var`` initialised to ``value``."""

    var: Var
    value: Expr

    def __init__(self, var: Var, value: Expr) -> None:
        d = self.__dict__
        d["var"], d["value"] = var, value


@dataclass(frozen=True)
class Assign:
    var: Var
    value: Expr

    def __init__(self, var: Var, value: Expr) -> None:
        d = self.__dict__
        d["var"], d["value"] = var, value


@dataclass(frozen=True)
class Store:
    buffer: str
    index: Expr
    value: Expr  # already of the buffer's storage type


@dataclass(frozen=True)
class VecLoad:
    """``vars[i] = buffer[index + i]`` as one 128-bit load; ``index`` is a multiple of len(vars)."""

    vars: tuple[Var, ...]
    buffer: str
    index: Expr


@dataclass(frozen=True)
class VecStore:
    """``buffer[index + i] = values[i]`` as one 128-bit store; ``index`` is a multiple of len(values)."""

    buffer: str
    index: Expr
    values: tuple[Expr, ...]


@dataclass(frozen=True)
class For:
    """``for (var = start; var < stop; var += step) body``. ``kind`` is a hint for printers:
    ``serial``, ``unroll``, ``grid_stride`` or ``block_stride``; trip counts may differ per thread."""

    var: Var
    start: Expr
    stop: Expr
    step: Expr
    body: tuple[Stmt, ...]
    kind: str = "serial"


@dataclass(frozen=True)
class If:
    cond: Expr
    then: tuple[Stmt, ...]
    orelse: tuple[Stmt, ...] = ()


@dataclass(frozen=True)
class Barrier:
    """``__syncthreads()``: every thread of the block must reach it."""


@dataclass(frozen=True)
class Comment:
    text: str


@dataclass(frozen=True)
class Trap:
    """Stop the kernel with ``message``: an error of the program's inputs that eager rejects too
    (an index out of range). CUDA: ``printf`` and ``__trap()``, which fails the launch as torch's
    device-side asserts do; the simulator raises ``IndexError``. Each ``{}`` of the message is one
    of ``values``, printed as an integer: a size stays a constant of the tree, which a kernel shared
    across shapes takes as an argument (``codegen/size_args.py``), not text of the source."""

    message: str
    values: tuple[Expr, ...] = ()


Stmt = Let | Assign | Store | VecLoad | VecStore | For | If | Barrier | Comment | Trap


# ----------------------------------------------------------------------------------------------
# Buffers and the kernel
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Buffer:
    """A kernel parameter pointing at global memory, or a shared-memory array.

    ``extent`` is the number of elements the kernel may touch (for a strided tensor: the largest
    index it can address plus one). ``readonly`` buffers are printed ``const __restrict__``.
    ``aligned`` promises a 16-byte aligned base address (needed by ``VecLoad``/``VecStore``); the
    launcher checks it and falls back to a kernel without vector accesses when it does not hold.
    """

    name: str
    dtype: str
    extent: int
    space: str = "global"  # or "shared"
    readonly: bool = False
    aligned: bool = False
    noalias: bool = True  # printed __restrict__; False for an input and output sharing storage


@dataclass(frozen=True)
class Kernel:
    name: str
    params: tuple[Buffer, ...]
    body: tuple[Stmt, ...]
    threads: int
    blocks: int
    shared: tuple[Buffer, ...] = ()
    notes: tuple[str, ...] = field(default_factory=tuple)
    scalars: tuple[Param, ...] = ()  # scalar arguments, after the buffers

    def buffer(self, name: str) -> Buffer:
        for b in self.params + self.shared:
            if b.name == name:
                return b
        raise KeyError(f"kernel {self.name} has no buffer {name!r}")


# ----------------------------------------------------------------------------------------------
# Small constructors used by lowering (keep expressions readable there)
# ----------------------------------------------------------------------------------------------


def const(value: float | bool, dtype: str) -> Const:
    return Const(value, dtype)


def i64(value: int) -> Const:
    return Const(int(value), "i64")


def add(a: Expr, b: Expr) -> Expr:
    if isinstance(b, Const) and b.value == 0:
        return a
    if isinstance(a, Const) and a.value == 0:
        return b
    if isinstance(a, Const) and isinstance(b, Const):
        return Const(a.value + b.value, a.dtype)
    return Binary("add", a, b, a.dtype)


def mul(a: Expr, b: Expr) -> Expr:
    if isinstance(b, Const) and b.value == 1:
        return a
    if isinstance(a, Const) and a.value == 1:
        return b
    if (isinstance(a, Const) and a.value == 0) or (isinstance(b, Const) and b.value == 0):
        return Const(0, a.dtype)
    if isinstance(a, Const) and isinstance(b, Const):
        return Const(a.value * b.value, a.dtype)
    return Binary("mul", a, b, a.dtype)


def div(a: Expr, b: Expr) -> Expr:
    if isinstance(b, Const) and b.value == 1:
        return a
    return Binary("div", a, b, a.dtype)


def rem(a: Expr, b: Expr) -> Expr:
    if isinstance(b, Const) and b.value == 1:
        return Const(0, a.dtype)
    return Binary("rem", a, b, a.dtype)


def lt(a: Expr, b: Expr) -> Expr:
    return Binary("lt", a, b, "bool")


def land(a: Expr | None, b: Expr | None) -> Expr | None:
    """Logical and of two optional predicates (None means true)."""
    if a is None:
        return b
    if b is None:
        return a
    return Binary("and", a, b, "bool")
