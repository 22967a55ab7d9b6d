"""Which model class serves which checkpoint `architectures` entry."""
from __future__ import annotations

from torch import nn

from asyncllm.models.transformer import CausalLM


def _attention_bias(config) -> bool:
    return bool(getattr(config, "attention_bias", False))


MODEL_REGISTRY = {
    "Qwen3ForCausalLM": lambda c: CausalLM(c, qkv_bias=_attention_bias(c), o_bias=_attention_bias(c), qk_norm=True),
    "Qwen2ForCausalLM": lambda c: CausalLM(c, qkv_bias=True, o_bias=False, qk_norm=False),
    "LlamaForCausalLM": lambda c: CausalLM(c, qkv_bias=_attention_bias(c), o_bias=_attention_bias(c), qk_norm=False),
}


def create_model(config) -> nn.Module:
    architectures = getattr(config, "architectures", None) or []
    for arch in architectures:
        if arch in MODEL_REGISTRY:
            return MODEL_REGISTRY[arch](config)
    raise ValueError(f"unsupported architecture {architectures!r}; supported: {', '.join(sorted(MODEL_REGISTRY))}")
