"""/abort_request on a request of several generations (n > 1, several prompts): its rid reaches every
generation while it runs (refuzz audit 31: the choices ran to the end after an "ok")."""

from __future__ import annotations

import asyncio

from radixserve.server.generation import Fanout, Job
from radixserve.server.openai_serving import Serving


class BlockingTM:
    """Generations that wait until aborted; records the aborts."""

    def __init__(self) -> None:
        self.aborted: list[str] = []
        self.events: dict[str, asyncio.Event] = {}

    async def generate(self, inp):
        event = self.events.setdefault(inp, asyncio.Event())
        await event.wait()
        yield {"text": "", "meta_info": {"finish_reason": {"type": "abort"}}}

    def abort(self, rid: str) -> None:
        self.aborted.append(rid)
        self.events.setdefault(rid, asyncio.Event()).set()


def test_aborting_the_requests_rid_reaches_each_of_its_generations():
    async def run() -> None:
        tm = BlockingTM()
        serving = Serving(tm, metrics=None)
        jobs = [Job(i, f"req-{i}", f"req-{i}") for i in range(3)]  # inputs stand for themselves here
        fan = Fanout(tm, jobs, serving._groups, "req")
        collecting = asyncio.create_task(fan.collect())
        await asyncio.sleep(0)
        serving.abort("req")
        last = await asyncio.wait_for(collecting, 5)
        assert sorted(tm.aborted) == ["req-0", "req-1", "req-2"]
        assert all(out["meta_info"]["finish_reason"] == {"type": "abort"} for out in last.values())
        await fan.aclose()
        assert serving._groups == {}  # forgotten once it ends: the rid may be used again
        serving.abort("solo")  # a request of one generation is aborted by its own rid
        assert tm.aborted[-1] == "solo"

    asyncio.run(run())


def test_abort_all_asks_the_scheduler_to_stop_every_request_in_flight():
    """SGLang's /abort_request {"abort_all": true} (audit 37b): every unfinished request, each by its rid."""
    from types import SimpleNamespace

    from radixserve.runtime.tokenizer_manager import TokenizerManager

    asked: list[str] = []
    states = {rid: SimpleNamespace(rid=rid, finished=rid == "done") for rid in ("a", "done", "b")}
    tm = SimpleNamespace(_rid_to_state=states, abort=asked.append)
    assert TokenizerManager.abort_all(tm) == 2 and asked == ["a", "b"]
