"""A GpuProgram's steps written out as one straight-line Python function.

Once every kernel of a program is loaded and every buffer it keeps between calls exists, nothing
that ``GpuProgram.run``'s loop decides per op changes from one call to the next: which slot feeds
which op, which outputs are allocated and which are kept buffers, the kernel's grid and function.
``unroll`` then writes the program out as Python source, one block per step, and compiles it
once, as Inductor's generated wrapper does. A call of the function

- holds each value in a local variable (no slot list), and the kept buffers, their pointers and
  the views folded into library calls that read them as constants of the function;
- allocates only the outputs that leave the call;
- for a kernel, builds the list of its pointers, compares it with the launcher's last list (one C
  comparison; equal in the steady state wherever the allocator hands the same addresses back) and
  rewrites the prepacked argument array only where it differs, then calls ``cuLaunchKernel`` with
  arguments converted once (``driver.Driver.launch_raw``);
- runs a kernel with 16-byte vector accesses through its scalar variant when a pointer is
  misaligned (``KernelOp.misaligned``), as the loop does.

What the loop does per op (an indexed slot list, a method call, a loop over outputs and over
pointers, argument conversion by ``argtypes``) costs microseconds of host time per kernel, and a
training step of a convolutional network runs hundreds of kernels. ``GpuProgram`` keeps its loop
for the calls that are not settled: the first two calls (module loading, checks, kept buffers
allocated), a tuning call, and any call after the program's kernels changed.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fusionstitching.runtime.launch import CudaError

_ALIGNMENT = 16


def ready(program: Any) -> bool:
    """Whether every kernel of ``program`` has a loaded launcher and every kept buffer exists."""
    for op in program.ops:
        if op.kind == "kernel":
            launcher = op.launcher
            if launcher is None or launcher._function is None:
                return False
            if any(keep and buffer is None for keep, buffer in zip(op.kept, op.buffers)):
                return False
    return True


def unroll(program: Any, launch: Callable[..., int]) -> tuple[Callable[..., list[Any]], str]:
    """``program``'s run as one function ``run(tensors, stream, alloc)`` and its source.

    ``tensors``: the program's inputs; ``stream``: the raw stream as a ``ctypes.c_void_p``;
    ``alloc(shape, strides, dtype)``: a new tensor on the program's device. ``launch``: the driver's
    ``cuLaunchKernel`` taking converted arguments (a test passes a recorder). Call only when
    ``ready(program)``."""
    import ctypes

    constants: dict[str, Any] = {"_launch": launch, "_fail": _fail}
    slot_constants = dict(program.constants)
    for op in program.ops:
        if op.kind == "kernel":
            for slot, keep, buffer in zip(op.out_slots, op.kept, op.buffers):
                if keep:
                    slot_constants[slot] = buffer
    for slot, value in slot_constants.items():
        constants[f"v{slot}"] = value

    def constant(value: Any, stem: str) -> str:
        name = f"_{stem}{len(constants)}"
        constants[name] = value
        return name

    parameters = len(program.graph.parameters)
    lines = ["def run(tensors, stream, alloc):"]
    if parameters:
        names = ", ".join(f"v{k}" for k in range(parameters))
        lines.append(f"    {names}{',' if parameters == 1 else ''} = tensors")
    for index, op in enumerate(program.ops):
        if op.kind == "kernel":
            lines += _kernel_lines(op, index, slot_constants, constant, ctypes)
        else:
            lines += _call_lines(op, index, slot_constants, constant)
    outputs = ", ".join("None" if k is None else f"v{k}" for k in program.output_slots)
    lines.append(f"    return [{outputs}]")
    source = "\n".join(lines) + "\n"
    code = compile(source, f"<fusionstitching program {program.graph.name}>", "exec")
    namespace = dict(constants)
    exec(code, namespace)  # noqa: S102 (source written above from the program's own structure)
    return namespace["run"], source


def _kernel_lines(op: Any, index: int, slot_constants: dict[int, Any], constant: Callable[[Any, str], str],
                  ctypes: Any) -> list[str]:
    launcher = op.launcher
    lines = [f"    # {index}: kernel {op.kernel.name}"]
    inputs, pointers = [], []
    for k, slot in enumerate(op.in_slots):
        fixed = slot_constants.get(slot)
        if fixed is not None:  # a constant or a kept buffer: its pointer never changes
            if k in op.contiguous and not fixed.is_contiguous():
                fixed = fixed.contiguous()
            inputs.append(constant(fixed, "input"))
            pointers.append(str(fixed.data_ptr()))
            continue
        name = f"v{slot}"
        if k in op.contiguous:
            lines.append(f"    i{k} = {name} if {name}.is_contiguous() else {name}.contiguous()")
            name = f"i{k}"
        inputs.append(name)
        pointers.append(f"{name}.data_ptr()")
    outputs, out_pointers = [], []
    for slot, spec, keep in zip(op.out_slots, op.outputs, op.kept):
        name = f"v{slot}"
        if spec.alias >= 0:
            lines.append(f"    {name} = {inputs[spec.alias]}")
            out_pointers.append(pointers[spec.alias])
        elif keep:
            out_pointers.append(str(slot_constants[slot].data_ptr()))
        else:
            lines.append(f"    {name} = alloc({spec.shape!r}, {spec.strides!r}, {constant(spec.dtype, 'dtype')})")
            out_pointers.append(f"{name}.data_ptr()")
        outputs.append(name)
    last = constant(launcher._last, "last")
    repack = constant(launcher.repack, "repack")
    function = constant(ctypes.c_void_p(launcher._function), "function")
    params = constant(ctypes.c_void_p(launcher._params_addr or None), "params")
    alignment = _ALIGNMENT if op.has_scalar_variant else 0
    call = constant(f"cuLaunchKernel({launcher.name})", "name")
    lines += [
        f"    p = [{', '.join(out_pointers + pointers)}]",
        f"    if p == {last} or {repack}(p, {alignment}):",
        (f"        e = _launch({function}, {launcher.blocks}, 1, 1, {launcher.threads}, 1, 1, "
         f"{launcher.dynamic_smem}, stream, {params}, None)"),
        "        if e:",
        f"            _fail({call}, e)",
    ]
    if alignment:
        misaligned = constant(op.misaligned, "misaligned")
        lines += ["    else:",
                  f"        {misaligned}([{', '.join(inputs)}], [{', '.join(outputs)}])"]
    return lines


def _call_lines(op: Any, index: int, slot_constants: dict[int, Any], constant: Callable[[Any, str], str]) -> list[str]:
    fn = constant(op.fn, "call")
    args = []
    for k, slot in enumerate(op.in_slots):
        view = op.views[k] if op.views is not None else None
        if view is None:
            args.append(f"v{slot}")
        elif slot in slot_constants and op.stable[k]:  # a view of a kept buffer: made once
            args.append(constant(view(slot_constants[slot]), "view"))
        else:
            args.append(f"{constant(view, 'view')}(v{slot})")
    call = f"{fn}({', '.join(args)})"
    lines = [f"    # {index}: {op.label}"]
    if isinstance(op.out_slot, int):
        lines.append(f"    v{op.out_slot} = {call}")
    else:
        lines.append(f"    r = {call}")
        lines += [f"    v{slot} = r[{k}]" for k, slot in enumerate(op.out_slot)]
    return lines


def _fail(call: str, code: int) -> None:
    raise CudaError(call, code)
