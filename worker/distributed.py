"""This process's place in a training job: ``Dist`` (rank, world size, device) and
``init_distributed``, which joins the torchrun job (gloo on CPU, nccl on CUDA).

Under ``ps-launch`` (which sets ``PS_WORKER_PID_DIR``) each worker also writes its pid to
``LOG_DIR/workers/rank-<RANK>.pid`` as it joins, and removes it when it exits normally:
``kill -9 "$(cat LOG_DIR/workers/rank-1.pid)"`` stops exactly that launch's worker 1.

Example:
    >>> init_distributed("cpu")
    Dist(rank=0, world=1, device=device(type='cpu'))
"""

from __future__ import annotations

import atexit
import contextlib
import os
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist

__all__ = ["PID_DIR_ENV", "DeviceError", "Dist", "init_distributed"]

PID_DIR_ENV = "PS_WORKER_PID_DIR"  # where a worker writes rank-<RANK>.pid (ps-launch sets it)


@dataclass
class Dist:
    """This process's place in the job: rank, world size, and the device it trains on."""

    rank: int = 0
    world: int = 1
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))


class DeviceError(RuntimeError):
    """``--device`` asks for what this machine does not have; the message says what to pass instead."""


def init_distributed(device: str = "auto") -> Dist:
    """Join the torchrun job (gloo on CPU, nccl with CUDA) if there is one; idempotent.

    ``device``: ``"cuda"``, ``"cpu"`` or ``"auto"`` (CUDA when there is a device). On CUDA each
    worker of a machine takes the GPU of its ``LOCAL_RANK``, so a machine runs at most one
    worker per GPU; more is an error that says so, not a crash inside CUDA.
    """
    if device not in ("auto", "cpu", "cuda"):
        raise ValueError(f"device={device!r}: expected auto, cpu or cuda")
    world, local_rank = int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("LOCAL_RANK", "0"))
    gpus = torch.cuda.device_count() if device != "cpu" else 0
    if device == "cuda" and gpus == 0:
        raise DeviceError(
            "--device cuda: torch sees no CUDA device (a CPU build of torch, or no GPU visible): "
            "pass --device cpu, or --device auto to use a GPU when there is one"
        )
    cuda = gpus > 0
    if cuda and local_rank >= gpus:
        raise DeviceError(
            f"worker LOCAL_RANK={local_rank} needs a GPU of its own, but this machine has {gpus}: start at most "
            f"{gpus} worker{'s' if gpus > 1 else ''} per machine (ps-launch --workers {gpus}), or train on CPU "
            "(--device cpu)"
        )
    if cuda:
        torch.cuda.set_device(local_rank)  # streams and allocations that name no device land there
    if os.environ.get(PID_DIR_ENV):
        _write_pid(Path(os.environ[PID_DIR_ENV]) / f"rank-{os.environ.get('RANK', '0')}.pid")
    if world == 1:
        return Dist(device=torch.device("cuda", local_rank) if cuda else torch.device("cpu"))
    if not dist.is_initialized():
        dist.init_process_group("nccl" if cuda else "gloo")
    return Dist(dist.get_rank(), world, torch.device("cuda", local_rank) if cuda else torch.device("cpu"))


def _write_pid(path: Path) -> None:
    """This process's pid in ``path`` (replaced whole), removed at a normal exit unless a
    newer worker of the same rank wrote its own since."""
    path.parent.mkdir(parents=True, exist_ok=True)
    temp = path.with_name(f".{path.name}.{os.getpid()}")
    temp.write_text(f"{os.getpid()}\n")
    temp.replace(path)

    def remove() -> None:
        with contextlib.suppress(OSError):
            if path.read_text().strip() == str(os.getpid()):
                path.unlink()

    atexit.register(remove)
