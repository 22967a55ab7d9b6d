"""The OpenAI request protocol: error bodies, the fields a request may carry, and their parsing.

Sampling fields are checked by SamplingParams, not here: this module only names, in the 400 it
answers, the field the client sent.
"""
from __future__ import annotations

import json
import logging
from collections.abc import Callable

from starlette.responses import JSONResponse

from asyncllm.chat_template import check_template_kwargs
from asyncllm.errors import ArgumentError, PromptTooLongError
from asyncllm.sampling_params import SamplingParams
from asyncllm.validation import is_int

COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for the legacy completions endpoint
MAX_STOP_STRINGS = 16

MISSING = object()

logger = logging.getLogger("asyncllm.server")


class APIError(Exception):
    """An error answered with an OpenAI-style body: {"error": {message, type, param, code}}."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 type: str | None = None, headers: dict | None = None):  # noqa: A002 - OpenAI's field name
        # a message may quote what the client sent: lone surrogates (valid in JSON's \ud800, not in
        # UTF-8) would make the response's encoding fail, so they are written as escapes
        message = message.encode("utf-8", "backslashreplace").decode("utf-8")
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type or ("server_error" if status >= 500 else
                             "rate_limit_error" if status == 429 else "invalid_request_error")
        self.headers = {"WWW-Authenticate": "Bearer"} if status == 401 else dict(headers or {})

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers or None)


def type_name(value) -> str:
    return {dict: "an object", list: "an array", str: "a string", bool: "a boolean", int: "an integer",
            float: "a number", type(None): "null"}.get(type(value), type(value).__name__)


def expect(body: dict, name: str, check: Callable[[object], bool], what: str):
    """body[name] if present and not null, checked; MISSING otherwise."""
    value = body.get(name)
    if value is None:
        return MISSING
    if not check(value):
        raise APIError(400, f"'{name}': expected {what}, got {type_name(value)} ({json.dumps(value)[:80]})",
                       param=name, code="invalid_type")
    return value


# Fields OpenAI clients send that this server does not implement: accepted only at a neutral value.
NEUTRAL_CHAT = {
    "functions": lambda v: v == [],
    "function_call": lambda v: v == "none",
    "store": lambda v: v is False,
    "modalities": lambda v: v == ["text"],
    "user": lambda v: isinstance(v, str),  # an end-user id for abuse tracking: accepted, unused
    "metadata": lambda v: isinstance(v, dict),
    "service_tier": lambda v: isinstance(v, str),
}
NEUTRAL_COMPLETIONS = {name: check for name, check in NEUTRAL_CHAT.items()
                       if name not in ("tools", "tool_choice", "functions", "function_call",
                                       "parallel_tool_calls", "response_format", "store", "modalities")}
NEUTRAL_COMPLETIONS.update(best_of=lambda v: v == 1,
                           suffix=lambda v: v == "")

# request field -> SamplingParams field; max_tokens is handled apart (the server's limit and default),
# and so are logprobs (chat: logprobs + top_logprobs) and logit_bias (JSON keys are strings)
SAMPLING_FIELDS = {name: name for name in ("temperature", "top_p", "top_k", "min_p", "seed", "stop",
                                           "stop_token_ids", "ignore_eos", "include_stop_str_in_output", "n",
                                           "presence_penalty", "frequency_penalty", "repetition_penalty",
                                           "min_tokens", "skip_special_tokens", "spaces_between_special_tokens",
                                           "prompt_logprobs", "timeout", "allowed_token_ids", "bad_words")}
# constraints (server/constraints.py maps them)
CONSTRAINT_FIELDS = {"response_format", "structured_outputs", "guided_json", "guided_regex", "guided_choice",
                     "guided_grammar"}
COMMON_FIELDS = {"model", "stream", "stream_options", "max_tokens", "logprobs", "logit_bias", *SAMPLING_FIELDS,
                 *CONSTRAINT_FIELDS}
CHAT_FIELDS = COMMON_FIELDS | {"messages", "max_completion_tokens", "chat_template_kwargs", "chat_template",
                               "enable_thinking", "top_logprobs", "tools", "tool_choice", "parallel_tool_calls"}
COMPLETION_FIELDS = COMMON_FIELDS | {"prompt", "echo"}


def check_fields(body: dict, known: set[str], neutral: dict) -> None:
    """Fields this server does not implement: 400 unless at their neutral value; unknown fields: ignored."""
    for name, value in body.items():
        if name in known:
            continue
        if name in neutral:
            if value is None or neutral[name](value):
                continue
            raise APIError(400, f"'{name}'={json.dumps(value)[:80]} is not supported by this server; "
                                f"leave it out", param=name, code="unsupported_parameter")
        warn_unknown_field(name)


# Field names already warned about: one warning per name per process, as vLLM does. Bounded, so
# that clients sending ever new names cannot grow it (or the log) without end.
_warned_fields: set[str] = set()
MAX_WARNED_FIELDS = 256


def warn_unknown_field(name: str) -> None:
    """An unknown request field is ignored (clients and frameworks send newer OpenAI fields), with
    one logged warning per field name."""
    if name in _warned_fields or len(_warned_fields) >= MAX_WARNED_FIELDS:
        return
    _warned_fields.add(name)
    logger.warning("ignoring the unknown request field %r (warned once per field name)", name[:100])
    if len(_warned_fields) == MAX_WARNED_FIELDS:
        logger.warning("%d unknown field names seen: further ones are ignored without a warning",
                       MAX_WARNED_FIELDS)


def field_error(field: str, error: Exception, argument: str | None = None) -> APIError:
    """A 400 naming `field` (what the client sent) for an error raised about `argument` (what the
    engine or SamplingParams calls it, if not the same): an ArgumentError about either reads as
    about `field`; any other error is quoted whole after it."""
    if isinstance(error, ArgumentError) and error.field in (argument or field, field):
        item = error.argument[len(error.field):]  # an item: prompt[3], messages[0]
        message = f"{field}{item}: {error.reason}" if item else f"'{field}': {error.reason}"
    else:
        message = f"'{field}': {error}"
    code = "context_length_exceeded" if isinstance(error, PromptTooLongError) else "invalid_value"
    return APIError(400, message, param=field, code=code)


def max_tokens_field_sent(body: dict, max_tokens_field: str) -> str:
    """The field that carries max_tokens: max_tokens_field (chat: max_completion_tokens) if sent, else max_tokens."""
    return max_tokens_field if body.get(max_tokens_field) is not None else "max_tokens"


def logprobs_field(body: dict, chat: bool) -> tuple[str, object] | None:
    """(the field the client sent, SamplingParams.logprobs) from the request: chat's logprobs (a
    boolean) with top_logprobs, or completions' logprobs (how many top alternatives)."""
    if not chat:
        return None if body.get("logprobs") is None else ("logprobs", body["logprobs"])
    wanted = expect(body, "logprobs", lambda v: isinstance(v, bool), "a boolean")
    top = body.get("top_logprobs")
    if wanted is not True:
        if top is not None:
            raise APIError(400, "'top_logprobs' needs 'logprobs': true", param="top_logprobs", code="invalid_value")
        return None
    return ("top_logprobs", top) if top is not None else ("logprobs", 0)


def logit_bias_field(body: dict):
    """logit_bias with its JSON (string) keys as token ids where they are integers; other keys are
    passed on for SamplingParams to refuse."""
    bias = body.get("logit_bias")
    if not isinstance(bias, dict):
        return bias
    return {int(key) if isinstance(key, str) and key.strip().isdecimal() else key: value
            for key, value in bias.items()}


def sampling_params(body: dict, max_tokens_field: str, default_max_tokens: int,
                    max_tokens_limit: int | None, chat: bool = True, structured_output=None) -> SamplingParams:
    """SamplingParams from the request's fields; SamplingParams is the one that checks them.
    structured_output: what the constraint fields asked for (server/constraints.py)."""
    field = max_tokens_field_sent(body, max_tokens_field)
    if field != "max_tokens":  # sent beside max_completion_tokens, which wins: still checked
        expect(body, "max_tokens", lambda v: is_int(v) and v >= 1, "a positive integer")
    max_tokens = expect(body, field, is_int, "an integer")  # compared with the limit below: an int first
    if max_tokens is MISSING:
        max_tokens = default_max_tokens if max_tokens_limit is None else min(default_max_tokens, max_tokens_limit)
    elif max_tokens_limit is not None and max_tokens > max_tokens_limit:
        raise APIError(400, f"'{field}'={max_tokens} is over this server's limit of {max_tokens_limit}",
                       param=field, code="invalid_value")
    sent = {field: ("max_tokens", max_tokens)}
    sent.update((name, (arg, body[name])) for name, arg in SAMPLING_FIELDS.items() if body.get(name) is not None)
    logprobs = logprobs_field(body, chat)
    if logprobs is not None:
        sent[logprobs[0]] = ("logprobs", logprobs[1])
    if body.get("logit_bias") is not None:
        sent["logit_bias"] = ("logit_bias", logit_bias_field(body))
    stop = body.get("stop")
    if isinstance(stop, list) and len(stop) > MAX_STOP_STRINGS:
        raise APIError(400, f"'stop': at most {MAX_STOP_STRINGS} stop strings", param="stop", code="invalid_value")
    try:
        return SamplingParams(**dict(sent.values()), structured_output=structured_output)
    except ArgumentError as e:  # names the SamplingParams field: the 400 names the request's field that set it
        sent_as = {argument: name for name, (argument, _) in sent.items()}
        if e.field in sent_as:
            raise field_error(sent_as[e.field], e, e.field) from None
        raise APIError(400, e.message_without_owner, code="invalid_value") from None


def stream_options(body: dict) -> tuple[bool, bool]:
    """Checks 'stream' and 'stream_options'; returns (include_usage, continuous_usage_stats: vLLM's
    usage in every chunk, where include_usage is set too)."""
    stream = expect(body, "stream", lambda v: isinstance(v, bool), "a boolean")
    options = expect(body, "stream_options", lambda v: isinstance(v, dict), "an object")
    if options is MISSING:
        return False, False
    if stream is not True:
        raise APIError(400, "'stream_options' is only allowed with stream=true", param="stream_options",
                       code="invalid_value")
    for name in sorted(set(options) - {"include_usage", "continuous_usage_stats"}):
        warn_unknown_field(f"stream_options.{name}")  # e.g. newer OpenAI options: ignored, as top-level fields
    flags = []
    for name in ("include_usage", "continuous_usage_stats"):
        value = options.get(name)
        if value is not None and not isinstance(value, bool):
            raise APIError(400, f"'stream_options.{name}': expected a boolean", param=f"stream_options.{name}",
                           code="invalid_type")
        flags.append(value is True)
    include, continuous = flags
    return include, include and continuous


# others: ignored with a warning. reasoning_content: an earlier answer's reasoning, which templates
# (Qwen3's) may render
MESSAGE_FIELDS = {"role", "content", "name", "tool_calls", "tool_call_id", "reasoning_content"}


def messages(body: dict) -> list[dict]:
    if body.get("messages") is None:
        raise APIError(400, "'messages' is required", param="messages", code="missing_required_parameter")
    messages = body["messages"]
    if not isinstance(messages, list):
        raise APIError(400, f"'messages': expected an array, got {type_name(messages)}", param="messages",
                       code="invalid_type")
    if not messages:
        raise APIError(400, "'messages' must not be empty", param="messages", code="invalid_value")
    result = []
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, dict):
            raise APIError(400, f"'{where}': expected an object, got {type_name(message)}", param=where,
                           code="invalid_type")
        role = message.get("role")
        if role not in ("system", "developer", "user", "assistant", "tool"):
            raise APIError(400, f"'{where}.role': invalid value {json.dumps(role)}: expected one of 'system', "
                                "'developer', 'user', 'assistant', 'tool'", param=f"{where}.role", code="invalid_value")
        for name in sorted(set(message) - MESSAGE_FIELDS):  # e.g. "refusal", "audio", vendor fields
            warn_unknown_field(f"messages[].{name}")
        for name in ("name", "tool_call_id", "reasoning_content"):
            if message.get(name) is not None and not isinstance(message[name], str):
                raise APIError(400, f"'{where}.{name}': expected a string, got {type_name(message[name])}",
                               param=f"{where}.{name}", code="invalid_type")
        content = message.get("content")
        tool_calls = message.get("tool_calls")
        if tool_calls is not None and (role != "assistant" or not isinstance(tool_calls, list) or not all(
                isinstance(c, dict) and isinstance(c.get("function"), dict) for c in tool_calls)):
            raise APIError(400, f"'{where}.tool_calls': expected an array of calls in an assistant message",
                           param=f"{where}.tool_calls", code="invalid_value")
        if content is None and role == "assistant":
            content = ""  # an assistant turn that only called tools (or refused)
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
                                f"{type_name(content)}", param=f"{where}.content", code="invalid_type")
        result.append({"role": "system" if role == "developer" else role, "content": content,
                       **{key: message[key] for key in ("tool_calls", "tool_call_id", "reasoning_content")
                          if key in message}})
    return result


def chat_template_kwargs(body: dict, trust_request_chat_template: bool) -> dict:
    """The template's keyword arguments. A template the request brings would run on this server:
    refused unless the operator trusts request templates."""
    kwargs = expect(body, "chat_template_kwargs", lambda v: isinstance(v, dict), "an object")
    kwargs = {} if kwargs is MISSING else dict(kwargs)
    # Qwen3's switch, also taken at the top level (as Qwen's own API takes it)
    thinking = expect(body, "enable_thinking", lambda v: isinstance(v, bool), "a boolean")
    if thinking is not MISSING:
        if kwargs.get("enable_thinking", thinking) != thinking:
            raise APIError(400, "'enable_thinking' and 'chat_template_kwargs.enable_thinking' differ: send one",
                           param="enable_thinking", code="invalid_value")
        kwargs["enable_thinking"] = thinking
    for param, template in (("chat_template", body.get("chat_template")),
                            ("chat_template_kwargs.chat_template", kwargs.get("chat_template"))):
        if template is None:
            continue
        if not trust_request_chat_template:
            raise APIError(400, f"'{param}': this server does not render chat templates sent by clients "
                                "(the operator can allow it with --trust-request-chat-template)",
                           param=param, code="unsupported_parameter")
        if not isinstance(template, str):
            raise APIError(400, f"'{param}': expected a string, got {type_name(template)}", param=param,
                           code="invalid_type")
        kwargs["chat_template"] = template
    try:  # the engine's checks, answered as about the key the client sent (a reserved one, a wrong type)
        check_template_kwargs(kwargs)
    except ArgumentError as e:
        param = f"chat_template_kwargs.{e.field}"
        raise APIError(400, f"'chat_template_kwargs.{e.argument}': {e.reason}", param=param,
                       code="invalid_type" if isinstance(e, TypeError) else "invalid_value") from None
    return kwargs


def prompts(body: dict) -> list[str | list[int]]:
    """The completions request's prompts: a string or token ids, or an array of either (a batch: its
    prompt p's choices are p * n .. p * n + n - 1, as OpenAI numbers them)."""
    if body.get("prompt") is None:
        raise APIError(400, "'prompt' is required", param="prompt", code="missing_required_parameter")
    prompt = body["prompt"]
    batch = isinstance(prompt, list) and prompt != [] and all(isinstance(p, (str, list)) for p in prompt)
    prompts = prompt if batch else [prompt]
    for i, prompt in enumerate(prompts):
        where = f"prompt[{i}]" if batch else "prompt"
        if isinstance(prompt, str):
            if not prompt:
                raise APIError(400, f"'{where}' must not be empty", param="prompt", code="invalid_value")
        elif not (isinstance(prompt, list) and prompt and all(is_int(t) for t in prompt)):
            raise APIError(400, f"'{where}': expected a string or an array of token ids, got {type_name(prompt)}",
                           param="prompt", code="invalid_type")
    return prompts


def echo(body: dict) -> bool:
    """Completions' echo: each choice begins with its prompt (with logprobs, the prompt's tokens' too)."""
    echo = expect(body, "echo", lambda v: isinstance(v, bool), "a boolean") is True
    if echo and body.get("logprobs") is not None and body.get("stream") is True:
        raise APIError(400, "'echo' with 'logprobs' is not available with 'stream': true (the prompt's logprobs "
                            "come whole)", param="echo", code="unsupported_value")
    return echo
