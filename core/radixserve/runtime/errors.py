"""Re-export: the request errors live in `radixserve.errors` (the contracts layer, so the scheduler
and the validation module can raise them without importing upward)."""

from radixserve.errors import EngineDeadError, RequestError

__all__ = ["EngineDeadError", "RequestError"]
