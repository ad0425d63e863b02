"""Regenerate ``ps_pb2.py``, ``ps_pb2.pyi`` and ``ps_pb2_grpc.py`` from ``ps.proto``.

Run from anywhere: ``python -m protos.generate``. The generated files are committed;
``tests/unit/test_protos.py`` regenerates them into a temporary folder and fails on
any difference, so edit ``ps.proto`` and rerun this instead of editing them by hand.
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


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
        str(ROOT / "protos" / "ps.proto"),
    ]
    if protoc.main(args) != 0:
        raise RuntimeError(f"protoc failed: {' '.join(args)}")


if __name__ == "__main__":
    generate(ROOT)
    sys.exit(0)
