"""The names the server uses from the runtime (radixserve.runtime), in one place.

The HTTP layer depends only on the TokenizerManager contract (see radixserve.runtime.tokenizer_manager);
tests drive it with a fake manager built on the same `GenerateInput` and `RequestError`."""

from __future__ import annotations

from radixserve.runtime.errors import RequestError
from radixserve.runtime.tokenizer_manager import GenerateInput

__all__ = ["GenerateInput", "RequestError"]
