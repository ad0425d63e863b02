"""Regenerate ``<name>_pb2.py``, ``<name>_pb2.pyi`` and ``<name>_pb2_grpc.py`` from each ``.proto``.

The protos are ``ps.proto`` (the shards' service) and ``infer.proto`` (the predictor's).
Run from anywhere: ``python -m protos.generate``. The generated files are committed;
``tests/unit/test_protos.py`` regenerates them into a temporary folder and fails on
any difference, so edit a ``.proto`` and rerun this instead of editing them by hand.
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROTOS = ("ps.proto", "infer.proto")


def generate(out_dir: Path) -> None:
    """Write the generated modules under ``out_dir/protos/``.

    Raises ``RuntimeError`` when protoc reports an error.
    """
    from grpc_tools import protoc  # build-time tool, not a runtime dependency

    (out_dir / "protos").mkdir(parents=True, exist_ok=True)
    args = [
        "protoc",
        f"-I{ROOT}",
        f"--python_out={out_dir}",
        f"--pyi_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        *(str(ROOT / "protos" / name) for name in PROTOS),
    ]
    if protoc.main(args) != 0:
        raise RuntimeError(f"protoc failed: {' '.join(args)}")


if __name__ == "__main__":
    generate(ROOT)
    sys.exit(0)
