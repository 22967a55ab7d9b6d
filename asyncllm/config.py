"""Engine settings: one dataclass whose fields are checked on construction, and nothing more.

The model the settings name is read by models/resolve.py (resolve_config), a step the engine takes:
a hub id downloaded, a .gguf file converted, the checkpoint's config loaded, max_model_len and dtype
'auto' settled. Nothing here imports torch (the command line builds its options from these fields
and answers --help without it); torch is imported where a field needs it (device 'auto' or 'cuda').
"""
from __future__ import annotations

import os
import re
import sys
from dataclasses import dataclass, field
from typing import Any

from asyncllm.errors import InvalidValueError
from asyncllm.validation import FieldChecks, is_int, short_repr

DTYPES = ("float32", "float16", "bfloat16")  # models/resolve.py maps them to torch dtypes
_DTYPE_ALIASES = {"float": "float32", "half": "float16"}  # as vLLM accepts them
ATTENTION_BACKENDS = ("auto", "torch", "triton", "fa4", "fa2")
# Config.quantization: how weights are kept ("fp8" on an unquantized checkpoint: the dense linear weights
# quantized to FP8 per output channel at load and kept so; models/fp8.py, layers/fp8_linear.py;
# "fp8_weight_only": the same weights, never W8A8: activations stay in the compute dtype at every batch)
QUANTIZATIONS = (None, "fp8", "fp8_weight_only")
KV_CACHE_DTYPES = ("auto", "fp8")  # auto: the compute dtype
# how a model marks its reasoning (engine/reasoning_format.py defines each: its tags, where a block starts)
REASONING_PARSERS = ("qwen3", "deepseek_r1")
# ORG/NAME, as the Hugging Face hub spells repository ids (letters, digits, '-', '_', '.'; 96 at most)
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]{0,95}/[A-Za-z0-9][\w.-]{0,95}", re.ASCII)


def is_hub_id(model: str) -> bool:
    """Whether a model that is no local path has the shape of a Hugging Face hub id, ORG/NAME."""
    return bool(_HUB_ID.fullmatch(model)) and ".." not in model and not model.endswith(".gguf")


_fail = FieldChecks("Config")


def config_error(field_name: str, message: str) -> InvalidValueError:
    return _fail.error(field_name, message)


def model_file_error(path: str, setting: str, reason: str) -> InvalidValueError:
    """A setting of the model's own files that is refused (config.json's head_dim, its
    quantization_config.fmt): an error of Config.model, as every loading error is, naming the file and
    the setting. reason: "=<value> ..." follows the setting directly, anything else after a space
    ("Config.model: /m/config.json: head_dim=7 must be even: ...")."""
    return config_error("model", f"{path}: {setting}{'' if reason.startswith('=') else ' '}{reason}")


def _dtype_name(dtype) -> str:
    """'auto' or one of DTYPES, from a name, an alias or a torch.dtype."""
    torch = sys.modules.get("torch")  # a torch.dtype exists only once torch is imported
    if torch is not None and isinstance(dtype, torch.dtype):
        name = str(dtype).removeprefix("torch.")
        if name in DTYPES:
            return name
    elif isinstance(dtype, str):
        name = _DTYPE_ALIASES.get(dtype, dtype)
        if name == "auto" or name in DTYPES:
            return name
    _fail("dtype", f"must be 'auto', one of {sorted(DTYPES)} (or {sorted(_DTYPE_ALIASES)}), or the torch.dtype "
                   f"of one of them, got {dtype!r}")


# ---- speculative_config, in vLLM's shape, checked into a SpeculativeConfig -----------------------
#   {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max": n, "prompt_lookup_min": m}
#   {"model": draft_checkpoint_dir, "num_speculative_tokens": k}   (a draft model: speculative/draft_model.py)
# proposals verified per row and step: each is a query row of the target's forward, and a draft
# longer than this is almost never accepted whole
MAX_SPECULATIVE_TOKENS = 16
MAX_PROMPT_LOOKUP = 64  # the longest n-gram prompt lookup matches (its cost grows with it)
SPECULATIVE_KEYS = ("method", "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min", "model")
SPECULATIVE_METHODS = ("ngram", "draft_model")
# vLLM's other methods: named here so that a vLLM user's setting gets "not yet", not "unknown"
SPECULATIVE_NOT_YET = {"eagle": "EAGLE heads", "eagle3": "EAGLE-3 heads", "mtp": "MTP layers", "medusa": "Medusa heads"}


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str  # "ngram" (prompt lookup) or "draft_model" (a smaller checkpoint with the same tokenizer)
    num_speculative_tokens: int  # the most draft tokens a row verifies per step
    prompt_lookup_min: int  # ngram: the shortest suffix of the tokens so far that a match must have
    prompt_lookup_max: int  # ngram: the longest suffix tried first
    model: str | None = None  # draft_model: the draft checkpoint's directory or hub id


def parse_speculative_config(value, fail: FieldChecks, field: str = "speculative_config"
                             ) -> SpeculativeConfig | None:
    """value (None, or a dict in vLLM's shape) checked; refusals name f"{field}.<key>"."""
    if value is None:
        return None
    if not isinstance(value, dict):
        fail(field, f"expected None or a dict such as {{'method': 'ngram', 'num_speculative_tokens': 4}}, "
                    f"got {short_repr(value)}")
    for key in value:
        if key not in SPECULATIVE_KEYS:
            fail(f"{field}.{key}", f"unknown key; the keys are {SPECULATIVE_KEYS}")
    method = value.get("method")
    if method is None:
        method = "draft_model" if "model" in value else None
        if method is None:
            fail(f"{field}.method", f"missing: one of {SPECULATIVE_METHODS} (or 'model': a draft checkpoint)")
    if not isinstance(method, str) or method not in SPECULATIVE_METHODS and method not in SPECULATIVE_NOT_YET:
        fail(f"{field}.method", f"must be one of {SPECULATIVE_METHODS}, got {short_repr(method)}")
    k = value.get("num_speculative_tokens")
    if not is_int(k) or not 1 <= k <= MAX_SPECULATIVE_TOKENS:
        fail(f"{field}.num_speculative_tokens",
             f"expected an int in [1, {MAX_SPECULATIVE_TOKENS}], got {short_repr(k)}")
    if method == "draft_model":
        model = value.get("model")
        if not isinstance(model, str) or not model:
            fail(f"{field}.model", f"expected a draft checkpoint's directory or hub id, got {short_repr(model)}")
        if not os.path.exists(model) and not is_hub_id(model):
            fail(f"{field}.model", f"{model!r} does not exist, and is not a Hugging Face hub id (ORG/NAME)")
    elif "model" in value and method != "draft_model":
        fail(f"{field}.model", f"is for method 'draft_model' (a draft checkpoint), not {method!r}")
    if method in SPECULATIVE_NOT_YET:
        fail(f"{field}.method", f"{method!r}: {SPECULATIVE_NOT_YET[method]}: not yet (only 'ngram', prompt lookup, "
                                f"and 'draft_model' are built)")
    lookup_max, lookup_min = value.get("prompt_lookup_max"), value.get("prompt_lookup_min")
    for key, n in (("prompt_lookup_max", lookup_max), ("prompt_lookup_min", lookup_min)):
        if n is not None and (not is_int(n) or not 1 <= n <= MAX_PROMPT_LOOKUP):
            fail(f"{field}.{key}", f"expected None or an int in [1, {MAX_PROMPT_LOOKUP}], got {short_repr(n)}")
    # vLLM's defaults: both 5 when neither is given, else the one given for the other
    if lookup_max is None and lookup_min is None:
        lookup_max = lookup_min = 5
    lookup_max = lookup_min if lookup_max is None else lookup_max
    lookup_min = lookup_max if lookup_min is None else lookup_min
    if lookup_min > lookup_max:
        fail(f"{field}.prompt_lookup_min", f"must be <= prompt_lookup_max ({lookup_max}), got {lookup_min}")
    return SpeculativeConfig(method, k, lookup_min, lookup_max, value.get("model"))


# the int fields: the least value each takes (None: checked on its own below) and what that least means
_INT_FIELDS = {
    "max_num_batched_tokens": (1, ""), "max_num_seqs": (1, ""), "max_model_len": (1, ""),
    "tensor_parallel_size": (1, ""), "cpu_kvcache_bytes": (1, ""), "kvcache_block_size": (None, ""),
    "num_kvcache_blocks": (None, ""), "seed": (0, ""), "max_queued_requests": (0, "0 = unbounded"),
    "cuda_graph_max_tokens": (0, "0 = CUDA graphs for decode steps only"),
}


@dataclass
class Config:
    model: str  # a checkpoint directory, a .gguf file, or a Hugging Face hub id (ORG/NAME)
    # a hub id's branch, tag or commit (None: main); safetensors only, downloaded into the hub's cache
    revision: str | None = None
    max_num_batched_tokens: int = 16384
    max_num_seqs: int = 512
    max_model_len: int = 4096
    gpu_memory_utilization: float = 0.9
    tensor_parallel_size: int = 1
    enforce_eager: bool = False
    # steps with prefill chunks of up to this many tokens replay CUDA graphs too (where the attention
    # backend supports it); 0 = decode steps only. Clamped to max_num_batched_tokens.
    cuda_graph_max_tokens: int = 2048
    kvcache_block_size: int = 256
    num_kvcache_blocks: int = -1  # -1: sized from free GPU memory, or from cpu_kvcache_bytes on CPU
    cpu_kvcache_bytes: int = 1 << 30
    # auto: float32 on CPU; on GPU the checkpoint's dtype, bfloat16 for a .gguf file (models/resolve.py's
    # auto_torch_dtype); stored as its name
    dtype: str | torch.dtype = "auto"
    device: str = "auto"  # auto: cuda when present, else cpu
    enable_prefix_caching: bool = True
    attention_backend: str = "auto"
    seed: int = 0
    max_queued_requests: int = 0  # async engine only; 0 = unbounded
    # launch step N+1 before reading step N's sampled tokens, so the host's work for a step runs while
    # the device computes the previous one. None: on where the device runs asynchronously (CUDA)
    overlap_scheduling: bool | None = None
    # latency under load: while streams decode, a step takes prefill chunks only up to what keeps it
    # within this many ms, by a step-time model learned from the engine's own steps
    # (engine/step_budget.py). None or 0: throughput first, prefill takes all that max_num_batched_tokens
    # leaves. LLM's default is None; AsyncLLMEngine's is STREAMING_TARGET_STEP_MS
    target_step_ms: float | None = None
    # the model writes its reasoning in tags before its answer (<think>...</think>): outputs carry it
    # apart from the answer (out.reasoning; the server's reasoning_content), and a grammar applies
    # to the answer. None: the text holds everything
    reasoning_parser: str | None = None
    # None: weights as the checkpoint has them (an FP8 checkpoint's dense linear weights stay FP8); "fp8":
    # an unquantized checkpoint's dense decoder linear weights quantized to FP8 per output channel at load,
    # multiplied above 16 rows as W8A8 (activations rounded to e4m3 per token: FP8 tensor cores, at a
    # quality cost: SmolLM2's mean KL 0.057 weight-only -> 0.092, docs/BENCHMARKS.md); "fp8_weight_only":
    # the same, or an FP8 checkpoint's weights, always multiplied with activations in the compute dtype
    quantization: str | None = None
    # "auto": the compute dtype; "fp8": float8_e4m3fn with a scale per tensor (attention/base.py's
    # FP8_KV_SCALES), half the bytes of bf16 a token, so twice the blocks (Triton backend; emulated on CPU)
    kv_cache_dtype: str = "auto"
    # an FP8 KV cache's keys: each head's q and k times a Hadamard matrix after the rotary, before K is
    # stored (attention scores unchanged; K's outlier channels spread over the head before e4m3 rounds
    # it: SmolLM2's mean KL against bf16 0.028 -> 0.017). Needs a power-of-two head_dim; off for others
    kv_cache_rotation: bool = True
    # speculative decoding, vLLM's dict: {"method": "ngram", "num_speculative_tokens": k,
    # "prompt_lookup_max": n, "prompt_lookup_min": m}, or {"model": draft_dir, "num_speculative_tokens": k}
    # (SpeculativeConfig above); None: off
    speculative_config: dict | None = None
    # filled in from the checkpoint by models.resolve.resolve_config; not user settings
    hf_config: Any = field(default=None, repr=False, init=False)
    torch_dtype: torch.dtype | None = field(default=None, repr=False, init=False)
    kv_cache_torch_dtype: torch.dtype | None = field(default=None, repr=False, init=False)  # from kv_cache_dtype
    # speculative_config, checked (None: off)
    speculative: SpeculativeConfig | None = field(default=None, repr=False, init=False)

    def __post_init__(self) -> None:
        if not isinstance(self.model, (str, os.PathLike)):
            _fail("model", f"expected a path, got {type(self.model).__name__}")
        self.model = os.fspath(self.model)
        local = os.path.exists(self.model)
        if not local and not is_hub_id(self.model):
            _fail("model", f"{self.model!r} does not exist, and is not a Hugging Face hub id (ORG/NAME)")
        if self.revision is not None:
            if not isinstance(self.revision, str) or not self.revision.strip():
                _fail("revision", f"expected a branch, tag or commit of the hub repository, or None; got "
                                  f"{self.revision!r}")
            if local:
                _fail("revision", f"is for a Hugging Face hub id; {self.model!r} is a local path")
        for name, (low, meaning) in _INT_FIELDS.items():
            value = getattr(self, name)
            _fail.expect_int(name, value)
            if low is not None and value < low:
                _fail(name, f"must be >= {low} ({meaning})" if meaning else f"must be >= {low}, got {value}")
        if self.seed >= 1 << 64:  # torch.manual_seed's range (and numpy's generator's: not negative)
            _fail("seed", f"must be below 2**64, got {self.seed}")
        bs = self.kvcache_block_size
        if not (16 <= bs <= 256 and bs & (bs - 1) == 0):
            _fail("kvcache_block_size", f"must be a power of two in [16, 256], got {bs}")
        if self.num_kvcache_blocks != -1 and self.num_kvcache_blocks < 1:
            _fail("num_kvcache_blocks", f"must be -1 (auto) or >= 1, got {self.num_kvcache_blocks}")
        if isinstance(self.gpu_memory_utilization, bool) or not isinstance(self.gpu_memory_utilization, (int, float)) \
                or not (0.0 < self.gpu_memory_utilization <= 1.0):
            _fail("gpu_memory_utilization", f"must be a number in (0, 1], got {self.gpu_memory_utilization!r}")
        for name in ("enforce_eager", "enable_prefix_caching", "kv_cache_rotation"):
            _fail.expect_bool(name, getattr(self, name))
        if self.overlap_scheduling is not None and not isinstance(self.overlap_scheduling, bool):
            _fail("overlap_scheduling", f"expected a bool or None (auto), got {self.overlap_scheduling!r}")
        if self.target_step_ms is not None:
            if isinstance(self.target_step_ms, bool) or not isinstance(self.target_step_ms, (int, float)) \
                    or not (0 <= self.target_step_ms < float("inf")):
                _fail("target_step_ms", f"must be None or a finite number of ms >= 0 (None or 0 = throughput "
                                        f"first), got {self.target_step_ms!r}")
            self.target_step_ms = float(self.target_step_ms) or None
        self.dtype = _dtype_name(self.dtype)
        if self.attention_backend not in ATTENTION_BACKENDS:
            _fail("attention_backend", f"must be one of {ATTENTION_BACKENDS}, got {self.attention_backend!r}")
        if self.reasoning_parser is not None and self.reasoning_parser not in REASONING_PARSERS:
            _fail("reasoning_parser", f"must be None or one of {REASONING_PARSERS}, got {self.reasoning_parser!r}")
        _fail.one_of("quantization", self.quantization, QUANTIZATIONS)
        _fail.one_of("kv_cache_dtype", self.kv_cache_dtype, KV_CACHE_DTYPES)
        if self.kv_cache_dtype == "fp8" and self.attention_backend in ("fa4", "fa2"):
            # FlashAttention reads an FP8 cache only with an FP8 query and descale tensors (FA3's path),
            # which these backends do not drive; the Triton kernels dequantize as they load
            _fail("kv_cache_dtype", f"'fp8' is not supported by attention_backend={self.attention_backend!r}; use "
                                    "attention_backend='triton' or 'auto' (or 'torch'), or kv_cache_dtype='auto'")
        self.speculative = parse_speculative_config(self.speculative_config, _fail)
        if self.speculative is not None and self.speculative.model is not None and self.tensor_parallel_size > 1:
            # the draft's runner is one rank's: under tensor parallelism its layers would shard over the group
            _fail("speculative_config.model", "a draft model under tensor_parallel_size > 1: not yet (use "
                                              "{'method': 'ngram', ...}, or tensor_parallel_size=1)")
        if self.device not in ("auto", "cpu", "cuda"):
            _fail("device", f"must be 'auto', 'cpu' or 'cuda', got {self.device!r}")
        if self.device != "cpu":
            import torch  # here, not at the top: importing this module (the command line's parser) must not
            cuda = torch.cuda.is_available()
            if self.device == "auto":
                self.device = "cuda" if cuda else "cpu"
            elif not cuda:
                _fail("device", "'cuda' was asked for but no CUDA device is available")
        if self.overlap_scheduling is None:
            # on CPU a forward returns when it is done: nothing to overlap, and results would come a step later
            self.overlap_scheduling = self.device == "cuda"
