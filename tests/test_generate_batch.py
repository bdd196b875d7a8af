"""SGLang's batch form and `n > 1` on the native /generate route, against the fake runtime of test_http_api:
output `k * n + i` is sample i of prompt k (SGLang's tokenizer_manager order), with seed + i as the OpenAI
routes' choice i; one prompt with n == 1 keeps its single object; streamed, each event is one output's with
its `index`, then `[DONE]`; every prompt is checked before any runs; /abort_request and a disconnect reach
every generation."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from fastapi.testclient import TestClient
from test_http_api import FakeTM, _wait_for, expected_text, make_client, running


class AbortingTM(FakeTM):
    """FakeTM whose aborted generation ends with an output, as the runtime's does (finish_reason abort)."""

    async def generate(self, inp):
        ended = False
        async for out in super().generate(inp):
            ended = out["meta_info"]["finish_reason"] is not None
            yield out
        if not ended:
            yield {"text": "", "output_ids": [], "meta_info": {"id": inp.rid, "prompt_tokens": len(inp.input_ids),
                                                               "completion_tokens": 0, "cached_tokens": 0,
                                                               "finish_reason": {"type": "abort"}}}


@pytest.fixture
def tm() -> FakeTM:
    return FakeTM()


@pytest.fixture
def live_server():
    tm = AbortingTM(context_len=100000, delay=0.01)
    with running(tm) as url:
        yield tm, url


@pytest.fixture
def client(tm) -> TestClient:
    return make_client(tm)


def generate(client, body: dict):
    r = client.post("/generate", json=body)
    assert r.status_code == 200, r.text
    return r.json()


def without_id(out: dict) -> dict:
    """An output without its rid (meta_info.id), which differs between requests that are otherwise alike."""
    return {**out, "meta_info": {k: v for k, v in out["meta_info"].items() if k != "id"}}


def test_a_batch_of_texts_answers_a_list_in_prompt_order(client, tm):
    outs = generate(client, {"text": ["ab", "cde", "f"], "sampling_params": {"max_new_tokens": 3}, "rid": "t"})
    assert isinstance(outs, list) and len(outs) == 3
    for k, (prompt, out) in enumerate(zip(["ab", "cde", "f"], outs, strict=True)):
        assert set(out) == {"text", "output_ids", "meta_info"}  # today's object, nothing added
        assert out["text"] == expected_text(tm, tm.tokenizer.encode(prompt), 3)
        assert out["meta_info"]["id"] == f"t-{k}"  # as the OpenAI routes name their generations
        assert out == generate(client, {"text": prompt, "sampling_params": {"max_new_tokens": 3}, "rid": f"t-{k}"})
    # a batch of one is still a list (SGLang's too); one prompt keeps its object
    assert isinstance(generate(client, {"text": ["ab"], "sampling_params": {"max_new_tokens": 1}}), list)
    assert isinstance(generate(client, {"text": "ab", "sampling_params": {"max_new_tokens": 1}}), dict)


def test_a_batch_of_input_ids(client, tm):
    outs = generate(client, {"input_ids": [[1, 2], [3], [4, 5, 6]], "sampling_params": {"max_new_tokens": 2},
                             "rid": ["a", "b", "c"]})
    assert [o["text"] for o in outs] == [expected_text(tm, ids, 2) for ids in ([1, 2], [3], [4, 5, 6])]
    assert [o["meta_info"]["id"] for o in outs] == ["a", "b", "c"]  # the per-prompt rids, as given
    assert [o["meta_info"]["prompt_tokens"] for o in outs] == [2, 1, 3]
    one = generate(client, {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 2}})
    assert isinstance(one, dict) and one["text"] == outs[0]["text"]


def test_n_samples_each_prompt_with_seed_plus_i_in_sglangs_order(client, tm):
    sampling = {"max_new_tokens": 3, "temperature": 1.0, "seed": 40}
    outs = generate(client, {"text": ["ab", "cde"], "sampling_params": {**sampling, "n": 3}})
    assert len(outs) == 6
    for k, prompt in enumerate(["ab", "cde"]):
        for i in range(3):  # output k * n + i: sample i of prompt k, as the single request with seed + i
            alone = generate(client, {"text": prompt, "sampling_params": {**sampling, "seed": 40 + i}})
            assert without_id(outs[k * 3 + i]) == without_id(alone), (k, i)
    assert len({o["text"] for o in outs[:3]}) == 3  # the samples differ under one seed
    # one prompt with n > 1 answers a list too (SGLang's)
    two = generate(client, {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 2, "n": 2}, "rid": "r"})
    assert [o["meta_info"]["id"] for o in two] == ["r-0", "r-1"]
    assert [i.sampling_params.n for i in tm.inputs[-2:]] == [1, 1]  # each generation makes one sample


def test_sampling_params_per_prompt(client, tm):
    outs = generate(client, {"text": ["ab", "cde"], "sampling_params": [{"max_new_tokens": 2},
                                                                        {"max_new_tokens": 4, "seed": 3}]})
    assert [o["meta_info"]["completion_tokens"] for o in outs] == [2, 4]
    assert outs[1]["text"] == expected_text(tm, tm.tokenizer.encode("cde"), 4, seed=3)
    outs = generate(client, {"text": ["ab", "cde"], "sampling_params": [{"max_new_tokens": 1, "n": 2, "seed": 1},
                                                                        {"max_new_tokens": 2, "n": 2}]})
    assert [o["meta_info"]["completion_tokens"] for o in outs] == [1, 1, 2, 2]
    assert [i.sampling_params.seed for i in tm.inputs[-4:]] == [1, 2, None, None]


def assert_400(r, param: str, words: str) -> None:
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and words in err["message"], err


@pytest.mark.parametrize("body,param,words", [
    ({"text": ["ab", "x" * 70]}, "text[1]", "the prompt has 70 tokens"),
    ({"input_ids": [[1, 2], [1, 200]]}, "input_ids[1]", "input_ids[1][1] token id 200 is out of range"),
    ({"input_ids": [[1, 2], []]}, "input_ids[1]", "a token list must not be empty"),
    ({"text": ["ab", "cd"], "sampling_params": [{"max_new_tokens": 2}, {"temperature": "hot"}]},
     "sampling_params[1].temperature", ""),
    ({"text": ["ab", "cd"], "sampling_params": [{"max_new_tokens": 2}, {"max_new_tokens": 70}]},
     "sampling_params[1].max_new_tokens", "plus sampling_params[1].max_new_tokens (70) exceeds"),
    ({"text": ["ab", "cd"], "sampling_params": [{"max_new_tokens": 2, "n": 2}, {"max_new_tokens": 2}]},
     "sampling_params[1].n", "sampling_params[1].n (1) differs from sampling_params[0].n (2)"),
    ({"text": "ab", "sampling_params": {"max_new_tokens": 2, "n": 2, "seed": 2**63 - 1}}, "sampling_params.seed",
     "64-bit"),
    ({"text": ["ab", "cd"], "rid": ["x", "x"]}, "rid", "the rids of one batch must be distinct"),
    ({"text": ["ab"] * 513, "sampling_params": {"n": 2}}, "text", "at most 1024 completions in one request"),
    ({"text": ["ab", "cd"], "return_logprob": [True, False]}, "return_logprob", "one value for every prompt"),
    ({"text": ["ab", "cd"], "priority": [1, 2]}, "priority", "one value for every prompt"),
    ({"text": []}, "text", "must not be empty"),
])
def test_every_prompt_is_checked_before_any_generation_starts(client, tm, body, param, words):
    assert_400(client.post("/generate", json={"sampling_params": {"max_new_tokens": 2}, **body}), param, words)
    assert tm.inputs == []  # nothing ran, not even the good first prompt


def events(lines) -> list[str]:
    return [line[len("data: "):] for line in lines if line.startswith("data: ")]


def test_streaming_a_batch_sends_each_outputs_events_with_its_index_then_done(client, tm):
    body = {"text": ["ab", "cde"], "sampling_params": {"max_new_tokens": 3, "n": 2, "seed": 9}}
    with client.stream("POST", "/generate", json={**body, "stream": True}) as s:
        data = events(s.iter_lines())
    assert data[-1] == "[DONE]" and "[DONE]" not in data[:-1]
    parsed = [json.loads(d) for d in data[:-1]]
    assert all(isinstance(e, dict) and set(e) == {"text", "output_ids", "meta_info", "index"} for e in parsed)
    by_index: dict[int, list[dict]] = {}
    for e in parsed:
        by_index.setdefault(e.pop("index"), []).append(e)
    assert sorted(by_index) == [0, 1, 2, 3]
    final = generate(client, body)
    for index, evs in by_index.items():
        assert [len(e["output_ids"]) for e in evs] == [1, 2, 3]  # each carries the whole output so far
        assert [e["meta_info"]["finish_reason"] for e in evs][-1] == {"type": "length"}  # every output ends
        assert without_id(evs[-1]) == without_id(final[index])
    # one prompt with n == 1: its events, no index (unchanged)
    with client.stream("POST", "/generate", json={"text": "ab", "stream": True,
                                                  "sampling_params": {"max_new_tokens": 2}}) as s:
        single = events(s.iter_lines())
    assert single[-1] == "[DONE]" and all("index" not in json.loads(e) for e in single[:-1])


def test_aborting_a_batch_reaches_every_generation(live_server):
    tm, url = live_server
    body = {"text": ["ab", "cde"], "sampling_params": {"max_new_tokens": 5000, "n": 2}}
    with ThreadPoolExecutor(2) as pool:
        # the request's rid: every generation (b-0 .. b-3)
        pending = pool.submit(httpx.post, f"{url}/generate", json={**body, "rid": "b"}, timeout=30)
        assert _wait_for(lambda: len(tm.inputs) == 4), tm.inputs
        assert httpx.post(f"{url}/abort_request", json={"rid": "b"}).status_code == 200
        outs = pending.result().json()
        assert [o["meta_info"]["finish_reason"] for o in outs] == [{"type": "abort"}] * 4
        assert sorted(tm.aborted) == ["b-0", "b-1", "b-2", "b-3"]
        # a per-prompt rid: that prompt's samples alone
        tm.aborted.clear()
        pending = pool.submit(httpx.post, f"{url}/generate", json={**body, "rid": ["p", "q"]}, timeout=30)
        assert _wait_for(lambda: len(tm.inputs) == 8), tm.inputs
        assert httpx.post(f"{url}/abort_request", json={"rid": "q"}).status_code == 200
        assert _wait_for(lambda: sorted(tm.aborted) == ["q-0", "q-1"]), tm.aborted
        assert not pending.done()  # prompt p's samples still run
        assert httpx.post(f"{url}/abort_request", json={"rid": "p"}).status_code == 200
        outs = pending.result().json()
        assert [o["meta_info"]["id"] for o in outs] == ["p-0", "p-1", "q-0", "q-1"]
        assert sorted(tm.aborted) == ["p-0", "p-1", "q-0", "q-1"]


def test_a_disconnect_aborts_every_generation_of_a_batch(live_server):
    tm, url = live_server
    body = {"input_ids": [[1, 2], [3]], "sampling_params": {"max_new_tokens": 5000, "n": 2}, "rid": "d",
            "stream": True}
    with httpx.stream("POST", f"{url}/generate", json=body, timeout=10) as r:
        for line in r.iter_lines():
            if line.startswith("data: "):
                break  # one event received; leaving the block closes the connection
    assert _wait_for(lambda: sorted(tm.aborted) == ["d-0", "d-1", "d-2", "d-3"]), tm.aborted


class RefusingRegexTM(FakeTM):
    """FakeTM whose runtime refuses a regex as the scheduler does a constraint that does not compile."""

    async def generate(self, inp):
        if inp.sampling_params.regex == "((zz":
            from radixserve.validation import InvalidRequest

            raise InvalidRequest("sampling_params.regex: invalid regex: missing )", "sampling_params.regex")
        async for out in super().generate(inp):
            yield out


def test_a_runtime_refusal_names_its_entry_of_a_per_prompt_list():
    """Audit 37b: a regex the runtime refused in sampling_params[1] was named `sampling_params.regex` (one object's
    name), so a client could not tell which prompt to fix."""
    client = make_client(RefusingRegexTM())
    body = {"text": ["a", "b"], "sampling_params": [{"max_new_tokens": 2}, {"max_new_tokens": 2, "regex": "((zz"}]}
    r = client.post("/generate", json=body)
    err = r.json()["error"]
    assert r.status_code == 400 and err["param"] == "sampling_params[1].regex", r.text
    assert err["message"] == "sampling_params[1].regex: invalid regex: missing )"
    one = client.post("/generate", json={"text": ["a", "b"], "sampling_params": {"max_new_tokens": 2, "regex": "((zz"}})
    assert one.json()["error"]["param"] == "sampling_params.regex"  # one object for all: its own name
