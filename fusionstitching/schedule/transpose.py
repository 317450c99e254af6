"""The shared-memory tiled transpose template, a fallback of ``feasible`` to the register-tiled
default for elementwise patterns whose transposes move an input's innermost dim."""

from __future__ import annotations

from fusionstitching.graph.pattern import is_reduction
from fusionstitching.graph.pattern import iteration_space as _space
from fusionstitching.schedule.packing import MAX_BLOCKS
from fusionstitching.schedule.template import (
    WARP_SIZE,
    KernelSchedule,
    Launch,
    Level,
    Schedule,
    Tile,
    level_extent,
)


def transpose_smem_template(pattern, threads: int = 256) -> KernelSchedule:
    """The classic shared-memory tiled transpose, a fallback to the register-tiled default.

    Every transpose inside the pattern that moves its input's innermost dim becomes an ``S`` group
    over 32 x 32 tiles: its lanes run along the dim that is innermost in the input
    (``CTA_32``: coalesced reads) and the block's warps, ``THREAD_k`` rows each, along the output's
    last dim; the tile goes to shared memory (padded against bank conflicts, see compose.py's note),
    a barrier follows, and each output reads it the other way round, lanes along its last dim
    (coalesced writes), warps along the transposed dim. The other dims are GRID. E.g. for
    ``relu(x.T * y + 1)`` on 4096 x 4096::

        transpose[GRID-CTA_32,GRID-WARP_8-THREAD_4]S; max[GRID-WARP_8-THREAD_4,GRID-CTA_32];
        launch(blocks=16384,threads=256)

    Elementwise patterns only; a ValueError says why a pattern does not fit. ``feasible`` tries it
    when the default template does not lower.
    """
    if any(is_reduction(n) for n in pattern.nodes):
        raise ValueError("the shared-memory transpose template is for patterns without reductions")
    outputs = {id(o) for o in pattern.outputs}
    transposes = [n for n in pattern.nodes if n.op == "transpose" and id(n) not in outputs
                  and n.attrs["permutation"][-1] != len(n.shape) - 1]
    if not transposes:
        raise ValueError("no transpose of an input's innermost dim read inside the pattern")
    tile, warps = WARP_SIZE, threads // WARP_SIZE
    if tile % warps:
        raise ValueError(f"a {tile} x {tile} tile needs a warp count dividing {tile}, found {warps}")
    rank = len(transposes[0].shape)
    lanes_dim = transposes[0].attrs["permutation"].index(rank - 1)

    def dims(lanes: int, rows: int) -> tuple[tuple[Tile, ...], ...]:
        result = [(Tile(Level.GRID),) for _ in range(rank)]
        result[lanes] = (Tile(Level.GRID), Tile(Level.CTA, tile))
        result[rows] = (Tile(Level.GRID), Tile(Level.WARP, warps)) + \
            ((Tile(Level.THREAD, tile // warps),) if tile > warps else ())
        return tuple(result)

    schedules = []
    for node in transposes:
        if len(node.shape) != rank:
            raise ValueError(f"{node.name}: transposes of different ranks ({len(node.shape)}, {rank})")
        schedules.append(Schedule(node.name, dims(node.attrs["permutation"].index(rank - 1), rank - 1), shared=True))
    for out in pattern.outputs:
        if len(_space(out)) != rank:
            raise ValueError(f"{out.name}: output of rank {len(_space(out))}, the transposed tile has rank {rank}")
        schedules.append(Schedule(out.name, dims(rank - 1, lanes_dim)))
    grid = level_extent(schedules[-1], _space(pattern.outputs[-1]), Level.GRID)
    return KernelSchedule(tuple(schedules), Launch(max(1, min(grid, MAX_BLOCKS)), threads))
