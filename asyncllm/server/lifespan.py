"""The app's lifespan: the engine started (waited for, or in the background while HTTP already
answers) and shut down; and the engine's start-up as the routes see it (EngineStartup).

`asyncllm serve` starts the engine in the background: its port answers at once, /health says
503 {"status": "starting", "phase": ...} (the start-up phase under way, asyncllm/startup.py's
names) until the engine is ready and 200 {"status": "ready"} from then on, as readiness probes and
load balancers expect, and any other route but /metrics gets a 503 with code server_starting at
once rather than waiting out the start-up. A start-up that fails calls on_engine_started with the
error (serve then stops the server and exits with code 2)."""
from __future__ import annotations

import logging
from collections.abc import Callable
from contextlib import asynccontextmanager

import anyio
from starlette.responses import JSONResponse

from asyncllm.errors import EngineDeadError
from asyncllm.server.errors import RETRY_AFTER_SECONDS
from asyncllm.server.protocol import APIError

logger = logging.getLogger("asyncllm.server")


class EngineStartup:
    """Whether the engine is starting and in which phase, for /health and the routes' 503."""

    def __init__(self, engine):
        self.engine = engine
        self.in_background = False  # the lifespan started the engine without waiting, and it is not done

    def phase(self) -> str | None:
        """The start-up phase under way ("starting" before the engine's first), or None when the
        engine is not starting."""
        phase = self.engine.startup_phase
        if phase is None and not self.in_background:
            return None
        return phase or "starting"

    def check_started(self) -> None:
        """A 503 (Retry-After) while the engine starts: at once, a request must not wait out a
        start-up of seconds to minutes."""
        phase = self.phase()
        if phase is not None:
            raise APIError(503, f"the server is starting (start-up phase: {phase}); retry once /health answers 200",
                           code="server_starting", headers={"Retry-After": str(RETRY_AFTER_SECONDS)})

    def health(self) -> JSONResponse | None:
        """/health's answer while the engine starts, else None."""
        phase = self.phase()
        if phase is None:
            return None
        return JSONResponse({"status": "starting", "phase": phase}, status_code=503,
                            headers={"Retry-After": str(RETRY_AFTER_SECONDS)})


class EngineLifespan:
    """create_app's lifespan (run): owns = it starts the engine and shuts it down (manage_engine:
    True, False, or None = it owns an engine not started yet)."""

    def __init__(self, engine, startup: EngineStartup, model_name: str, manage_engine: bool | None,
                 in_background: bool, on_engine_started: Callable[[BaseException | None], None] | None):
        self.engine = engine
        self.startup = startup
        self.model_name = model_name
        self.manage_engine = manage_engine
        self.in_background = in_background
        self.on_engine_started = on_engine_started

    @asynccontextmanager
    async def run(self, app):
        engine = self.engine
        owns = (not engine.started) if self.manage_engine is None else self.manage_engine
        try:
            async with anyio.create_task_group() as background:
                if owns and self.in_background:
                    self.startup.in_background = True
                    background.start_soon(self._start)
                elif owns:
                    await self._start()
                else:
                    self._log_serving()
                try:
                    yield
                finally:
                    background.cancel_scope.cancel()  # a start under way: the shutdown waits for it, not this
        finally:
            if owns:  # outside the cancelled scope
                await engine.shutdown(drain=False)

    async def _start(self) -> None:
        try:
            await self.engine.start()
        except EngineDeadError as e:
            if self.on_engine_started is not None:
                self.on_engine_started(e)  # it reports the error
            elif self.in_background:  # the app serves on, every route a 503 (the engine is dead)
                logger.error("asyncllm: the engine failed to start: %s", e.__cause__ or e)
            if not self.in_background:
                raise
            return
        finally:
            self.startup.in_background = False
        self._log_serving()
        if self.on_engine_started is not None:
            self.on_engine_started(None)

    def _log_serving(self) -> None:
        stats = self.engine.stats()
        logger.info("asyncllm: serving %s (%s KV blocks of %s tokens)", self.model_name,
                    stats.get("num_total_blocks"), stats.get("block_size"))
