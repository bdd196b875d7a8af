"""Build the drafter a config selects (`stack.speculative` + the `speculative` section)."""

from __future__ import annotations

import logging
from typing import Any

import torch

from radixserve.config import Config
from radixserve.interfaces.drafter import Drafter, DrafterInfo
from radixserve.plugins.registry import build_component

logger = logging.getLogger(__name__)


def drafter_info(config: Config, runner: Any) -> DrafterInfo:
    spec = config.speculative
    return DrafterInfo(
        device=torch.device(getattr(runner, "device", "cpu")),
        vocab_size=int(runner.vocab_size),
        num_draft_tokens=spec.num_draft_tokens,
        topk=spec.topk,
        num_steps=spec.num_steps or spec.num_draft_tokens,
        supports_tree=bool(getattr(runner, "supports_tree_mask", False)),
        model_path=getattr(runner, "model_path", None),
        draft_model_path=spec.draft_model_path,
        eos_token_ids=frozenset(getattr(runner, "eos_token_ids", ()) or ()),
        hf_config=getattr(runner, "hf_config", None),
        target_states=getattr(runner, "target_states", None),
        # a drafter running its own layers may route its one-row matmuls as the target's (EAGLE)
        extra={"batch1_gemv": config.runtime.batch1_gemv},
    )


def build_drafter(config: Config, runner: Any, registry: Any) -> Drafter | None:
    """The configured drafter, or None when `stack.speculative` is not set. A constructor that
    refuses its options or its info (ValueError, a TypeError over the options) becomes a PluginError naming it;
    any other exception a PluginCodeError naming the drafter and its distribution (registry.build_component)."""
    name = config.stack.speculative
    if name is None:
        default = type(config.speculative)()  # what the section is when nobody set it (serve passes its defaults)
        given = sorted(k for k in type(config.speculative).model_fields
                       if getattr(config.speculative, k) != getattr(default, k))
        if given:  # drafter audit 32: the settings were accepted and nothing said they do nothing
            logger.warning("speculative settings given (%s) but stack.speculative names no drafter: speculative "
                           "decoding is off (set stack.speculative, or serve --speculative NAME)",
                           ", ".join(f"speculative.{key}" for key in given))
        return None
    cls = registry.load("drafter", name)
    # a refusal (ValueError, a TypeError over the options) stays the user's PluginError; its own bug (a KeyError
    # in __init__) is a PluginCodeError naming the drafter and its distribution (audit 37: it was "the scheduler
    # process failed: KeyError('x')")
    return build_component(registry.get("drafter", name), cls, drafter_info(config, runner),
                           refused=f"stack.speculative={name!r}: the drafter refused its configuration",
                           **config.speculative.options)
