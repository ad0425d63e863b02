"""``ps-launch``: start shards, run training workers under torchrun, tear everything down.

    ps-launch --shards 2 --workers 2 -- python examples/train_dlrm.py --train-samples 100000

The workers get the shard addresses in ``TRAINER_ADDRESSES`` (read by
``worker.trainer``). The launch fails loudly, and stops everything, if a shard dies
or a worker fails; Ctrl-C stops everything too. The exit status is the workers'.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from deploy.local import LocalCluster, ShardStartError, die_with_parent

__all__ = ["main"]

log = logging.getLogger("ps-launch")


def _parse(argv: Sequence[str]) -> tuple[argparse.Namespace, list[str]]:
    parser = argparse.ArgumentParser(
        prog="ps-launch",
        description="Start N shard processes on this machine, run W workers of COMMAND under torchrun with "
        "TRAINER_ADDRESSES set to the shards, and stop the shards when the workers end.",
        usage="ps-launch [--shards N] [--workers W] [--shard-arg ARG ...] [--data-dir DIR] -- COMMAND [ARGS ...]",
    )
    parser.add_argument("--shards", type=int, default=2, help="shard processes to start (default 2)")
    parser.add_argument("--workers", type=int, default=1, help="worker processes per torchrun (default 1)")
    parser.add_argument("--shard-arg", action="append", default=[], help="extra ps-server flag, repeatable; {shard} becomes the shard index, e.g. "
                        "--shard-arg=--data-dir=/var/ps/shard-{shard} --shard-arg=--memory-budget-bytes=4000000000")
    parser.add_argument("--data-dir", type=Path, default=None, help="shard logs and port files (default: a temp dir)")
    if "--" not in argv:
        parser.error("missing '-- COMMAND': e.g. ps-launch --shards 2 -- python examples/train_dlrm.py")
    split = list(argv).index("--")
    args = parser.parse_args(list(argv[:split]))
    command = list(argv[split + 1 :])
    if not command:
        parser.error("no COMMAND after '--'")
    if args.shards < 1 or args.workers < 1:
        parser.error("--shards and --workers must be >= 1")
    if command[0] in ("python", "python3"):
        command[0] = sys.executable  # the same interpreter (and venv) as ps-launch
    return args, command


def _torchrun(workers: int, command: list[str]) -> list[str]:
    # torchrun runs "script.py ARGS" or "-m module ARGS" itself; anything else (python -c,
    # other interpreter flags, a non-Python program) runs as given with --no-python.
    python_target = command[0] == sys.executable and len(command) > 1
    if python_target and (command[1] == "-m" or not command[1].startswith("-")):
        target = command[1:]
    else:
        target = ["--no-python", *command]
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={workers}", *target]


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``ps-launch``; returns the exit status."""
    logging.basicConfig(level=logging.INFO, format="ts=%(asctime)s level=%(levelname)s logger=%(name)s msg=%(message)s")
    args, command = _parse(sys.argv[1:] if argv is None else argv)
    cluster = LocalCluster(args.shards, args.data_dir, tuple(args.shard_arg))
    try:
        cluster.start()
    except ShardStartError as exc:
        log.error("%s", exc)
        return 1
    log.info("shards up: %s", ",".join(cluster.addresses))
    env = dict(os.environ, TRAINER_ADDRESSES=",".join(cluster.addresses))
    workers = subprocess.Popen(_torchrun(args.workers, command), env=env, start_new_session=True,
                               preexec_fn=die_with_parent)  # fmt: skip
    # SIGTERM (a scheduler or `kill`) tears down like Ctrl-C, instead of orphaning everything.
    signal.signal(signal.SIGTERM, lambda signum, frame: signal.raise_signal(signal.SIGINT))
    status = 1
    try:
        while True:
            code = workers.poll()
            if code is not None:
                status = code if code >= 0 else 128 - code  # killed by a signal: shell convention
                log.info("workers exited with status %d", code)
                break
            dead = [s for s in cluster.shards if s.proc.poll() is not None]
            if dead:
                for s in dead:
                    log.error("shard %d died with status %s; stopping the workers:\n%s", s.index, s.proc.returncode,
                              s.log_tail())  # fmt: skip
                _stop(workers)
                status = 1
                break
            time.sleep(0.2)
    except KeyboardInterrupt:
        log.warning("interrupted (SIGINT or SIGTERM): stopping workers and shards")
        _stop(workers)
        status = 130
    finally:
        try:
            cluster.stop()
        except ShardStartError as exc:
            log.error("%s", exc)
            status = status or 1
    return status


def _stop(workers: subprocess.Popen[bytes]) -> None:
    if workers.poll() is None:
        os.killpg(workers.pid, signal.SIGTERM)
        try:
            workers.wait(40)  # longer than torchrun's own grace period for its workers
        except subprocess.TimeoutExpired:
            os.killpg(workers.pid, signal.SIGKILL)
            workers.wait()


if __name__ == "__main__":
    sys.exit(main())
