"""Runtime: compile generated CUDA C with NVRTC and launch it.

``nvrtc.py`` compiles to CUBIN (no GPU needed) with a per-user disk cache. Nothing here
imports ``cuda.bindings`` at import time, so the rest of the package works without it.
"""
