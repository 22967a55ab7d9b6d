"""Speculative decoding with a draft model (speculative_config={"model": dir, ...}) on CPU, against the
plain engine: the draft equal to the target (every proposal accepted: the mechanism's ceiling), a
random draft of the same vocabulary (almost none accepted), seeded sampled output equal to the plain
engine's (exact-match verification of keyed drafts), and
every target and draft KV block free after prefix hits, chunked prefill, preemption and cancellation.
A greedy request's drafts are point masses, as prompt lookup's are (their exactness: the rejection
sampler's tests in tests/test_speculative.py); an unseeded sampled request's are drawn from the draft's
own q and verified against it: chi-square tests below, with acceptance against point proposals. The draft's
prefix cache: a new turn over a cached prefix, and every draft block free after finishes, aborts and
preemptions over shared prefixes.
"""
from __future__ import annotations

import glob
import math
import os
import random
import shutil
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from asyncllm.config import Config
from asyncllm.engine.speculation import ACCEPTANCE_WEIGHT, LOW_ACCEPTANCE
from asyncllm.errors import InvalidValueError
from asyncllm.layers.rejection_sampler import verify_drafts
from asyncllm.llm import LLM
from asyncllm.runner.cuda_graph import CudaGraphRunner, graph_batch_sizes, graph_token_sizes
from asyncllm.sampling_params import SamplingParams
from asyncllm.speculative.draft_model import REPLAYED_CATCH_UP_GRAPHS, DraftModelProposer
from asyncllm.speculative.proposer import DraftRow
from asyncllm.testing import build_tiny_checkpoint
from helpers import assert_all_blocks_free
from test_speculative import chi_square_p_value

pytestmark = pytest.mark.timeout(600)

VOCAB = 4096
K = 4
ROOMY = dict(num_kvcache_blocks=96, kvcache_block_size=16)
# chunked prefill (a 24-token budget) and preemption (10 blocks of 16 for 6 requests of up to ~90 tokens);
# the draft's cache mirrors the target's 10 blocks, so some rows find no draft blocks either
SMALL = dict(num_kvcache_blocks=10, kvcache_block_size=16, max_num_batched_tokens=24, max_num_seqs=6)
# 1 token from the prefill, then 8 verifications of K drafts + 1: every verification is a whole one
GREEDY = SamplingParams(temperature=0, max_tokens=1 + 8 * (K + 1), ignore_eos=True)


@pytest.fixture(scope="module")
def target(tmp_path_factory, tokenizer_dir) -> str:
    return build_tiny_checkpoint(str(tmp_path_factory.mktemp("draft-target")), "qwen3", tokenizer_dir,
                                 vocab_size=VOCAB)


@pytest.fixture(scope="module")
def other_draft(tmp_path_factory, tokenizer_dir) -> str:
    """Same shape and vocabulary, other random weights: its proposals are (almost) never the target's."""
    return build_tiny_checkpoint(str(tmp_path_factory.mktemp("draft-other")), "qwen3", tokenizer_dir,
                                 vocab_size=VOCAB, seed=1)


@pytest.fixture(scope="module")
def engines(target, other_draft):
    made = {}

    def get(draft: str | None, shape: str = "roomy") -> LLM:
        key = (draft, shape)
        if key not in made:
            spec = None if draft is None else {"model": target if draft == "same" else other_draft,
                                               "num_speculative_tokens": K}
            made[key] = LLM(target, speculative_config=spec, **(SMALL if shape == "small" else ROOMY))
        return made[key]
    yield get
    for llm in made.values():
        llm.core.close()


def prompts(num: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(10, VOCAB) for _ in range(rng.randrange(8, 50))] for _ in range(num)]


def assert_draft_blocks_free(llm: LLM) -> None:
    assert_proposer_blocks_free(llm.core.speculation.proposer)


def assert_proposer_blocks_free(proposer: DraftModelProposer) -> None:
    assert proposer._held == {}
    manager = proposer.block_manager
    assert manager.num_free_blocks == proposer.num_total_blocks
    assert all(block.ref_count == 0 for block in manager.blocks)


def run(llm: LLM, prompt_list, params) -> list[list[int]]:
    outputs = llm.generate(prompt_list, params, use_tqdm=False)
    assert_all_blocks_free(llm)
    assert not llm.core.has_unfinished() and llm.core.requests == {}
    if llm.core.speculation is not None:
        assert_draft_blocks_free(llm)
    return [out["token_ids"] for out in outputs]


def delta(llm: LLM, before: dict) -> dict:
    after = llm.core.stats()
    return {key: after[key] - before[key] for key in ("spec_draft_tokens", "spec_accepted_tokens", "spec_verifications")}


def test_draft_equal_to_target_accepts_every_proposal_and_keeps_greedy_output(engines):
    plain, spec = engines(None), engines("same")
    batch = prompts(6, seed=1)
    for _ in range(2):  # the second round hits the prefix cache
        before = spec.core.stats()
        assert run(spec, batch, GREEDY) == run(plain, batch, GREEDY)
        got = delta(spec, before)
        assert got["spec_draft_tokens"] > 0
        # the ceiling: every draft accepted (the same weights, dtype and argmax; a float near-tie may
        # differ between the draft's shapes and the target's, hence not exactly 1)
        assert got["spec_accepted_tokens"] >= 0.95 * got["spec_draft_tokens"]
        # and k drafts a step but for each request's ramp: its first speculation a probe, its next
        # at the rate one step paying all lifts the probe's to (K = 4: 1 then 3 drafts, 4 short)
        after_probe = LOW_ACCEPTANCE + ACCEPTANCE_WEIGHT * (1 - LOW_ACCEPTANCE)
        ramp = 2 * K - math.ceil(K * LOW_ACCEPTANCE) - math.ceil(K * after_probe)
        assert ramp == 4
        assert 1 + (got["spec_accepted_tokens"] + ramp * len(batch)) / got["spec_verifications"] >= K + 1 - 0.3
    assert spec.core.block_manager.num_prefix_hit_tokens > 0


def test_random_draft_keeps_greedy_output_with_few_accepted(engines):
    plain, spec = engines(None), engines("other")
    batch = prompts(5, seed=2)
    before = spec.core.stats()
    assert run(spec, batch, GREEDY) == run(plain, batch, GREEDY)
    got = delta(spec, before)
    assert got["spec_draft_tokens"] > 0
    assert got["spec_accepted_tokens"] <= 0.2 * got["spec_draft_tokens"]


@pytest.mark.parametrize("draft", ["same", "other"])
def test_seeded_sampled_output_is_the_plain_engines_whatever_the_schedule(engines, draft):
    """A seeded request's drafts are the plain sampler's keyed draws over the draft's logits, verified
    by exact match against the target's: its output is the plain engine's token for token, in a batch
    or alone, with prefix-cache hits (target and draft) or without, with chunked prefill and
    preemption; a draft equal to the target draws the target's tokens (nearly every draft
    accepted), a random one's drafts are rejected too."""
    plain = engines(None)
    batch = prompts(5, seed=3)
    params = [SamplingParams(temperature=1.0, seed=100, max_tokens=30, ignore_eos=True),
              SamplingParams(temperature=0.05, seed=101, max_tokens=30, ignore_eos=True),
              SamplingParams(temperature=1.0, top_p=0.95, seed=102, max_tokens=30, ignore_eos=True),
              SamplingParams(temperature=0.8, top_k=20, min_p=0.01, seed=103, max_tokens=30, ignore_eos=True),
              SamplingParams(temperature=1.2, repetition_penalty=1.3, presence_penalty=0.4, seed=104, max_tokens=30,
                             ignore_eos=True)]
    expected = run(plain, batch, params)
    assert len({tuple(tokens) for tokens in expected}) == len(batch)
    # (a random draft on the small engine proposed nothing here: its misses back it off, and 10 blocks)
    for shape in ("roomy", "small") if draft == "same" else ("roomy",):
        spec = engines(draft, shape)
        spec.core.speculation.engine_pause = 0  # an earlier test's misses: the first run speculates at once
        before = spec.core.stats()
        assert run(spec, batch, params) == expected
        assert run(spec, batch, params) == expected  # prefix hits, target's and draft's
        spec.core.block_manager.reset_prefix_cache()
        spec.core.speculation.proposer.block_manager.reset_prefix_cache()
        assert run(spec, batch[::-1], params[::-1]) == expected[::-1]
        assert [run(spec, [prompt], settings)[0] for prompt, settings in zip(batch, params)] == expected
        got = delta(spec, before)
        assert got["spec_draft_tokens"] > 0
        if draft == "same":
            assert got["spec_accepted_tokens"] >= 0.9 * got["spec_draft_tokens"]
        else:  # (the shared noise lifts a random draft's acceptance on the tiny model's flat logits)
            assert got["spec_accepted_tokens"] < got["spec_draft_tokens"]


def test_chunked_prefill_and_preemption_free_every_target_and_draft_block(engines):
    plain, spec = engines(None, "small"), engines("same", "small")
    batch = prompts(6, seed=4)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    before = spec.core.stats()
    assert run(spec, batch, params) == run(plain, batch, params)
    assert spec.core.scheduler.num_preemptions > 0
    got = delta(spec, before)
    # the draft's catch-up ran in forwards of 24 tokens (prompts up to 50) over KV kept through
    # preemptions or rebuilt after them: the draft (the target) is still right almost always
    assert got["spec_accepted_tokens"] >= 0.9 * got["spec_draft_tokens"] > 0


def test_mixed_speculating_and_plain_requests_in_one_batch(engines):
    plain, spec = engines(None), engines("same")
    batch = prompts(6, seed=5)
    params = [SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, speculate=i % 2 == 0) for i in range(6)]
    before = spec.core.stats()
    assert run(spec, batch, params) == run(plain, batch, params)
    assert delta(spec, before)["spec_accepted_tokens"] > 0


def test_cancellation_mid_verification_frees_every_target_and_draft_block(engines):
    spec = engines("same", "small")
    core = spec.core
    params = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)
    for prompt in prompts(4, seed=7):
        core.add_request(prompt, params)
    for _ in range(8):
        core.step()
    while core._launched is None or core._launched.plan.draft_token_ids is None:
        core.resolve_step()
        core.launch_step()
    assert core.speculation.proposer._held  # the draft holds KV for the requests being verified
    for request_id in list(core.requests):
        core.finish_request(request_id)
    assert core.resolve_step() == []
    core.drain()
    assert not core.has_unfinished() and core.requests == {}
    assert_all_blocks_free(core)
    assert_draft_blocks_free(spec)


def test_a_row_without_draft_blocks_just_does_not_speculate(engines):
    proposer: DraftModelProposer = engines("same", "small").core.speculation.proposer
    assert proposer._held == {}
    total, block_size = proposer.num_total_blocks, proposer.block_size
    long_row = DraftRow(list(range(10, 10 + (total - 1) * block_size)), K, "long")
    short_row = DraftRow(list(range(10, 40)), K, "short")  # needs 3 blocks: only 1 is left
    first, second = proposer.propose([long_row, short_row])
    assert len(first) == K and second is None
    assert proposer.propose([DraftRow(short_row.token_ids, 1, "short")]) == [None]
    proposer.release("long")
    assert len(proposer.propose([short_row])[0]) == K  # the blocks came back
    # a row's KV rolled back past rejected drafts: the same proposal from the accepted tokens
    tokens = short_row.token_ids + [7, 8]
    again = proposer.propose([DraftRow(tokens, K, "short")])[0]
    proposer.release("short")
    assert proposer.propose([DraftRow(tokens, K, "fresh")])[0] == again
    proposer.release("fresh")
    assert_proposer_blocks_free(proposer)


def test_bad_draft_configs_are_refused_naming_the_field(target, tmp_path, tokenizer_dir):
    missing = {"model": str(tmp_path / "nowhere"), "num_speculative_tokens": K}
    with pytest.raises(InvalidValueError) as caught:
        Config(target, speculative_config=missing)
    assert caught.value.field == "speculative_config.model" and "does not exist" in str(caught.value)
    with pytest.raises(InvalidValueError) as caught:
        Config(target, speculative_config={"model": target, "num_speculative_tokens": K}, tensor_parallel_size=2)
    assert caught.value.field == "speculative_config.model" and "not yet" in str(caught.value)

    small_vocab = build_tiny_checkpoint(str(tmp_path / "small-vocab"), "qwen3", tokenizer_dir, vocab_size=2048)
    with pytest.raises(InvalidValueError) as caught:
        LLM(target, speculative_config={"model": small_vocab, "num_speculative_tokens": K}, **ROOMY)
    assert caught.value.field == "speculative_config.model" and "vocab_size 2048" in str(caught.value)

    # the same vocabulary size, another tokenizer (the 2048-id one's files)
    other_tokenizer = str(tmp_path / "other-tokenizer")
    shutil.copytree(target, other_tokenizer)
    for name in os.listdir(small_vocab):
        if name.startswith(("tokenizer", "vocab", "merges", "special_tokens", "added_tokens")):
            shutil.copy(os.path.join(small_vocab, name), other_tokenizer)
    with pytest.raises(InvalidValueError) as caught:
        LLM(target, speculative_config={"model": other_tokenizer, "num_speculative_tokens": K}, **ROOMY)
    assert caught.value.field == "speculative_config.model" and "tokenizer" in str(caught.value)

    no_weights = str(tmp_path / "no-weights")
    shutil.copytree(target, no_weights, ignore=shutil.ignore_patterns("*.safetensors"))
    with pytest.raises(InvalidValueError, match="no .safetensors weights"):
        LLM(target, speculative_config={"model": no_weights, "num_speculative_tokens": K}, **ROOMY)


# ---- sampled requests: drafts drawn from the draft's own distribution q -----------------------------
def test_sampled_drafts_verified_against_q_keep_the_target_distribution():
    """verify_drafts with drafts drawn from q (not point masses): over 20 seeds' draws the tokens
    follow p, and a draft is accepted with probability sum(min(p, q))."""
    p = torch.tensor([0.45, 0.2, 0.15, 0.1, 0.1, 0.0], dtype=torch.float64)
    q = torch.tensor([0.1, 0.5, 0.05, 0.05, 0.2, 0.1], dtype=torch.float64)
    counts, num_accepted, num = np.zeros(len(p), dtype=np.int64), 0, 2000
    for seed in range(20):
        generator = torch.Generator().manual_seed(seed)
        drafts = torch.multinomial(q.float(), num, replacement=True, generator=generator)
        uniforms = torch.rand(num, generator=generator)
        exponentials = torch.empty((num, len(p))).exponential_(generator=generator)
        tokens, accepted = verify_drafts(p.float().expand(num, -1), drafts, uniforms, exponentials,
                                         q.float().expand(num, -1))
        counts += np.bincount(tokens.numpy(), minlength=len(p))
        num_accepted += int(accepted.sum())
        assert torch.equal(tokens[accepted], drafts[accepted])
    assert counts[5] == 0  # p(5) = 0: a draft of 5 (q(5) = 0.1) is never kept
    assert chi_square_p_value(counts, p.numpy()) > 0.01, counts
    assert math.isclose(num_accepted / (20 * num), torch.minimum(p, q).sum().item(), abs_tol=0.01)


def scaled_draft(target: str, out: str, scale: float) -> str:
    """The target with its final norm's weight scaled: its logits times scale (the target at
    temperature 1 / scale), so its q differs from the target's p but ranks tokens alike."""
    shutil.copytree(target, out)
    for path in glob.glob(os.path.join(out, "*.safetensors")):
        weights = load_file(path)
        weights["model.norm.weight"] = weights["model.norm.weight"] * scale
        save_file(weights, path, metadata={"format": "pt"})
    return out


def test_sampled_tokens_with_a_sampling_draft_follow_the_target_distribution(engines, target, tmp_path):
    """End to end at temperature 1, top-k 6: the second token given the first (its step verified a
    draft drawn from the draft's q, a sharper distribution than p over the same 6 tokens), over many
    unseeded requests (rejection sampling against q: a seeded request verifies by exact match), against
    the plain engine's probabilities; drafts both accepted and rejected."""
    plain = engines(None)
    spec = LLM(target, speculative_config={"model": scaled_draft(target, str(tmp_path / "sharp"), 2.5),
                                           "num_speculative_tokens": K}, **ROOMY)
    try:
        prompt = prompts(1, seed=11)[0]
        top_k = 6
        first = run(plain, [prompt], SamplingParams(temperature=0, max_tokens=1))[0][0]
        scored = plain.generate([prompt + [first]], SamplingParams(temperature=0, max_tokens=1, logprobs=top_k),
                                use_tqdm=False)[0]["logprobs"][0]
        top_ids = [int(t) for t in scored.top_ids]
        p = np.exp(np.asarray(scored.top_logprobs, dtype=np.float64))
        p /= p.sum()
        before, second = spec.core.stats(), []
        params = [SamplingParams(temperature=1.0, top_k=top_k, max_tokens=3, ignore_eos=True)] * 32
        for _ in range(0, 1600, 32):
            second += [tokens[1] for tokens in run(spec, [prompt] * 32, params) if tokens[0] == first]
        got = delta(spec, before)
        # sum(min(p, q)) with q ~ p ** 2.5 over p's 6 tokens: ~0.86 (point proposals: ~0.2; q = p: 1)
        assert 0.6 * got["spec_draft_tokens"] < got["spec_accepted_tokens"] < 0.95 * got["spec_draft_tokens"]
        assert len(second) > 200 and set(second) <= set(top_ids)
        counts = np.array([second.count(t) for t in top_ids])
        assert chi_square_p_value(counts, p) > 0.01, (counts, p)
    finally:
        spec.core.close()


class PointProposals:
    """The draft model's proposer with every row taken as greedy: point proposals, as before q."""

    def __init__(self, proposer):
        self.proposer = proposer
        self.drafts_cost_forwards = proposer.drafts_cost_forwards

    def propose(self, rows):
        return self.proposer.propose([row._replace(params=None) for row in rows])

    def release(self, request):
        self.proposer.release(request)


def test_a_draft_equal_to_the_target_accepts_almost_every_sampled_draft(engines):
    """Temperature 1 on the tiny model's flat logits, unseeded (rejection sampling against q): a
    draft drawn from q = p is accepted (nearly) always; the same draft model's greedy point
    proposals almost never (p(argmax) is ~0.5%)."""
    spec = engines("same")
    batch = prompts(4, seed=12)
    params = SamplingParams(temperature=1.0, max_tokens=1 + 6 * (K + 1), ignore_eos=True)
    before = spec.core.stats()
    run(spec, batch, params)
    got = delta(spec, before)
    assert got["spec_draft_tokens"] > 0 and got["spec_accepted_tokens"] >= 0.9 * got["spec_draft_tokens"]
    speculation = spec.core.speculation
    proposer, speculation.proposer = speculation.proposer, PointProposals(speculation.proposer)
    try:
        before = spec.core.stats()
        spec.generate(batch, params, use_tqdm=False)
    finally:
        speculation.proposer = proposer
    assert_draft_blocks_free(spec)
    got = delta(spec, before)
    assert got["spec_draft_tokens"] > 0 and got["spec_accepted_tokens"] <= 0.2 * got["spec_draft_tokens"]


# ---- the draft's prefix cache ------------------------------------------------------------------
def count_draft_tokens(proposer: DraftModelProposer) -> list[int]:
    """A one-element list counting the tokens the draft's runner computes from now on."""
    fed, forward = [0], proposer.runner.forward

    def counting(inputs, *args, **kwargs):
        fed[0] += len(inputs.input_ids)
        return forward(inputs, *args, **kwargs)
    proposer.runner.forward = counting
    return fed


def test_a_new_turn_over_a_cached_prefix_does_not_prefill_the_draft_again(engines):
    plain, spec = engines(None), engines("same")
    proposer = spec.core.speculation.proposer
    rng = random.Random(13)
    first_turn = [rng.randrange(10, VOCAB) for _ in range(100)]
    answer = run(spec, [first_turn], GREEDY)[0]
    second_turn = first_turn + answer + [rng.randrange(10, VOCAB) for _ in range(10)]  # 151 tokens
    fed = count_draft_tokens(proposer)
    try:
        hits = proposer.num_prefix_hit_tokens
        assert run(spec, [second_turn], GREEDY) == run(plain, [second_turn], GREEDY)
        hit, with_cache = proposer.num_prefix_hit_tokens - hits, fed[0]
        assert hit >= (100 + len(answer)) // 16 * 16 - 16  # the first turn's full blocks, but the last
        # the same turn with every prefix forgotten: the draft computes the hit tokens as well
        proposer.block_manager.reset_prefix_cache()
        spec.core.block_manager.reset_prefix_cache()
        fed[0] = 0
        assert run(spec, [second_turn], GREEDY) == run(plain, [second_turn], GREEDY)
        assert fed[0] - with_cache == hit
    finally:
        del proposer.runner.forward


def test_finishes_aborts_and_preemptions_over_shared_prefixes_free_every_draft_block(engines):
    spec = engines("same", "small")
    core, proposer = spec.core, spec.core.speculation.proposer
    hits, preemptions = proposer.num_prefix_hit_tokens, core.scheduler.num_preemptions
    shared = prompts(1, seed=14)[0][:8] * 5  # 40 tokens: two full blocks every request shares
    batch = [shared + tail for tail in prompts(6, seed=15)]
    for round_ in range(2):
        for i, prompt in enumerate(batch):
            core.add_request(prompt, SamplingParams(temperature=0 if i % 2 else 0.8, seed=i, max_tokens=20 + 5 * i,
                                                    ignore_eos=True), request_id=f"{round_}-{i}")
        for step in range(12):
            core.step()
            if step in (4, 8):  # aborts mid-run, one of them mid-verification where one is in flight
                victim = f"{round_}-{step // 4}"
                if victim in core.requests:
                    core.finish_request(victim)
        while core.has_unfinished():
            core.step()
        core.drain()
        assert core.requests == {}
        assert_all_blocks_free(core)
        assert_draft_blocks_free(spec)
    assert proposer.num_prefix_hit_tokens > hits
    assert core.scheduler.num_preemptions > preemptions


def test_a_proposal_reads_its_drafts_back_once_and_they_are_the_drafts_of_one_token_proposals(engines, monkeypatch):
    """The draft's steps feed each draft to the next on the device: the host reads a proposal's drafts
    back once (one .tolist() of a tensor), not once per draft (on CUDA each would wait for the device).
    Rows of different lengths and draft counts (one row stops drafting early) get the same drafts as
    proposals one draft at a time, each from the drafts so far (greedy: the draft's argmax chain)."""
    proposer: DraftModelProposer = engines("same").core.speculation.proposer
    rng = random.Random(5)
    rows = [DraftRow([rng.randrange(10, VOCAB) for _ in range(n)], k, f"row{n}") for n, k in ((20, K), (37, 2))]
    reads = []
    tolist = torch.Tensor.tolist
    monkeypatch.setattr(torch.Tensor, "tolist", lambda self: reads.append(self.shape) or tolist(self))
    drafts = proposer.propose(rows)
    monkeypatch.undo()
    assert reads == [torch.Size([2, K])] and [len(d) for d in drafts] == [K, 2]
    for row, row_drafts in zip(rows, drafts):
        proposer.release(row.request)
        chain = []
        for j in range(len(row_drafts)):
            chain += proposer.propose([DraftRow(row.token_ids + chain, 1, "chain")])[0]
        proposer.release("chain")
        assert chain == row_drafts
    assert_proposer_blocks_free(proposer)


def test_a_verification_replays_a_mixed_graph_where_its_logits_rows_fit():
    """CudaGraphRunner's choice of graph (no graph is captured here: the choice alone): a verification
    step (1 + k query rows and logits rows per request) fits the mixed graph of its token bucket, whose
    logits rows are min(bucket, max_batch_size); a step with more logits rows than that runs eagerly;
    decode-only steps take decode graphs."""
    graphs = CudaGraphRunner.__new__(CudaGraphRunner)
    graphs.batch_sizes, graphs.max_batch_size = graph_batch_sizes(16), 16
    graphs.token_sizes, graphs.max_mixed_tokens = graph_token_sizes(64), 64
    graphs.max_context = 4096
    graphs.context_bounds = {size: [4096] for size in graphs.batch_sizes}
    graphs.mixed_context_bounds = {size: [4096] for size in graphs.token_sizes}

    def step(num_seqs, num_tokens, num_logits):
        return SimpleNamespace(num_seqs=num_seqs, num_tokens=num_tokens, logits_indices=torch.zeros(num_logits),
                               is_decode_only=num_tokens == num_seqs, max_seq_len=100)
    assert graphs._key(step(1, 5, 5)) == ("mixed", 16, 4096)  # batch 1, k = 4
    assert graphs._key(step(3, 15, 15)) == ("mixed", 16, 4096)
    assert graphs._key(step(4, 20, 20)) is None  # 20 logits rows: the 32-token graph gathers 16
    assert graphs._key(step(3, 20, 3)) == ("mixed", 32, 4096)  # a prefill chunk beside decodes
    assert graphs._key(step(4, 4, 4)) == ("decode", 4, 4096)
    assert graphs._key(step(1, 65, 5)) is None  # past the mixed graphs' tokens


def test_a_catch_up_of_a_few_graphs_tokens_runs_in_graph_sized_forwards(engines, monkeypatch):
    """With mixed graphs of replay_tokens tokens (on CUDA: the draft's largest; set here, on CPU, to 16),
    a catch-up of at most REPLAYED_CATCH_UP_GRAPHS times that many tokens (a prompt's) runs in forwards
    that fit the graph, not one eager forward; a longer one in forwards of max_num_batched_tokens.
    Either way the drafts are those of one forward over the whole catch-up (graphs off; no prefix hits)."""
    proposer: DraftModelProposer = engines("same").core.speculation.proposer
    rng = random.Random(7)
    short = [DraftRow([rng.randrange(10, VOCAB) for _ in range(n)], K, f"short{n}") for n in (37, 20)]
    long = [DraftRow([rng.randrange(10, VOCAB) for _ in range(70)], K, "long")]
    monkeypatch.setattr(proposer.block_manager, "match_prefix", lambda state: None)  # each run feeds every token
    unchunked = [proposer.propose([row])[0] for row in short + long]
    for row in short + long:
        proposer.release(row.request)
    sizes = []
    forward = DraftModelProposer._forward

    def recording(self, input_ids, positions, *rest):
        sizes.append(len(positions))
        return forward(self, input_ids, positions, *rest)
    monkeypatch.setattr(DraftModelProposer, "_forward", recording)
    monkeypatch.setattr(proposer, "replay_tokens", 16)
    assert REPLAYED_CATCH_UP_GRAPHS * 16 == 64  # short: 57 tokens, within; long: 70, past it
    drafts = proposer.propose(short)
    assert sizes == [16, 16, 16, 9] + [2] * (K - 1)  # the catch-up's pieces, then one token a row a draft
    sizes.clear()
    drafts += proposer.propose(long)
    assert sizes == [70] + [1] * (K - 1)
    for row in short + long:
        proposer.release(row.request)
    assert drafts == unchunked
    assert_proposer_blocks_free(proposer)
