"""Embedding throughput: tokens/s embedded for N texts of L tokens (random token ids), alone and
beside streaming generation.

    python benchmarks/bench_embed.py [--num-texts 1024] [--text-len 512] [--pooling last,mean]
                                     [--streams 32] [--stream-tokens 256] [--json PATH]

Rows (after a warm-up embed and generate, so that no first-call compile is timed):
  sync        LLM.embed of every text in one call (throughput first: no step-time target).
  async       AsyncLLMEngine.embed of every text, alone (its default step-time target, 8 ms).
  streams     --streams greedy streams of --stream-tokens tokens each, alone: their inter-token gaps.
  async+streams  the same embed while the same streams run (each restarted as it ends, all stopped once
              the embed returns): the embedding's tokens/s, and the streams' gaps meanwhile (a step
              with a pooling row runs eagerly, not as a CUDA graph, so decodes that share it are slower).
Each row per --pooling method. The issue's target (issue 50): >= 50,000 tokens/s embedded with the
0.6B shape on one H200 (the sync row, last pooling).
"""
from __future__ import annotations

import random
import statistics
import time

import anyio

from common import (Report, add_engine_args, checkpoint_from_args, engine_kwargs, make_parser, ms, parse_args,
                    percentile, random_prompt, release_memory, timed)

from asyncllm import LLM, AsyncLLMEngine, SamplingParams


def texts(num: int, length: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [random_prompt(rng, length) for _ in range(num)]


def run_sync(model_dir: str, kwargs: dict, prompts, pooling: str, device: str) -> dict:
    llm = LLM(model_dir, **kwargs)
    llm.embed(prompts[:8], pooling=pooling)  # warm-up
    before = llm.core.stats()
    vectors, elapsed = timed(lambda: llm.embed(prompts, pooling=pooling), device)
    after = llm.core.stats()
    assert len(vectors) == len(prompts)
    llm = None  # noqa: F841 - freed before the next engine starts
    release_memory()
    return dict(elapsed_s=elapsed, num_steps=after["num_steps"] - before["num_steps"],
                num_preemptions=after["num_preemptions"] - before["num_preemptions"])


async def _stream(engine: AsyncLLMEngine, prompt, params, gaps: list[float], tokens: list[int],
                  again: bool = False) -> None:
    """One stream of params.max_tokens tokens; again: a new one each time it ends, until cancelled (beside
    the embed, which may outlast one: run AE's 256 tokens ended before the embed began)."""
    while True:
        last = None
        async for out in engine.stream(prompt, params):
            now = time.perf_counter()
            if last is not None:
                gaps.append(now - last)
            last = now
            tokens[0] += len(out.token_ids)
        if not again:
            return


async def run_async(model_dir: str, kwargs: dict, prompts, pooling: str, num_streams: int, stream_tokens: int,
                    seed: int) -> list[dict]:
    """The async, streams and async+streams rows (one engine)."""
    rng = random.Random(seed + 1)
    stream_prompts = [random_prompt(rng, 64) for _ in range(num_streams)]
    params = SamplingParams(temperature=0, max_tokens=stream_tokens, ignore_eos=True)
    rows = []
    async with AsyncLLMEngine(model_dir, **kwargs) as engine:
        await engine.embed(prompts[:8], pooling=pooling)  # warm-up
        await engine.generate(stream_prompts[0], SamplingParams(max_tokens=8))
        start = time.perf_counter()
        await engine.embed(prompts, pooling=pooling)
        rows.append(dict(row="async", elapsed_s=time.perf_counter() - start))
        for with_embed in (False, True) if num_streams else ():
            gaps, tokens = [], [0]
            start = time.perf_counter()
            async with anyio.create_task_group() as tasks:
                for prompt in stream_prompts:
                    tasks.start_soon(_stream, engine, prompt, params, gaps, tokens, with_embed)
                if with_embed:
                    await anyio.sleep(0.5)  # the streams decoding first
                    gaps.clear()
                    tokens[0] = 0
                    embed_start = time.perf_counter()
                    await engine.embed(prompts, pooling=pooling)
                    embed_s = time.perf_counter() - embed_start
                    tasks.cancel_scope.cancel()
            elapsed = time.perf_counter() - start
            row = dict(row="async+streams" if with_embed else "streams",
                       stream_tokens_s=tokens[0] / (embed_s if with_embed else elapsed),
                       itl_median_ms=ms(statistics.median(gaps)) if gaps else None, itl_p99_ms=ms(percentile(gaps, 99)))
            if with_embed:
                row["elapsed_s"] = embed_s
            rows.append(row)
    return rows


def main(argv=None) -> dict:
    parser = make_parser(__doc__)
    add_engine_args(parser)
    parser.add_argument("--num-texts", type=int, default=1024)
    parser.add_argument("--text-len", type=int, default=512, help="tokens per text")
    parser.add_argument("--pooling", default="last", help="comma-separated of last, mean")
    parser.add_argument("--streams", type=int, default=32, help="generation streams beside the async embed (0: none)")
    parser.add_argument("--stream-tokens", type=int, default=256, help="max_tokens of each stream")
    args = parse_args(parser, argv)
    report = Report("embed", args)
    prompts = texts(args.num_texts, args.text_len, args.seed)
    num_tokens = args.num_texts * args.text_len
    with checkpoint_from_args(args) as model_dir:
        kwargs = engine_kwargs(args, args.backend)
        for pooling in args.pooling.split(","):
            base = dict(pooling=pooling, shape=args.shape, num_texts=args.num_texts, text_len=args.text_len)
            try:
                rows = [dict(row="sync", **run_sync(model_dir, kwargs, prompts, pooling, args.device))]
                rows += anyio.run(run_async, model_dir, kwargs, prompts, pooling, args.streams, args.stream_tokens,
                                  args.seed)
            except Exception as exc:  # noqa: BLE001 - reported as the row's error
                report.add(dict(base, error=f"{type(exc).__name__}: {exc}"))
                print(f"{pooling}: FAILED {type(exc).__name__}: {exc}")
                continue
            for row in rows:
                if "elapsed_s" in row:
                    row["embed_tokens_s"] = num_tokens / row["elapsed_s"]
                report.add(dict(base, **row))
    report.finish("Embedding throughput", [
        ("row", "row"), ("pooling", "pooling"), ("texts", "num_texts"), ("tokens each", "text_len"),
        ("embedded tok/s", "embed_tokens_s", "{:,.0f}"), ("streams tok/s", "stream_tokens_s", "{:,.0f}"),
        ("ITL median ms", "itl_median_ms", "{:.2f}"), ("ITL p99 ms", "itl_p99_ms", "{:.2f}")])
    return report.data


if __name__ == "__main__":
    main()
