"""load_tokenizer reads a Qwen2-class tokenizer.json as saved (tokenizers, in Rust) rather than through
transformers 5's Python rebuild (models/tokenizer_loader.py): the result must be the tokenizer that
AutoTokenizer builds, which we did not write. Other classes still go to AutoTokenizer."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
from transformers import AutoTokenizer

from asyncllm.models.tokenizer_loader import load_tokenizer
from asyncllm.testing import _cut_tokenizer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TEXTS = ["Hello world!", "  leading spaces\n\nand\ttabs\r\n", "日本語のテキスト 😀 naïve café ﬁ", "x" * 300,
         "<|im_start|>user\nhi<|im_end|>\n<|endoftext|>", "def f(x):\n    return x**2  # it's 3.14159",
         "I'm sure you'll've done it, they'd", "Ａ１２３ e\u0301 \u00e9"]
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+2?"},
            {"role": "assistant", "content": "4"}, {"role": "user", "content": "And 3+3?"}]


def copy_tokenizer(src: str, dst, edit_config=None) -> str:
    for name in os.listdir(src):
        if name.startswith(("tokenizer", "vocab", "merges", "special_tokens", "added_tokens")):
            shutil.copy(os.path.join(src, name), dst)
    if edit_config is not None:
        path = os.path.join(dst, "tokenizer_config.json")
        with open(path) as f:
            config = json.load(f)
        edit_config(config)
        with open(path, "w") as f:
            json.dump(config, f)
    return str(dst)


def cut_tokenizer_dir(src: str, dst) -> str:
    for name, content in _cut_tokenizer(src, 2048)[0].items():  # the tiny checkpoints' tokenizer
        with open(os.path.join(dst, name), "w") as f:
            json.dump(content, f, ensure_ascii=False)
    return str(dst)


def assert_same_tokenizer(ours, reference) -> None:
    for text in TEXTS:
        assert ours.encode(text) == reference.encode(text), text
        ids = reference.encode(text, add_special_tokens=False)
        assert ours.encode(text, add_special_tokens=False) == ids, text
        for skip in (False, True):
            assert ours.decode(ids, skip_special_tokens=skip) == reference.decode(ids, skip_special_tokens=skip)
        assert ours.convert_ids_to_tokens(ids) == reference.convert_ids_to_tokens(ids)
    for name in ("eos_token", "eos_token_id", "bos_token_id", "pad_token_id", "unk_token", "all_special_ids",
                 "chat_template", "model_max_length"):
        assert getattr(ours, name) == getattr(reference, name), name
    assert len(ours) == len(reference) and ours.get_vocab() == reference.get_vocab()
    for tokenize in (False, True):
        assert ours.apply_chat_template(MESSAGES, tokenize=tokenize, add_generation_prompt=True) == \
            reference.apply_chat_template(MESSAGES, tokenize=tokenize, add_generation_prompt=True)


@pytest.mark.parametrize("cut", [False, True], ids=["qwen3-tokenizer", "cut-to-2048-ids"])
def test_a_qwen2_class_tokenizer_loads_as_saved_and_equals_autotokenizers(tokenizer_dir, tmp_path, cut):
    model_dir = cut_tokenizer_dir(tokenizer_dir, tmp_path) if cut else tokenizer_dir
    ours = load_tokenizer(model_dir)
    reference = AutoTokenizer.from_pretrained(model_dir)
    assert type(reference).__name__ == "Qwen2Tokenizer"  # the class whose Python rebuild is skipped
    assert type(ours).__name__ == "TokenizersBackend"  # the fast path was taken
    assert_same_tokenizer(ours, reference)


def test_the_qwen2_classes_special_token_defaults_apply_where_the_config_names_none(tokenizer_dir, tmp_path):
    def drop_special_tokens(config):
        for name in ("eos_token", "pad_token", "unk_token"):
            config.pop(name, None)
    model_dir = copy_tokenizer(tokenizer_dir, tmp_path, drop_special_tokens)
    ours, reference = load_tokenizer(model_dir), AutoTokenizer.from_pretrained(model_dir)
    assert type(ours).__name__ == "TokenizersBackend"
    assert ours.eos_token == reference.eos_token == "<|endoftext|>"
    assert_same_tokenizer(ours, reference)


@pytest.mark.parametrize("edit", ["another class", "no tokenizer.json"])
def test_other_tokenizers_are_built_by_their_class(tokenizer_dir, tmp_path, edit):
    if edit == "another class":
        model_dir = copy_tokenizer(tokenizer_dir, tmp_path, lambda c: c.update(tokenizer_class="GPT2Tokenizer"))
    else:
        model_dir = copy_tokenizer(tokenizer_dir, tmp_path)
        os.remove(os.path.join(model_dir, "tokenizer.json"))  # vocab.json + merges.txt remain
    ours = load_tokenizer(model_dir)
    assert type(ours) is type(AutoTokenizer.from_pretrained(model_dir))
    assert type(ours).__name__ != "TokenizersBackend"


def test_a_broken_tokenizer_json_is_a_value_error_naming_the_directory(tokenizer_dir, tmp_path):
    model_dir = copy_tokenizer(tokenizer_dir, tmp_path)
    with open(os.path.join(model_dir, "tokenizer.json"), "w") as f:
        f.write("{not json")
    with pytest.raises(ValueError, match="cannot be loaded") as info:
        load_tokenizer(model_dir)
    assert model_dir in str(info.value)


def test_importing_the_engines_api_imports_no_optional_heavy_module():
    # each takes from tens of ms to seconds to import and serves a feature an engine may never use:
    # the tokenizer (transformers, on its thread), structured output, the hub, the server, GGUF files,
    # Triton (CUDA only)
    optional = ["transformers", "xgrammar", "huggingface_hub", "fastapi", "uvicorn", "pydantic", "gguf",
                "jinja2", "asyncllm.server", "asyncllm.models.hub", "triton"]
    code = ("import sys, json\nfrom asyncllm import LLM, AsyncLLMEngine, SamplingParams\n"
            f"print(json.dumps([m for m in {optional!r} if m in sys.modules]))\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, PYTHONPATH=ROOT))
    assert done.returncode == 0, done.stderr[-2000:]
    assert json.loads(done.stdout.strip().splitlines()[-1]) == []
