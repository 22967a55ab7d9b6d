"""Host time of one new turn over a long cached history, stage by stage (issue 44).

    python benchmarks/bench_turn_host.py [--contexts 1024,32768] [--new-tokens 64] [--reps 7] [--profile]
                                         [--no-forward] [--text] [--async-path]

On the tiny model (CPU), through EngineCore as LLM drives it: one --contexts[i]-token prompt is
prefilled (so the prefix cache holds it), then --reps times the same prompt + --new-tokens new
random ids, max_tokens=1 (the first token is the whole request). Each stage is timed by wrapping
the engine's own functions (ms, the best of --reps: the least disturbed by other
processes, as host work that does the same every time is)

  intake     encode_prompt + check_request (validation, the token-id list)
  add        add_checked_request (the Sequence)
  schedule   Scheduler.schedule, of which match_prefix (hashing the cached blocks) is shown apart
  plan       plan_step (StepPlan)
  inputs     ModelRunner.build_inputs (numpy arrays, block table, slot mapping)
  model      the forward itself (the model's compute: not host work, shown to subtract)
  rest       the rest of the step: launch/sampling/commit (commit_computed hashing)/resolve/events/free
  host       everything but model

What grows from the short to the long context is host work that is O(context).
--no-forward: the runner's forward returns zero logits instead (after the context's prefill, which
fills the prefix cache as a real one does): host work only, as on a GPU host, where no CPU forward
runs between turns and leaves the next turn's host work cold caches ("rest" grows with the context
by that on CPU); seconds, not minutes, and steadier on a busy machine.
--text adds a row: a chat app's turn sent as text, the conversation (docs/ARCHITECTURE.md
in 500-character pieces as alternating user/assistant messages, at least the context's tokens) through
the chat template and the tokenizer (asyncllm.chat_template.chat_prompt_ids, as AsyncLLMEngine.chat
and the server's chat route); each rep is a new turn (an answer and a question added to the
conversation): the history is rendered again, and encoded again where the engine's piece cache
(engine/text_pieces.py) does not hold it.
--profile prints cProfile's top functions of one long-context turn. --async-path adds a row: the
same turns through AsyncLLMEngine.stream, TTFT minus the forward (its intake on the event loop,
the engine thread's hand-offs and the first token's delivery included).
"""
from __future__ import annotations

import argparse
import asyncio
import cProfile
import os
import pstats
import random
import re
import tempfile
import time
from contextlib import contextmanager

import torch

import asyncllm.engine.core as engine_core
from asyncllm import LLM, AsyncLLMEngine, SamplingParams
from asyncllm.chat_template import chat_prompt_ids
from asyncllm.testing import build_tiny_checkpoint

STAGES = ("intake", "add", "schedule", "match_prefix", "plan", "inputs", "model", "rest", "host", "total")


class StageTimer:
    """Seconds per stage of the current turn, from wrappers put around the engine's functions."""

    def __init__(self):
        self.seconds: dict[str, float] = {}

    def wrap(self, owner, name: str, stage: str) -> None:
        inner = getattr(owner, name)

        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                self.seconds[stage] = self.seconds.get(stage, 0.0) + time.perf_counter() - start
        setattr(owner, name, timed)

    @contextmanager
    def stage(self, name: str):
        start = time.perf_counter()
        yield
        self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - start


def instrument(llm: LLM) -> StageTimer:
    timer = StageTimer()
    core = llm.core
    timer.wrap(core.scheduler, "schedule", "schedule")
    timer.wrap(core.block_manager, "match_prefix", "match_prefix")
    timer.wrap(engine_core, "plan_step", "plan")
    timer.wrap(core.runner, "build_inputs", "inputs")
    timer.wrap(core.runner, "_forward", "model")
    return timer


def one_turn(llm: LLM, timer: StageTimer, prompt: list[int], num_cached: int) -> dict[str, float]:
    """The stages' seconds of one request of prompt, of which the prefix cache must serve num_cached tokens."""
    core = llm.core
    timer.seconds = {}
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    start = time.perf_counter()
    with timer.stage("intake"):
        token_ids = core.encode_prompt(prompt)
        checked = core.check_request(token_ids, params)
    with timer.stage("add"):
        seq = core.add_checked_request(token_ids, checked)
    while not seq.request_finished:
        core.step()
    core.drain()
    total = time.perf_counter() - start
    s = timer.seconds
    if seq.num_cached_prompt_tokens != num_cached:
        raise RuntimeError(f"the prefix cache served {seq.num_cached_prompt_tokens} tokens, not {num_cached}")
    stages = {name: s.get(name, 0.0) for name in ("intake", "add", "schedule", "match_prefix", "plan", "inputs",
                                                   "model")}
    stages["total"] = total
    stages["host"] = total - stages["model"]
    stages["rest"] = stages["host"] - sum(stages[k] for k in ("intake", "add", "schedule", "plan", "inputs"))
    return stages


def conversation_of(core, num_tokens: int) -> tuple[list[dict], int]:
    """Alternating user/assistant messages (docs/ARCHITECTURE.md in 500-character pieces, cycled)
    whose chat prompt holds at least num_tokens tokens, and that count."""
    with open(os.path.join(os.path.dirname(__file__), "..", "docs", "ARCHITECTURE.md"), encoding="utf-8") as f:
        text = f.read()
    # a chat's messages hold no special-token text (this file's "<tool_call>" would be sanitized: encoded
    # whole each turn, transformers' way, chat_template.py)
    added = re.compile("|".join(map(re.escape, core.tokenizer.added_tokens_encoder)))
    paragraphs = [p for p in (text[i:i + 500] for i in range(0, len(text), 500)) if not added.search(p)]
    lengths = [len(core.tokenizer.encode(p, add_special_tokens=False)) for p in paragraphs]
    messages, count = [], 0
    while count < num_tokens:
        estimate = count
        while estimate < num_tokens:  # each message's content alone, a lower bound of what it adds
            estimate += lengths[len(messages) % len(paragraphs)]
            messages.append({"role": ("user", "assistant")[len(messages) % 2],
                             "content": paragraphs[len(messages) % len(paragraphs)]})
        count = len(chat_prompt_ids(core, messages, {}))
    return messages, count


def text_turn_ms(core, num_tokens: int, reps: int) -> tuple[float, int]:
    """The best of reps (ms) of a conversation of at least num_tokens tokens through the chat template
    and tokenizer, and its tokens."""
    messages, count = conversation_of(core, num_tokens)
    chat_prompt_ids(core, messages, {})  # the history, as the turn before sent it
    best = float("inf")
    for turn in range(reps):
        # a new turn: the assistant's last answer and the user's next question
        messages += [{"role": "assistant", "content": f"Answer {turn}: the engine thread owns the core."},
                     {"role": "user", "content": f"Question {turn}: where does a request's prompt get encoded?"}]
        start = time.perf_counter()
        chat_prompt_ids(core, messages, {})
        best = min(best, time.perf_counter() - start)
    return best * 1e3, count


async def async_host_ms(model_dir: str, contexts: list[int], args, max_len: int) -> dict[int, float]:
    """Per context: the best TTFT minus forward time (ms) of --reps turns through AsyncLLMEngine.stream."""
    rng = random.Random(args.seed + 1)
    best = {}
    async with AsyncLLMEngine(model_dir, device="cpu", max_model_len=max_len, max_num_batched_tokens=4096) as engine:
        timer = StageTimer()
        timer.wrap(engine._engine_thread.core.runner, "_forward", "model")
        threads = torch.get_num_threads()
        for context_len in contexts:
            context = [rng.randrange(10, 4000) for _ in range(context_len)]
            torch.set_num_threads(threads)
            await engine.generate(context, SamplingParams(max_tokens=1))
            torch.set_num_threads(1)
            host = []
            for _ in range(args.reps):
                prompt = context + [rng.randrange(10, 4000) for _ in range(args.new_tokens)]
                timer.seconds = {}
                start = time.perf_counter()
                ttft = None
                async for out in engine.stream(prompt, SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)):
                    if out.token_ids and ttft is None:
                        ttft = time.perf_counter() - start
                host.append(ttft - timer.seconds.get("model", 0.0))
            best[context_len] = min(host) * 1e3
    return best


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--contexts", default="1024,32768", help="comma-separated cached context lengths")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--profile", action="store_true", help="cProfile one turn at the longest context")
    parser.add_argument("--async-path", action="store_true", help="also through AsyncLLMEngine.stream")
    parser.add_argument("--no-forward", action="store_true", help="zero logits in place of the turns' forwards")
    parser.add_argument("--text", action="store_true", help="also a conversation of each context's length as text")
    args = parser.parse_args(argv)
    contexts = [int(c) for c in args.contexts.split(",") if c]
    max_len = max(contexts) + args.new_tokens + 8
    rng = random.Random(args.seed)
    threads = torch.get_num_threads()
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build_tiny_checkpoint(tmp, vocab_size=4096, max_position_embeddings=max(max_len, 4096))
        llm = LLM(model_dir, device="cpu", max_model_len=max_len, max_num_batched_tokens=4096,
                  enable_prefix_caching=True)
        timer = instrument(llm)
        for context_len in contexts:
            context = [rng.randrange(10, 4000) for _ in range(context_len)]
            torch.set_num_threads(threads)
            llm.generate([context], SamplingParams(max_tokens=1))  # prefilled once: cached from now on
            # the turns on one thread: a CPU forward's OpenMP workers spin on after it, taking the
            # core the next turn's host work would run on (a GPU step's host has no such workers)
            torch.set_num_threads(1)
            if args.no_forward:
                runner = llm.core.runner
                vocab = llm.core.intake.vocab_size
                runner._forward = lambda batch, pooling=None: torch.zeros(len(batch.logits_indices), vocab)
                timer.wrap(runner, "_forward", "model")
            # the context's full blocks: a block is cached whole
            num_cached = context_len // llm.core.block_manager.block_size * llm.core.block_manager.block_size
            turns = [one_turn(llm, timer, context + [rng.randrange(10, 4000) for _ in range(args.new_tokens)],
                              num_cached) for _ in range(args.reps)]
            results[context_len] = {k: min(t[k] for t in turns) * 1e3 for k in STAGES}
            if args.text:
                results[context_len]["chat_text"], results[context_len]["chat_tokens"] = text_turn_ms(
                    llm.core, context_len, args.reps)
            if args.profile and context_len == max(contexts):
                profiler = cProfile.Profile()
                profiler.enable()
                one_turn(llm, timer, context + [rng.randrange(10, 4000) for _ in range(args.new_tokens)], num_cached)
                profiler.disable()
                pstats.Stats(profiler).sort_stats("tottime").print_stats(25)
            if args.no_forward:
                del llm.core.runner._forward  # the model's own again, for the next context's prefill
                timer.wrap(llm.core.runner, "_forward", "model")
        llm.close()
        if args.async_path:
            for context_len, ms in asyncio.run(async_host_ms(model_dir, contexts, args, max_len)).items():
                results[context_len]["async_host"] = ms
    print(f"host ms per stage of a {args.new_tokens}-token turn over a cached context (tiny model, CPU, best "
          f"of {args.reps}{', no forward' if args.no_forward else ''})\n")
    print("| stage | " + " | ".join(f"{c} cached" for c in contexts) + " |")
    print("|---|" + "---:|" * len(contexts))
    for stage in STAGES + (("async_host",) if args.async_path else ()) + (("chat_text",) if args.text else ()):
        print(f"| {stage} | " + " | ".join(f"{results[c][stage]:.3f}" for c in contexts) + " |")
    if args.text:
        print("\nchat_text: the conversation's " + ", ".join(f"{results[c]['chat_tokens']}" for c in contexts)
              + " tokens through the chat template and tokenizer")
    return results


if __name__ == "__main__":
    main()
