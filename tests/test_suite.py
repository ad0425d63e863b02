"""The README's test command never hangs: no process is started through a fork that runs
Python (gRPC's fork handlers can hang it for good), and a test that hangs anyway fails
after its time limit with the stack of every thread, while the run goes on."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_no_process_is_started_with_code_run_between_fork_and_exec() -> None:
    tracked = subprocess.run(["git", "ls-files", "*.py"], cwd=ROOT, capture_output=True, text=True, check=True)
    word = "preexec" + "_fn"  # spelled apart so that this file does not find itself
    found = [f for f in tracked.stdout.split() if (ROOT / f).is_file() and word in (ROOT / f).read_text()]
    assert found == [], f"{word} in {found}: start children with protos.rpc.child_command and start_new_session"


def test_a_hanging_test_fails_with_every_threads_stack_and_the_run_goes_on(tmp_path: Path) -> None:
    (tmp_path / "test_hangs.py").write_text(
        textwrap.dedent(
            """
            import threading, time

            def test_hangs():
                threading.Thread(target=time.sleep, args=(60,), name="helper", daemon=True).start()
                threading.Event().wait()

            def test_after():
                pass
            """
        )
    )
    # The project's settings, with the limit shortened: the same plugin and method as every test.
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-c", str(ROOT / "pyproject.toml"), "--rootdir", str(tmp_path)]
        + ["-o", "timeout=2", "-o", "addopts=", "-p", "no:cacheprovider", str(tmp_path / "test_hangs.py")],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
    )
    out = done.stdout + done.stderr
    assert done.returncode == 1, out
    assert "Timeout" in out and "1 failed, 1 passed" in out, out
    assert "Stack of helper" in out, out  # every thread, not only the one that hung
