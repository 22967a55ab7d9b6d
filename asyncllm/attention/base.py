"""The attention backend interface and the one step's inputs it reads (ForwardBatch)."""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch

# An FP8 KV cache's (k_scale, v_scale): the cache holds x / scale, readers multiply by it. One scale
# per tensor (K, V), as vLLM keeps per layer; uncalibrated, every layer's is 1.0, vLLM's default
# (calculate_kv_scales=False). e4m3 spans +-448 with a relative step of 1/16 down to 2**-6, so K and V
# of models in bf16 (Qwen3's k after its RMSNorm, v rarely past a few tens) fit without a scale; the
# stores clamp what does not. The kernels take the pair, so calibrated or checkpoint scales plug in.
FP8_KV_SCALES = (1.0, 1.0)


def hadamard_matrix(n: int, device: torch.device | str | None = None) -> torch.Tensor:
    """Sylvester's n x n Hadamard matrix over sqrt(n), fp32 (n a power of two): orthogonal and
    symmetric, entry (i, j) = (-1) ** popcount(i & j) / sqrt(n), as kernels.fused_ops builds it."""
    assert n > 0 and n & (n - 1) == 0, f"a Hadamard matrix needs a power-of-two size, got {n}"
    index = torch.arange(n)
    bits = index[:, None] & index[None, :]
    parity = torch.zeros_like(bits)
    while bits.any():
        parity ^= bits & 1
        bits >>= 1
    return ((1 - 2 * parity).float() / n ** 0.5).to(device)


def rotate_heads(x: torch.Tensor, rotation: torch.Tensor) -> torch.Tensor:
    """x (..., head_dim) @ rotation in fp32, rounded once to x's dtype (as the fused kernel rounds)."""
    return (x.float() @ rotation).to(x.dtype)


class DecodeRope(NamedTuple):
    """What the q/k norm + rotary (kernels.fused_ops.qk_norm_rope_) of a step reads besides the fused
    projection: given to the backend with the projection (AttentionBackend.attend_qkv), a decode
    step's attention kernel may do that work itself."""
    num_heads: int  # query heads (this rank's)
    positions: torch.Tensor  # (T,) int64
    cos_sin_cache: torch.Tensor  # (max_positions, head_dim) fp32 rows [cos(half) | sin(half)]
    slot_mapping: torch.Tensor  # (T,) int64, -1: store nothing
    q_weight: torch.Tensor | None = None  # q / k RMSNorm weights (head_dim,), Qwen3; None: no norm
    k_weight: torch.Tensor | None = None
    eps: float = 1e-6
    rotate: bool = False  # q and k by hadamard_matrix(head_dim) after the rotary (AttentionBackend.qk_rotation)


@dataclass
class ForwardBatch:
    """One step's inputs, packed along a single token axis (no padded batch axis).

    Sequence i owns query rows query_start_loc[i]:query_start_loc[i+1]; its KV after this step
    spans seq_lens[i] tokens, of which the last (query length) are the ones computed now.
    """
    input_ids: torch.Tensor  # (num_tokens,) int64
    positions: torch.Tensor  # (num_tokens,) int64
    slot_mapping: torch.Tensor  # (num_tokens,) int64: block_id * block_size + offset; -1 = don't store
    query_start_loc: torch.Tensor  # (num_seqs + 1,) int32
    seq_lens: torch.Tensor  # (num_seqs,) int32
    block_tables: torch.Tensor  # (num_seqs, max_blocks_per_seq) int32, padded with 0
    logits_indices: torch.Tensor  # (num_sampled,) int64: rows whose logits are sampled
    num_seqs: int
    num_tokens: int
    max_query_len: int
    max_seq_len: int
    query_lens_cpu: list[int] = field(default_factory=list)
    seq_lens_cpu: list[int] = field(default_factory=list)
    attn_backend: "AttentionBackend | None" = None
    attn_metadata: Any = None  # the backend's own, set by prepare_metadata

    @property
    def is_decode_only(self) -> bool:
        return self.max_query_len == 1


class AttentionBackend(ABC):
    """Stores each step's K/V into the paged cache and attends over it."""

    name = "base"
    supports_cuda_graphs = False  # decode-only steps
    supports_mixed_cuda_graphs = False  # steps with prefill chunks too (up to a token bound)

    def __init__(self, k_caches: list[torch.Tensor], v_caches: list[torch.Tensor], num_heads: int,
                 num_kv_heads: int, head_dim: int, scale: float, rotate_qk: bool = False):
        # each cache: (num_blocks, block_size, num_kv_heads, head_dim)
        self.k_caches = k_caches
        self.v_caches = v_caches
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale
        self.block_size = k_caches[0].shape[1]
        self.kv_scales = FP8_KV_SCALES  # read only where the caches are FP8 (Config.kv_cache_dtype="fp8")
        # an FP8 cache's keys (Config.kv_cache_rotation): the model rotates each head's q and k by this
        # orthogonal matrix after its rotary, so scores are unchanged but K's outlier channels are spread
        # over the head before e4m3 rounds it; None: no rotation
        self.qk_rotation = hadamard_matrix(head_dim, k_caches[0].device) if rotate_qk else None

    def prepare_metadata(self, batch: ForwardBatch) -> None:
        """Build per-step metadata from the batch (called once per step, before the forward)."""

    def forward(self, layer_id: int, q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None,
                batch: ForwardBatch) -> torch.Tensor:
        """q: (T, H, D); k, v: (T, Hkv, D) for this step's tokens, stored into the cache first, or
        None where the caller has stored them already (kv_cache). Returns (T, H, D)."""
        if k is not None:
            self.store_kv(k, v, self.k_caches[layer_id], self.v_caches[layer_id], batch.slot_mapping)
        return self.attend(layer_id, q, batch)

    @abstractmethod
    def store_kv(self, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 slot_mapping: torch.Tensor) -> None:
        """Write k, v (T, Hkv, D) into the caches at slot_mapping's slots (-1: skip)."""

    @abstractmethod
    def attend(self, layer_id: int, q: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        """Attention of q (T, H, D) over this layer's paged cache, this step's K/V stored. Returns (T, H, D)."""

    def attend_qkv(self, layer_id: int, qkv: torch.Tensor, rope: DecodeRope,
                   batch: ForwardBatch) -> torch.Tensor | None:
        """A decode-only step's attention from the fused projection qkv (T, (H + 2 * Hkv) * D) before
        its q/k norm + rotary, for a backend whose kernel does that work (and the K/V store) itself:
        (T, H, D), or None where this backend does not, and the caller runs the q/k norm + rotary
        and forward. Default: None."""
        return None

    def kv_cache(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        """This layer's (k_cache, v_cache), for a kernel that stores a step's K/V as it makes them
        (the fused q/k norm + rotary, quantizing by kv_scales where the cache is FP8); forward is
        then called with k = v = None."""
        return self.k_caches[layer_id], self.v_caches[layer_id]

    # CUDA graphs: decode-only steps of up to max_batch_size sequences, and (where
    # supports_mixed_cuda_graphs) any step of up to max_mixed_tokens tokens
    def init_cuda_graph_state(self, max_batch_size: int, max_blocks_per_seq: int, max_mixed_tokens: int = 0,
                              decode_buffers: "PagedGraphBuffers | None" = None) -> None:
        """decode_buffers: the decode graphs' slot mapping, lengths and block tables where the caller
        keeps them (and writes a replay's own into them); None: the backend makes its own."""
        raise NotImplementedError(f"the {self.name} backend does not support CUDA graphs")

    def decode_graph_context_bounds(self, batch_size: int, max_seq_len: int) -> list[int]:
        """The context-length bounds (ascending, the last max_seq_len) for which decode graphs of
        batch_size are captured, each replayed for steps whose longest sequence fits in it: a
        backend whose kernels choose their work split by the length bound gets short contexts
        their own graphs. Default: one graph for any length."""
        return [max_seq_len]

    def mixed_graph_context_bounds(self, num_tokens: int, num_seqs: int, max_seq_len: int) -> list[int]:
        """As decode_graph_context_bounds, for the mixed graph of num_tokens tokens and num_seqs
        sequences. Default: one graph for any length."""
        return [max_seq_len]

    def prepare_for_capture(self, batch: ForwardBatch) -> None:
        """Point batch's metadata at static buffers sized for its num_tokens and num_seqs; a batch
        with max_query_len > 1 is captured as a mixed step. batch.max_seq_len is the graph's context
        bound (decode_graph_context_bounds / mixed_graph_context_bounds); every replay's sequences fit in it."""
        raise NotImplementedError

    def prepare_for_replay(self, batch: ForwardBatch, graph_batch: ForwardBatch) -> None:
        """Copy this step's metadata into the static buffers of the graph captured with graph_batch."""
        raise NotImplementedError
