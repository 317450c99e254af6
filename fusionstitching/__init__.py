"""fusionstitching: a just-in-time fusion compiler for memory-intensive deep-learning graphs.

Public API: ``capture`` (PyTorch → IR graphs). See README.md and DESIGN.md for the pipeline.
"""

from fusionstitching.frontend.torch_fx import Captured, capture
from fusionstitching.graph.graph import Graph, GraphBuilder, Layout, Node
from fusionstitching.graph.ops import Category, DType

__all__ = ["Captured", "Category", "DType", "Graph", "GraphBuilder", "Layout", "Node", "capture"]
__version__ = "0.1.0"
