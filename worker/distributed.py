"""This process's place in a training job: ``Dist`` (rank, world size, device) and
``init_distributed``, which joins the torchrun job (gloo on CPU, nccl on CUDA).

Example:
    >>> init_distributed("cpu")
    Dist(rank=0, world=1, device=device(type='cpu'))
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

__all__ = ["DeviceError", "Dist", "init_distributed"]


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
    if world == 1:
        return Dist(device=torch.device("cuda", local_rank) if cuda else torch.device("cpu"))
    if not dist.is_initialized():
        dist.init_process_group("nccl" if cuda else "gloo")
    return Dist(dist.get_rank(), world, torch.device("cuda", local_rank) if cuda else torch.device("cpu"))
