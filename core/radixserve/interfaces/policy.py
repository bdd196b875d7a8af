"""SchedulePolicy: the order in which waiting requests are admitted."""

from __future__ import annotations

import abc
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from radixserve.interfaces.prefix_cache import PrefixCache
    from radixserve.state import Req


class SchedulePolicy(abc.ABC):
    """Orders the waiting queue before each admission round.

    Contract:
    - `order(waiting, cache)` returns the same requests (no additions, no drops) in admission order.
      It is called at most once per scheduler step with the current waiting queue.
    - It may call `cache.match_prefix(req.fill_ids)` and should then store the result on the request
      (`req.prefix_indices`, `req.last_node`) so the scheduler does not match twice (not storing it is
      still correct, only slower); it must not lock nodes or change slot ownership.
    - It must be deterministic given its inputs, except for policies that are random by design
      (which take a seed).
    - Options are the constructor's keyword arguments, set from a stack with `stack.policy_options`
      (e.g. `{fcfs_threshold: 64}`); the core checks the names against the signature and builds
      instances at start-up to check the values (a few: each process that checks the stack builds
      its own), so the constructor must be cheap, free of side effects, and raise ValueError for a
      bad value. The base constructor takes no options.

    Options: a policy that takes options declares them as keyword arguments of `__init__`
    (validated there, raising ValueError naming the bad value); the base class refuses any.

    Check a policy with `radixserve.testing.check_schedule_policy(MyPolicy)`.

    Added in plugin API 1.0.
    """

    supports_tensor_parallel: bool = True
    """Class flag: this component works when `runtime.tp_size > 1`. True by default: a policy only
    orders requests inside the rank-0 scheduler, which broadcasts the resulting batch. Set False
    to make the stack resolution refuse it with tp_size > 1. Added in plugin API 1.3."""

    def __init__(self, **options) -> None:
        if options:
            raise ValueError(f"{type(self).__name__} takes no options, got {sorted(options)}")

    @abc.abstractmethod
    def order(self, waiting: list[Req], cache: PrefixCache) -> list[Req]:
        """The waiting requests in admission order.

        :param waiting: a fresh list (the policy may sort it in place); each request has
            `fill_ids` (prompt plus any output so far), `prefix_indices`/`last_node` None,
            `arrival_time` (`time.monotonic()` seconds when the scheduler received it, strictly
            increasing in arrival order: `time.monotonic() - req.arrival_time` is how long it has
            waited; since plugin API 1.15, a counter before), `priority`, `sampling_params`.
        :param cache: the prefix cache, for `match_prefix` only.
        :return: every request of `waiting` exactly once. The scheduler admits from the front
            while memory and batch limits allow; the rest wait for the next step. If `order`
            raises, or returns anything else, that step admits in arrival order and the log names
            the policy (its traceback once, then a count): serving goes on.

        Added in plugin API 1.0.
        """
