"""A weight-only int8 quantization plugin written from the docs alone (audit 29): pre-quantized MoE
checkpoints that name their expert tensors as the method names its parameters, float tensors refused
for integer parameters, the plugin's own exceptions at start-up said in one line naming it (the
traceback kept), the conformance kits' messages, and the refusals, `config show` and the start-up
log naming the registered component."""

from __future__ import annotations

import json
import logging
import re
import shutil

import pytest
import torch
from family_cases import MOE_CASES
from plugin_fixtures import make_fake_distribution, run_cli
from radixserve.config import Config
from radixserve.layers.moe import FusedMoE
from radixserve.plugins.registry import PluginCodeError, PluginError, Registry
from runner_driver import greedy_generate
from safetensors.torch import load_file, save_file

INT8_PLUGIN = """
import os

import torch
import torch.nn as nn
import torch.nn.functional as F
from radixserve.interfaces import QuantMethod
from radixserve.layers.weight_utils import set_weight_attrs
from radixserve.plugins import hookimpl
from radixserve_models_llama.model import LlamaForCausalLM

PLUGIN_API = ">=1,<2"


def bug():  # read at each call: in-process tests set it per test
    return os.environ.get("RS_INT8T_BUG", "")


def scale_name():
    return os.environ.get("RS_INT8T_SCALE", "weight_scale")


def quantize_rows(w):
    w = w.float()
    scale = w.abs().amax(-1).clamp(min=1e-8) / 127.0
    return torch.round(w / scale[..., None]).clamp(-127, 127).to(torch.int8), scale


class Int8Method(QuantMethod):
    supports_tensor_parallel = True  # the checkpoint mode; the online instance says False

    def __init__(self, online=False):
        self.online = online
        if online:
            self.supports_tensor_parallel = False

    @classmethod
    def from_config(cls, qc):
        if qc is not None and qc.get("bits", 8) != 8:
            raise ValueError(f"bits={qc['bits']} is not supported (only 8)")
        return cls(online=qc is None)

    def create_weights(self, layer, input_size, output_sizes, dtype):
        if bug() == "create":
            raise RuntimeError("deliberate failure in create_weights")
        if bug() == "refuse" and input_size > 64:
            raise ValueError(f"int8t takes at most 64 input features, not {input_size}")
        out = sum(output_sizes) + (bug() == "shape")
        weight = nn.Parameter(torch.empty(out, input_size, dtype=dtype if self.online else torch.int8),
                              requires_grad=False)
        dims = {"output_dim": 0} if bug() == "no_input_dim" else {"output_dim": 0, "input_dim": 1}
        set_weight_attrs(weight, {"weight_loader": layer.weight_loader, **dims})
        layer.register_parameter("weight", weight)
        if not self.online:
            scale = nn.Parameter(torch.empty(out, dtype=torch.float32), requires_grad=False)
            set_weight_attrs(scale, {"output_dim": 0, "weight_loader": layer.weight_loader})
            layer.register_parameter("weight_scale", scale)

    def process_weights_after_loading(self, layer):
        if bug() == "process":
            raise RuntimeError("deliberate failure in process_weights_after_loading")
        if self.online and layer.weight.dtype != torch.int8:  # online: quantized from the float checkpoint
            q, s = quantize_rows(layer.weight.data)
            layer.weight = nn.Parameter(q, requires_grad=False)
            layer.weight_scale = nn.Parameter(s, requires_grad=False)

    def apply(self, layer, x, bias):
        if bug() == "apply":
            raise RuntimeError("deliberate failure in apply")
        return F.linear(x, (layer.weight.float() * layer.weight_scale[:, None]).to(x.dtype), bias)

    def create_moe_weights(self, layer, num_experts, hidden_size, intermediate_size, dtype):
        shapes = {"w13": (num_experts, 2 * intermediate_size, hidden_size), "w2": (num_experts, hidden_size,
                                                                                  intermediate_size)}
        for prefix, shape in shapes.items():
            fused = {"moe_fused_dim": 1} if prefix == "w13" else {}
            w = nn.Parameter(torch.empty(*shape, dtype=torch.int8), requires_grad=False)
            s = nn.Parameter(torch.empty(*shape[:2], dtype=torch.float32), requires_grad=False)
            for p in (w, s):
                set_weight_attrs(p, {"weight_loader": layer.weight_loader, **fused})
            layer.register_parameter(f"{prefix}_weight", w)
            layer.register_parameter(f"{prefix}_{scale_name()}", s)

    def apply_moe(self, layer, x, topk_weights, topk_ids):
        from radixserve.layers.moe.reference import fused_experts_reference

        if bug() == "apply":
            raise RuntimeError("deliberate failure in apply_moe")
        w13 = layer.w13_weight.float() * getattr(layer, f"w13_{scale_name()}")[..., None]
        w2 = layer.w2_weight.float() * getattr(layer, f"w2_{scale_name()}")[..., None]
        return fused_experts_reference(x, w13.to(x.dtype), w2.to(x.dtype), topk_weights, topk_ids)


class NoApply(QuantMethod):
    def create_weights(self, layer, input_size, output_sizes, dtype):
        pass


class NoMoE(Int8Method):
    create_moe_weights = QuantMethod.create_moe_weights


class CrashingLlama(LlamaForCausalLM):
    def forward(self, *args, **kwargs):
        raise RuntimeError("deliberate crash in the model's forward")


@hookimpl
def radixserve_register(registry):
    registry.register("quantization", "int8t", "rs_int8t:Int8Method", devices=("cpu",))
    registry.register("quantization", "int8t-abstract", "rs_int8t:NoApply", devices=("cpu",))
    registry.register("quantization", "int8t-nomoe", "rs_int8t:NoMoE", devices=("cpu",))
    registry.register("model", "CrashingForCausalLM", "rs_int8t:CrashingLlama")
"""
LABEL = "quantization method 'int8t' (radixserve-quant-int8t)"


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    path = tmp_path_factory.mktemp("int8t-site")
    make_fake_distribution(path, "radixserve-quant-int8t", "int8t", "rs_int8t", INT8_PLUGIN)
    return path


@pytest.fixture
def on_path(site, monkeypatch):
    monkeypatch.syspath_prepend(str(site))
    monkeypatch.delenv("RS_INT8T_BUG", raising=False)
    monkeypatch.delenv("RS_INT8T_SCALE", raising=False)
    return site


@pytest.fixture(scope="module")
def tiny_moe(tmp_path_factory):
    from radixserve.testing import tiny_checkpoint

    model_type, overrides = MOE_CASES["Qwen2MoeForCausalLM"]
    return tiny_checkpoint(model_type, str(tmp_path_factory.mktemp("qwen2-moe")), **overrides)


def _quantized(src: str, dst, scale: str = "weight_scale", float_weights: bool = False, **config) -> tuple[str, str]:
    """(a copy of `src` with its decoder projections and experts stored as int8 + per-row scales (the experts'
    named `scale`), declaring
    quant_method int8t; the same model with those weights dequantized, as a float checkpoint)."""
    ref = f"{dst}-ref"
    for path in (dst, ref):
        shutil.copytree(src, path)
    weights = load_file(f"{src}/model.safetensors")
    quant, deq = {}, {}
    for name, w in weights.items():
        if name.startswith("model.layers.") and name.endswith("_proj.weight"):
            scales = w.float().abs().amax(-1).clamp(min=1e-8) / 127.0
            q = torch.round(w.float() / scales[:, None]).clamp(-127, 127).to(torch.int8)
            deq[name] = q.float() * scales[:, None]
            quant[name] = deq[name] if float_weights else q
            quant[name[: -len("weight")] + (scale if ".experts." in name else "weight_scale")] = scales
        else:
            quant[name] = deq[name] = w
    save_file(quant, f"{dst}/model.safetensors", metadata={"format": "pt"})
    save_file(deq, f"{ref}/model.safetensors", metadata={"format": "pt"})
    cfg = json.load(open(f"{dst}/config.json"))
    cfg["quantization_config"] = {"quant_method": "int8t", "bits": 8, **config}
    json.dump(cfg, open(f"{dst}/config.json", "w"))
    return str(dst), ref


def _config(path: str, **stack) -> Config:
    return Config.build({"model": {"path": path}, "stack": stack, "runtime": {"device": "cpu", "num_threads": 1},
                         "scheduler": {"max_total_tokens": 256}})


def _runner(path: str, **stack):
    from radixserve.model_runner import ModelRunner

    config = _config(path, **stack)
    return ModelRunner(config, Registry.from_config(config), show_progress=False)


# ---- 1. MoE checkpoints: any per-expert suffix the method registers loads -----------------------------------


def test_map_checkpoint_name_maps_any_per_expert_suffix():
    m = FusedMoE.map_checkpoint_name
    base = "model.layers.1.mlp.experts"
    assert m(f"{base}.0.down_proj.weight_scale") == (f"{base}.w2_weight_scale", 0, "down")
    assert m(f"{base}.3.gate_proj.qweight") == (f"{base}.w13_qweight", 3, "gate")
    assert m(f"{base}.2.up_proj.scales") == (f"{base}.w13_scales", 2, "up")
    assert m(f"{base}.1.up_proj.weight_scale_inv") == (f"{base}.w13_weight_scale_inv", 1, "up")  # as before
    assert m(f"{base}.1.up_proj.weight") == (f"{base}.w13_weight", 1, "up")
    assert m(f"{base}.0.gate_proj.weight.absmax") is None  # not one identifier: no parameter name


@pytest.mark.parametrize("scale", ["weight_scale", "scales"])
def test_a_prequantized_moe_checkpoint_loads_the_methods_own_expert_names(on_path, tiny_moe, tmp_path, monkeypatch,
                                                                          scale):
    """Was: "checkpoint tensor '...experts.0.down_proj.weight_scale' has no matching parameter" (only `weight` and
    fp8's `weight_scale_inv` were mapped), while the MoE kit passed the same layout."""
    from radixserve.testing import check_quant_method_moe

    monkeypatch.setenv("RS_INT8T_SCALE", scale)
    path, ref = _quantized(tiny_moe, tmp_path / "q", scale=scale)
    runner = _runner(path)
    experts = runner.model.model.layers[1].mlp.experts
    want = load_file(f"{path}/model.safetensors")["model.layers.1.mlp.experts.2.down_proj." + scale]
    assert torch.equal(getattr(experts, f"w2_{scale}")[2], want)
    prompts = [[5, 9, 2, 7, 11], [3, 1, 4, 1, 5, 9, 2]]
    got = [g.tokens for g in greedy_generate(runner, prompts, 6)]
    assert got == [g.tokens for g in greedy_generate(_runner(ref), prompts, 6)]
    # the kit loads as the loader does, so it passes the same layout
    from rs_int8t import Int8Method, quantize_rows

    def quantize(w):
        q, s = quantize_rows(w)
        return {"weight": q, scale: s}, q.float() * s[:, None]

    check_quant_method_moe(lambda: Int8Method.from_config({"quant_method": "int8t"}), quantize)


def test_an_expert_tensor_the_layer_has_no_parameter_for_names_the_layers_parameters(tiny_moe):
    from radixserve.layers.weight_utils import UnknownCheckpointTensorError, load_stacked_weights
    from transformers import AutoConfig

    model = Registry.discover().load("model", "Qwen2MoeForCausalLM")(AutoConfig.from_pretrained(tiny_moe))
    name = "model.layers.1.mlp.experts.0.down_proj.weight_scale"
    with pytest.raises(UnknownCheckpointTensorError, match=re.escape(name) + ".*'w2_weight_scale'.*expert parameters "
                       r"are w13_weight, w2_weight"):
        load_stacked_weights(model, [(name, torch.ones(64))], expert_names=("gate_proj", "up_proj", "down_proj"))


def test_the_moe_kit_refuses_what_no_checkpoint_could_name(on_path, monkeypatch):
    from radixserve.testing import check_quant_method_moe
    from rs_int8t import Int8Method, quantize_rows

    def quantize(w):
        q, s = quantize_rows(w)
        return {"weight": q, "weight_scale.x": s}, q.float() * s[:, None]

    with pytest.raises(AssertionError, match=r"'weight_scale\.x'.*maps to no expert parameter"):
        check_quant_method_moe(lambda: Int8Method.from_config({"quant_method": "int8t"}), quantize)


# ---- 2. a float tensor is never cast into an integer parameter ----------------------------------------------


def test_a_float_tensor_for_an_integer_parameter_is_refused_naming_both_dtypes(on_path, tiny_llama_dir, tmp_path):
    """Was: the fp32 (dequantized) weights were truncated into the int8 parameter: garbage text, exit 0."""
    path, _ = _quantized(tiny_llama_dir("llama"), tmp_path / "floatw", float_weights=True)
    with pytest.raises(ValueError) as e:
        _runner(path)
    text = str(e.value)
    for piece in (f"checkpoint {path!r} (file model.safetensors)", "is torch.float32", "is torch.int8",
                  "'model.layers.0.mlp.down_proj.weight'"):
        assert piece in text, (piece, text)


def test_integers_into_floats_and_floats_of_another_width_still_load():
    from radixserve.layers.weight_utils import CheckpointDtypeError, load_into

    for param_dtype, tensor in ((torch.float32, torch.arange(6, dtype=torch.int32)),
                                (torch.bfloat16, torch.randn(6)), (torch.float32, torch.randn(6).half())):
        param = torch.nn.Parameter(torch.zeros(6, dtype=param_dtype), requires_grad=False)
        load_into(param, tensor)
        assert torch.equal(param, tensor.to(param_dtype))
    for param_dtype in (torch.int8, torch.int32, torch.uint8):
        with pytest.raises(CheckpointDtypeError, match=f"is torch.float16, but .* is {param_dtype}"):
            load_into(torch.nn.Parameter(torch.zeros(6, dtype=param_dtype), requires_grad=False), torch.ones(6).half())


# ---- 3+4. the plugin's own exceptions at start-up: one line naming it, the traceback kept -------------------


@pytest.mark.parametrize("bug,where", [
    ("create", r"create_weights for a QKVParallelLinear \(input_size 64, output_sizes \[64, 32, 32\]\) of decoder "
               r"layer 0 while the model was built"),
    ("process", r"process_weights_after_loading for layer model\.layers\.0\.self_attn\.qkv_proj \(QKVParallelLinear\)"),
    ("apply", r"apply for layer model\.layers\.0\.self_attn\.qkv_proj \(QKVParallelLinear\) during the warm-up"),
])
def test_an_exception_in_a_methods_hook_is_one_line_naming_it_and_the_layer(on_path, tiny_llama_dir, monkeypatch,
                                                                            bug, where):
    """Was: the plugin's raw exception (a traceback in `generate`, one repr line with no traceback in `serve`)."""
    monkeypatch.setenv("RS_INT8T_BUG", bug)
    with pytest.raises(PluginCodeError) as e:
        _runner(tiny_llama_dir("llama"), quantization="int8t").warmup()
    assert re.fullmatch(re.escape(f"{LABEL} failed in ") + where + f": RuntimeError: deliberate failure in {bug}.*",
                        str(e.value)), str(e.value)
    assert isinstance(e.value.__cause__, RuntimeError)  # the plugin's traceback


def test_a_value_error_from_a_hook_is_the_methods_refusal_named_as_such(on_path, tiny_llama_dir, monkeypatch):
    """A hook refusing a value with ValueError (as from_config does) is a mistake to fix, not a crash: one line,
    still a ValueError, no "failed"."""
    from radixserve.plugins.registry import PluginRefusal

    monkeypatch.setenv("RS_INT8T_BUG", "refuse")
    with pytest.raises(PluginRefusal) as e:
        _runner(tiny_llama_dir("llama"), quantization="int8t")
    assert isinstance(e.value, ValueError) and str(e.value) == (
        f"{LABEL} refused a RowParallelLinear (input_size 128, output_sizes [64]) of decoder layer 0 in create_weights "
        "while the model was built: int8t takes at most 64 input features, not 128")


def test_an_abstract_method_class_is_refused_by_name(on_path, tiny_llama_dir):
    with pytest.raises(PluginError, match=r"quantization method 'int8t-abstract' \(radixserve-quant-int8t\) cannot be "
                                          r"used: rs_int8t\.NoApply is abstract: it does not implement apply"):
        _runner(tiny_llama_dir("llama"), quantization="int8t-abstract")


def test_generate_says_it_in_one_line_and_shows_the_traceback_with_debug(on_path, tiny_llama_dir, monkeypatch, capsys):
    from radixserve.cli import main

    monkeypatch.setenv("RS_INT8T_BUG", "create")
    args = ["generate", "--model", tiny_llama_dir("llama"), "--no-chat", "--max-tokens", "1", "hi",
            "stack.quantization=int8t", "runtime.num_threads=1"]
    capsys.readouterr()
    assert main(args) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"radixserve: error: {LABEL} failed in create_weights") and len(err.splitlines()) == 1, err
    monkeypatch.setenv("RADIXSERVE_DEBUG", "1")
    with pytest.raises(PluginCodeError) as e:
        main(args)
    assert "deliberate failure in create_weights" in str(e.value.__cause__)


def test_serve_logs_the_plugins_traceback_once_and_the_error_in_one_line(site, tiny_llama_dir):
    from server_process import with_tiny_tokenizer

    model = with_tiny_tokenizer(tiny_llama_dir("llama"))
    r = run_cli(["serve", "--model", model, "--port", "0", "stack.quantization=int8t", "runtime.num_threads=1"],
                site=site, env={"RS_INT8T_BUG": "apply"})
    out = r.stdout + r.stderr
    errors = [line for line in out.splitlines() if line.startswith("radixserve: error:")]
    assert r.returncode == 2 and len(errors) == 1, out[-4000:]
    assert errors[0].startswith(f"radixserve: error: {LABEL} failed in apply for layer model.layers.0.self_attn"), errors
    assert re.search(r"scheduler ERROR .*start-up failed", out), out[-4000:]  # the plugin's author gets the traceback
    assert "rs_int8t.py" in out and 'raise RuntimeError("deliberate failure in apply")' in out, out[-4000:]


def test_serve_logs_the_traceback_of_a_crash_at_start_up(site, tiny_llama_dir, tmp_path):
    """Was: `the scheduler process failed: RuntimeError('...')` and no traceback, even at --log-level debug (the
    scheduler printed it after telling the parent, which then stopped it)."""
    from radixserve.testing import tiny_checkpoint
    from server_process import with_tiny_tokenizer

    model = with_tiny_tokenizer(tiny_checkpoint("llama", str(tmp_path / "crash"), architectures=["CrashingForCausalLM"]))
    r = run_cli(["serve", "--model", model, "--port", "0", "runtime.num_threads=1"], site=site)
    out = r.stdout + r.stderr
    assert r.returncode == 1, out[-4000:]
    assert out.count("Traceback") == 1 and "deliberate crash in the model's forward" in out, out[-4000:]
    assert "the scheduler process failed: RuntimeError" in out, out[-4000:]


# ---- 6. refusals name the registered component ------------------------------------------------------------


def test_the_moe_refusal_names_the_component(on_path, tiny_moe):
    with pytest.raises(PluginError, match=r"^quantization method 'int8t-nomoe' \(radixserve-quant-int8t\) does not "
                                          r"support MoE expert weights \(layer 'model\.layers\.1\.mlp\.experts', 4 "
                                          r"experts\)"):
        _runner(tiny_moe, quantization="int8t-nomoe")


def test_the_tensor_parallel_refusal_names_the_component_and_the_mode(on_path, tiny_llama_dir):
    from radixserve.model_runner import check_model_tensor_parallel
    from rs_int8t import Int8Method
    from transformers import AutoConfig

    hf_config = AutoConfig.from_pretrained(tiny_llama_dir("llama"))
    model_cls = Registry.discover().load("model", "LlamaForCausalLM")
    with pytest.raises(PluginError, match=r"runtime.tp_size=2: quantization method 'int8t' \(radixserve-quant-int8t\) "
                                          r"does not support tensor parallelism in this mode \(the instance built by "
                                          r"from_config\(None\) \(online quantization\) sets supports_tensor_parallel "
                                          r"False, though its class Int8Method sets True\)"):
        check_model_tensor_parallel("LlamaForCausalLM", model_cls, Int8Method.from_config(None), hf_config, 2,
                                    quant_label=LABEL, quant_built_by="from_config(None) (online quantization)")
    check_model_tensor_parallel("LlamaForCausalLM", model_cls, Int8Method.from_config({}), hf_config, 2,
                                quant_label=LABEL)


# ---- 8. config show refuses what start-up refuses ----------------------------------------------------------


def test_config_show_refuses_what_start_up_refuses(on_path, tiny_llama_dir, tmp_path, capsys):
    from radixserve.cli import main

    bits4, _ = _quantized(tiny_llama_dir("llama"), tmp_path / "bits4", bits=4)
    model = tiny_llama_dir("llama")
    cases = [(["config", "show", "stack.quantization=int8t"],  # no --model: the default model is the embedded GGUF
              "stack.quantization='int8t' cannot apply to .*SmolLM2.*gguf.*weight source 'gguf'"),
             (["config", "show", "--model", bits4], re.escape(f"{LABEL}: bits=4 is not supported (only 8)")),
             (["config", "show", "--model", model, "stack.quantization=int8t-abstract"],
              r"quantization method 'int8t-abstract' .*cannot be used: rs_int8t\.NoApply is abstract"),
             # quantization audit 33: the online mode's instance sets supports_tensor_parallel False (class True)
             (["config", "show", "--model", model, "stack.quantization=int8t", "runtime.tp_size=2"],
              r"runtime.tp_size=2: quantization method 'int8t' \(radixserve-quant-int8t\) does not support tensor "
              r"parallelism in this mode \(the instance built by from_config\(None\)")]
    capsys.readouterr()
    for args, message in cases:
        assert main(args) == 2, args
        err = capsys.readouterr().err
        assert re.match("radixserve: error: " + message, err) and len(err.splitlines()) == 1, (args, err)
    assert main(["config", "show", "--model", model, "stack.quantization=int8t"]) == 0  # online: from_config(None)


# ---- 9. the start-up log names a checkpoint-declared method -----------------------------------------------


def test_the_stack_log_line_names_the_checkpoints_method(on_path, tiny_llama_dir, tmp_path, caplog):
    path, _ = _quantized(tiny_llama_dir("llama"), tmp_path / "q")
    with caplog.at_level(logging.INFO, logger="radixserve.model_runner"):
        _runner(path)
    line = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("stack:"))
    assert "policy fcfs, quantization int8t (checkpoint), grammar" in line, line


# ---- 5. the kits: the method's exceptions in context, its class named, the right hint -----------------------


def _kit(moe: bool = False, **kw):
    from radixserve.testing import check_quant_method, check_quant_method_moe
    from rs_int8t import Int8Method, quantize_rows

    def quantize(w):
        q, s = quantize_rows(w)
        return {"weight": q, "weight_scale": s}, q.float() * s[:, None]

    kit = check_quant_method_moe if moe else check_quant_method
    kit(lambda: Int8Method.from_config({"quant_method": "int8t"}), kw.pop("quantize", quantize), **kw)


@pytest.mark.parametrize("bug,message", [
    ("create", r"^Int8Method: ColumnParallelLinear tp rank 0 of 1: building the layer \(create_weights\) raised "
               r"RuntimeError: deliberate failure in create_weights$"),
    ("process", r"^Int8Method: ColumnParallelLinear tp rank 0 of 1: process_weights_after_loading raised RuntimeError"),
    ("apply", r"^Int8Method: ColumnParallelLinear tp rank 0 of 1: apply on \(5, 64\) input raised RuntimeError"),
])
def test_the_quant_kit_puts_the_methods_exceptions_in_context(on_path, monkeypatch, bug, message):
    monkeypatch.setenv("RS_INT8T_BUG", bug)
    with pytest.raises(AssertionError, match=message) as e:
        _kit()
    assert isinstance(e.value.__cause__, RuntimeError)


def test_the_moe_kit_puts_the_methods_exceptions_in_context(on_path, monkeypatch):
    monkeypatch.setenv("RS_INT8T_BUG", "apply")
    with pytest.raises(AssertionError, match=r"^Int8Method: FusedMoE: apply_moe on 1 token\(s\), top-2 of 4 raised "
                                             r"RuntimeError: deliberate failure in apply_moe"):
        _kit(moe=True)


def test_the_quant_kit_hints_at_the_split_only_where_there_is_one(on_path, monkeypatch):
    monkeypatch.setenv("RS_INT8T_BUG", "shape")  # create_weights registers one row too many
    with pytest.raises(AssertionError, match=r"tp rank 0 of 1: loading 'weight' .*shape \(49, 64\).*check the shape "
                                             "create_weights gives it") as e:
        _kit()
    assert "output_dim" not in str(e.value)
    monkeypatch.setenv("RS_INT8T_BUG", "no_input_dim")
    with pytest.raises(AssertionError, match=r"RowParallelLinear tp rank 0 of 2: .*needs `output_dim` .*`input_dim`"):
        _kit()


def test_the_quant_kit_names_a_float_tensor_for_an_integer_parameter(on_path):
    def float_weight(w):
        from rs_int8t import quantize_rows

        q, s = quantize_rows(w)
        return {"weight": q.float() * s[:, None], "weight_scale": s}, q.float() * s[:, None]

    with pytest.raises(AssertionError, match=r"^Int8Method: ColumnParallelLinear tp rank 0 of 1: checkpoint tensor "
                                             r"'weight' is torch.float32, but .* is torch.int8"):
        _kit(quantize=float_weight)
