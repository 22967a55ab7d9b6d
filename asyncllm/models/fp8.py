"""FP8 weights at load: the format config.json's quantization_config declares, and the streams of
checkpoint tensors that load_weights takes, FP8 weights kept in FP8 or dequantized.

Formats (quant_method "fp8", fmt "e4m3", the weights torch.float8_e4m3fn):
- block-wise (weight_block_size [bm, bn]; Qwen3-*-FP8, DeepSeek-V3): `<name>_scale_inv`, float32 of
  shape (ceil(out/bm), ceil(in/bn)), one factor per bm x bn block (the last row/column of blocks may be
  partial); weight = fp8 * factor. Despite the name the factor multiplies, as in transformers and vLLM.
- per-tensor or per-channel (no weight_block_size): `<name>_scale`, shape () / (1,), or (out,) / (out, 1).
Static activation scales (`<name-without-weight>input_scale`) are read past: weights are computed in the
compute dtype here, so nothing quantizes activations.

An engine on an FP8 checkpoint, or with Config(quantization="fp8"), keeps its decoder's linear
layers' weights in FP8 (fp8_layout; layers/fp8_linear.py computes with them): the stream
(resident_fp8) gives each such weight as '<name>' (float8_e4m3fn) and '<name>_scale' (float32, one
scale per output row and group of input columns), which the layers' loaders fuse and shard as rows.
A checkpoint's block scales are repeated over their blocks' rows, its FP8 bytes kept as they are;
an unquantized checkpoint's weights are quantized per output channel: every row its own scale,
which a fused or sharded layer cuts with its rows and torch._scaled_mm applies directly (W8A8 at
large batch), unlike 128-column groups. Mixture-of-experts experts and the router are dequantized
(the experts' kernel computes in the compute dtype): an unquantized checkpoint's experts are
rounded through block-wise FP8 (quantize_blockwise, then dequantize), FP8 quality emulated.
An engine without an FP8 layout (reload() of an FP8 checkpoint into an unquantized engine) takes
every FP8 weight dequantized (dequantized).
"""
from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch

from asyncllm.config import model_file_error
from asyncllm.layers.fp8_linear import FP8_MAX, fp8_scales, quantize_rows

EMULATION_BLOCK = (128, 128)  # an unquantized checkpoint's experts: the block of Qwen's and DeepSeek's checkpoints
_FP8_DTYPES = tuple(getattr(torch, name) for name in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz",
                                                      "float8_e5m2fnuz") if hasattr(torch, name))


@dataclass(frozen=True)
class Fp8Format:
    block: tuple[int, int] | None  # None: per-tensor or per-channel scales
    static_activations: bool  # the checkpoint carries input_scale tensors (read past)

    @property
    def scale_suffix(self) -> str:
        return "_scale_inv" if self.block else "_scale"


_UNSET = object()  # checkpoint_weights' layout argument, not given


@dataclass(frozen=True)
class Fp8Layout:
    """How an engine keeps its decoder linear weights in FP8: a float32 scale per output row and group_k
    input columns (None: per row); w8a8: above 16 rows the activations may be rounded to e4m3 for an
    FP8 tensor-core GEMM (False: Config(quantization="fp8_weight_only"), never)."""
    group_k: int | None
    w8a8: bool = True


def fp8_layout(hf_config, quantization: str | None, config_path: str) -> Fp8Layout | None:
    """The layout of an engine's FP8 weights: an FP8 checkpoint's own groups (its blocks' columns, or
    per row for per-tensor / per-channel scales), per row for Config(quantization="fp8") on an
    unquantized checkpoint; None: unquantized weights."""
    fmt = fp8_format(hf_config, config_path)
    w8a8 = quantization != "fp8_weight_only"
    if fmt is not None:
        return Fp8Layout(fmt.block[1] if fmt.block else None, w8a8)
    return Fp8Layout(None, w8a8) if quantization in ("fp8", "fp8_weight_only") else None


def keeps_fp8(name: str, tensor: torch.Tensor) -> bool:
    """A checkpoint tensor that an engine with an FP8 layout holds in FP8: a dense decoder linear
    layer's weight (no expert's, no router's)."""
    return tensor.dim() == 2 and is_decoder_linear_weight(name, tensor) and ".experts." not in name


def keep_linear_weights_fp8(model, layout: Fp8Layout) -> None:
    """Turn the model's dense decoder linear layers (those keeps_fp8 names) to FP8 storage, before loading."""
    for module_name, module in model.named_modules():
        weight = getattr(module, "weight", None)
        if hasattr(module, "keep_fp8") and weight is not None and keeps_fp8(module_name + ".weight", weight):
            module.keep_fp8(layout.group_k, layout.w8a8)


def fp8_format(hf_config, config_path: str) -> Fp8Format | None:
    """The checkpoint's FP8 format from config.json's quantization_config (None: not quantized); any
    other quantization is refused, naming the field."""
    spec = getattr(hf_config, "quantization_config", None)
    if spec is None:
        return None
    if not isinstance(spec, dict):
        spec = spec.to_dict() if hasattr(spec, "to_dict") else None
    if spec is None:
        raise model_file_error(config_path, "quantization_config", "must be a JSON object")

    setting = "quantization_config."
    method = spec.get("quant_method")
    if method != "fp8":
        raise model_file_error(config_path, setting + "quant_method",
                               f"={method!r} is not supported: asyncllm loads 'fp8' checkpoints (block-wise, "
                               "per-tensor or per-channel scales) and unquantized ones")
    fmt = spec.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise model_file_error(config_path, setting + "fmt",
                               f"={fmt!r} is not supported: only 'e4m3' (torch.float8_e4m3fn) weights")
    scheme = spec.get("activation_scheme", "dynamic")
    if scheme not in ("dynamic", "static"):
        raise model_file_error(config_path, setting + "activation_scheme",
                               f"={scheme!r} is not supported: 'dynamic' or 'static'")
    block = spec.get("weight_block_size")
    if block is not None:
        if not (isinstance(block, (list, tuple)) and len(block) == 2
                and all(isinstance(b, int) and not isinstance(b, bool) and b >= 1 for b in block)):
            raise model_file_error(config_path, setting + "weight_block_size",
                                   f"must be two integers >= 1 ([rows, columns] of a block) or null, got {block!r}")
        block = tuple(block)
    return Fp8Format(block, scheme == "static")


def is_fp8(tensor: torch.Tensor) -> bool:
    return tensor.dtype in _FP8_DTYPES


def dequantized(weights: Iterable[tuple], fmt: Fp8Format) -> Iterator[tuple]:
    """(name, tensor, *file) as they come, but each FP8 weight as (name, float32 weight, *file)."""
    for name, tensor, scale, *source in _paired(weights, fmt):
        yield (name, tensor if scale is None else dequantize(tensor, scale, fmt.block), *source)


def resident_fp8(weights: Iterable[tuple], fmt: Fp8Format | None, layout: Fp8Layout,
                 device: torch.device | None = None) -> Iterator[tuple]:
    """What an engine with an FP8 layout loads: each weight keeps_fp8 names as (name, float8_e4m3fn,
    *file) and (name + "_scale", float32 (rows, groups), *file); an FP8 checkpoint's bytes as they are
    where its groups are the layout's, else (reload() of another format) dequantized and quantized
    again. The other FP8 weights dequantized, an unquantized checkpoint's experts rounded through FP8.
    device: where weights are quantized (the model's: an 8B checkpoint's passes over float32 copies take
    tens of seconds on a CPU)."""
    same_groups = fmt is not None and (fmt.block[1] if fmt.block else None) == layout.group_k
    for name, tensor, scale, *source in _paired(weights, fmt) if fmt is not None else \
            ((name, tensor, None, *source) for name, tensor, *source in weights):
        if keeps_fp8(name, tensor) and (scale is not None or tensor.is_floating_point()):
            if scale is not None and same_groups:
                quantized, row_scale = tensor, _row_scales(scale, fmt.block, tensor.shape[0])
            else:
                weight = tensor if scale is None else dequantize(tensor, scale, fmt.block)
                quantized, row_scale = quantize_rows(weight.to(device) if device is not None else weight,
                                                     layout.group_k)
            yield (name, quantized, *source)
            yield (name + "_scale", row_scale, *source)
        elif scale is not None:
            yield (name, dequantize(tensor, scale, fmt.block), *source)
        elif fmt is None and is_decoder_linear_weight(name, tensor) and tensor.is_floating_point():
            yield (name, dequantize(*quantize_blockwise(tensor, EMULATION_BLOCK), EMULATION_BLOCK), *source)
        else:
            yield (name, tensor, *source)


def _row_scales(scale: torch.Tensor, block: tuple[int, int] | None, rows: int) -> torch.Tensor:
    """A checkpoint's scales as one per output row (and column block): (rows, groups) float32."""
    scale = scale.to(torch.float32)
    if block:
        return scale.repeat_interleave(block[0], dim=0)[:rows].contiguous()
    return scale.reshape(-1, 1).expand(rows, 1).contiguous() if scale.numel() == 1 else scale.reshape(rows, 1)


def _paired(weights: Iterable[tuple], fmt: Fp8Format) -> Iterator[tuple]:
    """(name, tensor, None, *file) as they come, but each FP8 weight, once its scale has come too
    (before or after it, in any shard), as (name, FP8 weight, its scale, *file); the scales are not
    passed on by themselves. An FP8 weight without its scale, a scale without its FP8 weight, a scale
    of the wrong shape or with a non-finite value are ValueErrors naming the tensor and file."""
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
                _check_pair(weight_name, quantized, tensor, fmt, source)
                yield (weight_name, quantized, tensor, *source)
            else:
                waiting_scales[weight_name] = (tensor, source)
        elif name.endswith("weight" + other_suffix):
            raise ValueError(f"checkpoint tensor {name!r}{_where(source)}: config.json's quantization_config "
                             f"{_describe(fmt)} asks for '<weight>{suffix}' scales, not '{other_suffix}'")
        elif is_fp8(tensor):
            if name in waiting_scales:
                scale, _ = waiting_scales.pop(name)
                _check_pair(name, tensor, scale, fmt, source)
                yield (name, tensor, scale, *source)
            else:
                waiting_weights[name] = (tensor, source)
        else:
            if name in waiting_scales:
                _unscaled(name, tensor, source)
            yield (name, tensor, None, *source)
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


def _check_pair(name: str, quantized: torch.Tensor, scale: torch.Tensor, fmt: Fp8Format, source: list) -> None:
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
    scale = fp8_scales(amax)  # an all-zero block stays zero
    quantized = weight.to(torch.float32) / _per_element(scale, block, rows, cols)
    return quantized.clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn), scale


def is_decoder_linear_weight(name: str, tensor: torch.Tensor) -> bool:
    """What Config(quantization="fp8") rounds through FP8: the decoder layers' projection matrices
    (attention, MLP, experts), not the embedding, the LM head, norms or a mixture-of-experts router
    (its scores pick experts: FP8 checkpoints keep it unquantized too)."""
    return tensor.dim() >= 2 and ".layers." in name and not name.endswith("gate.weight")


def _where(source: list) -> str:
    return f" in {source[0]}" if source else ""


def _dtype(tensor: torch.Tensor) -> str:
    return str(tensor.dtype).removeprefix("torch.")


def _describe(fmt: Fp8Format) -> str:
    return f"(weight_block_size={list(fmt.block)})" if fmt.block else "(per-tensor or per-channel scales)"
