"""Sampling features end to end, against Hugging Face transformers on the same tiny random weights
(CPU, float32): logprobs, repetition penalty, min_tokens, logit_bias, n > 1 with shared prompt
blocks; each with the overlapped step loop and without it."""
from __future__ import annotations

import random

import pytest
import torch

from asyncllm import LLM, SamplingParams
from asyncllm.sampling_params import MAX_REPETITION_PENALTY, MAX_TEMPERATURE
from helpers import assert_all_blocks_free

pytestmark = pytest.mark.timeout(300)


def rand_ids(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1000, 150_000) for _ in range(n)]


PROMPTS = [rand_ids(7, 1), rand_ids(23, 2), rand_ids(40, 3)]
N = 10


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny ops on a shared machine: one thread is faster
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def hf_model(tiny_qwen3):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(tiny_qwen3, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def llms(tiny_qwen3):
    made = {}

    def get(overlap: bool) -> LLM:
        if overlap not in made:
            made[overlap] = LLM(tiny_qwen3, kvcache_block_size=16, num_kvcache_blocks=64, overlap_scheduling=overlap)
        return made[overlap]
    return get


def hf_generate(model, prompt: list[int], **kwargs) -> list[int]:
    input_ids = torch.tensor([prompt])
    with torch.inference_mode():
        out = model.generate(input_ids, attention_mask=torch.ones_like(input_ids), do_sample=False,
                             pad_token_id=0, **kwargs)
    return out[0, len(prompt):].tolist()


def run(llm: LLM, prompts, params) -> list:
    outputs = llm.generate(prompts, params, use_tqdm=False)
    assert_all_blocks_free(llm)
    assert not llm.core.requests and all(block.ref_count == 0 for block in llm.core.block_manager.blocks)
    assert llm.core.runner.sampling_inputs.token_counts.capacity == len(
        llm.core.runner.sampling_inputs.token_counts.free_slots)  # every penalty slot released
    return outputs


@pytest.mark.parametrize("overlap", [False, True], ids=["serial", "overlap"])
def test_logprobs_are_hf_log_softmax(llms, hf_model, overlap):
    outputs = run(llms(overlap), PROMPTS, SamplingParams(temperature=0, max_tokens=N, ignore_eos=True, logprobs=5))
    for prompt, out in zip(PROMPTS, outputs):
        tokens = out["token_ids"]
        with torch.inference_mode():
            logits = hf_model(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1:-1]
        expected = logits.float().log_softmax(-1)
        assert len(out["logprobs"]) == len(tokens) == N
        for step, (entry, token) in enumerate(zip(out["logprobs"], tokens)):
            assert entry.token_id == token and entry.rank == 1  # greedy takes the most likely token
            assert entry.logprob == pytest.approx(expected[step, token].item(), abs=1e-4)
            top = expected[step].topk(5)
            assert [t for t, _ in entry.top] == top.indices.tolist()
            assert [lp for _, lp in entry.top] == pytest.approx(top.values.tolist(), abs=1e-4)
            assert isinstance(entry.token, str) and len(entry.top_tokens) == 5


def test_logprobs_rank_of_a_sampled_token_and_zero_alternatives(llms):
    out = run(llms(False), PROMPTS[:1], SamplingParams(temperature=1.5, max_tokens=N, ignore_eos=True, logprobs=0,
                                                       seed=3))[0]
    assert all(entry.top == [] and entry.rank >= 1 and entry.logprob <= 0 for entry in out["logprobs"])
    assert any(entry.rank > 1 for entry in out["logprobs"])  # at temperature 1.5, not always the top token
    # a request without logprobs in the same batch gets none
    outs = run(llms(False), PROMPTS[:2], [SamplingParams(max_tokens=3, logprobs=2), SamplingParams(max_tokens=3)])
    assert len(outs[0]["logprobs"]) == len(outs[0]["token_ids"]) and outs[1]["logprobs"] is None


@pytest.mark.parametrize("overlap", [False, True], ids=["serial", "overlap"])
def test_repetition_penalty_matches_hf(llms, hf_model, overlap):
    # the tiny random model never repeats a token greedily, so a penalty > 1 changes nothing; one
    # below 1 rewards the prompt's and the output's tokens, and the output turns repetitive
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, repetition_penalty=0.5)
    outputs = run(llms(overlap), PROMPTS, params)
    for prompt, out in zip(PROMPTS, outputs):
        assert out["token_ids"] == hf_generate(hf_model, prompt, max_new_tokens=16, min_new_tokens=16,
                                               repetition_penalty=0.5)
    assert any(len(set(o["token_ids"])) < 16 for o in outputs)  # repeats: the output's counts were used
    plain = run(llms(overlap), PROMPTS, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))
    assert [o["token_ids"] for o in plain] != [o["token_ids"] for o in outputs]


@pytest.mark.parametrize("overlap", [False, True], ids=["serial", "overlap"])
def test_min_tokens_suppresses_eos_as_hf(llms, hf_model, overlap):
    llm = llms(overlap)
    eos = sorted(llm.core.eos_token_ids)
    bias = {eos[0]: 100.0}  # EOS would be chosen at once, if min_tokens allowed it
    ended = run(llm, PROMPTS, SamplingParams(temperature=0, max_tokens=N, logit_bias=bias))
    assert all(o["token_ids"] == [eos[0]] and o["finish_reason"] == "stop" for o in ended)
    outputs = run(llm, PROMPTS, SamplingParams(temperature=0, max_tokens=N, logit_bias=bias, min_tokens=5))
    for prompt, out in zip(PROMPTS, outputs):
        expected = hf_generate(hf_model, prompt, max_new_tokens=N, min_new_tokens=5, eos_token_id=eos,
                               sequence_bias={(eos[0],): 100.0})
        assert out["token_ids"] == expected and len(expected) == 6 and expected[-1] == eos[0]
        assert out["finish_reason"] == "stop" and out["stop_reason"] is None  # EOS: no stop_reason (vLLM's)


@pytest.mark.parametrize("overlap", [False, True], ids=["serial", "overlap"])
def test_logit_bias_forces_and_bans(llms, overlap):
    llm = llms(overlap)
    forced = run(llm, PROMPTS, SamplingParams(temperature=1.0, max_tokens=N, ignore_eos=True, logit_bias={4242: 100},
                                              seed=1))
    assert all(o["token_ids"] == [4242] * N for o in forced)
    greedy = SamplingParams(temperature=0, max_tokens=N, ignore_eos=True)
    plain = run(llm, PROMPTS, greedy)
    first = plain[0]["token_ids"][0]
    banned = run(llm, PROMPTS[:1], SamplingParams(temperature=0, max_tokens=N, ignore_eos=True,
                                                  logit_bias={first: -100}))[0]
    assert banned["token_ids"][0] != first and first not in banned["token_ids"]


def test_allowed_token_ids_and_bad_words(llms):
    llm = llms(False)
    words = [" the", " cat", " dog", " and", " sat"]
    allowed = [llm.tokenizer.encode(w, add_special_tokens=False)[0] for w in words]
    outs = run(llm, PROMPTS, SamplingParams(temperature=1.0, max_tokens=N, ignore_eos=True, allowed_token_ids=allowed))
    assert all(set(o["token_ids"]) <= set(allowed) for o in outs)
    greedy = SamplingParams(temperature=0, max_tokens=N, ignore_eos=True, allowed_token_ids=allowed)
    first = run(llm, PROMPTS[:1], greedy)[0]["token_ids"][0]
    word = llm.tokenizer.decode([first]).strip()
    out = run(llm, PROMPTS[:1], SamplingParams(temperature=0, max_tokens=N, ignore_eos=True, allowed_token_ids=allowed,
                                               bad_words=[word]))[0]
    assert first not in out["token_ids"] and set(out["token_ids"]) <= set(allowed)


def test_the_highest_temperature_keeps_to_the_allowed_tokens(llms):
    """At MAX_TEMPERATURE sampling is uniform over the allowed tokens and never leaves them (a
    temperature past float32's range once made forbidden logits NaN and let any token through)."""
    llm = llms(False)
    allowed = [5, 6, 7]
    params = SamplingParams(temperature=MAX_TEMPERATURE, max_tokens=N, ignore_eos=True, allowed_token_ids=allowed)
    tokens = [t for o in run(llm, PROMPTS, params) for t in o["token_ids"]]
    assert set(tokens) <= set(allowed) and len(set(tokens)) > 1


@pytest.mark.parametrize("repetition_penalty", [1 / MAX_REPETITION_PENALTY, MAX_REPETITION_PENALTY])
def test_the_extreme_repetition_penalties_keep_to_the_allowed_tokens(llms, repetition_penalty):
    """The prompt's tokens are allowed and penalized at each end of the accepted range: the sampled
    tokens stay allowed (a penalty of 1e-50, 0 in float32, once made every sampled token a forbidden one)."""
    llm = llms(False)
    allowed = [5, 6, 7]
    params = SamplingParams(temperature=1.0, max_tokens=N, ignore_eos=True, allowed_token_ids=allowed,
                            repetition_penalty=repetition_penalty)
    tokens = [t for o in run(llm, [[5, 6, 7, 1, 2, 3]] * 3, params) for t in o["token_ids"]]
    assert set(tokens) <= set(allowed)


@pytest.mark.parametrize("overlap", [False, True], ids=["serial", "overlap"])
def test_penalties_with_and_without_overlap_agree(llms, overlap):
    params = [SamplingParams(temperature=0.8, max_tokens=12, ignore_eos=True, seed=i, presence_penalty=1.5,
                             frequency_penalty=0.7, repetition_penalty=1.2, logprobs=2) for i in range(3)]
    a = run(llms(False), PROMPTS, params)
    b = run(llms(True), PROMPTS, params)
    assert [o["token_ids"] for o in a] == [o["token_ids"] for o in b]
    for x, y in zip(a, b):
        assert [e.logprob for e in x["logprobs"]] == pytest.approx([e.logprob for e in y["logprobs"]], abs=1e-5)


def test_stop_reason_of_a_stop_token_and_a_stop_string(llms):
    llm = llms(False)
    plain = run(llm, PROMPTS[:1], SamplingParams(temperature=0, max_tokens=N, ignore_eos=True))[0]
    stop_id = plain["token_ids"][3]
    out = run(llm, PROMPTS[:1], SamplingParams(temperature=0, max_tokens=N, ignore_eos=True,
                                               stop_token_ids=[stop_id]))[0]
    assert out["finish_reason"] == "stop" and out["stop_reason"] == stop_id
    stop_text = plain["text"][len(plain["text"]) // 2:][:3]
    if stop_text:
        out = run(llm, PROMPTS[:1], SamplingParams(temperature=0, max_tokens=N, ignore_eos=True, stop=[stop_text]))[0]
        assert out["finish_reason"] == "stop" and out["stop_reason"] == stop_text


# ---- n > 1 ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("overlap", [False, True], ids=["serial", "overlap"])
def test_n_samples_are_seeded_sequences_of_their_own(llms, overlap):
    llm = llms(overlap)
    prompt = PROMPTS[2]  # 40 tokens: 2 full blocks of 16 shared, 8 tokens recomputed per extra sequence
    params = SamplingParams(temperature=1.0, max_tokens=8, ignore_eos=True, n=4, seed=7, logprobs=1)
    first = run(llm, [prompt], params)[0]
    again = run(llm, [prompt], params)[0]
    assert [o["index"] for o in first] == [0, 1, 2, 3]
    assert [o["token_ids"] for o in first] == [o["token_ids"] for o in again]
    assert len({tuple(o["token_ids"]) for o in first}) > 1
    # sequence i draws as a lone request with seed 7 + i would
    for o in first:
        alone = run(llm, [prompt], SamplingParams(temperature=1.0, max_tokens=8, ignore_eos=True, seed=7 + o["index"]))
        assert o["token_ids"] == alone[0]["token_ids"] and len(o["logprobs"]) == 8


def test_n_shares_the_prompt_blocks(tiny_qwen3):
    llm = LLM(tiny_qwen3, kvcache_block_size=16, num_kvcache_blocks=64, enable_prefix_caching=False)
    core, bm = llm.core, llm.core.block_manager
    prompt = PROMPTS[2]  # 40 tokens
    leader = core.add_request(prompt, SamplingParams(temperature=1.0, max_tokens=8, ignore_eos=True, n=4))
    computed = []
    while any(len(seq.completion_token_ids) < 2 for seq in leader.group):
        core.step()
        computed.append(core.last_step[0])
    # one prefill of the prompt, and 8 tokens (the last, partial block) for each of the 3 others
    assert sum(computed) == 40 + 3 * 8
    shared = leader.block_table[:2]
    assert all(seq.block_table[:2] == shared for seq in leader.group)
    assert [bm.blocks[b].ref_count for b in shared] == [4, 4]
    # 2 shared blocks + one own block each; 4 separate requests would hold 12
    assert bm.num_total_blocks - bm.num_free_blocks == 2 + 4
    core.finish_request(leader.request_id)  # abort all four
    assert_all_blocks_free(core)
    assert not core.requests and all(seq.is_finished for seq in leader.group)


def test_n_with_preemption_and_a_small_cache(tiny_qwen3):
    # 7 blocks: 4 sequences of 40 + 24 tokens do not fit at once; preempted ones recompute
    llm = LLM(tiny_qwen3, kvcache_block_size=16, num_kvcache_blocks=7)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, n=4)
    outs = run(llm, [PROMPTS[2]], params)[0]
    assert len(outs) == 4 and all(len(o["token_ids"]) == 24 for o in outs)
    assert len({tuple(o["token_ids"]) for o in outs}) == 1  # greedy: four equal answers
    assert llm.core.scheduler.num_preemptions > 0


# ---- prompt_logprobs ------------------------------------------------------------------------------
@pytest.mark.parametrize("overlap", [False, True], ids=["serial", "overlap"])
def test_prompt_logprobs_are_hf_log_softmax(tiny_qwen3, hf_model, overlap):
    # small chunks and a prefix already cached: every prompt position is still scored, once
    llm = LLM(tiny_qwen3, kvcache_block_size=16, num_kvcache_blocks=64, max_num_batched_tokens=32,
              overlap_scheduling=overlap)
    run(llm, PROMPTS, SamplingParams(max_tokens=2))  # fills the prefix cache
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True, prompt_logprobs=3, n=2)
    outputs = run(llm, PROMPTS, params)
    for prompt, outs in zip(PROMPTS, outputs):
        scored = outs[0]["prompt_logprobs"]
        assert "prompt_logprobs" not in outs[1]  # the prompt is scored once, with the first sequence
        with torch.inference_mode():
            expected = hf_model(torch.tensor([prompt])).logits[0, :-1].float().log_softmax(-1)
        assert len(scored) == len(prompt) and scored[0] is None
        for position, entry in enumerate(scored[1:]):
            assert entry.token_id == prompt[position + 1]
            assert entry.logprob == pytest.approx(expected[position, prompt[position + 1]].item(), abs=1e-4)
            assert [t for t, _ in entry.top] == expected[position].topk(3).indices.tolist()


@pytest.mark.parametrize("overlap", [False, True], ids=["serial", "overlap"])
def test_min_tokens_holds_off_a_stop_string(llms, tiny_qwen3, overlap):
    from transformers import AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(tiny_qwen3)
    llm, prompt = llms(overlap), PROMPTS[0]
    free = run(llm, [prompt], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))[0]
    tokens, text = free["token_ids"], free["text"]
    # a stop string the output has within its first 3 tokens' text, and again later or not
    first3 = tokenizer.decode(tokens[:3])
    stop = first3[-2:] if len(first3.strip()) >= 2 else first3
    assert stop and text.startswith(first3)
    early = run(llm, [prompt], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, stop=[stop]))[0]
    assert early["finish_reason"] == "stop" and len(early["token_ids"]) <= 3  # without min_tokens: it ends there
    for min_tokens in (3, 6):
        out = run(llm, [prompt], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, stop=[stop],
                                                min_tokens=min_tokens))[0]
        protected = len(tokenizer.decode(tokens[:min_tokens]))
        start = text.find(stop)
        while start != -1 and start + len(stop) <= protected:
            start = text.find(stop, start + 1)
        assert out["text"] == (text if start == -1 else text[:start])
        assert out["finish_reason"] == ("length" if start == -1 else "stop")
        assert len(out["token_ids"]) > min_tokens


def contains(tokens: list[int], word: list[int]) -> bool:
    return any(tokens[i:i + len(word)] == word for i in range(len(tokens) - len(word) + 1))


def test_bad_word_whose_prefix_ends_in_the_token_in_flight(llms):
    # overlapped steps: step N+1 is built before N's token reaches the host; a two-token bad word
    # whose first token is that one is banned on the device (before: it was missed)
    serial, overlapped = llms(False), llms(True)
    tokenizer = serial.tokenizer
    params = dict(temperature=0, max_tokens=N, ignore_eos=True)
    for prompt in PROMPTS:
        free = run(serial, [prompt], SamplingParams(**params))[0]["token_ids"]
        for k in range(1, N - 1):
            pair, text = free[k:k + 2], tokenizer.decode(free[k:k + 2])
            encodings = [tokenizer.encode(t, add_special_tokens=False) for t in (text.lstrip(), " " + text.lstrip())]
            if pair in encodings and all(len(e) > 1 for e in encodings):
                break
        else:
            continue
        banned = SamplingParams(**params, bad_words=[text])
        a = run(serial, [prompt], banned)[0]["token_ids"]
        b = run(overlapped, [prompt], banned)[0]["token_ids"]
        assert a == b and a[:k + 1] == free[:k + 1] and a[k + 1] != free[k + 1]
        assert not any(contains(b, e) for e in encodings)
        return
    pytest.fail("no generated pair of tokens reads back as itself")
