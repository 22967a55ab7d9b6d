"""Prompt lookup (n-gram) proposals: the tokens that followed the most recent earlier occurrence (that
a whole draft follows) of the longest suffix of the tokens so far (prompt_lookup_max down to prompt_lookup_min tokens long),
looked up in the prompt and the output. Pays for editing, summarising, code and RAG answers, where
the output copies spans of its context; costs a numpy pass over each row's tokens per step."""
from __future__ import annotations

import numpy as np

from asyncllm.speculative.proposer import DraftRow


def ngram_draft(token_ids: np.ndarray, max_tokens: int, lookup_min: int, lookup_max: int) -> list[int]:
    """The continuation (at most max_tokens) of the most recent earlier match of the longest suffix of
    token_ids that has one, between lookup_min and lookup_max tokens long; [] when none has."""
    length = len(token_ids)
    if length < lookup_min + 1 or max_tokens < 1:
        return []
    # candidate matches end at j < length - 1 (a continuation follows) with the last token equal
    ends = np.flatnonzero(token_ids[:-1] == token_ids[-1])
    if not len(ends):
        return []
    # each candidate's match length, grown one token back at a time while it still matches
    match_len = np.ones(len(ends), dtype=np.int64)
    alive = np.ones(len(ends), dtype=bool)
    for back in range(1, min(lookup_max, length - 1)):
        before = ends - back
        alive &= before >= 0
        alive[alive] = token_ids[before[alive]] == token_ids[length - 1 - back]
        if not alive.any():
            break
        match_len += alive
    best = int(match_len.max())
    if best < lookup_min:
        return []
    # the most recent of the longest matches that a whole draft follows (in a run that repeats, the most
    # recent match of all is followed by a single token), else the earliest (the longest continuation)
    longest = ends[match_len == best]
    whole = longest[longest + max_tokens < length]
    start = int(whole[-1] if len(whole) else longest[0]) + 1
    return token_ids[start:start + max_tokens].tolist()


class NgramProposer:
    """The Proposer of method "ngram" (prompt lookup). Keeps each request's tokens as a numpy array,
    extended by the tokens added since its last proposal: converting a whole 4k-token list every
    step cost as much as the lookup itself."""
    drafts_cost_forwards = False

    def __init__(self, lookup_min: int, lookup_max: int):
        self.lookup_min = lookup_min
        self.lookup_max = lookup_max
        self._tokens: dict[object, tuple[np.ndarray, int]] = {}  # request -> (buffer, tokens in it)

    def propose(self, rows: list[DraftRow]) -> list[list[int]]:
        return [ngram_draft(self._array(row), row.max_tokens, self.lookup_min, self.lookup_max) for row in rows]

    def release(self, request: object) -> None:
        self._tokens.pop(request, None)

    def close(self) -> None:
        pass  # nothing outlives the garbage collector

    def _array(self, row: DraftRow) -> np.ndarray:
        token_ids, length = row.token_ids, len(row.token_ids)
        if row.request is None:
            return np.asarray(token_ids, dtype=np.int64)
        buffer, held = self._tokens.get(row.request, (None, 0))
        if buffer is None or held > length:
            buffer, held = np.empty(max(64, 2 * length), dtype=np.int64), 0
        elif length > len(buffer):
            buffer = np.concatenate([buffer[:held], np.empty(length, dtype=np.int64)])
        buffer[held:length] = token_ids[held:length]
        self._tokens[row.request] = (buffer, length)
        return buffer[:length]
