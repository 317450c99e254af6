"""Kernel schedules and their text form, the implementation template of [B §5.2].

A ``KernelSchedule`` says how one fused kernel computes its pattern: one ``Schedule`` per group
root (a tiling attribute per dim of the root's iteration space, and ``S`` when the root's result is
cached in shared memory), plus the launch dims. It prints as, and parses from, one line::

    reduce_1[GRID,WARP,WARP,CTA]S; mul_1[GRID,CTA_256-THREAD_4]; launch(blocks=4096,threads=256)

Grammar (the paper's, with a launch clause added; whitespace is allowed between tokens, none
inside ``LEVEL_N``)::

    template ::= schedule (';' schedule)* ';' launch [';']
    schedule ::= identifier '[' [attr (',' attr)*] ']' ['S']
    attr     ::= tile ('-' tile)*
    tile     ::= level ['_' integer]
    level    ::= 'GRID' | 'CTA' | 'WARP' | 'THREAD'
    launch   ::= 'launch' '(' 'blocks' '=' integer ',' 'threads' '=' integer ')'   (keywords in any order)

Departures from the paper: the launch dims are part of the template (the paper keeps them beside
it), a 0-dim iteration space is written ``name[]``, and ``;`` separates items instead of ending
each schedule. Printing is canonical (``"; "`` between items, no other spaces), so
``parse_template(str(ks)) == ks``. Parse errors carry the text and the 0-based offset of the
offending character; the dataclasses check the same rules, without a position, when built.

[Note: tiling semantics]
The iteration space of a root is its output dims, or its input dims for a reduce or a dot. Each dim
of size d is split into nested factors, one per tile, outermost tile first. ``LEVEL_n`` gives that
factor's extent n; one tile per dim may omit n and then takes the remaining extent
ceil(d / product of the other extents) (``tile_extents``). A dim index is the mixed-radix
combination of its factor indices, outer first: i = (f0 * e1 + f1) * e2 + f2 ...; indices >= d
(the tail when the extents over-cover d) are predicated off.

All the factors of one level, across dims in dim order and within a dim outer first, form that
level's index space, of size ``level_extent`` (a linear index over it is split mixed-radix, the
first factor most significant). Each level is mapped onto the hardware as follows:

- GRID: indexed by the blocks of the launch; a grid-stride loop when ``blocks`` < its size.
- WARP: indexed by the warps of a block; a warp-stride loop when there are fewer warps.
- CTA: indexed by the threads of a block (block-stride loop), or, when the schedule has WARP tiles,
  by the 32 lanes of a warp (lane-stride loop).
- THREAD: a sequential loop inside the thread.

E.g. ``reduce_1[GRID,WARP,WARP,CTA]S`` over a (64, 4, 8, 1024) input: block b takes row b of dim
0, the 32 pairs of dims 1 and 2 go to the warps of the block, each warp's 32 lanes stride over
dim 3; the result is cached in shared memory for the consumers in the block (block composition).
"""

from __future__ import annotations

import enum
import functools
import math
import operator
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass

WARP_SIZE = 32
MAX_THREADS = 1024


class Level(str, enum.Enum):
    """A level of the parallel hierarchy that a tile is mapped onto."""

    GRID = "GRID"
    CTA = "CTA"
    WARP = "WARP"
    THREAD = "THREAD"


# ----------------------------------------------------------------------------------------------
# Records
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Tile:
    """One factor of a dim, mapped onto ``level``; ``size`` is its extent, ``None`` for the rest."""

    level: Level
    size: int | None = None

    def __post_init__(self) -> None:
        if type(self.level) is not Level:
            object.__setattr__(self, "level", Level(self.level))
        if self.size is not None and (type(self.size) is not int or self.size < 1):
            object.__setattr__(self, "size", _check_positive("tile size", self.size))

    def __str__(self) -> str:
        return self.level.value if self.size is None else f"{self.level.value}_{self.size}"


@dataclass(frozen=True)
class Schedule:
    """The tiling of one root's iteration space: per dim, its tiles, outermost first."""

    root: str
    dims: tuple[tuple[Tile, ...], ...]
    shared: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "dims", tuple(tuple(tiles) for tiles in self.dims))
        if not isinstance(self.root, str) or not _IDENTIFIER.fullmatch(self.root):
            raise ValueError(f"schedule root must be an identifier, found {self.root!r}")
        for k, tiles in enumerate(self.dims):
            if not tiles:
                raise ValueError(f"{self.root}: dim {k} has no tile")
            if sum(tile.size is None for tile in tiles) > 1:
                raise ValueError(f"{self.root}: dim {k} has more than one unsized tile")

    def __str__(self) -> str:
        return self._text

    @functools.cached_property
    def _text(self) -> str:  # printed in every lowering's comments: built once
        attrs = ",".join("-".join(str(tile) for tile in tiles) for tiles in self.dims)
        return f"{self.root}[{attrs}]{'S' if self.shared else ''}"


@dataclass(frozen=True)
class Launch:
    """The launch dims: a 1-D grid of ``blocks`` blocks of ``threads`` threads."""

    blocks: int
    threads: int

    def __post_init__(self) -> None:
        object.__setattr__(self, "blocks", _check_positive("blocks", self.blocks))
        object.__setattr__(self, "threads", _check_threads("threads", self.threads))

    def __str__(self) -> str:
        return f"launch(blocks={self.blocks},threads={self.threads})"


@dataclass(frozen=True)
class KernelSchedule:
    """One fused kernel's schedules, one per group root, and its launch dims."""

    schedules: tuple[Schedule, ...]
    launch: Launch

    def __post_init__(self) -> None:
        object.__setattr__(self, "schedules", tuple(self.schedules))
        if not self.schedules:
            raise ValueError("a kernel schedule needs at least one schedule")
        seen: set[str] = set()
        for schedule in self.schedules:
            if schedule.root in seen:
                raise ValueError(f"duplicate schedule for root {schedule.root!r}")
            seen.add(schedule.root)

    def __str__(self) -> str:
        return self._text

    @functools.cached_property
    def _text(self) -> str:
        return "; ".join([*(str(s) for s in self.schedules), str(self.launch)])

    def schedule(self, root: str) -> Schedule:
        for schedule in self.schedules:
            if schedule.root == root:
                return schedule
        roots = ", ".join(s.root for s in self.schedules)
        raise KeyError(f"no schedule for root {root!r} (roots: {roots})")


def format_template(ks: KernelSchedule) -> str:
    """The canonical template text of ``ks``; the same as ``str(ks)``."""
    return str(ks)


def _check_positive(what: str, value: int) -> int:
    if isinstance(value, bool) or not hasattr(value, "__index__"):
        raise TypeError(f"{what} must be an int, found {value!r}")
    value = operator.index(value)
    if value < 1:
        raise ValueError(f"{what} must be positive, found {value}")
    return value


def _check_threads(what: str, value: int) -> int:
    value = _check_positive(what, value)
    if value % WARP_SIZE:
        raise ValueError(f"{what} must be a multiple of {WARP_SIZE}, found {value}")
    if value > MAX_THREADS:
        raise ValueError(f"{what} must be at most {MAX_THREADS}, found {value}")
    return value


# ----------------------------------------------------------------------------------------------
# Tiling arithmetic
# ----------------------------------------------------------------------------------------------


def tile_extents(dim_size: int, tiles: Sequence[Tile]) -> tuple[int, ...]:
    """The extent of each factor of a dim of ``dim_size`` elements split by ``tiles``.

    Sized tiles keep their size; the unsized one (at most one) takes ceil(dim_size / product of
    the sizes), at least 1. The extents' product may exceed ``dim_size``: the tail is predicated
    off. With no unsized tile the sizes must cover the dim; a ValueError says so otherwise.
    """
    return _tile_extents(dim_size, tuple(tiles))


@functools.lru_cache(maxsize=4096)
def _tile_extents(dim_size: int, tiles: tuple[Tile, ...]) -> tuple[int, ...]:
    if dim_size < 0:
        raise ValueError(f"dim size must be non-negative, found {dim_size}")
    if not tiles:
        raise ValueError("a dim needs at least one tile")
    if sum(tile.size is None for tile in tiles) > 1:
        raise ValueError(f"more than one unsized tile in {'-'.join(map(str, tiles))}")
    given = math.prod(tile.size for tile in tiles if tile.size is not None)
    rest = max(1, -(-dim_size // given))
    if all(tile.size is not None for tile in tiles) and given < dim_size:
        raise ValueError(f"tiles {'-'.join(map(str, tiles))} cover {given} of a dim of size {dim_size}")
    return tuple(rest if tile.size is None else tile.size for tile in tiles)


def level_extent(schedule: Schedule, dim_sizes: Sequence[int], level: Level) -> int:
    """The size of ``level``'s index space: the product of its factors' extents over all dims.

    ``dim_sizes`` is the root's iteration space, one size per dim of ``schedule``; 1 when the
    level has no tile (e.g. the GRID extent is the number of blocks the schedule wants).
    """
    if len(dim_sizes) != len(schedule.dims):
        raise ValueError(
            f"{schedule.root}: schedule has {len(schedule.dims)} dims, iteration space has {len(dim_sizes)}"
        )
    extent = 1
    for size, tiles in zip(dim_sizes, schedule.dims):
        for tile, factor in zip(tiles, tile_extents(size, tiles)):
            if tile.level == level:
                extent *= factor
    return extent


# ----------------------------------------------------------------------------------------------
# Parser
# ----------------------------------------------------------------------------------------------


class TemplateSyntaxError(ValueError):
    """A template text that does not parse; ``position`` is the 0-based offset of the culprit.

    ``str()`` shows the message at a 1-based column, the offending line and a caret under it.
    """

    def __init__(self, message: str, text: str, position: int) -> None:
        super().__init__(message, text, position)
        self.message = message
        self.text = text
        self.position = position

    def __str__(self) -> str:
        lines = self.text.split("\n")
        row = self.text.count("\n", 0, self.position)
        column = self.position - (self.text.rfind("\n", 0, self.position) + 1)
        where = f"line {row + 1}, column {column + 1}" if len(lines) > 1 else f"column {column + 1}"
        pad = "".join(c if c == "\t" else " " for c in lines[row][:column])
        return f"template syntax error at {where}: {self.message}\n  {lines[row]}\n  {pad}^"


def parse_template(text: str) -> KernelSchedule:
    """Parse an implementation template; raises ``TemplateSyntaxError`` with the position."""
    return _Parser(text).template()


_IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_.]*")
_WORD = re.compile(r"[A-Za-z0-9_.]+")
_LEVEL_WORD = re.compile(r"[A-Za-z][A-Za-z0-9]*")
_INTEGER = re.compile(r"-?[0-9]+")
_SPACE = re.compile(r"\s*")
_LEVELS = ", ".join(level.value for level in Level)


class _Parser:
    """Recursive descent over the text; each method starts at a token (whitespace skipped)."""

    def __init__(self, text: str) -> None:
        self.text = text
        self.pos = 0

    def template(self) -> KernelSchedule:
        self.skip_space()
        if self.at_end():
            raise self.error("empty template")
        schedules: dict[str, Schedule] = {}
        while True:
            start = self.pos
            name = self.match(_IDENTIFIER, "a schedule name or launch(...)")
            self.skip_space()
            if name == "launch" and self.peek("("):
                if not schedules:
                    raise self.error("expected a schedule before launch(...)", start)
                launch = self.launch()
                break
            if name in schedules:
                raise self.error(f"duplicate schedule for root {name!r}", start)
            schedules[name] = self.schedule(name)
            self.expect(";")
            if self.at_end():
                raise self.error("expected a schedule or launch(...), found end of template")
        if self.peek(";"):
            self.expect(";")
        if not self.at_end():
            raise self.error(f"expected end of template after launch(...), found {self.found()}")
        return KernelSchedule(tuple(schedules.values()), launch)

    def schedule(self, name: str) -> Schedule:
        self.expect("[")
        dims: list[tuple[Tile, ...]] = []
        if not self.peek("]"):
            dims.append(self.attr())
            while self.peek(","):
                self.expect(",")
                dims.append(self.attr())
        self.expect("]")
        shared = self.peek("S")
        if shared:
            self.expect("S")
        return Schedule(name, tuple(dims), shared)

    def attr(self) -> tuple[Tile, ...]:
        tiles = [self.tile()]
        while self.peek("-"):
            self.expect("-")
            start = self.pos
            tiles.append(self.tile())
            if tiles[-1].size is None and any(tile.size is None for tile in tiles[:-1]):
                raise self.error("a dim may have only one unsized tile", start)
        return tuple(tiles)

    def tile(self) -> Tile:
        word = _LEVEL_WORD.match(self.text, self.pos)
        if word is None or word.group() not in Level.__members__:
            raise self.error(f"expected one of {_LEVELS}, found {self.found()}")
        self.pos = word.end()
        size = None
        if self.text.startswith("_", self.pos):
            self.pos += 1
            size = self.integer(_check_positive, "tile size")
        self.skip_space()
        return Tile(Level(word.group()), size)

    def launch(self) -> Launch:
        self.expect("(")
        values: dict[str, int] = {}
        while True:
            start = self.pos
            key = self.match(_IDENTIFIER, "blocks or threads")
            if key not in ("blocks", "threads"):
                raise self.error(f"expected blocks or threads, found {key!r}", start)
            if key in values:
                raise self.error(f"duplicate launch keyword {key!r}", start)
            self.skip_space()
            self.expect("=")
            values[key] = self.integer(_check_threads if key == "threads" else _check_positive, key)
            self.skip_space()
            if len(values) == 2:
                break
            if self.peek(")"):
                missing = "threads" if key == "blocks" else "blocks"
                raise self.error(f"launch(...) needs both blocks and threads, missing {missing}")
            self.expect(",")
        self.expect(")")
        return Launch(values["blocks"], values["threads"])

    def integer(self, check: Callable[[str, int], int], what: str) -> int:
        start = self.pos
        digits = _INTEGER.match(self.text, self.pos)
        if digits is None:
            raise self.error(f"expected an integer ({what}), found {self.found()}")
        try:
            value = check(what, int(digits.group()))
        except ValueError as err:
            raise self.error(str(err), start) from None
        self.pos = digits.end()
        return value

    # -- tokens

    def skip_space(self) -> None:
        self.pos = _SPACE.match(self.text, self.pos).end()

    def at_end(self) -> bool:
        return self.pos == len(self.text)

    def peek(self, token: str) -> bool:
        return self.text.startswith(token, self.pos)

    def expect(self, token: str) -> None:
        if not self.peek(token):
            raise self.error(f"expected '{token}', found {self.found()}")
        self.pos += len(token)
        self.skip_space()

    def match(self, pattern: re.Pattern[str], what: str) -> str:
        found = pattern.match(self.text, self.pos)
        if found is None:
            raise self.error(f"expected {what}, found {self.found()}")
        self.pos = found.end()
        return found.group()

    def found(self) -> str:
        if self.at_end():
            return "end of template"
        word = _WORD.match(self.text, self.pos)
        return repr(word.group() if word else self.text[self.pos])

    def error(self, message: str, position: int | None = None) -> TemplateSyntaxError:
        return TemplateSyntaxError(message, self.text, self.pos if position is None else position)


def grid_carried(sched: Schedule, space: Sequence[int], reduced: Sequence[int], blocks: int) -> bool:
    """Whether a reduction's GRID-tiled reduced dims are summed by each block over the iterations
    of the kernel's grid-stride loop: its reduced dims have GRID tiles only, every reduced GRID
    factor is more significant in the grid index than every kept one (they come first in dim
    order), and the launch has exactly as many blocks as the kept GRID factors have points. Block
    ``b`` then visits the grid indices ``b + k * blocks``: the kept factors stay those of ``b``
    and the reduced ones run through all their points."""
    reduced = set(reduced)
    order = []  # (dim, extent) of the GRID factors, most significant first
    for d, (size, tiles) in enumerate(zip(space, sched.dims)):
        extents = tile_extents(size, tiles)
        if d in reduced and any(t.level != Level.GRID for t, e in zip(tiles, extents) if e > 1):
            return False
        order += [(d, e) for t, e in zip(tiles, extents) if t.level == Level.GRID and e > 1]
    flags = [d in reduced for d, _ in order]
    if not any(flags) or flags != sorted(flags, reverse=True):
        return False
    kept = 1
    for d, e in order:
        if d not in reduced:
            kept *= e
    return kept == blocks
