"""Waiting queues: first-come-first-served and priority (vLLM's ``request_queue``)."""

from __future__ import annotations

import enum
import heapq
import itertools
from collections import deque
from collections.abc import Iterable, Iterator

from jaxkv.core.request import Request


class SchedulingPolicy(str, enum.Enum):
    """``FCFS``: arrival order. ``PRIORITY``: lowest ``(priority, arrival_time)`` first."""

    FCFS = "fcfs"
    PRIORITY = "priority"


class FCFSRequestQueue:
    """A deque: ``add_request`` appends, ``prepend_request`` puts a preempted request first."""

    def __init__(self):
        self._queue: deque[Request] = deque()

    def add_request(self, request: Request) -> None:
        self._queue.append(request)

    def pop_request(self) -> Request:
        return self._queue.popleft()

    def peek_request(self) -> Request:
        if not self._queue:
            raise IndexError("peek from an empty queue")
        return self._queue[0]

    def prepend_request(self, request: Request) -> None:
        self._queue.appendleft(request)

    def prepend_requests(self, requests: Iterable[Request]) -> None:
        """Puts ``requests`` at the front, keeping their order."""
        self._queue.extendleft(reversed(list(requests)))

    def remove_request(self, request: Request) -> None:
        self._queue.remove(request)

    def remove_requests(self, requests: Iterable[Request]) -> None:
        to_remove = set(map(id, requests))
        self._queue = deque(r for r in self._queue if id(r) not in to_remove)

    def __len__(self) -> int:
        return len(self._queue)

    def __bool__(self) -> bool:
        return bool(self._queue)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._queue)


class PriorityRequestQueue:
    """A heap on ``(priority, arrival_time, insertion order)``; lower values come first.

    Prepending is the same as adding: a preempted request goes back to its priority slot.
    """

    def __init__(self):
        self._heap: list[tuple[int, float, int, Request]] = []
        self._counter = itertools.count()

    def add_request(self, request: Request) -> None:
        heapq.heappush(
            self._heap, (request.priority, request.arrival_time, next(self._counter), request)
        )

    def pop_request(self) -> Request:
        return heapq.heappop(self._heap)[-1]

    def peek_request(self) -> Request:
        if not self._heap:
            raise IndexError("peek from an empty queue")
        return self._heap[0][-1]

    def prepend_request(self, request: Request) -> None:
        self.add_request(request)

    def prepend_requests(self, requests: Iterable[Request]) -> None:
        for request in requests:
            self.add_request(request)

    def remove_request(self, request: Request) -> None:
        self.remove_requests([request])

    def remove_requests(self, requests: Iterable[Request]) -> None:
        to_remove = set(map(id, requests))
        self._heap = [entry for entry in self._heap if id(entry[-1]) not in to_remove]
        heapq.heapify(self._heap)

    def __len__(self) -> int:
        return len(self._heap)

    def __bool__(self) -> bool:
        return bool(self._heap)

    def __iter__(self) -> Iterator[Request]:
        """In priority order (sorts a copy)."""
        return (entry[-1] for entry in sorted(self._heap, key=lambda e: e[:3]))


def create_request_queue(policy: SchedulingPolicy | str) -> FCFSRequestQueue | PriorityRequestQueue:
    policy = SchedulingPolicy(policy)
    return PriorityRequestQueue() if policy is SchedulingPolicy.PRIORITY else FCFSRequestQueue()
