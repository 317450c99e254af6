"""Compile generated CUDA C to CUBIN with NVRTC, with a per-user disk cache.

NVRTC comes from the pip packages ``cuda-bindings`` (Python API) and ``nvidia-cuda-nvrtc``
(the library); both work without a GPU. ``cuda.bindings`` is imported inside functions
only, so the rest of the package imports without it.

[Note: options] Every compile passes ``--gpu-architecture=<arch>`` (a real ``sm_XX``, so
NVRTC emits SASS in a CUBIN, not PTX), ``--std=c++17`` (NVRTC's default today, pinned so a
toolkit update does not change the language), ``--fmad=false`` and ``-Xptxas=-v`` (for the
resource report, below). Without contraction every ``a * b + c`` of a kernel rounds the product as
eager's separate ops do and as the simulator and the reference compute it; a value recomputed in
another kernel then has the same bits wherever the compiler would have contracted it in one place
and not in the other (the deviation of a one-element row from its mean was not 0, and a variance
of 0/0 came out inf). Library code keeps its explicit fused multiply-adds. Nothing else: the generated sources include no headers (f16/bf16 are stored as
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

[Note: cache] A CUBIN read from the cache is loaded into the GPU and run, so the cache is
trusted only as far as the user's own files are; every rule below is about that.
- Where: ``cache_root(cache_dir)`` is the one root of all of the package's caches
  (``Options.cache_dir``; default ``$XDG_CACHE_HOME/fusionstitching``); NVRTC's entries are
  in its ``nvrtc/`` subdirectory. No environment variable moves it.
- Trust: the root and ``nvrtc/`` are created 0700. Each compile checks that both are
  directories owned by the current user and writable by no one else; if not, the cache is
  neither read nor written (one warning per process) and the source is compiled. An entry
  is opened without following links and used only if it is a regular file owned by the user
  and writable by no one else; otherwise it is a miss (logged) and is replaced.
- Key: sha256 of (format, arch, full option list, source, toolchain), where the toolchain is
  NVRTC's ``nvrtcVersion`` and the installed versions of ``cuda-bindings`` and the NVRTC
  wheel: a CUBIN is reused only from the same compiler.
- Entry: ``<key>.entry`` is a one-line JSON header (format, key, arch, log, resources, CUBIN
  size and sha256) and then the raw CUBIN bytes; nothing is unpickled. Every header field is
  checked for its exact JSON type and value (the key and arch asked for; the CUBIN's size and
  hash), so a damaged, foreign or renamed entry is a logged miss, never an exception.
- Writes: to a temp file made 0600 by ``mkstemp`` in ``nvrtc/`` and then ``os.replace``d, so
  readers see a whole entry or none. No fsync: a write lost in a crash leaves a truncated
  entry, which fails its hash. A temp file's name holds its writer's host and pid; temp files
  older than an hour, or from a process of this host that no longer runs, are removed when a
  process first uses the directory and at each pruning.
- Compiling once: a process that misses an entry compiles it holding an advisory lock on
  ``<key>.lock``; another process (the other ranks of a data-parallel job) or thread that misses
  the same key waits for the lock and then reads the entry. Lock files older than an hour are
  removed with stale temp files.
- Size: above ``cache_max_bytes`` the entries least recently written or hit (a hit touches
  its mtime) are deleted until the cache is at 90% of the limit, so the next writes do not
  prune again. A process scans the directory when it first uses it, then keeps a running
  total of what it writes and scans again when that total passes the limit or every 64
  writes (other processes write too); a hit never scans.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import importlib.metadata
import json
import logging
import os
import re
import socket
import stat
import tempfile
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from fusionstitching.options import Options, cache_root

logger = logging.getLogger(__name__)

DEFAULT_OPTIONS: tuple[str, ...] = ("--std=c++17", "--fmad=false", "-Xptxas=-v")
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


def compile_cuda(
    source: str,
    arch: str = "sm_90",
    options: Sequence[str] = (),
    *,
    name: str = "kernel.cu",
    cache_dir: str | os.PathLike | None = None,
    cache_max_bytes: int = Options.cache_max_bytes,
) -> CompiledModule:
    """Compile ``source`` to a CUBIN for ``arch``, served from the disk cache when possible.

    ``cache_dir`` is the cache root (``Options.cache_dir``; None: ``cache_root``'s default) and
    ``cache_max_bytes`` the NVRTC cache's size limit (``Options.cache_max_bytes``); see
    [Note: cache]."""
    if isinstance(options, str):
        raise TypeError("options must be a sequence of strings, not one string")
    if cache_max_bytes < 0:
        raise ValueError(f"cache_max_bytes must be >= 0, got {cache_max_bytes}")
    _check_arch(arch)
    all_options = [f"--gpu-architecture={arch}", *DEFAULT_OPTIONS, *options]
    key = _cache_key(source, arch, all_options)
    cache = _open_cache(cache_root(cache_dir), cache_max_bytes)
    if cache is None:
        return _compile_module(source, name, arch, all_options)
    hit = cache.read(key, arch)
    if hit is not None:
        return hit
    with cache.compiling(key):
        hit = cache.read(key, arch)  # written meanwhile by the process that held the lock
        if hit is not None:
            return hit
        module = _compile_module(source, name, arch, all_options)
        cache.write(key, module, cache_max_bytes)
    return module


def _compile_module(source: str, name: str, arch: str, options: list[str]) -> CompiledModule:
    start = time.perf_counter()
    cubin, log = _compile(source, name, arch, options)
    logger.debug("NVRTC compiled %s for %s in %.1f ms", name, arch, 1e3 * (time.perf_counter() - start))
    return CompiledModule(cubin, arch, parse_ptxas_info(log), log, cached=False)


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


# --- the disk cache (see [Note: cache]) ---

_CACHE_FORMAT = 2
_NVRTC_SUBDIRECTORY = "nvrtc"
_NVRTC_WHEELS = ("nvidia-cuda-nvrtc", "nvidia-cuda-nvrtc-cu13", "nvidia-cuda-nvrtc-cu12", "nvidia-cuda-nvrtc-cu11")
_KEY = re.compile(r"[0-9a-f]{64}")
_MAX_HEADER_BYTES = 1 << 20
_STALE_TEMP_SECONDS = 3600
_PRUNE_TO = 0.9  # of cache_max_bytes
_RESCAN_WRITES = 64
_HEADER_TYPES = {
    "format": int, "key": str, "arch": str, "log": str, "resources": dict, "cubin_size": int, "cubin_sha256": str,
}
_REPORT_FIELDS = frozenset(f.name for f in dataclasses.fields(ResourceReport))


@functools.cache
def _toolchain() -> tuple[str, ...]:
    """The compiler a CUBIN comes from, for the cache key: NVRTC's own version and the installed
    versions of cuda-bindings and of the NVRTC wheel (``nvrtcVersion`` gives no patch level)."""
    major, minor = nvrtc_version()
    parts = [f"nvrtc {major}.{minor}"]
    for distribution in ("cuda-bindings", *_NVRTC_WHEELS):
        try:
            parts.append(f"{distribution} {importlib.metadata.version(distribution)}")
        except importlib.metadata.PackageNotFoundError:
            pass
    if not any(part.startswith("cuda-bindings ") for part in parts):  # not installed as a distribution
        _nvrtc()  # the ImportError with the install hint, where it is missing
        import cuda.bindings

        parts.insert(1, f"cuda-bindings {getattr(cuda.bindings, '__version__', 'unknown')}")
    return tuple(parts)


def _cache_key(source: str, arch: str, options: list[str]) -> str:
    payload = json.dumps([_CACHE_FORMAT, arch, options, source, _toolchain()])
    return hashlib.sha256(payload.encode()).hexdigest()


class _CorruptEntry(ValueError):
    """A cache entry that is not one this module wrote for the key asked for."""


def _untrusted(status: os.stat_result) -> str | None:
    """Why a file or directory with this status may not be trusted, or None."""
    if not hasattr(os, "getuid"):
        return "on a platform without file owners to check"
    uid = os.getuid()
    if status.st_uid != uid:
        return f"owned by uid {status.st_uid}, not by this user (uid {uid})"
    if status.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return f"writable by other users (mode {stat.S_IMODE(status.st_mode):04o})"
    return None


def _untrusted_directory(path: Path) -> str | None:
    """Create ``path`` (mode 0700) if missing; why it may not hold the cache, or None."""
    try:
        status = os.stat(path)
    except FileNotFoundError:
        try:
            path.mkdir(mode=0o700, parents=True)
            os.chmod(path, 0o700)  # mkdir's mode passes through the umask
        except FileExistsError:
            pass  # another thread or process made it first; it is checked below
        except OSError as exc:
            return f"not creatable ({exc})"
        try:
            status = os.stat(path)
        except OSError as exc:
            return f"not readable ({exc})"
    except OSError as exc:
        return f"not readable ({exc})"
    if not stat.S_ISDIR(status.st_mode):
        return "not a directory"
    return _untrusted(status)


_warned: set[str] = set()
_warned_lock = threading.Lock()


def _warn_once(message: str) -> None:
    with _warned_lock:
        if message in _warned:
            return
        _warned.add(message)
    logger.warning("%s", message)


_caches: dict[Path, _NvrtcCache] = {}  # what this process knows of each cache directory
_caches_lock = threading.Lock()


def _open_cache(root: Path, max_bytes: int) -> _NvrtcCache | None:
    """The NVRTC cache under ``root``, or None (warned once) where it may not be used."""
    directory = root / _NVRTC_SUBDIRECTORY
    for path in (root, directory):
        reason = _untrusted_directory(path)
        if reason is not None:
            _warn_once(f"not using the NVRTC cache: {path} is {reason}; compiling without a cache")
            return None
    with _caches_lock:
        cache = _caches.get(directory)
        first_use = cache is None
        if first_use:
            cache = _caches[directory] = _NvrtcCache(directory)
    if first_use:
        cache.maintain(max_bytes)
    return cache


class _NvrtcCache:
    """One directory of ``<key>.entry`` files, and this process's running total of its size."""

    def __init__(self, directory: Path):
        self.directory = directory
        self.bytes_estimate = 0
        self.writes_since_scan = 0
        self.lock = threading.Lock()

    def read(self, key: str, arch: str) -> CompiledModule | None:
        path = self.directory / f"{key}.entry"
        flags = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0)
        try:
            fd = os.open(path, flags)
        except FileNotFoundError:
            return None
        except OSError as exc:  # ELOOP: a symbolic link
            logger.warning("refusing NVRTC cache entry %s: %s", path, exc)
            return None
        try:
            with os.fdopen(fd, "rb") as file:
                status = os.fstat(file.fileno())
                reason = "not a regular file" if not stat.S_ISREG(status.st_mode) else _untrusted(status)
                if reason is not None:
                    logger.warning("refusing NVRTC cache entry %s: it is %s", path, reason)
                    return None
                module = _parse_entry(file.read(), key, arch)
                if os.utime in os.supports_fd:
                    os.utime(file.fileno())  # the pruning order is least recently used first
        except _CorruptEntry as exc:
            logger.warning("ignoring NVRTC cache entry %s: %s", path, exc)
            return None
        except OSError as exc:
            logger.warning("cannot read NVRTC cache entry %s: %s", path, exc)
            return None
        return module

    @contextlib.contextmanager
    def compiling(self, key: str) -> Iterator[None]:
        """Held while ``key`` is compiled and written: another process (each rank of a
        data-parallel job compiles the same kernels) or thread that misses the same key waits,
        then reads the entry instead of compiling it again. An advisory lock (``flock``) on
        ``<key>.lock``, which the system releases if its holder dies; where no lock can be taken
        (no ``fcntl``, a link in the lock's place, a file system that refuses), compiling goes on
        unlocked, as without a cache."""
        try:
            import fcntl
        except ImportError:
            yield
            return
        path = self.directory / f"{key}.lock"
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0), 0o600)
        except OSError as exc:
            logger.warning("cannot lock NVRTC cache entry %s: %s", path, exc)
            yield
            return
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX)
            except OSError as exc:
                logger.warning("cannot lock NVRTC cache entry %s: %s", path, exc)
            yield
        finally:
            os.close(fd)  # releases the lock

    def write(self, key: str, module: CompiledModule, max_bytes: int) -> None:
        header = {
            "format": _CACHE_FORMAT,
            "key": key,
            "arch": module.arch,
            "log": module.log,
            "resources": {name: dataclasses.asdict(r) for name, r in module.resources.items()},
            "cubin_size": len(module.cubin),
            "cubin_sha256": hashlib.sha256(module.cubin).hexdigest(),
        }
        data = json.dumps(header).encode() + b"\n" + module.cubin
        path = self.directory / f"{key}.entry"
        temp = None
        try:
            prefix = f".{key[:16]}.{_host_tag()}.{os.getpid()}."
            fd, temp = tempfile.mkstemp(dir=self.directory, prefix=prefix, suffix=".tmp")  # mode 0600
            with os.fdopen(fd, "wb") as file:
                file.write(data)
            os.replace(temp, path)
            temp = None
        except OSError as exc:  # a cache that cannot be written only costs a recompile next time
            logger.warning("cannot write NVRTC cache entry %s: %s", path, exc)
            return
        finally:
            if temp is not None:
                _remove(Path(temp))
        with self.lock:
            self.bytes_estimate += len(data)
            self.writes_since_scan += 1
            due = self.bytes_estimate > max_bytes or self.writes_since_scan >= _RESCAN_WRITES
        if due:
            self.maintain(max_bytes)

    def maintain(self, max_bytes: int) -> None:
        """Remove stale temp files, measure the entries and prune them to the limit."""
        with self.lock:
            entries = self._scan()
            total = sum(size for _, size, _ in entries)
            if total > max_bytes:
                total = self._prune(entries, total, int(max_bytes * _PRUNE_TO))
            self.bytes_estimate = total
            self.writes_since_scan = 0

    def _scan(self) -> list[tuple[float, int, Path]]:
        """(mtime, size, path) of each entry; stale temp files are removed on the way."""
        now = time.time()
        entries = []
        try:
            with os.scandir(self.directory) as items:
                for item in items:
                    try:
                        status = item.stat(follow_symlinks=False)
                    except FileNotFoundError:
                        continue  # removed by another process meanwhile
                    if item.name.endswith(".tmp") and _stale_temp(item.name, status, now):
                        _remove(Path(item.path))
                    elif item.name.endswith(".lock") and now - status.st_mtime > _STALE_TEMP_SECONDS:
                        _remove(Path(item.path))  # a compile takes seconds: no one holds it any more
                    elif (item.name.endswith(".entry") and _KEY.fullmatch(item.name[: -len(".entry")])
                          and stat.S_ISREG(status.st_mode)):
                        entries.append((status.st_mtime, status.st_size, Path(item.path)))
        except OSError as exc:
            logger.warning("cannot list the NVRTC cache %s: %s", self.directory, exc)
        return entries

    def _prune(self, entries: list[tuple[float, int, Path]], total: int, target: int) -> int:
        removed = 0
        for _, size, path in sorted(entries):
            if total <= target:
                break
            _remove(path)
            total -= size
            removed += 1
        logger.debug("pruned %d NVRTC cache entries from %s; %d bytes left", removed, self.directory, total)
        return total


def _parse_entry(data: bytes, key: str, arch: str) -> CompiledModule:
    """The module in an entry's bytes; raises _CorruptEntry unless every field is as written."""
    newline = data.find(b"\n", 0, _MAX_HEADER_BYTES)
    if newline < 0:
        raise _CorruptEntry(f"no header line in its first {_MAX_HEADER_BYTES} bytes")
    cubin = data[newline + 1:]
    try:
        header = json.loads(data[:newline])
    except (ValueError, RecursionError) as exc:  # RecursionError: deeply nested arrays or objects
        raise _CorruptEntry(f"header is not JSON ({type(exc).__name__})") from None
    if type(header) is not dict or set(header) != set(_HEADER_TYPES):
        raise _CorruptEntry("header is not an object with the fields " + ", ".join(_HEADER_TYPES))
    for field, kind in _HEADER_TYPES.items():
        if type(header[field]) is not kind:  # exact: a JSON true is no int
            raise _CorruptEntry(f"{field} is a {type(header[field]).__name__}, not a {kind.__name__}")
    for field, expected in (("format", _CACHE_FORMAT), ("key", key), ("arch", arch), ("cubin_size", len(cubin))):
        if header[field] != expected:
            raise _CorruptEntry(f"{field} is {header[field]!r}, expected {expected!r}")
    if header["cubin_sha256"] != hashlib.sha256(cubin).hexdigest():
        raise _CorruptEntry("the CUBIN does not match its sha256")
    resources = {name: _parse_report(name, fields) for name, fields in header["resources"].items()}
    return CompiledModule(cubin, arch, resources, header["log"], cached=True)


def _parse_report(name: str, fields: object) -> ResourceReport:
    if type(fields) is not dict or set(fields) != _REPORT_FIELDS:
        raise _CorruptEntry(f"resources[{name!r}] is not an object with the fields " + ", ".join(sorted(_REPORT_FIELDS)))
    for field, value in fields.items():
        if type(value) is not int or value < 0:
            raise _CorruptEntry(f"resources[{name!r}].{field} is {value!r}, not a count")
    return ResourceReport(**fields)


@functools.cache
def _host_tag() -> str:
    """Eight hex digits naming this host in temp file names (a cache may be on a shared disk)."""
    return hashlib.sha256(socket.gethostname().encode()).hexdigest()[:8]


def _stale_temp(name: str, status: os.stat_result, now: float) -> bool:
    """A temp file left by a writer that was killed: old, or its writer on this host is gone.
    Names are ``.<key prefix>.<host tag>.<pid>.<random>.tmp``."""
    if now - status.st_mtime > _STALE_TEMP_SECONDS:
        return True
    parts = name[1: -len(".tmp")].split(".")
    if len(parts) != 4 or parts[1] != _host_tag() or not parts[2].isdigit() or int(parts[2]) <= 0:
        return False
    try:
        os.kill(int(parts[2]), 0)  # signal 0: only asks whether the process exists
    except ProcessLookupError:
        return True
    except OSError:  # PermissionError: it exists, as another user
        return False
    return False


def _remove(path: Path) -> None:
    try:
        path.unlink()
    except FileNotFoundError:
        pass
    except OSError as exc:
        logger.warning("cannot remove %s from the NVRTC cache: %s", path, exc)
