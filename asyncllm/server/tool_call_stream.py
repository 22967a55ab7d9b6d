"""Streaming an answer that may hold tool calls, as OpenAI streams them: per call, a delta with
its index, id, type and name (arguments ""), then its arguments in pieces as the model writes
them; finish_reason "tool_calls" at the end.

A call is streamed once its name is complete and its arguments value has begun: a forced named
call (the output is the arguments object) at once; "required" (an array of {"name",
"parameters"}) and Hermes <tool_call>{"name": ..., "arguments": ...}</tool_call> element by
element. Llama 3's bare JSON is decided only at the end (its calls come in the last chunk).
The pieces are the raw text the model writes, which is what the whole answer's arguments are
(tool_calls.parse_output), so a client's accumulated calls equal the non-streamed ones; the
whole answer's parse has the last word and its calls not yet streamed are sent at the end.
"""
from __future__ import annotations

from dataclasses import dataclass

from asyncllm.server.json_scan import ObjectScan, OpenContainer, scan_array_of_objects, scan_object, skip_whitespace
from asyncllm.server.tool_calls import ToolCallFormat, ToolRequest, new_call, parse_output


@dataclass
class StreamedCall:
    id: str
    arguments: str = ""  # sent so far


class ToolCallStream:
    """One answer's content and tool-call deltas, fed the text as it comes."""

    def __init__(self, tools: ToolRequest, fmt: ToolCallFormat):
        self.tools, self.fmt = tools, fmt
        self.known = {t["function"]["name"] for t in tools.tools}
        self.text = ""
        self.sent = 0  # characters of text already streamed as content
        self.holding = tools.forced  # from `sent` on, no more content: calls (or the end) decide
        self.calls: list[StreamedCall] = []
        self.stopped = False  # something the stream cannot follow: the end decides the rest
        self.open_arguments: tuple[int, OpenContainer] | None = None  # (call index, its arguments value)

    def feed(self, delta: str) -> tuple[str, list[dict]]:
        """(the content, the tool-call deltas) that may be sent now."""
        self.text += delta
        content = "" if self.holding else self._content()
        return content, (self._call_deltas() if self.holding and not self.stopped else [])

    def _content(self) -> str:
        if not self.fmt.start:  # a bare JSON call is the whole message: decided by its first character
            head = self.text.lstrip()
            if not head:
                return ""
            self.holding = head[0] in "{<"
            end = self.sent if self.holding else len(self.text)
        else:
            end = self.text.find(self.fmt.start, self.sent)
            self.holding = end != -1
            if end == -1:  # hold back a tail that may be the start of the marker
                end = len(self.text)
                for k in range(min(len(self.fmt.start) - 1, len(self.text) - self.sent), 0, -1):
                    if self.fmt.start.startswith(self.text[-k:]):
                        end -= k
                        break
        out, self.sent = self.text[self.sent:end], end
        return out

    def _scans(self) -> list[tuple[str | None, int | None, int | None]]:
        """(name, arguments start, arguments end) of each call seen so far."""
        text = self.text
        if self.tools.choice == "named":
            start = skip_whitespace(text, 0)
            if start >= len(text) or text[start] != "{":
                return []
            end = scan_object(text, start).end
            return [(self.tools.named, start, end)]
        if self.tools.choice == "required":
            start = skip_whitespace(text, 0)
            if start >= len(text) or text[start] != "[":
                return []
            return [self._call_span(scan, ("parameters",)) for scan in scan_array_of_objects(text, start)]
        if not self.fmt.start:
            return []  # Llama 3's bare JSON: at the end
        spans, position = [], self.sent
        while (opened := text.find(self.fmt.start, position)) != -1:
            start = skip_whitespace(text, opened + len(self.fmt.start))
            if start >= len(text) or text[start] != "{":
                break
            scan = scan_object(text, start)
            spans.append(self._call_span(scan, self.fmt.argument_keys))
            if scan.end is None or not self.tools.parallel:
                break
            position = scan.end
        return spans

    def _call_span(self, scan: ObjectScan, keys: tuple[str, ...]) -> tuple[str | None, int | None, int | None]:
        name = scan.string(self.text, "name")
        for key in keys:
            if key in scan.fields:
                return (name, *scan.fields[key])
        return name, None, None

    def _call_deltas(self) -> list[dict]:
        deltas = []
        if self.open_arguments is not None:  # arguments being written: only the new text is read
            index, value = self.open_arguments
            end = value.advance(self.text)
            self._send_arguments(index, value.start, end, deltas)
            if end is None:
                return deltas
            self.open_arguments = None
        for index, (name, start, end) in enumerate(self._scans()):
            if name is None:
                break
            if name not in self.known:  # not a call the whole answer's parse would return
                self.stopped = True
                break
            if index == len(self.calls):
                call = new_call(name, "")
                self.calls.append(StreamedCall(call["id"]))
                deltas.append({"index": index, **call})
            if start is None or (end is None and self.text[start] not in "{["):
                break  # a scalar's end is not known yet
            self._send_arguments(index, start, end, deltas)
            if end is None:
                self.open_arguments = (index, OpenContainer(start))
                self.open_arguments[1].advance(self.text)
                break
        return deltas

    def _send_arguments(self, index: int, start: int, end: int | None, deltas: list[dict]) -> None:
        piece = self.text[start:len(self.text) if end is None else end][len(self.calls[index].arguments):]
        if piece:
            self.calls[index].arguments += piece
            deltas.append({"index": index, "function": {"arguments": piece}})

    def finish(self) -> tuple[str, list[dict], bool]:
        """(the content still to send, the last tool-call deltas, whether the answer called tools)
        once the answer is complete."""
        _, calls = parse_output(self.text, self.tools, self.fmt)
        if not calls:  # no call parses (cut short by max_tokens): what streamed stays
            if self.calls or self.tools.forced:  # a forced call's output is never content
                return "", [], bool(self.calls)
            return self.text[self.sent:], [], False
        deltas = []
        for index, call in enumerate(calls):
            arguments = call["function"]["arguments"]  # read before a header blanks it
            if index >= len(self.calls):  # the header, as for a call streamed as it came
                call["function"]["arguments"] = ""
                self.calls.append(StreamedCall(call["id"]))
                deltas.append({"index": index, **call})
            if arguments.startswith(self.calls[index].arguments) and arguments != self.calls[index].arguments:
                deltas.append({"index": index, "function": {"arguments": arguments[len(self.calls[index].arguments):]}})
        return "", deltas, True
