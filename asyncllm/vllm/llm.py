"""vLLM's offline LLM (vllm.LLM): generate() and chat() returning RequestOutput objects, over
asyncllm's LLM (which runs the batch)."""
from __future__ import annotations

import itertools

from asyncllm.chat_template import chat_prompt_ids
from asyncllm.llm import LLM as NativeLLM, normalize_params
from asyncllm.vllm.inputs import engine_options, prompt_list, prompt_parts, truncated
from asyncllm.vllm.outputs import (EmbeddingOutput, EmbeddingRequestOutput, RequestOutput, completion_output,
                                   prompt_token_logprobs)
from asyncllm.vllm.sampling_params import PoolingParams, SamplingParams


class LLM:
    """LLM(model, **engine_args): model is a directory, a .gguf file or a hub id (None: the built-in
    default model); engine arguments are vLLM's names (engine_options) or asyncllm's Config fields."""

    def __init__(self, model: str | None = None, **kwargs):
        self.native_llm = NativeLLM(model, **engine_options(kwargs))
        self._request_counter = itertools.count()

    def get_tokenizer(self):
        return self.native_llm.tokenizer

    def close(self) -> None:
        self.native_llm.close()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def generate(self, prompts, sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool = True, lora_request=None, priority: list[int] | None = None) -> list[RequestOutput]:
        """One finished RequestOutput per prompt, in order."""
        if lora_request is not None:
            raise ValueError("lora_request: LoRA adapters are not supported")
        prompts = prompt_list(prompts)
        params = normalize_params(sampling_params, len(prompts), SamplingParams,
                                  "asyncllm.vllm.SamplingParams")
        if priority is not None and len(priority) != len(prompts):
            raise ValueError(f"priority: {len(priority)} given for {len(prompts)} prompts")
        core = self.native_llm.core
        texts, token_lists = [], []
        for i, (prompt, p) in enumerate(zip(prompts, params)):
            text, native_prompt = prompt_parts(prompt, f"prompts[{i}]")
            texts.append(text)
            token_lists.append(truncated(core.encode_prompt(native_prompt, f"prompts[{i}]"), p.truncate_prompt_tokens,
                                         core.max_seq_len))
        native = [p.to_native(priority[i] if priority is not None else 0) for i, p in enumerate(params)]
        results = self.native_llm.generate(token_lists, native, use_tqdm=bool(use_tqdm))
        outputs = []
        for text, token_ids, p, result in zip(texts, token_lists, params, results):
            sequences = result if isinstance(result, list) else [result]
            outputs.append(RequestOutput(
                str(next(self._request_counter)), text, token_ids,
                prompt_token_logprobs(sequences[0].get("prompt_logprobs")),
                [completion_output(s["index"], s["text"] if p.detokenize else "", s["token_ids"], s["logprobs"],
                                   s["finish_reason"], s["stop_reason"]) for s in sequences],
                finished=True))
        return outputs

    def embed(self, prompts, *, truncate_prompt_tokens: int | None = None, use_tqdm: bool = True,
              pooling_params: PoolingParams | None = None, lora_request=None) -> list[EmbeddingRequestOutput]:
        """One EmbeddingRequestOutput per prompt, in order: `.outputs.embedding` is the final-norm hidden
        state of the prompt's last token (as Qwen3-Embedding pools), L2-normalised unless
        pooling_params.normalize is False, cut to pooling_params.dimensions if given."""
        if lora_request is not None:
            raise ValueError("lora_request: LoRA adapters are not supported")
        params = PoolingParams() if pooling_params is None else pooling_params
        if not isinstance(params, PoolingParams):
            raise TypeError(f"pooling_params: expected asyncllm.vllm.PoolingParams, got {type(params).__name__}")
        core = self.native_llm.core
        token_lists = []
        for i, prompt in enumerate(prompt_list(prompts)):
            _, native_prompt = prompt_parts(prompt, f"prompts[{i}]")
            token_lists.append(truncated(core.encode_prompt(native_prompt, f"prompts[{i}]"), truncate_prompt_tokens,
                                         core.max_seq_len))
        vectors = self.native_llm.embed(token_lists, normalize=True if params.normalize is None else params.normalize,
                                        dimensions=params.dimensions)  # checked there
        return [EmbeddingRequestOutput(str(next(self._request_counter)), EmbeddingOutput(vector), token_ids)
                for token_ids, vector in zip(token_lists, vectors)]

    def chat(self, messages, sampling_params: SamplingParams | list[SamplingParams] | None = None,
             use_tqdm: bool = True, lora_request=None, chat_template: str | None = None,
             chat_template_content_format: str = "auto", add_generation_prompt: bool = True,
             continue_final_message: bool = False, tools: list[dict] | None = None,
             chat_template_kwargs: dict | None = None, mm_processor_kwargs: dict | None = None) -> list[RequestOutput]:
        """A conversation (a list of {"role", "content"} dicts), or a list of them, answered as
        generate() answers prompts: each rendered by the tokenizer's chat template (or chat_template)."""
        if chat_template_content_format not in ("auto", "string"):
            raise ValueError("chat_template_content_format: only 'auto' or 'string' (message content is a string)")
        if mm_processor_kwargs:
            raise ValueError("mm_processor_kwargs: not supported (text-only models)")
        if not isinstance(messages, (list, tuple)) or not messages:
            raise ValueError("messages: expected a conversation (a non-empty list of message dicts) or a list of them")
        conversations = [messages] if isinstance(messages[0], dict) else list(messages)
        options = dict(chat_template_kwargs or {}, add_generation_prompt=add_generation_prompt)
        if continue_final_message:
            options["continue_final_message"] = True
        if chat_template is not None:
            options["chat_template"] = chat_template
        if tools is not None:
            options["tools"] = tools
        prompts = []
        for conversation in conversations:
            core = self.native_llm.core
            token_ids = chat_prompt_ids(core, conversation, dict(options))
            # the rendered prompt, as vLLM reports it (special-token text in messages stays text)
            prompts.append({"prompt": core.tokenizer.decode(token_ids), "prompt_token_ids": token_ids})
        return self.generate(prompts, sampling_params, use_tqdm, lora_request)
