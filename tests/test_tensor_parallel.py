"""Tensor parallelism on the CPU (gloo): TP ranks give the same greedy tokens as one process, through
the whole runtime (scheduler, radix cache hits, chunked prefill, overlap off/on), every rank exits 0
at shutdown, a stack with a component that does not support TP is refused by name, and two
`radixserve serve` "nodes" on one machine serve together."""

from __future__ import annotations

import os
import signal
import sys
import time

import httpx
import pytest
from radixserve.config import Config
from radixserve.engine import Engine
from radixserve.model_runner import ModelRunner, check_model_tensor_parallel
from radixserve.plugins.registry import PluginError, Registry
from radixserve.plugins.stack import resolve_stack
from runner_driver import greedy_generate
from server_process import child_pids, free_port, is_alive, spawn_server, wait_until_healthy, with_tiny_tokenizer

# shared 12-token prefix: the later requests hit the radix cache; chunk 5 splits every prompt
PREFIX = [11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22]
PROMPTS = [PREFIX + [30, 31, 32], PREFIX + [40, 41], [7, 8, 9]]
NEW_TOKENS = 6
CPU = {"device": "cpu", "dtype": "float32", "num_threads": 1, "cuda_graph": False}


def _reference(path: str, prompts: list[list[int]], new_tokens: int, tokenizer: str | None = None) -> list[list[int]]:
    """Greedy tokens of one process (TP=1), the prompts batched together without any cache."""
    # a GGUF dequantized, as tensor-parallel ranks load it (kept blocks are one-process only)
    options = {"dequantize": True} if path.endswith(".gguf") else {}
    cfg = Config.build({"model": {"path": path, "tokenizer": tokenizer, "weight_source_options": options}, "runtime": CPU,
                        "scheduler": {"max_total_tokens": 2048, "max_running_requests": 8}})
    return [g.tokens for g in greedy_generate(ModelRunner(cfg, show_progress=False), prompts, new_tokens)]


def _tp_generate(path: str, tp: int, prompts: list[list[int]], new_tokens: int, after=None,
                 **sections) -> tuple[list, list, dict]:
    """(output ids, cached prompt tokens, child exit codes) from an Engine with `tp` ranks: the
    first prompt alone, then the others together (so they find its prefix in the radix cache).
    `after(engine)` runs before the shutdown."""
    greedy = {"temperature": 0, "max_new_tokens": new_tokens, "ignore_eos": True}
    sections.setdefault("runtime", CPU)
    engine = Engine(path, tp_size=tp, **sections)
    try:
        first = engine.generate(input_ids=prompts[0], sampling_params=greedy)
        rest = engine.generate(input_ids=prompts[1:], sampling_params=greedy)
        if after is not None:
            after(engine)
    finally:
        engine.shutdown()
    outs = [first] + rest
    procs = engine.tokenizer_manager._procs
    return [o["output_ids"] for o in outs], [o["meta_info"]["cached_tokens"] for o in outs], {
        name: p.returncode for name, p in procs.items()
    }


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_tp2_greedy_equals_tp1_with_cache_hits_and_chunked_prefill(tiny_llama_dir, arch):
    # qwen3 with one KV head: each rank holds a replica of it
    path = with_tiny_tokenizer(tiny_llama_dir(arch) if arch == "llama" else tiny_llama_dir(arch, num_key_value_heads=1))
    expected = _reference(path, PROMPTS, NEW_TOKENS)
    # overlap on for llama: the followers then receive decode inputs by a tensor broadcast
    sections = {"scheduler": {"chunked_prefill_size": 5, "max_total_tokens": 2048}}
    if arch == "llama":
        sections["runtime"] = {**CPU, "overlap": True}
    out, cached, codes = _tp_generate(path, 2, PROMPTS, NEW_TOKENS, after=None if arch == "llama" else _kill_rank_1,
                                      **sections)
    assert out == expected
    assert cached[1] == len(PREFIX), cached  # a radix cache hit on the shared prefix
    assert set(codes) == {"scheduler", "detokenizer", "tp1"}
    if arch == "llama":
        assert codes == dict.fromkeys(codes, 0), codes  # every rank ended cleanly
    else:
        assert codes["tp1"] == -signal.SIGKILL


def _kill_rank_1(engine) -> None:
    """A rank that dies takes the engine down with an error naming it (no hang)."""
    from radixserve.runtime.errors import EngineDeadError

    os.kill(engine.tokenizer_manager.child_pids()["tp1"], signal.SIGKILL)
    deadline = time.monotonic() + 30
    while engine.is_healthy() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not engine.is_healthy()
    with pytest.raises(EngineDeadError, match=r"tensor-parallel rank 1 \(tp1\) process exited unexpectedly"):
        engine.generate(input_ids=PROMPTS[2], sampling_params={"max_new_tokens": 2})


def test_smollm2_tp3_greedy_equals_tp1(smollm2_gguf_path):
    """SmolLM2-135M (fp32): 9 query / 3 KV heads split over 3 ranks (2 would not divide them)."""
    from radixserve.tokenizer import apply_chat_template, load_tokenizer

    tok = load_tokenizer(smollm2_gguf_path)
    prompts = [apply_chat_template(tok, [{"role": "user", "content": q}])
               for q in ("What is the capital of France?", "Name a famous physicist.")]
    expected = _reference(smollm2_gguf_path, prompts, 8)
    out, _, codes = _tp_generate(smollm2_gguf_path, 3, [prompts[0]] + prompts, 8,
                                 scheduler={"chunked_prefill_size": 16, "max_total_tokens": 2048})
    assert out == [expected[0]] + expected
    assert codes == dict.fromkeys(codes, 0) and "tp2" in codes, codes


# ---- refusals -------------------------------------------------------------------------------
def test_stack_with_a_component_without_tp_support_is_refused_by_name():
    cfg = Config.build({"runtime": {"device": "cpu", "tp_size": 2}, "stack": {"speculative": "ngram"}})
    with pytest.raises(PluginError, match=r"tp_size=2: stack.speculative='ngram'.*does not support tensor parallelism"):
        resolve_stack(cfg, Registry.from_config(cfg), "cpu")
    # the same stack at tp_size=1, and the default stack at tp_size=2, are fine
    resolve_stack(cfg.with_overrides({"runtime": {"tp_size": 1}}), Registry.from_config(cfg), "cpu")
    tp2 = Config.build({"runtime": {"device": "cpu", "tp_size": 2}})
    stack = resolve_stack(tp2, Registry.from_config(tp2), "cpu")
    assert stack.attention.name and stack.prefix_cache.name == "radix"


def test_model_or_head_layout_without_tp_support_is_refused():
    class NoTP:
        supports_tensor_parallel = False

    class Cfg:
        num_attention_heads, num_key_value_heads = 9, 3

    with pytest.raises(PluginError, match="model architecture 'GemmaForCausalLM'.*does not support tensor parallelism"):
        check_model_tensor_parallel("GemmaForCausalLM", NoTP, None, Cfg, 2)

    class TP:
        supports_tensor_parallel = True

    with pytest.raises(PluginError, match="quantization method NoTP"):
        check_model_tensor_parallel("LlamaForCausalLM", TP, NoTP(), Cfg, 3)
    with pytest.raises(ValueError, match=r"tp_size=2 does not divide the model's attention heads \(9 query, 3"):
        check_model_tensor_parallel("LlamaForCausalLM", TP, None, Cfg, 2)
    check_model_tensor_parallel("LlamaForCausalLM", TP, None, Cfg, 3)


def test_runner_refuses_tp_size_without_a_group(tiny_llama_dir):
    cfg = Config.build({"model": {"path": tiny_llama_dir("llama")}, "runtime": {**CPU, "tp_size": 2}})
    with pytest.raises(ValueError, match=r"runtime.tp_size=2 needs a TPGroup"):
        ModelRunner(cfg, show_progress=False)


# ---- two "nodes" on one machine ---------------------------------------------------------------
def test_two_node_launch_serves_and_shuts_down_cleanly(tiny_llama_dir, tmp_path):
    path = with_tiny_tokenizer(tiny_llama_dir("llama"))
    rendezvous, port = f"127.0.0.1:{free_port()}", free_port()
    # 4 ranks, 2 per node: node 0 runs rank 0 (the scheduler) and rank 1, node 1 ranks 2 and 3;
    # 4 query heads and 2 KV heads: one query head per rank, each KV head on two ranks
    common = [sys.executable, "-m", "radixserve.cli", "serve", "--model", path, "--tp", "4", "--nnodes", "2",
              "--dist-init-addr", rendezvous, "runtime.device=cpu", "runtime.num_threads=1",
              "scheduler.max_total_tokens=2048", "scheduler.chunked_prefill_size=2"]
    node1, log1 = spawn_server(common + ["--node-rank", "1"], tmp_path / "node1.log")
    node0, log0 = spawn_server(common + ["--node-rank", "0", "--port", str(port)], tmp_path / "node0.log")
    try:
        wait_until_healthy(node0, f"http://127.0.0.1:{port}", tmp_path / "node0.log", 300)
        r = httpx.post(f"http://127.0.0.1:{port}/generate", timeout=120, json={
            "input_ids": PROMPTS[2], "sampling_params": {"max_new_tokens": NEW_TOKENS, "temperature": 0,
                                                         "ignore_eos": True},
        })
        assert r.status_code == 200, r.text
        assert r.json()["output_ids"] == _reference(path, [PROMPTS[2]], NEW_TOKENS)[0]
        children = child_pids(node0.pid) + child_pids(node1.pid)
        assert len(children) == 3 + 2, children  # scheduler, detokenizer, tp1; tp2, tp3
        node0.send_signal(signal.SIGTERM)
        assert node0.wait(timeout=60) == 0
        assert node1.wait(timeout=60) == 0  # rank 0 stopped node 1's ranks; that node exits by itself
        time.sleep(0.5)
        assert not [pid for pid in children if is_alive(pid)], "a rank outlived the shutdown"
    finally:
        for p in (node0, node1):
            if p.poll() is None:
                p.kill()
                p.wait()
        for f in (log0, log1):
            f.close()
    text = "".join((tmp_path / f"node{i}.log").read_text() for i in (0, 1))
    assert "Traceback" not in text, text[-3000:]


# ---- layers: shards of 2 detached ranks recombine to the single-process result -----------------
def test_layer_shards_recombine_to_the_full_layer():
    import torch
    from radixserve.layers.distributed import TPGroup
    from radixserve.layers.embedding import ParallelLMHead
    from radixserve.layers.linear import QKVParallelLinear, RowParallelLinear

    torch.manual_seed(0)
    x = torch.randn(3, 32)
    # 4 query heads, 1 KV head (replicated on both ranks), head_dim 8
    qkv_w = torch.randn(4 * 8 + 2 * 8, 32)
    full = QKVParallelLinear(32, 8, 4, 1)
    full.weight_loader(full.weight, qkv_w)
    shards = [QKVParallelLinear(32, 8, 4, 1, tp_group=TPGroup(r, 2)) for r in (0, 1)]
    for s in shards:
        s.weight_loader(s.weight, qkv_w)
    q_full, k_full, v_full = full(x).split([32, 8, 8], dim=-1)
    outs = [s(x).split([16, 8, 8], dim=-1) for s in shards]
    assert torch.equal(torch.cat([o[0] for o in outs], dim=-1), q_full)  # query heads split
    assert all(torch.equal(o[1], k_full) and torch.equal(o[2], v_full) for o in outs)  # KV replicated

    row_w, bias = torch.randn(16, 32), torch.randn(16)
    row_full = RowParallelLinear(32, 16, bias=True)
    row_full.weight_loader(row_full.weight, row_w)
    row_full.weight_loader(row_full.bias, bias)
    parts = []
    for r in (0, 1):
        row = RowParallelLinear(32, 16, bias=True, tp_group=TPGroup(r, 2))
        row.weight_loader(row.weight, row_w)
        row.weight_loader(row.bias, bias)
        row.reduce_results = False  # the all-reduce is the sum below
        parts.append(row(x[:, r * 16 : (r + 1) * 16]))
    torch.testing.assert_close(parts[0] + parts[1], row_full(x), rtol=1e-5, atol=1e-5)

    vocab_w = torch.randn(101, 32)  # not divisible by 2: padded rows give no logits
    head_full = ParallelLMHead(101, 32)
    head_full.weight_loader(head_full.weight, vocab_w)
    heads = [ParallelLMHead(101, 32, tp_group=TPGroup(r, 2)) for r in (0, 1)]
    for h in heads:
        h.weight_loader(h.weight, vocab_w)
    logits = torch.cat([x @ h.weight.T for h in heads], dim=-1)[:, :101]
    torch.testing.assert_close(logits, head_full.compute_logits(x), rtol=1e-5, atol=1e-5)


def test_group_of_one_is_the_identity_and_a_detached_group_cannot_communicate():
    import torch
    from radixserve.layers.distributed import TPGroup

    x = torch.randn(2, 3)
    one = TPGroup.single()
    assert one.all_reduce(x) is x and one.all_gather_last_dim(x) is x and one.broadcast_object({"a": 1}) == {"a": 1}
    with pytest.raises(RuntimeError, match="no process group"):
        TPGroup(1, 2).all_reduce(x)
    with pytest.raises(ValueError, match="invalid tensor-parallel rank 2 of size 2"):
        TPGroup(2, 2)
