"""``python -m deploy.workers [--rendezvous-file FILE] TORCHRUN_ARGS``: torchrun, elastic, one line per failure.

``ps-launch`` runs its workers through this instead of ``torch.distributed.run`` itself,
which turns any worker failure into exit status 1 and a page-long traceback of its
own. Here the first failing worker's exit status becomes the exit status (128 + N for
signal N), and the failure is summarised in one line: the worker's own traceback is
already above it, and an entry point decorated with torchelastic's ``record`` (as the
trainer's are) puts its error message in that line too.

Elastic on one machine: with ``--rendezvous-file FILE`` this process hosts the c10d
rendezvous store on ``127.0.0.1`` (a port of the kernel's choosing, written to ``FILE``
atomically), and its agent and every agent that joins later (``ps-launch --join``, which
reads ``FILE``) are clients of it: the store lives as long as this launch, whichever
worker dies. A worker that dies makes its agent restart the whole group (at most
``--max-restarts`` times); an agent that joins makes the group restart with it
(``--nnodes MIN:MAX`` bounds the agents). Each restart starts every worker afresh, so
the trainer resumes from its checkpoint (``worker.resume``).

torchrun's agents share their rendezvous store with the workers' process group by
default, and a group restarted by one agent then reads the previous group's addresses
from it (pytorch/pytorch#135712): ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` is set here.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

from torch.distributed import TCPStore  # type: ignore[attr-defined]  # re-exported without __all__
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.run import parse_args, run

from deploy.rendezvous import host_store

__all__ = ["JOIN_FILE", "RENDEZVOUS_FILE", "Elastic", "main", "read_join", "torchrun_command", "write_join"]

JOIN_FILE = "workers.json"  # in ps-launch's log dir: how another agent joins its workers
RENDEZVOUS_FILE = "rendezvous"  # in ps-launch's log dir: the store's 127.0.0.1:PORT
# After the fewest agents joined, how long the rendezvous waits for more: long enough for
# agents started together, short enough that a restart does not wait on it.
LAST_CALL_S = 1


@dataclass(frozen=True)
class Elastic:
    """How ``ps-launch`` runs torchrun: ``nnodes`` (``MIN:MAX`` agents), ``max_restarts``
    of the group after a failure (an agent joining does not count), the rendezvous id."""

    nnodes: str = "1:4"
    max_restarts: int = 3
    rdzv_id: str = "ps-launch"

    def rdzv_args(self, endpoint: str | None) -> list[str]:
        """torchrun's rendezvous flags; ``endpoint`` None: this process hosts it (``--rendezvous-file``)."""
        conf = f"is_host=false,last_call_timeout={LAST_CALL_S}"
        where = [f"--rdzv-endpoint={endpoint}"] if endpoint is not None else []
        return [
            f"--nnodes={self.nnodes}",
            f"--max-restarts={self.max_restarts}",
            "--rdzv-backend=c10d",
            f"--rdzv-id={self.rdzv_id}",
            f"--rdzv-conf={conf}",
            *where,
        ]


@dataclass(frozen=True)
class Join:
    """What ``ps-launch --join`` needs to add workers to a running launch (``JOIN_FILE``)."""

    elastic: Elastic
    command: list[str]
    env: dict[str, str] = field(default_factory=dict)  # TRAINER_ADDRESSES and the like


def torchrun_command(
    workers: int, command: list[str], elastic: Elastic, *, endpoint: str | None = None, host: Path | None = None
) -> list[str]:
    """``python -m deploy.workers ...`` running ``command`` as ``workers`` workers of one agent:
    hosting the rendezvous (its address written to ``host``) or joining the one at ``endpoint``."""
    # torchrun runs "script.py ARGS" or "-m module ARGS" itself; anything else (python -c,
    # other interpreter flags, a non-Python program) runs as given with --no-python.
    python_target = command[0] == sys.executable and len(command) > 1
    if python_target and (command[1] == "-m" or not command[1].startswith("-")):
        target = command[1:]
    else:
        target = ["--no-python", *command]
    hosting = ["--rendezvous-file", str(host)] if host is not None else []
    return [
        sys.executable,
        "-m",
        "deploy.workers",
        *hosting,
        *elastic.rdzv_args(endpoint),
        f"--nproc-per-node={workers}",
        *target,
    ]


def write_join(log_dir: Path, join: Join) -> None:
    """Write ``JOIN_FILE`` in ``log_dir`` atomically."""
    tmp = log_dir / f".{JOIN_FILE}.{os.getpid()}"
    tmp.write_text(json.dumps(asdict(join), indent=2))
    os.replace(tmp, log_dir / JOIN_FILE)


def read_join(log_dir: Path) -> Join:
    """The ``Join`` of the launch whose log dir is ``log_dir``; ``ValueError`` saying what is missing."""
    path = log_dir / JOIN_FILE
    try:
        raw = json.loads(path.read_text())
        return Join(Elastic(**raw["elastic"]), list(raw["command"]), dict(raw["env"]))
    except FileNotFoundError:
        raise ValueError(f"{path} does not exist: is {log_dir} the --log-dir of a running ps-launch?") from None
    except (KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"{path} is not a ps-launch join file ({exc})") from None


def _host_rendezvous(path: Path) -> TCPStore:
    """A rendezvous store on 127.0.0.1 (a free port, no race), its address written to ``path``."""
    store = host_store("127.0.0.1:0")
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    tmp.write_text(f"127.0.0.1:{store.port}\n")
    os.replace(tmp, path)
    return store


def _first_line(message: object, limit: int = 400) -> str:
    if isinstance(message, dict):  # torchelastic's error-file payload
        message = message.get("message", "")
    line = next((x.strip() for x in str(message).splitlines() if x.strip()), "")
    return line if len(line) <= limit else line[: limit - 3] + "..."


def main(argv: Sequence[str] | None = None) -> int:
    """Run torchrun with ``argv``; returns the first failing worker's exit status (0 if none failed)."""
    args = list(sys.argv[1:] if argv is None else argv)
    store = None
    if args[:1] == ["--rendezvous-file"]:
        store = _host_rendezvous(Path(args[1]))
        args = [f"--rdzv-endpoint=127.0.0.1:{store.port}", *args[2:]]
    os.environ.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    try:
        run(parse_args(args))  # type: ignore[no-untyped-call]
    except ChildFailedError as exc:
        rank, failure = exc.get_first_failure()
        code = failure.exitcode if failure.exitcode >= 0 else 128 - failure.exitcode
        message = _first_line(failure.message) if os.path.isfile(failure.error_file) else ""
        how = f"was killed by {failure.signal_name()}" if failure.exitcode < 0 else f"exited with status {code}"
        others = len(exc.failures) - 1
        print(
            f"ps-launch: worker rank {rank} (pid {failure.pid}) {how}"
            + (f": {message}" if message else "")
            + (f" ({others} other workers failed too)" if others > 0 else ""),
            file=sys.stderr,
            flush=True,
        )
        return code or 1
    finally:
        del store  # the rendezvous ends with this launch
    return 0


if __name__ == "__main__":
    sys.exit(main())
