"""An OpenAI-compatible HTTP server around AsyncLLMEngine (Starlette; run it with `asyncllm serve`).

Endpoints: POST /v1/chat/completions, POST /v1/completions (streaming as server-sent events ending
in `data: [DONE]`, or one JSON body), GET /v1/models, GET /health, GET /metrics (Prometheus text).

    app = create_app(engine, "my-model", api_key="secret")   # engine started by the app's lifespan
    uvicorn.run(app, host="127.0.0.1", port=8000)            # unless the caller started it already

Request fields map to SamplingParams: max_tokens / max_completion_tokens, temperature, top_p, stop
(a string or a list), seed, plus the extensions top_k, min_p, ignore_eos, stop_token_ids,
include_stop_str_in_output and (chat) chat_template_kwargs. n must be 1. Fields this server does
not implement (logprobs, tools, echo, best_of, penalties, ...) are accepted only at their neutral
value; anything else, and any unknown field, is a 400 with an OpenAI-style error body.

A client that disconnects, mid-stream or while waiting for a non-streamed answer, aborts its
request: the engine frees its KV blocks before its next step.
"""
from __future__ import annotations

import bisect
import hmac
import json
import logging
import threading
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager

import anyio
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

from asyncllm.errors import EngineDeadError, QueueFullError
from asyncllm.sampling_params import SamplingParams

logger = logging.getLogger("asyncllm.server")

DEFAULT_MAX_BODY_BYTES = 1 << 20  # 1 MiB
COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for the legacy completions endpoint

_MISSING = object()


# ---- errors ---------------------------------------------------------------------------------------
class APIError(Exception):
    """An error answered with an OpenAI-style body: {"error": {message, type, param, code}}."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 type: str | None = None):  # noqa: A002 - OpenAI's field name
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type or ("server_error" if status >= 500 else
                             "rate_limit_error" if status == 429 else "invalid_request_error")

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        headers = {"WWW-Authenticate": "Bearer"} if self.status == 401 else None
        return JSONResponse(self.body(), status_code=self.status, headers=headers)


def _type_name(value) -> str:
    return {dict: "an object", list: "an array", str: "a string", bool: "a boolean", int: "an integer",
            float: "a number", type(None): "null"}.get(type(value), type(value).__name__)


# ---- request fields ---------------------------------------------------------------------------------
def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _expect(body: dict, name: str, check: Callable[[object], bool], what: str):
    """body[name] if present and not null, checked; _MISSING otherwise."""
    value = body.get(name)
    if value is None:
        return _MISSING
    if not check(value):
        raise APIError(400, f"'{name}': expected {what}, got {_type_name(value)} ({json.dumps(value)[:80]})",
                       param=name, code="invalid_type")
    return value


# Fields OpenAI clients send that this server does not implement: accepted only at a neutral value.
_NEUTRAL = {
    "logprobs": lambda v: v is False or v is None,
    "top_logprobs": lambda v: v == 0,
    "tools": lambda v: v == [],
    "tool_choice": lambda v: v == "none",
    "functions": lambda v: v == [],
    "function_call": lambda v: v == "none",
    "parallel_tool_calls": lambda v: isinstance(v, bool),  # meaningless without tools
    "response_format": lambda v: v == {"type": "text"},
    "frequency_penalty": lambda v: v == 0,
    "presence_penalty": lambda v: v == 0,
    "repetition_penalty": lambda v: v == 1,
    "logit_bias": lambda v: v == {},
    "store": lambda v: v is False,
    "modalities": lambda v: v == ["text"],
    "user": lambda v: isinstance(v, str),  # an end-user id for abuse tracking: accepted, unused
    "metadata": lambda v: isinstance(v, dict),
    "service_tier": lambda v: isinstance(v, str),
}
_NEUTRAL_COMPLETIONS = dict(_NEUTRAL, logprobs=lambda v: v is None, echo=lambda v: v is False,
                            best_of=lambda v: v == 1, suffix=lambda v: v == "")
for _name in ("top_logprobs", "tools", "tool_choice", "functions", "function_call", "parallel_tool_calls",
              "response_format", "store", "modalities"):
    _NEUTRAL_COMPLETIONS.pop(_name)

_SAMPLING_FIELDS = {"model", "stream", "stream_options", "n", "max_tokens", "temperature", "top_p", "top_k",
                    "min_p", "seed", "stop", "stop_token_ids", "ignore_eos", "include_stop_str_in_output"}
_CHAT_FIELDS = _SAMPLING_FIELDS | {"messages", "max_completion_tokens", "chat_template_kwargs"}
_COMPLETION_FIELDS = _SAMPLING_FIELDS | {"prompt"}


def _check_fields(body: dict, known: set[str], neutral: dict) -> None:
    for name, value in body.items():
        if name in known:
            continue
        if name in neutral:
            if value is None or neutral[name](value):
                continue
            raise APIError(400, f"'{name}'={json.dumps(value)[:80]} is not supported by this server; "
                                f"leave it out", param=name, code="unsupported_parameter")
        raise APIError(400, f"Unrecognized request argument supplied: {name}", param=name,
                       code="unknown_parameter")


# ---- metrics -----------------------------------------------------------------------------------------
class _Histogram:
    def __init__(self, name: str, help_text: str, buckets: tuple[float, ...]):
        self.name, self.help, self.buckets = name, help_text, buckets
        self.counts = [0] * (len(buckets) + 1)  # the last one: above every bucket
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.sum += value
        self.count += 1

    def render(self, out: list[str]) -> None:
        out += [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} histogram"]
        cumulative = 0
        for bound, count in zip(self.buckets, self.counts):
            cumulative += count
            out.append(f'{self.name}_bucket{{le="{bound}"}} {cumulative}')
        out.append(f'{self.name}_bucket{{le="+Inf"}} {self.count}')
        out.append(f"{self.name}_sum {self.sum!r}")
        out.append(f"{self.name}_count {self.count}")


class ServerMetrics:
    """Request-level metrics, fed as requests end, rendered with the engine's gauges."""

    FINISH_REASONS = ("stop", "length", "abort", "error")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.ttft = _Histogram("asyncllm_time_to_first_token_seconds", "Time from arrival to the first token.",
                               (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                                7.5, 10.0, 20.0, 40.0, 80.0))
        self.itl = _Histogram("asyncllm_inter_token_latency_seconds", "Time between a request's token deliveries.",
                              (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1,
                               0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0))
        self.e2e = _Histogram("asyncllm_e2e_request_latency_seconds", "Time from arrival to the last token.",
                              (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0))
        self.finished = dict.fromkeys(self.FINISH_REASONS, 0)
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.rejected: dict[int, int] = {}

    def observe_request(self, stream, finish_reason: str) -> None:
        m = stream.metrics
        with self._lock:
            self.finished[finish_reason] = self.finished.get(finish_reason, 0) + 1
            self.prompt_tokens += len(stream.prompt_token_ids)
            self.generation_tokens += len(stream.token_ids)
            if m is None:
                return
            if m.time_to_first_token is not None:
                self.ttft.observe(m.time_to_first_token)
            for gap in list(m.inter_token_latencies):
                self.itl.observe(gap)
            if m.e2e_latency is not None:
                self.e2e.observe(m.e2e_latency)

    def observe_rejection(self, status: int) -> None:
        with self._lock:
            self.rejected[status] = self.rejected.get(status, 0) + 1

    def render(self, stats: dict) -> str:
        out: list[str] = []

        def gauge(name: str, help_text: str, value, kind: str = "gauge") -> None:
            out.extend([f"# HELP {name} {help_text}", f"# TYPE {name} {kind}", f"{name} {value}"])

        total = stats.get("num_total_blocks", 0)
        gauge("asyncllm_num_requests_waiting", "Requests queued in the scheduler, not yet running.",
              stats.get("num_waiting", 0))
        gauge("asyncllm_num_pending_commands", "Submissions and aborts not yet taken in by the engine thread.",
              stats.get("num_inbox", 0))
        gauge("asyncllm_num_requests_running", "Requests being generated.", stats.get("num_running", 0))
        gauge("asyncllm_kv_blocks_in_use", "KV-cache blocks held by requests.", total - stats.get("num_free_blocks", 0))
        gauge("asyncllm_kv_blocks_total", "KV-cache blocks in all.", total)
        gauge("asyncllm_kv_cache_usage_ratio", "Fraction of the KV-cache blocks in use.",
              (total - stats.get("num_free_blocks", 0)) / total if total else 0.0)
        gauge("asyncllm_prefix_cache_hit_rate", "Fraction of prompt tokens served from the prefix cache.",
              float(stats.get("prefix_cache_hit_rate", 0.0)))
        gauge("asyncllm_num_preemptions_total", "Requests preempted for lack of KV blocks.",
              stats.get("num_preemptions", 0), "counter")
        with self._lock:
            out += ["# HELP asyncllm_requests_total Finished requests by finish reason.",
                    "# TYPE asyncllm_requests_total counter"]
            out += [f'asyncllm_requests_total{{finish_reason="{r}"}} {n}' for r, n in self.finished.items()]
            out += ["# HELP asyncllm_requests_rejected_total Requests refused before generation, by HTTP status.",
                    "# TYPE asyncllm_requests_rejected_total counter"]
            out += [f'asyncllm_requests_rejected_total{{status="{s}"}} {n}' for s, n in sorted(self.rejected.items())]
            gauge("asyncllm_prompt_tokens_total", "Prompt tokens of finished requests.", self.prompt_tokens, "counter")
            gauge("asyncllm_generation_tokens_total", "Tokens generated for finished requests.",
                  self.generation_tokens, "counter")
            for histogram in (self.ttft, self.itl, self.e2e):
                histogram.render(out)
        return "\n".join(out) + "\n"


# ---- streaming responses ----------------------------------------------------------------------------
class EventStreamResponse(StreamingResponse):
    """A server-sent-events response that always closes its body iterator.

    The body runs beside a watcher of the client's connection, whatever the server's ASGI spec
    version; when the client goes away the body is cancelled, and in every case the async
    generator is aclose()d, so a generator that holds an engine stream in `async with` or
    try/finally aborts its request at once instead of at garbage collection.
    """

    media_type = "text/event-stream"

    def __init__(self, content: AsyncIterator, status_code: int = 200, headers: dict | None = None,
                 on_close: Callable[[], Awaitable] | None = None):
        """on_close: awaited last, in every case, even when the client left before the body started
        (then the generator never ran, so its own finally never runs): pass the engine stream's aclose."""
        headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no", **(headers or {})}
        super().__init__(content, status_code=status_code, headers=headers)
        self.on_close = on_close

    async def __call__(self, scope, receive, send) -> None:
        try:
            async with anyio.create_task_group() as tasks:
                async def run_body() -> None:
                    try:
                        await self.stream_response(send)
                    except (OSError, ClientDisconnect):  # the client is gone
                        pass
                    except Exception:  # noqa: BLE001 - the status line is sent; nothing to answer with
                        logger.exception("error while streaming a response")
                    tasks.cancel_scope.cancel()

                tasks.start_soon(run_body)
                await self.listen_for_disconnect(receive)
                tasks.cancel_scope.cancel()
        finally:
            with anyio.CancelScope(shield=True):
                aclose = getattr(self.body_iterator, "aclose", None)
                if aclose is not None:
                    await aclose()
                if self.on_close is not None:
                    await self.on_close()


def sse(data) -> str:
    """One server-sent event carrying `data` (JSON-encoded unless it is a string)."""
    return f"data: {data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)}\n\n"


async def _await_disconnect(receive) -> None:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


# ---- the application ----------------------------------------------------------------------------------
class OpenAIServer:
    def __init__(self, engine, model_name: str, api_key: str | None = None, *,
                 max_body_bytes: int = DEFAULT_MAX_BODY_BYTES, max_tokens_limit: int | None = None):
        if max_tokens_limit is not None and (not _is_int(max_tokens_limit) or max_tokens_limit < 1):
            raise ValueError(f"max_tokens_limit: expected a positive int or None, got {max_tokens_limit!r}")
        if not _is_int(max_body_bytes) or max_body_bytes < 1:
            raise ValueError(f"max_body_bytes: expected a positive int, got {max_body_bytes!r}")
        self.engine = engine
        self.model_name = model_name
        self.api_key = api_key or None
        self.max_body_bytes = max_body_bytes
        self.max_tokens_limit = max_tokens_limit
        self.metrics = ServerMetrics()
        self.created = int(time.time())

    # ---- plumbing ----
    def _check_auth(self, request: Request) -> None:
        if self.api_key is None:
            return
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), self.api_key.encode()):
            raise APIError(401, "Incorrect or missing API key: send 'Authorization: Bearer <key>'.",
                           code="invalid_api_key")

    async def _read_json(self, request: Request) -> dict:
        length = request.headers.get("content-length")
        if length is not None:
            if not length.isdigit():
                raise APIError(400, "invalid Content-Length header")
            if int(length) > self.max_body_bytes:
                raise APIError(413, f"the request body is {length} bytes; the limit is {self.max_body_bytes}",
                               code="request_too_large")
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > self.max_body_bytes:
                raise APIError(413, f"the request body is over the limit of {self.max_body_bytes} bytes",
                               code="request_too_large")
            chunks.append(chunk)
        try:
            body = json.loads(b"".join(chunks))
        except (ValueError, RecursionError) as e:
            raise APIError(400, f"We could not parse the JSON body of your request ({e}). "
                                "The body must be a JSON object.", code="invalid_json") from None
        if not isinstance(body, dict):
            raise APIError(400, f"the request body must be a JSON object, got {_type_name(body)}",
                           code="invalid_json")
        return body

    def _check_engine(self) -> None:
        check = getattr(self.engine, "check_alive", None)
        if check is not None:
            try:
                check()
            except (EngineDeadError, RuntimeError) as e:
                raise APIError(503, f"the engine is not available: {e}", code="engine_unavailable") from None

    def _endpoint(self, handler, *, auth: bool = True):
        async def endpoint(request: Request) -> Response:
            try:
                if auth:
                    self._check_auth(request)
                return await handler(request)
            except APIError as e:
                if e.status in (429, 503):
                    self.metrics.observe_rejection(e.status)
                return e.response()
            except Exception:  # noqa: BLE001 - answered as a 500 with an OpenAI body
                logger.exception("unhandled error in %s", request.url.path)
                return APIError(500, "internal server error").response()
        return endpoint

    # ---- request parsing ----
    def _check_model(self, body: dict) -> None:
        model = _expect(body, "model", lambda v: isinstance(v, str), "a string")
        if model is not _MISSING and model != self.model_name:
            raise APIError(404, f"The model '{model}' does not exist; this server serves '{self.model_name}'.",
                           param="model", code="model_not_found")

    def _sampling_params(self, body: dict, max_tokens_field: str, default_max_tokens: int) -> SamplingParams:
        n = _expect(body, "n", _is_int, "an integer")
        if n is not _MISSING and n != 1:
            raise APIError(400, f"'n'={n} is not supported: this server returns one choice (n=1)",
                           param="n", code="unsupported_value")
        kwargs: dict = {}
        max_tokens = _expect(body, max_tokens_field, _is_int, "an integer")
        param = max_tokens_field
        if max_tokens is _MISSING and max_tokens_field != "max_tokens":
            max_tokens = _expect(body, "max_tokens", _is_int, "an integer")
            param = "max_tokens"
        if max_tokens is _MISSING:
            max_tokens = default_max_tokens
            if self.max_tokens_limit is not None:
                max_tokens = min(max_tokens, self.max_tokens_limit)
        elif self.max_tokens_limit is not None and max_tokens > self.max_tokens_limit:
            raise APIError(400, f"'{param}'={max_tokens} is over this server's limit of {self.max_tokens_limit}",
                           param=param, code="invalid_value")
        kwargs["max_tokens"] = max_tokens
        for name, check, what in (("temperature", _is_number, "a number"), ("top_p", _is_number, "a number"),
                                  ("min_p", _is_number, "a number"), ("top_k", _is_int, "an integer"),
                                  ("seed", _is_int, "an integer"), ("ignore_eos", lambda v: isinstance(v, bool), "a boolean"),
                                  ("include_stop_str_in_output", lambda v: isinstance(v, bool), "a boolean"),
                                  ("stop", lambda v: isinstance(v, str) or (isinstance(v, list) and all(
                                      isinstance(s, str) for s in v)), "a string or an array of strings"),
                                  ("stop_token_ids", lambda v: isinstance(v, list) and all(_is_int(t) for t in v),
                                   "an array of integers")):
            value = _expect(body, name, check, what)
            if value is not _MISSING:
                kwargs[name] = value
        if "seed" in kwargs and not -(1 << 63) <= kwargs["seed"] < (1 << 64):  # torch.Generator's range
            raise APIError(400, f"'seed'={kwargs['seed']} is out of range [-2**63, 2**64)", param="seed",
                           code="invalid_value")
        if isinstance(kwargs.get("stop"), list) and len(kwargs["stop"]) > 16:
            raise APIError(400, "'stop': at most 16 stop strings", param="stop", code="invalid_value")
        try:
            return SamplingParams(**kwargs)
        except ValueError as e:
            message = str(e)
            field = message.split(":", 1)[0].removeprefix("SamplingParams.") if ":" in message else None
            if field == "max_tokens":
                field = param
            raise APIError(400, message.removeprefix("SamplingParams."), param=field, code="invalid_value") from None

    def _stream_options(self, body: dict) -> bool:
        """Checks 'stream' and 'stream_options'; returns include_usage."""
        stream = _expect(body, "stream", lambda v: isinstance(v, bool), "a boolean")
        options = _expect(body, "stream_options", lambda v: isinstance(v, dict), "an object")
        if options is _MISSING:
            return False
        if stream is not True:
            raise APIError(400, "'stream_options' is only allowed with stream=true", param="stream_options",
                           code="invalid_value")
        unknown = set(options) - {"include_usage", "continuous_usage_stats"}
        if unknown:
            raise APIError(400, f"'stream_options': unknown field(s) {sorted(unknown)}", param="stream_options",
                           code="unknown_parameter")
        include = options.get("include_usage", False)
        if not isinstance(include, bool):
            raise APIError(400, "'stream_options.include_usage': expected a boolean",
                           param="stream_options.include_usage", code="invalid_type")
        return include

    @staticmethod
    def _messages(body: dict) -> list[dict]:
        if "messages" not in body or body["messages"] is None:
            raise APIError(400, "'messages' is required", param="messages", code="missing_required_parameter")
        messages = body["messages"]
        if not isinstance(messages, list):
            raise APIError(400, f"'messages': expected an array, got {_type_name(messages)}", param="messages",
                           code="invalid_type")
        if not messages:
            raise APIError(400, "'messages' must not be empty", param="messages", code="invalid_value")
        result = []
        for i, message in enumerate(messages):
            where = f"messages[{i}]"
            if not isinstance(message, dict):
                raise APIError(400, f"'{where}': expected an object, got {_type_name(message)}", param=where,
                               code="invalid_type")
            role = message.get("role")
            if role not in ("system", "developer", "user", "assistant"):
                detail = "tool messages need tool calling, which this server does not support" \
                    if role in ("tool", "function") else "expected one of 'system', 'developer', 'user', 'assistant'"
                raise APIError(400, f"'{where}.role': invalid value {json.dumps(role)}: {detail}",
                               param=f"{where}.role", code="invalid_value")
            unknown = set(message) - {"role", "content", "name"}
            if unknown:
                raise APIError(400, f"'{where}': unsupported field(s) {sorted(unknown)}", param=where,
                               code="unsupported_parameter")
            content = message.get("content")
            if isinstance(content, list):  # content parts: text only
                texts = []
                for j, part in enumerate(content):
                    if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
                        raise APIError(400, f"'{where}.content[{j}]': only text parts are supported",
                                       param=f"{where}.content[{j}]", code="invalid_value")
                    texts.append(part["text"])
                content = "".join(texts)
            if not isinstance(content, str):
                raise APIError(400, f"'{where}.content': expected a string or an array of text parts, got "
                                    f"{_type_name(content)}", param=f"{where}.content", code="invalid_type")
            result.append({"role": "system" if role == "developer" else role, "content": content})
        return result

    @staticmethod
    def _prompt(body: dict):
        if "prompt" not in body or body["prompt"] is None:
            raise APIError(400, "'prompt' is required", param="prompt", code="missing_required_parameter")
        prompt = body["prompt"]
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]  # a batch of one
        if isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
            raise APIError(400, "batched prompts are not supported: send one prompt per request", param="prompt",
                           code="unsupported_value")
        if isinstance(prompt, str):
            if not prompt:
                raise APIError(400, "'prompt' must not be empty", param="prompt", code="invalid_value")
            return prompt
        if isinstance(prompt, list) and prompt and all(_is_int(t) for t in prompt):
            return prompt
        raise APIError(400, f"'prompt': expected a string or an array of token ids, got {_type_name(prompt)}",
                       param="prompt", code="invalid_type")

    def _submit(self, prompt, params: SamplingParams, request_id: str, param: str):
        """engine.stream with the engine's exceptions mapped to HTTP errors (429, 400, 503)."""
        self._check_engine()
        try:
            return self.engine.stream(prompt, params, request_id=request_id)
        except QueueFullError as e:
            raise APIError(429, f"the server is busy: {e}", code="queue_full") from None
        except EngineDeadError as e:
            raise APIError(503, f"the engine is not available: {e}", code="engine_unavailable") from None
        except (ValueError, TypeError) as e:
            raise APIError(400, str(e), param=param, code="invalid_value") from None

    def _closer(self, stream) -> Callable[..., Awaitable[None]]:
        """close(reason=None): aborts `stream` unless it has finished, and records its metrics, once."""
        done = False

        async def close(reason: str | None = None) -> None:
            nonlocal done
            await stream.aclose()
            if not done:
                done = True
                self.metrics.observe_request(stream, reason or stream.finish_reason or "abort")
        return close

    @staticmethod
    def _usage(stream) -> dict:
        prompt, completion = len(stream.prompt_token_ids), len(stream.token_ids)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}

    async def _collect(self, request: Request, stream) -> tuple[str, str]:
        """The whole answer; a client that disconnects meanwhile aborts the request."""
        parts: list[str] = []
        error = None
        close = self._closer(stream)
        try:
            async with anyio.create_task_group() as tasks:
                async def watch() -> None:
                    await _await_disconnect(request.receive)
                    tasks.cancel_scope.cancel()

                tasks.start_soon(watch)
                try:
                    async for out in stream:
                        parts.append(out.text)
                except EngineDeadError as e:
                    error = e
                tasks.cancel_scope.cancel()
        finally:
            with anyio.CancelScope(shield=True):
                await close("error" if error is not None else None)
        if error is not None:
            raise APIError(503, f"the engine failed: {error}", code="engine_unavailable")
        return "".join(parts), stream.finish_reason or "abort"

    def _event_stream(self, stream, make_chunk: Callable[[str | None, str | None], dict], first: dict | None,
                      include_usage: bool) -> EventStreamResponse:
        close = self._closer(stream)
        return EventStreamResponse(self._events(stream, close, make_chunk, first, include_usage), on_close=close)

    async def _events(self, stream, close, make_chunk: Callable[[str | None, str | None], dict],
                      first: dict | None, include_usage: bool) -> AsyncIterator[str]:
        """The SSE body: chunks built by make_chunk(text, finish_reason), then usage, then [DONE]."""
        finish_reason = None
        try:
            if first is not None:
                yield sse(first)
            async for out in stream:
                if out.text:
                    yield sse(make_chunk(out.text, None))
                if out.finish_reason is not None:
                    finish_reason = out.finish_reason
                    yield sse(make_chunk(None, out.finish_reason))
            if include_usage:
                chunk = make_chunk(None, None)
                chunk["choices"], chunk["usage"] = [], self._usage(stream)
                yield sse(chunk)
            yield sse("[DONE]")
        except EngineDeadError as e:
            finish_reason = "error"
            yield sse(APIError(503, f"the engine failed: {e}", code="engine_unavailable").body())
            yield sse("[DONE]")
        finally:
            await close(finish_reason)  # aborts the request unless it has finished

    # ---- endpoints ----
    async def chat_completions(self, request: Request) -> Response:
        body = await self._read_json(request)
        _check_fields(body, _CHAT_FIELDS, _NEUTRAL)
        self._check_model(body)
        include_usage = self._stream_options(body)
        messages = self._messages(body)
        template_kwargs = _expect(body, "chat_template_kwargs", lambda v: isinstance(v, dict), "an object")
        template_kwargs = {} if template_kwargs is _MISSING else template_kwargs
        self._check_engine()
        try:
            prompt_ids = self.engine.apply_chat_template(messages, **template_kwargs)
        except (ValueError, TypeError) as e:
            raise APIError(400, str(e), param="messages", code="invalid_value") from None
        except Exception as e:  # noqa: BLE001 - a template error (jinja) caused by the request
            raise APIError(400, f"the chat template failed on these messages: {e}", param="messages",
                           code="invalid_value") from None
        room = max(1, self.engine.config.max_model_len - len(prompt_ids))
        params = self._sampling_params(body, "max_completion_tokens", room)
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        stream = self._submit(prompt_ids, params, request_id, "messages")
        created = int(time.time())
        base = {"id": request_id, "object": "chat.completion", "created": created, "model": self.model_name}
        if body.get("stream"):
            usage_field = {"usage": None} if include_usage else {}

            def chunk(text: str | None, finish_reason: str | None, role: bool = False) -> dict:
                delta = {"role": "assistant", "content": ""} if role else ({} if text is None else {"content": text})
                return {**base, "object": "chat.completion.chunk",
                        "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}],
                        **usage_field}

            return self._event_stream(stream, chunk, chunk(None, None, role=True), include_usage)
        text, finish_reason = await self._collect(request, stream)
        return JSONResponse({**base, "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                                                  "logprobs": None, "finish_reason": finish_reason}],
                             "usage": self._usage(stream)})

    async def completions(self, request: Request) -> Response:
        body = await self._read_json(request)
        _check_fields(body, _COMPLETION_FIELDS, _NEUTRAL_COMPLETIONS)
        self._check_model(body)
        include_usage = self._stream_options(body)
        prompt = self._prompt(body)
        params = self._sampling_params(body, "max_tokens", COMPLETIONS_DEFAULT_MAX_TOKENS)
        request_id = f"cmpl-{uuid.uuid4().hex}"
        stream = self._submit(prompt, params, request_id, "prompt")
        base = {"id": request_id, "object": "text_completion", "created": int(time.time()), "model": self.model_name}
        if body.get("stream"):
            usage_field = {"usage": None} if include_usage else {}

            def chunk(text: str | None, finish_reason: str | None) -> dict:
                return {**base, "choices": [{"index": 0, "text": text or "", "logprobs": None,
                                             "finish_reason": finish_reason}], **usage_field}

            return self._event_stream(stream, chunk, None, include_usage)
        text, finish_reason = await self._collect(request, stream)
        return JSONResponse({**base, "choices": [{"index": 0, "text": text, "logprobs": None,
                                                  "finish_reason": finish_reason}],
                             "usage": self._usage(stream)})

    def _model_card(self) -> dict:
        return {"id": self.model_name, "object": "model", "created": self.created, "owned_by": "asyncllm",
                "max_model_len": self.engine.config.max_model_len}

    async def models(self, request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [self._model_card()]})

    async def model(self, request: Request) -> Response:
        if request.path_params["model"] != self.model_name:
            raise APIError(404, f"The model '{request.path_params['model']}' does not exist", param="model",
                           code="model_not_found")
        return JSONResponse(self._model_card())

    async def health(self, request: Request) -> Response:
        self._check_engine()
        return JSONResponse({"status": "ok"})

    async def metrics_endpoint(self, request: Request) -> Response:
        return PlainTextResponse(self.metrics.render(self.engine.stats()),
                                 media_type="text/plain; version=0.0.4; charset=utf-8")

    def routes(self) -> list[Route]:
        e = self._endpoint
        return [
            Route("/v1/chat/completions", e(self.chat_completions), methods=["POST"]),
            Route("/v1/completions", e(self.completions), methods=["POST"]),
            Route("/v1/models", e(self.models), methods=["GET"]),
            Route("/v1/models/{model:path}", e(self.model), methods=["GET"]),
            Route("/health", e(self.health, auth=False), methods=["GET"]),
            Route("/metrics", e(self.metrics_endpoint, auth=False), methods=["GET"]),
        ]


def _engine_started(engine) -> bool:
    return bool(getattr(engine, "started", False))


def create_app(engine, model_name: str, api_key: str | None = None, *,
               max_body_bytes: int = DEFAULT_MAX_BODY_BYTES, max_tokens_limit: int | None = None,
               manage_engine: bool | None = None) -> Starlette:
    """The OpenAI-compatible Starlette app for `engine` (an AsyncLLMEngine).

    manage_engine: True = the app's lifespan starts the engine and shuts it down; False = the caller
    does; None (default) = the lifespan starts it if it is not started yet, and then owns it.
    The API key, when set, guards /v1/*; /health and /metrics stay open for probes and scrapers.
    """
    server = OpenAIServer(engine, model_name, api_key, max_body_bytes=max_body_bytes,
                          max_tokens_limit=max_tokens_limit)

    @asynccontextmanager
    async def lifespan(app):
        owns = (not _engine_started(engine)) if manage_engine is None else manage_engine
        if owns:
            await engine.start()
        stats = engine.stats()
        logger.info("asyncllm: serving %s (%s KV blocks of %s tokens)", model_name,
                    stats.get("num_total_blocks"), stats.get("block_size"))
        try:
            yield
        finally:
            if owns:
                await engine.shutdown(drain=False)

    async def http_error(request: Request, exc: HTTPException) -> Response:
        return APIError(exc.status_code, f"{exc.detail}: {request.method} {request.url.path}").response()

    app = Starlette(routes=server.routes(), lifespan=lifespan,
                    exception_handlers={HTTPException: http_error})
    app.state.server = server
    return app
