"""Which model class serves which checkpoint `architectures` entry."""
from __future__ import annotations

from torch import nn

from asyncllm.models.moe_spec import moe_spec
from asyncllm.models.transformer import CausalLM


def _attention_bias(config) -> bool:
    return bool(getattr(config, "attention_bias", False))


# architecture -> the CausalLM switches for a config
MODEL_REGISTRY = {
    "Qwen3ForCausalLM": lambda c: dict(qkv_bias=_attention_bias(c), o_bias=_attention_bias(c), qk_norm=True),
    "Qwen2ForCausalLM": lambda c: dict(qkv_bias=True, o_bias=False, qk_norm=False),
    "LlamaForCausalLM": lambda c: dict(qkv_bias=_attention_bias(c), o_bias=_attention_bias(c), qk_norm=False),
    "Qwen3MoeForCausalLM": lambda c: dict(qkv_bias=_attention_bias(c), o_bias=_attention_bias(c), qk_norm=True,
                                          moe=moe_spec(c)),
    "MixtralForCausalLM": lambda c: dict(qkv_bias=False, o_bias=False, qk_norm=False, moe=moe_spec(c)),
}
# base models, as transformers' AutoModel saves them (an embedding model's checkpoint; no LM head:
# checkpoint.load_weights)
MODEL_REGISTRY.update(Qwen3Model=MODEL_REGISTRY["Qwen3ForCausalLM"], Qwen2Model=MODEL_REGISTRY["Qwen2ForCausalLM"],
                      LlamaModel=MODEL_REGISTRY["LlamaForCausalLM"])


def create_model(config, max_model_len: int | None = None) -> nn.Module:
    """The model for a Hugging Face config. max_model_len: the longest sequence it will run (its rotary
    cache covers that many positions); default the config's max_position_embeddings."""
    architectures = getattr(config, "architectures", None) or []
    for arch in architectures:
        if arch in MODEL_REGISTRY:
            return CausalLM(config, **MODEL_REGISTRY[arch](config), max_positions=max_model_len)
    raise ValueError(f"unsupported architecture {architectures!r}; supported: {', '.join(sorted(MODEL_REGISTRY))}")
