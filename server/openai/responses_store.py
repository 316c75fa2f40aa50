"""Stored responses (`store`, on by default as OpenAI's): a bounded in-memory LRU.

Each entry holds the Response object, its input items (with ids; after a `previous_response_id`
the chain's earlier inputs and outputs come first, as OpenAI lists them), and the conversation as
Responses items (every earlier turn's input and output, then its own), which a request naming it
as `previous_response_id` continues. Instructions are not carried over (OpenAI's rule). The store
lives in this process: a restart forgets it; `--responses-store-size` bounds it.

    GET    /v1/responses/{id}               the Response
    DELETE /v1/responses/{id}               {"id", "object": "response", "deleted": true}
    GET    /v1/responses/{id}/input_items   a list (order, limit, after) of its input items
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass

from server.openai.errors import APIError
from server.openai.responses_protocol import new_item_id


@dataclass
class StoredResponse:
    response: dict
    input_items: list[dict]  # the chain's earlier inputs and outputs, then its own input
    conversation: list[dict]  # items: earlier turns, this input, this output


def not_found(response_id: str, param: str | None = None) -> APIError:
    """OpenAI's 404 for an unknown (or dropped) response id."""
    msg = f"Response with id '{response_id}' not found."
    return APIError(404, msg, "invalid_request_error", param)


def with_ids(items: list[dict]) -> list[dict]:
    """Input items as stored: each with an id (messages get `msg_...`) and a type."""
    out = []
    for item in items:
        item = {"type": "message", **item}
        if "id" not in item:
            prefix = {"message": "msg", "function_call": "fc"}.get(item["type"], "item")
            item["id"] = new_item_id(prefix)
        out.append(item)
    return out


class ResponseStore:
    def __init__(self, max_size: int) -> None:
        self.max_size = max_size
        self._items: OrderedDict[str, StoredResponse] = OrderedDict()
        self._lock = threading.Lock()

    def put(self, response_id: str, entry: StoredResponse) -> None:
        if self.max_size <= 0:
            return
        with self._lock:
            self._items[response_id] = entry
            self._items.move_to_end(response_id)
            while len(self._items) > self.max_size:
                self._items.popitem(last=False)

    def get(self, response_id: str, param: str | None = None) -> StoredResponse:
        with self._lock:
            entry = self._items.get(response_id)
            if entry is None:
                raise not_found(response_id, param)
            self._items.move_to_end(response_id)
            return entry

    def delete(self, response_id: str) -> dict:
        with self._lock:
            if self._items.pop(response_id, None) is None:
                raise not_found(response_id)
        return {"id": response_id, "object": "response", "deleted": True}

    def input_items(
        self, response_id: str, order: str = "desc", limit: int = 20, after: str | None = None
    ) -> dict:
        if order not in ("asc", "desc"):
            raise APIError(400, "order must be 'asc' or 'desc'", param="order")
        if not 1 <= limit <= 100:
            raise APIError(400, "limit must be between 1 and 100", param="limit")
        items = list(self.get(response_id).input_items)
        if order == "desc":
            items.reverse()
        if after is not None:
            ids = [i["id"] for i in items]
            if after not in ids:
                raise APIError(400, f"no input item with id {after!r}", param="after")
            items = items[ids.index(after) + 1 :]
        page = items[:limit]
        return {
            "object": "list",
            "data": page,
            "first_id": page[0]["id"] if page else None,
            "last_id": page[-1]["id"] if page else None,
            "has_more": len(items) > limit,
        }
