"""``ps-launch``: start shards, run training workers under torchrun, tear everything down.

    ps-launch --shards 2 --workers 2 -- python examples/train_dlrm.py --train-samples 100000
    ps-launch --shards 2 --shard-arg=--data-dir=/var/ps/shard-{shard} -- python examples/train_dlrm.py
    ps-launch --join LOG_DIR --workers 1        # one more worker for the launch logging to LOG_DIR
    ps-launch --scale LOG_DIR --to 3            # that launch's cluster grows to 3 shards, live

The workers get the shard addresses in ``TRAINER_ADDRESSES`` (read by
``worker.trainer``). A shard that dies is restarted on the same address and data dir
when the shards have one (``--restart-shards``, the default then): the workers' client
retries through the gap and every acknowledged push is still there in ``every-push``
mode. Without a data dir a restarted shard would come back empty, so a dead shard stops
the run instead, as do repeated fast shard failures.

Workers are elastic (``deploy.workers``): a worker that dies makes torchrun restart the
group, up to ``--max-restarts`` times, and ``ps-launch --join`` adds workers to a running
launch (``--nnodes MIN:MAX`` bounds the torchrun agents: this one and those that join).
The trainer resumes from its checkpoint each time: ``TRAINER_CHECKPOINT_DIR`` is set to
``<log-dir>/checkpoints/<launch id>`` unless the environment sets it. Each worker writes its
pid to ``<log-dir>/workers/rank-<RANK>.pid`` (``worker.distributed``), so a script can signal
one worker of this launch and no other process.

The shards grow and shrink while the workers train: ``ps-launch --scale LOG_DIR --to N``
asks the launch to start the new shards and move keys to them (``deploy.launch_scale``).
``--followers`` starts a serving shard following each training shard (``--serving-replicas R``:
R of each) for ``ps-infer --ps-file LOG_DIR/serving-addresses``; they follow each scale, one
that dies is replaced, and ``ps-launch --scale LOG_DIR --serving-replicas R`` changes how many
each shard has while they serve (``deploy.replicas``). Ctrl-C or SIGTERM
stops everything. The exit status is the workers' (1 if the launch itself failed, 2 for
a bad setting, 130 when interrupted).
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Sequence
from pathlib import Path

import grpc

from deploy.launch_scale import SERVING_ADDRESSES_FILE, Scaler, ScaleRequest, request_scale
from deploy.local import LocalCluster, ShardStartError, threads_beside_local_shards
from deploy.replicas import ServingReplicas
from deploy.restarts import RestartPolicy, describe_exit, replace_followers, revive
from deploy.workers import RENDEZVOUS_FILE, Elastic, Join, read_join, torchrun_command, write_join
from protos.rpc import child_command
from protos.rpc.logs import configure_logging
from protos.rpc.tls import open_channel
from worker.distributed import PID_DIR_ENV

__all__ = ["RestartPolicy", "main"]

log = logging.getLogger("ps-launch")

_SETTLE_S = 0.5  # after a shard death is seen, how long others dying with it have to show
_RENDEZVOUS_WAIT_S = 60.0  # how long --join waits for the launch it joins to open its rendezvous
_SCALE_WAIT_S = 4 * 3600.0  # how long --scale waits for the launch's answer

_EPILOG = """\
examples:
  ps-launch --shards 2 --workers 2 -- python examples/train_dlrm.py --train-samples 400000
  ps-launch --shards 2 --shard-arg=--data-dir=/var/ps/shard-{shard} --shard-arg=--durability=every-push \\
            -- python examples/train_dlrm.py
  ps-launch --join /tmp/ps-cluster-abc123 --workers 1   # add a worker to the launch logging there
  ps-launch --scale /tmp/ps-cluster-abc123 --to 3       # grow its cluster to 3 shards while it trains
  ps-launch --scale /tmp/ps-cluster-abc123 --serving-replicas 3   # 3 serving replicas per shard, live

Shard logs and port files go to --log-dir (a temp dir by default; --data-dir is its old
name, and not where shards keep rows: that is --shard-arg=--data-dir=...); a shard's log
tail is printed once if it fails for good. A worker that dies restarts the group (the
trainer resumes from its checkpoint, kept under --log-dir unless TRAINER_CHECKPOINT_DIR
is set). The exit status is the workers'.
"""


def _parse(argv: Sequence[str]) -> tuple[argparse.Namespace, list[str]]:
    parser = argparse.ArgumentParser(
        prog="ps-launch",
        description="Start N shard processes on this machine, run W workers of COMMAND under torchrun with "
        "TRAINER_ADDRESSES set to the shards, and stop the shards when the workers end.",
        usage="ps-launch [--shards N] [--workers W] [--nnodes MIN:MAX] [--max-restarts R] [--shard-arg ARG ...] "
        "[--log-dir DIR] [--[no-]restart-shards] -- COMMAND [ARGS ...]\n"
        "       ps-launch --join LOG_DIR [--workers W]\n"
        "       ps-launch --scale LOG_DIR --to N [--max-rows-per-s R]\n"
        "       ps-launch --scale LOG_DIR --serving-replicas R",
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--shards", type=int, default=2, help="shard processes to start (default 2)")
    parser.add_argument(
        "--workers", type=int, default=1, help="worker processes this launch's torchrun agent runs (default 1)"
    )
    parser.add_argument(
        "--nnodes",
        default=Elastic.nnodes,
        metavar="MIN:MAX",
        help=f"torchrun agents the group runs with: this launch's and those of --join (default {Elastic.nnodes})",
    )
    parser.add_argument(
        "--max-restarts",
        type=int,
        default=Elastic.max_restarts,
        help="restarts of the worker group after a worker fails, before the launch fails (default "
        f"{Elastic.max_restarts}; an agent joining does not count)",
    )
    parser.add_argument(
        "--join",
        type=Path,
        default=None,
        metavar="LOG_DIR",
        help="add --workers workers to the running launch whose --log-dir is LOG_DIR (its command, shards and "
        "rendezvous); the group restarts with them and the trainer resumes from its checkpoint",
    )
    parser.add_argument(
        "--scale",
        type=Path,
        default=None,
        metavar="LOG_DIR",
        help="grow or shrink the shards of the running launch whose --log-dir is LOG_DIR to --to N, live: it "
        "starts the new shards, moves keys while its workers train, stops the shards a shrink retires",
    )
    parser.add_argument("--to", type=int, default=None, metavar="N", help="with --scale: the new number of shards")
    parser.add_argument(
        "--max-rows-per-s",
        type=float,
        default=0.0,
        metavar="R",
        help="with --scale: pace each copy of rows to leave training its share (default 0: unpaced)",
    )
    parser.add_argument(
        "--followers",
        action="store_true",
        help="also start a serving shard following each training shard (addresses in LOG_DIR/serving-addresses, "
        "for ps-infer --ps-file); they follow every --scale",
    )
    parser.add_argument(
        "--serving-replicas",
        type=int,
        default=None,
        metavar="R",
        help="at start: R serving replicas of each training shard (implies --followers; default 1). With --scale "
        "LOG_DIR: give each shard of that launch R replicas now (new ones are called once ready; extra ones drain, "
        "then stop)",
    )
    parser.add_argument(
        "--listen",
        default="127.0.0.1",
        metavar="HOST",
        help="the host (interface) the shards listen on, port 0 each (default 127.0.0.1: this machine only; "
        "0.0.0.0: every interface, for workers on other machines)",
    )
    parser.add_argument(
        "--advertise",
        default=None,
        metavar="HOST",
        help="the host the workers (and ps-launch --join) dial the shards at (default: --listen, or for 0.0.0.0 "
        "this machine's own address); give the name or IP other machines reach this one by",
    )
    parser.add_argument(
        "--shard-arg",
        action="append",
        default=[],
        help="extra ps-server flag, repeatable; {shard} becomes the shard index, e.g. "
        "--shard-arg=--data-dir=/var/ps/shard-{shard} --shard-arg=--memory-budget-bytes=4000000000",
    )
    parser.add_argument(
        "--log-dir",
        type=Path,
        default=None,
        metavar="DIR",
        help="where the shards' logs and port files go, not shard data (default: a temp dir); "
        "give shards a data dir with --shard-arg=--data-dir=DIR/{shard}",
    )
    parser.add_argument("--data-dir", type=Path, default=None, dest="old_log_dir", help=argparse.SUPPRESS)
    parser.add_argument(
        "--restart-shards",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="restart a dead shard on the same address and data dir (default: on when a "
        "--shard-arg gives --data-dir; without one a restarted shard would be empty)",
    )
    split = list(argv).index("--") if "--" in argv else len(argv)
    joining = any(a.split("=")[0] in ("--join", "--scale") for a in argv[:split])
    if split == len(argv) and not joining and not {"-h", "--help"} & set(argv):
        parser.error("missing '-- COMMAND': e.g. ps-launch --shards 2 -- python examples/train_dlrm.py")
    args = parser.parse_args(list(argv[:split]))  # --help prints and exits 0 here
    command = list(argv[split + 1 :])
    if args.scale is not None:
        if split < len(argv) or args.join is not None:
            parser.error("--scale asks a running launch: no '-- COMMAND' or --join with it")
        if (args.to is None) == (args.serving_replicas is None):
            parser.error(
                "--scale needs --to N (the new number of shards) or --serving-replicas R (replicas per serving "
                "shard), one of the two"
            )
        if args.to is not None and args.to < 1:
            parser.error(f"--to {args.to}: the new number of shards must be at least 1")
        if args.serving_replicas is not None and args.serving_replicas < 1:
            parser.error(f"--serving-replicas {args.serving_replicas}: each shard needs at least 1")
        if args.max_rows_per_s < 0:
            parser.error(f"--max-rows-per-s {args.max_rows_per_s:g}: must be >= 0")
        return args, []
    if args.to is not None:
        parser.error("--to goes with --scale LOG_DIR")
    if args.join is not None:
        if split < len(argv):
            parser.error("--join runs the command of the launch it joins: no '-- COMMAND' with it")
        if args.workers < 1:
            parser.error("--workers must be >= 1")
        return args, []
    if not command:
        parser.error("no COMMAND after '--'")
    if args.shards < 1 or args.workers < 1:
        parser.error("--shards and --workers must be >= 1")
    if args.serving_replicas is not None and args.serving_replicas < 1:
        parser.error(f"--serving-replicas {args.serving_replicas}: each shard needs at least 1")
    if args.max_restarts < 0:
        parser.error(f"--max-restarts {args.max_restarts}: must be >= 0")
    low, _, high = args.nnodes.partition(":")
    if not (low.isdigit() and (high or low).isdigit() and 1 <= int(low) <= int(high or low)):
        parser.error(f"--nnodes {args.nnodes}: expected MIN:MAX (or N) with 1 <= MIN <= MAX, e.g. 1:4")
    if args.old_log_dir is not None:
        print(
            "ps-launch: warning: --data-dir is the old name of --log-dir (shard logs and port files, not shard "
            "data; a shard's data dir is --shard-arg=--data-dir=DIR/{shard}): use --log-dir",
            file=sys.stderr,
        )
        if args.log_dir is None:
            args.log_dir = args.old_log_dir
    if args.restart_shards is None:
        args.restart_shards = any(a.startswith("--data-dir") for a in args.shard_arg)
    if command[0] in ("python", "python3"):
        command[0] = sys.executable  # the same interpreter (and venv) as ps-launch
    return args, command


def _check_reachable(cluster: LocalCluster, *, tls: bool) -> None:
    """Raise ``ShardStartError`` when a shard does not answer at the address its workers
    are given (``--advertise``), dialled from here. Shards dialled at the host they listen on,
    shards with TLS and shards that already exited (their restart is the policy's) are not
    checked."""
    if tls or cluster.host == cluster.listen_host:
        return
    for shard in cluster.shards:
        address = shard.address
        with open_channel(address, None, []) as channel:
            check = channel.unary_unary("/grpc.health.v1.Health/Check", None, None)
            try:
                check(b"", timeout=5.0)
            except grpc.RpcError as exc:
                if shard.proc.poll() is not None:
                    continue
                raise ShardStartError(
                    f"the workers would dial {address}, where no shard answers ({exc.code().name}): the shards "
                    f"listen on {cluster.listen_host}; give --advertise a host they are reached at (or --listen 0.0.0.0)"
                ) from None


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``ps-launch``; returns the exit status."""
    configure_logging(logging.INFO)
    args, command = _parse(sys.argv[1:] if argv is None else argv)
    # SIGTERM (a scheduler or `kill`) tears down like Ctrl-C, instead of orphaning everything;
    # raised here, not as a SIGINT, which a launch started in the background ignores.
    interrupt = _Interrupt()
    signal.signal(signal.SIGTERM, interrupt)
    if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
        signal.signal(signal.SIGINT, interrupt)
    if args.join is not None:
        return _join(args.join, args.workers, interrupt)
    if args.scale is not None:
        request = ScaleRequest(args.to or 0, args.max_rows_per_s, replicas=args.serving_replicas or 0)
        return _scale(args.scale, request, interrupt)
    cluster = LocalCluster(
        args.shards, args.log_dir, tuple(args.shard_arg), listen_host=args.listen, advertise_host=args.advertise
    )
    followers: ServingReplicas | None = None
    try:
        cluster.start()
        interrupt.check()
        _check_reachable(cluster, tls=any(a.startswith("--tls-") for a in args.shard_arg))
        if args.followers or args.serving_replicas:
            assert cluster.root is not None
            followers = ServingReplicas(
                cluster.addresses,
                cluster.root / "serving",
                per_shard=args.serving_replicas or 1,
                addresses_file=cluster.root / SERVING_ADDRESSES_FILE,
                listen_host=cluster.listen_host,
                host=cluster.host,
            )
            followers.start()
            interrupt.check()
    except ShardStartError as exc:
        log.error("%s", exc)
        if followers is not None:
            followers.stop(quietly=True)
        return _stop_cluster(cluster, set(), 1)
    except KeyboardInterrupt:
        log.warning("interrupted (SIGINT or SIGTERM) while starting the shards")
        if followers is not None:
            followers.stop(quietly=True)
        return _stop_cluster(cluster, set(), 130)  # nothing to stop if the interrupt reached start
    workers: subprocess.Popen[bytes] | None = None
    status = 1
    reported: set[int] = set()  # shards whose log tail was printed already
    scaler: Scaler | None = None
    try:
        policy, follower_policy = RestartPolicy(), RestartPolicy()
        for s in cluster.shards:
            policy.started(s.index)
        log.info(
            "shards up: %s (restart on failure: %s)",
            ",".join(cluster.addresses),
            "on" if args.restart_shards else "off",
        )
        if followers is not None:
            log.info(
                "serving shards following them: %s (in %s)",
                ",".join("+".join(shard) for shard in followers.addresses),
                followers.addresses_file,
            )
        root = cluster.root if cluster.root is not None else Path(".")
        scaler = Scaler(root, cluster, followers)
        elastic = Elastic(args.nnodes, args.max_restarts, f"ps-launch-{uuid.uuid4().hex[:12]}")
        given = {k: os.environ[k] for k in ("TRAINER_CHECKPOINT_DIR", "OMP_NUM_THREADS") if k in os.environ}
        env = {
            "TRAINER_ADDRESSES": ",".join(cluster.addresses),
            # A restarted group resumes from there; a launch of its own is a run of its own.
            "TRAINER_CHECKPOINT_DIR": str(root / "checkpoints" / elastic.rdzv_id),
            # Each worker writes its pid there as rank-<RANK>.pid (worker.distributed).
            PID_DIR_ENV: str(root.absolute() / "workers"),
            # The shards share this machine: leave them a core. torchrun sets no thread count for a
            # single worker, and torch's spinning OpenMP threads on every core starve the shards
            # (2 cores, DLRM: 1.2K samples/s with 2 torch threads against 11.8K with 1).
            "OMP_NUM_THREADS": str(threads_beside_local_shards(args.workers)),
        } | given
        shutil.rmtree(root / "workers", ignore_errors=True)  # pid files of an earlier launch in this --log-dir
        write_join(root, Join(elastic, command, env))
        workers = subprocess.Popen(
            child_command(torchrun_command(args.workers, command, elastic, host=root / RENDEZVOUS_FILE)),
            env=os.environ | env,
            start_new_session=True,
        )
        log.info(
            "workers: %d, elastic (--nnodes %s, --max-restarts %d); to add workers: ps-launch --join %s --workers N",
            args.workers,
            elastic.nnodes,
            elastic.max_restarts,
            root,
        )
        while True:
            interrupt.check()
            code = workers.poll()
            if code is not None:
                status = code if code >= 0 else 128 - code  # killed by a signal: shell convention
                if code:
                    log.error("workers exited with %s (the failing worker's error is above)", describe_exit(status))
                else:
                    log.info("workers exited with status 0")
                break
            scaler.poll()
            if followers is not None and not scaler.busy and replace_followers(followers, follower_policy):
                _stop(workers)
                break
            dead = [s for s in cluster.shards if s.proc.poll() is not None]
            if dead:
                # Look at every shard again, a moment later: a look that began before two
                # shards died and ended after would see only the second, and a process
                # killed with others may take a moment to exit (a large one gives back
                # its memory first). Shards that died together are restarted together.
                time.sleep(_SETTLE_S)
                dead = [s for s in cluster.shards if s.proc.poll() is not None]
            if dead and args.restart_shards:
                lost = revive(cluster, dead, policy)
                if not lost:
                    continue
                reported.update(lost)  # _revive printed their log tails
                _stop(workers)
                status = 1
                break
            if dead:
                for s in dead:
                    log.error(
                        "shard %d died with %s; stopping the workers (restarts are off: --no-restart-shards, "
                        "or no --data-dir, so it would come back empty). "
                        "Its log (%s):\n%s",
                        s.index,
                        describe_exit(s.proc.returncode),
                        s.log,
                        s.log_tail(),
                    )
                    reported.add(s.index)
                _stop(workers)
                status = 1
                break
            time.sleep(0.2)
    except KeyboardInterrupt:
        log.warning("interrupted (SIGINT or SIGTERM): stopping workers and shards")
        if workers is not None:
            _stop(workers)
        status = 130
    finally:
        if scaler is not None:
            scaler.close()
        if followers is not None:
            try:
                followers.stop()
            except ShardStartError as exc:
                log.error("a serving replica did not stop cleanly: %s", exc)
        status = _stop_cluster(cluster, reported, status)
    return status


def _scale(log_dir: Path, request: ScaleRequest, interrupt: _Interrupt) -> int:
    """``ps-launch --scale``: ask the launch logging to ``log_dir`` to scale; its status."""
    try:
        return request_scale(log_dir, request, print, interrupt.check, timeout_s=_SCALE_WAIT_S)
    except ValueError as exc:
        log.error("%s", exc)
        return 2
    except KeyboardInterrupt:
        log.warning("interrupted: the launch goes on with the scale (LOG_DIR/addresses names the shards once done)")
        return 130


def _join(log_dir: Path, workers: int, interrupt: _Interrupt) -> int:
    """``ps-launch --join``: run ``workers`` more workers of the launch logging to ``log_dir``
    (its command, shards and rendezvous, from its join file); returns their exit status."""
    try:
        join = read_join(log_dir)
    except ValueError as exc:
        log.error("%s", exc)
        return 2
    rendezvous = log_dir / RENDEZVOUS_FILE
    deadline = time.monotonic() + _RENDEZVOUS_WAIT_S
    proc: subprocess.Popen[bytes] | None = None
    try:
        while not rendezvous.exists():  # the launch writes it as its workers start
            interrupt.check()
            if time.monotonic() > deadline:
                log.error(
                    "%s did not appear within %.0f s: has the launch in %s started its workers?",
                    rendezvous,
                    _RENDEZVOUS_WAIT_S,
                    log_dir,
                )
                return 1
            time.sleep(0.1)
        endpoint = rendezvous.read_text().strip()
        env = os.environ | join.env
        env["OMP_NUM_THREADS"] = os.environ.get("OMP_NUM_THREADS", str(threads_beside_local_shards(workers)))
        proc = subprocess.Popen(
            child_command(torchrun_command(workers, join.command, join.elastic, endpoint=endpoint)),
            env=env,
            start_new_session=True,
        )
        log.info("joining %d workers to the launch in %s (rendezvous %s)", workers, log_dir, endpoint)
        while (code := proc.poll()) is None:
            interrupt.check()
            time.sleep(0.2)
    except KeyboardInterrupt:
        log.warning("interrupted (SIGINT or SIGTERM): stopping the workers that joined")
        if proc is not None:
            _stop(proc)
        return 130
    status = code if code >= 0 else 128 - code
    (log.error if status else log.info)("joined workers exited with %s", describe_exit(status))
    return status


class _Interrupt:
    """The SIGTERM/SIGINT handler: raises ``KeyboardInterrupt`` where the signal lands, and
    remembers it for ``check()``, since Python only reports (and drops) an exception raised
    where it cannot propagate, such as the fork hooks that run inside ``subprocess.Popen``.
    Later signals are ignored: the teardown the first one started (workers get 40 s, then
    SIGKILL) runs to its end."""

    def __init__(self) -> None:
        self.seen = False

    def __call__(self, signum: int, frame: object) -> None:
        if self.seen:
            return  # shutting down already: a second signal must not cut the teardown short
        self.seen = True
        raise KeyboardInterrupt

    def check(self) -> None:
        if self.seen:
            raise KeyboardInterrupt


def _stop_cluster(cluster: LocalCluster, reported: set[int], status: int) -> int:
    """Stop every shard; report (once) any that did not exit 0. Returns the final status."""
    unreported = [s for s in cluster.shards if s.index not in reported]
    try:
        cluster.stop()
    except ShardStartError:
        for s in unreported:
            if s.proc.returncode not in (0, None):
                log.error(
                    "shard %d exited with %s at shutdown. Its log (%s):\n%s",
                    s.index,
                    describe_exit(s.proc.returncode),
                    s.log,
                    s.log_tail(),
                )
        return status or 1
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
