"""The names the server uses from the runtime (radixserve.runtime), in one place.

The HTTP layer depends only on the TokenizerManager contract (see launch.py); tests drive it with
a fake manager built on the same `GenerateInput` and `RequestError`."""

from __future__ import annotations

try:
    from radixserve.runtime.errors import RequestError
    from radixserve.runtime.tokenizer_manager import GenerateInput
except ImportError:  # TEMPORARY until the runtime package lands
    from dataclasses import dataclass

    from radixserve.state import SamplingParams

    class RequestError(Exception):  # type: ignore[no-redef]
        def __init__(self, message: str, status: int = 400) -> None:
            super().__init__(message)
            self.message = message
            self.status = status

    @dataclass
    class GenerateInput:  # type: ignore[no-redef]
        text: str | None = None
        input_ids: list[int] | None = None
        sampling_params: SamplingParams | None = None
        rid: str | None = None
        stream: bool = False
        return_logprob: bool = False
        top_logprobs_num: int = 0


__all__ = ["GenerateInput", "RequestError"]
