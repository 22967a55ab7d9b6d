"""POST /tokenize and /detokenize, in vLLM's shapes:

    {"model", "prompt", "add_special_tokens": true}            -> {"tokens", "count", "max_model_len", "token_strs"}
    {"model", "messages", "add_generation_prompt": true, ...}  -> the same, for the chat template's rendering
    {"model", "tokens"}                                         -> {"prompt"}

The tokens are those a completion or chat request with the same prompt or messages would get;
max_model_len is the engine's max_seq_len (what prompt + max_tokens must fit in).
"""
from __future__ import annotations

import anyio
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

import asyncllm.server.protocol as protocol
from asyncllm.server import tool_calls
from asyncllm.engine.intake import check_text
from asyncllm.server.protocol import APIError, field_error

TOKENIZE_FIELDS = {"model", "prompt", "messages", "add_special_tokens", "return_token_strs",
                   "add_generation_prompt", "continue_final_message", "chat_template", "chat_template_kwargs",
                   "enable_thinking", "tools", "tool_choice", "parallel_tool_calls"}
DETOKENIZE_FIELDS = {"model", "tokens"}
_BOOLEAN = (lambda v: isinstance(v, bool), "a boolean")


class TokenizationEndpoints:
    """Mixed into OpenAIServer: uses its request plumbing (_request_body, _chat_prompt_ids) and engine."""

    async def tokenize(self, request: Request) -> Response:
        body = await self._request_body(request, TOKENIZE_FIELDS, {})
        if (body.get("prompt") is None) == (body.get("messages") is None):
            raise APIError(400, "send either 'prompt' (a string) or 'messages' (a chat)", param="prompt",
                           code="invalid_value")
        flags = {name: protocol.expect(body, name, *_BOOLEAN)
                 for name in ("add_special_tokens", "return_token_strs", "add_generation_prompt",
                              "continue_final_message")}
        if body.get("messages") is not None:
            token_ids = await self._tokenize_chat(body, flags)
        else:
            token_ids = await self._tokenize_prompt(body["prompt"], flags["add_special_tokens"] is not False)
        token_strs = None
        if flags["return_token_strs"] is True:
            token_strs = self.engine.tokenizer.convert_ids_to_tokens(token_ids)
        return JSONResponse({"tokens": token_ids, "count": len(token_ids), "max_model_len": self.engine.max_seq_len,
                             "token_strs": token_strs})

    async def _tokenize_prompt(self, prompt, add_special_tokens: bool) -> list[int]:
        if not isinstance(prompt, str):
            raise APIError(400, f"'prompt': expected a string, got {protocol.type_name(prompt)}", param="prompt",
                           code="invalid_type")
        self._check_engine(needs_model=False)  # the tokenizer serves while the engine sleeps
        if add_special_tokens:  # exactly what /v1/completions does with this prompt
            try:
                return await anyio.to_thread.run_sync(self.engine.encode, prompt, "prompt")
            except (ValueError, TypeError) as e:
                raise field_error("prompt", e) from None
        if len(prompt) > self.engine.max_prompt_chars:
            raise APIError(400, f"'prompt': {len(prompt)} characters cannot fit in max_model_len "
                                f"({self.engine.max_seq_len} tokens)", param="prompt", code="context_length_exceeded")
        try:
            check_text(prompt, "prompt")
        except ValueError as e:
            raise field_error("prompt", e) from None
        return await anyio.to_thread.run_sync(lambda: self.engine.tokenizer.encode(prompt, add_special_tokens=False))

    async def _tokenize_chat(self, body: dict, flags: dict) -> list[int]:
        if flags["add_special_tokens"] is True:  # the template writes the special tokens itself
            raise APIError(400, "'add_special_tokens': only false is supported with 'messages'",
                           param="add_special_tokens", code="unsupported_value")
        messages = protocol.messages(body)
        template_kwargs = protocol.chat_template_kwargs(body, self.trust_request_chat_template)
        for name in ("add_generation_prompt", "continue_final_message"):
            if flags[name] is not protocol.MISSING:
                template_kwargs[name] = flags[name]
        if template_kwargs.get("continue_final_message"):
            template_kwargs.setdefault("add_generation_prompt", False)
        # the request's tools rendered as chat completions renders them
        messages, template_kwargs, _ = tool_calls.with_tools(body, messages, template_kwargs, self.engine.chat_template)
        return await self._chat_prompt_ids(messages, template_kwargs)

    async def detokenize(self, request: Request) -> Response:
        body = await self._request_body(request, DETOKENIZE_FIELDS, {})
        tokens = body.get("tokens")
        if not isinstance(tokens, list):
            raise APIError(400, f"'tokens': expected an array of token ids, got {protocol.type_name(tokens)}",
                           param="tokens", code="missing_required_parameter" if tokens is None else "invalid_type")
        self._check_engine(needs_model=False)  # the tokenizer serves while the engine sleeps
        if tokens:
            try:
                tokens = self.engine.encode(tokens, "tokens")  # ints inside the vocabulary
            except (ValueError, TypeError) as e:
                raise field_error("tokens", e) from None
        text = await anyio.to_thread.run_sync(self.engine.tokenizer.decode, tokens)
        return JSONResponse({"prompt": text})
