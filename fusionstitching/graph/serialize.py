"""The JSON round trip of a Graph: ``to_json`` (encoding, in ``text.py`` with the printer) and
``from_json``, which decodes and rebuilds the graph.

Decoding checks the document's structure and names the failing field by its path
(``nodes[3].shape: expected a list of ints, found "abc"``); the rebuilt graph then goes through
``graph.verify``, whose ``VerifyError`` names the offending node.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from fusionstitching.graph.graph import Graph, Layout, Node, verify
from fusionstitching.graph.ops import OPS, DType
from fusionstitching.graph.text import FORMAT, VERSION, GraphFormatError, to_json, to_text

__all__ = ["FORMAT", "VERSION", "GraphFormatError", "from_json", "to_json", "to_text"]

_NONFINITE = {"nan": math.nan, "inf": math.inf, "-inf": -math.inf}


# ----------------------------------------------------------------------------------------------
# JSON decoding
# ----------------------------------------------------------------------------------------------

_TOP_FIELDS = ("format", "version", "name", "nodes", "parameters", "outputs", "mutations", "output_layouts")
_NODE_FIELDS = ("name", "op", "operands", "shape", "dtype", "attrs", "layout")
_OPTIONAL_TOP = {"mutations": {}, "output_layouts": None}
_OPTIONAL_NODE = {"attrs": {}, "layout": None}


def from_json(text: str) -> Graph:
    """Rebuild a graph from ``to_json`` output; structural errors raise ``GraphFormatError``."""
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as err:
        raise GraphFormatError("", f"invalid JSON at line {err.lineno}, column {err.colno}: {err.msg}") from None
    fields = _fields(doc, "", _TOP_FIELDS, _OPTIONAL_TOP, what="a JSON object at the top level")
    if fields["format"] != FORMAT:
        raise GraphFormatError("format", f"expected {FORMAT!r}, found {_show(fields['format'])}")
    if fields["version"] != VERSION:
        raise GraphFormatError("version", f"expected {VERSION}, found {_show(fields['version'])}")
    name = _expect_str(fields["name"], "name")

    by_name: dict[str, Node] = {}
    for i, item in enumerate(_expect_list(fields["nodes"], "nodes")):
        node = _decode_node(item, f"nodes[{i}]", by_name)
        by_name[node.name] = node

    parameters = [
        _lookup(entry, f"parameters[{i}]", by_name)
        for i, entry in enumerate(_expect_list(fields["parameters"], "parameters"))
    ]
    outputs = [
        None if entry is None else _lookup(entry, f"outputs[{i}]", by_name)
        for i, entry in enumerate(_expect_list(fields["outputs"], "outputs"))
    ]
    mutations = _decode_mutations(fields["mutations"], len(outputs), len(parameters))
    output_layouts = None
    if fields["output_layouts"] is not None:
        entries = _expect_list(fields["output_layouts"], "output_layouts")
        if len(entries) != len(outputs):
            raise GraphFormatError(
                "output_layouts", f"expected {len(outputs)} entries (one per output), found {len(entries)}"
            )
        output_layouts = [_decode_layout(entry, f"output_layouts[{i}]") for i, entry in enumerate(entries)]

    graph = Graph(parameters, outputs, name=name, mutations=mutations, output_layouts=output_layouts)
    verify(graph)
    return graph


def _fields(value: Any, path: str, names: Sequence[str], optional: Mapping[str, Any], what: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise GraphFormatError(path, f"expected {what}, found {_show(value)}")
    for key in value:
        if key not in names:
            raise GraphFormatError(_join(path, key), "unknown field")
    out = {}
    for key in names:
        if key in value:
            out[key] = value[key]
        elif key in optional:
            out[key] = optional[key]
        else:
            raise GraphFormatError(_join(path, key), "missing")
    return out


def _decode_node(item: Any, path: str, by_name: Mapping[str, Node]) -> Node:
    fields = _fields(item, path, _NODE_FIELDS, _OPTIONAL_NODE, what="a node object")
    name = _expect_str(fields["name"], f"{path}.name")
    if not name:
        raise GraphFormatError(f"{path}.name", "expected a non-empty string")
    if name in by_name:
        raise GraphFormatError(f"{path}.name", f"duplicate node name {name!r}")
    op = _expect_str(fields["op"], f"{path}.op")
    if op not in OPS:
        raise GraphFormatError(f"{path}.op", f"unknown op {op!r}")
    operands = tuple(
        _lookup(entry, f"{path}.operands[{i}]", by_name)
        for i, entry in enumerate(_expect_list(fields["operands"], f"{path}.operands"))
    )
    shape = _expect_ints(fields["shape"], f"{path}.shape")
    if any(d < 0 for d in shape):
        raise GraphFormatError(f"{path}.shape", f"dims must be >= 0, found {list(shape)}")
    dtype = _decode_dtype(fields["dtype"], f"{path}.dtype")
    attrs = _decode_attrs(op, fields["attrs"], f"{path}.attrs")
    layout = _decode_layout(fields["layout"], f"{path}.layout")
    return Node(name, op, operands, shape, dtype, attrs, layout)


def _decode_attrs(op: str, value: Any, path: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise GraphFormatError(path, f"expected an object, found {_show(value)}")
    schema = OPS[op].attrs
    for key in value:
        if key not in schema:
            raise GraphFormatError(f"{path}.{key}", f"unknown attribute of {op}")
    attrs = {}
    for key, kind in schema.items():
        if key not in value:
            raise GraphFormatError(f"{path}.{key}", "missing")
        attrs[key] = _decode_attr(kind, value[key], f"{path}.{key}")
    return attrs


def _decode_attr(kind: str, value: Any, path: str) -> Any:
    if kind == "int":
        return _expect_int(value, path)
    if kind == "ints":
        return _expect_ints(value, path)
    if kind == "str":
        return _expect_str(value, path)
    if kind == "float":
        return _expect_float(value, path)
    if kind == "bool":
        if not isinstance(value, bool):
            raise GraphFormatError(path, f"expected true or false, found {_show(value)}")
        return value
    if kind == "dtype":
        return _decode_dtype(value, path)
    if kind == "array":
        return _decode_array(value, path)
    if kind == "call":
        return value
    raise GraphFormatError(path, f"unknown attribute kind {kind!r}")


def _decode_array(value: Any, path: str) -> np.ndarray:
    fields = _fields(value, path, ("dtype", "shape", "data"), {}, what="an array object {dtype, shape, data}")
    dtype = _decode_dtype(fields["dtype"], f"{path}.dtype")
    shape = _expect_ints(fields["shape"], f"{path}.shape")
    data = _expect_list(fields["data"], f"{path}.data")
    if any(d < 0 for d in shape):
        raise GraphFormatError(f"{path}.shape", f"dims must be >= 0, found {list(shape)}")
    if len(data) != math.prod(shape):
        raise GraphFormatError(f"{path}.data", f"expected {math.prod(shape)} values for shape {list(shape)}, found {len(data)}")
    if dtype == DType.BOOL:
        values = [_expect_bool(v, f"{path}.data[{i}]") for i, v in enumerate(data)]
        return np.array(values, dtype=np.bool_).reshape(shape)
    if dtype.is_float:
        floats = [_expect_float(v, f"{path}.data[{i}]") for i, v in enumerate(data)]
        return np.array(floats, dtype=np.float64).astype(dtype.numpy).reshape(shape)
    info = np.iinfo(dtype.numpy)
    ints = []
    for i, v in enumerate(data):
        number = _expect_int(v, f"{path}.data[{i}]")
        if not info.min <= number <= info.max:
            raise GraphFormatError(f"{path}.data[{i}]", f"{number} does not fit in {dtype.value}")
        ints.append(number)
    return np.array(ints, dtype=dtype.numpy).reshape(shape)


def _decode_layout(value: Any, path: str) -> Layout | None:
    if value is None:
        return None
    fields = _fields(value, path, ("strides", "offset"), {"offset": 0}, what="a layout object or null")
    strides = _expect_ints(fields["strides"], f"{path}.strides")
    offset = _expect_int(fields["offset"], f"{path}.offset")
    if offset < 0:
        raise GraphFormatError(f"{path}.offset", f"expected an offset >= 0, found {offset}")
    return Layout(strides, offset)


def _decode_mutations(value: Any, n_outputs: int, n_params: int) -> dict[int, int]:
    if not isinstance(value, dict):
        raise GraphFormatError("mutations", f"expected an object {{output index: parameter index}}, found {_show(value)}")
    mutations = {}
    for key, param in value.items():
        path = f"mutations.{key}"
        if not (key.isascii() and key.isdigit() and int(key) < n_outputs):
            raise GraphFormatError(path, f"expected an output index below {n_outputs}, found {_show(key)}")
        index = _expect_int(param, path)
        if not 0 <= index < n_params:
            raise GraphFormatError(path, f"expected a parameter index below {n_params}, found {index}")
        mutations[int(key)] = index
    return mutations


def _decode_dtype(value: Any, path: str) -> DType:
    names = [d.value for d in DType]
    if not isinstance(value, str) or value not in names:
        raise GraphFormatError(path, f"unknown dtype {_show(value)} (expected one of {', '.join(names)})")
    return DType(value)


def _lookup(value: Any, path: str, by_name: Mapping[str, Node]) -> Node:
    name = _expect_str(value, path)
    if name not in by_name:
        raise GraphFormatError(path, f"unknown node {name!r}")
    return by_name[name]


def _expect_list(value: Any, path: str) -> list:
    if not isinstance(value, list):
        raise GraphFormatError(path, f"expected a list, found {_show(value)}")
    return value


def _expect_str(value: Any, path: str) -> str:
    if not isinstance(value, str):
        raise GraphFormatError(path, f"expected a string, found {_show(value)}")
    return value


def _expect_int(value: Any, path: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool):
        raise GraphFormatError(path, f"expected an int, found {_show(value)}")
    return value


def _expect_bool(value: Any, path: str) -> bool:
    if not isinstance(value, bool):
        raise GraphFormatError(path, f"expected true or false, found {_show(value)}")
    return value


def _expect_ints(value: Any, path: str) -> tuple[int, ...]:
    if not isinstance(value, list) or any(not isinstance(v, int) or isinstance(v, bool) for v in value):
        raise GraphFormatError(path, f"expected a list of ints, found {_show(value)}")
    return tuple(value)


def _expect_float(value: Any, path: str) -> float:
    if isinstance(value, str) and value in _NONFINITE:
        return _NONFINITE[value]
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise GraphFormatError(path, f'expected a number or "nan"/"inf"/"-inf", found {_show(value)}')
    return float(value)


def _join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


def _show(value: Any, limit: int = 60) -> str:
    """A found value as JSON text, cut short: ``"abc"``, ``[1, 2]``, ``null``."""
    try:
        text = json.dumps(value)
    except (TypeError, ValueError):
        text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."
