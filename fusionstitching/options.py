"""Options: the one place where a compilation's choices live (DESIGN.md "Package layout").

Every stage that needs a choice takes the ``Options`` it is given; nothing reads the environment.
``device`` names a ``cost.gpu_spec`` entry (the GPU the plan is made for); the small-dot threshold
decides which ``dot_general`` nodes are fused by the code generator and which go to the GEMM
library (cuBLAS through PyTorch).
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Options:
    device: str = "H100"
    solver: str = "ilp"  # plan selection in fusion.explore: "ilp" (HiGHS) or "beam" (width 3)
    generators: tuple[str, ...] | None = None  # candidate generators (fusion/explore.py); None: the default set
    score: str = "delta"  # "delta" [C §5.4] or "model" [B §4.3]
    # A dot_general is "small" (fused in generated kernels) when its FLOPs and its per-batch output
    # stay under these; larger dots are library calls. The bounds come from
    # ``python -m fusionstitching.bench.small_dots`` (figures in CHANGELOG.md): up to them a generated
    # dot alone is about as fast as cuBLAS, and fused with its producers and consumers it also saves
    # their traffic; beyond them (BERT's attention bmm) cuBLAS is several times faster.
    small_dot_max_flops: int = 1 << 26
    small_dot_max_output: int = 256  # elements of one batch element's output (M x N)
    small_dot_max_contract: int = 1024  # contracted length K
    split_reductions: bool = True  # the reduction-splitting pass before exploration
    # Half-type GEMMs whose f32 conversion leaves the graph write their f32 accumulator instead
    # (``graph.transforms.widen_dots``): one rounding fewer than the graph asks for, 0.71 GB less
    # per BERT-base training step (its weight gradients).
    widen_dots: bool = True
    # Library GEMMs with a leading dimension that is not a whole number of 16-byte vectors take
    # zero-padded operands, padded by the kernels that produce them (``fusion/padding.py``).
    pad_gemms: bool = True
    # What padding saves, measured: (``fusion.padding.GemmProblem.describe()``, µs unaligned, µs
    # padded) of the graph's unaligned library GEMMs on its GPU. The backend fills it before a graph
    # is planned (``runtime/gemm_timing.py``), unless tune="off"; the padding pass prefers these
    # figures to its model, and plans cached on disk are keyed by them.
    gemm_timings: tuple[tuple[str, float, float], ...] = ()
    # A library GEMM whose bias add must be written to memory in any plan (a graph output, an
    # operand of library calls) adds the bias in its epilogue: one ``addmm`` call instead of the
    # GEMM and a kernel pass over its result (``fusion/gemm_bias.py``).
    gemm_bias: bool = True
    # Adjacent dims that reductions reduce together are merged into one dim before exploration
    # (a BatchNorm's H x W image becomes one row; ``graph/collapse.py``).
    collapse_dims: bool = True
    # Reshapes between elementwise, reduce and broadcast nodes are resolved by splitting dims, so
    # that a region computed in several shapes of the same elements tiles one iteration space
    # (GroupNorm's [N, C, H, W], [N, C, H*W] and [N, G, C/G, H*W]; ``graph/refine.py``), and
    # ``collapse_dims`` then merges every reduced row back into one dim. A graph the split changes
    # is planned both ways and the lower estimate kept.
    split_reshaped_dims: bool = True
    # 2-D convolutions take and give NHWC nodes, so the kernels around them write and read what
    # cuDNN's channels-last kernels use without conversions (``graph/layout.py``).
    channels_last: bool = True
    smem_limit: int = 48 * 1024  # bytes of shared memory a generated kernel may use per block
    # Failure policy (DESIGN.md "Failure policy"): an internal error while compiling a graph makes
    # that graph run in PyTorch with a FallbackWarning; strict raises it instead (the tests run strict).
    strict: bool = False
    # The one cache root: the NVRTC cache and any later plan or performance caches live under it.
    # None: ``$XDG_CACHE_HOME/fusionstitching`` (``~/.cache/fusionstitching``). Created 0700.
    cache_dir: str | None = None
    cache_max_bytes: int = 1 << 30  # the NVRTC and plan caches are each pruned, oldest entries first, above this size
    # Plans are kept under the cache root and read back by a later process that plans the same
    # graph with the same options and code, which then skips exploration (``fusion/plan_cache.py``).
    cache_plans: bool = True
    # A training graph's backward is explored in a worker process while the forward compiles and
    # runs, and its compile takes that plan; a graph planned both with and without split reshaped
    # dims has its unsplit plan explored there meanwhile (``fusion/background.py``).
    explore_ahead: bool = True
    # Shape classes (sizes bucketed by power of two and alignment, ``backend.size_class``) a graph
    # is compiled for: any number of shapes of each; shapes of further classes run in PyTorch (one
    # FallbackWarning). Under mode="reduce-overhead", also the specializations that replay CUDA graphs.
    max_specializations: int = 16
    # A graph compiles in a background thread while its calls run in PyTorch (a graph of symbolic
    # shapes: each shape signature); the compiled program takes over at the first call after it is
    # ready (``backend._Runner``). A
    # training forward takes over only once its backward has compiled too, and each backward takes
    # the path its forward took. The call that takes over measures no schedule: patterns the
    # performance library lacks keep the plan's templates (``fusionstitching tune`` fills it).
    async_compile: bool = False
    # Schedule tuning on a GPU (``runtime/tuner.py``): "measure" times the plan's template and the
    # latency model's next best, ``tune_candidates`` in all, on each new pattern at the graph's first
    # call and keeps the fastest in the performance library; "exhaustive" times every template of
    # the tuning space; "off" runs the plan's templates (the model's choice) and measures nothing.
    tune: str = "measure"
    tune_candidates: int = 6
    # Tuning at a first call may take at most this multiple of the graph's own compile time
    # (exploration, code generation, NVRTC), and at least ``tune_min_seconds``; a candidate is only
    # made when its predicted cost (the graph's compile seconds per character of CUDA C, times the
    # kernel's) fits. Patterns left run the plan's templates and are tuned by a later process.
    # "exhaustive" (and ``fusionstitching tune``) has no limit.
    tune_budget: float = 0.5
    tune_min_seconds: float = 2.0
    # A GPU program whose kernels are loaded and whose kept buffers exist (from its third call) runs
    # as one straight-line function written out for it (``runtime/unrolled.py``); False keeps the
    # loop over its steps (the reference path, to compare host times against).
    unroll: bool = True

    def __post_init__(self) -> None:
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if field.type == "bool" and not isinstance(value, bool):
                raise ValueError(f"Options.{field.name} must be True or False, got {value!r}")
        if self.solver not in ("ilp", "beam"):
            raise ValueError(f"Options.solver: unknown solver {self.solver!r}; known: 'ilp', 'beam'")
        if self.tune not in ("off", "measure", "exhaustive"):
            raise ValueError(f"Options.tune: unknown mode {self.tune!r}; known: 'off', 'measure', 'exhaustive'")
        for name in ("tune_budget", "tune_min_seconds"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or value < 0:
                raise ValueError(f"Options.{name} must be a number >= 0, got {value!r}")
        if type(self.tune_candidates) is not int or self.tune_candidates < 1:
            raise ValueError(f"Options.tune_candidates must be an int >= 1, got {self.tune_candidates!r}")
        for entry in self.gemm_timings:
            if not (isinstance(entry, tuple) and len(entry) == 3 and isinstance(entry[0], str)
                    and all(isinstance(t, (int, float)) and t >= 0 for t in entry[1:])):
                raise ValueError(f"Options.gemm_timings: each entry is (GEMM problem, µs unaligned, µs padded) "
                                 f"with times >= 0, got {entry!r}")
        if self.score not in ("delta", "model"):
            raise ValueError(f"Options.score: unknown score {self.score!r}; known: 'delta', 'model'")


def cache_root(cache_dir: str | os.PathLike | None = None) -> Path:
    """The root of the package's disk caches: ``cache_dir`` if given, else
    ``$XDG_CACHE_HOME/fusionstitching`` (``~/.cache/fusionstitching`` where ``XDG_CACHE_HOME`` is
    unset or, against the XDG spec, relative). The NVRTC cache is its ``nvrtc/``
    subdirectory, the plan cache its ``plans/`` (``Options.cache_dir``)."""
    if cache_dir is not None and os.fspath(cache_dir) != "":
        return Path(cache_dir).expanduser()
    base = os.environ.get("XDG_CACHE_HOME", "")
    if not os.path.isabs(base):
        base = Path.home() / ".cache"
    return Path(base) / "fusionstitching"
