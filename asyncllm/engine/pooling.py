"""Embedding requests in the step: which hidden states a step pools, and their vectors once resolved.

An embedding request is one sequence that is prefilled like any prompt (chunked prefill, prefix-cache
hits, preemption) and never samples (Sequence.pooling; the scheduler never marks it `samples`). A
step with such a chunk runs the model eagerly and sums, per pooling row, the final-norm hidden
states of some of its tokens (runner/pooling.py): the last prompt token for "last" pooling, in the
step that computes it; every token of every chunk for "mean" pooling, whose sums the engine adds up
on the host across chunks (a request that starts over after preemption starts its sum over). Mean
pooling takes no prefix-cache hits (cached positions' hidden states were never computed); "last"
takes them, since match_prefix always leaves the last token to compute. When the step that computed
the last prompt token resolves, the request ends ("stop") with its vector, and its blocks are freed
(its full blocks stay in the prefix cache).
"""
from __future__ import annotations

import numpy as np

from asyncllm.engine.scheduler import SchedulerOutput
from asyncllm.engine.sequence import Sequence
from asyncllm.pooling_params import PoolingParams
from asyncllm.sampling_params import SamplingParams

# torch.nn.functional.normalize's: a zero vector stays zero
NORM_EPS = 1e-12


def embedding_sequence(request_id: str, prompt_token_ids: list[int], params: PoolingParams,
                       block_size: int) -> Sequence:
    """The one sequence of an embedding request (checked by RequestIntake.check_embedding_request):
    prefilled and never sampled; its length limit is its prompt."""
    seq = Sequence(request_id, prompt_token_ids, SamplingParams(max_tokens=1), block_size)
    seq.max_len = seq.num_prompt_tokens
    seq.pooling = params
    seq.pools_every_token = params.pooling == "mean"
    return seq


class PoolingPlan:
    """A step's pooling rows, in the order of its scheduled items: row r sums the hidden states at
    token_index[row_of_token == r] (indices into the step's flattened tokens). Built at launch,
    before the scheduler commits the step (a sequence's num_computed_tokens is the chunk's start)."""
    __slots__ = ("seqs", "starts", "num_tokens", "finals", "token_index", "row_of_token")

    def __init__(self, seqs: list[Sequence], starts: list[int], num_tokens: list[int], finals: list[bool],
                 token_index: np.ndarray, row_of_token: np.ndarray):
        self.seqs = seqs
        self.starts = starts  # each row's first prompt position in this step
        self.num_tokens = num_tokens  # how many positions its sum covers
        self.finals = finals  # this step computes its last prompt token
        self.token_index = token_index  # (N,) int64
        self.row_of_token = row_of_token  # (N,) int64

    @property
    def num_rows(self) -> int:
        return len(self.seqs)

    @classmethod
    def of(cls, sched: SchedulerOutput) -> PoolingPlan | None:
        """The plan of a step (None where no chunk of it pools: a "last" request's earlier chunks)."""
        seqs, starts, num_tokens, finals, indices = [], [], [], [], []
        offset = 0  # the item's first token in the step
        for item in sched.scheduled:
            seq = item.seq
            if seq.pooling is not None:
                start = seq.num_computed_tokens
                final = start + item.num_tokens == len(seq)
                if final or seq.pools_every_token:
                    first = offset if seq.pools_every_token else offset + item.num_tokens - 1
                    seqs.append(seq)
                    starts.append(start)
                    num_tokens.append(offset + item.num_tokens - first)
                    finals.append(final)
                    indices.append(np.arange(first, offset + item.num_tokens, dtype=np.int64))
            offset += item.num_tokens
        if not seqs:
            return None
        row_of_token = np.repeat(np.arange(len(seqs), dtype=np.int64), num_tokens)
        return cls(seqs, starts, num_tokens, finals, np.concatenate(indices), row_of_token)

    def vectors(self, sums: np.ndarray) -> list[tuple[Sequence, np.ndarray]]:
        """The requests whose embedding this resolved step completes, each with its vector, given
        the step's per-row sums ((rows, hidden) float32 on the host); mean pooling's partial sums
        are kept on their sequences. Rows of requests that ended meanwhile are dropped."""
        done = []
        for row, seq in enumerate(self.seqs):
            if seq.is_finished:
                continue  # aborted while the step was in flight
            if not seq.pools_every_token:
                done.append((seq, finish_vector(sums[row], seq.pooling)))
                continue
            if self.starts[row] == 0:  # its first chunk, or the first again after a preemption
                seq.pooled_sum, seq.num_pooled_tokens = sums[row].copy(), 0
            else:
                seq.pooled_sum += sums[row]
            seq.num_pooled_tokens += self.num_tokens[row]
            if self.finals[row]:
                if seq.num_pooled_tokens != seq.num_prompt_tokens:  # an engine bug, not a wrong vector for someone
                    raise RuntimeError(f"mean pooling summed {seq.num_pooled_tokens} of {seq.num_prompt_tokens} "
                                       f"prompt positions of request {seq.request_id!r}")
                done.append((seq, finish_vector(seq.pooled_sum / seq.num_pooled_tokens, seq.pooling)))
                seq.pooled_sum = None
        return done


def finish_vector(pooled: np.ndarray, params: PoolingParams) -> np.ndarray:
    """A new float32 array (never a view of the step's host buffer, which is reused): the first
    params.dimensions entries, then scaled to unit L2 norm where params.normalize."""
    vector = np.array(pooled if params.dimensions is None else pooled[:params.dimensions], dtype=np.float32)
    if params.normalize:
        vector /= max(float(np.linalg.norm(vector)), NORM_EPS)
    return vector
