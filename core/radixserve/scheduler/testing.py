"""Moved to `radixserve.testing.toy_runner`; this name keeps old imports working."""

from radixserve.testing.toy_runner import ToyRunner, toy_next_token, toy_reference

__all__ = ["ToyRunner", "toy_next_token", "toy_reference"]
