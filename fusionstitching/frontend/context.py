"""What an ATen lowering sees: the FX node being converted, its meta value and IR helpers.

Every entry of ``aten_table.TABLE`` is called as ``lower(cx, *args, **kwargs)`` with the FX node's
arguments already converted: tensors are IR ``Node``s, Python scalars stay Python values, lists
stay lists. ``cx`` knows the node's result shape and dtype (from ``node.meta["val"]``, the fake
tensor AOTAutograd recorded) and makes IR nodes through the graph builder.

Type promotion (DESIGN.md "Precision") happens here, explicitly: ``lift`` converts an operand to
the dtype the op computes in and broadcasts it to the result shape, so every IR elementwise op
sees operands of one shape and one dtype. Python scalars become scalar constants of the tensor's
dtype and so never promote it, as in torch.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from fusionstitching.graph.graph import GraphBuilder, Layout, Node
from fusionstitching.graph.ops import DType
from fusionstitching.graph.torch_dtypes import DTYPE_TO_TORCH, TORCH_TO_DTYPE


class CaptureError(RuntimeError):
    """A graph that cannot be converted; the message names the FX node and its ATen op."""


class StorageDependent(CaptureError):
    """A graph whose result depends on more than its inputs' values (an ``as_strided`` at an absolute
    storage offset of a graph input): it runs in PyTorch, by design rather than by an internal error."""


class Unsupported(Exception):
    """Raised by a lowering for a case it does not handle; the node becomes a library call."""


def to_dtype(dtype: torch.dtype, where: str = "") -> DType:
    try:
        return TORCH_TO_DTYPE[dtype]
    except KeyError:
        raise Unsupported(f"dtype {dtype} is not supported{where}") from None


def layout_of(value: torch.Tensor) -> Layout:
    return Layout(tuple(int(s) for s in value.stride()), int(value.storage_offset()))


class LoweringContext:
    """Per-node view of the conversion: result meta plus node-making helpers."""

    def __init__(self, builder: GraphBuilder, fx_node: torch.fx.Node, rng: RngState,
                 values: Mapping[torch.fx.Node, Any] | None = None) -> None:
        self.b = builder
        self.fx_node = fx_node
        self.meta = fx_node.meta.get("val")
        self.rng = rng
        # the IR values of the FX nodes converted so far (an ``as_strided`` reads the storage of a
        # node other than its operand)
        self.values = values if values is not None else {}

    # -- the result ----------------------------------------------------------------------------
    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(int(s) for s in self.meta.shape)

    @property
    def dtype(self) -> DType:
        return to_dtype(self.meta.dtype, f" (result of {self.fx_node.name})")

    def meta_of(self, index: int) -> torch.Tensor:
        """The fake value of the index-th result of a multi-output op."""
        return self.meta[index]

    # -- operand coercion --------------------------------------------------------------------
    def constant(self, value: Any, dtype: DType, shape: Sequence[int] = ()) -> Node:
        scalar = self.b.constant(value, dtype)
        return self.broadcast_to(scalar, shape)

    def broadcast_to(self, x: Node, shape: Sequence[int]) -> Node:
        """Numpy-style broadcast: align trailing dims, expand size-1 dims."""
        shape = tuple(shape)
        if x.shape == shape:
            return x
        offset = len(shape) - len(x.shape)
        if offset < 0:
            raise CaptureError(f"{self.fx_node.name}: cannot broadcast {list(x.shape)} to {list(shape)}")
        return self.b.broadcast(x, shape, tuple(range(offset, len(shape))))

    def lift(self, x: Any, dtype: DType, shape: Sequence[int] | None = None) -> Node:
        """An operand as an IR node of ``dtype``, broadcast to ``shape`` (default: the result's)."""
        shape = self.shape if shape is None else tuple(shape)
        if isinstance(x, Node):
            return self.broadcast_to(self.b.convert(x, dtype), shape)
        if isinstance(x, (bool, int, float)):
            return self.constant(x, dtype, shape)
        raise Unsupported(f"operand {x!r} of type {type(x).__name__}")

    def common_dtype(self, *args: Any) -> DType:
        """torch's result_type over tensors (by their IR dtype) and Python scalars."""
        examples = []
        for a in args:
            if isinstance(a, Node):
                examples.append(torch.empty((1,) * len(a.shape), dtype=DTYPE_TO_TORCH[a.dtype]))
            elif a is not None:
                examples.append(a)
        result = examples[0]
        if len(examples) == 1:
            return to_dtype(result.dtype) if isinstance(result, torch.Tensor) else to_dtype(
                torch.tensor(result).dtype)
        dtype = torch.result_type(examples[0], examples[1])
        for e in examples[2:]:
            dtype = torch.promote_types(dtype, torch.result_type(e, torch.empty((), dtype=dtype)))
        return to_dtype(dtype)

    # -- node making ----------------------------------------------------------------------------
    def node(self, op: str, *operands: Node, **kwargs: Any) -> Node:
        return self.b.node(op, operands, **kwargs)

    def elementwise(self, op: str, *args: Any, dtype: DType | None = None) -> Node:
        """``op`` over ``args`` lifted to ``dtype`` (default: the result dtype) and the result shape."""
        dtype = self.dtype if dtype is None else dtype
        return self.b.node(op, [self.lift(a, dtype) for a in args])

    def reshape(self, x: Node, shape: Sequence[int]) -> Node:
        return self.b.reshape(x, tuple(shape))

    def normalize_dim(self, dim: int, rank: int) -> int:
        if not -max(rank, 1) <= dim < max(rank, 1):
            raise CaptureError(f"{self.fx_node.name}: dim {dim} out of range for rank {rank}")
        return dim % max(rank, 1)

    def normalize_dims(self, dims: Sequence[int] | int | None, rank: int) -> tuple[int, ...]:
        """Reduction dims: None or [] means every dim. A 0-d tensor has none: torch accepts dim 0
        or -1 for it and reduces nothing (the reduction is the identity, or a cast)."""
        if dims is None or (isinstance(dims, (list, tuple)) and len(dims) == 0):
            return tuple(range(rank))
        if isinstance(dims, int):
            dims = [dims]
        normalized = tuple(sorted({self.normalize_dim(d, rank) for d in dims}))
        return normalized if rank > 0 else ()


class RngState:
    """Seed and offset parameters, made on first use, and a stream number per rng node."""

    def __init__(self, builder: GraphBuilder) -> None:
        self.builder = builder
        self.seed: Node | None = None
        self.offset: Node | None = None
        self.streams = 0

    def uniform(self, shape: Sequence[int], dtype: DType) -> Node:
        if self.seed is None:
            self.seed = self.builder.parameter((), DType.I64, name="rng_seed")
            self.offset = self.builder.parameter((), DType.I64, name="rng_offset")
        stream, self.streams = self.streams, self.streams + 1
        return self.builder.rng_uniform(self.seed, self.offset, stream, shape, dtype)
