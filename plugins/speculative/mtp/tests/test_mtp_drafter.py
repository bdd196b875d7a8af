"""The MTP drafter on a tiny random DeepSeek-V3 target with one MTP layer (CPU): the MTP module
against transformers' decoder layer, clear errors for checkpoints without MTP weights, the Drafter
contract kit, greedy outputs with speculation equal to those without (chains of 2 and 3, batched,
radix cache hits, chunked prefill), acceptance reported, and an MTP layer built to reproduce the
target being accepted (the hidden-state and draft-KV plumbing lines up)."""

from __future__ import annotations

import random

import pytest
import torch
from mtp_checkpoints import TINY_V3, mtp_tensors, write_copy_target, write_tiny_v3_with_mtp, write_tiny_v3_without_mtp
from radixserve.config import Config
from radixserve.interfaces.target_states import HiddenRows
from radixserve.model_runner import ModelRunner
from radixserve.plugins.registry import PluginError, Registry
from radixserve.runtime.messages import GenerateRequest
from radixserve.scheduler.speculative.setup import build_drafter, drafter_info
from radixserve.state import SamplingParams
from radixserve.static_batch import run_static_batch
from radixserve.testing import check_drafter
from radixserve.testing import run_to_completion as _run
from radixserve.testing.speculative import RecordingDrafter, shared_prefix_prompts, speculative_scheduler, target_runner
from radixserve.testing.speculative import assert_drafter_released as _assert_released
from radixserve.testing.speculative import greedy_request as _greedy
from radixserve_spec_mtp.checkpoint import MtpCheckpointError, read_mtp_layer
from radixserve_spec_mtp.drafter import MtpDrafter
from radixserve_spec_mtp.layer import MtpModule

VOCAB = 512


def _runner(path: str, max_total_tokens: int = 6000, impl: str = "native") -> ModelRunner:
    """The target: the native DeepSeek plugin (latent KV pool, torch_native latent attention), or
    the transformers fallback with `impl="transformers"`."""
    return target_runner(path, max_total_tokens=max_total_tokens, impl=impl)


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    """(checkpoint dir, runner) for a 2-layer tiny DeepSeek-V3 with one random MTP layer."""
    path = write_tiny_v3_with_mtp(tmp_path_factory.mktemp("v3"), seed=3)
    runner = _runner(path)
    assert type(runner.model).__name__ == "DeepseekV3ForCausalLM"
    return path, runner


@pytest.fixture(scope="module")
def targets(target):
    """The same checkpoint served natively and through the transformers fallback."""
    return {"native": target[1], "transformers": _runner(target[0], impl="transformers")}


def _config(num_steps: int = 3, chunk: int = 2048, draft_path: str | None = None, **options) -> Config:
    return Config.build({
        "stack": {"prefix_cache": "radix", "speculative": "mtp"},
        "speculative": {"num_draft_tokens": num_steps, "draft_model_path": draft_path, "adaptive_batch_size": 0,
                        "options": options},
        "scheduler": {"max_total_tokens": 6000, "chunked_prefill_size": chunk},
    })


class RecordingMtp(RecordingDrafter, MtpDrafter):
    """Keeps every proposal and the rows each request ran."""


def _scheduler(runner, cfg: Config | None):
    return speculative_scheduler(runner, cfg, lambda info, cfg: RecordingMtp(info, **cfg.speculative.options))


def _prompts(n, seed=0):
    return shared_prefix_prompts(n, VOCAB, seed)


# ---- registration, loading, the module's math --------------------------------------------------
def test_registered_as_the_mtp_drafter():
    registry = Registry.discover()
    assert registry.load("drafter", "mtp") is MtpDrafter
    assert registry.get("drafter", "mtp").supports_device("cpu")


def test_mtp_module_matches_transformers_decoder_layer(target):
    """The MTP module's fusion + decoder layer (MLA with interleaved rope, MoE with grouped routing
    and shared experts) over its own latent cache equals transformers' DeepseekV3DecoderLayer run on
    eh_proj(cat(enorm(embed), hnorm(hidden))) with a causal mask."""
    from transformers import AutoConfig
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3DecoderLayer, DeepseekV3RotaryEmbedding

    path = target[0]
    cfg = AutoConfig.from_pretrained(path)
    weights = read_mtp_layer(path, cfg)
    assert weights.layer == 2 and "shared_head.head.weight" in weights.tensors
    mtp = MtpModule(weights).eval()
    params = dict(mtp.named_parameters())
    for name, tensor in weights.tensors.items():  # every tensor landed where its name says
        assert torch.equal(params[MtpModule._param_name(name)], tensor), name

    cfg._attn_implementation = "eager"
    hf = DeepseekV3DecoderLayer(cfg, weights.layer).eval()
    t = dict(weights.tensors)
    e = cfg.n_routed_experts
    hf_state = {k: v for k, v in t.items() if k in hf.state_dict()}
    hf_state["mlp.experts.gate_up_proj"] = torch.stack(
        [torch.cat([t[f"mlp.experts.{i}.gate_proj.weight"], t[f"mlp.experts.{i}.up_proj.weight"]]) for i in range(e)])
    hf_state["mlp.experts.down_proj"] = torch.stack([t[f"mlp.experts.{i}.down_proj.weight"] for i in range(e)])
    hf.load_state_dict(hf_state, strict=True)

    n, g = 9, torch.Generator().manual_seed(0)
    embeds, hidden = torch.randn(n, cfg.hidden_size, generator=g), torch.randn(n, cfg.hidden_size, generator=g)
    positions = torch.arange(4, 4 + n)
    from radixserve_spec_mtp.layer import latent_attention

    attn = mtp.layer.self_attn
    with torch.no_grad():
        def attend(q_nope, q_pe, c_kv, k_pe):
            lat = torch.cat([c_kv, k_pe.reshape(n, -1)], dim=-1)[None]
            mask = torch.tril(torch.ones(n, n, dtype=torch.bool))[None]
            return latent_attention(q_nope[None], q_pe[None], lat, attn.w_uk, attn.w_uv, attn.kv_lora_rank,
                                    attn.scaling, mask)[0]

        ours = mtp.step(embeds, positions, hidden, attend)
        x = mtp.eh_proj(torch.cat([mtp.enorm(embeds), mtp.hnorm(hidden)], dim=-1))[None]
        cos_sin = DeepseekV3RotaryEmbedding(cfg)(x, positions[None])
        causal = torch.full((n, n), float("-inf")).triu(1)[None, None]
        theirs = hf(x, attention_mask=causal, position_ids=positions[None], position_embeddings=cos_sin)[0]
    torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=1e-4)


def test_checkpoints_without_mtp_weights_are_named_errors(tmp_path, target):
    from transformers import AutoConfig

    none = write_tiny_v3_without_mtp(tmp_path / "none", declared=0)
    with pytest.raises(MtpCheckpointError, match=r"num_nextn_predict_layers is 0"):
        read_mtp_layer(none, AutoConfig.from_pretrained(none))
    dropped = write_tiny_v3_without_mtp(tmp_path / "dropped", declared=1)
    with pytest.raises(MtpCheckpointError, match=r"no tensors under model\.layers\.2\.\*"):
        read_mtp_layer(dropped, AutoConfig.from_pretrained(dropped))
    # at start-up, through the core: a PluginError naming the drafter and the checkpoint
    registry = Registry.discover()
    runner = _runner(dropped)
    with pytest.raises(PluginError, match=r"stack.speculative='mtp'.*model\.layers\.2\."):
        build_drafter(_config(), runner, registry)
    with pytest.raises(PluginError, match=r"mtp.*unexpected keyword|layr"):
        build_drafter(_config(layr=0), target[1], registry)
    with pytest.raises(PluginError, match=r"MTP layer 1 requested, the checkpoint has 1"):
        build_drafter(_config(layer=1), target[1], registry)


@pytest.mark.parametrize("impl", ["native", "transformers"])
def test_target_hidden_state_is_the_last_layer_before_the_norm(target, targets, impl):
    """The hook the drafter reads: the residual stream after the last decoder layer; the target's
    final norm of it is the state its LM head reads."""
    path, runner = target[0], targets[impl]
    ts = runner.target_states
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    prompt = [5, 77, 300, 12, 9, 401, 33]
    was = ts.aux_layers
    ts.request(aux_layers=(0, 1))
    try:
        out = run_static_batch(runner, [prompt], max_new_tokens=3).output_ids[0]
        rows = ts.take("0")
    finally:
        ts.request(aux_layers=was or (ts.num_layers - 1,))
    aux = torch.cat([r.aux for r in rows])
    full = torch.tensor([prompt + out[:2]])
    with torch.no_grad():
        states = hf(input_ids=full, output_hidden_states=True).hidden_states
        torch.testing.assert_close(aux[:, :64], states[1][0], atol=2e-4, rtol=1e-3)  # after layer 0
        torch.testing.assert_close(hf.model.norm(aux[:, 64:]), states[-1][0], atol=2e-4, rtol=1e-3)
    torch.testing.assert_close(ts.embed(full[0]), hf.model.embed_tokens(full[0]))


# ---- the contract kit ----------------------------------------------------------------------------
def test_passes_the_drafter_kit(target):
    """check_drafter's toy requests run no target forwards; a subclass stands in for the runner and
    records a deterministic pseudo hidden state for every new position, so proposals are real MTP
    chains under the kit's random batches, orders and releases."""
    path, runner = target
    base = drafter_info(_config(), runner)

    class KitMtp(MtpDrafter):
        def _collect(self, req):
            st = self._state(req.rid)
            ids = req.all_ids()
            start = st.last_pos + 1
            if start < len(ids) - 1:
                pos = list(range(start, len(ids) - 1))
                g = torch.Generator().manual_seed(sum(ids[: len(ids) - 1]) % 1000)
                aux = torch.randn(len(pos), self.target.hidden_size, generator=g)
                self.target.record(req.rid, HiddenRows(pos, [ids[p] for p in pos], None, None, aux))
            super()._collect(req)

    def factory(info):
        from dataclasses import replace

        return KitMtp(replace(base, vocab_size=info.vocab_size, num_draft_tokens=info.num_draft_tokens,
                              num_steps=info.num_steps, topk=info.topk, supports_tree=info.supports_tree))

    check_drafter(factory, vocab_size=VOCAB, num_draft_tokens=3, topk=(1, 3), seeds=(0,), num_requests=6)


# ---- losslessness --------------------------------------------------------------------------------
@pytest.mark.parametrize("steps,chunk,impl", [(2, 2048, "native"), (3, 8, "native"), (2, 2048, "transformers")])
def test_greedy_identical_on_and_off(targets, steps, chunk, impl):
    runner = targets[impl]
    ps = _prompts(6, seed=steps)
    plain = _run(_scheduler(runner, None), [_greedy(f"r{i}", p, 16) for i, p in enumerate(ps)])
    cfg = _config(num_steps=steps, chunk=chunk)
    sched = _scheduler(runner, cfg)
    assert _run(sched, [_greedy(f"r{i}", p, 16) for i, p in enumerate(ps)]) == plain  # batched
    stats = sched.stats()
    assert stats["spec_verifies"] > 0
    print(f"mtp random weights, k={steps}: accept length {stats['spec_accept_length']:.3f}")
    d = sched.drafter
    drafted = 0
    for batch, k, prop in d.proposals:
        assert len(prop.tokens) == batch and prop.parents is None
        for toks in prop.tokens:
            assert len(toks) <= min(k, steps) and all(0 <= t < VOCAB for t in toks)
            drafted += len(toks) > 0
    assert drafted > 0  # the MTP layer did draft (not every proposal empty)
    # a row for every position whose next token is known, except radix-served prefix positions
    for i, p in enumerate(ps):
        assert d.rows_run[f"r{i}"] <= len(p) + 16 - 1
    assert d.rows_run["r0"] == len(ps[0]) + 16 - 1  # the first request had no cache hit
    _assert_released(d)
    alone = _scheduler(runner, cfg)
    assert _run(alone, [_greedy("r1", ps[1], 16)]) == {"r1": plain["r1"]}
    _assert_released(alone.drafter)


def test_seeded_sampling_and_retraction_identical_on_and_off(target):
    """Sampled rows verify drafts by the target's own seeded draw; a small KV pool forces
    retraction (the request comes back, the radix cache serving part of it): same tokens as
    without speculation, nothing left behind."""
    path, _ = target
    runner = _runner(path, max_total_tokens=400)

    def sampled(rid, prompt):
        sp = SamplingParams(max_new_tokens=30, temperature=0.7, top_k=5, ignore_eos=True, seed=123)
        return GenerateRequest(rid=rid, input_ids=prompt, sampling_params=sp)

    rng = random.Random(11)
    ps = [[rng.randrange(VOCAB) for _ in range(rng.randint(20, 40))] for _ in range(10)]
    sched_cfg = {"max_total_tokens": 400, "chunked_prefill_size": 16, "schedule_conservativeness": 0.05}
    plain = _run(_scheduler(runner, Config.build({"stack": {"prefix_cache": "radix"}, "scheduler": sched_cfg})),
                 [sampled(f"r{i}", p) for i, p in enumerate(ps)])
    spec = _config(num_steps=3).model_dump()
    spec["scheduler"].update(sched_cfg)
    sched = _scheduler(runner, Config.build({k: spec[k] for k in ("stack", "speculative", "scheduler")}))
    assert _run(sched, [sampled(f"r{i}", p) for i, p in enumerate(ps)]) == plain
    assert sched.stats()["retractions"] > 0 and sched.stats()["spec_verifies"] > 0
    _assert_released(sched.drafter)


def test_an_mtp_layer_that_copies_the_target_is_accepted(tmp_path, monkeypatch):
    import radixserve_spec_mtp.drafter as drafter_module

    path = write_copy_target(tmp_path / "copy", seed=7)
    runner = _runner(path)
    rng = random.Random(9)
    # long prompts: the MTP layer never sees token 0 (its row p reads token p + 1), which matters
    # less the more context there is
    ps = [[rng.randrange(VOCAB) for _ in range(100)] for _ in range(4)]
    plain = _run(_scheduler(runner, None), [_greedy(f"r{i}", p, 24) for i, p in enumerate(ps)])
    for steps, piece, budget in ((2, 256, 1 << 26), (3, 256, 1 << 26), (3, 7, 4 * 7 * 40 * 3)):
        # the last case cuts each prompt's rows into pieces of 7, several per forward, several forwards
        monkeypatch.setattr(drafter_module, "ROWS_PER_PIECE", piece)
        monkeypatch.setattr(drafter_module, "SCORE_BUDGET", budget)
        sched = _scheduler(runner, _config(num_steps=steps))
        assert _run(sched, [_greedy(f"r{i}", p, 24) for i, p in enumerate(ps)]) == plain
        length = sched.stats()["spec_accept_length"]
        print(f"mtp copy of the target, k={steps}, pieces of {piece}: accept length {length:.3f}")
        # random weights accept ~1/512 of drafts (length ~1); the copy nearly all (at most k + 1)
        assert length > steps + 0.5, (steps, length)
        assert sched.drafter.rows_run == {f"r{i}": 100 + 24 - 1 for i in range(4)}
        _assert_released(sched.drafter)


def test_mtp_weights_from_a_separate_draft_checkpoint(tmp_path, target):
    """speculative.draft_model_path: an exported NextN checkpoint (config + the MTP layer only)."""
    import json
    from pathlib import Path

    from safetensors.torch import save_file
    from transformers import AutoConfig

    path, runner = target
    cfg = AutoConfig.from_pretrained(path)
    draft = tmp_path / "nextn"
    draft.mkdir()
    (draft / "config.json").write_text((Path(path) / "config.json").read_text())
    t = mtp_tensors(cfg, torch.Generator().manual_seed(1), own_head=False)
    save_file({f"model.layers.2.{k}": v.contiguous() for k, v in t.items()}, str(draft / "model.safetensors"))
    assert json.loads((draft / "config.json").read_text())["num_nextn_predict_layers"] == TINY_V3[
        "num_nextn_predict_layers"]
    d = MtpDrafter(drafter_info(_config(draft_path=str(draft)), runner))
    assert d.mtp.shared_head.head is None and d.mtp.embed_tokens is None  # the target's are used
    assert torch.equal(d.mtp.eh_proj.weight, t["eh_proj.weight"])


# ---- the native DeepSeek model's capability --------------------------------------------------------
class _OneSequenceLatentBackend:
    """Stands in for the runner's latent backend on one sequence (causal, no pool): runs the
    native model's forward outside the runner, with this plugin's latent attention."""

    def forward_latent(self, q_nope, q_pe, c_kv, k_pe, layer, batch):
        from radixserve_spec_mtp.layer import latent_attention

        n = q_nope.shape[0]
        lat = torch.cat([c_kv, k_pe.reshape(n, -1)], dim=-1)[None]
        mask = torch.tril(torch.ones(n, n, dtype=torch.bool))[None]
        return latent_attention(q_nope[None], q_pe.view(n, layer.num_heads, -1)[None], lat, layer.w_uk, layer.w_uv,
                                layer.kv_lora_rank, layer.scaling, mask)[0]


def test_native_deepseek_exposes_the_last_layer_output(target):
    """radixserve-models-deepseek's DeepseekV3ForCausalLM has the hidden-state capability the
    drafter needs: the residual stream after each requested layer, in the requested order, equal to
    transformers' hidden states (and the final norm of the last one to the model's output); its MTP
    tensors are skipped at load."""
    from types import SimpleNamespace

    from radixserve.model_loader.loader import load_model
    from radixserve.model_loader.sources import ModelSource
    from radixserve_models_deepseek.model import DeepseekV3ForCausalLM
    from transformers import AutoConfig, AutoModelForCausalLM

    path = target[0]
    cfg = AutoConfig.from_pretrained(path)
    model = load_model(ModelSource(path=path, format="safetensors"), cfg, DeepseekV3ForCausalLM,
                       torch.device("cpu"), torch.float32, show_progress=False)
    assert model.supports_aux_hidden_states
    model.set_aux_hidden_state_layers((1, 0))
    ids = torch.tensor([5, 77, 300, 12, 9, 401, 33])
    batch = SimpleNamespace(attn_backend=_OneSequenceLatentBackend())
    with torch.no_grad():
        final = model(ids, torch.arange(len(ids)), batch)
        hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        states = hf(input_ids=ids[None], output_hidden_states=True).hidden_states
        after1, after0 = model.aux_hidden_states
        torch.testing.assert_close(after0, states[1][0], atol=2e-4, rtol=1e-3)
        torch.testing.assert_close(final, states[-1][0], atol=2e-4, rtol=1e-3)
        torch.testing.assert_close(hf.model.norm(after1), final, atol=2e-4, rtol=1e-3)
        torch.testing.assert_close(model.embed_input_ids(ids), hf.model.embed_tokens(ids))
    model.set_aux_hidden_state_layers(())
    with torch.no_grad():
        model(ids, torch.arange(len(ids)), batch)
    assert model.aux_hidden_states is None


def test_block_fp8_mtp_weights_are_dequantized(target, tmp_path):
    """DeepSeek-V3 ships its MTP layer in block FP8 (`weight_scale_inv` per tile): read back as
    fp32 within FP8's rounding, and the module builds from them."""
    from safetensors.torch import save_file
    from transformers import AutoConfig

    path = target[0]
    cfg = AutoConfig.from_pretrained(path)
    cfg.quantization_config = {"quant_method": "fp8", "weight_block_size": [16, 16]}
    plain = read_mtp_layer(path, cfg).tensors
    quant, block = {}, 16
    for name, w in plain.items():
        if w.dim() == 2 and name.endswith("proj.weight") and not (w.shape[0] % block or w.shape[1] % block):
            amax = w.abs().unflatten(0, (-1, block)).unflatten(2, (-1, block)).amax(dim=(1, 3))
            scale = (amax / 448.0).clamp_min(1e-12)
            full = scale.repeat_interleave(block, 0).repeat_interleave(block, 1)
            quant[name] = (w / full).to(torch.float8_e4m3fn)
            quant[name + "_scale_inv"] = scale
        else:
            quant[name] = w
    d = tmp_path
    save_file({f"model.layers.2.{k}": v.contiguous() for k, v in quant.items()}, str(d / "model.safetensors"))
    got = read_mtp_layer(str(d), cfg).tensors
    assert any(n.endswith("_scale_inv") for n in quant) and not any(n.endswith("_scale_inv") for n in got)
    for name, w in plain.items():
        assert got[name].dtype == torch.float32
        torch.testing.assert_close(got[name], w, atol=0.02 * float(w.abs().max()), rtol=0.07)
    MtpModule(read_mtp_layer(str(d), cfg))


def test_passes_the_drafter_kit_on_a_model(target):
    """The kit third-party drafters run on a real tiny target (radixserve.testing.check_drafter_on_model):
    the DeepSeek-V3 target's own MTP layer drafts; outputs equal plain greedy decoding."""
    from radixserve.testing import check_drafter_on_model

    assert check_drafter_on_model(MtpDrafter, target[0], num_draft_tokens=3) >= 1.0

