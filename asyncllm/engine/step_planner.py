"""The engine's side of the step contract: a SchedulerOutput as the StepPlan the runner runs
(asyncllm/step_plan.py). One pass of plain Python over the step's rows; the runner does the rest in numpy."""
from __future__ import annotations

import numpy as np

from asyncllm.engine.scheduler import SchedulerOutput
from asyncllm.engine.sequence import Sequence
from asyncllm.engine.speculation import verified_drafts
from asyncllm.runner.request_table import HISTORY, request_flags
from asyncllm.step_plan import PromptLogprobsPlan, RequestSampling, StepPlan


def plan_step(sched: SchedulerOutput) -> StepPlan:
    """The step's plan. Plans its prompt positions' log-probabilities too (plan_prompt_logprobs),
    which records them as planned: call it once per step launched."""
    input_ids, starts, query_lens, block_rows, logits_indices = [], [], [], [], []
    in_flight_rows, sampling, new_requests = [], [], []
    num_tokens = 0
    for item in sched.scheduled:
        seq, num_new = item.seq, item.num_tokens
        token_ids, start = seq.token_ids, seq.num_computed_tokens
        drafts = item.draft_token_ids
        # its last token is in flight (sampled by the step in flight): the runner fills it in
        in_flight = start + num_new > len(token_ids)
        if num_new == 1:
            input_ids.append(0 if in_flight else token_ids[start])
        elif drafts:  # a speculating decode: its last token (known: speculation waits for it), then the drafts
            input_ids.append(token_ids[start])
            input_ids.extend(drafts)
        else:
            input_ids.extend(token_ids[start:start + num_new])
            if in_flight:
                input_ids.append(0)
        num_tokens += num_new
        starts.append(start)
        query_lens.append(num_new)
        block_rows.append(seq.block_table)
        if item.samples:
            if not seq.in_runner_table:  # its first sampling step: the runner's table learns its settings
                seq.in_runner_table = True
                new_requests.append(request_sampling(seq))
            if drafts:  # every position samples: the target's token there, against the draft
                logits_indices.extend(range(num_tokens - num_new, num_tokens))
                sampling.extend([seq.uid] * num_new)
            else:
                if in_flight:
                    in_flight_rows.append(len(sampling))
                logits_indices.append(num_tokens - 1)
                sampling.append(seq.uid)
    plan = StepPlan(input_ids, starts, query_lens, block_rows, logits_indices, in_flight_rows, sampling,
                    plan_prompt_logprobs(sched), engine_step=sched, new_requests=new_requests)
    if sched.num_draft_tokens:
        plan.draft_token_ids, plan.rows_per_request, plan.draft_probs = verified_drafts(sched)
    return plan


def request_sampling(seq: Sequence) -> RequestSampling:
    """seq's sampling settings as the plain values the runner keeps (made once, at its first sampling
    step), with its tokens so far."""
    p = seq.params
    settings = RequestSampling(
        seq.uid, [], seq.num_prompt_tokens, p.temperature, p.top_k, p.top_p,
        p.min_p, p.seed, p.presence_penalty, p.frequency_penalty, p.repetition_penalty, p.uses_penalties,
        p.logit_bias, seq.allowed_token_ids, seq.early_stop_ids, p.min_tokens, seq.bad_word_ids, p.logprobs,
        seq.adjusts_logits, seq.grammar)
    # the runner reads a request's tokens only where its sampling does (HISTORY): a plain request's
    # 32k-token prompt is neither copied nor sent to tensor-parallel workers
    if request_flags(settings) & HISTORY:
        settings.token_ids = list(seq.token_ids)
    return settings


def plan_prompt_logprobs(sched: SchedulerOutput) -> PromptLogprobsPlan | None:
    """The step's prompt positions not yet scored for requests with prompt_logprobs (a preempted
    request recomputing its prompt is not scored twice); None when there are none."""
    rows, targets, spans, offset = [], [], [], 0
    for item in sched.scheduled:
        seq = item.seq
        k = seq.params.prompt_logprobs
        if k is not None:
            start = seq.num_computed_tokens
            lo = max(start, seq.num_prompt_logprobs_planned)
            hi = min(start + item.num_tokens, seq.num_prompt_tokens - 1)
            if hi > lo:
                rows.extend(range(offset + lo - start, offset + hi - start))
                targets.extend(seq.token_ids[lo + 1:hi + 1])
                spans.append((seq, hi - lo, k))
                seq.num_prompt_logprobs_planned = hi
        offset += item.num_tokens
    if not rows:
        return None
    return PromptLogprobsPlan(np.asarray(rows, dtype=np.int64), targets, spans, max(k for _, _, k in spans))
