"""models/model_config.py reads config.json without transformers: held to transformers' AutoConfig
(the reference it replaces) on the configs the tests' tiny checkpoints are built from, on sparse
files that leave fields to the defaults, and on the rope spellings of old and new files."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from asyncllm.models.checkpoint import load_hf_config
from asyncllm.models.model_config import SUPPORTED_MODEL_TYPES, read_model_config
from asyncllm.testing import hf_config

transformers = pytest.importorskip("transformers", reason="the reference these configs are held to")

# every config field the engine reads (models/, runner/tp_protocol.py, startup_cache.py, engine/intake.py)
FIELDS = ("architectures", "model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
          "num_attention_heads", "num_key_value_heads", "head_dim", "max_position_embeddings", "rms_norm_eps",
          "hidden_act", "tie_word_embeddings", "attention_bias", "rope_parameters", "partial_rotary_factor",
          "use_sliding_window", "sliding_window", "layer_types", "eos_token_id", "bos_token_id", "dtype",
          "quantization_config", "num_experts", "num_local_experts", "num_experts_per_tok", "moe_intermediate_size",
          "norm_topk_prob", "mlp_only_layers", "decoder_sparse_step", "final_logit_softcapping",
          "attn_logit_softcapping")
ABSENT = "<absent>"
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ARCHITECTURES = {"qwen3": "Qwen3ForCausalLM", "qwen2": "Qwen2ForCausalLM", "llama": "LlamaForCausalLM",
                 "qwen3_moe": "Qwen3MoeForCausalLM", "mixtral": "MixtralForCausalLM"}
LLAMA3_SCALING = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                  "original_max_position_embeddings": 64}


def seen(config) -> dict:
    out = {}
    for name in FIELDS:
        value = getattr(config, name, ABSENT)
        out[name] = str(value).removeprefix("torch.") if name == "dtype" and value is not None else value
    return out


def assert_like_transformers(model_dir) -> None:
    ours = read_model_config(os.path.join(model_dir, "config.json"))
    assert ours is not None
    theirs = transformers.AutoConfig.from_pretrained(str(model_dir))
    assert seen(ours) == seen(theirs)


# the overrides the tests build tiny checkpoints with (tests/conftest.py, test_models.py, test_moe.py, ...)
BUILT = [("qwen3", {}), ("qwen3", {"tie_word_embeddings": True}), ("qwen2", {}), ("llama", {}),
         ("llama", {"rope_scaling": LLAMA3_SCALING}), ("qwen3_moe", {}), ("qwen3_moe", {"mlp_only_layers": [0]}),
         ("qwen3_moe", {"decoder_sparse_step": 2, "norm_topk_prob": True}), ("mixtral", {}),
         ("qwen2", {"attention_bias": True}), ("qwen3", {"head_dim": 32})]


@pytest.mark.parametrize("arch,overrides", BUILT, ids=[f"{a}-{o}" for a, o in BUILT])
def test_a_saved_tiny_config_reads_as_transformers_reads_it(tmp_path, arch, overrides):
    hf_config(arch, **overrides).save_pretrained(tmp_path)
    assert_like_transformers(tmp_path)


SPARSE = [{}, {"rope_theta": 5e5}, {"rope_scaling": {"type": "linear", "factor": 2.0}},
          {"rope_theta": 5e5, "rope_scaling": dict(LLAMA3_SCALING, original_max_position_embeddings=64)},
          {"rope_parameters": {"rope_type": "default", "rope_theta": 3.0}, "rope_theta": 7.0},
          {"rope_parameters": {"rope_type": "default"}}, {"torch_dtype": "bfloat16"}, {"dtype": "float16"},
          {"rope_scaling": None, "rope_theta": 3.0}, {"num_experts": 4, "num_experts_per_tok": 2},
          {"head_dim": 16}, {"use_sliding_window": True, "sliding_window": 32, "max_window_layers": 1},
          {"use_sliding_window": False, "sliding_window": 32}, {"eos_token_id": [5, 6]},
          {"quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128]}}]


CASES = [(arch, fields) for arch in SUPPORTED_MODEL_TYPES for fields in SPARSE] + [
    # num_key_value_heads null: the number of query heads, where transformers' class takes None at all
    (arch, {"num_key_value_heads": None}) for arch in ("llama", "qwen2", "qwen3")]


@pytest.mark.parametrize("arch,fields", CASES, ids=[f"{a}-{json.dumps(f)[:60]}" for a, f in CASES])
def test_a_sparse_config_gets_transformers_defaults(tmp_path, arch, fields):
    # only what every file has: the rest is the model_type's defaults, which must be transformers'
    config = {"model_type": arch, "architectures": [ARCHITECTURES[arch]], "num_hidden_layers": 2,
              "hidden_size": 64, "num_attention_heads": 4, "max_position_embeddings": 128, **fields}
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert_like_transformers(tmp_path)


def test_the_engine_config_matches_through_load_hf_config(tmp_path):
    # load_hf_config's own derivations (rope_theta, the rope scaling the rotary reads) on our reading
    hf_config("llama", rope_scaling=LLAMA3_SCALING).save_pretrained(tmp_path)
    config = load_hf_config(str(tmp_path))
    assert type(config).__name__ == "ModelConfig"
    assert config.rope_theta == 1000000.0 and config.asyncllm_rope_scaling["rope_type"] == "llama3"
    assert config.asyncllm_rope_scaling["factor"] == 8.0 and config.head_dim == 64


def test_another_model_type_is_left_to_transformers(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]}))
    assert read_model_config(str(tmp_path / "config.json")) is None


@pytest.mark.parametrize("text,says", [("{not json", "not valid JSON"), ("[1, 2]", "expected a JSON object")])
def test_a_config_that_is_no_json_object_is_refused_naming_the_file(tmp_path, text, says):
    (tmp_path / "config.json").write_text(text)
    with pytest.raises(ValueError, match=says) as info:
        load_hf_config(str(tmp_path))
    assert str(tmp_path / "config.json") in str(info.value)


def test_importing_the_api_and_resolving_a_config_import_no_transformers(tmp_path):
    # transformers takes seconds to import: `import asyncllm`, the API's classes and the config a
    # start-up resolves must not need it (the tokenizer, which does, loads in a thread beside the weights)
    hf_config("qwen3").save_pretrained(tmp_path)
    code = ("import sys, asyncllm; assert 'transformers' not in sys.modules, 'import asyncllm'\n"
            "from asyncllm import LLM, AsyncLLMEngine, SamplingParams, Config\n"
            "assert 'transformers' not in sys.modules, 'the API classes'\n"
            "from asyncllm.models.resolve import resolve_config\n"
            f"resolve_config(Config(model={str(tmp_path)!r}, device='cpu'))\n"
            "assert 'transformers' not in sys.modules, 'resolve_config'\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, PYTHONPATH=ROOT))
    assert done.returncode == 0, done.stderr[-2000:]

