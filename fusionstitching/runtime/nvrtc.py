"""Compile generated CUDA C to CUBIN with NVRTC, with a per-user disk cache.

NVRTC comes from the pip packages ``cuda-bindings`` (Python API) and ``nvidia-cuda-nvrtc``
(the library); both work without a GPU. ``cuda.bindings`` is imported inside functions
only, so the rest of the package imports without it.

[Note: options] Every compile passes ``--gpu-architecture=<arch>`` (a real ``sm_XX``, so
NVRTC emits SASS in a CUBIN, not PTX), ``--std=c++17`` (NVRTC's default today, pinned so a
toolkit update does not change the language) and ``-Xptxas=-v`` (for the resource report,
below). Nothing else: the generated sources include no headers (f16/bf16 are stored as
``unsigned short`` and converted with inline PTX), so no include paths and no
``-default-device`` are needed. Caller ``options`` are appended after these.

[Note: resource reports] With ``-Xptxas=-v`` NVRTC returns ptxas's verbose report in the
program log even for CUBIN output, so no ELF parsing, GPU or nvcc is needed. Per entry:
    ptxas info    : Compiling entry function 'k' for 'sm_90'
    ptxas info    : Function properties for k
    ptxas         .     256 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
    ptxas info    : Used 32 registers, used 1 barriers, 256 bytes cumulative stack size,
                    512 bytes smem, 372 bytes cmem[0]
``shared_bytes`` is static shared memory; ``stack_bytes`` is the cumulative stack size
(the entry's own frame plus callees') when given, else the entry's frame; spills are the
entry's own; ``constant_bytes`` sums all ``cmem[N]`` banks (sm_90 reports none for
kernel parameters). Fields ptxas does not print are 0. Keys are the names ptxas prints,
i.e. the lowered (mangled unless ``extern "C"``) names that ``cuModuleGetFunction`` takes.

[Note: cache] Key: sha256 of (source, full option list including the arch, NVRTC
version, cache format). One file per entry, ``<key>.entry``: a one-line JSON header (arch,
log, reports, cubin size and sha256) then the raw CUBIN bytes. Written to a temp file in
the same directory and ``os.replace``d, so readers never see a partial entry; an entry
that does not parse or whose CUBIN does not match its hash is ignored and rewritten.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import logging
import os
import re
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger(__name__)

DEFAULT_OPTIONS: tuple[str, ...] = ("--std=c++17", "-Xptxas=-v")
_CACHE_FORMAT = 1
_INSTALL_HINT = "install the pip packages `cuda-bindings` and `nvidia-cuda-nvrtc`"


class NvrtcError(RuntimeError):
    """NVRTC rejected a program; the message shows the numbered source and the NVRTC log."""

    def __init__(self, message: str, *, log: str = "", arch: str = "", options: Sequence[str] = ()):
        super().__init__(message)
        self.log = log
        self.arch = arch
        self.options = tuple(options)


@dataclass(frozen=True)
class ResourceReport:
    """What ptxas reports for one kernel (see [Note: resource reports])."""

    registers: int = 0
    shared_bytes: int = 0
    spill_stores: int = 0
    spill_loads: int = 0
    stack_bytes: int = 0
    constant_bytes: int = 0
    barriers: int = 0


@dataclass(frozen=True)
class CompiledModule:
    cubin: bytes
    arch: str
    resources: dict[str, ResourceReport]
    log: str
    cached: bool


def _nvrtc():
    try:
        from cuda.bindings import nvrtc
    except ImportError as exc:
        raise ImportError(f"NVRTC is not available ({exc}); {_INSTALL_HINT}") from exc
    return nvrtc


def _check(result: tuple, what: str) -> list:
    """Unpack a cuda-bindings ``(status, *values)`` tuple, raising on a bad status."""
    status, *values = result
    if status != _nvrtc().nvrtcResult.NVRTC_SUCCESS:
        raise NvrtcError(f"{what} failed: {status.name}")
    return values


@functools.cache
def nvrtc_version() -> tuple[int, int]:
    """(major, minor) of the loaded NVRTC library."""
    nvrtc = _nvrtc()
    try:
        result = nvrtc.nvrtcVersion()
    except Exception as exc:  # the library is loaded on first call; its absence surfaces here
        raise ImportError(f"cannot load the NVRTC library ({exc}); {_INSTALL_HINT}") from exc
    major, minor = _check(result, "nvrtcVersion")
    return (int(major), int(minor))


@functools.cache
def _supported_numbers() -> tuple[int, ...]:
    nvrtc_version()  # turns a missing library into the ImportError above
    (numbers,) = _check(_nvrtc().nvrtcGetSupportedArchs(), "nvrtcGetSupportedArchs")
    return tuple(int(n) for n in numbers)


def supported_archs() -> list[str]:
    """Real architectures this NVRTC can emit CUBIN for, e.g. ``["sm_75", "sm_80", ...]``."""
    return [f"sm_{n}" for n in _supported_numbers()]


def _check_arch(arch: str) -> None:
    match = re.fullmatch(r"sm_(\d+)[af]?", arch)  # sm_90a / sm_100f: arch-specific variants
    if match is None or int(match[1]) not in _supported_numbers():
        raise ValueError(
            f"NVRTC {nvrtc_version()} cannot compile for {arch!r}; supported: {supported_archs()}"
        )


CACHE_VARIABLE = "FUSIONSTITCHING_CACHE_DIR"


def default_cache_dir() -> Path:
    """``$FUSIONSTITCHING_CACHE_DIR`` if set, else ``fusionstitching/nvrtc`` in the user's cache directory."""
    if os.environ.get(CACHE_VARIABLE):
        return Path(os.environ[CACHE_VARIABLE])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "fusionstitching" / "nvrtc"


def compile_cuda(
    source: str,
    arch: str = "sm_90",
    options: Sequence[str] = (),
    *,
    name: str = "kernel.cu",
    cache_dir: Path | None = None,
) -> CompiledModule:
    """Compile ``source`` to a CUBIN for ``arch``, served from the disk cache when possible."""
    if isinstance(options, str):
        raise TypeError("options must be a sequence of strings, not one string")
    _check_arch(arch)
    all_options = [f"--gpu-architecture={arch}", *DEFAULT_OPTIONS, *options]
    path = Path(cache_dir or default_cache_dir()) / f"{_cache_key(source, all_options)}.entry"
    hit = _read_entry(path, arch)
    if hit is not None:
        return hit
    start = time.perf_counter()
    cubin, log = _compile(source, name, arch, all_options)
    logger.debug("NVRTC compiled %s for %s in %.1f ms", name, arch, 1e3 * (time.perf_counter() - start))
    module = CompiledModule(cubin, arch, parse_ptxas_info(log), log, cached=False)
    _write_entry(path, module)
    return module


def _compile(source: str, name: str, arch: str, options: list[str]) -> tuple[bytes, str]:
    nvrtc = _nvrtc()
    (program,) = _check(
        nvrtc.nvrtcCreateProgram(source.encode(), name.encode(), 0, [], []), "nvrtcCreateProgram"
    )
    try:
        (status,) = nvrtc.nvrtcCompileProgram(program, len(options), [o.encode() for o in options])
        (log_size,) = _check(nvrtc.nvrtcGetProgramLogSize(program), "nvrtcGetProgramLogSize")
        log_buffer = bytearray(log_size)
        _check(nvrtc.nvrtcGetProgramLog(program, log_buffer), "nvrtcGetProgramLog")
        log = log_buffer.decode(errors="replace").rstrip("\x00").strip()
        if status != nvrtc.nvrtcResult.NVRTC_SUCCESS:
            message = _error_message(source, name, arch, options, status.name, log)
            raise NvrtcError(message, log=log, arch=arch, options=options)
        (size,) = _check(nvrtc.nvrtcGetCUBINSize(program), "nvrtcGetCUBINSize")
        cubin = bytearray(size)
        _check(nvrtc.nvrtcGetCUBIN(program, cubin), "nvrtcGetCUBIN")
    finally:
        nvrtc.nvrtcDestroyProgram(program)
    return bytes(cubin), log


def numbered_source(source: str, marked: frozenset[int] = frozenset()) -> str:
    """The source with width-aligned line numbers; lines in ``marked`` start with '>'."""
    lines = source.splitlines()
    width = len(str(len(lines)))
    rows = []
    for number, line in enumerate(lines, start=1):
        mark = ">" if number in marked else " "
        rows.append(f"{mark} {number:>{width}} | {line}")
    return "\n".join(rows)


def _error_message(source: str, name: str, arch: str, options: list[str], status: str, log: str) -> str:
    error_lines = frozenset(int(n) for n in re.findall(rf"{re.escape(name)}\((\d+)\): error", log))
    return (
        f"NVRTC failed to compile {name} for {arch} ({status})\n"
        f"options: {' '.join(options)}\n"
        f"--- source ---\n{numbered_source(source, error_lines)}\n"
        f"--- NVRTC log ---\n{log}"
    )


_ENTRY = re.compile(r"Compiling entry function '([^']+)'")
_PROPERTIES = re.compile(r"Function properties for (\S+)")
_FRAME = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_USED = re.compile(r"Used (\d+) registers")
_USED_FIELDS = {
    "barriers": re.compile(r"used (\d+) barriers"),
    "shared_bytes": re.compile(r"(\d+) bytes smem"),
    "stack_bytes": re.compile(r"(\d+) bytes cumulative stack size"),
}
_CMEM = re.compile(r"(\d+) bytes cmem\[\d+\]")


def parse_ptxas_info(log: str) -> dict[str, ResourceReport]:
    """Per-entry resource reports from ptxas ``-v`` output (see [Note: resource reports])."""
    used: dict[str, dict[str, int]] = {}
    frames: dict[str, dict[str, int]] = {}
    entry = properties_of = None
    for line in log.splitlines():
        if match := _ENTRY.search(line):
            entry = match[1]
        elif match := _PROPERTIES.search(line):
            properties_of = match[1]
        elif (match := _FRAME.search(line)) and properties_of is not None:
            stack, stores, loads = (int(g) for g in match.groups())
            frames[properties_of] = {"stack_bytes": stack, "spill_stores": stores, "spill_loads": loads}
        elif (match := _USED.search(line)) and entry is not None:
            fields = {"registers": int(match[1]), "constant_bytes": sum(map(int, _CMEM.findall(line)))}
            for field, pattern in _USED_FIELDS.items():
                if found := pattern.search(line):
                    fields[field] = int(found[1])
            used[entry] = fields
    return {name: ResourceReport(**{**frames.get(name, {}), **fields}) for name, fields in used.items()}


def _cache_key(source: str, options: list[str]) -> str:
    payload = json.dumps([_CACHE_FORMAT, source, options, nvrtc_version()])
    return hashlib.sha256(payload.encode()).hexdigest()


def _read_entry(path: Path, arch: str) -> CompiledModule | None:
    try:
        header, _, cubin = path.read_bytes().partition(b"\n")
        meta = json.loads(header)
        if meta["format"] != _CACHE_FORMAT or meta["arch"] != arch:
            raise ValueError("format or arch mismatch")
        if len(cubin) != meta["cubin_size"] or hashlib.sha256(cubin).hexdigest() != meta["cubin_sha256"]:
            raise ValueError("CUBIN does not match its hash")
        resources = {name: ResourceReport(**fields) for name, fields in meta["resources"].items()}
        log = str(meta["log"])
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError) as exc:
        logger.warning("ignoring corrupt NVRTC cache entry %s: %s", path, exc)
        return None
    return CompiledModule(cubin, arch, resources, log, cached=True)


def _write_entry(path: Path, module: CompiledModule) -> None:
    meta = {
        "format": _CACHE_FORMAT,
        "arch": module.arch,
        "log": module.log,
        "resources": {name: dataclasses.asdict(r) for name, r in module.resources.items()},
        "cubin_size": len(module.cubin),
        "cubin_sha256": hashlib.sha256(module.cubin).hexdigest(),
    }
    temp = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, temp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.stem[:16]}.", suffix=".tmp")
        with os.fdopen(fd, "wb") as file:
            file.write(json.dumps(meta).encode() + b"\n" + module.cubin)
        os.replace(temp, path)
    except OSError as exc:  # a cache that cannot be written only costs a recompile next time
        logger.warning("cannot write NVRTC cache entry %s: %s", path, exc)
        if temp is not None and os.path.exists(temp):
            os.unlink(temp)
