"""The pre-norm decoder-only transformer shared by Qwen3, Qwen2, Llama, Qwen3-MoE and Mixtral.

The three differ only in three switches, set by the registry from the architecture name:
Qwen3 normalises each q and k head with RMSNorm before rotary (qk_norm); Qwen2 has biases on
the q/k/v projections (qkv_bias); the output projection has one where the config's
attention_bias asks (o_bias, as q/k/v then do too). Llama has none of them by default. Parameter names follow Hugging Face's, except
that q/k/v and gate/up are fused (packed_modules_mapping says how checkpoint tensors map in).
Mixture-of-experts models (a MoESpec, models/moe_spec.py) have an expert block in place of the MLP
in their sparse layers; each expert's checkpoint tensors load into the stacked parameters of
layers/moe.py (expert_projections and checkpoint_renames say how).
"""
from __future__ import annotations

import torch
from torch import nn

from asyncllm.attention.base import DecodeRope, ForwardBatch, rotate_heads
from asyncllm.distributed import get_tp_size
from asyncllm.layers.embed_head import ParallelLMHead, VocabParallelEmbedding
from asyncllm.layers.fused import fused_ops_for
from asyncllm.layers.layernorm import RMSNorm
from asyncllm.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from asyncllm.layers.moe import SparseMoeBlock
from asyncllm.layers.rotary import RotaryEmbedding
from asyncllm.models.moe_spec import MoESpec


def head_dim_of(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


class DecoderAttention(nn.Module):
    def __init__(self, config, layer_id: int, qkv_bias: bool, o_bias: bool, qk_norm: bool,
                 rotary_emb: RotaryEmbedding):
        super().__init__()
        tp_size = get_tp_size()
        self.head_dim = head_dim_of(config)
        self.num_heads = config.num_attention_heads // tp_size
        self.num_kv_heads = max(1, config.num_key_value_heads // tp_size)
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.qkv_proj = QKVParallelLinear(config.hidden_size, self.head_dim, config.num_attention_heads,
                                          config.num_key_value_heads, bias=qkv_bias)
        self.o_proj = RowParallelLinear(config.num_attention_heads * self.head_dim, config.hidden_size, bias=o_bias)
        self.rotary_emb = rotary_emb  # one cache for all layers (DecoderModel's)
        self.layer_id = layer_id  # this layer's slice of the paged KV cache
        if qk_norm:
            self.q_norm = RMSNorm(self.head_dim, eps=config.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, eps=config.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None
        # chosen once, by where the weights live (the runner builds the model on its device)
        self._fused = fused_ops_for(self.o_proj.weight)
        self._norm_rope = self._norm_rope_native if self._fused is None else self._norm_rope_fused

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        qkv = self.qkv_proj(hidden_states)
        out = None
        if self._fused is not None and batch.is_decode_only:
            # the backend's attention kernel may do the q/k norm + rotary and the K/V store itself
            out = batch.attn_backend.attend_qkv(self.layer_id, qkv, self._decode_rope(positions, batch), batch)
        if out is None:
            q, k, v = self._norm_rope(positions, qkv, batch)
            out = batch.attn_backend.forward(self.layer_id, q, k, v, batch)
        return self.o_proj(out.flatten(1, -1))

    def _decode_rope(self, positions: torch.Tensor, batch: ForwardBatch) -> DecodeRope:
        # what the fused q/k norm + rotary reads besides the projection: the rotary kernel's arguments
        # too (_norm_rope_fused), so the two paths cannot drift apart
        norm_args = (self.q_norm.weight, self.k_norm.weight, self.q_norm.eps) if self.q_norm is not None else ()
        return DecodeRope(self.num_heads, positions, self.rotary_emb.cos_sin_cache, batch.slot_mapping, *norm_args,
                          rotate=batch.attn_backend.qk_rotation is not None)

    def _split_heads(self, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        return (q.view(-1, self.num_heads, self.head_dim), k.view(-1, self.num_kv_heads, self.head_dim),
                v.view(-1, self.num_kv_heads, self.head_dim))

    def _norm_rope_fused(self, positions: torch.Tensor, qkv: torch.Tensor, batch: ForwardBatch):
        # q/k norm and rotary in one kernel, in place on the projection's q and k columns, which
        # also stores k and v into the paged cache (so the backend is given None for them)
        rope = self._decode_rope(positions, batch)
        self._fused.qk_norm_rope_(qkv, positions, rope.cos_sin_cache, self.num_heads, self.num_kv_heads,
                                  self.head_dim, rope.q_weight, rope.k_weight, rope.eps,
                                  kv_cache=batch.attn_backend.kv_cache(self.layer_id), slot_mapping=batch.slot_mapping,
                                  kv_scales=batch.attn_backend.kv_scales, rotate=rope.rotate)
        q, _, _ = self._split_heads(qkv)
        return q, None, None

    def _norm_rope_native(self, positions: torch.Tensor, qkv: torch.Tensor, batch: ForwardBatch):
        # the PyTorch path (CPU, no Triton) and the fused kernel's reference
        q, k, v = self._split_heads(qkv)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.rotary_emb(positions, q, k)
        rotation = batch.attn_backend.qk_rotation
        if rotation is not None:
            q, k = rotate_heads(q, rotation), rotate_heads(k, rotation)
        return q, k, v


class DecoderMLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(config.hidden_size, [config.intermediate_size] * 2)
        self.down_proj = RowParallelLinear(config.intermediate_size, config.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # = down_proj(SiluAndMul()(gate_up)), with SwiGLU inside down_proj's kernel at decode: one launch fewer a layer
        return self.down_proj.forward_silu_mul(self.gate_up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, config, layer_id: int, qkv_bias: bool, o_bias: bool, qk_norm: bool,
                 rotary_emb: RotaryEmbedding, moe: MoESpec | None):
        super().__init__()
        self.self_attn = DecoderAttention(config, layer_id, qkv_bias, o_bias, qk_norm, rotary_emb)
        if moe is not None and layer_id in moe.sparse_layers:
            self.mlp = SparseMoeBlock(config.hidden_size, moe.num_experts, moe.top_k, moe.intermediate_size,
                                      moe.renormalize)
        else:
            self.mlp = DecoderMLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, positions, hidden_states, residual, batch: ForwardBatch):
        if residual is None:
            hidden_states, residual = self.input_layernorm(hidden_states), hidden_states
        else:
            hidden_states, residual = self.input_layernorm(hidden_states, residual)
        hidden_states = self.self_attn(positions, hidden_states, batch)
        hidden_states, residual = self.post_attention_layernorm(hidden_states, residual)
        return self.mlp(hidden_states), residual


class DecoderModel(nn.Module):
    def __init__(self, config, qkv_bias: bool, o_bias: bool, qk_norm: bool, max_positions: int,
                 moe: MoESpec | None):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        # one fp32 cos/sin cache shared by every layer, for the positions the engine can reach: one per
        # layer of max_position_embeddings rows took 560 MiB from Qwen3-0.6B's KV cache
        self.rotary_emb = RotaryEmbedding(head_dim_of(config), max_positions, config.rope_theta,
                                          config.asyncllm_rope_scaling)
        self.layers = nn.ModuleList(DecoderLayer(config, i, qkv_bias, o_bias, qk_norm, self.rotary_emb, moe)
                                    for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        hidden_states, residual = self.embed_tokens(input_ids), None
        for layer in self.layers:
            hidden_states, residual = layer(positions, hidden_states, residual, batch)
        hidden_states, _ = self.norm(hidden_states, residual)
        return hidden_states


class CausalLM(nn.Module):
    packed_modules_mapping = {
        "q_proj": ("qkv_proj", "q"),
        "k_proj": ("qkv_proj", "k"),
        "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }
    skipped_weight_prefixes = ("model.rotary_emb.",)  # some checkpoints store rotary buffers

    def __init__(self, config, qkv_bias: bool, o_bias: bool, qk_norm: bool, max_positions: int | None = None,
                 moe: MoESpec | None = None):
        """max_positions: the positions the rotary cache covers (the engine's max_model_len);
        default max_position_embeddings. moe: the expert layers, for a mixture-of-experts model."""
        super().__init__()
        self.config = config
        self.model = DecoderModel(config, qkv_bias, o_bias, qk_norm,
                                  max_positions or config.max_position_embeddings, moe)
        if moe is not None:  # read by load_weights
            self.checkpoint_renames, self.expert_projections = moe.checkpoint_renames, dict(moe.expert_projections)
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size)
        self.tied_parameters: tuple[str, ...] = ()
        if getattr(config, "tie_word_embeddings", False):
            self.lm_head.weight = self.model.embed_tokens.weight
            self.tied_parameters = ("lm_head.weight",)
            self.skipped_weight_prefixes = self.skipped_weight_prefixes + ("lm_head.",)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        return self.model(input_ids, positions, batch)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden_states)
