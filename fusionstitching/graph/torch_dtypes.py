"""The IR's dtypes and torch's, both ways: the one map that the frontend, the reference semantics
and the runtime share (it imports torch, so the rest of ``graph`` does not import it)."""

from __future__ import annotations

import torch

from fusionstitching.graph.ops import DType

TORCH_TO_DTYPE = {
    torch.float32: DType.F32,
    torch.float16: DType.F16,
    torch.bfloat16: DType.BF16,
    torch.float64: DType.F64,
    torch.int32: DType.I32,
    torch.int64: DType.I64,
    torch.uint8: DType.U8,
    torch.int8: DType.I8,
    torch.int16: DType.I16,
    torch.bool: DType.BOOL,
}
DTYPE_TO_TORCH = {v: k for k, v in TORCH_TO_DTYPE.items()}
