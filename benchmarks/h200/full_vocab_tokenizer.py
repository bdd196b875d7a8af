"""A synthetic tokenizer with exactly as many tokens as a model's vocabulary, so benchmarks on
random-weight models decode every sampled id (a real tokenizer of another model would leave ids
past its own vocabulary without text).

    python benchmarks/h200/full_vocab_tokenizer.py --vocab-size 102400 --out /tmp/tok102k
"""

from __future__ import annotations

import argparse
import itertools
import string
from pathlib import Path


def make_tokenizer(out: Path, vocab_size: int) -> None:
    """A byte-level BPE tokenizer with exactly `vocab_size` tokens (no merges: it encodes text
    byte by byte, which is all the benchmark needs; every id decodes)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    byte_chars = sorted(alphabet)
    vocab: dict[str, int] = {"<|eos|>": 0}
    for ch in byte_chars:
        vocab.setdefault(ch, len(vocab))
    pieces = [c for c in string.ascii_letters + string.digits + "{}[]\":,._-"] + ["Ġ"]  # Ġ: a space
    for n in (2, 3, 4):
        for combo in itertools.product(pieces, repeat=n):
            if len(vocab) >= vocab_size:
                break
            vocab.setdefault("".join(combo), len(vocab))
    assert len(vocab) == vocab_size, len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|eos|>")
    fast.save_pretrained(out)
    print(f"wrote a {len(vocab)}-token byte-level tokenizer to {out}")


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--vocab-size", type=int, required=True)
    ap.add_argument("--out", type=Path, required=True)
    a = ap.parse_args()
    make_tokenizer(a.out, a.vocab_size)
