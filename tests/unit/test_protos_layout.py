"""``protos/`` holds the wire contract, and only it: the ``.proto`` files and their generated
code, the codecs of keys, rows and Predict columns, key hashing and the row types both
ends agree on bit for bit. The runtime the processes share (server start-up, TLS and
tokens, settings, logging) lives in ``protos/rpc/``, which the contract never imports."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PROTOS = ROOT / "protos"
CONTRACT = {"__init__", "buffers", "columns", "generate", "hashing", "keys", "pbwire", "rowkernels", "rowtypes"}
CONTRACT |= {"services", "wire", "ps_pb2", "ps_pb2_grpc", "infer_pb2", "infer_pb2_grpc"}


def test_protos_holds_the_contract_and_its_runtime_apart() -> None:
    modules = {p.stem for p in PROTOS.glob("*.py")}
    assert modules == CONTRACT, f"not contract: {sorted(modules - CONTRACT)}: runtime belongs in protos/rpc/"
    assert sorted(p.name for p in PROTOS.iterdir() if p.is_dir() and p.name != "__pycache__") == ["rpc"]


def test_the_contract_imports_no_runtime() -> None:
    wrong = []
    for path in sorted(PROTOS.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = (
                [node.module or ""]
                if isinstance(node, ast.ImportFrom)
                else [a.name for a in node.names]
                if isinstance(node, ast.Import)
                else []
            )
            wrong += [f"{path.name} imports {n}" for n in names if n.startswith("protos.rpc")]
    assert wrong == []
