"""Index arithmetic of reshapes for the value emitter (``values._op_reshape``) and for packed nests
whose roots are one reshape apart (``packed._element``)."""

from __future__ import annotations

import math
from collections.abc import Callable, Collection, Mapping, Sequence

from fusionstitching.codegen import kernel_ir as K


def reshape_index(index: Sequence[K.Expr], out_shape: Sequence[int], in_shape: Sequence[int],
                  idx: Callable[[int], K.Const], definitions: Mapping[str, K.Expr] | None = None,
                  bounds: Mapping[str, int] | None = None) -> tuple[K.Expr, ...]:
    """Operand index of a reshape: dims are matched in groups of equal product, and only a group that
    really splits or merges dims pays for a linearize/delinearize (size-1 dims map for free). A
    merge of the two parts of a split, ``(x / n) * n + x % n``, is ``x`` (C's integer division
    makes it an identity); ``definitions`` lets the parts be registers bound to them. A split of a
    merge is its parts again (``_digit``): ``bounds`` gives registers that index a dim their
    exclusive upper bound, the dim's size (a valid index is in [0, size)), which proves
    ``(a * n + b) / n`` is ``a`` and ``(a * n + b) % n`` is ``b`` when ``b < n``. Without it a
    GroupNorm's reshapes [C, H, W] → [G, C/G · H · W] → [C, H, W] left the innermost index a
    quotient and a remainder, and the vectorizer, which needs an affine index, read the
    activations two bytes at a time."""
    result: list[K.Expr] = []
    i = j = 0
    out_dims = [(d, s) for d, s in enumerate(out_shape)]
    in_dims = list(in_shape)
    while i < len(out_dims) or j < len(in_dims):
        if j < len(in_dims) and in_dims[j] == 1:
            result.append(idx(0))
            j += 1
            continue
        if i < len(out_dims) and out_dims[i][1] == 1:
            i += 1
            continue
        group_out, group_in = [i], [j]
        p_out, p_in = out_dims[i][1], in_dims[j]
        i += 1
        j += 1
        while p_out != p_in:
            if p_out < p_in:
                group_out.append(i)
                p_out *= out_dims[i][1]
                i += 1
            else:
                group_in.append(j)
                p_in *= in_dims[j]
                j += 1
        while i < len(out_dims) and out_dims[i][1] == 1:
            i += 1
        if len(group_out) == 1 and len(group_in) == 1:
            result.append(index[out_dims[group_out[0]][0]])
            continue
        linear: K.Expr = idx(0)
        for g in group_out:
            linear = _merged(linear, out_dims[g][1], index[out_dims[g][0]], idx, definitions or {})
        sizes = [in_dims[g] for g in group_in]
        for k in range(len(sizes)):
            inner = math.prod(sizes[k + 1 :])
            result.append(_digit(linear, inner, sizes[k] if k > 0 else None, idx, definitions or {}, bounds or {}))
    return tuple(result)


def _digit(linear: K.Expr, inner: int, size: int | None, idx: Callable[[int], K.Const],
           definitions: Mapping[str, K.Expr], bounds: Mapping[str, int]) -> K.Expr:
    """``(linear / inner) % size`` (no remainder when ``size`` is None), without the division or the
    remainder where the bounds of ``linear``'s terms prove them exact (``_terms``)."""
    quotient = None
    for terms in _decompositions(linear, definitions, bounds):
        quotient = _divided(terms, inner)
        if quotient is not None:
            break
    if quotient is None:
        part = K.div(linear, idx(inner)) if inner > 1 else linear
        return K.rem(part, idx(size)) if size is not None else part
    if size is not None:
        kept = _remainder(quotient, size)
        if kept is None:  # as written when undivided: ``linear.values._split_pair`` recognizes x / n, x % n
            return K.rem(_expression(quotient, idx) if inner > 1 else linear, idx(size))
        quotient = kept
    return _expression(quotient, idx)


# A non-negative linear form: (coefficient, term, exclusive bound of the term) triples and a constant.
Terms = tuple[tuple[tuple[int, K.Expr, int], ...], int]


def _decompositions(e: K.Expr, definitions: Mapping[str, K.Expr], bounds: Mapping[str, int]) -> list[Terms]:
    """``e`` as non-negative linear forms over bounded registers: expanded through the registers'
    definitions as far as their terms are bounded, and ``e`` itself as one term when it is a bounded
    register."""
    found = []
    expanded = _terms(e, definitions, bounds)
    if expanded is not None:
        found.append(expanded)
    if isinstance(e, K.Var) and e.name in bounds:
        found.append((((1, e, bounds[e.name]),), 0))
    return found


def _terms(e: K.Expr, definitions: Mapping[str, K.Expr], bounds: Mapping[str, int]) -> Terms | None:
    if isinstance(e, K.Const) and isinstance(e.value, int) and not isinstance(e.value, bool):
        return ((), e.value) if e.value >= 0 else None
    if isinstance(e, K.Var):
        definition = definitions.get(e.name)
        if isinstance(definition, K.Binary) and definition.op in ("add", "mul"):
            expanded = _terms(definition, definitions, bounds)
            if expanded is not None:
                return expanded
        return (((1, e, bounds[e.name]),), 0) if e.name in bounds else None
    if isinstance(e, K.Binary) and e.op == "add":
        a, b = _terms(e.a, definitions, bounds), _terms(e.b, definitions, bounds)
        if a is None or b is None:
            return None
        return a[0] + b[0], a[1] + b[1]
    if isinstance(e, K.Binary) and e.op == "mul":
        for x, c in ((e.a, e.b), (e.b, e.a)):
            if isinstance(c, K.Const) and isinstance(c.value, int) and c.value >= 0:
                inner = _terms(x, definitions, bounds)
                if inner is None:
                    return None
                return tuple((k * c.value, t, b) for k, t, b in inner[0]), inner[1] * c.value
    return None


def _largest(terms: Terms) -> int:
    return sum(k * (b - 1) for k, _, b in terms[0]) + terms[1]


def _divided(terms: Terms, n: int) -> Terms | None:
    """``terms / n`` as a form, when the terms whose coefficients ``n`` does not divide (and the
    constant's remainder) stay below ``n``: every term is non-negative, so the quotient is then the
    sum of the divisible terms' quotients."""
    if n == 1:
        return terms
    whole = tuple((k // n, t, b) for k, t, b in terms[0] if k % n == 0)
    rest = (tuple((k, t, b) for k, t, b in terms[0] if k % n), terms[1] % n)
    if _largest(rest) >= n:
        return None
    return whole, terms[1] // n


def _remainder(terms: Terms, n: int) -> Terms | None:
    """``terms % n`` as a form, when the terms whose coefficients ``n`` does not divide stay below ``n``."""
    rest = (tuple((k, t, b) for k, t, b in terms[0] if k % n), terms[1] % n)
    return rest if _largest(rest) < n else None


def _expression(terms: Terms, idx: Callable[[int], K.Const]) -> K.Expr:
    total: K.Expr = idx(0)
    for k, t, _ in terms[0]:
        total = K.add(total, K.mul(t, idx(k)))
    return K.add(total, idx(terms[1]))


def _merged(high: K.Expr, n: int, low: K.Expr, idx: Callable[[int], K.Const],
            definitions: Mapping[str, K.Expr]) -> K.Expr:
    """``high * n + low``, or ``x`` when ``high`` is ``x / n`` and ``low`` is ``x % n``."""
    whole = split_pair(high, low, n, definitions)
    return whole if whole is not None else K.add(K.mul(high, idx(n)), low)


def split_pair(high: K.Expr, low: K.Expr, n: int, definitions: Mapping[str, K.Expr],
               mutable: Collection[str] = ()) -> K.Expr | None:
    """``x`` when ``high`` is ``x / n`` and ``low`` is ``x % n`` (through the registers bound to
    them, unless assigned after their binding: ``mutable``); C's integer division makes
    ``(x / n) * n + x % n`` equal ``x``."""
    def bound(e: K.Expr) -> K.Expr | None:
        if not isinstance(e, K.Var):
            return e
        return None if e.name in mutable else definitions.get(e.name, e)

    a, b = bound(high), bound(low)
    if (isinstance(a, K.Binary) and a.op == "div" and isinstance(b, K.Binary) and b.op == "rem"
            and a.a == b.a and a.b == b.b and isinstance(a.b, K.Const) and a.b.value == n):
        return a.a
    return None
