"""Greedy output of the engine == Hugging Face transformers' greedy generate on the same weights.

The engine runs batches (paged KV, chunked prefill, prefix-cache hits, preemption, requests joining
mid-flight); the reference runs one prompt at a time with no padding, in float32. Also: length
limits, seeded sampling and stop tokens, end to end through LLM.generate.
"""
from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from asyncllm import LLM, SamplingParams
from asyncllm.models import tokenizer_loader
from asyncllm.runner.step_inputs import StepInputs
from helpers import assert_all_blocks_free

N = 8  # new tokens for most cases
N_PREFIX = 12  # for the shared-prefix prompts (enough to need a 4th block and force preemption)


def rand_ids(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1000, 150_000) for _ in range(n)]


# lengths 1, ~5 (string), 15, 16, 17, ~40 (string), 40, 100: on and around block boundaries
POOL = [
    rand_ids(1, 1),
    "Hello, my name is",
    rand_ids(15, 2),
    rand_ids(16, 3),
    rand_ids(17, 4),
    "The quick brown fox jumps over the lazy dog. " * 4,
    rand_ids(40, 5),
    rand_ids(100, 6),
]
PREFIX = rand_ids(40, 7)  # 2 full blocks of 16 and a partial one
PREFIX_PROMPTS = [PREFIX + rand_ids(k, 10 + k) for k in (2, 3, 4, 5)]  # 42..45 tokens


def greedy(max_tokens: int, **kwargs) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, **kwargs)


class HFReference:
    """One HF model per checkpoint; greedy continuations cached per (checkpoint, prompt)."""

    def __init__(self):
        self.models: dict[str, object] = {}
        self.tokenizers: dict[str, object] = {}
        self.cache: dict[tuple[str, tuple[int, ...]], list[int]] = {}

    def ids(self, model_dir: str, prompt) -> list[int]:
        if isinstance(prompt, str):
            if model_dir not in self.tokenizers:
                from transformers import AutoTokenizer
                self.tokenizers[model_dir] = AutoTokenizer.from_pretrained(model_dir, trust_remote_code=False)
            return self.tokenizers[model_dir].encode(prompt)
        return list(prompt)

    def greedy(self, model_dir: str, prompt, n: int) -> list[int]:
        ids = self.ids(model_dir, prompt)
        key = (model_dir, tuple(ids))
        cached = self.cache.get(key)
        if cached is None or len(cached) < n:
            if model_dir not in self.models:
                from transformers import AutoModelForCausalLM
                self.models[model_dir] = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
            model = self.models[model_dir]
            input_ids = torch.tensor([ids])
            with torch.inference_mode():
                out = model.generate(input_ids, attention_mask=torch.ones_like(input_ids), do_sample=False,
                                     max_new_tokens=n, min_new_tokens=n, pad_token_id=0)
            cached = out[0, len(ids):].tolist()
            assert len(cached) == n
            self.cache[key] = cached
        return cached[:n]


@pytest.fixture(scope="module", autouse=True)
def _fast_cpu():
    """Speed only. One torch thread: these ops are tiny and the machine is shared (two spinning threads
    are several times slower under load). And each checkpoint's tokenizer is loaded once: loading
    the Qwen tokenizer is most of an LLM's start-up, and a tokenizer is stateless for encode/decode."""
    original = tokenizer_loader.load_tokenizer
    cache = {}

    def cached_load_tokenizer(model_dir):
        if model_dir not in cache:
            cache[model_dir] = original(model_dir)
        return cache[model_dir]

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(tokenizer_loader, "load_tokenizer", cached_load_tokenizer)  # what the engine's loader calls
            yield
    finally:
        torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def hf() -> HFReference:
    return HFReference()


@pytest.fixture(scope="module")
def llm16(tiny_qwen3) -> LLM:
    """The shared engine: untied lm_head, 16-token blocks, a small cache."""
    return LLM(tiny_qwen3, kvcache_block_size=16, num_kvcache_blocks=512)


def assert_idle(llm: LLM) -> None:
    assert_all_blocks_free(llm)
    assert llm.core.scheduler.num_unfinished == 0 and not llm.core.requests


def assert_matches_hf(hf: HFReference, model_dir: str, prompts, outputs, n: int) -> None:
    assert len(outputs) == len(prompts)
    for i, (prompt, out) in enumerate(zip(prompts, outputs)):
        expected = hf.greedy(model_dir, prompt, n)
        assert out["token_ids"] == expected, f"prompt {i} ({len(hf.ids(model_dir, prompt))} tokens)"
        assert out["finish_reason"] == "length"


def record_schedules(llm: LLM) -> list[list[tuple]]:
    """Wrap the scheduler to log, per step: (request_id, start, num_tokens, samples, prompt length)."""
    log: list[list[tuple]] = []
    scheduler = llm.core.scheduler
    schedule = scheduler.schedule

    def recording_schedule():
        out = schedule()
        assert out.num_batched_tokens <= scheduler.max_num_batched_tokens
        assert len(scheduler.running) <= scheduler.max_num_seqs
        log.append([(item.seq.request_id, item.seq.num_computed_tokens, item.num_tokens, item.samples,
                     item.seq.num_prompt_tokens) for item in out.scheduled])
        return out

    scheduler.schedule = recording_schedule
    return log


# ---- plain batches ----------------------------------------------------------------------------
@pytest.mark.parametrize("tied,block_size", [(False, 16), (False, 256), (True, 16), (True, 256)],
                         ids=["untied-16", "untied-256", "tied-16", "tied-256"])
def test_batch_matches_hf(request, hf, tied, block_size):
    model_dir = request.getfixturevalue("tiny_qwen3_tied" if tied else "tiny_qwen3")
    if not tied and block_size == 16:
        llm = request.getfixturevalue("llm16")
    else:
        llm = LLM(model_dir, kvcache_block_size=block_size, num_kvcache_blocks=512 if block_size == 16 else 16)
    outputs = llm.generate(POOL, greedy(N), use_tqdm=False)
    assert_matches_hf(hf, model_dir, POOL, outputs, N)
    assert_idle(llm)


def test_chunked_prefill_matches_hf(tiny_qwen3, hf):
    llm = LLM(tiny_qwen3, kvcache_block_size=16, num_kvcache_blocks=512, max_num_batched_tokens=32)
    log = record_schedules(llm)
    prompts = POOL + PREFIX_PROMPTS[:2]
    outputs = llm.generate(prompts, greedy(N), use_tqdm=False)
    assert all(sum(item[2] for item in step) <= 32 for step in log)
    # some step computed only part of a prompt, and some step mixed decodes with a prefill chunk
    assert any(start + n < prompt_len for step in log for _, start, n, _, prompt_len in step)
    assert any(any(n == 1 and s for _, _, n, s, _ in step) and any(n > 1 for _, _, n, _, _ in step) for step in log)
    # the second shared-prefix prompt, admitted in a later step, hits blocks the first one computed
    assert llm.core.block_manager.num_prefix_hit_tokens >= 32
    for i, prompt in enumerate(prompts):
        assert outputs[i]["token_ids"] == hf.greedy(tiny_qwen3, prompt, N)
    assert_idle(llm)


# ---- prefix cache -----------------------------------------------------------------------------
def test_prefix_cache_hits_match_hf(llm16, tiny_qwen3, hf):
    bm = llm16.core.block_manager
    outputs = llm16.generate(PREFIX_PROMPTS, greedy(N_PREFIX), use_tqdm=False)
    assert_matches_hf(hf, tiny_qwen3, PREFIX_PROMPTS, outputs, N_PREFIX)
    assert_idle(llm16)
    hits_before = bm.num_prefix_hit_tokens
    # repeated prompts and other prompts sharing the 2-block prefix, served from the freed blocks
    prompts = [PREFIX_PROMPTS[0], PREFIX_PROMPTS[0], PREFIX_PROMPTS[3], PREFIX_PROMPTS[1]]
    outputs = llm16.generate(prompts, greedy(N_PREFIX), use_tqdm=False)
    assert bm.num_prefix_hit_tokens - hits_before >= 4 * 32
    assert_matches_hf(hf, tiny_qwen3, prompts, outputs, N_PREFIX)
    assert_idle(llm16)


def test_a_chat_turn_over_its_cached_history_matches_hf(llm16, tiny_qwen3, hf):
    # turn 2 = turn 1's prompt and answer, then new ids: its prompt's blocks are matched from the
    # int64 ids the intake made, against blocks hashed from the token list as decoding filled them
    # (the last two hold generated tokens); the cached turn's tokens are the uncached run's (HF's)
    bm = llm16.core.block_manager
    first = rand_ids(42, 77)
    answer = llm16.generate([first], greedy(30), use_tqdm=False)[0]["token_ids"]
    assert answer == hf.greedy(tiny_qwen3, first, 30)
    second = first + answer + rand_ids(5, 78)
    hits_before = bm.num_prefix_hit_tokens
    outputs = llm16.generate([second], greedy(N), use_tqdm=False)
    # 71 of the 72 tokens had their KV computed (the last answer token is never fed): 4 full blocks
    assert bm.num_prefix_hit_tokens - hits_before == 4 * 16
    assert_matches_hf(hf, tiny_qwen3, [second], outputs, N)
    assert_idle(llm16)


# ---- preemption -------------------------------------------------------------------------------
@pytest.mark.parametrize("prefix_caching", [True, False])
def test_preemption_matches_hf(tiny_qwen3, hf, prefix_caching):
    # 12 blocks of 16: four 42..45-token prompts take 3 blocks each, and each needs a 4th to decode
    llm = LLM(tiny_qwen3, kvcache_block_size=16, num_kvcache_blocks=12, enable_prefix_caching=prefix_caching)
    outputs = llm.generate(PREFIX_PROMPTS, greedy(N_PREFIX), use_tqdm=False)
    assert llm.core.scheduler.num_preemptions > 0
    assert_matches_hf(hf, tiny_qwen3, PREFIX_PROMPTS, outputs, N_PREFIX)
    assert_idle(llm)


# ---- requests joining mid-flight, queueing ----------------------------------------------------
def test_requests_added_between_steps_match_hf(llm16, tiny_qwen3, hf):
    core = llm16.core
    first = [POOL[0], POOL[7]]
    later = [POOL[2], POOL[5]]
    seqs = [core.add_request(core.encode_prompt(p), greedy(N)) for p in first]
    for _ in range(3):
        core.step()
    assert all(s.num_completion_tokens > 0 and not s.is_finished for s in seqs)
    seqs += [core.add_request(core.encode_prompt(p), greedy(N)) for p in later]
    core.step()
    num_prefill, num_decode = core.last_step
    assert num_prefill > 0 and num_decode == 2, "the new requests did not join the running batch"
    steps = 0
    while core.has_unfinished():
        core.step()
        steps += 1
        assert steps < 100
    for seq, prompt in zip(seqs, first + later):
        assert seq.finish_reason == "length"
        assert seq.completion_token_ids == hf.greedy(tiny_qwen3, prompt, N)
    assert_idle(llm16)


def test_max_num_seqs_queueing_matches_hf(tiny_qwen3, hf):
    llm = LLM(tiny_qwen3, kvcache_block_size=16, num_kvcache_blocks=512, max_num_seqs=2)
    log = record_schedules(llm)
    prompts = POOL[2:7]
    outputs = llm.generate(prompts, greedy(N), use_tqdm=False)
    assert max(len(step) for step in log) == 2
    assert_matches_hf(hf, tiny_qwen3, prompts, outputs, N)
    assert_idle(llm)


# ---- length limits ----------------------------------------------------------------------------
def test_max_model_len(tiny_qwen3, hf):
    llm = LLM(tiny_qwen3, kvcache_block_size=16, num_kvcache_blocks=64, max_model_len=32)
    prompt = rand_ids(20, 20)
    out = llm.generate([prompt], greedy(100), use_tqdm=False)[0]
    assert out["finish_reason"] == "length" and len(out["token_ids"]) == 12
    assert out["token_ids"] == hf.greedy(tiny_qwen3, prompt, 12)
    out = llm.generate([rand_ids(31, 21)], greedy(100), use_tqdm=False)[0]
    assert out["finish_reason"] == "length" and len(out["token_ids"]) == 1
    assert_idle(llm)
    # a prompt with no room to generate is refused before anything of the batch is queued
    with pytest.raises(ValueError, match="max_model_len"):
        llm.generate([prompt, rand_ids(32, 22)], greedy(4), use_tqdm=False)
    assert_idle(llm)
    with pytest.raises(ValueError):
        llm.generate([rand_ids(50, 23)], greedy(4), use_tqdm=False)
    # the engine still serves a valid request
    out = llm.generate([prompt], greedy(100), use_tqdm=False)[0]
    assert out["token_ids"] == hf.greedy(tiny_qwen3, prompt, 12)
    assert_idle(llm)


def test_prompt_larger_than_the_cache(tiny_qwen3, hf):
    llm = LLM(tiny_qwen3, kvcache_block_size=16, num_kvcache_blocks=2)
    with pytest.raises(ValueError, match="capacity"):
        llm.generate([rand_ids(40, 30)], greedy(4), use_tqdm=False)
    assert_idle(llm)
    # a sequence also stops growing at the cache's capacity (32 tokens)
    out = llm.generate([POOL[2]], greedy(100), use_tqdm=False)[0]
    assert out["finish_reason"] == "length" and len(out["token_ids"]) == 32 - 15
    assert out["token_ids"][:N] == hf.greedy(tiny_qwen3, POOL[2], N)
    assert_idle(llm)


# ---- sampling and stopping end to end ---------------------------------------------------------
def test_seeded_sampling(llm16):
    prompt = POOL[2]
    seeded = SamplingParams(temperature=1.0, seed=1234, max_tokens=8, ignore_eos=True)
    alone = llm16.generate([prompt], seeded, use_tqdm=False)[0]["token_ids"]
    assert len(alone) == 8
    assert llm16.generate([prompt], seeded, use_tqdm=False)[0]["token_ids"] == alone
    # batched with other requests (unseeded, seeded, filtered, greedy) it draws the same tokens
    others = [SamplingParams(temperature=0.7, max_tokens=5, ignore_eos=True),
              SamplingParams(temperature=1.0, seed=99, top_k=20, top_p=0.9, max_tokens=12, ignore_eos=True),
              greedy(3)]
    outputs = llm16.generate([POOL[7], POOL[1], prompt, POOL[4]], [others[0], others[1], seeded, others[2]],
                             use_tqdm=False)
    assert outputs[2]["token_ids"] == alone
    # a different seed draws differently (8 tokens from a flat-ish distribution over 152k)
    other_seed = SamplingParams(temperature=1.0, seed=4321, max_tokens=8, ignore_eos=True)
    assert llm16.generate([prompt], other_seed, use_tqdm=False)[0]["token_ids"] != alone
    # no seed: still samples valid tokens to the end
    out = llm16.generate([prompt], SamplingParams(temperature=1.0, max_tokens=8, ignore_eos=True),
                         use_tqdm=False)[0]
    assert len(out["token_ids"]) == 8 and out["finish_reason"] == "length"
    assert all(0 <= t < 151936 for t in out["token_ids"])
    assert_idle(llm16)


def test_stop_token_ids(llm16, tiny_qwen3, hf):
    reference = hf.greedy(tiny_qwen3, POOL[5], N)
    stop_at = next(i for i in range(2, N) if reference[i] not in reference[:i])
    outputs = llm16.generate([POOL[5], POOL[3]],
                             [greedy(N, stop_token_ids=[reference[stop_at]]), greedy(N)], use_tqdm=False)
    assert outputs[0]["token_ids"] == reference[:stop_at + 1]
    assert outputs[0]["finish_reason"] == "stop"
    assert outputs[1]["token_ids"] == hf.greedy(tiny_qwen3, POOL[3], N)
    assert outputs[1]["finish_reason"] == "length"
    assert_idle(llm16)


@pytest.mark.parametrize("batch", [1, 2, 3, 5])
def test_step_inputs_start_on_16_byte_boundaries(llm16, batch):
    """Every uploaded step tensor (the batch's and the extra arrays that share its copy, of mixed
    dtypes) starts 16-byte aligned whatever the batch and token counts, so a Triton kernel meets one
    pointer alignment and never compiles a new variant mid-serving."""
    runner = llm16.core.runner
    lens = np.arange(1, batch + 1, dtype=np.int32)
    tables = np.arange(batch * 3, dtype=np.int32).reshape(batch, 3)
    inputs = StepInputs(np.arange(int(lens.sum()), dtype=np.int64), np.arange(int(lens.sum()), dtype=np.int64),
                        np.arange(int(lens.sum()), dtype=np.int64), lens, lens + 2, tables,
                        np.cumsum(lens).astype(np.int64) - 1)
    extra = [np.arange(2 * batch + 1, dtype=np.int64), np.linspace(0, 1, batch + 3, dtype=np.float32),
             np.arange(3 * batch + 2, dtype=np.int32)]
    batch_t, extra_t = runner._make_batch(inputs, extra)
    for array, tensor in [(inputs.input_ids, batch_t.input_ids), (inputs.positions, batch_t.positions),
                          (inputs.slot_mapping, batch_t.slot_mapping), (inputs.seq_lens, batch_t.seq_lens),
                          (inputs.block_tables, batch_t.block_tables), (inputs.logits_indices, batch_t.logits_indices),
                          *zip(extra, extra_t)]:
        assert tensor.data_ptr() % 16 == 0
        assert tensor.tolist() == array.tolist()
