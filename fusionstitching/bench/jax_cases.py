"""JAX versions of the micro benchmark workloads, compiled by XLA through ``jax.jit``.

Each takes the same values as the PyTorch case (the module's parameters and the inputs, copied to
JAX arrays on the GPU) and computes the same function; training cases return the forward output
and the gradients of its sum (``jax.vjp``), as the PyTorch step computes them. JAX must not take
most of the GPU's memory before PyTorch runs, so its allocator is told not to preallocate.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")


def unavailable(case: Any, device: torch.device) -> str:
    """Why ``case`` cannot run on XLA here ("" when it can)."""
    if case.name not in BUILDERS:
        return "no JAX version"
    if device.type != "cuda":
        return "needs a GPU"
    try:
        import jax
    except ImportError:
        return "JAX is not installed"
    if jax.default_backend() != "gpu":
        return f"JAX's backend is {jax.default_backend()}, not a GPU"
    return ""


def system(case: Any) -> tuple[Callable[[], Any], Callable[[Any], None], float, Callable[[Any], list]]:
    """(step, sync, first-call seconds, comparable outputs) of ``case`` under ``jax.jit``."""
    import jax

    fn, args, forward = BUILDERS[case.name](case)
    jitted = jax.jit(fn)
    start = time.perf_counter()
    jax.block_until_ready(jitted(*args))
    first = time.perf_counter() - start

    def comparable(result: Any) -> list[torch.Tensor]:
        return [_to_torch(x) for x in forward(result)]

    return (lambda: jitted(*args)), jax.block_until_ready, first, comparable


def _array(t: torch.Tensor):
    import jax.numpy as jnp

    dtype = {torch.float32: jnp.float32, torch.bfloat16: jnp.bfloat16, torch.float16: jnp.float16,
             torch.bool: jnp.bool_, torch.int64: jnp.int32, torch.int32: jnp.int32}[t.dtype]
    return jnp.asarray(t.detach().float().cpu().numpy()).astype(dtype)


def _to_torch(x: Any) -> torch.Tensor:
    import jax.numpy as jnp

    return torch.from_numpy(np.asarray(x.astype(jnp.float32)))


def _layernorm_fn(eps: float):
    import jax.numpy as jnp

    def layernorm(x, w, b):
        y = x.astype(jnp.float32)
        mean = y.mean(-1, keepdims=True)
        var = ((y - mean) ** 2).mean(-1, keepdims=True)
        out = (y - mean) * (1.0 / jnp.sqrt(var + eps)) * w.astype(jnp.float32) + b.astype(jnp.float32)
        return out.astype(x.dtype)
    return layernorm


def _layernorm(case):
    module = case.fn
    fn = _layernorm_fn(module.eps)
    args = (_array(case.inputs[0]), _array(module.weight), _array(module.bias))
    if not case.train:
        return fn, args, lambda out: [out]
    return _forward_backward(fn), args, lambda result: [result[0]]


def _forward_backward(fn):
    """out, grads of out.sum() with respect to every argument."""
    import jax
    import jax.numpy as jnp

    def step(*args):
        out, vjp = jax.vjp(fn, *args)
        return out, vjp(jnp.ones_like(out))
    return step


def _softmax(case):
    import jax

    def fn(x, mask):
        return jax.nn.softmax(x * 0.125 + mask, axis=-1)
    return fn, tuple(_array(t) for t in case.inputs), lambda out: [out]


def _bias_gelu(case):
    import jax
    import jax.numpy as jnp

    def fn(x, b):
        return jax.nn.gelu((x + b).astype(jnp.float32), approximate=True).astype(x.dtype)
    return fn, tuple(_array(t) for t in case.inputs), lambda out: [out]


def _adam(case):
    import jax.numpy as jnp

    h = case.extra
    lr, (beta1, beta2), eps, decay, step = h["lr"], h["betas"], h["eps"], h["weight_decay"], h["step"]
    bias1, bias2 = 1 - beta1**step, 1 - beta2**step
    n = len(case.inputs) // 4

    def fn(*tensors):
        params, grads, ms, vs = (tensors[i * n:(i + 1) * n] for i in range(4))
        new = ([], [], [])
        for p, g, m, v in zip(params, grads, ms, vs):
            m = m + (g - m) * (1 - beta1)
            v = v * beta2 + g * g * (1 - beta2)
            p = p * (1 - lr * decay) - (lr / bias1) * m / (jnp.sqrt(v) / math.sqrt(bias2) + eps)
            for out, value in zip(new, (p, m, v)):
                out.append(value)
        return new
    return fn, tuple(_array(t) for t in case.inputs), lambda result: []


def _mlp_train(case):
    import jax
    import jax.numpy as jnp

    module = case.fn
    x, target = case.inputs

    def loss(w1, b1, w2, b2, x, target):
        h = jax.nn.relu(x @ w1.T + b1)
        logits = h @ w2.T + b2
        logp = jax.nn.log_softmax(logits, axis=-1)
        return -jnp.take_along_axis(logp, target[:, None], axis=-1).mean()

    def fn(w1, b1, w2, b2, x, target):
        return jax.value_and_grad(loss, argnums=(0, 1, 2, 3))(w1, b1, w2, b2, x, target)
    args = tuple(_array(t) for t in (module.fc1.weight, module.fc1.bias, module.fc2.weight, module.fc2.bias,
                                     x, target))
    return fn, args, lambda result: [result[0]]


def _din_attention(case):
    import jax
    import jax.numpy as jnp

    def fn(query, keys, mask):
        scores = jnp.einsum("bqd,bkd->bqk", query, keys) / math.sqrt(keys.shape[-1])
        scores = jnp.where(mask[:, None, :], scores, -jnp.inf)
        return jnp.einsum("bqk,bkd->bqd", jax.nn.softmax(scores, axis=-1), keys)
    return fn, tuple(_array(t) for t in case.inputs), lambda out: [out]


BUILDERS: dict[str, Callable[[Any], tuple]] = {
    "layernorm": _layernorm,
    "layernorm_bf16": _layernorm,
    "layernorm_train": _layernorm,
    "layernorm_train_bf16": _layernorm,
    "softmax": _softmax,
    "bias_gelu": _bias_gelu,
    "adam": _adam,
    "mlp_train": _mlp_train,
    "din_attention": _din_attention,
}
