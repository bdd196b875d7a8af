"""`radixserve serve --nnodes N --node-rank I` with I > 0: a follower node.

It starts this node's tensor-parallel ranks (runtime/tp.py `run_tp_worker_process`) and waits for
them; it serves no HTTP and runs no tokenizer, detokenizer or scheduler. The ranks exit 0 when rank
0 (on node 0) stops them at its shutdown, and then so does this process. A rank that fails makes it
exit 1 naming the rank. SIGTERM / Ctrl-C here stops this node's ranks (which ends the whole group:
stop node 0 for a clean shutdown of every node)."""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import time

from radixserve.config import Config
from radixserve.runtime.child import ChildSpec, spawn, sys_path_for_children
from radixserve.runtime.ipc import PortArgs
from radixserve.runtime.tp import local_ranks

logger = logging.getLogger(__name__)


def run_follower_node(config: Config) -> int:
    rt = config.runtime
    from radixserve.model_loader.model_files import resolve_model_path

    config = config.with_overrides({"model": {"path": resolve_model_path(config.model.path)}})
    ranks = local_ranks(rt.tp_size, rt.nnodes, rt.node_rank)
    no_ports = PortArgs(ipc_dir="", scheduler_input="", detokenizer_input="", manager_input="")
    procs = {}
    for rank in ranks:
        spec = ChildSpec(process="tp_worker", config=config.model_dump(mode="json"), ports=no_ports,
                         parent_pid=os.getpid(), tokenizer_path="", sys_path=sys_path_for_children(), tp_rank=rank,
                         dist_init_addr=str(rt.dist_init_addr))
        procs[rank] = spawn(spec)
    print(f"radixserve: node {rt.node_rank}/{rt.nnodes} runs tensor-parallel ranks {ranks} "
          f"(rendezvous {rt.dist_init_addr})", file=sys.stderr, flush=True)
    stopping = threading.Event()

    def stop(signum, frame) -> None:
        stopping.set()

    old = {sig: signal.signal(sig, stop) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        while True:
            if stopping.is_set():
                for p in procs.values():
                    if p.poll() is None:
                        p.kill()
                for p in procs.values():
                    p.wait()
                return 0
            codes = {rank: p.poll() for rank, p in procs.items()}
            failed = [rank for rank, c in codes.items() if c not in (None, 0)]
            if failed:
                rank = failed[0]
                print(f"radixserve: tensor-parallel rank {rank} exited with code {codes[rank]}; stopping this node",
                      file=sys.stderr, flush=True)
                for p in procs.values():
                    if p.poll() is None:
                        p.kill()
                return 1
            if all(c == 0 for c in codes.values()):
                return 0
            time.sleep(0.2)
    finally:
        for sig, handler in old.items():
            signal.signal(sig, handler)
