"""A chat's text as token ids, encoding only what is new (issue 44): the text split at the tokenizer's
added tokens, each piece between them looked up in a cache of piece -> ids, the misses encoded.

A new turn of a conversation sent as messages renders the whole history again; encoding all of it
cost ~50 ms at 36k tokens (the Qwen3 tokenizer), most of a turn's time to first token. The pieces of
the history are the ones the last turn encoded.

Exact: a fast (Rust `tokenizers`) tokenizer first splits a text at its added tokens (leftmost, the
longest at a place), then normalizes, pre-tokenizes and encodes each piece between them on its own
(the normalizer runs per piece; the pre-tokenizers allowed below split each piece alone too), so the
text's ids are the pieces' ids and the added tokens' ids in order. That holds only where an added token
is matched as its plain text: one with lstrip/rstrip (it eats the whitespace beside it), single_word
(matched only between word boundaries) or normalized (matched in the normalized text) breaks it, and
so does a pre-tokenizer that reads where a piece sits in the text (Metaspace's prepend_scheme "first"
prepends "▁" to the text's first piece only), a BPE with dropout (ids that vary per call), a tokenizer
that encodes special-token text as text (split_special_tokens) and a slow (Python) tokenizer, whose
pieces transformers does not encode alike. Such a tokenizer encodes the whole text each time
(`reason` says why).
"""
from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict

# the normalizers and pre-tokenizers that transform a piece by its own text alone
_PIECEWISE_NORMALIZERS = frozenset({"NFC", "NFD", "NFKC", "NFKD", "Lowercase", "Strip", "StripAccents", "Replace",
                                    "Prepend", "Sequence"})
_PIECEWISE_PRE_TOKENIZERS = frozenset({"ByteLevel", "Split", "Digits", "Punctuation", "Whitespace", "WhitespaceSplit",
                                       "UnicodeScripts", "BertPreTokenizer", "CharDelimiterSplit", "Sequence"})
# a turn's few new pieces are encoded one call each: a batch call wakes the Rust library's worker
# threads, ms on a busy host (measured: a new turn over a 36k-token chat, 4 new pieces, the whole
# encode a median 5.8 ms batched, 1.3 ms one by one; Qwen3's tokenizer, 2 busy cores); a first
# turn's hundreds of pieces gain from them
_BATCH_FROM = 16
# ~4 characters a token: ~1M tokens of history held, tens of MB (a list of int objects per piece)
DEFAULT_MAX_CHARS = 4_000_000


def _component_types(component) -> list[tuple[str, dict]]:
    """A normalizer's or pre-tokenizer's parts, each (type name, its JSON), a Sequence's flattened."""
    if component is None:
        return []
    parts, stack = [], [json.loads(component.__getstate__())]
    while stack:
        part = stack.pop()
        parts.append((part.get("type"), part))
        stack.extend(part.get("normalizers") or part.get("pretokenizers") or ())
    return parts


def unsplittable_reason(tokenizer) -> str | None:
    """Why tokenizer's ids of a text are not its pieces' ids (the module's docstring), or None."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or not getattr(tokenizer, "is_fast", False):
        return f"{type(tokenizer).__name__} is not a fast (Rust tokenizers) tokenizer"
    if getattr(tokenizer, "split_special_tokens", False):
        return "split_special_tokens is set: special-token text is encoded as text"
    for token in backend.get_added_tokens_decoder().values():
        for flag in ("lstrip", "rstrip", "single_word", "normalized"):
            if getattr(token, flag):
                return f"added token {token.content!r} has {flag}=True"
    for name, part in _component_types(backend.normalizer):
        if name not in _PIECEWISE_NORMALIZERS:
            return f"normalizer {name} may read more than a piece"
    for name, part in _component_types(backend.pre_tokenizer):
        if name == "Metaspace" and part.get("prepend_scheme", "always") == "always":
            continue
        if name not in _PIECEWISE_PRE_TOKENIZERS:
            return f"pre-tokenizer {name} may read where a piece sits in the text"
    if getattr(backend.model, "dropout", None):
        return "the BPE has dropout: a text's ids vary from call to call"
    return None


class TextPieceEncoder:
    """tokenizer.encode(text, add_special_tokens=False), its pieces between added tokens cached (an LRU
    bounded by their characters). Thread-safe: the cache's reads and writes hold a lock, encoding does
    not (two threads may encode the same piece; both get its ids)."""

    def __init__(self, tokenizer, max_chars: int = DEFAULT_MAX_CHARS):
        self.tokenizer = tokenizer
        self.max_chars = max_chars
        self.reason = unsplittable_reason(tokenizer)  # None: the cache is used
        self._cache: OrderedDict[str, list[int]] = OrderedDict()
        self._cached_chars = 0
        self._lock = threading.Lock()
        added = {} if self.reason else {t.content: i for i, t in tokenizer.backend_tokenizer.get_added_tokens_decoder().items()}
        self._added_ids = added
        # longest first at a place: the tokenizer's leftmost-longest match (a token beats its own prefix)
        alternatives = "|".join(map(re.escape, sorted(added, key=len, reverse=True)))
        self._added_re = re.compile(f"({alternatives})") if added else None

    @property
    def cached_chars(self) -> int:
        return self._cached_chars

    def has_added_token(self, text: str) -> bool:
        """Whether text holds an added token's text (a fallback tokenizer: always, to be safe)."""
        return self._added_re is None or self._added_re.search(text) is not None

    def encode(self, text: str) -> list[int]:
        if self.reason is not None or self._added_re is None:
            return self.tokenizer.encode(text, add_special_tokens=False)
        # [text, token, text, token, ..., text]: odd entries the added tokens
        parts = self._added_re.split(text)
        found: dict[str, list[int]] = {}
        with self._lock:
            for piece in parts[::2]:
                if piece and piece not in found:
                    ids = self._cache.get(piece)
                    if ids is not None:
                        self._cache.move_to_end(piece)
                        found[piece] = ids
        misses = [piece for piece in dict.fromkeys(parts[::2]) if piece and piece not in found]
        if misses:
            if len(misses) > _BATCH_FROM:
                encoded = self.tokenizer(misses, add_special_tokens=False)["input_ids"]
            else:
                encoded = [self.tokenizer.encode(piece, add_special_tokens=False) for piece in misses]
            found.update(zip(misses, encoded))
            self._remember(zip(misses, encoded))
        ids: list[int] = []
        for i, part in enumerate(parts):
            if i % 2:
                ids.append(self._added_ids[part])
            elif part:
                ids.extend(found[part])
        return ids

    def _remember(self, pieces) -> None:
        with self._lock:
            for piece, ids in pieces:
                if len(piece) > self.max_chars or piece in self._cache:
                    continue
                self._cache[piece] = ids
                self._cached_chars += len(piece)
            while self._cached_chars > self.max_chars:
                piece, _ = self._cache.popitem(last=False)
                self._cached_chars -= len(piece)
