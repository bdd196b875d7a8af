"""The batch-1 Triton GEMV (radixserve.layers.triton_gemv) against torch's F.linear, in Triton's CPU
interpreter without a GPU (small shapes), on CUDA with one."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from triton_interpret import use_interpreter_without_gpu

ON_GPU, _restore_interpret = use_interpreter_without_gpu()
_restore_triton_interpret = pytest.fixture(autouse=True, scope="module")(_restore_interpret)

from radixserve.layers.triton_gemv import GemvConfig, gemv  # noqa: E402

DEVICE = "cuda" if ON_GPU else "cpu"


@pytest.mark.parametrize("n, k", [(24, 64), (37, 100), (8, 32)], ids=["even", "ragged", "one-block"])
@pytest.mark.parametrize("with_bias", [False, True])
def test_gemv_matches_linear(n, k, with_bias):
    """Ragged N and K (masked tails), bias, a weight that is a row slice of a bigger matrix (row
    stride != K), a 1-D x: equal to F.linear up to fp32 summation order."""
    gen = torch.Generator().manual_seed(n + k)
    big = torch.randn(n + 5, k + 3, generator=gen).to(DEVICE)
    w = big[2 : 2 + n, :k]  # unit stride on K, row stride k + 3
    x = torch.randn(1, k, generator=gen).to(DEVICE)
    b = torch.randn(n, generator=gen).to(DEVICE) if with_bias else None
    want = F.linear(x, w, b)
    got = gemv(x, w, b)
    assert got.shape == (1, n)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(gemv(x[0], w, b), want[0], rtol=1e-5, atol=1e-5)
    # another tile shape (several programs, several K steps) gives the same answer
    tile = GemvConfig(4, 16, 1, 1)
    torch.testing.assert_close(gemv(x, w, b, tile), want, rtol=1e-5, atol=1e-5)
    if k % 16 and with_bias:  # the PDL body (first weight tile loaded ahead of x, masked; the interpreter runs it
        # without the griddepcontrol wait) sums in the same order: bit-equal
        assert torch.equal(gemv(x, w, b, GemvConfig(4, 16, 1, 1, pdl=True)), gemv(x, w, b, tile))


def test_lm_head_runs_one_row_on_its_gemv_config():
    """The LM head with a tile (attach_batch1_gemv): a one-row hidden state's logits come from the
    GEMV (equal to F.linear up to summation order, fp32 out); several rows keep the usual path."""
    from radixserve.layers.embedding import ParallelLMHead

    head = ParallelLMHead(40, 32, params_dtype=torch.float32).to(DEVICE)
    torch.nn.init.normal_(head.weight)
    head.gemv_config = GemvConfig(8, 16, 1, 1)
    h = torch.randn(3, 32, device=DEVICE)
    got = head.compute_logits(h[:1])
    assert got.dtype == torch.float32 and got.shape == (1, 40)
    torch.testing.assert_close(got, F.linear(h[:1], head.weight), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(head.compute_logits(h), F.linear(h, head.weight), rtol=1e-5, atol=1e-5)


def test_gemv_refuses_what_it_cannot_compute():
    w = torch.zeros(8, 16, device=DEVICE)
    with pytest.raises(ValueError, match="one row"):
        gemv(torch.zeros(2, 16, device=DEVICE), w)
    with pytest.raises(ValueError, match="unit stride"):
        gemv(torch.zeros(1, 8, device=DEVICE), w.t())
    with pytest.raises(ValueError, match="bias shape"):
        gemv(torch.zeros(1, 16, device=DEVICE), w, torch.zeros(4, device=DEVICE))


def _plain_layer(method, n: int, k: int, dtype=torch.float32, device=DEVICE) -> torch.nn.Module:
    layer = torch.nn.Module()
    method.create_weights(layer, k, [n], dtype)
    layer.to(device)
    if device != "meta":
        torch.nn.init.normal_(layer.weight)
        method.process_weights_after_loading(layer)
    layer.quant_method = method
    return layer


def test_plain_linear_layers_route_one_row_by_their_gemv_config(monkeypatch):
    """`UnquantizedMethod.apply` sends a one-row activation to the GEMV with the tile attached to the
    layer (same result as F.linear, bias included); several rows, or a layer without a tile, keep
    the usual path."""
    from radixserve.layers import quant_unquantized, triton_gemv

    calls = []
    real = triton_gemv.gemv
    monkeypatch.setattr(triton_gemv, "gemv", lambda *a: calls.append((tuple(a[1].shape), a[3])) or real(*a))
    method = quant_unquantized.UnquantizedMethod()
    routed, plain = _plain_layer(method, 24, 64), _plain_layer(method, 40, 64)
    tile = GemvConfig(8, 32, 1, 1)
    routed.gemv_config, plain.gemv_config = tile, None
    x1, x2 = torch.randn(1, 64, device=DEVICE), torch.randn(2, 64, device=DEVICE)
    bias = torch.randn(24, device=DEVICE)
    torch.testing.assert_close(method.apply(routed, x1, bias), F.linear(x1, routed.weight, bias), rtol=1e-5, atol=1e-5)
    assert calls == [((24, 64), tile)]
    torch.testing.assert_close(method.apply(routed, x2, None), F.linear(x2, routed.weight), rtol=1e-5, atol=1e-5)
    method.apply(plain, x1, None)
    assert len(calls) == 1


def test_gemv_tiles_per_shape_measured_then_envelope():
    """Measured H200 shapes get their own best tile; unmeasured shapes the rule's (wide N: the tile
    that won on every wide shape; narrow N: the one that won on the narrow shape); smaller shapes stay
    on cuBLAS."""
    from radixserve.layers import gemv_selection as sel

    assert sel.gemv_config_for_shape(4096, 4096) == GemvConfig(16, 1024, 8, 2)
    assert sel.gemv_config_for_shape(6144, 4096) == GemvConfig(8, 512, 4, 3)
    assert sel.gemv_config_for_shape(4096, 14336) == GemvConfig(16, 1024, 8, 2)
    assert sel.gemv_config_for_shape(8192, 8192) == sel.SM90_UNMEASURED
    assert sel.gemv_config_for_shape(2048, 4096) == GemvConfig(2, 2048, 4, 1)  # Qwen3-30B-A3B o_proj
    assert sel.gemv_config_for_shape(5120, 3072) == sel.SM90_UNMEASURED
    assert sel.gemv_config_for_shape(3072, 8192) == sel.SM90_NARROW
    assert sel.gemv_config_for_shape(1024, 4096) is None  # e.g. Qwen3-0.6B / TP-sharded shapes
    assert sel.gemv_config_for_shape(4096, 1024) is None  # 2 K steps of 512
    assert sel.gemv_config_for_shape(2048, 2048) is None


@pytest.mark.parametrize("mode, capability, routed", [
    ("auto", (9, 0), True), ("auto", (8, 0), False), ("on", (8, 0), True), ("off", (9, 0), False)])
def test_attach_decides_per_layer_from_mode_and_device(monkeypatch, mode, capability, routed):
    """`runtime.batch1_gemv`: auto routes on measured GPUs (sm90) only, on everywhere on CUDA, off
    nowhere; per layer, only 2-D bf16/fp16 plain weights with unit stride on K, of an eligible shape
    (not a quant method's weight, nor an UnquantizedMethod subclass with its own `apply`).
    Weights on the meta device: the choice needs only shapes, dtypes and strides."""
    from radixserve.interfaces.quantization import QuantMethod
    from radixserve.layers import gemv_selection as sel
    from radixserve.layers.embedding import ParallelLMHead
    from radixserve.layers.quant_unquantized import UnquantizedMethod

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    method = UnquantizedMethod()
    model = torch.nn.ModuleDict({
        "o": _plain_layer(method, 4096, 4096, torch.bfloat16, "meta"),
        "big": _plain_layer(method, 8192, 8192, torch.float16, "meta"),
        "small": _plain_layer(method, 1024, 4096, torch.bfloat16, "meta"),
        "fp32": _plain_layer(method, 4096, 4096, torch.float32, "meta"),
        "quantized": torch.nn.Module(),
        "own_apply": _plain_layer(method, 4096, 4096, torch.bfloat16, "meta"),
    })
    model["own_apply"].quant_method = type("KeptBlocks", (UnquantizedMethod,), {"apply": lambda *a: None})()
    model["quantized"].quant_method = type("Int4Method", (QuantMethod,), {"create_weights": None, "apply": None})()
    model["quantized"].weight = torch.empty(4096, 4096, dtype=torch.bfloat16, device="meta")
    with torch.device("meta"):  # the Llama-3 LM head (a subclass with its own compute_logits is left alone)
        model["lm_head"] = ParallelLMHead(128256, 4096, params_dtype=torch.bfloat16)
        model["block_head"] = type("BlockHead", (ParallelLMHead,), {"compute_logits": lambda self, h: h})(
            128256, 4096, params_dtype=torch.bfloat16)
    n = sel.attach_batch1_gemv(model, mode, torch.device("cuda"))
    got = {name: getattr(layer, "gemv_config", "unset") for name, layer in model.items()}
    assert got["block_head"] is None
    if routed:
        assert n == 3 and got["o"] == GemvConfig(16, 1024, 8, 2) and got["big"] == sel.SM90_UNMEASURED
        assert got["lm_head"] == GemvConfig(16, 256, 4, 4)
    else:
        assert n == 0 and got["o"] is None and got["big"] is None and got["lm_head"] is None
    assert got["small"] is None and got["fp32"] is None
    assert got["quantized"] == "unset" and got["own_apply"] == "unset"  # other weight layouts: untouched


def test_attach_never_routes_on_cpu_and_names_a_bad_mode():
    from radixserve.layers import gemv_selection as sel
    from radixserve.layers.quant_unquantized import UnquantizedMethod

    model = torch.nn.ModuleDict({"o": _plain_layer(UnquantizedMethod(), 4096, 4096, torch.bfloat16, "meta")})
    assert sel.attach_batch1_gemv(model, "on", torch.device("cpu")) == 0
    assert model["o"].gemv_config is None
    with pytest.raises(ValueError, match="batch1_gemv='fast'"):
        sel.attach_batch1_gemv(model, "fast", torch.device("cuda"))


def test_config_key_defaults_to_auto_and_rejects_other_values():
    from radixserve.config import Config, ConfigError, parse_dotted_overrides

    assert Config.build({}).runtime.batch1_gemv == "auto"
    assert Config.build({"runtime": {"batch1_gemv": "off"}}).runtime.batch1_gemv == "off"
    with pytest.raises(ConfigError, match="batch1_gemv"):
        Config.build({"runtime": {"batch1_gemv": "fast"}})
    assert Config.build({}).runtime.batch1_gemv_pdl == "auto"
    with pytest.raises(ConfigError, match="batch1_gemv_pdl"):
        Config.build({"runtime": {"batch1_gemv_pdl": "yes"}})
    # on / off typed bare in a YAML file or a `section.key=value` override arrive as booleans
    for key in ("batch1_gemv", "batch1_gemv_pdl", "lowbit_gemv"):
        for word in ("on", "off"):
            rt = Config.build(parse_dotted_overrides([f"runtime.{key}={word}"])).runtime
            assert getattr(rt, key) == word


def test_runner_attaches_tiles_and_greedy_decode_is_unchanged(tiny_llama_dir, monkeypatch):
    """The model runner passes runtime.batch1_gemv down and attaches the tiles after loading: with
    every tiny-model projection routed (the shape rule, dtype and device checks widened to fp32 and
    the CPU interpreter), batch-1 decode runs through the GEMV and generates the same greedy tokens as
    the same runner with the tiles removed. With runtime.batch1_gemv_fuse_norm on, the decoder layers
    run both RMSNorms of each decode step inside the qkv / gate_up GEMV (layers/norm_gemv.py)."""
    from radixserve.config import Config
    from radixserve.layers import gemv_selection as sel
    from radixserve.layers import norm_gemv, triton_gemv
    from radixserve.model_runner import ModelRunner
    from radixserve.static_batch import run_static_batch

    monkeypatch.setattr(sel, "batch1_gemv_enabled", lambda mode, device: mode == "on")
    monkeypatch.setattr(sel, "gemv_config_for_shape", lambda n, k: GemvConfig(64, 64, 1, 1))  # few programs: interpreter time
    monkeypatch.setattr(sel, "_DTYPES", (torch.float32,))
    calls = []
    real = triton_gemv.gemv
    monkeypatch.setattr(triton_gemv, "gemv", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    fused, real_fused = [], norm_gemv.rmsnorm_gemv
    monkeypatch.setattr(norm_gemv, "rmsnorm_gemv", lambda *a: fused.append(1) or real_fused(*a))
    cfg = Config.build({"model": {"path": tiny_llama_dir("llama")}, "runtime": {"device": DEVICE, "dtype": "float32", "batch1_gemv": "on", "cuda_graph": False,
                                                                         "batch1_gemv_fuse_norm": True},
                        "stack": {"attention": "torch_native"}})
    runner = ModelRunner(cfg, show_progress=False)
    layers = [m for m in runner.model.modules() if getattr(m, "gemv_config", None) is not None]
    assert len(layers) >= 4 * runner.hf_config.num_hidden_layers  # qkv, o, gate_up, down per layer
    prompt = [[5, 17, 42, 9, 33, 21]]
    routed = run_static_batch(runner, prompt, max_new_tokens=4).output_ids
    assert calls  # the decode steps' projections ran on the GEMV
    n_layers = runner.hf_config.num_hidden_layers
    assert fused and len(fused) % (2 * n_layers) == 0  # both norms of every layer, decode steps only
    for layer in layers:
        layer.gemv_config = None
    n_calls, n_fused = len(calls), len(fused)
    assert run_static_batch(runner, prompt, max_new_tokens=4).output_ids == routed
    assert len(calls) == n_calls and len(fused) == n_fused


@pytest.mark.parametrize("k", [64, 40], ids=["even", "ragged"])
def test_gated_gemv_is_silu_and_mul_then_gemv(k):
    """gated=True: x = [gate | up] of 2K columns; the product equals the GEMV of the silu_and_mul
    kernel's output bit for bit (same rounding of the activation, same tile) and F.linear of
    silu(gate) * up up to summation order."""
    from radixserve.layers import triton_ops

    gen = torch.Generator().manual_seed(k)
    w = torch.randn(24, k, generator=gen).to(DEVICE)
    gate_up = torch.randn(1, 2 * k, generator=gen).to(DEVICE)
    b = torch.randn(24, generator=gen).to(DEVICE)
    tile = GemvConfig(8, 32, 1, 1)
    got = gemv(gate_up, w, b, tile, gated=True)
    assert torch.equal(got, gemv(triton_ops.silu_and_mul(gate_up), w, b, tile))
    assert torch.equal(got, gemv(gate_up, w, b, GemvConfig(8, 32, 1, 1, pdl=True), gated=True))
    gate, up = gate_up.chunk(2, dim=-1)
    torch.testing.assert_close(got, F.linear(F.silu(gate) * up, w, b), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="2K columns"):
        gemv(gate_up[:, :k], w, gated=True)


@pytest.mark.parametrize("mode, capability, has_pdl, want", [
    ("auto", (9, 0), True, True), ("auto", (9, 0), False, False), ("auto", (8, 0), True, False),
    ("auto", (10, 0), True, False), ("on", (10, 0), True, True), ("off", (9, 0), True, False),
    ("on", (8, 6), True, "sm86"), ("on", (9, 0), False, "no programmatic"), ("yes", (9, 0), True, "'yes'")])
def test_pdl_mode_resolves_per_gpu_and_triton(monkeypatch, mode, capability, has_pdl, want):
    """`runtime.batch1_gemv_pdl`: auto = on for sm90 (where measured) with a Triton that has PDL; on
    = any sm90+ GPU, and a clear start-up error (naming the GPU or the missing Triton feature) where
    it cannot run; off never; never on CPU; another value is named in the error. On a GPU the kernel
    launches get the PDL body, the griddepcontrol instructions and `launch_pdl`; the interpreter gets
    the body alone (no inline assembly there)."""
    from radixserve.layers import gemv_selection as sel
    from radixserve.layers.triton_gemv import pdl_launch_args
    from radixserve.layers.triton_support import trigger_dependents

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    monkeypatch.setattr(sel, "triton_has_pdl", lambda: has_pdl)
    if isinstance(want, str):
        with pytest.raises(ValueError, match=want):
            sel.batch1_gemv_pdl_enabled(mode, torch.device("cuda"))
        return
    assert sel.batch1_gemv_pdl_enabled(mode, torch.device("cuda")) is want
    assert sel.batch1_gemv_pdl_enabled(mode, torch.device("cpu")) is False
    assert pdl_launch_args(True, interpret=False) == {"PDL": True, "GDC": True, "launch_pdl": True}
    assert pdl_launch_args(True, interpret=True) == {"PDL": True, "GDC": False}
    assert pdl_launch_args(False, interpret=False) == {"PDL": False, "GDC": False}
    assert trigger_dependents(torch.zeros(2)) is False  # the early trigger of silu_and_mul etc.: GPUs only


@pytest.mark.parametrize("capability, pdl", [((9, 0), True), ((8, 0), False)])
def test_attach_pdl_tiles_only_on_sm90(monkeypatch, capability, pdl):
    """pdl=True (programmatic dependent launch, opt-in) marks the chosen tiles on sm90+ only (the
    griddepcontrol instructions do not exist before Hopper); the tile is otherwise the same."""
    from radixserve.layers import gemv_selection as sel
    from radixserve.layers.quant_unquantized import UnquantizedMethod

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    model = torch.nn.ModuleDict({"o": _plain_layer(UnquantizedMethod(), 4096, 4096, torch.bfloat16, "meta")})
    assert sel.attach_batch1_gemv(model, "on", torch.device("cuda"), pdl=True) == 1
    assert model["o"].gemv_config == GemvConfig(16, 1024, 8, 2, pdl=pdl)
