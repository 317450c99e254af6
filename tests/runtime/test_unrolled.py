"""A GpuProgram written out as one function (``runtime/unrolled.py``) launches what its loop launches.

On a CPU the kernels cannot run: each kernel's launcher is a stand-in whose driver call records
the kernel and the pointers in its prepacked arguments. The loop and the unrolled function run the
same program on the same inputs; their launches, pointer for pointer (fresh allocations numbered
in order of first appearance), and their outputs must agree. ``tests/runtime/test_executor.py``
checks the unrolled path's values on a GPU.
"""

from __future__ import annotations

import ctypes

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fusionstitching.cli import capture_workload
from fusionstitching.fusion import explore
from fusionstitching.graph.graph import GraphBuilder
from fusionstitching.graph.ops import DType
from fusionstitching.pipeline import compile_plan
from fusionstitching.runtime import unrolled
from fusionstitching.runtime.executor import _library_function
from fusionstitching.runtime.launch import CudaError, LoadedKernel
from fusionstitching.runtime.program import GpuProgram, KernelOp


class Recorder:
    """The driver's launch: records (kernel name, its argument pointers), returns ``error``."""

    def __init__(self) -> None:
        self.launchers: dict[int, LoadedKernel] = {}
        self.launches: list[tuple[str, tuple[int, ...]]] = []
        self.error = 0

    def __call__(self, function, *args) -> int:
        function = function.value if isinstance(function, ctypes.c_void_p) else function
        launcher = self.launchers[function]
        self.launches.append((launcher.name, tuple(launcher._values[: launcher.num_params])))
        return self.error


def _program(graph, recorder: Recorder) -> GpuProgram:
    """``graph``'s program on the CPU, every kernel's launcher a stand-in of ``recorder``."""
    compiled = compile_plan(explore(graph))
    program = GpuProgram(compiled.graph, compiled.steps, torch.device("cpu"), compiled._constant, _library_function)
    for op in program.ops:
        if isinstance(op, KernelOp):
            ir = op.kernel.lowered.kernel
            launcher = LoadedKernel(b"", ir.name, len(ir.params), ir.blocks, ir.threads)
            launcher._function = 0x1000 + 16 * len(recorder.launchers)
            launcher._launch = recorder
            recorder.launchers[launcher._function] = launcher
            op.launcher = launcher
    return program


def _tensors(graph, seed: int) -> list[torch.Tensor]:
    rng = np.random.default_rng(seed)
    tensors = []
    for p in graph.parameters:
        if p.dtype.is_float:
            tensors.append(torch.from_numpy(np.asarray(rng.random(p.shape), dtype=np.float32)).to(
                getattr(torch, {"bf16": "bfloat16", "f16": "float16"}.get(p.dtype.value, "float32"))))
        else:
            tensors.append(torch.from_numpy(np.asarray(rng.integers(0, 2, p.shape), dtype=p.dtype.numpy)))
    return tensors


def _canonical(launches, outputs, known: dict[int, str]):
    """Launches and outputs with every pointer named: ``known`` ones by name, the others in order
    of first appearance."""
    names = dict(known)

    def name(pointer: int) -> str:
        if pointer not in names:
            names[pointer] = f"new{len(names) - len(known)}"
        return names[pointer]

    steps = [(kernel, tuple(name(p) for p in pointers)) for kernel, pointers in launches]
    results = [None if t is None else (name(t.data_ptr()), tuple(t.shape), t.stride()) for t in outputs]
    return steps, results


def _known(program: GpuProgram, tensors) -> dict[int, str]:
    known = {t.data_ptr(): f"input{k}" for k, t in enumerate(tensors)}
    for op in program.ops:
        if isinstance(op, KernelOp):
            for slot, buffer in zip(op.out_slots, op.buffers):
                if buffer is not None:
                    known.setdefault(buffer.data_ptr(), f"kept{slot}")
    for slot, value in program.constants:
        if isinstance(value, torch.Tensor):
            known.setdefault(value.data_ptr(), f"constant{slot}")
    return known


def _graphs():
    _, bert = capture_workload("bert")
    _, adam = capture_workload("adam_step")
    b = GraphBuilder("split_sum")  # a kernel reads a reshape of its input (made contiguous)
    x = b.parameter((4096, 512), DType.F32, "x")
    split = b.build([b.reduce(x, (0,), "sum"), b.unary("neg", x)])
    return {"bert": bert.forward, "adam": adam.forward, "split_sum": split}


@pytest.mark.parametrize("name", ["bert", "adam", "split_sum"])
def test_the_unrolled_function_launches_what_the_loop_launches(name):
    graph = _graphs()[name]
    recorder = Recorder()
    program = _program(graph, recorder)
    first = _tensors(graph, 0)
    program.run(first)  # the lean loop's first call allocates the kept buffers
    assert unrolled.ready(program)
    run, source = unrolled.unroll(program, recorder)
    assert source.count("_launch(") == sum(isinstance(op, KernelOp) for op in program.ops)
    kept = sum(k for op in program.ops if isinstance(op, KernelOp) for k in op.kept)
    assert source.count("alloc(") == sum(len(op.kept) for op in program.ops if isinstance(op, KernelOp)) - kept \
        - sum(spec.alias >= 0 for op in program.ops if isinstance(op, KernelOp) for spec in op.outputs)
    alloc = lambda shape, strides, dtype: torch.empty_strided(shape, strides, dtype=dtype)
    for seed in (1, 2):  # new inputs, then the same ones again (pointers equal to the last launch's)
        if seed == 1:
            tensors = _tensors(graph, seed)
            if name == "split_sum":  # transposed storage: the reshape's reader takes a contiguous copy
                tensors = [t.t().contiguous().t() for t in tensors]
        recorder.launches.clear()
        looped = program.run(tensors)
        loop = _canonical(recorder.launches, looped, _known(program, tensors))
        recorder.launches.clear()
        got = run(tensors, ctypes.c_void_p(None), alloc)
        assert _canonical(recorder.launches, got, _known(program, tensors)) == loop
        assert len(recorder.launches) == source.count("_launch(")


SQUARE = (64, 64)


@st.composite
def _programs(draw):
    """1-3 parameters of SQUARE, then 2-9 steps: exp, a binary op, a row sum broadcast back, a
    transpose or a reshape round trip (views), a GEMM (a library call); outputs: the last value,
    and up to three others (views among them: outputs that are views of kernel outputs)."""
    b = GraphBuilder("random_program")
    values = [b.parameter(SQUARE, DType.F32, f"p{i}") for i in range(draw(st.integers(1, 3)))]
    for _ in range(draw(st.integers(2, 9))):
        kind = draw(st.sampled_from(["exp", "binary", "reduce", "transpose", "reshape", "dot"]))
        x = draw(st.sampled_from(values))
        if kind == "exp":
            values.append(b.unary("exp", b.unary("neg", x)))
        elif kind == "binary":
            values.append(b.binary(draw(st.sampled_from(["add", "mul", "max"])), x, draw(st.sampled_from(values))))
        elif kind == "reduce":
            values.append(b.broadcast(b.reduce(x, (1,), "sum"), SQUARE, (0,)))
        elif kind == "transpose":
            values.append(b.transpose(x, (1, 0)))
        elif kind == "reshape":
            values.append(b.reshape(b.reshape(x, (32, 128)), SQUARE))
        else:
            y = draw(st.sampled_from(values))
            values.append(b.node("dot_general", [x, y], lhs_batch=(), rhs_batch=(), lhs_contract=(1,),
                                 rhs_contract=(0,)))
    computed = [v for v in values if v.op != "parameter"]
    outputs = [computed[-1]] + [v for v in draw(st.lists(st.sampled_from(computed), max_size=3, unique_by=id))
                                if v is not computed[-1]]
    return b.build(outputs)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(graph=_programs())
def test_random_programs_launch_the_same_unrolled_as_looped(graph):
    recorder = Recorder()
    program = _program(graph, recorder)
    rng = np.random.default_rng(0)
    tensors = [torch.from_numpy(rng.random(p.shape, dtype=np.float32)) for p in graph.parameters]
    program.run(tensors)
    assert unrolled.ready(program)
    run, _ = unrolled.unroll(program, recorder)
    alloc = lambda shape, strides, dtype: torch.empty_strided(shape, strides, dtype=dtype)
    for fresh in (False, True):
        if fresh:
            tensors = [t.clone() for t in tensors]
        recorder.launches.clear()
        looped = program.run(tensors)
        loop = _canonical(recorder.launches, looped, _known(program, tensors))
        recorder.launches.clear()
        got = run(tensors, ctypes.c_void_p(None), alloc)
        assert _canonical(recorder.launches, got, _known(program, tensors)) == loop, str(graph)


def test_a_misaligned_pointer_runs_the_scalar_variant():
    b = GraphBuilder("vectors")
    x = b.parameter((4096,), DType.F32, "x")
    graph = b.build([b.binary("mul", b.unary("exp", x), x)])
    recorder = Recorder()
    program = _program(graph, recorder)
    (op,) = program.ops
    assert op.has_scalar_variant
    taken = []
    op.misaligned = lambda inputs, outputs: taken.append((inputs[0].data_ptr(), outputs[0].shape))
    aligned = torch.rand(4096)
    program.run([aligned])
    run, _ = unrolled.unroll(program, recorder)
    alloc = lambda shape, strides, dtype: torch.empty_strided(shape, strides, dtype=dtype)
    recorder.launches.clear()
    run([aligned], ctypes.c_void_p(None), alloc)
    assert len(recorder.launches) == 1 and not taken
    shifted = torch.rand(4097)[1:]  # 4 bytes past an aligned start
    run([shifted], ctypes.c_void_p(None), alloc)
    assert len(recorder.launches) == 1 and taken == [(shifted.data_ptr(), (4096,))]
    run([aligned], ctypes.c_void_p(None), alloc)  # the aligned pointers were never packed over
    assert len(recorder.launches) == 2 and recorder.launches[1][1][1] == aligned.data_ptr()


def test_a_failed_launch_names_the_kernel():
    b = GraphBuilder("failing")
    x = b.parameter((256,), DType.F32, "x")
    graph = b.build([b.unary("exp", x)])
    recorder = Recorder()
    program = _program(graph, recorder)
    program.run([torch.rand(256)])
    run, _ = unrolled.unroll(program, recorder)
    recorder.error = 700
    with pytest.raises(CudaError, match=f"cuLaunchKernel\\({program.ops[0].kernel.name}\\)"):
        run([torch.rand(256)], ctypes.c_void_p(None), lambda s, st, d: torch.empty_strided(s, st, dtype=d))


def test_a_program_is_not_ready_before_its_kept_buffers_exist():
    graph = _graphs()["bert"]
    recorder = Recorder()
    program = _program(graph, recorder)
    assert any(any(op.kept) for op in program.ops if isinstance(op, KernelOp))
    assert not unrolled.ready(program)
    program.run(_tensors(graph, 0))
    assert unrolled.ready(program)
    next(op for op in program.ops if isinstance(op, KernelOp)).launcher = None  # a kernel not loaded
    assert not unrolled.ready(program)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_the_unrolled_program_on_a_gpu_takes_misaligned_and_moved_inputs():
    b = GraphBuilder("vectors_gpu")
    x = b.parameter((4096,), DType.F32, "x")
    y = b.binary("mul", b.unary("exp", x), x)
    graph = b.build([y, b.reduce(y, (0,), "sum")])
    compiled = compile_plan(explore(graph))
    base = torch.rand(4097, device="cuda")
    inputs = [base[:4096], base[:4096], base[:4096].clone(), base[1:], base[:4096], torch.rand(4096, device="cuda")]
    for call, t in enumerate(inputs):
        product, total = compiled.run([t], trusted=True)
        want = torch.exp(t) * t
        torch.testing.assert_close(product, want, rtol=1e-5, atol=1e-6, msg=f"call {call}")
        torch.testing.assert_close(total, want.sum(), rtol=1e-4, atol=1e-3, msg=f"call {call}")
    (program,) = compiled._programs.values()
    assert program.unrolled is not None


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_program_under_unroll_false_keeps_its_loop():
    from fusionstitching.options import Options

    b = GraphBuilder("looped_gpu")
    x = b.parameter((4096,), DType.F32, "x")
    graph = b.build([b.binary("mul", b.unary("exp", x), x)])
    compiled = compile_plan(explore(graph), options=Options(unroll=False))
    t = torch.rand(4096, device="cuda")
    for _ in range(4):
        torch.testing.assert_close(compiled.run([t], trusted=True)[0], torch.exp(t) * t)
    (program,) = compiled._programs.values()
    assert program.unrolled is None and not program.unroll


def test_the_bench_system_without_unrolling_compiles_with_unroll_false(monkeypatch):
    from fusionstitching.bench import suite

    seen = {}
    monkeypatch.setattr(torch, "compile", lambda fn, backend=None, options=None: seen.update(options or {}) or fn)
    suite._compiled(suite.make_case("layernorm", small=True), "fusionstitching-loop")
    assert seen == {"unroll": False}
