"""Heavy requests: their slow parts on worker threads, their replies deferred, every
session's replies still in order.

A few requests take long (a large ATTACH, WRITE, STAGE, WRITE_STAGED, BLOCK_WRITE_KEYS or
BLOCK_READ_KEYS). Their handlers are generators: ``value = yield Slow(fn)`` runs ``fn()``
on a worker thread and resumes the handler on the loop with its result (or its exception
raised at the ``yield``); what the generator returns is the reply. Everything between two yields runs on the loop, so
the loop alone still touches sessions, residency, the registry and the pool's allocator;
``fn`` touches only what its handler set aside for it.

Order and exclusion. A request in flight holds its session: that session's later
requests wait, in order, until it has replied. When its ``Slow`` names an engine it holds
that engine too: requests of every session attached to it, and ATTACHes naming it, wait
as well, so no rank reads a row half written or joins an engine half made.

The daemon's own work. :meth:`HeavyRequests.hold` runs a function that belongs to no
request (the zeros of the blocks a gone client held) on a thread of its own, holding its
engine as a heavy request would; its failure stops the daemon.

Lifetimes. When the session of a request in flight is gone (reaped) or the daemon stops,
its handler is resumed with :class:`Gone` raised at its ``yield`` once ``fn`` has returned
(a running ``fn`` is never interrupted): it rolls back what it took, re-raises, and
nothing is replied. Without a serving loop (``Daemon.handle``) the generators run inline.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from dataclasses import dataclass
from typing import Any, Callable, Generator

log = logging.getLogger("sparsekv.heavy")

# Worker threads: a second keeps one long pinning from holding up the rest; more would take cores.
THREADS = 2
# Copies of at least this many bytes (a write's rows, indexer keys) run on a worker thread;
# smaller ones cost less than the hop.
HEAVY_BYTES = 4 << 20
# A cpu rank's STEP or TOPK from this much host work on (region slots scanned, top-k ids
# resolved): EngineRequests._host_heavy.
HEAVY_SLOTS = 1 << 20
# Requests one session may have waiting behind a request in flight; more are dropped
# unanswered (as libzmq drops messages past its high-water mark).
MAX_WAITING = 1024


@dataclass(frozen=True)
class Slow:
    """What a heavy handler yields: ``fn()`` to run on a worker thread; ``engine``: an
    engine it creates or copies pool rows of, whose requests wait until the reply."""

    fn: Callable[[], Any]
    engine: str | None = None
    ranks: bool = False  # fn touches the residency of the engine's ranks (a cpu STEP, TOPK or drop)


class Gone(Exception):
    """Raised at a heavy handler's ``yield`` when nobody is left to answer (the session
    is gone, or the daemon stops): roll back what the request took and re-raise.
    ``result``: what the slow part returned when it ran to its end (its work was done:
    counted, not answered), else None."""

    def __init__(self, why: str, result=None):
        super().__init__(why)
        self.result = result


@dataclass(eq=False)
class Job:
    """One request whose handler is a generator, from its first ``yield`` to its reply."""

    gen: Generator
    identity: bytes  # the session's ZeroMQ routing id
    session: Any
    kind: Any  # its MsgType
    msg_type: int
    req_id: int
    tr: int  # when it was received (perf_counter_ns)
    slow: Slow | None = None  # what it waits for now
    future: Future | None = None


@dataclass(eq=False)
class Hold:
    """The daemon's own work holding an engine (:meth:`HeavyRequests.hold`)."""

    engine: str
    then: Callable[[], None]
    future: Future | None = None


class HeavyRequests:
    """The requests in flight on worker threads, what they hold, and the requests
    waiting for them. Used from the loop's thread only (``fn`` aside)."""

    def __init__(self, threads: int = THREADS):
        self.threads = threads
        self._executor: ThreadPoolExecutor | None = None
        self._loop: asyncio.AbstractEventLoop | None = None  # while serving
        self._jobs: dict[bytes, Job] = {}  # in flight, by session identity
        self._engines: dict[str, Job] = {}  # engines held, by name
        self._waiting: dict[bytes, deque] = {}  # requests waiting, by session identity
        self._holds: dict[str, list[Hold]] = {}  # the daemon's own work in flight, by engine
        self._released: Callable[[], None] | None = None  # (serving) after a hold: serve who waited
        self._failed: Callable[[str], None] | None = None  # (serving) a hold's work failed: the daemon stops
        self._hold_thread: ThreadPoolExecutor | None = None
        self._cpus = None

    # -- state ---------------------------------------------------------------------
    @property
    def serving(self) -> bool:
        return self._loop is not None

    def running(self, identity: bytes) -> bool:
        """Whether a request of session ``identity`` is in flight."""
        return identity in self._jobs

    def busy(self, identity: bytes) -> bool:
        """Whether a new request of ``identity`` must queue: one is in flight or waits."""
        return identity in self._jobs or identity in self._waiting

    def ranks_in_use(self, engine: str | None) -> bool:
        """Whether a request in flight holds ``engine`` with a slow part that works on its
        ranks' residency (``Slow.ranks``) on a worker thread."""
        job = self._engines.get(engine) if engine is not None else None
        return job is not None and job.slow is not None and job.slow.ranks

    def engine_busy(self, engine: str | None) -> bool:
        return engine is not None and (engine in self._engines or engine in self._holds)

    # -- running -------------------------------------------------------------------
    def open(self, loop: asyncio.AbstractEventLoop, cpus=None, released: Callable[[], None] | None = None,
             failed: Callable[[str], None] | None = None) -> None:
        """Serve on ``loop``; ``cpus``: where the worker threads run (None: where the loop
        does); ``released``: called on the loop after a :meth:`hold` ends (the requests
        that waited for its engine are served); ``failed(why)``: a hold's work raised."""
        self._loop = loop
        self._cpus = cpus
        self._released, self._failed = released, failed

    def hold(self, engine: str, fn: Callable[[], Any], then: Callable[[], None]) -> None:
        """Run ``fn()``, the daemon's own work on ``engine`` (no session, no reply), on the
        holds' own thread (one: the two workers stay free for requests; holds run in turn)
        holding that engine: its requests and ATTACHes naming it wait, as behind a heavy
        request. Then ``then()`` on the loop, and the requests that waited are served. An
        error of ``fn`` is fatal (``open``'s ``failed``: the daemon stops; nobody to answer,
        and what it did not do, the zeros of freed blocks, must not be served). Without a
        serving loop, all now (an error raised)."""
        if self._loop is None:
            try:
                fn()
            finally:
                then()
            return
        h = Hold(engine, then)
        self._holds.setdefault(engine, []).append(h)
        loop = self._loop
        if self._hold_thread is None:
            init = None if self._cpus is None else functools.partial(os.sched_setaffinity, 0, self._cpus)
            self._hold_thread = ThreadPoolExecutor(1, thread_name_prefix="hold", initializer=init)
        h.future = future = self._hold_thread.submit(_error_of, fn)
        future.add_done_callback(lambda f: loop.call_soon_threadsafe(self._hold_done, h, f))

    def fail(self, why: str) -> bool:
        """The daemon cannot serve on (``open``'s ``failed``: it stops); False without a
        serving loop (the caller raises)."""
        if self._failed is None:
            return False
        self._failed(why)
        return True

    def hold_futures(self, engines) -> list[Future]:
        """The work in flight of the holds on ``engines`` (done ones whose end has not run
        on the loop yet included), for a worker thread to wait on."""
        return [h.future for name in engines for h in self._holds.get(name, ()) if h.future is not None]

    def _hold_done(self, h: Hold, future: Future) -> None:
        if h.future is not future:
            return  # close() has taken it
        h.future = None
        error = future.result()
        if error is not None and self._failed is not None:  # before anyone waiting is served
            self._failed(f"the daemon's own work on engine {h.engine!r} failed: {type(error).__name__}: {error}")
        try:
            self._end_hold(h)
        finally:
            if self._released is not None:
                self._released()

    def _end_hold(self, h: Hold) -> None:
        holds = self._holds[h.engine]
        holds.remove(h)
        if not holds:
            del self._holds[h.engine]
        try:
            h.then()
        except Exception:  # noqa: BLE001 - a callback of the loop: log, never raise
            log.exception("ending the daemon's own work on engine %r failed", h.engine)

    def start(self, job: Job, resume: Callable[[Job, Any, BaseException | None], None]) -> None:
        """Run ``job.slow.fn`` on a worker thread, holding the job's session (and its
        engine); then call ``resume(job, value, error)`` on the loop."""
        for name in [n for n, j in self._engines.items() if j is job]:
            del self._engines[name]  # a later step may hold another engine, or none
        if job.slow.engine is not None:
            self._engines[job.slow.engine] = job
        self._jobs[job.identity] = job
        loop = self._loop
        job.future = future = self._workers().submit(job.slow.fn)
        future.add_done_callback(lambda f: loop.call_soon_threadsafe(self._done, job, f, resume))

    def _done(self, job: Job, future: Future, resume) -> None:
        if job.future is not future:
            return  # close() has taken it
        job.future = None
        value, error = _outcome(future)
        del future
        try:
            resume(job, value, error)
        finally:
            # The error's traceback reaches this frame: keep no reference cycle through it,
            # which would keep what the handler held (a rank's memory) until collected.
            del value, error

    def finish(self, job: Job) -> None:
        """Release what ``job`` held (it has replied, or had nobody to reply to)."""
        if self._jobs.get(job.identity) is job:
            del self._jobs[job.identity]
        for name in [n for n, j in self._engines.items() if j is job]:
            del self._engines[name]

    # -- waiting requests ------------------------------------------------------------
    def wait(self, identity: bytes, request, first: bool = False) -> bool:
        """Queue ``request`` of ``identity`` (``first``: back at the head, where it was);
        False when its queue is full (the request is dropped)."""
        q = self._waiting.setdefault(identity, deque())
        if len(q) >= MAX_WAITING and not first:
            return False
        (q.appendleft if first else q.append)(request)
        return True

    def waiting_sessions(self) -> list[bytes]:
        return list(self._waiting)

    def next_waiting(self, identity: bytes):
        """The oldest waiting request of ``identity``, taken off its queue; None when it
        has none, or has a request in flight again."""
        q = self._waiting.get(identity)
        if not q or identity in self._jobs:
            return None
        request = q.popleft()
        if not q:
            del self._waiting[identity]
        return request

    def forget(self, identity: bytes) -> None:
        """Drop what ``identity`` has waiting (its session is gone)."""
        self._waiting.pop(identity, None)

    # -- lifetimes -------------------------------------------------------------------
    def release(self, box: list) -> None:
        """Empty ``box`` on a worker thread (now, without a serving loop): the caller puts
        the last reference to something slow to free in it and keeps none."""
        if self._loop is None:
            box.clear()
        else:
            self._workers().submit(box.clear)

    def _workers(self) -> ThreadPoolExecutor:
        if self._executor is None:
            init = None if self._cpus is None else functools.partial(os.sched_setaffinity, 0, self._cpus)
            self._executor = ThreadPoolExecutor(self.threads, thread_name_prefix="heavy", initializer=init)
        return self._executor

    def close(self, wait: bool = True) -> list[Job]:
        """Stop serving: wait for every running ``fn`` and return the jobs in flight, for the
        server to resume with :class:`Gone`; waiting requests are dropped. ``wait`` False
        (the daemon is failing): do not wait, return nothing."""
        self._loop = None
        self._released = self._failed = None
        self._waiting.clear()
        jobs = list(self._jobs.values())
        self._jobs.clear()
        self._engines.clear()
        holds = [h for hs in self._holds.values() for h in hs]
        running = [j.future for j in jobs if j.future is not None] + [h.future for h in holds if h.future is not None]
        for x in (*jobs, *holds):
            x.future = None  # no resume from the futures' callbacks any more
        if not wait:
            return []
        if running:
            log.info("stopping: waiting for %d heavy request(s) and engine holds in flight", len(running))
            wait_futures(running)
        for h in holds:  # their work is done: what follows it (the engine may go now; an error is logged)
            self._end_hold(h)
        return jobs

    def shutdown(self, wait: bool = True) -> None:
        """End the worker threads (after :meth:`close`), waiting for what they run."""
        for ex in (self._executor, self._hold_thread):
            if ex is not None:
                ex.shutdown(wait=wait, cancel_futures=not wait)
        self._executor = self._hold_thread = None


def _error_of(fn: Callable[[], Any]) -> BaseException | None:
    """Run ``fn()``, the daemon's own work; return its error (None when it succeeded)."""
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - no request to fail: the loop decides (_hold_done)
        log.exception("the daemon's own work on a worker thread failed")
        return e
    return None


def _outcome(future: Future) -> tuple[Any, BaseException | None]:
    """(value, None) or (None, the exception ``fn`` raised), raising nothing here (a
    raise would put this frame in the exception's traceback)."""
    error = future.exception()
    return (None, error) if error is not None else (future.result(), None)
