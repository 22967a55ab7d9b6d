"""The model's tokenizer: which class loads it, and the load on a thread of its own while the engine
builds the model, loads its weights and captures its graphs.

A tokenizer is transformers', and importing transformers takes seconds, a large part of a warm
start-up and more than the tokenizer's files; nothing before the
request intake needs it (the config is read without it: models/model_config.py). Much of the main
thread's work waits outside the GIL (file reads, device syncs, the compilers' subprocesses), which is
when this thread runs.

transformers 5's AutoTokenizer builds a Qwen2Tokenizer (the Qwen2/2.5/3 families') from a Python
parse of tokenizer.json and a BPE rebuilt in Python from the parsed vocab and merges: most of the
load of Qwen's 151k-token vocabulary, all of it holding the GIL against the start-up on the main
thread. Where the class's constructor only re-derives what tokenizer.json
holds (the classes below), the file is read as saved, by the tokenizers library in Rust, into
transformers' generic class (transformers 4's way for every fast tokenizer): the same ids, text,
special tokens and chat template (tests/test_tokenizer_loading.py checks them against AutoTokenizer's).
"""
from __future__ import annotations

import json
import os
import threading

from asyncllm.config import config_error

# tokenizer_config.json's tokenizer_class -> the special tokens its constructor defaults where the
# config names none (transformers' Qwen2Tokenizer.__init__); any other class goes to AutoTokenizer
_QWEN2_DEFAULTS = {"unk_token": "<|endoftext|>", "eos_token": "<|endoftext|>", "pad_token": "<|endoftext|>"}
_LOADED_AS_SAVED = {
    "Qwen2Tokenizer": _QWEN2_DEFAULTS, "Qwen2TokenizerFast": _QWEN2_DEFAULTS,
    "PreTrainedTokenizerFast": {}, "TokenizersBackend": {},
}


def _saved_tokenizer_defaults(model_dir: str) -> dict | None:
    """The special-token defaults to load model_dir's tokenizer.json as saved with, or None where
    its class must build it (another class, no tokenizer.json, an unreadable tokenizer_config.json:
    AutoTokenizer then says what is wrong)."""
    if not os.path.isfile(os.path.join(model_dir, "tokenizer.json")):
        return None
    try:
        with open(os.path.join(model_dir, "tokenizer_config.json")) as f:
            tokenizer_config = json.load(f)
    except (OSError, ValueError):
        return None
    if not isinstance(tokenizer_config, dict):
        return None
    defaults = _LOADED_AS_SAVED.get(tokenizer_config.get("tokenizer_class"))
    if defaults is None:
        return None
    return {name: token for name, token in defaults.items() if name not in tokenizer_config}


# transformers' lazy top-level names break under concurrent first imports: a second thread's
# `from transformers import AutoTokenizer` while another's is under way raised ImportError (two
# engines starting at once, or an engine started after a failed start whose tokenizer thread was
# still importing). Every import of it by the engine goes through this lock.
_TRANSFORMERS_IMPORT = threading.Lock()


def transformers_attribute(name: str):
    """transformers.<name> (AutoTokenizer, AutoConfig, ...), imported by one thread at a time."""
    with _TRANSFORMERS_IMPORT:
        # seconds to import: only where a tokenizer (or a foreign config) is made. transformers imports
        # its classes on first use, so the fast path never imports AutoTokenizer's (its auto mappings)
        import transformers
        return getattr(transformers, name)


def load_tokenizer(model_dir: str):
    """The model directory's tokenizer (transformers', never remote code); a broken one is a
    ValueError naming the directory."""
    defaults = _saved_tokenizer_defaults(model_dir)
    tokenizer_class = transformers_attribute("AutoTokenizer" if defaults is None else "PreTrainedTokenizerFast")
    try:
        tokenizer = tokenizer_class.from_pretrained(model_dir, trust_remote_code=False)
        # the class's special-token defaults where the config names none, set after the load: **kwargs
        # into from_pretrained could carry trust_remote_code (tests/test_bad_inputs.py forbids any)
        for name, token in (defaults or {}).items():
            setattr(tokenizer, name, token)
        return tokenizer
    except Exception as e:  # noqa: BLE001 - transformers and tokenizers raise many types for broken files
        raise config_error("model", f"the tokenizer files in {model_dir!r} cannot be loaded: "
                           f"{type(e).__name__}: {e}") from e


class TokenizerLoader:
    """Starts loading model_dir's tokenizer on a daemon thread; result() waits for it."""

    def __init__(self, model_dir: str):
        self.model_dir = model_dir
        self._tokenizer = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._load, name="asyncllm-tokenizer", daemon=True)
        self._thread.start()

    def _load(self) -> None:
        try:
            self._tokenizer = load_tokenizer(self.model_dir)
        except BaseException as e:  # noqa: BLE001 - raised where result() is called, on the caller's thread
            self._error = e

    def result(self):
        """The tokenizer, once loaded; what the load raised (a ValueError naming the directory), raised here."""
        self._thread.join()
        if self._error is not None:
            raise self._error
        return self._tokenizer
