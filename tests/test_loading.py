"""Loading broken checkpoints: each is refused at load with a ValueError that names the file, tensor
or config field and what is wrong -- never a torch message, a silent cut, or an engine that starts
and then dies on the first prompt. Directories are copies of the tiny Qwen3 checkpoint (weights
hard-linked where unchanged), changed in one way each."""
from __future__ import annotations

import json
import os
import shutil
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file, save_file

from asyncllm import LLM, Config
from asyncllm.errors import InvalidValueError
from asyncllm.models.checkpoint import (check_tokenizer, iter_safetensors, load_hf_config, load_weights,
                                        safetensors_files)
from asyncllm.models.registry import create_model
from asyncllm.models.resolve import resolve_config

ENGINE_KW = dict(num_kvcache_blocks=8, kvcache_block_size=16, max_model_len=64)
TOKENIZER_IDS = 151669  # len() of the Qwen3 tokenizer, added tokens included; the weights have 151936 rows


def copy_checkpoint(src: str, dst, *, config: dict | None = None, skip=()) -> str:
    """src's files in dst (weights hard-linked: they are large), config.json updated with `config`."""
    dst = str(dst)
    os.makedirs(dst)
    for name in os.listdir(src):
        if name in skip or not os.path.isfile(os.path.join(src, name)):
            continue
        if name.endswith(".safetensors"):
            os.link(os.path.join(src, name), os.path.join(dst, name))
        else:
            shutil.copy(os.path.join(src, name), dst)
    if config:
        path = os.path.join(dst, "config.json")
        with open(path) as f:
            data = json.load(f)
        data.update(config)
        with open(path, "w") as f:
            json.dump(data, f)
    return dst


def message_of(excinfo) -> str:
    return str(excinfo.value)


# ---- item 3: config, weights and tokenizer must agree on the vocabulary ------------------------------
def test_config_vocab_smaller_than_the_embedding_is_refused_naming_all_three(tiny_qwen3, tmp_path):
    # it used to load with the embedding cut to 1000 rows, and die on the first text prompt (IndexError)
    model_dir = copy_checkpoint(tiny_qwen3, tmp_path / "vocab-1000", config={"vocab_size": 1000})
    with pytest.raises(ValueError) as info:
        LLM(model_dir, **ENGINE_KW)
    message = message_of(info)
    for part in ("config.json: vocab_size=1000", "model.safetensors: model.embed_tokens.weight has 151936 rows",
                 "lm_head.weight has 151936 rows", f"tokenizer.json: the tokenizer has {TOKENIZER_IDS} token ids"):
        assert part in message, message


def test_config_vocab_larger_than_the_embedding_is_refused(tiny_qwen3, tmp_path):
    model_dir = copy_checkpoint(tiny_qwen3, tmp_path / "vocab-big", config={"vocab_size": 152064})
    with pytest.raises(ValueError, match=r"vocab_size=152064.*has 151936 rows"):
        LLM(model_dir, **ENGINE_KW)


def test_tokenizer_with_ids_beyond_the_vocabulary_is_refused(tiny_qwen3, tmp_path):
    from transformers import AutoTokenizer
    model_dir = copy_checkpoint(tiny_qwen3, tmp_path / "big-tokenizer")
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    tokenizer.add_tokens([f"<extra_{i}>" for i in range(300)])  # ids up to 151968 >= 151936
    tokenizer.save_pretrained(model_dir)
    with pytest.raises(ValueError, match=rf"vocab_size=151936.*the tokenizer has {TOKENIZER_IDS + 300} token ids"):
        LLM(model_dir, **ENGINE_KW)


def test_a_tokenizer_smaller_than_the_padded_vocabulary_is_fine(tiny_qwen3):
    # Qwen pads its vocabulary: 151936 rows for 151669 token ids
    from transformers import AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(tiny_qwen3)
    check_tokenizer(tokenizer, load_hf_config(tiny_qwen3), tiny_qwen3)


# ---- item 10: loading errors that name what is wrong --------------------------------------------------
def test_a_model_directory_without_tokenizer_is_refused(tiny_qwen3, tmp_path):
    # it used to load, and then every text prompt failed with "encodes to no tokens"
    tokenizer_files = [n for n in os.listdir(tiny_qwen3) if n.startswith(("tokenizer", "vocab", "merges"))]
    model_dir = copy_checkpoint(tiny_qwen3, tmp_path / "no-tokenizer", skip=tokenizer_files)
    with pytest.raises(ValueError) as info:
        LLM(model_dir, **ENGINE_KW)
    assert model_dir in message_of(info) and "no tokenizer" in message_of(info)
    assert "tokenizer.json" in message_of(info)


def changed_tensor(name: str, change):
    """iter_safetensors of the tiny checkpoint with one tensor changed."""
    def weights(model_dir):
        for tensor_name, tensor, *source in iter_safetensors(model_dir):
            yield tensor_name, (change(tensor) if tensor_name == name else tensor), *source
    return weights


MIS_SHAPED = {
    # (checkpoint tensor, change, the shape it then has, the shape the model expects)
    "transposed o_proj (row-parallel)": ("model.layers.0.self_attn.o_proj.weight", lambda t: t.t(), (256, 128),
                                         (128, 256)),
    "q_proj rows missing (fused qkv)": ("model.layers.1.self_attn.q_proj.weight", lambda t: t[:-64], (192, 128),
                                        (256, 128)),
    "up_proj too wide (fused gate/up)": ("model.layers.0.mlp.up_proj.weight", lambda t: torch.cat([t, t], 1),
                                         (256, 256), (256, 128)),
    # these two were silent before: copy_ broadcast the 1-element norm, narrow cut the embedding
    "norm of 1 element": ("model.layers.0.input_layernorm.weight", lambda t: t[:1], (1,), (128,)),
    "embedding with extra rows": ("model.embed_tokens.weight", lambda t: torch.cat([t, t[:64]]), (152000, 128),
                                  (151936, 128)),
}


@pytest.mark.parametrize("case", list(MIS_SHAPED))
def test_mis_shaped_tensor_names_the_tensor_both_shapes_and_the_file(tiny_qwen3, case):
    name, change, got, expected = MIS_SHAPED[case]
    model = create_model(load_hf_config(tiny_qwen3))
    with pytest.raises(ValueError) as info:
        load_weights(model, changed_tensor(name, change)(tiny_qwen3))
    message = message_of(info)
    assert f"{name!r}" in message and str(got) in message and str(expected) in message, message
    assert os.path.join(tiny_qwen3, "model.safetensors") in message, message


def test_transposed_tensor_in_the_file_is_refused_at_load(tiny_qwen3, tmp_path):
    model_dir = copy_checkpoint(tiny_qwen3, tmp_path / "transposed", skip=("model.safetensors",))
    tensors = load_file(os.path.join(tiny_qwen3, "model.safetensors"))
    tensors["model.layers.1.mlp.down_proj.weight"] = tensors["model.layers.1.mlp.down_proj.weight"].t().contiguous()
    save_file(tensors, os.path.join(model_dir, "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"'model.layers.1.mlp.down_proj.weight' in .*model.safetensors has shape "
                                         r"\(256, 128\), but .* expects \(128, 256\)"):
        LLM(model_dir, **ENGINE_KW)


BAD_CONFIG_FIELDS = [
    ("num_attention_heads", 0), ("num_attention_heads", -4), ("max_position_embeddings", -1),
    ("max_position_embeddings", 0), ("hidden_size", 0), ("num_hidden_layers", 0), ("vocab_size", 0),
    ("intermediate_size", -256), ("head_dim", 0), ("head_dim", 63), ("num_key_value_heads", 0),
    ("num_key_value_heads", 3), ("num_hidden_layers", 2.5), ("hidden_size", "128"),
]


@pytest.mark.parametrize("field,value", BAD_CONFIG_FIELDS, ids=[f"{f}={v!r}" for f, v in BAD_CONFIG_FIELDS])
def test_unworkable_config_field_is_refused_naming_config_json_and_the_field(tiny_qwen3, tmp_path, field, value):
    model_dir = copy_checkpoint(tiny_qwen3, tmp_path / "bad-config", config={field: value},
                                skip=("model.safetensors",))
    with pytest.raises(ValueError) as info:
        resolve_config(Config(model=model_dir))
    # some transformers refuses itself (e.g. an odd head_dim), in its own words: wrapped, naming the file
    assert os.path.join(model_dir, "config.json") in message_of(info) and field in message_of(info), message_of(info)


def test_an_explicit_head_dim_unlike_hidden_over_heads_is_accepted(tiny_qwen3):
    # Qwen3 sets head_dim explicitly (128 for hidden 1024 and 16 heads, 64 for 128 and 4 here, ...)
    config = resolve_config(Config(model=tiny_qwen3)).hf_config
    assert config.head_dim != config.hidden_size // config.num_attention_heads


def write_index(model_dir: str, shard: str) -> None:
    weight_map = {name: shard for name in load_file(os.path.join(model_dir, "model.safetensors"))}
    with open(os.path.join(model_dir, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f)


@pytest.mark.parametrize("where", ["../outside.safetensors", "absolute", "symlink"])
def test_weight_files_outside_the_model_directory_are_refused(tiny_qwen3, tmp_path, where):
    outside = tmp_path / "outside.safetensors"
    os.link(os.path.join(tiny_qwen3, "model.safetensors"), outside)
    model_dir = copy_checkpoint(tiny_qwen3, tmp_path / "model")
    if where == "symlink":
        os.remove(os.path.join(model_dir, "model.safetensors"))
        os.symlink(outside, os.path.join(model_dir, "model.safetensors"))
    else:
        write_index(model_dir, str(outside) if where == "absolute" else "../outside.safetensors")
    with pytest.raises(ValueError, match=r"outside the model directory") as info:
        LLM(model_dir, **ENGINE_KW)  # it used to load the outside file
    assert str(outside) in message_of(info)


def test_a_missing_shard_named_by_the_index_is_named(tiny_qwen3, tmp_path):
    model_dir = copy_checkpoint(tiny_qwen3, tmp_path / "model")
    write_index(model_dir, "model-00002-of-00002.safetensors")
    with pytest.raises(ValueError, match=r"model.safetensors.index.json names the shard "
                                         r"'model-00002-of-00002.safetensors', which is not a file"):
        safetensors_files(model_dir)


def test_a_huggingface_cache_snapshot_of_symlinks_into_blobs_loads(tiny_qwen3, tmp_path):
    # huggingface_hub's layout: models--org--name/snapshots/<rev>/<file> -> ../../blobs/<hash>
    repo = tmp_path / "models--org--tiny"
    (repo / "blobs").mkdir(parents=True)
    snapshot = repo / "snapshots" / "0123abcd"
    snapshot.mkdir(parents=True)
    for i, name in enumerate(sorted(os.listdir(tiny_qwen3))):
        blob = repo / "blobs" / f"blob{i}"
        os.link(os.path.join(tiny_qwen3, name), blob)
        os.symlink(os.path.join("..", "..", "blobs", blob.name), snapshot / name)
    assert safetensors_files(str(snapshot)) == [str(snapshot / "model.safetensors")]
    # the vocabulary check reads the embedding's rows through the symlinks too (range: a len() of token ids)
    check_tokenizer(range(TOKENIZER_IDS), SimpleNamespace(vocab_size=151936), str(snapshot))


# ---- session 25's audit ------------------------------------------------------------------------------
def test_a_snapshot_may_reach_its_own_blobs_only(tiny_qwen3, tmp_path):
    """The cache exception covers models--*/snapshots/<rev> -> that repository's blobs/, nothing else
    under the repository (nor any folder that merely is called snapshots)."""
    for repo_name, target in (("models--org--tiny", "secret.safetensors"), ("x", os.path.join("blobs", "b"))):
        repo = tmp_path / repo_name
        snapshot = repo / "snapshots" / "rev"
        snapshot.mkdir(parents=True)
        (repo / "blobs").mkdir()
        os.link(os.path.join(tiny_qwen3, "model.safetensors"), repo / target)
        os.symlink(os.path.join("..", "..", target), snapshot / "model.safetensors")
        with pytest.raises(ValueError, match="outside the model directory"):
            safetensors_files(str(snapshot))


def without(name: str):
    def weights(model_dir):
        for tensor_name, tensor, *source in iter_safetensors(model_dir):
            if tensor_name != name:
                yield tensor_name, tensor, *source
    return weights


@pytest.mark.parametrize("name, fused", [("model.layers.0.self_attn.k_proj.weight", "qkv_proj.weight (k missing)"),
                                          ("model.layers.1.mlp.up_proj.weight", "gate_up_proj.weight (1 missing)")])
def test_a_missing_part_of_a_fused_weight_is_missing(tiny_qwen3, name, fused):
    # it loaded, leaving those rows of the fused parameter uninitialised (wrong tokens, or all zeros)
    model = create_model(load_hf_config(tiny_qwen3))
    with pytest.raises(ValueError, match=r"checkpoint is missing weights") as info:
        load_weights(model, without(name)(tiny_qwen3))
    assert fused in message_of(info), message_of(info)


@pytest.mark.parametrize("dtype", [torch.int8, torch.int32, torch.bool, torch.float8_e4m3fn])
def test_weights_that_are_not_float16_bfloat16_or_float32_are_refused(tiny_qwen3, dtype):
    # they were cast silently (an fp8 checkpoint without its scales makes nonsense)
    name = "model.layers.0.mlp.down_proj.weight"
    model = create_model(load_hf_config(tiny_qwen3))
    with pytest.raises(ValueError, match=rf"'{name}' in .*model.safetensors is {dtype}"):
        load_weights(model, changed_tensor(name, lambda t: t.to(dtype))(tiny_qwen3))


def test_a_tensor_in_two_shards_is_refused(tiny_qwen3):
    model = create_model(load_hf_config(tiny_qwen3))
    twice = [*iter_safetensors(tiny_qwen3), *(t for t in iter_safetensors(tiny_qwen3) if "norm" in t[0])]
    with pytest.raises(ValueError, match=r"appears twice"):
        load_weights(model, twice)


@pytest.mark.parametrize("how", ["truncated", "not-safetensors"])
def test_an_unreadable_safetensors_file_is_named(tiny_qwen3, tmp_path, how):
    model_dir = copy_checkpoint(tiny_qwen3, tmp_path / how, skip=("model.safetensors",))
    path = os.path.join(model_dir, "model.safetensors")
    with open(os.path.join(tiny_qwen3, "model.safetensors"), "rb") as src, open(path, "wb") as dst:
        dst.write(src.read(100_000) if how == "truncated" else b"\x00" * 8 + b"not a header")
    with pytest.raises(ValueError, match=rf"{path}: not a readable safetensors file"):
        LLM(model_dir, **ENGINE_KW)


def rope(**values) -> dict:
    return {"rope_theta": 1000000.0, "rope_type": "default", **values}


UNSUPPORTED_CONFIG = [
    # (config.json field, its value, the field the message names)
    ("hidden_act", "gelu", "hidden_act"), ("use_sliding_window", True, "use_sliding_window"),
    ("final_logit_softcapping", 30.0, "final_logit_softcapping"), ("rms_norm_eps", -1e-6, "rms_norm_eps"),
    # transformers 5 keeps these in rope_parameters (a top-level rope_theta beside them is ignored)
    ("rope_parameters", rope(partial_rotary_factor=0.5), "partial_rotary_factor"),
    ("rope_parameters", rope(rope_theta=0), "rope_theta"), ("rope_parameters", rope(rope_theta=-1.0), "rope_theta"),
    ("rope_parameters", rope(rope_theta="abc"), "rope_theta"),
]


@pytest.mark.parametrize("field,value,named", UNSUPPORTED_CONFIG, ids=[f"{f}={v!r}" for f, v, _ in UNSUPPORTED_CONFIG])
def test_config_that_the_model_code_would_ignore_is_refused(tiny_qwen3, tmp_path, field, value, named):
    # each was accepted and ignored (or gave NaN logits): a model that answers wrongly
    model_dir = copy_checkpoint(tiny_qwen3, tmp_path / "unsupported", config={field: value},
                                skip=("model.safetensors",))
    with pytest.raises(InvalidValueError) as info:
        resolve_config(Config(model=model_dir))
    assert os.path.join(model_dir, "config.json") in message_of(info) and named in message_of(info), message_of(info)
    assert (info.value.owner, info.value.field) == ("Config", "model")


@pytest.mark.parametrize("content, message", [
    ("[1, 2]", "expected a JSON object"), ("{not json", "not valid JSON"),
    ('{"eos_token_id": "abc"}', "eos_token_id must be a token id")])
def test_a_broken_generation_config_is_named(tiny_qwen3, tmp_path, content, message):
    model_dir = copy_checkpoint(tiny_qwen3, tmp_path / "gen")
    with open(os.path.join(model_dir, "generation_config.json"), "w") as f:
        f.write(content)
    with pytest.raises(ValueError, match=message) as info:
        LLM(model_dir, **ENGINE_KW)
    assert "generation_config.json" in message_of(info)


def test_a_broken_tokenizer_file_is_named(tiny_qwen3, tmp_path):
    model_dir = copy_checkpoint(tiny_qwen3, tmp_path / "tok")
    with open(os.path.join(model_dir, "tokenizer.json"), "w") as f:
        f.write("{not json")
    with pytest.raises(ValueError, match=r"Config.model: the tokenizer files in .* cannot be loaded"):
        LLM(model_dir, **ENGINE_KW)


def test_weights_larger_than_the_machines_memory_are_refused_naming_config_json(tiny_qwen3, tmp_path):
    # hidden_size 2**22 failed in torch's allocator ("can't allocate 2549063090176 bytes"), naming nothing
    model_dir = copy_checkpoint(tiny_qwen3, tmp_path / "huge", config={"hidden_size": 2 ** 22, "head_dim": 64},
                                skip=("model.safetensors",))
    with pytest.raises(ValueError, match=r"config.json: the model it describes takes .* GiB of float32 weights, "
                                         r"more than this machine's"):
        resolve_config(Config(model=model_dir, device="cpu"))
