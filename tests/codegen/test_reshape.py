"""Reshape index arithmetic (``codegen/reshape.py``, ``ValueEmitter.linear``): a split of a merge is
its parts again where the parts' bounds prove it, and every simplified index equals the plain
quotient and remainder on every valid index."""

from __future__ import annotations

import gzip
import itertools
import math
import random
from pathlib import Path

import numpy as np
import pytest
import torch

from fusionstitching.codegen import kernel_ir as K
from fusionstitching.codegen.reshape import reshape_index
from fusionstitching.codegen.values import ValueEmitter

I32 = "i32"


def _idx(value: int) -> K.Const:
    return K.Const(int(value), I32)


def _eval(e: K.Expr, env: dict[str, int], definitions: dict[str, K.Expr]) -> int:
    if isinstance(e, K.Const):
        return e.value
    if isinstance(e, K.Var):
        if e.name in env:
            return env[e.name]
        return _eval(definitions[e.name], env, definitions)
    a, b = _eval(e.a, env, definitions), _eval(e.b, env, definitions)
    if e.op == "add":
        return a + b
    if e.op == "mul":
        return a * b
    if e.op == "div":
        return int(a / b)  # C's truncating division (operands are non-negative here)
    if e.op == "rem":
        return a - int(a / b) * b
    raise AssertionError(e.op)


def _ops(e: K.Expr) -> set[str]:
    if isinstance(e, K.Binary):
        return {e.op} | _ops(e.a) | _ops(e.b)
    return set()


def test_a_split_of_a_merge_is_its_parts_with_bounds_and_a_quotient_without():
    """[64, 64] → [4096] → [64, 64], as a GroupNorm's reshapes: with the parts' bounds the second
    reshape gives back ``h`` and ``w``; without them it must divide."""
    h, w = K.Var("h", I32), K.Var("w", I32)
    (flat,) = reshape_index([h, w], (64, 64), (4096,), _idx)
    i = K.Var("i", I32)
    definitions = {"i": flat}
    assert reshape_index([i], (4096,), (64, 64), _idx, definitions, {"h": 64, "w": 64}) == (h, w)
    split = reshape_index([i], (4096,), (64, 64), _idx, definitions)
    assert _ops(split[0]) == {"div"} and _ops(split[1]) == {"rem"}


def test_a_term_that_can_reach_the_divisor_keeps_the_division():
    """``w`` < 128 may carry into the next row of 64: no bound proves the split exact."""
    h, w = K.Var("h", I32), K.Var("w", I32)
    flat = K.add(K.mul(h, _idx(64)), w)
    high, low = reshape_index([K.Var("i", I32)], (4096,), (64, 64), _idx, {"i": flat}, {"h": 32, "w": 128})
    assert "div" in _ops(high) and "rem" in _ops(low)


def _shapes(rng: random.Random) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
    """Three shapes of one size: a source, the shape it is merged or split into, and a third."""
    factors = [rng.choice([2, 3, 4]) for _ in range(rng.randint(2, 5))]

    def grouped() -> tuple[int, ...]:
        cuts = sorted(rng.sample(range(1, len(factors)), rng.randint(0, len(factors) - 1)))
        return tuple(math.prod(factors[a:b]) for a, b in zip([0, *cuts], [*cuts, len(factors)]))

    return grouped(), grouped(), grouped()


@pytest.mark.parametrize("seed", range(40))
def test_two_reshapes_in_a_row_index_the_same_element(seed):
    """Random chains shape a → b → c: the index of c's element in a, through both reshapes with the
    emitter's bounds, is the row-major position of the element, for every element."""
    rng = random.Random(seed)
    a, b, c = _shapes(rng)
    index = [K.Var(f"x{d}", I32) for d in range(len(a))]
    em = ValueEmitter(inputs={}, pattern=set(), index_type=I32)
    em.bound(index, a)
    middle = tuple(em.let("i", i) for i in reshape_index(index, a, b, em.idx, em.definitions, em.index_bounds))
    em.bound(middle, b)
    last = reshape_index(middle, b, c, em.idx, em.definitions, em.index_bounds)
    strides = [math.prod(c[d + 1:]) for d in range(len(c))]
    offset = em.linear(last, strides)
    for point in itertools.product(*(range(n) for n in a)):
        env = {f"x{d}": v for d, v in enumerate(point)}
        flat = int(np.ravel_multi_index(point, a))
        assert [_eval(e, env, em.definitions) for e in last] == list(np.unravel_index(flat, c)), (a, b, c, point)
        assert _eval(offset, env, em.definitions) == flat


def test_group_norm_activations_are_read_sixteen_bytes_at_a_time():
    """The GroupNorm + SiLU forward captured on a GPU (bf16 [16, 512, 64, 64]): its normalizing
    kernel reads the activations through [N, C, H, W] → [N, G, C/G, H·W] → [N, C, H, W]; with
    the split of the merge proved exact its reads are 16-byte vectors, like its writes."""
    from fusionstitching.graph.serialize import from_json
    from fusionstitching.options import Options
    from fusionstitching.pipeline import compile_graph

    path = Path(__file__).parent.parent / "data" / "groupnorm_silu_bf16_gpu_graph.json.gz"
    graph = from_json(gzip.decompress(path.read_bytes()).decode())
    compiled = compile_graph(graph, Options(strict=True))
    sources = [k.cuda_source for k in compiled.kernels]
    (normalize,) = [s for s in sources if "expf" in s]
    assert "reinterpret_cast<const uint4*>(&in0[" in normalize
    assert "fs_b2f(in0[" not in normalize


def test_a_bound_from_one_groups_guard_does_not_reach_the_next_group():
    """Fuzz program 1306823149:12: a kernel's group of one row ([1, 1], a slice of the input) is
    guarded by ``warp < 1``, and the bound its reshape recorded for the warp register stayed for
    the next group, whose 8 rows run on 8 warps: there it merged the rows of a transposed input as
    if contiguous (``w`` for ``(w / 4) * 2044 + w % 4``), and a std over the input read the wrong
    rows. Index bounds now end with the scope that recorded them."""
    import fusionstitching

    def fn(x0):
        v0 = torch.expm1(x0)
        v3 = v0 + v0.std(dim=(0, 1, 2), correction=0)
        return torch.softmax(v0, dim=2), torch.log(v3.unsqueeze(0).expand(1, 2, 4, 511).abs() + 0.5).mean(0)

    x = torch.randn((2, 511, 4), generator=torch.Generator().manual_seed(69042119349434)).transpose(-1, -2)
    torch._dynamo.reset()
    generators = ("substitution", "deep", "exploratory", "dp", "merging", "packing", "remote")
    compiled = fusionstitching.compile(fn, options={"strict": True, "solver": "ilp", "generators": generators})
    for got, want in zip(compiled(x), fn(x)):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
