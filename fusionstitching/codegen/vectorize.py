"""128-bit (and 64-bit) vector accesses for the lanes of a THREAD_v factor.

When a root's innermost tile is ``THREAD_v``, lowering unrolls the v lanes and this pass merges
their scalar accesses: ``Let x_j = buf[e + j]`` for j = 0..v-1 becomes one ``VecLoad`` (in chunks
of 16 bytes of the buffer's type) and the v stores one ``VecStore``. Where the v lanes of a buffer
hold only 8 bytes (a row of f32 tiled by 4 lanes also read as bf16: the GEMM output in BERT's
LayerNorm kernels), they become one 8-byte access instead of four 2-byte ones, and where they hold
4 bytes of narrower lanes, one 32-bit word. Bools are a byte per lane: 16, 8 or 4 lanes of a mask
(a ReLU's, saved for the backward) are one access.
A group merges only when an affine analysis proves the lane-0 index a multiple of the chunk:
indices are expanded through the registers that define them (``definitions``) into a sum of
opaque terms with integer coefficients plus a constant, and every coefficient and the constant
must be divisible. Accesses inside a branch, broadcast reads (same index on every lane) and
strided reads stay scalar. Base addresses are assumed 16-byte aligned; the launcher checks that
and otherwise runs the scalar variant of the kernel.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from fusionstitching.codegen import kernel_ir as K

ITEM_BYTES = {"f32": 4, "f64": 8, "f16": 2, "bf16": 2, "i32": 4, "i64": 8, "u32": 4, "u64": 8, "u8": 1, "i8": 1, "i16": 2,
              "bool": 1}
VECTOR_BYTES = 16


def affine(e: K.Expr, definitions: Mapping[str, K.Expr],
           memo: dict[str, tuple] | None = None) -> tuple[dict[str | K.Expr, int], int] | None:
    """``e`` as (coefficients of opaque terms, constant), or None when it is not affine. An opaque
    term is a register that is no sum of products by constants, or a pure integer expression that is
    not (a quotient, a remainder: ``(h / 2) * 3584`` in a padded read's index), keyed by itself: it has
    one value wherever it occurs. ``memo`` keeps the forms of registers expanded through
    ``definitions`` (a register is defined once, so its form never changes); the forms returned are
    shared and must not be modified."""
    if isinstance(e, K.Const) and isinstance(e.value, int) and not isinstance(e.value, bool):
        return {}, e.value
    if isinstance(e, K.Var):
        if memo is not None:
            known = memo.get(e.name)
            if known is not None:
                return known
        form = None
        if e.name in definitions:
            form = affine(definitions[e.name], definitions, memo)
        if form is None:
            form = {e.name: 1}, 0
        if memo is not None:
            memo[e.name] = form
        return form
    if isinstance(e, K.Cast) and e.dtype in ("i32", "i64") and e.x.dtype in ("i32", "i64"):
        return affine(e.x, definitions, memo)
    if isinstance(e, K.Binary) and e.op in ("add", "sub"):
        a, b = affine(e.a, definitions, memo), affine(e.b, definitions, memo)
        if a is None or b is None:
            return _opaque(e)
        sign = 1 if e.op == "add" else -1
        terms = dict(a[0])
        for name, c in b[0].items():
            terms[name] = terms.get(name, 0) + sign * c
        return {n: c for n, c in terms.items() if c}, a[1] + sign * b[1]
    if isinstance(e, K.Binary) and e.op == "mul":
        a, b = affine(e.a, definitions, memo), affine(e.b, definitions, memo)
        if a is None or b is None:
            return _opaque(e)
        if not b[0]:
            a, b = b, a
        if a[0]:
            return _opaque(e)  # product of two non-constant terms
        k = a[1]
        return {n: c * k for n, c in b[0].items() if c * k}, b[1] * k
    return _opaque(e)


def _opaque(e: K.Expr) -> tuple[dict[K.Expr, int], int] | None:
    """``e`` as one opaque term, where it is an integer expression of registers and constants only
    (no load, shuffle or random number, whose values differ between occurrences)."""
    if e.dtype not in ("i32", "i64") or not _pure_arithmetic(e):
        return None
    return {e: 1}, 0


def _pure_arithmetic(e: K.Expr) -> bool:
    kind = type(e)
    if kind is K.Var or kind is K.Const or kind is K.Special:
        return True
    if kind is K.Binary:
        return _pure_arithmetic(e.a) and _pure_arithmetic(e.b)
    if kind is K.Unary or kind is K.Cast:
        return _pure_arithmetic(e.x)
    if kind is K.Select:
        return _pure_arithmetic(e.cond) and _pure_arithmetic(e.a) and _pure_arithmetic(e.b)
    return False


def _chunk(dtype: str, lanes: int) -> int:
    """Elements per vector access of ``dtype`` for ``lanes`` unrolled lanes: 16 bytes, or all the
    lanes when they hold exactly 8 bytes or one 32-bit word of narrower lanes (4 bools, 2 halves)."""
    item = ITEM_BYTES[dtype]
    chunk = VECTOR_BYTES // item
    return lanes if chunk > lanes > 1 and lanes * item in (4, 8) else chunk


def _aligned(form: tuple[dict[str, int], int], chunk: int) -> bool:
    terms, constant = form
    return constant % chunk == 0 and all(c % chunk == 0 for c in terms.values())


def _lane_offset(base: tuple[dict[str, int], int], other: tuple[dict[str, int], int]) -> int | None:
    if base[0] != other[0]:
        return None
    return other[1] - base[1]


def pack_lanes(stmts: Sequence[K.Stmt], definitions: Mapping[str, K.Expr], lanes: int) -> list[K.Stmt]:
    """Merge the scalar loads and stores of ``lanes`` unrolled lanes into vector accesses; the
    lanes' branches on one condition are merged first (``_merge_lane_branches``), and their bodies
    packed in turn."""
    stmts, merged = _merge_lane_branches(list(stmts))
    stmts = [K.If(s.cond, tuple(pack_lanes(s.then, definitions, lanes)), tuple(pack_lanes(s.orelse, definitions, lanes)))
             if id(s) in merged else s for s in stmts]
    stmts = _pack_loads(stmts, definitions, lanes)
    return _pack_stores(stmts, definitions, lanes)


class _Effects:
    """What a statement reads and changes: registers read (``reads``), declared (``defines``) and
    assigned after their declaration (``assigns``), buffers loaded and stored, and whether it holds
    anything a branch may not be moved across or merged with (a barrier, a trap, a loop, a
    shuffle)."""

    __slots__ = ("assigns", "defines", "fixed", "loaded", "reads", "stored")

    def __init__(self, stmt: K.Stmt) -> None:
        self.reads: set[str] = set()
        self.defines: set[str] = set()
        self.assigns: set[str] = set()
        self.loaded: set[str] = set()
        self.stored: set[str] = set()
        self.fixed = False
        self._stmt(stmt)
        self.reads -= self.defines  # a register declared inside and read there is not read from outside

    def _stmt(self, s: K.Stmt) -> None:
        kind = type(s)
        if kind is K.Let:
            self._expr(s.value)
            self.defines.add(s.var.name)
        elif kind is K.Assign:
            self._expr(s.value)
            self.assigns.add(s.var.name)
        elif kind is K.If:
            self._expr(s.cond)
            for inner in s.then + s.orelse:
                self._stmt(inner)
        elif kind is K.VecLoad:
            self._expr(s.index)
            self.loaded.add(s.buffer)
            self.defines.update(v.name for v in s.vars)
        elif kind in (K.Store, K.VecStore):
            self._expr(s.index)
            for value in (s.values if kind is K.VecStore else (s.value,)):
                self._expr(value)
            self.stored.add(s.buffer)
        elif kind is not K.Comment:
            self.fixed = True  # Barrier, Trap, For

    def _expr(self, e: K.Expr) -> None:
        kind = type(e)
        if kind is K.Var:
            self.reads.add(e.name)
            return
        if kind is K.Const or kind is K.Special:
            return
        if kind is K.Load:
            self.loaded.add(e.buffer)
        elif kind is K.Shuffle:
            self.fixed = True
        for child in vars(e).values():
            for c in (child if isinstance(child, tuple) else (child,)):
                if hasattr(c, "dtype") and not isinstance(c, str):
                    self._expr(c)


def _merge_lane_branches(stmts: list[K.Stmt]) -> tuple[list[K.Stmt], set[int]]:
    """Unrolled lanes of one position guard their padded reads alike: lane j's branch has the same
    condition as lane 0's (the position the lanes share), with its loads at the next element. Each
    such branch is merged into the first one on its condition, so that the lanes' loads sit side by
    side in one body. A branch moves up only past statements it does not depend on: every register
    it reads is declared before the first branch, nothing between assigns them or reads what it
    assigns, and nothing between stores to a buffer it loads. The declarations of the registers it
    assigns (``float p = 0``, constants) move up with it. Branches that store, loop, shuffle or trap
    stay where they are. Returns the statements and the ids of the merged branches."""
    merged: set[int] = set()
    if sum(type(s) is K.If for s in stmts) < 2:
        return stmts, merged
    out: list[K.Stmt] = []
    effects: list[_Effects] = []
    first: dict[K.Expr, int] = {}  # condition -> id of the branch in ``out`` that lanes merge into
    for stmt in stmts:
        mine = _Effects(stmt)
        if type(stmt) is K.If and not mine.fixed and not mine.stored:
            target = first.get(stmt.cond)
            if target is not None:
                at = next(k for k, s in enumerate(out) if id(s) == target)
                if _merge_into(out, effects, at, stmt, mine):
                    merged.discard(target)
                    branch = next(s for s in out[at:] if type(s) is K.If)
                    merged.add(id(branch))
                    first[stmt.cond] = id(branch)
                    continue
            first[stmt.cond] = id(stmt)  # later lanes merge into this one
        out.append(stmt)
        effects.append(mine)
    return out, merged


def _merge_into(out: list[K.Stmt], effects: list[_Effects], at: int, branch: K.If, mine: _Effects) -> bool:
    """Merge ``branch`` into the branch at ``out[at]`` if that is legal (``_merge_lane_branches``),
    the declarations it needs moved up before it; whether it was."""
    declared = {name: k for k, e in enumerate(effects) for name in e.defines}
    moving = []  # positions of the declarations of registers the branch assigns, after ``at``
    for name in mine.assigns:
        k = declared.get(name)
        if k is None:
            continue  # declared in an enclosing scope
        if k > at:
            decl = out[k]
            if type(decl) is not K.Let or type(decl.value) is not K.Const:
                return False
            moving.append(k)
    for name in mine.reads:
        k = declared.get(name)
        if k is not None and k >= at and k not in moving:
            return False
    for k in range(at, len(out)):
        e = effects[k]
        if k in moving:
            continue
        if e.fixed and k > at or e.assigns & mine.reads or e.reads & mine.assigns or e.stored & mine.loaded:
            return False
    target = out[at]
    merged = K.If(target.cond, target.then + branch.then, target.orelse + branch.orelse)
    decls = [out[k] for k in sorted(moving)]
    decl_effects = [effects[k] for k in sorted(moving)]
    for k in sorted(moving, reverse=True):
        del out[k]
        del effects[k]
    out[at] = merged
    effects[at] = _Effects(merged)
    out[at:at] = decls
    effects[at:at] = decl_effects
    return True


def _load_of(stmt: K.Stmt) -> K.Load | None:
    if isinstance(stmt, K.Let):
        value = stmt.value.x if isinstance(stmt.value, K.Cast) else stmt.value
        if isinstance(value, K.Load):
            return value
    return None


def _pack_loads(stmts: list[K.Stmt], definitions, lanes: int) -> list[K.Stmt]:
    loads = [(k, _load_of(s)) for k, s in enumerate(stmts)]
    loads = [(k, load, affine(load.index, definitions)) for k, load in loads if load is not None]
    replaced: dict[int, list[K.Stmt]] = {}
    removed: set[int] = set()
    for position, (k, load, form) in enumerate(loads):
        if k in removed or form is None:
            continue
        chunk = _chunk(load.dtype, lanes)
        if chunk > lanes or lanes % chunk or not _aligned(form, chunk):
            continue
        group = {0: k}
        for k2, load2, form2 in loads[position + 1 :]:
            if load2.buffer == load.buffer and form2 is not None and k2 not in removed:
                offset = _lane_offset(form, form2)
                if offset is not None and 0 < offset < chunk and offset not in group:
                    group[offset] = k2
        if len(group) != chunk:
            continue
        storage_vars = tuple(K.Var(f"{stmts[group[j]].var.name}_s", load.dtype) for j in range(chunk))
        new = [K.VecLoad(storage_vars, load.buffer, load.index)]
        for j in range(chunk):
            target = stmts[group[j]]
            value = storage_vars[j] if not isinstance(target.value, K.Cast) else K.Cast(storage_vars[j],
                                                                                        target.value.dtype)
            new.append(K.Let(target.var, value))
        replaced[k] = new
        removed.update(group[j] for j in range(1, chunk))
    out: list[K.Stmt] = []
    for k, stmt in enumerate(stmts):
        if k in replaced:
            out.extend(replaced[k])
        elif k not in removed:
            out.append(stmt)
    return out


def _pack_stores(stmts: list[K.Stmt], definitions, lanes: int) -> list[K.Stmt]:
    stores = [(k, s, affine(s.index, definitions)) for k, s in enumerate(stmts) if isinstance(s, K.Store)]
    by_buffer: dict[str, list] = {}
    for item in stores:
        by_buffer.setdefault(item[1].buffer, []).append(item)
    replaced: dict[int, K.Stmt] = {}
    removed: set[int] = set()
    for items in by_buffer.values():
        for position, (k, store, form) in enumerate(items):
            if k in removed or form is None:
                continue
            dtype = store.value.dtype
            chunk = _chunk(dtype, lanes)
            if chunk > lanes or lanes % chunk or not _aligned(form, chunk):
                continue
            group = {0: (k, store)}
            for k2, store2, form2 in items[position + 1 :]:
                offset = _lane_offset(form, form2) if form2 is not None else None
                if offset is not None and 0 < offset < chunk and offset not in group:
                    group[offset] = (k2, store2)
            if len(group) != chunk:
                continue
            last = max(group[j][0] for j in range(chunk))
            replaced[last] = K.VecStore(store.buffer, store.index, tuple(group[j][1].value for j in range(chunk)))
            removed.update(group[j][0] for j in range(chunk) if group[j][0] != last)
    return [replaced.get(k, s) for k, s in enumerate(stmts) if k not in removed]
