"""The router's state: replicas in rotation, the routing policy, and the requests in flight.

A `Flight` is one request forwarded to one replica. Whatever waits on the replica for it waits
through `Flight.race`, so that the router can end it at once: when its replica dies (the socket
usually says so first; the process watch makes sure) or when a shutdown's grace period is over.
`Router` also offers GracefulShutdown's surface (stop_admitting, in_flight, end_in_flight)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from radixserve.server.errors import APIError
from radixserve.server.router.policies import Decision, RoutingPolicy
from radixserve.server.router.replicas import Replica

logger = logging.getLogger("radixserve.router")

T = TypeVar("T")


class FlightEnded(Exception):
    """The router ended this request (replica died, shutdown): `message`, HTTP `status`."""

    def __init__(self, message: str, status: int) -> None:
        super().__init__(message)
        self.message, self.status = message, status


class Flight:
    def __init__(self, replica: Replica) -> None:
        self.replica = replica
        self._ended = asyncio.Event()
        self.message = ""
        self.status = 503

    def end(self, message: str, status: int) -> None:
        if not self._ended.is_set():
            self.message, self.status = message, status
            self._ended.set()

    async def race(self, aw: Awaitable[T]) -> T:
        """The result of `aw`, unless the flight is ended first (then FlightEnded; `aw` cancelled)."""
        if self._ended.is_set():
            if asyncio.iscoroutine(aw):
                aw.close()
            raise FlightEnded(self.message, self.status)
        work = asyncio.ensure_future(aw)
        ender = asyncio.ensure_future(self._ended.wait())
        try:
            await asyncio.wait({work, ender}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            ender.cancel()
            if not work.done():
                work.cancel()
        if work.done() and not work.cancelled():
            return work.result()
        raise FlightEnded(self.message, self.status)


class Router:
    def __init__(self, replicas: list[Replica], policy: RoutingPolicy, metrics: Any = None) -> None:
        self.replicas = replicas
        self.policy = policy
        self.metrics = metrics
        self.refusing: str | None = None  # set by stop_admitting
        self.on_all_dead: list[Callable[[str], None]] = []
        self.on_replica_died: list[Callable[[int], None]] = []  # called with the index of a replica leaving rotation

    # ---- rotation ----------------------------------------------------------------------------

    def alive(self) -> list[Replica]:
        return [r for r in self.replicas if r.alive]

    def pick(self, text: str, exclude: set[int] = frozenset()) -> tuple[Replica, Decision]:
        """The replica for a request with routing text `text` (APIError 503 when none can take it)."""
        if self.refusing is not None:
            raise APIError(self.refusing, 503)
        loads = {r.index: r.load for r in self.alive() if r.index not in exclude}
        if not loads:
            raise APIError("no replica is available to serve the request", 503)
        decision = self.policy.choose(text, loads)
        replica = self.replicas[decision.replica]
        if self.metrics is not None:
            self.metrics.routed(replica.index, decision.reason)
        return replica, decision

    def pin(self, replica: Replica, reason: str) -> Replica:
        """`replica` for a request that must go to it (it holds the request's state), counted as `pick`
        counts (APIError 503 while shutting down)."""
        if self.refusing is not None:
            raise APIError(self.refusing, 503)
        if self.metrics is not None:
            self.metrics.routed(replica.index, reason)
        return replica

    def open_flight(self, replica: Replica) -> Flight:
        flight = Flight(replica)
        replica.flights.add(flight)
        return flight

    def close_flight(self, flight: Flight) -> None:
        flight.replica.flights.discard(flight)

    def replica_died(self, replica: Replica, reason: str) -> None:
        """Take `replica` out of rotation and end its requests now (502)."""
        if not replica.alive:
            return
        replica.alive = False
        replica.dead_reason = reason
        logger.error("replica %d is out of rotation: %s", replica.index, reason)
        for flight in list(replica.flights):
            flight.end(f"replica {replica.index} failed while serving the request: {reason}", 502)
        self.policy.forget(replica.index)
        for callback in list(self.on_replica_died):
            callback(replica.index)
        if not self.alive():
            for callback in list(self.on_all_dead):
                callback(f"every replica died (the last: {reason})")

    # ---- GracefulShutdown's surface ------------------------------------------------------------

    def stop_admitting(self, reason: str) -> None:
        self.refusing = reason

    def in_flight(self) -> int:
        return sum(r.load for r in self.replicas)

    def end_in_flight(self, reason: str) -> None:
        for r in self.replicas:
            for flight in list(r.flights):
                flight.end(reason, 503)
