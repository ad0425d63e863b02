"""The trainer's command line: its ``--help``, its settings (flags, ``TRAINER_*``
variables, ``--config``) and the line it prints at the end.

Both ``python -m worker.trainer`` (running shards given by ``--addresses``) and
``python -m deploy.train`` (starting shards of its own) parse with ``parse``; their
``--help`` says which they are.

Example:
    >>> parse(["--model=deepfm", "--dim=8"]).model
    'deepfm'
"""

from __future__ import annotations

import os
import sys
import textwrap
from collections.abc import Sequence
from typing import Any

from protos.rpc.logs import configure_logging
from protos.rpc.settings import load_settings
from worker.config import ENV_PREFIX, TrainerConfig

__all__ = ["parse", "report"]


def _description(local_shards: bool, what: str | None = None) -> str:
    if what is None and local_shards:
        what = (
            "Train DLRM or DeepFM with embeddings on parameter-server shards. With no --addresses, "
            "--num-shards shard processes are started on 127.0.0.1 for the run and stopped after it; "
            "with --addresses (or TRAINER_ADDRESSES) the run uses those shards. Under torchrun every "
            "worker trains on its share of the data."
        )
    elif what is None:
        what = (
            "Train DLRM or DeepFM against running parameter-server shards: --addresses (or "
            "TRAINER_ADDRESSES, which ps-launch sets) is required, and --num-shards is ignored. "
            "To have shards started for you, run `python -m deploy.train` (or examples/train_dlrm.py) "
            "with the same flags."
        )
    data = (
        "--data synthetic (the default) trains on a generated Criteo-like stream; a file path trains on the "
        "first --train-fraction of its rows (per --schema) and reports AUC and logloss on the rest. The "
        "dense model, manifest and metrics go to --output-dir (default runs/<UTC time>/, with runs/latest "
        "pointing at the newest)."
    )
    return textwrap.fill(what, 79) + "\n\n" + textwrap.fill(data, 79)


def _prog() -> str:
    main_spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    if main_spec is not None and main_spec.name:
        return f"python -m {main_spec.name.removesuffix('.__main__')}"
    return f"python {sys.argv[0]}" if sys.argv and sys.argv[0] else "trainer"


def parse(
    argv: Sequence[str] | None = None, *, local_shards: bool = True, description: str | None = None
) -> TrainerConfig:
    """The ``TrainerConfig`` from flags, ``TRAINER_*`` variables and ``--config``; exits 2 on a bad setting.

    Configures logging (key=value lines). ``local_shards`` says whether the caller
    starts shards when no addresses are given (``deploy.train``) or requires them
    (``python -m worker.trainer``); ``--help`` describes what the caller does. A caller
    that uses the shard flags its own way says so in ``description`` (the first paragraph
    of ``--help``).
    """
    try:
        config = load_settings(
            TrainerConfig,
            sys.argv[1:] if argv is None else argv,
            os.environ,
            ENV_PREFIX,
            _prog(),
            _description(local_shards, description),
        )
    except ValueError as exc:
        print(f"trainer: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
    configure_logging(config.log_level, rank=os.environ.get("RANK", "0"))
    return config


def report(metrics: dict[str, Any]) -> None:
    """Print the final line: AUC, logloss, throughput, where the run went (rank 0 only has the final metrics)."""
    if metrics.get("final"):
        f = metrics["final"]
        print(
            f"AUC {f['auc']:.4f}  logloss {f['logloss']:.4f}  ({int(f['samples'])} held-out samples, "
            f"{metrics['samples_per_s']:,.0f} samples/s)  -> {metrics.get('output_dir', '?')}"
        )
