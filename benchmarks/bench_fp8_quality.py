"""FP8 quality, teacher-forced: what FP8 weights (Config quantization="fp8"), an FP8 KV cache
(kv_cache_dtype="fp8") and both cost against bf16, over a fixed text.

    python benchmarks/bench_fp8_quality.py --model smollm2 [--device cpu] [--json PATH]
    python benchmarks/bench_fp8_quality.py --shape 0.6b [--model-dir DIR]      # random weights

Each configuration is an engine in bfloat16 that reads the text (benchmarks/data/, the Declaration
of Independence: public domain, ~1.6k tokens) as one prompt with prompt log-probabilities on, so every
position's next-token distribution comes out of the engine's own paths (the FP8 cache is written
and read back as in serving: prefill attends the K/V it just stored). Against the bf16 engine's
distributions p, per configuration q: mean KL(p || q) over the positions, top-1 agreement (argmax q
== argmax p), the same over the positions where float32 and bf16 agree (top-1 choices not decided by
bf16's own rounding: float32 itself agrees on only ~97 %) and the perplexity of the text under q;
a float32 row shows bf16's own rounding distance. Runs on CPU (slowly for SmolLM2) and CUDA; on CPU
the FP8 cache is emulated exactly and FP8 weights take CUDA's routes and arithmetic
(layers/fp8_linear.cuda_paths_on_cpu: the prefill W8A8 with per-token activation scales, as on CUDA;
--cpu-fp8-path: CPU's own dequantizing path, weight-only); --model smollm2 is the shipped SmolLM2-135M-Instruct (its Q4_1 GGUF dequantized:
"bf16" here means those weights in bf16).
"""
from __future__ import annotations

import contextlib
import math
import os
import time

import torch
from common import Report, checkpoint_from_args, make_parser, parse_args, release_memory

from asyncllm import LLM, SamplingParams
from asyncllm.layers import fp8_linear
from asyncllm.runner import model_runner

TEXT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "declaration_of_independence.txt")
# the reference first; float32 shows what rounding alone moves (bf16's own distance from fp32)
# (KV FP8 rotates q and k by a Hadamard matrix, Config.kv_cache_rotation's default; the row before it does not)
CONFIGS = [("bf16", {}), ("float32", {"dtype": "float32"}), ("weights FP8", {"quantization": "fp8"}),
           ("weights FP8 weight-only", {"quantization": "fp8_weight_only"}),
           ("KV FP8 unrotated", {"kv_cache_dtype": "fp8", "kv_cache_rotation": False}),
           ("KV FP8", {"kv_cache_dtype": "fp8"}), ("weights + KV FP8", {"quantization": "fp8", "kv_cache_dtype": "fp8"})]


@contextlib.contextmanager
def recorded_prompt_logits(rows: list[torch.Tensor]):
    """Every prompt position's logits the runner scores (model_runner.gather_logprobs's input), as
    float32 log-softmax rows on the host, in step order."""
    original = model_runner.gather_logprobs

    def recording(logits, targets, num_top):
        rows.append(torch.log_softmax(logits.float(), -1).cpu())
        return original(logits, targets, num_top)
    model_runner.gather_logprobs = recording
    try:
        yield
    finally:
        model_runner.gather_logprobs = original


def teacher_forced(llm: LLM, token_ids: list[int]) -> torch.Tensor:
    """(len - 1, vocab) log-probabilities of each next token given the text before it."""
    rows: list[torch.Tensor] = []
    with recorded_prompt_logits(rows):
        llm.generate([token_ids], SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)
    logprobs = torch.cat(rows)
    assert logprobs.shape[0] == len(token_ids) - 1, (logprobs.shape, len(token_ids))
    return logprobs


def compare(reference: torch.Tensor, logprobs: torch.Tensor, targets: torch.Tensor,
            settled: torch.Tensor | None) -> dict:
    """settled: the positions whose top-1 bf16 and float32 agree on (None: all), where a choice is not
    down to bf16's own rounding."""
    kl = (reference.exp() * (reference - logprobs)).sum(-1)
    agree = reference.argmax(-1) == logprobs.argmax(-1)
    return {"mean_kl": kl.mean().item(), "max_kl": kl.max().item(), "top1_agreement": agree.float().mean().item(),
            "top1_settled": agree[settled].float().mean().item() if settled is not None else None,
            "perplexity": math.exp(-logprobs.gather(1, targets[:, None]).mean().item())}


def main(argv=None) -> dict:
    parser = make_parser(__doc__)
    parser.add_argument("--model", default=None,
                        help="'smollm2' (the shipped SmolLM2-135M-Instruct) or a checkpoint directory / hub id; "
                             "default: random weights of --shape")
    parser.add_argument("--max-tokens", type=int, default=None, help="read only the text's first N tokens")
    parser.add_argument("--configs", default=None,
                        help=f"comma-separated subset of {[name for name, _ in CONFIGS]} (bf16 always runs)")
    parser.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    parser.add_argument("--cpu-fp8-path", action="store_true",
                        help="on CPU, FP8 weights take CPU's own path (dequantize, bf16 GEMM: weight-only) "
                             "rather than emulating CUDA's (W8A8 above 16 rows)")
    args = parse_args(parser, argv)
    report = Report("fp8_quality", args)
    wanted = None if args.configs is None else {name.strip() for name in args.configs.split(",")}
    with contextlib.ExitStack() as stack:
        if args.device == "cpu" and not args.cpu_fp8_path:
            stack.enter_context(fp8_linear.cuda_paths_on_cpu())
        if args.model == "smollm2":
            from asyncllm.models.default_model import default_model_path
            model = default_model_path()
        else:
            model = args.model or stack.enter_context(checkpoint_from_args(args))
        report.set("model", args.model or f"random {args.shape}")
        report.set("fp8_weight_path", "cpu (dequantize)" if args.device == "cpu" and args.cpu_fp8_path else "cuda's")
        with open(TEXT) as f:
            text = f.read()
        reference = targets = settled = None
        for name, options in CONFIGS:
            if name != "bf16" and wanted is not None and name not in wanted:
                continue
            start = time.perf_counter()
            llm = LLM(model, **{"dtype": "bfloat16", **options}, device=args.device, enable_prefix_caching=False,
                      enforce_eager=args.enforce_eager, max_model_len=4096)
            token_ids = llm.core.encode_prompt(text)[:args.max_tokens]
            logprobs = teacher_forced(llm, token_ids)
            llm.close()
            del llm
            release_memory()
            if reference is None:
                reference, targets = logprobs, torch.tensor(token_ids[1:])
            elif name == "float32":
                settled = reference.argmax(-1) == logprobs.argmax(-1)
            row = {"config": name, "tokens": len(token_ids), **compare(reference, logprobs, targets, settled),
                   "seconds": round(time.perf_counter() - start, 1)}
            report.add(row)
            print(row, flush=True)
    report.finish(f"FP8 quality, teacher-forced ({report.data['model']}, {args.device})",
                  [("config", "config"), ("tokens", "tokens"), ("mean KL vs bf16", "mean_kl", "{:.5f}"),
                   ("max KL", "max_kl", "{:.3f}"), ("top-1 agreement", "top1_agreement", "{:.2%}"),
                   ("top-1 where bf16 = fp32", "top1_settled", "{:.2%}"),
                   ("perplexity", "perplexity", "{:.3f}")])
    return report.data


if __name__ == "__main__":
    main()
