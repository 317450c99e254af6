"""The main module of the worker process that explores ahead and alongside (``fusion/background.py``).

The worker is started with ``background.PLANNER_ONLY`` set in its environment, so that the package imports
its planner and code generator without PyTorch and TorchDynamo (``fusionstitching/__init__.py``):
it is ready in about a third of the time a full import takes, before the graph it is wanted for
has been traced. The step after a plan it sends, generating the plan's kernels and compiling them
with NVRTC (``pipeline._compile_kernels``), needs the runtime and loads it at its first use.
"""

from __future__ import annotations

from typing import Any

from fusionstitching.fusion import background
from fusionstitching.options import Options


def _compile_kernels(plan: Any, options: Options, arch: str) -> None:
    from fusionstitching.pipeline import _compile_kernels as compile_kernels

    compile_kernels(plan, options, arch)


if __name__ == "__main__":
    background.serve(after=_compile_kernels)
