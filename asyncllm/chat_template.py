"""A conversation as prompt token ids, through the tokenizer's chat template (AsyncLLMEngine.chat and
apply_chat_template, and so the server's chat route and /tokenize).

Everything the caller passes is checked, and its length bounded, before the template renders it: a
10 MB message is refused by its characters, not after seconds of rendering and tokenizing. Special-token
text in what the caller passes (`<|im_start|>system` in a message's content, in tools or in template
variables) is encoded as plain text, so that a user's words cannot open a turn of another role; only
the template's own special tokens become special token ids. That is transformers'
apply_chat_template(sanitize_control_tokens=True): its control tokens are the tokenizer's special
tokens and the added tokens the template itself writes (Qwen3's `<think>`, `<tool_call>`). The engine
option parse_special_tokens_in_chat_content=True keeps the old way, where such text became the tokens.

A new turn renders the whole conversation again, but the engine's TextPieceEncoder
(engine/text_pieces.py) encodes only the text an earlier turn did not (issue 44): exactly the ids
above, taken where the caller's strings hold no added token's text (then sanitizing changes nothing).
"""
from __future__ import annotations

import functools
import importlib.metadata
import inspect

from asyncllm.engine.intake import check_text
from asyncllm.errors import InvalidTypeError, InvalidValueError, PromptTooLongError

# the private-use characters transformers' sanitize_control_tokens wraps around control tokens in the
# caller's strings (transformers.utils.chat_template_utils), and drops when it encodes the chat
_CONTROL_MARKERS = ("\U000f0000", "\U000f0001")

# apply_chat_template's own keywords, not template variables: the engine sets them, the caller cannot
# ("messages": the conversation is the messages argument, not a keyword beside it)
RESERVED_KEYWORDS = frozenset({"conversation", "messages", "tokenize", "return_dict", "return_tensors", "padding", "truncation",
                               "max_length", "return_assistant_tokens_mask", "tokenizer_kwargs",
                               "sanitize_control_tokens"})
# the keywords transformers gives a meaning, and the types they take
_TYPED_KEYWORDS = {"add_generation_prompt": ((bool,), "a bool"),
                   "continue_final_message": ((bool, str), "a bool or the name of the field to continue"),
                   "chat_template": ((str, type(None)), "a string or None"),
                   "tools": ((list, tuple, type(None)), "a list of tools or None"),
                   "documents": ((list, tuple, type(None)), "a list of documents or None")}


def check_messages(messages) -> None:
    if not isinstance(messages, (list, tuple)) or not messages:
        raise InvalidValueError("messages", "expected a non-empty list of {'role': ..., 'content': ...} dicts")
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise InvalidTypeError(f"messages[{i}]", f"expected a dict, got {type(message).__name__}")
        if not isinstance(message.get("role"), str) or not message.get("role"):
            raise InvalidValueError(f"messages[{i}]", "'role' must be a non-empty string")
        if not isinstance(message.get("content"), str):
            raise InvalidValueError(f"messages[{i}]", "'content' must be a string")


def check_template_kwargs(template_kwargs: dict) -> None:
    reserved = sorted(RESERVED_KEYWORDS & set(template_kwargs))
    if reserved:
        raise InvalidTypeError(reserved[0], "not a chat template variable (the engine tokenizes the chat itself)")
    for name, (types, expected) in _TYPED_KEYWORDS.items():
        if name in template_kwargs and not isinstance(template_kwargs[name], types):
            raise InvalidTypeError(name, f"expected {expected}, got {type(template_kwargs[name]).__name__}")
    for name in ("tools", "documents"):
        for i, item in enumerate(template_kwargs.get(name) or ()):
            if not isinstance(item, dict) and not (name == "tools" and callable(item)):
                expected = "a dict (a JSON schema) or a function" if name == "tools" else "a dict"
                raise InvalidTypeError(f"{name}[{i}]", f"expected {expected}, got {type(item).__name__}")
    if template_kwargs.get("chat_template") == "":
        raise InvalidValueError("chat_template", "the template is empty (None: the tokenizer's own)")


def check_length(messages, template_kwargs: dict, max_chars: int, max_seq_len: int) -> None:
    """Refuse, before rendering, what cannot fit: more characters than max_chars in the strings of the
    messages and template arguments together (a template writes them out whole). Each string is
    checked to be valid Unicode text on the way (the tokenizer would fail on it obscurely)."""
    total = 0
    for argument, value in [*((f"messages[{i}]", m) for i, m in enumerate(messages)), *template_kwargs.items()]:
        stack = [value]
        # every item counts at least 1, so this ends (over the limit) on a structure that holds itself
        while stack and total <= max_chars:
            item = stack.pop()
            if isinstance(item, str):
                total += len(item)
                if total <= max_chars:
                    check_text(item, argument)
                continue
            total += 1  # an item of a structure costs the template something too, whatever it is
            if isinstance(item, (dict, list, tuple)):
                stack.extend(item.items() if isinstance(item, dict) else item)
        if total > max_chars:
            raise PromptTooLongError("messages", f"more than {max_chars} characters cannot fit in max_model_len "
                                                 f"({max_seq_len} tokens)")


@functools.cache
def _sanitizes(tokenizer_type: type) -> bool:
    return "sanitize_control_tokens" in inspect.signature(tokenizer_type.apply_chat_template).parameters


def _caller_strings(messages, template_kwargs: dict):
    """Every string the caller passed that transformers' sanitize_control_tokens marks (dict keys too:
    more than it marks, never less); the template itself, which it does not mark, left out."""
    stack = [messages, *(value for name, value in template_kwargs.items() if name != "chat_template")]
    while stack:  # check_length walked these already: no structure holds itself
        item = stack.pop()
        if isinstance(item, str):
            yield item
        elif isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, (list, tuple)):
            stack.extend(item)


def render_chat(tokenizer, messages, template_kwargs: dict, parse_special_tokens_in_content: bool,
                text_encoder=None) -> list[int]:
    """The token ids of the conversation; the messages and keywords are checked already.
    text_encoder: the engine's TextPieceEncoder (engine/text_pieces.py) over tokenizer, which encodes
    only the pieces of the rendered text that an earlier turn did not; None: the whole text each time."""
    if not getattr(tokenizer, "chat_template", None) and not template_kwargs.get("chat_template"):
        raise ValueError("chat: this model's tokenizer has no chat template; use stream() with a prompt")
    # the assistant's turn opens, unless the last message is one to continue (the two exclude each other)
    template_kwargs.setdefault("add_generation_prompt", not template_kwargs.get("continue_final_message"))
    encode = text_encoder.encode if text_encoder is not None else functools.partial(tokenizer.encode,
                                                                                     add_special_tokens=False)
    if parse_special_tokens_in_content:
        return encode(tokenizer.apply_chat_template(list(messages), tokenize=False, **template_kwargs))
    if not _sanitizes(type(tokenizer)):
        # an older transformers would take the keyword as a template variable, and sanitize nothing
        # (the version read from the installed metadata: importing transformers here would cost every
        # `import asyncllm.async_engine` seconds; the tokenizer that got here imported it already)
        raise RuntimeError(f"chat: transformers {importlib.metadata.version('transformers')} cannot encode special-token text in "
                           "messages as text; install transformers >= 5.20, or start the engine with "
                           "parse_special_tokens_in_chat_content=True")
    if text_encoder is not None and not any(map(text_encoder.has_added_token, _caller_strings(messages, template_kwargs))):
        # no added token's text in what the caller passed: sanitizing marks nothing, and transformers
        # encodes the rendered text as tokenizer.encode does, unless a marker character is in it (the
        # caller's, which sanitizing drops first, or the template's): then transformers' way below
        text = tokenizer.apply_chat_template(list(messages), tokenize=False, **template_kwargs)
        if not any(marker in text for marker in _CONTROL_MARKERS):
            return encode(text)
    return tokenizer.apply_chat_template(list(messages), tokenize=True, return_dict=False,
                                         sanitize_control_tokens=True, **template_kwargs)


def chat_prompt_ids(core, messages, template_kwargs: dict, parse_special_tokens_in_content: bool = False) -> list[int]:
    """A conversation as checked prompt token ids (core: the EngineCore whose tokenizer and limits
    apply): its messages and keywords checked, its length bounded, then rendered and encoded."""
    check_messages(messages)
    check_template_kwargs(template_kwargs)
    check_length(messages, template_kwargs, core.max_prompt_chars, core.max_seq_len)
    token_ids = render_chat(core.tokenizer, messages, template_kwargs, parse_special_tokens_in_content,
                            core.chat_text_encoder)
    return core.encode_prompt(token_ids, "messages")
