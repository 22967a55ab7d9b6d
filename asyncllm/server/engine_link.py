"""The wire between `asyncllm serve --api-server-count N`'s engine process and its front-end processes:
length-prefixed pickles over a Unix socket in a private (0700) directory, read back by an unpickler
that makes nothing but plain data and the few asyncllm classes a request and its errors need (a
SamplingParams, its StructuredOutput, asyncllm's errors). HTTP clients never reach this socket: the
front-ends decode their JSON and send these messages.

Messages (tuples, the first item names them):
  front-end -> engine: ("submit", request_id, prompt_token_ids, SamplingParams); ("abort", request_id);
                       ("embed", call_id, prompts, options); ("cancel", call_id)
  engine -> front-end: ("starting", phase) while the engine starts; ("ready", max_seq_len, engine.stats())
                       once; ("out", [item, ...]) -- every stream's new outputs of one engine step together;
                       ("stats", engine.stats()); ("dead", message); ("reply", call_id, value, error)
An out item is (request_id, error, text, token_ids, finish_reason, index, logprobs, stop_reason,
prompt_logprobs, reasoning, metrics); logprobs as (token_id, logprob, rank, top_ids, top_logprobs)
tuples (their texts are decoded by the front-end's own tokenizer); metrics, with a request's last
item, RequestMetrics' fields.
"""
from __future__ import annotations

import asyncio
import builtins
import io
import pickle
import struct

import asyncllm.errors
from asyncllm.outputs import TokenLogprob

_LENGTH = struct.Struct("!I")
_SAFE_BUILTINS = {"ValueError", "TypeError", "RuntimeError", "TimeoutError", "KeyError", "set", "frozenset",
                  "slice", "complex"}
_SAFE_CLASSES = {("asyncllm.sampling_params", "SamplingParams"), ("asyncllm.structured.spec", "StructuredOutput"),
                 ("asyncllm.pooling_params", "PoolingParams"), ("copyreg", "_reconstructor"),
                 ("builtins", "object")}


class _PlainUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        if module == "builtins" and name in _SAFE_BUILTINS:
            return getattr(builtins, name)
        if module == "asyncllm.errors" and isinstance(getattr(asyncllm.errors, name, None), type) \
                and issubclass(getattr(asyncllm.errors, name), Exception):
            return getattr(asyncllm.errors, name)
        if (module, name) in _SAFE_CLASSES:
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"the engine link does not carry {module}.{name}")


def frame(message: tuple) -> bytes:
    data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    return _LENGTH.pack(len(data)) + data


async def read_message(reader: asyncio.StreamReader) -> tuple | None:
    """The next message, or None once the other side has closed the link."""
    try:
        (length,) = _LENGTH.unpack(await reader.readexactly(_LENGTH.size))
        data = await reader.readexactly(length)
    except (asyncio.IncompleteReadError, ConnectionError):
        return None
    return _PlainUnpickler(io.BytesIO(data)).load()


def logprobs_out(entries) -> list[tuple] | None:
    if entries is None:
        return None
    return [None if e is None else (int(e.token_id), float(e.logprob), int(e.rank), _plain(e.top_ids),
                                    _plain(e.top_logprobs)) for e in entries]


def _plain(values) -> list:
    return values.tolist() if hasattr(values, "tolist") else list(values)  # numpy rows: no numpy on the wire


def logprobs_in(entries) -> list[TokenLogprob] | None:
    if entries is None:
        return None
    return [None if e is None else TokenLogprob(*e) for e in entries]
