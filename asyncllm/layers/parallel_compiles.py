"""Triton compiles in parallel, ahead of the launches that need them.

A Triton kernel compiles on its first launch with a new specialization (dtypes, constexprs, which
int arguments are 1 or multiples of 16), and the launch waits: on a fresh machine the start-up's
warm-ups and graph captures compiled some dozens of specializations one after another, most of a
cold start. Inside `parallel_compiles()`, a launch of a
kernel whose specialization is not compiled in this process does not run: the specialization is
recorded (Triton's jit_cache_hook, acting on this thread only: another engine's steps on other
threads launch as usual). On leaving the block every recorded one compiles on a thread pool (Triton's
AsyncCompileMode with JITFunction.preload: its LLVM passes and the ptxas subprocess of one kernel
overlap another's), each into its kernel's cache, where the next launch finds it. With Triton's
disk cache warm a "compile" is a read of the cached binary, so the block costs what it records.

The block is a dry run: what a skipped launch should have written holds whatever was there, so
the caller runs it on throwaway inputs, reads nothing it computed, and then runs the real thing
(the block's DryRun.missed says whether it skipped anything, so that a run that skipped nothing
need not be repeated). Code that times kernels (a tiling's choice) must not decide inside it:
in_dry_run() says when it is. Here, not in kernels/: it imports triton only when a block runs (CPU
users never import it).
"""
from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

logger = logging.getLogger("asyncllm")

MAX_COMPILE_THREADS = 16


class DryRun:
    def __init__(self):
        self.recorded: dict[tuple, tuple] = {}  # (kernel, key) -> (kernel, specialization data)
        self.missed = 0  # launches skipped, and decisions put off (note_put_off), in this block


_local = threading.local()


def in_dry_run() -> bool:
    """Whether this thread is inside parallel_compiles(): launches of uncompiled kernels are skipped."""
    return getattr(_local, "dry_run", None) is not None


def note_put_off() -> None:
    """Count something the dry run did not do as the real run will (a decision left for later)."""
    dry = getattr(_local, "dry_run", None)
    if dry is not None:
        dry.missed += 1


@contextlib.contextmanager
def parallel_compiles(max_threads: int | None = None) -> Iterator[DryRun]:
    """Within the block (on this thread), launches of Triton kernels not compiled yet are skipped and
    their specializations recorded; on leaving it, all of them compile at once on max_threads
    threads (None: the CPU count, at most MAX_COMPILE_THREADS). A compile that fails is left for
    the real launch, which raises it where it would have. Yields the DryRun, whose `missed` says,
    after the block, whether it skipped anything (an exception in the block is logged and counts as
    a miss: the real run raises it where it would have). Without triton, a plain block."""
    try:
        from triton import knobs
        from triton.runtime import _async_compile
    except ImportError:  # no triton (or one without these): nothing compiles ahead, nothing is skipped
        yield DryRun()
        return
    if in_dry_run():  # nested: the outer block compiles what this one records
        yield _local.dry_run
        return
    _install_hook(knobs)
    dry = _local.dry_run = DryRun()
    try:
        yield dry
    except Exception as e:  # noqa: BLE001 - a dry run is best effort: the real run does what it did not
        dry.missed += 1
        logger.warning("start-up: a dry run that gathers Triton compiles stopped early (the rest compile as "
                       "they launch): %s: %s", type(e).__name__, str(e)[:200])
    finally:
        _local.dry_run = None
    _compile_all(list(dry.recorded.values()), max_threads, _async_compile)


_foreign_hook = None  # a jit_cache_hook someone else had installed: asked on threads not in a dry run
_install_lock = threading.Lock()


def _record(*, key, fn, compile, **rest) -> bool | None:
    """Triton's jit_cache_hook, installed once for the process: called before each compile, it skips
    the compile (and the launch) where the calling thread is in a dry run, recording it instead."""
    dry = getattr(_local, "dry_run", None)
    if dry is None:
        return _foreign_hook(key=key, fn=fn, compile=compile, **rest) if _foreign_hook is not None else None
    kernel = fn.jit_function
    dry.recorded.setdefault((id(kernel), str(key)), (kernel, compile["specialization_data"]))
    dry.missed += 1
    return True


def _install_hook(knobs) -> None:
    # once, never removed: a hook put back at the end of a block would undo another thread's block
    global _foreign_hook
    with _install_lock:
        if knobs.runtime.jit_cache_hook is not _record:
            _foreign_hook = knobs.runtime.jit_cache_hook
            knobs.runtime.jit_cache_hook = _record


def _compile_all(recorded: list[tuple], max_threads: int | None, async_compile) -> None:
    if not recorded:
        return
    start = time.perf_counter()
    threads = max_threads or min(MAX_COMPILE_THREADS, os.cpu_count() or 1)
    with ThreadPoolExecutor(max_workers=threads, thread_name_prefix="asyncllm-compile") as pool:
        # ignore_errors: a specialization that fails to compile is simply not cached; its launch
        # compiles it again and raises there, where the caller expects it (a tiling left out)
        with async_compile.AsyncCompileMode(pool, ignore_errors=True):
            for kernel, specialization in recorded:
                kernel.preload(specialization)
    logger.debug("compiled %d Triton kernel specializations on %d threads in %.2f s", len(recorded), threads,
                 time.perf_counter() - start)
