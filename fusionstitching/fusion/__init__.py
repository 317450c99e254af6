"""Fusion exploration: Graph → FusionPlan (DESIGN.md "Fusion exploration")."""

from fusionstitching.fusion.baseline import baseline
from fusionstitching.fusion.explore import explore
from fusionstitching.fusion.plan import FusedPattern, FusionPlan, UnfusedEdge

__all__ = ["FusedPattern", "FusionPlan", "UnfusedEdge", "baseline", "explore"]
