"""Multi-turn chat and long context through AsyncLLMEngine.stream (issue 44).

    python benchmarks/bench_multiturn.py [--cases chat,rag,cached] [--users 8,64] [--turns 20]
        [--user-tokens 1024,4096] [--answer-tokens 64,256] [--max-context 32768] [--backends triton,fa4]

Random token-id prompts (--seed; no tokenizer needed), temperature 0.6, EOS ignored, after
--warmup-requests short requests (so that no Triton JIT compile is timed). Every case runs in one
engine per backend, with max_model_len the longest context a case needs.

chat: for each --users level, that many conversations at once, each of --turns turns streamed one
after the other. A turn's prompt is the conversation so far (the previous prompt + the answer's
token ids) + user-tokens new random ids (uniform in the range), and it asks for answer-tokens
tokens (uniform); a conversation ends early when a turn would pass --max-context. So the prefix
cache can serve each turn's history. Per turn index: conversations, mean prompt tokens, TTFT and
ITL p50/p99 (ITL: every gap between stream items with tokens), prefix-cache hit rate (prompt
tokens the cache served / prompt tokens, from each request's metrics); per level: output tok/s
(all answer tokens / wall time), the hit rate, preemptions.

rag: one --rag-doc-tokens document, then --rag-questions questions (document + 16..64 new ids, each
answered with --rag-answer-tokens tokens): the first alone (the document not yet cached), the rest
by --rag-concurrency closed-loop clients.

cached: one --cached-tokens prompt (its TTFT: the uncached prefill), then --reps times the same
prompt + --new-tokens new ids: TTFT with the prefix cached (issue 44's "32k tokens cached + 64
new tokens" row), and the ITL p50 of its --decode-tokens answer tokens (batch-1 decode at that
context). The cache keeps whole KV blocks: a multiple of kvcache_block_size (256) is cached whole.
"""
from __future__ import annotations

import asyncio
import random
import time

from common import (Report, add_engine_args, checkpoint_from_args, engine_kwargs, format_table, make_parser, median, ms,
                    parse_args, percentile, random_prompt, release_memory, stream_timings, warmup_requests)
from load_clients import drive

from asyncllm import AsyncLLMEngine, SamplingParams

CASES = ("chat", "rag", "cached")
RAG_QUESTION_TOKENS = (16, 64)


def token_range(text: str, option: str) -> tuple[int, int]:
    """'64,256' -> (64, 256); '128' -> (128, 128)."""
    try:
        values = [int(v) for v in text.split(",")]
    except ValueError:
        raise SystemExit(f"{option}: expected N or MIN,MAX token counts, got {text!r}") from None
    if len(values) not in (1, 2) or min(values) < 1 or values[0] > values[-1]:
        raise SystemExit(f"{option}: expected N or MIN,MAX with 1 <= MIN <= MAX, got {text!r}")
    return values[0], values[-1]


def params(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=max_tokens)


def hit_rate(results: list[dict]) -> float | None:
    prompt = sum(r["prompt_tokens"] for r in results)
    return sum(r["cached_tokens"] or 0 for r in results) / prompt if prompt else None


def latency_fields(results: list[dict]) -> dict:
    """TTFT and ITL p50/p99 (ms) of results, ITL pooled."""
    row = {}
    for name, values in (("ttft", [r["ttft"] for r in results if r["ttft"] is not None]),
                         ("itl", [g for r in results for g in r["itl"]])):
        for q in (50, 99):
            row[f"{name}_p{q}_ms"] = ms(percentile(values, q))
    return row


# ---- chat ---------------------------------------------------------------------------------------------------
async def conversation(engine: AsyncLLMEngine, args, rng: random.Random) -> list[dict]:
    """One user's turns, one after the other; each turn's result gets its turn index."""
    history: list[int] = []
    results = []
    for turn in range(args.turns):
        prompt = history + random_prompt(rng, rng.randint(*args.user_tokens))
        answer = rng.randint(*args.answer_tokens)
        if len(prompt) + answer > args.max_context:
            break
        result = await stream_timings(engine, prompt, params(answer))
        results.append(dict(result, turn=turn))
        history = prompt + result["token_ids"]
    return results


async def run_chat(engine: AsyncLLMEngine, args, backend: str, report: Report) -> None:
    for users in args.users:
        rngs = [random.Random(args.seed * 1_000_003 + users * 1009 + user) for user in range(users)]
        before = engine.stats()
        start = time.perf_counter()
        conversations = await asyncio.gather(*(conversation(engine, args, rng) for rng in rngs))
        wall = time.perf_counter() - start
        await engine.wait_idle()
        after = engine.stats()
        results = [r for turns in conversations for r in turns]
        for turn in sorted({r["turn"] for r in results}):
            at_turn = [r for r in results if r["turn"] == turn]
            report.data["turns"].append(dict(
                backend=backend, users=users, turn=turn, conversations=len(at_turn),
                prompt_tokens_mean=sum(r["prompt_tokens"] for r in at_turn) / len(at_turn),
                prefix_hit_rate=hit_rate(at_turn), **latency_fields(at_turn)))
        tokens = sum(r["tokens"] for r in results)
        row = dict(backend=backend, case="chat", users=users, requests=len(results), wall_s=wall,
                   output_tokens=tokens, output_tok_s=tokens / wall,
                   turns_done=sum(len(turns) for turns in conversations),
                   prompt_tokens_max=max(r["prompt_tokens"] for r in results), prefix_hit_rate=hit_rate(results),
                   preemptions=after["num_preemptions"] - before["num_preemptions"], **latency_fields(results))
        report.add(row)
        print(f"{backend}, chat, {users} users: {row['turns_done']} turns, TTFT p50 {row['ttft_p50_ms']:.1f} ms, "
              f"ITL p99 {row['itl_p99_ms'] or 0:.2f} ms, hit rate {row['prefix_hit_rate']:.1%}, "
              f"{row['output_tok_s']:,.0f} tok/s", flush=True)


# ---- long document, cached context -------------------------------------------------------------------------
async def run_rag(engine: AsyncLLMEngine, args, backend: str, report: Report) -> None:
    rng = random.Random(args.seed + 7)
    document = random_prompt(rng, args.rag_doc_tokens)
    questions = [(document + random_prompt(rng, rng.randint(*RAG_QUESTION_TOKENS)), args.rag_answer_tokens)
                 for _ in range(args.rag_questions)]
    prompt, answer_tokens = questions[0]
    first = await stream_timings(engine, prompt, params(answer_tokens))
    report.add(dict(backend=backend, case="rag: first question (document uncached)", requests=1,
                    prompt_tokens_max=first["prompt_tokens"], prefix_hit_rate=hit_rate([first]),
                    output_tokens=first["tokens"], **latency_fields([first])))

    async def send(prompt: list[int], max_tokens: int) -> dict:
        return await stream_timings(engine, prompt, params(max_tokens))
    start = time.perf_counter()
    results = await drive(send, questions[1:], None, args.rag_concurrency)
    wall = time.perf_counter() - start
    failed = [r["error"] for r in results if "error" in r]
    if failed:
        raise RuntimeError(f"rag: {len(failed)} questions failed, first: {failed[0]}")
    tokens = sum(r["tokens"] for r in results)
    row = dict(backend=backend, case=f"rag: {len(results)} questions over the cached document",
               users=args.rag_concurrency, requests=len(results), wall_s=wall, output_tokens=tokens,
               output_tok_s=tokens / wall,
               prompt_tokens_max=max(r["prompt_tokens"] for r in results), prefix_hit_rate=hit_rate(results),
               **latency_fields(results))
    report.add(row)
    print(f"{backend}, rag: first question TTFT {report.data['results'][-2]['ttft_p50_ms']:.1f} ms, then TTFT p50 "
          f"{row['ttft_p50_ms']:.1f} ms, hit rate {row['prefix_hit_rate']:.1%}", flush=True)


async def run_cached(engine: AsyncLLMEngine, args, backend: str, report: Report) -> None:
    rng = random.Random(args.seed + 11)
    context = random_prompt(rng, args.cached_tokens)
    prefill = await stream_timings(engine, context, params(1))
    report.add(dict(backend=backend, case=f"{args.cached_tokens}-token prefill (uncached): TTFT", requests=1,
                    prompt_tokens_max=len(context), prefix_hit_rate=hit_rate([prefill]),
                    output_tokens=prefill["tokens"], ttft_p50_ms=ms(prefill["ttft"])))
    runs = [await stream_timings(engine, context + random_prompt(rng, args.new_tokens), params(args.decode_tokens))
            for _ in range(args.reps)]
    itl = [g for r in runs for g in r["itl"]]
    report.add(dict(backend=backend, case=f"{args.cached_tokens} cached + {args.new_tokens} new tokens: TTFT",
                    requests=len(runs), prompt_tokens_max=max(r["prompt_tokens"] for r in runs),
                    prefix_hit_rate=hit_rate(runs), output_tokens=sum(r["tokens"] for r in runs),
                    ttft_p50_ms=ms(median([r["ttft"] for r in runs])), ttft_min_ms=ms(min(r["ttft"] for r in runs)),
                    itl_p50_ms=ms(median(itl)), itl_p99_ms=ms(percentile(itl, 99))))
    row = report.data["results"][-1]
    print(f"{backend}, {row['case']} {row['ttft_p50_ms']:.1f} ms (uncached {ms(prefill['ttft']):.1f} ms), decode at "
          f"that context {row['itl_p50_ms'] or 0:.2f} ms per token, hit rate {row['prefix_hit_rate']:.1%}", flush=True)


def needed_context(args) -> int:
    """The longest sequence a chosen case makes: the engine's max_model_len."""
    lengths = [args.max_context] if "chat" in args.cases else []
    if "rag" in args.cases:
        lengths.append(args.rag_doc_tokens + RAG_QUESTION_TOKENS[1] + args.rag_answer_tokens)
    if "cached" in args.cases:
        lengths.append(args.cached_tokens + args.new_tokens + args.decode_tokens)
    return max(lengths)


async def run_backend(args, model_dir: str, backend: str, report: Report) -> None:
    kwargs = dict(engine_kwargs(args, backend), max_model_len=needed_context(args))
    async with AsyncLLMEngine(model_dir, **kwargs) as engine:
        warmup = warmup_requests(args.warmup_requests, min(1024, args.max_context), args.seed + 1)
        await asyncio.gather(*(engine.generate(p, sp) for p, sp in zip(*warmup)))
        for case, run in (("chat", run_chat), ("rag", run_rag), ("cached", run_cached)):
            if case in args.cases:
                await run(engine, args, backend, report)


COLUMNS = [("backend", "backend"), ("case", "case"), ("users", "users"), ("requests", "requests"),
           ("longest prompt", "prompt_tokens_max"), ("prefix hit rate", "prefix_hit_rate", "{:.1%}"),
           ("TTFT p50", "ttft_p50_ms", "{:.1f}"), ("TTFT p99", "ttft_p99_ms", "{:.1f}"),
           ("ITL p50", "itl_p50_ms", "{:.2f}"), ("ITL p99", "itl_p99_ms", "{:.2f}"),
           ("output tok/s", "output_tok_s", "{:,.0f}"), ("preemptions", "preemptions")]
TURN_COLUMNS = [("backend", "backend"), ("users", "users"), ("turn", "turn"), ("conversations", "conversations"),
                ("mean prompt", "prompt_tokens_mean", "{:,.0f}"), ("prefix hit rate", "prefix_hit_rate", "{:.1%}"),
                ("TTFT p50", "ttft_p50_ms", "{:.1f}"), ("TTFT p99", "ttft_p99_ms", "{:.1f}"),
                ("ITL p50", "itl_p50_ms", "{:.2f}"), ("ITL p99", "itl_p99_ms", "{:.2f}")]


def main(argv=None) -> dict:
    parser = make_parser(__doc__)
    add_engine_args(parser, multi_backend=True)
    parser.add_argument("--target-step-ms", default="default",
                        help="Config.target_step_ms: a number, none (throughput first), or default (AsyncLLMEngine's)")
    parser.add_argument("--cases", default=",".join(CASES), help=f"comma-separated of {', '.join(CASES)}")
    parser.add_argument("--users", default="8,64", help="chat: comma-separated numbers of conversations at once")
    parser.add_argument("--turns", type=int, default=20, help="chat: turns per conversation")
    parser.add_argument("--user-tokens", default="1024,4096", help="chat: new tokens per turn, N or MIN,MAX")
    parser.add_argument("--answer-tokens", default="64,256", help="chat: answer tokens per turn, N or MIN,MAX")
    parser.add_argument("--max-context", type=int, default=32768, help="chat: a conversation's longest context")
    parser.add_argument("--rag-doc-tokens", type=int, default=32768, help="rag: the document's tokens")
    parser.add_argument("--rag-questions", type=int, default=64, help="rag: questions about it")
    parser.add_argument("--rag-answer-tokens", type=int, default=64, help="rag: answer tokens per question")
    parser.add_argument("--rag-concurrency", type=int, default=8, help="rag: questions in flight after the first")
    parser.add_argument("--cached-tokens", type=int, default=32768, help="cached: the context's tokens")
    parser.add_argument("--new-tokens", type=int, default=64, help="cached: new tokens after it")
    parser.add_argument("--decode-tokens", type=int, default=64, help="cached: answer tokens (the decode ITL)")
    parser.add_argument("--reps", type=int, default=5, help="cached: runs (each with other new tokens)")
    parser.add_argument("--warmup-requests", type=int, default=32)
    args = parse_args(parser, argv)
    args.cases = [c for c in args.cases.split(",") if c]
    if set(args.cases) - set(CASES):
        parser.error(f"--cases: unknown {sorted(set(args.cases) - set(CASES))}; choose from {list(CASES)}")
    args.users = [int(u) for u in args.users.split(",") if u]
    args.user_tokens = token_range(args.user_tokens, "--user-tokens")
    args.answer_tokens = token_range(args.answer_tokens, "--answer-tokens")
    if args.rag_questions < 2 or args.reps < 1:
        parser.error("--rag-questions must be >= 2 (the first is timed alone) and --reps >= 1")
    report = Report("multiturn", args)
    report.data["turns"] = []
    with checkpoint_from_args(args) as model_dir:
        for backend in args.backends:
            try:
                asyncio.run(run_backend(args, model_dir, backend, report))
            except Exception as exc:  # one failing backend (e.g. FA4 not built here) must not end the run
                report.add(dict(backend=backend, case="-", error=f"{type(exc).__name__}: {exc}"))
                print(f"{backend}: FAILED {type(exc).__name__}: {exc}", flush=True)
            release_memory()  # the next engine sizes its KV cache from the memory left
    title = f"{args.shape}, {','.join(args.backends)}, latencies in ms"
    report.finish(f"Multi-turn chat and long context, {title}", COLUMNS + [("error", "error")])
    if report.data["turns"]:
        table = f"### Chat turns, {title}\n\n" + format_table(report.data["turns"], TURN_COLUMNS)
        print("\n" + table)
        report.set("turn_table", table)
    return report.data


if __name__ == "__main__":
    main()
