"""Where the values of a JSON object lie in text that may still be growing: what streaming tool
calls need to send a call's name once it is complete and its arguments as the raw text the model
writes (the same text the whole answer returns, so that a client's accumulated deltas equal it)."""
from __future__ import annotations

import json
from dataclasses import dataclass, field

WHITESPACE = " \t\n\r"


def skip_whitespace(text: str, i: int) -> int:
    while i < len(text) and text[i] in WHITESPACE:
        i += 1
    return i


def value_end(text: str, i: int) -> int | None:
    """The end (exclusive) of the JSON value that starts at text[i]; None while it is incomplete.
    A scalar other than a string is complete only once something follows it."""
    first = text[i]
    if first == '"':
        j = i + 1
        while j < len(text):
            if text[j] == "\\":
                j += 2
                continue
            if text[j] == '"':
                return j + 1
            j += 1
        return None
    if first in "{[":
        return OpenContainer(i).advance(text)
    j = i
    while j < len(text) and text[j] not in ",}]" + WHITESPACE:
        j += 1
    return j if j < len(text) else None


class OpenContainer:
    """An object or array value read as its text grows: advance() goes on from where it stopped,
    so following a long value costs the new text only."""

    def __init__(self, start: int):
        self.start = start
        self.position, self.depth, self.in_string, self.end = start, 0, False, None

    def advance(self, text: str) -> int | None:
        """The end (exclusive) of the value once text holds it all; None till then."""
        j, depth, in_string = self.position, self.depth, self.in_string
        while self.end is None and j < len(text):
            ch = text[j]
            if in_string:
                if ch == "\\":
                    if j + 1 == len(text):
                        break  # the escaped character is still to come
                    j += 2
                    continue
                in_string = ch != '"'
            elif ch == '"':
                in_string = True
            elif ch in "{[":
                depth += 1
            elif ch in "}]":
                depth -= 1
                if depth == 0:
                    self.end = j + 1
            j += 1
        self.position, self.depth, self.in_string = j, depth, in_string
        return self.end


@dataclass
class ObjectScan:
    """The members of an object seen so far: key -> (start, end or None while incomplete) of the value."""
    fields: dict[str, tuple[int, int | None]] = field(default_factory=dict)
    end: int | None = None  # after the closing brace, once the object is complete

    def string(self, text: str, key: str) -> str | None:
        """The decoded value of `key` once complete, if it is a string."""
        start, end = self.fields.get(key, (0, None))
        if end is None:
            return None
        try:
            value = json.loads(text[start:end])
        except ValueError:
            return None
        return value if isinstance(value, str) else None


def scan_object(text: str, i: int) -> ObjectScan:
    """The object that starts at text[i] ('{'), as far as text goes. Malformed text stops the scan
    (as if incomplete): the whole answer's parse has the last word."""
    scan = ObjectScan()
    j = skip_whitespace(text, i + 1)
    while j < len(text):
        if text[j] == "}":
            scan.end = j + 1
            break
        if text[j] == ",":
            j = skip_whitespace(text, j + 1)
            continue
        key_end = value_end(text, j) if text[j] == '"' else None
        if key_end is None:
            break
        try:
            key = json.loads(text[j:key_end])
        except ValueError:
            break
        j = skip_whitespace(text, key_end)
        if j >= len(text) or text[j] != ":":
            break
        j = skip_whitespace(text, j + 1)
        if j >= len(text):
            break
        end = value_end(text, j)
        scan.fields[key] = (j, end)
        if end is None:
            break
        j = skip_whitespace(text, end)
    return scan


def scan_array_of_objects(text: str, i: int) -> list[ObjectScan]:
    """The objects of the array that starts at text[i] ('['), as far as text goes."""
    scans = []
    j = skip_whitespace(text, i + 1)
    while j < len(text) and text[j] == "{":
        scans.append(scan_object(text, j))
        if scans[-1].end is None:
            break
        j = skip_whitespace(text, scans[-1].end)
        if j < len(text) and text[j] == ",":
            j = skip_whitespace(text, j + 1)
    return scans
