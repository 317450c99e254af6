"""Code generation: Kernel IR, lowering of a scheduled pattern, CUDA C, CPU simulation."""

from fusionstitching.codegen.generate import GeneratedKernel, default_template, generate

__all__ = ["GeneratedKernel", "default_template", "generate"]
