"""Conformance kit for model plugins: greedy parity with transformers on a (tiny, random) HF
checkpoint of the architecture.

The model is built and loaded as the runtime does (`radixserve.model_loader.load_model`: the
default dtype set, `load_weights`, every parameter must be loaded), then driven through its
contract only (`forward(input_ids, positions, batch)`, `compute_logits`, `greedy_token_ids`) with
the kit's exact reference attention: prompts prefilled in chunks inside mixed batches, one request
starting from another's cached prefix, then decode. Each request's greedy tokens must equal
transformers' (one prompt at a time, no padding), or at the first difference each side's token
must be in the other's top 5 (vLLM's rule); the first step's logits must agree closely."""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from radixserve.interfaces.attention import AttentionRunnerInfo
from radixserve.interfaces.model import attention_dims_of
from radixserve.layers.attention import check_kv_layout
from radixserve.layers.logits import select_logit_rows
from radixserve.memory import KVPool, LatentKVPool, ReqToTokenPool, TokenAllocator
from radixserve.state import ForwardBatch, ForwardMode
from radixserve.testing._threads import single_threaded

TINY_CONFIG = dict(
    hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
    head_dim=16, vocab_size=512, max_position_embeddings=512, rms_norm_eps=1e-6,
    initializer_range=0.1,  # peaked logits: fewer near-ties for greedy comparisons
)
# model types whose transformers defaults make no working model at TINY_CONFIG's sizes: DeepSeek's keep
# full-size latent widths, a null experts-per-token (V2) and fewer KV heads than heads (MLA expands the
# latent to every head; transformers' eager attention repeats KV heads by heads / num_key_value_heads)
_LATENT = dict(kv_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16, head_dim=8,
               num_key_value_heads=4, first_k_dense_replace=1, n_routed_experts=8, num_experts_per_tok=2,
               moe_intermediate_size=32, n_shared_experts=1, n_group=1, topk_group=1)
TINY_BY_TYPE = {
    "deepseek_v2": dict(_LATENT, q_lora_rank=None),  # V2-Lite's shape: no query compression
    "deepseek_v3": dict(_LATENT, q_lora_rank=24),
}


def tiny_checkpoint(model_type: str, path: str, seed: int = 0, **overrides) -> str:
    """Save a tiny random transformers checkpoint of `model_type` (e.g. "llama", "qwen3") to `path`;
    norms and biases are randomised too, so their loading is checked. Returns `path`.

    `overrides` are config fields; `architectures=["MyForCausalLM"]` makes the checkpoint claim a
    plugin's own architecture name (transformers' `save_pretrained` writes the class it saved, so
    the name is put back into `config.json` after saving)."""
    import json
    import os

    from transformers import AutoConfig, AutoModelForCausalLM

    # only the fields the architecture's config has: GPT-NeoX has no num_key_value_heads, and one written
    # anyway sized the KV pool for heads its attention does not have (audit 34)
    defaults = AutoConfig.for_model(model_type)
    tiny = {k: v for k, v in {**TINY_CONFIG, **TINY_BY_TYPE.get(model_type, {})}.items() if hasattr(defaults, k)}
    cfg = AutoConfig.for_model(model_type, **{**tiny, **overrides})
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=gen))
            elif name.endswith(".bias"):
                p.copy_(0.1 * torch.randn(p.shape, generator=gen))
    model.save_pretrained(path)
    architectures = overrides.get("architectures")
    if architectures is not None:
        config_file = os.path.join(path, "config.json")
        with open(config_file) as f:
            saved = json.load(f)
        saved["architectures"] = list(architectures)
        with open(config_file, "w") as f:
            json.dump(saved, f, indent=2)
    return path


@torch.inference_mode()
def _hf_greedy(model, prompt: list[int], n: int) -> tuple[list[int], list[torch.Tensor]]:
    out = model(input_ids=torch.tensor([prompt]), use_cache=True)
    tokens, logits = [], []
    while True:
        row = out.logits[0, -1].float()
        tokens.append(int(row.argmax()))
        logits.append(row)
        if len(tokens) == n:
            return tokens, logits
        out = model(input_ids=torch.tensor([[tokens[-1]]]), past_key_values=out.past_key_values, use_cache=True)


@dataclass
class _Seq:
    prompt: list[int]
    slots: list[int] = field(default_factory=list)
    row: int = 0
    tokens: list[int] = field(default_factory=list)
    logits: list[torch.Tensor] = field(default_factory=list)

    def ids(self) -> list[int]:
        return self.prompt + self.tokens


class _Driver:
    def __init__(self, model, hf_config, attention) -> None:
        c = hf_config
        self.model = model
        self.vocab = c.vocab_size
        latent = None
        if getattr(model, "attention_type", "standard") == "latent":  # one latent row per token (as the runner)
            latent = model.latent_attention_dims()
            layers, heads, kv_heads, head_dim = latent.num_layers, latent.num_heads, 1, latent.latent_width
        else:
            dims = model.attention_dims()  # the model's own KV-cache shape, else the config's (as the runner)
            layers, heads, kv_heads, head_dim = dims if dims is not None else attention_dims_of(c)
            check_kv_layout(model, layers, kv_heads, head_dim, type(model).__name__)
        self.alloc = TokenAllocator(1024)
        self.table = ReqToTokenPool(8, 256)
        if latent is not None:
            self.kv = LatentKVPool(1024, layers, latent.kv_lora_rank, latent.qk_rope_head_dim, torch.float32)
        else:
            self.kv = KVPool(1024, layers, kv_heads, head_dim, torch.float32)
        self.backend = attention(AttentionRunnerInfo(
            device=torch.device("cpu"), dtype=torch.float32, num_layers=layers, num_heads=heads,
            num_kv_heads=kv_heads, head_dim=head_dim, req_to_token_pool=self.table, kv_pool=self.kv, max_bs=8,
            context_len=256, latent=latent,
        ))

    def admit(self, seq: _Seq, cached_from: _Seq | None = None, cached: int = 0) -> None:
        seq.row = self.table.alloc()
        seq.slots = list(cached_from.slots[:cached]) if cached_from else []
        if seq.slots:
            self.table.write(seq.row, 0, torch.tensor(seq.slots))

    @torch.inference_mode()
    def step(self, picks: list[tuple[_Seq, list[int]]]) -> None:
        """One forward; each picked sequence adds the given tokens and, if its prompt is then
        complete, gets its next greedy token."""
        prefix = [len(s.slots) for s, _ in picks]
        ext = [len(t) for _, t in picks]
        new = self.alloc.alloc(sum(ext))
        start = 0
        for (s, _), n in zip(picks, ext, strict=True):
            self.table.write(s.row, len(s.slots), new[start : start + n])
            s.slots += new[start : start + n].tolist()
            start += n
        seq_lens = [p + e for p, e in zip(prefix, ext, strict=True)]
        mode = ForwardMode.DECODE if all(e == 1 for e in ext) and all(len(s.slots) > len(s.prompt) for s, _ in picks) \
            else ForwardMode.EXTEND
        t = lambda xs: torch.tensor(xs, dtype=torch.int64)  # noqa: E731
        batch = ForwardBatch(
            mode=mode, batch_size=len(picks), input_ids=t([x for _, toks in picks for x in toks]),
            positions=torch.cat([torch.arange(p, s) for p, s in zip(prefix, seq_lens, strict=True)]),
            req_pool_indices=t([s.row for s, _ in picks]), seq_lens=t(seq_lens), prefix_lens=t(prefix),
            extend_lens=t(ext), out_cache_loc=new, req_to_token_pool=self.table, kv_pool=self.kv,
            attn_backend=self.backend, seq_lens_cpu=seq_lens, prefix_lens_cpu=prefix, extend_lens_cpu=ext,
        )
        self.backend.init_forward_metadata(batch)
        hidden = self.model(batch.input_ids, batch.positions, batch)
        assert hidden.shape[0] == sum(ext), f"forward returned {hidden.shape[0]} rows for {sum(ext)} tokens"
        rows = select_logit_rows(hidden, batch)
        logits = self.model.compute_logits(rows)
        assert logits.dtype == torch.float32 and logits.shape[0] == len(picks), (
            f"compute_logits must return fp32 [rows, vocab], got {logits.dtype} {tuple(logits.shape)}")
        logits = logits[:, : self.vocab]
        fast = self.model.greedy_token_ids(rows, self.vocab)
        if fast is not None:
            assert fast.tolist() == logits.argmax(-1).tolist(), (
                f"greedy_token_ids gave {fast.tolist()}, the argmax of compute_logits is {logits.argmax(-1).tolist()}")
        for i, (s, _) in enumerate(picks):
            if len(s.slots) >= len(s.prompt):
                s.tokens.append(int(logits[i].argmax()))
                s.logits.append(logits[i].clone())


def _compare(name: str, ours: _Seq, ref: tuple[list[int], list[torch.Tensor]], atol: float) -> None:
    ref_tokens, ref_logits = ref
    err = (ours.logits[0] - ref_logits[0]).abs().max().item()
    assert err <= atol, f"{name}: first-step logits differ from transformers by {err:.2e} (> {atol:.0e})"
    for i, (a, b) in enumerate(zip(ours.tokens, ref_tokens, strict=True)):
        if a != b:
            ok = a in ref_logits[i].topk(5).indices.tolist() and b in ours.logits[i].topk(5).indices.tolist()
            assert ok, (f"{name}: greedy token {i} is {a}, transformers gives {b}, and they are not in each other's "
                        f"top 5 (ours {ours.tokens}, transformers {ref_tokens})")
            return


@single_threaded
def check_model_parity(
    model_cls: type,
    checkpoint: str,
    *,
    prompt_lens: Sequence[int] = (5, 13, 2),
    new_tokens: int = 8,
    chunk: int = 4,
    seed: int = 0,
    logits_atol: float = 1e-3,
    attention=None,
    quant_method=None,
    reference: str | None = None,
    weight_source=None,
) -> None:
    """Run a Model class on an HF safetensors checkpoint against transformers; raise
    AssertionError naming the prompt and step of the first difference.

    :param model_cls: your `Model` subclass (built as the loader builds it:
        `model_cls(hf_config, quant_method)`).
    :param checkpoint: a directory transformers can load (config.json + safetensors), for
        example one written by `tiny_checkpoint("llama", tmp_path)`.
    :param prompt_lens: random prompts of these lengths; one more prompt starts with the first
        prompt's tokens and reuses their KV (a prefix-cache hit).
    :param new_tokens: greedy tokens per prompt.
    :param chunk: prefill chunk size (prompts are prefilled in chunks, in mixed batches).
    :param logits_atol: largest absolute difference of the first step's logits.
    :param attention: the attention backend to run with (default: the kit's exact reference,
        `ReferenceLatentAttentionBackend` for a model with `attention_type = "latent"`, which then
        runs on a `LatentKVPool` sized from its `latent_attention_dims()`).
    :param quant_method: a QuantMethod instance for a quantized `checkpoint` (default unquantized).
    :param reference: the checkpoint transformers runs (default `checkpoint`); for a quantized
        checkpoint, the same model with its weights dequantized to float; for a checkpoint whose
        `model_type` has no transformers model class (a plugin's own model_type, its config
        registered with `AutoConfig.register`), the same weights under a model_type transformers
        can run. transformers runs its eager attention (its SDPA path ignores attention
        soft-capping).
    :param weight_source: a `WeightSource` instance that reads `checkpoint` (a file in its format),
        as the core runs one: its `hf_config`, its `iter_weights`, and itself as the layers'
        QuantMethod (unless `quant_method` is given); `reference` is then required
        (`check_weight_source` wraps this).
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    from radixserve.model_loader.loader import load_model
    from radixserve.model_loader.sources import ModelSource
    from radixserve.testing.attention import ReferenceAttentionBackend

    if weight_source is not None:
        if reference is None:
            raise ValueError("check_model_parity(weight_source=...) needs reference=, an HF directory of the same model")
        hf_config = weight_source.hf_config(checkpoint)
        source = ModelSource(path=checkpoint, format=type(weight_source).__name__, weight_source=weight_source)
        quant_method = quant_method if quant_method is not None else weight_source
    else:
        hf_config = AutoConfig.from_pretrained(checkpoint, trust_remote_code=False)
        source = ModelSource(path=checkpoint, format="safetensors")
    model = load_model(source, hf_config, model_cls, torch.device("cpu"), torch.float32, quant_method=quant_method,
                       show_progress=False)
    # eager: transformers' SDPA path silently drops options such as Gemma 2's attention soft-capping
    hf = AutoModelForCausalLM.from_pretrained(reference or checkpoint, dtype=torch.float32,
                                              attn_implementation="eager", trust_remote_code=False).eval()
    rng = random.Random(seed)
    vocab = hf_config.vocab_size
    seqs = [_Seq([rng.randrange(vocab) for _ in range(n)]) for n in prompt_lens]
    first = seqs[0].prompt
    sharer = _Seq(first + [rng.randrange(vocab) for _ in range(3)])
    if attention is None:
        from radixserve.testing.latent_attention import ReferenceLatentAttentionBackend

        latent = getattr(model, "attention_type", "standard") == "latent"
        attention = ReferenceLatentAttentionBackend if latent else ReferenceAttentionBackend
    driver = _Driver(model, hf_config, attention)
    for s in seqs:
        driver.admit(s)
    sharer_in = False
    while any(len(s.tokens) < new_tokens for s in seqs + [sharer]):
        if not sharer_in and len(seqs[0].slots) >= len(first):  # the first prompt's KV is now cached
            driver.admit(sharer, cached_from=seqs[0], cached=len(first))
            seqs.append(sharer)
            sharer_in = True
        picks = []
        for s in seqs:
            if len(s.tokens) >= new_tokens:
                continue
            done = len(s.slots)
            todo = s.prompt[done : done + chunk] if done < len(s.prompt) else [s.tokens[-1]]
            picks.append((s, todo))
        driver.step(picks)
    for i, s in enumerate(seqs):
        name = f"{model_cls.__name__} on {checkpoint}, prompt {i} (length {len(s.prompt)})"
        _compare(name, s, _hf_greedy(hf, s.prompt, new_tokens), logits_atol)
