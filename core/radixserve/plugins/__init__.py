"""The plugin system: hook specs (`hookspec`), discovery and the component registry (`registry`)."""

from radixserve.plugins.hookspec import hookimpl
from radixserve.plugins.registry import ComponentSpec, PluginError, Registry

__all__ = ["ComponentSpec", "PluginError", "Registry", "hookimpl"]
