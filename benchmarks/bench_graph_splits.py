"""The KV split count inside the batch-1 decode graph: which count each context wants. CUDA only.

    python benchmarks/bench_graph_splits.py --model-dir /tmp/ck/8b --shape 8b [--contexts 160,632,1432]
                                            [--splits 1,2,4,8,16,32]

A decode graph bakes its split count in (attention/triton_backend.py: the count for half its
context bound). This re-captures the graphs with every graph's count forced to each of --splits,
runs a greedy request whose last context is each of --contexts tokens, and times the batch-1
decode graph that context replays (median and least ms of 5 x 100 replays), beside the engine's
own count ("bound's"). Where the engine's count is not the fastest, DECODE_GRAPH_CONTEXTS or
_graph_num_splits want another look (docs/BENCHMARKS_ARCHIVE.md run R).
"""
from __future__ import annotations

import contextlib
import random
from unittest import mock

from bench_profile import recapture_graphs, sorted_replay_ms
from common import Report, checkpoint_from_args, make_parser, parse_args

from asyncllm import LLM, SamplingParams
from asyncllm.attention.triton_backend import TritonAttentionBackend

GENERATED = 32  # tokens a request generates: its last context is its prompt + these


def main(argv=None) -> dict:
    parser = make_parser(__doc__)
    parser.add_argument("--contexts", default="160,632,1432", help="comma-separated contexts (> 32 tokens)")
    parser.add_argument("--splits", default="1,2,4,8,16,32", help="comma-separated split counts to force")
    args = parse_args(parser, argv)
    assert args.device == "cuda", "CUDA graphs need a GPU"
    report = Report("graph_splits", args)
    contexts = [int(c) for c in args.contexts.split(",")]
    forced = [int(s) for s in args.splits.split(",")]
    with checkpoint_from_args(args) as model_dir:
        llm = LLM(model_dir, max_num_seqs=1, max_model_len=max(2048, max(contexts)), cuda_graph_max_tokens=16)
        runner = llm.core.runner
        rng = random.Random(args.seed)
        greedy = SamplingParams(temperature=0.0, max_tokens=GENERATED, ignore_eos=True)
        for context in contexts:
            prompt = [rng.randrange(1000, 20000) for _ in range(context - GENERATED)]
            for count in [None] + forced:
                patch = mock.patch.object(TritonAttentionBackend, "_graph_num_splits",
                                          lambda self, batch_size, bound, n=count: n)
                with patch if count is not None else contextlib.nullcontext():
                    recapture_graphs(runner)
                    llm.generate([prompt], greedy, use_tqdm=False)  # a real step's metadata in the buffers
                    times = sorted_replay_ms(runner, 1, context)
                report.add(dict(context=context, splits=count or "bound's", replay_ms=times[2], least_ms=times[0]))
                print(f"| {context} | {count or 'bound'} | {times[2]:.4f} | {times[0]:.4f} |", flush=True)
        recapture_graphs(runner)  # the engine's own counts again
    report.finish("Batch-1 decode graph replay by KV split count",
                  [("context", "context"), ("splits", "splits"), ("replay ms, median of 5", "replay_ms", "{:.4f}"),
                   ("least", "least_ms", "{:.4f}")])
    return report.data


if __name__ == "__main__":
    main()
