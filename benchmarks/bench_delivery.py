"""The event loop's cost per streamed token, without a model: what `async for out in engine.stream()`
costs on the consumer's side.

    python benchmarks/bench_delivery.py [--streams 256] [--steps 400] [--step-ms 5] [--cprofile 20]

A thread plays the engine: every --step-ms it hands each of --streams requests one random token
the way AsyncLLMEngine's engine thread does (RequestChannel.put_quietly, then one wake-up per event
loop), and the event loop runs one task per stream that reads out.text and counts out.token_ids, as
bench_throughput's stream mode does, detokenizing with the real Qwen3 tokenizer. Reported: the event
loop thread's CPU time per token and per step. The engine's own thread shares the interpreter with
that work, so on a GPU every microsecond here is one the launch of the next step may wait for.
"""
from __future__ import annotations

import asyncio
import random
import threading
import time

from common import Report, make_parser, parse_args
from transformers import AutoTokenizer

from asyncllm.detokenizer import TextAssembler
from asyncllm.sampling_params import SamplingParams
from asyncllm.streams import RequestChannel, RequestMetrics, RequestStream, wake
from asyncllm.testing import qwen_tokenizer_dir


def play_engine(channels: list[RequestChannel], num_steps: int, step_s: float, seed: int) -> None:
    rng = random.Random(seed)
    for step in range(num_steps):
        last = step == num_steps - 1
        to_wake: dict = {}
        for channel in channels:
            waiting = channel.put_quietly([rng.randrange(10, 20000)], "length" if last else None)
            if waiting is not None:
                to_wake.setdefault(waiting[0], []).append(waiting[1])
        wake(to_wake)
        time.sleep(step_s)


async def consume(stream: RequestStream) -> int:
    num_tokens, num_chars = 0, 0
    async for out in stream:
        num_chars += len(out.text)
        num_tokens += len(out.token_ids)
    return num_tokens


async def run(tokenizer, num_streams: int, num_steps: int, step_s: float, seed: int, profile_rows: int) -> dict:
    params = SamplingParams(max_tokens=num_steps, ignore_eos=True)
    channels, streams = [], []
    for i in range(num_streams):
        channel = RequestChannel(f"req-{i}")
        channel.metrics = RequestMetrics(arrival_time=time.monotonic())
        prompt = [1000 + i, 2000 + i]
        streams.append(RequestStream(lambda *args: None, channel, [TextAssembler(tokenizer, prompt, params)], prompt))
        channels.append(channel)
    tasks = [asyncio.ensure_future(consume(s)) for s in streams]
    await asyncio.sleep(0.05)  # every consumer waits on its first read
    profiler = None
    if profile_rows:
        import cProfile
        profiler = cProfile.Profile()
        profiler.enable()
    engine = threading.Thread(target=play_engine, args=(channels, num_steps, step_s, seed))
    cpu, wall = time.thread_time(), time.perf_counter()
    engine.start()
    num_tokens = sum(await asyncio.gather(*tasks))
    cpu, wall = time.thread_time() - cpu, time.perf_counter() - wall
    engine.join()
    if profiler is not None:
        import io
        import pstats
        profiler.disable()
        text = io.StringIO()
        pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(profile_rows)
        print(text.getvalue())
    return dict(streams=num_streams, steps=num_steps, tokens=num_tokens, wall_s=wall, loop_cpu_s=cpu,
                us_per_token=cpu / num_tokens * 1e6, ms_per_step=cpu / num_steps * 1e3)


COLUMNS = [("streams", "streams"), ("steps", "steps"), ("tokens", "tokens"), ("wall (s)", "wall_s", "{:.2f}"),
           ("loop CPU (s)", "loop_cpu_s", "{:.3f}"), ("us per token", "us_per_token", "{:.2f}"),
           ("loop ms per step", "ms_per_step", "{:.3f}")]


def main(argv=None) -> dict:
    parser = make_parser(__doc__)
    parser.add_argument("--streams", default="256", help="comma-separated stream counts, one run each")
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--step-ms", type=float, default=5.0, help="the engine's step time it plays")
    parser.add_argument("--cprofile", type=int, default=0, help="print this many rows of the loop's cProfile")
    args = parse_args(parser, argv)
    tokenizer = AutoTokenizer.from_pretrained(qwen_tokenizer_dir())
    report = Report("delivery", args)
    for num_streams in map(int, args.streams.split(",")):
        report.add(asyncio.run(run(tokenizer, num_streams, args.steps, args.step_ms / 1e3, args.seed, args.cprofile)))
    report.finish("The event loop's cost per streamed token (no model)", COLUMNS)
    return report.data


if __name__ == "__main__":
    main()
