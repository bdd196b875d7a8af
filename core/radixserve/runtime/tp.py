"""Tensor-parallel processes: where the follower ranks come from (the per-step protocol is in
`radixserve.tensor_parallel`)."""

from __future__ import annotations

import logging
import socket
import time

from radixserve.cpu_cores import set_torch_threads
from radixserve.errors import traceback_worth_showing
from radixserve.logs import configure_logging
from radixserve.runtime.child import log_level
from radixserve.tensor_parallel import follow

logger = logging.getLogger(__name__)
START_FAILURE_GRACE_S = 2.0


def free_local_addr() -> str:
    """127.0.0.1:<a free port> for a single-node rendezvous."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"


def local_ranks(tp_size: int, nnodes: int, node_rank: int) -> list[int]:
    """The TP ranks this node runs (consecutive: node k runs k*per .. (k+1)*per - 1)."""
    per = tp_size // nnodes
    return list(range(node_rank * per, (node_rank + 1) * per))


def run_tp_worker_process(config_dict: dict, rank: int, dist_init_addr: str, parent_pid: int) -> None:
    """Entry point of a follower rank (rank > 0): load the model shard, then follow rank 0.
    Talks to no tokenizer, detokenizer or HTTP process; exits 0 when rank 0 stops it."""
    from radixserve.config import Config
    from radixserve.runtime.ipc import install_parent_watchdog

    install_parent_watchdog(parent_pid)
    configure_logging(log_level(config_dict), f"tp{rank}")  # a no-op when spawned as a child
    config = Config.build(config_dict)
    set_torch_threads(config.runtime.num_threads)
    from radixserve.layers.distributed import init_tp_group
    from radixserve.model_runner import ModelRunner
    from radixserve.plugins.registry import Registry

    rt = config.runtime
    group = init_tp_group(rank, rt.tp_size, dist_init_addr, rt.resolved_device(),
                          local_rank=rank % (rt.tp_size // rt.nnodes))
    try:
        runner = ModelRunner(config, Registry.from_config(config, warn_unknown=False), show_progress=False, tp_group=group)
    except Exception as e:
        # a bad config fails on rank 0 too, which reports it to the user (once: no traceback here for
        # a mistake of the user's); let that message arrive before this exit makes the engine report
        # "rank K exited"
        if traceback_worth_showing(e):
            logger.exception("tensor-parallel rank %d could not start", rank)
        time.sleep(START_FAILURE_GRACE_S)
        raise SystemExit(1) from None
    follow(runner)
    group.destroy()
    logger.info("tensor-parallel rank %d stopped", rank)
