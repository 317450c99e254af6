"""Runtime: compile generated CUDA C with NVRTC and launch it.

``nvrtc.py`` compiles to CUBIN (no GPU needed) with a per-user disk cache; ``driver.py`` binds the
few CUDA driver calls the launcher makes. Nothing here imports ``cuda.bindings`` or opens the
driver library at import time, so the rest of the package works without them.
"""
