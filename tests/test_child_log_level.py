"""`server.log_level` reaches the runtime's child processes: `serve --log-level warning` shows no
scheduler INFO lines and no weight-loading progress bar."""

from __future__ import annotations

import logging
import re
import subprocess
import sys
import textwrap

import pytest
import zmq
from radixserve.runtime import child, scheduler_process
from radixserve.runtime.ipc import PortArgs


def test_log_level_of_a_config_dict():
    assert child.log_level({"server": {"log_level": "warning"}}) == logging.WARNING
    assert child.log_level({"server": {"log_level": "debug"}}) == logging.DEBUG
    assert child.log_level({}) == logging.INFO


@pytest.mark.parametrize("process, label", [("scheduler", "scheduler"), ("tp_worker", "tp1")])
def test_child_logs_at_the_servers_level(process, label):
    """In a fresh interpreter (the root logger is the child's own, as after spawn)."""
    code = textwrap.dedent(f"""
        import logging
        from radixserve.runtime.child import ChildSpec, setup_logging
        from radixserve.runtime.ipc import PortArgs
        spec = ChildSpec(process={process!r}, config={{"server": {{"log_level": "warning"}}}},
                         ports=PortArgs("", "", "", ""), parent_pid=0, tokenizer_path="", sys_path=[], tp_rank=1)
        setup_logging(spec)
        log = logging.getLogger("radixserve.runtime.scheduler_process")
        log.info("an info line")
        log.warning("a warning line")
    """)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "an info line" not in proc.stderr
    assert f" {label} WARNING radixserve.runtime.scheduler_process: a warning line" in proc.stderr


def test_every_process_writes_one_line_format_with_its_label():
    """A replica's runtime children carry its prefix (they said only "scheduler" under --dp), and the server,
    the router and the children share one timestamp format (they mixed HH:MM:SS with dates)."""
    code = textwrap.dedent("""
        import logging
        from radixserve.runtime.child import ChildSpec, setup_logging
        from radixserve.runtime.ipc import PortArgs
        spec = ChildSpec(process="detokenizer", config={}, ports=PortArgs("", "", "", ""), parent_pid=0,
                         tokenizer_path="", sys_path=[], log_prefix="[replica 1] ")
        setup_logging(spec)
        logging.getLogger("radixserve.runtime.detokenizer").info("hello")
    """)
    child_line = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60).stderr
    server = "from radixserve.server.launch import setup_logging; import logging; setup_logging('info', 'router'); " \
             "logging.getLogger('radixserve.router').info('hello')"
    server_line = subprocess.run([sys.executable, "-c", server], capture_output=True, text=True, timeout=60).stderr
    stamp = r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}"
    assert re.fullmatch(stamp + r" \[replica 1\] detokenizer INFO radixserve.runtime.detokenizer: hello\n", child_line)
    assert re.fullmatch(stamp + r" router INFO radixserve.router: hello\n", server_line)


@pytest.mark.parametrize("level, progress", [("warning", False), ("info", True)])
def test_scheduler_shows_the_progress_bar_at_info_only(level, progress, tmp_path, monkeypatch):
    """The scheduler builds its ModelRunner with show_progress only at INFO or below (a fake
    runner records it and fails, which the scheduler reports to the manager and exits 1)."""
    import radixserve.model_runner

    seen = {}

    def fake_runner(config, registry, show_progress=True, **kwargs):
        seen["show_progress"] = show_progress
        raise RuntimeError("stop here")

    monkeypatch.setattr(radixserve.model_runner, "ModelRunner", fake_runner)
    monkeypatch.setattr(scheduler_process, "install_parent_watchdog", lambda pid: None)
    monkeypatch.setattr(scheduler_process, "_build_cpu_kernels_in_background", lambda: None)
    ports = PortArgs(str(tmp_path), "", "", f"ipc://{tmp_path}/manager")
    ctx = zmq.Context(1)
    pull = ctx.socket(zmq.PULL)
    pull.bind(ports.manager_input)
    try:
        with pytest.raises(SystemExit):
            scheduler_process.run_scheduler_process({"server": {"log_level": level}}, ports, 0)
        assert pull.poll(5000)  # the ChildFailed report
    finally:
        pull.close(linger=0)
        ctx.term()
    assert seen == {"show_progress": progress}
