"""asyncllm: an LLM inference engine to embed in Python applications."""
from asyncllm.async_engine import AsyncLLMEngine
from asyncllm.config import Config
from asyncllm.errors import EngineDeadError, PromptTooLongError, QueueFullError
from asyncllm.llm import LLM
from asyncllm.sampling_params import SamplingParams
from asyncllm.streams import RequestResult, StreamOutput
from asyncllm.structured import StructuredOutput

__all__ = ["AsyncLLMEngine", "StreamOutput", "RequestResult", "LLM", "Config", "SamplingParams", "StructuredOutput",
           "EngineDeadError", "PromptTooLongError", "QueueFullError"]
__version__ = "0.1.0"
