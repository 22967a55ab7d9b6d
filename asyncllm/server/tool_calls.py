"""Tool calls: the request's tools and tool_choice, the messages that carry calls and results, the
constraint of a forced call, and the model's output parsed into OpenAI tool_calls.

Per model family, a table of output formats. A chat template that renders `tools` itself (Qwen3,
Qwen2.5, Llama 3.x) gets them as its `tools` argument; one that does not (SmolLM2's) gets them in a
system message in the Hermes format, which SmolLM2 was trained on, and calls/results as text.

A forced call (tool_choice "required" or a named function) is generated under a JSON schema, as
vLLM does: a named function's output is its arguments object; "required" outputs an array of
{"name", "parameters"} objects. Those need no family format.
"""
from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass

from asyncllm.server.json_scan import ObjectScan, scan_array_of_objects, scan_object, skip_whitespace
from asyncllm.server.protocol import APIError, type_name
from asyncllm.structured import StructuredOutput


@dataclass(frozen=True)
class ToolCallFormat:
    """How a family's model writes a call it chose itself (tool_choice "auto")."""
    name: str
    start: str  # what opens a call ("" = the call is a bare JSON object)
    end: str  # what closes it ("" = the end of the JSON object)
    arguments_key: str  # the JSON key of the arguments

    @property
    def argument_keys(self) -> tuple[str, ...]:
        """The keys a call's arguments are looked up by, in order (models mix up the two names)."""
        return tuple(dict.fromkeys((self.arguments_key, "arguments", "parameters")))


FORMATS = {
    # Qwen3, Qwen2.5, SmolLM2 (Hermes): <tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>
    "hermes": ToolCallFormat("hermes", "<tool_call>", "</tool_call>", "arguments"),
    # Llama 3.x: the message is {"name": ..., "parameters": {...}}, perhaps after <|python_tag|>
    "llama3_json": ToolCallFormat("llama3_json", "", "", "parameters"),
}

HERMES_SYSTEM = ("# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are "
                 "provided with function signatures within <tools></tools> XML tags:\n<tools>\n{tools}\n</tools>"
                 "\n\nFor each function call, return a json object with function name and arguments within "
                 "<tool_call></tool_call> XML tags:\n<tool_call>\n{{\"name\": <function-name>, \"arguments\": "
                 "<args-json-object>}}\n</tool_call>")


def format_for_template(template: str | None) -> tuple[ToolCallFormat, bool]:
    """The family format a chat template asks for, and whether the template renders tools itself."""
    template = template or ""
    if "<tool_call>" in template:
        return FORMATS["hermes"], True
    if "<|python_tag|>" in template or ("tools" in template and '"parameters"' in template):
        return FORMATS["llama3_json"], True
    return FORMATS["hermes"], False


@dataclass
class ToolRequest:
    tools: list[dict]  # OpenAI tool objects: {"type": "function", "function": {name, description, parameters}}
    choice: str  # "auto", "none", "required", or "named"
    named: str | None = None  # the function a named tool_choice forces
    parallel: bool = True  # parallel_tool_calls

    @property
    def forced(self) -> bool:
        return self.choice in ("required", "named")

    def schema_of(self, name: str) -> dict:
        return next(t["function"].get("parameters") or {"type": "object"} for t in self.tools
                    if t["function"]["name"] == name)

    def constraint(self) -> StructuredOutput | None:
        """What a forced call's output is held to."""
        if self.choice == "named":
            return StructuredOutput(json=self.schema_of(self.named))
        if self.choice == "required":
            calls = [{"type": "object", "properties": {"name": {"const": t["function"]["name"]},
                                                       "parameters": self.schema_of(t["function"]["name"])},
                      "required": ["name", "parameters"]} for t in self.tools]
            array = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
            if not self.parallel:
                array["maxItems"] = 1
            return StructuredOutput(json=array)
        return None


def tool_request(body: dict) -> ToolRequest | None:
    """tools and tool_choice, checked for shape; None when the request brings no tools (or "none")."""
    tools, choice = body.get("tools"), body.get("tool_choice")
    if tools is None or tools == []:
        if choice not in (None, "none"):
            raise APIError(400, "'tool_choice' needs 'tools'", param="tool_choice", code="invalid_value")
        return None
    if not isinstance(tools, list):
        raise APIError(400, f"'tools': expected an array, got {type_name(tools)}", param="tools", code="invalid_type")
    names = []
    for i, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, dict) else None
        if not (isinstance(tool, dict) and tool.get("type") == "function" and isinstance(function, dict)
                and isinstance(function.get("name"), str) and function["name"]):
            raise APIError(400, f"'tools[{i}]': expected {{\"type\": \"function\", \"function\": {{\"name\": ...}}}}",
                           param=f"tools[{i}]", code="invalid_value")
        if not isinstance(function.get("parameters", {}), dict):
            raise APIError(400, f"'tools[{i}].function.parameters': expected a JSON schema object",
                           param=f"tools[{i}].function.parameters", code="invalid_type")
        names.append(function["name"])
    parallel = body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise APIError(400, f"'parallel_tool_calls': expected a boolean, got {type_name(parallel)}",
                       param="parallel_tool_calls", code="invalid_type")
    parallel = parallel is not False
    if choice is None or choice in ("auto", "none", "required"):
        choice = choice or "auto"
        return None if choice == "none" else ToolRequest(tools, choice, parallel=parallel)
    name = choice.get("function", {}).get("name") if isinstance(choice, dict) and \
        choice.get("type") == "function" and isinstance(choice.get("function"), dict) else None
    if not isinstance(name, str):
        raise APIError(400, "'tool_choice': expected 'none', 'auto', 'required' or {\"type\": \"function\", "
                            "\"function\": {\"name\": ...}}", param="tool_choice", code="invalid_value")
    if name not in names:
        raise APIError(400, f"'tool_choice': no tool named {json.dumps(name)} in 'tools'", param="tool_choice",
                       code="invalid_value")
    return ToolRequest(tools, "named", name, parallel)


def render_messages(messages: list[dict], tools: ToolRequest | None, renders_tools: bool) -> tuple[list[dict], dict]:
    """The messages and template arguments to render: calls' arguments as objects (templates write
    them with tojson); for a template without tool support, tools and calls as Hermes text."""
    if renders_tools:
        out = []
        for message in messages:
            if message.get("tool_calls"):
                message = {**message, "tool_calls": [_call_with_object_arguments(c) for c in message["tool_calls"]]}
            out.append(message)
        return out, ({"tools": tools.tools} if tools is not None else {})
    out = []
    for message in messages:
        content = message["content"]
        if message.get("tool_calls"):
            calls = [_call_with_object_arguments(c)["function"] for c in message["tool_calls"]]
            content += "".join(f"<tool_call>\n{json.dumps(c, ensure_ascii=False)}\n</tool_call>" for c in calls)
            out.append({"role": "assistant", "content": content})
        elif message["role"] == "tool":
            out.append({"role": "user", "content": f"<tool_response>\n{content}\n</tool_response>"})
        else:
            out.append({"role": message["role"], "content": content})
    if tools is not None:
        system = HERMES_SYSTEM.format(tools="\n".join(json.dumps(t, ensure_ascii=False) for t in tools.tools))
        if out[0]["role"] == "system":
            out[0] = {"role": "system", "content": out[0]["content"] + "\n\n" + system}
        else:
            out.insert(0, {"role": "system", "content": system})
    return out, {}


def with_tools(body: dict, messages: list[dict], template_kwargs: dict, default_template: str | None):
    """A chat's messages and template arguments with the request's tools rendered for the template
    (the request's own, else default_template), and (tools, their call format), or None without
    tools: what chat completions and /tokenize render alike."""
    tools = tool_request(body)
    call_format, renders_tools = format_for_template(template_kwargs.get("chat_template") or default_template)
    messages, tool_kwargs = render_messages(messages, tools, renders_tools)
    return messages, {**template_kwargs, **tool_kwargs}, None if tools is None else (tools, call_format)


def _call_with_object_arguments(call: dict) -> dict:
    function = dict(call.get("function") or {})
    arguments = function.get("arguments")
    if isinstance(arguments, str):
        try:
            function["arguments"] = json.loads(arguments)
        except ValueError:
            pass  # rendered as the string it is
    return {**call, "function": function}


def new_call(name: str, arguments) -> dict:
    text = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function", "function": {"name": name, "arguments": text}}


def parse_output(text: str, tools: ToolRequest, fmt: ToolCallFormat) -> tuple[str | None, list[dict]]:
    """(content, tool_calls) of a whole answer. Arguments are the raw JSON text the model wrote, as
    streaming sends it piece by piece."""
    if tools.forced:
        return None, _forced_calls(text, tools)
    known = {t["function"]["name"] for t in tools.tools}
    calls = _parse_auto(text, fmt, known)
    if not tools.parallel and len(calls[1]) > 1:
        return calls[0], calls[1][:1]
    return calls


def _forced_calls(text: str, tools: ToolRequest) -> list[dict]:
    """The calls of a forced call's output (a named function's arguments object, or "required"'s
    array of {"name", "parameters"}): each whose name is complete, with its arguments' raw text.
    Output cut short by max_tokens keeps what it has, as vLLM and OpenAI return it (finish_reason
    "length" says so): the call named so far, arguments incomplete; never the raw JSON as content."""
    start = skip_whitespace(text, 0)
    if tools.choice == "named":
        if not text.startswith("{", start):
            return []
        end = scan_object(text, start).end
        return [new_call(tools.named, text[start:end] if end is not None else text[start:])]
    if not text.startswith("[", start):
        return []
    known = {t["function"]["name"] for t in tools.tools}
    calls = []
    for scan in scan_array_of_objects(text, start):
        name = scan.string(text, "name")
        if name not in known:  # not complete yet (the grammar allows only these)
            break
        value_start, value_end = scan.fields.get("parameters", (None, None))
        if value_start is None or (value_end is None and text[value_start] not in "{["):
            arguments = ""  # not begun, or a scalar whose end is not known: what streaming has sent
        else:
            arguments = text[value_start:value_end] if value_end is not None else text[value_start:]
        calls.append(new_call(name, arguments))
    return calls


def _raw_value(text: str, scan: ObjectScan, keys: tuple[str, ...]) -> str:
    """The raw text of the first complete value among `keys` ("{}": none)."""
    for key in keys:
        start, end = scan.fields.get(key, (0, None))
        if end is not None:
            return text[start:end]
    return "{}"


def _parse_auto(text: str, fmt: ToolCallFormat, known: set[str]) -> tuple[str | None, list[dict]]:
    if fmt.start:
        calls, content = [], []
        position = 0
        pattern = re.compile(re.escape(fmt.start) + r"(.*?)(?:" + re.escape(fmt.end) + "|$)", re.DOTALL)
        for match in pattern.finditer(text):
            call = _call_from_json(match.group(1), fmt, known)
            if call is None:
                continue
            content.append(text[position:match.start()])
            position = match.end()
            calls.append(call)
        content.append(text[position:])
        rest = "".join(content).strip()
        return (rest or None) if calls else text, calls
    body = text.strip().removeprefix("<|python_tag|>")
    calls = [_call_from_json(part, fmt, known) for part in body.split(";")] if body.startswith("{") else []
    return (None, calls) if calls and all(calls) else (text, [])


def _call_from_json(text: str, fmt: ToolCallFormat, known: set[str]) -> dict | None:
    body = text.strip()
    try:
        value = json.loads(body)
    except ValueError:
        return None
    if not isinstance(value, dict) or value.get("name") not in known:
        return None
    return new_call(value["name"], _raw_value(body, scan_object(body, 0), fmt.argument_keys))
