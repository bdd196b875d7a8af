"""Reference greedy decoding with transformers, and the comparison rules used by parity tests."""

from __future__ import annotations

import torch


@torch.inference_mode()
def hf_greedy(model, prompt: list[int], max_new_tokens: int) -> tuple[list[int], list[torch.Tensor]]:
    """Greedy tokens and fp32 logits per step, one prompt at a time (no padding), EOS ignored."""
    out = model(input_ids=torch.tensor([prompt], device=model.device), use_cache=True)
    tokens, logits = [], []
    for _ in range(max_new_tokens):
        row = out.logits[0, -1].float()
        tok = int(row.argmax())
        tokens.append(tok)
        logits.append(row)
        if len(tokens) == max_new_tokens:
            break
        out = model(input_ids=torch.tensor([[tok]], device=model.device), past_key_values=out.past_key_values, use_cache=True)
    return tokens, logits


def first_divergence(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b, strict=True)):
        if x != y:
            return i
    return None


def top5_rule_holds(ours: list[int], our_logits, ref: list[int], ref_logits) -> bool:
    """vLLM's rule: at the first divergence each side's token is in the other's top-5."""
    i = first_divergence(ours, ref)
    if i is None:
        return True
    return ours[i] in ref_logits[i].topk(5).indices.tolist() and ref[i] in our_logits[i].topk(5).indices.tolist()


def top5_rule_holds_ids(ours: list[int], our_logits, ref: list[int], ref_top5: list[list[int]]) -> bool:
    """The same rule given the reference's top-5 token ids per step instead of its logits."""
    i = first_divergence(ours, ref)
    if i is None:
        return True
    return ours[i] in ref_top5[i] and ref[i] in our_logits[i].topk(5).indices.tolist()
