"""A checkpoint's config.json read without transformers, for the architectures the engine runs.

Importing transformers takes seconds, a large part of a warm start-up, most of it before the first
weight is read; these five families' configs are plain JSON plus a few defaults, so
they are read here: every field of the file an attribute (as transformers' config classes keep them),
the fields the file leaves out set to the defaults of transformers' class for its model_type, and the
values those classes derive (head_dim, num_key_value_heads, sliding_window, layer_types, the rope
parameters) derived the same way. tests/test_model_config.py holds this to transformers' AutoConfig on
the tests' checkpoints and on sparse configs. Another model_type returns None: the caller asks
transformers (whose registry knows it, or refuses it in its own words).
"""
from __future__ import annotations

import json

from asyncllm.config import model_file_error

# transformers' defaults (5.x config classes) for the fields the engine reads; a family's own on top
_COMMON = dict(hidden_act="silu", tie_word_embeddings=False, rms_norm_eps=1e-6, bos_token_id=None, eos_token_id=None,
               rope_theta=10000.0)
_QWEN = dict(_COMMON, vocab_size=151936, hidden_size=4096, intermediate_size=22016, num_hidden_layers=32,
             num_attention_heads=32, num_key_value_heads=32, max_position_embeddings=32768, use_sliding_window=False,
             sliding_window=4096, max_window_layers=28, layer_types=None)
_DEFAULTS = {
    "llama": dict(_COMMON, vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                  num_attention_heads=32, num_key_value_heads=None, max_position_embeddings=2048, bos_token_id=1,
                  eos_token_id=2, attention_bias=False, mlp_bias=False, head_dim=None),
    "mixtral": dict(_COMMON, vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                    num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=4096 * 32, rms_norm_eps=1e-5,
                    bos_token_id=1, eos_token_id=2, sliding_window=None, head_dim=None, num_experts_per_tok=2, num_local_experts=8,
                    rope_theta=1e6),
    "qwen2": _QWEN,
    "qwen3": dict(_QWEN, head_dim=128, attention_bias=False),
    "qwen3_moe": dict({k: v for k, v in _QWEN.items() if k not in ("max_window_layers", "layer_types")},
                      hidden_size=2048, intermediate_size=6144, num_hidden_layers=24, num_key_value_heads=4,
                      attention_bias=False, decoder_sparse_step=1, moe_intermediate_size=768, num_experts_per_tok=8,
                      num_local_experts=128, norm_topk_prob=False, mlp_only_layers=None),
}
# config.json names that transformers' class keeps under another attribute (its attribute_map); both answer
_ALIASES = {"mixtral": {"num_experts": "num_local_experts"}, "qwen3_moe": {"num_experts": "num_local_experts"}}
SUPPORTED_MODEL_TYPES = tuple(_DEFAULTS)
_QWEN_FAMILY = ("qwen2", "qwen3", "qwen3_moe")  # sliding_window is None unless use_sliding_window


class ModelConfig:
    """config.json's fields as attributes, defaults filled as transformers' class for its model_type
    fills them (read with getattr(config, name, default), as a transformers config is)."""

    def __init__(self, fields: dict):
        self.__dict__.update(fields)

    def to_dict(self) -> dict:
        return dict(self.__dict__)

    def __repr__(self) -> str:
        return f"ModelConfig({self.__dict__!r})"


def read_json_object(path: str) -> dict:
    """path's JSON object (a checkpoint's config.json, generation_config.json); a ValueError naming the
    file where it is not valid JSON or not an object."""
    try:
        with open(path) as f:
            raw = json.load(f)
    except ValueError as e:
        raise ValueError(f"{path}: not valid JSON: {e}") from None
    if not isinstance(raw, dict):
        raise ValueError(f"{path}: expected a JSON object, got {type(raw).__name__}")
    return raw


def read_model_config(config_path: str) -> ModelConfig | None:
    """config_path's ModelConfig; None where its model_type is not one of SUPPORTED_MODEL_TYPES. A file
    that is not a JSON object is a ValueError naming it."""
    raw = read_json_object(config_path)
    model_type = raw.get("model_type")
    if model_type not in _DEFAULTS:
        return None
    fields = dict(_DEFAULTS[model_type])
    for name, default in fields.items():  # transformers' classes refuse another type; a truthy string would pass
        if isinstance(default, bool) and name in raw and not isinstance(raw[name], bool):
            raise model_file_error(config_path, name, f"must be true or false, got {raw[name]!r}")
    aliases = _ALIASES.get(model_type, {})
    for name, value in raw.items():
        fields[aliases.get(name, name)] = value
    for alias, name in aliases.items():
        fields[alias] = fields[name]
    if "torch_dtype" in fields and "dtype" not in fields:  # transformers 5's name for the older torch_dtype
        fields["dtype"] = fields["torch_dtype"]
    fields.setdefault("dtype", None)
    fields["torch_dtype"] = fields["dtype"]
    _derive(fields, model_type)
    return ModelConfig(fields)


def _derive(fields: dict, model_type: str) -> None:
    """The values transformers' config classes compute from others as they are built (their __post_init__)."""
    heads, hidden = fields.get("num_attention_heads"), fields.get("hidden_size")
    if fields.get("num_key_value_heads") is None:
        fields["num_key_value_heads"] = heads
    if model_type == "llama" and fields.get("head_dim") is None and _is_int(hidden) and _is_int(heads) and heads:
        fields["head_dim"] = hidden // heads
    if model_type == "qwen3_moe" and fields.get("mlp_only_layers") is None:
        fields["mlp_only_layers"] = []
    if model_type in _QWEN_FAMILY and not fields["use_sliding_window"]:
        fields["sliding_window"] = None
    if "layer_types" in fields and fields["layer_types"] is None and _is_int(fields.get("num_hidden_layers")):
        window, first = fields["sliding_window"], fields["max_window_layers"]
        fields["layer_types"] = ["sliding_attention" if window is not None and i >= first else "full_attention"
                                 for i in range(fields["num_hidden_layers"])]
    # transformers 5 keeps the rope settings in rope_parameters (rope_theta among them), built from an
    # older file's rope_scaling and top-level rope_theta; a file's own rope_parameters win over both
    parameters = fields.get("rope_parameters")
    if not isinstance(parameters, dict):
        parameters = dict(fields.get("rope_scaling") or {})
        parameters.setdefault("rope_theta", fields["rope_theta"])
    else:
        parameters = dict(parameters)
        parameters.setdefault("rope_theta", _DEFAULTS[model_type]["rope_theta"])
    parameters.setdefault("rope_type", parameters.get("type", "default"))
    fields["rope_parameters"] = fields["rope_scaling"] = parameters
    del fields["rope_theta"]  # transformers 5 has none beside rope_parameters; load_hf_config sets it from them


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)

