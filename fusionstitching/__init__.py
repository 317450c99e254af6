"""fusionstitching: a just-in-time fusion compiler for memory-intensive deep-learning graphs.

Public API: ``torch.compile(model, backend="fusionstitching")`` (or ``compile``), ``stats``,
``wait_for_compiles`` (``Options(async_compile=True)``), ``capture``
(PyTorch → IR graphs), ``explain`` (every stage's output for a callable's graphs, as files),
``Options``; ``fusionstitching.fusion.explore`` plans. See README.md and docs/architecture.md.
"""

import os as _os

from fusionstitching.fusion.background import PLANNER_ONLY as _PLANNER_ONLY
from fusionstitching.graph.graph import Graph, GraphBuilder, Layout, Node
from fusionstitching.graph.ops import Category, DType
from fusionstitching.options import Options
from fusionstitching.schedule.grouping import register_lowering_check

# A planning worker process (``fusionstitching/worker.py``, started with ``background.PLANNER_ONLY``
# set) imports the planner and code generator only: not the backend, the frontend or PyTorch.
_PLANNING_WORKER = _os.environ.get(_PLANNER_ONLY) == "1"
if not _PLANNING_WORKER:
    from fusionstitching.backend import (
        CompileFailure,
        FallbackWarning,
        compile,
        register,
        stats,
        wait_for_compiles,
    )
    from fusionstitching.frontend.torch_fx import Captured, capture

__all__ = ["Captured", "Category", "CompileFailure", "DType", "FallbackWarning", "Graph", "GraphBuilder", "Layout",
           "Node", "Options", "capture", "compile", "explain", "stats", "wait_for_compiles"]
__version__ = "0.1.0"



def __getattr__(name: str) -> object:
    """``explain`` is loaded on first use: it needs the planner and code generator, which
    ``import fusionstitching`` alone does not load."""
    if name == "explain":
        from fusionstitching.pipeline import explain

        return explain
    if _PLANNING_WORKER and name in __all__:
        raise AttributeError(f"fusionstitching.{name} is not loaded: {_PLANNER_ONLY}=1 is set, under which the "
                             "package loads only the planner and code generator (the planning worker's mode)")
    raise AttributeError(f"module 'fusionstitching' has no attribute {name!r}")


def _lowering_refusal(*args: object) -> object:
    """The code generator's answer to ``schedule.feasible`` (``codegen.generate.lowering_refusal``),
    loaded when first asked: schedule and fusion stand below codegen and cannot import it."""
    from fusionstitching.codegen.generate import lowering_refusal

    return lowering_refusal(*args)


register_lowering_check(_lowering_refusal)
if not _PLANNING_WORKER:
    register()  # torch.compile(..., backend="fusionstitching") works once the package is imported
