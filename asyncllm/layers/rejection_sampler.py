"""Speculative decoding's verification: sampling at each verified position, against the draft token
there, so that the tokens kept follow the target's distribution exactly.

Each position's distribution p is the request's own, as the plain sampler makes it: adjustments
(biases, bans, allowed tokens), a grammar's mask, temperature, then top-k / top-p / min-p. A greedy
position accepts its draft where the draft is p's argmax, and its token is that argmax: greedy output
is the plain engine's.

A seeded request's position verifies by exact match: its token is the plain sampler's keyed draw
(Sampler.draw with the key of its seed and completion index, the very token a plain engine samples
there), and it accepts its draft iff the draft is that token. Its output is then the plain engine's
token for token, whatever the schedule speculated (which rows draft depends on the batch, overlap,
the prefix cache and the backoff), and it still follows p exactly. A point draft x (prompt lookup) is
accepted with probability p(x), as by rejection sampling; a draft model draws a seeded request's
drafts with the same key (speculative/draft_model.py), so a draft close to the target mostly draws
the same token (the race's coupling: acceptance P(argmax p/E = argmax q/E), a little under
rejection sampling's sum(min(p, q)); a draft equal to the target: always).

Other sampled positions use standard rejection sampling: accept the draft x with probability
min(1, p(x) / q(x)), q the distribution the draft was drawn from (a draft model's own for a sampled
request, else a point mass at x, which makes it p(x)); on rejection draw from the residual
norm(max(p - q, 0)) (for a point mass: p with x taken out). A position without a draft (a row's last,
the bonus token) draws from p. Their noise is the engine's generator's. Plain PyTorch on every device
(a softmax over those rows, ROWS_PER_CHUNK at a time: bounded temporaries). The engine keeps a row's
drafts up to its first rejection, then the token at that position.
"""
from __future__ import annotations

import itertools

import torch

from asyncllm.layers.sampler import Sampler, SamplerOutput, SamplingTensors, apply_token_bitmask_, gather_logprobs
from asyncllm.layers.sampling_filters import apply_cutoffs, filter_cutoffs


# verified rows rejection-sampled at once: each takes a few (rows, vocabulary) float32 temporaries (a 152k-token
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
                  exponentials: torch.Tensor, draft_probs: torch.Tensor | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """Rejection sampling of sampled rows: (token, accepted) per row. probs (N, V): the target's p;
    draft_ids (N,) (-1: none, draw from p); uniforms (N,) in [0, 1); exponentials (N, V) Exp(1);
    draft_probs (N, V): the q each draft was drawn from (None: point masses at the drafts; a row
    without a draft must have q = 0). A row accepts its draft x with probability min(1, p(x) / q(x));
    its token is x where accepted, else a draw (the exponential race) from norm(max(p - q, 0))."""
    has_draft = draft_ids >= 0
    drafts = draft_ids.clamp(min=0).unsqueeze(1)
    if draft_probs is None:
        draft_probs = torch.zeros_like(probs).scatter_(1, drafts, has_draft.unsqueeze(1).to(probs.dtype))
    accepted = has_draft & (uniforms * draft_probs.gather(1, drafts).squeeze(1) < probs.gather(1, drafts).squeeze(1))
    residual = (probs - draft_probs).clamp_(min=0)
    # p <= q everywhere (p == q up to rounding): a rejection then is rounding's; draw from p
    residual = torch.where(residual.sum(dim=1, keepdim=True) > 0, residual, probs)
    replacement = (residual / exponentials).argmax(dim=-1)
    return torch.where(accepted, draft_ids, replacement), accepted


def chunk_draft_probs(draft_ids: torch.Tensor, draft_probs: list, rows: slice, vocab_size: int,
                      device: torch.device) -> torch.Tensor | None:
    """q of rows' verified positions, (n, V) float32: the draft distributions in draft_probs ((the
    first row, (k, V) q of its k drafts) each) where they cover a row, point masses at the other
    drafts, 0 where a row has none; None where no distribution covers rows (all point masses)."""
    q = None
    for first, probs in draft_probs:
        lo, hi = max(first, rows.start), min(first + len(probs), rows.stop)
        if lo < hi:
            if q is None:
                ids = draft_ids[rows]
                q = torch.zeros((len(ids), vocab_size), dtype=torch.float32, device=device)
                q.scatter_(1, ids.clamp(min=0).unsqueeze(1), (ids >= 0).unsqueeze(1).to(torch.float32))
            q[lo - rows.start:hi - rows.start] = probs[lo - first:hi - first]
    return q


def kept_rows(accepted: torch.Tensor, first_rows: torch.Tensor) -> torch.Tensor:
    """(N,) bool: the rows whose token their request keeps, those with no rejection before them among
    its rows (first_rows: each row's request's first row). On the device, no host sync."""
    rejected = (~accepted).to(torch.int32)
    rejected_before = rejected.cumsum(0) - rejected
    return rejected_before == rejected_before[first_rows]


def unseeded_chunks(num_rows: int, seeded: set[int]) -> list[slice]:
    """Runs of consecutive rows without a seed, of ROWS_PER_CHUNK rows at most (a request's rows are
    consecutive: seeded ones come in runs)."""
    chunks = []
    for is_seeded, run in itertools.groupby(range(num_rows), key=seeded.__contains__):
        if not is_seeded:
            rows = list(run)
            chunks += [slice(start, min(start + ROWS_PER_CHUNK, rows[-1] + 1))
                       for start in range(rows[0], rows[-1] + 1, ROWS_PER_CHUNK)]
    return chunks


class RejectionSampler:
    def __init__(self, generator: torch.Generator | None = None):
        """generator: the noise of rows without a seed (None: the process's default generator)."""
        self.generator = generator
        self.keyed = Sampler(generator)  # seeded rows' draws: the plain sampler's (they have keys)

    def __call__(self, logits: torch.Tensor, params: SamplingTensors, draft_ids: torch.Tensor,
                 first_rows: torch.Tensor, draft_probs: list = ()) -> SamplerOutput:
        """Verify each row's draft (draft_ids (N,), -1: none): SamplerOutput with each row's token and
        whether it accepted its draft (accepted). first_rows (N,): the first row of each row's request
        (its positions are consecutive rows): a row's token is kept where every earlier row of its
        request accepted, and only kept tokens are counted for penalties. draft_probs: (first row,
        (k, V) q) of the drafts drawn from a distribution (StepPlan.draft_probs); others are points."""
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
            seeded = sorted(row for row, _ in params.seeded_rows)
            if seeded:  # exact match against the plain sampler's keyed draw
                every = len(seeded) == len(logits)
                rows = slice(None) if every else torch.tensor(seeded).to(logits.device, non_blocking=True)
                drawn = self.keyed.draw(logits, params) if every else \
                    self.keyed.draw(logits[rows], params.select(seeded, rows))
                sampled[rows] = drawn
                sampled_accepted[rows] = (draft_ids[rows] >= 0) & (draft_ids[rows] == drawn)
            for rows in unseeded_chunks(len(logits), set(seeded)):
                probs = speculative_probs(logits[rows], params, rows)
                uniforms = torch.rand(len(probs), device=probs.device, generator=self.generator)
                exponentials = torch.empty_like(probs).exponential_(generator=self.generator)
                q = chunk_draft_probs(draft_ids, draft_probs, rows, probs.shape[1], probs.device)
                sampled[rows], sampled_accepted[rows] = verify_drafts(probs, draft_ids[rows], uniforms, exponentials, q)
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
