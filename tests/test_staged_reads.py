"""The staged reads (models/staged_reads.py: large reads into reused host buffers, what a CUDA engine
loads with) give the same tensors and the same loaded weights, bit for bit, as safetensors' memory
map (what a CPU engine loads with), and never overwrite a tensor a consumer still holds. The
chunks are made small here so that every checkpoint spans many and the buffers are reused."""
from __future__ import annotations

import json
import os
import struct

import pytest
import torch

from asyncllm.models import staged_reads
from asyncllm.models.checkpoint import iter_safetensors, load_hf_config, load_weights
from asyncllm.models.fp8 import fp8_format, fp8_layout, keep_linear_weights_fp8, resident_fp8
from asyncllm.models.registry import create_model
from asyncllm.models.staged_reads import StagingBuffers
from asyncllm.testing import build_tiny_checkpoint
from test_fp8_loading import write_pair

SMALL_CHUNK = 1 << 16


@pytest.fixture(autouse=True)
def small_chunks(monkeypatch):
    monkeypatch.setattr(staged_reads, "CHUNK_BYTES", SMALL_CHUNK)


def as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.reshape(-1).view(torch.uint8)


def loaded_parameters(model_dir: str, staging: StagingBuffers | None) -> dict[str, torch.Tensor]:
    """The parameters of a model loaded as the engine loads it (FP8 linear weights for an FP8 checkpoint)."""
    hf = load_hf_config(model_dir)
    model = create_model(hf, dtype=torch.bfloat16)
    weights = iter_safetensors(model_dir, staging)
    layout = fp8_layout(hf, None, os.path.join(model_dir, "config.json"))
    if layout is not None:
        keep_linear_weights_fp8(model, layout)
        weights = resident_fp8(weights, fp8_format(hf, os.path.join(model_dir, "config.json")), layout)
    load_weights(model, weights)
    return {name: param.detach() for name, param in model.named_parameters()}


def assert_same_parameters(model_dir: str) -> StagingBuffers:
    staging = StagingBuffers(pin=False)
    staged, mapped = loaded_parameters(model_dir, staging), loaded_parameters(model_dir, None)
    assert staged.keys() == mapped.keys()
    for name, param in mapped.items():
        assert staged[name].dtype == param.dtype and torch.equal(as_bytes(staged[name]), as_bytes(param)), name
    return staging


def test_a_loaded_model_is_bit_identical_and_two_buffers_take_turns(tiny_qwen3):
    staging = assert_same_parameters(tiny_qwen3)
    # a for loop holds one tensor while it asks for the next: two buffers, each reused, never one per chunk
    assert len(staging.buffers) == 2


def test_fp8_weights_held_until_their_scales_in_the_next_shard_are_not_overwritten(tiny_qwen3, tmp_path):
    fp8_dir, _ = write_pair(tiny_qwen3, tmp_path, split_scales=True)
    staging = assert_same_parameters(fp8_dir)
    assert len(staging.buffers) > 2  # the held weights kept their buffers


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral"])
def test_a_mixture_of_experts_model_loads_bit_identically(tmp_path, tokenizer_dir, arch):
    model_dir = build_tiny_checkpoint(str(tmp_path / arch), arch, tokenizer_dir, seed=4, vocab_size=4096)
    assert_same_parameters(model_dir)


def test_every_tensor_held_at_once_keeps_its_bytes(tiny_qwen3):
    mapped = {name: tensor for name, tensor, _ in iter_safetensors(tiny_qwen3)}
    held = list(iter_safetensors(tiny_qwen3, StagingBuffers(pin=False)))
    assert [name for name, *_ in held] and {name for name, *_ in held} == mapped.keys()
    for name, tensor, _ in held:
        assert tensor.dtype == mapped[name].dtype and torch.equal(tensor, mapped[name]), name


def write_safetensors(path: str, tensors: dict[str, torch.Tensor]) -> None:
    """tensors packed back to back in the given order, as the format allows (save_file aligns them)."""
    header, data = {}, b""
    for name, tensor in tensors.items():
        raw = tensor.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
        dtype = {torch.uint8: "U8", torch.float32: "F32", torch.bool: "BOOL", torch.bfloat16: "BF16",
                 torch.int64: "I64", torch.complex64: "C64"}[tensor.dtype]
        header[name] = {"dtype": dtype, "shape": list(tensor.shape), "data_offsets": [len(data), len(data) + len(raw)]}
        data += raw
    encoded = json.dumps(header).encode()
    encoded += b" " * (-len(encoded) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(encoded)) + encoded + data)


def test_unaligned_and_unusual_tensors_read_as_safetensors_reads_them(tmp_path):
    # the one-byte tensor first puts the others at odd offsets; complex64 is a dtype the staged reads
    # leave to safetensors
    tensors = {"a": torch.tensor([7], dtype=torch.uint8), "b": torch.arange(5, dtype=torch.float32),
               "c": torch.tensor([[True, False]]), "d": torch.tensor(3.5, dtype=torch.bfloat16),
               "e": torch.arange(6, dtype=torch.int64).reshape(2, 3), "f": torch.empty(0, 4),
               "g": torch.tensor([1 + 2j], dtype=torch.complex64)}
    os.makedirs(tmp_path / "m")
    write_safetensors(str(tmp_path / "m" / "model.safetensors"), tensors)
    with open(tmp_path / "m" / "model.safetensors", "rb") as f:
        assert staged_reads.header_entries(f)[1][1][0] == 1  # "b" begins at byte 1
    read = {name: tensor for name, tensor, _ in iter_safetensors(str(tmp_path / "m"), StagingBuffers(pin=False))}
    assert read.keys() == tensors.keys()
    for name, tensor in tensors.items():
        assert read[name].dtype == tensor.dtype and read[name].shape == tensor.shape and torch.equal(read[name], tensor)


@pytest.mark.parametrize("rank", [0, 1])
def test_each_rank_of_two_slices_the_same_weights(tiny_qwen3, tmp_path, tokenizer_dir, monkeypatch, rank):
    moe_dir = build_tiny_checkpoint(str(tmp_path / "moe"), "qwen3_moe", tokenizer_dir, seed=4, vocab_size=4096)
    # the layers take their tensor-parallel rank and size from torch.distributed when built; nothing
    # here runs a collective, so no process group is needed to build and load one rank's shards
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.distributed, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(torch.distributed, "get_rank", lambda group=None: rank)
    for model_dir in (tiny_qwen3, moe_dir):
        hf = load_hf_config(model_dir)
        shard = create_model(hf).model.layers[0].self_attn.qkv_proj.weight
        assert shard.shape[0] < hf.hidden_size + 2 * hf.num_key_value_heads * hf.head_dim  # sharded indeed
        assert_same_parameters(model_dir)
