"""Reading checkpoints: Hugging Face config and safetensors weights. Never pickle, never remote code."""
from __future__ import annotations

import glob
import json
import os
from collections.abc import Iterable, Iterator

import contextlib
import logging
import math
import re

import torch
from safetensors import SafetensorError, safe_open
from torch import nn

from asyncllm import settings
from asyncllm.config import config_error, model_file_error
from asyncllm.models.fp8 import _UNSET, Fp8Layout, dequantized, fp8_format, fp8_layout, is_fp8, resident_fp8
from asyncllm.layers.linear import WeightShapeError, check_loaded_shape
from asyncllm.models.model_config import read_json_object, read_model_config
from asyncllm.models.moe_spec import moe_spec
from asyncllm.models.staged_reads import StagingBuffers, staged_tensors
from asyncllm.models.tokenizer_loader import transformers_attribute

PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")

logger = logging.getLogger("asyncllm")


# config.json fields every supported architecture needs, each an int >= 1
_POSITIVE_CONFIG_FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                           "num_attention_heads", "max_position_embeddings")


def load_hf_config(model_dir: str):
    """model_dir's config.json, checked: read here for the architectures the engine runs (models/
    model_config.py), by transformers for any other model_type (which the registry then refuses)."""
    if not os.path.isdir(model_dir):
        raise config_error("model", f"{model_dir!r} is not a model directory")
    config_path = os.path.join(model_dir, "config.json")
    if not os.path.exists(config_path):
        raise config_error("model", f"{model_dir!r} has no config.json")
    config = read_model_config(config_path)
    if config is None:
        auto_config = transformers_attribute("AutoConfig")  # only for a model_type not read here
        try:
            config = auto_config.from_pretrained(model_dir, trust_remote_code=False)
        except Exception as e:  # noqa: BLE001 - transformers' own checks raise several types (some not ValueError)
            raise ValueError(f"{config_path}: transformers refuses it: {type(e).__name__}: {e}") from e
    check_model_shape(config, config_path)
    moe_spec(config, config_path)  # a mixture-of-experts config's fields, checked before anything is built
    fp8_format(config, config_path)  # quantization_config: FP8 or refused, before anything is built
    # transformers 5 keeps rope settings in rope_parameters; older configs have rope_theta/rope_scaling
    rope_parameters = getattr(config, "rope_parameters", None) or {}
    if getattr(config, "rope_theta", None) is None:
        config.rope_theta = rope_parameters.get("rope_theta", 10000.0)
    scaling = getattr(config, "rope_scaling", None) or rope_parameters
    rope_type = scaling.get("rope_type", scaling.get("type", "default")) if scaling else "default"
    config.asyncllm_rope_scaling = dict(scaling, rope_type=rope_type) if rope_type != "default" else None
    check_model_features(config, config_path)
    return config


def check_model_features(config, config_path: str) -> None:
    """Refuse a config that asks for what the model code does not do (it would run without it and
    answer wrongly): another activation, sliding-window layers, partial rotary, logit soft-capping,
    and rope_theta / rms_norm_eps that are not positive numbers."""
    def is_positive_number(value) -> bool:
        return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value > 0

    act = getattr(config, "hidden_act", "silu")
    if act not in ("silu", "swish"):
        raise model_file_error(config_path, "hidden_act", f"={act!r} is not supported: the MLP here is SiLU-gated")
    if getattr(config, "use_sliding_window", False):
        raise model_file_error(config_path, "use_sliding_window",
                               "=true is not supported: every layer here attends to the whole context")
    layer_types = getattr(config, "layer_types", None) or []
    if any(kind != "full_attention" for kind in layer_types):
        raise model_file_error(config_path, "layer_types",
                               f"has {sorted(set(layer_types) - {'full_attention'})}: only full_attention layers "
                               "are supported")
    partial = getattr(config, "partial_rotary_factor", None)
    if partial is None:  # transformers 5 keeps it in rope_parameters
        partial = (getattr(config, "rope_parameters", None) or {}).get("partial_rotary_factor")
    if partial is not None and partial != 1:
        raise model_file_error(config_path, "partial_rotary_factor",
                               f"={partial!r} is not supported: the rotary embedding covers whole heads")
    for name in ("final_logit_softcapping", "attn_logit_softcapping"):
        if getattr(config, name, None) is not None:
            raise model_file_error(config_path, name, "is not supported: logits are not soft-capped here")
    for name in ("rope_theta", "rms_norm_eps"):
        value = getattr(config, name, None)
        if value is not None and not is_positive_number(value):
            raise model_file_error(config_path, name, f"must be a positive number, got {value!r}")


def check_model_shape(config, config_path: str) -> None:
    """Refuse a config whose model cannot be built, naming the field (torch would fail obscurely, or
    not at all until a prompt arrives). Only what cannot work is refused: an explicit head_dim that
    differs from hidden_size // num_attention_heads is fine (Qwen3 has them)."""
    def is_positive_int(value) -> bool:
        return isinstance(value, int) and not isinstance(value, bool) and value >= 1

    for name in _POSITIVE_CONFIG_FIELDS:
        value = getattr(config, name, None)
        if not is_positive_int(value):
            raise model_file_error(config_path, name, f"must be an integer >= 1, got {value!r}")
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None)
    if kv_heads is not None:
        if not is_positive_int(kv_heads):
            raise model_file_error(config_path, "num_key_value_heads", f"must be an integer >= 1, got {kv_heads!r}")
        if heads % kv_heads:
            raise model_file_error(config_path, "num_key_value_heads",
                                   f"={kv_heads} must divide num_attention_heads={heads} (each KV head "
                                   "serves a whole group of query heads)")
    head_dim = getattr(config, "head_dim", None)
    if head_dim is None:
        head_dim = config.hidden_size // heads
        if head_dim < 1:
            raise model_file_error(config_path, "hidden_size",
                                   f"={config.hidden_size} leaves no head_dim for num_attention_heads={heads}")
    elif not is_positive_int(head_dim):
        raise model_file_error(config_path, "head_dim", f"must be an integer >= 1, got {head_dim!r}")
    if head_dim % 2:
        raise model_file_error(config_path, "head_dim",
                               f"={head_dim} must be even: rotary embeddings rotate two halves of each head")


def safetensors_files(model_dir: str) -> list[str]:
    files = sorted(glob.glob(os.path.join(model_dir, "*.safetensors")))
    if not files:
        pickles = [f for f in os.listdir(model_dir) if f.endswith(PICKLE_SUFFIXES)]
        hint = (f" It holds {', '.join(sorted(pickles))}: pickle checkpoints are refused, since loading them "
                "can run arbitrary code; convert them to safetensors first.") if pickles else ""
        raise config_error("model", f"no .safetensors weights in {model_dir!r}.{hint}")
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
    snapshots = os.path.dirname(model_root)
    repo = os.path.dirname(snapshots)
    if os.path.basename(snapshots) == "snapshots" and os.path.basename(repo).startswith("models--"):
        roots.append(os.path.join(repo, "blobs"))
    real = os.path.realpath(path)
    if not any(os.path.commonpath([real, root]) == root for root in roots):
        raise ValueError(f"weight file {path!r} resolves to {real!r}, outside the model directory "
                         f"{model_dir!r}: refused")


@contextlib.contextmanager
def _reading(path: str):
    """Errors reading a safetensors file (truncated, a bad header, not safetensors at all) as a
    ValueError naming the file."""
    try:
        yield
    except (SafetensorError, OSError) as e:
        raise ValueError(f"{path}: not a readable safetensors file: {e}") from None


def iter_safetensors(model_dir: str, staging: StagingBuffers | None = None) -> Iterator[tuple[str, torch.Tensor, str]]:
    """(name, tensor, file) for every tensor of the checkpoint; the file names it in load errors.
    With staging, the tensors are read with a few large reads into its reused host buffers (pinned
    ones for a copy to CUDA: models/staged_reads.py); without, each is a view of safetensors' memory
    map, which a CPU model copies from faster (docs/ARCHITECTURE.md, Start-up). safe_open checks
    each file's header either way."""
    for path in safetensors_files(model_dir):
        with _reading(path), safe_open(path, framework="pt", device="cpu") as f:
            if staging is None:
                for name in f.keys():
                    yield name, f.get_tensor(name), path
            else:
                for name, tensor in staged_tensors(path, staging):
                    yield name, f.get_tensor(name) if tensor is None else tensor, path


def weight_layout(config) -> Fp8Layout | None:
    """How an engine built for a resolved Config keeps its linear weights: FP8 (models/fp8.py) or None."""
    return fp8_layout(config.hf_config, config.quantization, os.path.join(config.model, "config.json"))


def checkpoint_weights(config, layout: Fp8Layout | None = _UNSET, weights: Iterable[tuple] | None = None,
                       device: torch.device | None = None) -> Iterator[tuple[str, torch.Tensor, str]]:
    """What load_weights takes for a resolved Config's checkpoint (or the given weights in its stead)
    into a model of `layout` (default: the one this config builds): with an FP8 layout, the dense linear
    weights in FP8 with their row scales (quantized on `device`, the model's, where they must be); without,
    FP8 weights dequantized to float32 (models/fp8.py)."""
    if weights is None:
        staged = device is not None and device.type == "cuda" and settings.STAGED_LOADING.read()
        weights = iter_safetensors(config.model, StagingBuffers(pin=True) if staged else None)
    fmt = fp8_format(config.hf_config, os.path.join(config.model, "config.json"))
    if layout is _UNSET:
        layout = weight_layout(config)
    if layout is not None:
        return resident_fp8(weights, fmt, layout, device)
    return dequantized(weights, fmt) if fmt is not None else weights


def load_weights(model: nn.Module, weights: Iterable[tuple]) -> None:
    """Copy checkpoint tensors (HF names) into the model's (possibly fused, possibly sharded) params.

    weights: (name, tensor) pairs, or (name, tensor, file) triples as iter_safetensors gives, so that
    errors name the file. model.packed_modules_mapping maps a checkpoint name fragment to (fused param
    fragment, shard id), e.g. "q_proj" -> ("qkv_proj", "q"); a mixture-of-experts model's
    expert_projections map each expert's tensor into a stacked parameter (_expert_target). Every tensor
    must have exactly the shape its parameter's layer expects (before its sharding): nothing is cut or
    broadcast silently. A fused or stacked parameter is whole only with every part, each loaded once.

    A base model's checkpoint (transformers' AutoModel saves one: Qwen3-Embedding's) names its tensors
    without the "model." prefix and has no LM head: its embedding matrix then stands in for the head,
    as a tied model's does (what it generates means nothing; it is for embed()).
    """
    params = dict(model.named_parameters())
    packed = getattr(model, "packed_modules_mapping", {})
    skipped = getattr(model, "skipped_weight_prefixes", ())
    loaded: set[str] = set()
    seen: set[str] = set()
    parts_loaded: dict[str, dict] = {}  # a fused or stacked param -> {shard id: the checkpoint name}
    base_model = False  # some tensor was named as a base model names it
    for name, tensor, *source in weights:
        where = f" in {source[0]}" if source else ""
        if any(name.startswith(prefix) for prefix in skipped):
            continue
        if name in seen:
            raise ValueError(f"checkpoint tensor {name!r}{where} appears twice (in two shards?)")
        seen.add(name)
        param_name, shard_args = _expert_target(model, name, params) or _packed_target(name, packed)
        if param_name not in params and "model." + param_name in params:
            param_name, base_model = "model." + param_name, True
        fp8_param = param_name in params and is_fp8(params[param_name])
        if is_fp8(tensor) and not fp8_param:
            raise ValueError(f"checkpoint tensor {name!r}{where} is {tensor.dtype}, but config.json has no FP8 "
                             "quantization_config saying how it is scaled")
        if not fp8_param and (not tensor.is_floating_point() or tensor.element_size() < 2):
            raise ValueError(f"checkpoint tensor {name!r}{where} is {tensor.dtype}: only float16, bfloat16 and "
                             "float32 weights are supported (quantized checkpoints are not)")
        if fp8_param and tensor.dtype != params[param_name].dtype:
            raise ValueError(f"checkpoint tensor {name!r}{where} is {tensor.dtype}, but {param_name} holds FP8 "
                             f"({params[param_name].dtype})")
        if param_name not in params:
            raise ValueError(f"checkpoint tensor {name!r}{where} has no place in {type(model).__name__}")
        param = params[param_name]
        if hasattr(param, "required_shards"):  # loaded in parts, or (an expert stack) whole
            if shard_args and shard_args[0] not in param.required_shards:  # an expert past num_experts
                raise ValueError(f"checkpoint tensor {name!r}{where} has no place in {type(model).__name__} "
                                 f"(config.json has fewer experts)")
            parts = parts_loaded.setdefault(param_name, {})
            shards = shard_args or tuple(param.required_shards)
            clash = next((shard for shard in shards if shard in parts), None)
            if clash is not None:
                raise ValueError(f"checkpoint tensor {name!r}{where} loads the same weights as {parts[clash]!r}")
            parts.update(dict.fromkeys(shards, name))
        elif param_name in loaded:
            raise ValueError(f"checkpoint tensor {name!r}{where} is the second one for {param_name} (named with "
                             "and without the 'model.' prefix?)")
        try:
            getattr(param, "weight_loader", _default_loader)(param, tensor, *shard_args)
        except WeightShapeError as e:
            raise ValueError(f"checkpoint tensor {name!r}{where} has shape {e.got}, but the model built from "
                             f"config.json expects {e.expected} (a transposed tensor, or a config.json that does "
                             f"not belong to these weights?)") from None
        loaded.add(param_name)
    missing = set(params) - loaded - set(getattr(model, "tied_parameters", ()))
    if base_model and "lm_head.weight" in missing and "model.embed_tokens.weight" in loaded:
        params["lm_head.weight"].data.copy_(params["model.embed_tokens.weight"].data)
        missing.discard("lm_head.weight")
        logger.warning("the checkpoint is a base model's (no LM head): its embedding matrix stands in for the "
                       "head; use it for embeddings, not generation")
    # a fused param is whole only with every part (q, k and v; gate and up; each expert's): the rest is
    # uninitialised
    for param_name, parts in parts_loaded.items():
        absent = sorted(params[param_name].required_shards - set(parts), key=str)
        if absent:
            missing.add(_describe_absent(model, param_name, parts, absent))
    if missing:
        raise ValueError(f"checkpoint is missing weights: {sorted(missing)[:5]}{'...' if len(missing) > 5 else ''}")


def _packed_target(name: str, packed: dict) -> tuple[str, tuple]:
    for fragment, (fused, shard_id) in packed.items():
        if fragment in name:
            return name.replace(fragment, fused), (shard_id,)
    return name, ()


def _describe_absent(model: nn.Module, param_name: str, parts: dict, absent: list) -> str:
    """The missing parts of a fused param: an expert's by its checkpoint name (spelled as the loaded
    experts' names are), q/k/v or gate/up by shard id."""
    more = "..." if len(absent) > 4 else ""
    expert = _EXPERT_TENSOR.fullmatch(next(iter(parts.values())))
    if expert is None:
        return f"{param_name} ({', '.join(map(str, absent[:4]))}{more} missing)"
    stacked = param_name.rsplit(".", 1)[1]
    projection_of = {target: projection for projection, target in model.expert_projections.items()}
    return ", ".join(f"{expert[1]}.{e}.{projection_of[(stacked, part)]}.weight" for e, part in absent[:4]) + more


_EXPERT_TENSOR = re.compile(r"(.+\.experts)\.(\d+)\.(\w+)\.weight")


def _expert_target(model: nn.Module, name: str, params: dict) -> tuple[str, tuple] | None:
    """(the stacked parameter, ((expert, part),)) for one expert's projection, (the parameter, ()) for
    an expert stack stored whole (transformers 5's in-memory names), None for any other tensor."""
    projections = getattr(model, "expert_projections", None)
    if not projections:
        return None
    for old, new in getattr(model, "checkpoint_renames", ()):
        name = name.replace(old, new)
    match = _EXPERT_TENSOR.fullmatch(name)
    if match and match[3] in projections:
        stacked, part = projections[match[3]]
        return f"{match[1]}.{stacked}", ((int(match[2]), part),)
    if name.endswith(".experts.gate_up_proj") or name.endswith(".experts.down_proj"):
        return name, ()
    if name.endswith(".mlp.gate.weight"):  # the router: its own name after a rename (Mixtral's)
        return name, ()
    return None


def _default_loader(param: nn.Parameter, tensor: torch.Tensor) -> None:
    check_loaded_shape(tensor, param.shape)
    param.data.copy_(tensor)


# files that hold a tokenizer's vocabulary (tokenizer_config.json alone holds none)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt", "spiece.model")
_VOCAB_TENSORS = ("model.embed_tokens.weight", "embed_tokens.weight", "lm_head.weight")  # a base model's too


def check_tokenizer_files(hf_config, model_dir: str) -> bool:
    """The part of check_tokenizer that needs no tokenizer, run before the weights load: the model
    directory has tokenizer files (a ConfigError if not); whether the embedding's and lm_head's rows
    are config.json's vocab_size (False: check_tokenizer then says how the three disagree)."""
    _tokenizer_files(model_dir)
    return all(n == hf_config.vocab_size for n, _ in _vocab_tensor_rows(model_dir).values())


def check_tokenizer(tokenizer, hf_config, model_dir: str) -> None:
    """The model directory has a tokenizer, and its vocabularies agree: config.json's vocab_size, the
    rows of the embedding and lm_head, and every id the tokenizer can emit (len(tokenizer), added
    tokens included), which must all be below vocab_size -- the model may pad its vocabulary beyond
    the tokenizer's, as Qwen does (151,936 rows, 151,669 token ids). Without this a text prompt's
    ids index past the embedding and the engine dies mid-step. The engine runs check_tokenizer_files
    before the weights load, and this once the tokenizer is loaded (at once where the rows disagree,
    so that one message names all three numbers)."""
    present = _tokenizer_files(model_dir)
    vocab_size = hf_config.vocab_size
    rows = _vocab_tensor_rows(model_dir)
    num_token_ids = len(tokenizer)
    if num_token_ids <= vocab_size and all(n == vocab_size for n, _ in rows.values()):
        return
    weights = "".join(f"; {os.path.basename(path)}: {name} has {n} rows" for name, (n, path) in rows.items())
    raise ValueError(f"the vocabularies in {model_dir!r} disagree: config.json: vocab_size={vocab_size}{weights}; "
                     f"{present[0]}: the tokenizer has {num_token_ids} token ids (added tokens included). The "
                     "weights must have exactly vocab_size rows, and every token id must be below vocab_size")


def _tokenizer_files(model_dir: str) -> list[str]:
    present = [name for name in TOKENIZER_FILES if os.path.isfile(os.path.join(model_dir, name))]
    if not present:
        raise config_error("model", f"{model_dir!r} has no tokenizer (none of {', '.join(TOKENIZER_FILES)}), "
                           "so every text prompt would encode to no tokens; copy the model's tokenizer files into it")
    return present


def _vocab_tensor_rows(model_dir: str) -> dict[str, tuple[int, str]]:
    """{tensor name: (rows, file)} of the embedding and lm_head, read from the safetensors headers only."""
    rows = {}
    if not glob.glob(os.path.join(model_dir, "*.safetensors")):
        return rows  # no weights here: the engine was given them (or safetensors_files will say so)
    for path in safetensors_files(model_dir):
        with _reading(path), safe_open(path, framework="pt", device="cpu") as f:
            names = set(f.keys())
            for name in _VOCAB_TENSORS:
                if name in names:
                    shape = f.get_slice(name).get_shape()
                    rows[name] = (shape[0] if shape else 0, path)
    return rows


def _as_id_set(value, where: str) -> set[int]:
    if value is None:
        return set()
    ids = [value] if isinstance(value, int) else value if isinstance(value, list) else None
    if ids is None or not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids):
        raise ValueError(f"{where}: eos_token_id must be a token id or a list of them, got {value!r}")
    return set(ids)


def find_eos_token_ids(model_dir: str, hf_config, tokenizer) -> set[int]:
    """Every id that ends a generation: the config's, generation_config.json's and the tokenizer's."""
    ids = _as_id_set(getattr(hf_config, "eos_token_id", None), os.path.join(model_dir, "config.json"))
    gen_config = os.path.join(model_dir, "generation_config.json")
    if os.path.exists(gen_config):
        ids |= _as_id_set(read_json_object(gen_config).get("eos_token_id"), gen_config)
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return ids
