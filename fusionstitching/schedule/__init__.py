"""Kernel schedules: how the ops of a fused pattern map onto a CUDA kernel (DESIGN.md, Kernel schedules)."""

from fusionstitching.schedule.template import (
    KernelSchedule,
    Launch,
    Level,
    Schedule,
    TemplateSyntaxError,
    Tile,
    format_template,
    level_extent,
    parse_template,
    tile_extents,
)

__all__ = [
    "KernelSchedule",
    "Launch",
    "Level",
    "Schedule",
    "TemplateSyntaxError",
    "Tile",
    "check_block_locality",
    "feasible",
    "format_template",
    "level_extent",
    "parse_template",
    "tile_extents",
]


def feasible(graph, nodes, smem_limit: int = 48 * 1024, lowers=None):
    """A KernelSchedule that the code generator builds for ``nodes`` of ``graph`` within ``smem_limit``
    bytes of shared memory per block, or a falsy Reason (``schedule/grouping.py``: ``lowers`` is the
    code generator's check, by default the one the package registers)."""
    from fusionstitching.schedule.grouping import feasible as _feasible

    return _feasible(graph, nodes, smem_limit, lowers)


def check_block_locality(graph, nodes, template, smem_limit: int = 48 * 1024):
    """The Reason why ``template`` is provably not block-local for ``nodes`` of ``graph``, or None
    (``schedule/propagate.py``: block footprints, A's split_dim/sword view and Table 1's rules)."""
    from fusionstitching.schedule.propagate import check_block_locality as _check

    return _check(graph, nodes, template, smem_limit)
