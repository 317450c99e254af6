"""Generated kernels: compile with NVRTC (sm_80, sm_90), simulate, match graph/reference.py.

The same matrix runs on a GPU under the ``gpu`` marker, against the reference and eager PyTorch,
with outputs poisoned before each launch so that unwritten elements fail.
"""

from __future__ import annotations

import numpy as np
import pytest

from fusionstitching.codegen import default_template, generate
from fusionstitching.codegen import kernel_ir as K
from fusionstitching.codegen.simulate import SimulationError
from fusionstitching.codegen.values import CodegenError
from fusionstitching.graph import reference
from fusionstitching.graph.graph import GraphBuilder
from fusionstitching.graph.ops import DType

from . import cases as C

FLOATS = ["f32", "bf16", "f16"]
MATRIX = (
    [(f"bias_gelu_{d}_{r}x{c}", lambda d=d, r=r, c=c: C.bias_gelu(d, r, c))
     for d in FLOATS for r, c in ((4, 2048), (37, 70), (3, 5), (1, 1))]
    + [(f"relu_t_{d}_{n}x{m}", lambda d=d, n=n, m=m: C.relu_transpose(d, n, m))
       for d in FLOATS for n, m in ((64, 32), (33, 17))]
    + [(f"strided_{d}", lambda d=d: C.strided_inputs(d)) for d in FLOATS]
    + [(f"unit_dims_{d}", lambda d=d: C.one_element_dims(d)) for d in FLOATS]
    + [(f"slice_cat_pad_{d}", lambda d=d: C.slice_cat_pad(d)) for d in FLOATS]
    + [(f"gather_{d}", lambda d=d: C.gather_reshape_iota(d)) for d in FLOATS]
    + [(f"softmax_{d}", lambda d=d: C.softmax_rows(d, 5, 40)) for d in FLOATS]
    + [(f"silu_wide_{d}", lambda d=d: C.silu_wide(d)) for d in FLOATS]
    + [("packed_updates", C.packed_updates)]
    + [(f"{name}_{d}", lambda d=d, name=name: C.hand_built(DType(d), name))
       for name in ("rng", "pad_interior", "column_sum", "packed_shapes") for d in FLOATS]
    + [("int_ops", lambda: C.hand_built(DType.I32, "int_ops"))]
    + [(f"narrow_{d}", lambda d=d: C.narrow_ints(d)) for d in ("u8", "i8", "i16")]
    + [(f"narrow_wide_{d}", lambda d=d: C.narrow_wide(d)) for d in ("u8", "i8", "i16")]
)


def _inputs_for(case, kernel) -> list[np.ndarray]:
    by_name = {p.name: a for p, a in zip(case.graph.parameters, case.arrays)}
    arrays = []
    for name in kernel.inputs:
        node = case.graph.node(name)
        arrays.append(by_name[name] if node.op == "parameter" else node.attrs["value"])
    return arrays


def _expected(case, kernel) -> list[np.ndarray]:
    values = reference.evaluate(case.graph, case.arrays)
    by_name = {}
    for node, value in zip(case.graph.outputs, values):
        by_name.setdefault(node.name, value)
    return [by_name[name] for name in kernel.outputs]


def assert_close(got: np.ndarray, want: np.ndarray, dtype: DType, exact: bool, what: str) -> None:
    assert got.shape == want.shape and got.dtype == want.dtype, what
    tolerance = 0 if exact else C.TOLERANCE[dtype.value]
    if tolerance == 0:
        np.testing.assert_array_equal(got, want, err_msg=what)
    else:
        np.testing.assert_allclose(got.astype(np.float64), want.astype(np.float64), rtol=tolerance,
                                   atol=tolerance, err_msg=what)


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("nvrtc")


@pytest.mark.parametrize("name,make", MATRIX, ids=[m[0] for m in MATRIX])
def test_kernel_compiles_and_simulates_like_the_reference(name, make, cache_dir):
    case = make()
    templates = [default_template(case.graph, case.nodes)] + case.templates
    for template in templates:
        kernel = generate(case.graph, case.nodes, template)
        for arch in ("sm_80", "sm_90"):
            module = kernel.compile(arch, cache_dir=cache_dir)
            assert module.cubin[:4] == b"\x7fELF"
            assert module.resources[kernel.name].registers > 0
        got = kernel.simulate(_inputs_for(case, kernel))
        for out_name, g, w in zip(kernel.outputs, got, _expected(case, kernel)):
            dtype = case.graph.node(out_name).dtype
            assert_close(g, w, dtype, case.exact, f"{name} {template} output {out_name}")


def test_default_template_vectorizes_wide_rows():
    case = C.bias_gelu("bf16", 4, 2048)
    kernel = generate(case.graph, case.nodes, default_template(case.graph, case.nodes))
    assert "THREAD_8" in str(kernel.template)
    assert "uint4" in kernel.cuda_source and "make_uint4" in kernel.cuda_source
    assert kernel._scalar_variant is not None and "uint4" not in kernel._scalar_variant.cuda_source


def test_kernels_of_nodes_named_alike_beyond_the_name_limit_are_named_apart():
    """Names were cut at 60 characters: the patterns read from an attention backward's gradients
    (``..._attention_backward_2`` and ``..._backward_1_3``) got one name, and the tuner, which tells
    a program's kernels apart by name, gave one the other's template."""
    b = GraphBuilder("backward_11")
    x = b.parameter((4, 64), DType.F32, name="x")
    long = "_scaled_dot_product_efficient_attention_backward"
    first = b.node("exp", [x], name=f"{long}_2")
    second = b.node("neg", [x], name=f"{long}_1_3")
    graph = b.build([b.node("add", [first, x]), b.node("mul", [second, x])])
    names = set()
    for head in (first, second):
        nodes = [head, *graph.index.users[head]]
        kernel = generate(graph, nodes, default_template(graph, nodes))
        assert len(kernel.name) <= 60 and kernel.name.isidentifier()
        names.add(kernel.name)
    assert len(names) == 2


def test_small_index_math_is_32_bit():
    case = C.bias_gelu("f32", 37, 70)
    source = generate(case.graph, case.nodes, default_template(case.graph, case.nodes)).cuda_source
    assert "long long" not in source.split('extern "C"')[1]


def test_packed_kernel_has_one_sub_kernel_per_shape_and_block_ranges():
    case = C.hand_built(DType.F32, "packed_shapes")
    kernel = generate(case.graph, case.nodes, case.templates[0])
    assert kernel.cuda_source.count("// sub-kernel") == 3  # tanh and mul share one loop
    assert kernel.outputs == ["tanh", "mul", "add", "abs"]


def test_in_place_update_writes_into_the_input():
    case = C.packed_updates()
    kernel = generate(case.graph, case.nodes, default_template(case.graph, case.nodes))
    assert len(kernel.lowered.aliases) == 5
    assert "__restrict__" not in kernel.cuda_source.split("out0")[0].split("(")[-1]


def test_inputs_are_listed_in_order_of_first_use():
    b = GraphBuilder("order")
    x = b.parameter((4,), DType.F32, "x")
    y = b.parameter((4,), DType.F32, "y")
    out = b.binary("add", b.unary("exp", y), x)
    graph = b.build([out])
    kernel = generate(graph, [n for n in graph.nodes if n.op != "parameter"], "add[CTA]; launch(blocks=1,threads=32)")
    assert kernel.inputs == ["y", "x"] and kernel.outputs == ["add"]


def test_simulator_reports_out_of_bounds_template():
    case = C.bias_gelu("f32", 37, 70)
    template = f"{case.graph.outputs[0].name}[GRID,CTA_3-CTA_32]; launch(blocks=37,threads=96)"
    kernel = generate(case.graph, case.nodes, template, guard_tails=False)
    with pytest.raises(SimulationError, match=r"out of bounds|out-of-bounds"):
        kernel.simulate(_inputs_for(case, kernel))
    generate(case.graph, case.nodes, template).simulate(_inputs_for(case, kernel))  # guarded: fine


def test_simulator_reports_cross_block_read_of_an_in_place_transpose():
    b = GraphBuilder("inplace_t")
    p = b.parameter((64, 64), DType.F32, "p")
    out = b.binary("add", b.transpose(p, (1, 0)), p)
    graph = b.build([out], mutations={0: 0})
    nodes = [n for n in graph.nodes if n.op != "parameter"]
    template = "add[GRID,CTA]; launch(blocks=64,threads=64)"
    data = np.arange(64 * 64, dtype=np.float32).reshape(64, 64)
    # Not elementwise: the kernel writes a new buffer (the runtime copies it into p afterwards).
    safe = generate(graph, nodes, template)
    assert safe.lowered.aliases == {}
    np.testing.assert_array_equal(safe.simulate([data])[0], data.T + data)
    kernel = generate(graph, nodes, template, check_in_place=False)
    assert kernel.lowered.aliases == {0: 0}
    with pytest.raises(SimulationError, match="cross-block"):
        kernel.simulate([data])


def test_an_input_also_read_through_a_view_is_not_updated_in_place():
    """``v = x.unsqueeze(0).amax(-3); x.mul_(2)``: the kernel read x under two names, the view for the
    reduction and x itself for the update, and wrote x in place; a packed sub-kernel of other blocks
    read elements the update had already doubled (GPU fuzz 1126503:1517, 13 of 6147 elements)."""
    b = GraphBuilder("view_and_update")
    x = b.parameter((2049, 3), DType.I32, "x")
    amax = b.reduce(b.reshape(x, (1, 2049, 3)), (0,), "max")
    doubled = b.binary("mul", x, b.broadcast(b.constant(2, DType.I32), (2049, 3), ()))
    graph = b.build([amax, doubled], mutations={1: 0})
    # the reshape is a view step of the plan: the kernel reads it as an input of its own
    nodes = [n for n in graph.nodes if n.op not in ("parameter", "constant", "reshape")]
    kernel = generate(graph, nodes, default_template(graph, nodes))
    assert len(kernel.inputs) == 2 and kernel.lowered.aliases == {}
    data = np.arange(2049 * 3, dtype=np.int32).reshape(2049, 3)
    got = kernel.simulate([data.reshape(1, 2049, 3), data] if kernel.inputs[0] == "reshape" else [data, data.reshape(1, 2049, 3)])
    np.testing.assert_array_equal(got[0], data)
    np.testing.assert_array_equal(got[1], data * 2)


def test_a_32_bit_integer_max_is_no_max_instruction_for_ptxas():
    """ptxas 13.0 for sm_90 fuses three 32-bit integer max/min into VIMNMX3 and drops an operand's
    negation: ``(-x).int().amax(2)`` over 3 elements gave max(-a, b, -c) (GPU fuzz 1126501:1634).
    Integer max/min print as helpers that compare and mask (ptxas turned even a compare-and-select
    in inline PTX back into VIMNMX3)."""
    b = GraphBuilder("neg_amax")
    x = b.parameter((2, 3), DType.I32, "x")
    out = b.reduce(b.unary("neg", x), (1,), "max")
    graph = b.build([out])
    nodes = [n for n in graph.nodes if n.op != "parameter"]
    kernel = generate(graph, nodes, default_template(graph, nodes))
    body = kernel.cuda_source.split('extern "C"')[1]
    assert "fs_imax(" in body and " ? " not in body
    kernel.compile("sm_90")
    data = np.array([[-3, -2, -8], [-2, 6, 5]], dtype=np.int32)
    np.testing.assert_array_equal(kernel.simulate([data])[0], [8, 2])


def test_errors_name_the_node():
    case = C.bias_gelu("f32", 4, 8)
    root = case.graph.outputs[0].name
    with pytest.raises(CodegenError, match=f"template has no schedule for output {root}"):
        generate(case.graph, case.nodes, "x[GRID]; launch(blocks=1,threads=32)")
    with pytest.raises(CodegenError, match="iteration space"):
        generate(case.graph, case.nodes, f"{root}[GRID]; launch(blocks=1,threads=32)")
    col = C.hand_built(DType.F32, "column_sum")
    with pytest.raises(CodegenError, match="keeps dim 1 tiled CTA; its kept dims must be GRID, WARP or THREAD"):
        generate(col.graph, col.nodes, "reduce[CTA,CTA]; launch(blocks=1,threads=64)")
    # A column reduced across the threads of a block is legal (block composition).
    kernel = generate(col.graph, col.nodes, "reduce[CTA,GRID]; launch(blocks=70,threads=64)")
    got = kernel.simulate(_inputs_for(col, kernel))[0]
    np.testing.assert_allclose(got, _expected(col, kernel)[0], rtol=1e-5)


# ----------------------------------------------------------------------------------------------
# GPU
# ----------------------------------------------------------------------------------------------


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


@pytest.mark.gpu
@pytest.mark.skipif(not _cuda_available(), reason="needs an NVIDIA GPU")
@pytest.mark.parametrize("name,make", MATRIX, ids=[m[0] for m in MATRIX])
def test_kernel_on_gpu_matches_reference_and_eager(name, make):
    import torch

    from fusionstitching.bench.check import to_numpy
    from fusionstitching.frontend.context import DTYPE_TO_TORCH
    from fusionstitching.runtime.kernel_call import call_generated

    case = make()
    for template in [default_template(case.graph, case.nodes)] + case.templates:
        kernel = generate(case.graph, case.nodes, template)
        tensors = []
        for node, array in zip(kernel.lowered.pattern.inputs, _inputs_for(case, kernel)):
            t = _to_torch(array, DTYPE_TO_TORCH[node.dtype]).cuda()
            layout = kernel.lowered.input_layouts[len(tensors)]
            if node.op == "parameter" and node.layout is not None:
                storage = torch.zeros(max(kernel.kernel.buffer(f"in{len(tensors)}").extent, 1) + node.layout.offset,
                                      dtype=t.dtype, device="cuda")
                view = storage.as_strided(node.shape, layout.strides, node.layout.offset)
                view.copy_(t)
                t = view
            tensors.append(t)
        outputs = [t if k in kernel.lowered.aliases else None for k, t in enumerate(kernel.outputs)]
        poisoned = []
        for k, node in enumerate(kernel.lowered.pattern.outputs):
            if k in kernel.lowered.aliases:
                poisoned.append(tensors[kernel.lowered.aliases[k]])
            else:
                poisoned.append(_poisoned(node.shape, DTYPE_TO_TORCH[node.dtype]))
        got = call_generated(kernel, tensors, outputs=poisoned)
        torch.cuda.synchronize()
        for out_name, g, w in zip(kernel.outputs, got, _expected(case, kernel)):
            dtype = case.graph.node(out_name).dtype
            assert_close(to_numpy(g), w, dtype, case.exact, f"{name} {template} output {out_name} (GPU)")
        if case.torch_fn is not None and not kernel.lowered.aliases:
            eager = case.torch_fn(*[t.clone() for t in case.torch_inputs])  # on the CPU
            eager = eager if isinstance(eager, (tuple, list)) else [eager]
            for g, e in zip(got, eager):
                assert_close(to_numpy(g), to_numpy(e), DType.F32 if e.dtype == torch.float32 else DType.BF16,
                             False, f"{name} vs eager")
        del outputs


def _to_torch(array: np.ndarray, dtype):
    import torch

    if dtype == torch.bfloat16:
        return torch.from_numpy(np.asarray(array, np.float32)).to(dtype)
    return torch.from_numpy(np.array(array))


def _poisoned(shape, dtype):
    import torch

    t = torch.empty(shape, dtype=dtype, device="cuda")
    if dtype.is_floating_point:
        t.fill_(float("nan"))
    elif dtype == torch.bool:
        t.fill_(True)
    else:
        t.fill_(-7777 if torch.iinfo(dtype).bits >= 32 else 85)
    return t


def test_kernel_ir_is_immutable():
    with pytest.raises(AttributeError):
        K.Const(1, "i32").value = 2


def test_index_math_is_64_bit_when_sizes_need_it():
    b = GraphBuilder("huge")
    x = b.parameter((65536, 65536), DType.F32, "x")
    out = b.unary("neg", x)
    graph = b.build([out])
    nodes = [n for n in graph.nodes if n.op != "parameter"]
    source = generate(graph, nodes, default_template(graph, nodes)).cuda_source.split('extern "C"')[1]
    assert "long long" in source


@pytest.mark.parametrize("template, word_chosen_at_run_time", [
    # 4 consecutive elements per thread: one Philox block, a constant word per element
    ("select[GRID,CTA_16-THREAD_4]; rng_uniform[GRID,CTA_16-THREAD_4]; launch(blocks=6,threads=32)", False),
    # 50-wide rows one element per thread: the word is chosen at run time
    ("select[GRID,CTA_64]; rng_uniform[GRID,CTA_64]; launch(blocks=3,threads=64)", True),
])
def test_dropout_mask_shares_a_philox_block_between_a_threads_four_elements(template, word_chosen_at_run_time):
    b = GraphBuilder("rng4")
    rows, cols = (6, 64) if "THREAD_4" in template else (3, 50)
    x = b.parameter((rows, cols), DType.F32, "x")
    seed, offset = b.parameter((), DType.I64, "seed"), b.parameter((), DType.I64, "offset")
    u = b.rng_uniform(seed, offset, 1, shape=(rows, cols), dtype=DType.F32)
    keep = b.compare("LT", u, b.broadcast(b.constant(0.9, DType.F32), (rows, cols), ()))
    out = b.select(keep, x, b.broadcast(b.constant(0, DType.F32), (rows, cols), ()))
    graph = b.build([out, u])
    kernel = generate(graph, ["rng_uniform", "compare", "select"] + [n.name for n in graph.nodes
                                                                     if n.op == "broadcast_in_dim"],
                      template, vectorize=False)
    arrays = [np.random.default_rng(0).standard_normal((rows, cols)).astype(np.float32), np.int64(987654321),
              np.int64(2**33 + 5)]
    by_name = dict(zip(["x", "seed", "offset"], arrays))
    got_all = dict(zip(kernel.outputs, kernel.simulate([by_name[name] if name in by_name else graph.node(name).attrs["value"]
                                                         for name in kernel.inputs])))
    for node, want in zip(graph.outputs, reference.evaluate(graph, arrays)):
        got = got_all[node.name]
        np.testing.assert_array_equal(got, want)
    # a thread's four elements: four words of one block (one counter); else a select over the four words
    source = kernel.cuda_source
    assert ("== 2u" in source) == word_chosen_at_run_time
    if not word_chosen_at_run_time:
        assert all(f").{w}" in source for w in "xyzw")
        assert len({line.split("=")[0] for line in source.splitlines() if "fs_philox(" in line and "=" in line}) == 4


def test_packed_reductions_over_the_same_dims_share_one_loop():
    """Two column sums over the same dims that read a common input (a LayerNorm's dγ partial
    Σ x·g and dβ partial Σ g) run in one loop with an accumulator each: g is loaded once per point,
    where each sum had its own loop and sub-kernel, reading g twice."""
    b = GraphBuilder("two_sums")
    x = b.parameter((4, 16, 8, 96), DType.F32, "x")
    g = b.parameter((4, 16, 8, 96), DType.F32, "g")
    both = b.build([b.reduce(b.binary("mul", x, g), [2], "sum"), b.reduce(g, [2], "sum")])
    nodes = [n for n in both.nodes if n.op != "parameter"]
    kernel = generate(both, nodes, default_template(both, nodes))
    source = kernel.cuda_source[kernel.cuda_source.index('extern "C"'):]
    assert source.count("for (") == 1 and source.count("sub-kernel") == 0, source
    g_buffer = f"in{kernel.inputs.index('g')}["
    assert source.count(g_buffer) == 1, source
    rng = np.random.default_rng(0)
    arrays = {p.name: rng.standard_normal(p.shape).astype(np.float32) for p in both.parameters}
    got = kernel.simulate([arrays[name] for name in kernel.inputs])
    want = reference.evaluate(both, [arrays[p.name] for p in both.parameters])
    for a, w in zip(got, want):
        np.testing.assert_allclose(a, w, rtol=1e-5, atol=1e-5)


def test_outputs_one_reshape_apart_share_one_nest_and_read_the_input_once():
    """BERT's bias add [rows, 3072] is an output (saved for the backward) and so is the GELU of its
    [batch, seq, 3072] view: both tile the same elements onto the same threads, so one loop nest
    computes both (the add once) instead of two sub-kernels that each read the GEMM output; the
    weight cast beside them keeps its sub-kernel and its whole grid of blocks."""
    b = GraphBuilder("bias_gelu_saved")
    y = b.parameter((64, 512), DType.BF16, "y")
    bias = b.parameter((512,), DType.BF16, "bias")
    w = b.parameter((96, 512), DType.F32, "w")
    added = b.binary("add", y, b.broadcast(bias, (64, 512), (1,)))
    view = b.convert(b.reshape(added, (4, 16, 512)), DType.F32)
    gelu = b.convert(b.binary("mul", view, b.unary("tanh", view)), DType.BF16)
    graph = b.build([added, gelu, b.convert(w, DType.BF16)])
    nodes = [n for n in graph.nodes if n.op != "parameter"]
    kernel = generate(graph, nodes, default_template(graph, nodes))
    source = kernel.cuda_source[kernel.cuda_source.index('extern "C"'):]
    assert source.count("// sub-kernel") == 2, source
    assert source.count(f"in{kernel.inputs.index('y')}[") == 1, source
    assert source.count("tanhf(") == 8  # one 16-byte vector of bf16 lanes per thread
    ranges = [line.split("blocks [")[1] for line in source.splitlines() if "// sub-kernel" in line]
    assert ranges[-1].split(")")[0].split(", ")[1] == str(kernel.template.launch.blocks)
    rng = np.random.default_rng(0)
    arrays = {p.name: rng.standard_normal(p.shape).astype(p.dtype.numpy) for p in graph.parameters}
    got = kernel.simulate([arrays[name] for name in kernel.inputs])
    want = reference.evaluate(graph, [arrays[p.name] for p in graph.parameters])
    for a, w_ in zip(got, want):
        np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(w_, np.float32), rtol=1e-2, atol=1e-2)


def test_column_sums_read_vectors_of_adjacent_columns():
    """A column sum tiled with a THREAD vector on its kept innermost dim (bf16 rows, 4 adjacent
    columns per thread): one loop over the rows with an accumulator per column and one 8-byte
    vector load per row, where each column had its own loop of 2-byte loads. (Not the default
    tiling: on BERT's bias-gradient partial sums it measured no faster than a column per thread.)"""
    b = GraphBuilder("bias_grads")
    gs = [b.parameter((8, 16, 768), DType.BF16, f"g{k}") for k in range(2)]
    sums = [b.reduce(b.convert(g, DType.F32), (1,), "sum") for g in gs]
    graph = b.build(sums)
    nodes = [n for n in graph.nodes if n.op != "parameter"]
    template = "; ".join(f"{s.name}[GRID-CTA_4,THREAD,GRID-CTA_64-THREAD_4]" for s in sums) + \
        "; launch(blocks=12,threads=256)"
    kernel = generate(graph, nodes, template)
    source = kernel.cuda_source[kernel.cuda_source.index('extern "C"'):]
    assert source.count("for (") == 2 and source.count("reinterpret_cast<const uint2*>") == 2, source
    assert source.count("float4*>(&out") == 2
    rng = np.random.default_rng(0)
    arrays = {p.name: rng.standard_normal(p.shape).astype(p.dtype.numpy) for p in graph.parameters}
    got = kernel.simulate([arrays[name] for name in kernel.inputs])
    want = reference.evaluate(graph, [arrays[p.name] for p in graph.parameters])
    for a, w in zip(got, want):
        np.testing.assert_allclose(a, w, rtol=1e-5, atol=1e-5)


def test_a_dropout_mask_and_the_view_it_masks_share_one_nest_and_one_draw():
    """BERT's first attention dropout: the bool mask [b, h, s, s] (saved for the backward) and the
    masked bf16 probabilities viewed as [b·h, s, s]. Tiled by the widest type (8 lanes) both put the
    same elements on the same threads, so one nest draws each random number once and reads the
    probabilities once; as sub-kernels of 16 and 8 lanes each drew them and both read the input."""
    b = GraphBuilder("dropout_saved")
    p = b.parameter((2, 3, 16, 128), DType.F32, "p")
    seed = b.parameter((), DType.I64, "seed")
    offset = b.parameter((), DType.I64, "offset")
    shape = (2, 3, 16, 128)
    u = b.rng_uniform(seed, offset, 1, shape=shape, dtype=DType.F32)
    keep = b.compare("GT", u, b.broadcast(b.constant(0.1, DType.F32), shape, ()))
    kept = b.binary("mul", b.convert(keep, DType.F32), p)
    out = b.reshape(b.convert(b.binary("mul", kept, b.broadcast(b.constant(1 / 0.9, DType.F32), shape, ())),
                              DType.BF16), (6, 16, 128))
    graph = b.build([keep, out])
    nodes = [n for n in graph.nodes if n.op != "parameter" and not (n.op == "constant" and n.shape)]
    kernel = generate(graph, nodes, default_template(graph, nodes))
    source = kernel.cuda_source[kernel.cuda_source.index('extern "C"'):]
    assert "sub-kernel" not in source and "THREAD_8" in str(kernel.template), kernel.template
    assert source.count(f"in{kernel.inputs.index('p')}[") == 2, source  # two float4 per 8 lanes
    # 8 lanes: two Philox blocks of 4 words, each called once per word it serves.
    assert len({line.split("fs_philox(")[1].split(")")[0] for line in source.splitlines() if "fs_philox(" in line}) == 2
    arrays = [np.random.default_rng(0).random(shape).astype(np.float32), np.int64(-12345678901), np.int64(2**40 + 3)]
    by_name = dict(zip(["p", "seed", "offset"], arrays))
    got = kernel.simulate([by_name[name] if name in by_name else graph.node(name).attrs["value"]
                           for name in kernel.inputs])
    want = reference.evaluate(graph, arrays)
    for a, w in zip(got, want):
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(w, np.float32))
