"""``ps-launch`` as a user runs it: help, exit status, restarts, giving up on a crash loop."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from deploy.launch import _Interrupt
from deploy.local import advertised_host, threads_beside_local_shards
from deploy.restarts import RestartPolicy
from tests.integration.shards import shard_pid

REPO = Path(__file__).resolve().parents[2]


def _launch(*args: str) -> list[str]:
    return [sys.executable, "-m", "deploy.launch", *args]


def test_help_exits_0_and_documents_restarts() -> None:
    result = subprocess.run(_launch("--help"), cwd=REPO, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert "--restart-shards" in result.stdout and "-- COMMAND" in result.stdout
    assert "--max-restarts" in result.stdout and "--join LOG_DIR" in result.stdout
    assert "--scale LOG_DIR --to N" in result.stdout and "--followers" in result.stdout


def test_exit_status_is_the_workers_after_their_restarts(tmp_path: Path) -> None:
    code = "print('attempt', flush=True); raise SystemExit(3)"
    result = subprocess.run(
        _launch("--shards", "1", "--max-restarts", "1", "--log-dir", str(tmp_path), "--", "python", "-c", code),
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 3, result.stderr[-2000:]
    assert result.stdout.count("attempt") == 2, "a failed worker restarts the group, --max-restarts times"
    assert "workers exited with status 3" in result.stderr
    assert "ps-launch: worker rank 0 (pid" in result.stderr and "exited with status 3" in result.stderr


def test_workers_get_one_thread_per_spare_core_and_a_signal_is_128_plus(tmp_path: Path) -> None:
    code = "import os, signal; print('threads', os.environ['OMP_NUM_THREADS'], flush=True); os.kill(os.getpid(), signal.SIGKILL)"
    result = subprocess.run(
        _launch("--shards", "1", "--max-restarts", "0", "--log-dir", str(tmp_path), "--", "python", "-c", code),
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 128 + 9, result.stderr[-2000:]
    assert f"threads {threads_beside_local_shards(1)}" in result.stdout
    assert "was killed by SIGKILL" in result.stderr


def test_the_first_signal_interrupts_and_later_ones_let_the_teardown_finish() -> None:
    interrupt = _Interrupt()
    interrupt.check()  # nothing yet
    with pytest.raises(KeyboardInterrupt):
        interrupt(signal.SIGTERM, None)
    interrupt(signal.SIGTERM, None)  # during the teardown: recorded, not raised
    interrupt(signal.SIGINT, None)
    with pytest.raises(KeyboardInterrupt):
        interrupt.check()  # a first signal Python dropped (raised in a fork hook) is still seen


def test_restart_policy_gives_up_only_on_repeated_fast_failures() -> None:
    policy = RestartPolicy(fast_s=10.0, max_fast_failures=3)
    policy.started(0)
    assert policy.died(0) and policy.died(0)  # two fast failures: restart again
    assert not policy.died(0)  # the third in a row: give up
    slow = RestartPolicy(fast_s=0.05, max_fast_failures=2)
    for _ in range(5):
        slow.started(1)
        time.sleep(0.06)
        assert slow.died(1)  # ran longer than fast_s each time: never a crash loop


def test_a_crash_looping_shard_ends_the_run_with_its_log_once(tmp_path: Path) -> None:
    launch_dir, data = tmp_path / "launch", tmp_path / "data"
    proc = subprocess.Popen(
        _launch(
            "--shards",
            "2",
            "--log-dir",
            str(launch_dir),
            f"--shard-arg=--data-dir={data}/{{shard}}",
            "--",
            "python",
            "-c",
            "import time; time.sleep(300)",
        ),
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 120
        kills = 0
        last = None
        while proc.poll() is None and time.monotonic() < deadline:
            pid = shard_pid(launch_dir, 0)
            if pid is not None and pid != last and (launch_dir / "port.0").exists():
                os.kill(pid, signal.SIGKILL)  # dies right after each (re)start
                kills, last = kills + 1, pid
            time.sleep(0.05)
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 1, err[-3000:]
    assert kills == 3, (kills, err[-3000:])
    assert err.count("restarting it on the same address") == 2
    assert err.count("giving up") == 1 and err.count("Its log") == 1, err[-3000:]
    left = subprocess.run(["pgrep", "-af", str(tmp_path)], capture_output=True, text=True).stdout
    assert left == "", left


def test_two_dead_shards_are_restarted_together(tmp_path: Path) -> None:
    launch_dir, data, errors = tmp_path / "launch", tmp_path / "data", tmp_path / "ps-launch.err"
    proc = subprocess.Popen(
        _launch(
            "--shards",
            "2",
            "--log-dir",
            str(launch_dir),
            f"--shard-arg=--data-dir={data}/{{shard}}",
            "--",
            "python",
            "-c",
            "import time; time.sleep(300)",
        ),
        cwd=REPO,
        stdout=subprocess.DEVNULL,
        stderr=errors.open("w"),
        text=True,
    )
    try:
        deadline = time.monotonic() + 120
        pids = [shard_pid(launch_dir, i) for i in range(2)]
        while None in pids or not all((launch_dir / f"port.{i}").exists() for i in range(2)):
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[1][-3000:]
            time.sleep(0.05)
            pids = [shard_pid(launch_dir, i) for i in range(2)]
        # Both die while ps-launch is stopped, so its next look finds both dead at once.
        os.kill(proc.pid, signal.SIGSTOP)
        try:
            for pid in pids:
                assert pid is not None
                os.kill(pid, signal.SIGKILL)
            while any(shard_pid(launch_dir, i) == pid for i, pid in enumerate(pids)):
                time.sleep(0.01)
        finally:
            os.kill(proc.pid, signal.SIGCONT)
        # ps-launch says when each is back (a port file alone may be a killed shard's, left behind).
        while errors.read_text().count("is back on") < 2:
            assert proc.poll() is None and time.monotonic() < deadline, errors.read_text()[-3000:]
            time.sleep(0.05)
        back = [shard_pid(launch_dir, i) for i in range(2)]
        assert None not in back and set(back).isdisjoint(pids)
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=120)
    err = errors.read_text()
    lines = err.splitlines()
    restarting = [n for n, line in enumerate(lines) if "restarting it on the same address" in line]
    returned = [n for n, line in enumerate(lines) if "is back on" in line]
    assert len(restarting) == 2 and len(returned) == 2, err[-3000:]
    assert max(restarting) < min(returned), err[-3000:]  # both were started before either was waited for


def test_log_dir_is_named_for_what_it_holds_and_data_dir_still_works_with_a_warning(tmp_path: Path) -> None:
    help_text = subprocess.run(_launch("--help"), cwd=REPO, capture_output=True, text=True, timeout=60).stdout
    words = " ".join(help_text.split())  # as wrapped for any terminal width
    assert "--log-dir DIR" in words and "not shard data" in words
    result = subprocess.run(
        _launch("--shards", "1", "--data-dir", str(tmp_path), "--", "python", "-c", "pass"),
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert "--data-dir is the old name of --log-dir" in result.stderr
    assert (tmp_path / "shard.0.log").exists()


def test_a_relative_log_dir_works(tmp_path: Path) -> None:
    # The shards run in the log dir: a port file named relative to ours was looked for beneath it.
    result = subprocess.run(
        [*_launch("--shards", "1", "--max-restarts", "0", "--log-dir", "logs", "--"), "python", "-c", "pass"],
        cwd=tmp_path,
        env=dict(os.environ, PYTHONPATH=str(REPO)),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert (tmp_path / "logs" / "shard.0.log").exists() and (tmp_path / "logs" / "workers.json").exists()


def test_workers_dial_the_advertised_host_and_a_host_they_cannot_dial_fails_the_launch(tmp_path: Path) -> None:
    # Listening on every interface, the workers are given this machine's own address (not
    # 127.0.0.1, which other machines cannot dial) and reach the shards there.
    # So are the serving shards that follow them, listed for ps-infer --ps-file.
    serving = tmp_path / "a" / "serving-addresses"
    dial = (
        "import os; from client import PSClient; a = os.environ['TRAINER_ADDRESSES']; print('dial', a, flush=True); "
        f"print('serving', open({str(serving)!r}).read().strip(), flush=True); "
        "c = PSClient(a.split(',')); c.create_table('t', 4); c.close()"
    )
    everywhere = subprocess.run(
        _launch(
            "--shards",
            "1",
            "--listen",
            "0.0.0.0",
            "--followers",
            "--log-dir",
            str(tmp_path / "a"),
            "--",
            "python",
            "-c",
            dial,
        ),
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert everywhere.returncode == 0, everywhere.stderr[-2000:]
    (line,) = [x for x in everywhere.stdout.splitlines() if x.startswith("dial ")]
    assert line.split()[1].rpartition(":")[0] == advertised_host("0.0.0.0")
    (line,) = [x for x in everywhere.stdout.splitlines() if x.startswith("serving ")]
    assert line.split()[1].rpartition(":")[0] == advertised_host("0.0.0.0"), line
    # Advertised at a host where nothing listens: the launch fails before any worker starts.
    code = "print('worker ran', flush=True)"
    nowhere = subprocess.run(
        _launch(
            "--shards", "1", "--advertise", "127.0.0.2", "--log-dir", str(tmp_path / "b"), "--", "python", "-c", code
        ),
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert nowhere.returncode == 1 and "worker ran" not in nowhere.stdout
    assert "the workers would dial 127.0.0.2:" in nowhere.stderr and "--advertise" in nowhere.stderr, nowhere.stderr
