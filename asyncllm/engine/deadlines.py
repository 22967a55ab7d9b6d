"""Request deadlines (SamplingParams.timeout): which live requests are past theirs, cheaply.

A heap of (deadline, order added, the request's first sequence) holds only the requests that have a
timeout, so a step of requests without one pays an emptiness check and nothing per token. Entries
of requests that ended otherwise stay until they reach the top, or until they outnumber the live
requests, when the heap is rebuilt without them: an entry keeps its request's sequence (and token
list) alive, and a long server-wide timeout would otherwise keep every finished request's until
its deadline.

The clock is an attribute so that tests can drive deadlines with a fake one; the engine's other
times (metrics) stay on time.monotonic.
"""
from __future__ import annotations

import heapq
import itertools
import time
from collections.abc import Callable, Mapping

from asyncllm.engine.sequence import Sequence

# stale entries tolerated beyond twice the live requests before the heap is rebuilt
_COMPACT_SLACK = 64


class RequestDeadlines:
    def __init__(self, clock: Callable[[], float] = time.monotonic):
        self.clock = clock  # seconds; a request's deadline is its submission on this clock + its timeout
        self._heap: list[tuple[float, int, Sequence]] = []
        self._order = itertools.count()  # ties of equal deadlines: first added first

    def __len__(self) -> int:
        """Entries held, stale ones included."""
        return len(self._heap)

    def add(self, leader: Sequence) -> None:
        """Track a request (its first sequence) whose deadline is set."""
        heapq.heappush(self._heap, (leader.deadline, next(self._order), leader))

    def pop_expired(self, live: Mapping[str, Sequence]) -> list[Sequence]:
        """The live requests (live: request id -> first sequence) whose deadline has passed, earliest
        first; they are no longer tracked. Entries of requests no longer in live are dropped."""
        heap = self._heap
        if not heap:
            return []
        if len(heap) > 2 * len(live) + _COMPACT_SLACK:
            heap[:] = [entry for entry in heap if live.get(entry[2].request_id) is entry[2]]
            heapq.heapify(heap)
        now = self.clock()
        expired = []
        while heap and heap[0][0] <= now:
            leader = heapq.heappop(heap)[2]
            if live.get(leader.request_id) is leader:  # not ended, and not an id reused by a later request
                expired.append(leader)
        return expired
