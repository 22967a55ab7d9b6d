"""Compiling a StructuredOutput with xgrammar, and the per-request matcher that follows its tokens.

Why xgrammar (docs/DECISIONS.md has the numbers): its per-token mask fill, the work done for every
constrained row of every step, is several times faster than llguidance's on our tokenizers; its
compile is slower (up to about a second at structured/checks.py's size limits) but happens once per
schema, off the engine thread, and is cached.

Compiles run on CompileJobs' threads (xgrammar frees the GIL), one at a time plus a bounded number
left running by waiters that gave up; a caller waits up to deadline_s of compile time. The cache
of compiled grammars is bounded by their size in bytes, not by their count (one can be 50 MB).
"""
from __future__ import annotations

import collections
import functools
import json
import logging
import os
import threading
import time

import anyio
import torch

from asyncllm.errors import InvalidValueError
from asyncllm.structured.compile_jobs import CompileJobs
from asyncllm.structured.spec import StructuredOutput



@functools.cache
def _xgrammar():
    """The xgrammar module, or None where it is not installed (an optional dependency: only
    constrained requests need it). Imported on first use: it imports transformers, seconds that an
    engine start-up would otherwise spend before its first weight is read."""
    try:
        import xgrammar
    except ImportError:
        return None
    return xgrammar

logger = logging.getLogger("asyncllm")

INSTALL_HINT = "structured output needs xgrammar: pip install 'asyncllm-engine[structured]' (or pip install xgrammar)"
# a compile running longer than this fails its request (checks.py's limits keep an accepted one to
# a tenth of it on an idle CPU; the rest is room for a busy one)
COMPILE_DEADLINE_S = 20.0
CACHE_LIMIT_BYTES = 256 << 20


class GrammarCompiler:
    """Compiles StructuredOutputs for one tokenizer; thread-safe. Compiled grammars are cached by
    (kind, canonical text)."""

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: set[int], *,
                 deadline_s: float = COMPILE_DEADLINE_S, cache_limit_bytes: int = CACHE_LIMIT_BYTES,
                 jobs: CompileJobs | None = None):
        xgrammar = _xgrammar()
        if xgrammar is None:
            raise _structured_output_error(INSTALL_HINT)
        self.vocab_size = vocab_size
        self.deadline_s = deadline_s
        self.cache_limit_bytes = cache_limit_bytes
        self.jobs = jobs if jobs is not None else CompileJobs()
        # xgrammar's compiler reads the whole vocabulary (about a second): made by the first
        # compile, on its thread, not by whoever makes this object (possibly an event loop)
        self._tokenizer, self._stop_token_ids = tokenizer, sorted(stop_token_ids)
        self._xgrammar_compiler = None
        self._xgrammar_lock = threading.Lock()
        # fills a step's rows on several threads (C++, without the GIL)
        self._batch_matcher = xgrammar.BatchGrammarMatcher(max_threads=max(1, min(8, (os.cpu_count() or 1) // 2)))
        self._cache: collections.OrderedDict[tuple[str, str], object] = collections.OrderedDict()
        self._cache_bytes = 0
        self._lock = threading.Lock()

    @property
    def bitmask_width(self) -> int:
        """int32 words per row of a token bitmask."""
        return (self.vocab_size + 31) // 32

    def compile(self, spec: StructuredOutput):
        """spec's compiled grammar, from the cache or compiled on a compile thread (this one
        blocks meanwhile). ValueError naming SamplingParams.structured_output when the schema,
        regex or grammar is invalid or its compile runs past deadline_s; QueueFullError when too
        many compiles are queued."""
        compiled = self._cached(spec.key)
        if compiled is not None:
            return compiled
        job = self.jobs.submit(spec.key, functools.partial(self._compile_and_cache, spec))
        try:
            return self.jobs.wait(job, self.deadline_s)
        except TimeoutError:
            raise self._too_slow() from None
        finally:
            self.jobs.leave(job)

    async def compile_async(self, spec: StructuredOutput) -> None:
        """compile(spec) for a caller on an event loop (asyncio or trio): it waits without holding
        the loop or a thread, and cancelling it (a client gone) drops the compile if it has not
        started. The result is cached, for the submission that follows."""
        if self._cached(spec.key) is not None:
            return
        job = self.jobs.submit(spec.key, functools.partial(self._compile_and_cache, spec))
        try:
            delay = 0.001  # polled: a few checks for a quick compile, 20 a second for a long one
            while not job.done:
                if job.overdue(self.deadline_s):
                    raise self._too_slow()
                await anyio.sleep(delay)
                delay = min(2 * delay, 0.05)
            job.outcome()
        finally:
            self.jobs.leave(job)

    def prepare(self, spec: StructuredOutput) -> None:
        """compile(spec) for a request about to be queued, spec being the request's own copy: the
        compiled grammar stays with it, so the engine thread never compiles, whatever the cache
        evicts meanwhile."""
        object.__setattr__(spec, "_compiled", (self, self.compile(spec)))

    def new_state(self, spec: StructuredOutput, gate=None, request_id: str = "", params=None) -> "GrammarState":
        """gate: an engine.reasoning_format.ReasoningGate, which holds the grammar back while the
        output reasons (None: it applies from the first token). request_id and params (its
        SamplingParams): what a refusal's message names."""
        prepared = spec.__dict__.get("_compiled")
        return GrammarState(prepared[1] if prepared is not None and prepared[0] is self else self.compile(spec), gate,
                            request_id, _other_constraints(params))

    def stats(self) -> dict:
        """Compiles queued, running (detached: their waiters left, they run on unseen) and the cache."""
        jobs = self.jobs.stats()
        with self._lock:
            return {"grammar_compiles_queued": jobs["queued"], "grammar_compiles_running": jobs["running"],
                    "grammar_compiles_detached": jobs["detached"], "grammar_cache_bytes": self._cache_bytes,
                    "grammar_cache_entries": len(self._cache)}

    def _too_slow(self) -> InvalidValueError:
        return _structured_output_error(f"the grammar did not compile within {self.deadline_s:g} s "
                                        "(COMPILE_DEADLINE_S); make it smaller or simpler")

    def _cached(self, key: tuple[str, str]):
        with self._lock:
            compiled = self._cache.get(key)
            if compiled is not None:
                self._cache.move_to_end(key)
            return compiled

    def _compile_and_cache(self, spec: StructuredOutput):
        """On a compile thread. A compile past the deadline is not cached: its waiters have failed."""
        started = time.monotonic()
        compiled = self._compile(spec)
        if time.monotonic() - started <= self.deadline_s:
            size = compiled.memory_size_bytes
            with self._lock:
                if spec.key not in self._cache and size <= self.cache_limit_bytes:
                    self._cache[spec.key] = compiled
                    self._cache_bytes += size
                    while self._cache_bytes > self.cache_limit_bytes:
                        self._cache_bytes -= self._cache.popitem(last=False)[1].memory_size_bytes
        return compiled

    def _compile(self, spec: StructuredOutput):
        compiler = self._compiler()
        kind, text = spec.key
        try:
            if kind == "json":
                # compact JSON (no free whitespace): a model cannot spend its tokens on blank space
                return compiler.compile_json_schema(text, any_whitespace=False, strict_mode=True)
            if kind == "json_object":
                return compiler.compile_json_schema('{"type": "object"}', any_whitespace=False, strict_mode=False)
            if kind == "regex":
                return compiler.compile_regex(text)
            if kind == "choice":
                return compiler.compile_grammar(
                    "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in json.loads(text)))
            return compiler.compile_grammar(text)
        except Exception as e:  # xgrammar raises RuntimeError/ValueError subclasses of its own
            raise _structured_output_error(f"invalid {kind}: {_first_line(e)}") from None

    def _compiler(self):
        with self._xgrammar_lock:
            if self._xgrammar_compiler is None:
                xgrammar = _xgrammar()
                info = xgrammar.TokenizerInfo.from_huggingface(self._tokenizer, vocab_size=self.vocab_size,
                                                               stop_token_ids=self._stop_token_ids)
                # its own cache off: this class's, bounded by bytes, holds what is worth keeping
                self._xgrammar_compiler = xgrammar.GrammarCompiler(info, max_threads=2, cache_enabled=False)
            return self._xgrammar_compiler

    def fill_bitmask(self, states: list["GrammarState"], bitmask: torch.Tensor) -> None:
        """bitmask[i] = the tokens states[i] allows next; all of them for a state that is done
        (its row's token will be dropped), has refused a token, or is held back while its output reasons."""
        live = [i for i, state in enumerate(states) if state.error is None and not state.matcher.is_terminated()
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


    @staticmethod
    def fill_bitmask_after(state: "GrammarState", drafts: list[int], bitmask: torch.Tensor, row: int) -> None:
        """bitmask[row] = the tokens state allows after drafts (a speculative position's mask; the
        matcher is left as it was). All tokens where it refuses a draft or is done after them (the
        position follows a draft the grammar forbids, which the verification rejects, so its token
        is never kept) or where state fill_bitmask leaves whole."""
        if state.error is not None or state.gate is not None or state.matcher.is_terminated():
            return  # fill_bitmask gave it every token
        matcher, taken = state.matcher, 0
        for token in drafts:
            if not matcher.accept_token(token):
                break
            taken += 1
        if taken == len(drafts) and not matcher.is_terminated():
            matcher.fill_next_token_bitmask(bitmask, row)
        else:
            bitmask[row] = -1
        if taken:
            matcher.rollback(taken)


class GrammarState:
    """One request's matcher, advanced over the request's completion tokens as the host learns them.

    Only delivered tokens are ever fed: a token the engine drops (in flight when the request ended)
    belongs to a request that is over, and its state is dropped with it, so nothing is rolled back.
    A token the matcher refuses was sampled because the request's other constraints left no token
    the grammar allows: error says so, and the engine ends the request without that token."""

    __slots__ = ("matcher", "num_consumed", "error", "gate", "request_id", "others")

    def __init__(self, compiled, gate=None, request_id: str = "", others: tuple[str, ...] = ()):
        self.matcher = _xgrammar().GrammarMatcher(compiled)
        self.num_consumed = 0  # completion tokens taken so far (the grammar's, and the reasoning's before them)
        self.error: str | None = None  # why a token was refused (the other constraints left none it allows)
        self.gate = gate  # a ReasoningGate: the tokens it does not admit are the reasoning's, not the grammar's
        self.request_id = request_id
        self.others = others  # the request's other constraints, by field: what a refusal blames

    def catch_up(self, token_ids: list[int], num_prompt_tokens: int, pending_value: int | None = None) -> None:
        """Feed the completion tokens of token_ids (prompt, then completion: known values) not fed
        yet; then pending_value, when given: the token after the last known one (the runner's, which
        the previous step sampled)."""
        for index in range(num_prompt_tokens + self.num_consumed, len(token_ids)):
            self._feed(token_ids[index])
        if pending_value is not None:
            self._feed(pending_value)

    def _feed(self, token: int) -> None:
        if self.gate is not None and not self.gate.admits(token):
            self.num_consumed += 1
            return
        if self.error is None and not self.matcher.accept_token(token):
            self.error = _refusal(self.others, token, self.num_consumed)
            logger.warning("request %s: structured_output: %s", self.request_id, self.error)
        self.num_consumed += 1

    @property
    def is_terminated(self) -> bool:
        return self.matcher.is_terminated()


def _structured_output_error(reason: str) -> InvalidValueError:
    """A request's structured_output refused (the request's SamplingParams field)."""
    return InvalidValueError("structured_output", reason, "SamplingParams")


def _other_constraints(params) -> tuple[str, ...]:
    """The fields of params (SamplingParams, or None) that constrain tokens besides the grammar."""
    if params is None:
        return ()
    return tuple(name for name, given in (("allowed_token_ids", params.allowed_token_ids is not None),
                                          ("bad_words", bool(params.bad_words)), ("min_tokens", params.min_tokens > 0))
                 if given)


def _refusal(others: tuple[str, ...], token: int, index: int) -> str:
    """Why the request ends at its index-th output token, which its grammar refused (the reason of
    the UnsatisfiableConstraintsError its stream raises); others: _other_constraints'."""
    if not others:  # the grammar's mask alone decides: a refused token is the engine's fault
        return f"output token {index} ({token}) does not match the grammar"
    why = " (min_tokens bans the stop tokens that end a complete output)" if "min_tokens" in others else ""
    return (f"at output token {index} no token is allowed by both the grammar "
            f"and {' and '.join(others)}{why}; the request ends there, without that token")


def _first_line(error: Exception) -> str:
    text = str(error).strip() or type(error).__name__
    return text.splitlines()[0][:300]
