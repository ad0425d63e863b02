"""Starting shards from a process that is itself a gRPC client (``deploy.local``).

A training process or a test starts and restarts shards while its own threads are in
gRPC calls. Python code run in the child between fork and exec makes CPython fork
through its fork handlers, and gRPC's then hang the launcher or crash the child; so the
launcher runs none: a child asks for SIGTERM on its launcher's death itself, once it
has started (``protos.rpc.child``), and only then becomes the program.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

from deploy.local import REPO
from protos.rpc import child_command
from tests.integration.shards import start_shard, stop_shard


def test_starting_a_shard_runs_no_fork_handlers_in_the_launcher(tmp_path: Path) -> None:
    # Python's fork handlers (gRPC registers its own) run only when a child runs Python
    # before exec; they must not run for a shard.
    calls: list[int] = []
    os.register_at_fork(before=lambda: calls.append(os.getpid()))
    shard = start_shard(0, 1, tmp_path)
    try:
        assert calls == [], "the launcher forked through its fork handlers"
    finally:
        stop_shard(shard)


def test_a_shard_exits_when_its_launcher_dies(tmp_path: Path) -> None:
    launcher = textwrap.dedent(
        f"""
        import os, sys
        sys.path.insert(0, {str(REPO)!r})
        from deploy.local import start_shard
        shard = start_shard(0, 1, __import__("pathlib").Path({str(tmp_path)!r}))
        print(shard.proc.pid, flush=True)
        os._exit(0)  # no goodbye: the shard is not stopped
        """
    )
    out = subprocess.run([sys.executable, "-c", launcher], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    pid = int(out.stdout.split()[-1])
    deadline = time.monotonic() + 60
    while _alive(pid):
        assert time.monotonic() < deadline, f"shard {pid} outlived its launcher by 60 s"
        time.sleep(0.1)


def test_a_program_not_ours_dies_with_its_launcher() -> None:
    launcher = textwrap.dedent(
        f"""
        import os, subprocess, sys
        sys.path.insert(0, {str(REPO)!r})
        from protos.rpc import child_command
        proc = subprocess.Popen(child_command(["sleep", "300"]), start_new_session=True)
        print(proc.pid, flush=True)
        os._exit(0)
        """
    )
    out = subprocess.run([sys.executable, "-c", launcher], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr[-3000:]
    pid = int(out.stdout.split()[-1])
    deadline = time.monotonic() + 30
    while _alive(pid):
        assert time.monotonic() < deadline, f"sleep {pid} outlived its launcher by 30 s"
        time.sleep(0.1)


def test_a_child_starts_without_fork_handlers_as_the_program_with_its_limits() -> None:
    calls: list[int] = []
    os.register_at_fork(before=lambda: calls.append(os.getpid()))
    show = "import os, resource; print(os.getpid(), resource.getrlimit(resource.RLIMIT_FSIZE)[0])"
    proc = subprocess.Popen(
        child_command([sys.executable, "-c", show], file_size_limit_bytes=12345), stdout=subprocess.PIPE, text=True
    )
    out, _ = proc.communicate(timeout=60)
    assert calls == [], "the launcher forked through its fork handlers"
    assert out.split() == [str(proc.pid), "12345"]  # the same process: signals sent to it reach the program


def test_a_child_that_cannot_run_its_program_says_so_in_one_line() -> None:
    done = subprocess.run(child_command(["no-such-program-here"]), capture_output=True, text=True, timeout=60)
    assert done.returncode == 1
    assert done.stderr == "cannot run no-such-program-here: No such file or directory\n"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # An exited child of a dead launcher is reaped by init; until then it is a zombie.
    with open(f"/proc/{pid}/stat") as f:
        return f.read().split(") ", 1)[1][0] != "Z"


def test_a_stopped_shard_leaves_no_port_file(tmp_path: Path) -> None:
    # A launcher (or a script's wait loop) that finds the file takes the shard for running.
    shard = start_shard(0, 1, tmp_path)
    assert (tmp_path / "port.0").exists()
    stop_shard(shard)
    assert not (tmp_path / "port.0").exists()
