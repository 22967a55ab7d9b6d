"""The engine's sleep, wake and reload over HTTP (vLLM's dev-mode routes; off unless the server is
started with `--enable-lifecycle-routes`, create_app(lifecycle_routes=True)):

  POST /sleep?level=1|2   free the device's memory (engine/lifecycle.py's levels); {"is_sleeping": true}
  POST /wake_up           back from sleep; {"is_sleeping": false}
  GET  /is_sleeping       {"is_sleeping": bool}
  POST /reload            read the served checkpoint's directory again (new weights in place); a
                          client never names a path: what the engine loads is its own model

A sleep or reload waits for the requests in flight to finish; from the moment it is asked, new
generation (and embeddings) get 503 (code engine_sleeping, or engine_reloading with Retry-After)
until the wake, or the reload's end. A sleep while asleep and a wake while awake change nothing.
LifecycleGate runs them where the engine is: in the server's process, or with --api-server-count N
in the engine process (engine_host.py), whose front-ends forward the routes' calls over the link and
learn the gate's state from it (engine_client.RemoteLifecycle). A reload there reads the weights and
tokenizer into the engine process; the front-ends keep the tokenizer they loaded from the same
directory at start (a reload is for new weights of the same model: the engine checks the structure).
"""
from __future__ import annotations

from collections.abc import Callable

import anyio
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from asyncllm.errors import EngineAsleepError, EngineDeadError, EngineNotIdleError
from asyncllm.server.errors import RETRY_AFTER_SECONDS, asleep_error
from asyncllm.server.protocol import APIError

SLEEPING, RELOADING = "sleeping", "reloading"  # why a gate refuses generation
MAX_IDLE_RETRIES = 20  # a request that passed the gate just before it closed, submitted since: wait again


class LifecycleGate:
    """An engine's sleep(), wake() and reload() between requests, and the state that refuses new
    ones meanwhile (closed_reason). on_change(closed_reason) is called after every change."""

    def __init__(self, engine, on_change: Callable[[str | None], None] | None = None):
        self.engine = engine
        self.on_change = on_change
        self._lock = anyio.Lock()
        self._pausing: str | None = None  # SLEEPING or RELOADING while the requests in flight finish

    @property
    def closed_reason(self) -> str | None:
        """None while requests are admitted, else SLEEPING (asleep, or going to sleep) or RELOADING."""
        if self._pausing is not None:
            return self._pausing
        return SLEEPING if self.engine.is_sleeping else None

    @property
    def is_sleeping(self) -> bool:
        return self.engine.is_sleeping

    def _changed(self) -> None:
        if self.on_change is not None:
            self.on_change(self.closed_reason)

    async def sleep(self, level: int) -> None:
        async with self._lock:
            if not self.engine.is_sleeping:
                await self._between_requests(SLEEPING, lambda: self.engine.sleep(level))

    async def wake(self) -> None:
        async with self._lock:
            with anyio.CancelScope(shield=True):  # the engine thread wakes all the same
                await self.engine.wake()
            self._changed()

    async def reload(self) -> None:
        async with self._lock:
            if self.engine.is_sleeping:
                raise EngineAsleepError("reload: the engine is asleep; wake it first (POST /wake_up)")
            await self._between_requests(RELOADING, lambda: self.engine.reload(self.engine.config.model))

    async def _between_requests(self, reason: str, change) -> None:
        self._pausing = reason
        self._changed()
        try:
            for _ in range(MAX_IDLE_RETRIES):
                await self.engine.wait_idle()
                try:
                    with anyio.CancelScope(shield=True):  # once posted, the engine thread applies it
                        await change()
                    return
                except EngineNotIdleError:  # a request that passed the gate just before it closed
                    pass
            raise EngineNotIdleError("requests kept reaching the engine while it waited to be idle")
        finally:
            self._pausing = None
            self._changed()


def closed_error(reason: str) -> APIError:
    """The 503 of a request that a closed gate refuses."""
    if reason == RELOADING:
        return APIError(503, "the engine is reloading its checkpoint; retry shortly", code="engine_reloading",
                        headers={"Retry-After": str(RETRY_AFTER_SECONDS)})
    return asleep_error()


def _no_query(request: Request, allowed: tuple[str, ...] = ()) -> None:
    unknown = sorted(set(request.query_params) - set(allowed))
    if unknown:
        raise APIError(400, f"unknown query parameter(s) {', '.join(map(repr, unknown))}"
                            + (f"; this route takes {', '.join(allowed)}" if allowed else "; this route takes none"),
                       param=unknown[0], code="invalid_value")


async def _run(work) -> None:
    """A lifecycle call with the engine's refusals as HTTP errors."""
    try:
        await work
    except EngineAsleepError as e:
        raise APIError(409, str(e), code="engine_sleeping") from None
    except EngineNotIdleError as e:  # (crosses the engine link as itself)
        raise APIError(503, f"{e}; try again", code="engine_busy",
                       headers={"Retry-After": str(RETRY_AFTER_SECONDS)}) from None
    except NotImplementedError as e:  # tensor parallelism
        raise APIError(501, str(e), code="not_supported") from None
    except EngineDeadError:
        raise  # the endpoint's 503
    except (ValueError, TypeError, RuntimeError, OSError) as e:
        raise APIError(500, f"the engine could not do it: {e}", code="lifecycle_failed") from None


async def sleep(server, request: Request) -> Response:
    _no_query(request, ("level",))
    level = request.query_params.get("level", "1")
    if level not in ("1", "2"):
        raise APIError(400, f"'level' must be 1 (weights to host memory) or 2 (weights dropped), got {level!r}",
                       param="level", code="invalid_value")
    server._check_engine(needs_model=False)
    await _run(server.lifecycle.sleep(int(level)))
    return JSONResponse({"is_sleeping": True})


async def wake_up(server, request: Request) -> Response:
    _no_query(request)
    server._check_engine(needs_model=False)
    await _run(server.lifecycle.wake())
    return JSONResponse({"is_sleeping": False})


async def is_sleeping(server, request: Request) -> Response:
    _no_query(request)
    server._check_engine(needs_model=False)
    return JSONResponse({"is_sleeping": server.lifecycle.is_sleeping})


async def reload(server, request: Request) -> Response:
    _no_query(request)  # nothing a client sends names what is loaded
    server._check_engine(needs_model=False)  # asleep: the gate's 409
    await _run(server.lifecycle.reload())
    return JSONResponse({"reloaded": server.model_name})
