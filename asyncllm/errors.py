from __future__ import annotations


class AsyncLLMError(Exception):
    """Base class of asyncllm's own errors."""


class ArgumentError(AsyncLLMError):
    """An argument, or a field of one, refused where it was passed. Raised as InvalidValueError (a
    ValueError) or InvalidTypeError (a TypeError), so that `except ValueError` / `except TypeError`
    catch it as before; a caller that names fields its own way (the server's OpenAI `param`) reads
    them here instead of parsing the message.

    argument: the argument as the message names it, with the item refused where one was
    ("prompt", "prompts[3][1]", "logit_bias[0]"); field: the argument itself ("prompts",
    "logit_bias"); owner: the class whose field it is ("SamplingParams", "Config",
    "StructuredOutput"), None for a method's argument; reason: what is wrong with it.
    The message: "SamplingParams.top_p: must be in (0, 1], got 0.0"."""

    def __init__(self, argument: str, reason: str, owner: str | None = None):
        self.argument = argument
        self.field = argument.partition("[")[0]
        self.reason = reason
        self.owner = owner
        super().__init__(f"{owner}.{argument}: {reason}" if owner else f"{argument}: {reason}")

    @property
    def message_without_owner(self) -> str:
        """The message without the owner's name: "top_p: must be in (0, 1], got 0.0"."""
        return f"{self.argument}: {self.reason}"

    def __reduce__(self):  # pickled (a tensor-parallel worker's error) by its fields, not its message
        return type(self), (self.argument, self.reason, self.owner)


class InvalidValueError(ArgumentError, ValueError):
    """An argument or field whose value is refused (see ArgumentError)."""


class InvalidTypeError(ArgumentError, TypeError):
    """An argument or field whose type is refused (see ArgumentError)."""


class EngineDeadError(AsyncLLMError):
    """The engine's step loop has failed or stopped; no request can be served any more."""


class PromptTooLongError(InvalidValueError):
    """The prompt leaves no room to generate within the engine's length limit."""


class QueueFullError(AsyncLLMError):
    """More requests are queued than max_queued_requests allows; retry later."""


class UnsatisfiableConstraintsError(InvalidValueError):
    """A request's constraints left no token to sample: its grammar allows none of the tokens that
    allowed_token_ids, bad_words or min_tokens leave. Raised by its stream; nothing they forbid was
    delivered, and the other requests go on. reason: where and why (the grammar's refusal)."""

    def __init__(self, reason: str):
        super().__init__("structured_output", reason, "SamplingParams")

    def __reduce__(self):
        return type(self), (self.reason,)


class RequestTimeoutError(AsyncLLMError, TimeoutError):
    """A request's timeout (SamplingParams.timeout) passed before it produced its first token: it
    waited in the queue (or was still computing its prompt) that long, and was dropped there. Raised
    by its stream; a request that had produced tokens ends instead with finish_reason "timeout"."""


class EngineAsleepError(AsyncLLMError):
    """A request reached an engine that sleep() put to sleep; wake() it first (engine/lifecycle.py)."""


class EngineNotIdleError(AsyncLLMError, RuntimeError):
    """sleep() or reload() while a request is queued or running: they run between requests (wait for
    them, AsyncLLMEngine.wait_idle(), or abort them first)."""
