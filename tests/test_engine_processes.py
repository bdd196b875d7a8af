"""Process plumbing without a model: private ipc directory, and no orphans when the parent is killed."""

from __future__ import annotations

import os
import re
import signal
import stat
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from radixserve.runtime.ipc import PortArgs


def test_ipc_endpoints_live_in_a_private_directory():
    ports = PortArgs.create()
    try:
        mode = stat.S_IMODE(os.stat(ports.ipc_dir).st_mode)
        assert mode == 0o700
        for ep in (ports.scheduler_input, ports.detokenizer_input, ports.manager_input):
            assert ep.startswith(f"ipc://{ports.ipc_dir}/")
    finally:
        ports.cleanup()
    assert not os.path.exists(ports.ipc_dir)


PARENT = textwrap.dedent(
    """
    import multiprocessing as mp, os, sys, time
    from radixserve.runtime.ipc import install_parent_watchdog

    def child(parent_pid):
        install_parent_watchdog(parent_pid, interval_s=0.1)
        time.sleep(120)  # blocked like a child waiting on its socket

    if __name__ == "__main__":
        p = mp.get_context("spawn").Process(target=child, args=(os.getpid(),), daemon=True)
        p.start()
        print(p.pid, flush=True)
        time.sleep(120)
    """
)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie (exited, not yet reaped by init) counts as gone
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


GROUP_PARENT = textwrap.dedent(
    """
    import os, subprocess, sys, time
    from radixserve.runtime.ipc import install_parent_watchdog

    if sys.argv[1:] == ["child"]:  # a runtime child: its own session, with a compiler-like grandchild
        install_parent_watchdog(os.getppid(), interval_s=0.1)
        grandchild = subprocess.Popen(["sleep", "120"])
        print(os.getpid(), grandchild.pid, flush=True)
        time.sleep(120)
    else:
        child = subprocess.Popen([sys.executable, __file__, "child"], start_new_session=True)
        time.sleep(120)
    """
)


def test_a_killed_parent_takes_its_childs_own_processes_along(tmp_path):
    """Engine audit 31: killed during the first start's kernel compile, the parent left ninja and c++ running for
    minutes (the scheduler exited on its watchdog; its compilers, its own children, stayed)."""
    script = tmp_path / "group.py"
    script.write_text(GROUP_PARENT)
    parent = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    try:
        child_pid, grandchild_pid = map(int, parent.stdout.readline().split())
        assert _alive(grandchild_pid)
        parent.send_signal(signal.SIGKILL)
        parent.wait()
        deadline = time.monotonic() + 10
        while (_alive(child_pid) or _alive(grandchild_pid)) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not _alive(child_pid) and not _alive(grandchild_pid), "the child's own process outlived the parent"
    finally:
        parent.kill()


def test_children_exit_when_the_parent_is_killed(tmp_path):
    script = tmp_path / "parent.py"
    script.write_text(PARENT)
    parent = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    try:
        child_pid = int(parent.stdout.readline())
        assert _alive(child_pid)
        parent.send_signal(signal.SIGKILL)  # no cleanup runs in the parent
        parent.wait()
        deadline = time.monotonic() + 10
        while _alive(child_pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not _alive(child_pid), "the child outlived its killed parent (orphan)"
    finally:
        parent.kill()


def _readme_engine_example() -> str:
    readme = (Path(__file__).parent.parent / "README.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", readme, flags=re.S)
    [example] = [b for b in blocks if "Engine(" in b]
    return example


@pytest.mark.slow
def test_the_readme_engine_example_runs_as_a_plain_script(tmp_path, smollm2_gguf_path):
    """No `if __name__ == "__main__":` guard: the children must not re-import the user's script."""
    example = _readme_engine_example()
    assert "__main__" not in example
    script = tmp_path / "example.py"
    script.write_text(example.replace('"path/to/model"', repr(smollm2_gguf_path)))
    # audit 30: a file beside the script (and in the working directory) named like a dependency shadowed
    # it in the scheduler, which imports `gguf` to read the model (a script itself named gguf.py started
    # another Engine in every scheduler, without end)
    (tmp_path / "gguf.py").write_text("open(__file__ + '.imported', 'w').close()\nraise ImportError('shadow')\n")
    # one OpenMP thread (the example leaves runtime.num_threads unset): two beside the test process
    # and the engine's other processes on 2 cores only contend
    # a disable-list entry naming no installed plugin is said once, by the Engine's process (was: again by
    # the scheduler, whose registry is built from the same lists)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "RADIXSERVE_DISABLE_PLUGINS": "no_such_plugin"}
    run = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=900, cwd=tmp_path,
                         env=env)
    assert run.returncode == 0, run.stderr[-4000:]
    assert run.stderr.count("names 'no_such_plugin', which is no installed plugin") == 1, run.stderr[-4000:]
    assert "'finish_reason'" in run.stdout and "completion_tokens': 16" in run.stdout, run.stdout
    assert "Traceback" not in run.stderr, run.stderr[-4000:]
    assert not (tmp_path / "gguf.py.imported").exists()


def test_children_get_the_import_path_without_the_parents_script_directory(monkeypatch, tmp_path):
    from radixserve.runtime import child

    monkeypatch.setattr(sys.modules["__main__"], "__file__", str(tmp_path / "script.py"), raising=False)
    monkeypatch.setattr(sys, "path", [str(tmp_path), "", str(tmp_path / "site"), *sys.path])
    got = child.sys_path_for_children()
    assert str(tmp_path) not in got and "" not in got and str(tmp_path / "site") in got


def test_a_runtime_started_inside_a_runtime_child_is_refused(monkeypatch):
    from radixserve.runtime import child

    child.refuse_inside_runtime_child()  # not a child: nothing happens
    monkeypatch.setenv(child.RUNTIME_CHILD_ENV, "scheduler")
    with pytest.raises(RuntimeError, match=r"inside the runtime's own scheduler process: .*gguf.py"):
        child.refuse_inside_runtime_child()


@pytest.mark.parametrize("own_group", [False, True])
def test_a_child_stopped_while_loading_takes_its_own_processes_along(own_group):
    # a first start's kernel build runs compilers under the scheduler process; stopping the
    # scheduler during start-up (Ctrl-C) used to leave them compiling for a minute, orphaned.
    # own_group: ninja starts each compiler in a process group of its own (operator audit 30)
    from radixserve.runtime.child import kill_group

    code = ("import os, subprocess, sys, time; "
            f"p = subprocess.Popen(['sleep', '60'], process_group={0 if own_group else None}); "
            "print(p.pid, flush=True); time.sleep(60)")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, start_new_session=True)
    grandchild = int(proc.stdout.readline())
    kill_group(proc)
    proc.wait(timeout=10)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            os.kill(grandchild, 0)
        except ProcessLookupError:
            break
        with open(f"/proc/{grandchild}/stat") as f:  # a zombie waiting for init to reap it is gone too
            if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                break
        time.sleep(0.05)
    else:
        raise AssertionError(f"process {grandchild}, started by the stopped child, is still running")


CTRL_C_DURING_START = textwrap.dedent(
    """
    import os, signal, threading
    from radixserve import Engine

    def children():
        mine = []
        for d in os.listdir("/proc"):
            if d.isdigit():
                try:
                    with open(f"/proc/{d}/stat") as f:
                        fields = f.read().split(")")[-1].split()
                except OSError:
                    continue
                if fields[1] == str(os.getpid()) and fields[0] != "Z":
                    mine.append(d)
        return mine

    threading.Timer(2.0, os.kill, (os.getpid(), signal.SIGINT)).start()  # Ctrl-C while the model loads
    try:
        Engine(runtime={"device": "cpu", "cuda_graph": False, "num_threads": 1})
        print("started")
    except KeyboardInterrupt:
        print("interrupted")
    print("children", len(children()), flush=True)
    """
)


@pytest.mark.slow
def test_ctrl_c_while_the_engine_starts_stops_its_children_quietly(tmp_path):
    """KeyboardInterrupt during Engine() left the scheduler and detokenizer running for the rest of the script and
    printed 'Event loop is closed' and 'Task was destroyed' at exit (an Engine user's audit, session 27)."""
    script = tmp_path / "ctrl_c.py"
    script.write_text(CTRL_C_DURING_START)
    run = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert run.returncode == 0, run.stderr[-4000:]
    assert "interrupted" in run.stdout and "children 0" in run.stdout, run.stdout + run.stderr[-2000:]
    for bad in ("Traceback", "Event loop is closed", "Task was destroyed", "Exception ignored"):
        assert bad not in run.stderr, run.stderr[-4000:]
