"""A request's way into the engine: its prompt encoded and checked, its sampling params checked (a
grammar compiled), and its sequences made (stop ids, bad words, a grammar's state). Runs in the
caller's thread (AsyncLLMEngine's checks) and on the engine thread (new sequences); holds nothing
that a step changes."""
from __future__ import annotations

import dataclasses
import threading
import marshal

import numpy as np

from asyncllm.config import Config, config_error
from asyncllm.engine.reasoning_format import ReasoningTags
from asyncllm.engine.sequence import PromptIds, Sequence
from asyncllm.engine.text_pieces import TextPieceEncoder
from asyncllm.engine.token_bans import check_some_token_samplable, encode_bad_words
from asyncllm.errors import InvalidTypeError, InvalidValueError, PromptTooLongError
from asyncllm.models.checkpoint import find_eos_token_ids
from asyncllm.pooling_params import PoolingParams, shown_int
from asyncllm.sampling_params import SamplingParams
from asyncllm.structured.grammar import GrammarCompiler


def check_text(text: str, argument: str) -> None:
    """Refuse a str that is not valid Unicode text (lone surrogates, e.g. from bytes decoded with
    errors="surrogateescape"), which the tokenizer would reject with an obscure error."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise InvalidValueError(argument, f"not valid Unicode text (lone surrogate {text[e.start]!r} at index "
                                          f"{e.start}); decode bytes with errors='replace' first") from None


# marshal (format 2: no back-references) writes a list or tuple of n exact ints that fit in int32 as
# a 5-byte header, then per int the type code "i" and its 4 bytes little-endian; anything else
# (bool: "T"/"F", a float, a larger int, an int subclass or numpy int: unmarshallable or another
# code) breaks that layout. One C pass thus both checks a 32k-token prompt's types and converts its
# ids: ~3x as fast as counting the exact types and then converting (array.fromlist), two passes
_MARSHAL_VERSION = 2
_MARSHAL_INT = np.dtype([("code", "u1"), ("value", "<i4")])
_MARSHAL_LAYOUT = marshal.dumps([7, -2], _MARSHAL_VERSION) == b"[\x02\x00\x00\x00i\x07\x00\x00\x00i\xfe\xff\xff\xff"


def int32_ids(token_ids) -> np.ndarray | None:
    """token_ids (a list or tuple) as an int32 array if every entry is an exact int (not a bool)
    within int32, else None (the caller finds which entry is not)."""
    if not _MARSHAL_LAYOUT:  # another Python's marshal layout: every prompt takes the caller's loop
        return None
    try:
        data = marshal.dumps(token_ids, _MARSHAL_VERSION)
    except ValueError:  # unmarshallable: a list subclass, an int subclass, a numpy int, nesting too deep
        return None
    if len(data) != 5 + 5 * len(token_ids):
        return None
    records = np.frombuffer(data, dtype=_MARSHAL_INT, offset=5)
    # each entry's code at its offset 5 + 5 * i, all "i": by induction each entry is an int of 5 bytes
    if not (records["code"] == ord("i")).all():
        return None
    return records["value"]


class RequestIntake:
    """The tokenizer, the model's vocabulary and EOS ids, the length limits and the grammar compiler
    that a request is checked against and its sequences made with."""

    def __init__(self, config: Config, tokenizer, max_seq_len: int):
        self.tokenizer = tokenizer
        self.max_seq_len = max_seq_len  # max_model_len, or less where the KV cache is smaller
        self.max_model_len = config.max_model_len
        self.block_size = config.kvcache_block_size
        self.vocab_size = config.hf_config.vocab_size
        self.hidden_size = config.hf_config.hidden_size  # an embedding's length
        self.tensor_parallel_size = config.tensor_parallel_size
        self.eos_token_ids = find_eos_token_ids(config.model, config.hf_config, tokenizer)
        # no token decodes to more characters than this: a longer text cannot fit in max_seq_len
        # tokens, and is refused before the tokenizer spends seconds on it
        self.max_prompt_chars = max_seq_len * max(map(len, tokenizer.get_vocab()), default=1)
        self.reasoning = ReasoningTags.of(config.reasoning_parser, tokenizer)  # a grammar waits for its end
        # a conversation's rendered text: the pieces an earlier turn encoded are not encoded again
        self.chat_text_encoder = TextPieceEncoder(tokenizer)
        # made on the first constrained request (xgrammar reads the whole vocabulary)
        self._grammar_compiler: GrammarCompiler | None = None
        self._grammar_compiler_lock = threading.Lock()

    def encode_prompt(self, prompt, argument: str = "prompt") -> PromptIds:
        """A prompt string or token-id list, checked, as token ids (the caller's list copied)."""
        if isinstance(prompt, str):
            if not prompt:
                raise InvalidValueError(argument, "the prompt is empty")
            check_text(prompt, argument)
            if len(prompt) > self.max_prompt_chars:
                raise PromptTooLongError(argument, f"{len(prompt)} characters cannot fit in max_model_len "
                                                   f"({self.max_seq_len} tokens)")
            token_ids = self.tokenizer.encode(prompt)
            if not token_ids:
                raise InvalidValueError(argument, "the prompt encodes to no tokens")
            return self._checked_prompt(token_ids, argument, owned=type(token_ids) is list)
        if isinstance(prompt, (list, tuple)):
            if not prompt:
                raise InvalidValueError(argument, "the token-id list is empty")
            return self._checked_prompt(prompt, argument)
        raise InvalidTypeError(argument, f"expected a string or a list of token ids, got {type(prompt).__name__}")

    def _checked_prompt(self, token_ids, argument: str, owned: bool = False) -> PromptIds:
        """owned: token_ids is the intake's own list (the tokenizer's), else the caller's, which may
        change while and after it is checked: a snapshot is checked and kept."""
        ids = token_ids if owned else list(token_ids)
        checked = PromptIds(ids)
        checked.int64 = self._checked_int64(ids, argument)
        return checked

    def check_token_ids(self, token_ids: list[int], argument: str, owner: str | None = None) -> list[int]:
        """Every id an int inside the model's vocabulary: an id past it would fail inside a step.
        owner: the class whose field argument is, if it is one."""
        self._checked_int64(token_ids, argument, owner)
        return token_ids

    def _checked_int64(self, token_ids, argument: str, owner: str | None = None) -> np.ndarray:
        """check_token_ids' check; returns the ids as an int64 array."""
        values = int32_ids(token_ids)
        if values is not None and (not len(values) or (values.min() >= 0 and values.max() < self.vocab_size)):
            return values.astype(np.int64)
        for i, t in enumerate(token_ids):  # names the bad entry
            if isinstance(t, bool) or not isinstance(t, int):
                raise InvalidTypeError(f"{argument}[{i}]", f"token ids must be ints, got {type(t).__name__}", owner)
            if not 0 <= t < self.vocab_size:
                raise InvalidValueError(f"{argument}[{i}]", f"token id {t} is outside the vocabulary "
                                                            f"[0, {self.vocab_size})", owner)
        # valid, but not what int32_ids reads (int subclasses, an IntEnum's members; a list subclass)
        return np.array([int(t) for t in token_ids], dtype=np.int64)

    def check_request(self, prompt_token_ids: list[int], params: SamplingParams,
                      argument: str = "prompt") -> SamplingParams:
        """Check a request; returns the validated snapshot of params that the request must keep."""
        if not isinstance(params, SamplingParams):
            raise InvalidTypeError("sampling_params", f"expected SamplingParams, got {type(params).__name__}")
        # a snapshot: fields set on the caller's object later would otherwise reach a step and
        # fail there, killing the engine for every request
        params = params.snapshot()
        if params.logit_bias is not None:
            self.check_token_ids(list(params.logit_bias), "logit_bias", "SamplingParams")
        if params.allowed_token_ids is not None:
            self.check_token_ids(params.allowed_token_ids, "allowed_token_ids", "SamplingParams")
        if params.stop_token_ids:  # banned below min_tokens: an id past the logits would fail the step
            self.check_token_ids(params.stop_token_ids, "stop_token_ids", "SamplingParams")
        check_some_token_samplable(params, self.vocab_size, self.eos_token_ids, self.tokenizer)
        if params.structured_output is not None:
            # compiled here (the caller waits) and kept with the request's copy: the engine thread never compiles
            self.grammar_compiler.prepare(params.structured_output)
        if len(prompt_token_ids) >= self.max_seq_len:
            raise PromptTooLongError(argument, f"{len(prompt_token_ids)} tokens leave no room to generate within "
                                               f"{self._length_limit} ({self.max_seq_len} tokens)")
        return params

    @property
    def _length_limit(self) -> str:
        return "max_model_len" if self.max_seq_len == self.max_model_len else "the KV cache's capacity"

    def check_embedding_request(self, prompt_token_ids: list[int], params: PoolingParams,
                                argument: str = "prompt") -> PoolingParams:
        """Check an embedding request (its prompt checked by encode_prompt); returns params."""
        if not isinstance(params, PoolingParams):
            raise InvalidTypeError("pooling_params", f"expected PoolingParams, got {type(params).__name__}")
        if self.tensor_parallel_size > 1:
            # the worker ranks would replay CUDA graphs of a step that rank 0 runs eagerly to pool it
            raise config_error("tensor_parallel_size", "embeddings are not available with tensor_parallel_size > 1")
        if params.dimensions is not None and params.dimensions > self.hidden_size:
            raise InvalidValueError("dimensions", f"{shown_int(params.dimensions)} is more than the model's hidden "
                                                  f"size ({self.hidden_size})")
        if len(prompt_token_ids) > self.max_seq_len:  # no room to generate needed: nothing is generated
            raise PromptTooLongError(argument, f"{len(prompt_token_ids)} tokens exceed {self._length_limit} "
                                               f"({self.max_seq_len} tokens)")
        return params

    @property
    def grammar_compiler(self) -> GrammarCompiler:
        with self._grammar_compiler_lock:
            if self._grammar_compiler is None:
                self._grammar_compiler = GrammarCompiler(self.tokenizer, self.vocab_size, self.eos_token_ids)
            return self._grammar_compiler

    def grammar_stats(self) -> dict:  # live, from any thread; {} before the first constrained request
        return self._grammar_compiler.stats() if self._grammar_compiler is not None else {}

    def new_sequence(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                     index: int, deadline: float | None = None) -> Sequence:
        """Sequence index (of params.n) of a request whose params check_request returned (deadline:
        when the request times out, None: never)."""
        if params.n > 1:
            seed = params.seed
            if seed is not None:  # each sequence its own stream, reproducible: seed + index (wrapped)
                seed = seed + index if seed + index < 1 << 64 else seed + index - (1 << 64)
            # the first sequence alone computes the prompt, and scores it if asked
            params = dataclasses.replace(params, n=1, seed=seed,
                                         prompt_logprobs=params.prompt_logprobs if index == 0 else None)
        seq = Sequence(request_id, prompt_token_ids, params, self.block_size, self.max_seq_len, deadline)
        seq.index = index
        seq.stop_ids = frozenset(params.stop_token_ids) | (frozenset() if params.ignore_eos else self.eos_token_ids)
        if params.min_tokens:
            seq.early_stop_ids = sorted(seq.stop_ids)
        if params.bad_words:
            seq.bad_word_ids = encode_bad_words(self.tokenizer, params.bad_words)
        if params.structured_output is not None:  # each of n sequences follows the grammar on its own
            gate = self.reasoning.grammar_gate(prompt_token_ids) if self.reasoning is not None else None
            seq.grammar = self.grammar_compiler.new_state(params.structured_output, gate, request_id, params)
        return seq
