"""The engine streams of one request: one per prompt (completions takes a list of prompts), read as
one stream of choices numbered as OpenAI and vLLM number them, prompt p's choice i being p * n + i."""
from __future__ import annotations

from asyncllm.streams import RequestResult, RequestStream, StreamOutput


class StreamGroup:
    """Prompt p's engine stream is streams[p]. Iterating yields every stream's items with their
    choice index; with one prompt that is the engine stream itself (nothing added per token). The
    prompts are read one after another: they run side by side in the engine, and a stream not yet
    read keeps its tokens in its channel, so all finish as soon as they would read at once."""

    def __init__(self, streams: list[RequestStream], n: int):
        self.streams = streams
        self.n = n
        self._reading = 0  # the prompt whose stream is being read

    @property
    def num_choices(self) -> int:
        return len(self.streams) * self.n

    @property
    def num_prompt_tokens(self) -> int:
        return sum(len(stream.prompt_token_ids) for stream in self.streams)

    @property
    def num_completion_tokens(self) -> int:
        return sum(stream.num_completion_tokens for stream in self.streams)

    def __aiter__(self):
        return self.streams[0] if len(self.streams) == 1 else self

    async def __anext__(self) -> StreamOutput:
        while self._reading < len(self.streams):
            try:
                out = await self.streams[self._reading].__anext__()
            except StopAsyncIteration:
                self._reading += 1
                continue
            out.index += self._reading * self.n
            return out
        raise StopAsyncIteration

    def result(self, index: int, text: str) -> RequestResult:
        """Choice index's result, once its stream has finished (text: its whole text)."""
        result = self.streams[index // self.n].result(index % self.n, text)
        result.index = index
        return result

    async def aclose(self) -> None:
        """Aborts every prompt's request that has not finished."""
        for stream in self.streams:
            await stream.aclose()
