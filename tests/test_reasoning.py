"""Reasoning apart from the answer (Config.reasoning_parser): the formats and where a prompt leaves
the output, the split of a token stream at every position (tags as single tokens, and tags spelled
in pieces), and the engines end to end on the tiny random model, made to think by logit biases
(helpers.forced: <think>, three words, </think>, one more word, then <think> again and again).
"""
from __future__ import annotations

import dataclasses
import json
import os

import anyio
import pytest
import torch
import xgrammar

from asyncllm import LLM, AsyncLLMEngine, Config, SamplingParams
from asyncllm.cli import build_parser
from asyncllm.config import REASONING_PARSERS
from asyncllm.engine.reasoning_format import (ANSWER, FORMATS, MAYBE_REASONING, REASONING, ReasoningGate,
                                              ReasoningTags)
from asyncllm.reasoning import text_assembler
from asyncllm.structured import StructuredOutput
from helpers import ANSWER_WORD, MESSAGES_SAY_HI as MESSAGES, THINKING, WORDS, assert_all_blocks_free, chat_prompt, \
    forced, token

pytestmark = pytest.mark.timeout(300)

TIMEOUT = 120
ENGINE_KW = dict(num_kvcache_blocks=64, kvcache_block_size=16, max_num_batched_tokens=64)


@pytest.fixture(scope="module")
def tokenizer(tiny_qwen3):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(tiny_qwen3)


def untagged_copy(checkpoint: str, out_dir: str) -> str:
    """The checkpoint with a tokenizer that has no <think> / </think> tokens: the tags are spelled in
    pieces ("</", "think", ">"), as in a vocabulary that lacks them."""
    os.makedirs(out_dir, exist_ok=True)
    for name in os.listdir(checkpoint):
        if name not in ("tokenizer.json", "tokenizer_config.json"):
            os.link(os.path.join(checkpoint, name), os.path.join(out_dir, name))  # the engine refuses symlinks out
    tags = ("<think>", "</think>")
    with open(os.path.join(checkpoint, "tokenizer.json")) as f:
        data = json.load(f)
    data["added_tokens"] = [t for t in data["added_tokens"] if t["content"] not in tags]
    with open(os.path.join(out_dir, "tokenizer.json"), "w") as f:
        json.dump(data, f, ensure_ascii=False)
    with open(os.path.join(checkpoint, "tokenizer_config.json")) as f:
        config = json.load(f)
    config["added_tokens_decoder"] = {i: t for i, t in config["added_tokens_decoder"].items()
                                      if t["content"] not in tags}
    with open(os.path.join(out_dir, "tokenizer_config.json"), "w") as f:
        json.dump(config, f, ensure_ascii=False)
    return out_dir


@pytest.fixture(scope="module")
def untagged_checkpoint(tiny_qwen3, tmp_path_factory):
    return untagged_copy(tiny_qwen3, str(tmp_path_factory.mktemp("untagged")))


@pytest.fixture(scope="module")
def untagged_tokenizer(untagged_checkpoint):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(untagged_checkpoint)


# ---- formats, and where a prompt leaves the output ------------------------------------------------
def test_every_configured_parser_has_a_format_and_config_checks_the_name(tiny_qwen3):
    assert set(FORMATS) == set(REASONING_PARSERS)
    assert Config(model=tiny_qwen3, reasoning_parser="qwen3").reasoning_parser == "qwen3"
    for bad in ("llama", "", 3):
        with pytest.raises(ValueError, match=r"Config\.reasoning_parser: must be None or one of"):
            Config(model=tiny_qwen3, reasoning_parser=bad)
    args = build_parser().parse_args(["serve", "m", "--reasoning-parser", "deepseek_r1"])
    assert args.reasoning_parser == "deepseek_r1"
    with pytest.raises(SystemExit):  # argparse's choices: exit code 2 and the names on stderr
        build_parser().parse_args(["serve", "m", "--reasoning-parser", "llama"])


def test_the_qwen3_tags_are_single_tokens_and_found_as_such(tokenizer, untagged_tokenizer):
    assert ReasoningTags(FORMATS["qwen3"], tokenizer).token_ids == (151667, 151668)
    assert ReasoningTags(FORMATS["qwen3"], untagged_tokenizer).token_ids is None  # found in the text


def test_the_end_of_the_prompt_says_where_the_output_starts(tokenizer):
    qwen3, r1 = (ReasoningTags(FORMATS[name], tokenizer) for name in ("qwen3", "deepseek_r1"))
    default, off = chat_prompt(tokenizer), chat_prompt(tokenizer, enable_thinking=False)
    opened = default + tokenizer.encode("<think>\n", add_special_tokens=False)
    assert (qwen3.phase(default), qwen3.phase(off), qwen3.phase(opened)) == (MAYBE_REASONING, ANSWER, REASONING)
    assert (r1.phase(default), r1.phase(off), r1.phase(opened)) == (REASONING, ANSWER, REASONING)
    # an earlier turn's reasoning block (kept by Qwen3's template after a tool call) says nothing of this one
    turns = [*MESSAGES, {"role": "assistant", "content": "", "reasoning_content": "R",
                         "tool_calls": [{"function": {"name": "f", "arguments": {}}}]},
             {"role": "tool", "content": "42"}]
    text = tokenizer.apply_chat_template(turns, tokenize=False, add_generation_prompt=True)
    assert "</think>" in text
    assert qwen3.phase(tokenizer.encode(text, add_special_tokens=False)) == MAYBE_REASONING


def test_the_grammar_gate_admits_the_answer_only():
    gate = ReasoningGate(1, 2, ReasoningGate.OPTIONAL)
    assert gate.optional_token == 1 and not gate.in_reasoning
    assert [gate.admits(t) for t in (1, 5, 1, 2, 5, 2)] == [False, False, False, False, True, True]
    gate = ReasoningGate(1, 2, ReasoningGate.OPTIONAL)
    assert gate.admits(5) and gate.admits(1) and gate.optional_token is None  # no block opened: all grammar
    gate = ReasoningGate(1, 2, ReasoningGate.CLOSED)
    assert gate.in_reasoning and not gate.admits(1) and not gate.admits(2) and gate.admits(1)


# ---- the split, at every position ----------------------------------------------------------------
# (parser, how the prompt ends, output, its reasoning, its answer). 🦜 is two tokens.
CASES = [
    ("qwen3", "", "<think>\nR 🦜 1.</think>\n\nA 🦜 2.", "\nR 🦜 1.", "\n\nA 🦜 2."),
    ("qwen3", "", "No block </think> here", "", "No block </think> here"),
    ("qwen3", "", "<think>\ncut short 🦜", "\ncut short 🦜", ""),
    ("qwen3", "<think>\n\n</think>\n\n", "<think>x</think>y", "", "<think>x</think>y"),
    ("qwen3", "<think>\n", "R 🦜</think>A<think>", "R 🦜", "A<think>"),
    ("qwen3", "<think>\n", "<think>R</think>A", "R", "A"),
    ("qwen3", "<think>\n", "</think>", "", ""),
    ("deepseek_r1", "<think>\n", "R</think>\n\nA", "R", "\n\nA"),
    ("deepseek_r1", "", "<thin>R</think>A", "<thin>R", "A"),  # it may leave its opening tag out
]


def split(tokenizer, tags: ReasoningTags, prompt: list[int], chunks: list[list[int]], params=None,
          incremental: bool = True) -> tuple[str, str, str]:
    """(reasoning taken piece by piece, the reasoning, the answer) of output tokens fed in chunks."""
    assembler = text_assembler(tokenizer, tags, prompt, params or SamplingParams(), incremental=incremental)
    splitter = assembler.detokenizer
    answer, taken = [], []
    for chunk in chunks:
        answer.append(assembler.add(chunk))
        taken.append(splitter.take())
    answer.append(assembler.finish())
    taken.append(splitter.take())
    return "".join(taken), splitter.text, "".join(answer)


def partitions(token_ids: list[int]):
    """All at once, one by one, and every cut in two."""
    yield [token_ids]
    yield [[t] for t in token_ids]
    for cut in range(1, len(token_ids)):
        yield [token_ids[:cut], token_ids[cut:]]


@pytest.mark.parametrize("tagged", [True, False], ids=["tag-tokens", "tags-in-pieces"])
@pytest.mark.parametrize("name,prompt_end,output,reasoning,answer", CASES)
def test_split_at_every_position_gives_the_whole_outputs_split(tokenizer, untagged_tokenizer, tagged, name,
                                                               prompt_end, output, reasoning, answer):
    tok = tokenizer if tagged else untagged_tokenizer
    tags = ReasoningTags(FORMATS[name], tok)
    assert (tags.token_ids is not None) == tagged
    prompt = chat_prompt(tok) + tok.encode(prompt_end, add_special_tokens=False)
    output_ids = tok.encode(output, add_special_tokens=False)
    if not tagged:
        assert 151667 not in output_ids and 151668 not in output_ids
    for chunks in partitions(output_ids):
        taken, whole, text = split(tok, tags, prompt, chunks)
        assert (taken, whole, text) == (reasoning, reasoning, answer), chunks
    assert split(tok, tags, prompt, [output_ids], incremental=False)[1:] == (reasoning, answer)


def test_with_tag_tokens_a_tag_spelled_in_pieces_is_text(tokenizer):
    tags = ReasoningTags(FORMATS["qwen3"], tokenizer)
    pieces = [token(tokenizer, "</"), token(tokenizer, "think"), token(tokenizer, ">")]
    output = [151667, *tokenizer.encode("R", add_special_tokens=False), *pieces, 151668, token(tokenizer, "A")]
    assert split(tokenizer, tags, chat_prompt(tokenizer), [output])[1:] == ("R</think>", "A")


@pytest.mark.parametrize("tagged", [True, False], ids=["tag-tokens", "tags-in-pieces"])
def test_stop_strings_apply_to_the_answer_only(tokenizer, untagged_tokenizer, tagged):
    tok = tokenizer if tagged else untagged_tokenizer
    tags = ReasoningTags(FORMATS["qwen3"], tok)
    output_ids = tok.encode("<think>stop here? no</think>the answer; stop. Not this", add_special_tokens=False)
    params = SamplingParams(stop=["stop"], include_stop_str_in_output=True)
    for chunks in partitions(output_ids):
        assembler = text_assembler(tok, tags, chat_prompt(tok), params)
        answer = "".join(assembler.add(chunk) for chunk in chunks) + assembler.finish()
        assert (assembler.detokenizer.text, answer, assembler.stop_string) == ("stop here? no", "the answer; stop",
                                                                               "stop"), chunks


# ---- the engines, made to think --------------------------------------------------------------------
@pytest.fixture(scope="module")
def thinking_llm(tiny_qwen3):
    llm = LLM(tiny_qwen3, reasoning_parser="qwen3", **ENGINE_KW)
    yield llm
    llm.close()


def forced_split(tokenizer, token_ids: list[int], start: int = 151667, end: int = 151668) -> tuple[str, str]:
    """The forced output's reasoning and answer, by its tokens: between the tags, and after the end tag."""
    assert token_ids[0] == start and end in token_ids
    cut = token_ids.index(end)
    return tokenizer.decode(token_ids[1:cut]), tokenizer.decode(token_ids[cut + 1:])


@pytest.mark.anyio
async def test_streamed_reasoning_and_answer_equal_the_whole_ones(tiny_qwen3, tokenizer, thinking_llm):
    prompt = chat_prompt(tokenizer)
    params = forced(tokenizer, THINKING)
    whole = thinking_llm.generate([prompt], params, use_tqdm=False)[0]
    reasoning, answer = forced_split(tokenizer, whole["token_ids"])
    assert (whole["reasoning"], whole["text"]) == (reasoning, answer) == ("".join(WORDS), ANSWER_WORD + "<think>" * 4)
    with anyio.fail_after(TIMEOUT):
        async with AsyncLLMEngine(tiny_qwen3, reasoning_parser="qwen3", **ENGINE_KW) as engine:
            items = [out async for out in engine.chat(MESSAGES, params)]
            assert [t for out in items for t in out.token_ids] == whole["token_ids"]
            assert ("".join(out.reasoning for out in items), "".join(out.text for out in items)) == (reasoning, answer)
            result = await engine.generate(prompt, params)
            assert (result.reasoning, result.text, result.token_ids) == (reasoning, answer, whole["token_ids"])
            late = engine.stream(prompt, params)  # read once the request has ended: one item, every token
            await engine.wait_idle()
            items = [out async for out in late]
            assert len(items) == 1 and (items[0].reasoning, items[0].text) == (reasoning, answer)
            n = await engine.generate(prompt, dataclasses.replace(params, n=2))
            assert [(r.reasoning, r.text) for r in n] == [(reasoning, answer)] * 2
        assert_all_blocks_free(engine._core)


def test_without_a_parser_the_text_holds_everything(tiny_qwen3, tokenizer):
    with LLM(tiny_qwen3, **ENGINE_KW) as llm:
        out = llm.generate([chat_prompt(tokenizer)], forced(tokenizer, THINKING), use_tqdm=False)[0]
    assert "reasoning" not in out and out["text"] == tokenizer.decode(out["token_ids"])
    assert out["text"].startswith("<think>" + "".join(WORDS) + "</think>")


def test_stop_strings_ignore_the_reasoning_and_max_tokens_counts_it(thinking_llm, tokenizer):
    prompt = chat_prompt(tokenizer)
    out = thinking_llm.generate([prompt], forced(tokenizer, THINKING, stop=[" banana", "<think>"]), use_tqdm=False)[0]
    assert (out["reasoning"], out["text"], out["finish_reason"], out["stop_reason"]) == \
        ("".join(WORDS), ANSWER_WORD, "stop", "<think>")
    out = thinking_llm.generate([prompt], forced(tokenizer, THINKING, max_tokens=3), use_tqdm=False)[0]
    assert (out["reasoning"], out["text"], out["finish_reason"]) == ("".join(WORDS[:2]), "", "length")


def test_structured_output_applies_after_the_reasoning(thinking_llm, tokenizer):
    choice = StructuredOutput(choice=["yes", "no"])
    prompt = chat_prompt(tokenizer)
    out = thinking_llm.generate([prompt], forced(tokenizer, THINKING, structured_output=choice), use_tqdm=False)[0]
    assert (out["reasoning"], out["finish_reason"]) == ("".join(WORDS), "stop") and out["text"] in choice.choice
    # thinking off in the template: the grammar holds the first token already (<think> is not allowed)
    off = chat_prompt(tokenizer, enable_thinking=False)
    out = thinking_llm.generate([off], forced(tokenizer, THINKING, structured_output=choice), use_tqdm=False)[0]
    assert out["reasoning"] == "" and out["text"] in choice.choice and 151667 not in out["token_ids"]
    assert_all_blocks_free(thinking_llm)


@pytest.mark.parametrize("overlap", [False, True], ids=["serial", "overlap"])
def test_every_applied_bitmask_frees_the_reasoning_then_follows_the_grammar(tiny_qwen3, tokenizer, monkeypatch,
                                                                             overlap):
    spec = StructuredOutput(regex="[a-z]{3}")
    with LLM(tiny_qwen3, reasoning_parser="qwen3", overlap_scheduling=overlap, **ENGINE_KW) as llm:
        applied = []
        sampler = llm.core.runner.sampler

        def recording_sampler(logits, params):
            if params.mask_rows is not None:
                applied.append(params.token_bitmask[0].clone())
            return sampler.forward(logits, params)
        monkeypatch.setattr(llm.core.runner, "sampler", recording_sampler)
        out = llm.generate([chat_prompt(tokenizer)], forced(tokenizer, THINKING, structured_output=spec),
                           use_tqdm=False)[0]
        monkeypatch.undo()
        tokens = out["token_ids"]
        end = tokens.index(151668)
        matcher = xgrammar.GrammarMatcher(llm.core.grammar_compiler.compile(spec))
        vocab_size = llm.core.vocab_size
    expected = []
    first = xgrammar.allocate_token_bitmask(1, vocab_size)
    matcher.fill_next_token_bitmask(first)
    first[0, 151667 // 32] |= 1 << (151667 % 32)  # the first token may open a block instead
    expected.append(first[0])
    expected += [torch.full_like(first[0], -1)] * end  # inside the block (up to </think>): every token
    for t in tokens[end + 1:]:
        mask = xgrammar.allocate_token_bitmask(1, vocab_size)
        matcher.fill_next_token_bitmask(mask)
        expected.append(mask[0])
        assert matcher.accept_token(t)
    assert len(applied) - len(expected) in ((0, 1) if overlap else (0,))  # overlap: a row whose token was dropped
    for step, (mask, reference) in enumerate(zip(applied, expected)):
        assert torch.equal(mask, reference), step
    assert out["text"].isalpha() and len(out["text"]) == 3


@pytest.mark.anyio
async def test_a_deepseek_r1_prompt_that_opens_the_block(tiny_qwen3, tokenizer):
    prompt = chat_prompt(tokenizer) + tokenizer.encode("<think>\n", add_special_tokens=False)
    params = forced(tokenizer, WORDS + ["</think>", ANSWER_WORD])
    with anyio.fail_after(TIMEOUT):
        async with AsyncLLMEngine(tiny_qwen3, reasoning_parser="deepseek_r1", **ENGINE_KW) as engine:
            items = [out async for out in engine.stream(prompt, params)]
    tokens = [t for out in items for t in out.token_ids]
    cut = tokens.index(151668)
    assert "".join(out.reasoning for out in items) == tokenizer.decode(tokens[:cut]) == "".join(WORDS)
    assert "".join(out.text for out in items) == tokenizer.decode(tokens[cut + 1:])


@pytest.mark.anyio
async def test_an_end_tag_in_pieces_straddling_tokens(untagged_checkpoint, untagged_tokenizer):
    tok = untagged_tokenizer
    pieces = ["</", "think", ">"]
    params = forced(tok, WORDS[:2] + pieces + [ANSWER_WORD])
    with anyio.fail_after(TIMEOUT):
        async with AsyncLLMEngine(untagged_checkpoint, reasoning_parser="deepseek_r1", **ENGINE_KW) as engine:
            items = [out async for out in engine.stream(chat_prompt(tok), params)]
            result = await engine.generate(chat_prompt(tok), params)
    tokens = [t for out in items for t in out.token_ids]
    cut = tokens.index(token(tok, "</"))
    assert tokens[cut:cut + 3] == [token(tok, piece) for piece in pieces]
    reasoning, answer = "".join(out.reasoning for out in items), "".join(out.text for out in items)
    assert (reasoning, answer) == (tok.decode(tokens[:cut]), tok.decode(tokens[cut + 3:]))
    assert reasoning == "".join(WORDS[:2]) and answer.startswith(ANSWER_WORD)
    assert (result.reasoning, result.text) == (reasoning, answer)
