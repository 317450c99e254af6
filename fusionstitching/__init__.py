"""fusionstitching: a just-in-time fusion compiler for memory-intensive deep-learning graphs.

Public API: ``torch.compile(model, backend="fusionstitching")`` (or ``compile``), ``stats``, ``capture``
(PyTorch → IR graphs), ``Options``; ``fusionstitching.fusion.explore`` plans. See README.md and
DESIGN.md for the pipeline.
"""

from fusionstitching.frontend.backend import CompileFailure, FallbackWarning, compile, register, stats
from fusionstitching.frontend.torch_fx import Captured, capture
from fusionstitching.graph.graph import Graph, GraphBuilder, Layout, Node
from fusionstitching.graph.ops import Category, DType
from fusionstitching.options import Options

__all__ = ["Captured", "Category", "CompileFailure", "DType", "FallbackWarning", "Graph", "GraphBuilder", "Layout",
           "Node", "Options", "capture", "compile", "stats"]
__version__ = "0.1.0"

register()  # torch.compile(..., backend="fusionstitching") works once the package is imported
