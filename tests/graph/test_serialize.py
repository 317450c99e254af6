"""Text printing and the JSON round trip of graph/serialize.py."""

from __future__ import annotations

import json

import ml_dtypes
import numpy as np
import pytest

from fusionstitching.graph.graph import Graph, GraphBuilder, Layout, VerifyError
from fusionstitching.graph.ops import DType
from fusionstitching.graph.serialize import GraphFormatError, from_json, to_json, to_text

F32, BF16 = DType.F32, DType.BF16


# ----------------------------------------------------------------------------------------------
# Hand-made graphs
# ----------------------------------------------------------------------------------------------


def diamond() -> Graph:
    b = GraphBuilder("diamond")
    x = b.parameter([4], F32, name="x")
    left = b.unary("neg", x)
    right = b.unary("exp", x)
    return b.build([b.binary("add", left, right)])


def chain() -> Graph:
    b = GraphBuilder("chain")
    x = b.parameter([2, 3], F32, name="x")
    y = b.unary("tanh", b.unary("neg", x))
    return b.build([b.transpose(y, [1, 0])])


def layernorm() -> Graph:
    """Mean-centering and scaling, a reduce in the middle, a non-contiguous input, two outputs."""
    b = GraphBuilder("layernorm")
    x = b.parameter([4, 8], F32, name="x", layout=Layout((1, 4)))
    w = b.parameter([8], F32, name="w", layout=Layout((2,), offset=3))
    total = b.reduce(x, [1], "sum")
    scale = b.broadcast(b.constant(0.125, F32), [4], [])
    mean = b.binary("mul", total, scale)
    centered = b.binary("sub", x, b.broadcast(mean, [4, 8], [0]))
    out = b.binary("mul", centered, b.broadcast(w, [4, 8], [1]))
    return b.build([out, mean, None], output_layouts=[Layout((1, 4)), None, None])


def library_graph() -> Graph:
    """A library node with a call template, an output layout and a bf16 constant holding NaN."""
    b = GraphBuilder("lib")
    x = b.parameter([4, 8], BF16, name="x")
    w = b.parameter([8, 16], BF16, name="w")
    call = {
        "fn": "aten.mm.default",
        "args": [{"operand": 0}, {"operand": 1}],
        "kwargs": {"out_dtype": {"dtype": "bf16"}, "alpha": 1.5, "flags": (1, 2), "none": None, "max": float("inf")},
    }
    mm = b.node("library", [x, w], shape=[4, 16], dtype=BF16, layout=Layout((16, 1)),
                target="aten.mm.default", call=call, out_index=0)
    special = b.constant(np.array([np.nan, np.inf, -np.inf, 0.1, -0.0, 3.0e38]), BF16, [6])
    return b.build([mm, special])


def mutation_graph() -> Graph:
    """An optimizer-like in-place update: output 1 overwrites parameter 0."""
    b = GraphBuilder("sgd")
    param = b.parameter([16], F32, name="param")
    grad = b.parameter([16], F32, name="grad")
    lr = b.broadcast(b.constant(0.01, F32), [16], [])
    updated = b.binary("sub", param, b.binary("mul", grad, lr))
    loss = b.reduce(grad, [0], "sum")
    return b.build([loss, updated], mutations={1: 0})


def all_dtypes_graph() -> Graph:
    """Constants whose values are hard to keep exact: subnormals, extremes, 1/3, NaN, bools."""
    b = GraphBuilder("dtypes")
    values = {
        DType.F32: [np.finfo(np.float32).smallest_subnormal, np.finfo(np.float32).max, 1 / 3, np.nan],
        DType.F16: [np.finfo(np.float16).smallest_subnormal, 65504.0, 1 / 3, -np.inf],
        DType.BF16: [float(ml_dtypes.finfo(ml_dtypes.bfloat16).max), 1 / 3, np.nan, -0.0],
        DType.F64: [1 / 3, 5e-324, 1e308, np.inf],
        DType.I32: [-(2**31), 2**31 - 1, 0, 7],
        DType.I64: [-(2**63), 2**63 - 1, 0, 7],
        DType.BOOL: [True, False, True, True],
    }
    outputs = [b.constant(np.array(v).astype(d.numpy), d, [4]) for d, v in values.items()]
    scalar = b.constant(2**62 + 1, DType.I64)
    return b.build(outputs + [scalar])


def misc_ops_graph() -> Graph:
    """Ops with every remaining attribute kind: float (pad), int, several ints, str."""
    b = GraphBuilder("misc")
    x = b.parameter([3, 5], F32, name="x")
    idx = b.parameter([2], DType.I32, name="idx")
    padded = b.node("pad", [x], low=(1, 0), high=(0, 2), interior=(0, 1), value=float("-inf"))
    sliced = b.node("slice", [padded], start=(0, 1), limit=(4, 11), stride=(2, 3))
    gathered = b.node("gather", [x, idx], axis=0, batch_dims=0)
    cat = b.node("concatenate", [gathered, x], dimension=0)
    iota = b.iota([5, 5], 1, F32)
    dot = b.node("dot_general", [cat, iota], lhs_batch=(), rhs_batch=(), lhs_contract=(1,), rhs_contract=(0,))
    mask = b.compare("LT", dot, dot)
    return b.build([sliced, b.select(mask, dot, dot)])


GRAPHS = [diamond, chain, layernorm, library_graph, mutation_graph, all_dtypes_graph, misc_ops_graph]


# ----------------------------------------------------------------------------------------------
# Text
# ----------------------------------------------------------------------------------------------


def test_text_of_a_small_graph():
    expected = (
        "graph diamond(%x: f32[4]) {\n"
        "  %neg = f32[4] neg(%x)\n"
        "  %exp = f32[4] exp(%x)\n"
        "  %add = f32[4] add(%neg, %exp)\n"
        "  outputs (%add)\n"
        "}"
    )
    assert to_text(diamond()) == expected
    assert str(diamond()) == expected


def test_text_shows_layouts_attributes_and_outputs():
    text = to_text(layernorm())
    assert text.startswith("graph layernorm(%x: f32[4,8]{1,4}, %w: f32[8]{2}+3) {\n")
    assert "  %reduce = f32[4] reduce(%x), dims={1}, kind=sum\n" in text
    assert "  %c = f32[] constant(0.125)\n" in text
    assert "broadcast_in_dim(%mul), broadcast_dimensions={0}\n" in text
    assert "  outputs (%mul_1{1,4}, %mul, none)\n" in text
    assert "mutations" not in text


def test_text_of_library_node_and_special_constants():
    text = to_text(library_graph())
    line = next(ln for ln in text.splitlines() if "library(" in ln)
    assert line.startswith("  %library = bf16[4,16]{16,1} library(%x, %w), target=aten.mm.default, call={")
    assert '"args":[{"operand":0},{"operand":1}]' in line
    assert '"flags":[1,2]' in line
    assert line.endswith(", out_index=0")
    assert "  %c = bf16[6] constant({nan, inf, -inf, 0.1, -0, 3e+38})\n" in text


def test_text_shortens_big_constants_and_shows_mutations():
    b = GraphBuilder("big")
    table = b.constant(np.arange(64).reshape(4, 16), DType.I32, [4, 16])
    text = to_text(b.build([table]))
    assert "%c = i32[4,16] constant([4,16] {0, 1, 2, 3, ...})" in text
    assert "  mutations {1: %param}\n" in to_text(mutation_graph())


def test_text_prints_attributes_in_schema_order():
    text = to_text(misc_ops_graph())
    assert "pad(%x), low={1,0}, high={0,2}, interior={0,1}, value=-inf\n" in text
    assert "slice(%pad), start={0,1}, limit={4,11}, stride={2,3}\n" in text
    assert "gather(%x, %idx), axis=0, batch_dims=0\n" in text
    assert "compare(%dot_general, %dot_general), direction=LT\n" in text
    assert "%iota = f32[5,5] iota(), dimension=1\n" in text


# ----------------------------------------------------------------------------------------------
# JSON round trip
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("make", GRAPHS, ids=lambda make: make.__name__)
def test_json_round_trip(make):
    graph = make()
    text = to_json(graph)
    again = from_json(text)
    assert to_json(again) == text
    assert to_text(again) == to_text(graph)
    assert from_json(graph.to_json()).to_json() == text
    assert [n.name for n in again.nodes] == [n.name for n in graph.nodes]
    assert again.mutations == graph.mutations
    assert again.output_layouts == graph.output_layouts


def test_json_is_strict_outside_call_templates():
    doc = json.loads(to_json(all_dtypes_graph()), parse_constant=pytest.fail)
    assert doc["format"] == "fusionstitching.graph" and doc["version"] == 1
    node = doc["nodes"][0]
    assert list(node) == ["name", "op", "operands", "shape", "dtype", "attrs", "layout"]
    assert node["attrs"]["value"]["data"][3] == "nan"


@pytest.mark.parametrize("make", [all_dtypes_graph, library_graph], ids=lambda make: make.__name__)
def test_constants_are_exact(make):
    graph = make()
    again = from_json(to_json(graph))
    for old, new in zip(graph.nodes, again.nodes):
        if old.op == "constant":
            a, b = old.attrs["value"], new.attrs["value"]
            assert a.dtype == b.dtype and a.shape == b.shape
            assert a.tobytes() == b.tobytes()


def test_decoded_attributes_have_ir_types():
    again = from_json(to_json(layernorm()))
    reduce = again.node("reduce")
    assert reduce.attrs["dims"] == (1,) and isinstance(reduce.attrs["dims"], tuple)
    assert reduce.attrs["kind"] == "sum"
    assert isinstance(again.node("c").attrs["value"], np.ndarray)
    assert again.node("x").layout == Layout((1, 4), 0)
    assert again.node("w").layout == Layout((2,), 3)
    assert again.parameters == [again.node("x"), again.node("w")]
    assert again.outputs[2] is None
    lib = from_json(to_json(library_graph())).node("library")
    assert lib.attrs["call"]["args"] == [{"operand": 0}, {"operand": 1}]
    assert lib.attrs["call"]["kwargs"]["out_dtype"] == {"dtype": "bf16"}
    assert lib.attrs["call"]["kwargs"]["max"] == float("inf")


def test_non_finite_pad_value_round_trips():
    doc = json.loads(to_json(misc_ops_graph()))
    pad = next(n for n in doc["nodes"] if n["op"] == "pad")
    assert pad["attrs"]["value"] == "-inf"
    assert from_json(to_json(misc_ops_graph())).node("pad").attrs["value"] == float("-inf")


def test_attribute_outside_the_schema_is_refused():
    b = GraphBuilder()
    x = b.parameter([2], F32, name="x")
    y = b.node("neg", [x], fused=True)
    with pytest.raises(GraphFormatError, match="node neg: attribute 'fused' is not in the schema of neg"):
        to_json(b.build([y]))


# ----------------------------------------------------------------------------------------------
# Malformed documents
# ----------------------------------------------------------------------------------------------


def _node(doc, name):
    return next(n for n in doc["nodes"] if n["name"] == name)


def _set(path_fn, value):
    def edit(doc):
        target, key = path_fn(doc)
        target[key] = value
    return edit


def _delete(path_fn):
    def edit(doc):
        target, key = path_fn(doc)
        del target[key]
    return edit


# nodes of layernorm(): 0 x, 1 w, 2 reduce, 3 c, 4 broadcast_in_dim, 5 mul, ...
MALFORMED = [
    ("shape", _set(lambda d: (d["nodes"][3], "shape"), "abc"), 'nodes[3].shape: expected a list of ints, found "abc"'),
    ("shape-bool", _set(lambda d: (d["nodes"][3], "shape"), [True]), "nodes[3].shape: expected a list of ints"),
    ("operand", _set(lambda d: (d["nodes"][2]["operands"], 0), "foo"), "nodes[2].operands[0]: unknown node 'foo'"),
    ("operand-later", _set(lambda d: (d["nodes"][2]["operands"], 0), "mul"), "nodes[2].operands[0]: unknown node 'mul'"),
    ("op", _set(lambda d: (d["nodes"][1], "op"), "frob"), "nodes[1].op: unknown op 'frob'"),
    ("attr-missing", _delete(lambda d: (d["nodes"][2]["attrs"], "dims")), "nodes[2].attrs.dims: missing"),
    ("attr-type", _set(lambda d: (d["nodes"][2]["attrs"], "dims"), 1), "nodes[2].attrs.dims: expected a list of ints, found 1"),
    ("attr-unknown", _set(lambda d: (d["nodes"][2]["attrs"], "keepdims"), True),
     "nodes[2].attrs.keepdims: unknown attribute of reduce"),
    ("index", _set(lambda d: (d["nodes"][0]["attrs"], "index"), "0"), 'nodes[0].attrs.index: expected an int, found "0"'),
    ("output", _set(lambda d: (d["outputs"], 1), "x_"), "outputs[1]: unknown node 'x_'"),
    ("parameter", _set(lambda d: (d["parameters"], 0), 3), "parameters[0]: expected a string, found 3"),
    ("dtype", _set(lambda d: (d["nodes"][2], "dtype"), "f8"), 'nodes[2].dtype: unknown dtype "f8"'),
    ("array-dtype", _set(lambda d: (d["nodes"][3]["attrs"]["value"], "dtype"), "f128"),
     'nodes[3].attrs.value.dtype: unknown dtype "f128"'),
    ("array-data", _set(lambda d: (d["nodes"][3]["attrs"]["value"], "data"), [1, 2]),
     "nodes[3].attrs.value.data: expected 1 values for shape [], found 2"),
    ("array-value", _set(lambda d: (d["nodes"][3]["attrs"]["value"], "data"), ["x"]),
     'nodes[3].attrs.value.data[0]: expected a number or "nan"/"inf"/"-inf", found "x"'),
    ("node-field", _delete(lambda d: (d["nodes"][4], "shape")), "nodes[4].shape: missing"),
    ("node-extra", _set(lambda d: (d["nodes"][4], "shpe"), [4]), "nodes[4].shpe: unknown field"),
    ("node-type", _set(lambda d: (d["nodes"], 4), [1, 2]), "nodes[4]: expected a node object, found [1, 2]"),
    ("duplicate", _set(lambda d: (d["nodes"][3], "name"), "reduce"), "nodes[3].name: duplicate node name 'reduce'"),
    ("layout", _set(lambda d: (d["nodes"][0], "layout"), {"strides": [1, "4"]}),
     'nodes[0].layout.strides: expected a list of ints, found [1, "4"]'),
    ("format", _set(lambda d: (d, "format"), "hlo"), "format: expected 'fusionstitching.graph', found \"hlo\""),
    ("version", _set(lambda d: (d, "version"), 2), "version: expected 1, found 2"),
    ("top-missing", _delete(lambda d: (d, "nodes")), "nodes: missing"),
    ("mutation-out", _set(lambda d: (d, "mutations"), {"7": 0}), 'mutations.7: expected an output index below 3, found "7"'),
    ("mutation-param", _set(lambda d: (d, "mutations"), {"0": 5}), "mutations.0: expected a parameter index below 2, found 5"),
    ("output-layouts", _set(lambda d: (d, "output_layouts"), [None]),
     "output_layouts: expected 3 entries (one per output), found 1"),
]


@pytest.mark.parametrize("edit, message", [case[1:] for case in MALFORMED], ids=[case[0] for case in MALFORMED])
def test_malformed_json_names_the_field(edit, message):
    doc = json.loads(to_json(layernorm()))
    edit(doc)
    with pytest.raises(GraphFormatError) as info:
        from_json(json.dumps(doc))
    assert message in str(info.value)
    assert str(info.value).startswith(info.value.path)


def test_invalid_json_syntax_gives_line_and_column():
    text = to_json(diamond()).replace('"version": 1,', '"version": 1')
    with pytest.raises(GraphFormatError, match=r"invalid JSON at line 4, column 3: Expecting ',' delimiter"):
        from_json(text)


@pytest.mark.parametrize("text", ["[1, 2]", '"graph"', "null"])
def test_top_level_must_be_an_object(text):
    with pytest.raises(GraphFormatError, match="expected a JSON object at the top level, found"):
        from_json(text)


def test_verifier_error_names_the_node():
    doc = json.loads(to_json(layernorm()))
    doc["nodes"][2]["shape"] = [8]
    with pytest.raises(VerifyError, match=r"node reduce \(reduce\): expected f32\[4\], found f32\[8\]"):
        from_json(json.dumps(doc))
