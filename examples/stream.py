"""Stream answers to a few concurrent chat prompts, cancel one midway, and watch its KV blocks return.

    python examples/stream.py                 # the default model (SmolLM2-135M-Instruct, on CPU)
    python examples/stream.py --model DIR     # any supported checkpoint directory or .gguf file
"""
from __future__ import annotations

import argparse
import sys

import anyio

from asyncllm import AsyncLLMEngine, SamplingParams

QUESTIONS = [
    "What is the capital of France? Answer in two sentences.",
    "Give me three tips for writing clear Python code.",
    "Write a short poem about the sea.",
]


def blocks_in_use(engine: AsyncLLMEngine) -> int:
    stats = engine.stats()
    return stats["num_total_blocks"] - stats["num_free_blocks"]


async def answer_live(engine: AsyncLLMEngine, question: str, params: SamplingParams) -> None:
    print(f"\n[1] {question}\n    ", end="", flush=True)
    async for out in engine.chat([{"role": "user", "content": question}], params):
        print(out.text.replace("\n", "\n    "), end="", flush=True)
    print()


async def answer_quietly(engine: AsyncLLMEngine, question: str, params: SamplingParams, answers: dict) -> None:
    result = await engine.generate(engine.apply_chat_template([{"role": "user", "content": question}]), params)
    answers[question] = result


async def answer_then_cancel(engine: AsyncLLMEngine, question: str, params: SamplingParams,
                             cancel_after_tokens: int, report: dict) -> None:
    with anyio.CancelScope() as scope:
        num_tokens = 0
        async for out in engine.chat([{"role": "user", "content": question}], params):
            num_tokens += len(out.token_ids)
            if num_tokens >= cancel_after_tokens:
                report["tokens"] = num_tokens
                report["blocks_before"] = blocks_in_use(engine)
                scope.cancel()  # cancelling the reading task aborts the request


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="checkpoint directory or .gguf file (default: SmolLM2)")
    parser.add_argument("--max-tokens", type=int, default=96)
    args = parser.parse_args()

    params = SamplingParams(temperature=0, max_tokens=args.max_tokens)
    print("loading the model ...", file=sys.stderr)
    # small KV blocks, so the demo shows blocks coming and going
    async with AsyncLLMEngine(args.model, max_model_len=2048, kvcache_block_size=16) as engine:
        answers: dict = {}
        report: dict = {}
        async with anyio.create_task_group() as tasks:
            tasks.start_soon(answer_live, engine, QUESTIONS[0], params)
            tasks.start_soon(answer_quietly, engine, QUESTIONS[1], params, answers)
            tasks.start_soon(answer_then_cancel, engine, QUESTIONS[2], params, 8, report)
        await engine.wait_idle()
        result = answers[QUESTIONS[1]]
        answer = result.text.strip().replace("\n", "\n    ")
        print(f"\n[2] {QUESTIONS[1]}\n    {answer}")
        print(f"    ({result.metrics.num_completion_tokens} tokens, first after "
              f"{result.metrics.time_to_first_token * 1000:.0f} ms, finish: {result.finish_reason})")
        if report:
            print(f"\n[3] {QUESTIONS[2]}\n    cancelled after {report['tokens']} tokens; KV blocks in use while "
                  f"the three ran: {report['blocks_before']}, now: {blocks_in_use(engine)} "
                  f"of {engine.stats()['num_total_blocks']}")
        else:  # --max-tokens under 8, or an early end of sequence
            print(f"\n[3] {QUESTIONS[2]}\n    the answer ended before 8 tokens, so there was nothing to cancel; "
                  f"KV blocks in use now: {blocks_in_use(engine)} of {engine.stats()['num_total_blocks']}")


if __name__ == "__main__":
    anyio.run(main)
