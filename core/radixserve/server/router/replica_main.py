"""Entry of one data-parallel replica process: `python -m radixserve.server.router.replica_main`.

Reads its spec (index, config, unix socket path, the router's pid, import path) as JSON on stdin,
then runs an ordinary single server (`run_server`) on that socket. SIGTERM from the router is the
server's graceful shutdown (exit 0); the replica exits by itself if the router dies."""

from __future__ import annotations

import json
import logging
import sys


def main() -> None:
    spec = json.loads(sys.stdin.read())
    sys.stdin.close()
    sys.path[:] = list(dict.fromkeys(sys.path + [p for p in spec["sys_path"] if p]))

    from radixserve.config import Config
    from radixserve.runtime.ipc import install_parent_watchdog
    from radixserve.server.launch import end_process, run_server

    config = Config.build(spec["config"])
    # before run_server's own basicConfig (then a no-op): every line says which replica wrote it
    logging.basicConfig(
        level=getattr(logging, config.server.log_level.upper()),
        format=f"%(asctime)s %(levelname)s [replica {spec['index']}] %(name)s: %(message)s",
        datefmt="%H:%M:%S",
    )
    install_parent_watchdog(spec["parent_pid"])
    end_process(run_server(config, uds=spec["socket_path"]))


if __name__ == "__main__":
    main()
