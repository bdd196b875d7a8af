"""The weight-source kit (`radixserve.testing.check_weight_source`): a minimal file format of our own
(an .npz of the tensors plus the config as JSON) passes it, and each broken variant of that reader
fails naming what is wrong."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from radixserve.interfaces.quantization import WeightSource
from radixserve.layers.quant_unquantized import UnquantizedMethod
from radixserve.testing import check_weight_source, tiny_checkpoint
from safetensors.torch import load_file


class NpzSource(UnquantizedMethod, WeightSource):
    """fp32 tensors in an .npz, the HF config in its `__config__` entry (JSON text)."""

    def hf_config(self, path):
        from transformers import AutoConfig

        with np.load(path) as f:
            d = json.loads(str(f["__config__"]))
        return AutoConfig.for_model(d.pop("model_type"), **d)

    def num_tensors(self, path):
        with np.load(path) as f:
            return len(f.files) - 1

    def iter_weights(self, path, hf_config):
        with np.load(path) as f:
            for name in f.files:
                if name != "__config__":
                    yield name, torch.from_numpy(f[name].copy())


class DropsOne(NpzSource):  # consistent with itself: the loader finds the parameter it never fills
    def num_tensors(self, path):
        return super().num_tensors(path) - 1

    def iter_weights(self, path, hf_config):
        yield from list(super().iter_weights(path, hf_config))[1:]


class CountsWrong(NpzSource):
    def num_tensors(self, path):
        return super().num_tensors(path) + 1


class Repeats(NpzSource):
    def iter_weights(self, path, hf_config):
        pairs = list(super().iter_weights(path, hf_config))
        yield from pairs + pairs[:1]


class Perturbs(NpzSource):
    def iter_weights(self, path, hf_config):
        for name, t in super().iter_weights(path, hf_config):
            yield name, (t * 1.5 if name.endswith("layers.0.mlp.down_proj.weight") else t)


class NotAQuantMethod(WeightSource):
    hf_config = NpzSource.hf_config
    iter_weights = NpzSource.iter_weights


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    ref = tmp_path_factory.mktemp("ref")
    tiny_checkpoint("llama", str(ref), tie_word_embeddings=False)
    config = json.loads((ref / "config.json").read_text())
    tensors = {k: v.numpy() for k, v in load_file(str(ref / "model.safetensors")).items()}
    path = ref.parent / "tiny.npzw"
    with open(path, "wb") as f:
        np.savez(f, __config__=json.dumps(config), **tensors)
    return str(path), str(ref)


def test_a_faithful_reader_passes(checkpoint):
    path, ref = checkpoint
    check_weight_source(NpzSource, path, reference=ref)


@pytest.mark.parametrize("broken,words", [
    (DropsOne, "left 1 parameter(s) unloaded"),
    (CountsWrong, "num_tensors"),
    (Repeats, "more than once"),
    (Perturbs, "prompt 0"),
    (NotAQuantMethod, "subclass both"),
])
def test_a_broken_reader_fails_naming_the_rule(checkpoint, broken, words):
    path, ref = checkpoint
    with pytest.raises((AssertionError, ValueError)) as e:
        check_weight_source(broken, path, reference=ref)
    assert words in str(e.value), str(e.value)


class CorruptFile(NpzSource):
    def hf_config(self, path):
        import zipfile

        raise zipfile.BadZipFile("File is not a zip file")


class NoConfigEntry(NpzSource):
    def hf_config(self, path):
        raise ValueError("the file has no __config__ entry")


class BreaksMidway(NpzSource):
    def iter_weights(self, path, hf_config):
        yield next(iter(super().iter_weights(path, hf_config)))
        raise RuntimeError("truncated archive")


@pytest.mark.parametrize("source, error, words", [
    (CorruptFile, "PluginCodeError", r"^weight source 'npzw' \(test-dist 0\.1\) failed reading '.*tiny\.npzw' "
                                     r"\(hf_config\): BadZipFile: File is not a zip file$"),
    (NoConfigEntry, "ValueError", r"^'.*tiny\.npzw': the file has no __config__ entry$"),
    (BreaksMidway, "PluginCodeError", r"failed reading '.*tiny\.npzw' \(iter_weights\): RuntimeError: truncated"),
])
def test_a_weight_sources_failure_is_one_line_naming_the_source_and_file(checkpoint, source, error, words):
    """Weight-source audit 34: a corrupt file's exception (not a ValueError) was a traceback naming neither the
    plugin nor the file, and a ValueError while reading the config did not name the file."""
    from radixserve.model_loader.sources import ModelSource

    path, _ = checkpoint
    src = ModelSource(path=path, format="npzw", weight_source=source(), source_label="weight source 'npzw' (test-dist 0.1)")
    with pytest.raises(Exception, match=words) as e:
        list(src.iter_weights(NpzSource().hf_config(path))) if source is BreaksMidway else src.hf_config()
    assert type(e.value).__name__ == error


class TakesAScale(NpzSource):
    def __init__(self, scale: float = 1.0) -> None:
        super().__init__()
        if not isinstance(scale, int | float):
            raise TypeError(f"scale must be a number, not {type(scale).__name__}")
        if scale <= 0:
            raise ValueError(f"scale must be positive, got {scale}")
        self.scale = scale


@pytest.mark.parametrize("options, error, words", [
    ({"bogus": 1}, "ValueError", r"^model\.weight_source_options: 'bogus' not accepted by the weight source "
                                 r"'TakesAScale' \(valid: scale\)$"),
    ({"scale": -1}, "ValueError", r"^model\.weight_source_options for the weight source 'TakesAScale': scale must be "
                                  r"positive, got -1$"),
    ({"scale": "big"}, "PluginCodeError", r"^weight source 'TakesAScale' failed to build from "
                                          r"model\.weight_source_options \{'scale': 'big'\}: TypeError: scale must be"),
])
def test_the_kit_refuses_an_option_as_the_core_does(checkpoint, options, error, words):
    """Weight-source audit 34: an option the source's __init__ refused was a bare TypeError traceback in the kit (the
    core named an unknown one, but a value the constructor refused was a traceback there too)."""
    path, ref = checkpoint
    with pytest.raises(Exception, match=words) as e:
        check_weight_source(TakesAScale, path, reference=ref, options=options)
    assert type(e.value).__name__ == error
