"""The EAGLE drafter on a tiny random Llama target (CPU): the target-states capability against
transformers, loading both published draft layouts, well-formed proposals, greedy outputs with
speculation equal to those without (EAGLE-2 and EAGLE-3, chains and trees, alone and batched,
radix cache on), nothing left behind after requests finish, and a draft built to reproduce the
target being accepted (the hidden-state and draft-KV plumbing lines up)."""

from __future__ import annotations

import os
import random

import pytest
import torch
from eagle_checkpoints import target_config, write_eagle2, write_eagle2_copy, write_eagle3
from radixserve.config import Config
from radixserve.model_runner import ModelRunner
from radixserve.plugins.registry import PluginError, Registry
from radixserve.runtime.messages import GenerateRequest
from radixserve.scheduler.speculative.setup import build_drafter, drafter_info
from radixserve.state import SamplingParams
from radixserve.static_batch import run_static_batch
from radixserve.testing import run_to_completion as _run
from radixserve.testing import tiny_checkpoint
from radixserve.testing.speculative import RecordingDrafter, shared_prefix_prompts, speculative_scheduler, target_runner
from radixserve.testing.speculative import assert_drafter_released as _assert_released
from radixserve.testing.speculative import greedy_request as _greedy
from radixserve_spec_eagle.checkpoint import default_aux_layers, load_checkpoint
from radixserve_spec_eagle.drafter import EagleDrafter, best_nodes

VOCAB = 512
if not torch.cuda.is_available():  # as tests/conftest.py: the draft's GEMV in Triton's interpreter
    os.environ.setdefault("TRITON_INTERPRET", "1")  # (set before a fixture first imports triton)


def _runner(path: str) -> ModelRunner:
    return target_runner(path)


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    """(target dir, runner) for a 4-layer tiny Llama."""
    path = tiny_checkpoint("llama", str(tmp_path_factory.mktemp("target")), seed=3, num_hidden_layers=4)
    return path, _runner(path)


@pytest.fixture(scope="module")
def drafts(tmp_path_factory, target):
    cfg = target_config(target[0])
    return {
        "eagle2": write_eagle2(tmp_path_factory.mktemp("eagle2"), cfg, seed=1),
        "eagle3": write_eagle3(tmp_path_factory.mktemp("eagle3"), cfg, seed=2),
    }


def _config(draft: str, topk: int = 1, num_draft_tokens: int = 4, num_steps: int | None = None,
            chunk: int = 2048) -> Config:
    return Config.build({
        "stack": {"prefix_cache": "radix", "speculative": "eagle"},
        "speculative": {"num_draft_tokens": num_draft_tokens, "topk": topk, "num_steps": num_steps,
                        "draft_model_path": draft, "adaptive_batch_size": 0},
        "scheduler": {"max_total_tokens": 6000, "chunked_prefill_size": chunk},
    })


class RecordingEagle(RecordingDrafter, EagleDrafter):
    """Keeps every proposal, to check its shape."""


def _scheduler(runner, cfg: Config | None, drafter_cls=RecordingEagle):
    return speculative_scheduler(runner, cfg, lambda info, cfg: drafter_cls(info))


def _prompts(n, seed=0):
    return shared_prefix_prompts(n, VOCAB, seed)


# ---- the capability ----------------------------------------------------------------------------
def test_target_states_match_transformers(tmp_path):
    from transformers import AutoModelForCausalLM

    path = tiny_checkpoint("llama", str(tmp_path / "t"), seed=5, num_hidden_layers=3)
    runner = _runner(path)
    ts = runner.target_states
    assert not ts.recording
    ts.request(final=True, aux_layers=(1, 0))
    prompt = [5, 77, 300, 12, 9, 401, 33]
    out = run_static_batch(runner, [prompt], max_new_tokens=4).output_ids[0]
    rows = ts.take("0")
    assert ts.take("0") == []
    assert [r.positions for r in rows] == [list(range(7)), [7], [8], [9]]  # prefill, then decodes
    assert all(r.parents is None for r in rows)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    full = torch.tensor([prompt + out[:3]])
    with torch.no_grad():
        states = hf(input_ids=full, output_hidden_states=True).hidden_states
    final = torch.cat([r.final for r in rows])
    aux = torch.cat([r.aux for r in rows])
    torch.testing.assert_close(final, states[-1][0], atol=2e-4, rtol=1e-3)  # after the final norm
    # the residual stream after layer 1, then after layer 0 (as requested)
    torch.testing.assert_close(aux, torch.cat([states[2][0], states[1][0]], dim=-1), atol=2e-4, rtol=1e-3)
    torch.testing.assert_close(ts.embed(full[0]), hf.model.embed_tokens(full[0]))
    torch.testing.assert_close(ts.logits(final[:2]), hf.lm_head(states[-1][0, :2]), atol=2e-4, rtol=1e-3)
    with pytest.raises(ValueError, match="outside the target's 3 layers"):
        ts.request(aux_layers=(3,))


def test_default_eagle3_layers():
    from types import SimpleNamespace

    assert default_aux_layers(SimpleNamespace(), 32) == (1, 15, 28)  # after SGLang's 2, L/2, L-3 inputs
    assert default_aux_layers(SimpleNamespace(), 2) == (1, 0, 0)
    given = SimpleNamespace(eagle_config={"eagle_aux_hidden_state_layer_ids": [1, 23, 44]})
    assert default_aux_layers(given, 48) == (1, 23, 44)


# ---- loading -------------------------------------------------------------------------------------
def test_registered_as_the_eagle_drafter():
    registry = Registry.discover()
    assert registry.load("drafter", "eagle") is EagleDrafter
    assert registry.get("drafter", "eagle").supports_device("cpu")


def test_published_layouts_load(target, drafts):
    _, runner = target
    for name, version in (("eagle2", 2), ("eagle3", 3)):
        ckpt = load_checkpoint(drafts[name])
        assert ckpt.version == version
        d = EagleDrafter(drafter_info(_config(drafts[name]), runner))
        params = dict(d.head.named_parameters())
        for tensor_name, tensor in ckpt.tensors.items():
            if tensor_name in ("d2t", "t2d"):
                continue
            ours = tensor_name.replace("midlayer.", "layers.0.").replace("self_attn.", "").replace("mlp.", "")
            assert torch.equal(params[ours], tensor), tensor_name
    d3 = EagleDrafter(drafter_info(_config(drafts["eagle3"]), runner))
    ckpt = load_checkpoint(drafts["eagle3"])
    kept = torch.nonzero(ckpt.tensors["t2d"]).flatten()
    assert torch.equal(d3.head.to_target_ids(torch.arange(256)), kept)  # d2t: draft id -> target id


def test_bad_draft_paths_are_start_up_errors(target, drafts, tmp_path):
    _, runner = target
    registry = Registry.discover()
    with pytest.raises(PluginError, match="speculative.draft_model_path"):
        build_drafter(_config(None), runner, registry)
    with pytest.raises(PluginError, match="no config.json"):
        build_drafter(_config(str(tmp_path)), runner, registry)
    cfg = target_config(target[0])
    broken = write_eagle2(tmp_path / "broken", {**cfg, "intermediate_size": 96})  # weights 96 wide
    cfg_file = tmp_path / "broken" / "config.json"
    cfg_file.write_text(cfg_file.read_text().replace('"intermediate_size": 96', '"intermediate_size": 128'))
    with pytest.raises(PluginError, match="shape"):
        build_drafter(_config(broken), runner, registry)
    with pytest.raises(PluginError, match="eagle"):
        build_drafter(_config(drafts["eagle2"]).model_copy(
            update={"speculative": _config(drafts["eagle2"]).speculative.model_copy(update={"options": {"x": 1}})}),
            runner, registry)


# ---- proposals and losslessness ------------------------------------------------------------------
def test_fused_projections_match_separate(target, drafts):
    """The drafter's fused q/k/v and gate/up matmuls give the separate projections' outputs."""
    from radixserve_spec_eagle.head import EagleHead

    _, runner = target
    vocab = target_config(target[0])["vocab_size"]

    def attend(layer, q, k, v):  # causal attention over the rows themselves (GQA expanded)
        rep = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
        o = torch.nn.functional.scaled_dot_product_attention(
            q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=True)
        return o.transpose(0, 1)

    for name in ("eagle2", "eagle3"):
        ckpt = load_checkpoint(drafts[name])
        plain, fused = EagleHead(ckpt, vocab).eval(), EagleHead(ckpt, vocab).eval()
        fused.fuse_projections()
        assert fused.layers[0].qkv_weight is not None and plain.layers[0].qkv_weight is None
        g = torch.Generator().manual_seed(0)
        h = plain.hidden_size
        feats = torch.randn(5, plain.fc.in_features if name == "eagle3" else h, generator=g)
        embeds, pos = torch.randn(5, h, generator=g), torch.arange(5)
        with torch.no_grad():
            a, b = plain.step(embeds, pos, feats, attend), fused.step(embeds, pos, feats, attend)
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    d = EagleDrafter(drafter_info(_config(drafts["eagle3"]), runner))
    assert d.head.layers[0].qkv_weight is not None  # the drafter runs the fused form


def test_one_row_draft_matmuls_take_the_batch1_gemv(target, drafts, monkeypatch):
    """With GEMV tiles (forced here: the Triton kernel interpreted) a one-row EAGLE-3 step runs
    all six matmuls (fc, qkv, o, gate_up, down, draft LM head) on the GEMV and matches the plain
    path; on a CPU device nothing is routed; the Llama-3.1-8B head's six weight shapes all get the
    tile the target's layers of that shape would (the H200 choice)."""
    from radixserve.layers import triton_gemv
    from radixserve.layers.gemv_selection import gemv_config_for_shape
    from radixserve_spec_eagle.drafter import grouped_attention
    from radixserve_spec_eagle.head import EagleHead, gemv_tile

    cpu = torch.device("cpu")
    head = EagleHead(load_checkpoint(drafts["eagle3"]), target_config(target[0])["vocab_size"]).eval()
    head.fuse_projections()
    assert head.attach_batch1_gemv("auto", cpu) == 0 and head.attach_batch1_gemv("on", cpu) == 0
    with pytest.raises(ValueError, match="'fast'"):
        head.attach_batch1_gemv("fast", cpu)
    with pytest.raises(ValueError, match="speculative.options.batch1_gemv='fast'"):
        EagleDrafter(drafter_info(_config(drafts["eagle3"]), target[1]), batch1_gemv="fast")
    g = torch.Generator().manual_seed(0)
    feats, embeds = torch.randn(1, head.fc.in_features, generator=g), torch.randn(1, head.hidden_size, generator=g)

    def attend(layer, q, k, v):
        return grouped_attention(q, k, v, torch.ones(1, 1, dtype=torch.bool))

    with torch.no_grad():
        ref = head.logits(head.step(embeds, torch.tensor([3]), feats, attend), None)
        calls = []
        real = triton_gemv.gemv
        monkeypatch.setattr(triton_gemv, "gemv", lambda x, w, b, c: calls.append(tuple(w.shape)) or real(x, w, b, c))
        tile = triton_gemv.GemvConfig(64, 64, 1, 1)  # few programs: a quick interpreter
        head.tiles = dict.fromkeys(("fc", "lm_head"), tile)
        head.layers[0].tiles = dict.fromkeys(("qkv", "o", "gate_up", "down"), tile)
        got = head.logits(head.step(embeds, torch.tensor([3]), feats, attend), None)
    assert len(calls) == 6
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)
    for n, k in ((4096, 12288), (6144, 8192), (4096, 4096), (28672, 4096), (4096, 14336), (32000, 4096)):
        w = torch.empty(n, k, dtype=torch.bfloat16, device="meta")
        assert gemv_tile(w, True) is not None and gemv_tile(w, True) == gemv_config_for_shape(n, k)
        assert gemv_tile(w, False) is None


@pytest.mark.parametrize("topk", [1, 3])
def test_eager_draft_attention_shapes_stay_bounded(target, drafts, topk, monkeypatch):
    """The eager draft (no CUDA graphs: a CPU device, shapes past the graphs' buckets, or a failed
    capture) gives its attention a bounded set of shapes however long a request runs: KV widths
    are padded to graphs.WIDTH_STEP columns (masked). On the H200 the draft's SDPA runs in cuDNN,
    which builds an execution plan (tens of ms) for each new (shape, stride) key; exact widths grow
    every propose, so an eager propose paid one or two builds (session 8 call 5: 92.9 ms a propose)."""
    import torch.nn.functional as F

    _, runner = target
    seen: dict[tuple, int] = {}  # SDPA call signature -> first propose that used it
    proposes = [0]
    real = F.scaled_dot_product_attention

    def sdpa(q, k, v, attn_mask=None, **kw):
        if proposes[0]:  # the draft's calls only (the target's attention may use SDPA too)
            key = tuple((tuple(t.shape), t.stride()) for t in (q, k, v, attn_mask) if t is not None)
            seen.setdefault(key, proposes[0])
        return real(q, k, v, attn_mask=attn_mask, **kw)

    class Counting(RecordingEagle):
        def propose(self, reqs, k):
            proposes[0] = self.calls = getattr(self, "calls", 0) + 1
            try:
                return super().propose(reqs, k)
            finally:
                proposes[0] = 0

    monkeypatch.setattr(F, "scaled_dot_product_attention", sdpa)
    cfg = _config(drafts["eagle3"], topk=topk, num_draft_tokens=6 if topk > 1 else 4,
                  num_steps=3 if topk > 1 else None)
    sched = _scheduler(runner, cfg, Counting)
    _run(sched, [_greedy("r0", _prompts(1, seed=7)[0], 48)])
    calls = sched.drafter.calls
    assert calls >= 20
    # every shape shows up within the first proposes (prefill rows, the first chains / tree levels)
    # and none is new later, although the request's KV grows by one or more columns per propose
    late = [first for first in seen.values() if first > 6]
    assert not late, f"{len(late)} new attention shapes after propose 6 (of {calls}): {sorted(late)}"


def test_best_nodes_keeps_parents():
    # node 2's parent (1) scores low: 2 can only come with it
    assert best_nodes([-0.1, -3.0, -0.2, -0.5], [-1, -1, 1, 0], 2) == [0, 3]
    assert best_nodes([-0.1, -3.0, -0.2, -0.5], [-1, -1, 1, 0], 4) == [0, 1, 2, 3]


@pytest.mark.parametrize("draft,topk", [("eagle2", 1), ("eagle2", 3), ("eagle3", 1), ("eagle3", 3)])
def test_greedy_identical_on_and_off(target, drafts, draft, topk):
    _, runner = target
    ps = _prompts(6, seed=topk)
    plain = _run(_scheduler(runner, None), [_greedy(f"r{i}", p, 16) for i, p in enumerate(ps)])
    n = 6 if topk > 1 else 4
    cfg = _config(drafts[draft], topk=topk, num_draft_tokens=n, num_steps=3 if topk > 1 else None)
    sched = _scheduler(runner, cfg)
    assert _run(sched, [_greedy(f"r{i}", p, 16) for i, p in enumerate(ps)]) == plain  # batched
    d = sched.drafter
    assert sched.stats()["spec_verifies"] > 0
    branched = False
    for batch, k, prop in d.proposals:
        assert len(prop.tokens) == batch
        assert (prop.parents is None) == (topk == 1)
        for i, toks in enumerate(prop.tokens):
            assert 0 < len(toks) <= k and all(0 <= t < VOCAB for t in toks)
            if prop.parents is not None:
                par = prop.parents[i]
                assert len(par) == len(toks) and all(-1 <= p < j for j, p in enumerate(par))
                branched |= len(set(par)) < len(par)
                depth = [0] * len(par)
                for j, p in enumerate(par):
                    depth[j] = 1 if p == -1 else depth[p] + 1
                assert max(depth) <= 3  # num_steps levels
    assert branched == (topk > 1)
    _assert_released(d)
    alone = _scheduler(runner, cfg)
    assert _run(alone, [_greedy("r0", ps[0], 16)]) == {"r0": plain["r0"]}
    _assert_released(alone.drafter)


def test_a_draft_that_copies_the_target_is_accepted(tmp_path):
    from safetensors.torch import load_file, save_file

    path = tiny_checkpoint("llama", str(tmp_path / "t"), seed=7, num_hidden_layers=1)
    weights = load_file(str(tmp_path / "t" / "model.safetensors"))
    weights["model.norm.weight"] = torch.ones_like(weights["model.norm.weight"])  # argmax ignores the norm
    save_file(weights, str(tmp_path / "t" / "model.safetensors"))
    runner = _runner(path)
    draft = write_eagle2_copy(tmp_path / "copy", path)
    rng = random.Random(9)
    # long prompts: the draft never sees position 0's token (EAGLE's row p reads token p + 1), which
    # matters less the more context there is
    ps = [[rng.randrange(VOCAB) for _ in range(120)] for _ in range(4)]
    plain = _run(_scheduler(runner, None), [_greedy(f"r{i}", p, 24) for i, p in enumerate(ps)])
    # trees: enough nodes that the first choices four deep are kept (the draft is rarely sure here)
    # chunked prefill: the features of every chunk reach the draft
    for topk, n, chunk in ((1, 4, 2048), (2, 16, 2048), (1, 4, 32)):
        cfg = _config(draft, topk=topk, num_draft_tokens=n, num_steps=4 if topk > 1 else None, chunk=chunk)
        sched = _scheduler(runner, cfg)
        assert _run(sched, [_greedy(f"r{i}", p, 24) for i, p in enumerate(ps)]) == plain
        # a random draft is accepted ~1/512 of the time: acceptance length ~1; at most 5 here
        assert sched.stats()["spec_accept_length"] > 3.5, (topk, sched.stats()["spec_accept_length"])
        # a row for every position whose next token is known (prefill chunks included)
        assert sched.drafter.rows_run == {f"r{i}": 120 + 24 - 1 for i in range(4)}, chunk
        _assert_released(sched.drafter)


def test_retraction_under_memory_pressure(target, drafts):
    """A small KV pool forces retraction (the request re-prefills, with the radix cache serving
    part of it): the drafter keeps its draft cache, outputs stay the target's, nothing leaks."""
    path, _ = target
    runner = target_runner(path, max_total_tokens=400)
    rng = random.Random(11)
    ps = [[rng.randrange(VOCAB) for _ in range(rng.randint(20, 40))] for _ in range(10)]
    sched_cfg = {"max_total_tokens": 400, "chunked_prefill_size": 16, "schedule_conservativeness": 0.05}
    plain_sched = _scheduler(runner, Config.build({"stack": {"prefix_cache": "radix"}, "scheduler": sched_cfg}))
    plain = _run(plain_sched, [_greedy(f"r{i}", p, 40) for i, p in enumerate(ps)])
    spec = _config(drafts["eagle3"], num_draft_tokens=3).model_dump()
    spec["scheduler"].update(sched_cfg)
    sched = _scheduler(runner, Config.build({k: spec[k] for k in ("stack", "speculative", "scheduler")}))
    assert _run(sched, [_greedy(f"r{i}", p, 40) for i, p in enumerate(ps)]) == plain
    assert sched.stats()["retractions"] > 0
    assert sched.stats()["spec_verifies"] > 0
    _assert_released(sched.drafter)


def test_seeded_sampling_identical_on_and_off(target, drafts):
    """Sampled rows verify EAGLE drafts by the target's own seeded draw: same tokens as without."""
    _, runner = target

    def sampled(rid, prompt):
        sp = SamplingParams(max_new_tokens=16, temperature=0.7, top_k=5, ignore_eos=True, seed=123)
        return GenerateRequest(rid=rid, input_ids=prompt, sampling_params=sp)

    ps = _prompts(4, seed=21)
    plain = _run(_scheduler(runner, None), [sampled(f"r{i}", p) for i, p in enumerate(ps)])
    for topk in (1, 3):
        sched = _scheduler(runner, _config(drafts["eagle2"], topk=topk, num_draft_tokens=6, num_steps=3))
        assert _run(sched, [sampled(f"r{i}", p) for i, p in enumerate(ps)]) == plain
        _assert_released(sched.drafter)


@pytest.mark.parametrize("kind,topk", [("eagle3", 1), ("eagle2", 3)])
def test_passes_the_drafter_kit_on_a_model(target, drafts, kind, topk):
    """The kit third-party drafters run on a real tiny target (radixserve.testing.check_drafter_on_model):
    outputs equal plain greedy decoding, nothing left for finished requests."""
    from radixserve.testing import check_drafter_on_model

    assert check_drafter_on_model(EagleDrafter, target[0], draft_model_path=drafts[kind], topk=topk) >= 1.0

