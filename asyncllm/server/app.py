"""The OpenAI-compatible Starlette app: routes, request plumbing, and the engine calls."""
from __future__ import annotations

import dataclasses
import functools
import hmac
import logging
import time
import uuid
from collections.abc import Awaitable, Callable

import anyio
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from asyncllm.errors import (ArgumentError, EngineAsleepError, EngineDeadError, InvalidValueError, QueueFullError,
                             RequestTimeoutError, UnsatisfiableConstraintsError)
from asyncllm.sampling_params import SamplingParams
import asyncllm.server.protocol as protocol
from asyncllm.server import lifecycle_routes, tool_calls
from asyncllm.server.answers import Echo, Generation, stream_response, whole_response
from asyncllm.server.constraints import compile_constraint, requested_constraint
from asyncllm.server.embeddings import create_embeddings
from asyncllm.server.errors import asleep_error, exception_handlers, queue_full_error
from asyncllm.server.lifespan import EngineLifespan, EngineStartup
from asyncllm.server.limits import (RequestLimits, limit_output, limit_timeout, read_json_body,
                                    request_timeout_error)
from asyncllm.server.metrics import EngineMetrics
from asyncllm.server.protocol import APIError, field_error
from asyncllm.server.responses import create_response
from asyncllm.server.shutdown import Drain, shutting_down_error
from asyncllm.server.sse import unless_disconnected
from asyncllm.server.stream_group import StreamGroup
from asyncllm.server.tokenization import TokenizationEndpoints

logger = logging.getLogger("asyncllm.server")

DEFAULT_SSE_KEEPALIVE_INTERVAL = 10.0  # seconds without an event before a stream sends a comment
REQUEST_ID_PREFIXES = {"chat": "chatcmpl", "completions": "cmpl", "responses": "resp"}


class OpenAIServer(TokenizationEndpoints):
    """limits: RequestLimits' fields (max_body_bytes, body_timeout, max_tokens_limit,
    max_generated_tokens, max_logprob_entries, request_timeout)."""

    def __init__(self, engine, model_name: str, api_key: str | None = None, *,
                 trust_request_chat_template: bool = False,
                 sse_keepalive_interval: float | None = DEFAULT_SSE_KEEPALIVE_INTERVAL,
                 enable_lifecycle_routes: bool = False,
                 lifecycle: lifecycle_routes.LifecycleGate | None = None, **limits):
        self.limits = RequestLimits(**limits)
        if sse_keepalive_interval is not None and (not isinstance(sse_keepalive_interval, (int, float))
                                                   or not sse_keepalive_interval > 0):
            raise InvalidValueError("sse_keepalive_interval", f"expected a positive number of seconds or None, "
                                                            f"got {sse_keepalive_interval!r}")
        if api_key == "":  # e.g. --api-key "$KEY" with KEY unset: never a way to turn auth off
            raise InvalidValueError("api_key", "empty; pass None for no authentication")
        self.engine = engine
        self.model_name = model_name
        # compared as UTF-8 bytes: a non-ASCII key is sent as its UTF-8 bytes
        self.api_key = api_key.encode("utf-8") if api_key is not None else None
        self.trust_request_chat_template = trust_request_chat_template
        self.sse_keepalive_interval = sse_keepalive_interval
        self.metrics = EngineMetrics(engine, model_name)  # its own registry: several apps in a process
        self.created = int(time.time())
        self.drain = Drain(engine.abort)  # driven by connections.DrainingServer at shutdown
        self.startup = EngineStartup(engine)  # its state during start-up: /health and the 503s
        self.enable_lifecycle_routes = enable_lifecycle_routes
        # sleep, wake, reload and the 503s meanwhile (a front-end's: its engine client's, over the link)
        self.lifecycle = lifecycle or lifecycle_routes.LifecycleGate(engine)

    # ---- plumbing ----
    def _check_auth(self, request: Request) -> None:
        if self.api_key is None:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        # Starlette decodes header bytes as latin-1; encoding back gives the bytes the client sent
        sent = token.strip().encode("latin-1")
        if scheme.lower() != "bearer" or not hmac.compare_digest(sent, self.api_key):
            raise APIError(401, "Incorrect or missing API key: send 'Authorization: Bearer <key>' "
                                "(a non-ASCII key as UTF-8).", code="invalid_api_key")

    @staticmethod
    def _check_content_type(request: Request) -> None:
        media_type, *params = request.headers.get("content-type", "").split(";")
        charsets = [value.strip().strip('"').lower() for key, _, value in (p.partition("=") for p in params)
                    if key.strip().lower() == "charset"]
        if media_type.strip().lower() != "application/json" or any(c != "utf-8" for c in charsets):
            raise APIError(415, "the request body must be JSON in UTF-8: send 'Content-Type: application/json'",
                           code="unsupported_media_type")

    async def _read_json(self, request: Request) -> dict:
        self._check_content_type(request)
        return await read_json_body(request, self.limits.max_body_bytes, self.limits.body_timeout)

    async def _request_body(self, request: Request, known: set[str], neutral: dict) -> dict:
        body = await self._read_json(request)
        protocol.check_fields(body, known, neutral)
        model = protocol.expect(body, "model", lambda v: isinstance(v, str), "a string")
        if model is not protocol.MISSING and model != self.model_name:
            raise APIError(404, f"The model '{model}' does not exist; this server serves '{self.model_name}'.",
                           param="model", code="model_not_found")
        return body

    def _check_engine(self, needs_model: bool = True) -> None:
        """The engine serves; needs_model: and is awake, not reloading (the tokenizer alone serves while asleep)."""
        if self.drain.refusing:
            raise shutting_down_error()
        try:
            self.engine.check_alive()
        except (EngineDeadError, RuntimeError) as e:
            raise APIError(503, f"the engine is not available: {e}", code="engine_unavailable") from None
        if needs_model and (closed := self.lifecycle.closed_reason) is not None:
            raise lifecycle_routes.closed_error(closed)

    def _endpoint(self, handler, *, auth: bool = True, while_starting: bool = False):
        """handler's endpoint: the API key checked (auth), OpenAI-shaped errors, the drain; during the
        engine's start-up a 503 unless while_starting."""
        async def endpoint(request: Request) -> Response:
            try:
                if auth:
                    self._check_auth(request)
                if not while_starting:
                    self.startup.check_started()
                with self.drain.handling() as handling:
                    response = await handler(request)
                if handling.cancel_called:  # the shutdown's drain ended: whatever the handler did is cut
                    raise shutting_down_error()
                return response
            except EngineDeadError as e:  # the engine died between a route's check and its use of the engine
                e = APIError(503, f"the engine is not available: {e}", code="engine_unavailable")
                self.metrics.observe_rejection(e.status)
                return e.response()
            except APIError as e:
                if e.status in (429, 503):
                    self.metrics.observe_rejection(e.status)
                return e.response()
            except Exception:  # noqa: BLE001 - answered as a 500 with an OpenAI body
                logger.exception("unhandled error in %s", request.url.path)
                return APIError(500, "internal server error", code="internal_error").response()
        return endpoint

    # ---- prompts: long ones are refused by length before tokenizing (the engine's checks), and rendered
    # and tokenized off the event loop ----
    async def _chat_prompt_ids(self, messages: list[dict], template_kwargs: dict) -> list[int]:
        self._check_engine()
        num_chars = sum(len(m["content"]) for m in messages)
        if num_chars > self.engine.max_prompt_chars:  # the text to render: the engine sees only its tokens
            raise APIError(400, f"'messages': {num_chars} characters cannot fit in max_model_len "
                                f"({self.engine.max_seq_len} tokens)", param="messages", code="context_length_exceeded")
        render = functools.partial(self.engine.apply_chat_template, messages, **template_kwargs)
        try:
            prompt_ids = await anyio.to_thread.run_sync(render)
        except (ValueError, TypeError) as e:
            raise field_error("messages", e) from None
        except Exception as e:  # noqa: BLE001 - a template error (jinja) caused by the request
            raise APIError(400, f"the chat template failed on these messages: {e}", param="messages",
                           code="invalid_value") from None
        return prompt_ids

    async def _completion_prompt_ids(self, prompts: list[str | list[int]]) -> list[list[int]]:
        """Each prompt's ids (token ids as they are: the engine checks them against the vocabulary)."""
        self._check_engine()
        texts = [(i, p) for i, p in enumerate(prompts) if isinstance(p, str)]
        if not texts:
            return prompts
        field = "prompt" if len(prompts) == 1 else "prompt[{}]"

        def encode() -> list[list[int]]:
            return [self.engine.encode(p, field.format(i)) for i, p in texts]
        try:
            encoded = dict(zip((i for i, _ in texts), await anyio.to_thread.run_sync(encode)))
        except (ValueError, TypeError) as e:
            raise field_error("prompt", e) from None
        return [encoded.get(i, p) for i, p in enumerate(prompts)]

    # ---- answering ----
    async def _submit(self, request: Request, prompt_ids: list[int], params: SamplingParams, request_id: str,
                      field: str, constraint_field: str | None = None):
        """engine.stream with the engine's exceptions mapped to HTTP errors (429, 400, 503);
        constraint_field: the request field that brought params.structured_output."""
        self._check_engine()
        submit = functools.partial(self.engine.stream, prompt_ids, params, request_id=request_id)
        try:
            if params.structured_output is None:
                return submit()
            # its grammar (seconds for a large schema) compiles first, on the engine's compile threads,
            # given up if the client leaves; then stream() finds it compiled (a worker thread all the same)
            await compile_constraint(self.engine, request, params.structured_output)
            return await anyio.to_thread.run_sync(submit)
        except QueueFullError as e:
            raise queue_full_error(e) from None
        except EngineAsleepError as e:
            raise asleep_error(e) from None
        except EngineDeadError as e:
            raise APIError(503, f"the engine is not available: {e}", code="engine_unavailable") from None
        except (ValueError, TypeError) as e:
            if isinstance(e, ArgumentError) and e.owner == "SamplingParams":  # a field checked against the model
                # (token ids, the grammar): the request's field of that name, or the constraint's
                sent = constraint_field if e.field == "structured_output" and constraint_field is not None else e.field
                raise field_error(sent, e, e.field) from None
            raise field_error(field, e, "prompt") from None

    def closer(self, streams: StreamGroup) -> Callable[..., Awaitable[None]]:
        """close(reason=None): aborts each of `streams` that has not finished, and records each one's
        metrics (its own finish reason unless reason is given), once."""
        done = False
        for stream in streams.streams:
            self.drain.track(stream.request_id)

        async def close(reason: str | None = None) -> None:
            nonlocal done
            await streams.aclose()
            if not done:
                done = True
                for stream in streams.streams:
                    self.drain.untrack(stream.request_id)
                    self.metrics.observe_request(stream, reason or stream.finish_reason or "abort")
        return close

    async def collect(self, request: Request, streams: StreamGroup, observe: Callable | None = None) -> list:
        """The whole answer, a RequestResult per choice; a client that disconnects meanwhile aborts
        the request. observe: called with each stream item as it comes."""
        parts: dict[int, list[str]] = {i: [] for i in range(streams.num_choices)}
        close = self.closer(streams)

        async def read() -> None:
            async for out in streams:
                parts[out.index].append(out.text)
                if observe is not None:
                    observe(out)
        error = None
        try:
            await unless_disconnected(request.receive, read)
        except (EngineDeadError, UnsatisfiableConstraintsError, RequestTimeoutError, QueueFullError,
                EngineAsleepError) as e:
            error = e
        finally:
            with anyio.CancelScope(shield=True):
                await close("error" if isinstance(error, EngineDeadError) else
                            "timeout" if isinstance(error, RequestTimeoutError) else None)
        if isinstance(error, RequestTimeoutError):
            raise request_timeout_error(error)
        if isinstance(error, QueueFullError):
            raise queue_full_error(error)
        if isinstance(error, EngineAsleepError):  # asleep since the route's check
            raise asleep_error(error)
        if isinstance(error, UnsatisfiableConstraintsError):
            raise APIError(400, error.message_without_owner, code="unsatisfiable_constraints")
        if error is not None:
            raise APIError(503, f"the engine failed: {error}", code="engine_unavailable")
        results = [streams.result(i, "".join(texts)) for i, texts in parts.items()]
        for result in results:
            result.finish_reason = result.finish_reason or "abort"
        return results

    def _check_context(self, body: dict, max_tokens_field: str, prompt_ids: list[int], room: int,
                       params: SamplingParams) -> None:
        """The one check of the prompt and max_tokens against the context (room: what the engine's
        max_seq_len leaves after the prompt): a prompt with no room left is the engine's
        PromptTooLongError at submission; a max_tokens that the client sent and that runs past the
        context is a 400 here."""
        if room < 1 or params.max_tokens <= room:
            return
        field = protocol.max_tokens_field_sent(body, max_tokens_field)
        raise APIError(400, f"'{field}': {params.max_tokens} tokens after a prompt of {len(prompt_ids)} tokens "
                            f"exceed this model's context of {self.engine.max_seq_len} tokens; ask for at most "
                            f"{room}", param=field, code="context_length_exceeded")

    async def generate(self, request: Request, body: dict, prompts: list[list[int]], *, kind: str,
                       max_tokens_field: str, default_max_tokens: int | None, constraint=(None, None),
                       tools: tuple[tool_calls.ToolRequest, tool_calls.ToolCallFormat] | None = None,
                       echo_logprobs: bool = False) -> Generation:
        """What every generating route shares: sampling (from body's fields), the constraint (its
        StructuredOutput and the field that asked) or a forced tool call's, the limits, and one
        submission per prompt. kind: "chat", "completions" or "responses"; default_max_tokens: when
        the request has none, capped by the room the longest prompt leaves (None: that room);
        echo_logprobs: completions' echo with logprobs, whose prompt tokens need their logprobs too."""
        self._check_engine()
        chat = kind != "completions"
        constraint, constraint_field = constraint
        if tools is not None and tools[0].forced:
            if constraint is not None:
                raise APIError(400, f"'{constraint_field}': tool_choice forces a tool call; leave it out",
                               param=constraint_field, code="invalid_value")
            constraint, constraint_field = tools[0].constraint(), "tools"
        longest = max(prompts, key=len)
        room = self.engine.max_seq_len - len(longest)
        default_max_tokens = max(1, room if default_max_tokens is None else min(default_max_tokens, room))
        params = protocol.sampling_params(body, max_tokens_field, default_max_tokens, self.limits.max_tokens_limit,
                                          chat=chat, structured_output=constraint)
        prompt_logprobs_asked = params.prompt_logprobs is not None
        if echo_logprobs and params.logprobs is not None:  # the prompt's tokens are in the answer
            params = dataclasses.replace(params, prompt_logprobs=max(params.prompt_logprobs or 0, params.logprobs))
        if params.prompt_logprobs and body.get("stream"):  # as vLLM: the prompt's logprobs come whole or not at all
            raise APIError(400, "'prompt_logprobs' is not available with 'stream': true", param="prompt_logprobs",
                           code="unsupported_value")
        if tools is not None and params.n > 1:
            raise APIError(400, "'n' > 1 with tools is not supported", param="n", code="unsupported_value")
        if tools is not None and tools[0].choice == "auto" and not tools[0].parallel and tools[1].end:
            # parallel_tool_calls false: the first call's closing marker ends the answer (parse_output
            # accepts a call left open at the end)
            params = dataclasses.replace(params, stop=[*params.stop, tools[1].end])
        self._check_context(body, max_tokens_field, longest, room, params)
        params = limit_output(params, body, max_tokens_field, chat, sum(map(len, prompts)), self.limits,
                              num_prompts=len(prompts))
        params = limit_timeout(params, self.limits)
        request_id = f"{REQUEST_ID_PREFIXES[kind]}-{uuid.uuid4().hex}"
        field = {"chat": "messages", "completions": "prompt", "responses": "input"}[kind]
        streams = []
        try:
            for i, prompt_ids in enumerate(prompts):
                single = len(prompts) == 1
                streams.append(await self._submit(request, prompt_ids, params,
                                                  request_id if single else f"{request_id}-{i}",
                                                  field if single else f"{field}[{i}]", constraint_field))
        except BaseException:
            for stream in streams:  # a batch is admitted whole or not at all
                await stream.aclose()
            raise
        return Generation(request_id, params, StreamGroup(streams, params.n), tools, prompt_logprobs_asked)

    # ---- endpoints ----
    async def chat_completions(self, request: Request) -> Response:
        body = await self._request_body(request, protocol.CHAT_FIELDS, protocol.NEUTRAL_CHAT)
        messages, template_kwargs, tools = tool_calls.with_tools(
            body, protocol.messages(body), protocol.chat_template_kwargs(body, self.trust_request_chat_template),
            self.engine.chat_template)
        prompt_ids = await self._chat_prompt_ids(messages, template_kwargs)
        include_usage, continuous_usage = protocol.stream_options(body)
        gen = await self.generate(request, body, [prompt_ids], kind="chat", max_tokens_field="max_completion_tokens",
                                  default_max_tokens=None, constraint=requested_constraint(body), tools=tools)
        if body.get("stream"):
            return stream_response(self, gen, chat=True, include_usage=include_usage,
                                   continuous_usage=continuous_usage)
        return await whole_response(self, request, gen, chat=True)

    async def completions(self, request: Request) -> Response:
        body = await self._request_body(request, protocol.COMPLETION_FIELDS, protocol.NEUTRAL_COMPLETIONS)
        prompts = protocol.prompts(body)
        prompt_ids = await self._completion_prompt_ids(prompts)
        include_usage, continuous_usage = protocol.stream_options(body)
        # before submission: nothing may come between submitting and the answer that closes the streams
        echo = await self._echo(prompts, prompt_ids, body.get("logprobs") is not None) if protocol.echo(body) else None
        gen = await self.generate(request, body, prompt_ids, kind="completions", max_tokens_field="max_tokens",
                                  default_max_tokens=protocol.COMPLETIONS_DEFAULT_MAX_TOKENS,
                                  constraint=requested_constraint(body), echo_logprobs=echo is not None)
        if body.get("stream"):
            return stream_response(self, gen, chat=False, include_usage=include_usage,
                                   continuous_usage=continuous_usage, echo=echo)
        return await whole_response(self, request, gen, chat=False, echo=echo)

    async def _echo(self, prompts: list[str | list[int]], prompt_ids: list[list[int]], with_first_tokens: bool) -> Echo:
        """Each prompt as text (a token prompt decoded), and its first token's text for the logprobs."""
        def decode() -> Echo:
            tokenizer = self.engine.tokenizer
            return Echo([p if isinstance(p, str) else tokenizer.decode(p) for p in prompts],
                        [tokenizer.decode(ids[:1]) for ids in prompt_ids] if with_first_tokens else [])
        return await anyio.to_thread.run_sync(decode)

    def _model_card(self) -> dict:
        return {"id": self.model_name, "object": "model", "created": self.created, "owned_by": "asyncllm",
                "max_model_len": self.engine.max_seq_len}

    async def models(self, request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [self._model_card()]})

    async def model(self, request: Request) -> Response:
        if request.path_params["model"] != self.model_name:
            raise APIError(404, f"The model '{request.path_params['model']}' does not exist", param="model",
                           code="model_not_found")
        return JSONResponse(self._model_card())

    async def health(self, request: Request) -> Response:
        """200 {"status": "ready"} once the engine serves ({"status": "sleeping"} or "reloading" while
        the lifecycle routes have it so: the process is alive); while it starts 503 {"status":
        "starting", "phase": ...} (readiness probes and load balancers wait); after a failure, or while
        the server shuts down, a 503 error."""
        if self.drain.refusing:
            raise shutting_down_error()
        starting = self.startup.health()
        if starting is not None:
            return starting
        self._check_engine(needs_model=False)
        return JSONResponse({"status": self.lifecycle.closed_reason or "ready"})

    async def metrics_endpoint(self, request: Request) -> Response:
        content, media_type = self.metrics.render()
        return Response(content, media_type=media_type)

    def routes(self) -> list[Route]:
        e = self._endpoint
        return [
            Route("/v1/chat/completions", e(self.chat_completions), methods=["POST"]),
            Route("/v1/completions", e(self.completions), methods=["POST"]),
            Route("/v1/responses", e(functools.partial(create_response, self)), methods=["POST"]),
            Route("/v1/embeddings", e(functools.partial(create_embeddings, self)), methods=["POST"]),
            Route("/v1/models", e(self.models), methods=["GET"]),
            Route("/v1/models/{model:path}", e(self.model), methods=["GET"]),
            Route("/tokenize", e(self.tokenize), methods=["POST"]),
            Route("/detokenize", e(self.detokenize), methods=["POST"]),
            Route("/health", e(self.health, auth=False, while_starting=True), methods=["GET"]),
            Route("/metrics", e(self.metrics_endpoint, auth=False, while_starting=True), methods=["GET"]),
            *(self._lifecycle_routes() if self.enable_lifecycle_routes else ()),
        ]

    def _lifecycle_routes(self) -> list[Route]:
        e, routes = self._endpoint, lifecycle_routes
        return [Route("/sleep", e(functools.partial(routes.sleep, self)), methods=["POST"]),
                Route("/wake_up", e(functools.partial(routes.wake_up, self)), methods=["POST"]),
                Route("/is_sleeping", e(functools.partial(routes.is_sleeping, self)), methods=["GET"]),
                Route("/reload", e(functools.partial(routes.reload, self)), methods=["POST"])]


def create_app(engine, model_name: str, api_key: str | None = None, *, manage_engine: bool | None = None,
               start_in_background: bool = False,
               on_engine_started: Callable[[BaseException | None], None] | None = None, **options) -> Starlette:
    """The OpenAI-compatible Starlette app for `engine` (an AsyncLLMEngine).

    manage_engine: True = the app's lifespan starts the engine and shuts it down; False = the caller
    does; None (default) = the lifespan starts it if it is not started yet, and then owns it.
    start_in_background: the lifespan does not wait for the engine it starts, so HTTP answers at
    once: /health 503 {"status": "starting", "phase": ...} and every other route but /metrics 503
    (code server_starting) until the engine is ready (then /health 200 {"status": "ready"}).
    on_engine_started(error): called once the engine the lifespan started is ready (None) or has
    failed to start (its exception; `asyncllm serve` stops then).
    The API key, when set, guards /v1/*; /health and /metrics stay open for probes and scrapers.
    options: OpenAIServer's --
    trust_request_chat_template: render chat templates that requests bring (they run on this server);
    sse_keepalive_interval: seconds a stream may go without an event before it sends a comment (None: never);
    enable_lifecycle_routes: POST /sleep, /wake_up, /reload and GET /is_sleeping (lifecycle_routes.py);
    and the request limits (limits.RequestLimits): max_body_bytes, body_timeout, max_tokens_limit,
    max_generated_tokens (n x max_tokens), max_logprob_entries, request_timeout (seconds from submission:
    the default and the most of a request's `timeout`).
    """
    server = OpenAIServer(engine, model_name, api_key, **options)
    lifespan = EngineLifespan(engine, server.startup, model_name, manage_engine, start_in_background,
                              on_engine_started)
    app = Starlette(routes=server.routes(), lifespan=lifespan.run, exception_handlers=exception_handlers())
    app.state.server = server
    return app
