"""The wire between `asyncllm serve --api-server-count N`'s engine process and its front-end processes:
length-prefixed JSON over a Unix socket in a private (0700) directory. Reading a message makes
nothing but plain data (no pickle: a peer that writes to the socket cannot make the reader run
code); what JSON has no type for travels as plain data made by the functions here: SamplingParams as
an object of its fields (logit_bias as [token id, bias] pairs: JSON's object keys are strings), an
error as [class name, constructor arguments], raised again as the same class (ArgumentError's field
and reason kept). HTTP clients never reach this socket: the front-ends decode their JSON and send
these messages.

Messages (JSON arrays, the first item names them; the readers unpack them by position, so they and
the tuples inside arrive as lists):
  front-end -> engine: ["submit", request_id, prompt_token_ids, params_out(SamplingParams)];
                       ["abort", request_id]; ["embed", call_id, prompts, options]; ["cancel", call_id];
                       ["lifecycle", call_id, "sleep" | "wake" | "reload", level or null]
  engine -> front-end: ["starting", phase] while the engine starts; ["ready", max_seq_len, engine.stats()]
                       once; ["out", [item, ...]] -- every stream's new outputs of one engine step together;
                       ["stats", engine.stats()]; ["dead", message]; ["reply", call_id, value, error_out(error)];
                       ["lifecycle", closed_reason, is_sleeping] at connection and at every change of the
                       engine's lifecycle gate (lifecycle_routes.py)
An out item is [request_id, text, token_ids, index] while a sequence has only text and tokens to send
(most of a stream: a short item is a third cheaper to encode), else [request_id, error_out(error), text,
token_ids, finish_reason, index, logprobs, stop_reason, prompt_logprobs, reasoning, metrics]; logprobs as [token_id, logprob, rank, top_ids, top_logprobs]
(their texts are decoded by the front-end's own tokenizer); metrics, with a request's last item,
RequestMetrics' fields.
"""
from __future__ import annotations

import asyncio
import builtins
import dataclasses
import json
import struct

import asyncllm.errors
from asyncllm.outputs import TokenLogprob
from asyncllm.sampling_params import SamplingParams
from asyncllm.structured.spec import StructuredOutput

_LENGTH = struct.Struct("!I")
_PARAM_FIELDS = tuple(f.name for f in dataclasses.fields(SamplingParams) if f.init)
# the classes an error is raised again as; another class goes as the nearest of these in its MRO
_ERRORS = {cls.__name__: cls for cls in vars(asyncllm.errors).values()
           if isinstance(cls, type) and issubclass(cls, Exception)}
_ERRORS.update({name: getattr(builtins, name) for name in ("ValueError", "TypeError", "RuntimeError",
                                                          "TimeoutError", "KeyError", "Exception")})


def _plain(value):  # numpy scalars and rows (logprobs' top_ids, stats): no numpy on the wire
    if hasattr(value, "tolist"):
        return value.tolist()
    raise TypeError(f"the engine link does not carry {type(value).__name__}")


# ASCII (escapes): a lone surrogate (a prompt the engine will refuse) crosses intact, as \\udXXX.
# json.dumps makes a C encoder per call (most of a one-item message's cost): one is kept here,
# without the circular-reference check (the link's messages are made by the code around it).
if json.encoder.c_make_encoder is not None:
    _iterencode = json.encoder.c_make_encoder(None, _plain, json.encoder.encode_basestring_ascii, None, ":", ",",
                                              False, False, True)

    def _encode(message) -> str:
        return "".join(_iterencode(message, 0))
else:  # no C accelerator
    _encode = json.JSONEncoder(separators=(",", ":"), default=_plain).encode
_decode = json.JSONDecoder().decode


def frame(message: tuple) -> bytes:
    data = _encode(message).encode("ascii")
    return _LENGTH.pack(len(data)) + data


async def read_message(reader: asyncio.StreamReader) -> list | None:
    """The next message, or None once the other side has closed the link."""
    try:
        (length,) = _LENGTH.unpack(await reader.readexactly(_LENGTH.size))
        data = await reader.readexactly(length)
    except (asyncio.IncompleteReadError, ConnectionError):
        return None
    return _decode(data.decode("ascii"))


def params_out(params: SamplingParams) -> dict:
    fields = {name: getattr(params, name) for name in _PARAM_FIELDS}
    if params.logit_bias is not None:
        fields["logit_bias"] = list(params.logit_bias.items())
    spec = params.structured_output
    if spec is not None:
        fields["structured_output"] = {spec.kind: getattr(spec, spec.kind)}
    return fields


def params_in(fields: dict) -> SamplingParams:
    if fields["logit_bias"] is not None:
        fields["logit_bias"] = dict(fields["logit_bias"])
    if fields["structured_output"] is not None:
        fields["structured_output"] = StructuredOutput(**fields["structured_output"])
    return SamplingParams(**fields)


def error_out(error: Exception | None) -> list | None:
    if error is None:
        return None
    cls = next(c for c in type(error).__mro__ if _ERRORS.get(c.__name__) is c)  # Exception at the latest
    # the class's own constructor arguments (ArgumentError's __reduce__: argument, reason, owner)
    args = error.__reduce__()[1] if cls is type(error) else (str(error),)
    if not all(isinstance(a, (str, int, float, bool, type(None))) for a in args):
        args = (str(error),)
    return [cls.__name__, list(args)]


def error_in(error: list) -> Exception:
    name, args = error
    return _ERRORS[name](*args)


def logprobs_out(entries) -> list[tuple] | None:
    if entries is None:
        return None
    return [None if e is None else (e.token_id, e.logprob, e.rank, e.top_ids, e.top_logprobs) for e in entries]


def logprobs_in(entries) -> list[TokenLogprob] | None:
    if entries is None:
        return None
    return [None if e is None else TokenLogprob(*e) for e in entries]
