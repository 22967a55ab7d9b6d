"""Token ids to text, incrementally, with stop strings.

Text is released only once it is final: a UTF-8 character split across tokens decodes to U+FFFD
until its last byte arrives, so such text is held back; and text that could be the start of a stop
string is held back until the next tokens decide. The released deltas, concatenated, equal the
final text.
"""
from __future__ import annotations

from asyncllm.sampling_params import SamplingParams

try:
    from tokenizers.decoders import DecodeStream
except ImportError:  # tokenizers < 0.20.4
    DecodeStream = None

# prompt tokens decoded with the first output tokens, so tokenizers that treat the start of a
# string specially (a leading space) decode the output as it reads inside the full text
_CONTEXT_TOKENS = 5


def _decode_stream(tokenizer, context_ids: list[int]):
    """A DecodeStream primed with context_ids that gives exactly what the Python path below gives
    (the same release rule, in Rust), or None where it cannot."""
    backend = getattr(tokenizer, "backend_tokenizer", None)  # fast tokenizers only
    # transformers' decode may clean up spaces after the backend's decode: DecodeStream does not
    if DecodeStream is None or backend is None or getattr(tokenizer, "clean_up_tokenization_spaces", True):
        return None
    # a prompt ending mid-character: DecodeStream would release the context's text with the output
    if context_ids and tokenizer.decode(context_ids, skip_special_tokens=True).endswith("\ufffd"):
        return None
    try:
        return DecodeStream(ids=context_ids, skip_special_tokens=True)
    except TypeError:  # tokenizers < 0.22: no ids= (and no steps of several ids)
        return None


class IncrementalDetokenizer:
    """Releases the text of the tokens added, each character once its last byte has arrived."""

    def __init__(self, tokenizer, prompt_token_ids: list[int], decode_stream: bool = True):
        self.tokenizer = tokenizer
        # the tokens of the text released last (first the context), then those not released yet:
        # the new text is the decode of all of them minus the decode of the first ones
        self.window = list(prompt_token_ids[-_CONTEXT_TOKENS:])
        self.num_released_in_window = len(self.window)
        # False: decode in Python with tokenizer.decode (the reference the Rust path is tested against)
        self._stream = _decode_stream(tokenizer, self.window) if decode_stream else None

    def add(self, new_token_ids: list[int]) -> str:
        """Text made final by these tokens."""
        if not new_token_ids:
            return ""
        self.window.extend(new_token_ids)
        if self._stream is not None:
            try:
                text = self._stream.step(self.tokenizer.backend_tokenizer, new_token_ids)
            except Exception:  # e.g. a decode that does not extend the last one: the Python path copes
                self._stream = None
            else:
                if text is not None:
                    self._next_window()
                return text or ""
        prefix_text, full_text = self._decode_window()
        if len(full_text) > len(prefix_text) and not full_text.endswith("\ufffd"):
            self._next_window()
            return full_text[len(prefix_text):]
        return ""

    def flush(self) -> str:
        """At the end: whatever is still pending, even an incomplete character (as U+FFFD)."""
        prefix_text, full_text = self._decode_window()
        self.window, self.num_released_in_window, self._stream = [], 0, None
        return full_text[len(prefix_text):] if full_text.startswith(prefix_text) else ""

    def _decode_window(self) -> tuple[str, str]:
        decode = self.tokenizer.decode
        return (decode(self.window[:self.num_released_in_window], skip_special_tokens=True),
                decode(self.window, skip_special_tokens=True))

    def _next_window(self) -> None:
        """The tokens not released yet were just released (DecodeStream moves on the same way)."""
        del self.window[:self.num_released_in_window]
        self.num_released_in_window = len(self.window)


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
