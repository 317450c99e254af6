"""Kernels shared across the shapes of a symbolic graph: sizes as kernel arguments.

A graph of symbolic shapes is specialized per concrete shape signature (``backend._Runner``): each
specialization is planned and lowered at its own sizes, so each of its kernels is exact for them.
The kernels of two specializations often differ only in constants: grid extents, strides, trip
counts, the block ranges of packed sub-kernels, the grid itself. Compiling each with NVRTC and
loading its module costs most of a new shape's first call.

``SizeFamilies`` groups the kernels of one graph's specializations by their *skeleton*: the kernel
with every constant blanked (name, threads, buffers, shared arrays and the whole statement and
expression tree kept). The first kernel of a skeleton keeps its own source. A kernel of a later
specialization with that skeleton takes the *parametric* kernel of the family: the kernel with the
constants that differ between the family's members replaced by scalar arguments (``K.Param``). It
is compiled once and launched with each member's own values and grid; a member whose values
differ only where the parametric kernel already takes arguments compiles nothing. Where a new
member differs at another constant, the family's parametric kernel is made again with that one
too (one more compile; the earlier members keep theirs).

Why this is exact: a member runs the parametric kernel with its own constants bound, which is its
own kernel, constant for constant (``bind(parametric, values) == member``, tested, comments aside):
the skeleton compares everything else but the comments' text, which quotes sizes (a packed
sub-kernel's block range) and is no code. A parametric kernel's comments are those of the member
it was made from. Two constants are never made arguments: a ``pow`` exponent (the
printer expands small integral ones) and an integer divisor that is not positive in a member (the
printer's division by a positive argument is C's ``/``).
"""

from __future__ import annotations

import dataclasses
import struct
import threading
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from fusionstitching.codegen import kernel_ir as K

_PLAIN, _DIVISOR, _EXPONENT = "plain", "divisor", "exponent"
PREFIX = "fs_size"  # the name of a size argument: fs_size0, fs_size1, ...


def _rebuild(node: Any, const: Callable[[K.Const, str], Any], role: str = _PLAIN, comments: bool = True) -> Any:
    """``node`` with each constant ``c`` replaced by ``const(c, role)``, in preorder (a subtree
    shared in the DAG is visited once per occurrence, as the printer prints it); without
    ``comments``, every comment's text blanked."""
    if isinstance(node, K.Const):
        return const(node, role)
    if isinstance(node, K.Comment) and not comments:
        return K.Comment("")
    if isinstance(node, tuple):
        return tuple(_rebuild(item, const, comments=comments) for item in node)
    fields = getattr(node, "__dataclass_fields__", None)
    if fields is None:
        return node
    values = {}
    for name in fields:
        value = getattr(node, name)
        child_role = _PLAIN
        if isinstance(node, K.Binary) and name == "b":
            if node.op == "pow":
                child_role = _EXPONENT
            elif node.op in ("div", "rem") and node.dtype not in K.FLOAT_TYPES:
                child_role = _DIVISOR
        values[name] = _rebuild(value, const, child_role, comments) \
            if isinstance(value, tuple) or hasattr(value, "__dataclass_fields__") else value
    return type(node)(**values)


def _bits(value: Any, dtype: str) -> tuple:
    """A constant's value compared bit for bit (NaN equals NaN; 0.0 differs from -0.0)."""
    if dtype in ("f32", "f64"):
        return (dtype, struct.pack("<d", float(value)))
    return (dtype, int(value))


class _Skeleton:
    """A kernel's skeleton (hashable, ``key``) and its constants in preorder: value, dtype, role."""

    def __init__(self, kernel: K.Kernel) -> None:
        self.consts: list[tuple[Any, str, str]] = []

        def blank(c: K.Const, role: str) -> Any:
            self.consts.append((c.value, c.dtype, role))
            if role == _EXPONENT:
                return c
            return K.Param(f"c{len(self.consts) - 1}", c.dtype)

        body = _rebuild(kernel.body, blank, comments=False)  # a comment may quote sizes: it is no code
        buffers = tuple((b.name, b.dtype, b.space, b.readonly, b.aligned, b.noalias) for b in kernel.params)
        shared = tuple((b.name, b.dtype, b.extent) for b in kernel.shared)
        self.key = (kernel.name, kernel.threads, buffers, shared, kernel.scalars, body)
        self.bits = [_bits(v, t) for v, t, _ in self.consts]


def parametrize(kernel: K.Kernel, positions: Sequence[int]) -> K.Kernel:
    """``kernel`` with the constants at ``positions`` (preorder, as ``_Skeleton`` counts them) made
    scalar arguments ``fs_size0, fs_size1, ...`` in that order."""
    slot = {p: j for j, p in enumerate(sorted(positions))}
    params: list[K.Param | None] = [None] * len(slot)
    counter = [0]

    def swap(c: K.Const, role: str) -> Any:
        k = counter[0]
        counter[0] += 1
        j = slot.get(k)
        if j is None:
            return c
        params[j] = K.Param(f"{PREFIX}{j}", c.dtype)
        return params[j]

    body = _rebuild(kernel.body, swap)
    notes = (f"shared across shapes: {len(slot)} size arguments",)
    return dataclasses.replace(kernel, body=body, notes=notes, scalars=tuple(params))


def bind(kernel: K.Kernel, values: Sequence[Any], blocks: int, notes: tuple[str, ...] = ()) -> K.Kernel:
    """The parametric ``kernel`` with its scalar arguments replaced by the constants ``values``."""
    table = {p.name: K.Const(v, p.dtype) for p, v in zip(kernel.scalars, values, strict=True)}

    def put(node: Any) -> Any:
        if isinstance(node, K.Param):
            return table[node.name]
        if isinstance(node, tuple):
            return tuple(put(item) for item in node)
        fields = getattr(node, "__dataclass_fields__", None)
        if fields is None or isinstance(node, K.Const):
            return node
        return type(node)(**{name: put(getattr(node, name)) for name in fields})

    return dataclasses.replace(kernel, body=put(kernel.body), scalars=(), blocks=blocks, notes=notes)


def pack(value: Any, dtype: str) -> int:
    """The bits of a scalar argument as the integer a launcher's 8-byte argument slot holds (the
    argument's own bytes first, little-endian)."""
    if dtype == "f32":
        return struct.unpack("<I", struct.pack("<f", float(value)))[0]
    if dtype == "f64":
        return struct.unpack("<Q", struct.pack("<d", float(value)))[0]
    if dtype == "bool":
        return int(bool(value))
    bits = 32 if dtype in ("i32", "u32") else 64
    return int(value) & ((1 << bits) - 1)


class _Family:
    __slots__ = ("bits", "compile", "hoisted", "parametric")

    def __init__(self, bits: list[tuple], compile_id: int) -> None:
        self.bits = bits  # the founder's constants
        self.compile = compile_id  # the compile that found it
        self.hoisted: frozenset[int] = frozenset()
        self.parametric: Any = None  # the GeneratedKernel taking the hoisted constants as arguments


class SizeFamilies:
    """The kernel families of one graph's specializations (see the module's docstring)."""

    def __init__(self) -> None:
        self._families: dict[tuple, _Family] = {}
        self._lock = threading.Lock()
        self._compiles = 0
        self.shared = 0  # kernels that took a family's parametric kernel
        self.parametric = 0  # parametric kernels made

    def adopt(self, kernels: Iterable[Any]) -> int:
        """Let the generated kernels of one compile (a specialization) take their families'
        parametric kernels (``GeneratedKernel._shared``); returns how many did. Kernels of one
        compile never share with each other: a graph compiled once keeps every kernel its own."""
        with self._lock:
            self._compiles += 1
            taken = 0
            for kernel in kernels:
                if kernel._twin is not None:
                    continue
                for variant in (kernel, kernel._scalar_variant):
                    if variant is not None and self._adopt(variant, self._compiles):
                        taken += 1
            self.shared += taken
            return taken

    def _adopt(self, kernel: Any, compile_id: int) -> bool:
        from fusionstitching.codegen.generate import GeneratedKernel

        ir = kernel.lowered.kernel
        if ir.scalars:
            return False
        skeleton = _Skeleton(ir)
        family = self._families.get(skeleton.key)
        if family is None:
            self._families[skeleton.key] = _Family(skeleton.bits, compile_id)
            return False
        if family.compile == compile_id:
            return False
        differ = {i for i, (a, b) in enumerate(zip(family.bits, skeleton.bits)) if a != b}
        hoisted = family.hoisted | differ
        if any(skeleton.consts[i][2] == _DIVISOR and skeleton.consts[i][0] <= 0 for i in hoisted):
            return False
        if family.parametric is None or hoisted != family.hoisted:
            shared_ir = parametrize(ir, sorted(hoisted))
            from fusionstitching.codegen import cuda_c

            lowered = dataclasses.replace(kernel.lowered, kernel=shared_ir)
            family.parametric = GeneratedKernel(lowered, kernel.template, cuda_c.render(shared_ir))
            family.hoisted = frozenset(hoisted)
            self.parametric += 1
        shared_ir = family.parametric.lowered.kernel
        values = [skeleton.consts[i][0] for i in sorted(family.hoisted)]
        kernel._shared = (family.parametric, tuple(pack(v, p.dtype) for v, p in zip(values, shared_ir.scalars)),
                          tuple(values))
        return True
