"""The shape of generated code where it decides speed, checked on ``cuda_source`` in the manner of
LLVM's FileCheck: patterns that must appear in order, and counts of what must appear once."""

from __future__ import annotations

import re

from fusionstitching.codegen import default_template, generate
from fusionstitching.graph.graph import GraphBuilder
from fusionstitching.graph.ops import DType


def check_in_order(source: str, *patterns: str) -> None:
    """Each regular expression of ``patterns`` matches after the previous one's match."""
    at = 0
    for pattern in patterns:
        found = re.compile(pattern).search(source, at)
        assert found, f"{pattern!r} not found after:\n{source[at:at + 1500]}"
        at = found.end()


def _softmax_rows(rows: int, width: int):
    b = GraphBuilder("softmax_rows")
    x = b.parameter((rows, width), DType.F32, "x")
    top = b.reduce(x, [1], "max")
    e = b.unary("exp", b.binary("sub", x, b.broadcast(top, (rows, width), [0])))
    y = b.binary("div", e, b.broadcast(b.reduce(e, [1], "sum"), (rows, width), [0]))
    graph = b.build([y])
    return graph, [n for n in graph.nodes if n.op != "parameter"]


def test_a_softmax_row_is_read_once_into_registers_and_reduced_by_warp_then_block():
    graph, nodes = _softmax_rows(8, 1024)
    source = generate(graph, nodes, default_template(graph, nodes)).cuda_source.split('extern "C"')[1]
    body = source.split(") {", 1)[1]
    # One 16-byte load of the row per thread, and nothing else read from global memory.
    assert len(re.findall(r"\bin0\[", body)) == 1 and "float4" in body.split("in0[")[0].splitlines()[-1]
    # exp once per element: the division reuses the values the sum computed.
    assert body.count("expf(") == 4
    check_in_order(body,
                   r"fs_maxf\(acc\d+, ld\d+\)",               # the max over the thread's four elements
                   r"__shfl_xor_sync\(0xffffffffu, acc\d+, \(16\)",  # across the warp
                   r"__syncthreads\(\);",                      # then across the block's warps
                   r"expf\(",                                  # the sum of exps reads the registers
                   r"__shfl_xor_sync",
                   r"__syncthreads\(\);",
                   r"\*reinterpret_cast<float4\*>\(&out0\[")   # one 16-byte store per thread
    assert body.count("out0[") == 1


def test_a_narrow_row_is_reduced_within_a_warp_without_a_block_barrier():
    graph, nodes = _softmax_rows(64, 32)
    kernel = generate(graph, nodes, default_template(graph, nodes))
    body = kernel.cuda_source.split('extern "C"')[1]
    assert "__shfl_xor_sync" in body and "__syncthreads" not in body, kernel.template


def test_small_integral_powers_are_products_and_others_call_powf():
    """pow(x, 1), pow(x, 2) and pow(x, 3) as torch's CUDA pow computes them (x, x·x, x·x·x): a norm's
    gradient had a powf call per element (pow(x, 1.0)); pow(x, 2.5) still calls powf."""
    import numpy as np

    values = np.linspace(-3, 3, 8 * 256, dtype=np.float32).reshape(8, 256)
    for exponent in (1.0, 2.0, 3.0, 2.5):
        b = GraphBuilder("power")
        x = b.parameter((8, 256), DType.F32, "x")
        graph = b.build([b.binary("pow", x, b.broadcast(b.constant(exponent, DType.F32), (8, 256), []))])
        nodes = [n for n in graph.nodes if n.op != "parameter"]
        kernel = generate(graph, nodes, default_template(graph, nodes))
        assert ("powf(" in kernel.cuda_source) == (exponent == 2.5), exponent
        with np.errstate(invalid="ignore"):
            want = np.power(values, np.float32(exponent))
        np.testing.assert_allclose(kernel.simulate([values])[0], want, rtol=1e-6, equal_nan=True)


def test_a_long_serial_loop_inside_an_unrolled_one_is_unrolled_by_a_bounded_factor():
    """An unrolled loop around a serial one over 64 rows (a packed kernel's column sums): NVCC
    unrolled the inner loop whole inside each unrolled copy, and NVRTC took seconds per sub-kernel.
    The inner loop is unrolled ``NESTED_SERIAL_UNROLL`` times; a short nested loop, and a long loop
    outside any unrolled one, print as before (no pragma)."""
    from fusionstitching.codegen import kernel_ir as K
    from fusionstitching.codegen.cuda_c import NESTED_SERIAL_UNROLL, render

    def const(value):
        return K.Const(value, "i32")

    outer, inner, short, alone = (K.Var(name, "i32") for name in ("t_outer", "t_inner", "t_short", "t_alone"))
    acc = K.Var("acc", "f32")

    def summed(var):
        return (K.Assign(acc, K.Binary("add", acc, K.Load("x", var, "f32"), "f32")),)

    body = (
        K.Let(acc, K.Const(0.0, "f32")),
        K.For(outer, const(0), const(8), const(1), (
            K.For(inner, const(0), const(64), const(1), summed(inner)),
            K.For(short, const(0), const(NESTED_SERIAL_UNROLL), const(1), summed(short)),
        ), "unroll"),
        K.For(alone, const(0), const(64), const(1), summed(alone)),
        K.Store("out", const(0), acc),
    )
    params = (K.Buffer("out", "f32", 1), K.Buffer("x", "f32", 64, readonly=True))
    source = render(K.Kernel("nested", params, body, 32, 1, ()))
    check_in_order(source, r"#pragma unroll\n\s*for \(int t_outer",
                   rf"#pragma unroll {NESTED_SERIAL_UNROLL}\n\s*for \(int t_inner",
                   r"\}\n\s*for \(int t_short", r"\}\n\s*\}\n\s*for \(int t_alone")
    assert source.count("#pragma unroll") == 3  # the outer loop, the inner one and the prelude's
