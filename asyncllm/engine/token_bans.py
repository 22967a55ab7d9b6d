"""The tokens a request bans (its bad words; below min_tokens its stop ids and EOS), and the check that
its constraints leave some token to sample."""
from __future__ import annotations

from asyncllm.errors import InvalidValueError
from asyncllm.sampling_params import SamplingParams


def encode_bad_words(tokenizer, words: list[str]) -> list[list[int]]:
    """Each word's token ids, as it reads at the start of a text and after a space. vLLM keeps the
    second form only where it has as many tokens as the first and starts otherwise; here both are
    banned whenever they differ (a word that splits differently after a space is still banned)."""
    encoded = []
    for word in words:
        for text in (word.lstrip(), " " + word.lstrip()):
            ids = tokenizer.encode(text, add_special_tokens=False)
            if ids and ids not in encoded:
                encoded.append(ids)
    return encoded


def check_some_token_samplable(params: SamplingParams, vocab_size: int, eos_token_ids: set[int], tokenizer) -> None:
    """Refuse constraints that ban every token the request may sample (allowed_token_ids, or the whole
    vocabulary, minus the one-token bad words, and below min_tokens its stop ids and EOS too): the
    sampler would take token 0 from a row of -inf logits and say nothing. Multi-token bad words only
    ban a token after their other tokens, so they are left out. Token ids are checked already."""
    allowed = None if params.allowed_token_ids is None else set(params.allowed_token_ids)
    early = params.min_tokens > 0
    stop_ids = set(params.stop_token_ids) if early else set()
    eos_ids = set(eos_token_ids) - stop_ids if early and not params.ignore_eos else set()
    if allowed is None and len(stop_ids) + len(eos_ids) + 2 * len(params.bad_words or ()) < vocab_size:
        return  # cannot cover the vocabulary (a bad word bans at most one token in each of its two forms)
    bad_ids = {ids[0] for ids in encode_bad_words(tokenizer, params.bad_words or []) if len(ids) == 1}
    banned = bad_ids | stop_ids | eos_ids
    if (allowed - banned) if allowed is not None else len(banned) < vocab_size:
        return
    relevant = allowed if allowed is not None else banned
    causes = [(name, why) for name, ids, why in (
        ("bad_words", bad_ids, "bad_words"), ("stop_token_ids", stop_ids, "stop_token_ids below min_tokens"),
        ("ignore_eos", eos_ids, "EOS below min_tokens")) if ids & relevant]
    fields = ["allowed_token_ids"] * (allowed is not None) + [name for name, _ in causes] + \
        ["min_tokens"] * any(name != "bad_words" for name, _ in causes)
    what = "every token of allowed_token_ids" if allowed is not None else "every token of the vocabulary"
    # the argument: every field that takes part
    raise InvalidValueError(", ".join(fields), f"{what} is banned by {' and '.join(why for _, why in causes)}: "
                                               "no token could be sampled", "SamplingParams")
