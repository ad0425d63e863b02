"""The committed generated code matches ps.proto and infer.proto, and neither sends floats as `repeated`."""

from __future__ import annotations

from pathlib import Path

import pytest
from google.protobuf.descriptor import Descriptor, FieldDescriptor

from protos import infer_pb2
from protos import ps_pb2 as pb
from protos.generate import ROOT, generate

GENERATED = [f"{name}{suffix}" for name in ("ps_pb2", "infer_pb2") for suffix in (".py", ".pyi", "_grpc.py")]


@pytest.fixture(scope="module")
def regenerated(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("generated")
    generate(out)
    return out / "protos"


@pytest.mark.parametrize("name", GENERATED)
def test_generated_code_is_up_to_date(regenerated: Path, name: str) -> None:
    fresh = regenerated / name
    assert fresh.is_file(), f"protoc wrote no {name}"
    committed = ROOT / "protos" / name
    assert fresh.read_bytes() == committed.read_bytes(), (
        f"protos/{name} differs from what its .proto generates: run python -m protos.generate"
    )


def test_generate_writes_exactly_the_committed_files(regenerated: Path) -> None:
    assert sorted(p.name for p in regenerated.iterdir()) == sorted(GENERATED)


def test_generate_raises_on_protoc_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from grpc_tools import protoc

    monkeypatch.setattr(protoc, "main", lambda args: 1)
    with pytest.raises(RuntimeError, match="protoc failed"):
        generate(tmp_path)


def all_messages(descriptors: list[Descriptor]) -> list[Descriptor]:
    out: list[Descriptor] = []
    for d in descriptors:
        out.append(d)
        out += all_messages(list(d.nested_types))
    return out


def test_no_repeated_floats_in_proto() -> None:
    messages = all_messages(
        [*pb.DESCRIPTOR.message_types_by_name.values(), *infer_pb2.DESCRIPTOR.message_types_by_name.values()]
    )
    assert {"LookupResponse", "PushRequest", "TableSpec", "PredictRequest", "Column"} <= {m.name for m in messages}
    float_types = {FieldDescriptor.TYPE_FLOAT, FieldDescriptor.TYPE_DOUBLE}
    offenders = [
        f"{m.full_name}.{f.name}" for m in messages for f in m.fields if f.type in float_types and f.is_repeated
    ]
    assert offenders == [], "floats travel as raw bytes fields, never as repeated float/double"
    # The walk does see float fields and repeated fields, so the check above can fail.
    assert any(f.type in float_types for m in messages for f in m.fields)
    assert any(f.is_repeated for m in messages for f in m.fields)


def test_rows_and_keys_are_bytes_fields() -> None:
    bytes_fields = {
        ("LookupEntry", "keys"),
        ("LookupResult", "rows"),
        ("PushEntry", "keys"),
        ("PushEntry", "grads"),
    }
    for message, field in bytes_fields:
        f = pb.DESCRIPTOR.message_types_by_name[message].fields_by_name[field]
        assert f.type == FieldDescriptor.TYPE_BYTES, (message, field)


def test_predict_values_and_scores_are_bytes_fields() -> None:
    for message, field in (("Column", "values"), ("Column", "lengths"), ("PredictResponse", "scores")):
        f = infer_pb2.DESCRIPTOR.message_types_by_name[message].fields_by_name[field]
        assert f.type == FieldDescriptor.TYPE_BYTES, (message, field)
