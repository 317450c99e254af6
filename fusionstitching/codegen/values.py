"""Thread composition: the value of a graph node at a multi-index, as Kernel IR statements.

``ValueEmitter.value(node, index)`` appends to the current statement list whatever a thread must
execute to know ``node`` at ``index`` (a tuple of index expressions, one per dim) and returns an
expression holding it. Producers inside the pattern are recomputed in the consumer's thread
(thread composition): shape ops are pure index arithmetic, elementwise ops are register math,
a reduction used as a producer is a sequential loop. Values are cached per (node, index) within
the current scope, so a value used twice is computed once; a scope opens for each branch of a
predicated read (pad, concatenate), since a value computed inside a branch is not defined outside.

Registers hold f32 for f16/bf16 nodes; every half-typed node rounds its result to its type
(``Cast`` to the storage type and back), which is exactly what ``graph/reference.py`` does, so
simulated kernels match the reference bit for bit up to transcendental ulps.
"""

from __future__ import annotations

import math
from collections import ChainMap
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import numpy as np

from fusionstitching.codegen import kernel_ir as K
from fusionstitching.codegen.reshape import reshape_index, split_pair
from fusionstitching.graph.graph import Node
from fusionstitching.graph.ops import DType
from fusionstitching.graph.pattern import (
    PatternError,
    is_reduction,
    reduced_dims,
    reduction_kind,
    reduction_space,
)


class CodegenError(PatternError):
    """A pattern or schedule that this code generator cannot lower; names the node."""


class FootprintError(CodegenError):
    """A read of a sub-root's result that lowering cannot prove inside the block's footprint: the
    one refusal that depends on index expressions, so the only one that a probe lowering (symbolic
    THREAD indices) may make where the full lowering would not."""


class DataDependentRead(FootprintError):
    """A read of a sub-root in shared memory at an index computed from loaded data (a gather's):
    no footprint can be proven for it, and an elementwise sub-root is recomputed from the kernel's
    inputs at that index instead (``ValueEmitter.value``)."""


def register_type(dtype: DType) -> str:
    """The kernel type values of ``dtype`` are computed in: f32 for half types, i32 for narrow integers."""
    return dtype.compute.value


def rounded(value: K.Expr, dtype: DType) -> K.Expr:
    """``value`` (of ``register_type(dtype)``) rounded or wrapped to ``dtype`` and widened back."""
    return K.Cast(K.Cast(value, dtype.value), register_type(dtype))


def shared_value(value: K.Expr) -> K.Expr:
    """A sub-root's value as stored in shared memory, whose buffers are f32: a bool as 0 or 1 (read
    back as ``!= 0``), so that a mask computed once per row (a loss's ``target != ignore_index``)
    is stitched like the float values beside it."""
    return K.Cast(value, "f32") if value.dtype == "bool" else value


_REDUCE_INIT = {"sum": 0, "prod": 1}
_UNARY = {"neg", "abs", "not", "sign", "floor", "ceil", "exp", "log", "log1p", "expm1", "tanh", "erf",
          "sigmoid", "sqrt", "rsqrt", "sin", "cos"}
_APPROXIMATE = {"exp", "sigmoid"}  # ops with an approximate f32 form for half-bound values
_BINARY = {"add", "sub", "mul", "div", "rem", "pow", "max", "min", "and", "or", "xor"}
_COMPARE = {"EQ": "eq", "NE": "ne", "LT": "lt", "LE": "le", "GT": "gt", "GE": "ge"}


@dataclass
class InputBuffer:
    """How a pattern input is read: its kernel buffer and element strides (in-place, any layout)."""

    name: str
    node: Node
    strides: tuple[int, ...]


@dataclass(frozen=True)
class InRegisters:
    """A sub-root's result held in registers: each value this thread reduced, with its kept index
    (a consumer reads the one whose index is provably its own)."""

    root: Node
    values: tuple[tuple[Sequence[K.Expr], K.Expr], ...]


@dataclass(frozen=True)
class InShared:
    """A sub-root's result cached in shared memory: per dim, the block's base index, the extent and
    the stride of its tile, and the buffer."""

    root: Node
    bases: tuple[tuple[K.Expr, int, int], ...]
    buffer: K.Buffer


@dataclass
class _Guard:
    """An open guarded branch of a padded read: the statements and undo depth of the scope around
    it, the index expressions only its condition keeps in bounds, and the registers defined inside."""

    stmts: list
    depth: int
    guarded: frozenset | None  # None: a branch that is not a pad's (a concatenation's piece)
    inside: set
    # the registers and specials the guarded positions are made of: an index made of any of them
    # may be one of those positions rewritten (a reshape's index arithmetic simplifies
    # ``(8p + q) / 8`` to ``p``), so it reaches the guard even where no position appears in it
    variables: frozenset = frozenset()

    def reaches(self, index: Sequence[K.Expr], definitions: dict[str, K.Expr], memo: dict) -> bool:
        """Whether an index reads a guarded position, a register defined inside the guard, or a
        register or special the positions are made of (through the definitions of the index's
        registers). Every index reaches a branch that is not a pad's: its condition keeps in bounds
        index expressions made inside it (a concatenation's piece reads ``i - offset``), which no
        hoist may leave."""
        if self.guarded is None:
            return True
        return any(_mentions(e, self.guarded, self.inside) or bool(_uses(e, definitions, memo) & self.variables)
                   for e in index)


def _uses(e: K.Expr, definitions: dict[str, K.Expr], memo: dict) -> frozenset:
    """The registers and specials ``e`` is made of, through the definitions of its registers."""
    kind = type(e)
    if kind is K.Const:
        return frozenset()
    if kind is K.Special:
        return frozenset((e.name,))
    if kind is K.Var:
        found = memo.get(e.name)
        if found is None:
            memo[e.name] = frozenset((e.name,))  # a register defined through itself stops here
            definition = definitions.get(e.name)
            found = frozenset((e.name,)) | (_uses(definition, definitions, memo) if definition is not None else frozenset())
            memo[e.name] = found
        return found
    return frozenset().union(*(_uses(c, definitions, memo) for c in _operands(e)))


def _names(e: K.Expr) -> frozenset:
    """The registers and specials written in ``e`` (no definitions followed)."""
    kind = type(e)
    if kind is K.Var or kind is K.Special:
        return frozenset((e.name,))
    if kind is K.Const:
        return frozenset()
    return frozenset().union(*(_names(c) for c in _operands(e)))


def _operands(e: K.Expr) -> Iterator[K.Expr]:
    """The expressions ``e`` is made of (its fields that are expressions, tuples of them included)."""
    for child in vars(e).values():
        for c in child if isinstance(child, tuple) else (child,):
            if hasattr(c, "dtype") and not isinstance(c, str):
                yield c


def _mentions(e: K.Expr, exprs: frozenset, names: set) -> bool:
    if e in exprs:
        return True
    kind = type(e)
    if kind is K.Var:
        return e.name in names
    if kind is K.Const or kind is K.Special:
        return False
    return any(_mentions(c, exprs, names) for c in _operands(e))


@dataclass
class ValueEmitter:
    inputs: dict[int, InputBuffer]  # id(node) → buffer, for pattern inputs
    pattern: set[int]  # ids of the nodes computed inside the kernel
    index_type: str
    stmts: list[K.Stmt] = field(default_factory=list)
    definitions: dict[str, K.Expr] = field(default_factory=dict)  # register → its defining expression
    # register → exclusive bound, for registers that index a reshape's dims (a valid index is below
    # its dim's size; ``reshape.reshape_index`` proves splits of merges exact with them)
    index_bounds: dict[str, int] = field(default_factory=dict)
    factor_ranges: dict[str, int] = field(default_factory=dict)  # the loop nest's factor registers' extents
    sub_roots: dict[int, InRegisters | InShared] = field(default_factory=dict)  # earlier groups' results
    reader: Callable | None = None  # reads a sub-root's result: reader(result, index, consumer)
    current: str = ""  # the group being emitted, for error messages
    origins: dict[str, str] = field(default_factory=dict)  # node → its FX node and ATen op (``Graph.origins``)
    mutable: set[str] = field(default_factory=set)  # registers assigned after their Let (accumulators)
    shared_buffers: set[str] = field(default_factory=set)  # rewritten between barriers
    # ids of the nodes whose exp and sigmoid take the approximate instructions (``precision.py``)
    approximate: frozenset[int] = frozenset()
    # Values and let-bindings visible in the current scope, in one table; each open nested scope
    # keeps what it shadowed or added (``_undo``) and restores it when it closes, so a lookup is one
    # dict probe whatever the nesting depth.
    _table: dict = field(default_factory=dict)
    _undo: list[list] = field(default_factory=list)
    _pure_memo: dict = field(default_factory=dict)
    _consts: dict = field(default_factory=dict)  # index constants by value, built once
    affine_forms: dict = field(default_factory=dict)  # register → its affine form (``vectorize.affine``'s memo)
    _counter: int = 0
    # Open guarded branches, outermost first (``_Guard``): values that depend on no padded position
    # of a pad's guard, nor on anything inside it, are computed before the guard (``_hoisted``).
    _guards: list = field(default_factory=list)
    _uses_memo: dict = field(default_factory=dict)  # register → what it is made of (``_uses``)

    # -- statement plumbing -------------------------------------------------------------------
    def fresh(self, base: str, dtype: str) -> K.Var:
        self._counter += 1
        var = K.Var(f"{base}{self._counter}", dtype)
        for guard in self._guards:
            guard.inside.add(var.name)
        return var

    def accumulator(self, base: str, dtype: str) -> K.Var:
        """A register that is assigned again after its Let (so never reused by ``let``)."""
        var = self.fresh(base, dtype)
        self.mutable.add(var.name)
        return var

    def let(self, base: str, value: K.Expr) -> K.Expr:
        """Bind ``value`` to a register; an identical pure expression bound earlier in scope is reused."""
        if isinstance(value, (K.Const, K.Var, K.Special)):
            return value
        # Every binding is recorded; purity is asked only of a hit (most bindings are never hit),
        # and an impure hit is bound again, as if it had not been recorded.
        key = ("let", value)
        bound = self._table.get(key)
        if bound is not None and self._pure(value):
            return bound
        var = self.fresh(base, value.dtype)
        self.stmts.append(K.Let(var, value))
        self.definitions[var.name] = value
        self._bind(key, var, bound)
        return var

    def _bind(self, key, value, shadowed) -> None:
        """Make ``key`` mean ``value`` until the innermost open scope closes (``shadowed``: what
        it meant before, or None)."""
        if self._undo:
            self._undo[-1].append((key, shadowed))
        self._table[key] = value

    def _pure(self, e: K.Expr) -> bool:
        """Whether an expression's value depends only on registers that never change: no shuffles,
        no shared-memory reads (rewritten between barriers), no accumulators. Memoized per
        expression object: a register is an accumulator from its creation on, and a shared buffer
        is registered before anything loads from it, so an answer never changes."""
        hit = self._pure_memo.get(id(e))
        if hit is not None and hit[0] is e:
            return hit[1]
        result = self._pure_uncached(e)
        self._pure_memo[id(e)] = (e, result)
        return result

    def _pure_uncached(self, e: K.Expr) -> bool:
        kind = type(e)
        if kind is K.Var:
            return e.name not in self.mutable
        if kind is K.Const or kind is K.Special:
            return True
        if kind is K.Binary:
            return self._pure(e.a) and self._pure(e.b)
        if kind is K.Unary or kind is K.Cast:
            return self._pure(e.x)
        if kind is K.Select:
            return self._pure(e.cond) and self._pure(e.a) and self._pure(e.b)
        if kind is K.Shuffle:
            return False
        if kind is K.Load:
            return e.buffer not in self.shared_buffers and self._pure(e.index)
        if not hasattr(e, "__dict__"):
            raise TypeError(f"not an expression: {e!r} ({type(e).__name__})")
        for child in vars(e).values():
            children = child if isinstance(child, tuple) else (child,)
            if any(hasattr(c, "dtype") and not isinstance(c, str) and not self._pure(c) for c in children):
                return False
        return True

    def nested(self, body: Callable[[], K.Expr | None]) -> tuple[list[K.Stmt], K.Expr | None]:
        """Run ``body`` collecting its statements in a new scope; returns them and its result. The
        index bounds recorded in the scope (``bound``) end with it: an index is below a shape's
        size only where the scope's guards hold (a group of one row bounds the warp register by 1
        inside its guard; the next group's rows run on every warp)."""
        saved = self.stmts
        saved_bounds = dict(self.index_bounds)
        self.stmts = []
        self._undo.append([])
        try:
            result = body()
            return self.stmts, result
        finally:
            table = self._table
            for key, shadowed in reversed(self._undo.pop()):
                if shadowed is None:
                    del table[key]
                else:
                    table[key] = shadowed
            self.stmts = saved
            self.index_bounds.clear()
            self.index_bounds.update(saved_bounds)

    def idx(self, value: int) -> K.Const:
        const = self._consts.get(value)
        if const is None:
            const = self._consts[value] = K.Const(int(value), self.index_type)
        return const

    # -- values ---------------------------------------------------------------------------------
    def value(self, node: Node, index: Sequence[K.Expr]) -> K.Expr:
        index = tuple(index)
        key = (id(node), index)
        result = self._table.get(key)
        if result is not None:
            return result
        if self._guards and not is_reduction(node) and id(node) not in self.sub_roots:
            outermost = None  # the outermost guard that neither it nor any guard inside it reaches
            for k in range(len(self._guards) - 1, -1, -1):
                if self._guards[k].reaches(index, self.definitions, self._uses_memo):
                    break
                outermost = k
            if outermost is not None:
                return self._hoisted(outermost, node, index)
        entry = self.sub_roots.get(id(node))
        if entry is not None:
            try:
                result = self.reader(entry, index, self.current)
            except DataDependentRead:
                if is_reduction(node):
                    raise
                # A loss gathering one logit per row from the row's stitched logits: one load of
                # the GEMM output and the bias, where a footprint cannot be proven.
                result = self._compute(node, index)
        else:
            result = self._compute(node, index)
        self._bind(key, result, None)
        return result

    def _compute(self, node: Node, index: tuple[K.Expr, ...]) -> K.Expr:
        if id(node) in self.inputs:
            return self._load_input(self.inputs[id(node)], index)
        if id(node) not in self.pattern and node.op != "constant":
            raise CodegenError(f"node {node.name} is neither in the pattern nor an input")
        handler = getattr(self, f"_op_{node.op}", None)
        if handler is None:
            if node.op in _UNARY:
                rtype = register_type(node.dtype)
                op = f"{node.op}_approx" if node.op in _APPROXIMATE and rtype == "f32" \
                    and id(node) in self.approximate else node.op
                return self._round(node, K.Unary(op, self.value(node.operands[0], index), rtype))
            if node.op in _BINARY:
                a, b = (self.value(x, index) for x in node.operands)
                return self._round(node, K.Binary(node.op, a, b, register_type(node.dtype)))
            raise CodegenError(f"node {node.name}: {node.op} is not supported by thread composition")
        return handler(node, index)

    def _round(self, node: Node, value: K.Expr) -> K.Expr:
        """Bind ``value``; for half types, round it to the node's dtype first (one rounding per node),
        and wrap a narrow integer to its width."""
        if node.dtype.widened:
            value = rounded(value, node.dtype)
        return self.let("v", value)

    def stored(self, value: K.Expr, dtype: DType) -> K.Expr:
        """``value`` as written to a buffer of ``dtype``: half types are rounded on the store. A value
        that ``_round`` already rounded to that type is stored from before its round trip back to
        f32 (rounding twice to one type is rounding once), which spares two conversions per
        element of a half output; only when that expression is pure (``_pure``: an accumulator
        may have changed since the value was bound)."""
        if not dtype.widened:
            return value
        definition = self.definitions.get(value.name) if type(value) is K.Var else None
        if type(definition) is K.Cast and type(definition.x) is K.Cast and definition.x.dtype == dtype.value \
                and self._pure(definition.x):
            return definition.x
        return K.Cast(value, dtype.value)

    def linear(self, index: Sequence[K.Expr], strides: Sequence[int]) -> K.Expr:
        """``sum(index[d] * strides[d])``, with a pair ``x / n``, ``x % n`` over strides ``n * s``, ``s``
        (a dim split by a reshape and read from memory where the two dims are contiguous) summed as
        ``x * s``: the vectorizer then sees the index as affine in ``x``'s lanes."""
        terms = list(zip(index, strides))
        merged: list[tuple[K.Expr, int]] = []
        for i, s in terms:
            if merged and s and merged[-1][1] % s == 0:
                whole = split_pair(merged[-1][0], i, merged[-1][1] // s, self.definitions, self.mutable)
                if whole is not None:
                    merged[-1] = (whole, s)
                    continue
            merged.append((i, s))
        total: K.Expr = self.idx(0)
        for i, s in merged:
            total = K.add(total, K.mul(i, self.idx(s)))
        return total

    def _load_input(self, buf: InputBuffer, index: tuple[K.Expr, ...]) -> K.Expr:
        node = buf.node
        loaded = K.Load(buf.name, self.linear(index, buf.strides), node.dtype.value)
        if node.dtype.widened:
            return self.let("ld", K.Cast(loaded, register_type(node.dtype)))
        return self.let("ld", loaded)

    # -- per-op rules ---------------------------------------------------------------------------
    def _op_constant(self, node: Node, index):
        value = node.attrs["value"]
        if value.ndim != 0:
            raise CodegenError(f"node {node.name}: non-scalar constants must be kernel inputs")
        scalar = value.item()
        if node.dtype.is_half:
            scalar = float(scalar)
        elif node.dtype.is_narrow:
            scalar = int(scalar)
        return K.Const(scalar, register_type(node.dtype))

    def _op_convert(self, node: Node, index):
        x = self.value(node.operands[0], index)
        src, dst = node.operands[0].dtype, node.dtype
        if dst == DType.BOOL and src != DType.BOOL:
            zero = K.Const(0.0 if src.is_float else 0, register_type(src))
            return self.let("v", K.Binary("ne", x, zero, "bool"))
        if dst.is_narrow:  # straight to the narrow type: from a float through i64 (``graph/reference.py``)
            return self.let("v", rounded(x, dst))
        return self._round(node, K.Cast(x, register_type(dst)))

    def _op_copy(self, node: Node, index):
        return self.value(node.operands[0], index)

    def _op_compare(self, node: Node, index):
        a, b = (self.value(x, index) for x in node.operands)
        return self.let("v", K.Binary(_COMPARE[node.attrs["direction"]], a, b, "bool"))

    def _op_select(self, node: Node, index):
        c, a, b = (self.value(x, index) for x in node.operands)
        return self.let("v", K.Select(c, a, b, register_type(node.dtype)))

    def _op_div(self, node: Node, index):
        """An f32 quotient is the product with the divisor's reciprocal, in every kernel: a divisor
        uniform along a reduced row (a reduction's result, broadcast) then costs one reciprocal per
        row instead of a division per element, and a value recomputed in another kernel (a backward
        graph's rematerialization, where the divisor is a saved input, no longer a reduction) has
        the same bits as where it was first computed, which equality tests on it (the gradient of
        amax) rely on. ≤ 1.5 ulp instead of 0.5; a divisor below the smallest normal f32 is scaled by
        2^64 first (and the dividend with it, exactly), so its reciprocal stays finite."""
        a, b = (self.value(x, index) for x in node.operands)
        if register_type(node.dtype) != "f32":
            return self._round(node, K.Binary("div", a, b, register_type(node.dtype)))
        if isinstance(b, K.Const) and np.isfinite(b.value) and abs(b.value) >= 2.0 ** -126:
            # a constant divisor: its reciprocal (correctly rounded, as the GPU's) is a constant too
            inverse = float(np.float32(1) / np.float32(b.value))
            return self._round(node, K.Binary("mul", a, K.Const(inverse, "f32"), "f32"))
        tiny = K.Binary("lt", K.Unary("abs", b, "f32"), K.Const(2.0 ** -126, "f32"), "bool")
        scale = self.let("v", K.Select(tiny, K.Const(2.0 ** 64, "f32"), K.Const(1.0, "f32"), "f32"))
        inverse = self.let("v", K.Unary("rcp", K.Binary("mul", b, scale, "f32"), "f32"))
        return self._round(node, K.Binary("mul", K.Binary("mul", a, scale, "f32"), inverse, "f32"))

    def _op_broadcast_in_dim(self, node: Node, index):
        (x,) = node.operands
        dims = node.attrs["broadcast_dimensions"]
        return self.value(x, tuple(self.idx(0) if x.shape[i] == 1 else index[d] for i, d in enumerate(dims)))

    def _op_transpose(self, node: Node, index):
        (x,) = node.operands
        inner: list[K.Expr] = [self.idx(0)] * len(x.shape)
        for i, p in enumerate(node.attrs["permutation"]):
            inner[p] = index[i]
        return self.value(x, tuple(inner))

    def _op_slice(self, node: Node, index):
        (x,) = node.operands
        start, stride = node.attrs["start"], node.attrs["stride"]
        return self.value(x, tuple(K.add(K.mul(i, self.idx(st)), self.idx(lo))
                                   for i, lo, st in zip(index, start, stride)))

    def _op_reshape(self, node: Node, index):
        """The operand's index, each dim bound to a register: a split back to the rows of another
        group (a stitched partial's [blocks, rows, cols] → [blocks·rows, cols]) then reads the very
        index registers that group bound, and the values it computed are reused (``value`` is
        cached by (node, index))."""
        (x,) = node.operands
        self.bound(index, node.shape)
        bounds = ChainMap(self.index_bounds, self.factor_ranges)
        parts = tuple(self.let("i", i) for i in reshape_index(index, node.shape, x.shape, self.idx,
                                                              self.definitions, bounds))
        self.bound(parts, x.shape)
        return self.value(x, parts)

    def bound(self, index: Sequence[K.Expr], shape: Sequence[int]) -> None:
        """Record that the registers of ``index`` are below ``shape``'s sizes (``index_bounds``)."""
        for i, size in zip(index, shape):
            if isinstance(i, K.Var) and i.name not in self.mutable:
                self.index_bounds[i.name] = min(size, self.index_bounds.get(i.name, size))

    def _op_iota(self, node: Node, index):
        return K.Cast(index[node.attrs["dimension"]], register_type(node.dtype))

    def _op_gather(self, node: Node, index):
        x, indices = node.operands
        axis, batch = node.attrs["axis"], node.attrs["batch_dims"]
        k = len(indices.shape) - batch
        idx_index = index[:batch] + index[axis : axis + k]
        raw = self.value(indices, idx_index)
        size = self.idx(x.shape[axis] - 1)
        # An index out of range stops the kernel, as eager's indexing raises; it is checked in the
        # index's own type (an i64 index of 2^32 must not wrap into range). Other threads may still
        # read before the launch fails: indices are clamped too, so no thread reads outside the operand.
        rtype = register_type(indices.dtype)
        outside = K.Binary("or", K.Binary("lt", raw, K.Const(0, rtype), "bool"),
                           K.Binary("ge", raw, K.Const(x.shape[axis], rtype), "bool"), "bool")
        origin = self.origins.get(node.name, node.name)
        where = f"index out of range in {origin} (dim {axis} of {x.name}".replace("{", "(").replace("}", ")")  # no placeholder
        self.stmts.append(K.If(outside, (K.Trap(where + ", size {})", (K.Const(x.shape[axis], "i64"),)),)))
        position = self.let("g", K.Binary("min", K.Binary("max", K.Cast(raw, self.index_type), self.idx(0),
                                                          self.index_type), size, self.index_type))
        operand_index = index[:axis] + (position,) + index[axis + k :]
        return self.value(x, operand_index)

    def _guarded(self, node: Node, cond: K.Expr, inside: Callable[[], K.Expr], otherwise: Callable[[], K.Expr],
                 guarded: tuple[K.Expr, ...] = ()):
        """``cond ? inside() : otherwise()`` with each side evaluated only where it is taken.
        ``guarded``: the index expressions only ``cond`` keeps in bounds (a pad's positions in its
        padded dims); values that read none of them are computed before the branch, once for all
        the guarded reads of a thread (``_hoisted``)."""
        result = self.accumulator("p", register_type(node.dtype))
        variables = frozenset().union(*(_names(e) for e in guarded)) if guarded else frozenset()
        self._guards.append(_Guard(self.stmts, len(self._undo), frozenset(guarded) if guarded else None, set(),
                                   variables))
        try:
            then_stmts, then_value = self.nested(inside)
        finally:
            self._guards.pop()
        if guarded:
            else_stmts, else_value = self.nested(otherwise)
        else:  # the other side of a plain branch is guarded by the negated condition
            self._guards.append(_Guard(self.stmts, len(self._undo), None, set()))
            try:
                else_stmts, else_value = self.nested(otherwise)
            finally:
                self._guards.pop()
        self.stmts.append(K.Let(result, K.Const(0, result.dtype) if result.dtype != "bool" else K.Const(False, "bool")))
        self.stmts.append(K.If(cond, tuple(then_stmts) + (K.Assign(result, then_value),),
                               tuple(else_stmts) + (K.Assign(result, else_value),)))
        return result

    def _op_pad(self, node: Node, index):
        (x,) = node.operands
        low, high, interior = node.attrs["low"], node.attrs["high"], node.attrs["interior"]
        pad_value = K.Const(node.attrs["value"] if node.dtype.is_float else int(node.attrs["value"]),
                            register_type(node.dtype))
        cond, inner, constant = None, [], []
        for i, lo, hi, it, size in zip(index, low, high, interior, x.shape):
            step = it + 1
            if type(i) is K.Const:  # a position known here (an unrolled copy's): decided now, no test
                shifted = int(i.value) - lo
                if shifted < 0 or shifted > (size - 1) * step or shifted % step:
                    return pad_value
                inner.append(self.idx(shifted // step))
                constant.append(True)
                continue
            constant.append(False)
            # ``i`` is in [0, lo + (size - 1) * step + 1 + hi): a bound the padding cannot cross
            # (no low edge, no high edge) holds without a test
            shifted = K.Binary("sub", i, self.idx(lo), self.index_type) if lo else i
            position = K.div(shifted, self.idx(step)) if step > 1 else shifted
            if lo > 0:
                cond = K.land(cond, K.Binary("ge", shifted, self.idx(0), "bool"))
            if hi > 0:
                cond = K.land(cond, K.lt(shifted, self.idx((size - 1) * step + 1)))
            if step > 1:
                cond = K.land(cond, K.Binary("eq", K.rem(shifted, self.idx(step)), self.idx(0), "bool"))
            inner.append(position)
        if cond is None:
            return self.value(x, tuple(inner))
        padded = tuple(position for position, lo, hi, it, known in zip(inner, low, high, interior, constant)
                       if (lo or hi or it) and not known)
        return self._guarded(node, cond, lambda: self.value(x, tuple(inner)), lambda: pad_value, padded)

    def _hoisted(self, k: int, node: Node, index: tuple[K.Expr, ...]) -> K.Expr:
        """``node`` at ``index`` computed before the ``k``-th open guard, in the scope around it, as
        if the guard had not been opened yet: a max pooling's window reads the BatchNorm before it at
        nine padded positions, and the per-channel scale (a square root and a reciprocal) would
        otherwise be computed in each of the nine branches, which the compiler cannot merge."""
        guard = self._guards[k]
        saved_stmts, saved_guards = self.stmts, self._guards
        inner = self._undo[guard.depth:]
        shadowed = []  # the bindings of the scopes inside the guard, taken back for the hoist
        for entries in reversed(inner):
            for key, before in reversed(entries):
                shadowed.append((key, self._table.get(key)))
                if before is None:
                    self._table.pop(key, None)
                else:
                    self._table[key] = before
        del self._undo[guard.depth:]
        self.stmts, self._guards = guard.stmts, self._guards[:k]
        outer = self._undo[-1] if self._undo else None
        recorded = len(outer) if outer is not None else 0
        try:
            result = self.value(node, index)
        finally:
            self.stmts, self._guards = saved_stmts, saved_guards
            # A key the hoist bound in the scope around the guard that a scope inside it binds too:
            # that inner scope, when it closes, restores the hoisted binding (it recorded the key
            # as absent), and the outer scope's own record removes it once, when it closes.
            hoisted = {key: self._table[key] for key, _ in (outer[recorded:] if outer is not None else ())}
            for entries in inner:
                for n, (key, before) in enumerate(entries):
                    if key in hoisted:
                        entries[n] = (key, hoisted.pop(key))
            self._undo.extend(inner)
            for key, value in reversed(shadowed):
                if value is None:
                    self._table.pop(key, None)
                else:
                    self._table[key] = value
        return result

    def _op_concatenate(self, node: Node, index):
        dim = node.attrs["dimension"]
        pieces = list(node.operands)
        starts = [0]
        for x in pieces:
            starts.append(starts[-1] + x.shape[dim])

        def part(lo: int, hi: int) -> K.Expr:
            """Pieces lo..hi-1, split in halves: nested guards log2(n) deep, so a concatenation of
            hundreds of pieces (a stacked gradient) does not nest hundreds of scopes."""
            if hi - lo == 1:
                offset = starts[lo]
                shifted = K.Binary("sub", index[dim], self.idx(offset), self.index_type) if offset else index[dim]
                return self.value(pieces[lo], index[:dim] + (shifted,) + index[dim + 1 :])
            mid = (lo + hi) // 2
            return self._guarded(node, K.lt(index[dim], self.idx(starts[mid])),
                                 lambda: part(lo, mid), lambda: part(mid, hi))

        return part(0, len(pieces))

    def term(self, node: Node, point: Sequence[K.Expr]) -> K.Expr:
        """The element a reduction folds in at ``point`` of its iteration space (``reduction_space``)."""
        if node.op == "reduce":
            return self.value(node.operands[0], tuple(point))
        lhs, rhs = node.operands
        a = node.attrs
        n_batch, n_out = len(a["lhs_batch"]), len(node.shape)
        lhs_free = [d for d in range(len(lhs.shape)) if d not in a["lhs_batch"] + a["lhs_contract"]]
        rhs_free = [d for d in range(len(rhs.shape)) if d not in a["rhs_batch"] + a["rhs_contract"]]
        contract = point[n_out:]
        lhs_index: list[K.Expr] = [self.idx(0)] * len(lhs.shape)
        rhs_index: list[K.Expr] = [self.idx(0)] * len(rhs.shape)
        for k, (dl, dr) in enumerate(zip(a["lhs_batch"], a["rhs_batch"])):
            lhs_index[dl] = rhs_index[dr] = point[k]
        for k, d in enumerate(lhs_free):
            lhs_index[d] = point[n_batch + k]
        for k, d in enumerate(rhs_free):
            rhs_index[d] = point[n_batch + len(lhs_free) + k]
        for k, (dl, dr) in enumerate(zip(a["lhs_contract"], a["rhs_contract"])):
            lhs_index[dl] = rhs_index[dr] = contract[k]
        product = K.Binary("mul", self.value(lhs, tuple(lhs_index)), self.value(rhs, tuple(rhs_index)),
                           register_type(node.dtype))
        return self.let("m", product)

    def _reduction(self, node: Node, index):
        """A reduction used inside a thread: a sequential loop over the reduced dims."""
        space, dims, kind = reduction_space(node), reduced_dims(node), reduction_kind(node)
        rtype = register_type(node.dtype)
        acc = self.accumulator("acc", rtype)
        self.stmts.append(K.Let(acc, reduce_identity(kind, node.dtype)))
        loop_vars = {d: self.fresh(f"r{d}_", self.index_type) for d in dims}
        it = iter(index)
        point = tuple(loop_vars[d] if d in loop_vars else next(it) for d in range(len(space)))

        def body() -> None:
            self.stmts.append(K.Assign(acc, combine(kind, acc, self.term(node, point), rtype)))

        stmts, _ = self.nested(body)
        for d in reversed(dims):
            stmts = [K.For(loop_vars[d], self.idx(0), self.idx(space[d]), self.idx(1), tuple(stmts))]
        self.stmts.extend(stmts)
        return self._round(node, acc)

    _op_reduce = _reduction
    _op_dot_general = _reduction

    def _op_rng_uniform(self, node: Node, index):
        """Element ``i`` is word ``i % 4`` of the Philox block ``i // 4`` (``graph/reference.py``).
        When the row-major index is provably ``base + c`` with ``base`` a multiple of 4 (a thread's
        vector of 4 or 8 consecutive elements), the block is ``base / 4 + c // 4`` and the word the
        constant ``c % 4``: the elements of one block share one counter, so one Philox evaluation
        serves four elements (it dominates a dropout kernel's instructions otherwise)."""
        seed_node, offset_node, stream_node = node.operands
        seed = self.value(seed_node, ())
        offset = self.value(offset_node, ())
        stream = self.value(stream_node, (self.idx(0),))  # read, not inlined: one source for every stream
        linear = self.linear(index, _row_major(node.shape))
        split = self._aligned(linear, 4)
        if split is not None:
            base, c = split
            quad = K.add(K.Binary("shr", K.Cast(base, "u64"), K.Const(2, "u64"), "u64"), K.Const(c // 4, "u64"))
            word: K.Expr | int = c % 4
        else:
            wide = K.Cast(linear, "u64")
            quad = K.Binary("shr", wide, K.Const(2, "u64"), "u64")
            word = K.Cast(K.Binary("and", wide, K.Const(3, "u64"), "u64"), "u32")
        counter = (K.Cast(quad, "u32"), K.Cast(K.Cast(stream, "u64"), "u32"),
                   K.Cast(K.Cast(offset, "u64"), "u32"),
                   K.Cast(K.Binary("shr", K.Cast(offset, "u64"), K.Const(32, "u64"), "u64"), "u32"))
        key = (K.Cast(K.Cast(seed, "u64"), "u32"),
               K.Cast(K.Binary("shr", K.Cast(seed, "u64"), K.Const(32, "u64"), "u64"), "u32"))
        counter = tuple(self.let("c", c) for c in counter)
        key = tuple(self.let("k", k) for k in key)
        if isinstance(word, int):
            bits: K.Expr = K.Philox(counter, key, word)
        else:
            word = self.let("w", word)
            bits = K.Philox(counter, key, 3)
            for w in (2, 1, 0):
                bits = K.Select(K.Binary("eq", word, K.Const(w, "u32"), "bool"), K.Philox(counter, key, w), bits,
                                "u32")
        bits = self.let("bits", bits)
        top = K.Cast(K.Binary("shr", bits, K.Const(8, "u32"), "u32"), "f32")
        uniform = K.Binary("mul", top, K.Const(2.0**-24, "f32"), "f32")
        if node.dtype == DType.F32:
            return self.let("u", uniform)
        return self._round(node, K.Cast(uniform, register_type(node.dtype)))

    def _aligned(self, e: K.Expr, m: int) -> tuple[K.Expr, int] | None:
        """``(base, c)`` with ``e == base + c`` and ``base`` provably a multiple of ``m`` (index
        arithmetic: sums, products with constants, registers bound to such expressions), or None.
        ``base`` is spelled out through registers, so that the elements of one vector get the same
        ``base`` expression."""
        if isinstance(e, K.Const):
            return K.Const(0, e.dtype), int(e.value)
        if isinstance(e, K.Var):
            definition = self.definitions.get(e.name)
            if definition is None or e.name in self.mutable:
                return None
            return self._aligned(definition, m)
        if not isinstance(e, K.Binary):
            return None
        if e.op == "add":
            a, b = self._aligned(e.a, m), self._aligned(e.b, m)
            if a is None or b is None:
                return None
            return K.add(a[0], b[0]), a[1] + b[1]
        if e.op == "mul":
            for x, y in ((e.a, e.b), (e.b, e.a)):
                if isinstance(y, K.Const):
                    if int(y.value) % m == 0:
                        return e, 0
                    split = self._aligned(x, m)
                    if split is None:
                        return None
                    return K.mul(split[0], y), split[1] * int(y.value)
            for x in (e.a, e.b):
                split = self._aligned(x, m)
                if split is not None and split[1] % m == 0:
                    return e, 0
        return None


def _row_major(shape: Sequence[int]) -> tuple[int, ...]:
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= size
    return tuple(reversed(strides))


def reduce_identity(kind: str, dtype: DType) -> K.Const:
    rtype = register_type(dtype)
    if kind in _REDUCE_INIT:
        value = _REDUCE_INIT[kind]
        if dtype == DType.BOOL:
            return K.Const(bool(value), "bool")
        return K.Const(float(value) if dtype.is_float else value, rtype)
    if dtype == DType.BOOL:
        return K.Const(kind == "min", "bool")
    if dtype.is_float:
        return K.Const(-math.inf if kind == "max" else math.inf, rtype)
    info = np.iinfo(dtype.numpy)  # the type's own bounds (a narrow integer's, not its i32 register's)
    return K.Const(int(info.min) if kind == "max" else int(info.max), rtype)


def combine(kind: str, acc: K.Expr, value: K.Expr, rtype: str) -> K.Expr:
    if rtype == "bool":
        op = {"sum": "or", "max": "or", "prod": "and", "min": "and"}[kind]
        return K.Binary(op, acc, value, "bool")
    op = {"sum": "add", "prod": "mul", "max": "max", "min": "min"}[kind]
    return K.Binary(op, acc, value, rtype)
