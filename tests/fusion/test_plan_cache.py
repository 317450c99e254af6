"""``fusion/plan_cache.py``: a graph planned once is read back, in this process or another, with
the same kernels; other settings or code miss; a damaged entry is planned again; the size bound."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from fusionstitching.fusion import plan_cache
from fusionstitching.graph import reference
from fusionstitching.options import Options
from fusionstitching.pipeline import compile_graph

pytestmark = pytest.mark.plan_cache
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def graph():
    """LayerNorm's backward: several kernels, reductions, a layout the explorer rewrites."""
    from fusionstitching.cli import capture_workload

    _, captured = capture_workload("layernorm", train=True)
    return captured.backward


def _refuse_exploring(monkeypatch):
    from fusionstitching import pipeline

    def explore(*args, **kwargs):
        raise AssertionError("explored a graph whose plan is cached")

    monkeypatch.setattr(pipeline, "explore", explore)


def _entries(cache: Path) -> list[Path]:
    return sorted((cache / "plans").glob("*/*.json"))


def _same_plans(a, b) -> None:
    assert [(p.nodes, str(p.schedule), p.score, p.origin) for p in a.patterns] == \
        [(p.nodes, str(p.schedule), p.score, p.origin) for p in b.patterns]
    assert a.library == b.library and a.views == b.views and a.estimated_us == b.estimated_us
    assert a.graph.to_json() == b.graph.to_json() and a.graph.checks == b.graph.checks


def test_a_second_compile_reads_the_plan_and_generates_the_same_kernels(graph, tmp_path, monkeypatch):
    options = Options(cache_dir=str(tmp_path), strict=True)
    first = compile_graph(graph, options)
    assert len(_entries(tmp_path)) == 1
    import fusionstitching

    hits = fusionstitching.stats()["plan cache hits"]
    _refuse_exploring(monkeypatch)
    second = compile_graph(graph, options)
    assert fusionstitching.stats()["plan cache hits"] == hits + 1
    _same_plans(first.plan, second.plan)
    assert [k.cuda_source for k in second.kernels] == [k.cuda_source for k in first.kernels]
    assert second.plan.notes[:-1] == first.plan.notes and "plan cache" in second.plan.notes[-1]
    assert second.plan.unfused == first.plan.unfused  # worked out from the cached plan on demand
    rng = np.random.default_rng(0)
    inputs = [rng.standard_normal(p.shape).astype(p.dtype.numpy) for p in graph.parameters]
    for got, want in zip(second.run_numpy(inputs), reference.evaluate(graph, inputs)):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


def test_another_process_reads_the_plan(graph, tmp_path, monkeypatch):
    source = tmp_path / "graph.json"
    source.write_text(graph.to_json())
    script = ("import sys, warnings; warnings.simplefilter('ignore')\n"
              "from fusionstitching.graph.serialize import from_json\n"
              "from fusionstitching.options import Options\n"
              "from fusionstitching.pipeline import compile_graph\n"
              f"compile_graph(from_json(open({str(source)!r}).read()), Options(cache_dir={str(tmp_path)!r}, strict=True))\n")
    subprocess.run([sys.executable, "-c", script], check=True, env={**os.environ, "PYTHONPATH": str(ROOT)},
                   timeout=600)
    assert len(_entries(tmp_path)) == 1
    from fusionstitching.graph.serialize import from_json

    _refuse_exploring(monkeypatch)
    compiled = compile_graph(from_json(source.read_text()), Options(cache_dir=str(tmp_path), strict=True))
    assert "plan cache" in compiled.plan.notes[-1]


def test_other_options_solvers_or_code_plan_again(graph, tmp_path, monkeypatch):
    options = Options(cache_dir=str(tmp_path), strict=True)
    key = plan_cache.plan_key(graph, "ilp", ("deep",), options)
    assert plan_cache.plan_key(graph, "beam", ("deep",), options) != key
    assert plan_cache.plan_key(graph, "ilp", ("substitution",), options) != key
    assert plan_cache.plan_key(graph, "ilp", ("deep",), dataclasses.replace(options, channels_last=False)) != key
    # where the caches are is not what is planned
    assert plan_cache.plan_key(graph, "ilp", ("deep",), dataclasses.replace(options, cache_dir="elsewhere",
                                                                             cache_max_bytes=1)) == key
    monkeypatch.setattr(plan_cache, "planner_version", lambda: "other code")
    assert plan_cache.plan_key(graph, "ilp", ("deep",), options) != key


def test_a_damaged_entry_is_planned_again_and_replaced(graph, tmp_path):
    options = Options(cache_dir=str(tmp_path), strict=True)
    first = compile_graph(graph, options)
    [entry] = _entries(tmp_path)
    for damage in ("{not json", json.dumps({**json.loads(entry.read_text()), "patterns": [[["nowhere"], None, 0, "x"]]})):
        entry.write_text(damage)
        with pytest.warns(plan_cache.PlanCacheWarning, match="unusable"):
            again = compile_graph(graph, options)
        _same_plans(first.plan, again.plan)
        assert "plan cache" not in again.plan.notes[-1]
        assert plan_cache.load(plan_cache.key(graph, options.solver, _generators(), options), graph, options) is not None


def _generators():
    from fusionstitching.fusion.explore import DEFAULT_GENERATORS

    return DEFAULT_GENERATORS


def test_switched_off_it_neither_reads_nor_writes(graph, tmp_path, monkeypatch):
    options = Options(cache_dir=str(tmp_path), strict=True, cache_plans=False)
    compile_graph(graph, options)
    assert not (tmp_path / "plans").exists()
    compile_graph(graph, dataclasses.replace(options, cache_plans=True))
    assert len(_entries(tmp_path)) == 1
    explored = []
    from fusionstitching import pipeline

    real = pipeline.explore
    monkeypatch.setattr(pipeline, "explore", lambda *a, **k: explored.append(1) or real(*a, **k))
    compile_graph(graph, options)  # the entry exists, but is not read
    assert explored == [1]


def test_above_the_size_bound_the_least_recently_used_plans_go(graph, tmp_path):
    options = Options(cache_dir=str(tmp_path), strict=True)
    compile_graph(graph, options)
    [entry] = _entries(tmp_path)
    size = entry.stat().st_size
    os.utime(entry, (1, 1))  # long unused
    bounded = dataclasses.replace(options, cache_max_bytes=int(1.5 * size), channels_last=False)
    compile_graph(graph, bounded)  # a second entry: over the bound, the older one goes
    assert _entries(tmp_path) != [entry] and len(_entries(tmp_path)) == 1
    assert not entry.exists()


def test_the_directories_are_private_and_an_entry_of_another_user_is_not_read(graph, tmp_path, monkeypatch):
    options = Options(cache_dir=str(tmp_path / "root"), strict=True)
    compile_graph(graph, options)
    [entry] = _entries(tmp_path / "root")
    for directory in (tmp_path / "root", tmp_path / "root" / "plans", entry.parent):
        assert directory.stat().st_mode & 0o777 == 0o700
    monkeypatch.setattr(os, "getuid", lambda: entry.stat().st_uid + 1)
    with pytest.warns(plan_cache.PlanCacheWarning, match="not owned"):
        assert plan_cache.load(plan_cache.key(graph, options.solver, _generators(), options), graph, options) is None


def test_a_graph_that_cannot_be_keyed_is_planned_and_compiled_all_the_same(graph, tmp_path, monkeypatch):
    def refuse(*args, **kwargs):
        raise ValueError("not encodable")

    monkeypatch.setattr(plan_cache, "plan_key", refuse)
    with pytest.warns(plan_cache.PlanCacheWarning, match="cannot be keyed"):
        compiled = compile_graph(graph, Options(cache_dir=str(tmp_path), strict=True))
    assert compiled.kernels and not (tmp_path / "plans").exists()
