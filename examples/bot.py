"""A multi-turn chat bot in the terminal: answers stream in; Ctrl-C stops the answer, not the bot.

    python examples/bot.py                    # the default model (SmolLM2-135M-Instruct, on CPU)
    python examples/bot.py --model DIR --system "You are a pirate."

The conversation goes through the model's chat template (engine.chat) with the whole history.
Ctrl-C during an answer cancels the task that reads it, which aborts the request in the engine
(its KV blocks come back at once); the partial answer stays in the history. Ctrl-C or Ctrl-D at
the prompt quits. /reset starts a new conversation.
"""
from __future__ import annotations

import argparse
import asyncio
import signal
import sys
import time

from asyncllm import AsyncLLMEngine, SamplingParams

PROMPT = "you> "


async def answer(engine: AsyncLLMEngine, history: list[dict], params: SamplingParams, reply: list[str],
                 info: dict) -> None:
    """Stream one answer to stdout, collecting it into `reply` as it comes (so a stop keeps it)."""
    stream = engine.chat(history, params)
    info["prompt_tokens"] = len(stream.prompt_token_ids)
    start = time.monotonic()
    async for out in stream:  # a cancelled task aborts the request here
        reply.append(out.text)
        sys.stdout.write(out.text)
        sys.stdout.flush()
        info["tokens"] = len(stream.token_ids)
    info["finish_reason"] = stream.finish_reason
    info["seconds"] = time.monotonic() - start


def blocks_in_use(engine: AsyncLLMEngine) -> int:
    stats = engine.stats()
    return stats["num_total_blocks"] - stats["num_free_blocks"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="checkpoint directory or .gguf file (default: SmolLM2)")
    parser.add_argument("--system", default=None, help="a system message to start the conversation with")
    parser.add_argument("--max-tokens", type=int, default=512)
    parser.add_argument("--temperature", type=float, default=0.7)
    parser.add_argument("--ignore-eos", action="store_true", help="always answer max tokens (for demos and tests)")
    parser.add_argument("--max-model-len", type=int, default=4096)
    parser.add_argument("--num-kvcache-blocks", type=int, default=-1)
    parser.add_argument("--stats", action="store_true", help="after each answer: tokens, speed, context size")
    args = parser.parse_args()
    # Ctrl-C is this bot's stop button: a SIGINT "ignore" inherited from the parent (a shell's background
    # job, nohup) would make Python install no KeyboardInterrupt handler, and every Ctrl-C would do nothing
    signal.signal(signal.SIGINT, signal.default_int_handler)

    params = SamplingParams(temperature=args.temperature, top_p=0.95, max_tokens=args.max_tokens,
                            ignore_eos=args.ignore_eos)
    start_history = [{"role": "system", "content": args.system}] if args.system else []
    history = list(start_history)
    print("loading the model ...", file=sys.stderr, flush=True)
    engine = AsyncLLMEngine(args.model, max_model_len=args.max_model_len, num_kvcache_blocks=args.num_kvcache_blocks)
    # One event loop for the whole session; asyncio.Runner turns a Ctrl-C during runner.run() into
    # a cancellation of the task it runs, then raises KeyboardInterrupt here.
    with asyncio.Runner() as runner:
        try:
            runner.run(engine.start())
            print("Chat away. Ctrl-C stops an answer; Ctrl-C or Ctrl-D at the prompt quits; /reset forgets.",
                  flush=True)
            while True:
                try:
                    message = input(PROMPT)
                except (EOFError, KeyboardInterrupt):
                    print()
                    break
                if not message.strip():
                    continue
                if message.strip() == "/reset":
                    history = list(start_history)
                    print("[new conversation]", flush=True)
                    continue
                history.append({"role": "user", "content": message})
                reply: list[str] = []
                info: dict = {}
                print("bot> ", end="", flush=True)
                try:
                    runner.run(answer(engine, history, params, reply, info))
                    print(flush=True)
                    if args.stats:
                        print(f"[{info['tokens']} tokens, {info['tokens'] / max(info['seconds'], 1e-9):.1f} tok/s, "
                              f"{info['finish_reason']}; {info['prompt_tokens']} prompt tokens]", flush=True)
                except KeyboardInterrupt:
                    runner.run(engine.wait_idle())  # the abort is applied: its blocks are free
                    extra = f"; {info['prompt_tokens']} prompt tokens" if args.stats and "prompt_tokens" in info else ""
                    print(f"\n[stopped after {info.get('tokens', 0)} tokens; KV blocks in use: "
                          f"{blocks_in_use(engine)}{extra}]", flush=True)
                except ValueError as e:  # e.g. the conversation no longer fits in the context
                    print(f"\n[error: {e}; /reset to start over]", flush=True)
                    history.pop()
                    continue
                history.append({"role": "assistant", "content": "".join(reply)})
        except KeyboardInterrupt:  # a Ctrl-C outside an answer (loading, or right after a stop)
            print()
        finally:
            runner.run(engine.shutdown())
    print("bye", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
