"""The model's tokenizer, loaded on a thread of its own while the engine builds the model, loads its
weights and captures its graphs.

A tokenizer is transformers' (models/checkpoint.py: load_tokenizer), and importing transformers
takes seconds (5.1 s of a 13.8 s warm start-up to the first token on an H100, run AA), more than the
tokenizer's files; nothing before the request intake needs it (the config is read without it:
models/model_config.py). Much of the main thread's work waits outside the GIL (file reads, device
syncs, the compilers' subprocesses), which is when this thread runs.
"""
from __future__ import annotations

import threading

from asyncllm.models.checkpoint import load_tokenizer


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
