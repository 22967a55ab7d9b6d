"""An OpenAI-compatible HTTP server around AsyncLLMEngine (Starlette; run it with `asyncllm serve`).

Endpoints: POST /v1/chat/completions, POST /v1/completions (streaming as server-sent events ending
in `data: [DONE]`, with `: keep-alive` comments while a stream waits; or one JSON body; completions
take a list of prompts, prompt p's choice i being p * n + i, and echo), POST /v1/responses (OpenAI's
Responses API, stateless: its output items whole or as its stream events), GET /v1/models,
POST /tokenize and /detokenize (vLLM's shapes), GET /health, GET /metrics (prometheus_client).

    app = create_app(engine, "my-model", api_key="secret")   # engine started by the app's lifespan
    uvicorn.run(app, host="127.0.0.1", port=8000)            # unless the caller started it already

Request fields map to SamplingParams (protocol.SAMPLING_FIELDS; SamplingParams checks them):
max_tokens / max_completion_tokens, temperature, top_p, stop (a string or a list), seed, n, the
penalties, logit_bias, logprobs (chat: with top_logprobs), plus vLLM's extensions top_k, min_p,
min_tokens, ignore_eos, stop_token_ids, include_stop_str_in_output, prompt_logprobs, allowed_token_ids,
bad_words and (chat)
chat_template_kwargs and enable_thinking. With a reasoning parser (the engine's reasoning_parser),
answers carry reasoning_content beside content (deltas too). Chat takes tools, tool_choice and parallel_tool_calls (server/tool_calls.py);
both take the constraints response_format, structured_outputs and guided_* (server/constraints.py),
whose grammar compiles off the event loop. Fields this server does not implement (functions,
best_of, suffix, ...) are accepted only at their neutral value, else a 400; an unknown field is
ignored with one logged warning per field name (clients send newer OpenAI fields). A max_tokens
that runs past the context is a 400, and so is one whose n x max_tokens, or logprob entries, pass
the server's limits (RequestLimits; without max_tokens the default is lowered to fit). Every error
has an OpenAI-style body; a 429 (the queue is full) has Retry-After. A chat template sent by the
client is refused unless the operator trusts request templates.

A client that disconnects, mid-stream or while waiting for a non-streamed answer, aborts its
request: the engine frees its KV blocks before its next step.

Modules: protocol (request fields, error bodies), errors (Starlette's and uvicorn's own errors),
metrics (EngineCollector, EngineMetrics: also for apps that embed the engine), sse (event streams),
tokenization (/tokenize, /detokenize), app (routes, submission), answers (chat and completions
answers), stream_group (a request's prompts' engine streams), responses and response_output
(/v1/responses), limits (request bodies, n x max_tokens, logprob entries), shutdown (the drain on SIGTERM), connections (uvicorn as `asyncllm serve` runs it: head
timeouts, the --limit-concurrency 503, the draining shutdown).
"""
from asyncllm.server.app import DEFAULT_SSE_KEEPALIVE_INTERVAL, OpenAIServer, create_app
from asyncllm.server.limits import (DEFAULT_BODY_TIMEOUT, DEFAULT_MAX_BODY_BYTES, DEFAULT_MAX_GENERATED_TOKENS,
                                    DEFAULT_MAX_LOGPROB_ENTRIES, RequestLimits, read_json_body)
from asyncllm.server.metrics import EngineCollector, EngineMetrics, RequestMetricsRecorder
from asyncllm.server.protocol import COMPLETIONS_DEFAULT_MAX_TOKENS, APIError
from asyncllm.server.sse import EventStreamResponse, sse

__all__ = ["APIError", "COMPLETIONS_DEFAULT_MAX_TOKENS", "DEFAULT_BODY_TIMEOUT", "DEFAULT_MAX_BODY_BYTES",
           "DEFAULT_MAX_GENERATED_TOKENS", "DEFAULT_MAX_LOGPROB_ENTRIES", "DEFAULT_SSE_KEEPALIVE_INTERVAL",
           "EngineCollector", "EngineMetrics", "EventStreamResponse", "OpenAIServer", "RequestLimits",
           "RequestMetricsRecorder", "create_app", "read_json_body", "sse"]
