"""Exploration ahead of need, in a worker process.

A training graph's forward is compiled at its first call and its backward at the first backward,
each exploring for seconds (tens of seconds for a ResNet's). AOTAutograd partitions the joint
graph before either is compiled, so the backward is known while the forward explores: the backend
converts it then (``backend._Runner``) and ``submit``s it here, a worker process explores it while
this process explores, generates and runs the forward, and the backward's ``compile_graph`` takes
the plan (``take``) instead of exploring. The interpreter lock keeps a thread from doing this work
alongside, so it is a process: started when a graph arrives (``start``), running
``fusionstitching/worker.py`` with ``sys.executable -m`` (no re-import of the user's script, and
no import of PyTorch: it is ready within about a second on a 2-core machine), talking
pickled messages over its standard input and output, and ending when this process closes its
input (at exit, or when it dies). Given the GPU's arch, the worker then generates the plan's
kernels and compiles them with NVRTC into the disk cache, where the backward's first call finds
them (``pipeline._compile_kernels``).

The worker explores the graph as ``explore`` would here: from the graph's JSON, the same options,
solver and generators, with the same code. Its plan comes back as the plan cache's encoding
(``plan_cache.encode``) and is decoded against the graph the backward compiler converted; it is
used only where that graph's plan key (``plan_cache.plan_key``) is the key submitted, so a
backward that converts differently (other strides, another name) is explored here as before.
``take`` waits only for a graph the worker has begun: both processes explore at the same speed, so
a worker still importing (seconds) or busy with another graph cannot answer before exploring here,
started now, would; the graph is then explored here and the worker's late answer dropped.
A worker that fails (an exception in exploration, a crash, an unpicklable option) costs nothing
but its time: the graph is explored here, where an error surfaces through the compiler's failure
policy as it always did. ``Options(explore_ahead=False)`` turns this off.

The worker also explores alongside: where splitting reshaped dims changes a graph, ``explore``
plans it both ways and keeps the plan the latency evaluator estimates faster. The backend starts
the worker for every graph, and ``explore`` hands the unsplit exploration of its prepared graph to
a worker that is ready and has nothing else to do (``submit_unsplit``), explores the split graph
itself, then takes the worker's answer (``take_unsplit``): its estimate, and the plan decoded only
where it is kept. A worker busy (with a backward sent ahead) or not ready, or an answer not begun
by the time the split plan is done, leaves the unsplit exploration to this process as before. The
plan is the one exploring both here finds (the exploration is the same code on the same graph).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import pickle
import queue
import struct
import subprocess
import sys
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import IO, Any

from fusionstitching.graph.graph import Graph
from fusionstitching.options import Options

# graphs sent to the worker and plans used from it; unsplit explorations alike (``submit_unsplit``)
COUNTS = {"submitted": 0, "taken": 0, "unsplit submitted": 0, "unsplit taken": 0}
# The worker's main module (``fusionstitching/worker.py``), whose ``serve`` answers with the step that
# generates and compiles a plan's kernels (stages above this one). Running it imports the package
# first, which registers the code generator's lowering check that exploration asks; with
# ``PLANNER_ONLY`` set in its environment, without PyTorch.
WORKER_MODULE = "fusionstitching.worker"
PLANNER_ONLY = "FUSIONSTITCHING_PLANNER_ONLY"


def _command() -> list[str]:
    return [sys.executable, "-m", WORKER_MODULE]
_HEADER = struct.Struct("<Q")


def _message(message: Any) -> bytes:
    data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    return _HEADER.pack(len(data)) + data


def send(stream: IO[bytes], message: Any) -> None:
    stream.write(_message(message))
    stream.flush()


def receive(stream: IO[bytes]) -> Any:
    """The next message, or None at the end of the stream."""
    header = stream.read(_HEADER.size)
    if len(header) < _HEADER.size:
        return None
    size = _HEADER.unpack(header)[0]
    data = stream.read(size)
    if len(data) < size:
        return None
    return pickle.loads(data)


class _Worker:
    """The worker process and the plans it sent back, by job number."""

    def __init__(self) -> None:
        package_parent = str(Path(__file__).resolve().parent.parent.parent)
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join([package_parent, *filter(None, [env.get("PYTHONPATH")])])
        env[PLANNER_ONLY] = "1"
        self.process = subprocess.Popen(_command(),
                                        stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env)
        self.lock = threading.Condition()
        self.results: dict[int, tuple[bool, Any, float]] = {}
        self.alive = True
        self.ready = False  # the worker's imports are done and it reads requests
        self.started: set[int] = set()  # jobs the worker has begun exploring
        self.dropped: set[int] = set()  # jobs explored here instead: their answers are not kept
        self.open: set[int] = set()  # jobs sent and not yet answered
        self.jobs = 0
        # Requests are written by a thread of their own: a pipe holds 64 KiB, a model's graph is
        # megabytes, and the worker reads nothing until its imports are done (seconds).
        self.outbox: queue.SimpleQueue[bytes | None] = queue.SimpleQueue()
        for target, name in ((self._read, "reader"), (self._write, "writer")):
            threading.Thread(target=target, name=f"fusionstitching-explore-ahead-{name}", daemon=True).start()

    def _write(self) -> None:
        assert self.process.stdin is not None
        while True:
            data = self.outbox.get()
            try:
                if data is None:
                    self.process.stdin.close()
                    return
                self.process.stdin.write(data)
                self.process.stdin.flush()
            except (OSError, ValueError):  # the worker is gone: the reader marks it dead
                return

    def _read(self) -> None:
        assert self.process.stdout is not None
        while True:
            try:
                message = receive(self.process.stdout)
            except Exception:  # noqa: BLE001 -- a damaged stream ends the worker's use
                message = None
            if message is None:
                with contextlib.suppress(Exception):  # reaped, not left a zombie
                    self.process.wait(timeout=10)
            with self.lock:
                if message is None:
                    self.alive = False
                    self.lock.notify_all()
                    return
                kind, *rest = message
                if kind == "ready":
                    self.ready = True
                elif kind == "started":
                    self.started.add(rest[0])
                else:
                    job, ok, payload, seconds = rest
                    self.started.discard(job)
                    self.open.discard(job)
                    if job in self.dropped:
                        self.dropped.discard(job)
                    else:
                        self.results[job] = (ok, payload, seconds)
                self.lock.notify_all()

    def submit(self, request: tuple) -> int | None:
        with self.lock:
            if not self.alive:
                return None
            self.jobs += 1
            job = self.jobs
        try:
            message = _message((job, *request))
        except Exception:  # noqa: BLE001 -- an unpicklable option: explored here
            return None
        with self.lock:
            self.open.add(job)
        self.outbox.put(message)
        return job

    def forget(self, job: int) -> None:
        """Drop ``job``'s answer, now or when it comes, without waiting for it."""
        with self.lock:
            if self.results.pop(job, None) is None and job in self.open:
                self.dropped.add(job)

    def idle(self) -> bool:
        """Ready, alive, and with no job sent that it has not answered."""
        with self.lock:
            return self.alive and self.ready and not self.open

    def claim(self, job: int) -> tuple[bool, Any, float] | None:
        """The answer to ``job``, waiting for it if the worker has begun it; None where it failed,
        died, or has not begun (the job is then dropped: exploring here is at least as quick)."""
        with self.lock:
            if job not in self.results and job not in self.started:
                if self.alive:
                    self.dropped.add(job)
                return None
            while job not in self.results and self.alive:
                self.lock.wait()
            return self.results.pop(job, None)

    def close(self) -> None:
        """Ends the worker once it has read what was sent (its input closes)."""
        self.outbox.put(None)


_WORKER: _Worker | None = None
_PENDING: dict[str, int] = {}  # plan key -> job number
_GUARD = threading.Lock()


def _worker() -> _Worker:
    global _WORKER
    if _WORKER is None or not _WORKER.alive:
        import atexit

        _WORKER = _Worker()
        atexit.register(_WORKER.close)
    return _WORKER


def start() -> None:
    """Start the worker, if none runs, so that its imports (seconds) are done by the time a graph
    is sent: the backend calls this when a training graph arrives, before AOTAutograd traces it."""
    with contextlib.suppress(Exception), _GUARD:
        _worker()


def submit(graph: Graph, options: Options, generators: Sequence[str], arch: str | None = None) -> bool:
    """Have the worker explore ``graph`` (as ``compile_graph`` would) for a later ``take``; whether
    it was sent. With ``arch`` (the GPU's, ``sm_90``) the worker then generates the plan's kernels
    and compiles them with NVRTC into the disk cache (``codegen/nvrtc.py``), where the graph's first
    call finds them. Never raises: exploring ahead is an optimisation."""
    from fusionstitching.fusion import plan_cache

    try:
        cache_key = plan_cache.key(graph, options.solver, generators, options)
        if plan_cache.stored(cache_key, options):
            return False  # an earlier process planned it: the plan cache answers
        key = cache_key if cache_key is not None else plan_cache.plan_key(graph, options.solver, generators, options)
        with _GUARD:
            if key in _PENDING:
                return True
            job = _worker().submit(("plan", graph.to_json(), dict(graph.origins), graph.checks, options.solver,
                                    tuple(generators), options, key, arch))
            if job is None:
                return False
            _PENDING[key] = job
        COUNTS["submitted"] += 1
        return True
    except Exception:  # noqa: BLE001 -- the graph is explored where it is compiled instead
        return False


def take(graph: Graph, options: Options, generators: Sequence[str]):
    """The plan the worker found for ``graph`` (waiting for it if the worker has begun it), with
    the seconds the worker explored; None where nothing was submitted under this graph's key, the
    worker failed, or it has not begun the graph (see the module note)."""
    if not _PENDING:
        return None
    from fusionstitching.fusion.plan_cache import decode, plan_key

    try:
        key = plan_key(graph, options.solver, generators, options)
    except Exception:  # noqa: BLE001 -- a graph the key refuses was never submitted
        return None
    with _GUARD:
        job = _PENDING.pop(key, None)
        worker = _WORKER
    if job is None or worker is None:
        return None
    answer = worker.claim(job)
    if answer is None or not answer[0]:
        return None
    _, encoded, seconds = answer
    try:
        plan = decode(encoded, key, options, note=f"plan explored ahead by a worker process in {seconds:.2f} s "
                                                   "(fusion/background.py)")
    except Exception:  # noqa: BLE001 -- explored here instead
        return None
    plan.graph.origins = {**graph.origins, **plan.graph.origins}
    COUNTS["taken"] += 1
    return plan, seconds


@dataclasses.dataclass(frozen=True)
class Ticket:
    """An unsplit exploration sent: the worker it went to, its job number and its key."""

    worker: _Worker
    job: int
    key: str


def submit_unsplit(prepared: tuple[Graph, tuple[str, ...]], solver: str, options: Options,
                   generators: Sequence[str]) -> Ticket | None:
    """Have the worker explore a graph ``explore`` has prepared (the graph and its notes) with
    reshapes left unsplit (``explore.unsplit_plan``) while this process explores it split; a ticket
    for ``take_unsplit``. Only a worker that is ready and has nothing else to do is asked (it then
    begins at once, and a backward sent ahead is never queued behind it); None otherwise, in the
    worker itself, or with ``Options(explore_ahead=False)``. Never raises."""
    from fusionstitching.fusion.plan_cache import plan_key

    if os.environ.get(PLANNER_ONLY) == "1" or not options.explore_ahead:  # a worker sends nothing on
        return None
    try:
        with _GUARD:
            worker = _WORKER
            if worker is None or not worker.idle():
                return None
            graph, notes = prepared
            key = plan_key(graph, solver, generators, options) + ":unsplit"
            job = worker.submit(("unsplit", graph.to_json(), dict(graph.origins), graph.checks, solver,
                                 tuple(generators), options, key, tuple(notes)))
        if job is None:
            return None
        COUNTS["unsplit submitted"] += 1
        return Ticket(worker, job, key)
    except Exception:  # noqa: BLE001 -- explored here instead
        return None


@dataclasses.dataclass
class Unsplit:
    """A worker's unsplit plan, as sent: its estimate, and the plan decoded only when kept."""

    estimated_us: float
    entry: dict
    key: str
    seconds: float

    def plan(self, options: Options):
        """The plan (``plan_cache.decode``), or None where it does not decode."""
        from fusionstitching.fusion.plan_cache import decode

        try:
            plan = decode(self.entry, self.key, options,
                          note=f"unsplit plan explored by a worker process in {self.seconds:.2f} s (fusion/background.py)")
        except Exception:  # noqa: BLE001 -- explored here instead
            return None
        COUNTS["unsplit taken"] += 1
        return plan


def take_unsplit(ticket: Ticket, options: Options) -> Unsplit | None:
    """The answer to a ``submit_unsplit`` ticket, waiting for it if the worker has begun it; None
    where it failed, died or has not begun (the plan is then explored here)."""
    answer = ticket.worker.claim(ticket.job)
    if answer is None or not answer[0]:
        return None
    _, entry, seconds = answer
    try:
        if entry["key"] != ticket.key:  # not this exploration's answer: never trusted
            return None
        return Unsplit(float(entry["estimated_us"]), entry, ticket.key, seconds)
    except Exception:  # noqa: BLE001 -- explored here instead
        return None


def forget_unsplit(ticket: Ticket) -> None:
    """Drop a ticket's answer without waiting for it (the exploration that sent it failed)."""
    ticket.worker.forget(ticket.job)


def pending() -> int:
    """Graphs submitted and not yet taken."""
    return len(_PENDING)


def ready() -> bool:
    """Whether a worker runs and has finished its imports (it takes requests as they come)."""
    worker = _WORKER
    return worker is not None and worker.alive and worker.ready


def started(graph: Graph, options: Options, generators: Sequence[str]) -> bool:
    """Whether the worker has begun (or finished) exploring ``graph`` and not been asked for it."""
    from fusionstitching.fusion.plan_cache import plan_key

    try:
        key = plan_key(graph, options.solver, generators, options)
    except Exception:  # noqa: BLE001 -- a graph the key refuses was never submitted
        return False
    with _GUARD:
        job, worker = _PENDING.get(key), _WORKER
    if job is None or worker is None:
        return False
    with worker.lock:
        return job in worker.started or job in worker.results
