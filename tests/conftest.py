import pathlib
import sys

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

_CAPTURE_ROWS = pytest.StashKey[list]()


@pytest.fixture
def capture_table(request):
    """Rows of the workload capture table, printed at the end of the test run."""
    return request.config.stash.setdefault(_CAPTURE_ROWS, [])


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    rows = config.stash.get(_CAPTURE_ROWS, [])
    if rows:
        from fusionstitching.cli import format_table

        terminalreporter.write_sep("-", "captured workloads")
        terminalreporter.write_line(format_table(rows))


@pytest.fixture(autouse=True)
def strict_compiles(monkeypatch):
    """The project's own tests compile in strict mode: an internal error fails the test instead of
    falling back to PyTorch. A test of the fallback path passes ``options={"strict": False}``."""
    import dataclasses

    from fusionstitching import backend

    plain = backend._options

    def strict(options):
        if options is None:
            return dataclasses.replace(plain(None), strict=True)
        if isinstance(options, dict) and "strict" not in options:  # other options, strict all the same
            return plain({**options, "strict": True})
        return plain(options)

    monkeypatch.setattr(backend, "_options", strict)


@pytest.fixture(autouse=True)
def planned_afresh(monkeypatch, request):
    """The project's tests explore every graph they compile: no plan is read from, or written to,
    the plan cache of an earlier run (``fusion/plan_cache.py``), except in tests marked
    ``plan_cache``, which give their own cache directories."""
    if request.node.get_closest_marker("plan_cache") is None:
        from fusionstitching.fusion import plan_cache

        monkeypatch.setattr(plan_cache, "key", lambda *args, **kwargs: None)  # no key: neither read nor written


@pytest.fixture(autouse=True)
def explored_here(monkeypatch, request):
    """The project's tests explore every graph in their own process, where their patches of the
    planner apply: no graph is sent to the worker process that explores ahead or alongside
    (``fusion/background.py``), except in tests marked ``explore_ahead``."""
    if request.node.get_closest_marker("explore_ahead") is None:
        from fusionstitching.fusion import background

        monkeypatch.setattr(background, "submit", lambda *args, **kwargs: False)
        monkeypatch.setattr(background, "submit_unsplit", lambda *args, **kwargs: None)
        monkeypatch.setattr(background, "start", lambda: None)
