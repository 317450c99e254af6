"""Plans kept on disk: a process that plans a graph another process planned already reads the plan.

Exploration is the largest part of a first call (seconds to tens of seconds for a model's
training graphs), and its result depends only on the graph, the options and the planner's code.
``compile_graph`` makes the ``key``, asks ``load`` before exploring and ``store``s what exploration found, so a
second process (a restarted training job, another rank, the next run of a script) skips
exploration; with the NVRTC cache (``codegen/nvrtc.py``) and the performance library
(``cost/perflib.py``) it then compiles nothing and measures nothing either.

- Key: a hash of the graph as JSON (names, shapes, dtypes, layouts, attributes, outputs), its
  check outputs, the solver, the generators, every option but the cache's own location and size,
  and the package's sources (``planner_version``): any change to the code is a new key, so a plan
  is never reused by code that would plan differently.
- Entry: ``<cache root>/plans/<key[:2]>/<key>.json`` holding the planned graph (exploration
  rewrites the graph: splits, padding, layouts) as ``graph.serialize`` JSON with its node origins
  and check count, and each kernel's nodes and template (``schedule.tune.canonical``: roots named
  by position), the library calls, the views, the notes and the estimate.
- The directories are created 0700, and an entry another user owns is not read. Writes go to a
  temporary file renamed over the entry, so a reader never sees half a plan and
  concurrent writers of one key leave one whole entry. An entry that does not parse or does not
  match its graph is ignored with a ``PlanCacheWarning`` and planned again (and overwritten).
- Size: above ``Options.cache_max_bytes`` the least recently used plans (a hit touches its file)
  are removed, oldest first, down to 90 %.
- ``Options(cache_plans=False)`` neither reads nor writes.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import os
import tempfile
import warnings
from collections.abc import Sequence
from pathlib import Path

from fusionstitching.fusion.plan import FusedPattern, FusionPlan, edge_reasons_of
from fusionstitching.graph.graph import Graph
from fusionstitching.graph.serialize import from_json
from fusionstitching.options import Options

FORMAT = 1
_PRUNE_TO = 0.9
# options that say where the caches are or where exploration runs, not what is planned
_LOCATION_OPTIONS = frozenset({"cache_dir", "cache_max_bytes", "explore_ahead"})
COUNTS = {"hits": 0, "stored": 0}


class PlanCacheWarning(UserWarning):
    """A stored plan could not be read or used; the graph is planned again."""


@functools.cache
def planner_version() -> str:
    """A hash of every source file of the package, in path order."""
    from fusionstitching.cost.perflib import generator_version

    return generator_version([Path(__file__).resolve().parent.parent])


def plan_key(graph: Graph, solver: str, generators: Sequence[str], options: Options) -> str:
    """The cache key of planning ``graph`` with these settings (see the module note)."""
    settings = {f.name: repr(getattr(options, f.name)) for f in dataclasses.fields(options)
                if f.name not in _LOCATION_OPTIONS}
    payload = json.dumps([FORMAT, planner_version(), graph.to_json(), graph.checks, solver, list(generators),
                          settings], sort_keys=True)
    return hashlib.sha256(payload.encode()).hexdigest()


def key(graph: Graph, solver: str, generators: Sequence[str], options: Options) -> str | None:
    """``plan_key`` where the cache is on, else None. None too (with a warning) for a graph the JSON
    encoding refuses: such a graph is planned every time, never keyed by less than all of it."""
    if not options.cache_plans:
        return None
    try:
        return plan_key(graph, solver, generators, options)
    except Exception as err:  # noqa: BLE001 -- the cache is an optimisation: it never fails a compile
        warnings.warn(f"plan cache: {graph.name} cannot be keyed ({type(err).__name__}: {err}); it is planned "
                      "every time", PlanCacheWarning, stacklevel=3)
        return None


def _directory(options: Options) -> Path:
    from fusionstitching.options import cache_root

    return cache_root(options.cache_dir) / "plans"


def _path(key: str, options: Options) -> Path:
    return _directory(options) / key[:2] / f"{key}.json"


def stored(key: str | None, options: Options) -> bool:
    """Whether an entry is stored under ``key`` (``load`` may still find it unusable)."""
    return key is not None and _path(key, options).is_file()


def load(key: str | None, graph: Graph, options: Options) -> FusionPlan | None:
    """The plan stored under ``key`` (``key(graph, ...)``), or None (no key, not stored, or
    unusable: warned)."""
    if key is None:
        return None
    path = _path(key, options)
    try:
        if path.stat().st_uid != os.getuid():  # what another user wrote decides no kernel of ours
            warnings.warn(f"plan cache: {path} is not owned by this user; planning {graph.name} again",
                          PlanCacheWarning, stacklevel=3)
            return None
        text = path.read_text()
    except FileNotFoundError:
        return None
    except OSError as err:
        warnings.warn(f"plan cache: cannot read {path} ({err}); planning {graph.name} again", PlanCacheWarning,
                      stacklevel=3)
        return None
    try:
        plan = decode(json.loads(text), key, options)
    except Exception as err:  # noqa: BLE001 -- any damage to the file means: plan again
        warnings.warn(f"plan cache: entry {path} is unusable ({type(err).__name__}: {err}); planning "
                      f"{graph.name} again", PlanCacheWarning, stacklevel=3)
        return None
    plan.graph.origins = {**graph.origins, **plan.graph.origins}
    try:
        os.utime(path)  # recently used: pruned last
    except OSError:
        pass
    COUNTS["hits"] += 1
    return plan


def store(key: str | None, graph: Graph, options: Options, plan: FusionPlan) -> None:
    """Keep ``plan``, ``graph``'s, under ``key`` for later processes (nothing without a key); a
    failure to write is warned about, never raised."""
    if key is None:
        return
    path = _path(key, options)
    try:
        text = json.dumps(encode(plan, key))
    except Exception as err:  # noqa: BLE001 -- a plan that cannot be written is planned again next time
        warnings.warn(f"plan cache: the plan of {graph.name} cannot be stored ({type(err).__name__}: {err})",
                      PlanCacheWarning, stacklevel=3)
        return
    try:
        path.parent.parent.parent.mkdir(parents=True, exist_ok=True, mode=0o700)  # the cache root
        for directory in (path.parent.parent, path.parent):  # plans/, plans/xx/
            directory.mkdir(exist_ok=True, mode=0o700)
        handle, temporary = tempfile.mkstemp(dir=path.parent, prefix=".tmp-", suffix=".json")
        try:
            with os.fdopen(handle, "w") as out:
                out.write(text)
            os.replace(temporary, path)
        except BaseException:
            Path(temporary).unlink(missing_ok=True)
            raise
    except OSError as err:
        warnings.warn(f"plan cache: cannot write {path} ({err}); the plan of {graph.name} is not kept",
                      PlanCacheWarning, stacklevel=3)
        return
    COUNTS["stored"] += 1
    _prune(_directory(options), options.cache_max_bytes)


def encode(plan: FusionPlan, key: str) -> dict:
    """``plan`` as the JSON-ready entry stored under ``key`` (the module note)."""
    from fusionstitching.schedule.tune import canonical

    graph = plan.graph
    patterns = []
    for pattern in plan.patterns:
        nodes = [graph.node(n) for n in pattern.nodes]
        template = canonical(pattern.schedule, nodes) if pattern.schedule is not None else None
        patterns.append([list(pattern.nodes), template, pattern.score, pattern.origin])
    return {"format": FORMAT, "key": key, "graph": graph.to_json(), "origins": graph.origins,
            "checks": graph.checks, "patterns": patterns, "library": plan.library, "views": plan.views,
            "strategy": plan.strategy, "notes": plan.notes, "estimated_us": plan.estimated_us,
            "seconds": plan.seconds}


def decode(entry: dict, key: str, options: Options, note: str | None = None) -> FusionPlan:
    """The plan of an ``encode``d entry stored under ``key``; ``note`` is added to its notes (default:
    that an earlier process explored it). Raises where the entry is not this version's or not whole."""
    from fusionstitching.schedule.tune import renamed

    if entry.get("format") != FORMAT or entry.get("key") != key:
        raise ValueError(f"format {entry.get('format')!r} or key differs from this version's")
    graph = from_json(entry["graph"])
    graph.origins = {str(k): str(v) for k, v in entry["origins"].items()}
    graph.checks = int(entry["checks"])
    patterns = []
    for names, template, score, origin in entry["patterns"]:
        nodes = [graph.node(n) for n in names]  # KeyError: a name the graph lacks
        schedule = renamed(template, nodes) if template is not None else None
        patterns.append(FusedPattern(tuple(names), schedule, float(score), str(origin)))
    library = {str(k): str(v) for k, v in entry["library"].items()}
    views = {str(k): str(v) for k, v in entry["views"].items()}
    placed = [n for p in patterns for n in p.nodes] + list(library) + list(views)
    unknown = [n for n in placed if n not in graph.index.by_name]
    if unknown or len(placed) != len(set(placed)):
        raise ValueError(f"nodes placed twice or not in the graph ({unknown[:3]})")
    plan = FusionPlan(graph, tuple(patterns), library, views, edge_reasons_of(graph, options, patterns, library, views),
                      str(entry["strategy"]), notes=[str(n) for n in entry["notes"]],
                      estimated_us=entry["estimated_us"])
    plan.seconds = float(entry["seconds"])
    plan.notes.append(note if note is not None else f"plan read from the plan cache (fusion/plan_cache.py), "
                      f"explored in {plan.seconds:.2f} s by an earlier process")
    return plan


def _prune(directory: Path, limit: int) -> None:
    """Remove the least recently used plans until the directory holds at most 90 % of ``limit``
    bytes, when it holds more than ``limit``."""
    try:
        entries = []
        for path in directory.glob("*/*.json"):
            stat = path.stat()
            entries.append((stat.st_mtime, stat.st_size, path))
    except OSError:
        return
    total = sum(size for _, size, _ in entries)
    if total <= limit:
        return
    for _, size, path in sorted(entries, key=lambda e: (e[0], str(e[2]))):
        if total <= _PRUNE_TO * limit:
            break
        try:
            path.unlink()
            total -= size
        except FileNotFoundError:
            total -= size
        except OSError:
            continue


__all__ = ["COUNTS", "PlanCacheWarning", "decode", "encode", "key", "load", "plan_key", "planner_version", "store", "stored"]
