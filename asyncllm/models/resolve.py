"""The model a Config names, read once by the engine before it builds anything: a hub id
downloaded (safetensors only) into the hub's cache, a .gguf file converted into its cache directory, the checkpoint's config loaded and checked against the
settings (tensor-parallel splits, the CPU KV cache's size), max_model_len clipped to the model's
positions, and dtype 'auto' settled (auto_torch_dtype)."""
from __future__ import annotations

import os

import torch

from asyncllm.config import Config, config_error
from asyncllm.models.checkpoint import load_hf_config
from asyncllm.models.gguf import is_gguf_conversion, resolve_model_path
from asyncllm.models.moe_spec import MoESpec, moe_spec
from asyncllm.models.transformer import head_dim_of

TORCH_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}  # config.DTYPES


def resolve_config(config: Config) -> Config:
    """Fill in config's model-dependent fields (model, hf_config, max_model_len, torch_dtype), in place."""
    if not os.path.exists(config.model):  # a hub id (Config checked its shape): its snapshot directory
        # huggingface_hub takes most of a second to import (its HTTP stack): only for a hub id
        from asyncllm.models.hub import download_model
        config.model = download_model(config.model, config.revision)
    if os.path.isfile(config.model):  # a .gguf file: its converted cache directory
        config.model = resolve_model_path(config.model)
    hf = config.hf_config = load_hf_config(config.model)
    max_pos = getattr(hf, "max_position_embeddings", None) or config.max_model_len
    config.max_model_len = min(config.max_model_len, max_pos)
    if config.tensor_parallel_size > 1:
        _check_tensor_parallel_split(hf, config.tensor_parallel_size)
    config.torch_dtype = TORCH_DTYPES[config.dtype] if config.dtype != "auto" else \
        auto_torch_dtype(hf, config.model, config.device)
    config.kv_cache_torch_dtype = torch.float8_e4m3fn if config.kv_cache_dtype == "fp8" else config.torch_dtype
    head_dim = head_dim_of(hf)
    if config.kv_cache_dtype == "fp8" and config.kv_cache_rotation and head_dim & (head_dim - 1):
        raise config_error("kv_cache_rotation", f"the Hadamard rotation of an FP8 cache's keys needs a power-of-two "
                                                f"head_dim; this model's is {head_dim}: pass kv_cache_rotation=False")
    if config.device == "cpu":
        memory = _machine_memory()
        if memory is not None:
            _check_cpu_weights(config, memory)
            _check_cpu_kv_cache(config, memory)
    return config


def auto_torch_dtype(hf, model_dir: str, device: str) -> torch.dtype:
    """What dtype 'auto' runs the model in on device ('cpu' or 'cuda'): float32 on CPU (its bf16 matmuls
    are slow, and CPU results are compared with transformers' in float32); on CUDA bfloat16 for a GGUF
    conversion (its float32 tensors are quantized weights dequantized: float32 would only double the
    memory and bandwidth, and llama.cpp and vLLM run GGUF in 16 bits), else the checkpoint's own dtype
    (bfloat16 where its config.json names none)."""
    if device == "cpu":
        return torch.float32
    if is_gguf_conversion(model_dir):
        return torch.bfloat16
    ckpt = getattr(hf, "torch_dtype", None) or getattr(hf, "dtype", None)
    if isinstance(ckpt, str):
        ckpt = TORCH_DTYPES.get(ckpt)
    return ckpt if ckpt in (torch.float16, torch.bfloat16, torch.float32) else torch.bfloat16


def _machine_memory() -> int | None:
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def _check_cpu_weights(config: Config, memory: int) -> None:
    """Weights that config.json makes larger than the machine's memory fail in torch's allocator
    (naming nothing): say so here, naming the file."""
    hf = config.hf_config
    hidden, layers, vocab = hf.hidden_size, hf.num_hidden_layers, hf.vocab_size
    heads = hf.num_attention_heads
    kv_heads, head_dim = _kv_heads_and_head_dim(hf)
    attention = hidden * head_dim * (2 * heads + 2 * kv_heads)
    moe = moe_spec(hf) or MoESpec(0, 0, 0, False, frozenset())
    sparse = len(moe.sparse_layers)
    mlps = (layers - sparse) * 3 * hidden * hf.intermediate_size + \
        sparse * moe.num_experts * hidden * (3 * moe.intermediate_size + 1)  # + 1: the router's row
    embeddings = vocab * hidden * (1 if getattr(hf, "tie_word_embeddings", False) else 2)
    size = (embeddings + layers * attention + mlps) * config.torch_dtype.itemsize
    if size > memory:
        raise ValueError(f"{os.path.join(config.model, 'config.json')}: the model it describes takes "
                         f"{size / 2**30:.1f} GiB of {str(config.torch_dtype).removeprefix('torch.')} weights, more "
                         f"than this machine's {memory / 2**30:.1f} GiB of memory")


def _kv_heads_and_head_dim(hf) -> tuple[int, int]:
    heads = hf.num_attention_heads
    return getattr(hf, "num_key_value_heads", None) or heads, getattr(hf, "head_dim", None) or hf.hidden_size // heads


def _check_tensor_parallel_split(hf, size: int) -> None:
    heads = hf.num_attention_heads
    if heads % size:
        raise config_error("tensor_parallel_size", f"num_attention_heads={heads} is not divisible by {size}")
    kv_heads = getattr(hf, "num_key_value_heads", None) or heads
    if kv_heads % size and size % kv_heads:
        # neither split across ranks nor replicated evenly: ranks would attend to the wrong KV heads
        raise config_error("tensor_parallel_size", f"num_key_value_heads={kv_heads} neither divides nor is "
                                                   f"divisible by {size}")
    moe = moe_spec(hf)
    splits = {moe.intermediate_size_field: moe.intermediate_size} if moe is not None and moe.sparse_layers else {}
    if moe is None or len(moe.sparse_layers) < hf.num_hidden_layers:  # dense MLPs: split like the experts
        splits["intermediate_size"] = getattr(hf, "intermediate_size", 0)
    for name, intermediate in splits.items():
        if intermediate % size:
            raise config_error("tensor_parallel_size", f"{name}={intermediate} is not divisible by {size}")


def _check_cpu_kv_cache(config: Config, memory: int) -> None:
    """A CPU KV cache larger than the machine's memory fails (or is OOM-killed) deep in torch: say so here."""
    hf = config.hf_config
    kv_heads, head_dim = _kv_heads_and_head_dim(hf)
    per_block = (2 * hf.num_hidden_layers * config.kvcache_block_size * kv_heads * head_dim
                 * config.kv_cache_torch_dtype.itemsize)
    name, size = ("num_kvcache_blocks", config.num_kvcache_blocks * per_block) if config.num_kvcache_blocks != -1 \
        else ("cpu_kvcache_bytes", config.cpu_kvcache_bytes)
    if size > memory:
        raise config_error(name, f"a KV cache of {size / 2**30:.1f} GiB does not fit in this machine's "
                                 f"{memory / 2**30:.1f} GiB of memory")
