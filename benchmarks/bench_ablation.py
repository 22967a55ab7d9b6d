"""What each part of a batch-1 decode step costs inside the step: the step again without it.

    python benchmarks/bench_ablation.py --model-dir /tmp/ck/8b --shape 8b [--tokens 32] [--json PATH]

With programmatic dependent launch (kernels/pdl.py) the decode step's kernels overlap their
neighbours, so a profiler's per-kernel durations no longer add up to the step (a norm "takes" the
whole of the GEMV before it, waiting), and a kernel timed alone misses what it overlaps or breaks.
This takes one part out of every layer at a time (the norms, the q/k norm + rotary with its KV
store, the attention, both where the decode kernel does the rotary itself, a projection, a whole
block), captures the CUDA graphs again and times the batch-1 decode graph's replay: full minus that
is what the part costs in the chain, the most any fusion of it can save. The outputs without a part are garbage (nothing is checked); the step's
shapes and kernels otherwise stay. On CUDA: graph replays (median of 5 x 100); on CPU, where there
are no graphs, the eager time per token of LLM.generate (the logic runs, the figures mean little).
"""
from __future__ import annotations

import contextlib
import random
import time
from unittest import mock

from bench_profile import recapture_graphs, sorted_replay_ms
from common import Report, checkpoint_from_args, make_parser, parse_args

from asyncllm import LLM, SamplingParams


def _layers(model):
    return list(model.model.layers)


@contextlib.contextmanager
def _patched(pairs):
    """Sets each (object, attribute, value) for the duration (unittest.mock restores them)."""
    with contextlib.ExitStack() as stack:
        for obj, name, value in pairs:
            stack.enter_context(mock.patch.object(obj, name, value))
        yield


def _skip_norm(x, residual=None):
    return x if residual is None else (x, residual)


def variants(model, backend) -> dict[str, list]:
    """name -> the (object, attribute, value) patches that take that part out of every layer."""
    layers = _layers(model)
    hidden = model.config.hidden_size

    def first_columns(x):  # a projection replaced by a view of its input's first `hidden` columns
        return x[..., :hidden]

    def no_norm_rope(attn):
        def norm_rope(positions, qkv, batch):
            q, k, v = attn._split_heads(qkv)
            if attn._fused is not None:  # the fused kernel's KV store goes too: the attention reads the cache as it was
                return q, None, None
            return q, k, v
        return norm_rope

    def q_of(layer_id, qkv, rope, batch):  # the attention kernel with its own rotary replaced by q's columns
        return qkv[:, :rope.num_heads * backend.head_dim].view(qkv.shape[0], rope.num_heads, backend.head_dim)

    # where the backend's decode kernel does the q/k norm + rotary itself (attend_qkv, CUDA), the first
    # two variants take it back to the rotary kernel then the attention, and take one of them out
    no_norm_rope_patches = [(layer.self_attn, "_norm_rope", no_norm_rope(layer.self_attn)) for layer in layers]
    no_attention_patches = [(backend, "forward", lambda layer_id, q, k, v, batch: q)]
    return {
        "full step": [],
        "no input/post-attention norms": [(m, "forward", _skip_norm) for layer in layers
                                         for m in (layer.input_layernorm, layer.post_attention_layernorm)],
        "no q/k norm + rotary + KV store": no_norm_rope_patches + [(backend, "attend_qkv", lambda *args: None)],
        "no attention (decode + reduce)": no_attention_patches + [(backend, "attend_qkv", lambda *args: None)],
        "no attention with its q/k norm + rotary": (no_norm_rope_patches + no_attention_patches
                                                    + [(backend, "attend_qkv", q_of)]),
        "no qkv projection": [(layer.self_attn.qkv_proj, "forward",
                               lambda x, n=layer.self_attn.qkv_proj.weight.shape[0]: x.new_empty(x.shape[0], n))
                              for layer in layers],
        "no o_proj": [(layer.self_attn.o_proj, "forward", first_columns) for layer in layers],
        "no gate_up": [(layer.mlp.gate_up_proj, "forward",
                        lambda x, n=layer.mlp.gate_up_proj.weight.shape[0]: x.new_empty(x.shape[0], n))
                       for layer in layers],
        "no down projection": [(layer.mlp.down_proj, "forward_silu_mul", first_columns) for layer in layers],
        "no attention block": [(layer.self_attn, "forward", lambda positions, x, batch: x) for layer in layers],
        "no MLP": [(layer.mlp, "forward", lambda x: x) for layer in layers],
    }


def main(argv=None) -> dict:
    parser = make_parser(__doc__)
    parser.add_argument("--tokens", type=int, default=32, help="tokens generated per variant (CPU: the timed ones)")
    parser.add_argument("--only", default=None, help="comma-separated variant names to run (default: all)")
    args = parse_args(parser, argv)
    report = Report("ablation", args)
    cuda = args.device == "cuda"
    with checkpoint_from_args(args) as model_dir:
        llm = LLM(model_dir, max_num_seqs=1, max_model_len=1024, cuda_graph_max_tokens=16,
                  device=args.device)
        runner = llm.core.runner
        rng = random.Random(args.seed)
        prompt = [rng.randrange(10, min(20000, runner.model.config.vocab_size)) for _ in range(128)]
        greedy = SamplingParams(temperature=0.0, max_tokens=args.tokens, ignore_eos=True)
        full_ms = None
        wanted = args.only.split(",") if args.only else None
        for name, patches in variants(runner.model, runner.attn_backend).items():
            if wanted and name not in wanted and name != "full step":
                continue
            with _patched(patches):
                if cuda:
                    recapture_graphs(runner)
                start = time.perf_counter()
                llm.generate([prompt], greedy, use_tqdm=False)  # on CUDA: a real step's metadata in the graphs
                per_token = (time.perf_counter() - start) / args.tokens * 1e3
                if cuda:
                    ms = sorted_replay_ms(runner, 1, len(prompt) + args.tokens)[2]
                else:
                    ms = per_token
            full_ms = ms if full_ms is None else full_ms
            row = {"variant": name, "ms": ms, "saved_ms": full_ms - ms,
                   "saved_us_per_layer": (full_ms - ms) * 1e3 / len(_layers(runner.model))}
            report.add(row)
            print(f"| {name} | {ms:.4f} | {row['saved_ms']:.4f} | {row['saved_us_per_layer']:.2f} |", flush=True)
        if cuda:
            recapture_graphs(runner)  # the engine's own graphs again
        assert llm.core.block_manager.num_free_blocks == llm.core.block_manager.num_total_blocks
    what = "decode graph replay" if cuda else "eager time per token"
    report.finish(f"Ablation, {args.shape}, batch 1: {what} without each part (ms)",
                  [("variant", "variant"), ("ms", "ms", "{:.4f}"), ("saved ms", "saved_ms", "{:.4f}"),
                   ("saved us / layer", "saved_us_per_layer", "{:.2f}")])
    return report.data


if __name__ == "__main__":
    main()
