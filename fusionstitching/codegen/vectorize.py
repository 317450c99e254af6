"""128-bit vector accesses: a Kernel IR pass (placeholder identity until implemented)."""

from __future__ import annotations

from fusionstitching.codegen import kernel_ir as K


def vectorize(kernel: K.Kernel) -> K.Kernel:
    return kernel
