"""What a request's output must match: StructuredOutput, checked when it is made."""
from __future__ import annotations

import json
from dataclasses import dataclass, field

from asyncllm.structured import checks
from asyncllm.validation import FieldChecks

KINDS = ("json", "json_object", "regex", "choice", "grammar")
# JSON schemas whose objects and arrays nest deeper are refused: copying one (SamplingParams.snapshot)
# recurses per level, and some 300 levels exhaust Python's stack; a schema's nested object property
# costs two levels (the object, its "properties"), and real schemas nest a dozen or so
MAX_SCHEMA_DEPTH = 128

_fail = FieldChecks("StructuredOutput")


@dataclass(frozen=True)
class StructuredOutput:
    """Exactly one of:
    json: a JSON schema (a dict, or its JSON text); json_object: True for any JSON object;
    regex: a regular expression; choice: the outputs allowed, as strings; grammar: an EBNF grammar
    (xgrammar's dialect, the GBNF of llama.cpp, with a `root` rule).

    Refused here (ValueError naming the field, the limit or the feature; structured/checks.py):
    specs over the size limits, and regex features and JSON-schema keywords xgrammar would not
    enforce."""
    json: dict | str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    # (kind, canonical text): what compiled grammars are cached by
    key: tuple[str, str] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        given = [kind for kind in KINDS if getattr(self, kind) not in (None, False)]
        if len(given) != 1:
            raise ValueError(f"StructuredOutput: give exactly one of {', '.join(KINDS)}; got "
                             f"{', '.join(given) if given else 'none'}")
        kind = given[0]
        if kind == "json":
            schema = self.json
            if isinstance(schema, str):
                try:
                    schema = json.loads(schema)
                except ValueError as e:
                    _fail("json", f"not valid JSON: {e}")
                except RecursionError:
                    _fail("json", f"objects and arrays nested more than {MAX_SCHEMA_DEPTH} levels deep")
            if not isinstance(schema, (dict, bool)):
                _fail("json", f"expected a JSON schema (an object), got {type(schema).__name__}")
            if _depth_over(schema, MAX_SCHEMA_DEPTH):
                _fail("json", f"objects and arrays nested more than {MAX_SCHEMA_DEPTH} levels deep")
            text = json.dumps(schema, ensure_ascii=False)  # key order kept: properties come out in it
            problem = checks.check_text_size(text)  # first: the walk below is linear in the size
            if problem is not None:
                _fail("json", f"the schema is too large: {problem}")
            problem = checks.check_schema(schema)
            if problem is not None:
                _fail("json", problem)
        elif kind == "json_object":
            if self.json_object is not True:
                _fail("json_object", f"expected True, got {self.json_object!r}")
            text = ""
        elif kind == "choice":
            choice = self.choice
            if not isinstance(choice, (list, tuple)) or not choice or not all(
                    isinstance(c, str) and c for c in choice):
                _fail("choice", f"expected a non-empty list of non-empty strings, got {_short(choice)}")
            object.__setattr__(self, "choice", list(choice))
            text = json.dumps(list(choice), ensure_ascii=False)
            problem = checks.check_choice(choice) or checks.check_text_size(text)
            if problem is not None:
                _fail("choice", f"too many choices: {problem}")
        else:  # regex, grammar
            value = getattr(self, kind)
            if not isinstance(value, str) or not value:
                _fail(kind, f"expected a non-empty string, got {_short(value)}")
            text = value
            problem = checks.check_text_size(text)
            if problem is not None:
                _fail(kind, f"too large: {problem}")
            if kind == "regex" and (problem := checks.regex_problem(text)) is not None:
                _fail("regex", problem)
        object.__setattr__(self, "key", (kind, text))

    @property
    def kind(self) -> str:
        return self.key[0]

    @classmethod
    def coerce(cls, value) -> "StructuredOutput":
        """A StructuredOutput from itself or a dict of its fields (vLLM's structured_outputs shape)."""
        if isinstance(value, cls):
            return value
        if isinstance(value, dict):
            unknown = set(value) - set(KINDS)
            if unknown:
                raise ValueError(f"StructuredOutput: unknown field(s) {sorted(unknown)}; known: {list(KINDS)}")
            return cls(**value)
        raise ValueError(f"expected a StructuredOutput or a dict of its fields, got {type(value).__name__}")


def _depth_over(value, limit: int) -> bool:
    """Whether objects and arrays nest more than limit levels deep in value (without recursion)."""
    level = [value]  # the nodes at one depth: containers there are nested depth + 1 levels deep
    for _ in range(limit):
        level = [child for node in level if isinstance(node, (dict, list))
                 for child in (node.values() if isinstance(node, dict) else node)]
        if not level:
            return False
    return any(isinstance(node, (dict, list)) for node in level)


def _short(value, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."
