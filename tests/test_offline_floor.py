"""benchmarks/offline_floor.py states issue 18's offline limit from the FLOPs and bytes of the run; its
FLOP count must be what a model forward really does. Checked against torch's FLOP counter on a tiny
transformers Llama: the projections exactly, the attention as the causal half of eager attention's
full L x L products."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

CFG = {"hidden_size": 64, "intermediate_size": 160, "num_attention_heads": 4, "num_key_value_heads": 2,
       "num_hidden_layers": 2, "vocab_size": 512}


def _floor_module():
    spec = importlib.util.spec_from_file_location(
        "offline_floor", Path(__file__).resolve().parents[1] / "benchmarks" / "offline_floor.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _counted(model, ids) -> dict[str, int]:
    from torch.utils.flop_counter import FlopCounterMode

    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        model(ids)
    return {str(op).split(".")[1]: n for op, n in counter.get_flop_counts()["Global"].items()}


@pytest.mark.parametrize("length", [16, 33])
def test_flops_match_a_counted_forward(length):
    from transformers import LlamaConfig, LlamaForCausalLM

    floor = _floor_module()
    model = LlamaForCausalLM(LlamaConfig(**CFG, attn_implementation="eager")).eval()
    ids = torch.randint(0, CFG["vocab_size"], (1, length))
    counted = _counted(model.model, ids)  # the decoder without the LM head: a prefill's rows
    linear = counted.get("mm", 0) + counted.get("addmm", 0)
    attention_full = counted["bmm"]  # eager attention: QK^T and PV over the whole L x L square
    w = floor.workload(CFG, prompts=1, input_len=length, output_len=1, kv_bytes=2)
    assert w["prefill_flops"] == pytest.approx(linear + attention_full * (length + 1) / (2 * length), rel=1e-9)
    # a decode row: the same projections for one token, plus the LM head
    with_head = _counted(model, ids[:, :1])
    decode = floor.workload(CFG, prompts=1, input_len=length, output_len=1, kv_bytes=2)["decode_gemm_flops"]
    assert decode == with_head.get("mm", 0) + with_head.get("addmm", 0)


def test_kv_bytes_count_every_layer_head_and_position():
    floor = _floor_module()
    w = floor.workload(CFG, prompts=3, input_len=10, output_len=5, kv_bytes=2)
    head_dim = CFG["hidden_size"] // CFG["num_attention_heads"]
    per_token = CFG["num_hidden_layers"] * 2 * CFG["num_key_value_heads"] * head_dim * 2
    contexts = sum(10 + i for i in range(5))  # each generated token reads the KV before it
    assert w["decode_kv_bytes"] == pytest.approx(3 * contexts * per_token)
