"""The tensor-op graph IR: ops, nodes and graphs, reference semantics, analyses, serialization."""

from fusionstitching.graph.graph import Graph, GraphBuilder, Layout, Node, VerifyError, verify
from fusionstitching.graph.ops import Category, DType

__all__ = ["Category", "DType", "Graph", "GraphBuilder", "Layout", "Node", "VerifyError", "verify"]
