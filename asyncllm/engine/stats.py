"""The engine core's figures for stats() and /metrics, read from its parts. Takes the EngineCore
(engine/core.py, which calls it; not imported here: a cycle)."""
from __future__ import annotations


def engine_stats(core) -> dict:
    """EngineCore.stats(): queue, KV blocks, prefix cache, preemptions, steps, and the latency policy."""
    bm = core.block_manager
    return {
        "num_waiting": len(core.scheduler.waiting),
        "num_running": len(core.scheduler.running),
        "num_free_blocks": bm.num_free_blocks,
        "num_total_blocks": bm.num_total_blocks,
        "block_size": bm.block_size,
        "prefix_cache_hit_rate": bm.prefix_cache_hit_rate,
        # cumulative prompt tokens: looked up in the prefix cache, and found there
        "prefix_cache_queries": bm.num_prefix_query_tokens,
        "prefix_cache_hits": bm.num_prefix_hit_tokens,
        "num_preemptions": core.scheduler.num_preemptions,
        "num_steps": core.num_steps,
        **_step_time_stats(core),
        # speculative decoding (engine/speculation.py): drafts verified and accepted; absent when off
        **(core.speculation.stats() if core.speculation is not None else {}),
    }


def _step_time_stats(core) -> dict:
    """The latency policy's state: its target, the last step's prefill budget and step time."""
    model, budget = core.step_model, core.step_budget
    last = core.last_step
    return {
        "target_step_ms": core.config.target_step_ms,
        # None without a target: prefill takes what the decodes leave of max_num_batched_tokens
        "prefill_budget": budget.last_budget if budget is not None else None,
        "step_ms": model.last_step_ms,
        # every step's device time so far (CUDA events; on CPU the forwards' wall time)
        "steps_total_s": core.step_timer.total_ms / 1e3,
        "predicted_step_ms": model.predict(*last) if model.ready and last is not None else None,
        "step_model": {"ms": model.a, "ms_per_prefill_token": model.b, "ms_per_decode": model.c}
        if model.ready else None,
    }

