"""Printing a Graph as HLO-like text, and encoding it as JSON (``serialize.from_json`` decodes).

Text is for people: one line per node, ``%name = dtype[shape]{strides}+offset op(operands), attrs``,
attributes in the order of the op's schema (``ops.OPS[op].attrs``), constants shortened, parameters
in the header, then the outputs and input mutations::

    graph layernorm(%x: f32[4,8]{8,1}, %w: f32[8]) {
      %reduce = f32[4] reduce(%x), dims={1}, kind=sum
      %c = f32[] constant(0.125)
      outputs (%add_3, %reduce, none)
      mutations {0: %x}
    }

JSON is for machines and is exact: ``to_json(from_json(s)) == s``. Attributes are encoded by their
schema kind, so decoding knows what to rebuild (tuples for ``ints``, NumPy arrays for ``array``,
``DType`` for ``dtype``). Array data is a flat list in C order; every value of every dtype is exact
(bf16/f16/f32 widen to a Python float losslessly). Strict JSON has no NaN or infinity, so in typed
places (array data, ``float`` attributes) they are the strings ``"nan"``, ``"inf"``, ``"-inf"``.
A library ``call`` template is free-form JSON and is written as is; a non-finite float inside it
uses Python's ``NaN``/``Infinity`` extension tokens, which ``json.loads`` reads back.

This module only reads a graph: ``graph.py`` prints and encodes through it, and the decoder
(``serialize.py``), which builds graphs, imports ``graph.py``.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from fusionstitching.graph.ops import OPS, DType

if TYPE_CHECKING:
    from collections.abc import Sequence

    from fusionstitching.graph.node import Layout, Node


class _Graph(Protocol):
    """What printing and encoding read of a ``graph.Graph`` (which imports this module)."""

    name: str
    parameters: Sequence[Node]
    nodes: Sequence[Node]
    outputs: Sequence[Node | None]
    mutations: dict[int, int]
    output_layouts: Sequence[Layout | None]

FORMAT = "fusionstitching.graph"
VERSION = 1

_CONSTANT_FULL = 8  # constants with at most this many elements are printed in full
_CONSTANT_HEAD = 4  # values shown of a bigger constant


class GraphFormatError(ValueError):
    """A JSON graph document that does not have the expected structure; ``path`` names the field."""

    def __init__(self, path: str, message: str) -> None:
        self.path = path
        super().__init__(f"{path}: {message}" if path else message)


# ----------------------------------------------------------------------------------------------
# Text
# ----------------------------------------------------------------------------------------------


def to_text(graph: _Graph) -> str:
    params = ", ".join(f"%{p.name}: {_type(p)}" for p in graph.parameters)
    lines = [f"graph {graph.name}({params}) {{"]
    for node in graph.nodes:
        if node.op != "parameter":
            lines.append(f"  {_node_line(node)}")
    outputs = []
    for i, out in enumerate(graph.outputs):
        layout = graph.output_layouts[i] if i < len(graph.output_layouts) else None
        outputs.append(("none" if out is None else f"%{out.name}") + _layout_text(layout))
    lines.append(f"  outputs ({', '.join(outputs)})")
    if graph.mutations:
        items = ", ".join(f"{out}: %{_param_name(graph, p)}" for out, p in sorted(graph.mutations.items()))
        lines.append(f"  mutations {{{items}}}")
    lines.append("}")
    return "\n".join(lines)


def _param_name(graph: _Graph, index: int) -> str:
    return graph.parameters[index].name if 0 <= index < len(graph.parameters) else f"<parameter {index}>"


def _type(node: Node) -> str:
    dims = ",".join(str(d) for d in node.shape)
    return f"{node.dtype.value}[{dims}]{_layout_text(node.layout)}"


def _layout_text(layout: Layout | None) -> str:
    if layout is None:
        return ""
    text = "{" + ",".join(str(s) for s in layout.strides) + "}"
    return text + (f"+{layout.offset}" if layout.offset else "")


def _node_line(node: Node) -> str:
    operands = ", ".join(f"%{x.name}" for x in node.operands)
    attrs = dict(node.attrs)
    if node.op == "constant" and isinstance(attrs.get("value"), np.ndarray):
        operands = _constant_text(attrs.pop("value"))
    schema = OPS[node.op].attrs if node.op in OPS else {}
    parts = [f"{key}={_attr_text(schema[key], attrs[key])}" for key in schema if key in attrs]
    parts += [f"{key}={attrs[key]!r}" for key in attrs if key not in schema]
    tail = "".join(f", {part}" for part in parts)
    return f"%{node.name} = {_type(node)} {node.op}({operands}){tail}"


def _attr_text(kind: str, value: Any) -> str:
    if kind == "ints":
        return "{" + ",".join(str(int(v)) for v in value) + "}"
    if kind == "str":
        return value if _is_bare_word(value) else json.dumps(value)
    if kind == "float":
        return _float_text(float(value), np.dtype(np.float64))
    if kind == "bool":
        return "true" if value else "false"
    if kind == "dtype":
        return DType(value).value
    if kind == "array":
        return _constant_text(np.asarray(value))
    if kind == "call":
        return json.dumps(_plain_json(value, "call"), separators=(",", ":"))
    return str(value)


def _is_bare_word(text: str) -> bool:
    return bool(text) and all(ch.isalnum() or ch in "_.:-" for ch in text)


def _constant_text(value: np.ndarray) -> str:
    flat = value.reshape(-1)
    if value.ndim == 0:
        return _scalar_text(flat[0])
    if flat.size <= _CONSTANT_FULL:
        return "{" + ", ".join(_scalar_text(v) for v in flat) + "}"
    head = ", ".join(_scalar_text(v) for v in flat[:_CONSTANT_HEAD])
    dims = ",".join(str(d) for d in value.shape)
    return f"[{dims}] {{{head}, ...}}"


def _scalar_text(value: Any) -> str:
    if isinstance(value, (bool, np.bool_)):
        return "true" if value else "false"
    if isinstance(value, (int, np.integer)):
        return str(int(value))
    return _float_text(float(value), np.asarray(value).dtype)


def _float_text(value: float, dtype: np.dtype) -> str:
    """The shortest decimal that reads back as the same value of ``dtype`` (e.g. bf16 0.1 -> ``0.1``)."""
    if math.isnan(value):
        return "nan"
    if math.isinf(value):
        return "inf" if value > 0 else "-inf"
    if value.is_integer() and abs(value) < 1e7:
        return "-0" if value == 0 and math.copysign(1, value) < 0 else str(int(value))
    target = np.asarray(value, dtype=dtype)
    with np.errstate(over="ignore"):  # a too-short candidate may round past the dtype's max
        for digits in range(1, 18):
            text = f"{value:.{digits}g}"
            if np.asarray(float(text), dtype=dtype) == target:
                return text
    return repr(value)


# ----------------------------------------------------------------------------------------------
# JSON encoding
# ----------------------------------------------------------------------------------------------


def to_json(graph: _Graph) -> str:
    """The graph as a JSON document: one line per node, keys in a fixed order."""
    nodes = [_encode_node(node) for node in graph.nodes]
    layouts = list(graph.output_layouts) + [None] * (len(graph.outputs) - len(graph.output_layouts))
    fields = [
        ("format", FORMAT),
        ("version", VERSION),
        ("name", graph.name),
        ("nodes", nodes),
        ("parameters", [p.name for p in graph.parameters]),
        ("outputs", [None if out is None else out.name for out in graph.outputs]),
        ("mutations", {str(out): param for out, param in sorted(graph.mutations.items())}),
        ("output_layouts", [_encode_layout(layout) for layout in layouts]),
    ]
    lines = []
    for key, value in fields:
        if key == "nodes":
            body = ",\n".join(f"    {_dumps(node)}" for node in value)
            text = f"[\n{body}\n  ]" if value else "[]"
        else:
            text = _dumps(value)
        lines.append(f"  {json.dumps(key)}: {text}")
    return "{\n" + ",\n".join(lines) + "\n}\n"


def _dumps(value: Any) -> str:
    # Typed values are strict JSON already; NaN/Infinity can appear only inside a call template.
    return json.dumps(value, separators=(", ", ": "), allow_nan=True)


def _encode_node(node: Node) -> dict[str, Any]:
    info = OPS.get(node.op)
    if info is None:
        raise GraphFormatError(f"node {node.name}", f"unknown op {node.op!r}")
    extra = [key for key in node.attrs if key not in info.attrs]
    if extra:
        raise GraphFormatError(f"node {node.name}", f"attribute {extra[0]!r} is not in the schema of {node.op}")
    attrs = {}
    for key, kind in info.attrs.items():
        if key in node.attrs:
            attrs[key] = _encode_attr(kind, node.attrs[key], f"node {node.name}.attrs.{key}")
    return {
        "name": node.name,
        "op": node.op,
        "operands": [x.name for x in node.operands],
        "shape": [int(d) for d in node.shape],
        "dtype": node.dtype.value,
        "attrs": attrs,
        "layout": _encode_layout(node.layout),
    }


def _encode_layout(layout: Layout | None) -> dict[str, Any] | None:
    if layout is None:
        return None
    return {"strides": [int(s) for s in layout.strides], "offset": int(layout.offset)}


def _encode_attr(kind: str, value: Any, path: str) -> Any:
    if kind == "int":
        return int(value)
    if kind == "ints":
        return [int(v) for v in value]
    if kind == "str":
        return str(value)
    if kind == "float":
        return _encode_float(float(value))
    if kind == "bool":
        return bool(value)
    if kind == "dtype":
        return DType(value).value
    if kind == "array":
        return _encode_array(np.asarray(value))
    if kind == "call":
        return _plain_json(value, path)
    raise GraphFormatError(path, f"unknown attribute kind {kind!r}")


def _encode_float(value: float) -> float | str:
    if math.isnan(value):
        return "nan"
    if math.isinf(value):
        return "inf" if value > 0 else "-inf"
    return value


def _encode_array(array: np.ndarray) -> dict[str, Any]:
    dtype = DType.from_numpy(array.dtype)
    flat = array.reshape(-1)
    if dtype == DType.BOOL:
        data = [bool(v) for v in flat]
    elif dtype.is_float:
        data = [_encode_float(float(v)) for v in flat]
    else:
        data = [int(v) for v in flat]
    return {"dtype": dtype.value, "shape": list(array.shape), "data": data}


def _plain_json(value: Any, path: str) -> Any:
    """A call template as plain JSON values: tuples become lists, NumPy scalars Python ones."""
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, np.bool_):
        return bool(value)
    if isinstance(value, (int, np.integer)):
        return int(value)
    if isinstance(value, (float, np.floating)):
        return float(value)
    if isinstance(value, Mapping):
        out = {}
        for key, item in value.items():
            if not isinstance(key, str):
                raise GraphFormatError(path, f"call template keys must be strings, found {key!r}")
            out[key] = _plain_json(item, f"{path}.{key}")
        return out
    if isinstance(value, (list, tuple)):
        return [_plain_json(item, f"{path}[{i}]") for i, item in enumerate(value)]
    raise GraphFormatError(path, f"a call template holds only JSON values, found {type(value).__name__}")
