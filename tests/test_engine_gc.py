"""The engine freezes the heap it starts on (gc.freeze), once, and stays collectable itself."""
import gc
import weakref

from asyncllm import LLM, SamplingParams

# on the CPU wherever it runs: a GPU engine here would hold the device's memory from the GPU tests after it
ENGINE_KW = dict(device="cpu", num_kvcache_blocks=16, kvcache_block_size=16, enforce_eager=True)


def test_startup_heap_is_frozen_and_an_engine_is_still_collected(tiny_qwen3):
    llm = LLM(tiny_qwen3, **ENGINE_KW)
    assert gc.get_freeze_count() > 0  # modules and everything alive before the first engine
    frozen = gc.get_freeze_count()
    llm.generate(["hello"], SamplingParams(max_tokens=2, logprobs=2), use_tqdm=False)
    engine = weakref.ref(llm.core)
    kv_cache = weakref.ref(llm.core.runner.kv_cache)
    llm.close()
    del llm
    gc.collect()
    # made after the freeze: the engine, its model and its KV cache go with the last reference
    assert engine() is None and kv_cache() is None
    # a second engine freezes nothing more: its predecessors' objects are never pinned
    llm = LLM(tiny_qwen3, **ENGINE_KW)
    assert gc.get_freeze_count() <= frozen
    llm.close()
    del llm
    gc.collect()
