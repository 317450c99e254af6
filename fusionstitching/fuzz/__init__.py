"""The differential fuzzer (DESIGN.md "Verification tiers"): random torch programs compiled with
the fusionstitching backend and compared with eager PyTorch, every kernel of their plans simulated
against ``graph/reference.py``, failures shrunk to standalone reproducers.

    programs.py   Program: steps over symbolic shapes; its source text (what runs and what is saved)
    generate.py   program k of seed S: op families, odd sizes, dtypes, switchable special cases
    check.py      one program: eager vs torch.compile (strict), the plan check, tolerances
    coverage.py   op categories, shapes, composition schemes and kernel sizes over a run
    shrink.py     greedy shrinking of a failing program; the reproducer file
    run.py        the run: options in turn per program, failures saved, the report

``fusionstitching fuzz --count N [--seed S] [--device cpu|cuda]`` runs it (``cli.py``).
"""

from fusionstitching.fuzz.check import Config, Outcome, check
from fusionstitching.fuzz.generate import FEATURES, generate
from fusionstitching.fuzz.programs import Program, source
from fusionstitching.fuzz.run import CONFIGS, Settings, Summary, config_for, fuzz, report

__all__ = ["CONFIGS", "FEATURES", "Config", "Outcome", "Program", "Settings", "Summary", "check", "config_for",
           "fuzz", "generate", "report", "source"]
