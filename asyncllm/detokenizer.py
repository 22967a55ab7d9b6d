"""Token ids to text, incrementally, with stop strings.

Text is released only once it is final: a UTF-8 character split across tokens decodes to U+FFFD
until its last byte arrives, so such text is held back; and text that could be the start of a stop
string is held back until the next tokens decide. The released deltas, concatenated, equal the
final text.
"""
from __future__ import annotations

from asyncllm.sampling_params import SamplingParams

# prompt tokens decoded with the first output tokens, so tokenizers that treat the start of a
# string specially (a leading space) decode the output as it reads inside the full text
_CONTEXT_TOKENS = 5


class IncrementalDetokenizer:
    def __init__(self, tokenizer, prompt_token_ids: list[int]):
        self.tokenizer = tokenizer
        self.token_ids = list(prompt_token_ids[-_CONTEXT_TOKENS:])
        self.num_context_tokens = len(self.token_ids)
        self.prefix_offset = 0
        self.read_offset = len(self.token_ids)

    def _decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=True)

    def add(self, new_token_ids: list[int]) -> str:
        """Text made final by these tokens."""
        self.token_ids.extend(new_token_ids)
        prefix_text = self._decode(self.token_ids[self.prefix_offset:self.read_offset])
        full_text = self._decode(self.token_ids[self.prefix_offset:])
        if len(full_text) > len(prefix_text) and not full_text.endswith("\ufffd"):
            self.prefix_offset = self.read_offset
            self.read_offset = len(self.token_ids)
            return full_text[len(prefix_text):]
        return ""

    def flush(self) -> str:
        """At the end: whatever is still pending, even an incomplete character."""
        prefix_text = self._decode(self.token_ids[self.prefix_offset:self.read_offset])
        full_text = self._decode(self.token_ids[self.prefix_offset:])
        self.prefix_offset = self.read_offset = len(self.token_ids)
        return full_text[len(prefix_text):] if full_text.startswith(prefix_text) else ""


class TextAssembler:
    """One request's text: detokenizes, finds stop strings, decides what can be shown yet."""

    def __init__(self, tokenizer, prompt_token_ids: list[int], params: SamplingParams, incremental: bool = True):
        self.detokenizer = IncrementalDetokenizer(tokenizer, prompt_token_ids)
        # a caller that wants only the final text (and has no stop strings) skips per-step decoding
        self.incremental = incremental or bool(params.stop)
        self._undecoded: list[int] = []
        self.stop = params.stop
        self.include_stop = params.include_stop_str_in_output
        self.max_stop_len = max((len(s) for s in self.stop), default=0)
        self.text = ""  # all final text so far (stop-truncated once a stop is found)
        self.num_released = 0  # chars of self.text already handed out
        self.stopped = False

    def add(self, new_token_ids: list[int]) -> str:
        """Feed tokens; returns the text delta that can be shown. Sets .stopped on a stop string."""
        if self.stopped:
            return ""
        if not self.incremental:
            self._undecoded.extend(new_token_ids)
            return ""
        return self._append(self.detokenizer.add(new_token_ids), final=False)

    def finish(self) -> str:
        """The request ended: release everything still held."""
        if self.stopped:
            return self._release(len(self.text))
        text = self.detokenizer.add(self._undecoded) if self._undecoded else ""
        self._undecoded = []
        return self._append(text + self.detokenizer.flush(), final=True)

    def finish_reason(self, engine_reason: str | None) -> str | None:
        """The request's finish reason: a stop string wins, also one that came with the last token."""
        return "stop" if self.stopped else engine_reason

    def _append(self, new_text: str, final: bool) -> str:
        search_from = max(0, len(self.text) - self.max_stop_len + 1)
        self.text += new_text
        if self.stop:
            hit = self._find_stop(search_from)
            if hit is not None:
                index, stop = hit
                self.text = self.text[:index + len(stop) if self.include_stop else index]
                self.stopped = True
                return self._release(len(self.text))
        if final or not self.stop:
            return self._release(len(self.text))
        return self._release(len(self.text) - self._held_back_len())

    def _find_stop(self, search_from: int) -> tuple[int, str] | None:
        best = None
        for stop in self.stop:
            index = self.text.find(stop, search_from)
            if index != -1 and (best is None or index < best[0]):
                best = (index, stop)
        return best

    def _held_back_len(self) -> int:
        """Length of the longest tail of the text that is a proper prefix of some stop string."""
        for length in range(min(self.max_stop_len - 1, len(self.text)), 0, -1):
            tail = self.text[-length:]
            if any(stop.startswith(tail) for stop in self.stop):
                return length
        return 0

    def _release(self, upto: int) -> str:
        upto = max(upto, self.num_released)
        delta = self.text[self.num_released:upto]
        self.num_released = upto
        return delta
