"""Which model class runs an architecture: its native plugin, or the transformers fallback.

`model.impl` (config) decides: `auto` takes the native plugin registered under the HF
`architectures` name and otherwise the fallback (the model component named `FALLBACK_MODEL`, from
radixserve-models-transformers); `native` refuses the fallback; `transformers` always takes it.
Cheap to import (no torch): the CLI's `plugins` listing uses it too."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from radixserve.plugins.registry import ComponentSpec, PluginError, Registry

FALLBACK_MODEL = "transformers"  # registry name of the fallback model component
FALLBACK_DISTRIBUTION = "radixserve-models-transformers"
FALLBACK_CLAIM = "any AutoModelForCausalLM"
MODEL_IMPLS = ("auto", "native", "transformers")


@dataclass(frozen=True)
class ModelChoice:
    """The model class picked for an architecture and why (`describe()` is the start-up log line)."""

    architecture: str
    cls: Any
    spec: ComponentSpec
    fallback: bool  # True: the transformers fallback
    impl: str  # the model.impl it was chosen under

    @property
    def path(self) -> str:
        return "fallback" if self.fallback else "native"

    def describe(self) -> str:
        who = f"{self.spec.distribution} {self.spec.version}".strip()
        if self.fallback:
            why = "forced by model.impl=transformers" if self.impl == "transformers" else "no native plugin claims it"
            return f"architecture {self.architecture}: transformers fallback ({who}; {why})"
        return f"architecture {self.architecture}: native plugin {self.spec.plugin!r} ({who})"


def native_architectures(registry: Registry) -> list[str]:
    """Architectures claimed by a native model plugin (every model component but the fallback)."""
    return [s.name for s in registry.components("model") if s.name != FALLBACK_MODEL]


def fallback_spec(registry: Registry) -> ComponentSpec | None:
    return next((s for s in registry.components("model") if s.name == FALLBACK_MODEL), None)


def plan_model(registry: Registry, architecture: str, impl: str = "auto") -> tuple[ComponentSpec, bool]:
    """(the model component that runs `architecture` under `impl`, whether it is the transformers fallback),
    with nothing imported: the checks `select_model` makes, cheap enough for a process that never loads a
    model (the Engine's and the HTTP server's, before any child starts).

    Raises PluginError (a user-facing one-liner) when nothing can run it: `impl=native` with no
    native plugin, or no native plugin and the fallback not installed."""
    if impl not in MODEL_IMPLS:
        raise PluginError(f"model.impl={impl!r} is not one of {', '.join(MODEL_IMPLS)}")
    natives = native_architectures(registry)
    if impl != "transformers" and architecture in natives:
        return registry.get("model", architecture), False
    if impl == "native":
        raise PluginError(
            f"no native model plugin claims architecture {architecture!r} (native: {', '.join(natives) or 'none'}); "
            f"set model.impl: transformers (or auto) to run it through the transformers fallback "
            f"({FALLBACK_DISTRIBUTION})"
        )
    spec = fallback_spec(registry)
    if spec is None:
        reason = "model.impl: transformers needs" if impl == "transformers" else (
            f"no native model plugin claims architecture {architecture!r} "
            f"(native: {', '.join(natives) or 'none'}), and running it needs")
        skipped = _skipped_fallback(registry)
        if skipped is not None:
            raise PluginError(f"{reason} the transformers fallback, which is installed but not loaded: {skipped}")
        raise PluginError(
            f"{reason} the transformers fallback, which is not installed: pip install {FALLBACK_DISTRIBUTION} "
            "(it serves any AutoModelForCausalLM; model.impl: auto picks it when no native plugin claims the "
            "architecture)"
        )
    return spec, True


def select_model(registry: Registry, architecture: str, impl: str = "auto") -> ModelChoice:
    """Pick and load the model class for `architecture` under `impl` (one of MODEL_IMPLS); raises as
    `plan_model` does."""
    spec, fallback = plan_model(registry, architecture, impl)
    cls = registry.load("model", spec.name)
    return ModelChoice(architecture, cls, spec, fallback, impl)


def _skipped_fallback(registry: Registry) -> str | None:
    """How to enable the fallback when it is installed but its plugin was not loaded (deny- or
    allow-listed), or None."""
    for plugin, (dist, why) in sorted(registry.skipped.items()):
        if dist != FALLBACK_DISTRIBUTION:
            continue
        if why.startswith("not in"):  # an allow-list that leaves it out
            return f"plugin {plugin!r} of {dist} is {why}; add {plugin!r} to it to enable the fallback"
        where = ("the config's plugins.disable or a -p no:" + plugin + " flag" if why == "plugins.disable"
                 else f"the {why} environment variable")
        return f"plugin {plugin!r} of {dist} is disabled by {where}; remove {plugin!r} from it to enable the fallback"
    return None
