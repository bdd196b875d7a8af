"""Running the generations of one HTTP request on the TokenizerManager.

`Fanout` runs one `tm.generate` per choice (n > 1, several prompts, a /generate batch) in its own
task and merges their outputs in arrival order; closing it aborts every generation still running,
which is how a client disconnect frees the scheduler's KV. `until_disconnect` races an awaitable
against the client going away."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable
from dataclasses import dataclass
from typing import Any, TypeVar

from starlette.requests import Request

from radixserve.validation import InvalidRequest, at_prompt

T = TypeVar("T")


class ClientGone(Exception):
    """The client disconnected before the response was ready."""


@dataclass
class Job:
    """One generation: choice `index` of the response, run as request `rid`."""

    index: int
    rid: str
    input: Any  # GenerateInput
    # a caller's rid naming this generation and its siblings (a /generate batch's per-prompt rid with n > 1):
    # listed in `groups` like the request's own rid, so that aborting it reaches each of them
    group: str | None = None
    # where its sampling params came from when not `sampling_params` itself (`sampling_params[1]`, a per-prompt
    # list's entry): a refusal from the runtime (a regex that does not compile) names it there (audit 37b)
    sampling_field: str | None = None


_DONE = object()


class Fanout:
    """Merged outputs of several generations: iterate for (index, output dict) pairs.

    Errors of any generation are re-raised from the iterator. `aclose()` cancels the tasks and
    calls tm.abort(rid) for every generation that has not finished; it is idempotent."""

    def __init__(self, tm: Any, jobs: list[Job], groups: dict[str, tuple[str, ...]] | None = None,
                 request_rid: str | None = None) -> None:
        """`groups`: where a request of several generations (`n` > 1, several prompts) is listed under
        its own rid, `request_rid`, while it runs, so that aborting that rid reaches every generation
        (and under each `Job.group`, its generations)."""
        self.tm = tm
        self.jobs = jobs
        self._group: tuple[dict[str, tuple[str, ...]], list[str]] | None = None
        if groups is not None and len(jobs) > 1:
            if request_rid is None:
                raise ValueError("a Fanout of several generations listed in `groups` needs the request's rid")
            listed = {request_rid: tuple(job.rid for job in jobs)}
            for job in jobs:
                if job.group is not None and job.group != request_rid:
                    listed[job.group] = (*listed.get(job.group, ()), job.rid)
            groups.update(listed)
            self._group = (groups, list(listed))
        self._queue: asyncio.Queue = asyncio.Queue()
        self._pending = {job.index for job in jobs}
        self._tasks = [asyncio.create_task(self._pump(job)) for job in jobs]
        self._closed = False

    async def _pump(self, job: Job) -> None:
        try:
            async for out in self.tm.generate(job.input):
                self._queue.put_nowait((job.index, out))
            self._queue.put_nowait((job.index, _DONE))
        except asyncio.CancelledError:
            raise
        except BaseException as e:  # handed to the consumer, which re-raises it
            if job.sampling_field is not None and isinstance(e, InvalidRequest):
                e = at_prompt(e, job.sampling_field)
            self._queue.put_nowait((job.index, e))

    def __aiter__(self) -> AsyncIterator[tuple[int, dict]]:
        return self._iterate()

    async def _iterate(self) -> AsyncIterator[tuple[int, dict]]:
        while self._pending:
            index, item = await self._queue.get()
            if item is _DONE:
                self._pending.discard(index)
                continue
            if isinstance(item, BaseException):
                self._pending.discard(index)
                raise item
            yield index, item

    async def collect(self) -> dict[int, dict]:
        """The last output of every generation (the final one when each ran to completion)."""
        last: dict[int, dict] = {}
        async for index, out in self:
            last[index] = out
        return last

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._group is not None:
            groups, names = self._group
            for name in names:
                groups.pop(name, None)
        for job, task in zip(self.jobs, self._tasks, strict=True):
            if not task.done():
                task.cancel()
                self.tm.abort(job.rid)
            elif job.index in self._pending:
                self.tm.abort(job.rid)  # produced output nobody read: may still be running
        for task in self._tasks:
            with contextlib.suppress(BaseException):
                await task


async def _wait_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def until_disconnect(request: Request, awaitable: Awaitable[T]) -> T:
    """Await `awaitable`, or raise ClientGone (cancelling it) when the client disconnects first."""
    work = asyncio.ensure_future(awaitable)
    watcher = asyncio.create_task(_wait_disconnect(request))
    try:
        await asyncio.wait({work, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        work.cancel()
        raise
    finally:
        watcher.cancel()
    if work.done():
        return work.result()
    work.cancel()
    with contextlib.suppress(BaseException):
        await work
    raise ClientGone()
