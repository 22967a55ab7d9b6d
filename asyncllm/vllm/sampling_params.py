"""vLLM's SamplingParams (vllm.sampling_params): its field names and defaults (max_tokens=16, top_k=0,
stop=None, ...), checked by building asyncllm's SamplingParams from them, which validates every field
the two share; what is vLLM's alone (output_kind, detokenize, truncate_prompt_tokens) is checked here."""
from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Any

from asyncllm.sampling_params import SamplingParams as NativeSamplingParams
from asyncllm.structured import StructuredOutput


class RequestOutputKind(Enum):
    CUMULATIVE = 0  # each RequestOutput holds everything so far
    DELTA = 1  # each holds what is new
    FINAL_ONLY = 2  # one RequestOutput, at the end


@dataclass
class StructuredOutputsParams:
    """Exactly one constraint: json (a schema, dict or text), regex, choice, grammar or json_object."""
    json: str | dict | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    # vLLM's backend options; only their neutral values are accepted (xgrammar is always the backend)
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    whitespace_pattern: str | None = None
    structural_tag: str | None = None

    def __post_init__(self) -> None:
        self.to_native()

    def to_native(self) -> StructuredOutput:
        for name, neutral in (("disable_any_whitespace", False), ("disable_additional_properties", False),
                              ("whitespace_pattern", None), ("structural_tag", None)):
            if getattr(self, name) != neutral:
                raise ValueError(f"StructuredOutputsParams.{name}: not supported (only {neutral!r})")
        return StructuredOutput(json=self.json, json_object=bool(self.json_object), regex=self.regex,
                                choice=self.choice, grammar=self.grammar)


GuidedDecodingParams = StructuredOutputsParams  # its name before vLLM 0.11


@dataclass
class SamplingParams:
    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: every token
    min_p: float = 0.0
    seed: int | None = None  # -1: None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    max_tokens: int | None = 16  # None: up to the context
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    detokenize: bool = True  # False: outputs' text stays ""
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    truncate_prompt_tokens: int | None = None  # keep the prompt's last k tokens (-1: the context's length)
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    structured_outputs: StructuredOutputsParams | None = None
    guided_decoding: StructuredOutputsParams | None = None  # vLLM < 0.11's name of structured_outputs
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    extra_args: dict[str, Any] | None = None  # for custom samplers; nothing here reads it

    def __post_init__(self) -> None:
        def fail(name: str, message: str) -> None:
            raise ValueError(f"SamplingParams.{name}: {message}")

        if not isinstance(self.output_kind, RequestOutputKind):
            fail("output_kind", f"expected a RequestOutputKind, got {self.output_kind!r}")
        if not isinstance(self.detokenize, bool):
            fail("detokenize", f"expected a bool, got {self.detokenize!r}")
        if self.stop and not self.detokenize:
            fail("stop", "stop strings need detokenize=True")
        k = self.truncate_prompt_tokens
        if k is not None and (isinstance(k, bool) or not isinstance(k, int) or (k < 1 and k != -1)):
            fail("truncate_prompt_tokens", f"expected None, -1 or an int >= 1, got {k!r}")
        for name in ("structured_outputs", "guided_decoding"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, StructuredOutputsParams):
                fail(name, f"expected StructuredOutputsParams or None, got {type(value).__name__}")
        if self.structured_outputs is not None and self.guided_decoding is not None:
            fail("guided_decoding", "give structured_outputs or guided_decoding (its older name), not both")
        if self.extra_args is not None and not isinstance(self.extra_args, dict):
            fail("extra_args", f"expected a dict or None, got {type(self.extra_args).__name__}")
        self.to_native()  # checks every field asyncllm's SamplingParams shares

    def to_native(self, priority: int = 0) -> NativeSamplingParams:
        """asyncllm's SamplingParams of these (validated there)."""
        constraint = self.structured_outputs or self.guided_decoding
        return NativeSamplingParams(
            n=self.n, presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
            repetition_penalty=self.repetition_penalty, temperature=self.temperature, top_p=self.top_p,
            top_k=-1 if self.top_k == 0 else self.top_k, min_p=self.min_p, seed=None if self.seed == -1 else self.seed,
            stop=self.stop, stop_token_ids=self.stop_token_ids, bad_words=self.bad_words or None,
            include_stop_str_in_output=self.include_stop_str_in_output, ignore_eos=self.ignore_eos,
            max_tokens=self.max_tokens, min_tokens=self.min_tokens,
            logprobs=1 if self.logprobs is True else self.logprobs,
            prompt_logprobs=1 if self.prompt_logprobs is True else self.prompt_logprobs,
            skip_special_tokens=self.skip_special_tokens,
            spaces_between_special_tokens=self.spaces_between_special_tokens,
            structured_output=None if constraint is None else constraint.to_native(),
            logit_bias=self.logit_bias, allowed_token_ids=self.allowed_token_ids, priority=priority)


@dataclass
class PoolingParams:
    """vLLM's PoolingParams, for LLM.embed: dimensions (keep the first entries, Matryoshka) and
    normalize (None: the model's default, here L2-normalised)."""
    dimensions: int | None = None
    normalize: bool | None = None
