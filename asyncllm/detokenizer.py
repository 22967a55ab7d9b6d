"""Token ids to text, incrementally, with stop strings.

Text is released only once it is final: a UTF-8 character split across tokens decodes to U+FFFD
until its last byte arrives, so such text is held back; and text that could be the start of a stop
string is held back until the next tokens decide. The released deltas, concatenated, equal the
final text.
"""
from __future__ import annotations

import re
import weakref

from asyncllm.outputs import FinishReason
from asyncllm.sampling_params import SamplingParams

try:
    from tokenizers.decoders import DecodeStream
except ImportError:  # tokenizers < 0.20.4
    DecodeStream = None

# prompt tokens decoded with the first output tokens, so tokenizers that treat the start of a
# string specially (a leading space) decode the output as it reads inside the full text
_CONTEXT_TOKENS = 5


class TokenTexts(dict):
    """A tokenizer's token texts by id, each decoded alone (as logprobs show them) on its first
    lookup: a request with logprobs=5 names six tokens per step, most never read, and decoding the
    whole vocabulary up front was a visible share of LLM.generate's time."""

    def __init__(self, tokenizer):
        super().__init__()
        self._tokenizer = weakref.ref(tokenizer)  # the cache is the tokenizer's: it must not keep it alive
        self._bytes: dict[int, bytes] = {}

    def __missing__(self, token_id: int) -> str:
        text = self[token_id] = _decode_alone(self._tokenizer(), token_id)
        return text

    def bytes_of(self, token_id: int) -> bytes:
        """The token's own bytes (OpenAI's logprobs `bytes`): its text's UTF-8, but for a token that
        holds part of a character (its text alone is U+FFFD) the bytes of that part, which joined
        with its neighbours' make the character."""
        raw = self._bytes.get(token_id)
        if raw is None:
            text = self[token_id]
            raw = text.encode("utf-8")
            if "\ufffd" in text:
                raw = _piece_bytes(self._tokenizer().convert_ids_to_tokens(token_id)) or raw
            self._bytes[token_id] = raw
        return raw


_token_texts: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # tokenizer -> its TokenTexts


def _byte_level_alphabet() -> dict[str, int]:
    """Byte-level BPE's (GPT-2's, Qwen's, Llama 3's) printable stand-in for each byte, to that byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("\u00a1"), ord("\u00ac") + 1),
                 *range(ord("\u00ae"), ord("\u00ff") + 1)]
    others = [b for b in range(256) if b not in printable]
    return {**{chr(b): b for b in printable}, **{chr(256 + i): b for i, b in enumerate(others)}}


_BYTE_OF_CHAR = _byte_level_alphabet()
_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")  # SentencePiece's byte tokens


def _piece_bytes(piece: str | None) -> bytes | None:
    """A vocabulary entry's raw bytes, where its form says them (a byte-level BPE piece, or a
    SentencePiece byte token); None otherwise."""
    if not piece:
        return None
    byte = _BYTE_FALLBACK.fullmatch(piece)
    if byte is not None:
        return bytes([int(byte.group(1), 16)])
    if all(c in _BYTE_OF_CHAR for c in piece):
        return bytes(_BYTE_OF_CHAR[c] for c in piece)
    return None


def decode_logprobs(tokenizer, logprobs) -> None:
    """Give each TokenLogprob its tokenizer's texts (decoded when first read)."""
    texts = _token_texts.get(tokenizer)
    if texts is None:
        texts = _token_texts[tokenizer] = TokenTexts(tokenizer)
    for entry in logprobs:
        entry.set_texts(texts)


def _decode_alone(tokenizer, token_id: int) -> str:
    """One token's text alone: by the Rust backend where transformers would add nothing to it (no
    clean-up of spaces), skipping transformers' Python wrapper."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None and not getattr(tokenizer, "clean_up_tokenization_spaces", True):
        return backend.decode([token_id], skip_special_tokens=False)
    return tokenizer.decode([token_id])


def _decode_stream(tokenizer, context_ids: list[int], skip_special_tokens: bool = True):
    """A DecodeStream primed with context_ids that gives exactly what the Python path below gives
    (the same release rule, in Rust), or None where it cannot."""
    backend = getattr(tokenizer, "backend_tokenizer", None)  # fast tokenizers only
    # transformers' decode may clean up spaces after the backend's decode: DecodeStream does not
    if DecodeStream is None or backend is None or getattr(tokenizer, "clean_up_tokenization_spaces", True):
        return None
    # a prompt ending mid-character: DecodeStream would release the context's text with the output
    if context_ids and tokenizer.decode(context_ids, skip_special_tokens=skip_special_tokens).endswith("\ufffd"):
        return None
    try:
        return DecodeStream(ids=context_ids, skip_special_tokens=skip_special_tokens)
    except TypeError:  # tokenizers < 0.22: no ids= (and no steps of several ids)
        return None


class IncrementalDetokenizer:
    """Releases the text of the tokens added, each character once its last byte has arrived."""

    def __init__(self, tokenizer, prompt_token_ids: list[int], decode_stream: bool = True,
                 skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        # the tokens of the text released last (first the context), then those not released yet:
        # the new text is the decode of all of them minus the decode of the first ones
        self.window = list(prompt_token_ids[-_CONTEXT_TOKENS:])
        self.num_released_in_window = len(self.window)
        # False: decode in Python with tokenizer.decode (the reference the Rust path is tested against)
        self._stream = _decode_stream(tokenizer, self.window, skip_special_tokens) if decode_stream else None
        self._backend = getattr(tokenizer, "backend_tokenizer", None)  # looked up once: add() runs per token

    def add(self, new_token_ids: list[int]) -> str:
        """Text made final by these tokens. (Runs per token of every stream: the Rust path inline.)"""
        if not new_token_ids:
            return ""
        self.window.extend(new_token_ids)
        stream = self._stream
        if stream is not None:
            try:
                # one id as an int: the binding converts it faster than a list
                text = stream.step(self._backend, new_token_ids[0] if len(new_token_ids) == 1 else new_token_ids)
            except Exception:  # e.g. a decode that does not extend the last one: the Python path copes
                self._stream = None
            else:
                if text is None:
                    return ""
                self._next_window()
                return text
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
        decode, skip = self.tokenizer.decode, self.skip_special_tokens
        return (decode(self.window[:self.num_released_in_window], skip_special_tokens=skip),
                decode(self.window, skip_special_tokens=skip))

    def _next_window(self) -> None:
        """The tokens not released yet were just released (DecodeStream moves on the same way)."""
        del self.window[:self.num_released_in_window]
        self.num_released_in_window = len(self.window)


class _StopMatcher:
    """Finds one stop string in text fed piece by piece (Knuth-Morris-Pratt): each read costs time
    linear in the new text (amortized), however long the stop string and the text before.

    .matched is the length of the longest tail of the text so far that is a proper prefix of the stop
    string: what must be held back for it. The failure table is built only as far as the text ever
    matched, so a long stop string that never matches costs nothing to set up."""

    __slots__ = ("stop", "matched", "_borders")

    def __init__(self, stop: str):
        self.stop = stop
        self.matched = 0
        self._borders = [0]  # [i]: length of the longest proper prefix of stop[:i + 1] that is also its suffix

    def skip(self, text: str) -> None:
        """Feed text in which no occurrence counts (under min_tokens), keeping the partial match at its end."""
        while text:
            end = self.feed(text)
            if end == -1:
                return
            # an occurrence that does not count: go on from its longest proper border, as KMP does
            self.matched = self._border(len(self.stop) - 1)
            text = text[end:]

    def feed(self, text: str) -> int:
        """Index in text just past the first occurrence of the stop string that ends in it, or -1."""
        stop, matched = self.stop, self.matched
        if matched and matched + len(text) < len(stop) and stop.startswith(text, matched):
            self.matched += len(text)  # a partial match goes on (one call instead of a loop)
            return -1
        i = 0 if matched else text.find(stop[0])
        while 0 <= i < len(text):
            char = text[i]
            while matched and stop[matched] != char:
                matched = self._border(matched - 1)
            if stop[matched] == char:
                matched += 1
                if matched == len(stop):
                    return i + 1
                i += 1
            else:  # nothing matches: skip to where the stop string could start
                i = text.find(stop[0], i + 1)
        self.matched = matched
        return -1

    def _border(self, i: int) -> int:
        """KMP's failure function at i: where a partial match of i + 1 characters falls back to."""
        borders, stop = self._borders, self.stop
        while len(borders) <= i:
            j, k = len(borders), borders[-1]
            while k and stop[j] != stop[k]:
                k = borders[k - 1]
            borders.append(k + 1 if stop[j] == stop[k] else k)
        return borders[i]


class TextAssembler:
    """One request's text: detokenizes, finds stop strings, decides what can be shown yet."""

    def __init__(self, tokenizer, prompt_token_ids: list[int], params: SamplingParams, incremental: bool = True,
                 detokenizer=None):
        """detokenizer: what turns the tokens into this text (add, flush), if not an IncrementalDetokenizer
        of them (reasoning.ReasoningDetokenizer: the answer's text only, the reasoning kept apart)."""
        self.tokenizer = tokenizer
        self.detokenizer = detokenizer if detokenizer is not None else IncrementalDetokenizer(
            tokenizer, prompt_token_ids, skip_special_tokens=params.skip_special_tokens)
        # a caller that wants only the final text (and has no stop strings) skips per-step decoding
        self.incremental = incremental or bool(params.stop)
        self._undecoded: list[int] = []
        self._matchers = [_StopMatcher(stop) for stop in params.stop]
        self.include_stop = params.include_stop_str_in_output
        # vLLM's rule: a stop string counts only if it ends in a token past the first min_tokens
        self._stop_ignoring_tokens = params.min_tokens if params.stop else 0
        # the final text so far (stop-truncated once a stop is found) is _released + _held; the
        # released part is kept in pieces, so that a read costs nothing per character already out
        self._released: list[str] = []
        self._held = ""  # final text that could be the start of a stop string
        self.num_released = 0  # chars handed out
        self.stopped = False
        self.stop_string: str | None = None  # the stop string that ended the text
        if self.incremental and not self._matchers:
            self.add = self._add_unchecked  # most requests: nothing to hold back, nothing can stop them

    def _add_unchecked(self, new_token_ids: list[int]) -> str:
        """add() for a request without stop strings (nothing held back, nothing to stop it): add()'s
        checks skipped."""
        return self._append(self.detokenizer.add(new_token_ids), final=False)

    @property
    def text(self) -> str:
        """All final text so far (stop-truncated once a stop is found), released or held back."""
        if len(self._released) > 1:
            self._released[:] = ["".join(self._released)]
        return "".join(self._released) + self._held

    def add(self, new_token_ids: list[int]) -> str:
        """Feed tokens; returns the text delta that can be shown. Sets .stopped on a stop string."""
        if self.stopped:
            return ""
        if not self.incremental:
            self._undecoded.extend(new_token_ids)
            return ""
        if self._stop_ignoring_tokens:  # under min_tokens: stop strings ending in these tokens do not count
            ignoring, new_token_ids = new_token_ids[:self._stop_ignoring_tokens], new_token_ids[self._stop_ignoring_tokens:]
            self._stop_ignoring_tokens -= len(ignoring)
            text = self._append(self.detokenizer.add(ignoring), final=False, stops_count=False)
            return text + self._append(self.detokenizer.add(new_token_ids), final=False) if new_token_ids else text
        return self._append(self.detokenizer.add(new_token_ids), final=False)

    def add_counted(self, new_token_ids: list[int]) -> tuple[str, int]:
        """add(), and how many of the tokens belong to the output: all, or those up to the one that
        completed a stop string (a reader that fell behind gets several steps' tokens at once; the
        ones after the stop were never part of the answer)."""
        if len(new_token_ids) < 2 or not self._matchers:
            return self.add(new_token_ids), len(new_token_ids)
        parts = []
        for taken, token_id in enumerate(new_token_ids, 1):
            parts.append(self.add([token_id]))
            if self.stopped:
                return "".join(parts), taken
        return "".join(parts), len(new_token_ids)

    def finish(self) -> str:
        """The request ended: release everything still held."""
        if self.stopped:
            return ""
        text = self.detokenizer.add(self._undecoded) if self._undecoded else ""
        self._undecoded = []
        return self._append(text + self.detokenizer.flush(), final=True, stops_count=not self._stop_ignoring_tokens)

    def finish_reason(self, engine_reason: FinishReason | None) -> FinishReason | None:
        """The request's finish reason: a stop string wins, also one that came with the last token."""
        return FinishReason.STOP if self.stopped else engine_reason

    def _append(self, new_text: str, final: bool, stops_count: bool = True) -> str:
        if not self._matchers:  # no stop strings (most requests): nothing is ever held back
            if new_text:
                self._released.append(new_text)
                self.num_released += len(new_text)
            return new_text
        pending = self._held + new_text
        hold_back = 0
        stop_at = None  # (index in pending, stop string) of the earliest stop string; the first listed on a tie
        for matcher in self._matchers:
            if not stops_count:
                matcher.skip(new_text)
                hold_back = max(hold_back, matcher.matched)
                continue
            end = matcher.feed(new_text)
            if end != -1:
                # it started within what was held back for it, which is in self._held
                index = len(self._held) + end - len(matcher.stop)
                if stop_at is None or index < stop_at[0]:
                    stop_at = (index, matcher.stop)
            hold_back = max(hold_back, matcher.matched)
        if stop_at is not None:
            index, stop = stop_at
            self._held = pending[:index + len(stop) if self.include_stop else index]
            self.stopped = True
            self.stop_string = stop
            return self._release(len(self._held))
        self._held = pending
        return self._release(len(pending) if final else len(pending) - hold_back)

    def _release(self, upto: int) -> str:
        """Hands out self._held[:upto]."""
        delta, self._held = self._held[:upto], self._held[upto:]
        if delta:
            self._released.append(delta)
            self.num_released += len(delta)
        return delta
