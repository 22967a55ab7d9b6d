"""Grammar compiles on threads of their own: a bounded number at a time, each awaited within a
deadline, and dropped before they start when nobody waits for them any more.

xgrammar cannot interrupt a compile, so one whose waiters all left (cancelled, or past the
deadline) runs on in the background, detached; at most max_detached of them run beside the
max_running regular ones. A flood of grammars whose clients leave costs at most those threads,
never one per request, and a compile nobody waits for is never started.
"""
from __future__ import annotations

import collections
import threading
import time
from collections.abc import Callable, Hashable

from asyncllm.errors import QueueFullError

QUEUED, RUNNING, DONE, DROPPED = "queued", "running", "done", "dropped"


class CompileJob:
    """One compile, shared by every waiter that asked for the same key meanwhile."""

    __slots__ = ("key", "run", "state", "started_at", "result", "error", "num_waiters", "detached")

    def __init__(self, key: Hashable, run: Callable[[], object]):
        self.key = key
        self.run = run
        self.state = QUEUED
        self.started_at: float | None = None  # time.monotonic() when its thread started it
        self.result = None
        self.error: BaseException | None = None
        self.num_waiters = 0
        self.detached = False  # running with nobody waiting: counted against max_detached

    @property
    def done(self) -> bool:
        return self.state == DONE

    def outcome(self):
        """The compile's result, or its exception raised (once done)."""
        if self.error is not None:
            raise self.error
        return self.result

    def overdue(self, deadline_s: float) -> bool:
        """Running for longer than deadline_s (time in the queue does not count)."""
        started = self.started_at
        return self.state == RUNNING and started is not None and time.monotonic() - started > deadline_s


class CompileJobs:
    """The queue and threads of one GrammarCompiler's compiles."""

    def __init__(self, max_running: int = 1, max_detached: int = 2, max_queued: int = 64,
                 thread_name: str = "asyncllm-grammar-compile"):
        self.max_running = max_running
        self.max_detached = max_detached
        self.max_queued = max_queued
        self.thread_name = thread_name
        self._cond = threading.Condition()
        self._queue: collections.deque[CompileJob] = collections.deque()
        self._live: dict[Hashable, CompileJob] = {}  # queued or running, by key: a second asker joins
        self._num_running = 0  # detached ones included
        self._num_detached = 0

    def submit(self, key: Hashable, run: Callable[[], object]) -> CompileJob:
        """The job that compiles key (run() in a thread of its own), with the caller as one more
        waiter: the job already queued or running for key, or a new one. The caller must leave()
        it once done with it. QueueFullError when max_queued jobs are waiting already."""
        with self._cond:
            job = self._live.get(key)
            if job is None:
                if len(self._queue) >= self.max_queued:
                    raise QueueFullError(f"{self.max_queued} grammar compiles are already queued; retry later")
                job = self._live[key] = CompileJob(key, run)
                self._queue.append(job)
                self._start_queued()
            elif job.detached:  # waited for again: a regular job once more
                job.detached = False
                self._num_detached -= 1
            job.num_waiters += 1
            return job

    def wait(self, job: CompileJob, deadline_s: float):
        """Block until job is done (its outcome) or has run for deadline_s (TimeoutError)."""
        with self._cond:
            while job.state != DONE:
                if job.overdue(deadline_s):
                    raise TimeoutError
                timeout = None if job.started_at is None else job.started_at + deadline_s - time.monotonic()
                self._cond.wait(None if timeout is None else max(timeout, 0.001))
        return job.outcome()

    def leave(self, job: CompileJob) -> None:
        """A waiter is done with job (it has its outcome, was cancelled, or gave up at the deadline).
        A queued job nobody waits for is dropped; a running one goes on, detached."""
        with self._cond:
            job.num_waiters -= 1
            if job.num_waiters > 0 or job.state in (DONE, DROPPED):
                return
            if job.state == QUEUED:
                self._queue.remove(job)
                job.state = DROPPED
                del self._live[job.key]
            else:
                self._detach_unwaited()

    def stats(self) -> dict:
        with self._cond:
            return {"queued": len(self._queue), "running": self._num_running - self._num_detached,
                    "detached": self._num_detached}

    def _detach_unwaited(self) -> None:
        """Running jobs nobody waits for give their regular places up, as far as max_detached allows
        (past it they keep them: no more compiles run at once), and queued ones take them."""
        for job in self._live.values():
            if self._num_detached >= self.max_detached:
                break
            if job.state == RUNNING and job.num_waiters == 0 and not job.detached:
                job.detached = True
                self._num_detached += 1
        self._start_queued()

    def _start_queued(self) -> None:
        started = False
        while self._queue and self._num_running - self._num_detached < self.max_running and \
                self._num_running < self.max_running + self.max_detached:
            job = self._queue.popleft()
            job.state = RUNNING
            job.started_at = time.monotonic()
            self._num_running += 1
            threading.Thread(target=self._run, args=(job,), name=self.thread_name, daemon=True).start()
            started = True
        if started:  # its waiters' deadline starts now
            self._cond.notify_all()

    def _run(self, job: CompileJob) -> None:
        try:
            job.result = job.run()
        except BaseException as e:  # noqa: BLE001 - handed to the waiters
            job.error = e
        with self._cond:
            job.state = DONE
            job.run = None  # what it held (the spec) is not kept with the outcome
            self._num_running -= 1
            if job.detached:
                self._num_detached -= 1
            if self._live.get(job.key) is job:
                del self._live[job.key]
            self._detach_unwaited()
            self._cond.notify_all()
