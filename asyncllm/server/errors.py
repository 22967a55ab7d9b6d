"""OpenAI-shaped error bodies for what the routes do not answer themselves: Starlette's 404 and 405,
an exception that escapes a handler (500), and the 503 past --limit-concurrency."""
from __future__ import annotations

import json
import logging

from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response

from asyncllm.server.protocol import APIError

logger = logging.getLogger("asyncllm.server")

RETRY_AFTER_SECONDS = 1  # on 429 and 503: the queue and the connection limit drain within seconds
HTTP_ERROR_CODES = {404: "not_found", 405: "method_not_allowed"}


async def http_error(request: Request, exc: HTTPException) -> Response:
    error = APIError(exc.status_code, f"{exc.detail}: {request.method} {request.url.path}",
                     code=HTTP_ERROR_CODES.get(exc.status_code), headers=exc.headers)
    return error.response()


async def internal_error(request: Request, exc: Exception) -> Response:
    # Starlette logs the exception and re-raises it to the server after this response is sent
    return APIError(500, "internal server error", code="internal_error").response()


def queue_full_error(error: Exception) -> APIError:
    """The 429 of a full queue (QueueFullError): at submission, or, with front-end processes (where
    the engine admits the request after the route has its stream), as the stream's first read."""
    return APIError(429, f"the server is busy: {error}", code="queue_full",
                    headers={"Retry-After": str(RETRY_AFTER_SECONDS)})


def asleep_error(error: Exception | None = None) -> APIError:
    """The 503 of a request while the engine sleeps (lifecycle_routes.py): at the route's check, or
    (EngineAsleepError) from a stream submitted as the engine went to sleep."""
    return APIError(503, "the engine is asleep (POST /sleep); it serves again after POST /wake_up"
                    + (f" ({error})" if error is not None else ""), code="engine_sleeping")


def exception_handlers() -> dict:
    """For Starlette(exception_handlers=...): every error it answers itself in OpenAI's shape."""
    return {HTTPException: http_error, Exception: internal_error}


SERVICE_UNAVAILABLE_BODY = json.dumps(APIError(
    503, "the server is at its connection limit (--limit-concurrency); retry later",
    code="too_many_connections").body()).encode()


async def service_unavailable(scope, receive, send) -> None:
    """The ASGI app connections.HeadTimeoutH11Protocol runs instead of ours past --limit-concurrency
    (uvicorn's own answer is plain text): the same status, in OpenAI's shape, with Retry-After."""
    await send({"type": "http.response.start", "status": 503, "headers": [
        (b"content-type", b"application/json"), (b"content-length", str(len(SERVICE_UNAVAILABLE_BODY)).encode()),
        (b"retry-after", str(RETRY_AFTER_SECONDS).encode()), (b"connection", b"close")]})
    await send({"type": "http.response.body", "body": SERVICE_UNAVAILABLE_BODY, "more_body": False})
