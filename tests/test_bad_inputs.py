"""Bad inputs at every public entry point, from ONE table (BAD_INPUTS), plus the safety of loading.

Each row: (entry point, label, input, expected error, the argument the message must name, another
fragment the message must contain). The error is an exception type, or an HTTP status for the
OpenAI server's JSON rows. A ValueError or TypeError may be the InvalidValueError or
InvalidTypeError that carries the argument it names (errors.ArgumentError): then it carries the
row's argument. After the bad calls the engine still serves: a valid request that was
in flight meanwhile completes with the same tokens as alone, and a new valid request completes.

docs/RELIABILITY.md carries this table as markdown; test_docs_table_matches_this_table keeps the
two the same (print markdown_table() to regenerate it).
"""
from __future__ import annotations

import ast
import json
import os
import pathlib
import pickle
import shutil
from dataclasses import dataclass

import anyio
import numpy as np
import pytest

from asyncllm import LLM, Config, PromptTooLongError
from asyncllm.errors import ArgumentError, InvalidTypeError, InvalidValueError
from asyncllm.async_engine import AsyncLLMEngine
from asyncllm.sampling_params import SamplingParams
from helpers import assert_all_blocks_free

VOCAB = 151936  # the tiny checkpoint's vocab_size
EOS = 151645  # its EOS token id (<|im_end|>)
MAX_MODEL_LEN = 256
ENGINE_KW = dict(num_kvcache_blocks=64, kvcache_block_size=16, max_model_len=MAX_MODEL_LEN)
OK = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
ROOT = pathlib.Path(__file__).resolve().parent.parent
TINY, PICKLE_ONLY = "<tiny checkpoint>", "<dir with only pytorch_model.bin>"


def changed(**fields) -> SamplingParams:
    """SamplingParams that were valid when made and changed afterwards (dataclasses are mutable)."""
    params = SamplingParams(temperature=0, max_tokens=4)
    for name, value in fields.items():
        setattr(params, name, value)
    return params


@dataclass(frozen=True)
class Bad:
    entry: str
    label: str  # the input, as the docs show it
    value: object  # kwargs (dict) for the call; a callable is called first; bytes/str = a raw HTTP body
    error: type | int  # exception type, or HTTP status
    argument: str  # the message must name it
    says: str = ""  # and contain this

    @property
    def id(self) -> str:
        return f"{self.entry}: {self.label}"


SP, CFG, LLM_, AE = "SamplingParams(...)", "Config(model, ...)", "LLM(model, ...)", "AsyncLLMEngine(model, ...)"
GEN, STREAM, AGEN, CHAT = "LLM.generate", "AsyncLLMEngine.stream", "AsyncLLMEngine.generate", "AsyncLLMEngine.chat"
ABORT, SHUTDOWN, WAIT, ENCODE = ("AsyncLLMEngine.abort", "AsyncLLMEngine.shutdown", "AsyncLLMEngine.wait_idle",
                                 "AsyncLLMEngine.encode")
EMBED, LLM_EMBED = "AsyncLLMEngine.embed", "LLM.embed"
ASYNC_ENTRIES = (STREAM, AGEN, CHAT, EMBED, ABORT, SHUTDOWN, WAIT, ENCODE)
HTTP_CMPL, HTTP_CHAT, HTTP_EMBED = "POST /v1/completions", "POST /v1/chat/completions", "POST /v1/embeddings"
HIDDEN = 128  # the tiny checkpoint's hidden size: the longest embedding
MSG = [{"role": "user", "content": "Hi"}]

BAD_INPUTS: list[Bad] = [
    # ---- SamplingParams ----
    Bad(SP, "temperature=nan", dict(temperature=float("nan")), ValueError, "temperature", "finite"),
    Bad(SP, "temperature=inf", dict(temperature=float("inf")), ValueError, "temperature", "finite"),
    Bad(SP, "temperature=-1", dict(temperature=-1), ValueError, "temperature", ">= 0"),
    Bad(SP, "temperature=1e39", dict(temperature=1e39), ValueError, "temperature", "at most 1e+06"),
    Bad(SP, "repetition_penalty=1e-50", dict(repetition_penalty=1e-50), ValueError, "repetition_penalty",
        "[1e-06, 1e+06]"),
    Bad(SP, 'temperature="0.7"', dict(temperature="0.7"), ValueError, "temperature", "number"),
    Bad(SP, "top_p=0", dict(top_p=0), ValueError, "top_p", "(0, 1]"),
    Bad(SP, "top_p=nan", dict(top_p=float("nan")), ValueError, "top_p", "finite"),
    Bad(SP, "min_p=1.5", dict(min_p=1.5), ValueError, "min_p", "[0, 1]"),
    Bad(SP, "top_k=0", dict(top_k=0), ValueError, "top_k", "-1"),
    Bad(SP, "top_k=10**30", dict(top_k=10**30), ValueError, "top_k", "2**63"),
    Bad(SP, "max_tokens=0", dict(max_tokens=0), ValueError, "max_tokens", ">= 1"),
    Bad(SP, "max_tokens=1.5", dict(max_tokens=1.5), ValueError, "max_tokens", "int"),
    Bad(SP, "seed=2**70", dict(seed=2**70), ValueError, "seed", "2**64"),
    Bad(SP, 'seed="42"', dict(seed="42"), ValueError, "seed", "int"),
    Bad(SP, 'stop=""', dict(stop=""), ValueError, "stop", "empty"),
    Bad(SP, 'stop=["a", None]', dict(stop=["a", None]), ValueError, "stop", "strings"),
    Bad(SP, "stop_token_ids=[-1]", dict(stop_token_ids=[-1]), ValueError, "stop_token_ids", "non-negative"),
    Bad(SP, 'ignore_eos="yes"', dict(ignore_eos="yes"), ValueError, "ignore_eos", "bool"),
    # every step lists these for the sampler: long lists slowed every request sharing the steps
    Bad(SP, "stop_token_ids=[1] * 129", dict(stop_token_ids=[1] * 129), ValueError, "stop_token_ids", "at most 128"),
    Bad(SP, "bad_words=['x'] * 129", dict(bad_words=["x"] * 129), ValueError, "bad_words", "at most 128"),
    Bad(SP, "bad_words=['x' * 1025]", dict(bad_words=["x" * 1025]), ValueError, "bad_words", "at most 1024 characters"),
    Bad(SP, "logit_bias of 1025 entries", dict(logit_bias={i: 1.0 for i in range(1025)}), ValueError, "logit_bias",
        "at most 1024"),
    Bad(SP, "timeout=0", dict(timeout=0), ValueError, "timeout", "> 0"),
    Bad(SP, "timeout=-1", dict(timeout=-1), ValueError, "timeout", "> 0"),
    Bad(SP, "timeout=nan", dict(timeout=float("nan")), ValueError, "timeout", "finite"),
    Bad(SP, "timeout=inf", dict(timeout=float("inf")), ValueError, "timeout", "finite"),
    Bad(SP, 'timeout="5"', dict(timeout="5"), ValueError, "timeout", "seconds"),
    Bad(SP, "timeout=True", dict(timeout=True), ValueError, "timeout", "seconds"),
    # ---- Config / LLM / AsyncLLMEngine options ----
    Bad(CFG, "max_num_seqs=0", dict(max_num_seqs=0), ValueError, "max_num_seqs", ">= 1"),
    Bad(CFG, "max_num_batched_tokens=-1", dict(max_num_batched_tokens=-1), ValueError, "max_num_batched_tokens"),
    Bad(CFG, 'max_model_len="4096"', dict(max_model_len="4096"), ValueError, "max_model_len", "int"),
    Bad(CFG, "kvcache_block_size=24", dict(kvcache_block_size=24), ValueError, "kvcache_block_size", "power of two"),
    Bad(CFG, "gpu_memory_utilization=nan", dict(gpu_memory_utilization=float("nan")), ValueError,
        "gpu_memory_utilization"),
    # checked against the model's shape, so where the engine resolves the model, not in Config
    Bad(LLM_, "num_kvcache_blocks=10**9 (device cpu)", dict(num_kvcache_blocks=10**9, device="cpu"), ValueError,
        "num_kvcache_blocks", "does not fit"),
    Bad(LLM_, "cpu_kvcache_bytes=10**15 (device cpu)", dict(cpu_kvcache_bytes=10**15, num_kvcache_blocks=-1,
                                                             device="cpu"), ValueError, "cpu_kvcache_bytes",
        "does not fit"),
    Bad(LLM_, "cpu_kvcache_bytes=1 (device cpu)", dict(cpu_kvcache_bytes=1, num_kvcache_blocks=-1, device="cpu"),
        ValueError, "cpu_kvcache_bytes", "not enough memory for even one KV-cache block of"),
    Bad(CFG, 'dtype="int8"', dict(dtype="int8"), ValueError, "dtype"),
    Bad(CFG, 'device="tpu"', dict(device="tpu"), ValueError, "device"),
    Bad(CFG, 'quantization="awq"', dict(quantization="awq"), ValueError, "quantization", "one of"),
    Bad(CFG, 'kv_cache_dtype="fp8", attention_backend="fa4"', dict(kv_cache_dtype="fp8", attention_backend="fa4"),
        ValueError, "kv_cache_dtype", "not supported by attention_backend"),
    Bad(CFG, 'model="/nonexistent"', dict(model="/nonexistent"), ValueError, "model", "does not exist"),
    Bad(CFG, "model=123", dict(model=123), ValueError, "model", "path"),
    Bad(LLM_, "kv_cache_blocks=4 (unknown option)", dict(kv_cache_blocks=4), TypeError, "kv_cache_blocks", "unknown"),
    Bad(LLM_, f"model={PICKLE_ONLY}", dict(model=PICKLE_ONLY), ValueError, "model", "pickle checkpoints are refused"),
    Bad(AE, "max_num_seqs=0", dict(max_num_seqs=0), ValueError, "max_num_seqs"),
    Bad(AE, "max_queued_requests=-1", dict(max_queued_requests=-1), ValueError, "max_queued_requests"),
    Bad(AE, "parse_special_tokens_in_chat_content=1", dict(parse_special_tokens_in_chat_content=1), TypeError,
        "parse_special_tokens_in_chat_content", "bool"),
    # ---- LLM.generate ----
    Bad(GEN, "prompts=None", dict(prompts=None), TypeError, "prompts"),
    Bad(GEN, "prompts=[]", dict(prompts=[]), ValueError, "prompts", "empty"),
    Bad(GEN, 'prompts=b"Hello" (bytes)', dict(prompts=b"Hello"), TypeError, "prompts", "bytes"),
    Bad(GEN, 'prompts=[b"Hello"]', dict(prompts=[b"Hello"]), TypeError, "prompts[0]", "bytes"),
    Bad(GEN, 'prompts=""', dict(prompts=""), ValueError, "prompts[0]", "empty"),
    Bad(GEN, 'prompts="\\ud800 lone surrogate"', dict(prompts="\ud800 lone surrogate"), ValueError, "prompts[0]",
        "surrogate"),
    Bad(GEN, 'prompts=["ok", 5]', dict(prompts=["ok", 5]), TypeError, "prompts[1]"),
    Bad(GEN, "prompts=[[]]", dict(prompts=[[]]), ValueError, "prompts[0]", "empty"),
    Bad(GEN, "prompts=[[1, 2.5]]", dict(prompts=[[1, 2.5]]), TypeError, "prompts[0][1]", "int"),
    Bad(GEN, "prompts=[[1, nan]]", dict(prompts=[[1, float("nan")]]), TypeError, "prompts[0][1]", "int"),
    Bad(GEN, "prompts=[[True]]", dict(prompts=[[True]]), TypeError, "prompts[0][0]", "int"),
    Bad(GEN, "prompts=[[1, -1]]", dict(prompts=[[1, -1]]), ValueError, "prompts[0][1]", "vocabulary"),
    # past the first entries: the check's fast path over the whole list must still name the one bad entry
    Bad(GEN, "prompts=[[1] * 300 + [True, 2]]", dict(prompts=[[1] * 300 + [True, 2]]), TypeError, "prompts[0][300]",
        "int"),
    Bad(GEN, f"prompts=[[2] * 300 + [{VOCAB}, 1]]", dict(prompts=[[2] * 300 + [VOCAB, 1]]), ValueError,
        "prompts[0][300]", "vocabulary"),
    Bad(GEN, f"prompts=[[1, {VOCAB}]] (= vocab_size)", dict(prompts=[[1, VOCAB]]), ValueError, "prompts[0][1]",
        "vocabulary"),
    Bad(GEN, "prompts=[[1, 10**30]]", dict(prompts=[[1, 10**30]]), ValueError, "prompts[0][1]", "vocabulary"),
    Bad(GEN, f"prompts=[[1] * {MAX_MODEL_LEN}] (= max_model_len)", dict(prompts=[[1] * MAX_MODEL_LEN]),
        PromptTooLongError, "prompts[0]", "max_model_len"),
    Bad(GEN, 'prompts=["ok", "word " * 2000]', dict(prompts=["ok", "word " * 2000]), PromptTooLongError, "prompts[1]",
        "max_model_len"),
    Bad(GEN, 'sampling_params={"temperature": 0}', dict(prompts=["ok"], sampling_params={"temperature": 0}),
        TypeError, "sampling_params", "SamplingParams"),
    Bad(GEN, "2 sampling_params for 1 prompt", dict(prompts=["ok"], sampling_params=[OK, OK]), ValueError,
        "sampling_params", "2 given for 1"),
    Bad(GEN, "sampling_params=[None]", dict(prompts=["ok"], sampling_params=[None]), TypeError, "sampling_params[0]"),
    Bad(GEN, "SamplingParams changed after construction: max_tokens=0",
        lambda: dict(prompts=["ok"], sampling_params=changed(max_tokens=0)), ValueError, "max_tokens", ">= 1"),
    # banned below min_tokens: an id past the logits failed the step and killed the async engine
    Bad(GEN, f"stop_token_ids=[{VOCAB}] with min_tokens=2",
        dict(prompts=["ok"], sampling_params=SamplingParams(stop_token_ids=[VOCAB], min_tokens=2, max_tokens=4)),
        ValueError, "stop_token_ids", "vocabulary"),
    # contradictory constraints: the sampler took token 0 from a row of -inf logits, silently
    Bad(GEN, "allowed_token_ids=[5] with stop_token_ids=[5], min_tokens=1",
        dict(prompts=["ok"], sampling_params=SamplingParams(allowed_token_ids=[5], stop_token_ids=[5], min_tokens=1)),
        ValueError, "allowed_token_ids, stop_token_ids, min_tokens", "no token could be sampled"),
    Bad(GEN, 'use_tqdm="no"', dict(prompts=["ok"], use_tqdm="no"), TypeError, "use_tqdm", "bool"),
    # ---- AsyncLLMEngine.stream / generate ----
    Bad(STREAM, "prompt=None", dict(prompt=None), TypeError, "prompt"),
    Bad(STREAM, 'prompt=b"Hello" (bytes)', dict(prompt=b"Hello"), TypeError, "prompt", "bytes"),
    Bad(STREAM, 'prompt=""', dict(prompt=""), ValueError, "prompt", "empty"),
    Bad(STREAM, 'prompt="Hi \\udcff" (surrogateescape)', dict(prompt="Hi \udcff"), ValueError, "prompt", "surrogate"),
    Bad(STREAM, "prompt=[]", dict(prompt=[]), ValueError, "prompt", "empty"),
    Bad(STREAM, "prompt=np.array([1, 2])", dict(prompt=np.array([1, 2])), TypeError, "prompt", "ndarray"),
    Bad(STREAM, "prompt=[1.0]", dict(prompt=[1.0]), TypeError, "prompt[0]", "int"),
    Bad(STREAM, "prompt=[np.int64(1)]", dict(prompt=[np.int64(1)]), TypeError, "prompt[0]", "int"),
    Bad(STREAM, "prompt=[-5]", dict(prompt=[-5]), ValueError, "prompt[0]", "vocabulary"),
    Bad(STREAM, f"prompt=[{VOCAB}]", dict(prompt=[VOCAB]), ValueError, "prompt[0]", "vocabulary"),
    Bad(STREAM, f"prompt=[1] * {MAX_MODEL_LEN}", dict(prompt=[1] * MAX_MODEL_LEN), PromptTooLongError, "prompt",
        "max_model_len"),
    Bad(STREAM, 'sampling_params={"max_tokens": 4}', dict(prompt="Hi", sampling_params={"max_tokens": 4}),
        TypeError, "sampling_params", "SamplingParams"),
    Bad(STREAM, "SamplingParams changed after construction: top_k=10**30",
        lambda: dict(prompt="Hi", sampling_params=changed(top_k=10**30)), ValueError, "top_k", "2**63"),
    Bad(STREAM, "SamplingParams changed after construction: seed=-2**70",
        lambda: dict(prompt="Hi", sampling_params=changed(temperature=1.0, seed=-2**70)), ValueError, "seed"),
    Bad(STREAM, 'request_id=""', dict(prompt="Hi", request_id=""), ValueError, "request_id"),
    Bad(STREAM, "request_id=7", dict(prompt="Hi", request_id=7), TypeError, "request_id", "string"),
    Bad(STREAM, f"allowed_token_ids=[{EOS}] (EOS) with min_tokens=2",
        dict(prompt="Hi", sampling_params=SamplingParams(allowed_token_ids=[EOS], min_tokens=2, max_tokens=4)),
        ValueError, "allowed_token_ids, ignore_eos, min_tokens", "no token could be sampled"),
    Bad(AGEN, 'prompt=["Hi", "there"] (a batch)', dict(prompt=["Hi", "there"]), TypeError, "prompt[0]", "int"),
    Bad(AGEN, 'prompt="word " * 2000', dict(prompt="word " * 2000), PromptTooLongError, "prompt", "max_model_len"),
    # ---- AsyncLLMEngine.chat ----
    Bad(CHAT, 'messages="Hi"', dict(messages="Hi"), ValueError, "messages", "list"),
    Bad(CHAT, "messages=[]", dict(messages=[]), ValueError, "messages", "non-empty"),
    Bad(CHAT, 'messages=["Hi"]', dict(messages=["Hi"]), TypeError, "messages[0]", "dict"),
    Bad(CHAT, 'messages=[{"content": "Hi"}] (no role)', dict(messages=[{"content": "Hi"}]), ValueError,
        "messages[0]", "role"),
    Bad(CHAT, 'messages=[{"role": "user"}] (no content)', dict(messages=[{"role": "user"}]), ValueError,
        "messages[0]", "content"),
    Bad(CHAT, 'messages=[{"role": "user", "content": 5}]', dict(messages=[{"role": "user", "content": 5}]),
        ValueError, "messages[0]", "content"),
    Bad(CHAT, 'messages=[{"role": "user", "content": "\\ud800"}]', dict(messages=[{"role": "user", "content": "\ud800"}]),
        ValueError, "messages[0]", "surrogate"),
    Bad(CHAT, 'messages=[{"role": "user", "content": "word " * 2000}]',
        dict(messages=[{"role": "user", "content": "word " * 2000}]), PromptTooLongError, "messages",
        "max_model_len"),
    Bad(CHAT, 'messages=[{"role": "user", "content": "x" * 10**6}]',
        dict(messages=[{"role": "user", "content": "x" * 10**6}]), PromptTooLongError, "messages", "characters"),
    Bad(CHAT, 'sampling_params="greedy"', dict(messages=MSG, sampling_params="greedy"), TypeError, "sampling_params"),
    Bad(CHAT, "request_id=[1]", dict(messages=MSG, request_id=[1]), TypeError, "request_id"),
    Bad(CHAT, "tokenize=True (the engine's to set)", dict(messages=MSG, tokenize=True), TypeError, "tokenize"),
    Bad(CHAT, 'add_generation_prompt="yes"', dict(messages=MSG, add_generation_prompt="yes"), TypeError,
        "add_generation_prompt", "bool"),
    Bad(CHAT, 'tools="search"', dict(messages=MSG, tools="search"), TypeError, "tools", "list"),
    # ---- embeddings ----
    Bad(EMBED, "prompts=None", dict(prompts=None), TypeError, "prompts"),
    Bad(EMBED, "prompts=[]", dict(prompts=[]), ValueError, "prompts", "empty"),
    Bad(EMBED, 'prompts=["ok", ""]', dict(prompts=["ok", ""]), ValueError, "prompts[1]", "empty"),
    Bad(EMBED, f"prompts=[[1, {VOCAB}]]", dict(prompts=[[1, VOCAB]]), ValueError, "prompts[0][1]", "vocabulary"),
    # nothing is generated: a prompt of max_model_len tokens fits, one more does not
    Bad(EMBED, f"prompts=[[1] * {MAX_MODEL_LEN + 1}]", dict(prompts=[[1] * (MAX_MODEL_LEN + 1)]), PromptTooLongError,
        "prompts[0]", "max_model_len"),
    Bad(EMBED, 'pooling="max"', dict(prompts="ok", pooling="max"), ValueError, "pooling", "'mean'"),
    Bad(EMBED, 'normalize="yes"', dict(prompts="ok", normalize="yes"), TypeError, "normalize", "bool"),
    Bad(EMBED, "dimensions=0", dict(prompts="ok", dimensions=0), ValueError, "dimensions", ">= 1"),
    Bad(EMBED, "dimensions=1.5", dict(prompts="ok", dimensions=1.5), TypeError, "dimensions", "int"),
    Bad(EMBED, f"dimensions={HIDDEN + 1} (> hidden size)", dict(prompts="ok", dimensions=HIDDEN + 1), ValueError,
        "dimensions", "hidden size"),
    Bad(LLM_EMBED, 'prompts=[b"Hello"]', dict(prompts=[b"Hello"]), TypeError, "prompts[0]", "bytes"),
    Bad(LLM_EMBED, 'prompts=["ok", "word " * 2000]', dict(prompts=["ok", "word " * 2000]), PromptTooLongError,
        "prompts[1]", "max_model_len"),
    Bad(LLM_EMBED, "pooling=None", dict(prompts="ok", pooling=None), ValueError, "pooling"),
    # ---- AsyncLLMEngine's other methods: nothing reaches the engine thread unchecked ----
    Bad(ABORT, 'request_id=["id"] (a list)', dict(request_id=["id"]), TypeError, "request_id", "string"),
    Bad(ABORT, 'request_id={"id": 1} (a dict)', dict(request_id={"id": 1}), TypeError, "request_id", "string"),
    Bad(ABORT, "request_id=None", dict(request_id=None), TypeError, "request_id", "string"),
    Bad(SHUTDOWN, 'drain="no"', dict(drain="no"), TypeError, "drain", "bool"),
    Bad(WAIT, "poll_interval=nan", dict(poll_interval=float("nan")), ValueError, "poll_interval", "finite"),
    Bad(WAIT, "poll_interval=-1", dict(poll_interval=-1), ValueError, "poll_interval", "> 0"),
    Bad(WAIT, 'poll_interval="0.1"', dict(poll_interval="0.1"), TypeError, "poll_interval", "seconds"),
    Bad(ENCODE, "argument=5", dict(prompt="Hi", argument=5), TypeError, "argument", "string"),
    # ---- the OpenAI server's JSON (400s with an OpenAI error body; `param` names the field) ----
    Bad(HTTP_CMPL, 'body b\'{"prompt": "\\xff"}\' (invalid UTF-8)', b'{"prompt": "\xff\xfe"}', 400, "JSON"),
    Bad(HTTP_CMPL, "body 'not json'", b"not json", 400, "JSON"),
    Bad(HTTP_CMPL, 'body [1, 2] (not an object)', b"[1, 2]", 400, "JSON", "object"),
    Bad(HTTP_CMPL, '{"prompt": ""}', dict(prompt=""), 400, "prompt", "empty"),
    Bad(HTTP_CMPL, '{"prompt": "\\ud800"} (JSON escape of a lone surrogate)', b'{"prompt": "\\ud800 hi"}', 400,
        "prompt", "surrogate"),
    Bad(HTTP_CMPL, f'{{"prompt": [1, {VOCAB}]}}', dict(prompt=[1, VOCAB]), 400, "prompt", "vocabulary"),
    Bad(HTTP_CMPL, '{"prompt": "word " * 2000}', dict(prompt="word " * 2000), 400, "prompt", "max_model_len"),
    Bad(HTTP_CMPL, '{"temperature": NaN}', b'{"prompt": "Hi", "temperature": NaN}', 400, "temperature", "finite"),
    Bad(HTTP_CMPL, '{"top_k": 10**30}', dict(prompt="Hi", top_k=10**30), 400, "top_k"),
    Bad(HTTP_CMPL, '{"seed": 2**70}', dict(prompt="Hi", seed=2**70), 400, "seed"),
    Bad(HTTP_CMPL, '{"max_tokens": "5"}', dict(prompt="Hi", max_tokens="5"), 400, "max_tokens", "integer"),
    Bad(HTTP_CMPL, '{"max_tokens": 1e400}', b'{"prompt": "Hi", "max_tokens": 1e400}', 400, "max_tokens"),
    Bad(HTTP_CHAT, '{"messages": "Hi"}', dict(messages="Hi"), 400, "messages", "array"),
    Bad(HTTP_CHAT, '{"messages": [{"role": "robot", ...}]}', dict(messages=[{"role": "robot", "content": "Hi"}]),
        400, "messages[0].role"),
    Bad(HTTP_CHAT, '{"messages": [{"role": "user", "content": "\\udcff"}]}',
        b'{"messages": [{"role": "user", "content": "\\udcff"}]}', 400, "messages", "surrogate"),
    Bad(HTTP_CHAT, '{"n": 0}', dict(messages=MSG, n=0), 400, "n"),
    Bad(HTTP_CHAT, '{"logit_bias": {"x": 1}}', dict(messages=MSG, logit_bias={"x": 1}), 400, "logit_bias"),
    Bad(HTTP_CMPL, '{"timeout": 0}', dict(prompt="Hi", timeout=0), 400, "timeout", "> 0"),
    Bad(HTTP_CHAT, '{"timeout": "10"}', dict(messages=MSG, timeout="10"), 400, "timeout", "seconds"),
    Bad(HTTP_EMBED, '{"input": ""}', dict(input=""), 400, "input", "empty"),
    Bad(HTTP_EMBED, '{"input": []}', dict(input=[]), 400, "input", "empty"),
    Bad(HTTP_EMBED, f'{{"input": [1, {VOCAB}]}}', dict(input=[1, VOCAB]), 400, "input", "vocabulary"),
    Bad(HTTP_EMBED, '{"input": "word " * 2000}', dict(input="word " * 2000), 400, "input", "max_model_len"),
    Bad(HTTP_EMBED, '{"dimensions": 0}', dict(input="Hi", dimensions=0), 400, "dimensions"),
    Bad(HTTP_EMBED, f'{{"dimensions": {HIDDEN + 1}}}', dict(input="Hi", dimensions=HIDDEN + 1), 400, "dimensions",
        "hidden size"),
    Bad(HTTP_EMBED, '{"encoding_format": "hex"}', dict(input="Hi", encoding_format="hex"), 400, "encoding_format"),
]


def rows(*entries: str) -> list[Bad]:
    return [row for row in BAD_INPUTS if row.entry in entries]


def params_of(rows_: list[Bad]) -> dict:
    return dict(argvalues=rows_, ids=[row.id for row in rows_])


def resolve(row: Bad):
    return row.value() if callable(row.value) else row.value


def check_message(row: Bad, message: str) -> None:
    assert row.argument in message, f"{row.id}: the message does not name {row.argument!r}: {message!r}"
    assert row.says in message, f"{row.id}: the message lacks {row.says!r}: {message!r}"


# the refusal that carries the argument it names, where a row expects a plain ValueError or TypeError
CARRYING_ITS_ARGUMENT = {ValueError: InvalidValueError, TypeError: InvalidTypeError}


def check_error(row: Bad, error: BaseException) -> None:
    assert type(error) in (row.error, CARRYING_ITS_ARGUMENT.get(row.error)), \
        f"{row.id}: {type(error).__name__}: {error}"
    # every refusal carries the argument it names (or an item of it), for callers that name it their
    # own way (the server's `param`) without parsing the message
    assert isinstance(error, ArgumentError), f"{row.id}: {type(error).__name__} carries no field: {error}"
    assert error.field == row.argument.partition("[")[0], f"{row.id}: carries the field {error.field!r}: {error}"
    assert error.argument == row.argument or error.argument.startswith(row.argument + "["), \
        f"{row.id}: carries {error.argument!r}: {error}"
    check_message(row, str(error))


def expect_error(row: Bad, call) -> None:
    with pytest.raises(row.error) as info:
        call()
    check_error(row, info.value)


def error_name(row: Bad) -> str:
    return f"HTTP {row.error}" if isinstance(row.error, int) else row.error.__name__


def markdown_table() -> str:
    def cell(text: str) -> str:
        return "`" + text.replace("|", "\\|") + "`"
    lines = ["| Entry point | Input | Error | The message names / says |", "|---|---|---|---|"]
    for row in BAD_INPUTS:
        says = f" — “{row.says}”" if row.says else ""
        lines.append(f"| {cell(row.entry)} | {cell(row.label)} | {error_name(row)} | {cell(row.argument)}{says} |")
    return "\n".join(lines)


# ---- the checkpoint a row refuses: config + tokenizer fine, the only weights a pickle ----------------
class _PickleBomb:
    """Unpickling it creates a marker file: proof that nothing ever unpickled the checkpoint."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def write_pickle_checkpoint(src: str, dst: pathlib.Path, keep_safetensors: bool) -> pathlib.Path:
    dst.mkdir()
    for name in os.listdir(src):
        if (keep_safetensors or not name.endswith(".safetensors")) and os.path.isfile(os.path.join(src, name)):
            shutil.copy(os.path.join(src, name), dst)
    marker = dst.parent / f"{dst.name}-UNPICKLED"
    for name in ("pytorch_model.bin", "model.pt", "weights.pkl"):
        (dst / name).write_bytes(pickle.dumps(_PickleBomb(str(marker))))
    return marker


@pytest.fixture(scope="module")
def model_paths(tiny_qwen3, tmp_path_factory) -> dict:
    pickle_only = tmp_path_factory.mktemp("bad") / "pickle-only"
    write_pickle_checkpoint(tiny_qwen3, pickle_only, keep_safetensors=False)
    return {TINY: tiny_qwen3, PICKLE_ONLY: str(pickle_only)}


# ---- constructors -------------------------------------------------------------------------------------
@pytest.mark.parametrize("row", **params_of(rows(SP)))
def test_sampling_params(row):
    expect_error(row, lambda: SamplingParams(**resolve(row)))


@pytest.mark.parametrize("row", **params_of(rows(SP, CFG)))
def test_a_refused_field_is_carried_by_its_error(row, model_paths):
    """What names the field for a caller that names it its own way (the server's `param`): the
    error's field and owner, not its message."""
    kwargs = dict(resolve(row))
    owner = SamplingParams if row.entry == SP else Config
    if owner is Config:
        kwargs["model"] = model_paths.get(kwargs.get("model", TINY), kwargs.get("model"))
    with pytest.raises(ArgumentError) as info:
        owner(**kwargs)
    assert (info.value.field, info.value.owner) == (row.argument, owner.__name__), info.value
    assert str(info.value) == f"{owner.__name__}.{info.value.message_without_owner}"
    copy = pickle.loads(pickle.dumps(info.value))  # as a tensor-parallel worker's error would travel
    assert (type(copy), str(copy), copy.field) == (type(info.value), str(info.value), info.value.field)


@pytest.mark.parametrize("row", **params_of(rows(CFG, LLM_, AE)))
def test_engine_options(row, model_paths):
    kwargs = dict(resolve(row))
    model = model_paths.get(kwargs.get("model", TINY), kwargs.get("model"))
    kwargs.pop("model", None)
    if row.entry == CFG:
        expect_error(row, lambda: Config(model=model, **kwargs))
    elif row.entry == LLM_:
        expect_error(row, lambda: LLM(model, **{**ENGINE_KW, **kwargs}))
    else:
        expect_error(row, lambda: AsyncLLMEngine(model, **{**ENGINE_KW, **kwargs}))


# ---- the sync LLM ------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def llm(tiny_qwen3):
    return LLM(tiny_qwen3, **ENGINE_KW)


@pytest.mark.parametrize("row", **params_of(rows(GEN)))
def test_llm_generate(row, llm):
    kwargs = resolve(row)
    expect_error(row, lambda: llm.generate(kwargs["prompts"], kwargs.get("sampling_params", OK),
                                           use_tqdm=kwargs.get("use_tqdm", False)))
    # refused before anything was queued
    assert llm.core.requests == {} and not llm.core.has_unfinished()


@pytest.mark.parametrize("row", **params_of(rows(LLM_EMBED)))
def test_llm_embed(row, llm):
    kwargs = dict(resolve(row))
    expect_error(row, lambda: llm.embed(kwargs.pop("prompts"), **kwargs))
    assert llm.core.requests == {} and not llm.core.has_unfinished()


def test_llm_still_serves_after_bad_calls(llm):
    reference = llm.generate(["Hello", [5, 6, 7]], OK, use_tqdm=False)
    for row in rows(GEN):
        kwargs = resolve(row)
        with pytest.raises(row.error):
            llm.generate(kwargs["prompts"], kwargs.get("sampling_params", OK), use_tqdm=kwargs.get("use_tqdm", False))
    assert llm.generate(["Hello", [5, 6, 7]], OK, use_tqdm=False) == reference
    assert [r["finish_reason"] for r in reference] == ["length", "length"]
    assert_all_blocks_free(llm)


# ---- the async engine ---------------------------------------------------------------------------------
@pytest.fixture(scope="module")
async def engine(tiny_qwen3):
    async with AsyncLLMEngine(tiny_qwen3, **ENGINE_KW) as engine:
        yield engine


async def call_async(engine: AsyncLLMEngine, row: Bad):
    kwargs = dict(resolve(row))
    if row.entry in (SHUTDOWN, WAIT):
        return await getattr(engine, row.entry.rpartition(".")[2])(**kwargs)
    if row.entry in (ABORT, ENCODE):
        return getattr(engine, row.entry.rpartition(".")[2])(**kwargs)
    if row.entry == STREAM:
        return engine.stream(kwargs.pop("prompt"), kwargs.pop("sampling_params", OK), **kwargs)
    if row.entry == AGEN:
        return await engine.generate(kwargs.pop("prompt"), kwargs.pop("sampling_params", OK), **kwargs)
    if row.entry == EMBED:
        return await engine.embed(kwargs.pop("prompts"), **kwargs)
    return engine.chat(kwargs.pop("messages"), kwargs.pop("sampling_params", OK), **kwargs)


@pytest.mark.anyio
@pytest.mark.parametrize("row", **params_of(rows(*ASYNC_ENTRIES)))
async def test_async_engine(row, engine):
    with anyio.fail_after(30):
        with pytest.raises(row.error) as info:
            await call_async(engine, row)
        check_error(row, info.value)
        assert engine.stats()["num_inbox"] == 0  # refused before anything was queued


@pytest.mark.anyio
async def test_async_engine_serves_others_during_and_after_bad_calls(engine):
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    with anyio.fail_after(60):
        alone = await engine.generate([5, 6, 7, 8], params)
        stream = engine.stream([5, 6, 7, 8], params)  # in flight while the bad calls come
        await stream.__anext__()
        for row in rows(*ASYNC_ENTRIES):
            with pytest.raises(row.error):
                await call_async(engine, row)
        async for _ in stream:
            pass
        assert stream.finish_reason == "length" and stream.token_ids == alone.token_ids
        result = await engine.generate("Hello", OK)
        assert [len(v) for v in await engine.embed(["Hello", [5, 6]])] == [HIDDEN, HIDDEN]
        assert result.finish_reason == "length" and len(result.token_ids) == 4
        chat = await engine.generate(engine.apply_chat_template(MSG), OK)
        assert chat.finish_reason == "length"
        await engine.wait_idle()
        stats = engine.stats()
        assert stats["num_free_blocks"] == stats["num_total_blocks"]


# ---- the OpenAI server's JSON -------------------------------------------------------------------------
def make_app(engine):
    pytest.importorskip("starlette", reason="the server needs starlette")
    server = pytest.importorskip("asyncllm.server", reason="asyncllm.server is not importable")
    if not hasattr(server, "create_app"):
        pytest.skip("asyncllm.server has no create_app yet")
    return server.create_app(engine, "tiny", manage_engine=False)


async def post(client, row: Bad):
    path = {HTTP_CMPL: "/v1/completions", HTTP_CHAT: "/v1/chat/completions", HTTP_EMBED: "/v1/embeddings"}[row.entry]
    body = resolve(row)
    if isinstance(body, dict):
        body = json.dumps(body if row.entry == HTTP_EMBED else {"max_tokens": 4, **body}).encode()
    return await client.post(path, content=body, headers={"content-type": "application/json"})


@pytest.mark.anyio
async def test_server_json(engine):
    httpx = pytest.importorskip("httpx")
    app = make_app(engine)
    failures = []
    with anyio.fail_after(60):
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as client:
            for row in rows(HTTP_CMPL, HTTP_CHAT, HTTP_EMBED):
                response = await post(client, row)
                try:
                    assert response.status_code == row.error, (response.status_code, response.text)
                    error = response.json()["error"]
                    assert error["type"] == "invalid_request_error"
                    check_message(row, f"{error['param']} {error['message']}")
                except AssertionError as e:
                    failures.append(f"{row.id}: {e}")
            # the server still serves
            ok = await client.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 3, "temperature": 0})
            assert ok.status_code == 200 and ok.json()["choices"][0]["finish_reason"] == "length"
            ok = await client.post("/v1/chat/completions", json={"messages": MSG, "max_tokens": 3})
            assert ok.status_code == 200, ok.text
            ok = await client.post("/v1/embeddings", json={"input": ["Hello", [5, 6]]})
            assert ok.status_code == 200 and len(ok.json()["data"]) == 2, ok.text
    assert not failures, "\n".join(failures)
    await engine.wait_idle()
    assert engine.stats()["num_free_blocks"] == engine.stats()["num_total_blocks"]


# ---- the docs carry this table ---------------------------------------------------------------------------
def test_docs_table_matches_this_table():
    doc = (ROOT / "docs" / "RELIABILITY.md").read_text()
    assert markdown_table() in doc, "docs/RELIABILITY.md's bad-input table differs: paste markdown_table()"


# ---- safety of loading -------------------------------------------------------------------------------------
def test_pickle_weights_are_never_unpickled(tiny_qwen3, tmp_path):
    # next to safetensors, pickle files are ignored: the model loads from the safetensors alone
    both = tmp_path / "both"
    marker = write_pickle_checkpoint(tiny_qwen3, both, keep_safetensors=True)
    llm = LLM(str(both), num_kvcache_blocks=8, kvcache_block_size=16)
    assert llm.generate([[1, 2, 3]], OK, use_tqdm=False)[0]["finish_reason"] == "length"
    # alone, they are refused with a message that says why
    only = tmp_path / "only"
    marker_only = write_pickle_checkpoint(tiny_qwen3, only, keep_safetensors=False)
    with pytest.raises(ValueError) as info:
        LLM(str(only), num_kvcache_blocks=8, kvcache_block_size=16)
    message = str(info.value)
    assert "Config.model" in message and "pickle checkpoints are refused" in message and "safetensors" in message
    assert "pytorch_model.bin" in message
    assert not marker.exists() and not marker_only.exists(), "a pickle file was unpickled"


def test_a_fake_gguf_file_is_refused(tmp_path):
    from asyncllm.models.gguf import resolve_model_path
    fake = tmp_path / "model.gguf"
    fake.write_bytes(pickle.dumps({"not": "gguf"}))
    with pytest.raises(ValueError, match="GGUF magic"):
        resolve_model_path(str(fake))


def package_sources() -> list[pathlib.Path]:
    files = sorted((ROOT / "asyncllm").rglob("*.py"))
    assert len(files) > 20
    return files


def test_no_remote_code_and_no_pickle_loading_in_the_package():
    from_pretrained_calls = 0
    for path in package_sources():
        source = path.read_text()
        assert "trust_remote_code=True" not in source.replace(" ", ""), path
        tree = ast.parse(source, str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.Call):
                func = node.func
                name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
                for kw in node.keywords:
                    if kw.arg == "trust_remote_code":
                        assert isinstance(kw.value, ast.Constant) and kw.value.value is False, \
                            f"{path}:{node.lineno}: trust_remote_code must be the literal False"
                    if kw.arg == "weights_only":
                        assert isinstance(kw.value, ast.Constant) and kw.value.value is True, f"{path}:{node.lineno}"
                    if kw.arg == "allow_pickle":
                        assert isinstance(kw.value, ast.Constant) and kw.value.value is False, f"{path}:{node.lineno}"
                    assert kw.arg is not None or name != "from_pretrained", \
                        f"{path}:{node.lineno}: **kwargs into from_pretrained could carry trust_remote_code"
                if name == "from_pretrained":
                    from_pretrained_calls += 1
                # the loaders that unpickle
                if isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name):
                    dotted = f"{func.value.id}.{func.attr}"
                    assert dotted not in ("torch.load", "pickle.load", "pickle.loads", "dill.load", "joblib.load",
                                          "np.load", "numpy.load"), f"{path}:{node.lineno}: {dotted}"
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                modules = [alias.name for alias in node.names] + [getattr(node, "module", None) or ""]
                assert not {"pickle", "dill", "cloudpickle", "joblib"} & set(modules), f"{path}:{node.lineno}"
    assert from_pretrained_calls >= 3  # the tokenizer, the config, the GGUF tokenizer


def test_empty_bad_words_are_none():
    # max() of the empty list raised a bare ValueError naming no field (the server's 500)
    params = SamplingParams(bad_words=[])
    assert params.bad_words == [] and not params.adjusts_logits


def test_prompt_ids_check_and_conversion_agree_with_a_plain_loop(llm):
    """The intake's one-pass check (intake.int32_ids, through marshal's layout) against the plain
    per-entry rule: every entry an int, not a bool, within [0, vocab_size); the bad entry named;
    the accepted ids' int64 bytes those the prefix cache keys blocks by (array "q")."""
    import enum
    import random
    from array import array

    from asyncllm.engine import intake

    assert intake._MARSHAL_LAYOUT, "this Python's marshal layout changed: every prompt takes the slow loop"

    class Id(enum.IntEnum):
        A = 7

    odd = [True, False, 1.0, float("nan"), np.int64(3), np.int32(3), Id.A, 2**31, -2**31 - 1, 2**63, -1, VOCAB,
           VOCAB - 1, 0, "5", b"5", None, [5], (5,), np.array([5]), 10**30]
    rng = random.Random(0)
    for case in range(300):
        ids = [rng.randrange(VOCAB) for _ in range(rng.choice([1, 2, 300, 2000]))]
        for _ in range(rng.choice([0, 0, 1, 2])):
            ids[rng.randrange(len(ids))] = rng.choice(odd)
        prompt = tuple(ids) if case % 5 == 0 else ids
        expected = None  # the first bad entry's index, error type
        for i, t in enumerate(ids):
            if isinstance(t, bool) or not isinstance(t, int):
                expected = (f"prompt[{i}]", InvalidTypeError)
                break
            if not 0 <= t < VOCAB:
                expected = (f"prompt[{i}]", InvalidValueError)
                break
        if expected is None:
            checked = llm.core.encode_prompt(prompt)
            assert list(checked) == ids and type(checked.int64) is np.ndarray
            assert checked.int64.tobytes() == array("q", map(int, ids)).tobytes()
        else:
            with pytest.raises(expected[1]) as info:
                llm.core.encode_prompt(prompt)
            assert info.value.argument == expected[0], (case, info.value)


def test_the_checked_prompt_is_a_snapshot(llm):
    ids = [5, 6, 7]
    checked = llm.core.encode_prompt(ids)
    ids[0] = -1
    assert list(checked) == [5, 6, 7] and checked.int64.tolist() == [5, 6, 7]
