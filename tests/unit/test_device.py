"""Where the trainer puts the dense tower: ``--device`` and ``init_distributed``."""

from __future__ import annotations

import pytest
import torch

from worker.distributed import init_distributed
from worker.trainer import TrainerConfig


def test_an_unknown_device_names_the_field() -> None:
    with pytest.raises(ValueError, match="device='gpu'"):
        TrainerConfig(device="gpu")
    with pytest.raises(ValueError, match="device='tpu'"):
        init_distributed("tpu")


def test_cpu_is_always_there() -> None:
    assert init_distributed("cpu").device == torch.device("cpu")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks a machine without CUDA")
def test_without_cuda() -> None:
    assert init_distributed("auto").device == torch.device("cpu")
    with pytest.raises(RuntimeError, match="no CUDA device"):
        init_distributed("cuda")


def test_more_local_workers_than_gpus_is_refused_before_cuda_is_touched(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)  # a one-GPU machine, as torch would report it
    monkeypatch.setenv("LOCAL_RANK", "1")
    with pytest.raises(
        RuntimeError, match=r"LOCAL_RANK=1 needs a GPU of its own, but this machine has 1.*--device cpu"
    ):
        init_distributed("auto")
    assert init_distributed("cpu").device == torch.device("cpu")


@pytest.mark.gpu
def test_each_local_worker_takes_its_own_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    assert init_distributed("auto").device == torch.device("cuda", 0)
    monkeypatch.setenv("LOCAL_RANK", str(torch.cuda.device_count()))
    with pytest.raises(RuntimeError, match="needs a GPU of its own.*--device cpu"):
        init_distributed("cuda")
    assert init_distributed("cpu").device == torch.device("cpu")  # what the message offers works
