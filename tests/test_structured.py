"""Constrained decoding in the engine (SamplingParams.structured_output), on the tiny random model.

The reference is xgrammar's own GrammarMatcher: every bitmask the sampler applied must be the one a
fresh matcher gives after the tokens delivered so far, token by token, with overlapped steps too.
"""
from __future__ import annotations

import functools
import json
import re

import anyio
import jsonschema
import pytest
import torch
import xgrammar

from asyncllm.layers.sampler import Sampler, SamplingTensors, apply_token_bitmask_
from asyncllm.llm import LLM
from asyncllm.sampling_params import SamplingParams
from asyncllm.structured import StructuredOutput
from helpers import assert_all_blocks_free

pytestmark = pytest.mark.timeout(300)

# bounded schemas: enums, bounded integers and booleans end within a few tokens even on random weights
SCHEMA = {"type": "object", "properties": {
    "color": {"enum": ["red", "green", "blue"]}, "n": {"type": "integer", "minimum": 0, "maximum": 9},
    "ok": {"type": "boolean"}, "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 2}},
    "required": ["color", "n", "ok"]}
REGEX = r"[a-c]{3}-[0-9]{2}"
CHOICES = ["yes", "no", "maybe so"]


@pytest.fixture(scope="module")
def llms(tiny_qwen3):
    made = {}

    def get(overlap: bool) -> LLM:
        if overlap not in made:
            made[overlap] = LLM(tiny_qwen3, overlap_scheduling=overlap, num_kvcache_blocks=64,
                                kvcache_block_size=16, max_num_batched_tokens=64)
        return made[overlap]
    return get


def constrained(spec: dict, **kw) -> SamplingParams:
    kw.setdefault("temperature", 0)
    kw.setdefault("max_tokens", 32)
    return SamplingParams(structured_output=spec, **kw)


def check_output(spec: dict, text: str) -> None:
    if "json" in spec:
        schema = spec["json"]
        jsonschema.validate(json.loads(text), json.loads(schema) if isinstance(schema, str) else schema)
    elif "regex" in spec:
        assert re.fullmatch(spec["regex"], text), text
    elif "choice" in spec:
        assert text in spec["choice"]
    elif "json_object" in spec:
        assert isinstance(json.loads(text), dict)


# specs whose every output is short: random weights end them within max_tokens
BOUNDED_SPECS = [{"json": SCHEMA}, {"json": json.dumps(SCHEMA)}, {"regex": REGEX}, {"choice": CHOICES},
                 {"grammar": 'root ::= "(" [0-9] [0-9]? ")" | "none"'}]
# any JSON object is unbounded (a key may go on and on): it may end by length
SPECS = BOUNDED_SPECS + [{"json_object": True}]


# ---- the spec and its validation ----------------------------------------------------------------
@pytest.mark.parametrize("kwargs, message", [
    ({}, "exactly one of"),
    ({"regex": "a", "choice": ["a"]}, "exactly one of"),
    ({"json": "{not json"}, "StructuredOutput.json: not valid JSON"),
    ({"json": [1]}, "StructuredOutput.json: expected a JSON schema"),
    ({"choice": []}, "StructuredOutput.choice"),
    ({"choice": ["a", 3]}, "StructuredOutput.choice"),
    ({"regex": 5}, "StructuredOutput.regex"),
    ({"json_object": "yes"}, "StructuredOutput.json_object"),
    # nested past MAX_SCHEMA_DEPTH (a copy of it would exhaust the stack), as an object and as JSON text
    ({"json": functools.reduce(lambda inner, _: {"items": [inner]}, range(70), {})}, "nested more than 128"),
    ({"json": '{"a":' * 5000 + "{}" + "}" * 5000}, "nested more than 128"),
])
def test_structured_output_is_validated_where_it_is_made(kwargs, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        StructuredOutput(**kwargs)


def test_sampling_params_takes_a_spec_or_its_fields_and_snapshots_it():
    assert SamplingParams(structured_output={"regex": "a+"}).structured_output == StructuredOutput(regex="a+")
    with pytest.raises(ValueError, match="SamplingParams.structured_output: .*unknown field"):
        SamplingParams(structured_output={"pattern": "a+"})
    with pytest.raises(ValueError, match="SamplingParams.structured_output: expected a StructuredOutput"):
        SamplingParams(structured_output="a+")
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    params = SamplingParams(structured_output=StructuredOutput(json=schema))
    snapshot = params.snapshot()
    schema["properties"]["a"]["type"] = "string"  # the caller's dict changes after submission
    assert snapshot.structured_output.json["properties"]["a"]["type"] == "integer"


@pytest.mark.parametrize("spec, message", [
    ({"json": {"type": "object", "properties": {"a": {"type": "no-such-type"}}}}, "invalid json"),
    ({"regex": "(unclosed"}, "invalid regex"),
    ({"grammar": "root ::= missing_rule"}, "invalid grammar"),
])
def test_an_invalid_schema_regex_or_grammar_is_refused_at_submission(llms, spec, message):
    llm = llms(False)
    with pytest.raises(ValueError, match=f"SamplingParams.structured_output: {message}"):
        llm.generate(["hi"], constrained(spec), use_tqdm=False)
    assert llm.core.requests == {} and not llm.core.has_unfinished()


# ---- the sampler's mask against xgrammar's own ------------------------------------------------------
def test_apply_token_bitmask_matches_xgrammar_reference():
    torch.manual_seed(0)
    vocab = 1000  # not a multiple of 32: the last word is partly past the vocabulary
    logits = torch.randn(5, vocab)
    bitmask = torch.randint(-2**31, 2**31 - 1, (5, (vocab + 31) // 32), dtype=torch.int32)
    reference = logits.clone()
    xgrammar.apply_token_bitmask_inplace(reference, bitmask)
    every_row = logits.clone()
    apply_token_bitmask_(every_row, torch.arange(5), bitmask)
    assert torch.equal(every_row, reference)
    some_rows = torch.cat([logits, logits])  # rows 1, 4, 6, 7 held to masks 0..3, the others left alone
    rows = torch.tensor([1, 4, 6, 7])
    apply_token_bitmask_(some_rows, rows, bitmask[:4])
    expected = torch.cat([logits, logits])
    expected[rows] = torch.where(reference[:4].isinf(), reference[:4], expected[rows])
    assert torch.equal(some_rows, expected)


def test_sampler_masks_only_the_constrained_rows_before_greedy_and_sampling():
    logits = torch.randn(3, 64)
    bitmask = torch.zeros(1, 2, dtype=torch.int32)
    bitmask[0, 1] = 1 << 5  # only token 37 allowed
    for temperature in (0.0, 1.0):
        params = SamplingTensors.build([SamplingParams(temperature=temperature)] * 3, 64, torch.device("cpu"),
                                       keys=[11, 12, 13])
        params.mask_rows, params.token_bitmask = torch.tensor([1]), bitmask
        tokens = Sampler()(logits, params).token_ids
        assert tokens[1] == 37
        if temperature == 0:
            assert tokens[0] == logits[0].argmax() and tokens[2] == logits[2].argmax()


def reference_bitmasks(llm: LLM, spec: StructuredOutput, token_ids: list[int]) -> list[torch.Tensor]:
    """xgrammar's bitmask before each of token_ids, from a fresh matcher fed the tokens before it."""
    matcher = xgrammar.GrammarMatcher(llm.core.grammar_compiler.compile(spec))
    masks = []
    for token in token_ids:
        mask = xgrammar.allocate_token_bitmask(1, llm.core.vocab_size)
        matcher.fill_next_token_bitmask(mask)
        masks.append(mask[0])
        assert matcher.accept_token(token)
    return masks


@pytest.mark.parametrize("overlap", [False, True])
def test_every_applied_bitmask_is_the_reference_matchers_token_by_token(llms, monkeypatch, overlap):
    llm = llms(overlap)
    applied: dict[int, list[torch.Tensor]] = {}  # arrival number -> bitmask rows applied, in step order
    sampler = llm.core.runner.sampler

    def recording_sampler(logits, params):
        if params.mask_rows is not None:
            rows = params.mask_rows.tolist()
            sampling = llm.core.runner.current_plan.sampling_ids  # each row's request (its arrival number)
            for i, row in enumerate(rows):
                applied.setdefault(sampling[row], []).append(params.token_bitmask[i].clone())
        return sampler.forward(logits, params)

    launch = llm.core.runner.launch

    def remembering_launch(plan, prev, **kwargs):
        launched = launch(plan, prev, **kwargs)
        sample = launched._sample  # a constrained step's sampling runs later: it must see its own plan
        if sample is not None:
            def sample_with_plan():
                llm.core.runner.current_plan = plan
                return sample()
            launched._sample = sample_with_plan
        else:
            llm.core.runner.current_plan = plan
        return launched
    monkeypatch.setattr(llm.core.runner, "launch", remembering_launch)
    monkeypatch.setattr(llm.core.runner, "sampler", recording_sampler)
    specs = [StructuredOutput(**s) for s in SPECS]
    params = [constrained(s, temperature=0.9, seed=i) for i, s in enumerate(specs)]
    params.append(SamplingParams(temperature=0, max_tokens=8))  # an unconstrained neighbour
    outputs = llm.generate(["one", "two two", "three", "four", "five", "six", "seven"], params, use_tqdm=False)
    monkeypatch.undo()
    arrivals = sorted(applied)  # submission order
    assert len(arrivals) == len(specs)  # the unconstrained request got no mask row
    for spec, out, arrival in zip(specs, outputs, arrivals):
        assert out["finish_reason"] in ("stop", "length")
        if out["finish_reason"] == "stop":
            check_output({spec.kind: getattr(spec, spec.kind)}, out["text"])
        reference = reference_bitmasks(llm, spec, out["token_ids"])
        # with overlap, one more row may follow: its token was dropped (the request had ended)
        masks = applied[arrival]
        assert len(masks) - len(reference) in ((0, 1) if overlap else (0,))
        for step, (mask, expected) in enumerate(zip(masks, reference)):
            assert torch.equal(mask, expected), f"{spec.kind}: step {step}"
    assert_all_blocks_free(llm)


# ---- outputs, finishing, and the requests around them ----------------------------------------------
def test_outputs_match_and_finish_with_stop_when_the_grammar_ends(llms):
    llm = llms(True)  # serial steps: test_every_applied_bitmask... and the equality test below
    for ignore_eos in (False, True):
        params = [constrained(s, ignore_eos=ignore_eos) for s in BOUNDED_SPECS]
        outputs = llm.generate(["a"] * len(BOUNDED_SPECS), params, use_tqdm=False)
        for spec, out in zip(BOUNDED_SPECS, outputs):
            check_output(spec, out["text"])
            assert out["finish_reason"] == "stop"
    assert_all_blocks_free(llm)


def test_overlapped_and_serial_constrained_outputs_are_equal(llms):
    params = [constrained(s, temperature=0.8, seed=7) for s in BOUNDED_SPECS]
    prompts = ["x y z", "hello", "q", "the quick brown fox", "1 2"]
    serial = [o["token_ids"] for o in llms(False).generate(prompts, params, use_tqdm=False)]
    overlapped = [o["token_ids"] for o in llms(True).generate(prompts, params, use_tqdm=False)]
    assert serial == overlapped


@pytest.mark.parametrize("overlap", [False, True])
def test_each_of_n_sequences_follows_the_grammar_on_its_own(llms, overlap):
    """n > 1 with a constraint: every sequence has its own matcher (one shared would advance once per
    sibling's token and derail the others), and the mask comes after the logits adjustments: a
    +100 logit_bias on every token cannot lift one the grammar forbids."""
    llm = llms(overlap)
    for spec in ({"regex": REGEX}, {"json": SCHEMA}):
        params = constrained(spec, temperature=1.0, seed=3, n=4, presence_penalty=0.5, max_tokens=96,
                             logit_bias={token: 100.0 for token in range(0, 2000, 7)})
        [outputs] = llm.generate(["pick one"], params, use_tqdm=False)
        assert [o["index"] for o in outputs] == [0, 1, 2, 3]
        for out in outputs:
            check_output(spec, out["text"])
            assert out["finish_reason"] == "stop"
        assert len({tuple(o["token_ids"]) for o in outputs}) > 1  # four draws, not one copied
    assert_all_blocks_free(llm)


def test_unconstrained_requests_are_unchanged_beside_constrained_ones(llms):
    llm = llms(True)
    plain = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    prompts = ["alpha beta", "gamma"]
    alone = [o["token_ids"] for o in llm.generate(prompts, plain, use_tqdm=False)]
    mixed = llm.generate(prompts + ["c", "d"], [plain, plain, constrained(SPECS[0]), constrained(SPECS[2])],
                         use_tqdm=False)
    assert [o["token_ids"] for o in mixed[:2]] == alone


def test_preemption_and_max_tokens_with_constraints(tiny_qwen3):
    llm = LLM(tiny_qwen3, overlap_scheduling=True, num_kvcache_blocks=6, kvcache_block_size=16,
              max_num_batched_tokens=32, max_num_seqs=4)
    prompts = [" ".join(["word"] * n) for n in (20, 25, 30, 12)]
    # Qwen's tokenizer has one token per digit: 60 digits cannot fit in 30 tokens
    params = [constrained({"regex": "[0-9]{60}"}, temperature=0.9, seed=i, max_tokens=30) for i in range(4)]
    outputs = llm.generate(prompts, params, use_tqdm=False)
    for out in outputs:
        assert out["finish_reason"] == "length"
        assert re.fullmatch("[0-9]{30}", out["text"])
    assert llm.core.scheduler.num_preemptions > 0
    assert_all_blocks_free(llm)


@pytest.mark.anyio
async def test_stream_with_a_stop_string_and_an_abort(tiny_qwen3):
    from asyncllm.async_engine import AsyncLLMEngine
    engine = AsyncLLMEngine(tiny_qwen3, overlap_scheduling=True, num_kvcache_blocks=32)
    await engine.start()
    try:
        stopped = await engine.generate("hi", SamplingParams(temperature=0, max_tokens=40, stop=["-"],
                                                             structured_output={"regex": REGEX}))
        assert stopped.finish_reason == "stop" and re.fullmatch("[a-c]{3}", stopped.text)
        stream = engine.stream("hi", SamplingParams(temperature=0.9, seed=3, max_tokens=40,
                                                   structured_output={"regex": "[0-9]{30}"}))
        async for _ in stream:
            break
        await stream.aclose()  # aborted after one delta
        out = await engine.generate("hi", constrained({"json": SCHEMA}))
        check_output({"json": SCHEMA}, out.text)
        with pytest.raises(ValueError, match="SamplingParams.structured_output: invalid regex"):
            engine.stream("hi", constrained({"regex": "(("}))
    finally:
        await engine.shutdown()
    assert_all_blocks_free(engine._core)


# ---- constraints that leave no token (issue 52) ------------------------------------------------------
@pytest.mark.parametrize("overlap", [False, True])
def test_a_grammar_refusing_every_token_the_other_constraints_leave_ends_the_request_without_it(llms, overlap):
    """allowed_token_ids disjoint from the grammar's tokens, or min_tokens past the grammar's end (it
    bans the stop tokens a complete output needs), leave every logit at -inf: the sampler's fallback,
    token 0 ('!'), was delivered. The request now ends with "abort" and nothing the grammar refused;
    its neighbour is untouched."""
    llm = llms(overlap)
    letter_a = llm.tokenizer.encode("a", add_special_tokens=False)
    plain = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    alone = llm.generate(["three"], plain, use_tqdm=False)[0]
    disjoint, too_short, neighbour = llm.generate(["one", "two", "three"], [
        constrained({"regex": "[0-9]+"}, allowed_token_ids=letter_a),
        constrained({"regex": "ab"}, min_tokens=5, max_tokens=8), plain], use_tqdm=False)
    assert disjoint["token_ids"] == [] and disjoint["finish_reason"] == "abort"
    assert too_short["text"] == "ab" and too_short["finish_reason"] == "abort"
    assert neighbour["token_ids"] == alone["token_ids"]
    assert_all_blocks_free(llm)


@pytest.mark.anyio
async def test_a_stream_whose_constraints_leave_no_token_raises_naming_them(tiny_qwen3):
    from asyncllm.async_engine import AsyncLLMEngine
    from asyncllm.errors import UnsatisfiableConstraintsError
    engine = AsyncLLMEngine(tiny_qwen3, overlap_scheduling=True, num_kvcache_blocks=32)
    await engine.start()
    try:
        with anyio.fail_after(240):
            letter_a = engine.tokenizer.encode("a", add_special_tokens=False)
            received = []
            with pytest.raises(UnsatisfiableConstraintsError, match="grammar and allowed_token_ids") as info:
                async for out in engine.stream("hi", constrained({"regex": "[0-9]+"}, allowed_token_ids=letter_a,
                                                                 n=2, temperature=1.0)):
                    received.append(out)
            assert received == []  # both sequences: no token at all, not even the fallback
            # the field it is about, for a caller that names fields its own way (the server)
            assert (info.value.owner, info.value.field) == ("SamplingParams", "structured_output")
            assert str(info.value).startswith("SamplingParams.structured_output: at output token 0 ")
            with pytest.raises(UnsatisfiableConstraintsError, match="min_tokens"):
                async for out in engine.stream("hi", constrained({"regex": "ab"}, min_tokens=5, max_tokens=8)):
                    received.append(out)
            assert "ab".startswith("".join(out.text for out in received))  # a reader may miss the last ones
            out = await engine.generate("hi", constrained({"json": SCHEMA}))  # the engine goes on
            check_output({"json": SCHEMA}, out.text)
            assert engine.stats()["num_running"] == 0
    finally:
        await engine.shutdown()
    assert_all_blocks_free(engine._core)
