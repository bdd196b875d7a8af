"""RadixServe: a fast LLM serving runtime built as a slim core plus plugins."""

from radixserve.version import PLUGIN_API_VERSION, __version__

__all__ = ["Engine", "PLUGIN_API_VERSION", "__version__"]


def __getattr__(name: str):
    # Engine pulls in torch and zmq; keep `import radixserve` cheap for the CLI and plugins.
    if name == "Engine":
        from radixserve.engine import Engine

        return Engine
    raise AttributeError(name)
