"""What a mixture-of-experts config asks for, read once and checked (each family spells it its own way).

Qwen3-MoE: num_experts, num_experts_per_tok, moe_intermediate_size, norm_topk_prob, and which layers
keep a dense MLP of intermediate_size (mlp_only_layers, decoder_sparse_step: a layer is sparse when
it is not listed and (index + 1) is a multiple of the step, as transformers' modeling code decides).
Mixtral: num_local_experts, num_experts_per_tok, experts of intermediate_size, always renormalised,
every layer sparse.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from asyncllm.config import model_file_error


@dataclass(frozen=True)
class MoESpec:
    num_experts: int
    top_k: int
    intermediate_size: int  # each expert's
    renormalize: bool  # the top-k probabilities rescaled to sum to 1
    sparse_layers: frozenset[int]  # the layers whose MLP is the expert block
    # checkpoint name fragments -> the model's: Mixtral's block_sparse_moe is the model's mlp
    intermediate_size_field: str = "moe_intermediate_size"  # config.json's name for intermediate_size
    checkpoint_renames: tuple[tuple[str, str], ...] = ()
    # an expert's projection in the checkpoint -> (the stacked parameter, part); see layers/moe.py
    expert_projections: tuple[tuple[str, tuple[str, int]], ...] = (
        ("gate_proj", ("gate_up_proj", 0)), ("up_proj", ("gate_up_proj", 1)), ("down_proj", ("down_proj", 0)))


MOE_ARCHITECTURES = ("Qwen3MoeForCausalLM", "MixtralForCausalLM")


def moe_spec(config, config_path: str = "config.json") -> MoESpec | None:
    """The config's MoESpec; None for a dense architecture. A missing or bad field is refused
    (model_file_error: Config.model's InvalidValueError, naming config_path and the field)."""
    architectures = getattr(config, "architectures", None) or []

    def positive_int(field_name: str, least: int = 1) -> int:
        value = getattr(config, field_name, None)
        if not isinstance(value, int) or isinstance(value, bool) or value < least:
            raise model_file_error(config_path, field_name, f"must be an integer >= {least}, got {value!r}")
        return value

    layers = config.num_hidden_layers
    if "Qwen3MoeForCausalLM" in architectures:
        num_experts = positive_int("num_experts", least=0)
        step = positive_int("decoder_sparse_step")
        dense = getattr(config, "mlp_only_layers", None) or []
        if not isinstance(dense, (list, tuple)) or not all(isinstance(i, int) and not isinstance(i, bool)
                                                            and 0 <= i < layers for i in dense):
            raise model_file_error(config_path, "mlp_only_layers",
                                   f"must be a list of layer indices below num_hidden_layers={layers}, "
                                   f"got {dense!r}")
        sparse = frozenset(i for i in range(layers) if i not in dense and (i + 1) % step == 0) \
            if num_experts > 0 else frozenset()
        # models/model_config.py has checked norm_topk_prob is a bool
        spec = MoESpec(num_experts, 0, 0, bool(getattr(config, "norm_topk_prob", False)), sparse)
    elif "MixtralForCausalLM" in architectures:
        if getattr(config, "sliding_window", None) is not None:
            raise model_file_error(config_path, "sliding_window",
                                   f"={config.sliding_window!r} is not supported: every layer here attends to "
                                   "the whole context (it must be null)")
        spec = MoESpec(positive_int("num_local_experts"), 0, 0, True, frozenset(range(layers)),
                       intermediate_size_field="intermediate_size",
                       checkpoint_renames=((".block_sparse_moe.", ".mlp."),),
                       expert_projections=(("w1", ("gate_up_proj", 0)), ("w3", ("gate_up_proj", 1)),
                                           ("w2", ("down_proj", 0))))
    else:
        return None
    if not spec.sparse_layers:  # no expert layer: the rest of the fields are never read
        return spec
    top_k = positive_int("num_experts_per_tok")
    if top_k > spec.num_experts:
        raise model_file_error(config_path, "num_experts_per_tok",
                               f"={top_k} is more than the {spec.num_experts} experts")
    return replace(spec, top_k=top_k, intermediate_size=positive_int(spec.intermediate_size_field))
