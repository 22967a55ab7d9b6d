"""Per-request generation settings."""
from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass, field

from asyncllm.structured.spec import StructuredOutput
from asyncllm.validation import FieldChecks, as_finite_float, is_int, short_repr

# bounds that keep stop-string matching cheap for everyone sharing the engine thread's loop
MAX_STOP_STRINGS = 64
MAX_STOP_STRING_CHARS = 1024
MAX_LOGPROBS = 20  # top alternatives per token, as OpenAI's top_logprobs and vLLM's default max_logprobs
MAX_N = 128  # sequences per request: each holds its own KV blocks and batch rows
MAX_LOGIT_BIAS = 100.0  # OpenAI's range for a logit_bias value
# Every step lists each request's biased and banned tokens for the sampler, so long lists slow every
# request sharing the step, not only the one that sent them. vLLM's model runner keeps
# these bounds (OpenAI allows 300 logit_bias entries). allowed_token_ids is not bounded: a request
# turns it into an array once (engine/sequence.py), and a step's cost for it is a copy of that array.
MAX_LOGIT_BIAS_ENTRIES = 1024
MAX_STOP_TOKEN_IDS = 128
# bad words are encoded per request and matched against every step's tail: bounded like stop strings
MAX_BAD_WORDS = 128
MAX_PENALTY = 2.0  # OpenAI's range for presence_penalty and frequency_penalty
# repetition_penalty divides positive logits by it and multiplies negative ones: kept within
# [1 / this, this], so that float32 logits stay finite and a banned token's -inf never meets a 0
# (at 1e-50, 0 in float32, every sampled token left allowed_token_ids)
MAX_REPETITION_PENALTY = 1e6
# Beyond this the sampling only flattens further what is already uniform over the allowed tokens (a
# model's logits differ by far less than 1e6), and the float32 math breaks further on: a temperature
# past float32's range became inf, so a forbidden token's logit, -inf / inf, was NaN and any token
# could be sampled (allowed_token_ids, grammars and min_tokens' bans all broke at 1e39).
MAX_TEMPERATURE = 1e6

_fail = FieldChecks("SamplingParams", show=short_repr)


@dataclass
class SamplingParams:
    temperature: float = 1.0  # 0 = greedy
    top_k: int = -1  # -1 = all tokens
    top_p: float = 1.0
    min_p: float = 0.0
    max_tokens: int | None = 64  # None: up to the context (max_model_len, or the KV cache's room), as vLLM's None
    ignore_eos: bool = False
    stop_token_ids: list[int] = field(default_factory=list)
    stop: list[str] = field(default_factory=list)
    include_stop_str_in_output: bool = False
    seed: int | None = None
    # scheduling order, as vLLM's: lower values are admitted first and preempted last; ties go
    # first come first served
    priority: int = 0
    # sequences generated from the prompt, which is prefilled once and shared (vLLM's n)
    n: int = 1
    # the chosen token's log-probability and this many top alternatives, per generated token; the
    # model's raw distribution, before penalties, biases and temperature (vLLM's default)
    logprobs: int | None = None
    # the same for each prompt token after the first
    prompt_logprobs: int | None = None
    # OpenAI's: subtract presence_penalty once from every token already generated, and
    # frequency_penalty once per time it was generated
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    # Hugging Face's: a token in the prompt or the output has its logit divided by this when
    # positive, multiplied when negative; 1 = off
    repetition_penalty: float = 1.0
    # EOS, stop_token_ids and stop strings cannot end the output before this many tokens (as vLLM:
    # a stop string counts only if it ends in a later token)
    min_tokens: int = 0
    # token id -> value added to its logit (OpenAI's logit_bias; -100 bans, +100 nearly forces)
    logit_bias: dict[int, float] | None = None
    # only these token ids may be generated
    allowed_token_ids: list[int] | None = None
    # words that must not be generated (encoded by the engine, with and without a leading space)
    bad_words: list[str] | None = None
    skip_special_tokens: bool = True  # leave special tokens out of the text
    # accepted for vLLM compatibility; the fast tokenizers this engine loads decode the same either way
    spaces_between_special_tokens: bool = True
    # constrained decoding: the output must match a JSON schema, any JSON object, a regex, a choice
    # or a grammar (a StructuredOutput, or a dict of its fields)
    structured_output: StructuredOutput | None = None
    # seconds from submission: a request with no token by then is dropped (its stream raises
    # RequestTimeoutError), one generating then ends with finish_reason "timeout" (None: no limit);
    # with equal priorities, earlier deadlines are admitted first
    timeout: float | None = None
    # False: this request decodes one token per step even where the engine speculates
    # (Config.speculative_config); its output is the same either way
    speculate: bool = True

    def __post_init__(self) -> None:
        self._check_original_fields(_fail)
        self._check_new_fields(_fail)

    def _check_original_fields(self, fail: FieldChecks) -> None:
        for name in ("temperature", "top_p", "min_p"):
            setattr(self, name, fail.finite_float(name, getattr(self, name)))
        if self.temperature < 0:
            fail("temperature", f"must be >= 0 (0 = greedy), got {self.temperature}")
        if self.temperature != 0 and self.temperature < 1e-5:
            fail("temperature", f"must be 0 (greedy) or >= 1e-5, got {self.temperature}")
        if self.temperature > MAX_TEMPERATURE:
            fail("temperature", f"must be at most {MAX_TEMPERATURE:g} (uniform sampling already), "
                                f"got {self.temperature:g}")
        if not (0.0 < self.top_p <= 1.0):
            fail("top_p", f"must be in (0, 1], got {self.top_p}")
        if not (0.0 <= self.min_p <= 1.0):
            fail("min_p", f"must be in [0, 1], got {self.min_p}")
        fail.expect_int("top_k", self.top_k)
        if self.max_tokens is not None:
            fail.expect_int("max_tokens", self.max_tokens)
        if self.top_k == 0 or self.top_k < -1:
            fail("top_k", f"must be -1 (disabled) or >= 1, got {short_repr(self.top_k)}")
        if self.top_k >= 1 << 63:  # the sampler's int64 tensor; any top_k >= the vocabulary means all tokens
            fail("top_k", f"must be < 2**63, got {short_repr(self.top_k)}")
        if self.max_tokens is not None and self.max_tokens < 1:
            fail("max_tokens", f"must be >= 1, got {short_repr(self.max_tokens)}")
        fail.expect_bool("ignore_eos", self.ignore_eos)
        fail.expect_bool("include_stop_str_in_output", self.include_stop_str_in_output)
        if self.seed is not None and not is_int(self.seed):
            fail("seed", f"expected an int or None, got {short_repr(self.seed)}")
        if self.seed is not None and not -(1 << 63) <= self.seed < 1 << 64:  # torch.Generator's range
            fail("seed", f"must be in [-2**63, 2**64), got {short_repr(self.seed)}")
        if not is_int(self.priority):
            fail("priority", f"expected an int (lower is scheduled first), got {short_repr(self.priority)}")
        if self.stop_token_ids is None:  # vLLM's default
            self.stop_token_ids = []
        if is_int(self.stop_token_ids):
            self.stop_token_ids = [self.stop_token_ids]
        if not isinstance(self.stop_token_ids, (list, tuple)) or not all(
                is_int(t) and t >= 0 for t in self.stop_token_ids):
            fail("stop_token_ids", f"expected a list of non-negative ints, got {short_repr(self.stop_token_ids)}")
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            fail("stop_token_ids", f"at most {MAX_STOP_TOKEN_IDS} ids, got {len(self.stop_token_ids)}")
        self.stop_token_ids = list(self.stop_token_ids)
        if self.stop is None:  # vLLM's default
            self.stop = []
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if not isinstance(self.stop, (list, tuple)) or not all(isinstance(s, str) for s in self.stop):
            fail("stop", f"expected a string or a list of strings, got {short_repr(self.stop)}")
        if any(s == "" for s in self.stop):
            fail("stop", "stop strings must not be empty")
        if len(self.stop) > MAX_STOP_STRINGS:
            fail("stop", f"at most {MAX_STOP_STRINGS} stop strings, got {len(self.stop)}")
        longest = max((len(s) for s in self.stop), default=0)
        if longest > MAX_STOP_STRING_CHARS:
            fail("stop", f"a stop string may have at most {MAX_STOP_STRING_CHARS} characters, got one of {longest}")
        self.stop = list(self.stop)
        if isinstance(self.structured_output, dict):
            try:
                self.structured_output = StructuredOutput.coerce(self.structured_output)
            except (TypeError, ValueError) as e:
                fail("structured_output", str(e))
        if self.structured_output is not None and not isinstance(self.structured_output, StructuredOutput):
            fail("structured_output", f"expected a StructuredOutput, a dict of its fields or None, got "
                                      f"{short_repr(self.structured_output)}")

    def _check_new_fields(self, fail: FieldChecks) -> None:
        if not is_int(self.n) or not 1 <= self.n <= MAX_N:
            fail("n", f"expected an int in [1, {MAX_N}], got {short_repr(self.n)}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (not is_int(value) or not 0 <= value <= MAX_LOGPROBS):
                fail(name, f"expected None or an int in [0, {MAX_LOGPROBS}], got {short_repr(value)}")
        for name in ("presence_penalty", "frequency_penalty", "repetition_penalty"):
            setattr(self, name, fail.finite_float(name, getattr(self, name)))
        for name in ("presence_penalty", "frequency_penalty"):
            if not -MAX_PENALTY <= getattr(self, name) <= MAX_PENALTY:
                fail(name, f"must be in [-{MAX_PENALTY}, {MAX_PENALTY}], got {getattr(self, name)}")
        if not 1 / MAX_REPETITION_PENALTY <= self.repetition_penalty <= MAX_REPETITION_PENALTY:
            fail("repetition_penalty", f"must be in [{1 / MAX_REPETITION_PENALTY:g}, {MAX_REPETITION_PENALTY:g}] "
                                       f"(1 = off), got {self.repetition_penalty:g}")
        if not is_int(self.min_tokens) or self.min_tokens < 0:
            fail("min_tokens", f"expected an int >= 0, got {short_repr(self.min_tokens)}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            fail("min_tokens", f"must be <= max_tokens ({self.max_tokens}), got {self.min_tokens}")
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict):
                fail("logit_bias", f"expected a dict of token id -> bias, got {short_repr(self.logit_bias)}")
            if len(self.logit_bias) > MAX_LOGIT_BIAS_ENTRIES:
                fail("logit_bias", f"at most {MAX_LOGIT_BIAS_ENTRIES} entries, got {len(self.logit_bias)}")
            bias = {}
            for token_id, value in self.logit_bias.items():
                if not is_int(token_id) or token_id < 0:
                    fail("logit_bias", f"keys must be token ids (ints >= 0), got {short_repr(token_id)}")
                number = as_finite_float(value)
                if number is None or not -MAX_LOGIT_BIAS <= number <= MAX_LOGIT_BIAS:
                    fail("logit_bias", f"the bias of token {token_id} must be a number in [-{MAX_LOGIT_BIAS:g}, "
                         f"{MAX_LOGIT_BIAS:g}], got {short_repr(value)}")
                bias[token_id] = number
            self.logit_bias = bias or None
        if self.allowed_token_ids is not None:
            if not isinstance(self.allowed_token_ids, (list, tuple)) or not all(
                    is_int(t) and t >= 0 for t in self.allowed_token_ids):
                fail("allowed_token_ids", f"expected a list of token ids (ints >= 0), got "
                     f"{short_repr(self.allowed_token_ids)}")
            if not self.allowed_token_ids:
                fail("allowed_token_ids", "the list is empty: no token could be generated")
            # each once: with the engine's check against the vocabulary, at most one entry per token
            self.allowed_token_ids = list(dict.fromkeys(self.allowed_token_ids))
        if self.bad_words is not None:
            if isinstance(self.bad_words, str):
                self.bad_words = [self.bad_words]
            if not isinstance(self.bad_words, (list, tuple)) or not all(
                    isinstance(w, str) and w.strip() for w in self.bad_words):
                fail("bad_words", f"expected a list of non-blank strings, got {short_repr(self.bad_words)}")
            if len(self.bad_words) > MAX_BAD_WORDS:
                fail("bad_words", f"at most {MAX_BAD_WORDS} words, got {len(self.bad_words)}")
            longest = max((len(w) for w in self.bad_words), default=0)  # [] is none, as vLLM's
            if longest > MAX_STOP_STRING_CHARS:
                fail("bad_words", f"a bad word may have at most {MAX_STOP_STRING_CHARS} characters, got one of {longest}")
            self.bad_words = list(self.bad_words)
        for name in ("skip_special_tokens", "spaces_between_special_tokens", "speculate"):
            fail.expect_bool(name, getattr(self, name))
        if self.timeout is not None:
            self.timeout = fail.positive_seconds("timeout", self.timeout)

    def snapshot(self) -> "SamplingParams":
        """A validated copy that owns its lists: what a request keeps, so that changing these
        params after submission cannot reach the engine thread."""
        # __post_init__ validates again and rebuilds every container (lists, the logit_bias dict); the
        # schema dict too: the caller may change it after submission. Always this class: a subclass's
        # own methods and properties would run on the engine thread.
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(SamplingParams) if f.init}
        return SamplingParams(**{**fields, "structured_output": copy.deepcopy(self.structured_output)})

    @property
    def adjusts_logits(self) -> bool:
        """Whether the sampler changes this request's logits before sampling (penalties, biases, masks)."""
        return (self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1
                or self.min_tokens > 0 or self.logit_bias is not None or self.allowed_token_ids is not None
                or bool(self.bad_words))

    @property
    def uses_penalties(self) -> bool:
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

