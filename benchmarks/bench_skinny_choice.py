"""Does the skinny GEMM's per-shape choice pay inside the decode step? CUDA only.

    python benchmarks/bench_skinny_choice.py --model-dir /tmp/ck/8b --shape 8b

The engine decides each projection's kernel (ours or cuBLAS) by timing it alone, between two small
PDL kernels (asyncllm.layers.skinny_linear). This checks those decisions where they are closest,
the two widest projections (gate_up and lm_head, where ours and cuBLAS time within a few percent),
against what decides the time per token: the batch-1 decode graph's replay. It prints the
engine's own timings for 1 row (its debug log) and its choices, then re-captures the graphs with
gate_up and lm_head each forced to our kernel (fma n32 k256 and dot n64 k128) or to cuBLAS, every
other shape as chosen, and times 5 x 100 replays of each (median and least ms per replay).

With --grouped it then times each 1-row FMA decision in the FMA loop's grouped form
(SkinnyConfig.grouped), one projection at a time, the rest as chosen, and all at once: what
runner/decode_tuning.py weighs at start-up (docs/BENCHMARKS_ARCHIVE.md run T).
"""
from __future__ import annotations

import dataclasses
import logging
import random
import sys

from bench_profile import recapture_graphs, sorted_replay_ms
from common import checkpoint_from_args, make_parser, parse_args

from asyncllm import LLM, SamplingParams
from asyncllm.kernels import skinny_gemm
from asyncllm.layers import skinny_linear


def main(argv=None) -> None:
    parser = make_parser(__doc__)
    parser.add_argument("--grouped", action="store_true", help="also time each 1-row FMA decision grouped")
    args = parse_args(parser, argv)
    assert args.device == "cuda", "CUDA graphs and the skinny GEMM's timing need a GPU"
    handler = logging.StreamHandler(sys.stdout)
    handler.addFilter(lambda r: "timings" in r.getMessage() and "1 rows" in r.getMessage())
    logging.getLogger("asyncllm").addHandler(handler)
    logging.getLogger("asyncllm").setLevel(logging.DEBUG)
    with checkpoint_from_args(args) as model_dir:
        llm = LLM(model_dir, max_num_seqs=1, max_model_len=1024, cuda_graph_max_tokens=16)
        logging.getLogger("asyncllm").setLevel(logging.INFO)
        runner = llm.core.runner
        rng = random.Random(args.seed)
        prompt = [rng.randrange(1000, 20000) for _ in range(128)]
        greedy = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)

        def generate():
            return llm.generate([prompt], greedy, use_tqdm=False)[0]

        generate()
        chosen = dict(skinny_linear._choices)
        for label, choice in skinny_linear.describe_choices().items():
            if label.startswith("1 rows"):
                print(f"| choice | {label} | {choice} |", flush=True)
        config = runner.model.config

        def key_of(n: int) -> tuple:
            return next(key for key in chosen if key[2] == 1 and key[3] == n and key[4] == config.hidden_size)

        gate_up, lm_head = key_of(2 * config.intermediate_size), key_of(config.vocab_size)
        ours = {gate_up: skinny_gemm.SkinnyConfig(False, 32, 256, 1, 4),
                lm_head: skinny_gemm.SkinnyConfig(True, 64, 128, 1, 4)}
        print("| gate_up | lm_head | replay ms, median of 5 | least |", flush=True)
        for gate_up_kernel, lm_head_kernel in (("chosen", "chosen"), ("ours", "ours"), ("cublas", "cublas"),
                                               ("ours", "cublas"), ("cublas", "ours"), ("chosen", "chosen")):
            skinny_linear._choices.clear()
            skinny_linear._choices.update(chosen)
            for key, which in ((gate_up, gate_up_kernel), (lm_head, lm_head_kernel)):
                if which != "chosen":
                    skinny_linear._choices[key] = ours[key] if which == "ours" else None
            recapture_graphs(runner)
            generate()  # a real step's metadata in the graphs' buffers
            times = sorted_replay_ms(runner, 1, len(prompt) + greedy.max_tokens)
            print(f"| {gate_up_kernel} | {lm_head_kernel} | {times[2]:.4f} | {times[0]:.4f} |", flush=True)
        if args.grouped:
            grouped_sweep(runner, chosen, generate, len(prompt) + greedy.max_tokens)


def grouped_sweep(runner, chosen: dict, generate, context: int) -> None:
    """The batch-1 decode graph's replay with each 1-row FMA decision grouped in turn, then all
    (the gated down projection's decision where that form is in use)."""
    tables = {"": (skinny_linear._choices, chosen), " gated": (skinny_linear._gated_choices,
                                                             dict(skinny_linear._gated_choices))}
    fma = [(suffix, key) for suffix, (_, made) in tables.items() for key, config in made.items()
           if key[2] == 1 and config is not None and not config.dot]
    print("| grouped | replay ms, median of 5 | least |", flush=True)
    for label, grouped in [("none", [])] + [(f"({k[3]}, {k[4]}){g}", [(g, k)]) for g, k in fma] + [("all", fma)]:
        for table, made in tables.values():
            table.clear()
            table.update(made)
        for suffix, key in grouped:
            skinny_linear.set_choice(suffix == " gated", key, dataclasses.replace(tables[suffix][1][key], grouped=True))
        recapture_graphs(runner)
        generate()
        times = sorted_replay_ms(runner, 1, context)
        print(f"| {label} | {times[2]:.4f} | {times[0]:.4f} |", flush=True)


if __name__ == "__main__":
    main()
