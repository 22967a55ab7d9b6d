class AsyncLLMError(Exception):
    """Base class of asyncllm's own errors."""


class EngineDeadError(AsyncLLMError):
    """The engine's step loop has failed or stopped; no request can be served any more."""


class PromptTooLongError(AsyncLLMError, ValueError):
    """The prompt leaves no room to generate within the engine's length limit."""


class QueueFullError(AsyncLLMError):
    """More requests are queued than max_queued_requests allows; retry later."""


class UnsatisfiableConstraintsError(AsyncLLMError, ValueError):
    """A request's constraints left no token to sample: its grammar allows none of the tokens that
    allowed_token_ids, bad_words or min_tokens leave. Raised by its stream; nothing they forbid was
    delivered, and the other requests go on."""


class RequestTimeoutError(AsyncLLMError, TimeoutError):
    """A request's timeout (SamplingParams.timeout) passed before it produced its first token: it
    waited in the queue (or was still computing its prompt) that long, and was dropped there. Raised
    by its stream; a request that had produced tokens ends instead with finish_reason "timeout"."""
