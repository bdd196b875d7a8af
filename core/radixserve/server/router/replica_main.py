"""Entry of one data-parallel replica process: `python -m radixserve.server.router.replica_main`.

Reads its spec (index, config, unix socket path, the router's pid, import path) as JSON on stdin,
then runs an ordinary single server (`run_server`) on that socket. SIGTERM from the router is the
server's graceful shutdown (exit 0); the replica exits by itself if the router dies."""

from __future__ import annotations

import json
import sys

from radixserve.runtime.child import adopt_import_path


def main() -> None:
    spec = json.loads(sys.stdin.read())
    sys.stdin.close()
    adopt_import_path(spec["sys_path"])

    from radixserve.config import Config
    from radixserve.runtime.ipc import install_parent_watchdog
    from radixserve.server.launch import end_process, run_server

    config = Config.build(spec["config"])
    install_parent_watchdog(spec["parent_pid"])
    # every line of this replica and of its runtime children says which replica wrote it
    end_process(run_server(config, uds=spec["socket_path"], log_prefix=f"[replica {spec['index']}] "))


if __name__ == "__main__":
    main()
