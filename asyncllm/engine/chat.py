"""A conversation as a prompt, by the tokenizer's chat template: checked, rendered and encoded as
AsyncLLMEngine.chat and asyncllm.vllm's LLM.chat send it."""
from __future__ import annotations

from asyncllm.engine.core import EngineCore, check_text


def render_chat(core: EngineCore, messages, **chat_template_kwargs) -> tuple[str, list[int]]:
    """(the rendered prompt text, its checked token ids); add_generation_prompt defaults to True."""
    if not isinstance(messages, (list, tuple)) or not messages:
        raise ValueError("messages: expected a non-empty list of {'role': ..., 'content': ...} dicts")
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise TypeError(f"messages[{i}]: expected a dict, got {type(message).__name__}")
        if not isinstance(message.get("role"), str) or not message.get("role"):
            raise ValueError(f"messages[{i}]: 'role' must be a non-empty string")
        if not isinstance(message.get("content"), str):
            raise ValueError(f"messages[{i}]: 'content' must be a string")
        check_text(message["role"], f"messages[{i}]: 'role'")
        check_text(message["content"], f"messages[{i}]: 'content'")
    tokenizer = core.tokenizer
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("chat: this model's tokenizer has no chat template; use stream() with a prompt")
    chat_template_kwargs.setdefault("add_generation_prompt", True)
    text = tokenizer.apply_chat_template(list(messages), tokenize=False, **chat_template_kwargs)
    token_ids = tokenizer.encode(text, add_special_tokens=False)
    return text, core.encode_prompt(token_ids, "messages")
