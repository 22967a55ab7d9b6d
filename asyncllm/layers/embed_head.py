"""Vocabulary-parallel embedding and lm_head: each rank holds a contiguous slice of the vocabulary.

A vocabulary that the rank count does not divide (Qwen3's tokenizer has 151,669 ids) is padded as
vLLM does: every shard has ceil(vocab_size / tp) rows, the rows past vocab_size are zero, and the
lm_head drops their logits after the gather, so the sampler sees exactly vocab_size columns.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from asyncllm.distributed import all_gather_last_dim, all_reduce, get_tp_rank, get_tp_size
from asyncllm.layers import skinny_linear
from asyncllm.layers.linear import check_loaded_shape


class VocabParallelEmbedding(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int):
        super().__init__()
        self.tp_rank, self.tp_size = get_tp_rank(), get_tp_size()
        self.vocab_size = vocab_size
        self.shard_size = -(-vocab_size // self.tp_size)  # ceil: the last shard(s) may be padded
        self.vocab_start = self.tp_rank * self.shard_size
        # rows of this shard that are real ids (the rest is padding)
        self.num_real_rows = max(0, min(self.shard_size, vocab_size - self.vocab_start))
        self.weight = nn.Parameter(torch.empty(self.shard_size, hidden_size), requires_grad=False)
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        check_loaded_shape(loaded, (self.vocab_size, *param.shape[1:]))
        param.data[self.num_real_rows:].zero_()
        param.data[:self.num_real_rows].copy_(loaded.narrow(0, self.vocab_start, self.num_real_rows))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return F.embedding(input_ids, self.weight)
        local = input_ids - self.vocab_start
        in_shard = (local >= 0) & (local < self.shard_size)
        y = F.embedding(local.clamp(0, self.shard_size - 1), self.weight) * in_shard.unsqueeze(-1)
        return all_reduce(y)


class ParallelLMHead(VocabParallelEmbedding):
    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        logits = all_gather_last_dim(skinny_linear.linear(hidden_states, self.weight))
        # the padding rows' columns (zero logits) would be sampled as ids the tokenizer does not have
        return logits[..., :self.vocab_size] if logits.shape[-1] != self.vocab_size else logits
