"""The code paths chosen for speed keep the reference's results: one reciprocal per row for a
quotient by a reduction, NaN-propagating min/max, the column-reduction template, and dot operands
cached in shared memory (expensive ops both ways)."""

from __future__ import annotations

import re

import numpy as np
import pytest

from fusionstitching.codegen import default_template, generate
from fusionstitching.codegen.cuda_c import PRELUDE
from fusionstitching.codegen.lower import resolve_pattern
from fusionstitching.codegen.nvrtc import compile_cuda
from fusionstitching.graph import reference
from fusionstitching.graph.graph import GraphBuilder
from fusionstitching.graph.ops import DType
from fusionstitching.schedule import feasible
from fusionstitching.schedule.grouping import _candidate_templates
from fusionstitching.schedule.template import parse_template

F32 = DType.F32


def _normalize(rows: int, cols: int):
    """x / sum(x, row): the divisor is a reduction's result, broadcast along the row."""
    b = GraphBuilder("normalize")
    x = b.parameter((rows, cols), F32, "x")
    s = b.reshape(b.reduce(x, [1], "sum"), (rows, 1))
    out = b.binary("div", x, b.broadcast(s, (rows, cols), [0, 1]))
    return b.build([out])


def _simulate(graph, arrays, template=None):
    nodes = [n for n in graph.nodes if n.op != "parameter"]
    kernel = generate(graph, nodes, template or default_template(graph, nodes))
    return kernel, kernel.simulate(arrays)


def test_quotient_by_a_row_reduction_uses_one_reciprocal_and_matches_the_reference():
    graph = _normalize(6, 64)
    x = np.random.default_rng(0).uniform(0.5, 2.0, (6, 64)).astype(np.float32)
    kernel, (got,) = _simulate(graph, [x])
    (want,) = reference.evaluate(graph, [x])
    assert "__frcp_rn" in kernel.cuda_source and " / " not in kernel.cuda_source.split("extern")[1]
    np.testing.assert_allclose(got, want, rtol=5e-7, atol=0)  # the row sum in another order, then ≤ 1.5 ulp


def test_reciprocal_of_a_subnormal_divisor_stays_finite():
    """Rows whose sums are below the smallest normal f32 (and zero, infinite, NaN rows) give what
    division gives: the reciprocal of a subnormal would overflow without the 2^64 scaling."""
    graph = _normalize(5, 32)
    tiny = np.float32(1e-44)  # subnormal; a row sum of 32 of them is still subnormal
    x = np.full((5, 32), tiny, np.float32)
    x[1] = 0.0
    x[2, 3] = np.inf
    x[3, 7] = np.nan
    x[4] = np.float32(3e-39) * np.arange(1, 33, dtype=np.float32) / 32
    _, (got,) = _simulate(graph, [x])
    (want,) = reference.evaluate(graph, [x])
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
    finite = np.isfinite(want)
    assert np.isfinite(got[finite]).all()
    np.testing.assert_allclose(got[finite], want[finite], rtol=2e-7)


def test_min_max_propagate_nan_in_one_instruction_on_sm80_and_later():
    assert "max.NaN.f32" in PRELUDE and "min.NaN.f32" in PRELUDE
    b = GraphBuilder("rowmax")
    x = b.parameter((4, 96), F32, "x")
    graph = b.build([b.reduce(x, [1], "max")])
    arrays = [np.random.default_rng(1).standard_normal((4, 96)).astype(np.float32)]
    arrays[0][2, 50] = np.nan
    kernel, (got,) = _simulate(graph, arrays)
    (want,) = reference.evaluate(graph, arrays)
    np.testing.assert_array_equal(got, want)
    for arch in ("sm_80", "sm_90"):
        compile_cuda(kernel.cuda_source, arch)


def _column_sums(rows: int, cols: int):
    b = GraphBuilder("colsums")
    x = b.parameter((rows, cols), F32, "x")
    y = b.parameter((rows, cols), F32, "y")
    return b.build([b.reduce(x, [0], "sum"), b.reduce(y, [0], "sum")])


@pytest.mark.parametrize("rows,cols,expected", [
    (2048, 1024, "reduce[THREAD_64-WARP_32,GRID-CTA_32]"),
    (40, 64, "reduce[THREAD_10-WARP_4,GRID-CTA_32]"),
    (64, 96, "reduce[THREAD_8-WARP_8,GRID-CTA_32]"),
])
def test_column_reductions_put_columns_on_lanes_and_rows_on_warps(rows, cols, expected):
    graph = _column_sums(rows, cols)
    nodes = [n for n in graph.nodes if n.op != "parameter"]
    template = default_template(graph, nodes)
    assert str(template).startswith(expected), template
    if rows * cols <= 4096:
        rng = np.random.default_rng(2)
        arrays = [rng.standard_normal((rows, cols)).astype(np.float32) for _ in range(2)]
        _, got = _simulate(graph, arrays, template)
        for g, w in zip(got, reference.evaluate(graph, arrays)):
            np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5)


def _attention(batch: int, history: int, dim: int):
    """DIN-like: scores = q·kᵀ, softmax over the history, then p·k."""
    b = GraphBuilder("attention")
    q = b.parameter((batch, 1, dim), F32, "q")
    k = b.parameter((batch, history, dim), F32, "k")
    scores = b.node("dot_general", [q, k], lhs_batch=(0,), rhs_batch=(0,), lhs_contract=(2,), rhs_contract=(2,))
    top = b.broadcast(b.reshape(b.reduce(scores, [2], "max"), (batch, 1, 1)), scores.shape, [0, 1, 2])
    e = b.unary("exp", b.binary("sub", scores, top))
    total = b.broadcast(b.reshape(b.reduce(e, [2], "sum"), (batch, 1, 1)), scores.shape, [0, 1, 2])
    p = b.binary("div", e, total)
    out = b.node("dot_general", [p, k], lhs_batch=(0,), rhs_batch=(0,), lhs_contract=(2,), rhs_contract=(1,))
    return b.build([out]), p.name


def test_expensive_dot_operand_is_cached_in_shared_memory_and_the_other_way_is_a_candidate():
    graph, p = _attention(3, 10, 6)
    nodes = [n for n in graph.nodes if n.op != "parameter"]
    template = default_template(graph, nodes)
    cached = next(s for s in template.schedules if s.root == p)
    assert cached.shared, template
    candidates = []
    for make in _candidate_templates(resolve_pattern(graph, nodes)):
        try:
            candidates.append(make())
        except ValueError:  # a candidate that does not apply to this pattern
            continue
    recomputed = [t for t in candidates[1:] if not any(s.root == p for s in t.schedules)]
    assert recomputed
    assert feasible(graph, nodes) == template
    rng = np.random.default_rng(3)
    arrays = [rng.standard_normal((3, 1, 6)).astype(np.float32), rng.standard_normal((3, 10, 6)).astype(np.float32)]
    (want,) = reference.evaluate(graph, arrays)
    for t in (template, recomputed[-1]):
        _, (got,) = _simulate(graph, arrays, t)
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    assert "smem" in str(generate(graph, nodes, template).smem_plan)


@pytest.mark.parametrize("shape,perm,dtype", [((32, 12, 128, 64), (0, 2, 1, 3), DType.BF16),
                                              ((4, 6, 8, 16), (0, 2, 1, 3), DType.F32),
                                              ((2, 3, 4, 24), (0, 2, 1, 3), DType.BF16)])
def test_head_transposes_move_16_byte_vectors(shape, perm, dtype):
    """Swapping the heads and tokens of [batch, heads, tokens, 64] keeps rows of a few 16-byte
    vectors contiguous: the lanes take the vectors and the other threads of a block the dims before
    (every thread busy), not one element each."""
    b = GraphBuilder("heads")
    out = b.transpose(b.parameter(shape, dtype, "x"), perm)
    graph = b.build([out])
    nodes = [n for n in graph.nodes if n.op != "parameter"]
    template = feasible(graph, nodes)
    vector = 16 // dtype.itemsize
    assert f"-THREAD_{vector}]" in str(template), template
    kernel = generate(graph, nodes, template)
    assert ("uint4" if dtype == DType.BF16 else "float4") in kernel.cuda_source
    compile_cuda(kernel.cuda_source, "sm_90")
    if np.prod(shape) <= 4096:
        data = np.random.default_rng(0).standard_normal(shape).astype(np.float32)
        if dtype == DType.BF16:
            import ml_dtypes
            data = data.astype(ml_dtypes.bfloat16)
        (got,) = kernel.simulate([data])
        np.testing.assert_array_equal(np.asarray(got, np.float32), np.transpose(data, perm).astype(np.float32))


def test_wide_column_sum_with_an_epilogue_takes_a_thread_per_column():
    """A position-embedding gradient: [batch, tokens, hidden] summed over the batch into
    [1, tokens, hidden], then masked. A thread per column loops over the batch (lanes on the
    contiguous hidden dim); the epilogue's [1, ...] grid is the sum's [tokens, hidden] grid."""
    b = GraphBuilder("position_grad")
    x = b.parameter((4, 32, 256), DType.F32, "x")
    keep = b.parameter((1, 32, 256), DType.BOOL, "keep")
    total = b.reshape(b.reduce(x, [0], "sum"), (1, 32, 256))
    out = b.select(keep, total, b.broadcast(b.constant(0.0, DType.F32), (1, 32, 256), ()))
    graph = b.build([out])
    nodes = [n for n in graph.nodes if n.op != "parameter"]
    template = feasible(graph, nodes)
    assert str(template).startswith("reduce[THREAD,GRID,GRID-CTA_256]"), template
    kernel = generate(graph, nodes, template)
    rng = np.random.default_rng(0)
    arrays = {"x": rng.standard_normal((4, 32, 256)).astype(np.float32), "keep": rng.random((1, 32, 256)) < 0.5}
    (got,) = kernel.simulate([arrays[n] for n in kernel.inputs])
    (want,) = reference.evaluate(graph, [arrays["x"], arrays["keep"]])
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("rows,cols,dtype", [(8, 1000, DType.F32), (4, 200, DType.F32), (8, 520, DType.BF16)])
def test_rows_with_a_vector_tail_stay_in_registers(rows, cols, dtype):
    """A log-softmax over 1000 classes: 250 vectors of 4 in 256 slots of a warp (or of a block of
    256 threads, one vector each, when there are few rows to give the warps). The row is read
    once into registers as 16-byte vectors; the slots past the end read the last vector again
    (clamped index) and are masked out of the reductions and the stores."""
    b = GraphBuilder("log_softmax")
    x = b.parameter((rows, cols), dtype, "x")
    xf = b.convert(x, DType.F32) if dtype != DType.F32 else x
    top = b.broadcast(b.reduce(xf, [1], "max"), (rows, cols), (0,))
    shifted = b.binary("sub", xf, top)
    total = b.broadcast(b.reduce(b.unary("exp", shifted), [1], "sum"), (rows, cols), (0,))
    out = b.binary("sub", shifted, b.unary("log", total))
    out = b.convert(out, dtype) if dtype != DType.F32 else out
    graph = b.build([out])
    nodes = [n for n in graph.nodes if n.op != "parameter"]
    template = feasible(graph, nodes)
    vector = 16 // dtype.itemsize if cols % (16 // dtype.itemsize) == 0 else 8 // dtype.itemsize
    # a warp per row (THREAD_k-CTA_32-THREAD_v) or, for rows a block of vectors covers, a block per row
    assert re.search(rf"CTA_(32|256)-THREAD_{vector}\]", str(template)), template
    kernel = generate(graph, nodes, template)
    assert "(registers)" in kernel.cuda_source and "_vec" in kernel.cuda_source
    compile_cuda(kernel.cuda_source, "sm_90")
    data = np.random.default_rng(1).standard_normal((rows, cols)).astype(np.float32) * 4
    if dtype == DType.BF16:
        import ml_dtypes
        data = data.astype(ml_dtypes.bfloat16)
    (got,) = kernel.simulate([data])
    (want,) = reference.evaluate(graph, [data])
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), rtol=1e-2 if dtype == DType.BF16 else 1e-5, atol=1e-2 if dtype == DType.BF16 else 1e-5)


@pytest.mark.parametrize("lanes,half_vector,f32_vector", [(4, "uint2", "float4"), (2, "uint1", "float2")])
def test_half_lanes_of_an_f32_row_move_as_narrow_vectors(lanes, half_vector, f32_vector):
    """BERT's residual LayerNorm reads its GEMM output in bf16 and the residual in f32 along rows
    tiled by 4 lanes for the f32 values: the bf16 lanes are 8 bytes, read as one access (not four
    2-byte loads), and the bf16 result is stored the same way; 2 lanes are one 32-bit word."""
    b = GraphBuilder("residual")
    rows, cols = 8, 768
    h = b.parameter((rows, cols), DType.BF16, "h")
    r = b.parameter((rows, cols), F32, "r")
    s = b.binary("add", b.convert(h, F32), r)
    mean = b.broadcast(b.binary("div", b.reduce(s, [1], "sum"),
                                b.broadcast(b.constant(float(cols), F32), (rows,), ())), (rows, cols), (0,))
    centred = b.binary("sub", s, mean)
    graph = b.build([centred, b.convert(centred, DType.BF16)])
    nodes = [n for n in graph.nodes if n.op not in ("parameter", "constant")]
    tiles = f"[GRID-WARP_4,THREAD_{24 // lanes}-CTA_32-THREAD_{lanes}]"  # warp mode, the f32 values' tiles
    template = parse_template(f"reduce{tiles}; sub{tiles}; convert_1{tiles}; launch(blocks=2,threads=128)")
    kernel = generate(graph, nodes, template)
    source = kernel.cuda_source.split("extern")[1]
    assert f"reinterpret_cast<const {half_vector}*>(&in" in source and f"make_{half_vector}(" in source
    assert f"reinterpret_cast<const {f32_vector}*>(&in" in source
    compile_cuda(kernel.cuda_source, "sm_90")
    import ml_dtypes
    rng = np.random.default_rng(0)
    arrays = {"h": rng.standard_normal((rows, cols)).astype(ml_dtypes.bfloat16),
              "r": rng.standard_normal((rows, cols)).astype(np.float32)}
    got = kernel.simulate([arrays[n] for n in kernel.inputs])
    want = reference.evaluate(graph, [arrays["h"], arrays["r"]])
    for g, w in zip(got, want):
        np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(w, np.float32), rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("cols,dtype,lanes", [(3072, DType.BF16, 128), (1536, DType.F32, 128), (2048, DType.BF16, 256)])
def test_rows_of_vectors_that_are_not_whole_blocks_leave_no_thread_idle(cols, dtype, lanes):
    """BERT's [4096, 3072] bf16 GELU: a row is 384 16-byte vectors. Blocks of 256 lanes along the
    row left a quarter of their threads idle; 128 lanes × 2 rows cover it exactly. A row of whole
    blocks (2048 bf16 = 256 vectors) keeps one block per row."""
    b = GraphBuilder("gelu_like")
    x = b.parameter((6, cols), dtype, "x")
    out = b.convert(b.unary("tanh", b.convert(x, F32)), dtype) if dtype != F32 else b.unary("tanh", x)
    graph = b.build([out])
    nodes = [n for n in graph.nodes if n.op != "parameter"]
    template = feasible(graph, nodes)
    vector = 16 // dtype.itemsize
    assert f"CTA_{lanes}-THREAD_{vector}]" in str(template), template
    if lanes < 256:
        assert f"CTA_{256 // lanes}," in str(template), template
    kernel = generate(graph, nodes, template)
    compile_cuda(kernel.cuda_source, "sm_90")
    data = np.random.default_rng(2).standard_normal((6, cols)).astype(np.float32)
    if dtype == DType.BF16:
        import ml_dtypes
        data = data.astype(ml_dtypes.bfloat16)
    (got,) = kernel.simulate([data])
    (want,) = reference.evaluate(graph, [data])
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))


def test_few_long_rows_take_a_block_each():
    """A LayerNorm-like row reduction over 128 rows of 768 (BERT at batch 1): warp mode would give
    32 blocks of 4 warps, each lane working through 24 values; a block per row keeps the row in its
    threads' registers. With many rows warp mode stays."""
    from fusionstitching.schedule.grouping import FEW_ROWS_BLOCKS, WARP_ROWS

    def graph_of(rows):
        b = GraphBuilder("rows")
        x = b.parameter((rows, 768), F32, "x")
        mean = b.broadcast(b.reduce(x, [1], "sum"), (rows, 768), (0,))
        return b.build([b.binary("sub", x, mean)])

    few = graph_of(8)
    nodes = [n for n in few.nodes if n.op != "parameter"]
    template = feasible(few, nodes)
    assert "[GRID,THREAD_3-CTA_256]" in str(template) and "threads=256" in str(template), template
    kernel = generate(few, nodes, template)
    compile_cuda(kernel.cuda_source, "sm_90")
    data = np.random.default_rng(3).standard_normal((8, 768)).astype(np.float32)
    (got,) = kernel.simulate([data])
    (want,) = reference.evaluate(few, [data])
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    many = graph_of(WARP_ROWS * FEW_ROWS_BLOCKS)
    assert "WARP_4" in str(feasible(many, [n for n in many.nodes if n.op != "parameter"]))


def test_transpose_into_a_dim_before_others_takes_32_by_32_tiles_along_it():
    """A key gradient [b, h, d, s] -> [b, s, h, d]: the input runs along s, which lands before h in
    the output. The tiles are 32 x 32 over (s, d), not the short vector rows of the other head
    transposes, which read 2 bytes per row and lane here."""
    b = GraphBuilder("key_grad")
    shape = (2, 3, 64, 32)
    out = b.transpose(b.parameter(shape, DType.BF16, "x"), (0, 3, 1, 2))
    graph = b.build([out])
    nodes = [n for n in graph.nodes if n.op != "parameter"]
    template = feasible(graph, nodes)
    assert "[GRID,GRID-CTA_32,GRID,GRID-CTA_8-THREAD_4]" in str(template), template
    kernel = generate(graph, nodes, template)
    compile_cuda(kernel.cuda_source, "sm_90")
    import ml_dtypes
    data = np.random.default_rng(4).standard_normal(shape).astype(ml_dtypes.bfloat16)
    (got,) = kernel.simulate([data])
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.transpose(data, (0, 3, 1, 2)).astype(np.float32))


def _mask_kernel(lanes: int):
    """A ReLU's mask saved for the backward (``x <= 0``, a bool per element) and a mask read back
    (``where(m, x, 0)``), rows of 64 tiled by ``lanes`` THREAD lanes."""
    b = GraphBuilder("mask")
    rows, cols = 64, 64
    x = b.parameter((rows, cols), DType.BF16, "x")
    m = b.parameter((rows, cols), DType.BOOL, "m")
    zero = b.broadcast(b.constant(0.0, DType.BF16), (rows, cols), ())
    saved = b.compare("LE", x, zero)
    kept = b.select(m, x, zero)
    graph = b.build([saved, kept])
    nodes = [n for n in graph.nodes if n.op not in ("parameter", "constant")]
    tiles = f"[GRID-CTA_{256 * lanes // cols},CTA_{cols // lanes}-THREAD_{lanes}]"
    template = parse_template("; ".join(f"{n.name}{tiles}" for n in (saved, kept))
                              + f"; launch(blocks={rows * cols // 256},threads=256)")
    return graph, generate(graph, nodes, template), saved


@pytest.mark.parametrize("lanes,vector", [(16, "uint4"), (8, "uint2"), (4, "uint1")])
def test_bool_lanes_move_as_vectors_of_bytes(lanes, vector):
    """The mask's lanes are one 16-, 8- or 4-byte access, not a store or load per byte; values
    round-trip exactly."""
    graph, kernel, saved = _mask_kernel(lanes)
    source = kernel.cuda_source.split("extern")[1]
    mask_in = f"in{kernel.inputs.index('m')}"
    mask_out = f"out{kernel.outputs.index(saved.name)}"
    assert f"reinterpret_cast<const {vector}*>(&{mask_in}[" in source
    assert f"reinterpret_cast<{vector}*>(&{mask_out}[" in source
    assert not re.search(rf"[^&]({mask_in}|{mask_out})\[", source)  # no scalar access left
    compile_cuda(kernel.cuda_source, "sm_90")
    import ml_dtypes
    rng = np.random.default_rng(0)
    arrays = {"x": rng.standard_normal((64, 64)).astype(ml_dtypes.bfloat16),
              "m": rng.integers(0, 2, (64, 64)).astype(np.bool_)}
    got = kernel.simulate([arrays[n] for n in kernel.inputs])
    want = reference.evaluate(graph, [arrays["x"], arrays["m"]])
    for g, w in zip(got, want):
        np.testing.assert_array_equal(np.asarray(g, np.float32), np.asarray(w, np.float32))


@pytest.mark.gpu
@pytest.mark.parametrize("lanes", [16, 8, 4])
def test_bool_vectors_on_the_gpu(lanes):
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("needs an NVIDIA GPU")
    from fusionstitching.runtime.kernel_call import call_generated

    _, kernel, saved = _mask_kernel(lanes)
    x = torch.randn(64, 64, device="cuda", dtype=torch.bfloat16)
    m = torch.rand(64, 64, device="cuda") > 0.5
    got = dict(zip(kernel.outputs, call_generated(kernel, [{"x": x, "m": m}[n] for n in kernel.inputs])))
    assert torch.equal(got[saved.name], x <= 0)
    (kept,) = [name for name in kernel.outputs if name != saved.name]
    assert torch.equal(got[kept], torch.where(m, x, torch.zeros_like(x)))


def _padded_kernel():
    """Rows interleaved by interior padding (a strided pooling's gradient classes), 8 lanes along
    the channels: ``2 * pad(x) + pad(y)``."""
    b = GraphBuilder("padded")
    x = b.parameter((6, 64), DType.BF16, "x")
    y = b.parameter((6, 64), DType.BF16, "y")
    px = b.node("pad", [x], low=(1, 0), high=(0, 0), interior=(1, 0), value=0.0)
    py = b.node("pad", [y], low=(0, 0), high=(1, 0), interior=(1, 0), value=0.0)
    out = b.binary("add", b.binary("mul", px, b.broadcast(b.constant(2.0, DType.BF16), (12, 64), ())), py)
    graph = b.build([out])
    nodes = [n for n in graph.nodes if n.op not in ("parameter", "constant")]
    template = parse_template(f"{out.name}[GRID-CTA_4,CTA_8-THREAD_8]; launch(blocks=3,threads=32)")
    import ml_dtypes

    rng = np.random.default_rng(0)
    arrays = {n: rng.standard_normal((6, 64)).astype(ml_dtypes.bfloat16) for n in ("x", "y")}
    return graph, generate(graph, nodes, template), arrays


def test_padded_reads_of_vector_lanes_move_as_vectors():
    """Every lane guards its read with the same row condition: the lanes' branches merge and their
    reads become 16-byte loads; the values equal the reference's."""
    graph, kernel, arrays = _padded_kernel()
    source = kernel.cuda_source.split("extern")[1]
    assert source.count("reinterpret_cast<const uint4*>(&in") == 2
    assert not re.search(r"[^&]in[01]\[", source)  # no scalar read left
    compile_cuda(kernel.cuda_source, "sm_90")
    (got,) = kernel.simulate([arrays[n] for n in kernel.inputs])
    (want,) = reference.evaluate(graph, [arrays["x"], arrays["y"]])
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))


@pytest.mark.gpu
def test_padded_vector_reads_on_the_gpu():
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("needs an NVIDIA GPU")
    from fusionstitching.runtime.kernel_call import call_generated

    graph, kernel, arrays = _padded_kernel()
    inputs = [torch.from_numpy(arrays[n].view(np.int16)).view(torch.bfloat16).cuda() for n in kernel.inputs]
    (got,) = call_generated(kernel, inputs)
    (want,) = reference.evaluate(graph, [arrays["x"], arrays["y"]])
    np.testing.assert_array_equal(got.float().cpu().numpy(), np.asarray(want, np.float32))


@pytest.mark.parametrize("cols,tiles", [(100, "CTA_32-THREAD_4]"), (60, "CTA_32-THREAD_2]")])
def test_rows_shorter_than_a_warp_of_vectors_stay_in_registers(cols, tiles):
    """BERT's attention scores at sequence length 100: rows of 100 bf16 are 25 vectors of 4, one per
    lane of a warp (7 lanes idle, as in a loop's last pass). Read once into registers, where the
    lane-stride loop read each row again for the max, the sum and the output."""
    b = GraphBuilder("softmax")
    x = b.parameter((64, cols), DType.BF16, "x")
    xf = b.convert(x, DType.F32)
    top = b.broadcast(b.reduce(xf, [1], "max"), (64, cols), (0,))
    e = b.unary("exp", b.binary("sub", xf, top))
    total = b.broadcast(b.reduce(e, [1], "sum"), (64, cols), (0,))
    graph = b.build([b.convert(b.binary("div", e, total), DType.BF16)])
    nodes = [n for n in graph.nodes if n.op != "parameter"]
    template = feasible(graph, nodes)
    assert tiles in str(template) and f"THREAD_{cols // 32}-CTA" not in str(template), template
    kernel = generate(graph, nodes, template)
    assert "(registers)" in kernel.cuda_source and "for (" not in kernel.cuda_source.split("extern")[1]
    compile_cuda(kernel.cuda_source, "sm_90")
    import ml_dtypes
    data = (np.random.default_rng(2).standard_normal((64, cols)) * 3).astype(ml_dtypes.bfloat16)
    (got,) = kernel.simulate([data])
    (want,) = reference.evaluate(graph, [data])
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("length,lanes,vector,tiles", [
    (100, 32, 8, "CTA_32-THREAD_4"),  # 25 of 32 lanes, as in the loop's last pass
    (1000, 256, 4, "CTA_256-THREAD_4"),  # a block per row: 250 of 256
    (8, 32, 8, "CTA"),  # one vector in one lane: the loop keeps 8 lanes busy
    (20, 32, 8, "CTA"),
    (96, 32, 8, "THREAD_3-CTA_32"),  # whole: no tail
])
def test_a_row_shorter_than_the_slots_takes_registers_where_no_more_lanes_idle(length, lanes, vector, tiles):
    from fusionstitching.schedule.grouping import _reduced_tiles

    got = "-".join(f"{t.level.value}_{t.size}" if t.size else t.level.value for t in _reduced_tiles(length, lanes, vector))
    assert got == tiles


def _odd_row_slice(rows: int, cols: int, padded: int, dtype=DType.BF16):
    """The unpadded columns of a padded GEMM result: rows of odd length, read and written a scalar
    at a time (no vector divides them)."""
    b = GraphBuilder("slice")
    x = b.parameter((rows, padded), dtype, "x")
    return b.build([b.node("slice", [x], start=(0, 0), limit=(rows, cols), stride=(1, 1))])


def test_a_threads_points_along_rows_test_the_column_tail_once_before_their_loads():
    """A thread taking 4 rows of a column (``packing.with_rows``) tests the column tail once,
    outside its unrolled loop, so the 4 loads issue together; the values are the reference's."""
    from fusionstitching.schedule.packing import _packed_template

    graph = _odd_row_slice(8, 257, 264)
    nodes = [n for n in graph.nodes if n.op != "parameter"]
    template = _packed_template(resolve_pattern(graph, nodes), 256, rows=4)
    assert "GRID-THREAD_4," in str(template), template
    kernel = generate(graph, nodes, template)
    body = kernel.cuda_source.split("extern")[1]
    tail, loop = body.index("< (257)"), body.index("#pragma unroll")
    assert tail < loop and body.count("< (257)") == 1, body
    compile_cuda(kernel.cuda_source, "sm_90")
    import ml_dtypes
    data = np.random.default_rng(0).standard_normal((8, 264)).astype(ml_dtypes.bfloat16)
    (got,) = kernel.simulate([data])
    (want,) = reference.evaluate(graph, [data])
    np.testing.assert_array_equal(got, want)
