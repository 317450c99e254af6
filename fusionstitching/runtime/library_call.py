"""A library node's call written out as one Python function, from its call template.

A library node records how eager called its op (``frontend/torch_fx.py``): the positional and
keyword arguments as a template in which ``{"operand": k, ...}`` stands for the node's operand
``k``, laid out as traced (permuted from the graph's layout where ``"permute"`` says, copied to the
traced strides where they differ, moved to the host where ``"host"`` says), ``{"dtype": ...}`` for
a torch dtype, and everything else for itself. ``library_function`` reads the template once and
writes the call out as source:

    def library_op(a0, a1):
        o0 = a0.permute((0, 3, 1, 2))
        if o0.stride() != _c1:
            o0 = _restride(o0, _c1)
        ...
        r = _target(o0, o1, None, _c4, _c5, _c6, False, _c7, 1)
        return _result(_call, r)

so that a call builds nothing but its operands: constant parts of the arguments (sizes, strides,
flags, dtypes, nested lists without operands) are built once and shared by every call, and no
argument list is walked at call time. A training step of a convolutional network makes a hundred
such calls. The op runs under ``torch.no_grad`` where grad mode is on (a graph's own values need
no autograd history); under AOTAutograd's compiled functions it is off, and no context is entered.
"""

from __future__ import annotations

import itertools
import keyword
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from fusionstitching.graph import reference


def library_function(call: Mapping, target: Callable[..., Any], operands: int, index: int = -1,
                     siblings: Sequence[int] = (), fill: Any = None,
                     transposed: Mapping[int, tuple[int, ...]] | None = None) -> Callable[..., Any]:
    """The call of ``target`` that ``call`` (a library node's ``attrs["call"]``) describes, as a
    function of the node's ``operands`` operands. ``index``: the node's ``out_index`` (-1: the whole
    result); ``siblings``: the output indices a multi-output step returns (a list); ``fill``: a scalar
    whose new filled tensor replaces operand 0, passed as it is (``executor._filled_destination``).

    ``transposed``: operands the caller would pass as ``x.permute(p)`` of a tensor ``x`` it has.
    Where the call permutes such an operand back (every place of it in the template permutes by the
    inverse of ``p``: a channels-last convolution's operand held NCHW by its parameter), the function
    takes ``x`` itself and permutes nothing; its ``undone`` attribute names those operands."""
    return _written(call, target, operands, index, siblings, fill, transposed)[0]


def _written(call: Mapping, target: Callable[..., Any], operands: int, index: int, siblings: Sequence[int],
             fill: Any, transposed: Mapping[int, tuple[int, ...]] | None = None) -> tuple[Callable[..., Any], str]:
    import torch

    raw = (0,) if fill is not None else ()
    undone = frozenset(k for k, permutation in (transposed or {}).items()
                       if k not in raw and _permuted_back(call, k, permutation))
    writer = _Writer(raw=raw, undone=undone)
    positional = [writer.expression(part) for part in call.get("args", [])]
    keywords = {key: writer.expression(part) for key, part in call.get("kwargs", {}).items()}
    lines = list(writer.lines)
    if fill is not None:  # a new filled tensor, put into in place: no copy of a broadcast
        value = writer.constant(fill)
        lines.append(f"    {positional[0]} = _full({positional[0]}.shape, {value}, dtype={positional[0]}.dtype, "
                     f"device={positional[0]}.device)")
    arguments = list(positional)
    plain = all(key.isidentifier() and not keyword.iskeyword(key) for key in keywords)
    if plain:
        arguments += [f"{key}={value}" for key, value in keywords.items()]
    elif keywords:
        arguments.append("**{" + ", ".join(f"{key!r}: {value}" for key, value in keywords.items()) + "}")
    invoke = f"_target({', '.join(arguments)})"
    lines += ["    if _grad_enabled():",
              "        with _no_grad():",
              f"            r = {invoke}",
              "    else:",
              f"        r = {invoke}"]
    if call.get("permute_result") is not None:
        lines.append("    r = _result(_call, r)")
    siblings = list(siblings) or [index]
    if index < 0:
        lines.append("    return r")
    elif len(siblings) == 1:
        lines.append(f"    return r[{index}]")
    else:
        lines.append(f"    return [{', '.join(f'r[{k}]' for k in siblings)}]")
    parameters = ", ".join(f"a{k}" for k in range(operands))
    source = f"def library_op({parameters}):\n" + "\n".join(lines) + "\n"
    namespace = {**writer.constants, "_target": _direct(target), "_call": call,
                 "_grad_enabled": torch.is_grad_enabled, "_no_grad": torch.no_grad, "_full": torch.full,
                 "_restride": reference.traced_layout, "_result": reference.library_result}
    exec(compile(source, "<fusionstitching library call>", "exec"), namespace)  # noqa: S102 (written above)
    function = namespace["library_op"]
    function.undone = undone
    return function, source


def _permuted_back(call: Mapping, k: int, permutation: tuple[int, ...]) -> bool:
    """Whether every place of operand ``k`` in ``call``'s template permutes it by the inverse of
    ``permutation`` (``x.permute(permutation).permute(back)`` is ``x``)."""
    places = list(_places(call, k))
    return bool(places) and all(
        "permute" in place and len(place["permute"]) == len(permutation)
        and all(permutation[back] == i for i, back in enumerate(place["permute"])) for place in places)


def _places(template: Any, k: int) -> Any:
    """The operand templates of operand ``k`` in ``template``."""
    if isinstance(template, Mapping):
        if template.get("operand") == k and "operand" in template:
            yield template
        elif "operand" not in template:
            for value in template.values():
                yield from _places(value, k)
    elif isinstance(template, (list, tuple)):
        for value in template:
            yield from _places(value, k)


class _Writer:
    """Expressions for a template's parts: operands as locals made by ``lines``, constant parts as
    names bound to values built once (``constants``)."""

    def __init__(self, raw: Sequence[int], undone: frozenset[int] = frozenset()) -> None:
        self.raw = set(raw)
        self.undone = undone  # operands passed untransposed: no permute back (``_permuted_back``)
        self.lines: list[str] = []
        self.constants: dict[str, Any] = {}
        self._names = itertools.count()

    def constant(self, value: Any) -> str:
        if value is None or isinstance(value, bool) or (isinstance(value, int) and abs(value) < 2**31):
            return repr(value)
        name = f"_c{next(self._names)}"
        self.constants[name] = value
        return name

    def expression(self, template: Any) -> str:
        code, constant, value = self._part(template)
        return self.constant(value) if constant else code

    def _part(self, template: Any) -> tuple[str, bool, Any]:
        """(code, whether constant, the value where constant)."""
        from fusionstitching.graph.ops import DType
        from fusionstitching.graph.torch_dtypes import DTYPE_TO_TORCH

        if isinstance(template, Mapping):
            if "operand" in template:
                return self._operand(template), False, None
            if set(template) == {"dtype"}:
                return "", True, DTYPE_TO_TORCH[DType(template["dtype"])]
            parts = {key: self._part(value) for key, value in template.items()}
            if all(constant for _, constant, _ in parts.values()):
                return "", True, {key: value for key, (_, _, value) in parts.items()}
            items = ", ".join(f"{key!r}: {self._code(part)}" for key, part in parts.items())
            return "{" + items + "}", False, None
        if isinstance(template, (list, tuple)):
            parts = [self._part(value) for value in template]
            if all(constant for _, constant, _ in parts):
                return "", True, type(template)(value for _, _, value in parts)
            items = ", ".join(self._code(part) for part in parts)
            return (f"[{items}]" if isinstance(template, list) else f"({items},)"), False, None
        return "", True, template

    def _code(self, part: tuple[str, bool, Any]) -> str:
        code, constant, value = part
        return self.constant(value) if constant else code

    def _operand(self, template: Mapping) -> str:
        k = template["operand"]
        if k in self.raw:
            return f"a{k}"
        name = f"o{next(self._names)}"
        self.lines.append(f"    {name} = a{k}")
        if template.get("host"):  # traced on the host: passed there (reference.library_operand)
            self.lines.append(f"    if {name}.device.type != 'cpu':")
            self.lines.append(f"        {name} = {name}.cpu()")
        if "permute" in template and k not in self.undone:  # held permuted by the graph (graph/layout.py): a view
            self.lines.append(f"    {name} = {name}.permute({tuple(template['permute'])!r})")
        if template.get("strides") is not None:
            strides = self.constant(tuple(template["strides"]))
            self.lines.append(f"    if {name}.stride() != {strides}:")
            self.lines.append(f"        {name} = _restride({name}, {strides})")
        return name


def _direct(target: Callable[..., Any]) -> Callable[..., Any]:
    """The C++ operator an ``OpOverload`` calls, where its ``__call__`` only forwards to it (not a
    TorchBind overload's, which converts script objects first): one Python frame less per call."""
    import torch

    overload = getattr(torch, "_ops", None) and getattr(torch._ops, "OpOverload", None)
    if overload is not None and isinstance(target, overload) \
            and type(target).__call__ is overload.__call__ and callable(getattr(target, "_op", None)):
        return target._op
    return target
