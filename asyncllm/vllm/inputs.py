"""What vLLM's entry points take, as the native API takes it: prompts (a string, {"prompt": ...},
{"prompt_token_ids": [...]}) and engine arguments (vLLM's names mapped onto Config's fields)."""
from __future__ import annotations

# vLLM engine argument -> the Config field it is
_RENAMED = {"block_size": "kvcache_block_size"}
# vLLM engine arguments asyncllm has no use for: accepted at the value that changes nothing here,
# refused (naming why) at any other
_NEUTRAL = {
    "trust_remote_code": (False, "asyncllm never runs a repository's code"),
    "tokenizer": (None, "the tokenizer is always the model directory's own"),
    "tokenizer_mode": ("auto", "the tokenizer is always transformers' fast one"),
    "skip_tokenizer_init": (False, "prompts are tokenized by the engine"),
    "load_format": ("auto", "weights are read from safetensors only"),
}
# (task / runner: an engine both generates and embeds, whichever vLLM's model runner is asked for)
_IGNORED = ("disable_log_stats", "enable_log_requests", "disable_log_requests", "swap_space", "max_logprobs",
            "task", "runner")


def engine_options(options: dict) -> dict:
    """vLLM's engine arguments as asyncllm's engine options (Config's fields pass through; the rest
    is refused by make_config, which names the options it knows)."""
    native = {}
    for name, value in options.items():
        if name in _NEUTRAL:
            neutral, why = _NEUTRAL[name]
            if value != neutral and not (name == "load_format" and value == "safetensors"):
                raise ValueError(f"{name}={value!r}: not supported ({why}); leave it at {neutral!r}")
        elif name in _IGNORED:
            continue
        elif name == "seed" and value is None:
            continue  # vLLM's "no seed": the engine's default
        else:
            native[_RENAMED.get(name, name)] = value
    return native


class EngineArgs:
    """vLLM's EngineArgs: a model and engine arguments, kept as attributes until an engine is made."""

    def __init__(self, model: str | None = None, **options):
        self.model = model
        self.__dict__.update(options)


class AsyncEngineArgs(EngineArgs):
    """vLLM's AsyncEngineArgs (for AsyncLLM.from_engine_args)."""


def prompt_parts(prompt, argument: str = "prompt") -> tuple[str | None, str | list[int]]:
    """(the prompt's text, or None where it is token ids; what the native API takes: text or ids)."""
    if isinstance(prompt, str):
        return prompt, prompt
    if isinstance(prompt, dict):
        unsupported = sorted(set(prompt) - {"prompt", "prompt_token_ids"})
        if unsupported:
            raise ValueError(f"{argument}: {unsupported} not supported (text-only models; a prompt dict takes "
                             "'prompt' or 'prompt_token_ids')")
        if "prompt_token_ids" in prompt:
            return prompt.get("prompt"), prompt["prompt_token_ids"]
        if "prompt" in prompt:
            return prompt["prompt"], prompt["prompt"]
        raise ValueError(f"{argument}: a prompt dict needs 'prompt' (text) or 'prompt_token_ids'")
    if isinstance(prompt, (list, tuple)):
        return None, list(prompt)
    raise TypeError(f"{argument}: expected a string, a dict with 'prompt' or 'prompt_token_ids', or token ids; got "
                    f"{type(prompt).__name__}")


def prompt_list(prompts) -> list:
    """One prompt (a string, a dict, token ids) as a list of one; a list of prompts as it is."""
    if isinstance(prompts, (str, dict)) or (isinstance(prompts, (list, tuple)) and prompts
                                            and all(isinstance(t, int) for t in prompts)):
        return [prompts]
    if not isinstance(prompts, (list, tuple)):
        raise TypeError(f"prompts: expected a prompt or a list of prompts, got {type(prompts).__name__}")
    if not prompts:
        raise ValueError("prompts: the list is empty")
    return list(prompts)


def truncated(token_ids: list[int], keep: int | None, max_seq_len: int) -> list[int]:
    """The prompt's last `keep` tokens (SamplingParams.truncate_prompt_tokens; -1: max_seq_len)."""
    if keep is None:
        return token_ids
    keep = max_seq_len if keep == -1 else keep
    return token_ids[-keep:]
