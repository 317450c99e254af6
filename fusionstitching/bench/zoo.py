"""The model zoo: small ``transformers`` models through ``torch.compile``, fusionstitching against
eager PyTorch, with Inductor alongside as the yardstick.

``python -m fusionstitching.bench.zoo [--models a,b] [--variants train:bf16,...] [--systems
eager,inductor,fusionstitching] [--sizes full|tiny] [--json FILE]`` builds each model from its
``transformers`` config with random weights (nothing is downloaded; every dropout probability is 0,
so eager and compiled runs compute the same function). It has its own entry point rather than a flag
of ``correctness.py``, whose error measure and allocator poisoning it uses: a flag there would make
the two files import each other.

- BERT (``BertModel``), GPT-2 (``GPT2LMHeadModel``: tied embedding and head), Llama (``LlamaModel``:
  RMSNorm, rotary embedding, SwiGLU, grouped-query attention) with ``attn_implementation`` "sdpa"
  and "eager", T5 (``T5Model``: encoder, decoder, relative position buckets), ViT (``ViTModel``,
  32×32 images in 8×8 patches) and a ResNet (``ResNetModel``: bottleneck blocks, BatchNorm,
  convolutions channels-last forward and backward; 64×64 images), and on request ``bert-eager``
  and ``t5-eager``; 2 layers, hidden 128, batch 2 × 32 tokens with padding in the mask;
- each in four rows: inference (``no_grad``) and a training step (forward, then backward of the sum
  over the floating outputs ``o`` of ``(o.float() * r).mean()``, ``r`` fixed random weights), in f32
  and under bf16 autocast.

The loss. ``o.pow(2).mean()`` of an output that leaves a normalization with unit weight (Llama's
and T5's final RMSNorm at initialization) is a constant: every gradient but the norm weight's is
then rounding noise, as far from an f64 run in eager f32 as the f32 bound or further, and no bound
can tell a wrong kernel from it. Random weights give every gradient a value.

Rows are run one system after another (``torch._dynamo.reset()`` before each compiled system), the
compiled ones with the caching allocator's free memory poisoned (``correctness.poison``) before the
forward and before the backward call. Fusionstitching compiles with ``Options(strict=True)``: an
internal error raises instead of falling back, and a graph that still runs in PyTorch (a
``FallbackWarning``, ``stats()["fallbacks"]`` growing) fails its row.

The rule. For each compared tensor (every output; in training rows also every parameter's gradient,
with the floor of ``correctness.check_training`` for gradients that are zero in exact arithmetic),
the relative L2 error against eager must stay within ``max(2 × Inductor's error on that tensor,
1e-4 in f32, 2e-2 under bf16)``. Inductor's error measures how far a correct compiler that also
reorders and fuses float arithmetic lands; the factor 2 allows for a different fusion choice, the
floors for tensors that Inductor happens to reproduce exactly. A row whose model fails to compile or
run in our backend records the exception (its type, its first line and the innermost frame of this
package) and fails; the other rows go on. An Inductor failure is a note, and the row's bounds fall
back to the floors.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
import traceback
import warnings
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from fusionstitching.backend import FallbackWarning, stats
from fusionstitching.bench.correctness import BF16_TOLERANCE, F32_TOLERANCE, poison, relative_error

SYSTEMS = ("eager", "inductor", "fusionstitching")
GRADIENT_FLOOR = 1e-4  # of the largest gradient's norm, as in correctness.check_training
INDUCTOR_FACTOR = 2.0


@dataclass(frozen=True)
class Sizes:
    layers: int = 2
    hidden: int = 128
    heads: int = 4
    batch: int = 2
    seq: int = 32
    vocab: int = 512
    image: int = 32  # ViT: image side, in pixels
    patch: int = 8


TINY = Sizes(layers=1, hidden=32, heads=2, batch=2, seq=8, vocab=64, image=16, patch=8)


@dataclass
class Case:
    """A model and the keyword arguments of its forward call."""

    name: str
    model: torch.nn.Module
    inputs: dict[str, torch.Tensor]


@dataclass(frozen=True)
class Variant:
    """One row's setting: inference or a training step, f32 or bf16 autocast."""

    mode: str  # "inference" or "train"
    dtype: str  # "f32" or "bf16"

    @property
    def train(self) -> bool:
        return self.mode == "train"

    @property
    def autocast(self) -> bool:
        return self.dtype == "bf16"

    @property
    def tolerance(self) -> float:
        return BF16_TOLERANCE if self.autocast else F32_TOLERANCE


VARIANTS = (Variant("inference", "f32"), Variant("inference", "bf16"), Variant("train", "f32"),
            Variant("train", "bf16"))


@dataclass
class Row:
    model: str
    mode: str
    dtype: str
    ours: float = math.nan  # the largest relative error of fusionstitching over the compared tensors
    inductor: float | None = None  # the same for Inductor (None: not run)
    bound: float = math.nan  # the bound of the tensor that came closest to it
    tightest: str = ""  # that tensor
    fallbacks: int = 0
    seconds: float = 0.0
    tensors: int = 0  # tensors compared
    kernels: int = 0
    library_calls: int = 0
    graph_breaks: int = 0  # TorchDynamo graph breaks while compiling our system (code run by Python)
    library_ops: list[str] = field(default_factory=list)  # ops kept as library calls (no lowering)
    failures: list[str] = field(default_factory=list)  # why the row fails; empty when it passes
    notes: list[str] = field(default_factory=list)  # what does not fail the row (an Inductor error)

    @property
    def passed(self) -> bool:
        return not self.failures and math.isfinite(self.ours)


# --- the models ------------------------------------------------------------------------------------

def _token_inputs(sizes: Sizes, device: torch.device, prefix: str = "") -> dict[str, torch.Tensor]:
    """Token ids and an attention mask with the last quarter of the second sequence padded."""
    ids = torch.randint(1, sizes.vocab, (sizes.batch, sizes.seq), device=device)
    mask = torch.ones(sizes.batch, sizes.seq, dtype=torch.long, device=device)
    mask[-1, sizes.seq - sizes.seq // 4:] = 0
    return {f"{prefix}input_ids": ids, f"{prefix}attention_mask": mask}


def bert(sizes: Sizes, device: torch.device, attention: str = "sdpa") -> Case:
    from transformers import BertConfig, BertModel

    config = BertConfig(vocab_size=sizes.vocab, hidden_size=sizes.hidden, num_hidden_layers=sizes.layers,
                        num_attention_heads=sizes.heads, intermediate_size=4 * sizes.hidden,
                        max_position_embeddings=max(64, sizes.seq), hidden_dropout_prob=0.0,
                        attention_probs_dropout_prob=0.0, attn_implementation=attention)
    name = "bert" if attention == "sdpa" else f"bert-{attention}"
    return Case(name, BertModel(config), _token_inputs(sizes, device))


def gpt2(sizes: Sizes, device: torch.device) -> Case:
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(vocab_size=sizes.vocab, n_embd=sizes.hidden, n_layer=sizes.layers, n_head=sizes.heads,
                        n_positions=max(64, sizes.seq), resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                        use_cache=False, bos_token_id=sizes.vocab - 1, eos_token_id=sizes.vocab - 1,
                        attn_implementation="sdpa")
    return Case("gpt2", GPT2LMHeadModel(config), _token_inputs(sizes, device))


def llama(sizes: Sizes, device: torch.device, attention: str = "sdpa") -> Case:
    from transformers import LlamaConfig, LlamaModel

    heads = max(sizes.heads, 2)
    config = LlamaConfig(vocab_size=sizes.vocab, hidden_size=sizes.hidden, intermediate_size=2 * sizes.hidden,
                         num_hidden_layers=sizes.layers, num_attention_heads=heads,
                         num_key_value_heads=heads // 2, max_position_embeddings=max(64, sizes.seq),
                         attention_dropout=0.0, use_cache=False, attn_implementation=attention)
    return Case(f"llama-{attention}", LlamaModel(config), _token_inputs(sizes, device))


def t5(sizes: Sizes, device: torch.device, attention: str = "sdpa") -> Case:
    from transformers import T5Config, T5Model

    config = T5Config(vocab_size=sizes.vocab, d_model=sizes.hidden, d_kv=sizes.hidden // sizes.heads,
                      d_ff=2 * sizes.hidden, num_layers=sizes.layers, num_decoder_layers=sizes.layers,
                      num_heads=sizes.heads, relative_attention_num_buckets=8, dropout_rate=0.0,
                      use_cache=False, decoder_start_token_id=0, pad_token_id=0, attn_implementation=attention)
    inputs = _token_inputs(sizes, device)
    decoder = _token_inputs(Sizes(batch=sizes.batch, seq=max(4, sizes.seq // 2), vocab=sizes.vocab), device)
    inputs["decoder_input_ids"] = decoder["input_ids"]
    return Case("t5" if attention == "sdpa" else f"t5-{attention}", T5Model(config), inputs)


def vit(sizes: Sizes, device: torch.device) -> Case:
    from transformers import ViTConfig, ViTModel

    config = ViTConfig(image_size=sizes.image, patch_size=sizes.patch, num_channels=3, hidden_size=sizes.hidden,
                       num_hidden_layers=sizes.layers, num_attention_heads=sizes.heads,
                       intermediate_size=4 * sizes.hidden, hidden_dropout_prob=0.0,
                       attention_probs_dropout_prob=0.0, attn_implementation="sdpa")
    pixels = torch.randn(sizes.batch, 3, sizes.image, sizes.image, device=device)
    return Case("vit", ViTModel(config), {"pixel_values": pixels})


def resnet(sizes: Sizes, device: torch.device) -> Case:
    """A ResNet of bottleneck blocks with BatchNorm (``transformers``' ResNetModel), ``sizes.layers``
    stages; images of at least 64 pixels a side, so that BatchNorm's last statistics still have
    several elements per channel at batch 2."""
    from transformers import ResNetConfig, ResNetModel

    widths = [sizes.hidden // 2 ** (sizes.layers - 1 - k) for k in range(sizes.layers)]
    config = ResNetConfig(embedding_size=max(8, widths[0] // 2), hidden_sizes=widths, depths=[1] * sizes.layers,
                          layer_type="bottleneck", hidden_act="relu")
    side = max(64, sizes.image)
    pixels = torch.randn(sizes.batch, 3, side, side, device=device)
    return Case("resnet", ResNetModel(config), {"pixel_values": pixels})


ZOO: dict[str, Callable[[Sizes, torch.device], Case]] = {
    "bert": bert,
    "bert-eager": lambda sizes, device: bert(sizes, device, "eager"),
    "gpt2": gpt2,
    "llama-sdpa": lambda sizes, device: llama(sizes, device, "sdpa"),
    "llama-eager": lambda sizes, device: llama(sizes, device, "eager"),
    "t5": t5,
    "t5-eager": lambda sizes, device: t5(sizes, device, "eager"),
    "vit": vit,
    "resnet": resnet,
}
# The zoo's run: eager attention of BERT is in correctness.py's checks already, T5's is the
# same attention as its "sdpa" (a float bias, a causal mask) in other ops.
DEFAULT_MODELS = ("bert", "gpt2", "llama-sdpa", "llama-eager", "t5", "vit", "resnet")


def build(name: str, sizes: Sizes, device: torch.device) -> Case:
    """The model ``name`` of ``ZOO`` with seeded random weights and inputs, on ``device``."""
    torch.manual_seed(0)
    case = ZOO[name](sizes, device)
    case.model.to(device)
    return case


# --- one system on one row -------------------------------------------------------------------------

@dataclass
class Outcome:
    """What one system computed for a row: named tensors, or the exception it raised."""

    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    error: str | None = None  # "Type: first line (at file:line in function)"
    fallbacks: int = 0
    kernels: int = 0
    library_calls: int = 0
    graph_breaks: int = 0
    library_ops: list[str] = field(default_factory=list)
    seconds: float = 0.0


def _output_tensors(output: Any) -> dict[str, torch.Tensor]:
    """The floating tensors of a model output (a ``ModelOutput``, a tuple or a tensor), by name."""
    if isinstance(output, torch.Tensor):
        return {"output": output} if output.is_floating_point() else {}
    items = output.items() if hasattr(output, "items") else enumerate(output)
    found = {}
    for key, value in items:
        if isinstance(value, torch.Tensor) and value.is_floating_point():
            found[f"output {key}"] = value
    return found


def _probe(output: torch.Tensor, index: int) -> torch.Tensor:
    """The fixed random weights of output ``index`` in the training loss (the same for every system)."""
    generator = torch.Generator(output.device).manual_seed(index)
    return torch.randn(output.shape, generator=generator, device=output.device)


def _step(fn: Callable[..., Any], case: Case, variant: Variant, device: torch.device) -> dict[str, torch.Tensor]:
    """One call of ``fn`` (the model, compiled or not) as the variant says: its outputs and, for a
    training step, every parameter's gradient. Free memory is poisoned before each call."""
    model = case.model
    for p in model.parameters():
        p.grad = None
    model.train(variant.train)
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=variant.autocast)
    with torch.set_grad_enabled(variant.train), autocast:
        poison(device)
        outputs = _output_tensors(fn(**case.inputs))
    if not outputs:
        raise RuntimeError(f"{case.name}: the model returned no floating tensor")
    results = {name: t.detach().clone() for name, t in outputs.items()}
    if variant.train:
        loss = sum((t.float() * _probe(t, k)).mean() for k, t in enumerate(outputs.values()))
        poison(device)
        loss.backward()
        for name, p in model.named_parameters():
            if p.grad is not None:
                results[f"grad {name}"] = p.grad.detach().clone()
            p.grad = None
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return results


def _where(err: BaseException) -> str:
    """The innermost frame of this package (outside ``bench``) in the exception's traceback."""
    frames = [f for f in traceback.extract_tb(err.__traceback__)
              if "fusionstitching" in f.filename and "/bench/" not in f.filename]
    if not frames:
        return ""
    frame = frames[-1]
    path = frame.filename[frame.filename.rfind("fusionstitching"):]
    return f" (at {path}:{frame.lineno} in {frame.name})"


def describe(err: BaseException) -> str:
    """``Type: first line (at file:line in function)``, through TorchDynamo's wrapper of a backend's
    exception to the backend's own."""
    inner = getattr(err, "inner_exception", None)
    while inner is not None:
        err = inner
        inner = getattr(err, "inner_exception", None)
    cause = err.__cause__ if err.__cause__ is not None else err
    lines = str(err).strip().splitlines()
    first = lines[0] if lines else ""
    return f"{type(err).__name__}: {first[:300]}{_where(cause)}"


def _compiled(system: str, model: torch.nn.Module) -> Callable[..., Any]:
    if system == "eager":
        return model
    if system == "fusionstitching":
        return torch.compile(model, backend="fusionstitching", options={"strict": True})
    return torch.compile(model, backend=system)


def run_system(system: str, case: Case, variant: Variant, device: torch.device) -> Outcome:
    """``case`` through ``system`` for one variant; an exception becomes the outcome's ``error``."""
    from torch._dynamo.utils import counters

    from fusionstitching.frontend.torch_fx import LibraryFallbackWarning

    torch._dynamo.reset()
    before = stats()
    breaks = sum(counters["graph_break"].values())
    outcome = Outcome()
    start = time.perf_counter()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            outcome.tensors = _step(_compiled(system, case.model), case, variant, device)
        except Exception as err:  # noqa: BLE001 -- a failing model is a row's result, not the run's end
            outcome.error = describe(err)
    outcome.seconds = time.perf_counter() - start
    after = stats()
    if system == "fusionstitching":
        warned = sum(1 for w in caught if issubclass(w.category, FallbackWarning))
        outcome.fallbacks = max(warned, after.get("fallbacks", 0) - before.get("fallbacks", 0))
        outcome.kernels = after.get("kernels", 0) - before.get("kernels", 0)
        outcome.library_calls = after.get("library calls", 0) - before.get("library calls", 0)
        outcome.graph_breaks = sum(counters["graph_break"].values()) - breaks
        ops = {str(w.message).split(" ")[0] for w in caught if issubclass(w.category, LibraryFallbackWarning)}
        outcome.library_ops = sorted(ops)
    torch._dynamo.reset()
    return outcome


# --- one row ---------------------------------------------------------------------------------------

def _errors(outcome: Outcome, reference: dict[str, torch.Tensor]) -> dict[str, float]:
    """Relative L2 error per reference tensor; a missing tensor is an infinite error."""
    gradients = [float(t.double().norm()) for name, t in reference.items() if name.startswith("grad ")]
    floor = GRADIENT_FLOOR * max(gradients, default=0.0)
    errors = {}
    for name, ref in reference.items():
        got = outcome.tensors.get(name)
        if got is None or got.shape != ref.shape:
            errors[name] = math.inf
        else:
            errors[name] = relative_error(got, ref, floor if name.startswith("grad ") else 0.0)
    return errors


def run_row(case: Case, variant: Variant, device: torch.device, systems: Sequence[str] = SYSTEMS) -> Row:
    """One row: eager, then each compiled system of ``systems``, and the rule of the module docstring."""
    row = Row(case.name, variant.mode, variant.dtype)
    start = time.perf_counter()
    eager = run_system("eager", case, variant, device)
    ours = run_system("fusionstitching", case, variant, device) if "fusionstitching" in systems else None
    inductor = run_system("inductor", case, variant, device) if "inductor" in systems else None
    row.seconds = time.perf_counter() - start
    if eager.error is not None:
        row.failures.append(f"eager: {eager.error}")
        return row
    if ours is None:
        row.failures.append("fusionstitching was not run")
        return row
    row.fallbacks, row.kernels, row.library_calls = ours.fallbacks, ours.kernels, ours.library_calls
    row.graph_breaks, row.library_ops = ours.graph_breaks, ours.library_ops
    if ours.error is not None:
        row.failures.append(f"fusionstitching: {ours.error}")
    if ours.fallbacks:
        row.failures.append(f"{ours.fallbacks} graph(s) fell back to PyTorch")
    yardstick: dict[str, float] = {}
    if inductor is not None:
        if inductor.error is not None:
            row.notes.append(f"inductor: {inductor.error}")
        else:
            yardstick = _errors(inductor, eager.tensors)
            row.inductor = max(yardstick.values())
    if ours.error is not None:
        return row
    errors = _errors(ours, eager.tensors)
    row.tensors = len(errors)
    row.ours = max(errors.values())
    ratio = -1.0
    for name, error in errors.items():
        bound = max(INDUCTOR_FACTOR * yardstick.get(name, 0.0), variant.tolerance)
        if not math.isfinite(bound):
            bound = variant.tolerance
        if not error <= bound:  # NaN fails too
            row.failures.append(f"{name}: {error:.2e} > {bound:.1e}"
                                + (f" (inductor {yardstick[name]:.1e})" if name in yardstick else ""))
        if not math.isfinite(error) or error / bound > ratio:
            ratio = math.inf if not math.isfinite(error) else error / bound
            row.bound, row.tightest = bound, name
    return row


def run_model(name: str, device: torch.device, sizes: Sizes = Sizes(), variants: Sequence[Variant] = VARIANTS,
              systems: Sequence[str] = SYSTEMS, log: bool = True) -> list[Row]:
    """Every variant of one model; a model that cannot be built fails all of its rows."""
    rows = []
    try:
        case = build(name, sizes, device)
    except Exception as err:  # noqa: BLE001 -- a row's result
        return [Row(name, v.mode, v.dtype, failures=[f"build: {describe(err)}"]) for v in variants]
    for variant in variants:
        row = run_row(case, variant, device, systems)
        if log:
            print(f"  {_line(row)}", file=sys.stderr, flush=True)
        rows.append(row)
    return rows


def run_zoo(device: torch.device, models: Sequence[str] = DEFAULT_MODELS, sizes: Sizes = Sizes(),
            variants: Sequence[Variant] = VARIANTS, systems: Sequence[str] = SYSTEMS, log: bool = True
            ) -> list[Row]:
    rows = []
    for name in models:
        rows += run_model(name, device, sizes, variants, systems, log)
    return rows


# --- reporting -------------------------------------------------------------------------------------

def _line(row: Row) -> str:
    inductor = "-" if row.inductor is None else f"{row.inductor:.1e}"
    verdict = "pass" if row.passed else "FAIL"
    return (f"{row.model} {row.mode} {row.dtype}: ours {row.ours:.1e}, inductor {inductor}, "
            f"{verdict} ({row.seconds:.1f} s){': ' + row.failures[0] if row.failures else ''}")


def _note(row: Row) -> str:
    parts = list(row.failures[:3])
    if len(row.failures) > 3:
        parts.append(f"{len(row.failures) - 3} more")
    if not parts and row.tightest:
        parts.append(f"tightest: {row.tightest}")
    parts += row.notes
    if row.library_ops:
        parts.append("library ops: " + ", ".join(row.library_ops))
    if row.graph_breaks:
        parts.append(f"{row.graph_breaks} graph breaks")
    return "; ".join(parts).replace("|", "\\|")


def table(rows: Sequence[Row]) -> str:
    lines = ["| model | mode | dtype | ours | Inductor | bound | fallbacks | result | s | note |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for row in rows:
        inductor = "-" if row.inductor is None else f"{row.inductor:.1e}"
        lines.append(f"| {row.model} | {row.mode} | {row.dtype} | {row.ours:.1e} | {inductor} | "
                     f"{row.bound:.0e} | {row.fallbacks} | {'pass' if row.passed else 'FAIL'} | "
                     f"{row.seconds:.1f} | {_note(row)} |")
    return "\n".join(lines)


def _json_value(value: float | None) -> float | str | None:
    return value if value is None or math.isfinite(value) else str(value)


def to_json(rows: Sequence[Row], device: str) -> str:
    records = []
    for row in rows:
        record = asdict(row)
        record.update(ours=_json_value(row.ours), inductor=_json_value(row.inductor),
                      bound=_json_value(row.bound), passed=row.passed)
        records.append(record)
    return json.dumps({"device": device, "rows": records}, indent=1)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fusionstitching.bench.zoo",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(DEFAULT_MODELS),
                        help=f"comma-separated, of: {', '.join(ZOO)}; default all but bert-eager and t5-eager")
    parser.add_argument("--systems", default=None,
                        help="comma-separated; default eager,inductor,fusionstitching (no Inductor on a CPU)")
    parser.add_argument("--variants", default=None,
                        help="comma-separated mode:dtype, e.g. inference:f32,train:bf16; default all four")
    parser.add_argument("--sizes", choices=("full", "tiny"), default=None,
                        help="full: 2 layers, hidden 128, 2 × 32 tokens (default on a GPU); "
                        "tiny: 1 layer, hidden 32, 2 × 8 tokens (default on a CPU)")
    parser.add_argument("--json", metavar="FILE", help="write the rows as JSON")
    args = parser.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    on_cpu = device.type == "cpu"
    models = [m for m in args.models.split(",") if m]
    unknown = [m for m in models if m not in ZOO]
    if unknown:
        parser.error(f"unknown models {unknown}; known: {', '.join(ZOO)}")
    systems = tuple(args.systems.split(",")) if args.systems else (
        ("eager", "fusionstitching") if on_cpu else SYSTEMS)
    variants = VARIANTS
    if args.variants:
        variants = tuple(Variant(*v.split(":", 1)) for v in args.variants.split(",") if ":" in v)
        if not variants or any(v not in VARIANTS for v in variants):
            parser.error(f"--variants: mode:dtype pairs among {', '.join(f'{v.mode}:{v.dtype}' for v in VARIANTS)}")
    sizes = TINY if args.sizes == "tiny" or (args.sizes is None and on_cpu) else Sizes()
    name = torch.cuda.get_device_name(device) if not on_cpu else "CPU (simulated kernels)"
    start = time.perf_counter()
    rows = run_zoo(device, models, sizes, variants, systems)
    total = time.perf_counter() - start
    print(f"device: {name}; sizes: {sizes}; total {total:.0f} s")
    print(table(rows))
    if args.json:
        with open(args.json, "w") as out:
            out.write(to_json(rows, name))
    return 0 if all(row.passed for row in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
