"""Fuzz programs: small straight-line torch functions with symbolic shapes, and their source text.

A ``Program`` is a list of ``Step``s, each one torch expression over earlier values, plus the
``Input``s it takes and the values it returns. Shapes are symbolic: every dim is a ``Dim``,
``scale × product(symbols) + offset`` over the program's size symbols (``Program.sizes``), so that
the shrinker can make a symbol smaller and every shape, slice bound, pad and index range follows.
The source text (``source``) is rendered with the concrete sizes; it is what the fuzzer executes
and what a reproducer file contains, so the two cannot disagree.

Dtypes of values: ``"float"`` is the program's float dtype, written ``DT`` in the source (a float
program runs once more with ``DT = torch.float64`` as the arbiter of rounding differences);
``"int32"``, ``"int64"``, ``"int16"``, ``"int8"``, ``"uint8"`` and ``"bool"`` are themselves.

Input data is drawn per input from its own ``torch.Generator``, seeded from the program's data
seed and the input's name, so removing an input while shrinking leaves the others' data alone.
"""

from __future__ import annotations

import dataclasses
import math
import sys
import types
import zlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

FLOAT_DTYPES = ("float32", "bfloat16", "float16")


@dataclass(frozen=True)
class Dim:
    """A symbolic dim: ``scale × product(sizes of symbols) + offset``; a constant has no symbols."""

    symbols: tuple[str, ...] = ()
    scale: int = 1
    offset: int = 0

    @staticmethod
    def const(n: int) -> Dim:
        return Dim((), 0, n)

    @staticmethod
    def symbol(name: str) -> Dim:
        return Dim((name,))

    def size(self, sizes: Mapping[str, int]) -> int:
        if not self.symbols:
            return self.offset
        return self.scale * math.prod(sizes[s] for s in self.symbols) + self.offset

    def plus(self, n: int) -> Dim:
        return Dim(self.symbols, self.scale, self.offset + n)

    def __str__(self) -> str:
        if not self.symbols:
            return str(self.offset)
        text = "*".join(([str(self.scale)] if self.scale != 1 else []) + list(self.symbols))
        return text + (f"{self.offset:+d}" if self.offset else "")


Shape = tuple[Dim, ...]


def concrete(shape: Sequence[Dim], sizes: Mapping[str, int]) -> tuple[int, ...]:
    return tuple(d.size(sizes) for d in shape)


LAYOUTS = ("contiguous", "transposed", "offset", "strided", "expanded")


@dataclass(frozen=True)
class Input:
    """An argument of the program. ``index`` inputs hold integers in ``[0, bound)``, or, with
    ``out_of_range``, one element equal to ``bound`` (eager must reject it, so must the compiler).

    ``layout`` (``LAYOUTS``) is how the tensor lies in memory: contiguous; the last two dims
    transposed; at a storage offset; every other element of its last dim; or dim
    ``expanded_dim`` broadcast from size 1 (stride 0)."""

    name: str
    shape: Shape
    dtype: str
    index_bound: Dim | None = None
    out_of_range: bool = False
    layout: str = "contiguous"
    expanded_dim: int = 0


@dataclass(frozen=True)
class Step:
    """``name = code.format(*operands, d0=..., d1=...)``: one torch expression. ``dims`` are the
    symbolic sizes the code spells out (``{d0}``...), rendered with the concrete sizes."""

    name: str
    op: str  # the op's name, counted in the coverage report
    category: str  # its category in the coverage report
    code: str
    operands: tuple[str, ...]
    shape: Shape
    dtype: str
    dims: tuple[Dim, ...] = ()
    mutates: bool = False  # an in-place op on an input: kept though no output reads it


@dataclass(frozen=True)
class Program:
    """A fuzz program; ``ident`` is ``"S:k"`` (program k of seed S), enough to generate it again."""

    ident: str
    dtype: str  # the float dtype DT
    sizes: tuple[tuple[str, int], ...]
    inputs: tuple[Input, ...]
    steps: tuple[Step, ...]
    outputs: tuple[str, ...]
    backward: bool  # float inputs require grad and gradients are compared
    data_seed: int
    expect_error: bool = False  # an out-of-range index: eager raises, the compiled program must too
    calls: int = 1  # calls of the compiled function (a later call takes the lean path of a specialization)

    @property
    def size_map(self) -> dict[str, int]:
        return dict(self.sizes)

    def shape_of(self, name: str) -> Shape:
        return self.value(name).shape

    def value(self, name: str) -> Input | Step:
        for item in self.inputs + self.steps:
            if item.name == name:
                return item
        raise KeyError(name)

    def dims(self) -> list[Dim]:
        """Every dim the program mentions: shapes, spelled-out sizes and index bounds."""
        found = [d for item in self.inputs + self.steps for d in item.shape]
        found += [d for s in self.steps for d in s.dims]
        found += [i.index_bound for i in self.inputs if i.index_bound is not None]
        return found

    def valid_sizes(self, sizes: Mapping[str, int]) -> bool:
        """Every dim non-negative and every index bound positive under ``sizes``."""
        if any(d.size(sizes) < 0 for d in self.dims()):
            return False
        return all(i.index_bound.size(sizes) > 0 or 0 in concrete(i.shape, sizes)
                   for i in self.inputs if i.index_bound is not None)

    def with_sizes(self, sizes: Mapping[str, int]) -> Program:
        return dataclasses.replace(self, sizes=tuple(sorted(sizes.items())))

    def numels(self) -> list[int]:
        sizes = self.size_map
        return [math.prod(concrete(item.shape, sizes)) for item in self.inputs + self.steps]


def input_seed(program: Program, name: str) -> int:
    return (program.data_seed ^ zlib.crc32(name.encode())) & 0x7FFF_FFFF_FFFF


def _input_expression(program: Program, item: Input) -> str:
    """The tensor's data, drawn on the CPU and moved to ``device`` before it is given its layout
    (``Tensor.to`` would make a strided tensor contiguous)."""
    sizes = program.size_map
    shape = concrete(item.shape, sizes)
    storage, view = _layout(item, shape)
    gen = f"_generator({input_seed(program, item.name)})"
    if item.index_bound is not None:
        bound = item.index_bound.size(sizes)
        dtype = "torch.int64" if item.dtype == "int64" else "torch.int32"
        text = f"torch.randint(0, {max(bound, 1)}, {storage}, generator={gen}, dtype={dtype})"
        text = f"_out_of_range({text}, {bound})" if item.out_of_range else text
    elif item.dtype == "float":
        text = f"torch.randn({storage}, generator={gen}).to(DT)"
    elif item.dtype == "bool":
        text = f"torch.randint(0, 2, {storage}, generator={gen}).bool()"
    else:
        low, high = {"uint8": (0, 256), "int8": (-128, 128), "int16": (-300, 301)}.get(item.dtype, (-8, 9))
        text = f"torch.randint({low}, {high}, {storage}, generator={gen}, dtype=torch.{item.dtype})"
    return f"{text}.to(device){view}"


def _layout(item: Input, shape: tuple[int, ...]) -> tuple[tuple[int, ...], str]:
    """The shape of the tensor drawn, and the view of it that the program gets."""
    if item.layout == "transposed" and len(shape) >= 2:
        return shape[:-2] + (shape[-1], shape[-2]), ".transpose(-1, -2)"
    if item.layout == "offset":
        return (math.prod(shape) + 3,), f"[3:].view({shape})"
    if item.layout == "strided" and shape:
        return shape[:-1] + (2 * shape[-1],), "[..., ::2]"
    if item.layout == "expanded" and item.expanded_dim < len(shape):
        narrow = shape[:item.expanded_dim] + (1,) + shape[item.expanded_dim + 1:]
        return narrow, f".expand({shape})"
    return shape, ""


def function_source(program: Program) -> str:
    """``def fn(...)``: the program as a Python function."""
    sizes = program.size_map
    lines = [f"def fn({', '.join(i.name for i in program.inputs)}):"]
    for step in program.steps:
        spelled = {f"d{k}": d.size(sizes) for k, d in enumerate(step.dims)}
        lines.append(f"    {step.name} = {step.code.format(*step.operands, **spelled)}")
    lines.append(f"    return {', '.join(program.outputs)}{',' if len(program.outputs) == 1 else ''}")
    return "\n".join(lines)


PRELUDE = '''import torch
import torch.nn.functional as F


def _generator(seed):
    return torch.Generator().manual_seed(seed)
'''
OUT_OF_RANGE = '''

def _out_of_range(index, bound):
    index.view(-1)[0] = bound
    return index
'''


def source(program: Program) -> str:
    """The module text: ``DT``, ``fn`` and ``make_inputs(device)`` (fresh tensors on every call)."""
    body = [f"    {i.name} = {_input_expression(program, i)}" for i in program.inputs]
    names = ", ".join(i.name for i in program.inputs)
    make = ["def make_inputs(device='cpu'):", *body, f"    return [{names}]"]
    prelude = PRELUDE + (OUT_OF_RANGE if any(i.out_of_range for i in program.inputs) else "")
    return "\n".join([prelude, f"DT = torch.{program.dtype}", "", "", function_source(program), "", "",
                      *make, ""])


@dataclass
class Built:
    """A program made runnable: its function, the same function in float64, and its inputs' maker."""

    fn: Callable[..., Any]
    fn64: Callable[..., Any]
    make_inputs: Callable[..., list[Any]]
    text: str


def build(program: Program, suffix: str = "") -> Built:
    """Execute the program's source as a module (``fuzz_S_k``, registered in ``sys.modules``, where
    TorchDynamo looks up the globals of the functions it inlines) and once more with ``DT = float64``.
    ``suffix`` names the module of another build of the program (at other sizes), which leaves the
    first one's registered."""
    import torch

    text = source(program)
    name = f"fuzz_{program.ident.replace(':', '_')}{suffix}"
    module = _module(name, text, f"<fuzz program {program.ident}>")
    wide = _module(name + "_f64", text, f"<fuzz program {program.ident}, float64>")
    wide.DT = torch.float64
    return Built(module.fn, wide.fn, module.make_inputs, text)


def _module(name: str, text: str, filename: str) -> types.ModuleType:
    module = types.ModuleType(name)
    exec(compile(text, filename, "exec"), module.__dict__)  # noqa: S102 -- the source the generator wrote
    sys.modules[name] = module
    return module


def live(program: Program) -> Program:
    """The program without steps and inputs that no output depends on."""
    needed = set(program.outputs)
    steps = []
    for step in reversed(program.steps):
        if step.name in needed or step.mutates:
            steps.append(step)
            needed.update(step.operands)
    return dataclasses.replace(program, steps=tuple(reversed(steps)),
                               inputs=tuple(i for i in program.inputs if i.name in needed))


def used_symbols(program: Program) -> set[str]:
    return {s for d in program.dims() for s in d.symbols}


def describe(program: Program) -> str:
    """One line: dtype, sizes, op count."""
    sizes = ", ".join(f"{k}={v}" for k, v in program.sizes if k in used_symbols(program))
    return (f"{program.dtype}, {len(program.inputs)} inputs, {len(program.steps)} ops, sizes {sizes or 'none'}"
            f"{', backward' if program.backward else ''}{', expects an error' if program.expect_error else ''}")
