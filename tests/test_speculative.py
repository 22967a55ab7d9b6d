"""Speculative decoding (Config.speculative_config, n-gram prompt lookup) on CPU, against the plain engine.

Greedy output must be the plain engine's token for token (the verification keeps the target's own
argmax at every position), in every path: prefix hits, chunked prefill, preemption, mixed batches,
stop tokens and strings inside an accepted run, max_tokens, streaming, cancellation. Sampled output
must follow the target's distribution exactly: chi-square tests of the rejection sampler alone and
of a run end to end.

The tiny random Qwen3's output never repeats itself, so its drafts are (almost) all rejected; a
"repeating" tiny checkpoint (tied embeddings, small vocabulary, its layers' outputs scaled up) runs
in long runs of one token, broken now and then, so n-gram drafts are mostly accepted and sometimes
rejected: each test on it asserts that drafts were accepted, so the acceptance path is exercised.
"""
from __future__ import annotations

import glob
import math
import os
import random

import anyio
import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from asyncllm.async_engine import AsyncLLMEngine
from asyncllm.config import Config
from asyncllm.engine.speculation import LOW_ACCEPTANCE, MAX_PAUSE_STEPS, MAX_SPECULATING_DECODES, PAUSE_STEPS
from asyncllm.errors import InvalidValueError
from asyncllm.layers.rejection_sampler import ROWS_PER_CHUNK, RejectionSampler, kept_rows, unseeded_chunks, verify_drafts
from asyncllm.layers.sampler import Sampler, SamplingTensors, noise_key
from asyncllm.llm import LLM
from asyncllm.sampling_params import SamplingParams
from asyncllm.speculative.ngram import NgramProposer, ngram_draft
from asyncllm.speculative.proposer import DraftRow
from asyncllm.testing import build_tiny_checkpoint
from helpers import ScriptedProposer, assert_all_blocks_free

pytestmark = pytest.mark.timeout(600)

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
ROOMY = dict(num_kvcache_blocks=96, kvcache_block_size=16)
# chunked prefill (a 24-token budget) and preemption (10 blocks of 16 for 6 requests of up to ~90 tokens)
SMALL = dict(num_kvcache_blocks=10, kvcache_block_size=16, max_num_batched_tokens=24, max_num_seqs=6)
VOCAB = 4096
GREEDY = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)


@pytest.fixture(scope="module")
def repeating_model(tmp_path_factory, tokenizer_dir) -> str:
    out = build_tiny_checkpoint(str(tmp_path_factory.mktemp("tiny-repeating")), "qwen3", tokenizer_dir,
                                tie_word_embeddings=True, vocab_size=VOCAB)
    # tied embeddings make "the same token again" the likeliest next token; scaled-up layers let
    # the context change it now and then
    for path in glob.glob(os.path.join(out, "*.safetensors")):
        weights = load_file(path)
        for name in weights:
            if name.endswith(("o_proj.weight", "down_proj.weight")):
                weights[name] = weights[name] * 5.0
        save_file(weights, path, metadata={"format": "pt"})
    return out


@pytest.fixture(scope="module")
def engines(repeating_model, tiny_qwen3):
    made = {}

    def get(model: str, shape: str, speculative: bool) -> LLM:
        key = (model, shape, speculative)
        if key not in made:
            path = repeating_model if model == "repeating" else tiny_qwen3
            made[key] = LLM(path, speculative_config=NGRAM if speculative else None,
                            **(SMALL if shape == "small" else ROOMY))
        return made[key]
    return get


def prompts(num: int, seed: int, vocab: int = VOCAB, lo: int = 8, hi: int = 50) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(10, vocab) for _ in range(rng.randrange(lo, hi))] for _ in range(num)]


def run(llm: LLM, prompt_list, params) -> list[dict]:
    outputs = llm.generate(prompt_list, params, use_tqdm=False)
    assert_all_blocks_free(llm)
    assert not llm.core.has_unfinished() and llm.core.requests == {}
    if llm.core.speculation is not None and isinstance(llm.core.speculation.proposer, NgramProposer):
        assert llm.core.speculation.proposer._tokens == {}  # every ended request's tokens dropped
    return outputs


def ids(outputs) -> list[list[int]]:
    return [out["token_ids"] for out in outputs]


def accepted(llm: LLM) -> int:
    return llm.core.stats()["spec_accepted_tokens"]


# ---- the proposer -----------------------------------------------------------------------------
def test_ngram_draft_takes_the_longest_suffix_match_and_its_most_recent_whole_continuation():
    tokens = np.array([1, 2, 3, 4, 5, 9, 9, 1, 2, 3, 4, 7, 8, 6, 1, 2, 3])
    # "1 2 3" (3 long) occurs at 0 and 7: the most recent is followed by 4 7 8
    assert ngram_draft(tokens, 3, 1, 3) == [4, 7, 8]
    assert ngram_draft(tokens, 3, 4, 4) == []  # no earlier match of "6 1 2 3"
    assert ngram_draft(tokens, 3, 1, 1) == [4, 7, 8]  # "3" alone: the same most recent match
    assert ngram_draft(np.array([5, 6, 7]), 3, 1, 3) == []
    # a run of one token: the most recent match is followed by one token only; the draft is whole
    assert ngram_draft(np.array([3, 8, 8, 8, 8, 8, 8, 8]), 4, 1, 3) == [8, 8, 8, 8]
    # max_tokens caps it; a short tail gives what there is
    assert ngram_draft(np.array([1, 2, 9, 1, 2]), 5, 1, 2) == [9, 1, 2]
    rows = [DraftRow([1, 2, 3, 1, 2], 2), DraftRow([4, 5], 2)]
    assert NgramProposer(1, 3).propose(rows) == [[3, 1], []]


def test_ngram_proposer_extends_each_requests_tokens_as_they_grow():
    proposer, rng = NgramProposer(1, 3), random.Random(0)
    tokens = [rng.randrange(6) for _ in range(5)]
    for _ in range(200):  # past several buffer growths
        tokens += [rng.randrange(6) for _ in range(rng.randrange(1, 4))]
        expected = ngram_draft(np.array(tokens), 3, 1, 3)
        assert proposer.propose([DraftRow(tokens, 3, "request")]) == [expected]
    assert proposer.propose([DraftRow(tokens[:4], 3, "request")]) == [ngram_draft(np.array(tokens[:4]), 3, 1, 3)]
    proposer.release("request")
    assert proposer._tokens == {}


# ---- greedy identity ----------------------------------------------------------------------------
@pytest.mark.parametrize("shape", ["roomy", "small"])
def test_greedy_tokens_equal_the_plain_engine(engines, shape):
    plain, spec = engines("repeating", shape, False), engines("repeating", shape, True)
    batch = prompts(6, seed=1)
    before = accepted(spec)
    for _ in range(2):  # the second round hits the prefix cache
        assert ids(run(spec, batch, GREEDY)) == ids(run(plain, batch, GREEDY))
    assert accepted(spec) > before  # drafts were accepted (and rejected: the outputs change tokens)
    if shape == "small":
        assert spec.core.scheduler.num_preemptions > 0  # the equality covered preemption and chunked prefill
    else:
        assert spec.core.block_manager.num_prefix_hit_tokens > 0


def test_greedy_tokens_equal_on_the_random_model_with_drafts_accepted_and_rejected(engines):
    """The tiny random Qwen3, whose output never repeats (n-gram lookup proposes nothing there), with
    a proposer plugged in that drafts its known output, now and then wrong."""
    plain, spec = engines("random", "roomy", False), engines("random", "roomy", True)
    batch = prompts(5, seed=2, vocab=100000)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    expected = ids(run(plain, batch, params))
    speculation = spec.core.speculation
    ngram, speculation.proposer = speculation.proposer, ScriptedProposer(zip(batch, expected))
    before = spec.core.stats()
    try:
        assert ids(run(spec, batch, params)) == expected
    finally:
        speculation.proposer = ngram
    after = spec.core.stats()
    drafts = after["spec_draft_tokens"] - before["spec_draft_tokens"]
    accepted_now = after["spec_accepted_tokens"] - before["spec_accepted_tokens"]
    assert 0 < accepted_now < drafts
    assert spec.core.num_steps - plain.core.num_steps < 24 // 2  # fewer steps than tokens


def test_kept_rows_are_those_before_a_requests_first_rejection():
    accepted = torch.tensor([True, False, True, False, True, True, False, False])
    first_rows = torch.tensor([0, 0, 0, 0, 4, 4, 4, 7])  # requests of 4, 3 and 1 rows
    assert kept_rows(accepted, first_rows).tolist() == [True, True, False, False, True, True, True, True]


def test_mixed_batch_opt_out_penalties_and_logprobs(engines):
    """Speculating rows beside a plain one (opted out) in one step; penalties as of each verified
    position (the drafts before it counted), biases and min_tokens' bans there too; log-probabilities
    of accepted tokens equal the plain engine's."""
    plain, spec = engines("repeating", "roomy", False), engines("repeating", "roomy", True)
    batch = prompts(6, seed=4)
    params = [SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, logprobs=3),
              SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, speculate=False),
              SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, repetition_penalty=1.3),
              SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, logit_bias={17: 2.0}, min_tokens=5),
              SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, frequency_penalty=0.05),
              SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, presence_penalty=0.5, bad_words=["a"])]
    before = accepted(spec)
    expected, got = run(plain, batch, params), run(spec, batch, params)
    assert ids(got) == ids(expected)
    assert accepted(spec) > before
    # penalties alone: their verified positions accepted drafts too
    before = accepted(spec)
    penalised = [SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, frequency_penalty=0.05,
                                presence_penalty=0.05, repetition_penalty=1.02)] * 2
    assert ids(run(spec, batch[:2], penalised)) == ids(run(plain, batch[:2], penalised))
    assert accepted(spec) > before
    lp_plain, lp_spec = expected[0]["logprobs"], got[0]["logprobs"]
    assert len(lp_spec) == len(lp_plain) == 30
    for a, b in zip(lp_plain, lp_spec):
        assert a.token_id == b.token_id and a.rank == b.rank
        assert math.isclose(a.logprob, b.logprob, rel_tol=1e-4, abs_tol=1e-4)


def test_penalty_counts_hold_exactly_the_kept_tokens(engines):
    """After every step, each penalised request's token counts (the runner's slot) are those of its
    output: a verified position's token is counted only where its request keeps it."""
    spec = engines("repeating", "roomy", True)
    core, before = spec.core, accepted(spec)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, frequency_penalty=0.05)
    seqs = [core.add_request(prompt, params) for prompt in prompts(3, seed=12)]
    counts = core.runner.sampling_inputs
    while core.has_unfinished():
        core.step()
        for seq in seqs:
            if not seq.is_finished and seq.uid in counts.table:
                held = counts.token_counts.output_counts[counts.table.entries[seq.uid].penalty_slot]
                assert torch.equal(held, torch.bincount(torch.tensor(seq.completion_token_ids), minlength=VOCAB)
                                   .to(held.dtype))
    assert accepted(spec) > before
    assert_all_blocks_free(core)


def test_structured_output_masks_each_verified_position(engines):
    """A grammar's mask at every verified position is the one after the drafts before it (the
    matcher fed them and rolled back): constrained outputs equal the plain engine's, with drafts
    accepted and rejected (the scripted proposer on the random Qwen3)."""
    plain, spec = engines("random", "roomy", False), engines("random", "roomy", True)
    specs = [{"regex": r"([a-d]{2} ){6}[0-9]{3}"},
             {"json": {"type": "object", "properties": {"a": {"enum": ["red", "green", "blue"]},
                                                         "b": {"type": "integer", "minimum": 0, "maximum": 99}},
                       "required": ["a", "b"]}},
             {"choice": ["the quick brown fox", "a lazy dog"]}]
    params = [SamplingParams(temperature=0, max_tokens=40, structured_output=s) for s in specs]
    batch = prompts(len(specs), seed=13, vocab=100000, lo=4, hi=10)
    expected = run(plain, batch, params)
    speculation = spec.core.speculation
    before = spec.core.stats()
    ngram, speculation.proposer = speculation.proposer, ScriptedProposer(zip(batch, ids(expected)))
    try:
        got = run(spec, batch, params)
    finally:
        speculation.proposer = ngram
    assert ids(got) == ids(expected) and [o["text"] for o in got] == [o["text"] for o in expected]
    assert all(out["finish_reason"] == "stop" for out in got)
    after = spec.core.stats()
    assert 0 < after["spec_accepted_tokens"] - before["spec_accepted_tokens"] < \
        after["spec_draft_tokens"] - before["spec_draft_tokens"]


# ---- ends inside an accepted run ----------------------------------------------------------------
def test_stop_tokens_stop_strings_and_max_tokens_cut_exactly_there(engines):
    plain, spec = engines("repeating", "roomy", False), engines("repeating", "roomy", True)
    batch = prompts(4, seed=5)
    reference = ids(run(plain, batch, GREEDY))
    tokenizer = plain.tokenizer
    before = accepted(spec)
    for out, prompt in zip(reference, batch):
        # a stop token and a stop string met well inside a run of accepted drafts
        text = tokenizer.decode(out)
        stop_token = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, stop_token_ids=[out[17]])
        stop_string = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True,
                                     stop=[text[len(text) // 2:len(text) // 2 + 3]])
        for params in (stop_token, stop_string):
            expected, got = run(plain, [prompt], params)[0], run(spec, [prompt], params)[0]
            assert got["token_ids"] == expected["token_ids"] and got["text"] == expected["text"]
            assert got["finish_reason"] == expected["finish_reason"] == "stop"
            assert len(got["token_ids"]) < 40, (params, got)
        for max_tokens in (1, 2, 3, 5, 7, 9):  # every length, wherever a step's accepted run ends
            params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
            got = run(spec, [prompt], params)[0]
            assert got["token_ids"] == out[:max_tokens] and got["finish_reason"] == "length"
    assert accepted(spec) > before


# ---- streaming and cancellation -----------------------------------------------------------------
@pytest.mark.anyio
@pytest.mark.parametrize("overlap", [False, True], ids=["serial", "overlap"])
async def test_stream_delivers_every_accepted_token_as_generate_does(engines, repeating_model, overlap):
    plain = engines("repeating", "roomy", False)
    batch = prompts(3, seed=6)
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True, stop=[plain.tokenizer.decode([4000])])
    expected = run(plain, batch, params)
    streamed = []
    with anyio.fail_after(120):
        async with AsyncLLMEngine(repeating_model, speculative_config=NGRAM, overlap_scheduling=overlap,
                                  **ROOMY) as engine:
            for prompt, reference in zip(batch, expected):
                items = [out async for out in engine.stream(prompt, params)]
                streamed += items
                assert "".join(item.text for item in items) == reference["text"]
                assert [t for item in items for t in item.token_ids] == reference["token_ids"]
                assert items[-1].finish_reason == reference["finish_reason"]
            assert any(len(item.token_ids) > 1 for item in streamed)  # several tokens in one step
            await engine.wait_idle()
            stats = engine.stats()
            assert stats["spec_accepted_tokens"] > 0
            assert stats["num_free_blocks"] == stats["num_total_blocks"]


def test_cancellation_mid_run_frees_every_block(engines):
    spec = engines("repeating", "small", True)
    core = spec.core
    before = accepted(spec)
    params = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)
    request_ids = [core.add_request(prompt, params).request_id for prompt in prompts(4, seed=7)]
    core.add_request(prompts(1, seed=8)[0], SamplingParams(temperature=0, max_tokens=60, ignore_eos=True, n=2))
    for _ in range(12):
        core.step()
    assert accepted(spec) > before  # it was speculating when cancelled
    # cancelled mid-verification: a speculating step launched, not yet resolved
    while core._launched is None or core._launched.plan.draft_token_ids is None:
        core.resolve_step()
        core.launch_step()
    for request_id in list(core.requests):
        core.finish_request(request_id)
    assert core.resolve_step() == []  # the verified tokens of ended requests are dropped, never delivered
    core.drain()
    assert not core.has_unfinished() and core.requests == {}
    assert_all_blocks_free(core)
    assert core.speculation.proposer._tokens == {}
    assert request_ids


def test_a_steps_logits_rows_stay_within_max_num_seqs(repeating_model, engines, monkeypatch):
    """The sampler's memory is sized for max_num_seqs rows: drafts are cut to keep a step's logits
    rows (sampling rows + drafts) within it."""
    llm = LLM(repeating_model, speculative_config=NGRAM, max_num_seqs=3, **ROOMY)
    rows, launch = [], llm.core.runner.launch

    def recording_launch(plan, *args, **kwargs):
        rows.append(len(plan.logits_indices))
        return launch(plan, *args, **kwargs)
    monkeypatch.setattr(llm.core.runner, "launch", recording_launch)
    proposer, proposed = llm.core.speculation.proposer, []

    def recording_propose(draft_rows):
        drafts = type(proposer).propose(proposer, draft_rows)
        proposed.append(sum(len(d or ()) for d in drafts))
        return drafts
    monkeypatch.setattr(proposer, "propose", recording_propose)
    batch = prompts(2, seed=14)
    assert ids(run(llm, batch, GREEDY)) == ids(run(engines("repeating", "roomy", False), batch, GREEDY))
    assert max(rows) == 3 and accepted(llm) > 0  # drafts, cut to one beside a second row
    # only drafts that fit are proposed (a draft model's forwards are not spent on drafts then cut)
    assert sum(proposed) == llm.core.stats()["spec_draft_tokens"], proposed


class StepRecordingProposer:
    """Drafts of a script (script(call number, row) gives a row's drafts), recording the engine step
    and draft count of each row it is asked for; drafts_cost_forwards: as a draft model's (a request's
    first speculation a probe), or as n-gram's."""

    def __init__(self, core, script, drafts_cost_forwards: bool):
        self.core, self.script, self.asked = core, script, []
        self.drafts_cost_forwards = drafts_cost_forwards

    def propose(self, rows):
        drafts = []
        for row in rows:
            drafts.append(self.script(len(self.asked), row))
            self.asked.append((self.core.num_steps, row.max_tokens))
        return drafts

    def release(self, request):
        pass


def wrong_drafts(call, row):
    return [0] * row.max_tokens  # token 0: never this model's greedy choice


def run_scripted(llm: LLM, script, prompt_list, params, drafts_cost_forwards: bool = True
                 ) -> tuple[list[dict], list[tuple[int, int]]]:
    speculation = llm.core.speculation
    proposer = StepRecordingProposer(llm.core, script, drafts_cost_forwards)
    ngram, speculation.proposer = speculation.proposer, proposer
    try:
        return run(llm, prompt_list, params), proposer.asked
    finally:
        speculation.proposer = ngram


def gaps(asked) -> list[int]:
    return [b[0] - a[0] for a, b in zip(asked, asked[1:])]


def test_speculation_is_off_for_large_batches_and_backs_off_where_drafts_fail(engines):
    spec = engines("random", "roomy", True)
    batch = prompts(MAX_SPECULATING_DECODES + 1, seed=9, vocab=100000, lo=4, hi=6)
    drafted = spec.core.stats()["spec_draft_tokens"]
    run(spec, [p * 3 for p in batch], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    assert spec.core.stats()["spec_draft_tokens"] == drafted  # too many decoding rows: none speculated
    # drafts that are always rejected: the first speculation is a one-draft probe, which pauses it for
    # PAUSE_STEPS; each retry is a one-draft probe too, and each failed probe doubles the pause, up to MAX_PAUSE_STEPS
    num_steps = 1 + PAUSE_STEPS + 64 + 128 + 2 * MAX_PAUSE_STEPS + 20  # (greedy identity: the next test)
    before = spec.core.stats()
    _, asked = run_scripted(spec, wrong_drafts, prompts(1, seed=10, vocab=100000),
                            SamplingParams(temperature=0, max_tokens=num_steps, ignore_eos=True))
    assert [k for _, k in asked] == [math.ceil(4 * LOW_ACCEPTANCE)] * 6 == [1] * 6, asked
    # the probe comes at the step after the failed one's pause
    assert gaps(asked) == [pause + 1 for pause in (PAUSE_STEPS, 64, 128, MAX_PAUSE_STEPS, MAX_PAUSE_STEPS)], asked
    assert MAX_PAUSE_STEPS == 256
    # the cost model's bound: log2(MAX_PAUSE_STEPS / PAUSE_STEPS) + 1 probes to the cap, one per
    # MAX_PAUSE_STEPS + 1 steps after: 6 of num_steps (757) speculated, 0.8 % (the plain backoff
    # without doubling: 1 of every 33 steps, 3 %)
    assert len(asked) <= 1 + 3 + math.ceil((num_steps - 1 - PAUSE_STEPS - 64 - 128) / (MAX_PAUSE_STEPS + 1))
    assert len(asked) / num_steps < 0.009
    stats = spec.core.stats()
    verifications = stats["spec_verifications"] - before["spec_verifications"]
    assert verifications == len(asked)
    assert 0 < stats["spec_speculating_share"] < 1


def test_a_draft_that_never_pays_costs_one_probe_then_log_many(engines):
    """A request's first speculation is a probe: one draft at k = 4, so a draft that is never accepted
    (a random draft model: issue 46) speculates at its first decode step with 1 draft, then pauses, and
    in at most ceil(log2(n / PAUSE_STEPS)) + 1 of its first n steps."""
    spec = engines("random", "roomy", True)
    num_steps = MAX_PAUSE_STEPS + PAUSE_STEPS
    first_step = spec.core.num_steps + 1  # its prefill is step num_steps, its first decode the next
    _, asked = run_scripted(spec, wrong_drafts, prompts(1, seed=15, vocab=100000),
                            SamplingParams(temperature=0, max_tokens=num_steps, ignore_eos=True))
    assert asked[0] == (first_step, 1), asked
    steps = [step - first_step for step, _ in asked]
    for n in range(1, num_steps):
        bound = math.ceil(math.log2(max(n, PAUSE_STEPS) / PAUSE_STEPS)) + 1
        assert sum(step < n for step in steps) <= bound, (n, asked)
    assert len(asked) == 4, asked  # the bound is met: probes at 0, 33, 98 and 227


def test_a_new_request_starts_where_the_engines_failed_probes_left_the_backoff(engines):
    """A draft model that failed every probe since it last paid, in any request, costs a new request no
    probe (and its prompt's catch-up) at its first decode step: it waits the pause the latest failed
    probe set, then probes (a failure doubles it). Any step that pays starts the engine's backoff over:
    the next request probes at once. The engine's backoff ends with the proposer it judged."""
    llm = engines("random", "roomy", True)
    speculation = llm.core.speculation
    paying_prompt = prompts(1, seed=16, vocab=100000)[0]
    plain = ids(run(engines("random", "roomy", False), [paying_prompt],
                    SamplingParams(temperature=0, max_tokens=PAUSE_STEPS + 80, ignore_eos=True)))[0]
    full = paying_prompt + plain

    def script(call, row):  # right drafts for paying_prompt's request, wrong for the others
        if row.token_ids[:len(paying_prompt)] == paying_prompt:
            return full[len(row.token_ids):len(row.token_ids) + row.max_tokens]
        return wrong_drafts(call, row)
    proposer = StepRecordingProposer(llm.core, script, drafts_cost_forwards=True)
    ngram, speculation.proposer = speculation.proposer, proposer
    assert speculation.engine_pause == 0
    try:
        def first_asks(prompt, max_tokens):
            first_step, start = llm.core.num_steps + 1, len(proposer.asked)
            out = run(llm, [prompt], SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))
            return [step - first_step for step, _ in proposer.asked[start:]], ids(out)[0]
        # a fresh engine: the first request probes at its first decode step; its failure pauses it
        assert first_asks(prompts(1, seed=17, vocab=100000)[0], 10)[0] == [0]
        assert speculation.engine_pause == PAUSE_STEPS
        # the next request waits that pause first; its failed probe doubles it, for the engine too
        assert first_asks(prompts(1, seed=18, vocab=100000)[0], PAUSE_STEPS + 10)[0] == [PAUSE_STEPS]
        assert speculation.engine_pause == 2 * PAUSE_STEPS
        # a request whose drafts pay (after the engine's pause): every step speculates, same tokens
        asks, out = first_asks(paying_prompt, PAUSE_STEPS + 80)
        assert asks[:3] == [2 * PAUSE_STEPS, 2 * PAUSE_STEPS + 1, 2 * PAUSE_STEPS + 2] and out == plain
        assert speculation.engine_pause == 0
        assert first_asks(prompts(1, seed=19, vocab=100000)[0], 10)[0] == [0]  # probes at once again
        speculation.proposer = ngram
        assert speculation.engine_pause == 0  # the n-gram lookup is judged afresh
    finally:
        speculation.proposer = ngram


def test_a_request_whose_drafts_pay_again_resumes_and_its_backoff_starts_over(engines):
    prompt = prompts(1, seed=11, vocab=100000)
    plain = ids(run(engines("random", "roomy", False), prompt,
                    SamplingParams(temperature=0, max_tokens=300, ignore_eos=True)))[0]
    full = prompt[0] + plain

    def script(call, row):  # wrong twice (the first speculation's probe, the first retry), right 6 times, then wrong for good
        if 2 <= call < 8:
            return full[len(row.token_ids):len(row.token_ids) + row.max_tokens]
        return wrong_drafts(call, row)
    out, asked = run_scripted(engines("random", "roomy", True), script, prompt,
                              SamplingParams(temperature=0, max_tokens=300, ignore_eos=True))
    assert ids(out)[0] == plain
    # the third probe (after a pause of 64) is right: it speculates at every step, more drafts as its
    # acceptance climbs; two wrong steps (4 drafts, then 2) then pause it for PAUSE_STEPS again, not 128
    assert gaps(asked)[:9] == [PAUSE_STEPS + 1, 64 + 1, 1, 1, 1, 1, 1, 1, 1], asked
    assert [k for _, k in asked][:10] == [1, 1, 1, 3, 4, 4, 4, 4, 4, 2], asked
    assert gaps(asked)[9] == PAUSE_STEPS + 1, asked



def test_a_lookup_that_finds_nothing_waits_longer_each_time_and_keeps_the_acceptance(engines):
    """No proposal (no n-gram match) is no verification: the request looks again after 1, 2, 4, ... up
    to PAUSE_STEPS steps; once a lookup proposes, the next miss waits 1 step again, and its first
    drafts are k (an n-gram lookup's first speculation is no probe, and the misses did not lower the
    acceptance)."""
    prompt = prompts(1, seed=12, vocab=100000)
    plain = ids(run(engines("random", "roomy", False), prompt,
                    SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)))[0]
    full = prompt[0] + plain

    def script(call, row):  # nothing 7 times, then the right drafts once, then nothing for good
        return full[len(row.token_ids):len(row.token_ids) + row.max_tokens] if call == 7 else []
    out, asked = run_scripted(engines("random", "roomy", True), script, prompt,
                              SamplingParams(temperature=0, max_tokens=200, ignore_eos=True), drafts_cost_forwards=False)
    assert ids(out)[0] == plain
    assert gaps(asked)[:6] == [1, 2, 4, 8, 16, PAUSE_STEPS], asked
    assert [k for _, k in asked][7] == 4, asked  # k: seven misses did not scale it down
    # the pause stays at PAUSE_STEPS; after the lookup that proposed, the misses' backoff starts over
    assert gaps(asked)[6:10] == [PAUSE_STEPS, 1, 1, 2], asked

# ---- sampled output: the target's distribution exactly --------------------------------------------
def chi_square_p_value(counts: np.ndarray, probs: np.ndarray) -> float:
    """Pearson's test of observed counts against probabilities (bins with expected counts < 5 merged)."""
    expected = probs * counts.sum()
    order = np.argsort(expected)
    counts, expected = counts[order], expected[order]
    small = np.cumsum(expected) < 5 * 2  # the least likely bins, pooled into one
    pooled_counts = np.concatenate([[counts[small].sum()], counts[~small]]) if small.any() else counts
    pooled_expected = np.concatenate([[expected[small].sum()], expected[~small]]) if small.any() else expected
    keep = pooled_expected > 0
    statistic = float((((pooled_counts - pooled_expected) ** 2)[keep] / pooled_expected[keep]).sum())
    dof = int(keep.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64),
                                         torch.tensor(statistic / 2, dtype=torch.float64)))


@pytest.mark.parametrize("draft", [0, 3, 5, -1], ids=["likely-draft", "unlikely-draft", "impossible-draft", "none"])
def test_rejection_sampling_keeps_the_target_distribution(draft):
    """verify_drafts over many independent draws: the tokens follow p whatever the draft."""
    probs = torch.tensor([0.45, 0.2, 0.15, 0.1, 0.1, 0.0], dtype=torch.float64)
    counts, num_accepted, num = np.zeros(len(probs), dtype=np.int64), 0, 2000
    for seed in range(20):  # 20 seeds' draws, pooled into one test
        generator = torch.Generator().manual_seed(seed)
        p = probs.float().expand(num, -1).contiguous()
        uniforms = torch.rand(num, generator=generator)
        exponentials = torch.empty_like(p).exponential_(generator=generator)
        tokens, accepted_mask = verify_drafts(p, torch.full((num,), draft), uniforms, exponentials)
        counts += np.bincount(tokens.numpy(), minlength=len(probs))
        num_accepted += int(accepted_mask.sum())
        assert torch.equal(accepted_mask, tokens == draft) if draft >= 0 else not accepted_mask.any()
    assert counts[5] == 0
    assert chi_square_p_value(counts, probs.numpy()) > 0.01, counts
    if draft >= 0:  # a draft x is accepted with probability p(x)
        assert math.isclose(num_accepted / (20 * num), probs[draft].item(), abs_tol=0.01)


def test_rejection_sampler_applies_temperature_and_top_k_to_unseeded_rows():
    """The sampler's p is the request's: temperature and top-k over the logits; unseeded rows draw
    from the sampler's generator (the same generator seed: the same tokens)."""
    logits = torch.tensor([2.0, 1.5, 1.0, 0.5, 0.0, -1.0])
    temperature, top_k = 0.8, 4
    target = torch.zeros(6, dtype=torch.float64)
    target[:top_k] = (logits[:top_k].double() / temperature).softmax(0)
    num, counts = 500, np.zeros(6, dtype=np.int64)
    params = SamplingTensors.build([SamplingParams(temperature=temperature, top_k=top_k)] * num, 6,
                                   torch.device("cpu"), keys=[0] * num)
    for seed in range(20):  # 20 generator seeds' draws of num rows (a row: one position), pooled
        drafts = torch.full((num,), seed % 6)
        alone = torch.arange(num)  # each row a request of its own
        out = RejectionSampler(torch.Generator().manual_seed(seed))(logits.expand(num, -1), params, drafts, alone)
        counts += np.bincount(out.token_ids.numpy(), minlength=6)
        again = RejectionSampler(torch.Generator().manual_seed(seed))(logits.expand(num, -1), params, drafts, alone)
        assert torch.equal(again.token_ids, out.token_ids)
    assert counts[top_k:].sum() == 0
    assert chi_square_p_value(counts, target.numpy()) > 0.01, counts


def test_seeded_rows_verify_by_exact_match_against_the_plain_keyed_draw():
    """A seeded row's token is the plain sampler's draw with its key (whatever the generator, the
    draft or the rows around it), it accepts its draft iff the draft is that token, and its tokens
    follow p; unseeded rows around seeded runs are rejection-sampled (unseeded_chunks' runs)."""
    logits = torch.tensor([2.0, 1.5, 1.0, 0.5, 0.0, -1.0])
    temperature, top_k = 0.8, 4
    target = torch.zeros(6, dtype=torch.float64)
    target[:top_k] = (logits[:top_k].double() / temperature).softmax(0)
    num = 2 * ROWS_PER_CHUNK + 9
    seeded = [row for row in range(num) if row % 5 in (1, 2) or row == num - 1]
    settings = [SamplingParams(temperature=temperature, top_k=top_k)] * num
    counts = np.zeros(6, dtype=np.int64)
    for seed in range(60):
        keys = [noise_key(seed, row) if row in seeded else 7 for row in range(num)]
        params = SamplingTensors.build(settings, 6, torch.device("cpu"), keys=keys,
                                       seeded_rows=[(row, keys[row]) for row in seeded])
        alone_params = SamplingTensors.build([settings[0]] * len(seeded), 6, torch.device("cpu"),
                                             keys=[keys[row] for row in seeded],
                                             seeded_rows=[(n, keys[row]) for n, row in enumerate(seeded)])
        plain = Sampler(torch.Generator().manual_seed(0)).draw(logits.expand(len(seeded), -1), alone_params)
        drafts = torch.randint(-1, 6, (num,), generator=torch.Generator().manual_seed(seed))
        first_rows = torch.arange(num)
        out = RejectionSampler(torch.Generator().manual_seed(seed))(logits.expand(num, -1), params, drafts, first_rows)
        assert torch.equal(out.token_ids[seeded], plain)
        assert torch.equal(out.accepted[seeded], drafts[seeded] == plain)
        counts += np.bincount(plain.numpy(), minlength=6)
        other = RejectionSampler(torch.Generator().manual_seed(seed + 100))(
            logits.expand(num, -1), params, torch.randint(0, 6, (num,)), first_rows)
        assert torch.equal(other.token_ids[seeded], plain)
        unseeded = [row for row in range(num) if row not in seeded]
        assert (out.token_ids[unseeded] < top_k).all()
        unseeded_drafts, unseeded_accepted = drafts[unseeded], out.accepted[unseeded]
        # an unseeded row's accepted draft is its token (rejection sampling; no draft: none accepted)
        assert not unseeded_accepted[unseeded_drafts < 0].any()
        assert torch.equal(out.token_ids[unseeded][unseeded_accepted], unseeded_drafts[unseeded_accepted])
    assert counts[top_k:].sum() == 0
    assert chi_square_p_value(counts, target.numpy()) > 0.01, counts


def test_unseeded_chunks_cover_the_unseeded_rows_in_runs_of_at_most_a_chunk():
    for num, seeded in ((0, set()), (40, set()), (40, {0, 5, 6, 39}), (5, {0, 1, 2, 3, 4}), (37, {20})):
        chunks = unseeded_chunks(num, seeded)
        rows = [row for chunk in chunks for row in range(chunk.start, chunk.stop)]
        assert rows == [row for row in range(num) if row not in seeded]
        assert all(0 < chunk.stop - chunk.start <= ROWS_PER_CHUNK for chunk in chunks)


def test_sampled_tokens_end_to_end_follow_the_target_distribution(engines):
    """At temperature 1, the second token given the first, over many unseeded requests (rejection
    sampling: a seeded request verifies by exact match, tested below): its step verified an n-gram
    draft, and its frequencies match the target's probabilities (the plain engine's)."""
    plain, spec = engines("repeating", "roomy", False), engines("repeating", "roomy", True)
    # a prompt ending in a run of the token the model itself takes next, which it then tends to repeat
    base = [1234] * 6
    prompt = base + run(plain, [base], SamplingParams(temperature=0, max_tokens=1))[0]["token_ids"] * 4
    # the plain engine's distribution of the second token after the likeliest first one
    first = run(plain, [prompt], SamplingParams(temperature=0, max_tokens=1))[0]["token_ids"][0]
    scored = run(plain, [prompt + [first]], SamplingParams(temperature=0, max_tokens=1, logprobs=20))[0]
    top = scored["logprobs"][0]
    top_ids = [int(t) for t in top.top_ids]
    top_probs = np.exp(np.asarray(top.top_logprobs, dtype=np.float64))
    drafted, kept = spec.core.stats()["spec_draft_tokens"], accepted(spec)
    second = []
    for start in range(0, 1200, MAX_SPECULATING_DECODES):
        params = [SamplingParams(temperature=1.0, max_tokens=3, ignore_eos=True)] * MAX_SPECULATING_DECODES
        second += [out["token_ids"][1] for out in run(spec, [prompt] * len(params), params)
                   if out["token_ids"][0] == first]
    # the second tokens' steps verified drafts, accepting some and rejecting some
    assert 0 < accepted(spec) - kept < spec.core.stats()["spec_draft_tokens"] - drafted
    assert len(second) > 300
    counts = np.array([second.count(t) for t in top_ids] + [sum(t not in top_ids for t in second)])
    probs = np.concatenate([top_probs, [max(0.0, 1 - top_probs.sum())]])
    assert chi_square_p_value(counts, probs / probs.sum()) > 0.01, (counts, probs)


# sampling settings of seeded requests: several temperatures, top-k / top-p / min-p, penalties
SEEDED = [dict(temperature=1.0), dict(temperature=0.7, top_k=5), dict(temperature=1.3, top_p=0.9),
          dict(temperature=0.9, min_p=0.05, repetition_penalty=1.2), dict(temperature=1.0, presence_penalty=0.5,
                                                                          frequency_penalty=0.3), dict(temperature=0)]


def seeded_params(max_tokens: int) -> list[SamplingParams]:
    return [SamplingParams(**settings, seed=100 + i, max_tokens=max_tokens, ignore_eos=True)
            for i, settings in enumerate(SEEDED)]


def test_seeded_sampled_output_is_the_plain_engines_whatever_the_schedule(engines):
    """A seeded request verifies by exact match against the plain sampler's keyed draw: its output
    is the plain engine's token for token, alone or in a batch, with or without prefix-cache hits,
    with chunked prefill and preemption (the small engine), whichever positions speculated."""
    plain = engines("repeating", "roomy", False)
    base = [1234] * 6
    batch = [base + p for p in prompts(len(SEEDED), seed=21, lo=4, hi=20)]
    params = seeded_params(40)
    expected = ids(run(plain, batch, params))
    for shape in ("roomy", "small"):
        spec = engines("repeating", shape, True)
        before, kept = spec.core.stats()["spec_draft_tokens"], accepted(spec)
        assert ids(run(spec, batch, params)) == expected
        assert ids(run(spec, batch, params)) == expected  # the prompts' prefixes now cached
        spec.core.block_manager.reset_prefix_cache()
        assert ids(run(spec, batch[::-1], params[::-1])) == expected[::-1]  # another order, nothing cached
        assert [ids(run(spec, [prompt], settings))[0] for prompt, settings in zip(batch, params)] == expected
        # drafts were verified, some accepted and some rejected
        assert 0 < accepted(spec) - kept < spec.core.stats()["spec_draft_tokens"] - before


# ---- settings -----------------------------------------------------------------------------------
@pytest.mark.parametrize("value, field, words", [
    ("ngram", "speculative_config", "expected None or a dict"),
    ({"method": "ngram"}, "speculative_config.num_speculative_tokens", "expected an int in [1, 16]"),
    ({"method": "ngram", "num_speculative_tokens": 0}, "speculative_config.num_speculative_tokens", "got 0"),
    ({"method": "ngram", "num_speculative_tokens": True}, "speculative_config.num_speculative_tokens", "got True"),
    ({"method": "lookup", "num_speculative_tokens": 2}, "speculative_config.method", "must be one of"),
    ({"num_speculative_tokens": 2}, "speculative_config.method", "missing"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2},
     "speculative_config.prompt_lookup_min", "must be <= prompt_lookup_max (2)"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 0}, "speculative_config.prompt_lookup_max",
     "expected None or an int in [1, 64]"),
    ({"method": "ngram", "num_speculative_tokens": 2, "draft_tokens": 3}, "speculative_config.draft_tokens",
     "unknown key"),
    ({"model": "/models/qwen3-0.6b", "num_speculative_tokens": 4}, "speculative_config.model", "does not exist"),
    ({"method": "eagle", "num_speculative_tokens": 4}, "speculative_config.method", "EAGLE heads: not yet"),
    ({"method": "ngram", "num_speculative_tokens": 2, "model": "x"}, "speculative_config.model", "is for method"),
])
def test_bad_speculative_config_values_are_refused_naming_the_key(tiny_qwen3, value, field, words):
    with pytest.raises(InvalidValueError) as caught:
        Config(tiny_qwen3, speculative_config=value)
    assert caught.value.field == field and words in str(caught.value)
    assert str(caught.value).startswith(f"Config.{field}: ")


def test_speculative_config_defaults_are_vllms(tiny_qwen3):
    spec = Config(tiny_qwen3, speculative_config={"method": "ngram", "num_speculative_tokens": 3}).speculative
    assert (spec.num_speculative_tokens, spec.prompt_lookup_min, spec.prompt_lookup_max) == (3, 5, 5)
    spec = Config(tiny_qwen3, speculative_config={"method": "ngram", "num_speculative_tokens": 3,
                                                  "prompt_lookup_max": 4}).speculative
    assert (spec.prompt_lookup_min, spec.prompt_lookup_max) == (4, 4)
    assert Config(tiny_qwen3).speculative is None


def test_speculate_is_a_checked_request_field():
    with pytest.raises(InvalidValueError, match=r"SamplingParams.speculate: expected a bool"):
        SamplingParams(speculate="no")
    assert SamplingParams(speculate=False).snapshot().speculate is False


def test_command_line_and_vllm_layer_take_the_same_dict(tiny_qwen3):
    from asyncllm.cli import build_parser
    from asyncllm.vllm.inputs import engine_options
    args = build_parser().parse_args(["serve", tiny_qwen3, "--speculative-config",
                                      '{"method": "ngram", "num_speculative_tokens": 4}'])
    assert args.speculative_config == {"method": "ngram", "num_speculative_tokens": 4}
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", tiny_qwen3, "--speculative-config", "ngram"])
    assert engine_options({"speculative_config": NGRAM}) == {"speculative_config": NGRAM}


def test_stats_and_metrics_report_drafts_and_acceptance(engines):
    from prometheus_client import CollectorRegistry, generate_latest
    from asyncllm.server.metrics import EngineCollector
    spec = engines("repeating", "roomy", True)
    run(spec, prompts(2, seed=11), GREEDY)
    stats = spec.core.stats()
    assert 0 < stats["spec_accepted_tokens"] <= stats["spec_draft_tokens"]
    assert stats["spec_acceptance_rate"] == stats["spec_accepted_tokens"] / stats["spec_draft_tokens"]
    assert stats["spec_mean_accepted_length"] == 1 + stats["spec_accepted_tokens"] / stats["spec_verifications"]
    registry = CollectorRegistry()
    registry.register(EngineCollector(spec.core, "m"))
    text = generate_latest(registry).decode()
    assert f'asyncllm_spec_decode_accepted_tokens_total{{model_name="m"}} {float(stats["spec_accepted_tokens"])}' in text
    assert "asyncllm_spec_decode_mean_accepted_length" in text
    assert stats["spec_speculating_share"] == stats["spec_verifications"] / stats["spec_decode_steps"] > 0
    assert f'asyncllm_spec_decode_speculating_share{{model_name="m"}} {stats["spec_speculating_share"]}' in text
    assert "spec_draft_tokens" not in engines("repeating", "roomy", False).core.stats()  # off: absent
