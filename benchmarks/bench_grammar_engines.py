"""xgrammar vs llguidance on the CPU: grammar compile time and per-token mask fill time.

    python benchmarks/bench_grammar_engines.py

For each tokenizer (Qwen3's, 151k tokens; SmolLM2's, 49k) and each JSON schema: the time to compile
(cold, cache off), and the mean time to fill one token's bitmask while a matcher walks a valid JSON
instance token by token (the work the engine does per constrained request per step).
"""
from __future__ import annotations

import json
import time

import numpy as np
import torch
from transformers import AutoTokenizer

from asyncllm.models.default_model import default_model_path
from asyncllm.testing import qwen_tokenizer_dir

SCHEMAS = {
    "flat": ({"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
              "required": ["name", "age"]}, {"name": "Ada Lovelace", "age": 36}),
    "enum+bounds": ({"type": "object", "properties": {
        "color": {"enum": ["red", "green", "blue"]}, "score": {"type": "number", "minimum": 0, "maximum": 10},
        "count": {"type": "integer", "minimum": 1, "maximum": 99}}, "required": ["color", "score", "count"]},
        {"color": "green", "score": 7.5, "count": 12}),
    "nested+array": ({"type": "object", "properties": {
        "user": {"type": "object", "properties": {"id": {"type": "integer"}, "tags": {
            "type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 4}},
            "required": ["id", "tags"]},
        "items": {"type": "array", "items": {"type": "object", "properties": {
            "sku": {"type": "string"}, "qty": {"type": "integer"}}, "required": ["sku", "qty"]}}},
        "required": ["user", "items"]},
        {"user": {"id": 7, "tags": ["a", "bb"]}, "items": [{"sku": "X-1", "qty": 2}, {"sku": "Y-22", "qty": 1}]}),
    "any json": (None, {"answer": [1, 2, {"k": "v"}], "ok": True}),
}


def bench_xgrammar(tokenizer, schema, instance_ids):
    import xgrammar as xgr
    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=len(tokenizer))
    compiler = xgr.GrammarCompiler(info, cache_enabled=False)
    start = time.perf_counter()
    compiled = (compiler.compile_json_schema(json.dumps(schema)) if schema is not None
                else compiler.compile_builtin_json_grammar())
    compile_ms = (time.perf_counter() - start) * 1e3
    matcher = xgr.GrammarMatcher(compiled)
    bitmask = xgr.allocate_token_bitmask(1, info.vocab_size)
    fill = 0.0
    for token in instance_ids:
        start = time.perf_counter()
        matcher.fill_next_token_bitmask(bitmask)
        fill += time.perf_counter() - start
        assert matcher.accept_token(token), "the instance's tokens must be accepted"
    return compile_ms, fill / len(instance_ids) * 1e6


def bench_llguidance(tokenizer, schema, instance_ids):
    import llguidance
    import llguidance.hf
    import llguidance.torch
    start = time.perf_counter()
    lltok = llguidance.hf.from_tokenizer(tokenizer)
    tok_ms = (time.perf_counter() - start) * 1e3
    grammar = llguidance.LLMatcher.grammar_from_json_schema(
        json.dumps(schema) if schema is not None else '{"type": "object"}')
    start = time.perf_counter()
    matcher = llguidance.LLMatcher(lltok, grammar)
    compile_ms = (time.perf_counter() - start) * 1e3
    assert not matcher.is_error(), matcher.get_error()
    bitmask = llguidance.torch.allocate_token_bitmask(1, lltok.vocab_size)
    fill = 0.0
    for token in instance_ids:
        start = time.perf_counter()
        llguidance.torch.fill_next_token_bitmask(matcher, bitmask, 0)
        fill += time.perf_counter() - start
        assert matcher.consume_token(token), matcher.get_error()
    return compile_ms, fill / len(instance_ids) * 1e6, tok_ms


def main():
    torch.set_num_threads(2)
    tokenizers = {"Qwen3": qwen_tokenizer_dir(), "SmolLM2": default_model_path()}
    print("| tokenizer | schema | xgrammar compile ms | xgrammar fill us/token | llguidance compile ms | "
          "llguidance fill us/token |")
    print("| --- | --- | --- | --- | --- | --- |")
    for tok_name, path in tokenizers.items():
        tokenizer = AutoTokenizer.from_pretrained(path)
        for name, (schema, instance) in SCHEMAS.items():
            ids = tokenizer.encode(json.dumps(instance), add_special_tokens=False)
            x_compile, x_fill = bench_xgrammar(tokenizer, schema, ids)
            l_compile, l_fill, _ = bench_llguidance(tokenizer, schema, ids)
            print(f"| {tok_name} | {name} | {x_compile:.1f} | {x_fill:.1f} | {l_compile:.2f} | {l_fill:.1f} |")


if __name__ == "__main__":
    main()
