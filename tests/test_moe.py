"""Mixture-of-experts models (issue 48) against HF transformers on the same tiny random weights (CPU,
float32): Qwen3-MoE (renormalised and not, dense layers by mlp_only_layers and decoder_sparse_step)
and Mixtral through LLM.generate with chunked prefill and prefix-cache hits -- greedy tokens equal,
and the logits of every step equal to HF's teacher-forced forward over the same tokens. Then the
expert layer against a per-token loop, and broken expert checkpoints and configs refused by name.
Tensor parallelism of the experts is in tests/test_tensor_parallel.py."""
from __future__ import annotations

import json
import os

import pytest
import torch

from asyncllm import LLM, SamplingParams
from asyncllm.errors import InvalidValueError
from asyncllm.layers.moe import SparseMoeBlock, route
from asyncllm.models.checkpoint import iter_safetensors, load_hf_config, load_weights
from asyncllm.models.registry import create_model
from asyncllm.testing import build_tiny_checkpoint
from helpers import assert_all_blocks_free, generate_with_logits, seed_every_test

_seed = seed_every_test(0)

VOCAB = 4096  # a small vocabulary: fast CPU steps (the tokenizer is cut to fit)
MAX_TOKENS = 10
# ids only (no tokenizer needed); lengths around the 16-token blocks; the last two share a 32-token prefix
_g = torch.Generator().manual_seed(48)
PROMPTS = [torch.randint(10, VOCAB, (n,), generator=_g).tolist() for n in (1, 7, 17, 40)]
PROMPTS += [PROMPTS[3][:32] + [11, 12, 13], PROMPTS[3][:32] + [21, 22]]

VARIANTS = {
    # Qwen3-30B-A3B routes this way: top-k probabilities renormalised to 1; layer 1 keeps a dense MLP
    "qwen3_moe-norm-mlp_only": ("qwen3_moe", dict(norm_topk_prob=True, mlp_only_layers=[1])),
    # no renormalisation; decoder_sparse_step=2: layer 0 dense, layer 1 experts
    "qwen3_moe-raw-sparse_step": ("qwen3_moe", dict(norm_topk_prob=False, decoder_sparse_step=2)),
    "mixtral": ("mixtral", {}),
}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory, tokenizer_dir):
    built = {}

    def get(variant: str) -> str:
        if variant not in built:
            arch, overrides = VARIANTS[variant]
            built[variant] = build_tiny_checkpoint(str(tmp_path_factory.mktemp(variant)), arch, tokenizer_dir,
                                                   seed=4, vocab_size=VOCAB, **overrides)
        return built[variant]
    return get


def hf_model(model_dir: str):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_greedy_tokens_and_teacher_forced_logits_match_hf(checkpoints, variant):
    model_dir = checkpoints(variant)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    # chunks of at most 16 tokens; prefix caching on (the default); on the CPU, where float32 is exact
    # enough for 1e-4 (the GPU's fused experts in bf16: tests/test_fused_moe.py)
    with LLM(model_dir, device="cpu", num_kvcache_blocks=64, kvcache_block_size=16,
             max_num_batched_tokens=16) as llm:
        layers = llm.core.runner.model.model.layers
        sparse = [type(layer.mlp).__name__ == "SparseMoeBlock" for layer in layers]
        assert sparse == {"qwen3_moe-norm-mlp_only": [True, False], "qwen3_moe-raw-sparse_step": [False, True],
                          "mixtral": [True, True]}[variant]
        tokens, logits = generate_with_logits(llm, PROMPTS, params)
        # again: the shared prefix and the first run's prompts now come from the prefix cache
        again = [o["token_ids"] for o in llm.generate(PROMPTS, params, use_tqdm=False)]
        assert llm.core.block_manager.prefix_cache_hit_rate > 0
        assert_all_blocks_free(llm)
    assert again == tokens
    model = hf_model(model_dir)
    with torch.inference_mode():
        for prompt, ours, our_logits in zip(PROMPTS, tokens, logits):
            expected = model.generate(torch.tensor([prompt]), max_new_tokens=MAX_TOKENS, do_sample=False,
                                      eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
            assert ours == expected
            # teacher-forced: one forward over prompt + our tokens; row len(prompt) - 1 + i chose token i
            forced = model(torch.tensor([prompt + ours])).logits[0, len(prompt) - 1:-1]
            torch.testing.assert_close(torch.stack(our_logits), forced, rtol=1e-4, atol=1e-4)


# ---- the layer ------------------------------------------------------------------------------------
def per_token_reference(block: SparseMoeBlock, x: torch.Tensor) -> torch.Tensor:
    """The definition, one token and one choice at a time."""
    weights, ids = route(x @ block.gate.weight.T, block.top_k, block.renormalize)
    out = torch.zeros_like(x)
    for t in range(x.size(0)):
        for k in range(block.top_k):
            e = ids[t, k]
            gate, up = (block.experts.gate_up_proj[e] @ x[t]).chunk(2)
            out[t] += weights[t, k] * (block.experts.down_proj[e] @ (torch.nn.functional.silu(gate) * up))
    return out


@pytest.mark.parametrize("renormalize", [True, False])
@pytest.mark.parametrize("num_tokens", [1, 5, 64])
def test_the_expert_block_is_the_per_token_weighted_sum(renormalize, num_tokens):
    block = SparseMoeBlock(hidden_size=32, num_experts=8, top_k=3, intermediate_size=24, renormalize=renormalize)
    for p in block.parameters():
        p.data.normal_(0, 0.3)
    x = torch.randn(num_tokens, 32)
    weights, ids = route(block.gate(x), 3, renormalize)
    assert ids.unique().numel() > min(3, num_tokens)  # the routing really spreads over several experts
    if renormalize:
        torch.testing.assert_close(weights.sum(-1), torch.ones(num_tokens))
    torch.testing.assert_close(block(x), per_token_reference(block, x), rtol=1e-5, atol=1e-5)


def test_routing_is_softmax_over_all_experts_then_top_k():
    logits = torch.tensor([[0.0, 1.0, 2.0, 3.0]])
    weights, ids = route(logits, 2, renormalize=False)
    probs = logits.softmax(-1)
    assert ids.tolist() == [[3, 2]]
    torch.testing.assert_close(weights, probs[:, [3, 2]])
    weights, _ = route(logits, 2, renormalize=True)
    torch.testing.assert_close(weights, probs[:, [3, 2]] / probs[:, [3, 2]].sum())


# ---- broken checkpoints and configs ----------------------------------------------------------------
def changed(model_dir: str, drop=(), change=None, add=()):
    for name, tensor, *source in iter_safetensors(model_dir):
        if name in drop:
            continue
        yield name, (change(name, tensor) if change else tensor), *source
    yield from add


def load(model_dir: str, weights):
    load_weights(create_model(load_hf_config(model_dir)), weights)


@pytest.mark.parametrize("variant, name", [
    ("qwen3_moe-norm-mlp_only", "model.layers.0.mlp.experts.3.up_proj.weight"),
    ("qwen3_moe-norm-mlp_only", "model.layers.0.mlp.experts.7.down_proj.weight"),
    ("mixtral", "model.layers.1.block_sparse_moe.experts.5.w3.weight"),
])
def test_a_missing_expert_tensor_is_named(checkpoints, variant, name):
    model_dir = checkpoints(variant)
    with pytest.raises(ValueError, match="checkpoint is missing weights") as info:
        load(model_dir, changed(model_dir, drop={name}))
    assert name in str(info.value), str(info.value)


def test_a_missing_router_is_named(checkpoints):
    model_dir = checkpoints("mixtral")
    with pytest.raises(ValueError, match=r"missing weights: \['model.layers.0.mlp.gate.weight'\]"):
        load(model_dir, changed(model_dir, drop={"model.layers.0.block_sparse_moe.gate.weight"}))


def test_a_mis_shaped_expert_tensor_is_named_with_both_shapes(checkpoints):
    model_dir, name = checkpoints("qwen3_moe-norm-mlp_only"), "model.layers.0.mlp.experts.2.gate_proj.weight"
    with pytest.raises(ValueError, match=rf"'{name}' in .*model.safetensors has shape \(128, 64\), but .* "
                                         r"expects \(128, 128\)"):
        load(model_dir, changed(model_dir, change=lambda n, t: t[:, :64] if n == name else t))


def test_an_expert_beyond_num_experts_is_refused(checkpoints):
    model_dir = checkpoints("qwen3_moe-norm-mlp_only")
    extra = ("model.layers.0.mlp.experts.8.up_proj.weight", torch.zeros(128, 128))
    with pytest.raises(ValueError, match=r"experts.8.up_proj.weight' has no place .*fewer experts"):
        load(model_dir, changed(model_dir, add=[extra]))


def test_an_expert_loaded_twice_is_refused(checkpoints):
    # the stacked form (transformers 5's in-memory name) beside the per-expert tensors it stacks
    model_dir = checkpoints("qwen3_moe-norm-mlp_only")
    stacked = ("model.layers.0.mlp.experts.down_proj", torch.zeros(8, 128, 128))
    with pytest.raises(ValueError, match=r"experts.0.down_proj.weight' .*loads the same weights as "
                                         r"'model.layers.0.mlp.experts.down_proj'"):
        load(model_dir, [stacked, *changed(model_dir)])


def test_experts_stored_stacked_load_like_per_expert_ones(checkpoints):
    model_dir = checkpoints("qwen3_moe-norm-mlp_only")
    reference = create_model(load_hf_config(model_dir))
    load_weights(reference, iter_safetensors(model_dir))
    tensors = {name: tensor for name, tensor, _ in iter_safetensors(model_dir)}
    prefix = "model.layers.0.mlp.experts"
    gate_up = torch.stack([torch.cat([tensors[f"{prefix}.{e}.gate_proj.weight"], tensors[f"{prefix}.{e}.up_proj.weight"]])
                           for e in range(8)])
    down = torch.stack([tensors[f"{prefix}.{e}.down_proj.weight"] for e in range(8)])
    stacked = [(n, t) for n, t in tensors.items() if ".experts." not in n]
    model = create_model(load_hf_config(model_dir))
    load_weights(model, [*stacked, (f"{prefix}.gate_up_proj", gate_up), (f"{prefix}.down_proj", down)])
    for (name, ours), (_, theirs) in zip(model.named_parameters(), reference.named_parameters()):
        assert torch.equal(ours, theirs), name


def _with_config(model_dir: str, tmp_path, **changes) -> str:
    out = tmp_path / "changed"
    out.mkdir()
    for name in os.listdir(model_dir):
        os.link(os.path.join(model_dir, name), out / name)
    os.unlink(out / "config.json")
    with open(os.path.join(model_dir, "config.json")) as f:
        config = json.load(f)
    config.update(changes)
    (out / "config.json").write_text(json.dumps(config))
    return str(out)


@pytest.mark.parametrize("variant, changes, message", [
    ("qwen3_moe-norm-mlp_only", dict(num_experts_per_tok=9), r"num_experts_per_tok=9 is more than the 8 experts"),
    ("qwen3_moe-norm-mlp_only", dict(num_experts_per_tok=0), r"num_experts_per_tok must be an integer >= 1"),
    ("qwen3_moe-norm-mlp_only", dict(moe_intermediate_size=None), r"moe_intermediate_size must be an integer >= 1"),
    ("qwen3_moe-norm-mlp_only", dict(mlp_only_layers=[2]), r"mlp_only_layers must be a list of layer indices"),
    ("qwen3_moe-norm-mlp_only", dict(decoder_sparse_step=0), r"decoder_sparse_step must be an integer >= 1"),
    ("qwen3_moe-norm-mlp_only", dict(norm_topk_prob="yes"), r"norm_topk_prob must be true or false, got 'yes'"),
    ("mixtral", dict(num_local_experts=0), r"num_local_experts must be an integer >= 1"),
    ("mixtral", dict(sliding_window=4096), r"sliding_window=4096 is not supported"),
])
def test_a_bad_moe_config_field_is_refused_by_name(checkpoints, tmp_path, variant, changes, message):
    model_dir = _with_config(checkpoints(variant), tmp_path, **changes)
    with pytest.raises(InvalidValueError, match=r"config.json: " + message) as info:
        LLM(model_dir, num_kvcache_blocks=8, kvcache_block_size=16)
    assert (info.value.owner, info.value.field) == ("Config", "model")  # a loading error, as the others
