"""Hugging Face hub ids (ORG/NAME) as models, against a local stand-in for the hub: a tiny checkpoint
laid out in huggingface_hub's cache under a temporary HF_HOME, with HF_HUB_OFFLINE=1 (no test here
reaches the network; the one that lists a repository answers from a stand-in HfApi)."""
from __future__ import annotations

import os
import shutil

import pytest
from huggingface_hub import constants

from asyncllm import LLM, Config, SamplingParams
from asyncllm.models import hub
from helpers import lay_out_in_hub_cache

ENGINE_KW = dict(num_kvcache_blocks=64, kvcache_block_size=16)
PROMPTS = ["Hello, my name is", [11, 22, 33, 44]]
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


@pytest.fixture
def hub_cache(tmp_path, monkeypatch) -> str:
    """An empty hub cache under a temporary HF_HOME, offline; huggingface_hub read its environment
    when it was imported, so its constants are set too."""
    home = tmp_path / "hf-home"
    cache = str(home / "hub")
    monkeypatch.setenv("HF_HOME", str(home))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", cache)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    return cache


def test_a_cached_hub_id_loads_offline_as_its_directory_does(tiny_qwen3, hub_cache):
    snapshot = lay_out_in_hub_cache(tiny_qwen3, hub_cache, "org/tiny")
    with LLM(tiny_qwen3, **ENGINE_KW) as local:
        expected = [o["token_ids"] for o in local.generate(PROMPTS, GREEDY, use_tqdm=False)]
    with LLM("org/tiny", **ENGINE_KW) as from_hub:
        assert from_hub.core.config.model == snapshot
        assert [o["token_ids"] for o in from_hub.generate(PROMPTS, GREEDY, use_tqdm=False)] == expected


def test_a_revision_names_its_snapshot(tiny_qwen3, hub_cache):
    lay_out_in_hub_cache(tiny_qwen3, hub_cache, "org/tiny")
    tagged = lay_out_in_hub_cache(tiny_qwen3, hub_cache, "org/tiny", revision="v2", commit="f" * 40)
    assert hub.download_model("org/tiny", "v2") == tagged
    with pytest.raises(OSError, match=r"revision 'v3'.*hf download org/tiny --revision v3"):
        hub.download_model("org/tiny", "v3")


def test_a_missing_hub_id_offline_says_how_to_get_it(hub_cache):
    with pytest.raises(OSError) as info:
        LLM("org/missing", **ENGINE_KW)
    message = str(info.value)
    assert message.startswith("no network (HF_HUB_OFFLINE is set)")
    assert "'org/missing'" in message and hub_cache in message
    assert "pass a local directory" in message and "`hf download org/missing`" in message


def test_a_hub_repository_of_pickle_weights_is_refused(tiny_qwen3, hub_cache, tmp_path):
    pickled = tmp_path / "pickled"
    pickled.mkdir()
    for name in os.listdir(tiny_qwen3):
        if not name.endswith(".safetensors"):
            shutil.copy(os.path.join(tiny_qwen3, name), pickled)
    (pickled / "pytorch_model.bin").write_bytes(b"not unpickled")
    lay_out_in_hub_cache(str(pickled), hub_cache, "org/pickled")
    with pytest.raises(ValueError, match=r"'org/pickled' has no \.safetensors weights \(it holds pytorch_model\.bin: "
                                         r"pickle checkpoints are refused"):
        LLM("org/pickled", **ENGINE_KW)


class _Listing:
    """What HfApi.model_info answers, for the files named."""
    class _File:
        def __init__(self, name: str):
            self.rfilename, self.size = name, 1000

    def __init__(self, *names: str):
        self.sha = "a" * 40
        self.siblings = [self._File(name) for name in names]


def test_online_only_safetensors_configs_and_tokenizers_are_fetched(monkeypatch, hub_cache):
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(hub.HfApi, "model_info", lambda self, repo_id, **kw: _Listing(
        "config.json", "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors",
        "model.safetensors.index.json", "pytorch_model.bin", "tokenizer.json", "tokenizer_config.json", "merges.txt",
        "chat_template.jinja", "modeling_custom.py", "original/consolidated.00.pth", "onnx/model.safetensors"))
    fetched = {}

    def snapshot_download(repo_id, revision=None, allow_patterns=None, **kw):
        fetched.update(repo_id=repo_id, revision=revision, files=allow_patterns)
        return hub_cache  # stands for the snapshot: a directory that must hold safetensors weights

    monkeypatch.setattr(hub, "snapshot_download", snapshot_download)
    os.makedirs(hub_cache)
    open(os.path.join(hub_cache, "model.safetensors"), "w").close()
    assert hub.download_model("org/sharded", "v1") == hub_cache
    assert fetched == dict(repo_id="org/sharded", revision="v1", files=[
        "chat_template.jinja", "config.json", "merges.txt", "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors", "model.safetensors.index.json", "tokenizer.json", "tokenizer_config.json"])


def test_online_a_repository_without_safetensors_is_refused_before_any_download(monkeypatch, hub_cache):
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(hub.HfApi, "model_info", lambda self, repo_id, **kw: _Listing(
        "config.json", "pytorch_model.bin", "tokenizer.json"))

    def snapshot_download(*args, **kwargs):
        raise AssertionError("downloaded a repository that is refused")

    monkeypatch.setattr(hub, "snapshot_download", snapshot_download)
    with pytest.raises(ValueError, match=r"'org/old' has no \.safetensors weights \(it holds pytorch_model\.bin"):
        hub.download_model("org/old")


def test_an_unreachable_hub_falls_back_to_the_cache(tiny_qwen3, monkeypatch, hub_cache):
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)

    def no_network(self, repo_id, **kwargs):
        raise ConnectionError("Name or service not known")

    monkeypatch.setattr(hub.HfApi, "model_info", no_network)
    snapshot = lay_out_in_hub_cache(tiny_qwen3, hub_cache, "org/tiny")
    assert hub.download_model("org/tiny") == snapshot
    with pytest.raises(OSError, match=r"no network \(the hub cannot be reached: ConnectionError: Name or service"):
        hub.download_model("org/elsewhere")


@pytest.mark.parametrize("model, message", [
    ("/no/such/dir", "does not exist, and is not a Hugging Face hub id"),
    ("no-such-dir", "does not exist, and is not a Hugging Face hub id"),
    ("org/name/extra", "does not exist, and is not a Hugging Face hub id"),
    ("org/../name", "does not exist, and is not a Hugging Face hub id"),
    ("org/model.gguf", "does not exist, and is not a Hugging Face hub id")])
def test_what_is_neither_a_path_nor_a_hub_id_is_refused(model, message):
    with pytest.raises(ValueError, match=rf"Config\.model: .*{message}"):
        Config(model=model)


def test_revision_is_checked(tiny_qwen3):
    assert Config(model="org/name", revision="v1").revision == "v1"
    with pytest.raises(ValueError, match=r"Config\.revision: is for a Hugging Face hub id"):
        Config(model=tiny_qwen3, revision="main")
    for bad in ("", " ", 3):
        with pytest.raises(ValueError, match=r"Config\.revision: expected a branch, tag or commit"):
            Config(model="org/name", revision=bad)
