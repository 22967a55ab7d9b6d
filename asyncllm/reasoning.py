"""Reasoning apart from the answer (Config.reasoning_parser): each sequence's output split, as it
streams, into its reasoning (StreamOutput.reasoning, RequestResult.reasoning, the "reasoning" of
LLM.generate's dicts; the server's reasoning_content) and its answer (the text), which alone is
searched for stop strings.

Where the tags are single tokens (Qwen3's, DeepSeek-R1's) the split falls between tokens: the ids
are cut at the tag token, each side decoded by the same incremental detokenizer, and the tag's own
text dropped. Elsewhere the tags are found in the decoded text, and a tail that may be the start of
a tag is held back until the next text settles it. Either way the split does not depend on how the
tokens arrive (one by one, or many steps at once): a streamed answer has the same reasoning and text
as the whole one.
"""
from __future__ import annotations

from asyncllm.detokenizer import IncrementalDetokenizer, TextAssembler
from asyncllm.engine.reasoning_format import ANSWER, REASONING, ReasoningTags
from asyncllm.sampling_params import SamplingParams


def text_assembler(tokenizer, reasoning: ReasoningTags | None, prompt_token_ids: list[int], params: SamplingParams,
                   incremental: bool = True) -> TextAssembler:
    """A sequence's TextAssembler; with reasoning tags, its text is the answer's and its detokenizer
    a ReasoningDetokenizer, which holds the reasoning."""
    detokenizer = None
    if reasoning is not None:
        tokens = IncrementalDetokenizer(tokenizer, prompt_token_ids, skip_special_tokens=params.skip_special_tokens)
        phase = reasoning.phase(prompt_token_ids, constrained=params.structured_output is not None)
        detokenizer = ReasoningDetokenizer(reasoning, tokens, phase)
    return TextAssembler(tokenizer, prompt_token_ids, params, incremental=incremental, detokenizer=detokenizer)


def _partial_tag_length(text: str, tag: str) -> int:
    """The length of the longest tail of text that is a proper start of tag."""
    for length in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:length]):
            return length
    return 0


class ReasoningDetokenizer:
    """An incremental detokenizer (add, flush) that gives the answer's text; the reasoning's text
    collects apart (take() what is new, .text all of it)."""

    def __init__(self, tags: ReasoningTags, detokenizer: IncrementalDetokenizer, phase: str):
        self.tags = tags
        self._detokenizer = detokenizer
        # the output's start may still turn out to be the start tag (dropped, and the output reasons)
        self._opening = phase != ANSWER
        # where the text goes (after the opening): the prompt's phase, until a tag says otherwise
        self._in_reasoning = phase == REASONING
        self._held = ""  # text matching: a tail that may be the start of a tag
        self._parts: list[str] = []  # the reasoning's text so far, in pieces
        self._new: list[str] = []  # the pieces not taken yet

    @property
    def text(self) -> str:
        """The reasoning so far (a held tail excluded, until the end releases it)."""
        if len(self._parts) > 1:
            self._parts[:] = ["".join(self._parts)]
        return self._parts[0] if self._parts else ""

    def take(self) -> str:
        """The reasoning's text released since the last take."""
        new, self._new = self._new, []
        return "".join(new)

    def _reason(self, text: str) -> None:
        if text:
            self._parts.append(text)
            self._new.append(text)

    def add(self, new_token_ids: list[int]) -> str:
        """The answer's text made final by these tokens."""
        if not new_token_ids:
            return ""
        if self.tags.token_ids is None:
            return self._split_text(self._detokenizer.add(new_token_ids), final=False)
        start_id, end_id = self.tags.token_ids
        token_ids = new_token_ids
        if self._opening:
            self._opening = False
            if token_ids[0] == start_id:
                self._in_reasoning = True
                self._reason(self._detokenizer.add(token_ids[:1]).removesuffix(self.tags.start_tag))
                token_ids = token_ids[1:]
        if self._in_reasoning:
            try:
                end = token_ids.index(end_id)
            except ValueError:
                self._reason(self._detokenizer.add(token_ids))
                return ""
            # the ids up to the tag decode to the text before it and the tag's own (none where it is
            # a special token that is skipped)
            self._reason(self._detokenizer.add(token_ids[:end + 1]).removesuffix(self.tags.end_tag))
            self._in_reasoning = False
            token_ids = token_ids[end + 1:]
        return self._detokenizer.add(token_ids)

    def flush(self) -> str:
        """At the end: the answer's text still pending (the reasoning's goes to it apart)."""
        text = self._detokenizer.flush()
        if self.tags.token_ids is None:
            return self._split_text(text, final=True)
        if self._in_reasoning:
            self._reason(text)
            return ""
        return text

    def _split_text(self, text: str, final: bool) -> str:
        """Matching the tags in the text: the answer's part of the held tail + text; at the end
        (final) nothing is held."""
        pending, self._held = self._held + text, ""
        start_tag, end_tag = self.tags.start_tag, self.tags.end_tag
        while pending:
            if self._opening:
                if pending.startswith(start_tag):
                    self._opening, self._in_reasoning = False, True
                    pending = pending[len(start_tag):]
                elif start_tag.startswith(pending) and not final:
                    self._held = pending
                    return ""
                else:
                    self._opening = False
            elif self._in_reasoning:
                end = pending.find(end_tag)
                if end == -1:
                    keep = 0 if final else _partial_tag_length(pending, end_tag)
                    self._reason(pending[:len(pending) - keep])
                    self._held = pending[len(pending) - keep:]
                    return ""
                self._reason(pending[:end])
                self._in_reasoning = False
                pending = pending[end + len(end_tag):]
            else:
                return pending
        return ""
