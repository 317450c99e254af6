"""The shared-memory tiled transpose: ``relu(x.T * y + 1)`` through a padded 32 x 33 tile.

``schedule/transpose.transpose_smem_template`` caches the transpose in shared memory (an ``S`` group whose
lanes read x along its rows), and the output group reads the tile transposed, lanes along its own
rows. Matrix: 4096 x 4096 and odd shapes (33 x 65, one row, one column, 100 x 3000) × f32/bf16.
Each kernel compiles for sm_80 and sm_90 and its simulation matches graph/reference.py; the
simulator reports the races that the barriers prevent; the GPU test runs the matrix against torch.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from fusionstitching.codegen import default_template, generate
from fusionstitching.codegen import kernel_ir as K
from fusionstitching.codegen.lower import resolve_pattern
from fusionstitching.codegen.simulate import SimulationError
from fusionstitching.codegen.values import CodegenError
from fusionstitching.codegen.vectorize import affine
from fusionstitching.graph.ops import DType
from fusionstitching.schedule import feasible
from fusionstitching.schedule.grouping import _candidate_templates
from fusionstitching.schedule.transpose import transpose_smem_template

from . import cases as C
from .test_generate import _expected, _inputs_for, assert_close

# (rows, cols) of the output; x is (cols, rows), y is (rows, cols).
SHAPES = [(4096, 4096), (33, 65), (65, 33), (1, 4096), (4096, 1), (100, 3000)]
MATRIX = [(d, r, c) for d in ("f32", "bf16") for r, c in SHAPES]
TEMPLATE_4096 = ("transpose[GRID-CTA_32,GRID-WARP_8-THREAD_4]S; max[GRID-WARP_8-THREAD_4,GRID-CTA_32]; "
                 "launch(blocks=16384,threads=256)")
TILE_BYTES = 32 * 33 * 4


def _template(case):
    return transpose_smem_template(resolve_pattern(case.graph, case.nodes))


def _with_body(kernel, body):
    """``kernel`` with its Kernel IR body replaced (the shared buffers stay)."""
    ir = kernel.lowered.kernel
    broken = K.Kernel(ir.name, ir.params, tuple(body), ir.threads, ir.blocks, ir.shared)
    kernel.lowered = dataclasses.replace(kernel.lowered, kernel=broken)
    return kernel


def _map_stmts(stmts, change):
    """Rebuild ``stmts`` bottom-up; ``change(stmt)`` returns a list of statements to put instead."""
    out = []
    for s in stmts:
        if isinstance(s, K.For):
            s = K.For(s.var, s.start, s.stop, s.step, tuple(_map_stmts(s.body, change)), s.kind)
        elif isinstance(s, K.If):
            s = K.If(s.cond, tuple(_map_stmts(s.then, change)), tuple(_map_stmts(s.orelse, change)))
        out.extend(change(s))
    return out


def _walk(stmts):
    for s in stmts:
        yield s
        if isinstance(s, K.For):
            yield from _walk(s.body)
        elif isinstance(s, K.If):
            yield from _walk(s.then)
            yield from _walk(s.orelse)


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("nvrtc")


def test_template_for_4096_squared():
    case = C.relu_transpose("f32", 4096, 4096)
    assert str(_template(case)) == TEMPLATE_4096


@pytest.mark.parametrize("dtype,rows,cols", MATRIX, ids=[f"{d}_{r}x{c}" for d, r, c in MATRIX])
def test_compiles_and_simulates_like_the_reference(dtype, rows, cols, cache_dir):
    case = C.relu_transpose(dtype, rows, cols)
    kernel = generate(case.graph, case.nodes, _template(case))
    for arch in ("sm_80", "sm_90"):
        module = kernel.compile(arch, cache_dir=cache_dir)
        assert module.cubin[:4] == b"\x7fELF"
        assert module.resources[kernel.name].shared_bytes == TILE_BYTES
    (got,) = kernel.simulate(_inputs_for(case, kernel))
    assert_close(got, _expected(case, kernel)[0], DType(dtype), False, f"{case.name} {kernel.template}")


def test_smem_plan_holds_one_padded_tile_and_one_barrier_separates_the_groups():
    case = C.relu_transpose("f32", 100, 3000)
    kernel = generate(case.graph, case.nodes, _template(case))
    plan = kernel.smem_plan
    assert [(b.name, b.bytes, b.sharers) for b in plan.buffers] == [("smem0", TILE_BYTES, ("transpose",))]
    assert plan.total_bytes == TILE_BYTES and "transpose" in str(plan)
    source = kernel.cuda_source
    assert "__shared__ __align__(16) float smem_smem0[1056];" in source
    assert source.count("__syncthreads()") == 1


def test_global_accesses_are_coalesced_and_tile_accesses_conflict_free():
    """Lane l of a warp reads x and y and writes the output at base + l (coalesced); it touches the
    tile at base + k*l with k odd (32 banks: 33 for the transposed store, 1 for the read)."""
    case = C.relu_transpose("f32", 100, 3000)
    kernel = generate(case.graph, case.nodes, _template(case))
    stmts = list(_walk(kernel.lowered.kernel.body))
    lanes = {s.var.name for s in stmts if isinstance(s, K.Let) and s.value == K.Special("lane")}
    definitions = {s.var.name: s.value for s in stmts if isinstance(s, K.Let) and s.var.name not in lanes}
    accesses = []
    for s in stmts:
        if isinstance(s, K.Store):
            accesses.append((s.buffer, s.index))
        if isinstance(s, K.Let) and isinstance(s.value, K.Load):
            accesses.append((s.value.buffer, s.value.index))
    seen = set()
    for buffer, index in accesses:
        terms, _ = affine(index, definitions)
        stride = sum(c for name, c in terms.items() if name in lanes)
        seen.add(buffer)
        if buffer.startswith("smem"):
            assert stride % 2 == 1, (buffer, stride)
        else:
            assert stride == 1, (buffer, stride)
    assert seen == {"in0", "in1", "out0", "smem_smem0"}


def test_removing_the_barrier_is_reported_as_a_race():
    case = C.relu_transpose("f32", 33, 65)
    kernel = generate(case.graph, case.nodes, _template(case))
    _with_body(kernel, _map_stmts(kernel.lowered.kernel.body, lambda s: [] if isinstance(s, K.Barrier) else [s]))
    assert "__syncthreads" in kernel.cuda_source  # the printed source is the original
    with pytest.raises(SimulationError, match=r"shared-memory race: read of smem_smem0\[\d+\], written by thread"):
        kernel.simulate(_inputs_for(case, kernel))


def test_blocks_looping_over_tiles_end_each_tile_with_a_barrier():
    """Fewer blocks than tiles: a grid-stride loop, whose next tile must not be written while other
    warps still read the last one; without the barrier that ends each iteration it is a race."""
    case = C.relu_transpose("f32", 100, 300)
    template = str(_template(case)).replace("blocks=40", "blocks=7")
    kernel = generate(case.graph, case.nodes, template)
    assert kernel.cuda_source.count("__syncthreads()") == 2
    (got,) = kernel.simulate(_inputs_for(case, kernel))
    assert_close(got, _expected(case, kernel)[0], DType.F32, False, template)

    def drop_trailing(s):
        if isinstance(s, K.For) and s.kind == "grid_stride":
            assert isinstance(s.body[-1], K.Barrier)
            return [K.For(s.var, s.start, s.stop, s.step, s.body[:-1], s.kind)]
        return [s]

    _with_body(kernel, _map_stmts(kernel.lowered.kernel.body, drop_trailing))
    with pytest.raises(SimulationError, match=r"shared-memory race: write of smem_smem0\[\d+\], read by thread"):
        kernel.simulate(_inputs_for(case, kernel))


def test_shared_groups_in_warp_mode_need_every_warp_of_the_block():
    case = C.relu_transpose("f32", 64, 64)
    template = str(_template(case)).replace("threads=256", "threads=512")
    with pytest.raises(CodegenError, match="WARP tiles must cover exactly the 16 warps"):
        generate(case.graph, case.nodes, template)


def test_feasible_keeps_the_register_tiled_default_and_lists_the_tile_as_a_fallback():
    case = C.relu_transpose("f32", 64, 32)
    pattern = resolve_pattern(case.graph, case.nodes)
    answer = feasible(case.graph, case.nodes)
    assert answer == default_template(case.graph, case.nodes) and "S" not in str(answer).split("launch")[0]
    candidates = []
    for make in _candidate_templates(pattern):
        try:
            candidates.append(str(make()))
        except ValueError:
            candidates.append(None)
    smem = str(_template(case))
    assert smem in candidates and candidates.index(smem) > 0


def test_patterns_without_a_transposed_read_are_refused():
    case = C.bias_gelu("f32", 37, 70)
    with pytest.raises(ValueError, match="no transpose"):
        transpose_smem_template(resolve_pattern(case.graph, case.nodes))


# ----------------------------------------------------------------------------------------------
# GPU
# ----------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
@pytest.mark.parametrize("dtype,rows,cols", MATRIX, ids=[f"{d}_{r}x{c}" for d, r, c in MATRIX])
def test_tiled_transpose_on_gpu_matches_torch(dtype, rows, cols):
    from fusionstitching.bench.check import to_numpy
    from fusionstitching.runtime.kernel_call import call_generated

    case = C.relu_transpose(dtype, rows, cols)
    by_name = {p.name: t.cuda() for p, t in zip(case.graph.parameters, case.torch_inputs)}
    x, y = (by_name[p.name] for p in case.graph.parameters)
    eager = case.torch_fn(x, y)
    kernel = generate(case.graph, case.nodes, _template(case))
    tensors = [by_name[name] for name in kernel.inputs]
    poisoned = torch.full((rows, cols), float("nan"), dtype=C.TORCH_DTYPES[dtype], device="cuda")
    (got,) = call_generated(kernel, tensors, outputs=[poisoned])
    torch.cuda.synchronize()
    assert_close(to_numpy(got), _expected(case, kernel)[0], DType(dtype), False, f"{case.name} (GPU)")
    assert_close(to_numpy(got), to_numpy(eager), DType(dtype), False, f"{case.name} vs torch")
    if rows * cols >= 1 << 24:
        _print_time(kernel, case, tensors, poisoned)


def _print_time(kernel, case, tensors, out) -> None:
    """Times of the shared-memory tile and of the register-tiled default (information only)."""
    from fusionstitching.runtime.kernel_call import call_generated

    for k in (kernel, generate(case.graph, case.nodes, default_template(case.graph, case.nodes))):
        for _ in range(3):
            call_generated(k, tensors, outputs=[out])
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(20):
            call_generated(k, tensors, outputs=[out])
        stop.record()
        torch.cuda.synchronize()
        print(f"{case.name}: {start.elapsed_time(stop) / 20 * 1000:.1f} us  {k.template}")
