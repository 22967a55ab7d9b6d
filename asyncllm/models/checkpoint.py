"""Reading checkpoints: Hugging Face config and safetensors weights. Never pickle, never remote code."""
from __future__ import annotations

import glob
import json
import os
from collections.abc import Iterable, Iterator

import torch
from safetensors import safe_open
from torch import nn

from asyncllm.layers.linear import WeightShapeError, check_loaded_shape

PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")


# config.json fields every supported architecture needs, each an int >= 1
_POSITIVE_CONFIG_FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                           "num_attention_heads", "max_position_embeddings")


def load_hf_config(model_dir: str):
    from transformers import AutoConfig
    if not os.path.isdir(model_dir):
        raise ValueError(f"Config.model: {model_dir!r} is not a model directory")
    config_path = os.path.join(model_dir, "config.json")
    if not os.path.exists(config_path):
        raise ValueError(f"Config.model: {model_dir!r} has no config.json")
    try:
        config = AutoConfig.from_pretrained(model_dir, trust_remote_code=False)
    except Exception as e:  # noqa: BLE001 - transformers' own checks raise several types (some not ValueError)
        raise ValueError(f"{config_path}: transformers refuses it: {type(e).__name__}: {e}") from e
    check_model_shape(config, config_path)
    # transformers 5 keeps rope settings in rope_parameters; older configs have rope_theta/rope_scaling
    rope_parameters = getattr(config, "rope_parameters", None) or {}
    if getattr(config, "rope_theta", None) is None:
        config.rope_theta = rope_parameters.get("rope_theta", 10000.0)
    scaling = getattr(config, "rope_scaling", None) or rope_parameters
    rope_type = scaling.get("rope_type", scaling.get("type", "default")) if scaling else "default"
    config.asyncllm_rope_scaling = dict(scaling, rope_type=rope_type) if rope_type != "default" else None
    return config


def check_model_shape(config, config_path: str) -> None:
    """Refuse a config whose model cannot be built, naming the field (torch would fail obscurely, or
    not at all until a prompt arrives). Only what cannot work is refused: an explicit head_dim that
    differs from hidden_size // num_attention_heads is fine (Qwen3 has them)."""
    def fail(field_name: str, message: str) -> None:
        raise ValueError(f"{config_path}: {field_name} {message}")

    def is_positive_int(value) -> bool:
        return isinstance(value, int) and not isinstance(value, bool) and value >= 1

    for name in _POSITIVE_CONFIG_FIELDS:
        value = getattr(config, name, None)
        if not is_positive_int(value):
            fail(name, f"must be an integer >= 1, got {value!r}")
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None)
    if kv_heads is not None:
        if not is_positive_int(kv_heads):
            fail("num_key_value_heads", f"must be an integer >= 1, got {kv_heads!r}")
        if heads % kv_heads:
            fail("num_key_value_heads", f"={kv_heads} must divide num_attention_heads={heads} (each KV head "
                                        "serves a whole group of query heads)")
    head_dim = getattr(config, "head_dim", None)
    if head_dim is None:
        head_dim = config.hidden_size // heads
        if head_dim < 1:
            fail("hidden_size", f"={config.hidden_size} leaves no head_dim for num_attention_heads={heads}")
    elif not is_positive_int(head_dim):
        fail("head_dim", f"must be an integer >= 1, got {head_dim!r}")
    if head_dim % 2:
        fail("head_dim", f"={head_dim} must be even: rotary embeddings rotate two halves of each head")


def safetensors_files(model_dir: str) -> list[str]:
    files = sorted(glob.glob(os.path.join(model_dir, "*.safetensors")))
    if not files:
        pickles = [f for f in os.listdir(model_dir) if f.endswith(PICKLE_SUFFIXES)]
        hint = (f" It holds {', '.join(sorted(pickles))}: pickle checkpoints are refused, since loading them "
                "can run arbitrary code; convert them to safetensors first.") if pickles else ""
        raise ValueError(f"Config.model: no .safetensors weights in {model_dir!r}.{hint}")
    index = os.path.join(model_dir, "model.safetensors.index.json")
    if os.path.exists(index):
        try:
            with open(index) as f:
                names = sorted(set(json.load(f)["weight_map"].values()))
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise ValueError(f"{index}: not a safetensors index (a JSON object with a weight_map): {e!r}") from None
        files = []
        for name in names:
            path = os.path.join(model_dir, name) if isinstance(name, str) else None
            if path is None or not os.path.isfile(path):
                raise ValueError(f"{index} names the shard {name!r}, which is not a file in {model_dir!r}")
            files.append(path)
    for path in files:
        _check_inside_model_dir(path, model_dir)
    return files


def _check_inside_model_dir(path: str, model_dir: str) -> None:
    """A weight file must lie in the model directory: an index (data, possibly downloaded) that names
    ../x or /x, or a symlink leading away, would read any file on the machine. Exception: a
    huggingface_hub cache snapshot (models--org--name/snapshots/<rev>), whose files are symlinks into
    the same repository's blobs/ folder."""
    model_root = os.path.realpath(model_dir)
    roots = [model_root]
    if os.path.basename(os.path.dirname(model_root)) == "snapshots":
        roots.append(os.path.dirname(os.path.dirname(model_root)))
    real = os.path.realpath(path)
    if not any(os.path.commonpath([real, root]) == root for root in roots):
        raise ValueError(f"weight file {path!r} resolves to {real!r}, outside the model directory "
                         f"{model_dir!r}: refused")


def iter_safetensors(model_dir: str) -> Iterator[tuple[str, torch.Tensor, str]]:
    """(name, tensor, file) for every tensor of the checkpoint; the file names it in load errors."""
    for path in safetensors_files(model_dir):
        with safe_open(path, framework="pt", device="cpu") as f:
            for name in f.keys():
                yield name, f.get_tensor(name), path


def load_weights(model: nn.Module, weights: Iterable[tuple]) -> None:
    """Copy checkpoint tensors (HF names) into the model's (possibly fused, possibly sharded) params.

    weights: (name, tensor) pairs, or (name, tensor, file) triples as iter_safetensors gives, so that
    errors name the file. model.packed_modules_mapping maps a checkpoint name fragment to (fused param
    fragment, shard id), e.g. "q_proj" -> ("qkv_proj", "q"). Every tensor must have exactly the shape
    its parameter's layer expects (before its sharding): nothing is cut or broadcast silently.
    """
    params = dict(model.named_parameters())
    packed = getattr(model, "packed_modules_mapping", {})
    skipped = getattr(model, "skipped_weight_prefixes", ())
    loaded: set[str] = set()
    for name, tensor, *source in weights:
        where = f" in {source[0]}" if source else ""
        if any(name.startswith(prefix) for prefix in skipped):
            continue
        param_name, shard_args = name, ()
        for fragment, (fused, shard_id) in packed.items():
            if fragment in name:
                param_name, shard_args = name.replace(fragment, fused), (shard_id,)
                break
        if param_name not in params:
            raise ValueError(f"checkpoint tensor {name!r}{where} has no place in {type(model).__name__}")
        param = params[param_name]
        try:
            getattr(param, "weight_loader", _default_loader)(param, tensor, *shard_args)
        except WeightShapeError as e:
            raise ValueError(f"checkpoint tensor {name!r}{where} has shape {e.got}, but the model built from "
                             f"config.json expects {e.expected} (a transposed tensor, or a config.json that does "
                             f"not belong to these weights?)") from None
        loaded.add(param_name)
    missing = set(params) - loaded - set(getattr(model, "tied_parameters", ()))
    if missing:
        raise ValueError(f"checkpoint is missing weights: {sorted(missing)[:5]}{'...' if len(missing) > 5 else ''}")


def _default_loader(param: nn.Parameter, tensor: torch.Tensor) -> None:
    check_loaded_shape(tensor, param.shape)
    param.data.copy_(tensor)


# files that hold a tokenizer's vocabulary (tokenizer_config.json alone holds none)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt", "spiece.model")
_VOCAB_TENSORS = ("model.embed_tokens.weight", "lm_head.weight")


def check_tokenizer(tokenizer, hf_config, model_dir: str) -> None:
    """The model directory has a tokenizer, and its vocabularies agree: config.json's vocab_size, the
    rows of the embedding and lm_head, and every id the tokenizer can emit (len(tokenizer), added
    tokens included), which must all be below vocab_size -- the model may pad its vocabulary beyond
    the tokenizer's, as Qwen does (151,936 rows, 151,669 token ids). Without this a text prompt's
    ids index past the embedding and the engine dies mid-step. Run before the weights are loaded, so
    that one message names all three numbers."""
    present = [name for name in TOKENIZER_FILES if os.path.isfile(os.path.join(model_dir, name))]
    if not present:
        raise ValueError(f"Config.model: {model_dir!r} has no tokenizer (none of {', '.join(TOKENIZER_FILES)}), "
                         "so every text prompt would encode to no tokens; copy the model's tokenizer files into it")
    vocab_size = hf_config.vocab_size
    rows = _vocab_tensor_rows(model_dir)
    num_token_ids = len(tokenizer)
    if num_token_ids <= vocab_size and all(n == vocab_size for n, _ in rows.values()):
        return
    weights = "".join(f"; {os.path.basename(path)}: {name} has {n} rows" for name, (n, path) in rows.items())
    raise ValueError(f"the vocabularies in {model_dir!r} disagree: config.json: vocab_size={vocab_size}{weights}; "
                     f"{present[0]}: the tokenizer has {num_token_ids} token ids (added tokens included). The "
                     "weights must have exactly vocab_size rows, and every token id must be below vocab_size")


def _vocab_tensor_rows(model_dir: str) -> dict[str, tuple[int, str]]:
    """{tensor name: (rows, file)} of the embedding and lm_head, read from the safetensors headers only."""
    rows = {}
    if not glob.glob(os.path.join(model_dir, "*.safetensors")):
        return rows  # no weights here: the engine was given them (or safetensors_files will say so)
    for path in safetensors_files(model_dir):
        with safe_open(path, framework="pt", device="cpu") as f:
            names = set(f.keys())
            for name in _VOCAB_TENSORS:
                if name in names:
                    shape = f.get_slice(name).get_shape()
                    rows[name] = (shape[0] if shape else 0, path)
    return rows


def _as_id_set(value) -> set[int]:
    if value is None:
        return set()
    return {value} if isinstance(value, int) else set(value)


def find_eos_token_ids(model_dir: str, hf_config, tokenizer) -> set[int]:
    """Every id that ends a generation: the config's, generation_config.json's and the tokenizer's."""
    ids = _as_id_set(getattr(hf_config, "eos_token_id", None))
    gen_config = os.path.join(model_dir, "generation_config.json")
    if os.path.exists(gen_config):
        with open(gen_config) as f:
            ids |= _as_id_set(json.load(f).get("eos_token_id"))
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return ids
