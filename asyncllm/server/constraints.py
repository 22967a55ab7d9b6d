"""The request fields that constrain an answer, mapped to a StructuredOutput: OpenAI's
response_format, and vLLM's structured_outputs and older guided_* fields. StructuredOutput checks
the values; this module only maps them and names the field in a 400. compile_constraint compiles
one for a request, given up when its client leaves."""
from __future__ import annotations

import json

from asyncllm.server.protocol import APIError, field_error, type_name
from asyncllm.server.sse import unless_disconnected
from asyncllm.structured import StructuredOutput

# vLLM's older names, each one kind of StructuredOutput
GUIDED_FIELDS = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
                 "guided_grammar": "grammar"}
CONSTRAINT_FIELDS = ("response_format", "structured_outputs", *GUIDED_FIELDS)


def requested_constraint(body: dict) -> tuple[StructuredOutput | None, str | None]:
    """The StructuredOutput the request asks for, and the field that asked; (None, None) if none."""
    given = [name for name in CONSTRAINT_FIELDS if body.get(name) is not None and not (
        name == "response_format" and _response_format_type(body[name]) == "text")]
    if not given:
        return None, None
    if len(given) > 1:
        raise APIError(400, f"give at most one of {', '.join(given)}: each constrains the whole answer",
                       param=given[1], code="invalid_value")
    field = given[0]
    value = body[field]
    try:
        if field == "response_format":
            return _from_response_format(value), field
        if field == "structured_outputs":
            if not isinstance(value, dict):
                raise APIError(400, f"'{field}': expected an object, got {type_name(value)}", param=field,
                               code="invalid_type")
            return StructuredOutput.coerce(value), field
        return StructuredOutput(**{GUIDED_FIELDS[field]: value}), field
    except ValueError as e:
        raise field_error(field, e) from None


def _response_format_type(value) -> str | None:
    if not isinstance(value, dict):
        raise APIError(400, f"'response_format': expected an object, got {type_name(value)}",
                       param="response_format", code="invalid_type")
    kind = value.get("type")
    if kind not in ("text", "json_object", "json_schema"):
        raise APIError(400, f"'response_format.type': expected 'text', 'json_object' or 'json_schema', got "
                            f"{json.dumps(kind)}", param="response_format.type", code="invalid_value")
    return kind


def _from_response_format(value: dict) -> StructuredOutput:
    if value["type"] == "json_object":
        return StructuredOutput(json_object=True)
    spec = value.get("json_schema")
    if not isinstance(spec, dict):
        raise APIError(400, f"'response_format.json_schema': expected an object, got {type_name(spec)}",
                       param="response_format.json_schema", code="invalid_type")
    return _json_schema(spec.get("schema"))


def _json_schema(schema) -> StructuredOutput:
    # strict or not, the output is held to the schema (xgrammar's strict mode: no properties or
    # items beyond the schema's)
    return StructuredOutput(json_object=True) if schema is None else StructuredOutput(json=schema)


def text_format_constraint(text) -> tuple[StructuredOutput | None, str | None]:
    """The Responses API's text.format ({"type": "text"}, "json_object", or "json_schema" with the
    schema beside name and strict, not nested as in response_format) as a StructuredOutput."""
    if text is None:
        return None, None
    if not isinstance(text, dict):
        raise APIError(400, f"'text': expected an object, got {type_name(text)}", param="text", code="invalid_type")
    value = text.get("format")
    if value is None:
        return None, None
    if not isinstance(value, dict):
        raise APIError(400, f"'text.format': expected an object, got {type_name(value)}", param="text.format",
                       code="invalid_type")
    kind = value.get("type")
    if kind == "text":
        return None, None
    if kind not in ("json_object", "json_schema"):
        raise APIError(400, f"'text.format.type': expected 'text', 'json_object' or 'json_schema', got "
                            f"{json.dumps(kind)}", param="text.format.type", code="invalid_value")
    try:
        return (StructuredOutput(json_object=True) if kind == "json_object" else _json_schema(value.get("schema"))), \
            "text.format"
    except ValueError as e:
        raise field_error("text.format", e) from None


async def compile_constraint(engine, request, structured_output: StructuredOutput) -> None:
    """engine.compile_structured_output, cancelled if the client disconnects meanwhile (a compile
    still queued is then dropped, never started)."""
    compiled, _ = await unless_disconnected(request.receive,
                                            lambda: engine.compile_structured_output(structured_output))
    if not compiled:  # nobody reads this answer
        raise APIError(499, "the client disconnected while its grammar compiled", code="client_disconnected")
