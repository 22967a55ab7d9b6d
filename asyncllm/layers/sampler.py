"""Batched sampling with per-request settings, on the logits' device.

Sampling uses the exponential race (Gumbel-max): argmax(p / E) with E ~ Exp(1) i.i.d. draws a token
with probability p, with no cumulative sums or searches. Each row has a 64-bit key for its noise: a
request with a seed gets a key that depends only on its seed and the token's index, so its output
does not depend on what else shares the batch. On CUDA the race runs in one kernel that reads the
logits once and draws the noise from a Philox stream of the key (kernels/logits_ops.sample); the
PyTorch path here, the CPU's and the reference, draws seeded rows' noise from a generator seeded
with the key, and the other rows' from the global generator. Top-k, top-p and min-p become one
cutoff per row on logits / T (layers/sampling_filters.py, without sorting on CUDA): the race runs
only among the tokens at or above it.

Requests may adjust their logits first (layers/logits_adjustments.py) and ask for log-probabilities:
those are the model's raw distribution (log_softmax of the logits before any adjustment or
temperature, as vLLM's default), computed only for the rows that asked.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from asyncllm.layers.fused import logits_ops_for
from asyncllm.layers.logits_adjustments import LogitsAdjustments
from asyncllm.layers.sampling_filters import apply_cutoffs, filter_cutoffs
from asyncllm.sampling_params import SamplingParams


_MASK64 = (1 << 64) - 1


def noise_key(seed: int, token_index: int) -> int:
    """The noise key (int64) of a seeded request's completion token number token_index: a mix
    (SplitMix64's) of the two alone, so a seeded request draws the same noise in any batch, step
    order or overlap mode."""
    z = (seed + (token_index + 1) * 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    z ^= z >> 31
    return z - (1 << 64) if z >> 63 else z


@dataclass
class LogprobsTensors:
    """Log-probabilities of the rows that asked, on the device."""
    chosen: torch.Tensor  # (L,) float32: the sampled token's
    ranks: torch.Tensor  # (L,) int64: 1 + how many tokens had a higher log-probability
    top_ids: torch.Tensor  # (L, K) int64: the K most likely tokens, K = the most any row asked for
    top_logprobs: torch.Tensor  # (L, K) float32


@dataclass
class SamplerOutput:
    token_ids: torch.Tensor  # (B,) int64
    logprobs: LogprobsTensors | None = None  # for SamplingTensors.logprob_rows
    accepted: torch.Tensor | None = None  # (B,) bool: the row accepted its draft (layers/rejection_sampler.py)


@dataclass
class SamplingTensors:
    temperatures: torch.Tensor | None  # (B,) float32; 0 = greedy; None when every row is greedy
    top_ks: torch.Tensor | None  # (B,) int64; vocab size = no limit; None when no row uses top-k
    top_ps: torch.Tensor | None  # (B,) float32; 1.0 = no limit; None when no row uses top-p
    min_ps: torch.Tensor | None  # (B,) float32; 0 = none; None when no row uses min-p
    seeded_rows: list[tuple[int, int]]  # (row, key) of the rows with a seed
    all_greedy: bool
    keys: torch.Tensor | None = None  # (B,) int64: each row's noise key; None when every row is greedy
    adjustments: LogitsAdjustments | None = None  # None when no row adjusts its logits
    logprob_rows: torch.Tensor | None = None  # (L,) int64: rows that want log-probabilities; None if none
    num_top_logprobs: int = 0  # the most top alternatives any of them asked for
    # constrained decoding: the rows held to a grammar, and their allowed tokens as bits (bit j of
    # word w allows token 32*w + j); None when no row is constrained
    mask_rows: torch.Tensor | None = None  # (M,) int64
    token_bitmask: torch.Tensor | None = None  # (M, ceil(V / 32)) int32

    HOST_ARRAYS = ("temperatures", "keys", "top_ks", "top_ps", "min_ps")  # the fields host_arrays() may give

    @property
    def is_plain(self) -> bool:
        """No row asks for more than its temperature (top-k/p, min-p, adjustments, log-probabilities,
        a grammar): the race alone, over temperatures and keys, greedy rows at temperature 0."""
        return self.top_ks is None and self.top_ps is None and self.min_ps is None and \
            self.adjustments is None and self.logprob_rows is None and self.mask_rows is None

    @classmethod
    def build(cls, params: list[SamplingParams], vocab_size: int, device: torch.device,
              keys: list[int] | None = None, seeded_rows: list[tuple[int, int]] = ()) -> "SamplingTensors":
        """Per-row settings as device tensors, one copy each; only what some row uses is built. keys:
        each row's noise key (int64), given unless every row is greedy. (A runner sends host_arrays()
        in its step's one copy instead.)"""
        arrays = cls.host_arrays(params, vocab_size, keys)
        return cls.from_device({name: torch.from_numpy(a).to(device, non_blocking=True) for name, a in arrays.items()},
                               seeded_rows)

    @staticmethod
    def host_arrays(params: list[SamplingParams], vocab_size: int, keys) -> dict[str, np.ndarray]:
        """The host arrays of build()'s tensors, by field name; none when every row is greedy (a
        runner sends them to the device in its step's one copy, then calls from_device)."""
        if all(p.temperature == 0 for p in params):
            return {}
        assert keys is not None, "sampled rows need their noise keys"
        arrays = {"temperatures": np.array([p.temperature for p in params], dtype=np.float32),
                  "keys": np.asarray(keys, dtype=np.int64)}
        sampled = [p for p in params if p.temperature > 0]
        if any(p.top_k > 0 for p in sampled):
            arrays["top_ks"] = np.array([p.top_k if p.top_k > 0 else vocab_size for p in params], dtype=np.int64)
        if any(p.top_p < 1.0 for p in sampled):
            arrays["top_ps"] = np.array([p.top_p for p in params], dtype=np.float32)
        if any(p.min_p > 0 for p in sampled):
            arrays["min_ps"] = np.array([p.min_p for p in params], dtype=np.float32)
        return arrays

    def select(self, rows: list[int], index: torch.Tensor) -> "SamplingTensors":
        """The sampling settings of rows alone (in that order; index: rows on the device), for draw():
        adjustments, masks and log-probabilities are left out (draw() reads none of them)."""
        if self.all_greedy:
            return SamplingTensors(None, None, None, None, [], True)
        position = {row: n for n, row in enumerate(rows)}
        return SamplingTensors(*(None if t is None else t[index] for t in (self.temperatures, self.top_ks,
                                                                           self.top_ps, self.min_ps)),
                               [(position[row], key) for row, key in self.seeded_rows if row in position],
                               False, keys=self.keys[index])

    @classmethod
    def from_device(cls, on_device: dict[str, torch.Tensor], seeded_rows: list[tuple[int, int]] = ()
                    ) -> "SamplingTensors":
        """From host_arrays' arrays on the device (an empty dict: every row greedy)."""
        if not on_device:
            return cls(None, None, None, None, list(seeded_rows), True)
        return cls(on_device["temperatures"], on_device.get("top_ks"), on_device.get("top_ps"),
                   on_device.get("min_ps"), list(seeded_rows), False, keys=on_device["keys"])


class Sampler(nn.Module):
    def __init__(self, generator: torch.Generator | None = None):
        """generator: the PyTorch path's noise for unseeded rows (None: the process's default generator)."""
        super().__init__()
        self.generator = generator

    def forward(self, logits: torch.Tensor, params: SamplingTensors) -> SamplerOutput:
        # the model's logits, in their own dtype, are never written (they may be a CUDA graph's output
        # buffer): log-probabilities read them, and adjustments and masks change a float32 copy
        model_logits = logits
        if params.adjustments is not None:
            logits = params.adjustments.adjusted(logits)
        elif params.mask_rows is not None:
            logits = logits.to(torch.float32, copy=True)
        if params.mask_rows is not None:
            # after the adjustments (a logit_bias cannot lift a token the grammar forbids) and before
            # everything else: greedy, temperature, top-k/p and min-p all see only allowed tokens
            apply_token_bitmask_(logits, params.mask_rows, params.token_bitmask)
        token_ids = self.draw(logits, params)
        if params.adjustments is not None:
            params.adjustments.count_sampled(token_ids)
        logprobs = None
        if params.logprob_rows is not None:
            rows = params.logprob_rows
            raw = model_logits if len(rows) == len(model_logits) else model_logits[rows]
            logprobs = gather_logprobs(raw, token_ids[rows], params.num_top_logprobs)
        return SamplerOutput(token_ids, logprobs)

    def draw(self, logits: torch.Tensor, params: SamplingTensors) -> torch.Tensor:
        """Each row's token from its logits, already adjusted and masked: the argmax at temperature 0,
        else the race with the row's noise (its key's where it has a seed). Speculative decoding draws
        a seeded request's tokens here too (its verification and a draft model's proposals), so that
        they are the plain engine's."""
        if params.all_greedy:
            return logits.argmax(dim=-1)
        temperatures = params.temperatures
        cutoffs = None  # top-k, top-p and min-p as one threshold per row on logits / T
        if params.top_ks is not None or params.top_ps is not None or params.min_ps is not None:
            cutoffs = filter_cutoffs(logits, temperatures, params.top_ks, params.top_ps, params.min_ps)
        if logits_ops_for(logits) is not None:
            return sample_race(logits, temperatures, params.keys, cutoffs)
        logits = logits.float()
        greedy_tokens = logits.argmax(dim=-1)
        logits = logits / torch.where(temperatures > 0, temperatures, 1.0).unsqueeze(1)
        if cutoffs is not None:
            logits = apply_cutoffs(logits, cutoffs)
        probs = logits.softmax(dim=-1)
        noise = torch.empty_like(probs)
        if len(params.seeded_rows) < len(noise):  # (every row seeded: speculative verification's draws)
            noise.exponential_(generator=self.generator)
        for row, key in params.seeded_rows:
            noise[row].exponential_(generator=torch.Generator(noise.device).manual_seed(key))
        sampled = (probs / noise).argmax(dim=-1)
        return torch.where(temperatures > 0, sampled, greedy_tokens)


def sample_race(logits: torch.Tensor, temperatures: torch.Tensor, keys: torch.Tensor,
                cutoffs: torch.Tensor | None = None) -> torch.Tensor:
    """The race on CUDA, in one read of the logits (kernels/logits_ops.sample): rows with temperature
    0 take the first maximum, the others draw with their key's noise (and cutoff, if given)."""
    return logits_ops_for(logits).sample(logits, temperatures, keys, cutoffs)


# from this many rows on, CUDA reads the logits once for log-probabilities (kernels/logits_ops.
# chunked_logprobs): the PyTorch path reads the logits several times (log_softmax, compare, topk), which
# costs more than the kernel at many rows; at about 64 rows the two tie (bench_sampler.py)
ONE_READ_LOGPROBS_MIN_ROWS = 64


def gather_logprobs(logits: torch.Tensor, token_ids: torch.Tensor, num_top: int) -> LogprobsTensors:
    """From logits (L, V) in the model's dtype (computed in float32, which holds bf16 and fp16 values
    exactly): the chosen tokens' log-probabilities and ranks, and the num_top best of each row."""
    kernels = logits_ops_for(logits)
    if kernels is not None and len(logits) >= ONE_READ_LOGPROBS_MIN_ROWS:
        rows = logits if logits.stride(1) == 1 else logits.contiguous()
        return LogprobsTensors(*kernels.chunked_logprobs(rows, token_ids, num_top))
    return log_softmax_logprobs(logits, token_ids, num_top)


def log_softmax_logprobs(logits: torch.Tensor, token_ids: torch.Tensor, num_top: int) -> LogprobsTensors:
    """gather_logprobs in PyTorch: the CPU's path and the kernel's reference."""
    # one fused log_softmax pass (upcast first: bf16 log-probabilities would be rounded); logsumexp
    # alone is several, with (L, V) temporaries
    logprobs = logits.log_softmax(dim=-1, dtype=torch.float32)
    chosen = logprobs.gather(1, token_ids.unsqueeze(1))
    ranks = (logprobs > chosen).sum(dim=-1) + 1
    # torch.topk: a two-round chunked selection, tried, was slower
    top_logprobs, top_ids = logprobs.topk(num_top, dim=-1)
    return LogprobsTensors(chosen.squeeze(1), ranks, top_ids, top_logprobs)


def apply_token_bitmask_(logits: torch.Tensor, rows: torch.Tensor, bitmask: torch.Tensor) -> None:
    """In place: in logits row rows[i], each token whose bit is 0 in bitmask[i] ((M, ceil(V / 32))
    int32; bit j of word w is token 32 * w + j) is -inf."""
    every_row = len(rows) == len(logits)  # rows are in order: no gather and scatter
    kernels = logits_ops_for(logits)
    if kernels is not None:
        kernels.apply_token_bitmask_(logits, None if every_row else rows, bitmask)
        return
    # unpacked by bytes (a quarter of the temporaries of unpacking int32 words): on little-endian
    # hosts and GPUs, token 8 * b + j is bit j of byte b
    shifts = torch.arange(8, device=bitmask.device, dtype=torch.uint8)
    allowed = ((bitmask.contiguous().view(torch.uint8).unsqueeze(-1) >> shifts) & 1).flatten(1)
    forbidden = ~allowed[:, :logits.shape[-1]].bool()
    if every_row:
        logits.masked_fill_(forbidden, float("-inf"))
    else:
        logits.index_copy_(0, rows, logits[rows].masked_fill(forbidden, float("-inf")))
