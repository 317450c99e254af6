"""Shrinking a failing program, and the reproducer file it is saved as.

``shrink(program, still_fails)`` is greedy delta debugging over the program's structure, in passes
repeated while one of them makes progress and the budget lasts (each try compiles the candidate):

1. drop an output (the steps only it needed go with it);
2. cut a step: give its users one of its operands of the same shape and dtype, or else a fresh input
   of its shape and dtype (what fed only that step goes); return an output's operand instead of it;
3. make an input contiguous, call the compiled function once, drop the backward, make a half-type
   program float32;
4. make each size symbol smaller (1, 2, half, one less): every shape, slice bound and index range
   follows, since shapes are symbolic (``programs.Dim``).

A candidate is kept when ``still_fails`` says it fails the same way (``check.Outcome.kind``: a
mismatch, or the same exception raised at the same function of the compiler).

``reproducer`` renders a standalone file: the program (``programs.source``), the options it was
compiled with, the failure it showed, and a ``__main__`` that compiles it with the
fusionstitching backend and prints the largest differences from eager.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterator

from fusionstitching.fuzz.check import Config, Outcome
from fusionstitching.fuzz.programs import Input, Program, live, source, used_symbols


@dataclasses.dataclass(frozen=True)
class Budget:
    """How many candidates the shrinker may check, and for how long."""

    checks: int = 40
    seconds: float = 120.0


def shrink(program: Program, still_fails: Callable[[Program], bool], budget: Budget = Budget()) -> Program:
    """The smallest program found that ``still_fails``; ``program`` itself when none is."""
    start = time.perf_counter()
    tries = 0

    def spent() -> bool:
        return tries >= budget.checks or time.perf_counter() - start > budget.seconds

    progress = True
    while progress and not spent():
        progress = False
        for candidate in _candidates(program):
            if spent():
                break
            tries += 1
            if still_fails(candidate):
                program = candidate
                progress = True
                break
    return program


def _candidates(program: Program) -> Iterator[Program]:
    """Smaller programs, roughly largest cut first; each differs from ``program`` by one change."""
    if len(program.outputs) > 1:
        for name in program.outputs:
            yield _tidy(dataclasses.replace(program, outputs=tuple(o for o in program.outputs if o != name)))
    for step in reversed(program.steps):
        same = [o for o in dict.fromkeys(step.operands)
                if program.value(o).shape == step.shape and program.value(o).dtype == step.dtype]
        for operand in same:
            yield _tidy(_renamed(program, step.name, operand))
        used = any(step.name in s.operands for s in program.steps)
        if step.name in program.outputs and not used:  # return an operand instead, whatever its shape
            computed = {s.name for s in program.steps}
            for operand in dict.fromkeys(step.operands):
                if operand in computed and operand not in same:
                    yield _tidy(_renamed(program, step.name, operand))
        if step.name not in program.outputs and step.operands:
            yield _tidy(_as_input(program, step.name))
    for item in program.inputs:
        if item.layout != "contiguous":
            changed = dataclasses.replace(item, layout="contiguous")
            yield dataclasses.replace(program, inputs=tuple(changed if i is item else i for i in program.inputs))
    if program.calls > 1:
        yield dataclasses.replace(program, calls=1)
    if program.backward:
        yield dataclasses.replace(program, backward=False)
    if program.dtype != "float32":
        yield dataclasses.replace(program, dtype="float32")
    sizes = program.size_map
    for symbol in sorted(used_symbols(program), key=lambda s: -sizes[s]):
        for smaller in sorted({1, 2, sizes[symbol] // 2, sizes[symbol] - 1}):
            if 0 < smaller < sizes[symbol]:  # never to 0: an empty tensor is a case of its own
                trial = dict(sizes, **{symbol: smaller})
                if program.valid_sizes(trial):
                    yield program.with_sizes(trial)


def _renamed(program: Program, name: str, replacement: str) -> Program:
    """The step ``name`` gone, its uses reading ``replacement`` instead."""
    steps = tuple(dataclasses.replace(s, operands=tuple(replacement if o == name else o for o in s.operands))
                  for s in program.steps if s.name != name)
    outputs = tuple(dict.fromkeys(replacement if o == name else o for o in program.outputs))
    return dataclasses.replace(program, steps=steps, outputs=outputs)


def _as_input(program: Program, name: str) -> Program:
    """The step ``name`` replaced by an input of its shape and dtype (random data of that dtype)."""
    step = next(s for s in program.steps if s.name == name)
    fresh = Input(name, step.shape, step.dtype)
    return dataclasses.replace(program, steps=tuple(s for s in program.steps if s.name != name),
                               inputs=program.inputs + (fresh,))


def _tidy(program: Program) -> Program:
    program = live(program)
    kept = used_symbols(program)
    program = dataclasses.replace(program, sizes=tuple((k, v) for k, v in program.sizes if k in kept),
                                  expect_error=any(i.out_of_range for i in program.inputs))
    if not any(i.dtype == "float" and i.index_bound is None for i in program.inputs):
        program = dataclasses.replace(program, backward=False)
    return program


def reproducer(program: Program, config: Config, outcome: Outcome, found_as: str, replay: str = "") -> str:
    """A standalone Python file that shows the failure."""
    options = config.options()
    compile_line = (f"    compiled = torch.compile(fn, backend='fusionstitching', dynamic={config.dynamic}, "
                    f"options={options!r})")
    if config.mode is not None:  # torch.compile takes a mode or options, not both
        compile_line = (f"    compiled = fusionstitching.compile(fn, fusionstitching.Options(**{options!r}), "
                        f"mode={config.mode!r}, dynamic={config.dynamic})")
    wait_line = ""
    if config.async_compile:  # the first call runs in PyTorch while the graphs compile
        wait_line = "    _run(compiled)\n    fusionstitching.backend.wait_for_compiles(300)\n"
    header = (f'"""fusionstitching fuzz reproducer: program {found_as} ({config}), shrunk to '
              f'{len(program.steps)} ops.\n\n{outcome.report()}\n\nReplay the unshrunk program: '
              f'{replay or "fusionstitching fuzz --replay " + found_as}\n"""\n')
    main = f'''

def _run(f):
    args = [t.detach().requires_grad_({program.backward} and t.is_floating_point()) for t in make_inputs()]
    outputs = f(*args)
    differentiable = [o for o in outputs if o.requires_grad]
    if not differentiable:
        return list(outputs), []
    generator = torch.Generator().manual_seed({program.data_seed + 1})
    tangents = [torch.randn(tuple(o.shape), generator=generator).to(o.dtype) for o in differentiable]
    wrt = [a for a in args if a.requires_grad]
    return list(outputs), list(torch.autograd.grad(differentiable, wrt, tangents, allow_unused=True))


if __name__ == "__main__":
    import fusionstitching  # noqa: F401  (registers the backend)

{compile_line}
    want_outputs, want_grads = _run(fn)
{wait_line}    for call in range({program.calls if config.mode is None else max(program.calls, 3)}):
        got_outputs, got_grads = _run(compiled)
        for label, got, want in [("output", g, w) for g, w in zip(got_outputs, want_outputs)] + \\
                [("gradient", g, w) for g, w in zip(got_grads, want_grads)]:
            if got is None or want is None:
                print(label, "none" if got is None else "", "/", "none" if want is None else "")
                continue
            difference = (got.double() - want.double()).abs().max().item() if want.numel() else 0.0
            print(f"call {{call + 1}}:", label, tuple(want.shape), want.dtype, "largest difference from eager:",
                  difference)
'''
    return header + source(program) + main
