"""vLLM's Python API over asyncllm, for porting code that uses vLLM: change the import and it runs.

    from asyncllm.vllm import LLM, AsyncLLM, SamplingParams, RequestOutput, CompletionOutput

LLM.generate / LLM.chat return lists of RequestOutput, LLM.embed a list of EmbeddingRequestOutput;
AsyncLLM.generate(prompt, sampling_params, request_id) is an async generator of RequestOutput
(output_kind: CUMULATIVE, DELTA or FINAL_ONLY); abort() is awaitable. Everything here is a thin
layer over asyncllm's own API (asyncllm.LLM, asyncllm.AsyncLLMEngine), which stays as it is.
docs/PORTING.md lists what still differs, and why.
"""
from asyncllm.vllm.async_llm import AsyncLLM
from asyncllm.vllm.inputs import AsyncEngineArgs, EngineArgs
from asyncllm.vllm.llm import LLM
from asyncllm.vllm.outputs import CompletionOutput, EmbeddingOutput, EmbeddingRequestOutput, Logprob, RequestOutput
from asyncllm.vllm.sampling_params import (GuidedDecodingParams, PoolingParams, RequestOutputKind, SamplingParams,
                                           StructuredOutputsParams)

__all__ = ["LLM", "AsyncLLM", "SamplingParams", "RequestOutput", "CompletionOutput", "Logprob", "RequestOutputKind",
           "StructuredOutputsParams", "GuidedDecodingParams", "EngineArgs", "AsyncEngineArgs", "PoolingParams",
           "EmbeddingRequestOutput", "EmbeddingOutput"]
