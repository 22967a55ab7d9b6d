"""The heap a process has when its first engine starts, frozen out of the cyclic collector's walks."""
from __future__ import annotations

import gc
import threading

_frozen = False
# two engines starting at once on two threads: without it both may freeze, the second freezing the
# first one's start-up objects for good (gc.freeze's price, below)
_lock = threading.Lock()


def freeze_startup_heap() -> None:
    """Move every object alive now (imported modules above all: hundreds of thousands of tracked
    objects) out of the cyclic collector's reach, once per process. A full collection walks the
    whole heap, and results that requests keep (one TokenLogprob per token with logprobs) trigger
    several, each walking again the imported modules, which almost all live as long as the process;
    frozen, they are left out of every walk. vLLM freezes its start-up heap the same way. Objects
    made later, the engines' own among them, stay collectable;
    the price is gc.freeze's: an object alive now that later becomes part of unreachable cycles is
    never collected (gc.unfreeze() gives the frozen objects back to the collector)."""
    global _frozen
    with _lock:
        if not _frozen:
            _frozen = True
            gc.collect()
            gc.freeze()
