"""Table specs between their Python and wire forms, and Stats replies as dicts.

``table_spec`` builds the ``pb.TableSpec`` that ``PSClient.create_table`` sends from its
keyword arguments; ``table_config`` reads a spec a shard returned into a ``TableConfig``.

Example:
    >>> spec = table_spec("user", 8, optimizer="adagrad", lr=0.05)
    >>> table_config(spec).optimizer, round(spec.optimizer.lr, 3)
    ('adagrad', 0.05)
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
from google.protobuf.message import Message

from client.config import TableConfig
from client.errors import InvalidRequestError
from protos import ps_pb2 as pb

__all__ = ["message_dict", "table_config", "table_spec"]

_OPTIMIZERS = {k.lower(): v for k, v in pb.OptimizerSpec.Kind.items() if v}
_INITIALIZERS = {k.lower(): v for k, v in pb.InitializerSpec.Kind.items() if v}
_OPT_FIELDS = [f for f in pb.OptimizerSpec.DESCRIPTOR.fields_by_name if f != "kind"]
_INIT_FIELDS = [f for f in pb.InitializerSpec.DESCRIPTOR.fields_by_name if f != "kind"]
_LIFECYCLE_FIELDS: dict[str, Any] = {
    "admit_after": int,
    "admit_probability": float,
    "ttl_seconds": float,
    "evict_below_frequency": int,
}


_SERVING_DEFAULTS = {k.lower(): v for k, v in pb.ServingDefault.items() if v}
_STORAGE_TYPES = {"float32": pb.FLOAT32, "bfloat16": pb.BFLOAT16, "float16": pb.FLOAT16}
_STATE_TYPES = {"float32": pb.FLOAT32, "bfloat16": pb.BFLOAT16}
_TYPE_NAMES = {v: k for k, v in _STORAGE_TYPES.items()} | {pb.DTYPE_UNSPECIFIED: "float32"}


def table_spec(
    name: str,
    dim: int,
    *,
    optimizer: str | None = None,
    initializer: str | None = None,
    seed: int = 0,
    serving_default: str | None = None,
    storage_dtype: str = "float32",
    state_dtype: str = "float32",
    **params: float,
) -> pb.TableSpec:
    """The spec ``create_table`` sends; ``TypeError`` for an unknown option,
    ``InvalidRequestError`` for an unknown optimizer, initializer, serving default or
    storage type."""
    spec = pb.TableSpec(name=name, dim=dim, seed=seed)
    spec.dtype = _choice("storage_dtype", storage_dtype, _STORAGE_TYPES)  # type: ignore[assignment]
    spec.state_dtype = _choice("state_dtype", state_dtype, _STATE_TYPES)  # type: ignore[assignment]
    if serving_default is not None:
        spec.serving_default = _choice("serving_default", serving_default, _SERVING_DEFAULTS)  # type: ignore[assignment]
    if optimizer is not None:
        spec.optimizer.kind = _choice("optimizer", optimizer, _OPTIMIZERS)  # type: ignore[assignment]
    if initializer is not None:
        spec.initializer.kind = _choice("initializer", initializer, _INITIALIZERS)  # type: ignore[assignment]
    for key, value in params.items():
        if key in _OPT_FIELDS:
            setattr(spec.optimizer, key, float(value))
        elif key in _INIT_FIELDS:
            setattr(spec.initializer, key, float(value))
        elif key in _LIFECYCLE_FIELDS:
            setattr(spec.lifecycle, key, _LIFECYCLE_FIELDS[key](value))
        else:
            valid = ", ".join((*_OPT_FIELDS, *_INIT_FIELDS, *_LIFECYCLE_FIELDS))
            raise TypeError(f"create_table: unknown option {key!r}; valid: {valid}")
    return spec


def table_config(spec: pb.TableSpec) -> TableConfig:
    """A shard's table spec as a ``TableConfig``, every default filled in."""
    return TableConfig(
        name=spec.name,
        dim=spec.dim,
        seed=spec.seed,
        initializer=pb.InitializerSpec.Kind.Name(spec.initializer.kind).lower(),
        optimizer=pb.OptimizerSpec.Kind.Name(spec.optimizer.kind).lower(),
        initializer_params={f: getattr(spec.initializer, f) for f in _INIT_FIELDS},
        optimizer_params={f: getattr(spec.optimizer, f) for f in _OPT_FIELDS},
        serving_default="initial" if spec.serving_default == pb.INITIAL else "zeros",
        storage_dtype=_TYPE_NAMES.get(spec.dtype, str(spec.dtype)),
        state_dtype=_TYPE_NAMES.get(spec.state_dtype, str(spec.state_dtype)),
    )


def message_dict(msg: Message) -> dict[str, Any]:
    """Every field of ``msg`` (zeros included, integers as ``int``), nested messages as
    dicts; a ``Histogram``'s bounds (float64 bytes on the wire) as a list of floats."""
    if isinstance(msg, pb.Histogram):
        return {
            "le": np.frombuffer(msg.le, "<f8").tolist(),
            "counts": list(msg.counts),
            "sum": msg.sum,
            "recent": list(msg.recent),
        }
    out: dict[str, Any] = {}
    for f in msg.DESCRIPTOR.fields:
        value = getattr(msg, f.name)
        if f.message_type is not None:
            value = [message_dict(v) for v in value] if f.is_repeated else message_dict(value)
        elif f.is_repeated:
            value = list(value)
        out[f.name] = value
    return out


def _choice(field: str, value: str, choices: Mapping[str, int]) -> int:
    try:
        return choices[value.lower()]
    except KeyError:
        raise InvalidRequestError(f"{field}={value!r}: expected one of {', '.join(choices)}") from None
