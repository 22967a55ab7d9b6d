"""How a model marks its reasoning (Config.reasoning_parser): the tags around it, where a request's
output starts (inside a reasoning block or not, read from the end of its prompt), and the gate that
holds a request's grammar back until its reasoning ends.

The engine uses the gate (structured output applies to the answer, as in vLLM and SGLang); the API's
reasoning.py splits a stream's text with the same phase, so both agree on where the answer begins.
"""
from __future__ import annotations

from dataclasses import dataclass

# where a request's output starts
REASONING = "reasoning"  # inside a reasoning block: reasoning until the end tag (a leading start tag is dropped)
MAYBE_REASONING = "maybe_reasoning"  # reasoning only if the output opens with the start tag, else the answer
ANSWER = "answer"  # the answer: the tags, if any, are text

PROMPT_TAIL_TOKENS = 16  # enough for a tag spelled in pieces, and the blank lines after it


@dataclass(frozen=True)
class ReasoningFormat:
    name: str
    start_tag: str
    end_tag: str
    # an output whose prompt opened no block, and that does not open one itself: True = it reasons
    # anyway up to the end tag (DeepSeek-R1 may leave the opening tag out), False = it is the answer
    # (Qwen3 opens every reasoning block, and its non-thinking models never do)
    reasons_without_start_tag: bool


FORMATS = {  # by Config.reasoning_parser (config.REASONING_PARSERS names them)
    "qwen3": ReasoningFormat("qwen3", "<think>", "</think>", reasons_without_start_tag=False),
    "deepseek_r1": ReasoningFormat("deepseek_r1", "<think>", "</think>", reasons_without_start_tag=True),
}


def _single_token(tokenizer, text: str) -> int | None:
    ids = tokenizer.encode(text, add_special_tokens=False)
    return ids[0] if len(ids) == 1 else None


class ReasoningTags:
    """A ReasoningFormat bound to a tokenizer. Where both tags are single tokens (Qwen3's <think> and
    </think>: 151667, 151668), only those tokens count as tags (a tag spelled in pieces is text), and
    token_ids holds them; otherwise (token_ids None) the tags are found in the text, and a grammar
    applies from the first token."""

    def __init__(self, reasoning_format: ReasoningFormat, tokenizer):
        self.format = reasoning_format
        self.start_tag, self.end_tag = reasoning_format.start_tag, reasoning_format.end_tag
        self.tokenizer = tokenizer
        start_id, end_id = _single_token(tokenizer, self.start_tag), _single_token(tokenizer, self.end_tag)
        self.token_ids = (start_id, end_id) if start_id is not None and end_id is not None else None

    @classmethod
    def of(cls, name: str | None, tokenizer) -> "ReasoningTags | None":
        return None if name is None else cls(FORMATS[name], tokenizer)

    def phase(self, prompt_token_ids: list[int], constrained: bool = False) -> str:
        """Where the output of a prompt starts. A chat template that opens the block ends the prompt
        with the start tag (DeepSeek-R1, Qwen3 thinking models); one that turns thinking off ends it
        with an empty block (Qwen3's enable_thinking=False: <think>\\n\\n</think>\\n\\n). Only the end
        of the prompt counts: earlier turns' blocks say nothing about this one. constrained: the
        request has a grammar; without tag tokens nothing holds it back, and what it makes is the answer."""
        if constrained and self.token_ids is None:
            return ANSWER
        tail = self.tokenizer.decode(prompt_token_ids[-PROMPT_TAIL_TOKENS:], skip_special_tokens=False).rstrip()
        if tail.endswith(self.end_tag):
            return ANSWER
        if tail.endswith(self.start_tag) or self.format.reasons_without_start_tag:
            return REASONING
        return MAYBE_REASONING

    def grammar_gate(self, prompt_token_ids: list[int]) -> "ReasoningGate | None":
        """The gate of a constrained request's grammar; None: the grammar applies from the first token."""
        phase = self.phase(prompt_token_ids, constrained=True)
        if phase == ANSWER:
            return None
        state = ReasoningGate.OPTIONAL if phase == MAYBE_REASONING else ReasoningGate.CLOSED
        return ReasoningGate(*self.token_ids, state)


class ReasoningGate:
    """Holds one request's grammar back while its output reasons: the grammar sees the tokens after
    the end tag only. OPTIONAL: the first token may open a block (the start tag is allowed beside the
    grammar's tokens); CLOSED: inside the block, every token is free; OPEN: the grammar applies."""

    OPTIONAL, CLOSED, OPEN = 0, 1, 2
    __slots__ = ("start_id", "end_id", "state")

    def __init__(self, start_id: int, end_id: int, state: int):
        self.start_id, self.end_id, self.state = start_id, end_id, state

    def admits(self, token_id: int) -> bool:
        """Takes the output's next token; True if the grammar must accept it (it is the answer's)."""
        state = self.state
        if state == self.OPEN:
            return True
        if state == self.OPTIONAL:
            if token_id == self.start_id:
                self.state = self.CLOSED
                return False
            self.state = self.OPEN
            return True
        if token_id == self.end_id:
            self.state = self.OPEN
        return False

    @property
    def in_reasoning(self) -> bool:
        """Every token is allowed next."""
        return self.state == self.CLOSED

    @property
    def optional_token(self) -> int | None:
        """The token allowed next beside the grammar's (the start tag, as the output's first token)."""
        return self.start_id if self.state == self.OPTIONAL else None
