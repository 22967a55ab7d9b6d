"""Compiling a StructuredOutput with xgrammar, and the per-request matcher that follows its tokens.

Why xgrammar (docs/BENCHMARKS.md has the numbers, benchmarks/bench_grammar_engines.py makes them):
its per-token mask fill, the work done for every constrained row of every step, is several times
faster than llguidance's on our tokenizers; its compile is slower, but happens once per schema, off
the engine thread, and is cached.
"""
from __future__ import annotations

import json
import logging
import os
import threading
from collections import OrderedDict

import torch

from asyncllm.engine.sequence import PENDING_TOKEN
from asyncllm.structured.spec import StructuredOutput

try:
    import xgrammar
except ImportError:  # an optional dependency: only constrained requests need it
    xgrammar = None

logger = logging.getLogger("asyncllm")

INSTALL_HINT = "structured output needs xgrammar: pip install 'asyncllm-engine[structured]' (or pip install xgrammar)"
MAX_CACHED_GRAMMARS = 512


class GrammarCompiler:
    """Compiles StructuredOutputs for one tokenizer; thread-safe, so requests compile in the thread
    that submits them. Compiled grammars are cached by (kind, canonical text)."""

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: set[int]):
        if xgrammar is None:
            raise ValueError(f"SamplingParams.structured_output: {INSTALL_HINT}")
        self.vocab_size = vocab_size
        info = xgrammar.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size,
                                                       stop_token_ids=sorted(stop_token_ids))
        self._compiler = xgrammar.GrammarCompiler(info, max_threads=2)
        # fills a step's rows on several threads (C++, without the GIL)
        self._batch_matcher = xgrammar.BatchGrammarMatcher(max_threads=max(1, min(8, (os.cpu_count() or 1) // 2)))
        self._cache: OrderedDict[tuple[str, str], object] = OrderedDict()
        self._lock = threading.Lock()

    @property
    def bitmask_width(self) -> int:
        """int32 words per row of a token bitmask."""
        return (self.vocab_size + 31) // 32

    def compile(self, spec: StructuredOutput):
        """The compiled grammar of spec; ValueError naming SamplingParams.structured_output when the
        schema, regex or grammar is invalid."""
        with self._lock:
            compiled = self._cache.get(spec.key)
            if compiled is not None:
                self._cache.move_to_end(spec.key)
                return compiled
        compiled = self._compile(spec)
        with self._lock:
            self._cache[spec.key] = compiled
            if len(self._cache) > MAX_CACHED_GRAMMARS:
                self._cache.popitem(last=False)
        return compiled

    def _compile(self, spec: StructuredOutput):
        kind, text = spec.key
        try:
            if kind == "json":
                # compact JSON (no free whitespace): a model cannot spend its tokens on blank space
                return self._compiler.compile_json_schema(text, any_whitespace=False, strict_mode=True)
            if kind == "json_object":
                return self._compiler.compile_json_schema('{"type": "object"}', any_whitespace=False,
                                                          strict_mode=False)
            if kind == "regex":
                return self._compiler.compile_regex(text)
            if kind == "choice":
                return self._compiler.compile_grammar(
                    "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in json.loads(text)))
            return self._compiler.compile_grammar(text)
        except Exception as e:  # xgrammar raises RuntimeError/ValueError subclasses of its own
            raise ValueError(f"SamplingParams.structured_output: invalid {kind}: {_first_line(e)}") from None

    def new_state(self, spec: StructuredOutput, gate=None) -> "GrammarState":
        """gate: an engine.reasoning_format.ReasoningGate, which holds the grammar back while the
        output reasons (None: it applies from the first token)."""
        return GrammarState(self.compile(spec), gate)

    def fill_bitmask(self, states: list["GrammarState"], bitmask: torch.Tensor) -> None:
        """bitmask[i] = the tokens states[i] allows next; all of them for a state that is done
        (its row's token will be dropped), failed, or held back while its output reasons."""
        live = [i for i, state in enumerate(states) if not state.failed and not state.matcher.is_terminated()
                and (state.gate is None or not state.gate.in_reasoning)]
        if len(live) < len(states):
            bitmask[:] = -1
        if live:
            self._batch_matcher.batch_fill_next_token_bitmask(
                [states[i].matcher for i in live], bitmask, None if len(live) == len(states) else live)
            for i in live:
                token = states[i].gate.optional_token if states[i].gate is not None else None
                if token is not None:  # the output may open a reasoning block instead
                    bit = 1 << (token % 32)
                    bitmask[i, token // 32] |= bit - (1 << 32) if bit >= 1 << 31 else bit  # int32 words


class GrammarState:
    """One request's matcher, advanced over the request's completion tokens as the host learns them.

    Only delivered tokens are ever fed: a token the engine drops (in flight when the request ended)
    belongs to a request that is over, and its state is dropped with it, so nothing is rolled back."""

    __slots__ = ("matcher", "num_consumed", "failed", "gate")

    def __init__(self, compiled, gate=None):
        self.matcher = xgrammar.GrammarMatcher(compiled)
        self.num_consumed = 0  # completion tokens taken so far (the grammar's, and the reasoning's before them)
        self.failed = False  # a token the grammar refused (it cannot be sampled; a bug if it was)
        self.gate = gate  # a ReasoningGate: the tokens it does not admit are the reasoning's, not the grammar's

    def catch_up(self, seq, pending_value: int | None = None) -> None:
        """Feed seq's completion tokens not fed yet, up to its first PENDING_TOKEN, whose value is
        pending_value when the caller knows it."""
        token_ids = seq.token_ids
        for index in range(seq.num_prompt_tokens + self.num_consumed, len(token_ids)):
            token = token_ids[index]
            if token == PENDING_TOKEN:
                if pending_value is None:
                    return
                token, pending_value = pending_value, None
            if self.gate is not None and not self.gate.admits(token):
                self.num_consumed += 1
                continue
            if not self.failed and not self.matcher.accept_token(token):
                logger.warning("request %s: token %d does not match its grammar", seq.request_id, token)
                self.failed = True
            self.num_consumed += 1

    @property
    def is_terminated(self) -> bool:
        return self.matcher.is_terminated()


def _first_line(error: Exception) -> str:
    text = str(error).strip() or type(error).__name__
    return text.splitlines()[0][:300]
