"""The records of the graph IR: a ``Node`` (name, op, operands, shape, dtype, attributes and, for
a tensor crossing the graph boundary, its ``Layout``) and layouts. ``graph.py`` builds and checks
graphs of them; the modules that order and print graphs (``order.py``, ``text.py``) need only
these records."""

from __future__ import annotations

import math
import zlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from fusionstitching.graph.ops import DType, op_info

Shape = tuple[int, ...]


@dataclass(frozen=True)
class Layout:
    """Where a boundary tensor's elements live in its storage: ``offset + sum(i_k * strides[k])``."""

    strides: tuple[int, ...]
    offset: int = 0

    @staticmethod
    def contiguous(shape: Sequence[int]) -> Layout:
        return Layout(contiguous_strides(shape), 0)

    def is_contiguous(self, shape: Sequence[int]) -> bool:
        if self.offset != 0:
            return False
        expected = contiguous_strides(shape)
        return all(size == 1 or s == e for size, s, e in zip(shape, self.strides, expected))


def contiguous_strides(shape: Sequence[int]) -> tuple[int, ...]:
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= max(size, 1)
    return tuple(reversed(strides))


@dataclass(frozen=True, eq=False)
class Node:
    name: str
    op: str
    operands: tuple[Node, ...]
    shape: Shape
    dtype: DType
    attrs: Mapping[str, Any] = field(default_factory=dict)
    layout: Layout | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "attrs", MappingProxyType(dict(self.attrs)))
        # Nodes compare by identity but hash by name: sets and dicts of nodes then iterate in the
        # same order in every process. With the address-based hash, candidate orders (and with them
        # tie-breaks between equally good plans) followed where the allocator put each node.
        object.__setattr__(self, "_hash", zlib.crc32(self.name.encode()))

    def __hash__(self) -> int:
        return self._hash

    @property
    def category(self):
        return op_info(self.op).category

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    def __repr__(self) -> str:
        return f"%{self.name}"
