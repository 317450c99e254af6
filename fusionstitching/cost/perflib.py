"""The performance library [A §4.4]: measured kernel schedules, stored on disk and reused.

One SQLite file, ``perflib.sqlite`` in the cache root (``Options.cache_dir``). A pattern's entry is
keyed by ``entry_key``: a hash of the pattern's canonical structure (ops, shapes, dtypes, strides,
attributes; no node names), the GPU's name and compute capability, and the code generator's version
(a hash of its sources, ``generator_version``), so an entry never outlives the code that measured it.
Two tables:

- ``measurements``: every candidate measured for a key (template, median µs, registers, shared
  bytes, resident blocks per SM, the latency model's rank of it);
- ``winners``: per key, the fastest candidate, the model's first choice and its time.

Templates are stored with their roots named by position (``n0``, ``n1``, ...: the pattern's nodes in
graph order), so that any pattern of the same structure can use them.

Robustness: several processes may write at once (each write is one transaction; SQLite's lock, with
a timeout, serializes them); a file that is not a readable SQLite database is moved aside with a
warning and a new one begun; any other database error is a warning and reads as a miss. The library
never makes a compilation fail.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import sqlite3
import time
import warnings
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

FILE_NAME = "perflib.sqlite"
_SCHEMA_VERSION = 1
_TIMEOUT_S = 30.0

_SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (name TEXT PRIMARY KEY, value TEXT);
CREATE TABLE IF NOT EXISTS measurements (
    key TEXT NOT NULL, template TEXT NOT NULL, us REAL NOT NULL, registers INTEGER, shared_bytes INTEGER,
    occupancy INTEGER, model_rank INTEGER, created REAL NOT NULL, PRIMARY KEY (key, template));
CREATE TABLE IF NOT EXISTS winners (
    key TEXT PRIMARY KEY, description TEXT, device TEXT, arch TEXT, generator TEXT, template TEXT NOT NULL,
    us REAL NOT NULL, model_template TEXT, model_us REAL, candidates INTEGER, created REAL NOT NULL);
"""


class PerfLibWarning(UserWarning):
    """The performance library could not be read or written; compilation goes on without it."""


@dataclass(frozen=True)
class Measured:
    """One candidate's measurement: its template (roots by position), median µs and resources."""

    template: str
    us: float
    registers: int = 0
    shared_bytes: int = 0
    occupancy: int = 0
    model_rank: int = 0


@dataclass(frozen=True)
class Winner:
    """A key's chosen template and what it was chosen against."""

    key: str
    template: str
    us: float
    model_template: str
    model_us: float
    candidates: int
    description: str = ""
    device: str = ""
    arch: str = ""
    generator: str = ""
    created: float = 0.0

    @property
    def model_was_right(self) -> bool:
        return self.template == self.model_template


def entry_key(structure: str, device: str, arch: str, generator: str) -> str:
    """The library key of a pattern's canonical ``structure`` text on a GPU named ``device`` of
    compute capability ``arch`` (``sm_90``), for the code generator of version ``generator``."""
    text = f"{structure}\n{device}\n{arch}\n{generator}"
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def generator_version(roots: Iterable[Path]) -> str:
    """A hash of the sources of the code generator and the schedules: every ``.py`` file under
    ``roots``, in path order. A change to any of them is a new generator version."""
    digest = hashlib.sha256()
    for root in roots:
        for path in sorted(Path(root).rglob("*.py")):
            digest.update(path.name.encode())
            digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


class PerfLib:
    """The library file at ``path`` (created with its directory on first write)."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)

    @contextlib.contextmanager
    def tuning(self, key: str) -> Iterator[None]:
        """Held while the pattern ``key`` is measured and stored: another process on this host
        (each rank of a data-parallel job meets the same patterns) that misses the same key waits,
        then reads the winner instead of measuring again, so every rank runs the same kernels. An
        advisory lock (``flock``) on ``perflib.sqlite.locks/<key>.lock``, removed by its holder
        once the winner is stored (a process that opened it before sees the winner then) and
        released by the system if the holder dies; where no lock can be taken, measuring goes on
        unlocked."""
        try:
            import fcntl
        except ImportError:
            yield
            return
        directory = self.path.with_name(f"{self.path.name}.locks")
        path = directory / f"{key}.lock"
        try:
            directory.mkdir(parents=True, exist_ok=True, mode=0o700)
            fd = os.open(path, os.O_RDWR | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0), 0o600)
        except OSError as err:
            warnings.warn(f"performance library {self.path}: cannot lock {key} ({err})", PerfLibWarning, stacklevel=3)
            yield
            return
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX)
            except OSError as err:
                warnings.warn(f"performance library {self.path}: cannot lock {key} ({err})", PerfLibWarning,
                              stacklevel=3)
            yield
        finally:
            with contextlib.suppress(OSError):
                path.unlink()
            os.close(fd)

    # -- access ---------------------------------------------------------------------------------
    def _connect(self) -> sqlite3.Connection:
        self.path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        connection = sqlite3.connect(self.path, timeout=_TIMEOUT_S, isolation_level=None)
        try:
            connection.executescript(_SCHEMA)
            row = connection.execute("SELECT value FROM meta WHERE name = 'schema'").fetchone()
            if row is None:
                connection.execute("INSERT OR IGNORE INTO meta VALUES ('schema', ?)", (str(_SCHEMA_VERSION),))
            elif row[0] != str(_SCHEMA_VERSION):
                raise sqlite3.DatabaseError(f"schema version {row[0]}, this code writes {_SCHEMA_VERSION}")
        except BaseException:
            connection.close()
            raise
        return connection

    def _run(self, action, default):
        """``action(connection)``; a file that is no readable library is moved aside and ``action``
        retried once on a new one; any other failure warns and gives ``default``."""
        for attempt in range(2):
            try:
                connection = self._connect()
                try:
                    return action(connection)
                finally:
                    connection.close()
            except sqlite3.DatabaseError as err:
                if attempt == 0 and _corrupt(err):
                    self._set_aside(err)
                    continue
                warnings.warn(f"performance library {self.path}: {err}", PerfLibWarning, stacklevel=3)
                return default
            except OSError as err:
                warnings.warn(f"performance library {self.path}: {err}", PerfLibWarning, stacklevel=3)
                return default
        return default

    def _set_aside(self, err: Exception) -> None:
        aside = self.path.with_name(f"{self.path.name}.corrupt-{int(time.time())}-{os.getpid()}")
        try:
            os.replace(self.path, aside)
            note = f"moved to {aside.name}"
        except OSError:
            note = "left in place"
        warnings.warn(f"performance library {self.path} is not a readable database ({err}); {note}, "
                      f"starting a new one", PerfLibWarning, stacklevel=4)

    # -- reads ----------------------------------------------------------------------------------
    def winner(self, key: str) -> Winner | None:
        def read(connection):
            row = connection.execute(f"SELECT {_WINNER_COLUMNS} FROM winners WHERE key = ?", (key,)).fetchone()
            return None if row is None else Winner(*row)

        return self._run(read, None)

    def winners(self) -> list[Winner]:
        def read(connection):
            rows = connection.execute(f"SELECT {_WINNER_COLUMNS} FROM winners ORDER BY created").fetchall()
            return [Winner(*row) for row in rows]

        return self._run(read, [])

    def measurements(self, key: str) -> list[Measured]:
        def read(connection):
            rows = connection.execute(
                "SELECT template, us, registers, shared_bytes, occupancy, model_rank FROM measurements "
                "WHERE key = ? ORDER BY us", (key,)).fetchall()
            return [Measured(*row) for row in rows]

        return self._run(read, [])

    # -- writes ---------------------------------------------------------------------------------
    def store(self, key: str, measured: list[Measured], *, chosen: str | None = None, description: str = "",
              device: str = "", arch: str = "", generator: str = "") -> Winner | None:
        """Record every measured candidate of ``key`` and its winner (``chosen``, by default the
        fastest; the model's first choice is the candidate of model rank 0) in one transaction;
        returns the winner."""
        if not measured:
            return None
        best = min(measured, key=lambda m: m.us)
        if chosen is not None:
            best = next(m for m in measured if m.template == chosen)
        model = min(measured, key=lambda m: m.model_rank)
        now = time.time()
        winner = Winner(key, best.template, best.us, model.template, model.us, len(measured), description,
                        device, arch, generator, now)

        def write(connection):
            connection.execute("BEGIN IMMEDIATE")
            try:
                connection.executemany(
                    "INSERT OR REPLACE INTO measurements VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                    [(key, m.template, m.us, m.registers, m.shared_bytes, m.occupancy, m.model_rank, now)
                     for m in measured])
                connection.execute(f"INSERT OR REPLACE INTO winners ({_WINNER_COLUMNS}) VALUES "
                                   f"({', '.join('?' * 11)})",
                                   (key, winner.template, winner.us, winner.model_template, winner.model_us,
                                    winner.candidates, description, device, arch, generator, now))
                connection.execute("COMMIT")
            except BaseException:
                connection.execute("ROLLBACK")
                raise
            return winner

        return self._run(write, winner)

    def prune(self, *, generator: str | Sequence[str] | None = None, older_than_s: float | None = None,
              device: str | None = None) -> int:
        """Delete entries of other generator versions than ``generator`` (one, or several that are
        all current), older than ``older_than_s`` seconds, or of GPU ``device``; returns how many
        keys went."""
        conditions, values = [], []
        if generator is not None:
            current = [generator] if isinstance(generator, str) else list(generator)
            conditions.append(f"generator NOT IN ({', '.join('?' * len(current))})")
            values.extend(current)
        if older_than_s is not None:
            conditions.append("created < ?")
            values.append(time.time() - older_than_s)
        if device is not None:
            conditions.append("device = ?")
            values.append(device)
        if not conditions:
            return 0

        def delete(connection):
            connection.execute("BEGIN IMMEDIATE")
            try:
                keys = [row[0] for row in connection.execute(
                    f"SELECT key FROM winners WHERE {' OR '.join(conditions)}", values)]
                connection.executemany("DELETE FROM winners WHERE key = ?", [(k,) for k in keys])
                connection.executemany("DELETE FROM measurements WHERE key = ?", [(k,) for k in keys])
                connection.execute("COMMIT")
            except BaseException:
                connection.execute("ROLLBACK")
                raise
            return len(keys)

        return self._run(delete, 0)


_WINNER_COLUMNS = ("key, template, us, model_template, model_us, candidates, description, device, arch, "
                   "generator, created")


def _corrupt(err: sqlite3.DatabaseError) -> bool:
    """Whether ``err`` says the file is no usable library (not a database, malformed, another schema)."""
    text = str(err).lower()
    return any(s in text for s in ("not a database", "malformed", "schema version", "file is encrypted",
                                   "no such column", "has no column"))
