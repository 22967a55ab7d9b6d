"""A request as the engine core sees it: token ids, KV progress and its block table."""
from __future__ import annotations

import itertools
import math
import sys
import time
from enum import Enum, auto

import numpy as np

from asyncllm.outputs import FinishReason
from asyncllm.sampling_params import SamplingParams

_arrival_counter = itertools.count()  # ties of time.monotonic() must not make the order arbitrary; the runner's key


class PromptIds(list):
    """A prompt's token ids as the intake checked them, with the same ids as an int64 numpy array
    in int64 (made by the check's one pass), from which the prefix cache keys and hashes the prompt's
    blocks: a 32k-token prompt is converted once, not again per block on the engine thread."""
    __slots__ = ("int64",)


class SequenceStatus(Enum):
    WAITING = auto()
    RUNNING = auto()
    FINISHED = auto()


class Sequence:
    def __init__(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, block_size: int,
                 max_seq_len: int | None = None, deadline: float | None = None):
        self.request_id = request_id
        self.uid = next(_arrival_counter)  # unique for the process's life: the runner's key for it
        self.in_runner_table = False  # the runner's request table has its sampling settings (engine/step_planner.py)
        self.params = params
        self.block_size = block_size
        self.status = SequenceStatus.WAITING
        # known values only; the prompt's ids as int64 where the intake made them (read by
        # block_manager.block_id_bytes), else None. [:] for a PromptIds: list() reads a list
        # subclass item by item, twice as long for a 32k-token prompt
        intake_ids = isinstance(prompt_token_ids, PromptIds)
        self.token_ids: list[int] = prompt_token_ids[:] if intake_ids else list(prompt_token_ids)
        self.prompt_int64: np.ndarray | None = prompt_token_ids.int64 if intake_ids else None
        # tokens that launched steps are sampling, not yet resolved: they follow token_ids (len(seq)
        # counts them), their values known to the runner alone until their step is read
        self.num_in_flight = 0
        self.num_prompt_tokens = len(prompt_token_ids)
        # the length at which it ends by "length": max_tokens, or the engine's limit if that comes first
        self.max_len = self.num_prompt_tokens + params.max_tokens if params.max_tokens is not None else sys.maxsize
        if max_seq_len is not None:
            self.max_len = min(self.max_len, max_seq_len)
        # KV entries already in the cache (computed, or served by the prefix cache)
        self.num_computed_tokens = 0
        self.block_table: list[int] = []
        # chained hashes of this sequence's full, computed blocks, in block order
        self.block_hashes: list[int] = []
        self.finish_reason: FinishReason | None = None
        # metrics
        self.arrival_time = time.monotonic()
        # when its request times out (SamplingParams.timeout after submission, on the engine core's
        # deadline clock: engine/deadlines.py); None: never
        self.deadline = deadline
        # the scheduler's order for admission and (reversed) preemption: lower priority value first,
        # then the earlier deadline (none: last), then first come first served; computed once,
        # compared on every insertion
        self.priority = params.priority
        self.sort_key = (params.priority, math.inf if deadline is None else deadline, self.uid)
        self.first_scheduled_time: float | None = None
        self.num_cached_prompt_tokens = 0
        self.num_preemptions = 0
        # n > 1: the index among its request's sequences, and all of them (the first one prefills the
        # prompt and holds the others, not yet forked from it, in forks)
        self.index = 0
        self.group: list[Sequence] | None = None
        self.forks: list[Sequence] = []
        # set by the engine when the request is added: the token ids that end it as "stop" (EOS unless
        # ignored, and its stop ids), what the sampler bans for it
        self.stop_ids: frozenset[int] = frozenset(params.stop_token_ids)
        self.early_stop_ids: list[int] = []  # EOS and stop ids, banned while under min_tokens
        self.bad_word_ids: list[list[int]] = []  # each bad word's token ids (with and without a leading space)
        # allowed_token_ids as an array, made once: a step copies it, never walks a list as long as the vocabulary
        self.allowed_token_ids = None if params.allowed_token_ids is None else \
            np.array(params.allowed_token_ids, dtype=np.int64)
        # prompt_logprobs: one entry per prompt token (None for the first, which nothing scores), filled
        # in as prefill steps resolve; the count of positions already planned in a step (engine/step_planner.py)
        self.prompt_logprobs: list | None = [None] if params.prompt_logprobs is not None else None
        self.num_prompt_logprobs_planned = 0
        # fixed for its life: the sampler asks every step (plain requests answer one question)
        self.adjusts_logits = params.adjusts_logits
        self.grammar = None  # structured.grammar.GrammarState of a constrained request
        # an embedding request's PoolingParams: prefilled, never sampled (engine/pooling.py); with
        # mean pooling every prompt position is computed (no prefix-cache hits), and its chunks'
        # hidden-state sums so far, and how many positions they cover, are kept here
        self.pooling = None
        self.pools_every_token = False
        self.pooled_sum = None
        self.num_pooled_tokens = 0
        # speculative decoding (engine/speculation.py): the draft tokens its next decode verifies
        # (read by the scheduler; [] decodes one token) and the distribution they were drawn from
        # (SampledDrafts.probs; None: point proposals), its recent acceptance (None until its first
        # speculation, which sets where it starts: Speculation.draft), the step until which it does not
        # speculate and its last pause's length (0: it has not paused since a step paid), and the
        # pause after its proposer's last miss (nothing proposed; 0: its last lookup proposed)
        self.draft_token_ids: list[int] = []
        self.draft_probs = None
        self.draft_acceptance: float | None = None
        self.drafts_paused_until = 0
        self.draft_pause = 0
        self.draft_miss_pause = 0

    def __len__(self) -> int:
        """Its tokens, those in flight counted (the scheduler's length)."""
        return len(self.token_ids) + self.num_in_flight

    @property
    def num_completion_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def completion_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self) - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status == SequenceStatus.FINISHED

    @property
    def request_finished(self) -> bool:
        """Whether every sequence of its request has finished (n > 1: all n, forked or not)."""
        if self.group is None:
            return self.is_finished
        return all(seq.is_finished for seq in self.group)

    def num_blocks_for(self, num_tokens: int) -> int:
        return (num_tokens + self.block_size - 1) // self.block_size

    def block_tokens(self, block_index: int) -> list[int]:
        start = block_index * self.block_size
        return self.token_ids[start:start + self.block_size]

    def __repr__(self) -> str:
        return (f"Sequence({self.request_id!r}, tokens={len(self)}, computed={self.num_computed_tokens}, "
                f"blocks={self.block_table}, {self.status.name})")
