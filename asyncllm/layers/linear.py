"""Linear layers split over tensor-parallel ranks (Megatron style).

Column-parallel layers split the output features, row-parallel ones the input features and sum
the partial products with one all-reduce. Each parameter carries a weight_loader that takes the
full checkpoint tensor and keeps this rank's shard, so loading needs no knowledge of the split.

keep_fp8() turns a layer's weight into float8_e4m3fn with a float32 weight_scale of one value per
output row and group of input columns (layers/fp8_linear.py); the scale has the same loaders, so it
is cut with its rows (and, in a row-parallel layer, with its column groups).
"""
from __future__ import annotations

import torch
from torch import nn

from asyncllm.distributed import all_reduce, get_tp_rank, get_tp_size
from asyncllm.layers import fp8_linear, skinny_linear


class WeightShapeError(ValueError):
    """A checkpoint tensor whose shape is not the one its parameter's layer expects. Raised by the
    weight loaders, which know the sharding; load_weights adds the tensor's name and file."""

    def __init__(self, expected: tuple[int, ...], got: tuple[int, ...]):
        super().__init__(f"expected shape {expected}, got {got}")
        self.expected, self.got = expected, got


def check_loaded_shape(loaded: torch.Tensor, expected) -> None:
    """The full (unsharded) checkpoint tensor must have exactly the expected shape: narrow() would
    silently cut a larger one and copy_() would broadcast a smaller one."""
    expected = tuple(int(n) for n in expected)
    if tuple(loaded.shape) != expected:
        raise WeightShapeError(expected, tuple(loaded.shape))


def _divide(numerator: int, denominator: int) -> int:
    assert numerator % denominator == 0, f"{numerator} is not divisible by {denominator}"
    return numerator // denominator


class LinearBase(nn.Module):
    def __init__(self, input_size: int, output_size: int, bias: bool, tp_dim: int | None):
        super().__init__()
        self.tp_dim = tp_dim
        self.tp_rank = get_tp_rank()
        self.tp_size = get_tp_size()
        self.weight = nn.Parameter(torch.empty(output_size, input_size), requires_grad=False)
        self.weight.weight_loader = self.weight_loader
        if bias:
            self.bias = nn.Parameter(torch.empty(output_size), requires_grad=False)
            self.bias.weight_loader = self.weight_loader
        else:
            self.register_parameter("bias", None)
        self.register_parameter("weight_scale", None)  # keep_fp8()'s
        self.group_k = None  # keep_fp8()'s: input columns per scale (None: one scale per row)
        self.fp8_w8a8 = True  # keep_fp8()'s: activations may be rounded to e4m3 above 16 rows

    def keep_fp8(self, group_k: int | None, w8a8: bool = True) -> None:
        """Hold the weight as float8_e4m3fn and a float32 scale per output row and group_k input
        columns (None: per row; w8a8: fp8_linear may take W8A8 above 16 rows), loaded as checkpoint tensors '<weight>' and '<weight>_scale' (models/fp8.py
        makes them so). A row-parallel shard must hold whole groups: the scales are cut between them."""
        out_features, in_features = self.weight.shape
        if group_k is not None and self.tp_dim == 1 and self.tp_size > 1 and in_features % group_k:
            raise ValueError(f"tensor_parallel_size={self.tp_size} splits {in_features * self.tp_size} input "
                             f"columns into {in_features} per rank, not a multiple of the FP8 weights' "
                             f"{group_k}-column scale blocks")
        groups = 1 if group_k is None else -(-in_features // group_k)
        shards = getattr(self.weight, "required_shards", None)
        device = self.weight.device
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=fp8_linear.FP8_DTYPE, device=device),
                                   requires_grad=False)
        self.weight_scale = nn.Parameter(torch.empty(out_features, groups, dtype=torch.float32, device=device),
                                         requires_grad=False)
        self.weight_scale.tp_replicated = group_k is None  # a per-row scale serves every column shard
        for param in (self.weight, self.weight_scale):
            param.weight_loader = self.weight_loader
            if shards is not None:
                param.required_shards = shards
        self.group_k, self.fp8_w8a8 = group_k, w8a8

    def require_shards(self, shard_ids) -> None:
        """A fused layer's parameters are loaded in parts (load_weights passes each one's shard id):
        whole only once every one of shard_ids has been."""
        for param in (self.weight, self.bias):
            if param is not None:
                param.required_shards = frozenset(shard_ids)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, *args) -> None:
        full_shape = list(param.shape)
        sharded = self.tp_dim is not None and param.dim() > self.tp_dim and self.tp_size > 1 \
            and not getattr(param, "tp_replicated", False)
        if sharded:
            full_shape[self.tp_dim] *= self.tp_size
        check_loaded_shape(loaded, full_shape)
        if sharded:
            shard = param.size(self.tp_dim)
            loaded = loaded.narrow(self.tp_dim, self.tp_rank * shard, shard)
        param.data.copy_(loaded)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.matmul(x, self.bias)

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if self.weight_scale is not None:
            return fp8_linear.linear(x, self.weight, self.weight_scale, self.group_k, bias, self.fp8_w8a8)
        return skinny_linear.linear(x, self.weight, bias)


class ColumnParallelLinear(LinearBase):
    def __init__(self, input_size: int, output_size: int, bias: bool = False):
        super().__init__(input_size, _divide(output_size, get_tp_size()), bias, tp_dim=0)


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel projections of one input in one matmul (e.g. gate and up)."""

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool = False):
        self.output_sizes = output_sizes
        super().__init__(input_size, sum(output_sizes), bias)
        self.require_shards(range(len(output_sizes)))

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: int) -> None:
        check_loaded_shape(loaded, (self.output_sizes[shard_id], *param.shape[1:]))
        offset = sum(self.output_sizes[:shard_id]) // self.tp_size
        size = self.output_sizes[shard_id] // self.tp_size
        target = param.data.narrow(0, offset, size)
        target.copy_(loaded.chunk(self.tp_size, 0)[self.tp_rank])


class QKVParallelLinear(ColumnParallelLinear):
    """Fused q, k and v projections. With fewer KV heads than ranks, KV heads are replicated."""

    def __init__(self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int, bias: bool = False):
        tp_size = get_tp_size()
        self.head_dim = head_dim
        self.total_num_heads, self.total_num_kv_heads = num_heads, num_kv_heads
        self.num_heads = _divide(num_heads, tp_size)
        self.num_kv_heads = max(1, num_kv_heads // tp_size)
        self.kv_replicas = max(1, tp_size // num_kv_heads)  # ranks that share one KV head
        output_size = (self.num_heads + 2 * self.num_kv_heads) * head_dim * tp_size
        super().__init__(hidden_size, output_size, bias)
        self.require_shards(("q", "k", "v"))

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: str) -> None:
        total_heads = self.total_num_heads if shard_id == "q" else self.total_num_kv_heads
        check_loaded_shape(loaded, (total_heads * self.head_dim, *param.shape[1:]))
        q_size = self.num_heads * self.head_dim
        kv_size = self.num_kv_heads * self.head_dim
        if shard_id == "q":
            offset, size, index = 0, q_size, self.tp_rank
        else:
            offset = q_size if shard_id == "k" else q_size + kv_size
            size, index = kv_size, self.tp_rank // self.kv_replicas
        param.data.narrow(0, offset, size).copy_(loaded.narrow(0, index * size, size))


class RowParallelLinear(LinearBase):
    def __init__(self, input_size: int, output_size: int, bias: bool = False):
        super().__init__(_divide(input_size, get_tp_size()), output_size, bias, tp_dim=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._reduce(self.matmul(x))

    def forward_silu_mul(self, x: torch.Tensor) -> torch.Tensor:
        """forward(silu(gate) * up) of x = [gate | up], this rank's shard of a merged gate/up
        projection's output: the MLP's down projection, in one kernel at decode's few rows."""
        if self.weight_scale is not None:
            return self._reduce(fp8_linear.silu_mul_linear(x, self.weight, self.weight_scale, self.group_k,
                                                           w8a8=self.fp8_w8a8))
        return self._reduce(skinny_linear.silu_mul_linear(x, self.weight))

    def _reduce(self, y: torch.Tensor) -> torch.Tensor:
        # the bias is added once, after the partial sums are reduced
        y = all_reduce(y)
        return y + self.bias if self.bias is not None else y
