"""A request as the engine core sees it: token ids, KV progress and its block table."""
from __future__ import annotations

import time
from enum import Enum, auto

from asyncllm.sampling_params import SamplingParams


class SequenceStatus(Enum):
    WAITING = auto()
    RUNNING = auto()
    FINISHED = auto()


class Sequence:
    def __init__(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, block_size: int):
        self.request_id = request_id
        self.params = params
        self.block_size = block_size
        self.status = SequenceStatus.WAITING
        self.token_ids: list[int] = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        # KV entries already in the cache (computed, or served by the prefix cache)
        self.num_computed_tokens = 0
        self.block_table: list[int] = []
        # chained hashes of this sequence's full, computed blocks, in block order
        self.block_hashes: list[int] = []
        self.finish_reason: str | None = None
        # metrics
        self.arrival_time = time.monotonic()
        self.first_scheduled_time: float | None = None
        self.num_cached_prompt_tokens = 0
        self.num_preemptions = 0
        self.generator = None  # the sampler's own RNG for seeded requests, made on first use

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def num_completion_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def completion_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status == SequenceStatus.FINISHED

    def num_blocks_for(self, num_tokens: int) -> int:
        return (num_tokens + self.block_size - 1) // self.block_size

    def block_tokens(self, block_index: int) -> list[int]:
        start = block_index * self.block_size
        return self.token_ids[start:start + self.block_size]

    def __repr__(self) -> str:
        return (f"Sequence({self.request_id!r}, tokens={len(self)}, computed={self.num_computed_tokens}, "
                f"blocks={self.block_table}, {self.status.name})")
