"""Start-up work the runtime avoids: the detokenizer process decodes with the serving tokenizer
(the `tokenizers` library: no transformers/torch import next to the scheduler loading the model),
exactly as transformers does."""

from __future__ import annotations

import random
import subprocess
import sys
import textwrap

from radixserve.model_loader.model_files import load_tokenizer
from radixserve.serving_tokenizer import ServingTokenizer, load_serving_tokenizer


def test_the_detokenizer_decodes_like_transformers(smollm2_gguf_path):
    hf = load_tokenizer(smollm2_gguf_path)
    decoder = load_serving_tokenizer(smollm2_gguf_path)
    assert isinstance(decoder, ServingTokenizer)
    rng = random.Random(0)
    special = list(hf.all_special_ids)
    for _ in range(2000):
        ids = [rng.randrange(len(hf)) for _ in range(rng.randint(1, 12))]
        ids.insert(rng.randrange(len(ids) + 1), rng.choice(special))
        for skip in (True, False):
            want = hf.decode(ids, skip_special_tokens=skip, clean_up_tokenization_spaces=False)
            assert decoder.decode(ids, skip_special_tokens=skip, clean_up_tokenization_spaces=False) == want, ids


def test_the_detokenizer_process_entry_imports_neither_transformers_nor_torch(smollm2_gguf_path):
    directory = load_serving_tokenizer(smollm2_gguf_path).directory
    code = textwrap.dedent(
        f"""
        import sys
        from radixserve.runtime import child, detokenizer
        from radixserve.serving_tokenizer import ServingTokenizer
        detokenizer.DetokenizerManager(ServingTokenizer({directory!r}))
        print(sorted(m for m in ("torch", "transformers") if m in sys.modules))
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"
