"""Library calls' arguments filled from templates read once (``executor._filler``): the same
arguments as the template says, operands laid out as traced, constant parts built once."""

from __future__ import annotations

import torch

from fusionstitching.graph.layout import TO_NCHW
from fusionstitching.runtime.executor import _filler


def test_a_filler_places_operands_and_shares_its_constants():
    template = [{"operand": 1, "permute": list(TO_NCHW), "strides": [48, 1, 16, 4]},
                {"operand": 0, "strides": [3, 1]}, [1, 1], [0, 0], False, {"dtype": "bf16"}, None]
    fill = _filler(template)
    nhwc = torch.arange(96.0).reshape(2, 3, 4, 4)
    strided = torch.arange(6.0).reshape(3, 2).t()  # [2, 3] with strides (1, 2): copied as traced
    first = fill([strided, nhwc])
    second = fill([strided, nhwc])
    assert first[0].shape == (2, 4, 3, 4) and first[0].stride() == (48, 1, 16, 4)
    assert first[0].data_ptr() == nhwc.data_ptr()  # a view, not a copy
    assert first[1].stride() == (3, 1) and torch.equal(first[1], strided)
    assert first[2:6] == [[1, 1], [0, 0], False, torch.bfloat16] and first[6] is None
    assert first[2] is second[2]  # built once
    assert first is not second  # each call its own argument list


def test_raw_operands_and_constant_templates():
    x = torch.ones(2, 2).t()
    assert _filler([{"operand": 0, "strides": [2, 1]}], raw=(0,))([x])[0] is x  # passed as it is
    constant = _filler({"dim": [1], "keepdim": True})
    assert constant([]) == {"dim": [1], "keepdim": True} and constant([]) is constant([x])
