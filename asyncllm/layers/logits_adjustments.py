"""What requests change in their logits before sampling: penalties, logit biases, banned and allowed
tokens. Batched over the rows that ask, on the logits' device; rows that ask for nothing are not touched.

Penalties read each sequence's token counts from TokenCounts, which stays on the device and is
updated in place from the sampled ids tensor right after each step samples: a step launched before
the previous one's ids reach the host (the overlapped loop) already sees them counted.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from asyncllm.layers.fused import logits_ops_for


class TokenCounts:
    """Per-sequence token statistics for penalties, one slot (row) per sequence that uses them:
    counts of generated tokens (presence, frequency) and which tokens the prompt has (repetition)."""

    def __init__(self, vocab_size: int, device: torch.device):
        self.vocab_size = vocab_size
        self.device = device
        self.output_counts = torch.zeros((0, vocab_size), dtype=torch.int32, device=device)
        self.in_prompt = torch.zeros((0, vocab_size), dtype=torch.bool, device=device)
        self.free_slots: list[int] = []
        self._one = torch.ones(1, dtype=torch.int32, device=device)  # count() adds it, expanded, to each slot

    @property
    def capacity(self) -> int:
        return self.output_counts.shape[0]

    def acquire(self, prompt_token_ids: list[int], output_token_ids: list[int]) -> int:
        """A slot holding these tokens (a sequence's first sampling step that needs penalties)."""
        if not self.free_slots:
            self._grow()
        slot = self.free_slots.pop()
        self.output_counts[slot].zero_()
        self.in_prompt[slot].zero_()
        if prompt_token_ids:
            ids = torch.tensor(prompt_token_ids, dtype=torch.int64).to(self.device, non_blocking=True)
            self.in_prompt[slot, ids] = True
        if output_token_ids:
            ids = torch.tensor(output_token_ids, dtype=torch.int64).to(self.device, non_blocking=True)
            self.output_counts[slot].index_add_(0, ids, torch.ones_like(ids, dtype=torch.int32))
        return slot

    def acquire_copy(self, slot: int, more_output_ids: list[int]) -> int:
        """A new slot holding slot's tokens and more_output_ids as generated too (a speculative
        position's counts: its request's and the drafts before it), copied on the device."""
        if not self.free_slots:
            self._grow()
        copy = self.free_slots.pop()
        self.output_counts[copy].copy_(self.output_counts[slot])
        self.in_prompt[copy].copy_(self.in_prompt[slot])
        if more_output_ids:
            ids = torch.tensor(more_output_ids, dtype=torch.int64).to(self.device, non_blocking=True)
            self.output_counts[copy].index_add_(0, ids, torch.ones_like(ids, dtype=torch.int32))
        return copy

    def release(self, slot: int) -> None:
        # steps still queued may add to it: they run before any later step that reuses the slot
        self.free_slots.append(slot)

    def _grow(self) -> None:
        """Double the slots (rare: the number of sequences with penalties at once only grows so far)."""
        old = self.capacity
        new = max(8, 2 * old)
        counts = torch.zeros((new, self.vocab_size), dtype=torch.int32, device=self.device)
        in_prompt = torch.zeros((new, self.vocab_size), dtype=torch.bool, device=self.device)
        counts[:old] = self.output_counts
        in_prompt[:old] = self.in_prompt
        self.output_counts, self.in_prompt = counts, in_prompt
        self.free_slots.extend(range(new - 1, old - 1, -1))

    def count(self, slots: torch.Tensor, token_ids: torch.Tensor, kept: torch.Tensor | None = None) -> None:
        """Add one sampled token to each slot (a slot listed twice counts both; kept: only where
        True), on the device and without waiting for it: index_add_ on the flat counts is one
        atomic add per token on CUDA, where index_put_(accumulate=True) sorts the indices first
        (several kernels)."""
        flat = token_ids.add(slots, alpha=self.vocab_size)
        ones = self._one.expand(len(flat)) if kept is None else kept.to(torch.int32)
        self.output_counts.view(-1).index_add_(0, flat, ones)


@dataclass
class LogitsAdjustments:
    """One step's adjustments; a None group means no row of the step uses it. Rows are the step's
    sampling rows; (row, token) pairs are flattened into equal-length tensors."""
    # penalties: the rows that have one, their TokenCounts slots and their three penalties
    penalty_rows: torch.Tensor | None = None  # (P,) int64
    penalty_slots: torch.Tensor | None = None  # (P,) int64
    presence: torch.Tensor | None = None  # (P,) float32
    frequency: torch.Tensor | None = None  # (P,) float32
    repetition: torch.Tensor | None = None  # (P,) float32
    token_counts: TokenCounts | None = None
    # speculative decoding: the slot each penalty row's token is counted into once kept (its
    # request's; a verified position reads a slot of its own, its request's counts and the drafts
    # before it); None: penalty_slots
    count_slots: torch.Tensor | None = None
    # logit_bias entries
    bias_rows: torch.Tensor | None = None  # (E,) int64
    bias_tokens: torch.Tensor | None = None  # (E,) int64
    bias_values: torch.Tensor | None = None  # (E,) float32
    # tokens a row may not take this step (EOS before min_tokens, bad words)
    ban_rows: torch.Tensor | None = None  # (K,) int64
    ban_tokens: torch.Tensor | None = None  # (K,) int64
    # bans that hang on the token still in flight (overlapped steps): (row, token) banned where the
    # row's pending token (read from the previous step's sampled ids, on the device) is pending_ban_if
    pending_ban_rows: torch.Tensor | None = None  # (B,) int64
    pending_ban_tokens: torch.Tensor | None = None  # (B,) int64
    pending_ban_values: torch.Tensor | None = None  # (B,) int64: the pending tokens
    pending_ban_if: torch.Tensor | None = None  # (B,) int64
    # rows restricted to a list of tokens: every other token of theirs is masked
    allow_rows: torch.Tensor | None = None  # (A,) int64, each row once
    allow_pair_rows: torch.Tensor | None = None  # (M,) int64: index into allow_rows
    allow_pair_tokens: torch.Tensor | None = None  # (M,) int64

    def adjusted(self, logits: torch.Tensor) -> torch.Tensor:
        """The adjusted logits: a new float32 (B, V) tensor; logits (the model's, in any float dtype,
        maybe a CUDA graph's output buffer) are left as they are. The copy is made by the first pass
        that changes them: with penalties on every row, the penalties' pass reads the model's logits
        and writes it."""
        # the penalties commute with the masks (-inf stays -inf under them, other logits keep their
        # value) but not with a bias, which comes before them: without a bias they go first
        penalties_first = self.penalty_rows is not None and self.bias_rows is None
        if penalties_first and len(self.penalty_rows) == len(logits):  # rows are distinct: every row
            out = torch.empty(logits.shape, dtype=torch.float32, device=logits.device)
        else:
            out = logits.to(torch.float32, copy=True)
        if penalties_first:
            self._penalize(logits, out)
        self._mask_and_bias_(out)
        if self.penalty_rows is not None and not penalties_first:
            self._penalize(out, out)
        return out

    def _mask_and_bias_(self, logits: torch.Tensor) -> None:
        """In place on float32 logits: allowed tokens, logit biases, bans and the bans that hang on a
        pending token."""
        if self.allow_rows is not None:
            allowed = torch.zeros((len(self.allow_rows), logits.shape[1]), dtype=torch.bool, device=logits.device)
            allowed[self.allow_pair_rows, self.allow_pair_tokens] = True
            rows = logits[self.allow_rows].masked_fill(~allowed, float("-inf"))
            logits.index_copy_(0, self.allow_rows, rows)
        if self.bias_rows is not None:
            logits.index_put_((self.bias_rows, self.bias_tokens), self.bias_values, accumulate=True)
        if self.ban_rows is not None:
            logits[self.ban_rows, self.ban_tokens] = float("-inf")
        if self.pending_ban_rows is not None:  # no host sync: add -inf where it holds, 0 elsewhere
            hit = self.pending_ban_values == self.pending_ban_if
            logits.index_put_((self.pending_ban_rows, self.pending_ban_tokens),
                              torch.zeros_like(hit, dtype=logits.dtype).masked_fill(hit, float("-inf")),
                              accumulate=True)

    def _penalize(self, logits: torch.Tensor, out: torch.Tensor) -> None:
        """out[row] = the penalised logits[row] for the rows with penalties; out is float32, logits
        any float dtype or out itself."""
        counts, rows, slots = self.token_counts, self.penalty_rows, self.penalty_slots
        kernels = logits_ops_for(out)
        if kernels is not None:
            kernels.penalize(logits, out, rows, slots, counts.output_counts, counts.in_prompt,
                             self.presence, self.frequency, self.repetition)
        else:
            out.index_copy_(0, rows, apply_penalties(
                logits[rows].float(), counts.output_counts[slots], counts.in_prompt[slots],
                self.presence, self.frequency, self.repetition))

    def count_sampled(self, sampled: torch.Tensor, kept: torch.Tensor | None = None) -> None:
        """Count the step's sampled tokens for the rows with penalties (before the next step reads
        them); kept (speculative decoding): only the rows whose token the request keeps."""
        if self.penalty_rows is not None:
            rows = self.penalty_rows
            self.token_counts.count(self.penalty_slots if self.count_slots is None else self.count_slots,
                                    sampled[rows], None if kept is None else kept[rows])


def apply_penalties(logits: torch.Tensor, output_counts: torch.Tensor, in_prompt: torch.Tensor,
                    presence: torch.Tensor, frequency: torch.Tensor, repetition: torch.Tensor) -> torch.Tensor:
    """Repetition (Hugging Face: prompt and output tokens), then frequency and presence (OpenAI:
    output tokens) penalties on (P, V) float32 logits."""
    generated = output_counts > 0
    seen = generated | in_prompt
    repetition = repetition.unsqueeze(1)
    penalized = torch.where(logits > 0, logits / repetition, logits * repetition)
    logits = torch.where(seen, penalized, logits)
    logits = logits - frequency.unsqueeze(1) * output_counts
    return logits - presence.unsqueeze(1) * generated
