"""`asyncllm serve --reasoning-parser qwen3` as a real subprocess, driven by the official openai client:
reasoning_content beside content, whole and streamed (delta.reasoning_content), enable_thinking and
chat_template_kwargs, structured output and tool calls after the reasoning block, and earlier turns'
reasoning_content given to the template. The tiny random model is made to think by logit biases
(tests/test_reasoning.py says how)."""
from __future__ import annotations

import json

import pytest

from helpers import (ANSWER_WORD, MESSAGES_SAY_HI as MESSAGES, THINKING, WORDS, chat_prompt, forced, live_server,
                     live_server_client)

httpx = pytest.importorskip("httpx", reason="the server tests need the server/test extras (httpx)")
openai = pytest.importorskip("openai", reason="the server tests need the test extras (openai)")
pytest.importorskip("starlette", reason="the server tests need asyncllm[server] (starlette)")
pytest.importorskip("uvicorn", reason="the server tests need asyncllm[server] (uvicorn)")

pytestmark = pytest.mark.timeout(300)

MODEL_NAME = "tiny-qwen3-thinking"
REASONING = "".join(WORDS)


@pytest.fixture(scope="module")
def server(tiny_qwen3, tmp_path_factory):
    with live_server(tiny_qwen3, tmp_path_factory.mktemp("server"), "--served-model-name", MODEL_NAME,
                     "--reasoning-parser", "qwen3", "--num-kvcache-blocks", "64", "--kvcache-block-size", "16",
                     "--log-level", "warning") as served:
        yield served.base


@pytest.fixture(scope="module")
def client(server):
    return live_server_client(server)


@pytest.fixture(scope="module")
def tokenizer(tiny_qwen3):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(tiny_qwen3)


def request(tokenizer, sequence=THINKING, **extra) -> dict:
    """The openai client's keyword arguments of forced(...)'s sampling."""
    params = forced(tokenizer, sequence)
    return dict(model=MODEL_NAME, messages=MESSAGES, temperature=0, max_tokens=params.max_tokens,
                logit_bias={str(t): v for t, v in params.logit_bias.items()},
                extra_body={"repetition_penalty": params.repetition_penalty, **extra})


def streamed(client, **kwargs) -> tuple[str, str, list]:
    """(reasoning_content, content, chunks) of a streamed chat answer, joined from its deltas."""
    chunks = list(client.chat.completions.create(stream=True, **kwargs))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    reasoning = "".join(getattr(d, "reasoning_content", None) or "" for d in deltas)
    return reasoning, "".join(d.content or "" for d in deltas), chunks


def test_the_openai_client_sees_reasoning_content_whole_and_streamed(client, tokenizer):
    full = client.chat.completions.create(**request(tokenizer))
    message = full.choices[0].message
    assert message.model_extra["reasoning_content"] == message.reasoning_content == REASONING
    assert message.content == ANSWER_WORD + "<think>" * 4  # then <think>, halved, keeps first place
    assert full.usage.completion_tokens == 10  # max_tokens counts the reasoning's tokens too
    reasoning, content, chunks = streamed(client, **request(tokenizer))
    assert (reasoning, content) == (REASONING, message.content)
    with_reasoning = [c for c in chunks if c.choices and getattr(c.choices[0].delta, "reasoning_content", None)]
    assert len(with_reasoning) >= 2  # streamed in pieces, not sent at the end
    assert all(c.choices[0].delta.content in (None, "") for c in with_reasoning)


def test_thinking_off_by_enable_thinking_or_chat_template_kwargs(server, client, tokenizer):
    for extra in ({"enable_thinking": False}, {"chat_template_kwargs": {"enable_thinking": False}}):
        full = client.chat.completions.create(**request(tokenizer, **extra))
        # the template ends the prompt with an empty block: everything is answer, reasoning_content null
        # (the block's tags in the prompt: the repetition penalty puts the words first)
        assert full.choices[0].message.reasoning_content is None
        assert full.choices[0].message.content.startswith(REASONING)
    r = httpx.post(server + "/v1/chat/completions", timeout=60, json={
        "model": MODEL_NAME, "messages": MESSAGES, "max_tokens": 2, "enable_thinking": True,
        "chat_template_kwargs": {"enable_thinking": False}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "enable_thinking"
    r = httpx.post(server + "/v1/chat/completions", timeout=60, json={
        "model": MODEL_NAME, "messages": MESSAGES, "max_tokens": 2, "enable_thinking": "no"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "enable_thinking"


def test_structured_output_applies_after_the_reasoning(client, tokenizer):
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
    kwargs = request(tokenizer, response_format={"type": "json_schema", "json_schema": {"name": "r", "schema": schema}})
    kwargs["max_tokens"] = 20
    full = client.chat.completions.create(**kwargs)
    message = full.choices[0].message
    assert message.reasoning_content == REASONING and full.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(message.content)["ok"], bool)
    assert streamed(client, **kwargs)[:2] == (REASONING, message.content)


def test_a_forced_tool_call_after_the_reasoning(client, tokenizer):
    tool = {"type": "function", "function": {"name": "weather", "parameters": {
        "type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}}, "required": ["city"]}}}
    kwargs = dict(request(tokenizer), tools=[tool], tool_choice={"type": "function", "function": {"name": "weather"}},
                  max_tokens=20)
    full = client.chat.completions.create(**kwargs)
    message = full.choices[0].message
    assert message.reasoning_content == REASONING
    (call,) = message.tool_calls
    assert call.function.name == "weather" and json.loads(call.function.arguments)["city"] in ("Paris", "Rome")
    reasoning, _, chunks = streamed(client, **kwargs)
    assert reasoning == REASONING
    calls = [d for c in chunks if c.choices for d in (c.choices[0].delta.tool_calls or ())]
    assert calls[0].function.name == "weather"
    assert "".join(d.function.arguments or "" for d in calls) == call.function.arguments


def test_completions_carry_reasoning_content_too(server, tokenizer):
    params = forced(tokenizer, THINKING)
    body = {"model": MODEL_NAME, "prompt": chat_prompt(tokenizer), "max_tokens": params.max_tokens, "temperature": 0,
            "logit_bias": {str(t): v for t, v in params.logit_bias.items()}, "repetition_penalty": 2.0}
    choice = httpx.post(server + "/v1/completions", json=body, timeout=60).json()["choices"][0]
    assert (choice["reasoning_content"], choice["text"]) == (REASONING, ANSWER_WORD + "<think>" * 4)
    with httpx.stream("POST", server + "/v1/completions", json={**body, "stream": True}, timeout=60) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    choices = [e["choices"][0] for e in events]
    assert "".join(c.get("reasoning_content", "") for c in choices) == REASONING
    assert "".join(c["text"] for c in choices) == choice["text"]


def test_an_earlier_turns_reasoning_content_reaches_the_template(server, tokenizer):
    turns = [*MESSAGES, {"role": "assistant", "content": "", "reasoning_content": "Earlier thoughts.",
                         "tool_calls": [{"id": "c1", "type": "function",
                                         "function": {"name": "weather", "arguments": "{}"}}]},
             {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]
    r = httpx.post(server + "/tokenize", json={"model": MODEL_NAME, "messages": turns}, timeout=60)
    assert r.status_code == 200, r.text
    assert "<think>\nEarlier thoughts.\n</think>" in tokenizer.decode(r.json()["tokens"])
    r = httpx.post(server + "/v1/chat/completions", timeout=60,
                   json={"model": MODEL_NAME, "messages": [*turns[:1], {**turns[1], "reasoning_content": 3}]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages[1].reasoning_content"


def test_the_responses_api_gives_the_reasoning_its_own_item(client, tokenizer):
    """/v1/responses: the reasoning is a reasoning item before the message (streamed as
    response.reasoning_text.* events), and the usage counts its tokens as reasoning tokens."""
    params = forced(tokenizer, THINKING)
    ask = dict(model=MODEL_NAME, input=MESSAGES, temperature=0, max_output_tokens=params.max_tokens,
               extra_body={"logit_bias": {str(t): v for t, v in params.logit_bias.items()},
                           "repetition_penalty": params.repetition_penalty})
    whole = client.responses.create(**ask)
    reasoning, message = whole.output
    assert reasoning.type == "reasoning" and reasoning.content[0].text == REASONING
    assert message.type == "message" and whole.output_text == ANSWER_WORD + "<think>" * 4
    assert 0 < whole.usage.output_tokens_details.reasoning_tokens < whole.usage.output_tokens
    events = list(client.responses.create(stream=True, **ask))
    kinds = [e.type for e in events]
    assert kinds.index("response.reasoning_text.done") < kinds.index("response.output_text.delta")
    assert "".join(e.delta for e in events if e.type == "response.reasoning_text.delta") == REASONING
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == whole.output_text
    assert [item.type for item in events[-1].response.output] == ["reasoning", "message"]
