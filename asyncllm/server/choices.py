"""OpenAI choice shapes for what a request generated: the per-index choices and their logprobs
(chat: logprobs.content[] with token, logprob, bytes, top_logprobs; completions: tokens,
token_logprobs, top_logprobs, text_offset), whole and as stream chunks."""
from __future__ import annotations

from asyncllm.outputs import TokenLogprob

REASONING_FIELD = "reasoning_content"  # a reasoning parser's output, beside content (text)
MIN_LOGPROB = -9999.0  # JSON has no -Infinity: a token the model gives no chance to is reported at this (vLLM's)


def _logprob(value: float) -> float:
    return max(value, MIN_LOGPROB)


def _chat_token(token: str, raw: bytes, logprob: float) -> dict:
    return {"token": token, "logprob": _logprob(logprob), "bytes": list(raw)}


def chat_logprobs(entries: list[TokenLogprob]) -> dict:
    return {"content": [{**_chat_token(e.token, e.token_bytes, e.logprob),
                         "top_logprobs": [_chat_token(text, raw, lp) for text, raw, (_, lp)
                                          in zip(e.top_tokens, e.top_token_bytes, e.top)]}
                        for e in entries], "refusal": None}


def prompt_logprobs_field(entries: list[TokenLogprob | None] | None) -> list[dict | None] | None:
    """vLLM's prompt_logprobs: None for the first prompt token, then per token a dict from token id (a
    string in JSON) to its logprob, rank and decoded_token: the prompt's own token first, then the top ones."""
    if entries is None:
        return None

    def position(e: TokenLogprob) -> dict:
        out = {str(e.token_id): {"logprob": _logprob(e.logprob), "rank": e.rank, "decoded_token": e.token}}
        for rank, ((token_id, lp), text) in enumerate(zip(e.top, e.top_tokens), start=1):
            out.setdefault(str(token_id), {"logprob": _logprob(lp), "rank": rank, "decoded_token": text})
        return out
    return [None if e is None else position(e) for e in entries]


class CompletionLogprobs:
    """Completions' logprobs of one choice, chunk by chunk: text_offset counts on from chunk to chunk."""

    def __init__(self):
        self.offset = 0

    def shape(self, entries: list[TokenLogprob | None], first_token: str | None = None) -> dict:
        """entries: None for a prompt's first token (echo: it has no logprob), whose text is first_token."""
        tokens, token_logprobs, top_logprobs, text_offset = [], [], [], []
        for e in entries:
            text_offset.append(self.offset)
            if e is None:
                tokens.append(first_token or "")
                token_logprobs.append(None)
                top_logprobs.append(None)
                self.offset += len(first_token or "")
                continue
            tokens.append(e.token)
            token_logprobs.append(_logprob(e.logprob))
            top = {text: _logprob(lp) for text, (_, lp) in zip(e.top_tokens, e.top)}
            top.setdefault(e.token, _logprob(e.logprob))  # the chosen token too, as vLLM and OpenAI list it
            top_logprobs.append(top)
            self.offset += len(e.token)
        return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top_logprobs,
                "text_offset": text_offset}


class ChoiceShaper:
    """One request's choices: whole (choice) or as stream chunks (chunk_choice), by index."""

    def __init__(self, chat: bool, wants_logprobs: bool):
        self.chat = chat
        self.wants_logprobs = wants_logprobs
        self._completion_logprobs: dict[int, CompletionLogprobs] = {}

    def _logprobs(self, index: int, entries: list[TokenLogprob | None] | None,
                  first_token: str | None = None) -> dict | None:
        if not self.wants_logprobs or entries is None:
            return None
        if self.chat:
            return chat_logprobs(entries)
        return self._completion_logprobs.setdefault(index, CompletionLogprobs()).shape(entries, first_token)

    def choice(self, index: int, text: str, finish_reason: str, stop_reason, logprobs,
               reasoning: str | None = None, first_token: str | None = None) -> dict:
        """A whole answer's choice; reasoning: with a reasoning parser, the reasoning (None: no parser);
        first_token: completions' echo with logprobs, the prompt's first token (logprobs[0] is None)."""
        answer = {"message": {"role": "assistant", "content": text}} if self.chat else {"text": text}
        if reasoning is not None:  # as vLLM and SGLang name it; null when the output did not reason
            (answer["message"] if self.chat else answer)[REASONING_FIELD] = reasoning or None
        logprobs = self._logprobs(index, logprobs if logprobs is not None else [], first_token)
        return {"index": index, **answer, "logprobs": logprobs, "finish_reason": finish_reason,
                "stop_reason": stop_reason}

    def chunk_choice(self, index: int, text: str | None, finish_reason: str | None, logprobs=None,
                     delta: dict | None = None, stop_reason=None, reasoning: str | None = None) -> dict:
        """A stream chunk's choice: new text and new reasoning (with their tokens' logprobs), or the finish."""
        choice = {"index": index}
        if self.chat:
            if delta is None:
                delta = {} if text is None or (reasoning and not text) else {"content": text}
            choice["delta"] = {REASONING_FIELD: reasoning, **delta} if reasoning else delta
        else:
            choice["text"] = text or ""
            if reasoning:
                choice[REASONING_FIELD] = reasoning
        choice["logprobs"] = self._logprobs(index, logprobs)
        choice["finish_reason"] = finish_reason
        if finish_reason is not None:
            choice["stop_reason"] = stop_reason
        return choice
