"""The NVRTC disk cache is trusted only as far as the user's own files are ([Note: cache] in nvrtc.py):
one root, created 0700, refused when someone else could write it; entries checked field by field,
keyed by the whole toolchain, written atomically, pruned to a size limit. No GPU needed."""

import json
import logging
import os
import subprocess
import sys
import time

import pytest

pytest.importorskip("cuda.bindings.nvrtc")

from fusionstitching.codegen import nvrtc
from fusionstitching.codegen.nvrtc import cache_root, compile_cuda

KERNEL = """\
extern "C" __global__ void k(float* __restrict__ y, const float* __restrict__ x, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) y[i] = SCALE * x[i] + y[i];
}
"""


def source(scale: int = 2) -> str:
    """A small kernel; each ``scale`` is another source, so another entry."""
    return KERNEL.replace("SCALE", f"{scale}.0f")


def entries(root) -> list:
    return sorted((root / "nvrtc").glob("*.entry"))


def only_entry(root):
    (entry,) = entries(root)
    return entry


def split(entry) -> tuple[dict, bytes]:
    header, _, cubin = entry.read_bytes().partition(b"\n")
    return json.loads(header), cubin


@pytest.fixture
def warnings_of_the_cache(caplog):
    caplog.set_level(logging.WARNING, logger=nvrtc.logger.name)
    return caplog


# --- 1. one root, no environment variable ---


def test_entries_live_in_the_nvrtc_subdirectory_of_the_root(tmp_path):
    compile_cuda(source(), cache_dir=tmp_path)
    assert [p.name for p in tmp_path.iterdir()] == ["nvrtc"]
    assert len(entries(tmp_path)) == 1


def test_default_root_is_xdg_and_no_environment_variable_moves_it(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    monkeypatch.setenv("FUSIONSTITCHING_CACHE_DIR", str(tmp_path / "env"))
    assert cache_root(None) == tmp_path / "xdg" / "fusionstitching"
    first = compile_cuda(source(), cache_dir=None)
    assert len(entries(tmp_path / "xdg" / "fusionstitching")) == 1
    assert not (tmp_path / "env").exists()
    assert compile_cuda(source(), cache_dir=None).cached and not first.cached


# --- 2. a root only this user can write ---


def test_root_and_subdirectory_are_created_0700(tmp_path):
    root = tmp_path / "made" / "here"
    umask = os.umask(0o022)
    try:
        compile_cuda(source(), cache_dir=root)
    finally:
        os.umask(umask)
    assert (root.stat().st_mode & 0o777, (root / "nvrtc").stat().st_mode & 0o777) == (0o700, 0o700)
    assert only_entry(root).stat().st_mode & 0o777 == 0o600


@pytest.mark.parametrize("mode", [0o770, 0o720, 0o702, 0o777])
@pytest.mark.parametrize("where", ["root", "nvrtc"])
def test_directory_writable_by_others_is_neither_read_nor_written(where, mode, tmp_path, warnings_of_the_cache):
    compile_cuda(source(), cache_dir=tmp_path)
    entry = only_entry(tmp_path)
    before = entry.stat()
    (tmp_path if where == "root" else tmp_path / "nvrtc").chmod(mode)
    module = compile_cuda(source(), cache_dir=tmp_path)
    assert not module.cached  # a valid entry is there, but it is not loaded
    assert not compile_cuda(source(3), cache_dir=tmp_path).cached
    assert entries(tmp_path) == [entry] and entry.stat().st_mtime_ns == before.st_mtime_ns  # nothing written
    warnings = [r.getMessage() for r in warnings_of_the_cache.records if "not using the NVRTC cache" in r.getMessage()]
    assert len(warnings) == 1 and "writable by other users" in warnings[0]  # once per process


def test_root_owned_by_another_user_is_not_used(monkeypatch, tmp_path, warnings_of_the_cache):
    compile_cuda(source(), cache_dir=tmp_path)
    uid = os.getuid()
    monkeypatch.setattr(os, "getuid", lambda: uid + 1)
    assert not compile_cuda(source(), cache_dir=tmp_path).cached
    assert f"owned by uid {uid}" in warnings_of_the_cache.text


def test_root_that_is_a_file_is_not_used(tmp_path, warnings_of_the_cache):
    (tmp_path / "root").write_text("not a directory")
    assert not compile_cuda(source(), cache_dir=tmp_path / "root").cached
    assert "not a directory" in warnings_of_the_cache.text


@pytest.mark.parametrize("mode", [0o620, 0o602, 0o666])
def test_entry_writable_by_others_is_refused_and_replaced(mode, tmp_path, warnings_of_the_cache):
    good = compile_cuda(source(), cache_dir=tmp_path)
    only_entry(tmp_path).chmod(mode)
    again = compile_cuda(source(), cache_dir=tmp_path)
    assert not again.cached and again.cubin == good.cubin
    assert "refusing NVRTC cache entry" in warnings_of_the_cache.text
    assert only_entry(tmp_path).stat().st_mode & 0o777 == 0o600  # rewritten
    assert compile_cuda(source(), cache_dir=tmp_path).cached


def test_entry_owned_by_another_user_is_refused(monkeypatch, tmp_path, warnings_of_the_cache):
    compile_cuda(source(), cache_dir=tmp_path)
    real_fstat = os.fstat

    def fstat_of_someone_elses_file(fd):
        fields = list(real_fstat(fd))
        fields[4] = os.getuid() + 1  # st_uid
        return os.stat_result(fields)

    monkeypatch.setattr(os, "fstat", fstat_of_someone_elses_file)
    assert not compile_cuda(source(), cache_dir=tmp_path).cached
    assert "owned by uid" in warnings_of_the_cache.text


def test_symbolic_link_entry_is_refused(tmp_path, warnings_of_the_cache):
    compile_cuda(source(), cache_dir=tmp_path)
    entry = only_entry(tmp_path)
    target = tmp_path / "elsewhere.entry"
    entry.rename(target)
    entry.symlink_to(target)
    assert not compile_cuda(source(), cache_dir=tmp_path).cached
    assert "refusing NVRTC cache entry" in warnings_of_the_cache.text
    assert not entry.is_symlink()  # replaced by a real entry


# --- 3. an entry is data, checked field by field: any damage is a logged miss ---

VALID_REPORT = {"registers": 8, "shared_bytes": 0, "spill_stores": 0, "spill_loads": 0, "stack_bytes": 0,
                "constant_bytes": 0, "barriers": 0}
DAMAGED_HEADERS = {
    "resources_list": lambda h: {**h, "resources": []},
    "resources_string": lambda h: {**h, "resources": "k"},
    "report_list": lambda h: {**h, "resources": {"k": [1, 2]}},
    "report_string_count": lambda h: {**h, "resources": {"k": {**VALID_REPORT, "registers": "12"}}},
    "report_bool_count": lambda h: {**h, "resources": {"k": {**VALID_REPORT, "registers": True}}},
    "report_float_count": lambda h: {**h, "resources": {"k": {**VALID_REPORT, "registers": 1.5}}},
    "report_negative_count": lambda h: {**h, "resources": {"k": {**VALID_REPORT, "registers": -1}}},
    "report_missing_field": lambda h: {**h, "resources": {"k": {"registers": 8}}},
    "report_extra_field": lambda h: {**h, "resources": {"k": {**VALID_REPORT, "rce": 1}}},
    "log_not_string": lambda h: {**h, "log": ["ptxas"]},
    "format_string": lambda h: {**h, "format": str(h["format"])},
    "format_bool": lambda h: {**h, "format": True},
    "arch_other": lambda h: {**h, "arch": "sm_80"},
    "size_string": lambda h: {**h, "cubin_size": str(h["cubin_size"])},
    "hash_null": lambda h: {**h, "cubin_sha256": None},
    "extra_field": lambda h: {**h, "loader": "pickle"},
    "missing_field": lambda h: {k: v for k, v in h.items() if k != "log"},
    "header_list": lambda h: [h],
    "header_null": lambda h: None,
}


def _rewritten(entry, header: bytes, cubin: bytes) -> None:
    entry.write_bytes(header + b"\n" + cubin)  # the file keeps its mode 0600 and owner


def _assert_miss_then_repaired(tmp_path, good, caplog) -> None:
    again = compile_cuda(source(), cache_dir=tmp_path)  # no exception
    assert not again.cached and again.cubin == good.cubin
    assert "NVRTC cache entry" in caplog.text
    assert compile_cuda(source(), cache_dir=tmp_path).cached  # rewritten


@pytest.mark.parametrize("damage", sorted(DAMAGED_HEADERS))
def test_damaged_header_field_is_a_logged_miss(damage, tmp_path, warnings_of_the_cache):
    good = compile_cuda(source(), cache_dir=tmp_path)
    entry = only_entry(tmp_path)
    header, cubin = split(entry)
    _rewritten(entry, json.dumps(DAMAGED_HEADERS[damage](header)).encode(), cubin)
    _assert_miss_then_repaired(tmp_path, good, warnings_of_the_cache)


@pytest.mark.parametrize("header", [b"[" * 100_000, b'{"log": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",
                                    b"\xff\xfe\x00garbage", b"1" * 5000, b"NaN"],
                         ids=["nested_arrays", "nested_in_a_field", "not_utf8", "huge_integer", "nan"])
def test_unparsable_header_is_a_logged_miss(header, tmp_path, warnings_of_the_cache):
    good = compile_cuda(source(), cache_dir=tmp_path)
    entry = only_entry(tmp_path)
    _rewritten(entry, header, split(entry)[1])
    _assert_miss_then_repaired(tmp_path, good, warnings_of_the_cache)


def test_entry_renamed_to_another_key_is_a_miss(tmp_path, warnings_of_the_cache):
    compile_cuda(source(2), cache_dir=tmp_path)
    (two,) = entries(tmp_path)
    three = compile_cuda(source(3), cache_dir=tmp_path)
    (other,) = set(entries(tmp_path)) - {two}
    other.write_bytes(two.read_bytes())  # a valid entry, for the other source
    again = compile_cuda(source(3), cache_dir=tmp_path)
    assert not again.cached and again.cubin == three.cubin
    assert "key is" in warnings_of_the_cache.text


# --- 4. the key covers the whole toolchain ---


@pytest.fixture
def fresh_toolchain():
    """The toolchain versions are read once per process; these tests change them."""
    nvrtc._toolchain.cache_clear()
    yield
    nvrtc._toolchain.cache_clear()


@pytest.mark.parametrize("distribution", ["cuda-bindings", "nvidia-cuda-nvrtc"])
def test_key_changes_with_an_installed_version(distribution, monkeypatch, tmp_path, fresh_toolchain):
    import importlib.metadata

    compile_cuda(source(), cache_dir=tmp_path)
    real_version = importlib.metadata.version

    def upgraded(name):
        return "999.0.0" if name == distribution else real_version(name)

    monkeypatch.setattr(importlib.metadata, "version", upgraded)
    nvrtc._toolchain.cache_clear()
    assert not compile_cuda(source(), cache_dir=tmp_path).cached
    assert len(entries(tmp_path)) == 2


def test_key_changes_with_the_nvrtc_version(monkeypatch, tmp_path, fresh_toolchain):
    compile_cuda(source(), cache_dir=tmp_path)
    monkeypatch.setattr(nvrtc, "nvrtc_version", lambda: (99, 9))
    nvrtc._toolchain.cache_clear()
    assert not compile_cuda(source(), cache_dir=tmp_path).cached


# --- 5. atomic writes; temp files of killed writers are removed ---


def test_entry_is_written_to_a_0600_temp_file_and_renamed(monkeypatch, tmp_path):
    real_replace = os.replace
    renames = []

    def replace(src, dst):
        renames.append((os.stat(src).st_mode & 0o777, os.path.dirname(src) == os.path.dirname(dst), str(src)))
        real_replace(src, dst)

    monkeypatch.setattr(os, "replace", replace)
    umask = os.umask(0)
    try:
        compile_cuda(source(), cache_dir=tmp_path)
    finally:
        os.umask(umask)
    ((mode, same_directory, name),) = renames
    assert mode == 0o600 and same_directory and name.endswith(".tmp")
    assert not list((tmp_path / "nvrtc").glob("*.tmp"))


def _dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def test_stale_temp_files_are_removed_on_first_use(tmp_path):
    directory = tmp_path / "nvrtc"
    directory.mkdir(mode=0o700)
    host = nvrtc._host_tag()
    other_host = "0" * 8 if host != "0" * 8 else "1" * 8
    names = {
        "old": ".0123456789abcdef.x.tmp",
        "dead_writer": f".0123456789abcdef.{host}.{_dead_pid()}.abc_12.tmp",
        "live_writer": f".0123456789abcdef.{host}.{os.getpid()}.abc_12.tmp",
        "other_host": f".0123456789abcdef.{other_host}.{_dead_pid()}.abc_12.tmp",
        "not_ours": "notes.txt",
    }
    for name in names.values():
        (directory / name).write_bytes(b"partial")
    hour_ago = time.time() - 2 * 3600
    os.utime(directory / names["old"], (hour_ago, hour_ago))
    compile_cuda(source(), cache_dir=tmp_path)
    left = {kind for kind, name in names.items() if (directory / name).exists()}
    assert left == {"live_writer", "other_host", "not_ours"}


# --- 6. pruned to cache_max_bytes, least recently used first, not on hits ---


def _age(entry, seconds: float) -> None:
    when = time.time() - seconds
    os.utime(entry, (when, when))


def test_prune_deletes_least_recently_used_entries_first(tmp_path):
    limit = 1 << 30
    paths = {}
    for scale in (2, 3, 4):
        before = set(entries(tmp_path))
        compile_cuda(source(scale), cache_dir=tmp_path, cache_max_bytes=limit)
        (paths[scale],) = set(entries(tmp_path)) - before
    for scale, seconds in ((2, 300), (3, 200), (4, 100)):
        _age(paths[scale], seconds)
    assert compile_cuda(source(2), cache_dir=tmp_path, cache_max_bytes=limit).cached  # a hit: 2 is now newest
    limit = int(sum(p.stat().st_size for p in entries(tmp_path)) / 0.85)  # three entries fit, four do not
    compile_cuda(source(5), cache_dir=tmp_path, cache_max_bytes=limit)
    left = set(entries(tmp_path))
    assert paths[3] not in left and {paths[2], paths[4]} <= left and len(left) == 3
    assert sum(p.stat().st_size for p in left) <= 0.9 * limit  # pruned below the limit, to leave room


def test_a_cache_over_the_limit_is_pruned_when_a_process_first_uses_it(monkeypatch, tmp_path):
    compile_cuda(source(2), cache_dir=tmp_path)
    (two,) = entries(tmp_path)
    compile_cuda(source(3), cache_dir=tmp_path)
    (three,) = set(entries(tmp_path)) - {two}
    _age(two, 100)
    monkeypatch.setattr(nvrtc, "_caches", {})  # as a new process
    limit = int(three.stat().st_size / 0.85)  # one entry fits, two do not
    assert compile_cuda(source(3), cache_dir=tmp_path, cache_max_bytes=limit).cached
    assert entries(tmp_path) == [three]


def test_hits_and_small_writes_do_not_scan_the_directory(monkeypatch, tmp_path):
    compile_cuda(source(2), cache_dir=tmp_path)  # the first use scans
    scans = []
    real_scan = nvrtc._NvrtcCache._scan
    monkeypatch.setattr(nvrtc._NvrtcCache, "_scan", lambda self: scans.append(1) or real_scan(self))
    for _ in range(20):
        assert compile_cuda(source(2), cache_dir=tmp_path).cached
    compile_cuda(source(3), cache_dir=tmp_path)
    assert scans == []
    compile_cuda(source(4), cache_dir=tmp_path, cache_max_bytes=1)  # over the limit: scan and prune
    assert scans == [1] and entries(tmp_path) == []


def test_negative_limit_is_rejected(tmp_path):
    with pytest.raises(ValueError, match="cache_max_bytes"):
        compile_cuda(source(), cache_dir=tmp_path, cache_max_bytes=-1)


# --- 7. the cache root is a parameter of the precompile path ---


def test_precompile_uses_the_cache_root_it_is_given(monkeypatch, tmp_path):
    from fusionstitching.fusion import explore
    from fusionstitching.graph.graph import GraphBuilder
    from fusionstitching.graph.ops import DType
    from fusionstitching.pipeline import compile_plan
    from fusionstitching.runtime import kernel_call

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "default"))
    b = GraphBuilder("cache_root")
    x = b.parameter((64, 32), DType.F32, "x")
    y = b.parameter((64, 32), DType.F32, "y")
    total = b.reduce(b.unary("exp", b.binary("mul", x, y)), [1], "sum")
    compiled = compile_plan(explore(b.build([total])))
    assert compiled.kernels
    kernel_call.precompile(compiled.kernels, "sm_90", cache_dir=tmp_path / "mine", cache_max_bytes=1 << 20)
    assert len(entries(tmp_path / "mine")) == len({k.cuda_source for k in compiled.kernels})
    assert not (tmp_path / "default").exists()
