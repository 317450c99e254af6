"""Block footprints: paper A's split_dim/sword view of a template and its Table 1 rules [A §4.1-4.2].

DESIGN.md "Block locality": a node's *block footprint* (what one block computes or needs of it) comes
from the GRID attributes; an edge through a warp shuffle or shared memory is legal only when the
consumer block's need lies in the producer's footprint for that block. ``check_block_locality``
decides it from the template alone, before lowering (``schedule.feasible``).

[Note: A's view] A cuts an op's work at ``split_dim`` into ``sword`` chunks (a divisor of the dim),
Row (the dims left of split_dim are blocks, one index each; those right of it are whole in the
block) or Column (the mirror image) [A §4.1]. ``schedule_view`` reads this off a ``Schedule`` with,
per dim, the GRID extent and the elements a block holds, or says why A cannot express the tiling.

[Note: footprints] Composed groups share the GRID factor registers by position (codegen/compose.py),
so a block is a point b of the first schedule's GRID space. A footprint dim (``DimFootprint``) is
``offset + Σ c_p·b_p + Σ w_j·l_j`` over local digits 0 <= l_j < e_j, clipped to [low, high): exact
for a root's tiles (tails are the clip). ``None`` is a dim not of that form; nothing follows from it.

[Note: Table 1] Needs go from each group root through the thread-composed nodes of its group, up to
a sub-root of another group (a cross-thread reduction read from shuffle registers, an ``S`` root read
from shared memory) or an input [A §4.2]. Elementwise ops pass the need; transpose permutes it (A's
"split_dim <= min trans dim keeps Row" is when the result is still one split_dim view); reduce
needs its reduced dims whole, and a reduction root with a GRID-split reduced dim holds no complete
result; dot_general passes batch and free dims and needs contracting dims whole (A splits batch
dims only; our dots compute each element in one thread, so only a split contracting dim, a partial
sum, is refused); broadcast drops the added dims; reshape merges or cuts digits where they align
with the cut (A's "transform split dim and sword"). Beyond A: slice scales and shifts; pad and
concatenate shift and clip (a piece outside the need is not read; interior padding must divide);
gather needs its indices elementwise, and ``None`` (data dependent) of its table's gathered dim.

[Note: soundness] The pre-check must never refuse what lowering accepts, so a refusal is a proof: a
block (the origin, or one GRID index at 1 or at its last value) where the consumer has work, each
dim of its need has an element and one dim an element outside the producer's footprint, an
interval. All else passes (``None`` dims, producers that are not intervals, ``S`` roots that
shared-memory planning may recompute: over the limit, not outputs); lowering, exact per thread,
refuses more. A GRID-split reduction that is stored or reduced across threads for its readers is
refused, as lowering does: several blocks would write each element, or readers get partial results.
Cost: one walk per distinct group footprint, with memoized tilings.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import NamedTuple

from fusionstitching.graph.graph import Graph, Node
from fusionstitching.graph.pattern import is_reduction, iteration_space, reduced_dims, resolve_pattern
from fusionstitching.schedule.packing import needs_composition
from fusionstitching.schedule.refusals import Reason
from fusionstitching.schedule.template import (
    WARP_SIZE,
    KernelSchedule,
    Level,
    Schedule,
    grid_carried,
    tile_extents,
)

# -- A's view of a schedule ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class DimSplit:
    """How the GRID tiles cut one dim: ``blocks`` parts of ``extent`` elements each."""

    size: int
    blocks: int  # product of the dim's GRID extents
    extent: int  # elements of the dim one block holds (product of its other extents)
    outermost: bool  # GRID tiles before the local ones: one contiguous chunk per block

    @property
    def kind(self) -> str:
        return "whole" if self.blocks == 1 else "grid-split" if self.outermost else "interleaved"

    def __str__(self) -> str:
        cut = f"{self.blocks}x{self.extent} of " if self.blocks > 1 else ""
        return f"{self.kind}({cut}{self.size})"


@dataclass(frozen=True)
class PaperView:
    """A §4.1's schedule; ``sched_type`` is "Row" or "Column"."""

    split_dim: int
    sword: int
    sched_type: str

    def __str__(self) -> str:
        return f"{self.sched_type}(split_dim={self.split_dim}, sword={self.sword})"


@dataclass(frozen=True)
class ScheduleView:
    """Per dim the block split, and A's view when one split_dim/sword expresses it (else ``note``)."""

    root: str
    dims: tuple[DimSplit, ...]
    paper: PaperView | None
    note: str = ""

    def __str__(self) -> str:
        return f"{self.root}[{', '.join(map(str, self.dims))}]: {self.paper or self.note}"


def schedule_view(schedule: Schedule, space: Sequence[int]) -> ScheduleView:
    """A's split_dim/sword/sched_type of ``schedule`` over its iteration space ``space``, with the
    per-dim block split; ``paper`` is None and ``note`` says why when A cannot express it."""
    if len(space) != len(schedule.dims):
        raise ValueError(f"{schedule.root}: {len(schedule.dims)} dims for an iteration space of {len(space)}")
    dims = []
    for size, tiles in zip(space, schedule.dims):
        extents = tile_extents(size, tiles)
        split = [k for k, (t, e) in enumerate(zip(tiles, extents)) if t.level == Level.GRID and e > 1]
        local = [k for k, (t, e) in enumerate(zip(tiles, extents)) if t.level != Level.GRID and e > 1]
        dims.append(DimSplit(size, math.prod(extents[k] for k in split), math.prod(extents[k] for k in local),
                             not split or not local or max(split) < min(local)))
    strided = [d for d, s in enumerate(dims) if s.kind == "interleaved"]
    split = [d for d, s in enumerate(dims) if s.blocks > 1]
    one_each = [s.extent == 1 or s.size == 1 for s in dims]
    view, note = PaperView(0, 1, "Row"), ""
    if strided:
        note = f"GRID tiles of dim {strided[0]} lie inside local tiles: a block holds a strided subset"
    elif split and all(one_each[: split[-1]]):
        view = PaperView(split[-1], dims[split[-1]].blocks, "Row")
    elif split and all(one_each[split[0] + 1:]):
        view = PaperView(split[0], dims[split[0]].blocks, "Column")
    elif split:
        note = (f"dims {[d for d in split if not one_each[d]]} are cut into chunks of several elements; "
                "Row needs one index per block before split_dim, Column after it")
    cut = dims[view.split_dim] if dims else None  # a 0-dim space is one block
    if split and not note and cut.blocks * cut.extent != cut.size:
        note = (f"would be {view}, but {cut.blocks} chunks of {cut.extent} do not cut dim {view.split_dim} "
                f"of size {cut.size} evenly (A's sword must divide it)")
    return ScheduleView(schedule.root, tuple(dims), None if note else view, note)


# -- Footprints ----------------------------------------------------------------------------------------------


class DimFootprint(NamedTuple):
    """``offset + Σ c·b[p] for (p, c) in terms + Σ w·l for (w, e) in digits (0 <= l < e)``, clipped
    to [low, high), b the block's GRID index (module note); a tuple, so hashed and compared fast."""

    terms: tuple[tuple[int, int], ...]
    offset: int
    digits: tuple[tuple[int, int], ...]  # (weight, extent), heaviest first, adjacent ones merged
    low: int
    high: int

    def __str__(self) -> str:
        if not self.terms and self.offset == 0 and self.low == 0 and self.digits == ((1, self.high),):
            return f"all({self.high})"
        parts = [f"b{p}" if c == 1 else f"{c}*b{p}" for p, c in self.terms]
        parts += [str(self.offset)] if self.offset else []
        parts += [f"[0,{e})" if w == 1 else f"{w}*[0,{e})" for w, e in self.digits]
        return f"{'+'.join(parts) or '0'} in [{self.low},{self.high})"


Dims = tuple  # tuple[DimFootprint | None, ...], one per dim of a node


@dataclass(frozen=True)
class Footprint:
    """What one block holds (a group root) or needs (other nodes) of a node, per dim; a ``None`` dim
    is not of the module note's form, or several consumers need different sets."""

    dims: Dims

    def __str__(self) -> str:
        return "[" + ", ".join("?" if d is None else str(d) for d in self.dims) + "]"


def _dim(terms, offset: int, digits, low: int, high: int) -> DimFootprint:
    merged: list[tuple[int, int]] = []
    for w, e in sorted(((w, e) for w, e in digits if e > 1), reverse=True):
        if merged and merged[-1][0] == w * e:
            merged[-1] = (w, merged[-1][1] * e)
        else:
            merged.append((w, e))
    return DimFootprint(tuple(sorted((p, c) for p, c in terms if c)), offset, tuple(merged), low, high)


def _whole(size: int) -> DimFootprint:
    return DimFootprint((), 0, ((1, size),) if size > 1 else (), 0, size)


_FIRST = _dim((), 0, (), 0, 1)  # index 0 of a size-1 dim


def block_footprint(schedule: Schedule, space: Sequence[int]) -> Footprint:
    """What block b computes of ``schedule``'s iteration space ``space``."""
    return Footprint(_schedule_info(schedule.dims, tuple(space), frozenset())[0])


def _unclipped(fp: DimFootprint, grid: Sequence[int]) -> bool:
    top = fp.offset + sum(c * (grid[p] - 1) for p, c in fp.terms) + sum(w * (e - 1) for w, e in fp.digits)
    return fp.offset >= fp.low and top < fp.high


def _affine(fp: DimFootprint | None, scale: int, shift: int, size: int, step: int = 1):
    """x → (scale·x + shift) / step, clipped to [0, size); False when nothing lands inside, None when
    some element is not a multiple of ``step`` (interior padding)."""
    if fp is None:
        return None
    parts = [fp.offset * scale + shift, *(c * scale for _, c in fp.terms), *(w * scale for w, _ in fp.digits)]
    if step > 1 and any(v % step for v in parts):
        return None
    low = max(-(-(fp.low * scale + shift) // step), 0)
    high = min(((fp.high - 1) * scale + shift) // step + 1, size)
    if low >= high:
        return False
    return DimFootprint(tuple((p, c * scale // step) for p, c in fp.terms), parts[0] // step,
                        tuple((w * scale // step, e) for w, e in fp.digits), low, high)


def _merge(parts: Sequence[tuple[DimFootprint | None, int]], grid: Sequence[int]) -> DimFootprint | None:
    """Row-major merge of dims (a reshape joining them); inner dims must not be clipped."""
    if any(fp is None for fp, _ in parts):
        return None
    terms, digits, offset, scale = [], [], 0, 1
    for k in range(len(parts) - 1, -1, -1):
        fp, size = parts[k]
        if k and not _unclipped(fp, grid):
            return None
        terms += [(p, c * scale) for p, c in fp.terms]
        digits += [(w * scale, e) for w, e in fp.digits]
        offset += fp.offset * scale
        scale *= size
    outer, inner = parts[0][0], scale // parts[0][1]
    return _dim(terms, offset, digits, outer.low * inner, outer.high * inner)


def _divmod(fp: DimFootprint, n: int, outer_size: int, grid: Sequence[int]):
    """(x // n, x % n) as two dims, or None when the terms and digits do not align with the cut."""
    if _unclipped(fp, grid):
        outer_clip = (0, outer_size)
    elif fp.low % n == 0 and fp.high % n == 0:
        outer_clip = (fp.low // n, fp.high // n)
    else:
        return None
    outer_terms = [(p, c // n) for p, c in fp.terms if c % n == 0]
    inner_terms = [(p, c) for p, c in fp.terms if c % n]
    outer_digits, inner_digits = [], []
    for w, e in fp.digits:
        if w % n == 0:
            outer_digits.append((w // n, e))
        elif w * (e - 1) < n:
            inner_digits.append((w, e))
        elif n % w == 0 and e % (n // w) == 0:  # a digit across the cut: its low and high parts
            inner_digits.append((w, n // w))
            outer_digits.append((1, e // (n // w)))
        else:
            return None
    inner = _dim(inner_terms, fp.offset % n, inner_digits, 0, n)
    if not _unclipped(inner, grid):
        return None
    return _dim(outer_terms, fp.offset // n, outer_digits, *outer_clip), inner


def _split(fp: DimFootprint | None, sizes: Sequence[int], grid: Sequence[int]) -> list[DimFootprint | None]:
    result: list[DimFootprint | None] = []
    for k in range(len(sizes) - 1):
        pair = _divmod(fp, math.prod(sizes[k + 1:]), sizes[k], grid) if fp is not None else None
        if pair is None:
            return [None] * len(sizes)
        result.append(pair[0])
        fp = pair[1]
    return result + [fp]


# -- Table 1: what a block needs of an op's operands when it needs ``need`` of the op ------------------------


def _operand_needs(node: Node, need: Dims, grid: Sequence[int]) -> list[tuple[Node, Dims]]:
    """(operand, what the block needs of it) for each operand ``node`` reads where it is needed."""
    op, operands, a = node.op, node.operands, node.attrs
    if op not in _SHAPE_OPS:
        return [(x, need if len(x.shape) == len(need) else (None,) * len(x.shape)) for x in operands]
    x = operands[0]
    if op == "broadcast_in_dim":
        dims = a["broadcast_dimensions"]
        return [(x, tuple(_FIRST if x.shape[i] == 1 else need[d] for i, d in enumerate(dims)))]
    if op == "transpose":
        return [(x, tuple(need[a["permutation"].index(d)] for d in range(len(need))))]
    if op == "reshape":
        return [(x, _reshape(need, node.shape, x.shape, grid))]
    if op == "reduce":
        rest = iter(need)
        return [(x, tuple(_whole(x.shape[d]) if d in a["dims"] else next(rest) for d in range(len(x.shape))))]
    if op == "dot_general":
        return _dot_needs(node, need + tuple(_whole(x.shape[d]) for d in a["lhs_contract"]))
    if op == "slice":
        return _if_read(x, [_affine(fp, st, lo, n) for fp, lo, st, n in
                            zip(need, a["start"], a["stride"], x.shape)])
    if op == "pad":
        return _if_read(x, [_affine(fp, 1, -lo, n, it + 1) for fp, lo, it, n in
                            zip(need, a["low"], a["interior"], x.shape)])
    if op == "gather":
        axis, batch, indices = a["axis"], a["batch_dims"], operands[1]
        k = len(indices.shape) - batch
        return [(indices, need[:batch] + need[axis:axis + k]), (x, need[:axis] + (None,) + need[axis + k:])]
    axis, start, result = a["dimension"], 0, []  # concatenate
    for x in operands:
        result += _if_read(x, [*need[:axis], _affine(need[axis], 1, -start, x.shape[axis]), *need[axis + 1:]])
        start += x.shape[axis]
    return result


_SHAPE_OPS = frozenset(("broadcast_in_dim", "transpose", "reshape", "reduce", "dot_general", "slice", "pad",
                        "gather", "concatenate"))  # the others are elementwise (Table 1's "pass")



def _reshape(need: Dims, out_shape: tuple[int, ...], in_shape: tuple[int, ...], grid) -> Dims:
    """Dims matched in groups of equal size, as ``codegen.reshape.reshape_index`` matches them."""
    result: list = [None] * len(in_shape)
    i = j = 0
    while 0 not in out_shape + in_shape and (i < len(out_shape) or j < len(in_shape)):
        if j < len(in_shape) and in_shape[j] == 1:
            result[j] = _FIRST
            j += 1
            continue
        if i < len(out_shape) and out_shape[i] == 1:
            i += 1
            continue
        group_out, group_in, p_out, p_in = [i], [j], out_shape[i], in_shape[j]
        i, j = i + 1, j + 1
        while p_out != p_in:
            if p_out < p_in:
                group_out.append(i)
                p_out, i = p_out * out_shape[i], i + 1
            else:
                group_in.append(j)
                p_in, j = p_in * in_shape[j], j + 1
        while i < len(out_shape) and out_shape[i] == 1:
            i += 1
        merged = need[group_out[0]] if len(group_out) == 1 else \
            _merge([(need[k], out_shape[k]) for k in group_out], grid)
        for k, fp in zip(group_in, _split(merged, [in_shape[k] for k in group_in], grid)):
            result[k] = fp
    return tuple(result)


def _if_read(x: Node, dims: list) -> list[tuple[Node, Dims]]:
    return [] if any(d is False for d in dims) else [(x, tuple(dims))]


def _dot_needs(node: Node, space: Dims) -> list[tuple[Node, Dims]]:
    """Operand needs of a dot from its iteration-space need (output dims, then contracting dims)."""
    (lhs, rhs), a = node.operands, node.attrs
    n_batch, n_out = len(a["lhs_batch"]), len(node.shape)
    lhs_free = [d for d in range(len(lhs.shape)) if d not in a["lhs_batch"] + a["lhs_contract"]]
    rhs_free = [d for d in range(len(rhs.shape)) if d not in a["rhs_batch"] + a["rhs_contract"]]
    left: list = [None] * len(lhs.shape)
    right: list = [None] * len(rhs.shape)
    for k, (dl, dr) in enumerate(zip(a["lhs_batch"] + a["lhs_contract"], a["rhs_batch"] + a["rhs_contract"])):
        left[dl] = right[dr] = space[k if k < n_batch else n_out + k - n_batch]
    for k, d in enumerate(lhs_free + rhs_free):
        (left if k < len(lhs_free) else right)[d] = space[n_batch + k]
    return [(lhs, tuple(left)), (rhs, tuple(right))]


# -- Block locality ------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class LocalityReason(Reason):
    """A refused edge: ``producer`` → ``consumer`` (node names), the ``rule`` and the producer dims."""

    producer: str = ""
    consumer: str = ""
    rule: str = ""
    dims: tuple[int, ...] = ()


@dataclass
class _Group:
    root: Node
    space: Dims  # the iteration-space footprint: what the block computes
    held: Dims  # what the block holds of the root's result
    split_reduced: tuple[int, ...]  # reduced dims cut across blocks: no block has a complete result
    read: str | None  # how other groups read it: "register", "shared", "maybe" (planning may recompute)


@lru_cache(maxsize=4096)
def _schedule_info(tiling: tuple, space: tuple[int, ...], reduced: frozenset[int]):
    """Of a root's tiling, memoized: its footprint, GRID (by position) and WARP extents, held dims,
    GRID-split reduced dims, whether it reduces across threads or across warps, and a bound of its
    ``S`` buffer's bytes."""
    dims, grid, warps, kept = [], [], [], []
    for d, (size, tiles) in enumerate(zip(space, tiling)):
        extents = tile_extents(size, tiles)
        terms, digits = [], []
        for k, (tile, e) in enumerate(zip(tiles, extents)):
            weight = math.prod(extents[k + 1:])
            if tile.level == Level.GRID:
                if e > 1:  # a GRID tile of one block is no grid dim (the codegen shares grids alike)
                    terms.append((len(grid), weight))
                    grid.append(e)
            else:
                digits.append((weight, e))
        dims.append(_dim(terms, 0, digits, 0, size))
        warps += [e for t, e in zip(tiles, extents) if t.level == Level.WARP]
        if d not in reduced:
            kept.append(math.prod(e for t, e in zip(tiles, extents) if t.level != Level.GRID))
    levels = {t.level for d in reduced for t in tiling[d]}
    cells = math.prod(kept) + math.prod(kept[:-1])  # a padding cell per row at most
    held = tuple(fp for d, fp in enumerate(dims) if d not in reduced)
    return (tuple(dims), tuple(grid), tuple(warps), held,
            tuple(d for d in sorted(reduced) if dims[d].terms), Level.CTA in levels,
            Level.CTA not in levels and Level.WARP in levels, -(-cells * 4 // 16) * 16)


class _Kernel:
    """The groups of one kernel and the walks from their roots (module note)."""

    def __init__(self, pattern, template: KernelSchedule, smem_limit: int) -> None:
        self.by_name = {n.name: n for n in pattern.nodes}
        self.inside = {id(n) for n in pattern.nodes}
        self.outputs = {o.name: o for o in pattern.outputs}
        if any(s.root not in self.by_name for s in template.schedules):
            raise ValueError("a schedule names a node outside the pattern")
        order = {n.name: k for k, n in enumerate(pattern.nodes)}
        self.groups: list[_Group] = []
        grids, warps, droppable, shared_bytes, scratch = [], [], [], 0, False
        for sched in sorted(template.schedules, key=lambda s: order[s.root]):
            root = self.by_name[sched.root]
            space = iteration_space(root)
            if len(space) != len(sched.dims):
                raise ValueError(f"{root.name}: {len(sched.dims)} dims for an iteration space of {space}")
            reduced = frozenset(reduced_dims(root)) if is_reduction(root) else frozenset()
            dims, grid, warp, held, split, cross, by_warp, size = _schedule_info(sched.dims, space, reduced)
            if split and root.name in self.outputs and not sched.shared and root.op == "reduce" \
                    and grid_carried(sched, space, reduced, template.launch.blocks):
                split = ()  # each block sums the points of its grid loop (template.grid_carried)
            grids.append(grid)
            warps.append(warp)
            read = "register" if cross else "shared" if sched.shared and not by_warp else None
            self.groups.append(_Group(root, dims, held, split, read))
            droppable.append(sched.shared and root.name not in self.outputs)
            shared_bytes += size if sched.shared else 0
            scratch = scratch or cross
        self.composed = needs_composition(template.schedules, self.outputs, self.by_name)
        self.grid, self.mismatch = grids[0], None
        for level, lists in (("GRID", grids), ("WARP", warps)):
            for g, other in zip(self.groups[1:], lists[1:]):
                if self.composed and other != lists[0] and self.mismatch is None:
                    first = self.groups[0].root.name
                    self.mismatch = LocalityReason(
                        f"block locality: {g.root.name} tiles the {level} space as {list(other)}, {first} as "
                        f"{list(lists[0])}; composed groups share one grid", first, g.root.name, "grid")
        over = shared_bytes + (4 * WARP_SIZE * 2 if scratch else 0) > smem_limit  # with the reduction scratch
        self.report_partial = False  # refuse reads of a split reduction (propagate), or not (pre-check)
        self.sub_roots: dict[int, _Group] = {}
        for g, drop in zip(self.groups, droppable):
            g.read = "maybe" if drop and over else g.read  # over the limit, planning may recompute S roots
            if self.composed and g.read is not None:
                self.sub_roots[id(g.root)] = g

    def reasons(self, first_only: bool, needs: dict[str, list] | None = None) -> list[LocalityReason]:
        if self.mismatch is not None:
            return [self.mismatch]
        found = [self._split_reason(g, "(kernel output)" if g.root.name in self.outputs else "(its readers)")
                 for g in self.groups if g.split_reduced and (g.root.name in self.outputs or g.read is not None)]
        if (found and first_only) or (not self.sub_roots and needs is None):
            return found  # nothing is read across threads: every read is recomputed
        walked: dict[Dims, dict] = {}  # groups with the same footprint need the same things
        for g in self.groups:
            found += self._walk(g, first_only, needs, walked.setdefault(g.space, {}))
            if first_only and found:
                break
        return found

    def _walk(self, group: _Group, first_only: bool, needs: dict[str, list] | None,
              seen: dict[int, list]) -> list[LocalityReason]:
        """Needs from ``group``'s root down to sub-roots and inputs; ``seen``: id(node) → needs walked."""
        found: list[LocalityReason] = []
        start = (group.root.name, None)  # the path back to the group root, linked
        root, space = group.root, group.space  # a reduction root reads its operand over its iteration space
        firsts = [(root.operands[0], space)] if root.op == "reduce" else _dot_needs(root, space) \
            if root.op == "dot_general" else _operand_needs(root, space, self.grid)
        stack = [(x, need, start) for x, need in firsts]
        while stack:
            node, need, path = stack.pop()
            if id(node) not in self.inside:
                continue
            producer = self.sub_roots.get(id(node))
            if producer is not None:
                reason = self._edge(producer, need, path, group) if producer.read != "maybe" else None
                if reason is not None:
                    found.append(reason)
                    if first_only:
                        return found
                continue
            walked = seen.setdefault(id(node), [])
            if need in walked:
                continue
            walked.append(need)
            if needs is not None:
                needs.setdefault(node.name, []).append(need)
            stack += [(x, x_need, (node.name, path)) for x, x_need in _operand_needs(node, need, self.grid)]
        return found

    def _edge(self, producer: _Group, need: Dims, link: tuple, group: _Group) -> LocalityReason | None:
        if producer.split_reduced and self.report_partial:  # lowering builds these (module note)
            return self._split_reason(producer, link[0])
        found = _escape(need, producer.held, group.space, self.grid)
        if found is None:
            return None
        (dims, block), path = found, []
        while link is not None:
            path, link = [link[0], *path], link[1]
        name, consumer = producer.root.name, path[-1]
        op = self.by_name[consumer].op  # the Table 1 rule it follows, or its own name (slice, pad, ...)
        rule = "broadcast" if op == "broadcast_in_dim" else op if op in _SHAPE_OPS else "elementwise"
        via = f", via {' <- '.join(path[:-1])}" if len(path) > 1 else ""
        where = ", ".join(f"b{p}={v}" for p, v in sorted(block.items())) or "b=0"
        return LocalityReason(
            f"block locality: {name} → {consumer} ({rule} rule; group {group.root.name}{via}): block {where} "
            f"needs {name}{Footprint(need)} but holds {name}{Footprint(producer.held)}; dims {list(dims)} "
            f"of {name} leave the block's footprint", name, consumer, rule, dims)

    def _split_reason(self, g: _Group, consumer: str) -> LocalityReason:
        return LocalityReason(
            f"block locality: {g.root.name} → {consumer} ({g.root.op} rule, A Table 1): "
            f"{'contracting' if g.root.op == 'dot_general' else 'reduced'} dims "
            f"{list(g.split_reduced)} of {g.root.name} are split across blocks (GRID), so no block holds a "
            "complete result", g.root.name, consumer, g.root.op, g.split_reduced)


def _span_at(fp: DimFootprint, block: dict[int, int]):
    """(smallest, largest) element of ``fp`` in ``block``; None when empty, "unknown" (several digits,
    clipped) when not computed."""
    base = fp.offset + sum(c * block.get(p, 0) for p, c in fp.terms)
    if len(fp.digits) <= 1:
        w, e = fp.digits[0] if fp.digits else (1, 1)
        first, last = max(0, -(-(fp.low - base) // w)), min(e - 1, (fp.high - 1 - base) // w)
        return (base + first * w, base + last * w) if first <= last else None
    top = base + sum(w * (e - 1) for w, e in fp.digits)
    return (base, top) if base >= fp.low and top < fp.high else "unknown"


def _outside(span: tuple[int, int], held: DimFootprint, block: dict[int, int]) -> bool:
    """Whether an end of ``span`` lies outside ``held`` in ``block`` (False if ``held`` is no interval)."""
    if len(held.digits) > 1 or (held.digits and held.digits[0][0] != 1):
        return False
    base = held.offset + sum(c * block.get(p, 0) for p, c in held.terms)
    top = base + (held.digits[0][1] - 1 if held.digits else 0)
    return span[0] < max(base, held.low) or span[1] > min(top, held.high - 1)


def _escape(need: Dims, held: Dims, own: Dims, grid: Sequence[int]):
    """(producer dims, block): a block whose consumer has work and needs an element the block does
    not hold; tried at the origin and at each GRID index set to 1 and to its last value."""
    if None in need or None in held or len(need) != len(held):
        return None
    if all(n == h or h == _whole(h.high) for n, h in zip(need, held)):
        return None  # the same sets, or the block holds the whole dim
    positions = sorted({p for fp in itertools.chain(need, held, own) if fp is not None for p, _ in fp.terms})
    for block in [{}] + [{p: v} for p in positions for v in sorted({1, grid[p] - 1}) if 0 < v < grid[p]]:
        spans = [_span_at(fp, block) for fp in need]
        if all(isinstance(s, tuple) for s in spans) and all(
                fp is not None and isinstance(_span_at(fp, block), tuple) for fp in own):
            dims = tuple(d for d, (s, h) in enumerate(zip(spans, held)) if _outside(s, h, block))
            if dims:
                return dims, block
    return None


# -- Entry points --------------------------------------------------------------------------------------------


def check_block_locality(graph: Graph, nodes: Iterable[Node | str], template: KernelSchedule,
                         smem_limit: int = 48 * 1024, *, pattern=None) -> Reason | None:
    """Why ``template`` cannot be block-local for ``nodes`` of ``graph`` (a ``LocalityReason``), or None
    when nothing proves it; never refuses what lowering accepts (module note). ``pattern``: the resolved
    pattern, if the caller has it; ``smem_limit``: the one lowering will use."""
    pattern = resolve_pattern(graph, nodes) if pattern is None else pattern
    try:
        kernel = _Kernel(pattern, template, smem_limit)
    except ValueError:  # a template lowering refuses for reasons of its own
        return None
    found = kernel.reasons(first_only=True)
    return found[0] if found else None


def propagate(graph: Graph, nodes: Iterable[Node | str], template: KernelSchedule,
              smem_limit: int = 48 * 1024) -> dict[str, Footprint | Reason]:
    """For every node of the pattern, the footprint one block needs of it (of a group root: what the
    block holds of its result), or the Reason naming the refused edge out of it; a node needed
    differently by several consumers has ``None`` where the needs differ. A ValueError says when the
    template does not fit the pattern (unknown roots, wrong ranks, tiles that do not cover a dim)."""
    pattern = resolve_pattern(graph, nodes)
    kernel = _Kernel(pattern, template, smem_limit)
    kernel.report_partial = True
    needs: dict[str, list] = {}
    reasons = kernel.reasons(first_only=False, needs=needs)
    result: dict[str, Footprint | Reason] = {
        name: Footprint(tuple(d if all(n[k] == d for n in seen) else None for k, d in enumerate(seen[0])))
        for name, seen in needs.items()}
    result.update({g.root.name: Footprint(g.held) for g in kernel.groups})
    result.update({r.producer: r for r in reversed(reasons)})
    return {n.name: result[n.name] for n in pattern.nodes if n.name in result}
