"""Workloads: the memory-intensive subgraphs and models the project is measured on.

Each factory returns a ``Workload``: a function or ``nn.Module``, example inputs and whether it is
captured for training. The defaults are small CPU sizes for tests; the keyword arguments give the
real sizes (``REAL_SIZES``) used by benchmarks. Models run with dropout probability 0 so that they
can be compared with eager PyTorch bit for bit up to rounding; ``dropout`` exists to test masks.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F


@dataclass
class Workload:
    name: str
    fn: Callable[..., Any]  # a function or an nn.Module
    inputs: tuple[Any, ...]
    train: bool = False
    notes: str = ""
    extra: dict[str, Any] = field(default_factory=dict)


def _rand(*shape: int, dtype: torch.dtype = torch.float32, seed: int = 0, requires_grad: bool = False) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=generator, dtype=torch.float32).to(dtype).requires_grad_(requires_grad)


def _norm(module: nn.Module, dtype: torch.dtype) -> nn.Module:
    """A normalization module in ``dtype`` with random (not unit and zero) weight and bias, so that
    their gradients and their broadcasts are tested too; seeded."""
    torch.manual_seed(0)
    module = module.to(dtype)
    with torch.no_grad():
        module.weight.normal_()
        module.bias.normal_()
    return module


def layernorm(batch: int = 16, hidden: int = 64, train: bool = False, dtype: torch.dtype = torch.float32) -> Workload:
    module = _norm(nn.LayerNorm(hidden), dtype)
    x = _rand(batch, hidden, dtype=dtype, requires_grad=train)
    return Workload("layernorm_train" if train else "layernorm", module, (x,), train)


def rmsnorm(batch: int = 16, hidden: int = 64, train: bool = False, dtype: torch.dtype = torch.bfloat16,
            eps: float = 1e-6) -> Workload:
    """Llama's RMSNorm: the row's mean square in f32, the normalized row cast back, times the weight."""
    torch.manual_seed(0)
    weight = torch.randn(hidden, dtype=dtype, requires_grad=train)

    def fn(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        wide = x.float()
        normed = wide * torch.rsqrt(wide.pow(2).mean(-1, keepdim=True) + eps)
        return weight * normed.to(x.dtype)

    x = _rand(batch, hidden, dtype=dtype, requires_grad=train)
    return Workload("rmsnorm_train" if train else "rmsnorm", fn, (x, weight), train)


def softmax_scale_mask(batch: int = 4, heads: int = 2, seq: int = 16, scale: float = 0.125,
                       dtype: torch.dtype = torch.float32) -> Workload:
    def fn(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return torch.softmax(x * scale + mask, dim=-1)

    x = _rand(batch, heads, seq, seq, dtype=dtype)
    mask = torch.where(_rand(batch, 1, 1, seq, seed=1) > 0, 0.0, -10000.0).to(dtype)
    return Workload("softmax_scale_mask", fn, (x, mask))


def bias_gelu(tokens: int = 32, hidden: int = 64, dtype: torch.dtype = torch.float32) -> Workload:
    def fn(x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        return F.gelu(x + bias, approximate="tanh")

    return Workload("bias_gelu", fn, (_rand(tokens, hidden, dtype=dtype), _rand(hidden, dtype=dtype, seed=1)))


def bert_base_parameter_shapes(layers: int = 12, hidden: int = 768, vocab: int = 30522,
                               positions: int = 512) -> tuple[tuple[int, ...], ...]:
    """The parameter shapes of BERT-base in module order: embeddings, 16 tensors per layer, pooler."""
    ffn = 4 * hidden
    shapes = [(vocab, hidden), (positions, hidden), (2, hidden), (hidden,), (hidden,)]
    for _ in range(layers):
        for _ in range(4):  # query, key, value, attention output
            shapes += [(hidden, hidden), (hidden,)]
        shapes += [(hidden,), (hidden,), (ffn, hidden), (ffn,), (hidden, ffn), (hidden,), (hidden,), (hidden,)]
    return tuple(shapes + [(hidden, hidden), (hidden,)])


ADAM_SHAPES = ((64, 32), (32,), (32, 32), (32,), (16, 32), (16,), (8, 4, 3, 3), (8,), (100,), (7, 5), (3, 3, 3))


def adam_step(shapes: tuple[tuple[int, ...], ...] = ADAM_SHAPES, lr: float = 1e-3, betas=(0.9, 0.999),
              eps: float = 1e-8, weight_decay: float = 0.01, step: int = 3) -> Workload:
    """One AdamW update per parameter tensor, in place (params, first and second moments)."""
    beta1, beta2 = betas
    bias1, bias2 = 1 - beta1**step, 1 - beta2**step

    def fn(*tensors: torch.Tensor) -> None:
        n = len(tensors) // 4
        params, grads, exp_avgs, exp_avg_sqs = (tensors[i * n : (i + 1) * n] for i in range(4))
        for p, g, m, v in zip(params, grads, exp_avgs, exp_avg_sqs):
            p.mul_(1 - lr * weight_decay)
            m.lerp_(g, 1 - beta1)
            v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
            denom = (v.sqrt() / math.sqrt(bias2)).add_(eps)
            p.addcdiv_(m, denom, value=-lr / bias1)

    tensors = []
    for group, seed in (("p", 0), ("g", 100), ("m", 200), ("v", 300)):
        for i, shape in enumerate(shapes):
            t = _rand(*shape, seed=seed + i)
            tensors.append(t.abs() if group == "v" else t)
    hyper = {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay, "step": step}
    return Workload("adam_step", fn, tuple(tensors), notes=f"{len(shapes)} parameter tensors", extra=hyper)


class MLP(nn.Module):
    def __init__(self, features: int, hidden: int, classes: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(features, hidden)
        self.fc2 = nn.Linear(hidden, classes)

    def forward(self, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(self.fc2(torch.relu(self.fc1(x))), target)


def mlp_train(batch: int = 16, features: int = 32, hidden: int = 64, classes: int = 10) -> Workload:
    torch.manual_seed(0)
    module = MLP(features, hidden, classes)
    target = torch.randint(0, classes, (batch,), generator=torch.Generator().manual_seed(1))
    return Workload("mlp_train", module, (_rand(batch, features), target), train=True)


class DINAttention(nn.Module):
    """DIN-style target attention: a small bmm, a masked softmax over the history, a bmm."""

    def forward(self, query: torch.Tensor, keys: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        scores = torch.bmm(query, keys.transpose(1, 2)) / math.sqrt(keys.shape[-1])
        scores = scores.masked_fill(~mask.unsqueeze(1), float("-inf"))
        return torch.bmm(torch.softmax(scores, dim=-1), keys)


def din_attention(batch: int = 8, history: int = 20, dim: int = 16) -> Workload:
    lengths = torch.randint(1, history + 1, (batch,), generator=torch.Generator().manual_seed(2))
    mask = torch.arange(history)[None, :] < lengths[:, None]
    inputs = (_rand(batch, 1, dim), _rand(batch, history, dim, seed=1), mask)
    return Workload("din_attention", DINAttention(), inputs)


def bert(batch: int = 2, seq: int = 16, train: bool = False, hidden: int = 128, layers: int = 2,
         heads: int = 2, vocab: int = 1000, dropout: float = 0.0) -> Workload:
    from transformers import BertConfig, BertModel

    config = BertConfig(
        vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
        intermediate_size=4 * hidden, max_position_embeddings=max(64, seq),
        hidden_dropout_prob=dropout, attention_probs_dropout_prob=dropout, attn_implementation="eager",
    )
    torch.manual_seed(0)
    model = BertModel(config)
    model.train(train)
    ids = torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(3))
    mask = torch.ones(batch, seq, dtype=torch.long)
    mask[0, seq // 2 :] = 0

    class BertOutputs(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.model = model

        def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor):
            out = self.model(input_ids=input_ids, attention_mask=attention_mask, return_dict=True)
            return out.last_hidden_state, out.pooler_output

    return Workload("bert_train" if train else "bert", BertOutputs(), (ids, mask), train)


def bert_layer(batch: int = 2, seq: int = 16, hidden: int = 128, heads: int = 2, train: bool = False,
               dropout: float = 0.0) -> Workload:
    """One BERT encoder layer (attention + feed-forward, eager attention) on hidden states, with an
    additive attention mask that hides the second half of the first sequence."""
    from transformers import BertConfig
    from transformers.models.bert.modeling_bert import BertLayer

    config = BertConfig(hidden_size=hidden, num_attention_heads=heads, intermediate_size=4 * hidden,
                        hidden_dropout_prob=dropout, attention_probs_dropout_prob=dropout,
                        attn_implementation="eager")
    torch.manual_seed(0)
    layer = BertLayer(config)
    layer.train(train)

    class Layer(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layer = layer

        def forward(self, hidden_states: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
            out = self.layer(hidden_states, attention_mask=mask)
            return out[0] if isinstance(out, tuple) else out

    mask = torch.zeros(batch, 1, 1, seq)
    mask[0, :, :, seq // 2 :] = torch.finfo(torch.float32).min
    x = _rand(batch, seq, hidden, requires_grad=train)
    return Workload("bert_layer_train" if train else "bert_layer", Layer(), (x, mask), train)


def dropout(numel: int = 4096, p: float = 0.3) -> Workload:
    def fn(x: torch.Tensor) -> torch.Tensor:
        return F.dropout(x, p=p, training=True)

    return Workload("dropout", fn, (torch.ones(numel),), extra={"p": p})


# --- the model zoo's bench rows: transformers' configs or plain modules, random weights -----------


def _causal_lm(model: nn.Module, train: bool, name: str, ids: torch.Tensor) -> Workload:
    """A causal language model called on token ids: the loss against the ids themselves when
    ``train``, else the logits."""

    class CausalLM(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.model = model

        def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
            if train:
                return self.model(input_ids=input_ids, labels=input_ids, return_dict=True).loss
            return self.model(input_ids=input_ids, return_dict=True).logits

    model.train(train)
    model.loss_type = "ForCausalLM"  # named: an unnamed loss type logs a warning inside the traced call
    return Workload(f"{name}_train" if train else name, CausalLM(), (ids,), train)


def _ids(batch: int, seq: int, vocab: int) -> torch.Tensor:
    return torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(3))


def gpt2(batch: int = 2, seq: int = 16, train: bool = False, hidden: int = 64, layers: int = 2, heads: int = 2,
         vocab: int = 256) -> Workload:
    """GPT-2 (learned positions, GELU MLP, LayerNorm, eager attention, tied LM head), dropout 0."""
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(vocab_size=vocab, n_embd=hidden, n_layer=layers, n_head=heads, n_positions=max(64, seq),
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False,
                        bos_token_id=vocab - 1, eos_token_id=vocab - 1, attn_implementation="eager")
    torch.manual_seed(0)
    return _causal_lm(GPT2LMHeadModel(config), train, "gpt2", _ids(batch, seq, vocab))


def llama(batch: int = 2, seq: int = 16, train: bool = False, hidden: int = 64, layers: int = 2, heads: int = 4,
          kv_heads: int = 2, intermediate: int = 176, vocab: int = 256) -> Workload:
    """A Llama-style decoder: RMSNorm, rotary embedding, SwiGLU, grouped-query ``sdpa`` attention."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate,
                         num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                         max_position_embeddings=max(64, seq), attention_dropout=0.0, use_cache=False,
                         attn_implementation="sdpa")
    torch.manual_seed(0)
    return _causal_lm(LlamaForCausalLM(config), train, "llama", _ids(batch, seq, vocab))


class UNetBlock(nn.Module):
    """A UNet residual block: GroupNorm, SiLU, 3×3 convolution, twice, and the skip connection."""

    def __init__(self, channels: int, groups: int) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.GroupNorm(groups, channels), nn.GroupNorm(groups, channels)
        self.conv1 = nn.Conv2d(channels, channels, 3, padding=1)
        self.conv2 = nn.Conv2d(channels, channels, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.conv1(F.silu(self.norm1(x)))
        return x + self.conv2(F.silu(self.norm2(h)))


def unet_block(batch: int = 2, channels: int = 32, size: int = 8, groups: int = 8, train: bool = True,
               dtype: torch.dtype = torch.float32) -> Workload:
    torch.manual_seed(0)
    module = UNetBlock(channels, groups).to(dtype)
    x = _rand(batch, channels, size, size, dtype=dtype, requires_grad=train)
    return Workload("unet_block_train" if train else "unet_block", module.train(train), (x,), train)


def groupnorm_silu(batch: int = 2, channels: int = 32, size: int = 8, groups: int = 8,
                   dtype: torch.dtype = torch.bfloat16, train: bool = False) -> Workload:
    module = nn.Sequential(_norm(nn.GroupNorm(groups, channels), dtype), nn.SiLU())
    x = _rand(batch, channels, size, size, dtype=dtype, requires_grad=train)
    return Workload("groupnorm_silu", module, (x,), train)


def instancenorm(batch: int = 2, channels: int = 8, size: int = 8, train: bool = False,
                 dtype: torch.dtype = torch.float32) -> Workload:
    module = _norm(nn.InstanceNorm2d(channels, affine=True), dtype)
    x = _rand(batch, channels, size, size, dtype=dtype, requires_grad=train)
    return Workload("instancenorm_train" if train else "instancenorm", module, (x,), train)


def resnet50(batch: int = 2, image: int = 32, train: bool = False, depths: tuple[int, ...] = (1, 1),
             widths: tuple[int, ...] = (32, 64), stem: int = 16) -> Workload:
    """ResNet (bottleneck blocks, BatchNorm) from ``transformers``' ResNetConfig; the real sizes are
    ResNet-50's depths (3, 4, 6, 3) and widths (256, 512, 1024, 2048)."""
    from transformers import ResNetConfig, ResNetModel

    config = ResNetConfig(embedding_size=stem, hidden_sizes=list(widths), depths=list(depths),
                          layer_type="bottleneck", hidden_act="relu")
    torch.manual_seed(0)
    model = ResNetModel(config).train(train)

    class Outputs(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.model = model

        def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
            return self.model(pixel_values=pixel_values, return_dict=True).pooler_output

    return Workload("resnet50_train" if train else "resnet50", Outputs(), (_rand(batch, 3, image, image),), train)


def cross_entropy(tokens: int = 16, vocab: int = 96, smoothing: float = 0.1,
                  dtype: torch.dtype = torch.bfloat16) -> Workload:
    """Label-smoothing cross-entropy of low-precision logits (upcast to f32), forward + backward."""
    logits = _rand(tokens, vocab, dtype=dtype, requires_grad=True)
    target = torch.randint(0, vocab, (tokens,), generator=torch.Generator().manual_seed(1))

    def fn(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.float(), target, label_smoothing=smoothing)

    return Workload("cross_entropy", fn, (logits, target), train=True)


def rotary(batch: int = 2, heads: int = 4, kv_heads: int = 2, seq: int = 16, dim: int = 16,
           dtype: torch.dtype = torch.bfloat16) -> Workload:
    """Rotary position embedding of queries and keys (Llama's ``rotate_half`` form)."""

    def rotate_half(x: torch.Tensor) -> torch.Tensor:
        half = x.shape[-1] // 2
        return torch.cat((-x[..., half:], x[..., :half]), dim=-1)

    def fn(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin

    inv = 1.0 / (10000 ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    angles = torch.outer(torch.arange(seq, dtype=torch.float32), inv)
    angles = torch.cat((angles, angles), dim=-1)
    inputs = (_rand(batch, heads, seq, dim, dtype=dtype), _rand(batch, kv_heads, seq, dim, dtype=dtype, seed=1),
              angles.cos().to(dtype), angles.sin().to(dtype))
    return Workload("rotary", fn, inputs)


WORKLOADS: dict[str, Callable[..., Workload]] = {
    "layernorm": layernorm,
    "layernorm_train": lambda **kw: layernorm(train=True, **kw),
    "rmsnorm": rmsnorm,
    "rmsnorm_train": lambda **kw: rmsnorm(train=True, **kw),
    "softmax_scale_mask": softmax_scale_mask,
    "bias_gelu": bias_gelu,
    "adam_step": adam_step,
    "mlp_train": mlp_train,
    "din_attention": din_attention,
    "bert": bert,
    "bert_train": lambda **kw: bert(train=True, **kw),
    "bert_layer": bert_layer,
    "gpt2": gpt2,
    "gpt2_train": lambda **kw: gpt2(train=True, **kw),
    "llama": llama,
    "llama_train": lambda **kw: llama(train=True, **kw),
    "unet_block_train": unet_block,
    "groupnorm_silu": groupnorm_silu,
    "instancenorm": instancenorm,
    "resnet50": resnet50,
    "resnet50_train": lambda **kw: resnet50(train=True, **kw),
    "cross_entropy": cross_entropy,
    "rotary": rotary,
}

REAL_SIZES: dict[str, dict[str, Any]] = {
    "layernorm": {"batch": 16384, "hidden": 768},
    "layernorm_train": {"batch": 16384, "hidden": 768},
    "softmax_scale_mask": {"batch": 32, "heads": 12, "seq": 128},
    "bias_gelu": {"tokens": 16384, "hidden": 3072},
    "adam_step": {"shapes": bert_base_parameter_shapes()},
    "mlp_train": {"batch": 4096, "features": 512, "hidden": 1024, "classes": 1000},
    "din_attention": {"batch": 2048, "history": 50, "dim": 64},
    "bert": {"batch": 8, "seq": 128, "vocab": 30522},
    "bert_train": {"batch": 8, "seq": 128, "vocab": 30522},
    "bert_layer": {"batch": 32, "seq": 128, "hidden": 768, "heads": 12},
}


def make(name: str, real: bool = False, **sizes: Any) -> Workload:
    """The workload called ``name``; ``real=True`` uses the benchmark sizes."""
    if name not in WORKLOADS:
        raise KeyError(f"unknown workload {name!r}; known: {', '.join(WORKLOADS)}")
    if real:
        sizes = {**REAL_SIZES.get(name, {}), **sizes}
    return WORKLOADS[name](**sizes)
