"""Hugging Face transformers on the same checkpoint, for scale (attn_implementation="sdpa").

    python benchmarks/bench_hf.py [--num-requests 32] [--json PATH]

(a) Continuous batching, model.generate_batch, on the first --num-requests requests of the
    nano-vllm workload (temperature 0.6, EOS off). generate_batch takes one max_new_tokens for all
    requests: the workload's mean max_tokens. Throughput = generated tokens / the generation window
    (first request added -> last request finished, from HF's own stamps; set-up and CUDA-graph
    warm-up excluded), with the whole call's wall time reported beside it.
(b) Plain generate, batch 1: TTFT (a --prompt-len prompt, max_new_tokens=1, greedy) and TPOT
    ((time of N+1 new tokens - time of 1) / N), medians.
(c) With --compile: (b) again with a static KV cache, which makes transformers compile the decode
    forward with torch.compile (CUDA only; on CPU it runs uncompiled).
Each part reports an error string instead of failing the run (the continuous batching API moves
between transformers releases).
"""
from __future__ import annotations

import inspect
import random
import statistics
import time

import torch
from common import (Report, bench_requests, checkpoint_from_args, make_parser, median, ms, parse_args,
                    random_prompt, release_memory, timed)


def load_model(model_dir: str, device: str):
    from transformers import AutoModelForCausalLM
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, attn_implementation="sdpa")
    return model.to(device).eval()


def sdpa_cb_config():
    """Keep generate_batch on sdpa: by default it switches to a flash kernel (possibly one fetched from the
    hub) when it finds one."""
    try:
        from transformers import ContinuousBatchingConfig
        return ContinuousBatchingConfig(auto_switch_to_flash=False)
    except (ImportError, TypeError):
        return None


def continuous_batching(model, args) -> dict:
    from transformers import GenerationConfig
    prompts, params = bench_requests(args.num_requests, args.seed, args.max_input, args.max_output)
    max_new_tokens = round(statistics.mean(p.max_tokens for p in params))
    config = GenerationConfig(max_new_tokens=max_new_tokens, do_sample=True, temperature=0.6, top_k=0, top_p=1.0,
                              eos_token_id=-1, pad_token_id=0)  # -1: no EOS, like ignore_eos
    kwargs = dict(inputs=prompts, generation_config=config, progress_bar=False)
    cb_config = sdpa_cb_config()
    if cb_config is not None and "continuous_batching_config" in inspect.signature(model.generate_batch).parameters:
        kwargs["continuous_batching_config"] = cb_config
    outputs, wall = timed(lambda: model.generate_batch(**kwargs), args.device)
    outputs = list(outputs.values()) if isinstance(outputs, dict) else list(outputs)
    errors = [o.error for o in outputs if getattr(o, "error", None)]
    tokens = sum(len(o.generated_tokens) for o in outputs)
    row = dict(part="generate_batch", num_requests=len(prompts), max_new_tokens=max_new_tokens,
               generated_tokens=tokens, wall_s=wall, wall_tok_s=tokens / wall,
               attn_implementation=model.config._attn_implementation)
    try:  # HF's stamps (perf_counter) leave out the manager's set-up and warm-up
        window = max(o.lifespan[1] for o in outputs) - min(o.created_time for o in outputs)
        if window > 0:
            row.update(window_s=window, output_tok_s=tokens / window)
    except (AttributeError, ValueError, TypeError):
        pass
    row.setdefault("output_tok_s", row["wall_tok_s"])
    if errors or len(outputs) != len(prompts):
        row["error"] = f"{len(outputs)}/{len(prompts)} results; errors: {errors[:3]}"
    return row


def batch1_latency(model, args, compiled: bool = False) -> dict:
    rng = random.Random(args.seed)
    device = args.device
    n = args.tpot_tokens
    extra = {}
    if compiled:
        # one static cache for every call (reset by generate), so the compiled graphs see one shape
        from transformers import CompileConfig, StaticCache
        cache = StaticCache(config=model.config, max_cache_len=args.prompt_len + n + 8)
        extra = dict(past_key_values=cache, compile_config=CompileConfig(fullgraph=True, mode="reduce-overhead"))

    def generate_time(new_tokens: int) -> float:
        input_ids = torch.tensor([random_prompt(rng, args.prompt_len)], device=device)
        if compiled:
            extra["past_key_values"].reset()
        return timed(lambda: model.generate(input_ids, attention_mask=torch.ones_like(input_ids), do_sample=False,
                                            max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                                            pad_token_id=0, **extra), device)[1]

    for _ in range(3 if compiled else 1):  # warm-up (compiled: the compile, then the CUDA graphs' recording)
        generate_time(8)
    ttfts = [generate_time(1) for _ in range(args.reps)]
    tpots = [(generate_time(n + 1) - generate_time(1)) / n for _ in range(args.tpot_reps)]
    return dict(part="generate batch 1" + (", static cache, torch.compile" if compiled else ""),
                prompt_len=args.prompt_len, ttft_ms=ms(median(ttfts)), tpot_ms=ms(median(tpots)), output_tokens=n)


def compiled_batch1_latency(model, args) -> dict:
    """(c): (b) with a static KV cache, where transformers compiles the decode step's forward with
    torch.compile (fullgraph, mode "reduce-overhead": Inductor's kernels replayed as CUDA graphs) --
    the gpt-fast recipe, the torch.compile baseline for a decode path (issue 22)."""
    return batch1_latency(model, args, compiled=True)


COLUMNS = [("part", "part"), ("requests", "num_requests"), ("max_new_tokens", "max_new_tokens"),
           ("generated", "generated_tokens"), ("window (s)", "window_s", "{:.2f}"), ("wall (s)", "wall_s", "{:.2f}"),
           ("output tok/s", "output_tok_s", "{:,.0f}"), ("TTFT (ms)", "ttft_ms", "{:.2f}"),
           ("TPOT (ms)", "tpot_ms", "{:.2f}"), ("error", "error")]


def main(argv=None) -> dict:
    parser = make_parser(__doc__)
    parser.add_argument("--num-requests", type=int, default=32, help="continuous batching requests")
    parser.add_argument("--max-input", type=int, default=1024)
    parser.add_argument("--max-output", type=int, default=1024)
    parser.add_argument("--prompt-len", type=int, default=128, help="batch-1 prompt length")
    parser.add_argument("--reps", type=int, default=5, help="batch-1 TTFT runs")
    parser.add_argument("--tpot-tokens", type=int, default=128)
    parser.add_argument("--tpot-reps", type=int, default=2)
    parser.add_argument("--skip-cb", action="store_true", help="skip continuous batching")
    parser.add_argument("--compile", action="store_true", help="also batch 1 with a static cache and torch.compile")
    args = parse_args(parser, argv)
    import transformers
    transformers.logging.set_verbosity_error()
    report = Report("hf", args)
    with checkpoint_from_args(args) as model_dir:
        model = load_model(model_dir, args.device)
        parts = [batch1_latency] + ([compiled_batch1_latency] if args.compile else []) + \
            ([] if args.skip_cb else [continuous_batching])
        for part in parts:
            start = time.perf_counter()
            try:
                row = part(model, args)
            except Exception as exc:  # report, don't crash: the other part may still run
                row = dict(part=part.__name__, error=f"{type(exc).__name__}: {exc}"[:500])
            row["elapsed_s"] = time.perf_counter() - start
            report.add(row)
            print(f"{row['part']}: done in {row['elapsed_s']:.1f} s", flush=True)
        del model
        release_memory()
    report.finish(f"Hugging Face transformers {transformers.__version__}, {args.shape}, sdpa", COLUMNS)
    return report.data


if __name__ == "__main__":
    main()
