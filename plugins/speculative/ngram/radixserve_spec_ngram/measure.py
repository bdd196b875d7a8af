"""Host-side cost of the n-gram drafter: `python -m radixserve_spec_ngram.measure [--prompt-len N]`.

Feeds copy-heavy requests (the answer quotes the prompt) and prints the one-off cost of feeding a
prompt (per token) and the per-step cost of propose() + on_accepted() per request, i.e. what a
decode step waits on the drafter."""

from __future__ import annotations

import argparse
import random
import time

from radixserve.state import Req, SamplingParams
from radixserve.testing import drafter_info

from radixserve_spec_ngram.drafter import NgramDrafter


def measure(prompt_len: int, batch: int, k: int, topk: int, steps: int, seed: int = 0) -> dict[str, float]:
    rng = random.Random(seed)
    vocab = 50_000
    drafter = NgramDrafter(drafter_info(vocab_size=vocab, num_draft_tokens=k, topk=topk))
    reqs = []
    for i in range(batch):
        prompt = [rng.randrange(vocab) for _ in range(prompt_len)]
        req = Req(f"m{i}", prompt, SamplingParams(temperature=0.0))
        req.output_ids = prompt[prompt_len // 3 : prompt_len // 3 + 4]
        reqs.append(req)
    start = time.perf_counter()
    for req in reqs:
        drafter.on_accepted(req, req.output_ids)
    feed = (time.perf_counter() - start) / (batch * prompt_len)
    start = time.perf_counter()
    accepted = 0
    for _ in range(steps):
        proposal = drafter.propose(reqs, k)
        for req, draft in zip(reqs, proposal.tokens):
            new = draft[: rng.randint(0, len(draft))] + [rng.randrange(vocab)]  # some accepted, then a miss
            accepted += len(new) - 1
            req.output_ids.extend(new)
            drafter.on_accepted(req, new)
    step = (time.perf_counter() - start) / (steps * batch)
    return {"feed_us_per_prompt_token": feed * 1e6, "step_us_per_request": step * 1e6,
            "accepted_per_step": accepted / (steps * batch)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompt-len", type=int, default=2000)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--num-draft-tokens", type=int, default=8)
    ap.add_argument("--topk", type=int, default=1)
    ap.add_argument("--steps", type=int, default=50)
    args = ap.parse_args()
    result = measure(args.prompt_len, args.batch, args.num_draft_tokens, args.topk, args.steps)
    for key, value in result.items():
        print(f"{key}: {value:.1f}")


if __name__ == "__main__":
    main()
