"""Latent attention (MLA, plugin API 1.4): the latent pool, the runner's pool and backend choice by
`Model.attention_type`, a tiny test-only latent model served end to end against its own eager
decompressed reference, and the latent conformance kit on torch_native."""

from __future__ import annotations

import json
import math
import types

import pytest
import torch
import torch.nn as nn
from radixserve.config import Config
from radixserve.interfaces import LatentAttentionDims, Model
from radixserve.layers.latent_attention import RadixLatentAttention
from radixserve.memory import LatentKVPool, kv_bytes_per_token, latent_bytes_per_token
from radixserve.model_runner import ModelRunner
from radixserve.plugins.registry import PluginError, Registry
from radixserve.plugins.stack import resolve_stack
from radixserve.runtime.messages import GenerateRequest
from radixserve.scheduler import Scheduler
from radixserve.state import SamplingParams
from radixserve.testing import check_latent_attention_backend
from radixserve_attention_torch_native.backend import TorchNativeBackend

ARCH = "TinyLatentForCausalLM"
TINY = dict(vocab_size=96, hidden_size=32, num_attention_heads=4, num_hidden_layers=2, kv_lora_rank=24,
            qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=6, max_position_embeddings=256)


# ---- a tiny latent-attention model (test only): attention-only blocks with DeepSeek's MLA layout ----
def _rms(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w


def _rotate(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotary (NeoX halves) on the last dim of x [T, ..., d] at positions [T]."""
    d = x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    ang = positions.double()[:, None] * inv[None, :]
    shape = (x.shape[0],) + (1,) * (x.dim() - 2) + (d // 2,)
    cos, sin = ang.cos().view(shape).to(x.dtype), ang.sin().view(shape).to(x.dtype)
    a, b = x[..., : d // 2], x[..., d // 2 :]
    return torch.cat([a * cos - b * sin, b * cos + a * sin], dim=-1)


class _Block(nn.Module):
    def __init__(self, c, layer_id: int) -> None:
        super().__init__()
        h, lora = c.num_attention_heads, c.kv_lora_rank
        nope, rope, v = c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim
        self.dims = (h, lora, nope, rope, v)
        self.norm = nn.Parameter(torch.ones(c.hidden_size))
        self.q_proj = nn.Linear(c.hidden_size, h * (nope + rope), bias=False)
        self.kv_a_proj = nn.Linear(c.hidden_size, lora + rope, bias=False)
        self.kv_a_layernorm = nn.Parameter(torch.ones(lora))
        self.kv_b_proj = nn.Linear(lora, h * (nope + v), bias=False)
        self.o_proj = nn.Linear(h * v, c.hidden_size, bias=False)
        self.attn = RadixLatentAttention(layer_id, h, lora, nope, rope, v, 0.9 * (nope + rope) ** -0.5, self.kv_b_proj)
        self.theta = 10000.0

    def project(self, x: torch.Tensor, positions: torch.Tensor):
        h, lora, nope, rope, _ = self.dims
        y = _rms(x, self.norm)
        q = self.q_proj(y).view(-1, h, nope + rope)
        kv = self.kv_a_proj(y)
        c_kv, k_pe = _rms(kv[:, :lora], self.kv_a_layernorm), kv[:, lora:]
        q_pe = _rotate(q[..., nope:], positions, self.theta)
        return q[..., :nope], q_pe, c_kv, _rotate(k_pe, positions, self.theta)

    def forward(self, x, positions, batch):
        q_nope, q_pe, c_kv, k_pe = self.project(x, positions)
        return x + self.o_proj(self.attn(q_nope, q_pe, c_kv, k_pe, batch))

    def reference(self, x: torch.Tensor) -> torch.Tensor:
        """Causal attention over the whole sequence with keys/values from kv_b_proj (no pool)."""
        h, lora, nope, rope, v = self.dims
        t = x.shape[0]
        q_nope, q_pe, c_kv, k_pe = self.project(x, torch.arange(t))
        kv = self.kv_b_proj(c_kv).view(t, h, nope + v)
        keys = torch.cat([kv[..., :nope], k_pe[:, None, :].expand(t, h, rope)], dim=-1)
        q = torch.cat([q_nope, q_pe], dim=-1)
        scores = torch.einsum("thd,shd->hts", q, keys) * self.attn.scaling
        scores = scores.masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), float("-inf"))
        out = torch.einsum("hts,shd->thd", scores.softmax(-1), kv[..., nope:]).reshape(t, h * v)
        return x + self.o_proj(out)


class TinyLatentModel(Model):
    attention_type = "latent"

    def __init__(self, config, quant_method=None, prefix: str = "") -> None:
        super().__init__(config)
        self.config = config
        self.embed = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(_Block(config, i) for i in range(config.num_hidden_layers))
        self.final_norm = nn.Parameter(torch.ones(config.hidden_size))
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def latent_attention_dims(self) -> LatentAttentionDims:
        c = self.config
        return LatentAttentionDims(c.num_hidden_layers, c.num_attention_heads, c.kv_lora_rank, c.qk_nope_head_dim,
                                   c.qk_rope_head_dim, c.v_head_dim)

    def forward(self, input_ids, positions, batch):
        x = self.embed(input_ids)
        for layer in self.layers:
            x = layer(x, positions, batch)
        return _rms(x, self.final_norm)

    def compute_logits(self, hidden):
        return self.lm_head(hidden).float()

    def load_weights(self, weights):
        params = dict(self.named_parameters())
        loaded = set()
        for name, tensor in weights:
            params[name].data.copy_(tensor)
            loaded.add(name)
        return loaded

    @torch.no_grad()
    def reference_greedy(self, prompt: list[int], n: int) -> list[int]:
        """Greedy tokens from the eager float64 copy of this model, recomputing the whole sequence."""
        ids = list(prompt)
        for _ in range(n):
            x = self.embed(torch.tensor(ids))
            for layer in self.layers:
                x = layer.reference(x)
            ids.append(int(self.lm_head(_rms(x, self.final_norm))[-1].argmax()))
        return ids[len(prompt):]


class SparseModel(TinyLatentModel):
    attention_type = "sparse"  # not a known attention type


def _plugin(name: str, register) -> types.ModuleType:
    mod = types.ModuleType(name)
    mod.PLUGIN_API = ">=1,<2"
    mod.radixserve_register = register
    return mod


class LatentOnlyBackend(TorchNativeBackend):
    """A latent-only backend (as an MLA kernel plugin would be)."""

    name = "latent_only"
    supports_latent_attention = True
    supports_standard_attention = False


def _registry(config: Config, latent_only_priority: int | None = None) -> Registry:
    reg = Registry.from_config(config)

    def register(registry) -> None:
        registry.register("model", ARCH, f"{__name__}:TinyLatentModel")
        registry.register("model", "SparseForCausalLM", f"{__name__}:SparseModel")
        if latent_only_priority is not None:
            registry.register("attention", "latent_only", f"{__name__}:LatentOnlyBackend", devices=("cpu",),
                              priority=latent_only_priority)

    reg.add_plugin_module(_plugin("tiny_latent_test_plugin", register), name="tiny-latent", distribution="tiny-latent-test")
    return reg


@pytest.fixture(scope="module")
def latent_dir(tmp_path_factory):
    """A checkpoint of the tiny latent model: config.json (a llama config with MLA fields) and safetensors."""
    from safetensors.torch import save_file
    from transformers import AutoConfig

    path = tmp_path_factory.mktemp("tiny_latent")
    cfg = AutoConfig.for_model("llama", **TINY)
    cfg.architectures = [ARCH]
    cfg.save_pretrained(path)
    torch.manual_seed(0)
    model = TinyLatentModel(cfg)
    with torch.no_grad():
        for p in model.parameters():  # peaked logits: few near-ties for the greedy comparison
            p.copy_(1 + 0.1 * torch.randn(p.shape) if p.dim() == 1 else torch.randn(p.shape) / math.sqrt(p.shape[-1]))
        model.lm_head.weight.mul_(4)
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(path / "model.safetensors"))
    assert "kv_lora_rank" in json.loads((path / "config.json").read_text())
    return str(path)


def _config(path: str, **stack) -> Config:
    return Config.build({
        "model": {"path": path},
        "runtime": {"device": "cpu", "num_threads": 1},
        "scheduler": {"max_total_tokens": 1024, "max_running_requests": 8},
        "stack": stack,
    })


@pytest.fixture(scope="module")
def runner(latent_dir):
    cfg = _config(latent_dir)
    return ModelRunner(cfg, registry=_registry(cfg), show_progress=False)


# ---- the pool ---------------------------------------------------------------------------------
def test_latent_pool_bytes_per_token_and_ratio_for_a_v2_lite_shape():
    # DeepSeek-V2-Lite: 27 layers, 16 heads, kv_lora_rank 512, rope 64, nope 128, v 128, bf16
    layers, heads, lora, rope, nope, v = 27, 16, 512, 64, 128, 128
    item = torch.empty((), dtype=torch.bfloat16).element_size()
    latent = latent_bytes_per_token(layers, lora, rope, torch.bfloat16)
    assert latent == layers * (lora + rope) * item
    pool = LatentKVPool(3, layers, lora, rope, torch.bfloat16)
    assert pool.nbytes() == (3 + 1) * latent  # slot 0 is the padding slot
    # what a standard pool would hold for the same attention: per head K (nope + rope) and V (v)
    uncompressed = layers * heads * ((nope + rope) + v) * item
    ratio = uncompressed / latent
    assert ratio == heads * (nope + rope + v) / (lora + rope)
    assert ratio > 8  # the reason MLA exists: ~8.9x more tokens in the same memory
    # a KVPool with the K width for V too is larger still
    assert kv_bytes_per_token(layers, heads, nope + rope, torch.bfloat16) > uncompressed


def test_latent_pool_writes_only_the_given_slots_and_layer():
    pool = LatentKVPool(10, 2, 6, 3, torch.float32)
    loc = torch.tensor([7, 2])
    c_kv, k_pe = torch.randn(2, 6), torch.randn(2, 1, 3)  # k_pe may carry a head axis of 1
    pool.set_latent(1, loc, c_kv, k_pe)
    buf = pool.get_latent(1)
    assert buf.shape == (11, 9)
    assert torch.equal(buf[loc, :6], c_kv) and torch.equal(buf[loc, 6:], k_pe.squeeze(1))
    others = torch.ones(11, dtype=torch.bool)
    others[loc] = False
    assert not buf[others].any() and not pool.get_latent(0).any()
    half = LatentKVPool(4, 1, 6, 3, torch.bfloat16)
    half.set_latent(0, torch.tensor([1]), c_kv[:1], k_pe[:1])
    assert half.get_latent(0).dtype == torch.bfloat16
    assert torch.equal(half.get_latent(0)[1, :6], c_kv[0].to(torch.bfloat16))


# ---- the runner: pool and backend from the model's attention_type ----------------------------
def test_runner_builds_a_latent_pool_and_a_latent_capable_backend(runner):
    dims = runner.model.latent_attention_dims()
    assert isinstance(runner.kv_pool, LatentKVPool)
    assert (runner.kv_pool.num_layers, runner.kv_pool.kv_lora_rank, runner.kv_pool.rope_dim) == (
        dims.num_layers, dims.kv_lora_rank, dims.qk_rope_head_dim)
    assert runner.kv_pool.num_slots == runner.max_total_tokens == 1024
    # cpu_batched (the CPU default for standard models) has no latent support: torch_native is chosen
    assert runner.attn_backend_name == "torch_native"
    info = runner.attn_backend.runner_info
    assert info.latent == dims and info.kv_pool is runner.kv_pool
    assert (info.num_kv_heads, info.head_dim, info.num_heads) == (1, dims.latent_width, dims.num_heads)
    assert runner.kv_bytes_per_token() == latent_bytes_per_token(2, 24, 4, torch.float32)


def test_runner_sizes_the_latent_pool_from_the_memory_budget(latent_dir):
    cfg = _config(latent_dir).with_overrides({"scheduler": {"max_total_tokens": None, "cpu_kv_cache_gb": 0.001}})
    r = ModelRunner(cfg, registry=_registry(cfg), show_progress=False)
    per_token = latent_bytes_per_token(2, 24, 4, torch.float32)
    assert r.max_total_tokens == int(0.001 * 2**30 // per_token)
    assert isinstance(r.kv_pool, LatentKVPool) and r.kv_pool.num_slots == r.max_total_tokens


def test_a_latent_model_on_a_backend_without_latent_support_is_refused(latent_dir):
    cfg = _config(latent_dir, attention="cpu_batched")
    with pytest.raises(PluginError) as e:
        ModelRunner(cfg, registry=_registry(cfg), show_progress=False)
    msg = str(e.value)
    assert "stack.attention='cpu_batched'" in msg and "attention_type='latent'" in msg and ARCH in msg
    assert "torch_native" in msg  # the installed backends that could serve it


def test_a_standard_model_on_a_latent_only_backend_is_refused(tiny_llama_dir):
    cfg = _config(tiny_llama_dir("llama"), attention="latent_only")
    with pytest.raises(PluginError) as e:
        ModelRunner(cfg, registry=_registry(cfg, latent_only_priority=5), show_progress=False)
    msg = str(e.value)
    assert "stack.attention='latent_only'" in msg and "attention_type='standard'" in msg
    assert "supports_standard_attention is False" in msg


def test_an_unknown_attention_type_is_refused(latent_dir, tmp_path):
    cfg_json = json.loads(open(f"{latent_dir}/config.json").read())
    cfg_json["architectures"] = ["SparseForCausalLM"]
    (tmp_path / "config.json").write_text(json.dumps(cfg_json))
    (tmp_path / "model.safetensors").symlink_to(f"{latent_dir}/model.safetensors")
    cfg = _config(str(tmp_path))
    with pytest.raises(ValueError, match="attention_type='sparse'.*'standard', 'latent'"):
        ModelRunner(cfg, registry=_registry(cfg), show_progress=False)


def test_default_backend_follows_the_attention_type_by_class_flags():
    cfg = Config.build({"runtime": {"device": "cpu"}})
    plain = _registry(cfg)
    assert resolve_stack(cfg, plain, "cpu", attention_type="standard").attention.name == "cpu_batched"
    assert resolve_stack(cfg, plain, "cpu", attention_type="latent").attention.name == "torch_native"
    # a latent-only backend ranked first is the default for latent models only
    ranked = _registry(cfg, latent_only_priority=100)
    assert resolve_stack(cfg, ranked, "cpu", attention_type="latent").attention.name == "latent_only"
    assert resolve_stack(cfg, ranked, "cpu", attention_type="standard").attention.name == "cpu_batched"
    named = cfg.with_overrides({"stack": {"attention": "torch_native"}})
    assert resolve_stack(named, ranked, "cpu", attention_type="latent").attention.name == "torch_native"


# ---- end to end: scheduler + radix cache + chunked prefill vs the eager decompressed reference ----
def _serve(runner, stages: list[dict[str, list[int]]], n: int, chunk: int):
    """Serve the stages one after the other on one scheduler (a later stage can hit the radix
    cache on an earlier one's prompts). Returns (tokens by rid, cached prompt tokens by rid)."""
    config = Config.build({"scheduler": {"chunked_prefill_size": chunk, "max_total_tokens": 1024}})
    reg = Registry.discover()
    cache = reg.load("prefix_cache", "radix")(runner.req_to_token_pool, runner.token_allocator)
    sched = Scheduler(config, runner, cache, reg.load("policy", "fcfs")(), None)
    params = SamplingParams(max_new_tokens=n, temperature=0, ignore_eos=True)
    tokens: dict[str, list[int]] = {}
    cached: dict[str, int] = {}
    for stage in stages:
        for rid, prompt in stage.items():
            sched.add_request(GenerateRequest(rid=rid, input_ids=prompt, sampling_params=params))
        for _ in range(1000):
            if not sched.has_work():
                break
            for out in sched.step():
                assert out.error is None, out.error
                tokens.setdefault(out.rid, []).extend(out.new_ids)
                cached[out.rid] = out.cached_tokens
    assert not sched.has_work() and sched.flush_cache()
    assert sched.allocator.available_size() == sched.allocator.size, "KV slots leaked"
    return tokens, cached


def test_latent_model_end_to_end_matches_its_eager_reference(runner):
    shared = [5, 17, 33, 2, 80, 41, 9, 60, 12, 7, 29]
    prompts = {"a": shared + [3, 4], "b": shared + [71, 8, 50, 1, 90], "c": [44, 2, 19], "d": shared[:6] + [1]}
    n = 6
    want = {rid: runner.model.reference_greedy(p, n) for rid, p in prompts.items()}
    # "a" first; then the others together, "b" and "d" from a's cached latent rows, in 4-token chunks
    rest = {rid: p for rid, p in prompts.items() if rid != "a"}
    got, cached = _serve(runner, [{"a": prompts["a"]}, rest], n, chunk=4)
    assert got == want
    assert cached["b"] >= len(shared) and cached["d"] >= 6 and cached["c"] == 0  # radix hits
    # batched together without cache hits, and each alone unchunked: the same tokens
    together, _ = _serve(runner, [prompts], n, chunk=4)
    assert together == want
    for rid, p in prompts.items():
        alone, _ = _serve(runner, [{rid: p}], n, chunk=512)
        assert alone[rid] == want[rid], rid


# ---- the conformance kit ---------------------------------------------------------------------
def test_latent_kit_passes_torch_native_fp32():
    check_latent_attention_backend(TorchNativeBackend)


def test_latent_kit_passes_torch_native_bf16():
    check_latent_attention_backend(TorchNativeBackend, dtype=torch.bfloat16, seeds=(3,), tree_steps=2)


class _NoRopeKeys(TorchNativeBackend):
    """Broken on purpose: drops the shared rotary key part from the scores."""

    supports_tree_mask = True
    decode_rows_share_requests = True
    supports_latent_attention = True

    def forward_latent_extend(self, q_nope, q_pe, c_kv, k_pe, layer, batch):
        return super().forward_latent_extend(q_nope, torch.zeros_like(q_pe), c_kv, k_pe, layer, batch)


class _WritesLayerZero(TorchNativeBackend):
    """Broken on purpose: stores every layer's rows in layer 0 as well."""

    supports_latent_attention = True

    def forward_latent_decode(self, q_nope, q_pe, c_kv, k_pe, layer, batch):
        batch.kv_pool.set_latent(0, batch.out_cache_loc, c_kv, k_pe)
        return super().forward_latent_decode(q_nope, q_pe, c_kv, k_pe, layer, batch)


class _NotLatent(TorchNativeBackend):
    pass  # __init_subclass__ resets supports_latent_attention: a subclass must declare it itself


@pytest.mark.parametrize("broken, needle", [
    (_NoRopeKeys, "differs from exact attention"),
    (_WritesLayerZero, "layer 0"),
    (_NotLatent, "does not declare supports_latent_attention"),
])
def test_latent_kit_catches_broken_backends(broken, needle):
    with pytest.raises(AssertionError, match=needle):
        check_latent_attention_backend(broken, dims=((2, 16, 8, 4, 8),), seeds=(0,), tree_steps=1)


def test_latent_models_at_tp2_need_supports_tensor_parallel():
    from radixserve.model_runner import check_model_tensor_parallel

    config = types.SimpleNamespace(num_attention_heads=4, num_key_value_heads=1)
    with pytest.raises(PluginError, match=f"{ARCH}.*supports_tensor_parallel is False"):
        check_model_tensor_parallel(ARCH, TinyLatentModel, None, config, 2)

    class ShardedLatent(TinyLatentModel):
        supports_tensor_parallel = True

    # every rank keeps the whole latent row: only the query heads must split
    check_model_tensor_parallel(ARCH, ShardedLatent, None, config, 2)
    with pytest.raises(ValueError, match="tp_size=3"):
        check_model_tensor_parallel(ARCH, ShardedLatent, None, config, 3)


def test_a_latent_only_backend_need_not_define_the_standard_methods():
    from radixserve.interfaces import AttentionBackend

    class MinimalLatent(AttentionBackend):
        supports_latent_attention = True
        supports_standard_attention = False

        def init_forward_metadata(self, batch):
            pass

    backend = MinimalLatent()  # constructible: forward_extend / forward_decode are not abstract for it
    with pytest.raises(NotImplementedError, match="MinimalLatent is latent-only"):
        backend.forward_extend(None, None, None, None, None)

    class MissingStandard(AttentionBackend):
        def init_forward_metadata(self, batch):
            pass

    with pytest.raises(TypeError):  # a standard backend must still define them
        MissingStandard()


# ---- speculative verify on latent attention: chains as decode rows, trees as masked extends ----
def _table_drafter(runner, config, table: dict, tree: bool):
    """Drafts the known greedy continuation; `tree`: a wrong sibling before every right node."""
    from radixserve.interfaces import Drafter, DraftProposal
    from radixserve.scheduler.speculative.setup import drafter_info
    from radixserve.testing.speculative import trees_with_wrong_siblings

    class TableDrafter(Drafter):
        def propose(self, reqs, k):
            chains = [list(table[tuple(r.origin_input_ids)][len(r.output_ids) : len(r.output_ids) + k]) for r in reqs]
            if not tree:
                return DraftProposal(chains)
            return trees_with_wrong_siblings(chains, k, TINY["vocab_size"])

    return TableDrafter(drafter_info(config, runner))


@pytest.mark.parametrize("tree", [False, True])
def test_speculative_verify_on_a_latent_model_keeps_greedy_outputs(runner, tree):
    prompts = {"a": [5, 17, 33, 2, 80, 41, 9], "b": [44, 2, 19, 60], "c": [5, 17, 33, 2, 80, 7, 7, 1]}
    n = 10
    want = {rid: runner.model.reference_greedy(p, n) for rid, p in prompts.items()}
    config = Config.build({"speculative": {"num_draft_tokens": 4},
                           "scheduler": {"max_total_tokens": 1024, "chunked_prefill_size": 4}})
    reg = Registry.discover()
    cache = reg.load("prefix_cache", "radix")(runner.req_to_token_pool, runner.token_allocator)
    table = {tuple(p): want[rid] + [0] * 8 for rid, p in prompts.items()}
    drafter = _table_drafter(runner, config, table, tree)
    sched = Scheduler(config, runner, cache, reg.load("policy", "fcfs")(), drafter=drafter)
    params = SamplingParams(max_new_tokens=n, temperature=0, ignore_eos=True)
    for rid, p in prompts.items():
        sched.add_request(GenerateRequest(rid=rid, input_ids=p, sampling_params=params))
    got: dict[str, list[int]] = {}
    while sched.has_work():
        for out in sched.step():
            assert out.error is None, out.error
            got.setdefault(out.rid, []).extend(out.new_ids)
    assert got == want
    stats = sched.stats()
    assert stats["spec_verifies"] > 0 and stats["spec_accept_length"] > (2.5 if tree else 3.5)
    assert sched.flush_cache() and sched.allocator.available_size() == sched.allocator.size
