"""An engine's life between start and close: sleep() and wake(), and reload() of another checkpoint.

Each runs between requests, on the thread that drives the core (AsyncLLMEngine's engine thread,
between steps; LLM's caller, between generate() calls), and is refused (RuntimeError) while a
request is queued or running: wait for them (AsyncLLMEngine.wait_idle) or abort them first.

sleep(level) frees the device's memory without closing the engine; the levels are vLLM's (its sleep
mode): level 1 copies the weights to host memory (pinned; on CPU they stay) and drops the KV cache,
level 2 drops both, and wake() then reads the weights from the checkpoint again. Both also drop the
penalties' token-count slots. The CUDA graphs stay where the weights and cache are in stable memory
(runner/memory.py: the same addresses after wake); elsewhere sleep drops them and wake re-captures. A request
while asleep raises EngineAsleepError: a wake takes back the memory that sleep gave (to a trainer,
say) and takes seconds, so the application decides when, never a request. sleep() while asleep is a
RuntimeError; wake() while awake does nothing. wake() brings everything back with start-up's
decisions (as many KV blocks, the skinny-GEMM and decode-tuning choices): no model build, no memory
probe, no tuning, and at level 1 no weight file read; the KV cache is zeroed and the prefix cache
is empty. A sleep or wake that fails (host or device memory) leaves the engine as it was.

reload(model) swaps the checkpoint for another of the same structure (registry.model_structure:
architecture, shapes, rotary and norm constants) and max_model_len: its tensors are loaded into the
parameters in place, so the CUDA graphs stay valid; the prefix cache is emptied (its KV came from
the old weights) and the tokenizer, EOS ids and reasoning tags are the new checkpoint's. Another
structure is a ValueError naming what differs: it needs a new engine. A checkpoint that fails to
load leaves the engine on its own weights (read again from its checkpoint); where even those cannot
be read the engine cannot serve, and says so (EngineDeadError). prepare_reload does the slow part
(a hub download, the tokenizer) in the caller's thread, before the core is touched.

Tensor parallelism: none of the three (NotImplementedError): the worker ranks would have to do each
in lockstep.
"""
from __future__ import annotations

import dataclasses

from asyncllm.config import Config
from asyncllm.errors import (EngineAsleepError, EngineDeadError, EngineNotIdleError, InvalidTypeError,
                             InvalidValueError)
from asyncllm.models.checkpoint import check_tokenizer, checkpoint_weights
from asyncllm.models.tokenizer_loader import load_tokenizer
from asyncllm.models.registry import model_structure
from asyncllm.models.resolve import resolve_config
from asyncllm.runner.memory import SLEEP_LEVELS

# the functions take the EngineCore (engine/core.py), which calls them: not imported here (a cycle)


@dataclasses.dataclass(frozen=True)
class Checkpoint:
    """A checkpoint an engine can reload: its resolved config (the engine's options, its model) and
    its tokenizer, checked against it."""
    config: Config
    tokenizer: object


def check_sleep_level(level) -> int:
    if isinstance(level, bool) or not isinstance(level, int):
        raise InvalidTypeError("level", f"expected an int, got {type(level).__name__}")
    if level not in SLEEP_LEVELS:
        raise InvalidValueError("level", f"must be 1 (weights to host memory) or 2 (weights dropped), got {level}")
    return level


def prepare_reload(config: Config, model, revision: str | None = None) -> Checkpoint:
    """model (a directory, a .gguf file or a hub id, as the engine takes one) resolved with the
    engine's options and dtype, checked against the engine's model structure, and its tokenizer."""
    new = resolve_config(dataclasses.replace(config, model=model, revision=revision, dtype=config.torch_dtype))
    ours, theirs = model_structure(config.hf_config), model_structure(new.hf_config)
    differences = [f"{name} {theirs[name]!r} (the engine's: {ours[name]!r})" for name in ours
                   if theirs[name] != ours[name]]
    if new.max_model_len != config.max_model_len:
        differences.append(f"max_position_embeddings {new.max_model_len} (the engine's max_model_len: "
                           f"{config.max_model_len})")
    if differences:
        raise InvalidValueError("model", f"{new.model!r} is not the engine's model structure: "
                                f"{'; '.join(differences)}. reload() loads weights of the same structure in place; "
                                "another model needs a new engine")
    tokenizer = load_tokenizer(new.model)
    check_tokenizer(tokenizer, new.hf_config, new.model)
    return Checkpoint(new, tokenizer)


def sleep(core, level: int) -> None:
    level = check_sleep_level(level)
    _check_one_rank(core, "sleep")
    if core.sleep_level is not None:
        raise RuntimeError(f"sleep(): the engine is asleep already (level {core.sleep_level}); wake() it first")
    _check_idle(core, "sleep")
    core.runner.sleep(level)
    core.block_manager.reset_prefix_cache()  # the KV it points at is gone


def wake(core) -> None:
    _check_one_rank(core, "wake")
    if core.sleep_level is not None:
        core.runner.wake()


def reload(core, checkpoint: Checkpoint) -> None:
    _check_one_rank(core, "reload")
    if core.sleep_level is not None:
        raise EngineAsleepError("reload(): the engine is asleep; wake() it first")
    _check_idle(core, "reload")
    try:
        # in the engine's own weight layout (an FP8 checkpoint into an unquantized engine: dequantized)
        core.runner.load_checkpoint(checkpoint_weights(checkpoint.config, core.runner.weight_layout,
                                                        device=core.runner.device))
    except Exception as error:
        try:  # some parameters may hold the new checkpoint's tensors already
            core.runner.load_checkpoint(checkpoint_weights(core.config, core.runner.weight_layout,
                                                            device=core.runner.device))
        except Exception as restore_error:
            raise EngineDeadError(f"reload(): {checkpoint.config.model!r} failed to load ({error}), and the "
                                  f"engine's own weights could not be read back from {core.config.model!r} "
                                  f"({restore_error}): it cannot serve") from restore_error
        raise
    core.block_manager.reset_prefix_cache()  # its KV came from the old weights
    config = core.config  # in place: the engine's callers hold this object
    config.model, config.revision, config.hf_config = (checkpoint.config.model, checkpoint.config.revision,
                                                      checkpoint.config.hf_config)
    core.use_tokenizer(checkpoint.tokenizer)


def _check_idle(core, what: str) -> None:
    """No request queued or running; the steps still launched (with overlap, one whose requests all
    ended) are resolved first."""
    num_requests = max(len(core.requests), core.scheduler.num_unfinished)
    if num_requests:
        raise EngineNotIdleError(f"{what}(): {num_requests} request(s) queued or running; it runs between requests "
                           "(wait for them, e.g. AsyncLLMEngine.wait_idle(), or abort them first)")
    core.drain()


def _check_one_rank(core, what: str) -> None:
    if core.config.tensor_parallel_size > 1:
        raise NotImplementedError(f"{what}(): not supported with tensor parallelism (tensor_parallel_size="
                                  f"{core.config.tensor_parallel_size}): the worker ranks would have to follow")
