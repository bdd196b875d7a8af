"""The built-in `oracle` drafter (benchmarks): stored continuations from a file or from finished
requests, exact acceptance with accept_len, clear errors for bad options; and the scheduler's
draft helpers (cutting drafts to the contract, the accepted path, the safeguard's rule)."""

from __future__ import annotations

import asyncio
import json
import types

import pytest
import torch
from radixserve.interfaces import DrafterInfo
from radixserve.plugins.registry import PluginError, Registry
from radixserve.scheduler.speculative.adaptive import PROBE_INTERVAL, DraftLengthControl
from radixserve.scheduler.speculative.drafts import Draft, accepted_path, checked_draft
from radixserve.scheduler.speculative.oracle import OracleDrafter
from radixserve.scheduler.speculative.setup import build_drafter
from radixserve.state import Req, SamplingParams

INFO = DrafterInfo(device=torch.device("cpu"), vocab_size=100, num_draft_tokens=4, topk=1, num_steps=4,
                   supports_tree=False)


def req(prompt, output=(), rid="a"):
    r = Req(rid=rid, origin_input_ids=list(prompt), sampling_params=SamplingParams())
    r.output_ids = list(output)
    return r


def test_oracle_proposes_the_stored_continuation_while_the_output_agrees(tmp_path):
    f = tmp_path / "cont.json"
    f.write_text(json.dumps([{"prompt_ids": [1, 2], "output_ids": [10, 11, 12, 13, 14, 15]}]))
    d = OracleDrafter(INFO, path=str(f))
    assert d.propose([req([1, 2], [10])], 3).tokens == [[11, 12, 13]]
    assert d.propose([req([1, 2], [10, 99])], 3).tokens == [[]]  # diverged: nothing to propose
    assert d.propose([req([7])], 3).tokens == [[]]  # unknown prompt
    assert d.propose([req([1, 2], [10, 11, 12, 13, 14])], 4).tokens == [[15]]  # the end of it


def test_oracle_accept_len_spoils_the_rest_and_learns_from_finished_requests():
    d = OracleDrafter(INFO, accept_len=1)
    r = req([5, 6], [20, 21, 22, 23, 24])
    r.finished_reason = {"type": "length"}
    d.on_finished(r)
    aborted = req([8], [1, 2, 3], rid="b")
    aborted.finished_reason = {"type": "abort"}
    d.on_finished(aborted)
    assert d.propose([req([5, 6], [20]), req([8], [1])], 3).tokens == [[21, 23, 24], []]


def test_oracle_bad_options_are_startup_errors(tmp_path):
    from radixserve.config import Config

    cfg = Config.build({"stack": {"speculative": "oracle"}, "speculative": {"options": {"path": str(tmp_path / "x")}}})

    class R:
        vocab_size = 100

    with pytest.raises(PluginError, match="stack.speculative='oracle'.*speculative.options.path.*does not exist"):
        build_drafter(cfg, R(), Registry.discover())


def test_drafter_that_does_not_support_the_device_is_a_startup_error():
    import types

    from radixserve.config import Config
    from radixserve.plugins import hookimpl
    from radixserve.plugins.stack import resolve_stack

    @hookimpl
    def radixserve_register(registry):
        registry.register("drafter", "cuda-only", "radixserve.scheduler.speculative.oracle:OracleDrafter",
                          devices=("cuda",))

    module = types.ModuleType("cuda_only_drafter")
    module.PLUGIN_API, module.radixserve_register = ">=1,<2", radixserve_register
    reg = Registry.discover()
    reg.add_plugin_module(module, name="cuda-only-drafter", distribution="test-cuda-only-drafter")
    with pytest.raises(PluginError, match="stack.speculative='cuda-only'.*does not support device 'cpu'"):
        resolve_stack(Config.build({"stack": {"speculative": "cuda-only"}}), reg, "cpu")


def test_checked_draft_cuts_to_the_contract():
    assert checked_draft([1, 2, 3, 4], None, 3, 100, True).tokens == [1, 2, 3]
    assert checked_draft([1, 200, 3], None, 5, 100, True).tokens == [1]  # out of vocabulary ends a chain
    # a tree: node 1 (token 200) is invalid, its child 3 goes with it
    d = checked_draft([1, 200, 3, 4], [-1, -1, 1, 0], 8, 100, True)
    assert d.tokens == [1, 4] and d.parents == [-1, 0, 1]
    # a parent after its child is dropped
    assert checked_draft([1, 2], [1, -1], 8, 100, True).tokens == [2]
    # trees not verifiable: the chain of first children
    d = checked_draft([1, 2, 3, 4], [-1, -1, 0, 0], 8, 100, False)
    assert d.tokens == [1, 3] and d.is_chain


def test_checked_draft_counts_what_the_drafter_got_wrong():
    """Plugin-author audit 37, G3: the tokens dropped for breaking the contract are counted (the scheduler's
    spec_invalid_draft_tokens); a dropped node's children and tokens past the limit are not the drafter's fault."""
    assert checked_draft([1, 2, 3, 4], None, 3, 100, True).invalid == 0
    d = checked_draft([1, 200, 3], None, 5, 100, True)
    assert d.invalid == 1 and d.invalid_why == "draft token 200 outside the vocabulary [0, 100)"
    d = checked_draft([1, 200, 3, 4], [-1, -1, 1, 0], 8, 100, True)
    assert d.invalid == 1 and d.tokens == [1, 4]
    d = checked_draft([1, 2], [1, -1], 8, 100, True)
    assert d.invalid == 1 and d.invalid_why.startswith("parents[0] = 1; a parent is -1")
    assert checked_draft([1, 2, 3, 4], [-1, -1, 0, 0], 8, 100, False).invalid == 0
    with pytest.raises(TypeError, match=r"draft token '1' is str, not int"):
        checked_draft(["1"], None, 5, 100, True)
    with pytest.raises(TypeError, match=r"parent 'x' is str, not int"):
        checked_draft([1], ["x"], 5, 100, True)


def test_accepted_path_follows_matching_children():
    tree = Draft([5, 6, 7, 8], [-1, 0, 0, 2, 2])  # root -> 5, 6; 6 -> 7, 8
    assert accepted_path(tree, [6, 0, 8, 0, 9]) == [0, 2, 4]
    assert accepted_path(tree, [1, 0, 0, 0, 0]) == [0]
    chain = Draft([5, 6], [-1, 0, 1])
    assert accepted_path(chain, [5, 6, 9]) == [0, 1, 2]


def test_safeguard_rule():
    c = DraftLengthControl(num_draft_tokens=4, adaptive_batch_size=8, min_accepted_drafts=0.5)
    assert c.tokens_for(7) == 4 and c.tokens_for(8) == 4  # optimistic start
    for _ in range(40):
        c.record([1, 1, 0, 2])
    assert c.tokens_for(8) == 2  # round(mean 1.0) + 1
    assert c.tokens_for(2) == 4  # small batches always use the full length
    for _ in range(30):
        c.record([0, 0, 1, 0, 0])
    got = [c.tokens_for(32) for _ in range(PROBE_INTERVAL)]
    assert got.count(0) == PROBE_INTERVAL - 1 and got[-1] == 1  # paused, one probe per interval


def test_bench_serve_acceptance_length_from_server_counters():
    from radixserve.bench.serve import _accept_length

    before = {"spec_verifies": 10, "spec_accepted_tokens": 5}
    assert _accept_length(before, {"spec_verifies": 20, "spec_accepted_tokens": 35}) == 4.0
    assert _accept_length(None, before) is None  # not reported: not RadixServe, or not speculating
    # audit 29: a speculating server that verified no draft during the run (random ids give a lookup
    # drafter nothing) gave null, read as "not speculating"; it is 0, beside spec_verifies 0
    assert _accept_length(before, before) == 0.0


def test_bench_serve_reads_the_counters_only_from_a_speculating_server():
    from radixserve.bench.serve import _server_stats, _spec_counters

    def read(client):  # one /server_info read, then its speculative counters
        return _spec_counters(asyncio.run(_server_stats(client)))

    class Client:
        def __init__(self, stats):
            self.stats = stats

        async def get(self, path):
            assert path == "/server_info"
            return types.SimpleNamespace(json=lambda: {"stats": self.stats})

    counters = {"spec_verifies": 3, "spec_accepted_tokens": 4}
    assert read(Client({"speculative": True, **counters})) == counters
    assert read(Client({"speculative": False, **counters})) is None
    assert read(Client({})) is None  # no counters: another server
