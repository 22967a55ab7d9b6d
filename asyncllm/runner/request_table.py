"""The runner's own record of the requests it samples for (the idea of vLLM v1's persistent input
batch, our own code): each request's sampling settings, sent once (step_plan.RequestSampling), as
numpy columns by table row, so that a step's sampling arrays are gathers over its rows; its tokens
as the runner learns them (each step's results, appended when the step is read); which row of a
launched step is still sampling its next token (the inputs of the next step take that row's id
on the device where its plan says the request's last token is in flight); its penalties'
token-count slot.

A request joins in the plan of its first sampling step and leaves when the engine ends it
(ModelRunner.release_request). Nothing here hangs on the request's KV: a preempted request keeps
its row, its tokens and its slot.
"""
from __future__ import annotations

import numpy as np

from asyncllm.step_plan import RequestSampling, StepPlan

# a row's flags (RequestTable.flags), each a question a step asks of its rows at once (an OR over them)
RANDOM = 1  # samples with temperature > 0
SEEDED = 2  # ... with a seed
TOP_K = 4  # ... with top-k (likewise top-p, min-p): a greedy row's filters change nothing
TOP_P = 8
MIN_P = 16
ADJUSTS = 32  # penalties, biases, bans or allowed ids
LOGPROBS = 64  # asks for log-probabilities
GRAMMAR = 128  # held to a grammar
# its sampling reads its history (its tokens, or their count): the table tracks its tokens in
# flight and appends its results; a row without it costs the table nothing per step
HISTORY = 256

# the numpy columns, by name: (dtype, the value of a row no request holds)
_COLUMNS = dict(flags=(np.int64, 0), temperature=(np.float32, 0.0), top_k=(np.int64, 0), top_p=(np.float32, 1.0),
                min_p=(np.float32, 0.0), logprobs=(np.int64, -1), pending_row=(np.int64, -1),
                pending_step=(np.int64, -1), sampled_row=(np.int64, -1))


def request_flags(s: RequestSampling) -> int:
    """The request's flags (the constants above)."""
    randomly = s.temperature > 0
    flags = (RANDOM * randomly | SEEDED * (randomly and s.seed is not None) | TOP_K * (randomly and s.top_k > 0)
             | TOP_P * (randomly and s.top_p < 1.0) | MIN_P * (randomly and s.min_p > 0)
             | ADJUSTS * s.adjusts_logits | LOGPROBS * (s.logprobs is not None) | GRAMMAR * (s.grammar is not None))
    return flags | HISTORY * bool(flags & (SEEDED | ADJUSTS | GRAMMAR))


class RequestEntry:
    """One request's row: its settings, and (HISTORY) its tokens as far as the runner has read its
    steps; a request without HISTORY has none (the engine sends none)."""
    __slots__ = ("settings", "token_ids", "row", "penalty_slot")

    def __init__(self, settings: RequestSampling, row: int):
        self.settings = settings
        # (HISTORY) results are appended to it: the list request_sampling copied for the runner
        # (copying it again would cost a long conversation every turn, in proportion to its length)
        self.token_ids = settings.token_ids
        self.row = row
        self.penalty_slot = -1  # its TokenCounts slot, from its first step that applies penalties


class RequestTable:
    def __init__(self, vocab_size: int, capacity: int = 64):
        self.vocab_size = vocab_size
        self.entries: dict[int, RequestEntry] = {}  # request key -> its entry (which holds its table row)
        self.free_rows: list[int] = []
        self.num_launched = 0  # steps launched (pending_step numbers them)
        self.capacity = 0
        for name, (dtype, _) in _COLUMNS.items():
            setattr(self, name, np.zeros(0, dtype=dtype))
        self._grow(capacity)

    def __len__(self) -> int:
        return len(self.entries)

    def __contains__(self, request: int) -> bool:
        return request in self.entries

    def _grow(self, capacity: int) -> None:
        for name, (dtype, vacant) in _COLUMNS.items():
            column = np.full(capacity, vacant, dtype=dtype)
            column[:self.capacity] = getattr(self, name)
            setattr(self, name, column)
        self.free_rows.extend(range(capacity - 1, self.capacity - 1, -1))  # the lowest row first
        self.capacity = capacity

    def add(self, settings: RequestSampling) -> None:
        """A request's first sampling step is being planned: its row, filled once."""
        if settings.request in self.entries:
            raise ValueError(f"RequestSampling.request: {settings.request} is already in the runner's table")
        if not self.free_rows:
            self._grow(2 * self.capacity)
        row = self.free_rows.pop()
        self.entries[settings.request] = RequestEntry(settings, row)
        s = settings
        for name, value in (("flags", request_flags(s)), ("temperature", s.temperature),
                            ("top_k", s.top_k if s.top_k > 0 else self.vocab_size), ("top_p", s.top_p),
                            ("min_p", s.min_p), ("logprobs", -1 if s.logprobs is None else s.logprobs),
                            ("pending_row", -1), ("pending_step", -1), ("sampled_row", -1)):
            getattr(self, name)[row] = value

    def remove(self, request: int) -> RequestEntry | None:
        """The engine ended the request: its row is free (None: the table never had it)."""
        entry = self.entries.pop(request, None)
        if entry is not None:
            row = entry.row
            for name, (_, vacant) in _COLUMNS.items():
                getattr(self, name)[row] = vacant
            self.free_rows.append(row)
        return entry

    def clear(self) -> list[RequestEntry]:
        """Every request leaves (a sleeping engine has none); returns their entries."""
        entries = list(self.entries.values())
        for entry in entries:
            self.remove(entry.settings.request)
        return entries

    def rows(self, request_ids: list[int]) -> np.ndarray:
        """The table rows of the given requests, in order."""
        entries = self.entries
        return np.array([entries[request].row for request in request_ids], dtype=np.int64)

    def num_generated(self, row: int, entry: RequestEntry) -> int:
        """(HISTORY) The completion token the request samples next is its number num_generated (its
        token in flight, if any, counted)."""
        return len(entry.token_ids) - entry.settings.num_prompt_tokens + (self.pending_row[row] >= 0)

    def in_flight_rows(self, plan: StepPlan, rows: np.ndarray) -> np.ndarray:
        """For each of plan's sampling rows whose last token is in flight (StepPlan.in_flight_rows;
        rows: the step's sampling rows' table rows), its row among the sampled ids of the step in
        flight (the last launched, which sampled it). Before launched() records this step."""
        return self.sampled_row[rows[plan.in_flight_rows]]

    def launched(self, plan: StepPlan, rows: np.ndarray, flags: np.ndarray, any_flags: int) -> tuple[int, list]:
        """plan's step is launched (rows, flags: its sampling rows' table rows and flags; any_flags:
        their OR): each request's next token is in flight at its sampling row (sampled_row; a
        speculating step, never left in flight, writes rows no step reads) and, for a request with
        HISTORY, tracked until the step is read (pending_row, at its first sampling row). Returns
        what recorded() takes: the step's number and those requests' (row, key)."""
        self.sampled_row[rows] = np.arange(len(rows))
        self.num_launched += 1
        if not any_flags & HISTORY:
            return self.num_launched, []
        tracked = np.flatnonzero(flags & HISTORY)
        if plan.rows_per_request is not None:  # a speculating request's positions: its first row
            tracked = tracked[speculative_positions(plan.rows_per_request)[tracked] == 0]
        self.pending_row[rows[tracked]] = tracked
        self.pending_step[rows[tracked]] = self.num_launched
        return self.num_launched, [(row, plan.sampling_ids[row]) for row in tracked.tolist()]

    def recorded(self, launched: tuple[int, list], plan: StepPlan, token_ids: list[int],
                 num_per_row: list[int] | None) -> None:
        """A step's results are read (launched: what launched() returned): each tracked request's
        tokens join its own, and its token in flight is known, unless a later step samples another.
        Requests ended meanwhile are skipped."""
        step, tracked = launched
        if not tracked:
            return
        if num_per_row is not None:  # a speculating step: each request's kept tokens, by its first row
            counts = np.array(num_per_row, dtype=np.int64)
            first_token = dict(zip(speculative_firsts(plan.rows_per_request).tolist(),
                                   zip((np.cumsum(counts) - counts).tolist(), num_per_row)))
        entries, pending_row, pending_step = self.entries, self.pending_row, self.pending_step
        for row, request in tracked:
            entry = entries.get(request)
            if entry is None:
                continue
            if num_per_row is None:
                entry.token_ids.append(token_ids[row])
            else:
                at, count = first_token[row]
                entry.token_ids.extend(token_ids[at:at + count])
            table_row = entry.row
            if pending_step[table_row] == step:
                pending_row[table_row] = pending_step[table_row] = -1


def speculative_firsts(rows_per_request: list[int]) -> np.ndarray:
    """Each request's first sampling row in a speculating step."""
    counts = np.array(rows_per_request, dtype=np.int64)
    return np.cumsum(counts) - counts


def speculative_positions(rows_per_request: list[int]) -> np.ndarray:
    """Each sampling row's position j within its request's rows (a speculating request's rows take
    their first j drafts as generated)."""
    counts = np.array(rows_per_request, dtype=np.int64)
    return np.arange(int(counts.sum())) - np.repeat(speculative_firsts(rows_per_request), counts)


def banned_token_ids(table: RequestTable, row: int, entry: RequestEntry, drafts: list[int]
                     ) -> tuple[list[int], list[tuple[int, int]]]:
    """Tokens the request may not sample next (after drafts, a speculative position's: taken as
    generated): stop tokens under min_tokens, and a bad word's last token once the tokens before it
    are generated. Second, the bans that hang on its token in flight (overlapped steps): (token it
    must turn out to be, token then banned), decided on the device."""
    s = entry.settings
    pending = not drafts and table.pending_row[row] >= 0
    num_generated = table.num_generated(row, entry) + len(drafts)
    banned = list(s.early_stop_ids) if num_generated < s.min_tokens else []
    if_pending_is: list[tuple[int, int]] = []
    if not s.bad_word_ids:
        return banned, if_pending_is
    ids = entry.token_ids + drafts if drafts else entry.token_ids
    length = len(ids) + pending  # the token in flight counted
    for word in s.bad_word_ids:
        if len(word) == 1:
            banned.append(word[0])
        elif len(word) - 1 <= num_generated:
            start = length - len(word) + 1
            if not pending:
                if ids[start:] == word[:-1]:
                    banned.append(word[-1])
            elif ids[start:] == word[:-2]:  # the rest of the prefix hangs on the token in flight
                if_pending_is.append((word[-2], word[-1]))
    return banned, if_pending_is
