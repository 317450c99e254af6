"""The lanes' branch merging of ``codegen/vectorize.py`` on hand-written Kernel IR: what it merges,
and the dependences that keep a branch where it is."""

from __future__ import annotations

from fusionstitching.codegen import kernel_ir as K
from fusionstitching.codegen.vectorize import _merge_lane_branches, affine, pack_lanes

I32 = "i32"


def _v(name: str, dtype: str = "f32") -> K.Var:
    return K.Var(name, dtype)


def _lane(j: int, cond: K.Expr, base: K.Expr, buffer: str = "in0") -> list[K.Stmt]:
    """Lane ``j``: ``float p_j = 0; if (cond) { ld_j = buffer[base + j]; p_j = ld_j; }``."""
    index = K.Binary("add", base, K.Const(j, I32), I32)
    return [K.Let(_v(f"p{j}"), K.Const(0.0, "f32")),
            K.If(cond, (K.Let(_v(f"ld{j}"), K.Load(buffer, index, "f32")), K.Assign(_v(f"p{j}"), _v(f"ld{j}"))))]


def _cond() -> K.Expr:
    return K.Binary("lt", _v("h", I32), K.Const(5, I32), "bool")


def _base() -> K.Expr:
    return K.Binary("mul", K.Binary("div", _v("h", I32), K.Const(2, I32), I32), K.Const(64, I32), I32)


def test_four_lanes_branches_merge_and_their_reads_become_one_vector():
    stmts = [s for j in range(4) for s in _lane(j, _cond(), _base())]
    merged, ids = _merge_lane_branches(stmts)
    branches = [s for s in merged if isinstance(s, K.If)]
    assert len(branches) == 1 and id(branches[0]) in ids and len(branches[0].then) == 8
    assert [s.var.name for s in merged if isinstance(s, K.Let)] == ["p0", "p1", "p2", "p3"]
    packed = pack_lanes(stmts, {}, 4)
    (branch,) = [s for s in packed if isinstance(s, K.If)]
    assert sum(isinstance(s, K.VecLoad) for s in branch.then) == 1


def test_a_quotient_is_an_opaque_term_and_a_load_is_not():
    half = K.Binary("div", _v("h", I32), K.Const(2, I32), I32)
    assert affine(K.Binary("add", _base(), K.Const(3, I32), I32), {}) == ({half: 64}, 3)
    gathered = K.Binary("mul", K.Load("idx", _v("h", I32), I32), K.Const(64, I32), I32)
    assert affine(gathered, {}) is None


def test_a_branch_reading_a_register_set_after_the_first_stays():
    """Lane 1's branch reads ``q``, declared between the two branches: it cannot move up."""
    lane0 = _lane(0, _cond(), _base())
    q = K.Let(_v("q", I32), K.Binary("add", _v("h", I32), K.Const(1, I32), I32))
    lane1 = _lane(1, _cond(), K.Binary("add", _base(), _v("q", I32), I32))
    merged, ids = _merge_lane_branches(lane0 + [q] + lane1)
    assert sum(isinstance(s, K.If) for s in merged) == 2 and not ids


def test_a_branch_stays_behind_a_store_to_what_it_loads_and_a_barrier():
    for between in (K.Store("in0", _v("h", I32), K.Const(1.0, "f32")), K.Barrier()):
        merged, ids = _merge_lane_branches(_lane(0, _cond(), _base()) + [between] + _lane(1, _cond(), _base()))
        assert sum(isinstance(s, K.If) for s in merged) == 2 and not ids


def test_a_branch_whose_register_is_read_in_between_stays():
    """Something between the branches reads lane 1's ``p1`` (its initial value): moving lane 1's
    branch up would change what it reads."""
    lane1 = _lane(1, _cond(), _base())
    reader = K.Let(_v("r"), K.Binary("add", _v("p1"), K.Const(1.0, "f32"), "f32"))
    merged, ids = _merge_lane_branches(_lane(0, _cond(), _base()) + [lane1[0], reader, lane1[1]])
    assert sum(isinstance(s, K.If) for s in merged) == 2 and not ids


def test_branches_on_different_conditions_stay_apart():
    other = K.Binary("lt", _v("w", I32), K.Const(5, I32), "bool")
    merged, ids = _merge_lane_branches(_lane(0, _cond(), _base()) + _lane(1, other, _base()))
    assert sum(isinstance(s, K.If) for s in merged) == 2 and not ids
