"""Triton kernels: paged KV-cache store, paged attention (varlen prefill + split-KV decode).

Importing triton needs a GPU only to launch; with TRITON_INTERPRET=1 (set before this import) the
kernels run on CPU tensors through Triton's interpreter, which the CPU tests use.
"""
from asyncllm import settings


def _fix_interpreter_scalar_index() -> None:
    """Triton 3.6's interpreter turns a loaded scalar (a shape-(1,) array) into a Python int with
    int(array), which numpy >= 2.4 rejects, so `range(lo, hi)` with runtime bounds fails there
    (triton-lang/triton#9171). Interpreter only; compiled kernels never run this code."""
    try:
        from triton.runtime import interpreter
    except ImportError:
        return
    original = getattr(interpreter, "_patch_lang_tensor", None)
    if original is None or getattr(original, "_scalar_index_fixed", False):
        return

    def patched(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    patched._scalar_index_fixed = True
    interpreter._patch_lang_tensor = patched


# at import, so the interpreter is patched before any kernel module is imported and run
if settings.TRITON_INTERPRET.read():
    _fix_interpreter_scalar_index()

from asyncllm.kernels.kv_store import store_kvcache  # noqa: E402
from asyncllm.kernels.paged_attention import (choose_decode_tile, choose_num_splits,  # noqa: E402
                                              choose_prefill_splits, paged_attention, split_workspace_numel)


def compiled_variants() -> dict[str, int]:
    """How many compiled variants each launched Triton kernel of ours holds, over all devices.

    A count that grows while serving means JIT compiles on the hot path (the benchmarks report
    it). Empty under the interpreter, which compiles nothing."""
    import importlib

    import triton
    counts = {}
    for module_name in ("paged_attention", "kv_store", "fused_ops", "logits_ops", "skinny_gemm", "sampling_filters",
                        "fused_moe", "skinny_moe", "moe_router"):
        module = importlib.import_module(f"asyncllm.kernels.{module_name}")
        for name, obj in vars(module).items():
            if isinstance(obj, triton.runtime.JITFunction):
                count = sum(len(caches[0]) for caches in obj.device_caches.values())
                if count:  # launched at least once (helpers inlined into kernels never are)
                    counts[name] = count
    return counts


__all__ = ["store_kvcache", "paged_attention", "choose_num_splits", "choose_prefill_splits", "choose_decode_tile",
           "split_workspace_numel", "compiled_variants"]
