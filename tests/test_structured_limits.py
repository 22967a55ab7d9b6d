"""What constrained decoding refuses and how its compiles are bounded (issue 52): the size limits
and the regex features and JSON-schema keywords xgrammar would not enforce (structured/checks.py),
and the compile threads, their deadline, their cancellation and the cache's byte bound
(structured/compile_jobs.py, structured/grammar.py). No model: xgrammar, and the real Qwen3
tokenizer where a compile is real."""
from __future__ import annotations

import json
import re
import threading
import time

import anyio
import pytest
import xgrammar

from asyncllm.errors import QueueFullError
from asyncllm.structured import StructuredOutput, checks
from asyncllm.structured.compile_jobs import CompileJobs
from asyncllm.structured.grammar import GrammarCompiler

pytestmark = pytest.mark.timeout(300)


def words(n: int, length: int = 8, seed: int = 0) -> list[str]:
    """n distinct lowercase words."""
    import random
    rng = random.Random(seed)
    found: set[str] = set()
    while len(found) < n:
        found.add("".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(length)))
    return sorted(found)


def xgrammar_lets_through(kind: str, spec, text: str) -> bool:
    """Whether xgrammar alone (none of our checks) generates `text` under a JSON schema or a regex."""
    grammar = (xgrammar.Grammar.from_json_schema(json.dumps(spec), any_whitespace=False, strict_mode=True)
               if kind == "json" else xgrammar.Grammar.from_regex(spec))
    compiled = xgrammar.GrammarCompiler(xgrammar.TokenizerInfo([]), cache_enabled=False).compile_grammar(grammar)
    matcher = xgrammar.GrammarMatcher(compiled, terminate_without_stop_token=True)
    return matcher.accept_string(text) and matcher.is_terminated()


# ---- size limits ----------------------------------------------------------------------------------
def nested_objects(num_objects: int, num_properties: int) -> dict:
    objects = {f"o{j}": {"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(num_properties)}}
               for j in range(num_objects)}
    return {"type": "object", "properties": objects, "required": list(objects)}


@pytest.mark.parametrize("kwargs, message", [
    ({"regex": "(" + "|".join(words(20000)) + ")"}, "MAX_SPEC_BYTES"),
    ({"grammar": "root ::= " + " | ".join(f'"{w}"' for w in words(12000))}, "MAX_SPEC_BYTES"),
    ({"json": {"type": "string", "description": "x" * checks.MAX_SPEC_BYTES}}, "MAX_SPEC_BYTES"),
    ({"json": {"enum": list(range(checks.MAX_ENUM_VALUES + 1))}}, "MAX_ENUM_VALUES"),
    ({"json": {"type": "array", "prefixItems": [{"enum": list(range(5000))}, {"enum": list(range(5000))}]}},
     "MAX_ENUM_VALUES"),
    ({"choice": [str(i) for i in range(checks.MAX_ENUM_VALUES + 1)]}, "MAX_ENUM_VALUES"),
    ({"json": nested_objects(1, checks.MAX_OBJECT_PROPERTIES + 1)}, "MAX_OBJECT_PROPERTIES"),
    ({"json": nested_objects(5, 250)}, "MAX_PROPERTIES"),
])
def test_specs_past_the_size_limits_are_refused_naming_the_limit(kwargs, message):
    with pytest.raises(ValueError, match=f"StructuredOutput.{next(iter(kwargs))}: .*{message}"):
        StructuredOutput(**kwargs)


def test_specs_at_the_limits_are_accepted():
    StructuredOutput(json={"enum": list(range(checks.MAX_ENUM_VALUES))})
    StructuredOutput(choice=[str(i) for i in range(checks.MAX_ENUM_VALUES)])
    StructuredOutput(json=nested_objects(3, checks.MAX_OBJECT_PROPERTIES))
    StructuredOutput(regex="(" + "|".join(words(12000)) + ")")  # 108 KB


# ---- regex features and JSON-schema keywords xgrammar would not enforce ---------------------------
# (regex, a text the regex does not match that xgrammar, reading it its way, generates)
MISREAD_REGEXES = [
    (r"^(?!a)[ab]$", "a"),  # issue 52's lookahead: ignored inside a JSON schema
    (r"\Aab", "Aab"),  # an unknown escape: the letter itself
    (r"ab\z", "abz"),
    (r"a^b", "ab"),  # an anchor inside: dropped
    (r"(a|b$)c", "bc"),
    (r"a++a", "aa"),  # possessive: read as a repeat of a repeat
    (r"x{2}{3}", "xxxxxx"),
]


def regex_matches(regex: str, text: str) -> bool:
    """Python's reading (False for what it cannot read: JavaScript's, JSON Schema's, refuses it too)."""
    try:
        return re.fullmatch(regex, text) is not None
    except re.error:
        return False


@pytest.mark.parametrize("regex, text", MISREAD_REGEXES)
def test_regex_features_xgrammar_would_misread_are_refused_as_regex_and_as_pattern(regex, text):
    assert not regex_matches(regex, text)  # the regex forbids text ...
    assert xgrammar_lets_through("json", {"type": "string", "pattern": regex}, json.dumps(text))  # ... xgrammar not
    with pytest.raises(ValueError, match="StructuredOutput.regex: .*not supported"):
        StructuredOutput(regex=regex)
    with pytest.raises(ValueError, match=r"StructuredOutput.json: at '/properties/x': the pattern .*not supported"):
        StructuredOutput(json={"type": "object", "properties": {"x": {"type": "string", "pattern": regex}}})
    with pytest.raises(ValueError, match="StructuredOutput.json: at '/patternProperties'.*not supported"):
        StructuredOutput(json={"type": "object", "patternProperties": {regex: {"type": "integer"}}})


@pytest.mark.parametrize("regex, what", [
    (r"(?<=a)b", "lookbehind"), (r"(a)\1", "backreference"), (r"(?P<x>a)", "named group"), (r"(?i)ab", "flags"),
    (r"\bword\b", "word boundaries"), (r"\p{L}", "Unicode property"), (r"(?>a)", "atomic group"),
    (r"[\b]", "word boundaries"), ("a\\", "lone backslash"), (r"\0", "\\\\0"),
])
def test_regex_features_xgrammar_refuses_are_refused_naming_the_feature(regex, what):
    with pytest.raises(ValueError, match=f"StructuredOutput.regex: .*{what}"):
        StructuredOutput(regex=regex)


@pytest.mark.parametrize("regex", [
    r"^[a-z]{1,8}@[a-z]{1,8}\.com$", r"^a$|^b$", r"(?:ab)+?c", r"\(\d{3}\) \d{3}-\d{4}", r"[\w\s\-\]]+",
    r"\u{41}+\x41\t", r"a{2,}b", r"[$^]\$\^", "a|",
])
def test_regexes_xgrammar_reads_as_meant_are_accepted(regex):
    StructuredOutput(regex=regex)
    StructuredOutput(json={"type": "string", "pattern": regex})


# (schema, an instance that breaks it and that xgrammar generates all the same)
UNENFORCED_SCHEMAS = [
    ({"type": "array", "items": {"type": "integer"}, "uniqueItems": True}, [1, 1]),
    ({"type": "array", "items": {"type": "integer"}, "contains": {"const": 1}}, [2]),
    ({"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
      "dependentRequired": {"a": ["b"]}}, {"a": 1}),
    ({"$schema": "http://json-schema.org/draft-07/schema#", "type": "object",
      "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "dependencies": {"a": ["b"]}}, {"a": 1}),
    ({"type": "integer", "if": {"minimum": 5}, "then": {"maximum": 7}}, 9),
    ({"type": "integer", "not": {"const": 3}}, 3),
    ({"allOf": [{"type": "integer", "minimum": 1}, {"maximum": 5}]}, 9),
    ({"type": "number", "multipleOf": 0.5}, 0.3),
    ({"type": "integer", "multipleOf": 5000}, 7),
    ({"type": "string", "pattern": "^[a-z]+$", "maxLength": 3}, "abcdef"),
    ({"type": "string", "format": "email", "maxLength": 8}, "abcdef@ghij.com"),
    ({"type": "string", "format": "email", "pattern": "^a"}, "b@c.com"),
    ({"type": "string", "format": "regex"}, "(("),
    ({"$ref": "http://example.com/schema.json"}, "anything"),
]


@pytest.mark.parametrize("schema, instance", UNENFORCED_SCHEMAS)
def test_json_schema_keywords_xgrammar_ignores_are_refused(schema, instance):
    import jsonschema
    if "$ref" not in schema:  # (a remote one would be fetched)
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(instance, schema, format_checker=jsonschema.FormatChecker())
    assert xgrammar_lets_through("json", schema, json.dumps(instance))
    with pytest.raises(ValueError, match="StructuredOutput.json: at '/': .*(not supported|only)"):
        StructuredOutput(json=schema)
    # nested too, with the place named
    with pytest.raises(ValueError, match="at '/properties/a/prefixItems/0'"):
        StructuredOutput(json={"type": "object", "properties": {"a": {"type": "array", "prefixItems": [schema]}}})


def test_enforced_keywords_and_annotations_are_accepted():
    StructuredOutput(json={
        "$defs": {"pet": {"type": "object", "properties": {"kind": {"enum": ["cat", "dog"]}}, "required": ["kind"]}},
        "type": "object", "title": "t", "description": "d", "properties": {
            "pet": {"$ref": "#/$defs/pet"}, "n": {"type": "integer", "multipleOf": 3, "minimum": 0},
            "tags": {"type": "array", "items": {"type": "string", "maxLength": 5}, "uniqueItems": False},
            "when": {"type": "string", "format": "date-time"}, "code": {"type": "string", "pattern": "^[A-Z]{3}$"},
            "one": {"allOf": [{"type": "boolean"}]}, "either": {"anyOf": [{"type": "null"}, {"type": "string"}]},
            # property names that are keywords elsewhere, and const/enum values that look like schemas
            "not": {"const": {"if": 1, "uniqueItems": True}}, "if": {"enum": [{"pattern": "(?!x)"}]}},
        "required": ["pet"]})


# ---- the compile threads: bounded, cancellable, with a deadline ------------------------------------
def gated_run(name: str, started: list, gates: dict):
    gates[name] = threading.Event()

    def run():
        started.append(name)
        assert gates[name].wait(60)
        return name
    return run


def wait_until(condition, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.005)


def test_a_queued_compile_nobody_waits_for_is_dropped_unstarted():
    jobs = CompileJobs(max_running=1, max_detached=1)
    started, gates = [], {}
    first = jobs.submit("a", gated_run("a", started, gates))
    second = jobs.submit("b", gated_run("b", started, gates))
    assert jobs.stats() == {"queued": 1, "running": 1, "detached": 0}
    jobs.leave(second)  # its client left
    assert jobs.stats() == {"queued": 0, "running": 1, "detached": 0}
    gates["a"].set()
    assert jobs.wait(first, 60) == "a"
    jobs.leave(first)
    wait_until(lambda: jobs.stats() == {"queued": 0, "running": 0, "detached": 0})
    assert started == ["a"]


def test_compiles_past_the_deadline_fail_their_waiters_and_run_on_detached_within_a_bound():
    jobs = CompileJobs(max_running=1, max_detached=1)
    started, gates = [], {}
    slow = jobs.submit("a", gated_run("a", started, gates))
    with pytest.raises(TimeoutError):
        jobs.wait(slow, 0.05)
    jobs.leave(slow)  # it runs on, detached: the regular place is free
    slower = jobs.submit("b", gated_run("b", started, gates))
    wait_until(lambda: started == ["a", "b"])
    with pytest.raises(TimeoutError):
        jobs.wait(slower, 0.05)
    jobs.leave(slower)  # one detached already: it keeps its place, and nothing more starts
    queued = jobs.submit("c", gated_run("c", started, gates))
    time.sleep(0.1)
    assert jobs.stats() == {"queued": 1, "running": 1, "detached": 1} and started == ["a", "b"]
    gates["a"].set()  # the detached one ends: "b" is detached in its place, "c" starts
    wait_until(lambda: started == ["a", "b", "c"])
    assert jobs.stats() == {"queued": 0, "running": 1, "detached": 1}
    gates["b"].set()
    gates["c"].set()
    assert jobs.wait(queued, 60) == "c"
    jobs.leave(queued)


def test_waiters_of_one_key_share_one_compile_and_the_queue_is_bounded():
    jobs = CompileJobs(max_running=1, max_queued=2)
    started, gates = [], {}
    first = jobs.submit("a", gated_run("a", started, gates))
    again = jobs.submit("a", gated_run("a2", started, gates))
    assert again is first
    queued = [jobs.submit(key, gated_run(key, started, gates)) for key in "bc"]
    with pytest.raises(QueueFullError, match="2 grammar compiles are already queued"):
        jobs.submit("d", gated_run("d", started, gates))
    for job in queued:
        jobs.leave(job)
    gates["a"].set()
    assert jobs.wait(first, 60) == jobs.wait(again, 60) == "a"
    jobs.leave(first)
    jobs.leave(again)
    assert started == ["a"]


@pytest.fixture(scope="module")
def tokenizer(tokenizer_dir):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(tokenizer_dir)


def make_compiler(tokenizer, **kwargs) -> GrammarCompiler:
    return GrammarCompiler(tokenizer, 151936, {151645}, **kwargs)


def gate_compiles(compiler: GrammarCompiler) -> tuple[list, threading.Event]:
    """Make compiler's compiles record their kinds and texts and wait for the returned event first."""
    compiled, release = [], threading.Event()
    real = compiler._compile

    def gated(spec):
        compiled.append(spec.key)
        assert release.wait(60)
        return real(spec)
    compiler._compile = gated
    return compiled, release


@pytest.mark.anyio
async def test_a_compile_cancelled_while_queued_never_runs(tokenizer):
    compiler = make_compiler(tokenizer)
    compiled, release = gate_compiles(compiler)
    first, second = StructuredOutput(regex="[ab]+"), StructuredOutput(json={"enum": words(3000)})
    with anyio.fail_after(120):
        async with anyio.create_task_group() as tasks:
            tasks.start_soon(compiler.compile_async, first)
            while not compiled:
                await anyio.sleep(0.01)
            with anyio.move_on_after(0.2):  # queued behind the first, then its client leaves
                await compiler.compile_async(second)
            assert compiler.stats()["grammar_compiles_queued"] == 0
            release.set()
    assert compiled == [first.key]
    assert compiler.stats() | {"grammar_cache_bytes": 0} == {
        "grammar_compiles_queued": 0, "grammar_compiles_running": 0, "grammar_compiles_detached": 0,
        "grammar_cache_bytes": 0, "grammar_cache_entries": 1}


@pytest.mark.anyio
async def test_a_compile_past_the_deadline_fails_its_request_and_is_not_cached(tokenizer):
    compiler = make_compiler(tokenizer, deadline_s=0.2)
    compiled, release = gate_compiles(compiler)
    spec = StructuredOutput(regex="[0-9]{3}")
    with anyio.fail_after(120):
        with pytest.raises(ValueError, match=r"SamplingParams.structured_output: .*did not compile within 0.2 s"):
            await compiler.compile_async(spec)
        with pytest.raises(ValueError, match="did not compile within 0.2 s"):
            await anyio.to_thread.run_sync(compiler.compile, spec)  # the same compile, detached: it fails at once
        assert compiled == [spec.key] and compiler.stats()["grammar_compiles_detached"] == 1
        release.set()
        while compiler.stats()["grammar_compiles_detached"]:
            await anyio.sleep(0.01)
    assert compiler.stats()["grammar_cache_entries"] == 0  # its result was thrown away


def test_the_cache_is_bounded_by_bytes(tokenizer):
    sizes = []
    probe = make_compiler(tokenizer)
    for n in (400, 401, 402, 403):
        probe.compile(StructuredOutput(json={"enum": words(n, seed=n)}))
        sizes.append(probe.stats()["grammar_cache_bytes"] - sum(sizes))
    limit = sizes[0] + sizes[1] + sizes[2] // 2  # room for two of them
    compiler = make_compiler(tokenizer, cache_limit_bytes=limit)
    specs = [StructuredOutput(json={"enum": words(n, seed=n)}) for n in (400, 401, 402, 403)]
    for spec in specs:
        compiler.compile(spec)
        assert compiler.stats()["grammar_cache_bytes"] <= limit
    assert compiler.stats()["grammar_cache_entries"] == 2
    compiler.jobs.submit = None  # the latest two are cached: no compile job for them
    compiler.compile(specs[-1])
    compiler.compile(specs[-2])


def test_a_prepared_request_keeps_its_compiled_grammar_whatever_the_cache_drops(tokenizer):
    compiler = make_compiler(tokenizer, cache_limit_bytes=0)  # caches nothing
    spec = StructuredOutput(regex="[ab]{4}")
    compiler.prepare(spec)
    compiler.jobs.submit = None  # the engine thread must not compile
    assert compiler.new_state(spec).matcher.accept_string("abba")
