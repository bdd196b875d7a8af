"""Data-parallel router without processes: the prefix index, the routing policies, the routing text,
the flight that the router ends, metrics aggregation, and the configuration of --dp."""

from __future__ import annotations

import asyncio

import pytest
from radixserve.config import Config, ConfigError, RouterSection
from radixserve.server.router.core import Flight, FlightEnded, Router
from radixserve.server.router.metrics import aggregate_replica_metrics, aggregate_stats
from radixserve.server.router.policies import CacheAware, LeastLoad, RoundRobin, make_policy
from radixserve.server.router.prefix_index import PrefixIndex
from radixserve.server.router.routing_text import routing_text

SYSTEM_A = "You are a pirate. Answer every question in pirate speech, briefly. " * 2
SYSTEM_B = "You are a librarian. Recommend exactly one book and say why, politely. " * 2

# ---- prefix index -----------------------------------------------------------------------------


def test_prefix_index_matches_whole_blocks_of_the_longest_held_prefix():
    idx = PrefixIndex(max_chars=10_000, block_chars=4)
    assert idx.match("abcdefgh") == 0
    idx.insert("abcdefghij")  # blocks abcd, efgh; "ij" is not a whole block
    assert idx.match("abcdefghij") == 8
    assert idx.match("abcdefXY") == 4  # diverges inside the second block
    assert idx.match("abcXefgh") == 0  # a later equal block does not count without its prefix
    assert idx.match("efghabcd") == 0
    assert idx.match("abc") == 0


def test_prefix_index_is_bounded_and_evicts_least_recently_used_leaves_first():
    idx = PrefixIndex(max_chars=12, block_chars=4)  # three blocks
    idx.insert("aaaabbbb")
    idx.insert("ccccdddd")  # four blocks held before eviction: the LRU one goes
    assert len(idx) == 3 and idx.size_chars == 12
    # "aaaa" was touched after "bbbb" (leaf first, root last): the leaf went, the prefix stayed
    assert idx.match("aaaabbbb") == 4
    assert idx.match("ccccdddd") == 8


def test_prefix_index_rejects_a_bad_size():
    with pytest.raises(ValueError, match="max_chars"):
        PrefixIndex(max_chars=0)


# ---- policies ---------------------------------------------------------------------------------


def test_round_robin_takes_turns_and_skips_replicas_out_of_rotation():
    rr = RoundRobin()
    loads = {0: 0, 1: 0, 2: 0}
    assert [rr.choose("x", loads).replica for _ in range(4)] == [0, 1, 2, 0]
    assert [rr.choose("x", {0: 0, 2: 0}).replica for _ in range(3)] == [2, 0, 2]


def test_least_load_picks_the_fewest_in_flight():
    assert LeastLoad().choose("x", {0: 3, 1: 1, 2: 1}).replica == 1


def test_cache_aware_sends_shared_prefixes_to_the_same_replica_and_spreads_new_ones():
    ca = CacheAware(2, cache_threshold=0.5, tree_block_chars=8)
    loads = {0: 0, 1: 0}
    first_a = ca.choose(SYSTEM_A + "Q1", loads)
    first_b = ca.choose(SYSTEM_B + "Q1", loads)
    assert first_a.reason == first_b.reason == "cache_room"
    assert first_a.replica != first_b.replica  # the empty tree has the most room
    for q in ("What is rum?", "Where is the treasure?", "Who are you?"):
        a = ca.choose(SYSTEM_A + q, loads)
        b = ca.choose(SYSTEM_B + q, loads)
        assert (a.replica, a.reason) == (first_a.replica, "cache_hit") and a.matched_chars >= len(SYSTEM_A) - 8
        assert (b.replica, b.reason) == (first_b.replica, "cache_hit")


def test_cache_aware_below_the_threshold_goes_where_there_is_room():
    ca = CacheAware(2, cache_threshold=0.9, tree_block_chars=8)
    loads = {0: 0, 1: 0}
    base = ca.choose(SYSTEM_A, loads).replica
    # the same system prompt followed by a long new question: match < 90% of the text
    d = ca.choose(SYSTEM_A + "z" * len(SYSTEM_A), loads)
    assert d.reason == "cache_room" and d.replica != base


def test_cache_aware_balances_when_the_load_is_uneven():
    ca = CacheAware(2, balance_abs_threshold=4, balance_rel_threshold=1.5, tree_block_chars=8)
    home = ca.choose(SYSTEM_A + "q", {0: 0, 1: 0}).replica
    other = 1 - home
    # within the thresholds the cache wins even against more load
    assert ca.choose(SYSTEM_A + "q2", {home: 4, other: 0}).reason == "cache_hit"
    # difference over abs (5 > 4) but not over rel (6 <= 1.5 * 4): still the cache
    assert ca.choose(SYSTEM_A + "q3", {home: 6, other: 4} if home == 0 else {other: 4, home: 6}).reason == "cache_hit"
    # both thresholds exceeded: the least-loaded replica, whatever it caches
    d = ca.choose(SYSTEM_A + "q4", {home: 9, other: 2})
    assert (d.replica, d.reason) == (other, "balance")
    assert ca.is_imbalanced({0: 9, 1: 2}) and not ca.is_imbalanced({0: 9, 1: 7})


def test_cache_aware_forgets_a_dead_replica_and_resets_on_flush():
    ca = CacheAware(2, tree_block_chars=8)
    home = ca.choose(SYSTEM_A, {0: 0, 1: 0}).replica
    ca.forget(home)
    assert len(ca.trees[home]) == 0
    ca.choose(SYSTEM_B, {0: 0, 1: 0})
    ca.reset()
    assert all(len(t) == 0 for t in ca.trees.values())


def test_policy_names_are_validated_with_the_valid_choices():
    assert isinstance(make_policy(RouterSection(), 2), CacheAware)
    assert isinstance(make_policy(RouterSection(policy="round_robin"), 2), RoundRobin)
    assert isinstance(make_policy(RouterSection(policy="least_load"), 2), LeastLoad)
    with pytest.raises(ConfigError, match=r"router\.policy.*cache_aware.*round_robin.*least_load.*'random'"):
        Config.build({"router": {"policy": "random"}})
    with pytest.raises(ConfigError, match="runtime.dp_size"):
        Config.build({"runtime": {"dp_size": 0}})


def test_dp_flags_map_to_the_config():
    import argparse

    from radixserve.cli import load_config_from_args
    from radixserve.cli_serve import _flag_overrides, add_serve_arguments

    p = argparse.ArgumentParser()
    add_serve_arguments(p)
    args = p.parse_args(
        ["--dp", "3", "--router-policy", "least_load", "--disable-overlap", "router.cache_threshold=0.7"]
    )
    config = load_config_from_args(args, _flag_overrides(args))
    assert config.runtime.dp_size == 3 and config.runtime.overlap is False
    assert config.router.policy == "least_load" and config.router.cache_threshold == 0.7


# ---- routing text -------------------------------------------------------------------------------


def test_routing_text_keeps_prefix_sharing_of_each_route():
    chat = lambda q: {"messages": [{"role": "system", "content": SYSTEM_A}, {"role": "user", "content": q}]}  # noqa: E731
    a, b = routing_text("/v1/chat/completions", chat("one")), routing_text("/v1/chat/completions", chat("two"))
    assert a.startswith("<|system|>" + SYSTEM_A) and a[: len(a) - 3] == b[: len(b) - 3]
    parts = {"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}, {"type": "text", "text": "!"}]}]}
    assert routing_text("/v1/chat/completions", parts) == "<|user|>hi!"
    assert routing_text("/v1/completions", {"prompt": "abc"}) == "abc"
    assert routing_text("/v1/completions", {"prompt": ["first", "second"]}) == "first"
    assert routing_text("/v1/completions", {"prompt": [1, 2, 3]}) == "1,2,3,"
    assert routing_text("/generate", {"input_ids": [5, 6]}) == "5,6,"
    assert routing_text("/generate", {"text": "t"}) == "t"
    assert routing_text("/v1/completions", ["not", "a", "dict"]) == ""


# ---- flights and the router -------------------------------------------------------------------------


class _Proc:
    pid = 0

    def poll(self):
        return None


def _replicas(n: int):
    from radixserve.server.router.replicas import Replica

    return [Replica(i, f"/nonexistent/{i}.sock", _Proc(), client=None) for i in range(n)]


def test_a_flight_ended_while_waiting_fails_at_once_and_cancels_the_wait():
    async def run():
        flight = Flight(_replicas(1)[0])
        never = asyncio.get_running_loop().create_future()
        asyncio.get_running_loop().call_later(0.05, flight.end, "replica 0 died", 502)
        with pytest.raises(FlightEnded) as e:
            await asyncio.wait_for(flight.race(never), 2)
        assert (e.value.message, e.value.status) == ("replica 0 died", 502)
        assert never.cancelled()
        with pytest.raises(FlightEnded):  # once ended, every later wait fails at once too
            await asyncio.wait_for(flight.race(asyncio.sleep(10)), 1)
        other = Flight(_replicas(1)[0])
        assert await other.race(asyncio.sleep(0, result=7)) == 7

    asyncio.run(run())


def test_a_dead_replica_leaves_rotation_its_flights_end_and_the_others_keep_serving():
    async def run():
        replicas = _replicas(2)
        router = Router(replicas, RoundRobin())
        dead_calls: list[str] = []
        router.on_all_dead.append(dead_calls.append)
        on0 = router.open_flight(replicas[0])
        on1 = router.open_flight(replicas[1])
        router.replica_died(replicas[0], "killed")
        with pytest.raises(FlightEnded, match="replica 0 failed.*killed"):
            await on0.race(asyncio.sleep(10))
        assert await on1.race(asyncio.sleep(0, result="ok")) == "ok"  # untouched
        assert [router.pick("x")[0].index for _ in range(3)] == [1, 1, 1]
        assert router.in_flight() == 2
        router.close_flight(on0)
        router.close_flight(on1)
        assert not dead_calls
        router.replica_died(replicas[1], "oom")
        assert dead_calls and "oom" in dead_calls[0]
        from radixserve.server.errors import APIError

        with pytest.raises(APIError, match="no replica"):
            router.pick("x")

    asyncio.run(run())


def test_shutdown_surface_refuses_new_requests_and_ends_in_flight_ones():
    async def run():
        replicas = _replicas(2)
        router = Router(replicas, LeastLoad())
        flight = router.open_flight(replicas[1])
        router.stop_admitting("the server is shutting down")
        from radixserve.server.errors import APIError

        with pytest.raises(APIError, match="shutting down"):
            router.pick("x")
        router.end_in_flight("the server is shutting down")
        with pytest.raises(FlightEnded) as e:
            await flight.race(asyncio.sleep(10))
        assert e.value.status == 503

    asyncio.run(run())


# ---- metrics ------------------------------------------------------------------------------------


def _replica_text(cached: float, computed: float, usage: float, requests: float) -> str:
    return (
        "# HELP radixserve_scheduler_prefill_tokens_cached Scheduler stat\n"
        "# TYPE radixserve_scheduler_prefill_tokens_cached gauge\n"
        f'radixserve_scheduler_prefill_tokens_cached{{model="m"}} {cached}\n'
        "# HELP radixserve_scheduler_prefill_tokens_computed Scheduler stat\n"
        "# TYPE radixserve_scheduler_prefill_tokens_computed gauge\n"
        f'radixserve_scheduler_prefill_tokens_computed{{model="m"}} {computed}\n'
        "# HELP radixserve_scheduler_cache_hit_rate Scheduler stat\n"
        "# TYPE radixserve_scheduler_cache_hit_rate gauge\n"
        f'radixserve_scheduler_cache_hit_rate{{model="m"}} {cached / (cached + computed)}\n'
        "# HELP radixserve_scheduler_token_usage Scheduler stat\n"
        "# TYPE radixserve_scheduler_token_usage gauge\n"
        f'radixserve_scheduler_token_usage{{model="m"}} {usage}\n'
        "# HELP radixserve_requests Finished HTTP generation requests\n"
        "# TYPE radixserve_requests counter\n"
        f'radixserve_requests_total{{model="m",route="completions",status="200"}} {requests}\n'
    )


def test_metrics_are_labelled_per_replica_and_aggregated():
    from prometheus_client.parser import text_string_to_metric_families

    text = aggregate_replica_metrics({0: _replica_text(90, 10, 0.2, 3), 1: _replica_text(0, 100, 0.4, 5)})
    samples = {(s.name, s.labels["replica"]): s.value for f in text_string_to_metric_families(text) for s in f.samples}
    assert samples[("radixserve_requests_total", "0")] == 3 and samples[("radixserve_requests_total", "1")] == 5
    assert samples[("radixserve_requests_total", "all")] == 8
    assert samples[("radixserve_scheduler_token_usage", "all")] == pytest.approx(0.3)  # a ratio: the mean
    # the hit rate of all prompt tokens (90 of 200), not the mean of 0.9 and 0.0
    assert samples[("radixserve_scheduler_cache_hit_rate", "all")] == pytest.approx(0.45)


def test_stats_are_aggregated_like_the_metrics():
    out = aggregate_stats(
        [
            {
                "running": 1,
                "prefill_tokens_cached": 30,
                "prefill_tokens_computed": 10,
                "token_usage": 0.5,
                "speculative": False,
            },
            {"running": 2, "prefill_tokens_cached": 0, "prefill_tokens_computed": 60, "token_usage": 0.1},
        ]
    )
    assert out["running"] == 3 and out["cache_hit_rate"] == pytest.approx(0.3)
    assert out["token_usage"] == pytest.approx(0.3) and "speculative" not in out


def test_one_engine_refuses_dp_size_above_one_naming_the_way_to_serve_it():
    from radixserve.runtime.tokenizer_manager import TokenizerManager

    with pytest.raises(ConfigError, match=r"runtime.dp_size=2.*radixserve serve --dp N"):
        TokenizerManager(Config.build({"runtime": {"dp_size": 2}}))


# ---- replica socket folders ---------------------------------------------------------------------


def test_a_killed_routers_socket_folder_is_removed_by_the_next_router_and_a_live_ones_is_kept(tmp_path):
    import os
    import subprocess
    import sys

    from radixserve.server.router.launch import SOCKET_DIR_PREFIX, sweep_stale_socket_dirs

    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead_pid = int(gone.stdout)  # exited: its pid names no process (reuse within the test is not a concern)
    stale = tmp_path / f"{SOCKET_DIR_PREFIX}{dead_pid}-abc"
    (stale / "replica-0.sock").parent.mkdir()
    (stale / "replica-0.sock").write_text("")
    live = tmp_path / f"{SOCKET_DIR_PREFIX}{os.getpid()}-def"
    live.mkdir()
    other = tmp_path / f"{SOCKET_DIR_PREFIX}old-style"  # no pid in the name: not ours to judge
    other.mkdir()
    assert sweep_stale_socket_dirs(str(tmp_path)) == [str(stale)]
    assert not stale.exists() and live.exists() and other.exists()
