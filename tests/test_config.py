"""Config validation, resolving the model it names (resolve_config), and the LLM constructor's checks of
its options and checkpoint."""
from __future__ import annotations

import os
import shutil

import pytest

from asyncllm import LLM, Config
from asyncllm.models.resolve import resolve_config

BAD_FIELDS = [
    ("kvcache_block_size", 8), ("kvcache_block_size", 24), ("kvcache_block_size", 512),
    ("max_num_seqs", 0), ("max_num_batched_tokens", -1),
    ("gpu_memory_utilization", 0), ("gpu_memory_utilization", 1.5),
    ("dtype", "int8"), ("dtype", "torch.bfloat16"), ("dtype", None),
    ("device", "tpu"), ("attention_backend", "nope"), ("enforce_eager", "yes"),
    ("num_kvcache_blocks", 0), ("max_model_len", 0), ("seed", 1.5), ("cuda_graph_max_tokens", -1),
    ("cuda_graph_max_tokens", 1.0), ("seed", -1), ("seed", 2 ** 64),
]


@pytest.mark.parametrize("field,value", BAD_FIELDS, ids=[f"{f}={v!r}" for f, v in BAD_FIELDS])
def test_bad_field_raises_value_error_naming_it(tiny_qwen3, field, value):
    with pytest.raises(ValueError, match=rf"\b{field}\b"):
        Config(model=tiny_qwen3, **{field: value})


def test_missing_model_dir():
    with pytest.raises(ValueError, match=r"\bmodel\b"):
        Config(model="/nonexistent")


def test_max_model_len_clipped_to_position_embeddings(tiny_qwen3):
    assert resolve_config(Config(model=tiny_qwen3, max_model_len=100000)).max_model_len == 4096
    assert resolve_config(Config(model=tiny_qwen3, max_model_len=100)).max_model_len == 100


@pytest.mark.parametrize("block_size", [16, 32, 64, 128, 256])
def test_all_power_of_two_block_sizes_accepted(tiny_qwen3, block_size):
    assert Config(model=tiny_qwen3, kvcache_block_size=block_size).kvcache_block_size == block_size


def test_cpu_defaults_resolve(tiny_qwen3):
    import torch
    config = resolve_config(Config(model=tiny_qwen3, device="cpu"))
    assert config.device == "cpu" and config.torch_dtype == torch.float32
    assert config.hf_config.vocab_size == 151936


def test_unknown_llm_option_is_a_type_error_naming_it(tiny_qwen3):
    with pytest.raises(TypeError, match="kv_cache_blocks"):
        LLM(tiny_qwen3, kv_cache_blocks=4)


def test_pickle_only_checkpoint_refused(tiny_qwen3, tmp_path):
    model_dir = tmp_path / "pickled"
    model_dir.mkdir()
    # the config and tokenizer are fine; the only weights are a pickle file
    for name in os.listdir(tiny_qwen3):
        if not name.endswith(".safetensors") and os.path.isfile(os.path.join(tiny_qwen3, name)):
            shutil.copy(os.path.join(tiny_qwen3, name), model_dir)
    (model_dir / "pytorch_model.bin").write_bytes(b"")
    with pytest.raises(ValueError, match="(?i)pickle") as info:
        LLM(str(model_dir), num_kvcache_blocks=4)
    assert "safetensors" in str(info.value)


def test_dtype_accepts_torch_dtypes_and_aliases(tiny_qwen3):
    import torch
    for dtype, name in [(torch.bfloat16, "bfloat16"), (torch.float16, "float16"), (torch.float32, "float32"),
                        ("half", "float16"), ("float", "float32"), ("bfloat16", "bfloat16")]:
        config = resolve_config(Config(model=tiny_qwen3, dtype=dtype))
        assert (config.dtype, config.torch_dtype) == (name, getattr(torch, name)), dtype
    with pytest.raises(ValueError, match=r"Config\.dtype: .*torch\.dtype.*got torch\.int8"):
        Config(model=tiny_qwen3, dtype=torch.int8)
