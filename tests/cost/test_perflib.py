"""The performance library: storage, reuse across processes, concurrent writers, corrupt files."""

from __future__ import annotations

import subprocess
import sys
import warnings
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import pytest

from fusionstitching.cost.perflib import Measured, PerfLib, PerfLibWarning, entry_key, generator_version

ROOT = Path(__file__).resolve().parents[2]


def _measured(fast: str = "b") -> list[Measured]:
    times = {"a": 10.0, "b": 12.0, "c": 11.0}
    times[fast] = 5.0
    return [Measured(t, us, 32, 0, 8, rank) for rank, (t, us) in enumerate(times.items())]


def test_the_winner_is_the_fastest_and_the_model_choice_is_rank_0(tmp_path):
    library = PerfLib(tmp_path / "perflib.sqlite")
    winner = library.store("k1", _measured("b"), description="reduce", device="GPU", arch="sm_90", generator="g")
    assert (winner.template, winner.us, winner.model_template, winner.model_us) == ("b", 5.0, "a", 10.0)
    assert not winner.model_was_right
    again = PerfLib(tmp_path / "perflib.sqlite").winner("k1")
    assert (again.template, again.model_template, again.candidates, again.device) == ("b", "a", 3, "GPU")
    assert [m.template for m in library.measurements("k1")] == ["b", "a", "c"]
    assert library.winner("other") is None


def test_a_second_process_reads_what_the_first_stored(tmp_path):
    path = tmp_path / "perflib.sqlite"
    PerfLib(path).store("k1", _measured("c"))
    script = ("import sys\nfrom fusionstitching.cost.perflib import PerfLib\n"
              "print(PerfLib(sys.argv[1]).winner('k1').template)\n")
    out = subprocess.run([sys.executable, "-c", script, str(path)], capture_output=True, text=True, check=True,
                         cwd=ROOT, env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    assert out.stdout.split() == ["c"]


def _write_many(args) -> int:
    path, worker = args
    library = PerfLib(path)
    for k in range(25):
        library.store(f"w{worker}-{k}", _measured("a"))
    return worker


def test_concurrent_writers_lose_nothing(tmp_path):
    path = str(tmp_path / "perflib.sqlite")
    with warnings.catch_warnings():
        warnings.simplefilter("error", PerfLibWarning)
        with ProcessPoolExecutor(4) as pool:
            assert sorted(pool.map(_write_many, [(path, w) for w in range(4)])) == [0, 1, 2, 3]
    assert len(PerfLib(path).winners()) == 100


def test_a_corrupt_file_is_set_aside_with_a_warning_and_a_new_one_begun(tmp_path):
    path = tmp_path / "perflib.sqlite"
    path.write_bytes(b"this is not an SQLite database" * 100)
    library = PerfLib(path)
    with pytest.warns(PerfLibWarning, match="not a readable database"):
        assert library.winner("k1") is None
    assert any(p.name.startswith("perflib.sqlite.corrupt-") for p in tmp_path.iterdir())
    library.store("k1", _measured("b"))
    assert library.winner("k1").template == "b"


def test_an_unwritable_location_warns_and_reads_as_a_miss(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    library = PerfLib(blocker / "sub" / "perflib.sqlite")  # a directory under a file: cannot exist
    with pytest.warns(PerfLibWarning):
        assert library.winner("k") is None
    with pytest.warns(PerfLibWarning):
        library.store("k", _measured())


def test_prune_by_generator_device_and_age(tmp_path):
    library = PerfLib(tmp_path / "perflib.sqlite")
    library.store("old", _measured(), device="A", generator="g1")
    library.store("new", _measured(), device="B", generator="g2")
    assert library.prune(generator="g2") == 1
    assert [w.key for w in library.winners()] == ["new"]
    assert library.prune(device="B") == 1
    library.store("x", _measured(), generator="g2")
    assert library.prune(older_than_s=3600) == 0
    assert library.prune(older_than_s=-1) == 1
    assert library.prune() == 0


def test_keys_and_generator_versions(tmp_path):
    base = entry_key("structure", "GPU", "sm_90", "g")
    assert len({base, entry_key("structure", "GPU", "sm_80", "g"), entry_key("structure", "GPU2", "sm_90", "g"),
                entry_key("structure", "GPU", "sm_90", "h"), entry_key("other", "GPU", "sm_90", "g")}) == 5
    (tmp_path / "a.py").write_text("x = 1\n")
    first = generator_version([tmp_path])
    assert generator_version([tmp_path]) == first
    (tmp_path / "a.py").write_text("x = 2\n")
    assert generator_version([tmp_path]) != first
