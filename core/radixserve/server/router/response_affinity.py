"""Which replica holds each stored Responses API response, so that `previous_response_id`, `GET` and
`DELETE /v1/responses/{id}` reach it (each replica's `ResponseStore` is its own, in its memory).

Owned by the router's HTTP app (`create_router_app` makes one per router, in its event loop; no locks):
`proxy.forward` shows it each `POST /v1/responses` answer (`seen_body`: a JSON response; `seen_event`:
a stream's first event, `response.created`, which carries the id) and it records the id under the
replica that answered; `Router.replica_died` makes it drop a dead replica's ids (its store died with it);
the app forgets an id after the owner's successful `DELETE`.

Bounded as the replicas' stores are: per replica at most `MAX_STORED_RESPONSES` ids, least recently used
(recorded or looked up) evicted first. A replica also evicts by bytes, and stores a response only once it
has ended (a stream's id is known from its start): an id known here may be unknown to its owner, which
then answers its own 404; an id unknown here goes to any live replica, which answers it (404, or 400 for
a bad query) as a single server would."""

from __future__ import annotations

import contextlib
import json
from collections import OrderedDict
from typing import Any

from radixserve.server.responses import MAX_STORED_RESPONSES


class ResponseAffinity:
    def __init__(self, max_per_replica: int = MAX_STORED_RESPONSES) -> None:
        self.max_per_replica = max_per_replica
        self._ids: dict[int, OrderedDict[str, None]] = {}  # replica index -> its response ids, oldest first

    def owner(self, response_id: str) -> int | None:
        """The index of the replica that produced `response_id` (marked as just used), or None."""
        for index, ids in self._ids.items():
            if response_id in ids:
                ids.move_to_end(response_id)
                return index
        return None

    def record(self, response_id: str, replica: int) -> None:
        self.forget(response_id)
        ids = self._ids.setdefault(replica, OrderedDict())
        ids[response_id] = None
        while len(ids) > self.max_per_replica:
            ids.popitem(last=False)

    def forget(self, response_id: str) -> None:
        for ids in self._ids.values():
            ids.pop(response_id, None)

    def forget_replica(self, replica: int) -> None:
        self._ids.pop(replica, None)

    def __len__(self) -> int:
        return sum(len(ids) for ids in self._ids.values())

    # ---- reading the ids off the replicas' answers (proxy.AnswerObserver) --------------------------

    def seen_body(self, replica: int, status: int, content: bytes) -> None:
        """A non-streamed answer of `replica`: a response object's id is recorded."""
        if status == 200:
            with contextlib.suppress(ValueError):  # not JSON: no response to record
                self._seen_response(replica, json.loads(content))

    def seen_event(self, replica: int, event: bytes) -> bool:
        """One whole SSE event of `replica`'s stream; True once no more are needed (the first event
        names the response: `response.created`)."""
        for line in event.split(b"\n"):
            if line.startswith(b"data:"):
                with contextlib.suppress(ValueError):  # not JSON: no response to record
                    data = json.loads(line[len(b"data:"):])
                    if isinstance(data, dict) and data.get("type") == "response.created":
                        self._seen_response(replica, data.get("response"))
        return True

    def _seen_response(self, replica: int, response: Any) -> None:
        if not isinstance(response, dict) or response.get("object") != "response":
            return
        if isinstance(response.get("id"), str) and response.get("store") is not False:  # store false: never kept
            self.record(response["id"], replica)

