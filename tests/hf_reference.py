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


@torch.inference_mode()
def hf_greedy_batch(model, prompts: list[list[int]], max_new_tokens: int, pad_id: int = 0) -> list[tuple[list[int], list[torch.Tensor]]]:
    """`hf_greedy` for several prompts decoded together (left-padded, masked, positions from the
    mask): one forward per step for all of them instead of one per prompt and step."""
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in prompts], device=model.device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=model.device)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    out = model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True)
    results: list[tuple[list[int], list[torch.Tensor]]] = [([], []) for _ in prompts]
    for step in range(max_new_tokens):
        rows = out.logits[:, -1].float()
        toks = rows.argmax(-1)
        for r, (tokens, logits) in enumerate(results):
            tokens.append(int(toks[r]))
            logits.append(rows[r])
        if step + 1 == max_new_tokens:
            break
        mask = torch.cat([mask, mask.new_ones(len(prompts), 1)], dim=-1)
        positions = positions[:, -1:] + 1
        out = model(input_ids=toks[:, None], attention_mask=mask, position_ids=positions,
                    past_key_values=out.past_key_values, use_cache=True)
    return results


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
