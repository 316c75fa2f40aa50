"""The scheduler's FCFS waiting queue (no torch)."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator

from engine.core.request import Request


class RequestQueue:
    """First come, first served, with O(1) append, prepend, pop, peek and remove by id.

    Preempted requests are prepended so they resume before newer arrivals; an abort removes a
    request from the middle without scanning (an OrderedDict is a linked list plus a dict).
    """

    def __init__(self) -> None:
        self._requests: OrderedDict[str, Request] = OrderedDict()

    def append(self, request: Request) -> None:
        self._requests[request.request_id] = request

    def appendleft(self, request: Request) -> None:
        self._requests[request.request_id] = request
        self._requests.move_to_end(request.request_id, last=False)

    def peek(self) -> Request:
        return next(iter(self._requests.values()))

    def popleft(self) -> Request:
        return self._requests.popitem(last=False)[1]

    def remove(self, request: Request) -> None:
        del self._requests[request.request_id]

    def __contains__(self, request: Request) -> bool:
        return request.request_id in self._requests

    def __len__(self) -> int:
        return len(self._requests)

    def __bool__(self) -> bool:
        return bool(self._requests)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._requests.values())
