"""Speculative decoding, the engine's side: which decoding rows speculate this step, their draft tokens
(from the proposer: speculative/), what the runner samples for each verified position, and what
each row's acceptance teaches for its next steps.

A speculating row verifies its k drafts in one step: the runner computes 1 + k query tokens (its
last accepted token, then the drafts) over the cached context and samples every position; the
engine keeps the drafts up to the first one the target rejects, then the target's own token there
(or the bonus token after the last draft). docs/ARCHITECTURE.md "Speculative decoding" tells the rest.

Adaptive, per request: its acceptance rate (a running average) sets how many drafts it proposes
(k scaled by it). Where a rejected draft costs a forward (a draft model:
Proposer.drafts_cost_forwards), a request's first speculation is a cheap probe (its rate starts at
LOW_ACCEPTANCE: ceil(k * LOW_ACCEPTANCE) drafts, 1 at k = 4), and drafts that pay ramp it up (k = 4:
1, 3, then 4 drafts); an n-gram lookup's wrong drafts cost little more than a lost overlap, so its
rate starts at 1 (k drafts: a copy task's first wrong guess must not pause it). A request whose
rate falls below LOW_ACCEPTANCE stops speculating for a pause, then retries with such a probe: a
probe that fails pauses it again for twice as long (PAUSE_STEPS, 64, ... up to MAX_PAUSE_STEPS);
any step that pays (its own acceptance at least LOW_ACCEPTANCE) starts the backoff over. A draft
model that never pays then costs one probe before its first pause and speculates in at most
ceil(log2(n / PAUSE_STEPS)) + 1 of a request's first n (PAUSE_STEPS to MAX_PAUSE_STEPS) steps,
then in 1 of MAX_PAUSE_STEPS + 1: with a speculating step's extra cost e (in plain steps), the
overhead tends to e / MAX_PAUSE_STEPS, under 1% for any draft no larger than the target. A step
with more than MAX_SPECULATING_DECODES decoding rows speculates for none: a large batch is
compute-bound, and verifying drafts then costs what it saves. A proposer that has nothing for a
request (no n-gram match) teaches nothing about acceptance; the request looks again after 1, 2,
4, ... up to PAUSE_STEPS steps (Speculation._missed). Across requests (Speculation.engine_pause):
while every probe of a draft model has failed since one last paid, a new request's first probe waits
the pause the latest failed probe set, so a never-paying draft does not pay a probe and its prompt's
prefill by the draft in every request's first steps.
docs/ARCHITECTURE.md "Speculative decoding" derives these numbers.
"""
from __future__ import annotations

import math

from asyncllm.config import Config, SpeculativeConfig
from asyncllm.engine.scheduler import SchedulerOutput
from asyncllm.engine.sequence import Sequence, SequenceStatus
from asyncllm.speculative.draft_model import DraftModelProposer
from asyncllm.speculative.ngram import NgramProposer
from asyncllm.speculative.proposer import DraftRow, Proposer, SampledDrafts

# decoding rows past which a step speculates for none (a Config-free constant): a step of B rows
# verifying k drafts each computes B * (1 + k) tokens a weight read; at 32 * 5 = 160 an H100/H200's
# GEMMs are near compute-bound (the bf16 ridge is ~300 flops a byte, ~150-200 where they run), so
# verification's extra rows then cost about what their accepted tokens save
MAX_SPECULATING_DECODES = 32
# a request's running acceptance rate below which it pauses speculating, and a step's own rate at
# which it pays: just above a draft model's break-even, d + (v + s) / k with d its forward's cost in
# target steps (Qwen3-0.6B for -8B: ~0.18), v + s verification's extra rows and lost overlap (~0.2).
# Also where a retry after a pause, and a draft model's first speculation, start the rate: a probe
LOW_ACCEPTANCE = 0.25
PAUSE_STEPS = 32  # engine steps a paused request decodes one token at a time before its first retry
# the longest pause (each failed retry doubles it): an always-rejected draft's overhead tends to its
# probe's extra cost / MAX_PAUSE_STEPS, <= 2.2 / 256 < 1% with the draft a copy of the target; a
# request whose drafts start to pay again waits at most this long to speculate
MAX_PAUSE_STEPS = 256
ACCEPTANCE_WEIGHT = 0.5  # the newest step's weight in the running acceptance rate


def verified_drafts(sched: SchedulerOutput) -> tuple[list[int], list[int], list[tuple[int, object]]]:
    """(the draft each sampling position verifies, -1 at a row's last; each sampling row's positions;
    (its first position, q of the drafts it verifies) of each row whose drafts were drawn from q)."""
    drafts, counts, probs = [], [], []
    for item in sched.scheduled:
        if item.samples:
            if item.draft_token_ids and item.seq.draft_probs is not None:  # the scheduler may have cut drafts
                probs.append((len(drafts), item.seq.draft_probs[:len(item.draft_token_ids)]))
            drafts.extend(item.draft_token_ids)
            drafts.append(-1)
            counts.append(len(item.draft_token_ids) + 1)
    return drafts, counts, probs


def make_proposer(config: Config, tokenizer) -> Proposer:
    """config.speculative's proposer. A draft model's is built before the target's runner (on CUDA
    the target's memory probe then counts the draft's weights and KV cache as used)."""
    spec = config.speculative
    if spec.method == "draft_model":
        # a retry's catch-up (the tokens decoded while paused, then its last draft and the target's token)
        # replays one of the draft's graphs
        return DraftModelProposer(config, tokenizer, MAX_SPECULATING_DECODES, MAX_PAUSE_STEPS + 2)
    return NgramProposer(spec.prompt_lookup_min, spec.prompt_lookup_max)


class Speculation:
    def __init__(self, config: SpeculativeConfig, proposer: Proposer, max_logits_rows: int):
        self.num_speculative_tokens = config.num_speculative_tokens
        self.proposer = proposer  # (its setter also starts the engine's backoff over)
        # a step's logits rows (one per sampling row, one per draft) stay within this (the scheduler's
        # cap, max_num_seqs): drafts past it would be proposed, then cut, never verified
        self.max_logits_rows = max_logits_rows
        self._drafted: list[Sequence] = []  # the sequences given drafts by the last draft()
        # the sequences the proposer may keep something for: released when they end or are preempted
        self._proposed_for: set[Sequence] = set()
        # counters for stats(): draft tokens verified and accepted, and verifications (a row's step)
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.num_verifications = 0
        self.num_decode_steps = 0  # decoding rows' steps, speculating or not

    @property
    def proposer(self) -> Proposer:
        return self._proposer

    @proposer.setter
    def proposer(self, proposer: Proposer) -> None:
        self._proposer = proposer
        # the engine's backoff (_learn): the pause the latest failed probe of a proposer whose drafts
        # cost forwards set, where a new request's speculation starts; 0 since a step paid. A new
        # proposer has no record
        self.engine_pause = 0

    def draft(self, running: list[Sequence], step: int) -> bool:
        """Give this step's speculating rows of running their drafts (seq.draft_token_ids, read by
        the scheduler). Returns whether some running request would speculate: its step must then be
        resolved before the next is planned (a draft needs the last token's value), not overlapped."""
        for seq in self._drafted:
            seq.draft_token_ids, seq.draft_probs = [], None
        self._drafted = []
        for seq in [seq for seq in self._proposed_for if seq.status is not SequenceStatus.RUNNING]:
            self.release(seq)  # preempted (an ended one was released by the core): a draft model's blocks go back
        ready = [seq for seq in running if len(seq) - seq.num_computed_tokens == 1]
        self.num_decode_steps += len(ready)
        if len(ready) > MAX_SPECULATING_DECODES:
            return False
        wanting = [seq for seq in ready if step >= seq.drafts_paused_until and _may_speculate(seq)]
        rows, seqs, deferred = [], [], 0
        logits_room = self.max_logits_rows - len(ready)
        for seq in wanting:
            if seq.draft_acceptance is None:  # its first speculation
                seq.draft_acceptance = LOW_ACCEPTANCE if self.proposer.drafts_cost_forwards else 1.0
                if self.engine_pause and self.proposer.drafts_cost_forwards:
                    # the draft has failed every probe since it last paid, in any request: this one
                    # starts where their backoff is, and probes after that pause (a probe's catch-up
                    # is the draft's prefill of the whole prompt, its dearest step)
                    seq.draft_pause = self.engine_pause
                    seq.drafts_paused_until = step + self.engine_pause
                    deferred += 1
                    continue
            room = seq.max_len - len(seq) - 1  # every token it may still take, after the bonus one
            k = min(room, logits_room, math.ceil(self.num_speculative_tokens * seq.draft_acceptance))
            if k > 0 and not seq.num_in_flight:
                rows.append(DraftRow(seq.token_ids, k, seq, seq.params, seq.num_prompt_tokens))
                seqs.append(seq)
                logits_room -= k
        self._proposed_for.update(seqs)
        for seq, drafts in zip(seqs, self.proposer.propose(rows) if rows else ()):
            if drafts:
                seq.draft_token_ids = drafts
                seq.draft_miss_pause = 0
                seq.draft_probs = drafts.probs if isinstance(drafts, SampledDrafts) else None
                self._drafted.append(seq)
            elif drafts is not None:  # nothing to propose (no n-gram match)
                self._missed(seq, step)
            # None: the proposer could not this step (a draft model's KV blocks ran out); nothing learnt
        # no room for drafts (the step's rows alone fill max_num_seqs): nothing waits for this step's tokens
        return len(wanting) > deferred and self.max_logits_rows > len(ready)

    def release(self, seq: Sequence) -> None:
        """seq has ended or was preempted: the proposer drops what it kept for it."""
        self._proposed_for.discard(seq)
        self.proposer.release(seq)

    def record(self, seq: Sequence, num_drafts: int, num_accepted: int, step: int) -> None:
        """A verification: num_accepted of seq's num_drafts drafts were accepted."""
        self.num_draft_tokens += num_drafts
        self.num_accepted_tokens += num_accepted
        self.num_verifications += 1
        self._learn(seq, num_accepted / num_drafts, step)

    def _learn(self, seq: Sequence, rate: float, step: int) -> None:
        seq.draft_acceptance += ACCEPTANCE_WEIGHT * (rate - seq.draft_acceptance)
        if rate >= LOW_ACCEPTANCE:
            seq.draft_pause = 0  # a step that pays: its next pause is PAUSE_STEPS again
            self.engine_pause = 0  # and a new request's first speculation is a probe at once
        elif seq.draft_acceptance < LOW_ACCEPTANCE:
            seq.draft_pause = min(2 * seq.draft_pause, MAX_PAUSE_STEPS) or PAUSE_STEPS
            seq.drafts_paused_until = step + seq.draft_pause
            # its retry is a probe, like its first speculation: one poor probe pauses it again
            seq.draft_acceptance = LOW_ACCEPTANCE
            if self.proposer.drafts_cost_forwards:
                self.engine_pause = seq.draft_pause

    @staticmethod
    def _missed(seq: Sequence, step: int) -> None:
        """The proposer had nothing for seq: no verification, so its acceptance is untouched, but the
        step was not overlapped (the lookup needs the last token's value). It waits 1, 2, 4, ... up
        to PAUSE_STEPS steps before it looks again, until a lookup proposes: a reply that starts to
        copy its prompt after a preamble speculates within a few steps, and text that never repeats
        loses one overlap in PAUSE_STEPS + 1 steps."""
        seq.draft_miss_pause = min(2 * seq.draft_miss_pause, PAUSE_STEPS) or 1
        seq.drafts_paused_until = step + seq.draft_miss_pause

    def stats(self) -> dict:
        drafts, accepted, verifications = self.num_draft_tokens, self.num_accepted_tokens, self.num_verifications
        return {
            "spec_draft_tokens": drafts,
            "spec_accepted_tokens": accepted,
            "spec_verifications": verifications,
            "spec_acceptance_rate": accepted / drafts if drafts else 0.0,
            # tokens a verifying row takes per step: its accepted drafts and the target's own token
            "spec_mean_accepted_length": 1 + accepted / verifications if verifications else 0.0,
            # decoding rows' steps, and the share of them that verified drafts: what adaptivity and the
            # batch rule left speculating
            "spec_decode_steps": self.num_decode_steps,
            "spec_speculating_share": verifications / self.num_decode_steps if self.num_decode_steps else 0.0,
        }


def _may_speculate(seq: Sequence) -> bool:
    """Requests that never speculate: those that opt out, and those whose grammar waits for the end
    of a reasoning block (its gate's state is not taken back with the drafts)."""
    return seq.params.speculate and (seq.grammar is None or seq.grammar.gate is None) and \
        seq.status is SequenceStatus.RUNNING and seq.pooling is None
