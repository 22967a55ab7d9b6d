"""One step's inputs as host arrays: what rank 0 builds (ModelRunner.build_inputs), every
tensor-parallel rank runs, and a decode graph's step stages in one copy (runner/decode_staging.py)."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np


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
