"""Every environment variable the package reads: each declared once, with its default, parser and meaning.

Code reads a variable through its Setting here (`settings.PDL.read()`), never through os.environ
(tests/test_layout.py checks that only this module touches os.environ), and writes one only in
place_triton_cache (Triton's cache folder, when unset: Triton reads it itself). read() looks at the
environment each time it is called, so a test's monkeypatch.setenv applies to the next read; the
few modules that keep a value in a global read at import say why where they do (a hot path, or a
value Triton itself fixes at its import). README.md's table of them is markdown_table()'s output
(tests/test_settings.py keeps the two equal). Like config.py, this module imports nothing of the
package, so every layer may use it.

These are process-wide switches, not Config fields: what they govern is per process (the skinny
GEMM's and the decode tuner's decisions are kept for every later engine of the process, PDL is a
launch flag of kernels that never see a Config, a tensor-parallel rank's identity comes from its
launcher), so an engine's Config could not change them for itself alone.
"""
from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


def _on_unless_zero(text: str) -> bool:
    return text != "0"


def _one(text: str) -> bool:
    return text == "1"


def _positive_seconds(text: str) -> float:
    seconds = float(text)
    if not seconds > 0:  # also NaN
        raise ValueError(f"expected a number of seconds > 0, got {text!r}")
    return seconds


def _positive_int(text: str) -> int:
    value = int(text)
    if value <= 0:
        raise ValueError(f"expected an integer > 0, got {text!r}")
    return value


def _cache_dir(text: str) -> str:
    return text or os.path.join(os.path.expanduser("~"), ".cache", "asyncllm")


@dataclass(frozen=True)
class Setting:
    name: str
    default: str | None  # the text that applies when the variable is unset; None: read() returns None
    parse: Callable[[str], Any]
    meaning: str
    default_shown: str | None = None  # the default as the docs show it, where `default` is not it

    @classmethod
    def switch(cls, name: str, meaning: str) -> Setting:
        """An on/off switch, on unless the variable is "0" (meaning: what "0" turns off)."""
        return cls(name, "1", _on_unless_zero, meaning)

    def text(self) -> str | None:
        """The variable's text, or the default text when it is unset (for argparse defaults, which
        argparse parses with the option's own type when the option is used)."""
        return os.environ.get(self.name, self.default)

    def read(self) -> Any:
        """The parsed value now (None when unset without a default); a ValueError names the variable."""
        text = self.text()
        if text is None:
            return None
        try:
            return self.parse(text)
        except ValueError as e:
            raise ValueError(f"${self.name}={text!r}: {e}") from None


LAUNCH_GATE = Setting.switch(
    "ASYNCLLM_LAUNCH_GATE",
    "0: AsyncLLMEngine's streams do not wait while the engine thread launches a step (to compare)")
PDL = Setting.switch(
    "ASYNCLLM_PDL",
    "0: no programmatic dependent launch for the decode step's kernels (sm_90+ GPUs)")
SKINNY_GEMM = Setting.switch(
    "ASYNCLLM_SKINNY_GEMM",
    "0: linear layers of 1-16 rows use cuBLAS, never the Triton skinny GEMM")
DECODE_TUNING = Setting.switch(
    "ASYNCLLM_DECODE_TUNING",
    "0: the batch-1 decode graph's 1-row tilings are not re-timed inside that graph at start-up")
CACHE = Setting(
    "ASYNCLLM_CACHE", "", _cache_dir,
    "where GGUF files are converted to safetensors checkpoints (once per file), and the start-up cache is kept "
    "(startup/: what start-up measured; triton/: Triton's compiled kernels)", default_shown="~/.cache/asyncllm")
STARTUP_CACHE = Setting.switch(
    "ASYNCLLM_STARTUP_CACHE",
    "0: no start-up cache: every start-up measures its decisions again and stores none, and Triton's cache "
    "stays where Triton puts it")
STAGED_LOADING = Setting(
    "ASYNCLLM_STAGED_LOADING", "0", _on_unless_zero,
    "1: a CUDA engine reads its safetensors weights with large reads into pinned host buffers "
    "(models/staged_reads.py) instead of from safetensors' memory map; off until measured on a GPU",
    default_shown="0")
MOE_ROUTED_DECODE = Setting(
    "ASYNCLLM_MOE_ROUTED_DECODE", "0", _on_unless_zero,
    "1: a CUDA MoE block at 1..16 tokens routes inside its experts' first kernel and sums the split-K parts "
    "in its second (kernels/skinny_moe.skinny_moe_routed: 3 launches a layer instead of 5); off until "
    "checked and timed on a GPU", default_shown="0")
TRITON_CACHE_DIR = Setting(
    "TRITON_CACHE_DIR", None, str,
    "Triton's own: where it caches compiled kernels; a CUDA engine sets it, when unset, to $ASYNCLLM_CACHE/triton",
    default_shown="$ASYNCLLM_CACHE/triton")
API_KEY = Setting(
    "ASYNCLLM_API_KEY", None, str,
    "`asyncllm serve`'s API key when --api-key is not given (empty: refused)", default_shown="none: no auth")
TRITON_INTERPRET = Setting(
    "TRITON_INTERPRET", "0", _one,
    "1: Triton kernels run on CPU tensors in Triton's interpreter (the CPU tests); set before asyncllm.kernels is imported")
TP_INIT_METHOD = Setting(
    "ASYNCLLM_TP_INIT_METHOD", None, str,
    "tensor-parallel rendezvous over machines: env:// or tcp://HOST:PORT (docs/TENSOR_PARALLEL.md)",
    default_shown="unset: one machine, a free local port; tp-worker: env://")
TP_LOCAL_RANKS = Setting(
    "ASYNCLLM_TP_LOCAL_RANKS", "", str,
    "with ASYNCLLM_TP_INIT_METHOD, the ranks rank 0 spawns on its own machine, e.g. 1,2,3", default_shown="none")
TP_TIMEOUT_S = Setting(
    "ASYNCLLM_TP_TIMEOUT_S", "300", _positive_seconds,
    "seconds a tensor-parallel rank waits for the rendezvous or a collective")
FRONTEND_MAX_PENDING_BYTES = Setting(
    "ASYNCLLM_FRONTEND_MAX_PENDING_BYTES", str(64 << 20), _positive_int,
    "serve --api-server-count N: the bytes the engine process holds for a front-end that does not read them "
    "before it treats that front-end as dead (aborts its requests, the server exits 1)", default_shown="67108864 (64 MiB)")
RANK = Setting("RANK", None, int, "torch.distributed's rank of this process (tp-worker; the engine's is 0)")
WORLD_SIZE = Setting("WORLD_SIZE", None, int, "torch.distributed's rank count; must equal tensor_parallel_size")
LOCAL_RANK = Setting("LOCAL_RANK", None, int, "this rank's GPU index on its machine",
                     default_shown="engine: 0; tp-worker: rank % GPUs")
MASTER_ADDR = Setting("MASTER_ADDR", None, str, "env:// rendezvous: rank 0's host")
MASTER_PORT = Setting("MASTER_PORT", None, int, "env:// rendezvous: rank 0's port")

ALL = (LAUNCH_GATE, PDL, SKINNY_GEMM, DECODE_TUNING, CACHE, STARTUP_CACHE, STAGED_LOADING, MOE_ROUTED_DECODE,
       TRITON_CACHE_DIR, API_KEY, TRITON_INTERPRET, TP_INIT_METHOD, TP_LOCAL_RANKS, TP_TIMEOUT_S,
       FRONTEND_MAX_PENDING_BYTES, RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT)


def place_triton_cache() -> str | None:
    """The one write to the environment: Triton's cache of compiled kernels under $ASYNCLLM_CACHE/triton,
    so that one folder holds the whole start-up cache. Triton reads TRITON_CACHE_DIR at each compile,
    so this must run before the process's first compile (ModelRunner's start-up calls it first thing;
    tensor-parallel workers inherit it). Nothing is changed where TRITON_CACHE_DIR is set already,
    ASYNCLLM_STARTUP_CACHE=0, or the folder cannot be made (Triton would fail to write there).
    Returns the folder it set, else None."""
    if TRITON_CACHE_DIR.read() or not STARTUP_CACHE.read():
        return None
    path = os.path.join(CACHE.read(), "triton")
    try:
        os.makedirs(path, exist_ok=True)
    except OSError:
        return None
    if not os.access(path, os.W_OK | os.X_OK):
        return None
    os.environ[TRITON_CACHE_DIR.name] = path
    return path


def markdown_table() -> str:
    """The variables as README.md shows them."""
    rows = ["| variable | default | meaning |", "| --- | --- | --- |"]
    for setting in ALL:
        default = setting.default_shown if setting.default_shown is not None else setting.default
        rows.append(f"| `{setting.name}` | {default if default is not None else 'unset'} | {setting.meaning} |")
    return "\n".join(rows) + "\n"
