"""What a StructuredOutput may ask for, checked before anything compiles (pure Python, linear in
the spec's size).

Limits: xgrammar's compile time grows with the grammar (a JSON schema's enum values, its
properties: optional ones more than linearly) and cannot be interrupted; these bounds keep an
accepted compile to about two seconds on Qwen3's 152k-token vocabulary (docs/RELIABILITY.md has
the measurements). Past them the spec is refused naming the limit.

Features xgrammar would accept but not enforce (it logs a warning, or nothing, and generates as if
the keyword were absent) are refused too, naming where they are: regex lookaround, backreferences,
group flags, unknown escapes, anchors inside a pattern; and the JSON-schema keywords listed in
UNENFORCED_KEYWORDS and the combinations below. Measured on xgrammar 0.2.9 by feeding its matcher
outputs that break each keyword.
"""
from __future__ import annotations

import re

MAX_SPEC_BYTES = 128 * 1024  # the spec's text (a schema as JSON, a regex, a grammar, the choices), UTF-8
MAX_ENUM_VALUES = 8192  # a schema's enum and const values, all together; or a choice's entries
MAX_OBJECT_PROPERTIES = 256  # one object's properties (optional ones cost more than linearly)
MAX_PROPERTIES = 1024  # all objects' properties together

# keyword -> why it is refused: an output that breaks it is accepted by xgrammar
UNENFORCED_KEYWORDS = {
    "uniqueItems": "duplicate items are not prevented",
    "contains": "arrays are not checked for a matching item",
    "minContains": "arrays are not checked for matching items",
    "maxContains": "arrays are not checked for matching items",
    "dependentRequired": "properties' dependencies are not enforced",
    "dependentSchemas": "properties' dependencies are not enforced",
    "dependencies": "properties' dependencies are not enforced",
    "if": "conditional schemas are not enforced",
    "then": "conditional schemas are not enforced",
    "else": "conditional schemas are not enforced",
    "not": "negated schemas are not enforced",
    "$dynamicRef": "dynamic references are not resolved",
    "$recursiveRef": "recursive references are not resolved",
}
# standard formats xgrammar does not know (a format it knows is enforced; others are annotations,
# as JSON Schema has them by default)
UNENFORCED_FORMATS = {"idn-email", "idn-hostname", "iri", "iri-reference", "regex"}
MAX_INTEGER_MULTIPLE_OF = 1024  # xgrammar ignores a larger multipleOf

# subschemas: keyword -> how they sit under it (the walk does not enter enum, const, default, ...)
_SCHEMA_VALUED = ("additionalProperties", "unevaluatedProperties", "items", "additionalItems",
                  "unevaluatedItems", "propertyNames")
_SCHEMA_LISTS = ("prefixItems", "items", "anyOf", "oneOf", "allOf")
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions")

# regex escapes xgrammar reads as the regex means them; any other letter is matched as itself
_KNOWN_LETTER_ESCAPES = set("dDwWsStnrfvaexuc")
_GROUP_KINDS = {"=": "lookahead (?=...)", "!": "lookahead (?!...)", "<=": "lookbehind (?<=...)",
                "<!": "lookbehind (?<!...)", "P<": "named group (?P<name>...)", "P=": "backreference (?P=name)",
                "<": "named group (?<name>...)", "#": "comment (?#...)", ">": "atomic group (?>...)",
                "(": "conditional (?(...)...)"}
_QUANTIFIER = re.compile(r"[*+?]|\{\d+(,\d*)?\}")


def check_text_size(text: str) -> str | None:
    size = len(text.encode("utf-8", "surrogatepass"))
    if size > MAX_SPEC_BYTES:
        return f"{size} bytes; the limit is {MAX_SPEC_BYTES} (MAX_SPEC_BYTES)"
    return None


def check_choice(choice: list[str]) -> str | None:
    if len(choice) > MAX_ENUM_VALUES:
        return f"{len(choice)} entries; the limit is {MAX_ENUM_VALUES} (MAX_ENUM_VALUES)"
    return None


def check_schema(schema) -> str | None:
    """What in a JSON schema is over a limit or would not be enforced, with where (a JSON pointer)."""
    num_values = num_properties = 0
    stack = [(schema, "")]
    while stack:
        node, where = stack.pop()
        if not isinstance(node, dict):
            continue
        problem = _schema_node_problem(node)
        if problem is not None:
            return f"at '{where or '/'}': {problem}"
        num_values += len(node["enum"]) if isinstance(node.get("enum"), list) else 0
        num_values += "const" in node
        if num_values > MAX_ENUM_VALUES:
            return f"more than {MAX_ENUM_VALUES} enum and const values in all (MAX_ENUM_VALUES)"
        properties = node.get("properties")
        if isinstance(properties, dict):
            if len(properties) > MAX_OBJECT_PROPERTIES:
                return (f"at '{where or '/'}': {len(properties)} properties; the limit is {MAX_OBJECT_PROPERTIES} "
                        "for one object (MAX_OBJECT_PROPERTIES)")
            num_properties += len(properties)
            if num_properties > MAX_PROPERTIES:
                return f"more than {MAX_PROPERTIES} properties in all objects together (MAX_PROPERTIES)"
        for key, value in node.get("patternProperties", {}).items() if isinstance(
                node.get("patternProperties"), dict) else ():
            problem = regex_problem(key)
            if problem is not None:
                return f"at '{where}/patternProperties': the pattern {_quote(key)}: {problem}"
        for key in _SCHEMA_VALUED:
            if isinstance(node.get(key), dict):
                stack.append((node[key], f"{where}/{key}"))
        for key in _SCHEMA_LISTS:
            if isinstance(node.get(key), list):
                stack.extend((item, f"{where}/{key}/{i}") for i, item in enumerate(node[key]))
        for key in _SCHEMA_MAPS:
            if isinstance(node.get(key), dict):
                stack.extend((item, f"{where}/{key}/{_pointer_part(name)}") for name, item in node[key].items())
    return None


def _schema_node_problem(node: dict) -> str | None:
    for key, why in UNENFORCED_KEYWORDS.items():
        if key in node and not (key == "uniqueItems" and node[key] is False):
            return f"'{key}' is not supported: {why}"
    ref = node.get("$ref")
    if isinstance(ref, str) and not ref.startswith("#"):
        return f"'$ref' {_quote(ref)}: only references inside the schema ('#/...') are supported"
    if isinstance(node.get("allOf"), list) and len(node["allOf"]) > 1:
        return "'allOf' with more than one schema is not supported: only one of them would be enforced"
    if "multipleOf" in node:
        multiple = node["multipleOf"]
        if node.get("type") != "integer" or isinstance(multiple, bool) or not isinstance(multiple, int) \
                or not 1 <= multiple <= MAX_INTEGER_MULTIPLE_OF:
            return (f"'multipleOf' is supported only on \"type\": \"integer\", as an integer in "
                    f"[1, {MAX_INTEGER_MULTIPLE_OF}]; got {_quote(multiple)}")
    fmt = node.get("format")
    if fmt in UNENFORCED_FORMATS:
        return f"'format': {_quote(fmt)} is not supported"
    pattern = node.get("pattern")
    if pattern is not None:
        if not isinstance(pattern, str):
            return f"'pattern': expected a string, got {_quote(pattern)}"
        problem = regex_problem(pattern)
        if problem is not None:
            return f"the pattern {_quote(pattern)}: {problem}"
    lengths = [key for key in ("minLength", "maxLength") if key in node]
    if lengths and (pattern is not None or fmt is not None):
        other = "'pattern'" if pattern is not None else "'format'"
        return (f"{other} with {' and '.join(map(repr, lengths))} is not supported: the length would not be "
                "enforced (put it in the pattern)")
    if pattern is not None and fmt is not None:
        return "'pattern' with 'format' is not supported: only one of them would be enforced"
    return None


def regex_problem(pattern: str) -> str | None:
    """What in a regex xgrammar would refuse or silently read otherwise than the regex means, or None.
    A full match is what xgrammar generates, so '^' and '$' belong at the ends (of the pattern, or
    of its top-level alternatives)."""
    depth = 0
    in_class = False
    branch_start = 0  # where the current top-level alternative starts
    i, n = 0, len(pattern)
    while i < n:
        c = pattern[i]
        if c == "\\":
            if i + 1 == n:
                return "it ends with a lone backslash"
            escape = pattern[i + 1]
            if escape.isdigit():
                return (f"the backreference \\{escape}: backreferences are not supported" if escape != "0" else
                        "the escape \\0 is not supported (write \\x00)")
            if escape == "k":
                return "the backreference \\k<...>: backreferences are not supported"
            if escape in "bB":
                return f"\\{escape}: word boundaries are not supported"
            if escape in "pP":
                return f"\\{escape}{{...}}: Unicode property classes are not supported"
            if escape.isalpha() and escape not in _KNOWN_LETTER_ESCAPES:
                return f"the escape \\{escape} is not supported (it would match the letter {escape})"
            i += 2
            if escape in "ux" and pattern.startswith("{", i):  # \u{...}: not a quantifier
                i = pattern.find("}", i) + 1 or n
            continue
        if in_class:
            in_class = c != "]"
            i += 1
            continue
        if c == "[":
            in_class = True
        elif c == "(":
            if pattern.startswith("(?", i) and not pattern.startswith("(?:", i):
                kind = next((kind for prefix, kind in _GROUP_KINDS.items() if pattern.startswith(prefix, i + 2)),
                            "inline flags (?...)")
                return f"{kind} is not supported"
            depth += 1
        elif c == ")":
            depth -= 1
        elif c == "|" and depth == 0:
            branch_start = i + 1
        elif c == "^" and i != branch_start:
            return "'^' inside the pattern is not supported (only at its start, or at a top-level alternative's)"
        elif c == "$" and not (i == n - 1 or depth == 0 and pattern[i + 1] == "|"):
            return "'$' inside the pattern is not supported (only at its end, or at a top-level alternative's)"
        else:
            quantifier = _QUANTIFIER.match(pattern, i)
            if quantifier is not None:
                after = quantifier.end()
                after += pattern.startswith("?", after)  # lazy: the same strings match
                if _QUANTIFIER.match(pattern, after):
                    return f"two quantifiers in a row at index {i} (possessive quantifiers are not supported)"
                i = after
                continue
        i += 1
    return None


def _pointer_part(name: str) -> str:
    return name.replace("~", "~0").replace("/", "~1")


def _quote(value, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."
