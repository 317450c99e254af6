"""Index arithmetic of reshapes for the value emitter (``values._op_reshape``) and for packed nests
whose roots are one reshape apart (``packed._element``)."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence

from fusionstitching.codegen import kernel_ir as K


def reshape_index(index: Sequence[K.Expr], out_shape: Sequence[int], in_shape: Sequence[int],
                  idx: Callable[[int], K.Const], definitions: Mapping[str, K.Expr] | None = None
                  ) -> tuple[K.Expr, ...]:
    """Operand index of a reshape: dims are matched in groups of equal product, and only a group that
    really splits or merges dims pays for a linearize/delinearize (size-1 dims map for free). A
    merge of the two parts of a split, ``(x / n) * n + x % n``, is ``x`` (C's integer division
    makes it an identity); ``definitions`` lets the parts be registers bound to them."""
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
            part = K.div(linear, idx(inner)) if inner > 1 else linear
            result.append(K.rem(part, idx(sizes[k])) if k > 0 else part)
    return tuple(result)


def _merged(high: K.Expr, n: int, low: K.Expr, idx: Callable[[int], K.Const],
            definitions: Mapping[str, K.Expr]) -> K.Expr:
    """``high * n + low``, or ``x`` when ``high`` is ``x / n`` and ``low`` is ``x % n``."""
    def bound(e: K.Expr) -> K.Expr:
        return definitions.get(e.name, e) if isinstance(e, K.Var) else e

    a, b = bound(high), bound(low)
    if (isinstance(a, K.Binary) and a.op == "div" and isinstance(b, K.Binary) and b.op == "rem"
            and a.a == b.a and a.b == b.b == idx(n)):
        return a.a
    return K.add(K.mul(high, idx(n)), low)
