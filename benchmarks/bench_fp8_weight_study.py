"""Where FP8 weights lose quality (issue 47): one bf16 engine, its decoder linear weights rounded
through FP8 in place, per layer type and scale granularity, with or without e4m3 activations.

    python benchmarks/bench_fp8_weight_study.py --model smollm2 --device cpu [--max-tokens 600] [--json PATH]
    python benchmarks/bench_fp8_weight_study.py --model smollm2 --device cpu --kv-scales   # the KV cache's instead

Every variant is teacher-forced over bench_fp8_quality.py's text and compared with the unmodified
engine's distributions (mean KL(bf16 || variant), top-1 agreement, perplexity), as that benchmark does.
A variant changes one engine's weights rather than loading a quantized one, so each costs one prefill:
- weights: each row's group of columns scaled to +-448, rounded to e4m3 (layers/fp8_linear.quantize_rows),
  multiplied back in float32 and rounded once to bf16 -- what the weight-only kernel computes with;
  "chan" one scale a row (Config(quantization="fp8")), "1x128" / "1x32" a scale per row and 128 / 32
  columns, "128x128" a checkpoint's blocks (models/fp8.quantize_blockwise); "int8 chan" the same bytes
  as int8 with a scale per row (amax / 127), for comparison;
- activations: each token's (row's) input to the layer rounded to e4m3 with amax / 448 (per token, the
  W8A8 path torch._scaled_mm takes above 16 rows), or per 128 columns of a token, then the product in
  float32 -- W8A8's arithmetic.
The embedding and LM head (tied in SmolLM2) stay in bf16 throughout, as in the engine.

--kv-scales: the KV cache's scale granularity instead. The engine keeps a bf16 cache but its q and k
rotated as an FP8 cache's are (Config.kv_cache_rotation), and K / V are rounded through e4m3 before
they are stored: with the engine's per-tensor scale 1.0, or a scale per token and head (amax / 448,
the finest a kernel could keep beside a block), which no per-head or per-layer scale can beat.
CPU only (it rounds the torch backend's stores).
"""
from __future__ import annotations

import contextlib
import time

import torch
import torch.nn.functional as F
from bench_fp8_quality import TEXT, compare, teacher_forced
from common import Report, checkpoint_from_args, make_parser, parse_args

from asyncllm import LLM
from asyncllm.attention import torch_ref
from asyncllm.attention.base import hadamard_matrix
from asyncllm.layers import skinny_linear
from asyncllm.layers.fp8_linear import dequantize_rows, quantize_rows
from asyncllm.models.fp8 import dequantize, quantize_blockwise

PROJECTIONS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")


def fp8_rows(group_k):
    def rounded(weight):
        quantized, scale = quantize_rows(weight, group_k)
        return dequantize_rows(quantized, scale, group_k, torch.float32)
    return rounded


def fp8_blocks(weight):
    return dequantize(*quantize_blockwise(weight, (128, 128)), (128, 128))


def int8_rows(weight):
    scale = (weight.abs().amax(-1, keepdim=True) / 127).clamp_min(1e-30)
    return (weight / scale).round().clamp(-127, 127) * scale


def e4m3_activations(group_k):
    def rounded(x):
        flat = x.float().reshape(-1, x.shape[-1])
        quantized, scale = quantize_rows(flat, group_k)
        return dequantize_rows(quantized, scale, group_k, torch.float32).view(x.shape)
    return rounded


ALL = PROJECTIONS
# (label, weight rounding or None, activation rounding or None, the projections it applies to)
VARIANTS = [
    ("weights e4m3 chan, weight-only (CPU's path, decode's kernel)", fp8_rows(None), None, ALL),
    ("  only q/k/v", fp8_rows(None), None, ("qkv_proj",)),
    ("  only o", fp8_rows(None), None, ("o_proj",)),
    ("  only gate/up", fp8_rows(None), None, ("gate_up_proj",)),
    ("  only down", fp8_rows(None), None, ("down_proj",)),
    ("weights e4m3 1x128 groups, weight-only", fp8_rows(128), None, ALL),
    ("weights e4m3 1x32 groups, weight-only", fp8_rows(32), None, ALL),
    ("weights e4m3 128x128 blocks, weight-only", fp8_blocks, None, ALL),
    ("weights int8 chan, weight-only (same bytes)", int8_rows, None, ALL),
    ("W8A8: weights chan, activations per token (CUDA above 16 rows)", fp8_rows(None), e4m3_activations(None), ALL),
    ("activations per token only (weights bf16)", None, e4m3_activations(None), ALL),
    ("activations 1x128 groups only (weights bf16)", None, e4m3_activations(128), ALL),
    ("W8A8: weights 1x128, activations 1x128 groups", fp8_rows(128), e4m3_activations(128), ALL),
]


def e4m3_per_tensor(x):
    return x.float().clamp(-448, 448).to(torch.float8_e4m3fn).float()


def e4m3_per_token_head(x):  # (tokens, heads, head_dim)
    scale = (x.float().abs().amax(-1, keepdim=True) / 448).clamp_min(1e-12)
    return (x.float() / scale).clamp(-448, 448).to(torch.float8_e4m3fn).float() * scale


def unrounded(x):
    return x


# (label, K rounding, V rounding)
KV_VARIANTS = [("bf16 cache, q/k rotated (no FP8)", unrounded, unrounded),
               ("K, V per tensor, scale 1 (the engine's FP8 cache)", e4m3_per_tensor, e4m3_per_tensor),
               ("K per token and head, V per tensor", e4m3_per_token_head, e4m3_per_tensor),
               ("K, V per token and head", e4m3_per_token_head, e4m3_per_token_head)]


@contextlib.contextmanager
def rounded_kv_stores(k_rounding, v_rounding):
    """The torch backend's K/V stores, each rounded through e4m3 first (the cache itself stays bf16)."""
    original = torch_ref.store_kvcache_torch

    def store(k, v, k_cache, v_cache, slot_mapping, kv_scales=(1.0, 1.0)):
        return original(k_rounding(k).to(k.dtype), v_rounding(v).to(v.dtype), k_cache, v_cache, slot_mapping,
                        kv_scales)
    torch_ref.store_kvcache_torch = store
    try:
        yield
    finally:
        torch_ref.store_kvcache_torch = original


def kv_rows(llm, token_ids, reference, targets) -> list[dict]:
    backend = llm.core.runner.attn_backend
    head_dim = llm.core.runner.model.model.layers[0].self_attn.head_dim
    backend.qk_rotation = hadamard_matrix(head_dim, backend.k_caches[0].device)
    rows = []
    for label, k_rounding, v_rounding in KV_VARIANTS:
        with rounded_kv_stores(k_rounding, v_rounding):
            rows.append({"variant": label, "tokens": len(token_ids),
                         **compare(reference, teacher_forced(llm, token_ids), targets, None)})
        print(rows[-1], flush=True)
    backend.qk_rotation = None
    return rows


class RoundedLinears:
    """The engine's decoder projections, with their bf16 weights kept aside to restore."""

    def __init__(self, model):
        self.layers = [(name, module, module.weight.data.clone()) for name, module in model.named_modules()
                       if name.endswith(PROJECTIONS)]

    def apply(self, weight_rounding, activation_rounding, projections) -> None:
        for name, module, original in self.layers:
            module.__dict__.pop("matmul", None)
            module.__dict__.pop("forward_silu_mul", None)
            chosen = name.endswith(projections)
            module.weight.data.copy_(weight_rounding(original.float()).to(original.dtype)
                                     if chosen and weight_rounding is not None else original)
            if chosen and activation_rounding is not None:
                module.matmul = self._w8a8(module, activation_rounding)
                if hasattr(module, "forward_silu_mul"):  # the MLP's down projection takes SwiGLU's output
                    module.forward_silu_mul = lambda x, m=module: m._reduce(m.matmul(skinny_linear.silu_and_mul(x)))

    @staticmethod
    def _w8a8(module, activation_rounding):
        def matmul(x, bias=None):
            out = F.linear(activation_rounding(x), module.weight.float(), None if bias is None else bias.float())
            return out.to(x.dtype)
        return matmul


def main(argv=None) -> dict:
    parser = make_parser(__doc__)
    parser.add_argument("--model", default=None, help="'smollm2' (the shipped SmolLM2-135M-Instruct) or a checkpoint "
                                                       "directory; default: random weights of --shape")
    parser.add_argument("--max-tokens", type=int, default=None, help="read only the text's first N tokens")
    parser.add_argument("--kv-scales", action="store_true", help="the KV cache's scale granularity instead")
    args = parse_args(parser, argv)
    if args.kv_scales and args.device != "cpu":
        raise SystemExit("--kv-scales rounds the torch backend's stores: --device cpu")
    report = Report("fp8_weight_study", args)
    with contextlib.ExitStack() as stack:
        if args.model == "smollm2":
            from asyncllm.models.default_model import default_model_path
            model = default_model_path()
        else:
            model = args.model or stack.enter_context(checkpoint_from_args(args))
        report.set("model", args.model or f"random {args.shape}")
        llm = LLM(model, dtype="bfloat16", device=args.device, enable_prefix_caching=False, enforce_eager=True,
                  max_model_len=4096)
        with open(TEXT) as f:
            token_ids = llm.core.encode_prompt(f.read())[:args.max_tokens]
        linears = RoundedLinears(llm.core.runner.model)
        reference = teacher_forced(llm, token_ids)
        targets = torch.tensor(token_ids[1:])
        for row in kv_rows(llm, token_ids, reference, targets) if args.kv_scales else ():
            report.add(row)
        for label, weight_rounding, activation_rounding, projections in () if args.kv_scales else VARIANTS:
            start = time.perf_counter()
            linears.apply(weight_rounding, activation_rounding, projections)
            row = {"variant": label, "tokens": len(token_ids),
                   **compare(reference, teacher_forced(llm, token_ids), targets, None),
                   "seconds": round(time.perf_counter() - start, 1)}
            report.add(row)
            print(row, flush=True)
        llm.close()
    report.finish(f"FP8 {'KV cache' if args.kv_scales else 'weights'}: where the loss is ({report.data['model']}, {args.device})",
                  [("variant", "variant"), ("mean KL vs bf16", "mean_kl", "{:.5f}"), ("max KL", "max_kl", "{:.3f}"),
                   ("top-1 agreement", "top1_agreement", "{:.2%}"), ("perplexity", "perplexity", "{:.3f}")])
    return report.data


if __name__ == "__main__":
    main()
