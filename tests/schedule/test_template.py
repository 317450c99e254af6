"""The implementation template: printing, parsing, errors with positions, tiling arithmetic."""

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from fusionstitching.schedule import (
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

GRID, CTA, WARP, THREAD = Level.GRID, Level.CTA, Level.WARP, Level.THREAD
DESIGN_EXAMPLE = "reduce_1[GRID,WARP,WARP,CTA]S; mul_1[GRID,CTA,CTA,THREAD]; launch(blocks=4096,threads=256)"


def _dims(*attrs: str) -> tuple[tuple[Tile, ...], ...]:
    """Dims from attribute texts, built by hand (not by the parser): "CTA_256-THREAD"."""
    dims = []
    for attr in attrs:
        tiles = []
        for sub in attr.split("-"):
            level, _, size = sub.partition("_")
            tiles.append(Tile(Level(level), int(size) if size else None))
        dims.append(tuple(tiles))
    return tuple(dims)


# ----------------------------------------------------------------------------------------------
# Round trips
# ----------------------------------------------------------------------------------------------


def test_design_example_parses_to_the_expected_records():
    ks = parse_template(DESIGN_EXAMPLE)
    assert ks == KernelSchedule(
        (
            Schedule("reduce_1", _dims("GRID", "WARP", "WARP", "CTA"), shared=True),
            Schedule("mul_1", _dims("GRID", "CTA", "CTA", "THREAD")),
        ),
        Launch(blocks=4096, threads=256),
    )
    assert str(ks) == format_template(ks) == DESIGN_EXAMPLE
    assert ks.schedule("reduce_1").shared and not ks.schedule("mul_1").shared


@pytest.mark.parametrize(
    "text",
    [
        DESIGN_EXAMPLE,
        "reduce_1[GRID,WARP,WARP,CTA]S; mul_1[GRID,CTA_256-THREAD_4]; launch(blocks=4096,threads=256)",
        "reduce_1[GRID_128-WARP_2,WARP,WARP,CTA]S; launch(blocks=128,threads=64)",
        "mul_1[GRID-CTA_256-THREAD_4]; launch(blocks=1,threads=1024)",
        "c[]; launch(blocks=1,threads=32)",
        "c[]S; x.y_2[THREAD]; launch(blocks=7,threads=96)",
        "launch[GRID]; launch(blocks=2,threads=32)",
        "dot_3[GRID_8-GRID,CTA_4-CTA_8,THREAD_16]S; launch(blocks=65535,threads=32)",
    ],
)
def test_canonical_text_round_trips(text):
    ks = parse_template(text)
    assert str(ks) == text
    assert parse_template(str(ks)) == ks


@pytest.mark.parametrize(
    "text",
    [
        "  reduce_1 [ GRID , WARP,WARP ,CTA ] S ;mul_1[GRID,CTA,CTA,THREAD];launch(blocks=4096,threads=256)",
        "reduce_1[GRID,WARP,WARP,CTA]S;\n  mul_1[GRID,CTA,CTA,THREAD];\n  launch(threads=256, blocks=4096);\n",
        "\treduce_1[GRID,WARP,WARP,CTA]S; mul_1[GRID , CTA,CTA,THREAD]; launch ( blocks = 4096 , threads = 256 ) ; ",
    ],
)
def test_whitespace_and_keyword_order_print_canonically(text):
    assert str(parse_template(text)) == DESIGN_EXAMPLE


def test_sizes_print_without_leading_zeros():
    assert str(parse_template("a[CTA_007]; launch(blocks=01,threads=064)")) == (
        "a[CTA_7]; launch(blocks=1,threads=64)"
    )


def test_schedule_lookup_names_the_missing_root():
    ks = parse_template(DESIGN_EXAMPLE)
    assert ks.schedule("mul_1").dims == _dims("GRID", "CTA", "CTA", "THREAD")
    with pytest.raises(KeyError, match="'add_7'.*reduce_1, mul_1"):
        ks.schedule("add_7")


# ----------------------------------------------------------------------------------------------
# Syntax errors: message, exact position, caret
# ----------------------------------------------------------------------------------------------

L32 = "launch(blocks=4,threads=32)"


@pytest.mark.parametrize(
    "text, position, message",
    [
        ("mul_1[GRID,CTA,GIRD]; " + L32, 15, "expected one of GRID, CTA, WARP, THREAD, found 'GIRD'"),
        ("mul_1[GRID,cta]; " + L32, 11, "expected one of GRID, CTA, WARP, THREAD, found 'cta'"),
        ("a[GRID,]; " + L32, 7, "expected one of GRID, CTA, WARP, THREAD, found ']'"),
        ("a[CTA_0]; " + L32, 6, "tile size must be positive, found 0"),
        ("a[CTA_-4]; " + L32, 6, "tile size must be positive, found -4"),
        ("a[CTA_]; " + L32, 6, "expected an integer (tile size), found ']'"),
        ("a[CTA_ 4]; " + L32, 6, "expected an integer (tile size), found ' '"),
        ("a[GRID-CTA_4-THREAD]; " + L32, 13, "a dim may have only one unsized tile"),
        ("a[GRID]; b[CTA]; a[THREAD]; " + L32, 17, "duplicate schedule for root 'a'"),
        ("a[GRID]; launch(blocks=4,threads=48)", 33, "threads must be a multiple of 32, found 48"),
        ("a[GRID]; launch(blocks=4,threads=2048)", 33, "threads must be at most 1024, found 2048"),
        ("a[GRID]; launch(blocks=4,threads=0)", 33, "threads must be positive, found 0"),
        ("a[GRID]; launch(blocks=0,threads=32)", 23, "blocks must be positive, found 0"),
        ("a[GRID]; launch(blocks=4,grid=32)", 25, "expected blocks or threads, found 'grid'"),
        ("a[GRID]; launch(blocks=4,blocks=32)", 25, "duplicate launch keyword 'blocks'"),
        ("a[GRID]; launch(threads=32)", 26, "launch(...) needs both blocks and threads, missing blocks"),
        ("a[GRID]; launch(blocks=x,threads=32)", 23, "expected an integer (blocks), found 'x'"),
        ("", 0, "empty template"),
        ("  \n ", 4, "empty template"),
        ("a[GRID]; " + L32 + " b", 37, "expected end of template after launch(...), found 'b'"),
        ("a[GRID]; " + L32 + ";;", 37, "expected end of template after launch(...), found ';'"),
        ("a[GRID]; " + L32 + "; b[CTA]", 38, "expected end of template after launch(...), found 'b'"),
        (L32 + "; a[GRID]", 0, "expected a schedule before launch(...)"),
        ("a[GRID]", 7, "expected ';', found end of template"),
        ("a[GRID];", 8, "expected a schedule or launch(...), found end of template"),
        ("a[GRID] b[CTA]; " + L32, 8, "expected ';', found 'b'"),
        ("a[GRID]s; " + L32, 7, "expected ';', found 's'"),
        ("1a[GRID]; " + L32, 0, "expected a schedule name or launch(...), found '1a'"),
        ("a(GRID); " + L32, 1, "expected '[', found '('"),
    ],
)
def test_syntax_error_position_and_message(text, position, message):
    with pytest.raises(TemplateSyntaxError) as info:
        parse_template(text)
    err = info.value
    assert (err.position, err.message, err.text) == (position, message, text)
    assert isinstance(err, ValueError)
    if "\n" not in text:
        assert str(err) == (
            f"template syntax error at column {position + 1}: {message}\n  {text}\n  {' ' * position}^"
        )


def test_error_shows_the_caret_under_the_offending_character():
    with pytest.raises(TemplateSyntaxError) as info:
        parse_template("mul_1[GRID,CTA,GIRD]; launch(blocks=4,threads=32)")
    assert str(info.value) == (
        "template syntax error at column 16: expected one of GRID, CTA, WARP, THREAD, found 'GIRD'\n"
        "  mul_1[GRID,CTA,GIRD]; launch(blocks=4,threads=32)\n"
        "                 ^"
    )


def test_error_in_multiline_text_shows_its_line():
    text = "a[GRID];\n\tb[CTA_0];\n  launch(blocks=1,threads=32)"
    with pytest.raises(TemplateSyntaxError) as info:
        parse_template(text)
    assert info.value.position == text.index("0]")
    assert str(info.value) == (
        "template syntax error at line 2, column 8: tile size must be positive, found 0\n"
        "  \tb[CTA_0];\n"
        "  \t      ^"
    )


# ----------------------------------------------------------------------------------------------
# Records check themselves
# ----------------------------------------------------------------------------------------------


def test_records_reject_what_the_parser_rejects():
    with pytest.raises(ValueError, match="positive"):
        Tile(CTA, 0)
    with pytest.raises(TypeError):
        Tile(CTA, True)
    with pytest.raises(ValueError):
        Tile("GIRD")
    with pytest.raises(ValueError, match="identifier"):
        Schedule("1a", ())
    with pytest.raises(ValueError, match="no tile"):
        Schedule("a", ((),))
    with pytest.raises(ValueError, match="more than one unsized"):
        Schedule("a", ((Tile(GRID), Tile(CTA)),))
    with pytest.raises(ValueError, match="multiple of 32"):
        Launch(1, 33)
    with pytest.raises(ValueError, match="at most 1024"):
        Launch(1, 1056)
    with pytest.raises(ValueError, match="duplicate"):
        KernelSchedule((Schedule("a", ()), Schedule("a", ())), Launch(1, 32))
    with pytest.raises(ValueError, match="at least one"):
        KernelSchedule((), Launch(1, 32))


def test_records_normalize_their_fields():
    assert Tile("CTA", 4) == Tile(CTA, 4) and Tile("CTA").level is CTA
    assert Schedule("a", [[Tile(GRID)]]).dims == ((Tile(GRID),),)
    assert KernelSchedule([Schedule("a", ())], Launch(1, 32)).schedules == (Schedule("a", ()),)
    assert hash(parse_template(DESIGN_EXAMPLE)) == hash(parse_template(DESIGN_EXAMPLE))


# ----------------------------------------------------------------------------------------------
# Tiling arithmetic
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "dim_size, attr, extents",
    [
        (1000, "GRID", (1000,)),
        (1000, "GRID-CTA_256", (4, 256)),
        (1024, "CTA_256-THREAD", (256, 4)),
        (1024, "GRID_128-WARP_2-CTA", (128, 2, 4)),
        (100, "GRID_8-CTA_4-THREAD", (8, 4, 4)),
        (10, "CTA_32", (32,)),
        (5, "GRID_8-CTA", (8, 1)),
        (0, "GRID", (1,)),
        (1, "THREAD", (1,)),
    ],
)
def test_tile_extents(dim_size, attr, extents):
    (tiles,) = _dims(attr)
    assert tile_extents(dim_size, tiles) == extents


def test_tile_extents_rejects_sizes_that_do_not_cover_the_dim():
    with pytest.raises(ValueError, match="tiles CTA_32-THREAD_2 cover 64 of a dim of size 100"):
        tile_extents(100, _dims("CTA_32-THREAD_2")[0])
    with pytest.raises(ValueError, match="more than one unsized"):
        tile_extents(100, (Tile(GRID), Tile(CTA)))


def test_level_extent_design_example():
    ks = parse_template(DESIGN_EXAMPLE)
    reduce_1 = ks.schedule("reduce_1")
    sizes = (64, 4, 8, 1024)
    assert [level_extent(reduce_1, sizes, level) for level in Level] == [64, 1024, 32, 1]


def test_level_extent_multi_level_tiles():
    schedule = parse_template("m[GRID_128-WARP,CTA_32-THREAD]; launch(blocks=128,threads=64)").schedule("m")
    sizes = (1000, 100)
    assert level_extent(schedule, sizes, GRID) == 128
    assert level_extent(schedule, sizes, WARP) == 8
    assert level_extent(schedule, sizes, CTA) == 32
    assert level_extent(schedule, sizes, THREAD) == 4
    assert level_extent(Schedule("c", ()), (), GRID) == 1
    with pytest.raises(ValueError, match="2 dims, iteration space has 1"):
        level_extent(schedule, (1000,), GRID)


# ----------------------------------------------------------------------------------------------
# Properties
# ----------------------------------------------------------------------------------------------

identifiers = st.from_regex(r"[A-Za-z_][A-Za-z0-9_.]{0,8}", fullmatch=True)
sizes = st.integers(1, 1 << 40)


@st.composite
def dims(draw):
    tiles = draw(st.lists(st.builds(Tile, st.sampled_from(Level), sizes), max_size=3))
    if draw(st.booleans()) or not tiles:
        tiles.insert(draw(st.integers(0, len(tiles))), Tile(draw(st.sampled_from(Level))))
    return tuple(tiles)


schedules = st.builds(Schedule, identifiers, st.lists(dims(), max_size=5).map(tuple), st.booleans())
launches = st.builds(Launch, st.integers(1, 2**31 - 1), st.integers(1, 32).map(lambda w: 32 * w))
kernel_schedules = st.builds(
    KernelSchedule,
    st.lists(schedules, min_size=1, max_size=4, unique_by=lambda s: s.root).map(tuple),
    launches,
)


def _tokens(ks: KernelSchedule) -> list[str]:
    tokens = []
    for s in ks.schedules:
        tokens += [s.root, "["]
        for k, tiles in enumerate(s.dims):
            tokens += [","] if k else []
            for j, tile in enumerate(tiles):
                tokens += ["-", str(tile)] if j else [str(tile)]
        tokens += ["]", "S", ";"] if s.shared else ["]", ";"]
    keywords = [("blocks", ks.launch.blocks), ("threads", ks.launch.threads)]
    tokens += ["launch", "("]
    for k, (key, value) in enumerate(keywords):
        tokens += [",", key, "=", str(value)] if k else [key, "=", str(value)]
    return tokens + [")"]


@given(kernel_schedules)
def test_parse_inverts_print(ks):
    assert parse_template(str(ks)) == ks
    assert str(parse_template(str(ks))) == str(ks)


@given(kernel_schedules, st.data())
def test_any_whitespace_between_tokens_parses_to_the_same_schedule(ks, data):
    tokens = _tokens(ks) + data.draw(st.sampled_from([[], [";"]]))
    spaces = st.sampled_from(["", " ", "  ", "\n", "\t", " \n "])
    text = data.draw(spaces) + "".join(token + data.draw(spaces) for token in tokens)
    assert parse_template(text) == ks
    assert str(parse_template(text)) == str(ks)


@given(st.integers(0, 10**6), dims())
def test_tile_extents_cover_the_dim_minimally(dim_size, tiles):
    given_product = math.prod(t.size for t in tiles if t.size is not None)
    if all(t.size is not None for t in tiles) and given_product < dim_size:
        with pytest.raises(ValueError):
            tile_extents(dim_size, tiles)
        return
    extents = tile_extents(dim_size, tiles)
    assert [e for t, e in zip(tiles, extents) if t.size is not None] == [t.size for t in tiles if t.size]
    assert math.prod(extents) >= dim_size
    unsized = [e for t, e in zip(tiles, extents) if t.size is None]
    if unsized and unsized[0] > 1:
        assert given_product * (unsized[0] - 1) < dim_size


@pytest.mark.parametrize("text, space, reduced, blocks, carried", [
    ("p[GRID,GRID,CTA_256-THREAD_8]", (4, 16, 2048), (0,), 16, True),  # block b visits b, b + 16, ...
    ("p[GRID,GRID,CTA_256-THREAD_8]", (4, 16, 2048), (0,), 8, False),  # blocks visit other kept points
    ("p[GRID,GRID,CTA_256-THREAD_8]", (16, 4, 2048), (1,), 16, False),  # the reduced factor is not leading
    ("p[GRID,GRID,GRID,CTA_256]", (2, 2, 8, 256), (0, 1), 8, True),
    ("p[GRID-THREAD_2,GRID,CTA_256-THREAD_8]", (4, 16, 2048), (0,), 16, False),  # a THREAD tile on a reduced dim
    ("p[GRID,CTA_256-THREAD_8]", (16, 2048), (), 16, False),  # nothing reduced
])
def test_grid_carried_needs_leading_reduced_grid_factors_and_one_block_per_kept_point(text, space, reduced, blocks,
                                                                                   carried):
    from fusionstitching.schedule.template import grid_carried

    sched = parse_template(text + "; launch(blocks=1,threads=256)").schedules[0]
    assert grid_carried(sched, space, reduced, blocks) is carried
