"""The random program generator: program k of seed S, the same on every run.

``generate(seed, k, features)`` draws a program from ``random.Random(f"fuzz:{S}:{k}")``: a float
dtype (f32, bf16, f16) or an integer/bool program, a base shape from the sizes that break kernels
(0, 1, primes, 2^k ± 1, rows shorter than a warp, rows longer than a block), then 3–12 steps, each
from an op family picked by weight (``FAMILIES``): light and expensive elementwise ops, comparisons,
``where``, conversions, broadcasts, reductions over any dims (keepdim or not, to a scalar),
softmax, layer and RMS norms, reshapes, transposes, slices, cat/stack, pads, gathers
(``index_select``, ``gather``, ``embedding``, ``x[idx]``), small matmuls, ``arange``/``full_like`` and
in-place ops on inputs (``mul_``, ``copy_``, a slice's ``fill_``). Inputs come contiguous or, a
quarter of them, transposed, at a storage offset, strided or expanded (``programs.LAYOUTS``).
The values no step uses are the outputs; a float program usually also gets a backward, and 30 %
of the programs call the compiled function twice (a later call takes a specialization's lean path).

Numerics. Each value carries a bound on its magnitude; an op that would overflow it is drawn in
a squashed form (``exp(tanh(x))``) or not at all, and log/sqrt/rsqrt/div/pow get a domain that
keeps them finite. Only *exact* values — inputs, and what abs, neg, max/min, where, shape ops,
gathers and conversions from bool or int make of them — are compared or truncated to integers:
the compiled program computes half types in f32 between stores, so a comparison of a computed
value could flip on a rounding difference that is no bug.

``features`` switches parts of the generator off by name (``FEATURES``): an op family, or one of
the special cases ``empty`` (size-0 dims), ``scalar_after_row`` (a reduction to a scalar of a
value computed from a reduction), ``expand_output`` (returning an ``expand``ed tensor),
``out_of_range`` (an index out of range: eager raises, the compiled program must too),
``long_rows`` (a dim of 1025–3001), ``backward`` and ``layouts`` (inputs that are not contiguous).
A special case switched off leaves the rest of the program as it was (``_Builder.chance``), so
``--skip empty`` runs program k of seed S without its size-0 dims, and a GPU run (which leaves out
``out_of_range``) runs the CPU's programs.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace

from fusionstitching.fuzz.programs import (
    FLOAT_DTYPES,
    LAYOUTS,
    Dim,
    Input,
    Program,
    Shape,
    Step,
    concrete,
    live,
    used_symbols,
)

ONE = Dim.const(1)
ELEMENT_CAP = 4096  # elements of any value
LONG_ELEMENT_CAP = 6200  # ... of a program with a long row
PRIMES = (2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37, 61, 97, 127, 251, 509)
POW2_PM1 = (3, 5, 7, 9, 15, 17, 31, 33, 63, 65, 127, 129, 255, 257, 511, 513)
POW2 = (2, 4, 8, 16, 32, 64, 128, 256, 512)
LONG_ROWS = (1025, 1031, 1500, 2047, 2049, 3001)
SPECIAL = ("empty", "scalar_after_row", "expand_output", "out_of_range", "long_rows", "backward", "layouts")
FAMILY_WEIGHTS = {
    "elementwise": 20, "expensive": 18, "compare": 5, "where": 5, "convert": 4, "broadcast": 3,
    "reduce": 13, "reduce_all": 4, "softmax": 4, "norm": 4, "reshape": 5, "transpose": 5, "slice": 5,
    "cat": 3, "pad": 3, "gather": 6, "matmul": 3, "creation": 2, "inplace": 3, "loss": 3,
}
FAMILIES = tuple(FAMILY_WEIGHTS)
VIEWS = ("reshape", "transpose", "slice", "broadcast", "inplace")  # categories whose ops may return a view
FEATURES = FAMILIES + SPECIAL
# Magnitude past which a value is squashed before an op that grows it; half types overflow sooner.
BOUND_LIMIT = {"float32": 1e5, "bfloat16": 1e3, "float16": 1e3}
INT_BOUND_LIMIT = 1e6
# Narrow integer dtypes wrap: a value whose bound exceeds its type's range is anywhere in it (a
# uint8 anywhere in [0, 255], since a negative result wraps to a large one); their inputs span the
# range (int16 a part of it) so that arithmetic on them wraps.
NARROW_RANGE = {"uint8": 255.0, "int8": 128.0, "int16": 32768.0}
NARROW_INPUT_BOUND = {"uint8": 255.0, "int8": 128.0, "int16": 300.0}


@dataclass(frozen=True)
class _Value:
    """What the generator knows of a value beyond its step: magnitude bound and flags."""

    name: str
    shape: Shape
    dtype: str
    bound: float
    exact: bool  # the same in eager and compiled, bit for bit (see the module docstring)
    reduced: bool = False  # computed from a reduction (a scalar reduction of it is "after a row reduction")
    expanded: bool = False  # an expand()ed view (stride 0)


def generate(seed: int, k: int, features: Iterable[str] = FEATURES) -> Program:
    """Program ``k`` of seed ``seed`` with the generator parts named in ``features``."""
    features = frozenset(features)
    unknown = features - set(FEATURES)
    if unknown:
        raise ValueError(f"unknown fuzz features {sorted(unknown)}; known: {', '.join(FEATURES)}")
    rng = random.Random(f"fuzz:{seed}:{k}")
    builder = _Builder(rng, features, f"{seed}:{k}")
    builder.start()
    for _ in range(rng.randint(3, 12)):
        builder.grow()
    return builder.finish()


def program_seed(seed: int, k: int) -> int:
    """The data seed of program k of seed S (inputs and tangents)."""
    return random.Random(f"fuzz-data:{seed}:{k}").getrandbits(48)


def broadcast_shapes(a: Shape, b: Shape) -> Shape | None:
    """The broadcast of two symbolic shapes, or None: dims match when equal or one is the constant 1."""
    rank = max(len(a), len(b))
    a = (ONE,) * (rank - len(a)) + tuple(a)
    b = (ONE,) * (rank - len(b)) + tuple(b)
    out = []
    for da, db in zip(a, b):
        if da == db or db == ONE:
            out.append(da)
        elif da == ONE:
            out.append(db)
        else:
            return None
    return tuple(out)


def multiply(a: Dim, b: Dim) -> Dim | None:
    """The dim of two flattened dims, when both are products (no offset)."""
    def factors(d: Dim) -> tuple[tuple[str, ...], int] | None:
        if not d.symbols:
            return (), d.offset
        return (d.symbols, d.scale) if d.offset == 0 else None

    fa, fb = factors(a), factors(b)
    if fa is None or fb is None:
        return None
    symbols, scale = fa[0] + fb[0], fa[1] * fb[1]
    return Dim(symbols, scale, 0) if symbols else Dim.const(scale)


def add_dims(a: Dim, b: Dim) -> Dim | None:
    """The dim of two concatenated dims, when they are multiples of one product."""
    if not a.symbols and not b.symbols:
        return Dim.const(a.offset + b.offset)
    if a.symbols != b.symbols:
        return None
    return Dim(a.symbols, a.scale + b.scale, a.offset + b.offset)


class _Builder:
    """The program being drawn: its sizes, inputs, steps and what is known of each value."""

    def __init__(self, rng: random.Random, features: frozenset[str], ident: str) -> None:
        self.rng = rng
        self.features = features
        self.ident = ident
        self.sizes: dict[str, int] = {}
        self.inputs: list[Input] = []
        self.steps: list[Step] = []
        self.values: list[_Value] = []
        self.dtype = "float32"
        self.cap = ELEMENT_CAP
        self.expect_error = False
        self.backward = False

    def chance(self, p: float, feature: str) -> bool:
        """True with probability ``p`` when ``feature`` is on. The draw is made either way, so that
        switching a special case off leaves the rest of the program as it was."""
        return self.rng.random() < p and feature in self.features

    # -- sizes -----------------------------------------------------------------------------------
    def draw_size(self, limit: int) -> int:
        rng = self.rng
        empty = self.chance(0.03, "empty")
        pool = rng.choices([(1,), (2, 3, 4, 5, 6, 7), PRIMES, POW2_PM1, POW2], [1, 2, 2, 2.5, 1.5])[0]
        fitting = [n for n in pool if n <= limit]
        size = rng.choice(fitting) if fitting else 1
        return 0 if empty else size

    def new_symbol(self, limit: int) -> Dim:
        name = _symbol_name(len(self.sizes))
        self.sizes[name] = self.draw_size(max(1, limit))
        return Dim.symbol(name)

    def size(self, dim: Dim) -> int:
        return dim.size(self.sizes)

    def numel(self, shape: Shape) -> int:
        return math.prod(concrete(shape, self.sizes))

    def fits(self, shape: Shape) -> bool:
        return self.numel(shape) <= self.cap

    def room(self, shape: Shape) -> int:
        """How large a new dim can be next to ``shape`` within the element cap."""
        return max(1, self.cap // max(1, self.numel(shape)))

    # -- values ----------------------------------------------------------------------------------
    def add_input(self, shape: Shape, dtype: str, bound: float | None = None, index_bound: Dim | None = None,
                  out_of_range: bool = False) -> _Value:
        name = f"x{len(self.inputs)}"
        strided = self.chance(0.25, "layouts") and index_bound is None
        layout = self.rng.choice([lay for lay in LAYOUTS[1:] if lay != "transposed" or len(shape) >= 2])
        wide = [d for d, dim in enumerate(shape) if dim.symbols]
        expanded_dim = self.rng.choice(wide) if wide else 0
        if (layout == "expanded" and not wide) or (layout == "strided" and not shape):
            layout = "offset"
        if not strided:
            layout, expanded_dim = "contiguous", 0
        elif layout != "expanded":
            expanded_dim = 0
        self.inputs.append(Input(name, tuple(shape), dtype, index_bound, out_of_range, layout, expanded_dim))
        if bound is None:
            bound = 4.5 if dtype == "float" else NARROW_INPUT_BOUND.get(dtype, 8.0)
        value = _Value(name, tuple(shape), dtype, bound, exact=True)
        self.values.append(value)
        return value

    def add(self, op: str, category: str, code: str, operands: Iterable[_Value], shape: Shape, dtype: str,
            bound: float, exact: bool, dims: Iterable[Dim] = (), reduced: bool = False,
            expanded: bool = False) -> _Value | None:
        operands = list(operands)
        shape = tuple(shape)
        if not self.fits(shape) or any(self.size(d) < 0 for d in shape):
            return None
        name = f"v{len(self.steps)}"
        if dtype in NARROW_RANGE and (dtype == "uint8" or bound >= NARROW_RANGE[dtype]):
            bound = NARROW_RANGE[dtype]  # it may have wrapped
        self.steps.append(Step(name, op, category, code, tuple(o.name for o in operands), shape, dtype,
                               tuple(dims)))
        reduced = reduced or any(o.reduced for o in operands)
        value = _Value(name, shape, dtype, float(bound), exact, reduced, expanded)
        self.values.append(value)
        return value

    def pick(self, accept: Callable[[_Value], bool]) -> _Value | None:
        """A value ``accept`` takes; the newest value half the time, so the steps form chains."""
        fitting = [v for v in self.values if accept(v)]
        if not fitting:
            return None
        if self.rng.random() < 0.5:
            return fitting[-1]
        return self.rng.choice(fitting)

    def limit(self) -> float:
        return BOUND_LIMIT[self.dtype]

    def partner(self, value: _Value, dtype: str | None = None, exact: bool = False,
                scalar: bool = True) -> _Value | str:
        """A second operand for ``value``: a value of a broadcast-compatible shape, a new input of a
        broadcast shape, or a Python scalar."""
        dtype = dtype or value.dtype
        rng = self.rng
        roll = rng.random()
        if scalar and roll < 0.15:
            return _scalar(rng, dtype)
        if roll < 0.6:
            found = self.pick(lambda v: v.dtype == dtype and (v.exact or not exact) and not v.expanded
                              and broadcast_shapes(value.shape, v.shape) is not None
                              and self.fits(broadcast_shapes(value.shape, v.shape)))
            if found is not None:
                return found
        return self.add_input(self.broadcast_variant(value.shape), dtype)

    def broadcast_variant(self, shape: Shape) -> Shape:
        """``shape`` with leading dims dropped or dims set to 1, or itself."""
        shape = list(shape)
        rng = self.rng
        if shape and rng.random() < 0.3:
            shape = shape[rng.randint(1, len(shape)):]
        if shape and rng.random() < 0.4:
            shape = [ONE if rng.random() < 0.5 else d for d in shape]
        return tuple(shape)

    # -- the program -----------------------------------------------------------------------------
    def start(self) -> None:
        rng = self.rng
        kind = rng.choices(["float32", "bfloat16", "float16", "int32", "int64", "bool", "int16", "int8", "uint8"],
                           [45, 18, 12, 9, 8, 8, 2, 2, 3])[0]
        self.dtype = kind if kind in FLOAT_DTYPES else rng.choice(FLOAT_DTYPES)
        self.backward = self.chance(0.65, "backward")
        dtype = "float" if kind in FLOAT_DTYPES else kind
        rank = rng.choices([0, 1, 2, 3, 4], [2, 15, 43, 30, 10])[0]
        long_at = None
        if self.chance(0.1, "long_rows") and rank >= 1:
            self.cap = LONG_ELEMENT_CAP
            long_at = rank - 1 - int(rank >= 2 and rng.random() < 0.25)
        shape: list[Dim | None] = [None] * rank
        if long_at is not None:
            name = _symbol_name(len(self.sizes))
            self.sizes[name] = rng.choice(LONG_ROWS)
            shape[long_at] = Dim.symbol(name)
        for d in rng.sample(range(rank), rank):  # in a random order: the first drawn may be the largest
            if shape[d] is None:
                shape[d] = self.new_symbol(self.room(tuple(x for x in shape if x is not None)))
        self.add_input(tuple(shape), dtype)
        if rng.random() < 0.5:
            self.add_input(self.broadcast_variant(tuple(shape)), dtype)

    def grow(self) -> None:
        families = [f for f in FAMILIES if f in self.features]
        if not families:
            return
        weights = [FAMILY_WEIGHTS[f] for f in families]
        for _ in range(12):
            family = self.rng.choices(families, weights)[0]
            if getattr(self, f"_{family}")():
                return

    def finish(self) -> Program:
        if not self.steps:
            self._elementwise()
        used = {o for s in self.steps for o in s.operands}
        computed = {s.name for s in self.steps if not s.mutates}
        leaves = [v for v in self.values if v.name in computed and v.name not in used]
        if not leaves:
            leaves = [v for v in self.values if v.name in computed][-1:]
        leaves = leaves[-4:]
        outputs = []
        for leaf in leaves:
            if leaf.expanded and "expand_output" not in self.features:
                leaf = self._materialize(leaf)
            outputs.append(leaf.name)
        float_inputs = any(i.dtype == "float" and i.index_bound is None for i in self.inputs)
        backward = self.backward and float_inputs and not self.expect_error
        program = Program(self.ident, self.dtype, tuple(sorted(self.sizes.items())), tuple(self.inputs),
                          tuple(self.steps), tuple(outputs), backward, program_seed(*map(int, self.ident.split(":"))),
                          self.expect_error)
        program = live(program)
        program = replace(program, expect_error=any(i.out_of_range for i in program.inputs),
                          calls=2 if self.rng.random() < 0.3 else 1)
        kept = used_symbols(program)
        return replace(program, sizes=tuple((k, v) for k, v in program.sizes if k in kept))

    def _materialize(self, value: _Value) -> _Value:
        """An op on an expanded value, so that what is returned is not a stride-0 view."""
        code = {"float": "{0} * 2", "bool": "~{0}"}.get(value.dtype, "{0} + 1")
        made = self.add("materialize", "elementwise", code, [value], value.shape, value.dtype,
                        value.bound * 2 + 1, value.exact)
        return made if made is not None else value

    # -- op families -----------------------------------------------------------------------------
    # Each returns the value it added, or None when it does not apply to the program as it is.

    def _elementwise(self) -> _Value | None:
        rng = self.rng
        value = self.pick(lambda v: v.dtype != "bool") or self.pick(lambda v: True)
        if value is None:
            return None
        if value.dtype == "bool":
            return self._logical(value)
        limit = self.limit() if value.dtype == "float" else INT_BOUND_LIMIT
        if rng.random() < 0.4:  # unary
            if value.dtype == "float":
                op, code, bound, exact = rng.choice([
                    ("neg", "-{0}", value.bound, True), ("abs", "{0}.abs()", value.bound, True),
                    ("relu", "torch.relu({0})", value.bound, True),
                    ("clamp", "{0}.clamp(-1.5, 1.5)", min(value.bound, 1.5), True),
                    ("mul", "{0} * 0.5", value.bound / 2, True), ("add", "{0} + 1.25", value.bound + 1.25, False),
                    ("sub", "1.5 - {0}", value.bound + 1.5, False), ("sign", "torch.sign({0})", 1.0, True),
                    ("floor", "torch.floor({0})", value.bound + 1, value.exact),
                    ("ceil", "torch.ceil({0})", value.bound + 1, value.exact),
                    ("trunc", "torch.trunc({0})", value.bound, value.exact),
                    ("round", "torch.round({0})", value.bound + 1, value.exact),
                    ("round", "{0}.round(decimals=1)", value.bound + 1, False),
                    ("frac", "{0}.frac()", 1.0, False),
                ])
                if op in ("floor", "ceil", "trunc", "round", "frac") and not value.exact:
                    op, code, bound, exact = "neg", "-{0}", value.bound, True
                return self.add(op, "elementwise", code, [value], value.shape, "float", bound, exact and value.exact)
            op, code, bound = rng.choice([
                ("neg", "-{0}", value.bound), ("abs", "{0}.abs()", value.bound), ("mul", "{0} * 3", value.bound * 3),
                ("add", "{0} + 2", value.bound + 2), ("bitwise_not", "~{0}", value.bound + 1),
                ("shift_left", "{0} << 2", value.bound * 4), ("shift_right", "{0} >> 1", value.bound),
            ])
            if bound > limit:
                return None
            return self.add(op, "elementwise", code, [value], value.shape, value.dtype, bound, True)
        other = self.partner(value)
        names = ["add", "sub", "mul", "maximum", "minimum"]
        if value.dtype != "float":
            names += ["floor_divide", "remainder", "fmod", "bitwise_and", "bitwise_or", "bitwise_xor"]
        op = rng.choice(names)
        codes = {"add": "{0} + {1}", "sub": "{0} - {1}", "mul": "{0} * {1}", "maximum": "torch.maximum({0}, {1})",
                 "minimum": "torch.minimum({0}, {1})",
                 "floor_divide": "torch.div({0}, {1}.abs() + 1, rounding_mode='floor')",
                 "remainder": "torch.remainder({0}, {1}.abs() + 1)", "fmod": "torch.fmod({0}, {1}.abs() + 1)",
                 "bitwise_and": "{0} & {1}", "bitwise_or": "{0} | {1}", "bitwise_xor": "{0} ^ {1}"}
        if isinstance(other, str):
            if op in ("maximum", "minimum"):
                op = "add"
            code = codes[op].replace("{1}.abs() + 1", other.lstrip("-")).replace("{1}", other)
            return self._binary(op, code, [value], value, None, value.shape)
        shape = broadcast_shapes(value.shape, other.shape)
        operands = [value, other] if rng.random() < 0.7 else [other, value]
        code = codes[op]
        if value.dtype in NARROW_RANGE:  # a uint8's |x| + 1 wraps to 0 at 255: a divisor in [1, 64]
            code = code.replace("{1}.abs() + 1", "(({1} & 63) + 1)")
        return self._binary(op, code, operands, value, other, shape)

    def _binary(self, op: str, code: str, operands: list[_Value], a: _Value, b: _Value | None,
                shape: Shape) -> _Value | None:
        bb = b.bound if b is not None else 8.0
        if a.dtype in NARROW_RANGE:
            bb = max(bb, 64.0)  # a divisor of a narrow type is ``(b & 63) + 1``
        bound = {"add": a.bound + bb, "sub": a.bound + bb, "mul": a.bound * bb, "maximum": max(a.bound, bb),
                 "minimum": max(a.bound, bb), "floor_divide": a.bound + 1, "remainder": bb + 1, "fmod": bb + 1,
                 "bitwise_and": max(a.bound, bb) * 2, "bitwise_or": max(a.bound, bb) * 2,
                 "bitwise_xor": max(a.bound, bb) * 2}[op]
        limit = self.limit() if a.dtype == "float" else INT_BOUND_LIMIT
        if bound > limit:
            return None
        exact = a.dtype != "float" or (op in ("maximum", "minimum") and a.exact and (b is None or b.exact))
        return self.add(op, "elementwise", code, operands, shape, a.dtype, bound, exact)

    def _logical(self, value: _Value) -> _Value | None:
        rng = self.rng
        if rng.random() < 0.3:
            op, code = rng.choice([("logical_not", "~{0}"), ("logical_not", "torch.logical_not({0})")])
            return self.add(op, "elementwise", code, [value], value.shape, "bool", 1, True)
        other = self.partner(value, "bool", scalar=False)
        op, code = rng.choice([("logical_and", "{0} & {1}"), ("logical_or", "{0} | {1}"),
                               ("logical_xor", "{0} ^ {1}"), ("logical_and", "torch.logical_and({0}, {1})")])
        return self.add(op, "elementwise", code, [value, other], broadcast_shapes(value.shape, other.shape),
                        "bool", 1, True)

    def _expensive(self) -> _Value | None:
        rng = self.rng
        value = self.pick(lambda v: v.dtype == "float")
        if value is None:
            return None
        b = value.bound
        small = b <= (8 if self.dtype == "float32" else 5)
        choices = [
            ("exp", "torch.exp({0})" if small else "torch.exp(torch.tanh({0}))", math.exp(min(b, 8))),
            ("expm1", "torch.expm1({0})" if small else "torch.expm1(torch.tanh({0}))", math.exp(min(b, 8))),
            ("log", "torch.log({0}.abs() + 0.5)", math.log(b + 0.5) + 1),
            ("log1p", "torch.log1p({0}.abs())", math.log1p(b) + 1),
            ("tanh", "torch.tanh({0})", 1), ("erf", "torch.erf({0})", 1), ("sigmoid", "torch.sigmoid({0})", 1),
            ("sigmoid", "{0}.sigmoid()", 1),
            ("sqrt", "torch.sqrt({0}.abs() + 0.0625)", math.sqrt(b + 0.0625)),
            ("rsqrt", "torch.rsqrt({0}.abs() + 0.25)", 2),
            ("pow", "({0}.abs() + 0.5) ** 1.5", (b + 0.5) ** 1.5), ("pow", "{0} ** 2", b * b),
            ("pow", "torch.pow({0}, 3)", b ** 3),
            ("reciprocal", "torch.reciprocal({0}.abs() + 1)", 1), ("gelu", "F.gelu({0})", b),
            ("gelu", "F.gelu({0}, approximate='tanh')", b), ("silu", "F.silu({0})", b),
            ("sin", "torch.sin({0})" if b < 100 else "torch.sin(torch.tanh({0}))", 1),
            ("cos", "torch.cos({0})" if b < 100 else "torch.cos(torch.tanh({0}))", 1),
        ]
        op, code, bound = rng.choice(choices)
        if rng.random() < 0.25:  # a division by another value
            other = self.partner(value, "float", scalar=False)
            shape = broadcast_shapes(value.shape, other.shape)
            return self.add("div", "expensive", "{0} / ({1}.abs() + 1)", [value, other], shape, "float", b, False)
        if bound > self.limit():
            op, code, bound = "tanh", "torch.tanh({0})", 1
        return self.add(op, "expensive", code, [value], value.shape, "float", bound, False)

    def _compare(self) -> _Value | None:
        rng = self.rng
        value = self.pick(lambda v: v.exact and v.dtype != "bool")
        if value is None:
            return None
        op, symbol = rng.choice([("gt", ">"), ("lt", "<"), ("ge", ">="), ("le", "<="), ("eq", "=="), ("ne", "!=")])
        other = self.partner(value, exact=True)
        if isinstance(other, str):
            return self.add(op, "compare", f"{{0}} {symbol} {other}", [value], value.shape, "bool", 1, True)
        return self.add(op, "compare", f"{{0}} {symbol} {{1}}", [value, other],
                        broadcast_shapes(value.shape, other.shape), "bool", 1, True)

    def _where(self) -> _Value | None:
        rng = self.rng
        value = self.pick(lambda v: v.dtype != "bool")
        if value is None:
            return None
        mask = self.pick(lambda v: v.dtype == "bool" and broadcast_shapes(v.shape, value.shape) is not None)
        if mask is None:
            mask = self._compare() or self.add_input(self.broadcast_variant(value.shape), "bool")
            if broadcast_shapes(mask.shape, value.shape) is None:
                return None
        other = self.partner(value)
        if isinstance(other, str):
            shape = broadcast_shapes(mask.shape, value.shape)
            code = f"torch.where({{0}}, {{1}}, {other})" if rng.random() < 0.5 else f"torch.where({{0}}, {other}, {{1}})"
            return self.add("where", "where", code, [mask, value], shape, value.dtype, value.bound + 8,
                            value.exact)
        shape = broadcast_shapes(mask.shape, value.shape)
        shape = None if shape is None else broadcast_shapes(shape, other.shape)  # () is a shape
        if shape is None:
            return None
        return self.add("where", "where", "torch.where({0}, {1}, {2})", [mask, value, other], shape, value.dtype,
                        max(value.bound, other.bound), value.exact and other.exact)

    def _convert(self) -> _Value | None:
        rng = self.rng
        value = self.pick(lambda v: v.dtype != "float" or v.exact)
        if value is None:
            return None
        if value.dtype == "float":
            target = rng.choice(["int32", "int64"] + (["int16", "int8", "uint8"] if rng.random() < 0.3 else []))
            return self.add("convert", "convert", f"{{0}}.to(torch.{target})", [value], value.shape, target,
                            value.bound, True)
        targets = ("float", "int32", "int64") + (("int16", "int8", "uint8") if rng.random() < 0.3 else ())
        target = rng.choice([t for t in targets if t != value.dtype])
        code = "{0}.to(DT)" if target == "float" else f"{{0}}.to(torch.{target})"
        if target == "float" and rng.random() < 0.3:
            code = "{0}.float().to(DT)" if self.dtype != "float32" else "{0}.float()"
        return self.add("convert", "convert", code, [value], value.shape, target, value.bound, True)

    def _broadcast(self) -> _Value | None:
        rng = self.rng
        value = self.pick(lambda v: len(v.shape) < 4)
        if value is None:
            return None
        shape = list(value.shape)
        source = "{0}"
        if ONE not in shape or rng.random() < 0.5:
            at = rng.randint(0, len(shape))
            shape.insert(at, ONE)
            source = f"{{0}}.unsqueeze({at})"
        target: list[Dim] = []
        for k, d in enumerate(shape):
            if d == ONE and rng.random() < 0.8:
                d = self.new_symbol(self.room(tuple(target) + tuple(shape[k + 1:])) // 2)
            target.append(d)
        dims = tuple(target)
        spelled = ", ".join(f"{{d{k}}}" for k in range(len(dims)))
        code = f"{source}.expand({spelled})" if rng.random() < 0.7 else f"torch.broadcast_to({source}, ({spelled},))"
        return self.add("expand", "broadcast", code, [value], dims, value.dtype, value.bound, value.exact,
                        dims=dims, expanded=True)

    def _reduce(self) -> _Value | None:
        rng = self.rng
        value = self.pick(lambda v: len(v.shape) >= 1)
        if value is None:
            return None
        rank = len(value.shape)
        count = rng.choices([1, 2, 3], [6, 2, 1])[0]
        dims = sorted(rng.sample(range(rank), min(count, rank)))
        if len(dims) == rank and not self.may_reduce_all(value):
            if rank == 1:
                return None
            dims = dims[:-1]
        keepdim = rng.random() < 0.4
        return self.reduction(value, dims, keepdim)

    def may_reduce_all(self, value: _Value) -> bool:
        return "scalar_after_row" in self.features or not value.reduced

    def reduction(self, value: _Value, dims: list[int], keepdim: bool, to_scalar: bool = False) -> _Value | None:
        rng = self.rng
        rank = len(value.shape)
        extent = math.prod(self.size(value.shape[d]) for d in dims)
        empty = extent == 0
        if len(dims) == 1 and not to_scalar and not empty and rng.random() < 0.25:
            return self.along(value, dims[0] - rank if rng.random() < 0.3 else dims[0], extent, keepdim)
        if value.dtype == "float":
            names = ["sum", "sum", "mean", "var", "amax", "amin", "std", "norm"]
            if extent <= 32 and (len(dims) == 1 or to_scalar):
                names.append("prod")
        elif value.dtype == "bool":
            names = ["any", "all", "sum"]
        else:
            names = ["sum", "amax", "amin"]
        if empty:
            names = [n for n in names if n not in ("amax", "amin")] or ["sum"]
        op = rng.choice(names)
        spelled = [d - rank if rng.random() < 0.3 else d for d in dims]
        dim_text = str(spelled[0]) if len(spelled) == 1 else str(tuple(spelled))
        keep = ", keepdim=True" if keepdim else ""
        norm_bound = 0.0
        if op == "norm":  # ord inf of an empty extent is an error in eager: 2 there
            order = rng.choice([2, 2, 1, 3, "float('inf')"])
            order = 2 if empty and not isinstance(order, int) else order
            norm_bound = value.bound * (max(extent, 1) ** (1 / order) if isinstance(order, int) else 1)
            dim_arg = "" if to_scalar else f", dim={dim_text}{keep}"
            # Tensor.norm over several dims takes 2 at most (a matrix norm's): one dim or all of them here
            plain = order == 2 and (to_scalar or len(dims) == 1) and rng.random() < 0.5
            code = (f"{{0}}.norm({'' if to_scalar else f'dim={dim_text}{keep}'})" if plain
                    else f"torch.linalg.vector_norm({{0}}, ord={order}{dim_arg})")
        elif to_scalar:
            code = f"{{0}}.{op}()" if op not in ("any", "all") or rng.random() < 0.5 else f"torch.{op}({{0}})"
            if op in ("var", "std") and rng.random() < 0.5:
                code = f"{{0}}.{op}(correction=0)"
        elif op in ("var", "std"):
            code = f"{{0}}.{op}(dim={dim_text}, correction={rng.choice([0, 1])}{keep})"
        elif op in ("any", "all") and len(dims) > 1:
            code = f"{{0}}.{op}(dim={dim_text}{keep})"
        elif rng.random() < 0.5:
            code = f"torch.{op}({{0}}, dim={dim_text}{keep})" if op != "mean" else f"{{0}}.mean({dim_text}{keep})"
        else:
            code = f"{{0}}.{op}({dim_text}{keep})"
        bound = {"sum": value.bound * max(extent, 1), "mean": value.bound, "amax": value.bound,
                 "amin": value.bound, "var": value.bound ** 2 * 2, "std": value.bound * 2,
                 "prod": value.bound ** max(extent, 1) if op == "prod" else 0.0, "any": 1, "all": 1,
                 "norm": norm_bound}[op]
        limit = self.limit() if value.dtype == "float" else INT_BOUND_LIMIT
        if op == "prod" and bound > limit:
            code = code.replace("{0}", "(torch.tanh({0}) * 0.5 + 1)", 1)
            bound = 1.5 ** max(extent, 1)
        if bound > limit:
            return None
        dtype = {"bool": "int64" if op == "sum" else "bool", "float": "float"}.get(
            value.dtype, "int64" if op == "sum" else value.dtype)  # integer sums promote to int64
        shape = tuple(ONE if d in dims else s for d, s in enumerate(value.shape) if keepdim or d not in dims)
        if to_scalar:
            shape = ()
        exact = value.dtype != "float" or (op in ("amax", "amin") and value.exact)
        return self.add(op, "reduce_all" if to_scalar else "reduce", code, [value], shape, dtype, bound, exact,
                        reduced=True)

    def along(self, value: _Value, dim: int, extent: int, keepdim: bool) -> _Value | None:
        """A scan along ``dim`` (cumsum, cumprod of factors near 1, logcumsumexp), or the index of an extreme
        (``torch.max(x, dim)``'s values or indices, argmax/argmin): indices only of exact values, whose
        ties cannot move with rounding."""
        rng = self.rng
        indexable = value.exact and value.dtype != "bool"
        scans = ["cumsum", "cumsum", "cumprod", "logcumsumexp"]
        op = rng.choice([*scans, "max", "arg"] if indexable else [*scans, "max"])
        keep = ", keepdim=True" if keepdim else ""
        if op in scans:
            if op == "cumprod" and (value.dtype != "float" or extent > 64) or op == "logcumsumexp" and value.dtype != "float":
                op = "cumsum"
            code = rng.choice([f"torch.{op}({{0}}, dim={dim})", f"{{0}}.{op}({dim})"])
            bound = value.bound * extent
            if op == "cumprod":
                code, bound = code.replace("{0}", "(torch.tanh({0}) * 0.1 + 1)", 1), 1.1 ** extent
            elif op == "logcumsumexp":  # at most the prefix's largest element plus log(extent)
                bound = value.bound + math.log(extent) + 1
            if bound > (self.limit() if value.dtype == "float" else INT_BOUND_LIMIT):
                return None
            dtype = "float" if value.dtype == "float" else "int64"
            return self.add(op, "reduce", code, [value], value.shape, dtype, bound, value.dtype != "float",
                            reduced=True)
        rank = len(value.shape)
        d = dim % rank
        shape = tuple(ONE if k == d else s for k, s in enumerate(value.shape) if keepdim or k != d)
        if op == "max":
            which = rng.choice(["max", "min"])
            part = rng.choice(["values", "[0]"] + (["indices", "[1]"] if indexable else []))
            code = f"torch.{which}({{0}}, dim={dim}{keep}){'.' if part[0] != '[' else ''}{part}"
            if part in ("values", "[0]"):
                return self.add(which, "reduce", code, [value], shape, value.dtype, value.bound, value.exact,
                                reduced=True)
        else:
            code = f"torch.{rng.choice(['argmax', 'argmin'])}({{0}}, dim={dim}{keep})"
        return self.add("argmax", "reduce", code, [value], shape, "int64", extent, True, reduced=True)

    def _reduce_all(self) -> _Value | None:
        after_row = self.chance(0.5, "scalar_after_row")
        reduced = self.pick(lambda v: v.reduced and len(v.shape) >= 1)  # drawn either way (see chance)
        value = reduced if after_row else None
        value = value or self.pick(lambda v: self.may_reduce_all(v) and len(v.shape) >= 1)
        if value is None:
            return None
        return self.reduction(value, list(range(len(value.shape))), False, to_scalar=True)

    def _softmax(self) -> _Value | None:
        rng = self.rng
        value = self.pick(lambda v: v.dtype == "float" and len(v.shape) >= 1)
        if value is None:
            return None
        dim = rng.randrange(len(value.shape))
        if rng.random() < 0.5:
            dim = -1 if dim == len(value.shape) - 1 else dim
        extent = self.size(value.shape[dim])
        op, code, bound = rng.choice([
            ("softmax", f"torch.softmax({{0}}, dim={dim})", 1),
            ("softmax", f"{{0}}.softmax({dim})", 1),
            ("log_softmax", f"F.log_softmax({{0}}, dim={dim})", 2 * value.bound + math.log(extent + 1)),
        ])
        return self.add(op, "softmax", code, [value], value.shape, "float", bound, False, reduced=True)

    def _norm(self) -> _Value | None:
        rng = self.rng
        value = self.pick(lambda v: v.dtype == "float" and len(v.shape) >= 1)
        if value is None:
            return None
        last = 2 if len(value.shape) >= 2 and rng.random() < 0.25 else 1
        normalized = value.shape[-last:]
        n = self.numel(normalized)
        if rng.random() < 0.25:
            return self.add("rms_norm", "norm", "{0} * torch.rsqrt({0}.pow(2).mean(-1, keepdim=True) + 1e-5)",
                            [value], value.shape, "float", math.sqrt(max(self.size(value.shape[-1]), 1)) * 2, False,
                            reduced=True)
        spelled = "(" + "".join(f"{{d{k}}}, " for k in range(last)) + ")"
        operands = [value]
        code = f"F.layer_norm({{0}}, {spelled}"
        bound = math.sqrt(max(n, 1)) + 1
        if rng.random() < 0.6:
            operands.append(self.add_input(normalized, "float"))
            code += ", {1}"
            bound *= 4.5
            if rng.random() < 0.7:
                operands.append(self.add_input(normalized, "float"))
                code += ", {2}"
                bound += 4.5
        if rng.random() < 0.3:
            code += ", eps=1e-3"
        code += ")"
        return self.add("layer_norm", "norm", code, operands, value.shape, "float", bound, False,
                        dims=normalized, reduced=True)

    def _reshape(self) -> _Value | None:
        rng = self.rng
        value = self.pick(lambda v: True)
        if value is None:
            return None
        shape = list(value.shape)
        rank = len(shape)
        products = [k for k in range(rank - 1) if multiply(shape[k], shape[k + 1]) is not None]
        splittable = [k for k, d in enumerate(shape) if len(d.symbols) >= 2 and d.offset == 0 and d.scale == 1]
        ones = [k for k, d in enumerate(shape) if d == ONE]
        moves = ["unsqueeze"] * (rank < 4) + ["flatten"] * bool(products) + ["unflatten"] * bool(splittable) * 2
        moves += ["squeeze"] * bool(ones)
        if all(multiply(d, ONE) is not None for d in shape) and rank >= 2:
            moves.append("all")
        if not moves:
            return None
        move = rng.choice(moves)
        if move == "unsqueeze":
            at = rng.randint(0, rank)
            new = shape[:at] + [ONE] + shape[at:]
            code = f"{{0}}.unsqueeze({at})" if rng.random() < 0.6 else f"{{0}}[{_index_prefix(at)}None]"
            dims: tuple[Dim, ...] = ()
        elif move == "squeeze":
            at = rng.choice(ones)
            new = shape[:at] + shape[at + 1:]
            code = f"{{0}}.squeeze({at})"
            dims = ()
        elif move == "flatten":
            at = rng.choice(products)
            new = shape[:at] + [multiply(shape[at], shape[at + 1])] + shape[at + 2:]
            dims = tuple(new)
            spelled = ", ".join(f"{{d{k}}}" for k in range(len(new)))
            code = rng.choice([f"{{0}}.flatten({at}, {at + 1})", f"{{0}}.reshape({spelled})",
                               f"{{0}}.contiguous().view({spelled})"])
        elif move == "all":
            total = shape[0]
            for d in shape[1:]:
                total = multiply(total, d)
            new, dims = [total], ()
            code = rng.choice(["{0}.reshape(-1)", "{0}.flatten()"])
        else:
            at = rng.choice(splittable)
            first, rest = Dim.symbol(shape[at].symbols[0]), Dim(shape[at].symbols[1:])
            new = shape[:at] + [first, rest] + shape[at + 1:]
            dims = (first, rest)
            code = f"{{0}}.unflatten({at}, ({{d0}}, {{d1}}))"
        return self.add("reshape", "reshape", code, [value], tuple(new), value.dtype, value.bound, value.exact,
                        dims=dims, expanded=value.expanded and "contiguous" not in code)

    def _transpose(self) -> _Value | None:
        rng = self.rng
        value = self.pick(lambda v: len(v.shape) >= 2)
        if value is None:
            return None
        rank = len(value.shape)
        if rng.random() < 0.15:  # reversed along one or two dims: a copy, in the shape it had
            flipped = sorted(rng.sample(range(rank), rng.choice([1, 2])))
            code = f"{{0}}.flip({flipped[0]})" if len(flipped) == 1 else f"torch.flip({{0}}, {tuple(flipped)})"
            return self.add("flip", "transpose", code, [value], value.shape, value.dtype, value.bound, value.exact)
        if rank == 2 and rng.random() < 0.3:
            order, code = [1, 0], "{0}.t()"
        elif rng.random() < 0.5:
            i, j = rng.sample(range(rank), 2)
            order = list(range(rank))
            order[i], order[j] = order[j], order[i]
            code = f"{{0}}.transpose({i}, {j})"
        else:
            order = list(range(rank))
            rng.shuffle(order)
            code = f"{{0}}.permute({', '.join(map(str, order))})"
        if rng.random() < 0.25:
            code += ".contiguous()"
        shape = tuple(value.shape[k] for k in order)
        return self.add("transpose", "transpose", code, [value], shape, value.dtype, value.bound, value.exact,
                        expanded=value.expanded and ".contiguous()" not in code)

    def _slice(self) -> _Value | None:
        rng = self.rng
        value = self.pick(lambda v: len(v.shape) >= 1)
        if value is None:
            return None
        rank = len(value.shape)
        at = rng.randrange(rank)
        dim = value.shape[at]
        size = self.size(dim)
        move = rng.choice(["slice", "slice", "narrow", "select", "unbind"])
        if move in ("select", "unbind"):
            if size < 1:
                return None
            index = rng.choice([0, -1])
            shape = value.shape[:at] + value.shape[at + 1:]
            code = f"{{0}}.select({at}, {index})" if move == "select" else f"{{0}}.unbind({at})[{index}]"
            if move == "select" and rng.random() < 0.5:
                code = f"{{0}}[{_index_prefix(at)}{index}]"
            return self.add("select", "slice", code, [value], shape, value.dtype, value.bound, value.exact,
                            expanded=value.expanded)
        least = 0 if self.chance(0.2, "empty") else 1
        start, trim = rng.randint(0, 3), rng.randint(0, 3)
        while start + trim > size - least and (start or trim):
            start, trim = max(0, start - 1), max(0, trim - 1)
        if start + trim == 0:
            return None
        new = dim.plus(-start - trim)
        shape = value.shape[:at] + (new,) + value.shape[at + 1:]
        if move == "narrow":
            code, dims = f"{{0}}.narrow({at}, {start}, {{d0}})", (new,)
        else:
            code, dims = f"{{0}}[{_index_prefix(at)}{start}:{{d0}}]", (dim.plus(-trim),)
        return self.add("slice", "slice", code, [value], shape, value.dtype, value.bound, value.exact, dims=dims,
                        expanded=value.expanded)

    def _cat(self) -> _Value | None:
        rng = self.rng
        value = self.pick(lambda v: len(v.shape) >= 1 and not v.expanded)
        if value is None:
            return None
        rank = len(value.shape)
        at = rng.randrange(rank)
        if rng.random() < 0.25 and rank < 4:  # stack of equal shapes
            other = self.pick(lambda v: v.shape == value.shape and v.dtype == value.dtype) \
                or self.add_input(value.shape, value.dtype)
            shape = value.shape[:at] + (Dim.const(2),) + value.shape[at:]
            return self.add("stack", "cat", f"torch.stack([{{0}}, {{1}}], dim={at})", [value, other], shape,
                            value.dtype, max(value.bound, other.bound), value.exact and other.exact)
        dim = value.shape[at]
        if dim.symbols and rng.random() < 0.6:
            other_dim = dim
        else:
            other_dim = Dim.const(rng.randint(1, 5)) if not dim.symbols else dim
        other_shape = value.shape[:at] + (other_dim,) + value.shape[at + 1:]
        other = self.pick(lambda v: v.shape == other_shape and v.dtype == value.dtype and not v.expanded) \
            or self.add_input(other_shape, value.dtype)
        new = add_dims(dim, other_dim)
        if new is None:
            return None
        operands = [value, other] if rng.random() < 0.7 else [other, value]
        shape = value.shape[:at] + (new,) + value.shape[at + 1:]
        return self.add("cat", "cat", f"torch.cat([{{0}}, {{1}}], dim={at if rng.random() < 0.7 else at - rank})",
                        operands, shape, value.dtype, max(value.bound, other.bound), value.exact and other.exact)

    def _pad(self) -> _Value | None:
        rng = self.rng
        value = self.pick(lambda v: len(v.shape) >= 1 and v.dtype != "bool")
        if value is None:
            return None
        two = len(value.shape) >= 2 and rng.random() < 0.4
        pads = [rng.randint(0, 3) for _ in range(4 if two else 2)]
        if not any(pads):
            pads[0] = 1
        shape = list(value.shape)
        shape[-1] = shape[-1].plus(pads[0] + pads[1])
        if two:
            shape[-2] = shape[-2].plus(pads[2] + pads[3])
        fill = rng.choice(["", ", value=0.5" if value.dtype == "float" else ", value=3"])
        return self.add("pad", "pad", f"F.pad({{0}}, {tuple(pads)}{fill})", [value], tuple(shape), value.dtype,
                        max(value.bound, 3), value.exact)

    def index_input(self, shape: Shape, bound: Dim, result: Shape, dtype: str = "int64") -> _Value:
        """An index input for a gather whose result has shape ``result``; eager checks the indices
        only when that result has elements, so only then may one be out of range."""
        out_of_range = self.chance(0.08, "out_of_range") and not self.expect_error and self.numel(result) > 0
        self.expect_error = self.expect_error or out_of_range
        index = self.add_input(shape, dtype, index_bound=bound, out_of_range=out_of_range)
        if out_of_range:  # used by its gather only, so that the program must fail
            self.values.remove(index)
        return index

    def _gather(self) -> _Value | None:
        rng = self.rng
        value = self.pick(lambda v: len(v.shape) >= 1 and not v.expanded)
        if value is None:
            return None
        rank = len(value.shape)
        move = rng.choice(["index_select", "index", "index", "gather", "embedding"])
        # torch's CUDA embedding backward reads a null pointer for a table of width 0
        # (pytorch/pytorch#189668): such a table is indexed with index_select instead
        if move == "embedding" and (rank != 2 or value.dtype != "float" or self.size(value.shape[1]) == 0):
            move = "index_select"
        if move == "index_select":
            at = rng.randrange(rank)
            if self.size(value.shape[at]) == 0:
                return None
            rows = self.new_symbol(self.room(value.shape[:at] + value.shape[at + 1:]))
            shape = value.shape[:at] + (rows,) + value.shape[at + 1:]
            index = self.index_input((rows,), value.shape[at], shape, rng.choice(["int64", "int32"]))
            return self.add("index_select", "gather", f"torch.index_select({{0}}, {at}, {{1}})", [value, index],
                            shape, value.dtype, value.bound, value.exact)
        if move == "gather":
            at = rng.randrange(rank)
            if self.size(value.shape[at]) == 0:
                return None
            rows = self.new_symbol(self.room(value.shape[:at] + value.shape[at + 1:]))
            shape = value.shape[:at] + (rows,) + value.shape[at + 1:]
            index = self.index_input(shape, value.shape[at], shape)
            return self.add("gather", "gather", f"torch.gather({{0}}, {at}, {{1}})", [value, index], shape,
                            value.dtype, value.bound, value.exact)
        at = 1 if move == "index" and rank >= 2 and rng.random() < 0.3 else 0
        if self.size(value.shape[at]) == 0:
            return None
        rest = value.shape[:at] + value.shape[at + 1:]
        index_shape: tuple[Dim, ...] = (self.new_symbol(self.room(rest)),)
        if rng.random() < 0.3:
            index_shape += (self.new_symbol(self.room(rest + index_shape)),)
        shape = value.shape[:at] + index_shape + value.shape[at + 1:]  # embedding too (at is 0)
        index = self.index_input(index_shape, value.shape[at], shape, rng.choice(["int64", "int32"]))
        if move == "embedding":
            return self.add("embedding", "gather", "F.embedding({1}, {0})", [value, index], shape, "float",
                            value.bound, value.exact)
        code = "{0}[{1}]" if at == 0 else "{0}[:, {1}]"
        return self.add("index", "gather", code, [value, index], shape, value.dtype, value.bound, value.exact)

    def _loss(self) -> _Value | None:
        """A classification loss of a [rows, classes] value against an index target: cross-entropy
        (mean, sum or per row; with label smoothing or an ignored class), ``nll_loss`` of a
        ``log_softmax``, or a one-hot product summed over the classes. Their backward sums a
        one-hot gradient over the classes (``graph.transforms.sum_one_hots``)."""
        rng = self.rng
        value = self.pick(lambda v: v.dtype == "float" and len(v.shape) == 2 and not v.expanded)
        if value is None or self.size(value.shape[1]) == 0:
            return None
        rows, classes = value.shape
        target = self.index_input((rows,), classes, (rows,))
        kind = rng.choice(["cross_entropy", "cross_entropy", "nll_loss", "one_hot"])
        if kind == "one_hot":
            return self.add("one_hot", "loss", "(F.one_hot({1}, {d0}) * {0}).sum(-1)", [value, target], (rows,),
                            "float", value.bound, False, dims=(classes,), reduced=True)
        reduction = rng.choice(["mean", "sum", "none"])
        bound = 2 * value.bound + math.log(self.size(classes) + 1)
        if reduction == "sum":
            bound *= max(1, self.size(rows))
        if kind == "nll_loss":
            code = f"F.nll_loss(F.log_softmax({{0}}, 1), {{1}}, reduction='{reduction}')"
        else:
            extra = rng.choice(["", ", label_smoothing=0.1", ", ignore_index=0"])
            code = f"F.cross_entropy({{0}}, {{1}}, reduction='{reduction}'{extra})"
        shape = (rows,) if reduction == "none" else ()
        return self.add(kind, "loss", code, [value, target], shape, "float", bound, False, reduced=True)

    def _matmul(self) -> _Value | None:
        rng = self.rng
        value = self.pick(lambda v: v.dtype == "float" and len(v.shape) in (2, 3) and not v.expanded)
        if value is None:
            return None
        inner = value.shape[-1]
        k = max(self.size(inner), 1)
        if rng.random() < 0.25:  # x @ x^T
            shape = value.shape[:-1] + (value.shape[-2],)
            bound = value.bound ** 2 * k
            if bound > self.limit():
                return None
            return self.add("matmul", "matmul", "{0} @ {0}.transpose(-1, -2)", [value], shape, "float", bound, False)
        cols = self.new_symbol(min(64, self.room(value.shape[:-1])))
        other = self.add_input(value.shape[:-2] + (inner, cols) if rng.random() < 0.7 else (inner, cols), "float")
        shape = value.shape[:-1] + (cols,)
        bound = value.bound * other.bound * k
        if bound > self.limit():
            return None
        if len(value.shape) == 2:
            code = rng.choice(["{0} @ {1}", "torch.mm({0}, {1})", "torch.matmul({0}, {1})"])
        else:
            code = "torch.bmm({0}, {1})" if len(other.shape) == 3 else "{0} @ {1}"
        return self.add("matmul", "matmul", code, [value, other], shape, "float", bound, False)

    def _inplace(self) -> _Value | None:
        """An in-place op on an input (one that needs no gradient): the new value is compared after the call."""
        rng = self.rng
        inputs = {i.name: i for i in self.inputs}
        # with a backward, not an input an earlier op read: it may be saved for the backward (a
        # where's mask), and eager refuses a saved value changed in place
        used = {name for s in self.steps for name in s.operands} if self.backward else set()
        target = self.pick(lambda v: v.name in inputs and inputs[v.name].index_bound is None
                           and inputs[v.name].layout != "expanded" and not (self.backward and v.dtype == "float")
                           and v.name not in used)
        if target is None:
            return None
        if target.dtype == "bool":
            choices = [("logical_not_", "{0}.logical_not_()", 1.0, True)]
        elif target.dtype == "float":
            choices = [("mul_", "{0}.mul_(0.5)", target.bound, target.exact),
                       ("add_", "{0}.add_(1.0)", target.bound + 1, False),
                       ("clamp_", "{0}.clamp_(-1.0, 1.0)", 1.0, target.exact)]
        else:
            choices = [("add_", "{0}.add_(1)", target.bound + 1, True), ("mul_", "{0}.mul_(2)", target.bound * 2, True)]
        if len(target.shape) >= 1 and self.size(target.shape[-1]) >= 2:
            fill = {"float": "0.5", "bool": "True"}.get(target.dtype, "3")
            choices.append(("fill_", f"{{0}}[..., 1:].fill_({fill})", max(target.bound, 3), target.exact))
        op, code, bound, exact = rng.choice(choices)
        operands = [target]
        views = {s.name for s in self.steps if s.category in VIEWS}  # may alias the target: no copy_ from them
        source = self.pick(lambda v: v.dtype == target.dtype and v.name != target.name and v.name not in views
                           and broadcast_shapes(target.shape, v.shape) == target.shape)
        if source is not None and rng.random() < 0.4:
            op, code, bound, exact = "copy_", "{0}.copy_({1})", source.bound, source.exact
            operands.append(source)
        if bound > (self.limit() if target.dtype == "float" else INT_BOUND_LIMIT):
            return None
        shape = target.shape  # what the op returns: the target, or for fill_ the slice it filled
        if op == "fill_":
            shape = target.shape[:-1] + (target.shape[-1].plus(-1),)
        name = f"v{len(self.steps)}"
        self.steps.append(Step(name, op, "inplace", code, tuple(o.name for o in operands), shape,
                               target.dtype, mutates=True))
        # a copy_ of a reduced value makes the target one (``coverage.special_cases`` follows operands)
        changed = replace(target, bound=bound, exact=exact, reduced=target.reduced or any(
            o.reduced for o in operands))
        self.values[self.values.index(target)] = changed
        value = replace(changed, name=name, shape=shape)
        self.values.append(value)
        return value

    def _creation(self) -> _Value | None:
        rng = self.rng
        value = self.pick(lambda v: v.dtype != "bool" and len(v.shape) >= 1)
        if value is None:
            return None
        if rng.random() < 0.5:
            last = value.shape[-1]
            bound = value.bound + self.size(last)
            if value.dtype == "float" and bound > self.limit():
                return None
            return self.add("arange", "creation",
                            "{0} + torch.arange({d0}, device={0}.device).to({0}.dtype)", [value], value.shape,
                            value.dtype, bound, value.dtype != "float", dims=(last,))
        fill = "0.5" if value.dtype == "float" else "2"
        op, code = rng.choice([("full_like", f"{{0}} * torch.full_like({{0}}, {fill})"),
                               ("ones_like", "{0} - torch.ones_like({0})")])
        return self.add(op, "creation", code, [value], value.shape, value.dtype, value.bound * 2 + 1,
                        value.dtype != "float")


def _symbol_name(k: int) -> str:
    return "abcdefghijklmnopqrstuvwxyz"[k % 26] + (str(k // 26) if k >= 26 else "")


def _index_prefix(dim: int) -> str:
    return ":, " * dim


def _scalar(rng: random.Random, dtype: str) -> str:
    if dtype == "float":
        return rng.choice(["0.5", "2.0", "-1.5", "3.0"])
    if dtype == "bool":
        return "True"
    return rng.choice(["2", "-3", "5"])
