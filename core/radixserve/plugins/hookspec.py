"""Hook specifications: the contract between the core and plugin distributions.

A plugin distribution exposes one module through the entry-point group `radixserve.plugins`.
That module declares `PLUGIN_API = ">=1,<2"` (the core plugin-API versions it was built for) and
implements any of the hooks below, decorated with `radixserve.plugins.hookimpl`.

The decorator is optional on `radixserve_register` (discovery calls the module's function by name)
and required on the others, which pluggy calls: an undecorated `radixserve_add_routes` or
`radixserve_stats` is never called (discovery logs a warning naming it).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import pluggy

if TYPE_CHECKING:
    from radixserve.plugins.registry import ComponentRegistrar

PROJECT = "radixserve"
hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)


@hookspec
def radixserve_register(registry: ComponentRegistrar) -> None:
    """Declare this plugin's components.

    Call `registry.register(kind, name, "module:Class", devices=..., dtypes=..., priority=...)`
    once per component. `kind` is one of radixserve.interfaces.KINDS. The reference is imported
    only when the component is selected, so this hook must stay cheap: no torch, no triton.
    A quantization component that reads a checkpoint file format declares the weight-source role
    with `weight_file_suffixes=(".gguf",)` (its class must then subclass
    `radixserve.interfaces.quantization.WeightSource`): the core picks it for files with those
    suffixes, whatever its name.

    :param registry: a registrar bound to this plugin's distribution (for conflict messages).
    :return: nothing; the return value is ignored.
    Restrictions: must not import heavy modules or touch devices; must not register the same
    (kind, name) twice. Called once per process (every process discovers plugins itself).
    An exception it raises is a PluginError naming the plugin, its distribution and the exception,
    and stops every command (as a plugin that fails to import does) until the plugin is fixed,
    uninstalled or disabled (`-p no:NAME`, `plugins.disable`, RADIXSERVE_DISABLE_PLUGINS).
    `devices` is a tuple or list of device types among "cpu" and "cuda" (anything else is refused).
    Added in plugin API 1.0.
    """


@hookspec
def radixserve_add_routes(app: Any, context: Any) -> None:
    """Add HTTP routes to the server's FastAPI `app` (1:N: every plugin may add routes).

    :param app: the `fastapi.FastAPI` instance, before it starts serving.
    :param context: the server's `TokenizerManager`, to submit requests from a route.
    :return: nothing.
    Restrictions: must not replace the core routes (/v1/*, /generate, /health, /metrics).
    Added in plugin API 1.0.
    """


@hookspec
def radixserve_stats(stats: dict[str, Any]) -> None:
    """Receive the scheduler's periodic stats (running/waiting counts, token usage, hit rate).

    Called in the scheduler process (rank 0) after a step, at most every
    `radixserve.runtime.scheduler_process.STATS_HOOK_INTERVAL_S` seconds (5) while requests run,
    and once when the scheduler goes idle; never while it is idle. The keys are those of
    `Scheduler.stats()` (what `/metrics` and `get_stats` report: `running`, `waiting`,
    `token_usage`, `cache_hit_rate`, `generated_tokens`, `throughput`, ...). An exception is logged
    and serving goes on. (Earlier cores, also at plugin API 1.7, declared this hook but never called it.)

    :param stats: a fresh dict per call; read it, do not keep it.
    :return: nothing.
    Restrictions: runs in the scheduler process between steps; must return within a millisecond
    or two (hand off slow work to a thread).
    Added in plugin API 1.0.
    """
