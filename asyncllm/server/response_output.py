"""A Responses API answer's output items (reasoning, message, function calls), built from the
answer's text as it comes: as the API's stream events, and whole as the response's `output`.

Events, in the order OpenAI sends them: response.created, response.in_progress; per item
response.output_item.added, then for a message response.content_part.added,
response.output_text.delta..., response.output_text.done, response.content_part.done (a reasoning
item the same with response.reasoning_text.*; a function call response.function_call_arguments.delta...
and .done), response.output_item.done; last response.completed (response.incomplete when
max_output_tokens cut it short). A whole answer is the same text fed at once, so both agree.
"""
from __future__ import annotations

import uuid

from asyncllm.server import tool_calls
from asyncllm.server.choices import chat_logprobs
from asyncllm.server.tool_call_stream import ToolCallStream


def _item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class ResponseOutput:
    """response: the response object without its output (id, model, the request's settings);
    tools: (ToolRequest, ToolCallFormat) when the answer may call functions; logprobs: whether
    output text carries its tokens' logprobs."""

    def __init__(self, response: dict, tools: tuple[tool_calls.ToolRequest, tool_calls.ToolCallFormat] | None,
                 logprobs: bool):
        self.response = {**response, "status": "in_progress", "output": []}
        self.items = self.response["output"]
        self.calls = ToolCallStream(*tools) if tools is not None else None
        self.logprobs = logprobs
        self.held_logprobs = []  # of answer text held back while it may be part of a call
        self.open: dict | None = None  # the item being written
        self.call_items: dict[int, int] = {}  # a call's index -> its item's output index
        self.sequence = -1
        self.reasoning_tokens = 0

    def _event(self, kind: str, **fields) -> dict:
        self.sequence += 1
        return {"type": kind, "sequence_number": self.sequence, **fields}

    def start(self) -> list[dict]:
        return [self._event("response.created", response=self._snapshot()),
                self._event("response.in_progress", response=self._snapshot())]

    def _snapshot(self) -> dict:
        return {**self.response, "output": []}

    # ---- items ----
    def _open(self, item: dict, part: dict | None) -> list[dict]:
        events = self._close()
        self.items.append(item)
        self.open = item
        index = len(self.items) - 1
        events.append(self._event("response.output_item.added", output_index=index, item=_copy(item)))
        if part is not None:
            item["content"].append(part)
            events.append(self._event("response.content_part.added", item_id=item["id"], output_index=index,
                                      content_index=0, part=_copy_part(part)))
        return events

    def _close(self, status: str = "completed") -> list[dict]:
        item, self.open = self.open, None
        if item is None:
            return []
        index = self.items.index(item)
        item["status"] = status
        where = {"item_id": item["id"], "output_index": index}
        events = []
        if item["type"] == "function_call":
            events.append(self._event("response.function_call_arguments.done", **where, name=item["name"],
                                      arguments=item["arguments"]))
        else:
            part = item["content"][0]
            if item["type"] == "message":
                done = {"logprobs": part["logprobs"]} if self.logprobs else {}
                events.append(self._event("response.output_text.done", **where, content_index=0, text=part["text"],
                                          **done))
            else:
                events.append(self._event("response.reasoning_text.done", **where, content_index=0, text=part["text"]))
            events.append(self._event("response.content_part.done", **where, content_index=0, part=_copy_part(part)))
        events.append(self._event("response.output_item.done", output_index=index, item=_copy(item)))
        return events

    def _reasoning(self, text: str) -> list[dict]:
        events = []
        if self.open is None or self.open["type"] != "reasoning":
            events += self._open({"type": "reasoning", "id": _item_id("rs"), "summary": [], "content": [],
                                  "status": "in_progress"}, {"type": "reasoning_text", "text": ""})
        self.open["content"][0]["text"] += text
        events.append(self._event("response.reasoning_text.delta", item_id=self.open["id"],
                                  output_index=len(self.items) - 1, content_index=0, delta=text))
        return events

    def _text(self, text: str, logprobs: list) -> list[dict]:
        events = []
        if self.open is None or self.open["type"] != "message":
            part = {"type": "output_text", "text": "", "annotations": []}
            if self.logprobs:
                part["logprobs"] = []
            events += self._open({"type": "message", "id": _item_id("msg"), "role": "assistant", "content": [],
                                  "status": "in_progress"}, part)
        part = self.open["content"][0]
        part["text"] += text
        delta = {}
        if self.logprobs:
            entries = chat_logprobs(logprobs)["content"] if logprobs else []
            part["logprobs"].extend(entries)
            delta["logprobs"] = entries
        events.append(self._event("response.output_text.delta", item_id=self.open["id"],
                                  output_index=len(self.items) - 1, content_index=0, delta=text, **delta))
        return events

    def _call(self, delta: dict) -> list[dict]:
        events = []
        if "id" in delta:  # a new call: its name, arguments to follow
            events += self._open({"type": "function_call", "id": _item_id("fc"), "call_id": delta["id"],
                                  "name": delta["function"]["name"], "arguments": "", "status": "in_progress"}, None)
            self.call_items[delta["index"]] = len(self.items) - 1
        piece = delta["function"].get("arguments")
        if piece:
            index = self.call_items[delta["index"]]
            item = self.items[index]
            item["arguments"] += piece
            events.append(self._event("response.function_call_arguments.delta", item_id=item["id"],
                                      output_index=index, delta=piece))
        return events

    def _answer(self, content: str, call_deltas: list[dict], logprobs: list) -> list[dict]:
        self.held_logprobs.extend(logprobs or ())
        events = []
        if content:
            events += self._text(content, self.held_logprobs)
            self.held_logprobs = []
        for delta in call_deltas:
            events += self._call(delta)
        return events

    # ---- the answer as it comes ----
    def add(self, out) -> list[dict]:
        """The events of one stream item (its reasoning, then its answer text)."""
        if out.reasoning and not out.text:
            self.reasoning_tokens += len(out.token_ids)
        events = self._reasoning(out.reasoning) if out.reasoning else []
        if self.calls is None:
            if out.text:  # an item of reasoning only: its tokens' logprobs are the reasoning's, not sent
                events += self._text(out.text, out.logprobs)
        else:
            events += self._answer(*self.calls.feed(out.text), out.logprobs if out.text else None)
        return events

    def finish(self, finish_reason: str, usage: dict) -> list[dict]:
        """The last events once the answer has finished: its calls as the whole text parses, each item
        done, and response.completed, or response.incomplete when max_output_tokens cut it short."""
        events = []
        if self.calls is not None:
            content, call_deltas, _ = self.calls.finish()
            events += self._answer(content, call_deltas, [])
        incomplete = finish_reason == "length"
        if not any(item["type"] in ("message", "function_call") for item in self.items):
            events += self._text("", [])  # an answer that said nothing is an empty message
        events += self._close("incomplete" if incomplete else "completed")
        self.response.update(status="incomplete" if incomplete else "completed", usage={
            "input_tokens": usage["prompt_tokens"], "input_tokens_details": {"cached_tokens": usage["cached_tokens"]},
            "output_tokens": usage["completion_tokens"],
            "output_tokens_details": {"reasoning_tokens": self.reasoning_tokens},
            "total_tokens": usage["prompt_tokens"] + usage["completion_tokens"]},
            incomplete_details={"reason": "max_output_tokens"} if incomplete else None)
        kind = "response.incomplete" if incomplete else "response.completed"
        return events + [self._event(kind, response=self.response)]

    def failed(self, code: str, message: str) -> list[dict]:
        """The response ends with an error (the engine died, the server shuts down, constraints that
        leave no token): response.failed, carrying what was written."""
        if self.open is not None:
            self.open["status"], self.open = "incomplete", None
        self.response.update(status="failed", error={"code": code, "message": message})
        return [self._event("response.failed", response=self.response)]


def _copy(item: dict) -> dict:
    """An item as it stands now (events carry snapshots; the item goes on growing)."""
    copy = dict(item)
    if "content" in item:
        copy["content"] = [_copy_part(part) for part in item["content"]]
    return copy


def _copy_part(part: dict) -> dict:
    return {**part, "logprobs": list(part["logprobs"])} if "logprobs" in part else dict(part)
