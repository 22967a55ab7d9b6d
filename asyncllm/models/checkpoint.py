"""Reading checkpoints: Hugging Face config and safetensors weights. Never pickle, never remote code."""
from __future__ import annotations

import glob
import json
import os
from collections.abc import Iterable, Iterator

import torch
from safetensors import safe_open
from torch import nn

PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")


def load_hf_config(model_dir: str):
    from transformers import AutoConfig
    if not os.path.isdir(model_dir):
        raise ValueError(f"Config.model: {model_dir!r} is not a model directory")
    if not os.path.exists(os.path.join(model_dir, "config.json")):
        raise ValueError(f"Config.model: {model_dir!r} has no config.json")
    config = AutoConfig.from_pretrained(model_dir, trust_remote_code=False)
    # transformers 5 keeps rope settings in rope_parameters; older configs have rope_theta/rope_scaling
    rope_parameters = getattr(config, "rope_parameters", None) or {}
    if getattr(config, "rope_theta", None) is None:
        config.rope_theta = rope_parameters.get("rope_theta", 10000.0)
    scaling = getattr(config, "rope_scaling", None) or rope_parameters
    rope_type = scaling.get("rope_type", scaling.get("type", "default")) if scaling else "default"
    config.asyncllm_rope_scaling = dict(scaling, rope_type=rope_type) if rope_type != "default" else None
    return config


def safetensors_files(model_dir: str) -> list[str]:
    files = sorted(glob.glob(os.path.join(model_dir, "*.safetensors")))
    if not files:
        pickles = [f for f in os.listdir(model_dir) if f.endswith(PICKLE_SUFFIXES)]
        hint = (f" It holds {', '.join(sorted(pickles))}: pickle checkpoints are refused, since loading them "
                "can run arbitrary code; convert them to safetensors first.") if pickles else ""
        raise ValueError(f"Config.model: no .safetensors weights in {model_dir!r}.{hint}")
    index = os.path.join(model_dir, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            names = sorted(set(json.load(f)["weight_map"].values()))
        files = [os.path.join(model_dir, name) for name in names]
    return files


def iter_safetensors(model_dir: str) -> Iterator[tuple[str, torch.Tensor]]:
    for path in safetensors_files(model_dir):
        with safe_open(path, framework="pt", device="cpu") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


def load_weights(model: nn.Module, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
    """Copy checkpoint tensors (HF names) into the model's (possibly fused, possibly sharded) params.

    model.packed_modules_mapping maps a checkpoint name fragment to (fused param fragment, shard id),
    e.g. "q_proj" -> ("qkv_proj", "q").
    """
    params = dict(model.named_parameters())
    packed = getattr(model, "packed_modules_mapping", {})
    skipped = getattr(model, "skipped_weight_prefixes", ())
    loaded: set[str] = set()
    for name, tensor in weights:
        if any(name.startswith(prefix) for prefix in skipped):
            continue
        for fragment, (fused, shard_id) in packed.items():
            if fragment in name:
                param_name = name.replace(fragment, fused)
                param = params[param_name]
                param.weight_loader(param, tensor, shard_id)
                break
        else:
            if name not in params:
                raise ValueError(f"checkpoint tensor {name!r} has no place in {type(model).__name__}")
            param_name = name
            param = params[name]
            getattr(param, "weight_loader", _default_loader)(param, tensor)
        loaded.add(param_name)
    missing = set(params) - loaded - set(getattr(model, "tied_parameters", ()))
    if missing:
        raise ValueError(f"checkpoint is missing weights: {sorted(missing)[:5]}{'...' if len(missing) > 5 else ''}")


def _default_loader(param: nn.Parameter, tensor: torch.Tensor) -> None:
    param.data.copy_(tensor)
