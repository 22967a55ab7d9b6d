"""Speculative decoding's verification: sampling at each verified position, against the draft token
there, so that the tokens kept follow the target's distribution exactly.

Each position's distribution p is the request's own, as the plain sampler makes it: adjustments
(biases, bans, allowed tokens), a grammar's mask, temperature, then top-k / top-p / min-p. A greedy
position accepts its draft where the draft is p's argmax, and its token is that argmax: greedy output
is the plain engine's. A sampled position accepts its draft x with probability p(x) (standard
rejection sampling, min(1, p(x) / q(x)), with q a point mass at x as the n-gram proposer's and any
deterministic proposer's is); on rejection its token is drawn from the residual, p with x taken out,
renormalised (norm(max(p - q, 0))). A position without a draft (a row's last, the bonus token) draws
from p. The engine keeps a row's drafts up to its first rejection, then the token at that position.

Noise: a seeded request's position draws its uniform and its exponential race from a generator
seeded with that position's noise key (its seed and completion index, layers/sampler.noise_key), so
a seed reproduces its output; other rows draw from the engine's generator. Plain PyTorch on every
device (a softmax over the sampled verified rows, ROWS_PER_CHUNK at a time: bounded temporaries).
"""
from __future__ import annotations

import torch

from asyncllm.layers.sampler import SamplerOutput, SamplingTensors, apply_token_bitmask_, gather_logprobs
from asyncllm.layers.sampling_filters import apply_cutoffs, filter_cutoffs


# verified rows sampled at once: each takes a few (rows, vocabulary) float32 temporaries (a 152k-token
# vocabulary: 0.6 MB a row each), which the KV cache's sizing does not set aside beyond this many rows
ROWS_PER_CHUNK = 16


def speculative_probs(logits: torch.Tensor, params: SamplingTensors, rows: slice = slice(None)) -> torch.Tensor:
    """(N, V) float32: the distribution p of each of logits' rows (params' rows `rows`) after
    temperature and its cutoffs (greedy rows: softmax at T = 1, unused). logits: adjusted and masked."""
    temperatures = params.temperatures[rows]
    z = logits.float() / torch.where(temperatures > 0, temperatures, 1.0).unsqueeze(1)
    if params.top_ks is not None or params.top_ps is not None or params.min_ps is not None:
        top_ks, top_ps, min_ps = (None if t is None else t[rows] for t in (params.top_ks, params.top_ps, params.min_ps))
        z = apply_cutoffs(z, filter_cutoffs(logits, temperatures, top_ks, top_ps, min_ps))
    return z.softmax(dim=-1)


def verify_drafts(probs: torch.Tensor, draft_ids: torch.Tensor, uniforms: torch.Tensor,
                  exponentials: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rejection sampling of sampled rows: (token, accepted) per row. probs (N, V): the target's p;
    draft_ids (N,) (-1: none, draw from p); uniforms (N,) in [0, 1); exponentials (N, V) Exp(1).
    A row accepts its draft x with probability p(x); its token is x where accepted, else a draw
    (the exponential race) from the residual p without x."""
    has_draft = draft_ids >= 0
    drafts = draft_ids.clamp(min=0).unsqueeze(1)
    accepted = has_draft & (uniforms < probs.gather(1, drafts).squeeze(1))
    residual = probs.scatter(1, drafts, torch.where(has_draft.unsqueeze(1), 0.0, probs.gather(1, drafts)))
    replacement = (residual / exponentials).argmax(dim=-1)
    return torch.where(accepted, draft_ids, replacement), accepted


def kept_rows(accepted: torch.Tensor, first_rows: torch.Tensor) -> torch.Tensor:
    """(N,) bool: the rows whose token their request keeps, those with no rejection before them among
    its rows (first_rows: each row's request's first row). On the device, no host sync."""
    rejected = (~accepted).to(torch.int32)
    rejected_before = rejected.cumsum(0) - rejected
    return rejected_before == rejected_before[first_rows]


class RejectionSampler:
    def __init__(self, generator: torch.Generator | None = None):
        """generator: the noise of rows without a seed (None: the process's default generator)."""
        self.generator = generator

    def __call__(self, logits: torch.Tensor, params: SamplingTensors, draft_ids: torch.Tensor,
                 first_rows: torch.Tensor) -> SamplerOutput:
        """Verify each row's draft (draft_ids (N,), -1: none): SamplerOutput with each row's token and
        whether it accepted its draft (accepted). first_rows (N,): the first row of each row's request
        (its positions are consecutive rows): a row's token is kept where every earlier row of its
        request accepted, and only kept tokens are counted for penalties."""
        model_logits = logits
        if params.adjustments is not None:
            logits = params.adjustments.adjusted(logits)
        if params.mask_rows is not None:
            logits = logits.to(torch.float32, copy=params.adjustments is None)
            apply_token_bitmask_(logits, params.mask_rows, params.token_bitmask)
        greedy = logits.argmax(dim=-1)
        greedy_accepted = (draft_ids >= 0) & (draft_ids == greedy)
        if params.all_greedy:
            tokens, accepted = greedy, greedy_accepted
        else:
            sampled, sampled_accepted = torch.empty_like(greedy), torch.empty_like(greedy_accepted)
            for start in range(0, len(logits), ROWS_PER_CHUNK):
                rows = slice(start, start + ROWS_PER_CHUNK)
                probs = speculative_probs(logits[rows], params, rows)
                uniforms, exponentials = self._noise(probs, params, start)
                sampled[rows], sampled_accepted[rows] = verify_drafts(probs, draft_ids[rows], uniforms, exponentials)
            is_sampled = params.temperatures > 0
            tokens = torch.where(is_sampled, sampled, greedy)
            accepted = torch.where(is_sampled, sampled_accepted, greedy_accepted)
        if params.adjustments is not None:
            params.adjustments.count_sampled(tokens, kept_rows(accepted, first_rows))
        logprobs = None
        if params.logprob_rows is not None:
            rows = params.logprob_rows
            logprobs = gather_logprobs(model_logits[rows], tokens[rows], params.num_top_logprobs)
        return SamplerOutput(tokens, logprobs, accepted=accepted)

    def _noise(self, probs: torch.Tensor, params: SamplingTensors, start: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Each row's uniform and exponentials (probs: params' rows from start on): a seeded row's
        from its key, the others' from the generator."""
        uniforms = torch.rand(len(probs), device=probs.device, generator=self.generator)
        exponentials = torch.empty_like(probs).exponential_(generator=self.generator)
        for row, key in params.seeded_rows:
            if start <= row < start + len(probs):
                generator = torch.Generator(probs.device).manual_seed(key)
                uniforms[row - start] = torch.rand(1, device=probs.device, generator=generator)[0]
                exponentials[row - start].exponential_(generator=generator)
        return uniforms, exponentials
