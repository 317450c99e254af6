"""Kernels shared across the shapes of a symbolic graph (``codegen/size_args.py``): a later
specialization's kernel runs its family's parametric kernel, which with that kernel's own
constants bound is that kernel, constant for constant."""

from __future__ import annotations

import dataclasses
import re
import struct
import warnings

import pytest
import torch

import fusionstitching
from fusionstitching import pipeline
from fusionstitching.codegen import cuda_c
from fusionstitching.codegen import kernel_ir as K
from fusionstitching.codegen.nvrtc import compile_cuda
from fusionstitching.codegen.size_args import SizeFamilies, _rebuild, bind, pack, parametrize


class _Block(torch.nn.Module):
    """Attention scores with a padding mask, softmax over the keys, LayerNorm and GELU: kernels
    whose grids, strides and row lengths follow the sequence length."""

    def __init__(self, hidden: int = 32, heads: int = 2) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = torch.nn.Linear(hidden, 3 * hidden)
        self.norm = torch.nn.LayerNorm(hidden)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, self.heads, h // self.heads).permute(2, 0, 3, 1, 4)
        scores = q @ k.transpose(-1, -2) * 0.25 + (1.0 - mask[:, None, None, :]) * -1e4
        y = (scores.softmax(-1) @ v).transpose(1, 2).reshape(b, s, h)
        return torch.nn.functional.gelu(self.norm(y + x))


def _recorded_compiles(monkeypatch) -> list:
    """The CompiledGraph of each ``pipeline.compile_graph`` call from now on, in order."""
    compiles = []
    plain = pipeline.compile_graph

    def recorded(*args, **kwargs):
        compiled = plain(*args, **kwargs)
        compiles.append(compiled)
        return compiled

    monkeypatch.setattr(pipeline, "compile_graph", recorded)
    torch._dynamo.reset()
    return compiles


def _compiled_kernels(monkeypatch, model, lengths, dynamic=True):
    """The kernels of each compile of ``model`` over ``lengths``, and the outputs against eager."""
    compiles = _recorded_compiles(monkeypatch)
    compiled = fusionstitching.compile(model, dynamic=dynamic, options={"device": "h200"})
    for seq in lengths:
        x = torch.randn(2, seq, 32)
        mask = (torch.arange(seq) < seq - 3).float().expand(2, seq)
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            torch.testing.assert_close(compiled(x, mask), model(x, mask), atol=2e-5, rtol=2e-5)
    return compiles


def _variants(kernels):
    for kernel in kernels:
        if kernel._twin is None:
            yield kernel
            if kernel._scalar_variant is not None:
                yield kernel._scalar_variant


def test_a_later_specializations_kernels_run_their_familys_parametric_kernel_bound_to_their_own_constants(monkeypatch):
    """Over five sequence lengths, the later specializations' kernels take their families'
    parametric kernels; each one, bound to its member's constants and grid, is the member's
    kernel exactly (body, threads, buffers, shared arrays), and its source compiles with NVRTC."""
    torch.manual_seed(0)
    compiles = _compiled_kernels(monkeypatch, _Block().eval(), (17, 24, 40, 48, 33))
    assert len(compiles) == 5
    assert compiles[0].shared_kernels == 0  # the first compile keeps every kernel its own
    shared = [k for c in compiles[1:] for k in _variants(c.kernels) if k._shared is not None]
    assert len(shared) >= 5, [c.shared_kernels for c in compiles]
    sources = set()
    for member in shared:
        parametric, packed, values = member._shared
        ir, own = parametric.lowered.kernel, member.lowered.kernel
        assert len(ir.scalars) == len(values) == len(packed)
        bound = bind(ir, values, own.blocks, own.notes)
        assert _code(bound.body) == _code(own.body), member.name
        assert (bound.name, bound.threads, bound.shared, bound.blocks) == (own.name, own.threads, own.shared, own.blocks)
        assert [dataclasses.replace(b, extent=0) for b in bound.params] == \
            [dataclasses.replace(b, extent=0) for b in own.params]
        for p, value, bits in zip(ir.scalars, values, packed):
            assert bits == pack(value, p.dtype)
            if p.dtype in K.INT_TYPES:
                assert value > 0 or not _divides(ir.body, p), (member.name, p, value)
        sources.add(parametric.cuda_source)
    assert any(member._shared[0].lowered.kernel.scalars for member in shared)  # sizes as arguments, not only grids
    for source in sources:
        assert "fs_size" in source or "shared across shapes: 0" in source
        compile_cuda(source, "sm_90")


def _divides(body, param) -> bool:
    """Whether ``param`` is the divisor of an integer division or remainder in ``body``."""
    found = []

    def visit(node):
        if isinstance(node, K.Binary) and node.op in ("div", "rem") and node.b == param:
            found.append(node)
        if isinstance(node, tuple):
            for item in node:
                visit(item)
        elif hasattr(node, "__dataclass_fields__") and not isinstance(node, (K.Const, K.Param, K.Var)):
            for name in node.__dataclass_fields__:
                visit(getattr(node, name))

    visit(body)
    return bool(found)


def test_a_graph_compiled_once_keeps_every_kernel_its_own(monkeypatch):
    """A static graph has one compile: its kernels of one skeleton at different sizes (none here,
    or several) never take a parametric kernel."""
    compiles = _compiled_kernels(monkeypatch, _Block().eval(), (24,), dynamic=False)
    assert [c.shared_kernels for c in compiles] == [0]
    assert all(k._shared is None for k in _variants(compiles[0].kernels))


def _kernel(stop: int, divisor: int, scale: float, exponent: int = 2) -> K.Kernel:
    i = K.Var("i", "i32")
    index = K.Binary("add", K.Binary("mul", K.Special("bid"), K.Const(256, "i32"), "i32"), K.Special("tid"), "i32")
    value = K.Binary("mul", K.Cast(K.Load("in0", K.Binary("rem", i, K.Const(divisor, "i32"), "i32"), "f32"), "f32"),
                     K.Const(scale, "f32"), "f32")
    value = K.Binary("pow", value, K.Const(float(exponent), "f32"), "f32")
    body = (K.For(i, index, K.Const(stop, "i32"), K.Const(256 * 4, "i32"),
                  (K.Store("out0", i, value),), kind="grid_stride"),)
    params = (K.Buffer("out0", "f32", stop), K.Buffer("in0", "f32", divisor, readonly=True))
    return K.Kernel("fs_test", params, body, 256, max(1, stop // 256))


class _Generated:
    """What ``SizeFamilies`` reads of a generated kernel."""

    def __init__(self, kernel: K.Kernel) -> None:
        from fusionstitching.codegen.lower import LoweredKernel

        self.lowered = LoweredKernel(kernel, None, (), (), {})
        self.template = None
        self._twin = self._scalar_variant = self._shared = None


def _code(body):
    """A kernel body without its comments' text (a parametric kernel's are its maker's)."""
    return _rebuild(body, lambda c, role: c, comments=False)


def test_members_whose_comments_quote_other_sizes_share_a_kernel():
    """A packed sub-kernel's comment quotes its block range; two members differing there and in
    the range's constant are one family, the range an argument."""
    def commented(stop):
        kernel = _kernel(stop, 64, 0.5)
        note = K.Comment(f"sub-kernel out0: blocks [0, {stop // 256})")
        return dataclasses.replace(kernel, body=(note, *kernel.body))

    families = SizeFamilies()
    first, second = _Generated(commented(1024)), _Generated(commented(2048))
    assert families.adopt([first]) == 0 and families.adopt([second]) == 1
    parametric, _, values = second._shared
    assert values == (2048,) and "< fs_size0" in parametric.cuda_source
    assert "blocks [0, 8)" in parametric.cuda_source  # the comment of the member it was made from


def test_a_family_takes_as_arguments_only_the_constants_its_members_differ_in():
    """Two members differing in the loop's stop and the divisor take those two as arguments; a
    third differing in the float scale makes the family's kernel again with it; a member that
    differs in the ``pow`` exponent, or whose divisor is not positive, is a family of its own."""
    families = SizeFamilies()
    first, second = _Generated(_kernel(1024, 64, 0.5)), _Generated(_kernel(2048, 128, 0.5))
    assert families.adopt([first]) == 0 and first._shared is None
    assert families.adopt([second]) == 1
    parametric, _, values = second._shared
    assert [p.dtype for p in parametric.lowered.kernel.scalars] == ["i32", "i32"]
    assert values == (2048, 128)  # preorder: the loop's stop is met before the divisor in its body
    assert "< fs_size0" in parametric.cuda_source and "% fs_size1" in parametric.cuda_source
    third = _Generated(_kernel(512, 64, 0.25))
    assert families.adopt([third]) == 1
    assert third._shared[0] is not parametric and len(third._shared[2]) == 3
    assert third._shared[2] == (512, 64, 0.25) and third._shared[1][2] == struct.unpack("<I", struct.pack("<f", 0.25))[0]
    assert bind(third._shared[0].lowered.kernel, third._shared[2], third.lowered.kernel.blocks).body == \
        third.lowered.kernel.body
    other = _Generated(_kernel(1024, 64, 0.5, exponent=3))
    assert families.adopt([other]) == 0
    zero = _Generated(_kernel(1024, 0, 0.5))
    assert families.adopt([zero]) == 0 and zero._shared is None


def test_one_compiles_kernels_never_share_with_each_other():
    families = SizeFamilies()
    a, b = _Generated(_kernel(1024, 64, 0.5)), _Generated(_kernel(2048, 128, 0.5))
    assert families.adopt([a, b]) == 0


def test_packed_scalar_arguments_hold_their_types_bytes():
    assert pack(-5, "i32") == 2**32 - 5
    assert pack(-5, "i64") == 2**64 - 5
    assert pack(1.5, "f64") == struct.unpack("<Q", struct.pack("<d", 1.5))[0]
    assert pack(True, "bool") == 1


def test_a_parametric_kernel_prints_its_sizes_as_arguments_after_the_buffers():
    # preorder: the block size in the loop's start (0), its stop (1), its step (2), the divisor (3)
    kernel = parametrize(_kernel(2048, 64, 0.5), [1, 3])
    source = cuda_c.render(kernel)
    assert "const float* __restrict__ in0,\n    int fs_size0,\n    int fs_size1)" in source
    assert "i < fs_size0" in source and "% fs_size1" in source
    assert "2048" not in source and "(64)" not in source and "(1024)" in source and "(256)" in source


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_the_gpu_kernels_shared_across_lengths_give_eagers_values():
    """Every length's call matches eager with the later lengths' kernels run as their families'
    parametric kernels; the last lengths compile no kernel with NVRTC."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = _Block().cuda().eval()
    compiled = fusionstitching.compile(model, dynamic=True)
    before = fusionstitching.stats()["kernels shared across shapes"]
    nvrtc = []
    for seq in (17, 24, 40, 48, 56, 40, 33, 64, 72):
        x = torch.randn(2, seq, 32, device="cuda")
        mask = (torch.arange(seq, device="cuda") < seq - 3).float().expand(2, seq)
        seconds = fusionstitching.stats()["compile seconds"]["nvrtc"]
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            torch.testing.assert_close(compiled(x, mask), model(x, mask), atol=2e-5, rtol=2e-5)
        nvrtc.append(fusionstitching.stats()["compile seconds"]["nvrtc"] - seconds)
    assert fusionstitching.stats()["kernels shared across shapes"] > before
    print("NVRTC seconds per length:", [round(s, 3) for s in nvrtc])


def test_packed_kernels_of_other_lengths_share_their_familys_kernel(monkeypatch):
    """A packed kernel's comments quote its sub-kernels' block ranges, which follow the lengths:
    BERT's packed kernels at later lengths run their family's parametric kernel, which bound to
    their constants is their code, and compiles with NVRTC; the outputs are eager's."""
    from fusionstitching.bench import workloads as W

    compiles = _recorded_compiles(monkeypatch)
    model = W.bert(batch=2, seq=24, hidden=64, layers=2, heads=2).fn
    compiled = fusionstitching.compile(model, dynamic=True, options={"device": "h200", "strict": True})
    for length in (20, 28, 22):
        ids = torch.randint(0, 1000, (2, length), generator=torch.Generator().manual_seed(length))
        mask = torch.ones(2, length, dtype=torch.long)
        mask[0, length // 2:] = 0
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            torch.testing.assert_close(compiled(ids, mask), model(ids, mask), rtol=1e-4, atol=1e-4)
    shared = [k for c in compiles[1:] for k in _variants(c.kernels) if k._shared is not None]
    # a sub-kernel whose block range follows the length: its bound an argument
    ranged = [k for k in shared if re.search(r"blockIdx\.x\) < fs_size\d+\)", k._shared[0].cuda_source)]
    assert ranged, [c.shared_kernels for c in compiles]
    sources = set()
    for member in shared:
        parametric, _, values = member._shared
        own = member.lowered.kernel
        assert _code(bind(parametric.lowered.kernel, values, own.blocks).body) == _code(own.body), member.name
        sources.add(parametric.cuda_source)
    for source in sources:
        compile_cuda(source, "sm_90")
