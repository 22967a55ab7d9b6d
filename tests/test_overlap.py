"""The overlapped step loop (Config.overlap_scheduling) on CPU, against the serial one.

With overlap, step N+1 is scheduled and launched before step N's sampled ids are read: N+1 takes
them on the device, and a request that finishes in step N may still hold a row of step N+1, whose
token is dropped. On CPU this brings no speed, but every rule must hold all the same.
"""
from __future__ import annotations

import pytest

from asyncllm.llm import LLM
from asyncllm.sampling_params import SamplingParams
from helpers import assert_all_blocks_free, random_prompts

pytestmark = pytest.mark.timeout(300)

SMALL = dict(num_kvcache_blocks=12, kvcache_block_size=16, max_num_batched_tokens=48, max_num_seqs=6)
PROMPTS = random_prompts(10, seed=11, lo=5, hi=90)


@pytest.fixture(scope="module")
def llms(tiny_qwen3):
    """(serial, overlapped) engines of each shape: a roomy one, and a small cache with a small token
    budget (chunked prefill and preemption)."""
    made = {}

    def get(shape: str, overlap: bool) -> LLM:
        key = (shape, overlap)
        if key not in made:
            kw = SMALL if shape == "small" else dict(num_kvcache_blocks=128, kvcache_block_size=16)
            made[key] = LLM(tiny_qwen3, overlap_scheduling=overlap, **kw)
        return made[key]
    return get


def tokens(llm: LLM, prompts, params) -> list[list[int]]:
    outputs = llm.generate(prompts, params, use_tqdm=False)
    assert_all_blocks_free(llm)
    assert not llm.core.has_unfinished() and llm.core.requests == {}
    for out in outputs:
        assert all(0 <= t < llm.core.vocab_size for t in out["token_ids"])
    return [out["token_ids"] for out in outputs]


@pytest.mark.parametrize("shape", ["roomy", "small"])
def test_greedy_and_seeded_tokens_equal_with_and_without_overlap(llms, shape):
    greedy = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    seeded = [SamplingParams(temperature=0.9, top_k=40, top_p=0.9, max_tokens=12, seed=i, ignore_eos=True)
              for i in range(len(PROMPTS))]
    serial, overlapped = llms(shape, False), llms(shape, True)
    assert overlapped.core.overlap and not serial.core.overlap
    for params in (greedy, seeded):
        assert tokens(overlapped, PROMPTS, params) == tokens(serial, PROMPTS, params)
    if shape == "small":
        assert overlapped.core.scheduler.num_preemptions > 0  # the equality covered preemption
    else:
        # the second run of the same prompts hit the prefix cache, and still matched
        assert overlapped.core.block_manager.num_prefix_hit_tokens > 0


def record_steps(monkeypatch, llm: LLM) -> list[list[tuple[str, int]]]:
    steps = []
    schedule = llm.core.scheduler.schedule

    def recording():
        out = schedule()
        if not out.is_empty:
            steps.append([(item.seq.request_id, item.num_tokens) for item in out.scheduled])
        return out
    monkeypatch.setattr(llm.core.scheduler, "schedule", recording)
    return steps


def test_a_request_that_stops_keeps_one_extra_row_whose_token_is_never_delivered(llms, monkeypatch):
    prompt = PROMPTS[0]
    free_run = tokens(llms("roomy", False), [prompt], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))[0]
    stop_id = free_run[3]
    stops_at = free_run.index(stop_id)  # the first time it comes
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, stop_token_ids=[stop_id])
    for overlap in (False, True):
        llm = llms("roomy", overlap)
        steps = record_steps(monkeypatch, llm)
        out = llm.generate([prompt], params, use_tqdm=False)[0]
        monkeypatch.undo()
        assert out["token_ids"] == free_run[:stops_at + 1] and out["finish_reason"] == "stop"
        # serial: one prefill step, then a decode per token after the first; overlapped: one more
        # step, launched before the stop token was read
        assert len(steps) == stops_at + 1 + overlap
        assert_all_blocks_free(llm)


def test_max_tokens_is_known_in_advance_so_no_extra_row_is_spent(llms, monkeypatch):
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    llm = llms("roomy", True)
    steps = record_steps(monkeypatch, llm)
    out = llm.generate([PROMPTS[1]], params, use_tqdm=False)[0]
    assert len(out["token_ids"]) == 5 and out["finish_reason"] == "length"
    assert len(steps) == 5  # prefill + 4 decodes: the step after the 5th token is never launched


def test_finishing_a_request_with_a_token_in_flight_drops_that_token(llms):
    llm = llms("roomy", True)
    core = llm.core
    seq = core.add_request(PROMPTS[2], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))
    delivered = []
    for _ in range(4):
        delivered += [t for event in core.step() for t in event.new_token_ids]
    assert seq.num_in_flight == 1  # the step in flight samples its next token
    assert seq.completion_token_ids == delivered  # the engine's tokens: known values only
    core.finish_request(seq.request_id, "abort")
    assert seq.num_in_flight == 0 and seq.completion_token_ids == delivered  # never delivered
    assert core.step() == [] and core.drain() == []  # the step in flight resolves, and drops its row
    assert not core.has_unfinished()
    assert_all_blocks_free(core)


def test_a_failed_step_leaves_nothing_in_flight(llms, monkeypatch):
    llm = llms("small", True)
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    reference = tokens(llm, PROMPTS[:4], params)
    launch = llm.core.runner.launch
    calls = []

    def failing_launch(plan, prev, **kwargs):
        calls.append(1)
        if len(calls) == 5:
            raise RuntimeError("device fell over")
        return launch(plan, prev, **kwargs)
    monkeypatch.setattr(llm.core.runner, "launch", failing_launch)
    with pytest.raises(RuntimeError, match="device fell over"):
        llm.generate(PROMPTS[:4], params, use_tqdm=False)
    monkeypatch.undo()
    assert not llm.core.has_unfinished() and llm.core.requests == {}
    assert_all_blocks_free(llm)
    assert tokens(llm, PROMPTS[:4], params) == reference


def test_overlap_option_is_validated(tiny_qwen3):
    with pytest.raises(ValueError, match="Config.overlap_scheduling: expected a bool or None"):
        LLM(tiny_qwen3, overlap_scheduling="yes")


def reference_inputs(sched, block_size: int, prev_rows: dict) -> dict[str, list]:
    """A step's inputs token by token, in plain Python: what ModelRunner.build_inputs must give.
    prev_rows: each request's row among the sampled ids of the step before (the one in flight)."""
    out = {name: [] for name in ("input_ids", "positions", "slot_mapping", "query_lens", "seq_lens", "logits_indices",
                                 "pending_at", "pending_rows")}
    width = max(len(item.seq.block_table) for item in sched.scheduled)
    out["block_tables"] = [item.seq.block_table + [0] * (width - len(item.seq.block_table)) for item in sched.scheduled]
    for item in sched.scheduled:
        seq, start = item.seq, item.seq.num_computed_tokens
        for position in range(start, start + item.num_tokens):
            if position >= len(seq.token_ids):  # the last token, sampled by the step in flight
                assert position == len(seq) - 1 == len(seq.token_ids) and seq.num_in_flight == 1
                out["pending_at"].append(len(out["input_ids"]))
                out["pending_rows"].append(prev_rows[seq.uid])
                out["input_ids"].append(0)  # the plan's value there: the runner fills it in
            else:
                out["input_ids"].append(seq.token_ids[position])
            out["positions"].append(position)
            out["slot_mapping"].append(seq.block_table[position // block_size] * block_size + position % block_size)
        out["query_lens"].append(item.num_tokens)
        out["seq_lens"].append(start + item.num_tokens)
        if item.samples:
            out["logits_indices"].append(len(out["input_ids"]) - 1)
    return out


@pytest.mark.parametrize("shape", ["roomy", "small"])
def test_every_steps_inputs_match_a_token_by_token_reference(llms, shape, monkeypatch):
    """build_inputs' numpy (decode-only steps and steps with prefill chunks) against a
    plain-Python reference, on every step of runs with prefill chunks, preemption, prefix hits and
    tokens still in flight."""
    llm = llms(shape, True)
    runner = llm.core.runner
    build, checked = runner.build_inputs, {"decode-only": 0, "mixed": 0, "pending": 0, "in place": 0}
    prev_rows = {}

    def checking_build(plan, sampling_rows):
        inputs, in_flight = build(plan, sampling_rows)
        pending_at, pending_rows = in_flight.at, in_flight.rows
        sched = plan.engine_step  # the reference reads the engine's sequences, as the plan's builder does
        expected = reference_inputs(sched, runner.block_size, prev_rows)
        prev_rows.clear()
        prev_rows.update((uid, row) for row, uid in enumerate(plan.sampling_ids))
        got = dict(input_ids=inputs.input_ids, positions=inputs.positions, slot_mapping=inputs.slot_mapping,
                   query_lens=inputs.query_lens, seq_lens=inputs.seq_lens, logits_indices=inputs.logits_indices,
                   pending_at=pending_at, pending_rows=pending_rows, block_tables=inputs.block_tables)
        for name, array in got.items():
            assert array.tolist() == expected[name], name
        assert inputs.block_tables.dtype.name == "int32" and inputs.slot_mapping.dtype.name == "int64"
        checked["decode-only" if len(inputs.input_ids) == len(sched.scheduled) else "mixed"] += 1
        checked["pending"] += len(pending_at) > 0
        # one device copy exactly where the tokens in flight are the first rows in prev's order
        assert in_flight.in_place == (len(pending_at) > 0 and pending_at.tolist() == pending_rows.tolist()
                                      == list(range(len(pending_at))))
        checked["in place"] += in_flight.in_place
        return inputs, in_flight
    monkeypatch.setattr(runner, "build_inputs", checking_build)
    tokens(llm, PROMPTS, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    assert all(checked.values()), checked
