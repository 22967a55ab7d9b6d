"""The start-up cache: what a start-up measured, kept on disk so that the next one on the same machine
reads it instead of measuring again (issue 45: a start-up measured in seconds).

A CUDA engine's start-up times and measures things: each skinny-GEMM shape's tilings against cuBLAS
(layers/skinny_linear.py), FP8 weights' route above 16 rows per shape and row bucket, W8A8 or
dequantize (layers/fp8_linear.py), the batch-1 decode graph's tilings (runner/decode_tuning.py), the
memory probe's activation peak (runner/memory.py), the step-time model's calibration steps
(engine/step_budget.py). What they find depends on the GPU, its
driver, the versions of torch and Triton, this package's code, the model's shapes and the engine's
settings (the fingerprint, fingerprint()), so the answers are kept in one JSON file per
fingerprint, $ASYNCLLM_CACHE/startup/<digest>.json. Each answer is stored under the question it
answers: a kind and a JSON description of what was measured (a shape and the candidate tilings,
the calibration's step shapes), so an answer is only ever given to the same question; where the
question differs (new candidates, other alternatives) it is measured again. Answers are indices
into the question's own candidates or plain numbers, never objects rebuilt from the file.

The file is rewritten whole on each new answer (to a temporary file, then renamed over it, under a
lock, merged with what other processes stored meanwhile: tensor-parallel ranks share it), so a
reader sees the old file or the new one, never half of one. A file that cannot be read, is not
JSON, has another format or another fingerprint is ignored with a warning (its decisions are
measured again) and replaced by the next write; so is a stored answer that does not fit its
question (an index past the candidates, a calibration of other steps): nothing in the file is
trusted further than its checks. ASYNCLLM_STARTUP_CACHE=0: nothing is read or written (and Triton's cache is not moved).
Triton's own cache of compiled kernels is the other half of the start-up cache: opened_for
places it under $ASYNCLLM_CACHE/triton (settings.place_triton_cache) before anything compiles.
"""
from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import importlib.metadata
import json
import logging
import os
import tempfile
import threading
from collections.abc import Callable
from typing import Any

import torch

from asyncllm import settings
from asyncllm.config import Config

logger = logging.getLogger("asyncllm")

FORMAT = 1  # of the file; another is ignored
FOLDER = "startup"
# the Config fields a stored decision may depend on: the graphs captured (sizes, context bounds),
# the steps the calibration times, the backend whose kernels run
DECISION_FIELDS = ("max_model_len", "max_num_seqs", "max_num_batched_tokens", "kvcache_block_size", "enforce_eager",
                   "cuda_graph_max_tokens", "attention_backend", "kv_cache_dtype", "kv_cache_rotation")
PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__))
_MISSING = object()


@functools.cache
def source_digest() -> str:
    """A digest of this package's Python sources: any change to the code (a kernel, its candidates)
    is another fingerprint, so nothing measured with other code is reused."""
    digest = hashlib.sha256()
    for folder, dirs, files in sorted(os.walk(PACKAGE_DIR)):
        dirs.sort()
        for name in sorted(files):
            if name.endswith(".py"):
                path = os.path.join(folder, name)
                digest.update(os.path.relpath(path, PACKAGE_DIR).encode())
                with open(path, "rb") as f:
                    digest.update(f.read())
    return digest.hexdigest()


def _distribution_version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def device_description(device: torch.device) -> dict:
    """The GPU as the fingerprint names it: its model, compute capability, SM count and the driver."""
    if device.type != "cuda":
        return {"type": device.type}
    props = torch.cuda.get_device_properties(device)
    try:  # torch has no public call for the driver's version
        driver = torch._C._cuda_getDriverVersion()
    except (AttributeError, RuntimeError):
        driver = None
    return {"type": "cuda", "name": props.name, "capability": [props.major, props.minor],
            "sms": props.multi_processor_count, "driver": driver}


def fingerprint(config: Config, device: torch.device) -> dict:
    """Everything a stored decision depends on besides its question (JSON-able)."""
    hf = config.hf_config
    heads = hf.num_attention_heads
    return {
        "format": FORMAT,
        "device": device_description(device),
        "versions": {"torch": torch.__version__, "cuda": torch.version.cuda, "triton": _distribution_version("triton"),
                     "asyncllm": _distribution_version("asyncllm-engine"), "code": source_digest()},
        "model": {"type": getattr(hf, "model_type", None), "hidden": hf.hidden_size,
                  "intermediate": getattr(hf, "intermediate_size", None), "heads": heads,
                  "kv_heads": getattr(hf, "num_key_value_heads", None) or heads,
                  "head_dim": getattr(hf, "head_dim", None) or hf.hidden_size // heads, "vocab": hf.vocab_size,
                  "layers": hf.num_hidden_layers},
        "dtype": str(config.torch_dtype),
        "tensor_parallel_size": config.tensor_parallel_size,
        "config": {name: getattr(config, name) for name in DECISION_FIELDS},
        # the switches that change what is measured or how a tie is decided
        "settings": {s.name: s.read() for s in (settings.PDL, settings.SKINNY_GEMM, settings.DECODE_TUNING)},
    }


def _canonical(value) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"))


class StartupDecisions:
    """Decisions by (kind, question), read from and written to one file (path None: the cache is off,
    every decision is measured and nothing kept). The file is read at the first lookup.

    remembered() is the one call: the stored answer where there is a valid one, else the measured
    one, stored. Thread-safe; reads and writes never raise (a file that is there and cannot be used
    is a warning, one that cannot be written a debug line; the decision is measured and kept in
    memory)."""

    def __init__(self, path: str | None, fingerprint: dict | None = None):
        self.path = path
        # as it comes back from the file (tuples as lists), to compare with the file's
        self.fingerprint = json.loads(_canonical(fingerprint))
        self.num_read = 0  # answers taken from the file
        self.num_measured = 0  # answers measured (and stored, where there is a file)
        self._decisions: dict[str, dict[str, Any]] | None = None  # kind -> question -> answer; read lazily
        self._lock = threading.Lock()

    @classmethod
    def opened_for(cls, config: Config, device: torch.device) -> "StartupDecisions":
        """The engine's start-up cache: on CUDA (the only device that measures) Triton's cache placed
        under the project's cache, and the decisions' file of this fingerprint; elsewhere, or with
        ASYNCLLM_STARTUP_CACHE=0, a store that keeps nothing."""
        if device.type != "cuda" or not settings.STARTUP_CACHE.read():
            return cls(None)
        settings.place_triton_cache()
        prints = fingerprint(config, device)
        name = hashlib.sha256(_canonical(prints).encode()).hexdigest()[:32] + ".json"
        return cls(os.path.join(settings.CACHE.read(), FOLDER, name), prints)

    def remembered(self, kind: str, question, measure: Callable[[], Any],
                   valid: Callable[[Any], bool] = lambda answer: True):
        """The answer stored for (kind, question) where valid(answer) holds; otherwise measure()'s,
        stored (an answer must be JSON: lists for tuples, as it comes back). question: JSON-able."""
        if self.path is None:  # off: nothing kept, not even in memory (an engine measures as it did before)
            self.num_measured += 1
            return measure()
        key = _canonical(question)
        with self._lock:
            stored = self._loaded().get(kind, {}).get(key, _MISSING)
        if stored is not _MISSING:
            if valid(stored):
                self.num_read += 1
                return stored
            logger.warning("start-up cache: %s: the stored %s decision does not fit its question; measuring it "
                           "again", self.path, kind)
        answer = measure()
        self.num_measured += 1
        with self._lock:
            self._decisions.setdefault(kind, {})[key] = answer
            self._write(kind, key, answer)
        return answer

    # ---- the file ----
    def _loaded(self) -> dict[str, dict[str, Any]]:
        if self._decisions is None:
            self._decisions = self._read(logging.WARNING)
        return self._decisions

    def _read(self, ignored_level: int = logging.DEBUG) -> dict[str, dict[str, Any]]:
        """The file's decisions, or {} where it is missing or not this format's or fingerprint's (said
        at ignored_level: a warning at the first read; the write's re-read has said it already)."""
        try:
            with open(self.path, encoding="utf-8") as f:
                content = json.load(f)
        except FileNotFoundError:
            return {}
        except (OSError, ValueError, RecursionError) as e:  # unreadable, not JSON (UnicodeDecodeError is a
            # ValueError), or nested past the parser's depth
            logger.log(ignored_level, "start-up cache: %s ignored (unreadable or not JSON): %s", self.path, e)
            return {}
        if not isinstance(content, dict) or content.get("format") != FORMAT \
                or content.get("fingerprint") != self.fingerprint or not isinstance(content.get("decisions"), dict) \
                or not all(isinstance(v, dict) for v in content["decisions"].values()):
            logger.log(ignored_level, "start-up cache: %s ignored: not a decisions file of format %d and this "
                       "fingerprint (another version's, or damaged)", self.path, FORMAT)
            return {}
        return content["decisions"]

    def _write(self, kind: str, key: str, answer) -> None:
        """The file with this answer added: merged under a lock with what is there now (another
        process's answers), written to a temporary file and renamed over it."""
        folder = os.path.dirname(self.path)
        try:
            _canonical(answer)  # not JSON: kept in memory only (raised here, before anything is written)
            os.makedirs(folder, exist_ok=True)
            with _locked(self.path + ".lock"):
                decisions = self._read()
                decisions.setdefault(kind, {})[key] = answer
                content = {"format": FORMAT, "fingerprint": self.fingerprint, "decisions": decisions}
                descriptor, temporary = tempfile.mkstemp(dir=folder, prefix=".decisions-", suffix=".tmp")
                try:
                    with os.fdopen(descriptor, "w", encoding="utf-8") as f:
                        json.dump(content, f, sort_keys=True)
                        f.flush()
                        os.fsync(f.fileno())
                    os.replace(temporary, self.path)
                except BaseException:
                    with contextlib.suppress(OSError):
                        os.unlink(temporary)
                    raise
        except (OSError, TypeError, ValueError) as e:
            logger.debug("start-up cache: %s not written: %s", self.path, e)


@contextlib.contextmanager
def _locked(path: str):
    """An exclusive flock on path (made if missing), held for the block."""
    descriptor = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(descriptor, fcntl.LOCK_EX)
        yield
    finally:
        os.close(descriptor)
