"""``TableSpec``: one embedding table as a shard holds it (name, dim, initial rows,
optimizer, stored types, lifecycle), and its wire form (``ps.v1.TableSpec``).

Example:
    >>> spec = TableSpec("user", 16, optimizer=OptimizerParams(OptimizerKind.ADAGRAD))
    >>> spec_from_proto(spec_to_proto(spec)) == spec, spec.row_format.state_width  # one accumulator per element
    (True, 16)
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from typing import Any

from protos import ps_pb2 as pb
from protos import wire
from protos.rpc.settings import ConfigError
from ps.errors import InvalidRequest
from ps.store import RowFormat, precision
from ps.table import optimizers
from ps.table.initializers import InitializerKind, InitializerParams
from ps.table.lifecycle import Lifecycle
from ps.table.optimizers import OptimizerKind, OptimizerParams

__all__ = ["MAX_DIM", "TableSpec", "spec_from_proto", "spec_to_proto"]

_TABLE_NAME = re.compile(r"[A-Za-z0-9_.:/-]{1,128}")
MAX_DIM = 65536


@dataclass(frozen=True)
class TableSpec:
    """One embedding table: name, row dim, initial rows, optimizer and seed.

    Two specs are the same table only if every field is equal; ``differences`` names
    the ones that are not. Raises ``ConfigError`` for a bad name, dim or seed.

    Example:
        >>> TableSpec("user", 16).differences(TableSpec("user", 32))
        ['dim: 16 != 32']
    """

    name: str
    dim: int
    initializer: InitializerParams = InitializerParams()
    optimizer: OptimizerParams = OptimizerParams()
    seed: int = 0
    storage_dtype: str = "float32"  # values: float32, bfloat16 or float16; int8 on serving shards (ps.store.precision)
    state_dtype: str = "float32"  # optimizer state: float32 or bfloat16
    lifecycle: Lifecycle = Lifecycle()
    serving_default: str = "zeros"  # or "initial": what a serving shard reads for a key without a row

    def __post_init__(self) -> None:
        if self.serving_default not in ("zeros", "initial"):
            raise ConfigError(
                f"table {self.name!r}: serving_default={self.serving_default!r}, expected zeros or initial"
            )
        if not isinstance(self.name, str) or not _TABLE_NAME.fullmatch(self.name):
            raise ConfigError(f"table name {self.name!r}: use 1-128 characters from A-Z a-z 0-9 _ . : / -")
        if not 1 <= self.dim <= MAX_DIM:
            raise ConfigError(f"table {self.name!r}: dim={self.dim}, must be in [1, {MAX_DIM}]")
        if not 0 <= self.seed < 1 << 64:
            raise ConfigError(f"table {self.name!r}: seed={self.seed}, must be in [0, 2**64)")
        if self.storage_dtype not in precision.SERVE_TYPES:  # int8: serving shards only (Shard.create_table)
            raise ConfigError(
                f"table {self.name!r}: storage_dtype={self.storage_dtype!r}, expected one of "
                + ", ".join(precision.STORAGE_TYPES)
            )
        if self.state_dtype not in precision.STATE_TYPES:
            raise ConfigError(
                f"table {self.name!r}: state_dtype={self.state_dtype!r}, expected one of "
                + ", ".join(precision.STATE_TYPES)
                + " (float16 state would overflow the optimizers' accumulators)"
            )

    @property
    def row_format(self) -> RowFormat:
        """How this table's rows are laid out: an 8-bit serving table keeps a scale and a bias
        in place of optimizer state."""
        if self.storage_dtype == precision.INT8:
            return RowFormat(self.dim, 2, precision.INT8, precision.FLOAT32)
        return RowFormat(
            self.dim, optimizers.state_width(self.optimizer, self.dim), self.storage_dtype, self.state_dtype
        )

    def differences(self, other: TableSpec) -> list[str]:
        """``"field: mine != theirs"`` for every field that differs, nested fields dotted."""

        def flat(obj: Any, prefix: str = "") -> dict[str, Any]:
            out: dict[str, Any] = {}
            for f in dataclasses.fields(obj):
                value = getattr(obj, f.name)
                if dataclasses.is_dataclass(value):
                    out.update(flat(value, f"{prefix}{f.name}."))
                else:
                    out[prefix + f.name] = value
            return out

        mine, theirs = flat(self), flat(other)
        return [f"{k}: {_show(mine[k])} != {_show(theirs[k])}" for k in mine if mine[k] != theirs[k]]


_INIT_FIELDS = ("low", "high", "mean", "std", "value")
_OPT_FIELDS = (
    "lr",
    "weight_decay",
    "eps",
    "initial_accumulator_value",
    "beta1",
    "beta2",
    "l1",
    "l2",
    "lr_power",
    "beta",
)


def spec_from_proto(msg: pb.TableSpec) -> TableSpec:
    """A validated ``TableSpec``; absent optional fields take their defaults.

    Raises ``InvalidRequest`` naming the bad field.
    """
    try:
        init_kw: dict[str, Any] = {f: getattr(msg.initializer, f) for f in _INIT_FIELDS if msg.initializer.HasField(f)}
        init_kind = msg.initializer.kind or InitializerKind.UNIFORM
        opt_kw: dict[str, Any] = {f: getattr(msg.optimizer, f) for f in _OPT_FIELDS if msg.optimizer.HasField(f)}
        opt_kind = msg.optimizer.kind or OptimizerKind.SGD
        lc = msg.lifecycle
        lifecycle = Lifecycle(
            admit_after=lc.admit_after,
            admit_probability=lc.admit_probability if lc.HasField("admit_probability") else 1.0,
            ttl_seconds=lc.ttl_seconds,
            evict_below_frequency=lc.evict_below_frequency,
        )
        storage_dtype = precision.from_wire(msg.dtype)
        state_dtype = precision.from_wire(msg.state_dtype)
        if storage_dtype is None:
            raise InvalidRequest(f"table {msg.name!r}: dtype {msg.dtype}: expected FLOAT32, BFLOAT16 or FLOAT16")
        if state_dtype is None or state_dtype not in precision.STATE_TYPES:
            raise InvalidRequest(
                f"table {msg.name!r}: state_dtype {wire.dtype_name(msg.state_dtype) if state_dtype else msg.state_dtype}:"
                " expected FLOAT32 or BFLOAT16 (float16 state would overflow the optimizers' accumulators)"
            )
        return TableSpec(
            name=msg.name,
            dim=msg.dim,
            initializer=InitializerParams(InitializerKind(init_kind), **init_kw),
            optimizer=OptimizerParams(OptimizerKind(opt_kind), **opt_kw),
            seed=msg.seed,
            storage_dtype=storage_dtype,
            state_dtype=state_dtype,
            lifecycle=lifecycle,
            serving_default="initial" if msg.serving_default == pb.INITIAL else "zeros",
        )
    except (ConfigError, ValueError) as exc:
        raise InvalidRequest(f"spec of table {msg.name!r}: {exc}") from None


def spec_to_proto(spec: TableSpec) -> pb.TableSpec:
    """The wire form of ``spec`` with every field set explicitly."""
    init = spec.initializer
    opt = spec.optimizer
    return pb.TableSpec(
        name=spec.name,
        dim=spec.dim,
        dtype=precision.to_wire(spec.storage_dtype),
        state_dtype=precision.to_wire(spec.state_dtype),
        seed=spec.seed,
        initializer=pb.InitializerSpec(kind=init.kind.name, **{f: getattr(init, f) for f in _INIT_FIELDS}),
        optimizer=pb.OptimizerSpec(kind=opt.kind.name, **{f: getattr(opt, f) for f in _OPT_FIELDS}),
        lifecycle=pb.Lifecycle(
            admit_after=spec.lifecycle.admit_after,
            admit_probability=spec.lifecycle.admit_probability,
            ttl_seconds=spec.lifecycle.ttl_seconds,
            evict_below_frequency=spec.lifecycle.evict_below_frequency,
        ),
        serving_default=pb.INITIAL if spec.serving_default == "initial" else pb.ZEROS,
    )


def _show(value: Any) -> str:
    return getattr(value, "name", None) or repr(value)
