"""Start a program as a child that must not outlive the process that starts it, with no
Python run between ``fork`` and ``exec``.

A process whose other threads are inside gRPC calls must not run code in a forked child
before ``exec`` (a pre-exec function given to ``subprocess.Popen``): gRPC's fork handlers can then hang
the child in ``fork()`` for good, and the parent waits for it forever. So the child
arranges its own fate once it has started: ``child_command(argv)`` is a command line that
runs this file as a script (it imports nothing of the package, and starts in a few
milliseconds), which asks Linux for SIGTERM when its parent dies (``PR_SET_PDEATHSIG``,
kept across ``exec``), exits if that parent is already gone, applies the resource limits
asked for, and then becomes ``argv`` with ``exec``: the pid a launcher holds is the
program's own, and signals sent to it reach the program.

The "parent" is the thread that started the child (Linux sends the signal when that
thread ends): start children from a thread that lives as long as they should. Elsewhere
than Linux the child starts without the signal.

Example:
    >>> cmd = child_command(["sleep", "1"], file_size_limit_bytes=1 << 20)
    >>> cmd[2:5], cmd[-3:]
    (['--file-size-limit-bytes', '1048576', '--parent'], ['--', 'sleep', '1'])
"""

from __future__ import annotations

import ctypes
import os
import resource
import signal
import sys
from collections.abc import Sequence

__all__ = ["child_command", "sigterm_on_parent_death"]

_PR_SET_PDEATHSIG = 1


def child_command(argv: Sequence[str], *, file_size_limit_bytes: int | None = None) -> list[str]:
    """The command line that runs ``argv`` as a child of this process that gets SIGTERM
    when this process (the thread that starts it) dies; ``file_size_limit_bytes``: its soft
    ``RLIMIT_FSIZE`` (writes past it fail with EFBIG, as on a full disk)."""
    limits = [] if file_size_limit_bytes is None else ["--file-size-limit-bytes", str(file_size_limit_bytes)]
    return [sys.executable, os.path.abspath(__file__), *limits, "--parent", str(os.getpid()), "--", *argv]


def sigterm_on_parent_death() -> bool:
    """Ask Linux for SIGTERM when this process's parent (the thread that started it)
    exits; False where that cannot be asked (not Linux)."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
    except OSError:
        return False
    return True


def main(args: Sequence[str]) -> None:
    """``[--file-size-limit-bytes N] --parent PID -- PROGRAM ARGS...``: never returns."""
    args = list(args)
    if "--" not in args or not args[args.index("--") + 1 :]:
        sys.exit(f"usage: {os.path.basename(__file__)} [--file-size-limit-bytes N] --parent PID -- PROGRAM ARGS")
    options, argv = args[: args.index("--")], args[args.index("--") + 1 :]
    settings = dict(zip(options[::2], options[1::2]))
    if sigterm_on_parent_death() and os.getppid() != int(settings["--parent"]):
        sys.exit(1)  # the parent died before the request: nobody would send the signal
    if "--file-size-limit-bytes" in settings:
        hard = resource.getrlimit(resource.RLIMIT_FSIZE)[1]
        resource.setrlimit(resource.RLIMIT_FSIZE, (int(settings["--file-size-limit-bytes"]), hard))
    try:
        os.execvp(argv[0], argv)
    except OSError as exc:
        sys.exit(f"cannot run {argv[0]}: {exc.strerror}")


if __name__ == "__main__":
    main(sys.argv[1:])
