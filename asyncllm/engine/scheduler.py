"""Continuous batching: which sequences run this step, and how many tokens each.

Every step fills one token budget: running decodes first (one token each), then the next chunks
of prompts already being prefilled, then new requests from the queue. A sequence's work in a step
is just "the next n of its uncomputed tokens", so decodes, prefill chunks and prefix-cache hits are
one mechanism. When blocks run out the last running sequence in order is preempted (its KV dropped,
to be recomputed later), so the first one always makes progress and nothing deadlocks.

Order is (priority, deadline, arrival) everywhere (Sequence.sort_key): the waiting queue and the
running list are kept sorted by it, so admission takes the lowest priority value first and, among
equal priorities, the earliest deadline (SamplingParams.timeout; none counts as the latest), and
preemption takes the other end; with equal priorities and no deadlines that is first come first
served and newest preempted first. Requests that share one timeout (a server's default) keep
arrival order, since their deadlines follow their arrivals.

With a budget policy (engine/step_budget.py) the prefill chunks of a step are capped by a per-step
budget, and chunking is fair: a prefill that cannot finish in this step leaves up to half of the
budget to the ones after it when the next one is shorter.
"""
from __future__ import annotations

import bisect
import itertools
import operator
import time
from dataclasses import dataclass, field

from asyncllm.engine.block_manager import BlockManager
from asyncllm.engine.sequence import Sequence, SequenceStatus
from asyncllm.outputs import FinishReason

# prompt tokens a step may compute for requests with prompt_logprobs: each is a row of logits over the
# whole vocabulary (float32), memory the KV-cache sizing does not set aside beyond this many rows
MAX_SCORED_PROMPT_TOKENS = 256


@dataclass(slots=True)
class ScheduledSeq:
    seq: Sequence
    num_tokens: int  # tokens whose KV this step computes
    samples: bool  # this step reaches the sequence's last token, so its logits give the next one
    # speculative decoding: the draft tokens this decode verifies after its last token (num_tokens
    # counts them; their KV counts as computed only once accepted)
    draft_token_ids: list[int] | tuple = ()


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledSeq] = field(default_factory=list)
    num_batched_tokens: int = 0
    num_decodes: int = 0  # sequences that take one decode token this step
    num_draft_tokens: int = 0  # draft tokens the decodes verify (speculative decoding)
    has_pooling: bool = False  # an embedding request's chunk is in it (engine/pooling.py: PoolingPlan)
    # resolved before the next step is planned, never left in flight (overlap): some request speculates
    serial: bool = False

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_batched_tokens: int, max_num_seqs: int,
                 budget_policy=None):
        self.block_manager = block_manager
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        # None: prefill takes whatever the decodes leave of max_num_batched_tokens (throughput
        # first); else its prefill_budget(num_decodes, num_prompts) caps the step's prefill tokens (a StepBudget)
        self.budget_policy = budget_policy
        self.waiting: list[Sequence] = []  # sorted by seq.sort_key: (priority, deadline, arrival)
        self.running: list[Sequence] = []  # sorted by seq.sort_key: the last is the first preempted
        self.num_preemptions = 0

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    def add(self, seq: Sequence) -> None:
        bisect.insort(self.waiting, seq, key=_sort_key)

    def finish(self, seq: Sequence, reason: FinishReason) -> None:
        """End a sequence (finished or aborted) wherever it is, and free its blocks at once."""
        if seq.status == SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status == SequenceStatus.WAITING:
            self.waiting.remove(seq)
        else:
            return
        self.block_manager.free(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.block_manager.free(seq)
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        bisect.insort(self.waiting, seq, key=_sort_key)

    def _reserve(self, seq: Sequence, num_tokens: int, scheduled_ids: set[int], out: SchedulerOutput) -> bool:
        """Find blocks for num_tokens more tokens of a running seq, preempting from the end of the
        running order (the highest priority value, newest first) until seq itself is the last.

        A victim already scheduled in this step (a decode behind an older or higher-priority prefill,
        which fair chunking or priority let ahead) is taken out of the step first: otherwise the
        prefill would be the one preempted, for a sequence that comes after it. Decodes reserve in
        running order, so only a prefill's reservation can meet a scheduled victim.

        Returns False when seq itself had to be preempted.
        """
        bm = self.block_manager
        while bm.num_blocks_needed(seq, num_tokens) > bm.num_free_blocks:
            victim = self.running[-1]
            if id(victim) in scheduled_ids:
                index = next(i for i, item in enumerate(out.scheduled) if item.seq is victim)
                taken_out = out.scheduled.pop(index)
                out.num_batched_tokens -= taken_out.num_tokens
                out.num_draft_tokens -= len(taken_out.draft_token_ids)
                out.num_decodes -= index < out.num_decodes
                scheduled_ids.discard(id(victim))
            self._preempt(victim)
            if victim is seq:
                return False
        bm.allocate(seq, num_tokens)
        return True

    def _fit_drafts(self, seq: Sequence, drafts: list[int], budget: int) -> list[int]:
        """The draft tokens (after its one decode token, whose block is reserved) that seq verifies
        this step: as many as the budget and its blocks plus the free ones hold, their blocks
        allocated. Never preempts: a guess is not worth another request's KV."""
        bm = self.block_manager
        room = (len(seq.block_table) + bm.num_free_blocks) * seq.block_size - seq.num_computed_tokens - 1
        num = max(0, min(len(drafts), budget, room))
        if num:
            bm.allocate(seq, 1 + num)
        return drafts[:num]

    def _tokens_that_fit(self, seq: Sequence, num_tokens: int) -> int:
        """How many of num_tokens fit in seq's current blocks plus the free ones."""
        capacity = (len(seq.block_table) + self.block_manager.num_free_blocks) * seq.block_size
        return max(0, min(num_tokens, capacity - seq.num_computed_tokens))

    def _fair_chunk(self, num_tokens: int, budget: int, followers) -> int:
        """num_tokens of a prefill, at most budget. One that cannot finish in this step, with a
        shorter prefill next in order, leaves the prefills after it (followers, in order) as much
        as they can take of up to half of the budget: short prompts are not stuck behind a long
        one for its whole length, and the long one still advances every step. Equal prompts keep
        first come first served. Looks at no more followers than it takes to fill that half."""
        if num_tokens <= budget or self.budget_policy is None:
            return min(num_tokens, budget)
        first = next(followers, None)
        if first is None or first.num_uncomputed_tokens >= num_tokens:
            return budget
        half = budget // 2
        if self.block_manager.num_free_blocks * self.block_manager.block_size < num_tokens + half:
            # a tight cache: first come first served. Shorter prompts let ahead would decode in blocks
            # this one needs, and it would be preempted for them
            return budget
        left_for_them = first.num_uncomputed_tokens
        for seq in followers:
            if left_for_them >= half:
                break
            left_for_them += seq.num_uncomputed_tokens
        return budget - min(left_for_them, half)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        scoring_left = MAX_SCORED_PROMPT_TOKENS  # prompt_logprobs rows left in this step
        scheduled_ids: set[int] = set()

        def take(seq: Sequence, num_tokens: int) -> None:
            nonlocal budget
            samples = seq.num_computed_tokens + num_tokens == len(seq)
            if seq.pooling is not None:  # an embedding: its last chunk pools hidden states, never samples
                samples = False
                out.has_pooling = True
            out.scheduled.append(ScheduledSeq(seq, num_tokens, samples))
            out.num_batched_tokens += num_tokens
            budget -= num_tokens
            scheduled_ids.add(id(seq))

        # 1. decodes, oldest first. One whose token in flight will be its last is left out: with
        # overlapped steps it is still running when the next step is scheduled. This loop runs for
        # every decoding sequence every step, so it is written for speed: a decode needs a new block
        # (and maybe a preemption) only when its last block is full, once every block_size tokens
        block_size, running = self.block_manager.block_size, SequenceStatus.RUNNING
        prefills = []  # running sequences with more than one token to compute, in running order
        num_draft_tokens = 0
        for seq in list(self.running):  # a copy: preemption below removes from self.running
            num_computed = seq.num_computed_tokens
            length = len(seq.token_ids) + seq.num_in_flight
            if length - num_computed != 1:
                if length - num_computed > 1:
                    prefills.append(seq)
                continue
            if length >= seq.max_len or budget == 0 or seq.status is not running:  # not running: preempted
                if seq.pooling is not None:  # an embedding's last prompt token is a prefill chunk, not a decode
                    prefills.append(seq)
                continue
            if num_computed >= len(seq.block_table) * block_size and not self._reserve(seq, 1, scheduled_ids, out):
                continue
            if seq.draft_token_ids:  # speculative decoding (engine/speculation.py)
                drafts = self._fit_drafts(seq, seq.draft_token_ids, budget - 1)
                num_draft_tokens += len(drafts)
                budget -= len(drafts)
                out.scheduled.append(ScheduledSeq(seq, 1 + len(drafts), True, drafts))
            else:
                out.scheduled.append(ScheduledSeq(seq, 1, True))
            scheduled_ids.add(id(seq))
            budget -= 1
        out.num_decodes, out.num_draft_tokens = len(out.scheduled), num_draft_tokens
        out.num_batched_tokens = out.num_decodes + num_draft_tokens
        prefills = [seq for seq in prefills if seq.status is running]  # a decode's block may have preempted some
        if self.budget_policy is not None:
            # decodes always run; what prefill may take on top of them follows from the target step
            # time, planned for the decodes that the prompts being prefilled and waiting will add
            budget = min(budget, self.budget_policy.prefill_budget(out.num_decodes, len(prefills) + len(self.waiting)))
        # 2. the next chunks of prompts already admitted
        for i, seq in enumerate(prefills):
            if budget == 0:
                break
            if seq.status != SequenceStatus.RUNNING:
                continue  # preempted above
            followers = itertools.chain(itertools.islice(prefills, i + 1, None), self.waiting)
            num_tokens = self._fair_chunk(seq.num_uncomputed_tokens, budget, followers)
            if seq.prompt_logprobs is not None:
                num_tokens = min(num_tokens, scoring_left)
                if num_tokens == 0:
                    continue
            fit = self._tokens_that_fit(seq, num_tokens)
            if fit == 0:
                if self._reserve(seq, 1, scheduled_ids, out):
                    fit = self._tokens_that_fit(seq, num_tokens)
                else:
                    continue
            self.block_manager.allocate(seq, fit)
            take(seq, fit)
            if seq.prompt_logprobs is not None:
                scoring_left -= fit
        # 3. new (or preempted) requests in waiting order (priority, deadline, arrival); no preemption on their behalf
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            # prompt_logprobs and mean pooling: every position computed, so no prefix-cache hits
            if not seq.block_table and seq.prompt_logprobs is None and not seq.pools_every_token:
                self.block_manager.match_prefix(seq)
            followers = itertools.islice(self.waiting, 1, None)
            num_tokens = self._tokens_that_fit(seq, self._fair_chunk(seq.num_uncomputed_tokens, budget, followers))
            if seq.prompt_logprobs is not None:
                num_tokens = min(num_tokens, scoring_left)
                scoring_left -= num_tokens
            if num_tokens == 0:
                self.block_manager.free(seq)
                break
            del self.waiting[0]
            self.block_manager.allocate(seq, num_tokens)
            if seq.first_scheduled_time is None:
                seq.first_scheduled_time = time.monotonic()
                seq.num_cached_prompt_tokens = seq.num_computed_tokens
                self.block_manager.num_prefix_query_tokens += len(seq)
                self.block_manager.num_prefix_hit_tokens += seq.num_computed_tokens
            seq.status = SequenceStatus.RUNNING
            bisect.insort(self.running, seq, key=_sort_key)
            take(seq, num_tokens)
        if out.num_draft_tokens:
            self._cap_drafts(out)
        return out

    def _cap_drafts(self, out: SchedulerOutput) -> None:
        """Keep the step's logits rows (one per sampling row, one per draft) within max_num_seqs, the
        rows the memory probe sized the sampler for: drafts cut from the last speculating rows. Their
        blocks stay allocated until the step resolves (and truncates past the accepted tokens)."""
        excess = sum(item.samples for item in out.scheduled) + out.num_draft_tokens - self.max_num_seqs
        for item in reversed(out.scheduled):
            if excess <= 0:
                return
            if item.draft_token_ids:
                cut = min(excess, len(item.draft_token_ids))
                item.draft_token_ids = item.draft_token_ids[:len(item.draft_token_ids) - cut]
                item.num_tokens -= cut
                out.num_batched_tokens -= cut
                out.num_draft_tokens -= cut
                excess -= cut

    def commit(self, out: SchedulerOutput) -> None:
        """Record that the scheduled KV was computed (before sampled tokens are appended)."""
        commit_computed = self.block_manager.commit_computed
        for item in out.scheduled:
            # a row's draft tokens count once verified (EngineCore's resolve: the accepted ones)
            item.seq.num_computed_tokens += item.num_tokens - len(item.draft_token_ids)
            commit_computed(item.seq)

_sort_key = operator.attrgetter("sort_key")
