"""POST /v1/embeddings in OpenAI's shape, over AsyncLLMEngine.embed:

    {"model", "input": str | [str] | [int] | [[int]], "encoding_format": "float" | "base64",
     "dimensions", "user"}
    -> {"object": "list", "data": [{"object": "embedding", "index", "embedding"}], "model",
        "usage": {"prompt_tokens", "total_tokens"}}

`dimensions` keeps a vector's first entries and normalises it again (Matryoshka, as Qwen3-Embedding
and OpenAI's text-embedding-3 shorten vectors); at most the model's hidden size. "base64" is the
little-endian float32 bytes (what the openai client asks for by default, and decodes). Two fields of
asyncllm's: "pooling" ("last", the default, or "mean") and "normalize" (default true).
"""
from __future__ import annotations

import base64
import json

import anyio
import numpy as np
from starlette.requests import Request
from starlette.responses import Response

import asyncllm.server.protocol as protocol
from asyncllm.errors import ArgumentError, EngineDeadError, QueueFullError
from asyncllm.server.errors import queue_full_error
from asyncllm.server.protocol import APIError, field_error
from asyncllm.server.sse import await_disconnect

EMBEDDINGS_FIELDS = {"model", "input", "encoding_format", "dimensions", "user", "pooling", "normalize"}
MAX_EMBEDDING_INPUTS = 2048  # OpenAI's limit on the entries of one request's input
ENCODING_FORMATS = ("float", "base64")


def embedding_inputs(body: dict) -> list[str | list[int]]:
    """The request's inputs, each a string or a token-id list (a flat list of ints is one input)."""
    value = body.get("input")
    if value is None:
        raise APIError(400, "'input' is required", param="input", code="missing_required_parameter")
    if isinstance(value, str) or (isinstance(value, list) and value and all(protocol.is_int(t) for t in value)):
        value = [value]
    if not isinstance(value, list) or not value:
        raise APIError(400, f"'input': expected a string, an array of strings, an array of token ids or an array "
                            f"of token-id arrays, got {'an empty array' if value == [] else protocol.type_name(value)}",
                       param="input", code="invalid_type" if value != [] else "invalid_value")
    if len(value) > MAX_EMBEDDING_INPUTS:
        raise APIError(400, f"'input': {len(value)} entries; at most {MAX_EMBEDDING_INPUTS} in one request",
                       param="input", code="invalid_value")
    for i, item in enumerate(value):
        if not (isinstance(item, str) or (isinstance(item, list) and all(protocol.is_int(t) for t in item))):
            raise APIError(400, f"'input[{i}]': expected a string or an array of token ids, got "
                                f"{protocol.type_name(item)}", param="input", code="invalid_type")
        if not item:  # OpenAI refuses empty inputs; an empty prompt has no last token to embed
            raise APIError(400, f"'input[{i}]' must not be empty", param="input", code="invalid_value")
    return value


def encoded(vector: list[float], encoding_format: str) -> list[float] | str:
    if encoding_format == "float":
        return vector
    return base64.b64encode(np.asarray(vector, dtype="<f4").tobytes()).decode("ascii")


async def create_embeddings(server, request: Request) -> Response:
    """server: the OpenAIServer (its request plumbing, engine and model name)."""
    body = await server._request_body(request, EMBEDDINGS_FIELDS, {})
    inputs = embedding_inputs(body)
    encoding_format = protocol.expect(body, "encoding_format", lambda v: v in ENCODING_FORMATS,
                                      " or ".join(map(repr, ENCODING_FORMATS)))
    dimensions = protocol.expect(body, "dimensions", lambda v: protocol.is_int(v) and v >= 1, "an integer >= 1")
    pooling = protocol.expect(body, "pooling", lambda v: isinstance(v, str), "'last' or 'mean'")
    normalize = protocol.expect(body, "normalize", lambda v: isinstance(v, bool), "a boolean")
    protocol.expect(body, "user", lambda v: isinstance(v, str), "a string")
    options = {"dimensions": None if dimensions is protocol.MISSING else dimensions,
               "pooling": "last" if pooling is protocol.MISSING else pooling,
               "normalize": True if normalize is protocol.MISSING else normalize}
    server._check_engine()
    engine = server.engine

    def token_lists() -> list[list[int]]:  # tokenized, and checked, as /v1/completions does a prompt
        return [engine.encode(item, f"input[{i}]") for i, item in enumerate(inputs)]
    try:
        prompts = await anyio.to_thread.run_sync(token_lists)
    except (ValueError, TypeError) as e:
        raise field_error("input", e) from None
    vectors = error = None
    async with anyio.create_task_group() as tasks:
        async def watch() -> None:  # a client that leaves takes its prompts out of the engine
            await await_disconnect(request.receive)
            tasks.cancel_scope.cancel()
        tasks.start_soon(watch)
        try:
            vectors = await engine.embed(prompts, **options)
        except (QueueFullError, EngineDeadError, ValueError, TypeError) as e:
            error = e  # raised out here, not as a task group's ExceptionGroup
        tasks.cancel_scope.cancel()
    if isinstance(error, QueueFullError):
        raise queue_full_error(error)
    if isinstance(error, EngineDeadError):
        raise error  # the route's 503
    if error is not None:
        name = error.field if isinstance(error, ArgumentError) and error.field in options else "input"
        raise field_error(name, error, "prompts")
    if vectors is None:
        raise APIError(400, "the client disconnected", code="client_disconnected")
    num_tokens = sum(map(len, prompts))
    encoding_format = "float" if encoding_format is protocol.MISSING else encoding_format

    def render() -> bytes:  # off the event loop: 2,048 vectors of 1,024 floats take JSON a while
        return json.dumps({
            "object": "list",
            "data": [{"object": "embedding", "index": i, "embedding": encoded(vector, encoding_format)}
                     for i, vector in enumerate(vectors)],
            "model": server.model_name,
            "usage": {"prompt_tokens": num_tokens, "total_tokens": num_tokens}}, separators=(",", ":")).encode()
    return Response(await anyio.to_thread.run_sync(render), media_type="application/json")
