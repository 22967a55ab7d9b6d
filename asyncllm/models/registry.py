"""Which model class serves which checkpoint `architectures` entry, and the model built for a config."""
from __future__ import annotations

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from asyncllm.models.moe_spec import moe_spec
from asyncllm.models.transformer import CausalLM, head_dim_of


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


class FloatFactoriesIn(TorchFunctionMode):
    """Within it, on this thread, the float factories that name no dtype (the layers' parameters:
    nn.Parameter(torch.empty(...))) make `dtype`: torch.set_default_dtype's effect without its
    reach, which is the whole process (two engines building at once would swap each other's dtype,
    and every thread's tensors that name none would take it meanwhile). Torch function modes are
    per thread, as the torch.device context is."""

    FACTORIES = frozenset({torch.empty, torch.zeros, torch.ones, torch.rand, torch.randn, torch.empty_strided})

    def __init__(self, dtype: torch.dtype):
        super().__init__()
        self.dtype = dtype

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in self.FACTORIES and kwargs.get("dtype") is None:
            kwargs["dtype"] = self.dtype
        return func(*args, **kwargs)


def create_model(config, max_model_len: int | None = None, dtype: torch.dtype | None = None) -> nn.Module:
    """The model for a Hugging Face config. max_model_len: the longest sequence it will run (its rotary
    cache covers that many positions); default the config's max_position_embeddings. dtype: its
    parameters' (None: torch's default dtype); the buffers keep the dtypes they name (the rotary
    cache is float32)."""
    architectures = getattr(config, "architectures", None) or []
    for arch in architectures:
        if arch in MODEL_REGISTRY:
            with FloatFactoriesIn(dtype or torch.get_default_dtype()):
                return CausalLM(config, **MODEL_REGISTRY[arch](config), max_positions=max_model_len)
    raise ValueError(f"unsupported architecture {architectures!r}; supported: {', '.join(sorted(MODEL_REGISTRY))}")


def model_structure(config) -> dict:
    """What the model create_model builds for a Hugging Face config depends on: two configs with the
    same structure build models of the same parameters, shapes and constants, so either's checkpoint
    loads into either's model (an engine's reload())."""
    arch = next((a for a in getattr(config, "architectures", None) or [] if a in MODEL_REGISTRY), None)
    fields = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
              "num_key_value_heads", "rope_theta", "asyncllm_rope_scaling", "rms_norm_eps")
    return {"architecture": arch, **(MODEL_REGISTRY[arch](config) if arch else {}),
            **{name: getattr(config, name, None) for name in fields}, "head_dim": head_dim_of(config),
            "tie_word_embeddings": bool(getattr(config, "tie_word_embeddings", False))}
