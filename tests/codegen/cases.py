"""The kernel-generation test matrix: patterns × dtypes × shapes × templates.

Each case builds a graph (captured from a torch function, so that GPU tests can also compare
with eager PyTorch, or built by hand for what torch cannot express the same way) and names the
templates to try besides the default one. ``fusable_nodes`` is the whole graph minus parameters.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cache

import numpy as np
import torch
import torch.nn.functional as F

from fusionstitching import capture
from fusionstitching.graph.graph import Graph, GraphBuilder, Layout
from fusionstitching.graph.ops import DType

TORCH_DTYPES = {"f32": torch.float32, "bf16": torch.bfloat16, "f16": torch.float16}
TOLERANCE = {"f32": 1e-5, "bf16": 1e-2, "f16": 1e-2, "f64": 1e-12, "i32": 0, "i64": 0, "u8": 0, "i8": 0, "i16": 0,
             "bool": 0}


@dataclass
class Case:
    name: str
    graph: Graph
    arrays: list[np.ndarray]  # in graph.parameters order
    templates: list[str] = field(default_factory=list)
    torch_fn: Callable | None = None
    torch_inputs: list[torch.Tensor] | None = None
    exact: bool = False

    @property
    def nodes(self):
        """Every node a kernel computes: all but the parameters and the constants that are kernel
        inputs (every non-scalar one; a random op's stream)."""
        return [n for n in self.graph.nodes if n.op != "parameter" and not (n.op == "constant" and n.shape)]


def _numpy(t: torch.Tensor) -> np.ndarray:
    if t.dtype == torch.bfloat16:
        return t.float().numpy().astype(DType.BF16.numpy)
    return t.numpy()


def _captured(name: str, fn, inputs, templates=()) -> Case:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        graph = capture(fn, *inputs, name=name).forward
    out = graph.outputs[0].name if graph.outputs else ""
    templates = [t.replace("{out}", out) for t in templates]
    return Case(name, graph, [_numpy(t) for t in inputs], templates, fn, list(inputs))


def _rand(shape, dtype: str, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(TORCH_DTYPES[dtype])


@cache
def bias_gelu(dtype: str, rows: int, cols: int) -> Case:
    def fn(x, b):
        return F.gelu(x + b, approximate="tanh")

    t = [f"{{out}}[GRID,GRID_{math.ceil(cols / 64)}-CTA_64]; launch(blocks={rows},threads=64)"]
    return _captured(f"bias_gelu_{dtype}_{rows}x{cols}", fn, [_rand((rows, cols), dtype), _rand((cols,), dtype, 1)], t)


@cache
def relu_transpose(dtype: str, n: int, m: int) -> Case:
    def fn(x, y):
        return torch.relu(x.t() * y + 1)

    return _captured(f"relu_t_{dtype}_{n}x{m}", fn, [_rand((m, n), dtype), _rand((n, m), dtype, 1)],
                     ["{out}[GRID_2-CTA_2-THREAD,CTA_32-THREAD]; launch(blocks=3,threads=64)"])


@cache
def strided_inputs(dtype: str) -> Case:
    base = _rand((9, 12), dtype)
    x = base.t()[2:10]  # (8, 9), strides (1, 12), storage offset 24

    def fn(x, y):
        return torch.sigmoid(x) * y[:, None] - x.abs().sqrt()

    return _captured(f"strided_{dtype}", fn, [x, _rand((8,), dtype, 1)],
                     ["{out}[CTA,THREAD]; launch(blocks=1,threads=32)", "{out}[GRID,CTA_4-THREAD]; launch(blocks=2,threads=32)"])


@cache
def one_element_dims(dtype: str) -> Case:
    def fn(x, y):
        return (x * y).exp() + x.unsqueeze(0).squeeze(0)

    return _captured(f"unit_dims_{dtype}", fn, [_rand((5, 1, 3), dtype), _rand((1, 4, 1), dtype, 1)],
                     ["{out}[GRID,CTA,CTA]; launch(blocks=5,threads=32)", "{out}[THREAD,GRID,CTA_2-THREAD]; launch(blocks=2,threads=32)"])


@cache
def slice_cat_pad(dtype: str) -> Case:
    def fn(x, y):
        z = torch.cat([x[:, 1:], y * 2, x[:, :2]], dim=1)
        return F.pad(z, (1, 2, 0, 1), value=0.5)

    return _captured(f"slice_cat_pad_{dtype}", fn, [_rand((6, 5), dtype), _rand((6, 3), dtype, 1)],
                     ["{out}[GRID_7,CTA_32]; launch(blocks=3,threads=32)"])


@cache
def gather_reshape_iota(dtype: str) -> Case:
    def fn(table, idx):
        rows = F.embedding(idx, table).reshape(2, 3, 2, 4)
        return rows * torch.arange(4).to(rows.dtype) + rows.sum(-1, keepdim=True)

    idx = torch.tensor([[0, 7, 3], [3, 9, 1]])
    return _captured(f"gather_{dtype}", fn, [_rand((10, 8), dtype), idx],
                     ["{out}[GRID,CTA,CTA,CTA]; launch(blocks=2,threads=32)"])


@cache
def softmax_rows(dtype: str, rows: int, cols: int) -> Case:
    def fn(x):
        return torch.softmax(x * 0.5, dim=-1)

    return _captured(f"softmax_{dtype}_{rows}x{cols}", fn, [_rand((rows, cols), dtype)], [])


def silu_wide(dtype: str) -> Case:
    """SiLU and an exponential computed in f32, over inputs from -100 to 100, with infinities and a
    NaN: in bf16 and f16 their exp and sigmoid take the approximate instructions
    (``codegen/precision.py``), whose error grows with |x| and which overflow and underflow at the
    ends. (Each output is rounded once, in eager as in the graph.)"""

    def fn(x):
        return F.silu(x), torch.exp(x.float() * 0.3).to(x.dtype)

    x = torch.linspace(-100, 100, 3 * 257).reshape(3, 257)
    x[0, :4] = torch.tensor([float("inf"), float("-inf"), float("nan"), 0.0])
    return _captured(f"silu_wide_{dtype}", fn, [x.to(TORCH_DTYPES[dtype])], [])


NARROW = {"u8": torch.uint8, "i8": torch.int8, "i16": torch.int16}


@cache
def narrow_ints(dtype: str, rows: int = 6, cols: int = 96) -> Case:
    """Narrow integers (computed in i32, wrapped after every op): wrapping arithmetic, a row
    maximum (whose identity is the type's own lowest value), a dequantized f32 row sum, and a
    requantization through i64 that wraps; rows wide enough for vector loads and stores."""
    kind = NARROW[dtype]

    def fn(x, scale):
        wrapped = (x * 3 + x) - (~x) * 5
        dequantized = x.float() * scale
        return wrapped, x.amax(dim=1), dequantized.sum(dim=1), (dequantized * 41.5).to(kind)

    info = torch.iinfo(kind)
    g = torch.Generator().manual_seed(7)
    x = torch.randint(int(info.min), int(info.max) + 1, (rows, cols), generator=g, dtype=torch.int64).to(kind)
    x[0] = int(info.min) if info.min < 0 else 3  # an all-negative row: its maximum is below 0
    x[0, :3] = torch.tensor([int(info.min), int(info.min) + 1, int(info.min)], dtype=torch.int64).to(kind)
    scale = torch.rand(cols, generator=g) * 0.25 - 0.125
    return _captured(f"narrow_{dtype}", fn, [x, scale], [])


@cache
def narrow_wide(dtype: str) -> Case:
    """Wide rows of a narrow integer, elementwise only: loaded and stored as vectors of lanes."""
    kind = NARROW[dtype]

    def fn(x):
        return x * 3 - ~x, (x.float() * 0.5).to(kind)

    info = torch.iinfo(kind)
    g = torch.Generator().manual_seed(8)
    x = torch.randint(int(info.min), int(info.max) + 1, (4, 2048), generator=g, dtype=torch.int64).to(kind)
    return _captured(f"narrow_wide_{dtype}", fn, [x], [])


@cache
def packed_updates(count: int = 5) -> Case:
    sizes = [7, 1000, 64, 33, 4096][:count]
    params = [torch.randn(s, generator=torch.Generator().manual_seed(i)) for i, s in enumerate(sizes)]
    grads = [torch.randn(s, generator=torch.Generator().manual_seed(100 + i)) for i, s in enumerate(sizes)]

    def fn(*tensors):
        n = len(tensors) // 2
        for p, g in zip(tensors[:n], tensors[n:]):
            p.mul_(0.9).add_(g)

    case = _captured(f"packed_{count}", fn, params + grads, [])
    return case


def hand_built(dtype: DType, name: str) -> Case:
    builder = {"rng": _rng, "int_ops": _int_ops, "pad_interior": _pad_interior, "column_sum": _column_sum,
               "packed_shapes": _packed_shapes}[name]
    return builder(dtype)


def _rng(dtype: DType) -> Case:
    b = GraphBuilder("rng")
    x = b.parameter((3, 50), dtype, "x")
    seed = b.parameter((), DType.I64, "seed")
    offset = b.parameter((), DType.I64, "offset")
    u = b.rng_uniform(seed, offset, 5, shape=(3, 50), dtype=DType.F32)
    keep = b.compare("LT", u, b.broadcast(b.constant(0.7, DType.F32), (3, 50), ()))
    out = b.select(keep, b.binary("mul", x, b.broadcast(b.constant(1 / 0.7, dtype), (3, 50), ())),
                   b.broadcast(b.constant(0, dtype), (3, 50), ()))
    graph = b.build([out, u])
    arrays = [np.random.default_rng(0).standard_normal((3, 50)).astype(dtype.numpy), np.int64(-12345678901),
              np.int64(2**40 + 3)]
    return Case(f"rng_{dtype.value}", graph, arrays,
                ["select[GRID,CTA_64]; rng_uniform[GRID,CTA_64]; launch(blocks=3,threads=64)"], exact=True)


def _int_ops(dtype: DType) -> Case:
    b = GraphBuilder("ints")
    a = b.parameter((4, 9), DType.I32, "a")
    c = b.parameter((4, 9), DType.I64, "c")
    a64 = b.convert(a, DType.I64)
    q = b.binary("div", c, a64)
    r = b.binary("rem", c, a64)
    m = b.select(b.compare("GT", q, r), b.binary("max", q, r), b.unary("neg", b.binary("xor", q, r)))
    f = b.convert(b.convert(m, DType.F32), DType.I32)
    graph = b.build([m, f])
    rng = np.random.default_rng(1)
    arrays = [rng.integers(-5, 6, (4, 9)).astype(np.int32), rng.integers(-1000, 1000, (4, 9)).astype(np.int64)]
    return Case("int_ops", graph, arrays, ["select[GRID,CTA]; convert_2[GRID,CTA]; launch(blocks=4,threads=32)"],
                exact=True)


def _pad_interior(dtype: DType) -> Case:
    b = GraphBuilder("pad")
    x = b.parameter((3, 4), dtype, "x")
    p = b.node("pad", [b.unary("neg", x)], low=(1, -1), high=(2, 1), interior=(1, 2), value=-2.0)
    graph = b.build([p])
    return Case(f"pad_interior_{dtype.value}", graph,
                [np.random.default_rng(2).standard_normal((3, 4)).astype(dtype.numpy)],
                ["pad[GRID,CTA]; launch(blocks=8,threads=32)"])


def _column_sum(dtype: DType) -> Case:
    b = GraphBuilder("colsum")
    x = b.parameter((33, 70), dtype, "x")
    s = b.reduce(b.unary("exp", x), [0], "sum")
    graph = b.build([s])
    return Case(f"column_sum_{dtype.value}", graph,
                [np.random.default_rng(3).standard_normal((33, 70)).astype(dtype.numpy)],
                ["reduce[THREAD,GRID-CTA_32]; launch(blocks=3,threads=32)",
                 "reduce[THREAD_4-THREAD,GRID_2-CTA_64]; launch(blocks=2,threads=64)"])


def _packed_shapes(dtype: DType) -> Case:
    b = GraphBuilder("packed")
    x = b.parameter((5, 7), dtype, "x")
    y = b.parameter((300,), dtype, "y")
    z = b.parameter((2, 3, 4), dtype, "z", layout=Layout((1, 2, 6)))
    ox = b.unary("tanh", x)
    ox2 = b.binary("mul", x, x)
    oy = b.binary("add", y, y)
    oz = b.unary("abs", z)
    graph = b.build([ox, ox2, oy, oz])
    rng = np.random.default_rng(4)
    arrays = [rng.standard_normal(s).astype(dtype.numpy) for s in ((5, 7), (300,), (2, 3, 4))]
    return Case(f"packed_shapes_{dtype.value}", graph, arrays,
                ["tanh[GRID,CTA]; mul[GRID,CTA]; add[GRID-CTA_32]; abs[GRID,CTA,CTA]; launch(blocks=6,threads=32)"])
