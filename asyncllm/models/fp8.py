"""FP8 checkpoints, dequantized at load: the format config.json's quantization_config declares, and
the stream of checkpoint tensors with each FP8 weight replaced by its dequantized float32 tensor.

Formats (quant_method "fp8", fmt "e4m3", the weights torch.float8_e4m3fn):
- block-wise (weight_block_size [bm, bn]; Qwen3-*-FP8, DeepSeek-V3): `<name>_scale_inv`, float32 of
  shape (ceil(out/bm), ceil(in/bn)), one factor per bm x bn block (the last row/column of blocks may be
  partial); weight = fp8 * factor. Despite the name the factor multiplies, as in transformers and vLLM.
- per-tensor or per-channel (no weight_block_size): `<name>_scale`, shape () / (1,), or (out,) / (out, 1).
Static activation scales (`<name-without-weight>input_scale`) are read past: weights are computed in the
compute dtype here, so nothing quantizes activations.

A weight is dequantized as it streams by, before load_weights places it, so a fused (q/k/v, gate/up)
or sharded parameter receives each part already in float. Config(quantization="fp8") on a checkpoint
that is not FP8 rounds every decoder linear weight through the same block-wise format
(quantize_blockwise, then dequantize): FP8 weights' quality, emulated, until FP8 GEMM kernels exist.
"""
from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch

FP8_MAX = 448.0  # float8_e4m3fn's largest finite value
EMULATION_BLOCK = (128, 128)  # Config(quantization="fp8"): the block of Qwen's and DeepSeek's checkpoints
_FP8_DTYPES = tuple(getattr(torch, name) for name in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz",
                                                      "float8_e5m2fnuz") if hasattr(torch, name))


@dataclass(frozen=True)
class Fp8Format:
    block: tuple[int, int] | None  # None: per-tensor or per-channel scales
    static_activations: bool  # the checkpoint carries input_scale tensors (read past)

    @property
    def scale_suffix(self) -> str:
        return "_scale_inv" if self.block else "_scale"


def fp8_format(hf_config, config_path: str) -> Fp8Format | None:
    """The checkpoint's FP8 format from config.json's quantization_config (None: not quantized); any
    other quantization is refused, naming the field."""
    spec = getattr(hf_config, "quantization_config", None)
    if spec is None:
        return None
    if not isinstance(spec, dict):
        spec = spec.to_dict() if hasattr(spec, "to_dict") else None
    if spec is None:
        raise ValueError(f"{config_path}: quantization_config must be a JSON object")

    def fail(field_name: str, message: str):  # message: "=<value> ..." or " must ..."
        raise ValueError(f"{config_path}: quantization_config.{field_name}{message}")

    method = spec.get("quant_method")
    if method != "fp8":
        fail("quant_method", f"={method!r} is not supported: asyncllm loads 'fp8' checkpoints (block-wise, "
                             "per-tensor or per-channel scales) and unquantized ones")
    fmt = spec.get("fmt", "e4m3")
    if fmt != "e4m3":
        fail("fmt", f"={fmt!r} is not supported: only 'e4m3' (torch.float8_e4m3fn) weights")
    scheme = spec.get("activation_scheme", "dynamic")
    if scheme not in ("dynamic", "static"):
        fail("activation_scheme", f"={scheme!r} is not supported: 'dynamic' or 'static'")
    block = spec.get("weight_block_size")
    if block is not None:
        if not (isinstance(block, (list, tuple)) and len(block) == 2
                and all(isinstance(b, int) and not isinstance(b, bool) and b >= 1 for b in block)):
            fail("weight_block_size", f" must be two integers >= 1 ([rows, columns] of a block) or null, got {block!r}")
        block = tuple(block)
    return Fp8Format(block, scheme == "static")


def is_fp8(tensor: torch.Tensor) -> bool:
    return tensor.dtype in _FP8_DTYPES


def dequantized(weights: Iterable[tuple], fmt: Fp8Format) -> Iterator[tuple]:
    """(name, tensor, *file) as they come, but each FP8 weight, once its scale has come too (before or
    after it, in any shard), as (name, float32 weight, *file); the scales themselves are consumed. An
    FP8 weight without its scale, a scale without its FP8 weight, a scale of the wrong shape or with a
    non-finite value are ValueErrors naming the tensor and file."""
    suffix = fmt.scale_suffix
    other_suffix = "_scale" if fmt.block else "_scale_inv"
    waiting_weights: dict[str, tuple] = {}  # an FP8 weight whose scale has not come yet
    waiting_scales: dict[str, tuple] = {}  # a scale (by its weight's name) whose weight has not come yet
    for name, tensor, *source in weights:
        if name.endswith(".input_scale"):
            if fmt.static_activations:
                continue
            raise ValueError(f"checkpoint tensor {name!r}{_where(source)} is a static activation scale, but "
                             "config.json's quantization_config.activation_scheme is 'dynamic'")
        if name.endswith(suffix):
            weight_name = name[:-len(suffix)]
            if weight_name in waiting_weights:
                quantized, source = waiting_weights.pop(weight_name)
                yield (weight_name, _dequantize_checked(weight_name, quantized, tensor, fmt, source), *source)
            else:
                waiting_scales[weight_name] = (tensor, source)
        elif name.endswith("weight" + other_suffix):
            raise ValueError(f"checkpoint tensor {name!r}{_where(source)}: config.json's quantization_config "
                             f"{_describe(fmt)} asks for '<weight>{suffix}' scales, not '{other_suffix}'")
        elif is_fp8(tensor):
            if name in waiting_scales:
                scale, _ = waiting_scales.pop(name)
                yield (name, _dequantize_checked(name, tensor, scale, fmt, source), *source)
            else:
                waiting_weights[name] = (tensor, source)
        else:
            if name in waiting_scales:
                _unscaled(name, tensor, source)
            yield (name, tensor, *source)
    if waiting_weights:
        name, (tensor, source) = next(iter(waiting_weights.items()))
        raise ValueError(f"checkpoint tensor {name!r}{_where(source)} is {_dtype(tensor)} but the checkpoint has no "
                         f"{name + suffix!r} to scale it ({len(waiting_weights)} such weight(s))")
    if waiting_scales:
        name, (_, source) = next(iter(waiting_scales.items()))
        raise ValueError(f"checkpoint tensor {name + suffix!r}{_where(source)} scales {name!r}, which is not an "
                         "FP8 tensor of the checkpoint")


def _unscaled(name: str, tensor: torch.Tensor, source: list) -> None:
    raise ValueError(f"checkpoint tensor {name!r}{_where(source)} is {_dtype(tensor)}, yet the checkpoint has a "
                     "scale for it: only FP8 weights are scaled")


def _dequantize_checked(name: str, quantized: torch.Tensor, scale: torch.Tensor, fmt: Fp8Format,
                        source: list) -> torch.Tensor:
    if quantized.dtype != torch.float8_e4m3fn:
        raise ValueError(f"checkpoint tensor {name!r}{_where(source)} is {_dtype(quantized)}: "
                         "quantization_config.fmt 'e4m3' means float8_e4m3fn")
    if quantized.dim() < 2:
        raise ValueError(f"checkpoint tensor {name!r}{_where(source)} is FP8 with shape {tuple(quantized.shape)}: "
                         "only weight matrices are quantized")
    expected = scale_shapes(quantized.shape, fmt.block)
    if tuple(scale.shape) not in expected:
        shown = " or ".join(map(str, expected))
        raise ValueError(f"checkpoint tensor {name + fmt.scale_suffix!r}{_where(source)} has shape "
                         f"{tuple(scale.shape)}, but {name!r} of shape {tuple(quantized.shape)} "
                         f"{_describe(fmt)} needs {shown}")
    if not scale.is_floating_point() or not bool(torch.isfinite(scale).all()):
        raise ValueError(f"checkpoint tensor {name + fmt.scale_suffix!r}{_where(source)} must hold finite floats "
                         f"(it is {_dtype(scale)}{'' if not scale.is_floating_point() else ', with inf or NaN'})")
    return dequantize(quantized, scale, fmt.block)


def scale_shapes(shape, block: tuple[int, int] | None) -> list[tuple]:
    """The scale shapes a weight of `shape` may have: per block, or per tensor / per output channel."""
    *lead, rows, cols = shape
    if block:
        return [(*lead, -(-rows // block[0]), -(-cols // block[1]))]
    return [(), (1,), (*lead, rows), (*lead, rows, 1)]


def dequantize(quantized: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] | None) -> torch.Tensor:
    """quantized (FP8, the last two dims a weight matrix) times its scales, in float32."""
    weight = quantized.to(torch.float32)
    scale = scale.to(torch.float32)
    if block:
        return weight * _per_element(scale, block, *weight.shape[-2:])
    if scale.numel() == 1:
        return weight * scale.reshape(())
    return weight * scale.reshape(*weight.shape[:-1], 1)


def _per_element(scale: torch.Tensor, block: tuple[int, int], rows: int, cols: int) -> torch.Tensor:
    """Block scales repeated over their blocks' elements, the partial last blocks cut to the weight."""
    factor = scale.repeat_interleave(block[0], dim=-2)[..., :rows, :]
    return factor.repeat_interleave(block[1], dim=-1)[..., :cols]


def quantize_blockwise(weight: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(float8_e4m3fn weight, float32 scales of shape (ceil(rows/bm), ceil(cols/bn))): each block's
    largest magnitude maps to FP8_MAX, as Qwen's and DeepSeek's checkpoints are made."""
    *lead, rows, cols = weight.shape
    block_rows, block_cols = -(-rows // block[0]), -(-cols // block[1])
    padded = torch.zeros(*lead, block_rows * block[0], block_cols * block[1], dtype=torch.float32)
    padded[..., :rows, :cols] = weight.to(torch.float32)
    blocks = padded.reshape(*lead, block_rows, block[0], block_cols, block[1])
    amax = blocks.abs().amax(dim=(-3, -1))
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))  # an all-zero block stays zero
    quantized = weight.to(torch.float32) / _per_element(scale, block, rows, cols)
    return quantized.clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn), scale


def is_decoder_linear_weight(name: str, tensor: torch.Tensor) -> bool:
    """What Config(quantization="fp8") rounds through FP8: the decoder layers' projection matrices
    (attention, MLP, experts), not the embedding, the LM head, norms or a mixture-of-experts router
    (its scores pick experts: FP8 checkpoints keep it unquantized too)."""
    return tensor.dim() >= 2 and ".layers." in name and not name.endswith("gate.weight")


def rounded_through_fp8(weights: Iterable[tuple]) -> Iterator[tuple]:
    """The checkpoint's decoder linear weights quantized block-wise to FP8 and dequantized again, in
    float32 (Config(quantization="fp8") on an unquantized checkpoint); everything else as it comes."""
    for name, tensor, *source in weights:
        if is_decoder_linear_weight(name, tensor) and tensor.is_floating_point():
            tensor = dequantize(*quantize_blockwise(tensor, EMULATION_BLOCK), EMULATION_BLOCK)
        yield (name, tensor, *source)


def _where(source: list) -> str:
    return f" in {source[0]}" if source else ""


def _dtype(tensor: torch.Tensor) -> str:
    return str(tensor.dtype).removeprefix("torch.")


def _describe(fmt: Fp8Format) -> str:
    return f"(weight_block_size={list(fmt.block)})" if fmt.block else "(per-tensor or per-channel scales)"
