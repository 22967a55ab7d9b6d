"""A resolved step's sampled tokens into the requests: each token in its place, the finishes it
brings (stop, length, a grammar's end or refusal), the blocks it lets the prefix cache hash, and the
StepEvent of each request. Takes the EngineCore (engine/core.py, which calls it; not imported here:
a cycle).

A step with speculating rows (engine/speculation.py) gives a row several tokens: they are taken in
order and cut at the first that ends it, so nothing past a stop (or max_tokens) is kept; the row's
accepted drafts join its computed KV, and the blocks that only its rejected drafts used are freed.
"""
from __future__ import annotations

from asyncllm.engine.scheduler import ScheduledSeq
from asyncllm.engine.sequence import Sequence, SequenceStatus
from asyncllm.engine.step_event import StepEvent
from asyncllm.outputs import FinishReason


def step_events(core, sampling: list[ScheduledSeq], token_ids: list[int], per_row: list[int] | None,
                logprobs: list | None) -> list[StepEvent]:
    """The events of a step's sampling rows (sampling), given their tokens: one each (per_row None),
    or per_row[i] of row i's (speculative decoding). logprobs: one per token, None where not asked."""
    if per_row is not None:
        return _speculative_events(core, sampling, token_ids, per_row, logprobs)
    events = []
    block_size = core.block_manager.block_size
    for row, (item, token_id) in enumerate(zip(sampling, token_ids)):
        seq = item.seq
        if seq.status == SequenceStatus.FINISHED:
            continue  # ended while this step was in flight: its token is dropped, never delivered
        # steps resolve in launch order: the first of its tokens in flight is this one
        index = len(seq.token_ids)
        seq.token_ids.append(token_id)
        seq.num_in_flight -= 1
        length = index + 1
        # most tokens end nothing: the full check only where one of its conditions can hold
        reason = finish_reason(core, seq, token_id, length) if token_id in seq.stop_ids or \
            length >= seq.max_len or seq.grammar is not None else None
        if reason is not None:
            event = _event(core, seq, index, [token_id], reason)
        else:  # most tokens: the event inline (this loop runs for every decoding row every step)
            if length % block_size == 0 and seq.num_computed_tokens > index:
                # the token closes a block whose KV a later step already computed: it can be hashed now
                core.block_manager.commit_computed(seq)
            event = StepEvent(seq, [token_id], None)
            if seq.prompt_logprobs is not None and index == seq.num_prompt_tokens:
                event.prompt_logprobs = seq.prompt_logprobs
        if logprobs is not None and logprobs[row] is not None and event.error is None:
            event.logprobs = [logprobs[row]]
        events.append(event)
    return events


def _speculative_events(core, sampling: list[ScheduledSeq], token_ids: list[int], per_row: list[int],
                        logprobs: list | None) -> list[StepEvent]:
    events, first = [], 0
    for item, count in zip(sampling, per_row):
        new_ids = token_ids[first:first + count]
        row_logprobs = None if logprobs is None else logprobs[first:first + count]
        first += count
        seq = item.seq
        if seq.status == SequenceStatus.FINISHED:
            continue  # ended while this step was in flight: its tokens are dropped, never delivered
        if item.draft_token_ids:
            core.speculation.record(seq, len(item.draft_token_ids), count - 1, core.num_steps)
        index = len(seq.token_ids)  # its first new token's
        seq.num_in_flight -= 1
        reason, taken = None, 0
        for token_id in new_ids:
            seq.token_ids.append(token_id)
            taken += 1
            length = len(seq.token_ids)
            if token_id in seq.stop_ids or length >= seq.max_len or seq.grammar is not None:
                reason = finish_reason(core, seq, token_id, length)
                if reason is not None:
                    break
        if reason is None:
            # the accepted drafts' KV (computed over the very tokens kept there) counts as computed;
            # the blocks past the next position go back (rejected positions are rewritten when reached)
            seq.num_computed_tokens += count - 1
            core.block_manager.truncate(seq, seq.num_computed_tokens + 1)
            core.block_manager.commit_computed(seq)
        event = _event(core, seq, index, new_ids[:taken], reason)
        if row_logprobs is not None and row_logprobs[0] is not None and event.error is None:
            event.logprobs = row_logprobs[:len(event.new_token_ids)]
        events.append(event)
    return events


def _event(core, seq: Sequence, index: int, new_ids: list[int], reason: FinishReason | None) -> StepEvent:
    """The event of seq's new tokens (the first at index in its tokens; their last ending it with
    reason, if any: seq ended here, its tokens in flight dropped). A token its grammar refused is
    taken back, and the event carries the grammar's error instead."""
    if reason is None:
        event = StepEvent(seq, new_ids, None)
    else:
        refused = reason is FinishReason.ABORT and seq.grammar is not None and seq.grammar.error is not None
        if refused:
            del seq.token_ids[-1]
            new_ids = new_ids[:-1]
        core._end(seq, reason)
        if seq.request_finished:
            core.requests.pop(seq.request_id, None)
        if refused:
            return StepEvent(seq, new_ids, reason, request_finished=seq.request_finished, error=seq.grammar.error)
        event = StepEvent(seq, new_ids, reason, request_finished=seq.request_finished)
        token_id = new_ids[-1]
        if reason is FinishReason.STOP and token_id in seq.params.stop_token_ids and not is_eos(core, seq, token_id):
            event.stop_reason = token_id
    if seq.prompt_logprobs is not None and index == seq.num_prompt_tokens:
        event.prompt_logprobs = seq.prompt_logprobs
    return event


def is_eos(core, seq: Sequence, token_id: int) -> bool:
    return not seq.params.ignore_eos and token_id in core.eos_token_ids


def finish_reason(core, seq: Sequence, token_id: int, length: int) -> FinishReason | None:
    """Why seq ends with token_id as its length-th token, if it does."""
    params = seq.params
    if (is_eos(core, seq, token_id) or token_id in params.stop_token_ids) and \
            length - seq.num_prompt_tokens > params.min_tokens:
        return FinishReason.STOP
    if seq.grammar is not None:
        seq.grammar.catch_up(seq.token_ids, seq.num_prompt_tokens)
        if seq.grammar.error is not None:  # its constraints left no token the grammar allows
            return FinishReason.ABORT
        if seq.grammar.is_terminated:  # the output is complete: the grammar allows nothing more
            return FinishReason.STOP
    if length >= seq.max_len:  # the scheduler plans no step past this length either
        return FinishReason.LENGTH
    return None
