"""IncrementalDetokenizer and TextAssembler on real Qwen3 token ids: multibyte characters split
across tokens, special tokens, stop strings spanning token boundaries, held-back text."""
from __future__ import annotations

import random

import pytest

from asyncllm.detokenizer import IncrementalDetokenizer, TextAssembler
from asyncllm.sampling_params import SamplingParams

MULTIBYTE_TEXTS = [
    "你好，世界 🌍🚀 naïve café",
    "Ünïcödé ✓ — “quotes” … 日本語のテキスト 👩‍👩‍👧‍👦 done",
    "🌍🌍🌍 🚀x🚀 Ω≈ç√∫ 한국어 텍스트 ภาษาไทย",
    "plain ascii text, then 中文 and emoji 🎉🎉",
]


@pytest.fixture(scope="module")
def tokenizer(tokenizer_dir):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(tokenizer_dir)


@pytest.fixture(scope="module")
def prompt_ids(tokenizer):
    return tokenizer.encode("User: say something.\nAssistant:")


def chunks(ids: list[int], rng: random.Random | None, max_k: int = 4):
    """ids one at a time (rng None) or in random chunks of 1..max_k (a slow reader gets merged steps)."""
    i = 0
    while i < len(ids):
        k = 1 if rng is None else rng.randint(1, max_k)
        yield ids[i:i + k]
        i += k


def feed(assembler: TextAssembler, pieces) -> list[str]:
    deltas = []
    for piece in pieces:
        deltas.append(assembler.add(piece))
        if assembler.stopped:
            break
    deltas.append(assembler.finish())
    return deltas


def test_texts_really_split_characters_across_tokens(tokenizer):
    # guards the tests below: with these texts some tokens are partial UTF-8 characters
    split = [t for text in MULTIBYTE_TEXTS for t in tokenizer.encode(text) if "\ufffd" in tokenizer.decode([t])]
    assert len(split) >= 3


@pytest.mark.parametrize("text", MULTIBYTE_TEXTS)
def test_token_bytes_join_into_the_texts_utf8(tokenizer, text):
    """TokenTexts.bytes_of (OpenAI's logprobs `bytes`): a token that holds part of a character gives
    that part's bytes, not U+FFFD's, so a text's tokens' bytes joined are its UTF-8; the server's
    chat logprobs carry them."""
    from asyncllm.detokenizer import TokenTexts, decode_logprobs
    from asyncllm.outputs import TokenLogprob
    from asyncllm.server.choices import chat_logprobs
    ids = tokenizer.encode(text)
    texts = TokenTexts(tokenizer)
    assert b"".join(texts.bytes_of(i) for i in ids) == text.encode("utf-8")
    entries = [TokenLogprob(i, -1.0, 1, top_ids=[i], top_logprobs=[-1.0]) for i in ids]
    decode_logprobs(tokenizer, entries)
    content = chat_logprobs(entries)["content"]
    assert bytes(b for c in content for b in c["bytes"]) == text.encode("utf-8")
    assert bytes(b for c in content for b in c["top_logprobs"][0]["bytes"]) == text.encode("utf-8")


def test_sentencepiece_byte_tokens_and_other_pieces():
    from asyncllm.detokenizer import _piece_bytes
    assert _piece_bytes("<0xE6>") == b"\xe6" and _piece_bytes("\u0120hi") == b" hi"
    assert _piece_bytes("\u2581hello") is None and _piece_bytes(None) is None  # the text's UTF-8 then


@pytest.mark.parametrize("text", MULTIBYTE_TEXTS)
@pytest.mark.parametrize("seed", [None, 0, 1, 2])
def test_incremental_detokenizer_multibyte(tokenizer, prompt_ids, text, seed):
    ids = tokenizer.encode(text)
    rng = None if seed is None else random.Random(seed)
    detok = IncrementalDetokenizer(tokenizer, prompt_ids)
    deltas = [detok.add(piece) for piece in chunks(ids, rng)]
    deltas.append(detok.flush())
    assert not any("\ufffd" in d for d in deltas), deltas
    assert "".join(deltas) == tokenizer.decode(ids, skip_special_tokens=True) == text


@pytest.mark.parametrize("seed", [None, 3, 4])
def test_text_assembler_multibyte_and_special_tokens(tokenizer, prompt_ids, seed):
    im_end, im_start = tokenizer.convert_tokens_to_ids(["<|im_end|>", "<|im_start|>"])
    ids = []
    for text in MULTIBYTE_TEXTS:
        ids += tokenizer.encode(text) + [im_end, im_start]
    rng = None if seed is None else random.Random(seed)
    assembler = TextAssembler(tokenizer, prompt_ids, SamplingParams())
    deltas = feed(assembler, chunks(ids, rng))
    assert not any("\ufffd" in d for d in deltas)
    expected = tokenizer.decode(ids, skip_special_tokens=True)
    assert "<|im_end|>" not in expected
    assert "".join(deltas) == expected == assembler.text
    assert not assembler.stopped


def test_first_output_tokens_read_as_inside_the_text(tokenizer):
    # the prompt's last tokens are context: the output's leading space survives
    prompt = tokenizer.encode("Hello")
    ids = tokenizer.encode(" there friend")
    assembler = TextAssembler(tokenizer, prompt, SamplingParams())
    assert "".join(feed(assembler, chunks(ids, None))) == " there friend"


def test_incomplete_character_is_held_until_complete(tokenizer, prompt_ids):
    ids = tokenizer.encode("a 🌍b")
    pieces = [tokenizer.decode([t]) for t in ids]
    assert any("\ufffd" in p for p in pieces)  # the emoji spans several tokens
    detok = IncrementalDetokenizer(tokenizer, prompt_ids)
    released = ""
    for t in ids:
        released += detok.add([t])
        # only whole characters are ever released, and nothing is lost
        assert "a 🌍b".startswith(released)
    released += detok.flush()
    assert released == "a 🌍b"


def test_flush_releases_a_trailing_incomplete_character(tokenizer, prompt_ids):
    ids = tokenizer.encode("ok 🌍")
    cut = next(i for i in range(1, len(ids)) if "\ufffd" in tokenizer.decode(ids[:i]))
    assembler = TextAssembler(tokenizer, prompt_ids, SamplingParams())
    deltas = feed(assembler, chunks(ids[:cut], None))
    # the request ended mid-character: the final text is what a full decode gives
    assert "".join(deltas) == tokenizer.decode(ids[:cut], skip_special_tokens=True)


# ---- DecodeStream (Rust) against the Python decode path ------------------------------------------
def has_decode_stream_with_context() -> bool:
    try:
        from tokenizers.decoders import DecodeStream
        DecodeStream(ids=[], skip_special_tokens=True)
    except (ImportError, TypeError):
        return False
    return True


def detokenize(tokenizer, prompt_ids, ids, pieces_seed: int, decode_stream: bool) -> list[str]:
    detok = IncrementalDetokenizer(tokenizer, prompt_ids, decode_stream=decode_stream)
    assert (detok._stream is not None) == decode_stream
    deltas = [detok.add(piece) for piece in chunks(ids, random.Random(pieces_seed))]
    return deltas + [detok.flush()]


def random_prompt(tokenizer, rng: random.Random) -> list[int]:
    """Random ids whose last ones decode to whole characters (else the Python path is used)."""
    while True:
        prompt = [rng.randrange(len(tokenizer)) for _ in range(rng.randint(1, 8))]
        if not tokenizer.decode(prompt[-5:], skip_special_tokens=True).endswith("\ufffd"):
            return prompt


@pytest.mark.skipif(not has_decode_stream_with_context(), reason="tokenizers < 0.22: no DecodeStream(ids=)")
@pytest.mark.parametrize("seed", range(50))
def test_decode_stream_deltas_match_python_decode(tokenizer, prompt_ids, seed):
    # random ids over the whole vocabulary (byte fragments, special tokens) and scrambled multibyte
    # text: the same deltas, released at the same tokens, as the Python path (today's implementation)
    rng = random.Random(seed)
    vocab = [rng.randrange(len(tokenizer)) for _ in range(rng.randint(1, 40))]
    multibyte = tokenizer.encode(rng.choice(MULTIBYTE_TEXTS))
    start = rng.randrange(len(multibyte))
    scrambled = multibyte[start:] + vocab[:5] + multibyte[:start]
    prompt = prompt_ids if seed % 2 else random_prompt(tokenizer, rng)
    for ids in (vocab, scrambled):
        pieces_seed = rng.randrange(1 << 30)
        rust = detokenize(tokenizer, prompt, ids, pieces_seed, decode_stream=True)
        python = detokenize(tokenizer, prompt, ids, pieces_seed, decode_stream=False)
        assert rust == python


def test_prompt_ending_mid_character_decodes_in_python(tokenizer):
    # DecodeStream primed with an incomplete character would release the prompt's text with the output
    ids = tokenizer.encode("ok 🌍 fine")
    cut = next(i for i in range(1, len(ids)) if tokenizer.decode(ids[:i]).endswith("\ufffd"))
    detok = IncrementalDetokenizer(tokenizer, ids[:cut])
    assert detok._stream is None
    released = "".join(detok.add([t]) for t in ids[cut:]) + detok.flush()
    assert released == " fine"  # the character the prompt started is dropped, as it always was


class TokenizerLike:
    """tokenizer.decode, with only the attributes given."""

    def __init__(self, tokenizer, **attributes):
        self.decode = tokenizer.decode
        self.__dict__.update(attributes)


class DecodeStreamWithoutContext:  # tokenizers 0.20.4 - 0.21: no ids=
    def __init__(self, skip_special_tokens=False):
        pass


@pytest.mark.parametrize("case", ["no DecodeStream", "DecodeStream without ids=", "slow tokenizer",
                                  "cleans up spaces", "fast tokenizer"])
def test_decode_stream_only_where_it_gives_the_same_text(tokenizer, prompt_ids, monkeypatch, case):
    import asyncllm.detokenizer as detokenizer_module
    if case == "no DecodeStream":
        monkeypatch.setattr(detokenizer_module, "DecodeStream", None)
    if case == "DecodeStream without ids=":
        monkeypatch.setattr(detokenizer_module, "DecodeStream", DecodeStreamWithoutContext)
    backend = {"backend_tokenizer": tokenizer.backend_tokenizer}
    tok = {"slow tokenizer": TokenizerLike(tokenizer),
           "cleans up spaces": TokenizerLike(tokenizer, clean_up_tokenization_spaces=True, **backend),
           "fast tokenizer": TokenizerLike(tokenizer, clean_up_tokenization_spaces=False, **backend),
           }.get(case, tokenizer)
    detok = IncrementalDetokenizer(tok, prompt_ids)
    assert (detok._stream is not None) == (case == "fast tokenizer" and has_decode_stream_with_context())
    text = MULTIBYTE_TEXTS[1]
    assert "".join(detok.add([t]) for t in tokenizer.encode(text)) + detok.flush() == text


@pytest.mark.skipif(not has_decode_stream_with_context(), reason="tokenizers < 0.22: no DecodeStream(ids=)")
def test_decode_stream_error_mid_request_goes_on_in_python(tokenizer, prompt_ids, monkeypatch):
    import asyncllm.detokenizer as detokenizer_module
    from tokenizers.decoders import DecodeStream

    class DecodeStreamFailingAtStep4:  # as DecodeStream's InvalidPrefix error would
        def __init__(self, ids=None, skip_special_tokens=False):
            self.stream, self.steps = DecodeStream(ids=ids, skip_special_tokens=skip_special_tokens), 0

        def step(self, backend, ids):
            self.steps += 1
            if self.steps == 4:
                raise Exception("decode stream error")
            return self.stream.step(backend, ids)

    monkeypatch.setattr(detokenizer_module, "DecodeStream", DecodeStreamFailingAtStep4)
    text = MULTIBYTE_TEXTS[2]
    detok = IncrementalDetokenizer(tokenizer, prompt_ids)
    deltas = [detok.add([t]) for t in tokenizer.encode(text)]
    assert detok._stream is None
    assert "".join(deltas) + detok.flush() == text
    assert not any("\ufffd" in d for d in deltas)


# ---- stop strings ---------------------------------------------------------------------------------
FOX = "The quick brown fox jumps over the lazy dog"


def assemble(tokenizer, prompt_ids, text, seed=None, **params):
    assembler = TextAssembler(tokenizer, prompt_ids, SamplingParams(**params))
    rng = None if seed is None else random.Random(seed)
    deltas = feed(assembler, chunks(tokenizer.encode(text), rng))
    return assembler, deltas


@pytest.mark.parametrize("seed", [None, 0, 1])
@pytest.mark.parametrize("include", [False, True])
def test_stop_string_spanning_tokens(tokenizer, prompt_ids, seed, include):
    stop = "brown fox ju"
    ids = tokenizer.encode(FOX)
    assert not any(stop in tokenizer.decode([t]) for t in ids)  # it really spans tokens
    assembler, deltas = assemble(tokenizer, prompt_ids, FOX, seed, stop=[stop], include_stop_str_in_output=include)
    expected = "The quick brown fox ju" if include else "The quick "
    assert assembler.stopped
    assert "".join(deltas) == assembler.text == expected
    assert assembler.add(tokenizer.encode(" more")) == "" and assembler.finish() == ""


def test_text_before_a_stop_string_is_released_before_it_completes(tokenizer, prompt_ids):
    assembler = TextAssembler(tokenizer, prompt_ids, SamplingParams(stop=["jumps"]))
    released = ""
    for t in tokenizer.encode(FOX):
        released += assembler.add([t])
        if assembler.stopped:
            break
        # everything but a possible start of "jumps" is out already
        assert released in ("The", "The quick", "The quick brown", "The quick brown fox")
    assert assembler.stopped and released == "The quick brown fox "


def test_held_back_prefix_released_when_not_a_stop(tokenizer, prompt_ids):
    hello, there = tokenizer.encode("Hello there")
    assembler = TextAssembler(tokenizer, prompt_ids, SamplingParams(stop=["Hello world"]))
    assert assembler.add([hello]) == ""  # "Hello" could start "Hello world": held
    assert assembler.add([there]) == "Hello there"  # it did not: released before the end
    assert not assembler.stopped
    assert assembler.finish() == ""
    assert assembler.text == "Hello there"


def test_partial_stop_match_held_back_until_finish(tokenizer, prompt_ids):
    assembler, deltas = assemble(tokenizer, prompt_ids, "Say Hello wor", stop=["Hello world"])
    assert not assembler.stopped
    assert deltas[-1] == "Hello wor"  # held to the end, then released: it never became the stop string
    assert "".join(deltas) == "Say Hello wor"


def test_held_back_prefix_that_becomes_the_stop_is_never_released(tokenizer, prompt_ids):
    assembler, deltas = assemble(tokenizer, prompt_ids, "Say Hello world again", stop=["Hello world"])
    assert assembler.stopped
    assert "".join(deltas) == "Say "


@pytest.mark.parametrize("seed", [None, 0, 5])
def test_multiple_stop_strings_earliest_wins(tokenizer, prompt_ids, seed):
    assembler, deltas = assemble(tokenizer, prompt_ids, FOX, seed, stop=["lazy", "fox", "quick"])
    assert "".join(deltas) == "The "
    # all at once: both stops are in the one chunk; the earlier one in the text wins
    assembler = TextAssembler(tokenizer, prompt_ids, SamplingParams(stop=["dog", "over", "brown"]))
    assert assembler.add(tokenizer.encode(FOX)) + assembler.finish() == "The quick "
    # two stops completed by the same token: the one starting earlier wins
    assembler, deltas = assemble(tokenizer, prompt_ids, FOX, seed, stop=["fox", "brown fox"],
                                 include_stop_str_in_output=True)
    assert "".join(deltas) == "The quick brown fox"
    # two stops starting at the same place, both complete in one read: the first listed wins
    for stops, expected in ((["brown fox", "brown"], "The quick brown fox"), (["brown", "brown fox"], "The quick brown")):
        assembler = TextAssembler(tokenizer, prompt_ids, SamplingParams(stop=stops, include_stop_str_in_output=True))
        assert assembler.add(tokenizer.encode(FOX)) == expected


@pytest.mark.parametrize("seed", [None, 0, 1, 2])
def test_multibyte_stop_string(tokenizer, prompt_ids, seed):
    text = MULTIBYTE_TEXTS[0]
    assembler, deltas = assemble(tokenizer, prompt_ids, text, seed, stop=["🌍🚀"])
    assert not any("\ufffd" in d for d in deltas)
    assert "".join(deltas) == "你好，世界 "
    # the stop string's first character is split across tokens; a delta ends right before it
    assembler, deltas = assemble(tokenizer, prompt_ids, text, seed, stop=["🌍"], include_stop_str_in_output=True)
    assert "".join(deltas) == "你好，世界 🌍"


@pytest.mark.parametrize("seed", range(6))
def test_stop_strings_random_chunks_match_reference(tokenizer, prompt_ids, seed):
    # concatenated deltas == the full text cut at the first stop string, however tokens arrive
    rng = random.Random(seed)
    text = " ".join(MULTIBYTE_TEXTS + [FOX])
    ids = tokenizer.encode(text)
    start = rng.randrange(0, len(text) - 8)
    stop = text[start:start + rng.randint(2, 6)]
    index = text.find(stop)
    include = rng.random() < 0.5
    assembler = TextAssembler(tokenizer, prompt_ids, SamplingParams(stop=[stop], include_stop_str_in_output=include))
    deltas = feed(assembler, chunks(ids, rng, max_k=6))
    assert assembler.stopped
    assert "".join(deltas) == text[:index + len(stop) if include else index]


def reference_release(text: str, stops: list[str], include: bool) -> str:
    """What may be shown of text: cut at the earliest stop string (the first listed on a tie), else
    all but the longest tail that is a proper prefix of a stop string (today's brute force)."""
    hits = [(text.find(stop), i) for i, stop in enumerate(stops) if stop in text]
    if hits:
        index, i = min(hits)
        return text[:index + len(stops[i]) if include else index]
    hold = max((n for stop in stops for n in range(1, len(stop)) if text.endswith(stop[:n])), default=0)
    return text[:len(text) - hold]


@pytest.mark.parametrize("seed", range(60))
def test_stop_strings_released_text_matches_brute_force_at_every_read(tokenizer, prompt_ids, seed):
    # a tiny alphabet makes stop strings overlap themselves and each other, and partial matches that
    # run long and then break (the failure table's cases)
    rng = random.Random(seed)
    alphabet = rng.choice(["ab", "abc", "a b", "ab\n🌍"])
    text = "".join(rng.choice(alphabet) for _ in range(rng.randint(20, 120)))
    stops = ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 12))) for _ in range(rng.randint(1, 5))]
    stops += [text[i:i + rng.randint(2, 30)] + "x" for i in rng.sample(range(len(text)), 2)]  # long, never whole
    include = rng.random() < 0.5
    ids = tokenizer.encode(text)
    assembler = TextAssembler(tokenizer, prompt_ids, SamplingParams(stop=stops, include_stop_str_in_output=include))
    released, fed = "", 0
    for piece in chunks(ids, rng if seed % 2 else None):
        released += assembler.add(piece)
        fed += len(piece)
        so_far = tokenizer.decode(ids[:fed])
        if not so_far.endswith("\ufffd"):
            assert released == reference_release(so_far, stops, include)
        if assembler.stopped:
            break
    released += assembler.finish()
    assert released == assembler.text
    assert assembler.stopped == any(stop in text for stop in stops)
    assert released == (reference_release(text, stops, include) if assembler.stopped else text)


# ---- min_tokens holds off stop strings (vLLM's rule) ---------------------------------------------
def reference_min_tokens_stop(tokenizer, ids: list[int], stop: str, min_tokens: int) -> str | None:
    """The text up to the first occurrence of stop that ends past the first min_tokens tokens' text
    (vLLM checks stop strings only once more than min_tokens tokens are out), or None."""
    text, protected = tokenizer.decode(ids), len(tokenizer.decode(ids[:min_tokens]))
    start = text.find(stop)
    while start != -1 and start + len(stop) <= protected:
        start = text.find(stop, start + 1)
    return None if start == -1 else text[:start]


@pytest.mark.parametrize("seed", [None, 0, 1, 2])
@pytest.mark.parametrize("stop, min_tokens", [("o", 0), ("o", 3), ("o", 6), ("the", 7), ("dog", 9), ("dog", 10),
                                              ("fox jumps", 4), ("fox jumps", 5)])
def test_min_tokens_holds_off_stop_strings(tokenizer, prompt_ids, seed, stop, min_tokens):
    ids = tokenizer.encode(FOX)
    assert len(ids) == 9 and tokenizer.decode(ids) == FOX
    assembler, deltas = assemble(tokenizer, prompt_ids, FOX, seed, stop=[stop], min_tokens=min_tokens, max_tokens=16)
    expected = reference_min_tokens_stop(tokenizer, ids, stop, min_tokens)
    assert assembler.stopped == (expected is not None)
    assert "".join(deltas) == assembler.text == (FOX if expected is None else expected)


def test_min_tokens_stop_string_overlapping_itself(tokenizer, prompt_ids):
    # "a a" occurs at every other character: one ending inside the first tokens is skipped, the next counts
    text = "a a a a a a a a"
    ids = tokenizer.encode(text)
    for min_tokens in range(len(ids)):
        for seed in (None, 3):
            assembler, deltas = assemble(tokenizer, prompt_ids, text, seed, stop=["a a"], min_tokens=min_tokens)
            expected = reference_min_tokens_stop(tokenizer, ids, "a a", min_tokens)
            assert "".join(deltas) == (text if expected is None else expected), (min_tokens, seed)


def test_without_min_tokens_a_stop_string_in_the_first_tokens_ends_it(tokenizer, prompt_ids):
    # the behaviour before: the same request without min_tokens stops at the first "o"
    assembler, deltas = assemble(tokenizer, prompt_ids, FOX, stop=["o"])
    assert assembler.stopped and "".join(deltas) == "The quick br"


@pytest.mark.parametrize("clean_up_spaces", [False, True], ids=["rust", "transformers"])
def test_logprob_token_texts_are_each_token_decoded_alone(tokenizer, clean_up_spaces):
    """The cached texts of logprobs entries equal tokenizer.decode([id]), through the Rust batch
    decode and through transformers' (which cleans up spaces, so ' .' reads '.'), misses and hits."""
    from asyncllm.detokenizer import _token_texts, decode_logprobs
    from asyncllm.outputs import TokenLogprob

    _token_texts.pop(tokenizer, None)
    tokenizer.clean_up_tokenization_spaces = clean_up_spaces
    try:
        ids = tokenizer.encode("Hello , world . ¿Qué tal? 日本語 <|im_end|>") + [tokenizer.eos_token_id]
        for _ in range(2):  # the second pass reads only the cache
            entries = [TokenLogprob(t, -1.0, 1, ids[::-1], [-2.0] * len(ids)) for t in ids]
            decode_logprobs(tokenizer, entries)
            for entry in entries:
                assert entry.token == tokenizer.decode([entry.token_id])
                assert entry.top_tokens == [tokenizer.decode([u]) for u, _ in entry.top]
    finally:
        tokenizer.clean_up_tokenization_spaces = False
        _token_texts.pop(tokenizer, None)


def test_token_logprob_reads_its_alternatives_from_array_rows_and_compares_by_value():
    import numpy as np

    from asyncllm.outputs import TokenLogprob

    ids, logprobs = np.array([[7, 3, 9], [1, 2, 4]]), np.array([[-0.5, -1.5, -2.5], [-0.1, -0.2, -0.3]],
                                                                dtype=np.float32)
    entry = TokenLogprob(7, -0.5, 1, ids[0, :2], logprobs[0, :2])
    assert entry.top == [(7, -0.5), (3, -1.5)] and all(type(t) is int and type(lp) is float for t, lp in entry.top)
    assert entry.top_tokens is None and entry.token is None
    entry.set_texts({7: "a", 3: "b"})
    assert entry.token == "a" and entry.top_tokens == ["a", "b"]
    same = TokenLogprob(7, -0.5, 1, [7, 3], [-0.5, -1.5])
    same.set_texts({7: "a", 3: "b"})
    assert entry == same and entry != TokenLogprob(7, -0.5, 2, [7, 3], [-0.5, -1.5])
    assert "top=[(7, -0.5), (3, -1.5)]" in repr(entry)
