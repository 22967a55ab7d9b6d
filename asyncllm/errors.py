class AsyncLLMError(Exception):
    """Base class of asyncllm's own errors."""


class EngineDeadError(AsyncLLMError):
    """The engine's step loop has failed or stopped; no request can be served any more."""


class QueueFullError(AsyncLLMError):
    """More requests are queued than max_queued_requests allows; retry later."""
