"""Narrow integers (uint8, int8, int16) compile: values of these types are computed in i32 inside a
kernel and wrapped to their width after every op, as PyTorch's arithmetic on them wraps; a float
converts to them through int64 and wraps (PyTorch's rule for uint8, and its CPU kernels' for int8
and int16). Before, any such value (a uint8 image normalized in the model) sent its whole graph to
PyTorch. Every case runs strict against eager: equal integers, close floats, no fallback."""

from __future__ import annotations

import random
import warnings

import pytest
import torch

import fusionstitching
from fusionstitching.frontend.torch_fx import capture

NARROW = (torch.uint8, torch.int8, torch.int16)


def _full_range(shape, dtype, seed):
    info = torch.iinfo(dtype)
    g = torch.Generator().manual_seed(seed)
    return torch.randint(int(info.min), int(info.max) + 1, shape, generator=g, dtype=torch.int64).to(dtype)


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
DEVICES = [pytest.param("cpu"), pytest.param("cuda", marks=[pytest.mark.gpu, needs_cuda])]


def _check(fn, *args, device="cpu"):
    """``fn`` compiled against eager on ``device`` (on the CPU the simulator runs the kernels)."""
    torch._dynamo.reset()
    args = tuple(a.to(device) for a in args)
    compiled = torch.compile(fn, backend="fusionstitching", options={"strict": True})
    fallbacks = fusionstitching.stats()["fallbacks"]
    want, got = fn(*args), compiled(*args)
    want = want if isinstance(want, tuple) else (want,)
    got = got if isinstance(got, tuple) else (got,)
    for w, g in zip(want, got, strict=True):
        assert g.dtype == w.dtype and g.shape == w.shape
        if w.dtype.is_floating_point:
            torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)
        else:
            assert torch.equal(g, w), (w.flatten()[:8], g.flatten()[:8])
    assert fusionstitching.stats()["fallbacks"] == fallbacks


MEAN, STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)


def _normalized(x):
    mean, std = (torch.tensor(v, device=x.device).view(1, 3, 1, 1) for v in (MEAN, STD))
    return (x.float() / 255 - mean) / std


CASES = {
    "normalized image": (_normalized, torch.uint8),
    "wrapping add, mul, sub": (lambda x: (x * 3 + x) - (~x) * 5, None),
    "negation and abs": (lambda x: (-x, x.abs()), None),
    "floor division and remainder by a scalar": (lambda x: (x // 7, x % 5, x // -3), None),
    "bitwise ops": (lambda x: (x & 0x5A) | (x ^ ~x), None),
    "row max and min": (lambda x: (x.amax(dim=-1), x.amin(dim=(1, 2))), None),
    "sums promote to int64": (lambda x: x.sum(dim=-1), None),
    "a sum kept in its type wraps": (lambda x: x.sum(dim=-1, dtype=x.dtype), None),
    "to float and back": (lambda x: (x.float() * 1.7).to(x.dtype), None),
    "to half types": (lambda x: (x.to(torch.float16) / 3, x.to(torch.bfloat16).to(x.dtype)), None),
    "clamp and where": (lambda x: torch.where(x > 10, x.clamp(-5, 100), x // 2), None),
    "transposed copy": (lambda x: x.transpose(1, 3).contiguous() + 1, None),
    "argmax and max over a dim": (lambda x: (x.argmax(1), x.max(dim=2).values), None),
    "dequantized softmax": (lambda x: (x.float() * 0.05).softmax(-1), None),
    "cumulative sum": (lambda x: x.cumsum(-1), None),
    "padding and concatenation": (lambda x: torch.cat([torch.nn.functional.pad(x, (1, 2)), x[..., :3]], -1), None),
}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(("case", "dtype"), [pytest.param(case, dtype, id=f"{case}-{str(dtype)[6:]}")
                                             for case, (_, only) in CASES.items() for dtype in NARROW
                                             if only in (None, dtype)])
def test_narrow_integer_programs_compile_to_eagers_values(case, dtype, device):
    _check(CASES[case][0], _full_range((2, 3, 8, 37), dtype, 1), device=device)


def test_mixed_types_promote_as_eager():
    u8, i8, i16 = (_full_range((4, 37), dtype, k) for k, dtype in enumerate(NARROW))
    _check(lambda a, b, c: (a + b, b * c, torch.minimum(b, c), a - 300, 255 - a, a * 2.5, a > -1), u8, i8, i16)
    _check(lambda a, b: (a & (b > 0), a + (b > 0), a.to(torch.int16) + b), u8, i8)


INTEGERS = (*NARROW, torch.int32, torch.int64)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", INTEGERS, ids=["u8", "i8", "i16", "i32", "i64"])
def test_shifts_by_every_amount_are_eagers(dtype, device):
    """``<<`` and ``>>`` by amounts below 0, inside and past the type's width (0, and the sign fill)."""
    info = torch.iinfo(dtype)
    x = _full_range((80,), dtype, 3) if info.bits < 64 else torch.randint(-2**62, 2**62, (80,), generator=torch.Generator().manual_seed(3))
    x[:4] = torch.tensor([int(info.min), int(info.max), 0, -1 if info.min < 0 else 1], dtype=torch.int64).to(dtype)
    amounts = (torch.arange(0, 80) if dtype == torch.uint8 else torch.arange(-6, 74)).to(dtype)
    _check(lambda a, s: (a << s, a >> s, a << 3, a >> (info.bits - 1), torch.bitwise_right_shift(a, 70)), x, amounts,
           device=device)


def _unpack(p, scale):
    nibbles = (p.unsqueeze(-1) >> torch.tensor([0, 4], dtype=torch.uint8, device=p.device)) & 0xF
    return (nibbles.to(torch.float32) - 8) * scale


@pytest.mark.parametrize("device", DEVICES)
def test_unpacking_four_bit_weights_needs_no_library_call(device):
    """Two 4-bit values per uint8 (``(packed >> [0, 4]) & 0xF``), dequantized: one kernel."""
    packed = _full_range((16, 32), torch.uint8, 4)
    scales = torch.rand(16, 1, 1)
    _check(_unpack, packed, scales, device=device)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        captured = capture(_unpack, packed, scales)
    assert not [n for n in captured.forward.nodes if n.op == "library"]


def test_no_graph_with_a_narrow_integer_runs_in_pytorch():
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a library call or a fallback is announced by a warning
        captured = capture(lambda x: (x.float() / 255 - 0.5) * 2, torch.randint(0, 256, (2, 3, 4), dtype=torch.uint8))
    assert not [n for n in captured.forward.nodes if n.op == "library"]


_UNARY = ["{} * 3", "{} + 77", "{} - 100", "-{}", "~{}", "{}.abs()", "{} // 3", "{} % 6", "{} & 0x3C", "{} | 0x41",
          "{} ^ 0x7E", "{}.clamp(-20, 90)", "{} << 3", "{} >> 2"]
_BINARY = ["{} + {}", "{} - {}", "{} * {}", "torch.maximum({}, {})", "torch.minimum({}, {})", "{} ^ {}",
           "torch.where({0} > {1}, {0}, {1})"]


def _random_program(rng: random.Random) -> tuple[str, list[torch.dtype]]:
    """A straight line of wrapping ops over two narrow inputs of one type, a conversion to another
    narrow type or through float, and reductions of the result."""
    dtype = rng.choice(NARROW)
    values = ["a", "b"]
    lines = []
    for k in range(rng.randint(3, 8)):
        if rng.random() < 0.5:
            expr = rng.choice(_UNARY).format(rng.choice(values))
        else:
            expr = rng.choice(_BINARY).format(rng.choice(values), rng.choice(values))
        if rng.random() < 0.15:
            expr = f"({expr}).to(torch.{str(rng.choice(NARROW)).split('.')[1]})"
        elif rng.random() < 0.1:
            expr = f"(({expr}).float() * {rng.choice([0.37, 2.5, -11.0])}).to({values[0]}.dtype)"
        lines.append(f"    v{k} = {expr}")
        values.append(f"v{k}")
    last = values[-1]
    lines.append(f"    return {last}, {last}.amax(-1), {last}.sum(-1), ({last}.float() * 0.5).mean(0)")
    return "def fn(a, b):\n" + "\n".join(lines), [dtype, dtype]


@pytest.mark.parametrize("device", DEVICES)
def test_random_narrow_integer_programs_match_eager(device):
    seed = random.SystemRandom().randrange(2**31)
    print(f"narrow-integer programs: seed {seed}")
    rng = random.Random(seed)
    for k in range(12):
        source, dtypes = _random_program(rng)
        scope: dict = {"torch": torch}
        exec(source, scope)  # noqa: S102 -- the program is built above from fixed pieces
        shape = (rng.randint(1, 5), rng.choice([1, 3, 16, 37, 64, 130]))
        inputs = [_full_range(shape, d, seed + k * 2 + i) for i, d in enumerate(dtypes)]
        try:
            _check(scope["fn"], *inputs, device=device)
        except AssertionError as err:
            raise AssertionError(f"seed {seed}, program {k}:\n{source}\n{err}") from err
