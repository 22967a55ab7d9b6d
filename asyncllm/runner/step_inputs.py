"""One step's inputs as host arrays: what rank 0 builds (ModelRunner.build_inputs), every
tensor-parallel rank runs, and a decode graph's step stages in one copy (runner/decode_staging.py)."""
from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np


@dataclass(slots=True)
class InFlightTokens:
    """A step's tokens in flight (overlapped steps): their values are the ids the step in flight
    samples, filled in where the inputs land (on the device, or on the host for tensor-parallel ranks)."""
    at: np.ndarray  # (P,) int64: their indices among the step's tokens
    rows: np.ndarray  # (P,) int64: their rows among the step in flight's sampled ids
    # at and rows both 0..P-1 (a decode batch that kept its rows): one device copy, no index arrays
    in_place: bool = False

    @property
    def index_arrays(self) -> list[np.ndarray]:
        """The arrays the device needs to fill them in: [at, rows], or none (in place, or no token)."""
        return [self.at, self.rows] if len(self.at) and not self.in_place else []


NO_TOKENS_IN_FLIGHT = InFlightTokens(np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64))


def padded_block_tables(block_rows: list[list[int]]) -> np.ndarray:
    """The rows' block tables as one (rows, longest) int32 array: row r's blocks fill its first
    len(block_rows[r]) entries, the rest 0."""
    table_lens = np.fromiter(map(len, block_rows), dtype=np.int64, count=len(block_rows))
    block_tables = np.zeros((len(block_rows), int(table_lens.max())), dtype=np.int32)
    block_tables[np.arange(block_tables.shape[1]) < table_lens[:, None]] = np.fromiter(
        itertools.chain.from_iterable(block_rows), dtype=np.int32, count=int(table_lens.sum()))
    return block_tables


@dataclass
class StepInputs:
    input_ids: np.ndarray  # (T,) int64
    positions: np.ndarray  # (T,) int64
    slot_mapping: np.ndarray  # (T,) int64
    query_lens: np.ndarray  # (B,) int32
    seq_lens: np.ndarray  # (B,) int32
    block_tables: np.ndarray  # (B, max_blocks) int32
    logits_indices: np.ndarray  # (S,) int64

    def pack(self) -> np.ndarray:
        """One int64 array: a 4-number header (T, B, max_blocks, S), then every field."""
        header = np.array([len(self.input_ids), len(self.query_lens), self.block_tables.shape[1],
                           len(self.logits_indices)], dtype=np.int64)
        return np.concatenate([header, self.input_ids, self.positions, self.slot_mapping, self.query_lens,
                               self.seq_lens, self.block_tables.ravel(), self.logits_indices]).astype(np.int64)

    @staticmethod
    def unpack(packed: np.ndarray) -> "StepInputs":
        num_tokens, num_seqs, max_blocks, num_logits = (int(x) for x in packed[:4])
        sizes = [num_tokens, num_tokens, num_tokens, num_seqs, num_seqs, num_seqs * max_blocks, num_logits]
        parts = np.split(packed[4:4 + sum(sizes)], np.cumsum(sizes)[:-1])
        return StepInputs(parts[0], parts[1], parts[2], parts[3].astype(np.int32), parts[4].astype(np.int32),
                          parts[5].astype(np.int32).reshape(num_seqs, max_blocks), parts[6])


def synthetic_step_inputs(num_prompts: int, prompt_len: int, num_decodes: int, context: int, block_size: int,
                          num_blocks: int) -> StepInputs:
    """A step of num_prompts whole prompts of prompt_len tokens, then num_decodes decodes over
    context tokens each, that stores nothing (slot -1): for measuring, never for results. The
    prompts' block tables point at block 0; each decode reads blocks of its own (cycling through
    the num_blocks of the cache), so the decodes' KV reads come from memory as a real step's do, not from L2."""
    blocks_per_prompt = -(-prompt_len // block_size)
    blocks_per_decode = -(-context // block_size)
    width = max(blocks_per_prompt if num_prompts else 0, blocks_per_decode if num_decodes else 0, 1)
    tables = np.zeros((num_prompts + num_decodes, width), dtype=np.int32)
    if num_decodes:
        blocks = np.arange(num_decodes * blocks_per_decode) % max(1, num_blocks)
        tables[num_prompts:, :blocks_per_decode] = blocks.reshape(num_decodes, blocks_per_decode)
    query_lens = np.array([prompt_len] * num_prompts + [1] * num_decodes, dtype=np.int32)
    num_tokens = int(query_lens.sum())
    positions = np.concatenate([np.tile(np.arange(prompt_len), num_prompts),
                                np.full(num_decodes, max(context - 1, 0))]).astype(np.int64)
    return StepInputs(
        input_ids=np.zeros(num_tokens, dtype=np.int64), positions=positions, slot_mapping=np.full(num_tokens, -1),
        query_lens=query_lens, seq_lens=np.array([prompt_len] * num_prompts + [context] * num_decodes, dtype=np.int32),
        block_tables=tables, logits_indices=np.cumsum(query_lens) - 1)
