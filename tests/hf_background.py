"""transformers' greedy reference for chat prompts of a GGUF model, computed in a child process so
that it runs beside the test's own work: on a 2-core machine, on the core the test leaves free.

    python tests/hf_background.py GGUF_PATH QUESTIONS_JSON NEW_TOKENS OUT_JSON
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path


class BackgroundReference:
    """Starts the child at construction; `result()` waits for it. Per question: the chat prompt's
    ids, transformers' greedy tokens and each step's top-5 token ids."""

    def __init__(self, gguf_path: str, questions: list[str], new_tokens: int, workdir: Path) -> None:
        self._out = workdir / "hf_reference.json"
        questions_file = workdir / "questions.json"
        questions_file.write_text(json.dumps(questions))
        self._log = open(workdir / "hf_reference.log", "w")
        cmd = [sys.executable, __file__, gguf_path, str(questions_file), str(new_tokens), str(self._out)]
        self._proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT)

    def result(self, timeout: float = 900) -> list[dict]:
        code = self._proc.wait(timeout)
        self._log.close()
        if code != 0:
            raise RuntimeError(f"the transformers reference failed ({code}):\n{Path(self._log.name).read_text()[-3000:]}")
        return json.loads(self._out.read_text())

    def close(self) -> None:
        if self._proc.poll() is None:
            self._proc.kill()
            self._proc.wait()
        self._log.close()


def _memoize_gguf_parsing() -> None:
    """Speed only, same weights: transformers parses the file twice (config, then tensors) and
    rebuilds gguf's tensor-name table once per submodule (~400 times); both are pure functions of
    their arguments, so keep the first result (half of the load time)."""
    import functools

    import gguf

    gguf.get_tensor_name_map = functools.cache(gguf.get_tensor_name_map)
    open_reader = gguf.GGUFReader
    gguf.GGUFReader = functools.cache(lambda path, mode="r": open_reader(path, mode))


def _main(gguf_path: str, questions_json: str, new_tokens: str, out_json: str) -> None:
    import torch
    from hf_reference import hf_greedy_batch
    from radixserve.tokenizer import apply_chat_template, load_tokenizer
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(1)  # the test process uses the other core
    _memoize_gguf_parsing()
    # the prompts as the test renders them (its tokenizer test compares them with transformers')
    tok = load_tokenizer(gguf_path)
    d, f = os.path.split(gguf_path)
    model = AutoModelForCausalLM.from_pretrained(d, gguf_file=f, dtype=torch.float32).eval()
    prompts = [apply_chat_template(tok, [{"role": "user", "content": q}]) for q in json.loads(Path(questions_json).read_text())]
    # all prompts in one left-padded batch: a fifth of the time of one at a time, same greedy tokens
    # (logits within 1e-4 of the unpadded ones on these prompts)
    results = [
        {"prompt": prompt, "tokens": tokens, "top5": [row.topk(5).indices.tolist() for row in logits]}
        for prompt, (tokens, logits) in zip(prompts, hf_greedy_batch(model, prompts, int(new_tokens)), strict=True)
    ]
    Path(out_json).write_text(json.dumps(results))


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    _main(*sys.argv[1:])
