"""GGUF checkpoints: convert a llama.cpp GGUF file once into a Hugging Face directory we can load.

The engine loads only safetensors + config.json + tokenizer files. A GGUF file is dequantized to
`model.safetensors` (names mapped to Hugging Face's, Llama q/k rows un-permuted), its metadata becomes
`config.json` and its vocabulary a saved tokenizer (chat template included). `resolve_model_path` caches
the result under a hash of the file's content, so the conversion cost is paid once per content (however
many copies of the file there are), and a conversion's arrival removes those no file converts to any
more (prune_cache).
"""
from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
import shutil
import sys
import tempfile
import time

import numpy as np
import torch
import xxhash

from asyncllm import settings
from asyncllm.models.tokenizer_loader import transformers_attribute

GGUF_MAGIC = b"GGUF"
# Bump when the converter's output changes, so stale caches are not reused.
_CONVERTER_VERSION = 1

_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}
_MODEL_TYPES = {"llama": "llama", "qwen2": "qwen2"}

_GLOBAL_TENSORS = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_BLOCK_TENSORS = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
_BLOCK_RE = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")


def is_gguf(path: str) -> bool:
    """True for a file named *.gguf that starts with the GGUF magic bytes."""
    path = os.fspath(path)
    if not (path.endswith(".gguf") and os.path.isfile(path)):
        return False
    with open(path, "rb") as f:
        return f.read(4) == GGUF_MAGIC


def hf_tensor_name(gguf_name: str) -> str:
    """Hugging Face name for a GGUF tensor name of a Llama/Qwen2 model; ValueError if unknown."""
    if gguf_name in _GLOBAL_TENSORS:
        return _GLOBAL_TENSORS[gguf_name]
    match = _BLOCK_RE.fullmatch(gguf_name)
    if match and match.group(2) in _BLOCK_TENSORS:
        layer, part, kind = match.groups()
        return f"model.layers.{layer}.{_BLOCK_TENSORS[part]}.{kind}"
    raise ValueError(f"unsupported GGUF tensor {gguf_name!r}: no Hugging Face Llama/Qwen2 equivalent")


def unpermute_rotary(weight: torch.Tensor, n_head: int) -> torch.Tensor:
    """Undo llama.cpp's convert_hf_to_gguf `permute` of q/k projections.

    llama.cpp interleaves the two rotary halves of each head (rows [h, 2, d/2] stored as [h, d/2, 2]) to
    suit its rope kernel; Hugging Face rotates halves, so the rows are put back.
    """
    half = weight.shape[0] // n_head // 2
    return weight.reshape(n_head, half, 2, *weight.shape[1:]).transpose(1, 2).reshape(weight.shape)


def open_gguf(path: str):
    """A GGUFReader for path, or a ValueError that names the file and what is wrong with it (the
    reader itself says "version 1055117301" of garbage and "cannot reshape array" of a truncated file)."""
    from gguf.gguf_reader import READER_SUPPORTED_VERSIONS, GGUFReader
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        header = f.read(8)
    if len(header) < 8 or header[:4] != GGUF_MAGIC:
        raise ValueError(f"{path!r} is not a GGUF file: its {size} bytes do not start with b'GGUF' and a version")
    versions = {int.from_bytes(header[4:], "little"), int.from_bytes(header[4:], "big")}  # either byte order
    if not versions & set(READER_SUPPORTED_VERSIONS):
        raise ValueError(f"{path!r}: GGUF version {int.from_bytes(header[4:], 'little')} is not supported "
                         f"(supported: {', '.join(map(str, READER_SUPPORTED_VERSIONS))}); the file is corrupt, "
                         "or from a newer llama.cpp")
    try:
        # it maps every tensor at once, so a file cut anywhere fails here (a cut tensor: "cannot reshape")
        return GGUFReader(path)
    except Exception as e:  # noqa: BLE001 - a cut or corrupt file fails anywhere in the reader's parsing
        raise ValueError(f"{path!r} is a truncated or corrupt GGUF file ({size} bytes; the reader said: "
                         f"{type(e).__name__}: {e})") from None


def _field(reader, key: str, default=None):
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def _int_field(reader, key: str, default=None) -> int:
    """A metadata integer the conversion needs; a ValueError naming the key if it is absent or not a number."""
    value = _field(reader, key, default)
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise ValueError(f"{getattr(reader.data, 'filename', 'the GGUF file')}: metadata {key!r} must be an integer, "
                         f"got {value!r}")
    return int(value)


def _dequantize(tensor) -> np.ndarray:
    from gguf.quants import dequantize
    try:
        array = dequantize(tensor.data, tensor.tensor_type)
    except NotImplementedError:
        raise ValueError(f"unsupported GGUF quantization type {tensor.tensor_type.name} "
                         f"(tensor {tensor.name!r})") from None
    # GGUF lists dimensions fastest-first; numpy/torch want them slowest-first.
    shape = tuple(int(n) for n in reversed(tensor.shape))
    # F32 tensors come back as read-only views of the memory-mapped file; torch wants writable memory.
    return array.astype(np.float32, copy=not array.flags.writeable).reshape(shape)


def _read_tensors(reader, arch: str, n_head: int, n_kv_head: int, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    tensors = {}
    for tensor in reader.tensors:
        name = hf_tensor_name(tensor.name)
        weight = torch.from_numpy(_dequantize(tensor))
        # Only llama.cpp's Llama converter permutes q/k (its Qwen2 converter does not), matching
        # transformers' LlamaTensorProcessor, which is registered for "llama" alone.
        if arch == "llama" and ".attn_q." in tensor.name:
            weight = unpermute_rotary(weight, n_head)
        elif arch == "llama" and ".attn_k." in tensor.name:
            weight = unpermute_rotary(weight, n_kv_head)
        tensors[name] = weight.to(dtype).contiguous()
    return tensors


def _build_config(reader, arch: str, tensors: dict[str, torch.Tensor], dtype: torch.dtype) -> dict:
    def meta(key, default=None):
        return _field(reader, f"{arch}.{key}", default)

    def int_meta(key, default=None):
        return _int_field(reader, f"{arch}.{key}", default)

    hidden = int_meta("embedding_length")
    n_head = int_meta("attention.head_count")
    head_dim = meta("attention.key_length") or meta("rope.dimension_count") or hidden // n_head
    # The embedding's row count is authoritative: it is often padded beyond the tokenizer's vocabulary.
    vocab_size = tensors["model.embed_tokens.weight"].shape[0]
    config = {
        "architectures": [_ARCHITECTURES[arch]],
        "model_type": _MODEL_TYPES[arch],
        "hidden_size": hidden,
        "intermediate_size": int_meta("feed_forward_length"),
        "num_hidden_layers": int_meta("block_count"),
        "num_attention_heads": n_head,
        "num_key_value_heads": int_meta("attention.head_count_kv", n_head),
        "head_dim": int(head_dim),
        "hidden_act": "silu",
        "rms_norm_eps": float(meta("attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": float(meta("rope.freq_base", 10000.0)),
        "max_position_embeddings": int_meta("context_length"),
        "vocab_size": int(vocab_size),
        "tie_word_embeddings": "lm_head.weight" not in tensors,
        "torch_dtype": str(dtype).removeprefix("torch."),
    }
    if arch == "llama":
        config["attention_bias"] = "model.layers.0.self_attn.q_proj.bias" in tensors
        config["mlp_bias"] = False
    for gguf_key, key in (("bos_token_id", "bos_token_id"), ("eos_token_id", "eos_token_id"),
                          ("padding_token_id", "pad_token_id")):
        value = _field(reader, f"tokenizer.ggml.{gguf_key}")
        if value is not None:
            config[key] = int(value)
    return config


def _save_tokenizer(gguf_path: str, out_dir: str, chat_template: str | None) -> None:
    auto_tokenizer = transformers_attribute("AutoTokenizer")
    try:
        tokenizer = auto_tokenizer.from_pretrained(os.path.dirname(gguf_path), gguf_file=os.path.basename(gguf_path))
    except Exception as e:  # noqa: BLE001 - transformers' GGUF reader raises many types for missing metadata
        raise ValueError(f"{gguf_path!r}: no usable tokenizer in its metadata: {type(e).__name__}: {e}") from None
    # Set it explicitly: without a template, apply_chat_template fails on the converted directory.
    if chat_template and not tokenizer.chat_template:
        tokenizer.chat_template = chat_template
    tokenizer.save_pretrained(out_dir)


def _replace_dir(src: str, dst: str) -> None:
    try:
        os.replace(src, dst)
    except OSError:
        # rename() refuses a non-empty target: move the old directory aside first, then drop it.
        old = tempfile.mkdtemp(prefix=f".{os.path.basename(dst)}.old-", dir=os.path.dirname(dst))
        os.replace(dst, old)
        os.replace(src, dst)
        shutil.rmtree(old, ignore_errors=True)


def convert_gguf(gguf_path: str, out_dir: str, dtype: torch.dtype = torch.float32) -> str:
    """Convert a Llama or Qwen2 GGUF file into a Hugging Face directory at out_dir; returns out_dir.

    Everything is written into a temporary sibling directory which is renamed into place last, so an
    interrupted conversion never leaves a partial out_dir behind.
    """
    from safetensors.torch import save_file

    gguf_path, out_dir = os.path.abspath(gguf_path), os.path.abspath(out_dir)
    if not is_gguf(gguf_path):
        raise ValueError(f"{gguf_path!r} is not a GGUF file (expected a *.gguf file starting with b'GGUF')")
    reader = open_gguf(gguf_path)
    arch = _field(reader, "general.architecture")
    num_experts = _field(reader, f"{arch}.expert_count")
    if num_experts:  # Mixtral's GGUFs say arch 'llama'; Qwen3-MoE's 'qwen3moe'
        raise ValueError(f"{gguf_path!r} is a mixture-of-experts model ({arch}, {num_experts} experts): the GGUF "
                         "converter does not support those; load its safetensors checkpoint instead "
                         "(Qwen3MoeForCausalLM and MixtralForCausalLM are supported there)")
    if arch not in _ARCHITECTURES:
        raise ValueError(f"unsupported GGUF architecture {arch!r} in {gguf_path!r}; "
                         f"supported: {', '.join(sorted(_ARCHITECTURES))}")
    rope_scaling = _field(reader, f"{arch}.rope.scaling.type")
    if rope_scaling not in (None, "none"):
        raise ValueError(f"unsupported GGUF rope scaling {rope_scaling!r} in {gguf_path!r}")
    n_head = _int_field(reader, f"{arch}.attention.head_count")
    n_kv_head = _int_field(reader, f"{arch}.attention.head_count_kv", n_head)
    if n_head < 1 or n_kv_head < 1:
        raise ValueError(f"{gguf_path!r}: metadata {arch}.attention.head_count ({n_head}) and head_count_kv "
                         f"({n_kv_head}) must be >= 1")
    try:
        tensors = _read_tensors(reader, arch, n_head, n_kv_head, dtype)
        config = _build_config(reader, arch, tensors, dtype)
    except (RuntimeError, KeyError, IndexError, TypeError) as e:  # tensors or metadata that do not fit together
        what = f"no tensor {e}" if isinstance(e, KeyError) else f"{type(e).__name__}: {e}"
        raise ValueError(f"{gguf_path!r}: its tensors and metadata do not make a {arch} model ({what})") from None

    parent = os.path.dirname(out_dir)
    os.makedirs(parent, exist_ok=True)
    tmp_dir = tempfile.mkdtemp(prefix=f".{os.path.basename(out_dir)}.tmp-", dir=parent)
    try:
        os.chmod(tmp_dir, 0o755)  # mkdtemp's 0700 would otherwise become out_dir's mode
        save_file(tensors, os.path.join(tmp_dir, "model.safetensors"), metadata={"format": "pt"})
        del tensors
        with open(os.path.join(tmp_dir, "config.json"), "w") as f:
            json.dump(config, f, indent=2, sort_keys=True)
        _save_tokenizer(gguf_path, tmp_dir, _field(reader, "tokenizer.chat_template"))
        _replace_dir(tmp_dir, out_dir)
    finally:
        shutil.rmtree(tmp_dir, ignore_errors=True)
    return out_dir


def cache_root() -> str:
    return settings.CACHE.read()


_KEY_CHUNK_BYTES = 1 << 23
# in each converted directory: the files it was converted from (real path, size, mtime), read by prune_cache
SOURCES_FILE = ".asyncllm-sources.json"
# the cache's entries before keys were the content's: <stem>-<12 hex> of the path and mtime, never found again
_PATH_KEYED_ENTRY = re.compile(r"(?P<stem>.+)-[0-9a-f]{12}")


def cache_dir_for(gguf_path: str) -> str:
    """Cache directory of a GGUF file: its name plus a hash of its whole content (xxh3-128, cheap
    beside a conversion) and the converter's version. The same file anywhere (each clone's
    copy of a package) shares one conversion; a changed file converts anew."""
    digest = xxhash.xxh3_128(f"asyncllm-gguf-converter-{_CONVERTER_VERSION}:".encode())
    with open(gguf_path, "rb") as f:
        while chunk := f.read(_KEY_CHUNK_BYTES):
            digest.update(chunk)
    stem = os.path.basename(gguf_path).removesuffix(".gguf")
    return os.path.join(cache_root(), f"{stem}-{digest.hexdigest()}")


@contextlib.contextmanager
def _cache_lock():
    """The cache's records are read, changed and pruned by one process at a time (flock on its folder)."""
    root = cache_root()
    os.makedirs(root, exist_ok=True)
    fd = os.open(root, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # and the lock with it


def _read_sources(entry: str) -> list[dict] | None:
    """The sources recorded for a converted directory; None if it has no record (path-keyed entries)."""
    try:
        with open(os.path.join(entry, SOURCES_FILE)) as f:
            records = json.load(f)
    except FileNotFoundError:
        return None
    except (OSError, ValueError):
        return []  # unreadable: no source known
    return [r for r in records if isinstance(r, dict)] if isinstance(records, list) else []


def _record_source(entry: str, gguf_path: str) -> None:
    """Note in entry that gguf_path (as it is now: real path, size, mtime) converts to it. Best
    effort: a cache this process may not write to (read-only for it, or on a read-only filesystem)
    still serves."""
    real = os.path.realpath(gguf_path)
    stat = os.stat(real)
    record = {"path": real, "size": stat.st_size, "mtime_ns": stat.st_mtime_ns}
    try:
        with _cache_lock():
            records = _read_sources(entry) or []
            if record in records:
                return
            records = [r for r in records if r.get("path") != real] + [record]
            tmp = os.path.join(entry, f"{SOURCES_FILE}.{os.getpid()}.tmp")
            with open(tmp, "w") as f:
                json.dump(records, f, indent=1)
            os.replace(tmp, os.path.join(entry, SOURCES_FILE))
    except OSError:
        pass


def is_gguf_conversion(model_dir: str) -> bool:
    """Whether model_dir is a GGUF file's conversion in the cache (resolve_model_path records in each
    the files that convert to it, before it returns the directory): its float32 safetensors are only
    quantized weights dequantized, not the precision the model needs."""
    return os.path.isfile(os.path.join(model_dir, SOURCES_FILE))


def _still_converts_to(record: dict) -> bool:
    try:
        stat = os.stat(record["path"])
    except (OSError, KeyError, TypeError, ValueError):
        return False
    return stat.st_size == record.get("size") and stat.st_mtime_ns == record.get("mtime_ns")


def prune_cache(keep: str) -> list[str]:
    """Remove the cache's conversions that no file converts to any more, keeping `keep`: those whose
    every recorded source is gone or changed (size or mtime), and those of keep's file name that the
    path-keyed scheme left (no key can reach them now). Never one that an existing, unchanged file
    converts to, so two files of one name used in turn do not convert again and again. Returns the
    removed directories."""
    root, stem = cache_root(), os.path.basename(keep).rsplit("-", 1)[0]
    removed = []
    with _cache_lock():
        for name in sorted(os.listdir(root)):
            entry = os.path.join(root, name)
            if entry == keep or name.startswith(".") or not os.path.isfile(os.path.join(entry, "config.json")):
                continue  # temporary directories of conversions under way, and what is not a conversion
            records = _read_sources(entry)
            if records is None:  # no record: path-keyed, or converted a moment ago and not yet recorded
                legacy = _PATH_KEYED_ENTRY.fullmatch(name)
                stale = legacy is not None and legacy.group("stem") == stem
            else:
                stale = not any(_still_converts_to(record) for record in records)
            if stale:
                shutil.rmtree(entry, ignore_errors=True)
                removed.append(entry)
    return removed


def resolve_model_path(path: str) -> str:
    """A loadable model directory: a GGUF file is converted once into the cache, anything else is returned as is."""
    path = os.fspath(path)
    if path.endswith(".gguf") and os.path.isfile(path) and not is_gguf(path):
        raise ValueError(f"{path!r} is named .gguf but does not start with the GGUF magic bytes; "
                         "is it a Git LFS pointer or a truncated download?")
    if not is_gguf(path):
        return path
    out_dir = cache_dir_for(path)
    if os.path.exists(os.path.join(out_dir, "config.json")):
        _record_source(out_dir, path)
        return out_dir
    print(f"asyncllm: converting {os.path.basename(path)} once into {out_dir} ...", end="", file=sys.stderr, flush=True)
    start = time.perf_counter()
    try:
        convert_gguf(path, out_dir)
    except BaseException:
        print(" failed", file=sys.stderr, flush=True)
        raise
    print(f" done in {time.perf_counter() - start:.1f} s", file=sys.stderr, flush=True)
    _record_source(out_dir, path)
    removed = prune_cache(out_dir)
    if removed:
        print(f"asyncllm: removed {len(removed)} conversion(s) no file converts to any more: "
              f"{', '.join(map(os.path.basename, removed))}", file=sys.stderr, flush=True)
    return out_dir
