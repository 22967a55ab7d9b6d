"""What one request may send and ask for: its body (size, time to arrive, encoding), its output
(n x max_tokens tokens, and the logprob entries of the answer) and its time in the engine (timeout)."""
from __future__ import annotations

import dataclasses
import json
import logging

import anyio
from starlette.requests import ClientDisconnect, Request

from asyncllm.errors import ArgumentError
from asyncllm.sampling_params import SamplingParams
from asyncllm.server.protocol import APIError, logprobs_field, max_tokens_field_sent, type_name
from asyncllm.validation import FieldChecks, is_int, short_repr

logger = logging.getLogger("asyncllm.server")
_fail = FieldChecks(None, show=short_repr)  # RequestLimits' fields: messages name them alone

DEFAULT_MAX_BODY_BYTES = 1 << 20  # 1 MiB
DEFAULT_BODY_TIMEOUT = 30.0  # seconds for a whole request body to arrive
# n x max_tokens of one request: one choice may still run to 64K tokens, and n=128 choices to 512 each
DEFAULT_MAX_GENERATED_TOKENS = 1 << 16
# n x max_tokens x (top_logprobs + 1), plus the prompt's: about 15 MB of JSON; a whole 8K context with
# top_logprobs=20 fits (172K entries)
DEFAULT_MAX_LOGPROB_ENTRIES = 1 << 18


@dataclasses.dataclass(frozen=True)
class RequestLimits:
    """max_body_bytes: the largest request body (413); body_timeout: seconds it may take to arrive
    (408); max_tokens_limit: the largest max_tokens (None: the context); max_generated_tokens: the
    most tokens one request may generate over all its choices, n x max_tokens; max_logprob_entries:
    the most logprob entries its answer may carry, n x max_tokens x (top_logprobs + 1) plus
    prompt tokens x (prompt_logprobs + 1); request_timeout: seconds a request may take from its
    submission to the engine (SamplingParams.timeout), the default of one that sends no `timeout`
    and the most one may send. None: no limit. A request without max_tokens gets a default lowered
    to fit max_generated_tokens and max_logprob_entries; one whose max_tokens (or timeout) does not
    fit gets a 400 naming the limit."""
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    body_timeout: float = DEFAULT_BODY_TIMEOUT
    max_tokens_limit: int | None = None
    max_generated_tokens: int | None = DEFAULT_MAX_GENERATED_TOKENS
    max_logprob_entries: int | None = DEFAULT_MAX_LOGPROB_ENTRIES
    request_timeout: float | None = None

    def __post_init__(self) -> None:
        for name in ("max_tokens_limit", "max_generated_tokens", "max_logprob_entries"):
            value = getattr(self, name)
            if value is not None and (not is_int(value) or value < 1):
                _fail(name, f"expected a positive int or None, got {value!r}")
        if not is_int(self.max_body_bytes) or self.max_body_bytes < 1:
            _fail("max_body_bytes", f"expected a positive int, got {self.max_body_bytes!r}")
        if not isinstance(self.body_timeout, (int, float)) or not self.body_timeout > 0:
            _fail("body_timeout", f"expected a positive number of seconds, got {self.body_timeout!r}")
        if self.request_timeout is not None:
            _fail.positive_seconds("request_timeout", self.request_timeout)  # SamplingParams.timeout's check


async def read_json_body(request: Request, max_body_bytes: int, body_timeout: float) -> dict:
    """The request's body, a JSON object in UTF-8, read within max_body_bytes (else 413) and
    body_timeout seconds (else 408); a client gone before its body ended is one debug line."""
    length = request.headers.get("content-length")
    if length is not None:
        if not length.isdigit():
            raise APIError(400, "invalid Content-Length header")
        if int(length) > max_body_bytes:
            raise APIError(413, f"the request body is {length} bytes; the limit is {max_body_bytes}",
                           code="request_too_large")
    chunks, size = [], 0
    try:
        # uvicorn has no body timeout: a client sending a byte now and then would hold its
        # connection (and file descriptor) forever
        with anyio.fail_after(body_timeout):
            async for chunk in request.stream():
                size += len(chunk)
                if size > max_body_bytes:
                    raise APIError(413, f"the request body is over the limit of {max_body_bytes} bytes",
                                   code="request_too_large")
                chunks.append(chunk)
    except TimeoutError:
        raise APIError(408, f"the request body did not arrive within {body_timeout:g} s",
                       code="request_timeout", headers={"Connection": "close"}) from None
    except ClientDisconnect:  # nobody to answer, and nothing wrong with the server: no traceback
        logger.debug("%s %s: the client disconnected before its request body ended", request.method,
                     request.url.path)
        raise APIError(400, "the client disconnected before its request body ended",
                       code="client_disconnected") from None
    raw = b"".join(chunks)
    if json.detect_encoding(raw) not in ("utf-8", "utf-8-sig"):  # json.loads would take UTF-16/32 too
        raise APIError(415, "the request body must be JSON in UTF-8", code="unsupported_media_type")
    try:
        body = json.loads(raw)
    except (ValueError, RecursionError) as e:
        raise APIError(400, f"We could not parse the JSON body of your request ({e}). "
                            "The body must be a JSON object.", code="invalid_json") from None
    if not isinstance(body, dict):
        raise APIError(400, f"the request body must be a JSON object, got {type_name(body)}", code="invalid_json")
    return body


def limit_output(params: SamplingParams, body: dict, max_tokens_field: str, chat: bool, num_prompt_tokens: int,
                 limits: RequestLimits, num_prompts: int = 1) -> SamplingParams:
    """params held to limits.max_generated_tokens and limits.max_logprob_entries: a max_tokens the
    client sent that goes past either is a 400 naming the limit; the server's default max_tokens
    is lowered to fit (a 400 only where not even one token a choice fits). num_prompts: a batch's
    prompts (each gets params.n choices); num_prompt_tokens: all of theirs."""
    n, max_tokens = params.n * num_prompts, params.max_tokens
    choices = f"{num_prompts} prompts x 'n'" if num_prompts > 1 else "'n'"
    field = max_tokens_field_sent(body, max_tokens_field)
    sent = body.get(field) is not None
    room = {}  # the limit's name -> the most max_tokens it leaves
    if limits.max_generated_tokens is not None:
        room["--max-generated-tokens"] = limits.max_generated_tokens // n
    prompt_entries = 0 if params.prompt_logprobs is None else num_prompt_tokens * (params.prompt_logprobs + 1)
    if limits.max_logprob_entries is not None and prompt_entries > limits.max_logprob_entries:
        raise APIError(400, f"'prompt_logprobs': {num_prompt_tokens} prompt tokens x {params.prompt_logprobs + 1} "
                            f"logprobs = {prompt_entries} entries are over this server's limit of "
                            f"{limits.max_logprob_entries} (--max-logprob-entries)", param="prompt_logprobs",
                       code="invalid_value")
    if limits.max_logprob_entries is not None and params.logprobs is not None:
        room["--max-logprob-entries"] = (limits.max_logprob_entries - prompt_entries) // (n * (params.logprobs + 1))
    if not room or max_tokens <= min(room.values()):
        return params
    flag, most = min(room.items(), key=lambda item: item[1])
    if flag == "--max-generated-tokens":
        param = field if sent else "n"
        message = (f"{choices} x '{field}' = {n} x {max_tokens} tokens is over this server's limit of "
                   f"{limits.max_generated_tokens} generated tokens a request (--max-generated-tokens)")
    else:
        param = logprobs_field(body, chat)[0]
        message = (f"'{param}': {n} choices x {max_tokens} tokens x {params.logprobs + 1} logprobs"
                   f"{f' + {prompt_entries} for the prompt' if prompt_entries else ''} are over this server's "
                   f"limit of {limits.max_logprob_entries} logprob entries (--max-logprob-entries)")
    if sent or most < 1:
        advice = f"; ask for at most {most} tokens" if most >= 1 else "; ask for fewer choices or logprobs"
        raise APIError(400, message + advice, param=param, code="invalid_value")
    try:
        return dataclasses.replace(params, max_tokens=most)
    except ArgumentError as e:  # min_tokens above what the limits leave
        raise APIError(400, f"{e.message_without_owner} ({flag} leaves {most} tokens a choice)",
                       code="invalid_value") from None


def limit_timeout(params: SamplingParams, limits: RequestLimits) -> SamplingParams:
    """params with the server's request timeout: the default where the request sent no `timeout`; a
    request may ask for less, and asking for more is a 400 naming the limit."""
    limit = limits.request_timeout
    if limit is None:
        return params
    if params.timeout is None:
        return dataclasses.replace(params, timeout=limit)
    if params.timeout > limit:
        raise APIError(400, f"'timeout': {params.timeout:g} s is over this server's limit of {limit:g} s "
                            "(--request-timeout)", param="timeout", code="invalid_value")
    return params


def request_timeout_error(error: BaseException) -> APIError:
    """The answer to a request whose timeout passed before its first token (RequestTimeoutError)."""
    return APIError(408, f"{error}; the server is busy: retry later, or allow more time", code="request_timeout")
