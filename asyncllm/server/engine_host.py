"""`asyncllm serve --api-server-count N` (N >= 2), the engine process: the AsyncLLMEngine (its
detokenization and stop strings included) behind a Unix socket in a private directory, and N
front-end processes (frontend.py) that share the HTTP port's listening socket and do the HTTP,
the JSON, the SSE framing and the tokenizing.

Each front-end's streams are read here as in-process consumers read them (one task per request);
what they yield in one engine step goes to their front-end as one message (outputs gathered until
the event loop has run every woken reader, then sent). Stats go out every STATS_INTERVAL_S for the
front-ends' /metrics and /health (before it, while the engine starts, its start-up phase: the
front-ends start with the engine and answer /health "starting"). A front-end's link that closes
aborts its requests; one that holds more than $ASYNCLLM_FRONTEND_MAX_PENDING_BYTES unread is
dropped as a dead front-end (its requests aborted, the server exits 1). SIGTERM or
SIGINT: the front-ends drain and stop, then the engine; a front-end that dies is reported and the
server exits 1.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import multiprocessing
import os
import shutil
import signal
import socket
import struct
import tempfile
from collections.abc import Callable

import anyio

from asyncllm import settings
from asyncllm.errors import EngineAsleepError, EngineDeadError
from asyncllm.server.engine_link import error_out, frame, logprobs_out, params_in, read_message
from asyncllm.server.frontend import FrontendSettings, run_frontend
from asyncllm.server.lifecycle_routes import LifecycleGate

logger = logging.getLogger("asyncllm.server")

STATS_INTERVAL_S = 0.25
FRONTEND_START_TIMEOUT_S = 120.0  # for each front-end to load its tokenizer and connect
EXTRA_STOP_S = 10.0  # past the drain's own limit before a front-end that has not stopped is killed


class FrontendLink:
    """One front-end's connection: its requests (a task each) and the outputs waiting to be sent.
    Past max_pending bytes written and not yet read by the front-end, the link is dropped as a dead
    front-end's would be (its requests aborted) and on_dropped is called."""

    def __init__(self, engine, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, max_pending: int,
                 on_dropped: Callable[[int | None], None], gate: LifecycleGate):
        self.engine = engine
        self.gate = gate
        self.reader, self.writer = reader, writer
        self.max_pending, self.on_dropped = max_pending, on_dropped
        self.peer_pid = _peer_pid(writer)
        self.tasks: dict[str, asyncio.Task] = {}  # request or call id -> its task
        self.pending: list[tuple] = []
        self.loop = asyncio.get_running_loop()

    def send(self, message: tuple) -> None:
        if self.writer.is_closing():
            return
        self.writer.write(frame(message))
        pending = self.writer.transport.get_write_buffer_size()
        if pending > self.max_pending:
            logger.error("asyncllm serve: a front-end stopped reading its link (%d bytes pending, past %d: "
                         "$ASYNCLLM_FRONTEND_MAX_PENDING_BYTES); aborting its %d request(s) and stopping the server",
                         pending, self.max_pending, len(self.tasks))
            self.writer.transport.abort()  # its buffer dropped; serve() sees the link closed
            for task in list(self.tasks.values()):
                task.cancel()
            self.on_dropped(self.peer_pid)

    def put(self, item: tuple) -> None:
        if not self.pending:  # sent once the readers that this step woke have all run
            self.loop.call_soon(self._flush)
        self.pending.append(item)

    def _flush(self) -> None:
        items, self.pending = self.pending, []
        self.send(("out", items))

    async def serve(self) -> None:
        try:
            while (message := await read_message(self.reader)) is not None:
                kind, key, *rest = message
                if kind == "submit":
                    self._start(key, self._relay(key, *rest))
                elif kind == "embed":
                    self._start(key, self._embed(key, *rest))
                elif kind == "lifecycle":
                    self._start(key, self._lifecycle(key, *rest))
                elif kind in ("abort", "cancel"):
                    task = self.tasks.get(key)
                    if task is not None:
                        task.cancel()  # a stream's read cancelled aborts its request
        finally:
            for task in list(self.tasks.values()):
                task.cancel()
            self.writer.close()

    def _start(self, key: str, work) -> None:
        task = self.loop.create_task(work)
        self.tasks[key] = task
        task.add_done_callback(lambda _: self.tasks.pop(key, None))

    async def _relay(self, request_id: str, prompt_token_ids: list[int], params_fields: dict) -> None:
        engine = self.engine
        try:
            if self.gate.closed_reason is not None:  # sent before its front-end heard of the sleep or reload
                raise EngineAsleepError(f"the engine is {self.gate.closed_reason}")
            params = params_in(params_fields)
            if params.structured_output is None:
                stream = engine.stream(prompt_token_ids, params, request_id=request_id)
            else:  # compiled off this loop, as the single-process server does
                await engine.compile_structured_output(params.structured_output)
                stream = await anyio.to_thread.run_sync(
                    lambda: engine.stream(prompt_token_ids, params, request_id=request_id))
            async with stream:
                async for out in stream:
                    if out.finish_reason is None and out.logprobs is None and out.reasoning is None \
                            and out.prompt_logprobs is None:  # most of a stream: the short item
                        self.put((request_id, out.text, out.token_ids, out.index))
                        continue
                    metrics = None
                    if out.finish_reason is not None and stream.metrics is not None:
                        metrics = tuple(vars(stream.metrics).values())
                    self.put((request_id, None, out.text, out.token_ids, out.finish_reason and str(out.finish_reason),
                              out.index, logprobs_out(out.logprobs), out.stop_reason,
                              logprobs_out(out.prompt_logprobs), out.reasoning, metrics))
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - the request's error, raised by its front-end's stream
            self.put((request_id, error_out(e)) + (None,) * 9)

    async def _embed(self, call_id: str, prompts, options: dict) -> None:
        try:
            value, error = await self.engine.embed(prompts, **options), None
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001
            value, error = None, e
        self.send(("reply", call_id, value, error_out(error)))

    async def _lifecycle(self, call_id: str, action: str, level: int | None) -> None:
        """A front-end's /sleep, /wake_up or /reload, run by the gate that every front-end shares."""
        try:
            if action == "sleep":
                await self.gate.sleep(level)
            elif action == "wake":
                await self.gate.wake()
            elif action == "reload":
                await self.gate.reload()
            else:
                raise ValueError(f"unknown lifecycle action {action!r}")
            error = None
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - the front-end's route answers it
            error = e
        self.send(("reply", call_id, None, error_out(error)))


class EngineHost:
    """The engine process's side: the link's socket, and what every front-end is sent: the engine's
    start-up phase until it is ready, then ("ready", max_seq_len, stats) and the stats."""

    def __init__(self, engine):
        self.engine = engine
        self.links: list[FrontendLink] = []
        self.ready = False
        self.dropped = False  # a front-end that stopped reading was dropped: the server stops
        self.dropped_pids: set[int] = set()  # those front-ends (killed at the stop: they cannot drain)
        self.max_pending = settings.FRONTEND_MAX_PENDING_BYTES.read()
        self.gate = LifecycleGate(engine, on_change=self._lifecycle_changed)

    def _lifecycle_message(self) -> tuple:
        return ("lifecycle", self.gate.closed_reason, self.gate.is_sleeping)

    def _lifecycle_changed(self, _reason) -> None:
        for link in self.links:
            link.send(self._lifecycle_message())

    def state(self) -> tuple:
        if not self.ready:
            return ("starting", self.engine.startup_phase or "starting")
        try:
            self.engine.check_alive()
            return ("stats", self.engine.stats())
        except EngineDeadError as e:
            return ("dead", str(e))

    def mark_ready(self) -> None:
        self.ready = True
        for link in self.links:
            link.send(("ready", self.engine.max_seq_len, self.engine.stats()))

    async def accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        link = FrontendLink(self.engine, reader, writer, self.max_pending, self._dropped, self.gate)
        link.send(("ready", self.engine.max_seq_len, self.engine.stats()) if self.ready else self.state())
        link.send(self._lifecycle_message())
        self.links.append(link)
        try:
            await link.serve()
        finally:
            self.links.remove(link)

    def _dropped(self, pid: int | None) -> None:
        self.dropped = True
        if pid is not None:
            self.dropped_pids.add(pid)

    async def send_stats(self) -> None:
        while True:
            await asyncio.sleep(STATS_INTERVAL_S)
            message = self.state()
            for link in list(self.links):
                link.send(message)


def listening_socket(host: str, port: int) -> socket.socket:
    """The HTTP port's socket, listened on here and shared by every front-end (the kernel hands each
    connection to one of them)."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(2048)
    return sock


def serve_with_frontends(engine, count: int, sock: socket.socket, settings_: FrontendSettings,
                         on_ready: Callable[[], None]) -> int:
    """Run the engine and `count` front-ends on sock until SIGTERM/SIGINT (0) or a failure (1; 2 if
    the engine failed to start)."""
    return asyncio.run(_serve(engine, count, sock, settings_, on_ready))


async def _serve(engine, count: int, sock: socket.socket, settings_: FrontendSettings, on_ready) -> int:
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    # the front-ends start with the engine: their /health says "starting" (and the phase) meanwhile
    private_dir = tempfile.mkdtemp(prefix="asyncllm-engine-")  # 0700: only this user reaches the socket
    path = os.path.join(private_dir, "engine.sock")
    host = EngineHost(engine)
    ipc = await asyncio.start_unix_server(host.accept, path)
    stats = loop.create_task(host.send_stats())
    starting = loop.create_task(engine.start())
    spawn = multiprocessing.get_context("spawn")
    frontends = [spawn.Process(target=run_frontend, args=(sock, path, settings_), name=f"asyncllm-frontend-{i}")
                 for i in range(count)]
    failed = start_failed = False
    try:
        for frontend in frontends:
            frontend.start()
        deadline = loop.time() + FRONTEND_START_TIMEOUT_S
        ready = False
        while not stop.is_set():
            crashed = _crashed(frontends)
            if crashed:
                for f in crashed:
                    logger.error("asyncllm serve: front-end %s exited with %s; stopping the server", f.name, f.exitcode)
                failed = True
                break
            if host.dropped:
                failed = True
                break
            if starting.done() and not ready:
                if starting.exception() is not None:
                    error = starting.exception()
                    logger.error("asyncllm serve: %s", error.__cause__ or error)
                    start_failed = True
                    break
                host.mark_ready()
                ready = True
            if ready and len(host.links) == count and on_ready is not None:
                on_ready()
                on_ready = None
            if len(host.links) < count and loop.time() > deadline:
                raise TimeoutError
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(0.05 if on_ready is not None else 0.2):
                    await stop.wait()
    except TimeoutError:
        logger.error("asyncllm serve: the front-ends did not connect within %.0f s", FRONTEND_START_TIMEOUT_S)
        failed = True
    finally:
        failed = not await _stop_frontends(frontends, settings_.drain_s, host.dropped_pids) or failed
        stats.cancel()
        ipc.close()
        with contextlib.suppress(Exception):  # a start under way is waited for (the engine thread cannot be cut)
            await starting
        await engine.shutdown(drain=False)
        shutil.rmtree(private_dir, ignore_errors=True)
    return 2 if start_failed else 1 if failed else 0


def _crashed(frontends) -> list:
    return [f for f in frontends if f.exitcode is not None]


def _peer_pid(writer: asyncio.StreamWriter) -> int | None:
    """The process at the other end of a Unix socket (Linux's SO_PEERCRED; None elsewhere)."""
    sock = writer.get_extra_info("socket")
    if sock is None or not hasattr(socket, "SO_PEERCRED"):
        return None
    pid, _, _ = struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i")))
    return pid


async def _stop_frontends(frontends, drain_s: float, dropped_pids: set[int]) -> bool:
    """SIGTERM each front-end (each drains as a single-process server does) and wait; True if all
    of them exited 0 (a front-end that had already failed or never started: False). SIGCONT after
    the SIGTERM (as systemd sends it): a stopped front-end (SIGSTOP, a terminal's Ctrl-Z) handles
    its SIGTERM now instead of being killed past the drain's limit. One whose link was dropped for
    not reading it is killed at once: its requests are gone, and it may be hung."""
    for frontend in frontends:
        if frontend.exitcode is None and frontend.pid is not None:
            if frontend.pid in dropped_pids:
                frontend.kill()
                continue
            os.kill(frontend.pid, signal.SIGTERM)
            os.kill(frontend.pid, signal.SIGCONT)
    deadline = asyncio.get_running_loop().time() + drain_s + EXTRA_STOP_S
    while any(f.exitcode is None and f.pid is not None for f in frontends):
        if asyncio.get_running_loop().time() > deadline:
            for frontend in frontends:
                if frontend.exitcode is None:
                    frontend.kill()
        await asyncio.sleep(0.05)
    return all(f.exitcode == 0 for f in frontends)
