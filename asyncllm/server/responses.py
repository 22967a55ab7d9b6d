"""POST /v1/responses: OpenAI's Responses API (what the OpenAI Agents SDK and newer clients call),
on the chat path: `input` (a string or items: messages, function calls and their outputs, earlier
reasoning) and `instructions` become chat messages, function `tools` and `tool_choice` chat's tools
(server/tool_calls.py), `text.format` a constraint (server/constraints.py); the answer is output
items (server/response_output.py), whole or as the API's events.

Nothing is stored: `store` true, `previous_response_id`, `conversation`, `background` and `prompt`
are a 400 naming the field; send the whole conversation in `input`.
"""
from __future__ import annotations

import json
import time

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

import asyncllm.server.protocol as protocol
from asyncllm.server import tool_calls
from asyncllm.server.constraints import text_format_constraint
from asyncllm.server.protocol import APIError, type_name
from asyncllm.server.response_output import ResponseOutput
from asyncllm.server.sse import EventStreamResponse, answer_events, sse

# the sampling fields SamplingParams takes (vLLM's Responses API takes these extensions too)
SAMPLING = ("temperature", "top_p", "top_k", "min_p", "seed", "stop", "stop_token_ids", "ignore_eos", "min_tokens",
            "presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias", "skip_special_tokens",
            "include_stop_str_in_output", "spaces_between_special_tokens")
RESPONSES_FIELDS = {"model", "input", "instructions", "max_output_tokens", "stream", "tools", "tool_choice",
                    "parallel_tool_calls", "text", "include", "top_logprobs", "chat_template_kwargs", "enable_thinking",
                    "stream_options", *SAMPLING}
NEUTRAL_RESPONSES = {
    **{name: check for name, check in protocol.NEUTRAL_CHAT.items() if name in ("user", "metadata", "service_tier")},
    "safety_identifier": lambda v: isinstance(v, str), "prompt_cache_key": lambda v: isinstance(v, str),
    "truncation": lambda v: v == "disabled", "max_tool_calls": lambda v: False,
    "reasoning": lambda v: isinstance(v, dict) and all(v.get(k) is None for k in ("effort", "summary")),
}
# the API's state, which this server does not keep
STATEFUL = {"store": lambda v: v is False, "previous_response_id": lambda v: False, "conversation": lambda v: False,
            "background": lambda v: v is False, "prompt": lambda v: False}
LOGPROBS_INCLUDE = "message.output_text.logprobs"
ROLES = ("user", "system", "developer", "assistant")


async def create_response(server, request: Request) -> Response:
    body = await server._request_body(request, RESPONSES_FIELDS | set(STATEFUL), NEUTRAL_RESPONSES)
    for name, neutral in STATEFUL.items():
        if body.get(name) is not None and not neutral(body[name]):
            raise APIError(400, f"'{name}': this server keeps no responses or conversations (a stateless "
                                f"Responses API); leave it out and send the whole conversation in 'input'",
                           param=name, code="unsupported_parameter")
    messages = input_messages(body)
    chat_body = {**chat_tools(body), "parallel_tool_calls": body.get("parallel_tool_calls")}
    messages, template_kwargs, tools = tool_calls.with_tools(
        chat_body, messages, protocol.chat_template_kwargs(body, server.trust_request_chat_template),
        server.engine.chat_template)
    prompt_ids = await server._chat_prompt_ids(messages, template_kwargs)
    logprobs = wants_logprobs(body)
    sampling = {name: body[name] for name in (*SAMPLING, "max_output_tokens", "stream") if name in body}
    if logprobs:
        sampling.update(logprobs=True, top_logprobs=body.get("top_logprobs") or 0)
    gen = await server.generate(request, sampling, [prompt_ids], kind="responses", max_tokens_field="max_output_tokens",
                                default_max_tokens=None, constraint=text_format_constraint(body.get("text")),
                                tools=tools)
    output = ResponseOutput(response_object(body, gen, server.model_name), gen.tools, logprobs)
    if body.get("stream"):
        return stream_response(server, gen, output)
    results = await server.collect(request, gen.streams, observe=output.add)
    output.finish(results[0].finish_reason, usage(gen.streams))
    return JSONResponse(output.response)


def stream_response(server, gen, output: ResponseOutput) -> EventStreamResponse:
    def events(items: list[dict]) -> list[str]:
        return [sse(event, event["type"]) for event in items]

    def item_events(out) -> list[str]:
        items = output.add(out)
        if out.finish_reason is not None:
            items += output.finish(out.finish_reason, usage(gen.streams))
        return events(items)

    def error_events(error: APIError) -> list[str]:
        return events(output.failed("server_error" if error.status >= 500 else "invalid_prompt", error.message))
    close = server.closer(gen.streams)
    body = answer_events(gen.streams, close, item_events, lambda: [], error_events, events(output.start()),
                         server.drain.ended_by_shutdown)
    return EventStreamResponse(body, on_close=close, keepalive_interval=server.sse_keepalive_interval)


def usage(streams) -> dict:
    (stream,) = streams.streams
    metrics = stream.metrics
    return {"prompt_tokens": streams.num_prompt_tokens, "completion_tokens": streams.num_completion_tokens,
            "cached_tokens": metrics.num_cached_tokens if metrics is not None else 0}


def response_object(body: dict, gen, model_name: str) -> dict:
    """The response's own fields: its id and the settings it ran with (output, usage and status come later)."""
    params = gen.params
    return {"id": gen.request_id, "object": "response", "created_at": int(time.time()), "model": model_name,
            "status": "in_progress", "error": None, "incomplete_details": None,
            "instructions": body.get("instructions"), "max_output_tokens": body.get("max_output_tokens"),
            "temperature": params.temperature, "top_p": params.top_p,
            "parallel_tool_calls": body.get("parallel_tool_calls") is not False,
            "tool_choice": body.get("tool_choice") or "auto", "tools": body.get("tools") or [],
            "text": body.get("text") or {"format": {"type": "text"}}, "reasoning": body.get("reasoning"),
            "metadata": body.get("metadata") or {}, "store": False, "background": False,
            "top_logprobs": body.get("top_logprobs"), "truncation": "disabled", "usage": None, "user": body.get("user")}


def wants_logprobs(body: dict) -> bool:
    include = protocol.expect(body, "include", lambda v: isinstance(v, list) and all(isinstance(x, str) for x in v),
                              "an array of strings")
    include = [] if include is protocol.MISSING else include
    for name in include:
        if name != LOGPROBS_INCLUDE:  # e.g. reasoning.encrypted_content: nothing of it here
            protocol.warn_unknown_field(f"include.{name}")
    return LOGPROBS_INCLUDE in include or body.get("top_logprobs") is not None


# ---- input ------------------------------------------------------------------------------------------
def input_messages(body: dict) -> list[dict]:
    """`instructions` and `input` as chat messages, as server/protocol.messages makes them."""
    instructions = protocol.expect(body, "instructions", lambda v: isinstance(v, str), "a string")
    items = body.get("input")
    if items is None:
        raise APIError(400, "'input' is required", param="input", code="missing_required_parameter")
    if isinstance(items, str):
        items = [{"role": "user", "content": items}]
    if not isinstance(items, list) or not items:
        raise APIError(400, f"'input': expected a string or a non-empty array of items, got {type_name(items)}",
                       param="input", code="invalid_type" if not isinstance(items, list) else "invalid_value")
    messages = [] if instructions is protocol.MISSING else [{"role": "system", "content": instructions}]
    reasoning = None  # an earlier turn's reasoning item: the next assistant message's reasoning_content
    for i, item in enumerate(items):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise APIError(400, f"'{where}': expected an object, got {type_name(item)}", param=where,
                           code="invalid_type")
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ROLES:
                raise APIError(400, f"'{where}.role': expected one of {', '.join(map(repr, ROLES))}, got "
                                    f"{json.dumps(role)}", param=f"{where}.role", code="invalid_value")
            message = {"role": "system" if role == "developer" else role, "content": _text(item.get("content"), where)}
            if role == "assistant" and reasoning is not None:
                message["reasoning_content"], reasoning = reasoning, None
            messages.append(message)
        elif kind == "function_call":
            call = {"id": _string(item, "call_id", where), "type": "function",
                    "function": {"name": _string(item, "name", where), "arguments": _string(item, "arguments", where)}}
            last = messages[-1] if messages else None
            if last is None or last["role"] != "assistant" or (i > 0 and items[i - 1].get("type") not in (
                    "function_call", "message", None)):
                last = {"role": "assistant", "content": ""}
                messages.append(last)
            if reasoning is not None:
                last["reasoning_content"], reasoning = reasoning, None
            last.setdefault("tool_calls", []).append(call)
        elif kind == "function_call_output":
            output = item.get("output")
            messages.append({"role": "tool", "tool_call_id": _string(item, "call_id", where),
                             "content": output if isinstance(output, str) else _text(output, where, "output")})
        elif kind == "reasoning":
            parts = item.get("content") or item.get("summary") or []
            if not isinstance(parts, list):
                raise APIError(400, f"'{where}.content': expected an array of reasoning_text parts, got "
                                    f"{type_name(parts)}", param=f"{where}.content", code="invalid_type")
            reasoning = "".join(p["text"] for p in parts if isinstance(p, dict) and isinstance(p.get("text"), str))
        else:
            raise APIError(400, f"'{where}.type': {json.dumps(kind)} is not supported: send messages, function_call "
                                "and function_call_output items", param=f"{where}.type", code="invalid_value")
    return messages


def _string(item: dict, name: str, where: str) -> str:
    value = item.get(name)
    if not isinstance(value, str):
        raise APIError(400, f"'{where}.{name}': expected a string, got {type_name(value)}", param=f"{where}.{name}",
                       code="invalid_type")
    return value


def _text(content, where: str, name: str = "content") -> str:
    """A message's content: a string, or text parts (input_text, output_text; a refusal is skipped)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise APIError(400, f"'{where}.{name}': expected a string or an array of text parts, got "
                            f"{type_name(content)}", param=f"{where}.{name}", code="invalid_type")
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in ("input_text", "output_text", "text") and isinstance(part.get("text"), str):
            texts.append(part["text"])
        elif kind != "refusal":
            raise APIError(400, f"'{where}.{name}[{j}]': only text parts are supported", param=f"{where}.{name}[{j}]",
                           code="invalid_value")
    return "".join(texts)


def chat_tools(body: dict) -> dict:
    """The Responses API's function tools ({"type": "function", "name", "parameters", ...}) and
    tool_choice in chat's shape, which server/tool_calls.py checks further."""
    tools, choice = body.get("tools"), body.get("tool_choice")
    if tools is not None and not isinstance(tools, list):
        raise APIError(400, f"'tools': expected an array, got {type_name(tools)}", param="tools", code="invalid_type")
    converted = []
    for i, tool in enumerate(tools or []):
        if not (isinstance(tool, dict) and tool.get("type") == "function" and isinstance(tool.get("name"), str)):
            raise APIError(400, f"'tools[{i}]': only function tools ({{\"type\": \"function\", \"name\": ...}}) are "
                                "supported", param=f"tools[{i}]", code="invalid_value")
        function = {key: tool[key] for key in ("name", "description", "parameters") if tool.get(key) is not None}
        converted.append({"type": "function", "function": function})
    if isinstance(choice, dict):
        if choice.get("type") != "function" or not isinstance(choice.get("name"), str):
            raise APIError(400, "'tool_choice': expected 'none', 'auto', 'required' or {\"type\": \"function\", "
                                "\"name\": ...}", param="tool_choice", code="invalid_value")
        choice = {"type": "function", "function": {"name": choice["name"]}}
    return {"tools": converted, "tool_choice": choice}
