"""Verdicts on adversarial requests: is a request valid, and which statuses may it get?

A verdict is made from the request bytes alone (decoded with the generated protobuf
classes, independently of the servers' own decoders) and what the test knows of the
server: its tables, mode and checkpoint root. ``valid=True``: the request is correct and
must succeed; ``False``: it is wrong and must be refused with one of ``codes`` (never
OK); ``None``: the oracle cannot tell (rules it does not model), so any answer but a
bug's (UNKNOWN, and INTERNAL from our own services) is accepted.

Example:
    >>> model = ShardModel("train", {"emb": 8}, max_message_bytes=1 << 20, checkpoint_root=Path("/tmp/x"))
    >>> shard_verdict(model, "Lookup", b"\\xff").codes
    frozenset({'INVALID_ARGUMENT'})
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any

import grpc
import numpy as np
from google.protobuf.message import DecodeError, Message
from grpc_health.v1 import health_pb2
from grpc_reflection.v1alpha import reflection_pb2

from protos import infer_pb2 as ipb
from protos import ps_pb2 as pb

__all__ = [
    "ALL_CODES",
    "ShardModel",
    "Verdict",
    "health_verdict",
    "predict_verdict",
    "reflection_verdict",
    "shard_verdict",
]

ALL_CODES = frozenset(c.name for c in grpc.StatusCode)
_TABLE_NAME = re.compile(r"[A-Za-z0-9_.:/-]{1,128}")
_MAX_DIM = 65536
_RESPONSE_OVERHEAD_BYTES = 4096  # ps.shard keeps this much of max_message_bytes for the response's framing
_ITEMSIZE = {0: 4, 1: 4, 2: 2, 3: 2}


@dataclass(frozen=True)
class Verdict:
    valid: bool | None
    codes: frozenset[str]
    why: str


def _valid(why: str = "valid", codes: Iterable[str] = ("OK",)) -> Verdict:
    return Verdict(True, frozenset(codes), why)


def _invalid(problems: list[tuple[str, tuple[str, ...]]]) -> Verdict:
    return Verdict(False, frozenset(c for _, codes in problems for c in codes), "; ".join(w for w, _ in problems))


def _unsure(why: str, ours: bool = True) -> Verdict:
    return Verdict(None, ALL_CODES - {"UNKNOWN", "INTERNAL"} if ours else ALL_CODES - {"UNKNOWN"}, why)


def _decode(cls: type[Message], data: bytes) -> Any:
    try:
        return cls.FromString(data)
    except DecodeError:
        return None


@dataclass
class ShardModel:
    """What the oracle knows of one shard (``index`` of ``num_shards``)."""

    mode: str  # "train" or "serve"
    tables: dict[str, int]  # name -> dim
    max_message_bytes: int
    checkpoint_root: Path
    index: int = 0
    num_shards: int = 1
    max_tables: int | None = None  # the shard's --max-tables
    creates: set[bytes] = field(default_factory=set)  # CreateTable request bytes known to succeed
    # Tables that may or may not be there (name -> dim): on a serving shard, those its training
    # shard created lately (copied when the next change batch comes, absent from older checkpoints).
    maybe_tables: dict[str, int] = field(default_factory=dict)


Problems = list[tuple[str, tuple[str, ...]]]
_IA, _FP, _RE = ("INVALID_ARGUMENT",), ("FAILED_PRECONDITION",), ("RESOURCE_EXHAUSTED",)
_NF = ("NOT_FOUND", "INVALID_ARGUMENT")  # an unknown table, or a name no table could have


def _route(model: ShardModel, num_shards: int, shard: int | None, epoch: int = 0) -> Problems:
    problems: Problems = []
    if epoch > 0:  # the shards under test never reshard: their cluster map stays at epoch 0
        return [(f"routed by the cluster map of epoch {epoch}", _FP)]
    if shard is not None and shard != model.index:
        problems.append((f"routed to shard {shard}", _FP))
    if num_shards and num_shards != model.num_shards:
        problems.append((f"routed for num_shards={num_shards}", _FP))
    return problems


def _table(model: ShardModel, name: str, i: int) -> tuple[int | None, Problems]:
    if not name:
        return None, [(f"entries[{i}]: empty table name", _IA)]
    if name not in model.tables and name not in model.maybe_tables:
        return None, [(f"entries[{i}]: unknown table {name[:40]!r}", _NF)]
    return model.tables.get(name, model.maybe_tables.get(name)), []


def _grads(data: bytes, dtype: int) -> np.ndarray[Any, Any]:
    if dtype in (0, 1):
        return np.frombuffer(data, "<f4")
    if dtype == 2:
        return np.frombuffer(data, "<f2")
    return (np.frombuffer(data, "<u2").astype(np.uint32) << 16).view(np.float32)


def _lookup(model: ShardModel, m: pb.LookupRequest, data: bytes) -> Verdict:
    problems = _route(model, m.num_shards, m.shard if m.HasField("shard") else None, m.epoch)
    total = 0
    for i, e in enumerate(m.entries):
        dim, bad = _table(model, e.table, i)
        problems += bad
        if dim is None:
            continue
        if len(e.keys) % 8:
            problems.append((f"entries[{i}].keys: {len(e.keys)} bytes", _IA))
        elif e.dtype not in _ITEMSIZE:
            problems.append((f"entries[{i}].dtype {e.dtype}", _IA))
        else:
            total += len(e.keys) // 8 * dim * _ITEMSIZE[e.dtype]
    limit = model.max_message_bytes - _RESPONSE_OVERHEAD_BYTES
    if total > limit + 4096:
        problems.append((f"response of {total} bytes", _RE))
    maybe = [e.table for e in m.entries if e.table in model.maybe_tables and e.table not in model.tables]
    if problems:
        return _invalid(problems + ([("a table that may not be there yet", ("NOT_FOUND",))] if maybe else []))
    if maybe:
        return _unsure(f"table {maybe[0][:40]!r} may not be there yet")
    return _valid() if total < limit - 4096 else _unsure(f"response of {total} bytes, at the limit")


def _push(model: ShardModel, m: pb.PushRequest, data: bytes) -> Verdict:
    problems = _route(model, m.num_shards, m.shard if m.HasField("shard") else None, m.epoch)
    if not problems and m.HasField("planned_epoch"):
        return _unsure("a push routed again after a reshard these shards never had (planned_epoch)")
    if model.mode != "train":
        problems.append(("push to a serving shard", _FP))
    for i, e in enumerate(m.entries):
        dim, bad = _table(model, e.table, i)
        problems += bad
        if dim is None:
            continue
        if len(e.keys) % 8:
            problems.append((f"entries[{i}].keys: {len(e.keys)} bytes", _IA))
        elif e.dtype not in _ITEMSIZE:
            problems.append((f"entries[{i}].dtype {e.dtype}", _IA))
        elif len(e.grads) != len(e.keys) // 8 * dim * _ITEMSIZE[e.dtype]:
            problems.append((f"entries[{i}].grads: {len(e.grads)} bytes for {len(e.keys) // 8} keys x dim {dim}", _IA))
        elif not np.isfinite(_grads(e.grads, e.dtype)).all():
            problems.append((f"entries[{i}].grads: NaN or Inf", _IA))
    return _invalid(problems) if problems else _valid()


_INIT_FLOATS = ("low", "high", "mean", "std", "value")
_OPT_FLOATS = (
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


def _create(model: ShardModel, m: pb.CreateTableRequest, data: bytes) -> Verdict:
    s = m.spec
    problems: Problems = []
    if model.mode != "train":  # the spec is checked first, by rules the oracle does not all know
        problems.append(("CreateTable on a serving shard", ("FAILED_PRECONDITION", "INVALID_ARGUMENT")))
    if not _TABLE_NAME.fullmatch(s.name):
        problems.append((f"table name {s.name[:40]!r}", _IA))
    if not 1 <= s.dim <= _MAX_DIM:
        problems.append((f"dim {s.dim}", _IA))
    if s.dtype not in (0, 1):
        problems.append((f"dtype {s.dtype}", _IA))
    if s.initializer.kind not in range(5) or s.optimizer.kind not in range(5):
        problems.append((f"initializer kind {s.initializer.kind}, optimizer kind {s.optimizer.kind}", _IA))
    if s.serving_default not in range(3):
        problems.append((f"serving_default {s.serving_default}", _IA))
    for part, names in ((s.initializer, _INIT_FLOATS), (s.optimizer, _OPT_FLOATS)):
        for name in names:
            if part.HasField(name) and not math.isfinite(getattr(part, name)):
                problems.append((f"{name}={getattr(part, name)}", _IA))
    if s.optimizer.HasField("lr") and not s.optimizer.lr > 0:
        problems.append((f"lr={s.optimizer.lr}", _IA))
    lc = s.lifecycle
    if lc.admit_after > 255:
        problems.append((f"admit_after={lc.admit_after}", _IA))
    if lc.HasField("admit_probability") and not 0 < lc.admit_probability <= 1:
        problems.append((f"admit_probability={lc.admit_probability}", _IA))
    if not (math.isfinite(lc.ttl_seconds) and lc.ttl_seconds >= 0):
        problems.append((f"ttl_seconds={lc.ttl_seconds}", _IA))
    if problems:
        return _invalid(problems)
    if data in model.creates:
        return _valid("the request that created the table")
    if s.name not in model.tables and model.max_tables is not None and len(model.tables) >= model.max_tables:
        # The spec is checked first, by rules beyond the oracle's.
        return _invalid([(f"a table past --max-tables={model.max_tables}", ("RESOURCE_EXHAUSTED", "INVALID_ARGUMENT"))])
    if s.name in model.tables and s.dim != model.tables[s.name]:
        return _invalid([(f"table {s.name!r} exists with dim {model.tables[s.name]}", ("ALREADY_EXISTS",))])
    return _unsure("a table spec (rules beyond the oracle's: optimizer ranges, table limit)")


def _checkpoint_path(root: Path, path: str, new: bool, part: str = "") -> Problems:
    """Problems of ``path`` as a checkpoint to write (``new``: the shard writes its ``part``
    inside it, so ``path`` may exist as a plain directory) or to read, under ``root``."""
    problems: Problems = []
    if "\0" in path:
        problems.append(("path with a NUL byte", _IA))
    elif len(os.fsencode(path)) > 4096:
        problems.append(("path over PATH_MAX", _IA))
    elif ".." in PurePosixPath(path).parts:
        problems.append(("path with '..'", _IA))
    elif any(len(os.fsencode(p)) > 255 for p in PurePosixPath(path).parts):
        problems.append(("path component over NAME_MAX", _IA))
    elif path.startswith("/") and not Path(path).is_relative_to(root):
        problems.append(("absolute path outside the root", _IA))
    elif new and path and os.path.lexists(root / path):
        target = root / path
        if not target.is_dir() or (target / "db").is_dir() or os.path.lexists(target / part):
            problems.append(("path exists", _IA))
    return problems


def _checkpoint(model: ShardModel, m: pb.CheckpointRequest, data: bytes) -> Verdict:
    if model.mode != "train":
        return _invalid([("Checkpoint on a serving shard", _FP)])
    part = f"shard-{model.index:05d}-of-{model.num_shards:05d}"
    problems = _checkpoint_path(model.checkpoint_root, m.path, new=True, part=part)
    if problems:
        return _invalid(problems)
    if not m.path or re.fullmatch(r"[A-Za-z0-9_.-]{1,64}", m.path) and m.path not in (".", ".."):
        return _valid("a new checkpoint")
    return _unsure("a checkpoint path the oracle does not model")


def _follow(model: ShardModel, m: pb.FollowRequest, data: bytes) -> Verdict:
    if model.mode != "train":
        return _unsure("Follow on a serving shard")
    if m.shard != model.index or m.num_shards != model.num_shards:
        return _invalid([(f"follower of shard {m.shard} of {m.num_shards}", _FP)])
    return _valid() if not m.history else _unsure("a history the oracle does not know")


def _serve_from(model: ShardModel, m: pb.ServeFromRequest, data: bytes) -> Verdict:
    if model.mode == "train":
        return _invalid([("ServeFrom on a training shard", _FP)])
    if not m.checkpoint:
        return _valid("unpin")
    problems = _checkpoint_path(model.checkpoint_root, m.checkpoint, new=False)
    if problems:
        return _invalid(problems)
    name = f"{int(m.checkpoint):06d}" if m.checkpoint.isascii() and m.checkpoint.isdigit() else m.checkpoint
    target = model.checkpoint_root / name
    part = target / f"shard-{model.index:05d}-of-{model.num_shards:05d}"  # this shard's part of checkpoint `name`
    if not any((t / "db").is_dir() and (t / "manifest.json").is_file() for t in (part, target)):
        return _invalid([(f"no checkpoint at {name[:60]!r}", ("INVALID_ARGUMENT", "NOT_FOUND"))])
    return _unsure("an existing checkpoint")


def _erase(model: ShardModel, m: pb.EraseRequest, data: bytes) -> Verdict:
    problems = _route(model, m.num_shards, m.shard if m.HasField("shard") else None, m.epoch)
    if not m.table:
        problems.append(("empty table name", _IA))
    elif m.table not in model.tables and m.table not in model.maybe_tables:
        problems.append((f"unknown table {m.table[:40]!r}", _NF))
    if len(m.keys) % 8:
        problems.append((f"keys: {len(m.keys)} bytes", _IA))
    if len(m.others) % 8:
        problems.append((f"others: {len(m.others)} bytes", _IA))
    if problems:
        return _invalid(problems)
    if m.table in model.maybe_tables and m.table not in model.tables:
        return _unsure(f"table {m.table[:40]!r} may not be there yet")
    if m.verify:
        return _valid()
    if model.mode == "serve" and not m.served:
        return _invalid([("an erase without served=true on a serving shard", _FP)])
    if model.mode == "train" and m.served:
        return _invalid([("served=true on a training shard", _IA)])
    return _unsure("an erase (the fuzz sends only those that ask)")


_SHARD_CHECKS: Mapping[str, tuple[type[Message], Callable[[ShardModel, Any, bytes], Verdict]]] = {
    "CreateTable": (pb.CreateTableRequest, _create),
    "ListTables": (pb.ListTablesRequest, lambda model, m, data: _valid()),
    "Lookup": (pb.LookupRequest, _lookup),
    "Push": (pb.PushRequest, _push),
    "Stats": (pb.StatsRequest, lambda model, m, data: _valid()),
    "Checkpoint": (pb.CheckpointRequest, _checkpoint),
    "Follow": (pb.FollowRequest, _follow),
    "ServeFrom": (pb.ServeFromRequest, _serve_from),
    "Erase": (pb.EraseRequest, _erase),
}


def shard_verdict(model: ShardModel, method: str, data: bytes) -> Verdict:
    """The verdict on ``data`` sent to ``/ps.v1.ParameterServer/<method>`` of the shard ``model`` describes."""
    cls, check = _SHARD_CHECKS[method]
    message = _decode(cls, data)
    if message is None:
        return _invalid([("does not decode", _IA)])
    return check(model, message, data)


def health_verdict(services: Iterable[str], data: bytes, watch: bool) -> Verdict:
    """Health ``Check`` (``watch``: ``Watch``) of ``data``; ``services``: those registered."""
    m = _decode(health_pb2.HealthCheckRequest, data)
    if m is None:
        return _invalid([("the request does not decode", ("INVALID_ARGUMENT",))])
    if m.service in services or watch:  # Watch answers SERVICE_UNKNOWN in its first message
        return _valid()
    return _invalid([(f"unknown service {m.service[:40]!r}", ("NOT_FOUND",))])


def reflection_verdict(messages: Iterable[bytes]) -> Verdict:
    """A ``ServerReflectionInfo`` stream of ``messages``: errors travel inside its answers."""
    decoded = [_decode(reflection_pb2.ServerReflectionRequest, d) for d in messages]
    if any(m is None for m in decoded):
        return _invalid([("a request does not decode", ("INVALID_ARGUMENT",))])
    if all(m.WhichOneof("message_request") is not None for m in decoded):
        return _valid()
    return _unsure("a reflection request naming no question", ours=False)


_NUMBER = re.compile(rb"[+-]?[0-9]{1,15}(\.[0-9]{1,15})?")
_NUMBERISH = frozenset(b"0123456789+-.eE_ \t\n\r\x0b\x0cinfatyINFATY")


def _column(c: ipb.Column, count: int, accepts: tuple[str, ...], dense: bool) -> tuple[str | None, bool]:
    """(problem, sure): what is wrong with column ``c``, if anything."""
    kinds = {ipb.VALUE_TYPE_STRING: "string", ipb.VALUE_TYPE_INT64: "int64", ipb.VALUE_TYPE_FLOAT64: "float64"}
    kind = kinds.get(c.type)
    if kind is None:
        return f"type {c.type}", True
    if kind != "string":
        if c.lengths or len(c.values) % 8:
            return "lengths or a byte count not a multiple of 8", True
        n = len(c.values) // 8
    else:
        if len(c.lengths) % 4:
            return "lengths not a multiple of 4", True
        lengths = np.frombuffer(c.lengths, "<i4")
        if (lengths < 0).any() or int(lengths.sum(dtype=np.int64)) != len(c.values):
            return "lengths do not add up", True
        n = lengths.shape[0]
    if kind not in accepts:
        return f"{kind} values", True
    if n != count:
        return f"{n} values, expected {count}", True
    if dense and kind == "float64":
        values = np.frombuffer(c.values, "<f8")
        if np.isinf(values).any():
            return "an infinite dense value", True
    if dense and kind == "string":
        ends = np.cumsum(np.frombuffer(c.lengths, "<i4"), dtype=np.int64)
        for lo, hi in zip(np.concatenate([[0], ends[:-1]]), ends):
            text = c.values[lo:hi]
            if not text or _NUMBER.fullmatch(text):
                continue
            if not set(text) <= _NUMBERISH:
                return f"dense value {text[:20]!r}", True
            return f"dense value {text[:20]!r} (the parser's call)", False
    return None, True


def predict_verdict(
    accepts: Mapping[str, tuple[str, ...]], dense: Iterable[str], max_candidates: int, data: bytes
) -> Verdict:
    """``Predict`` of ``data`` on a model whose raw columns take ``accepts`` (dense ones: ``dense``)."""
    m = _decode(ipb.PredictRequest, data)
    if m is None:
        return _invalid([("does not decode", _IA)])
    problems: Problems = []
    unsure: list[str] = []
    if not 1 <= m.num_candidates <= max_candidates:
        problems.append((f"num_candidates {m.num_candidates}", _IA))
    seen: set[str] = set()
    dense = set(dense)
    for part, columns, count in (("context", m.context, 1), ("candidates", m.candidates, m.num_candidates)):
        for c in columns:
            if c.name in seen:
                problems.append((f"{c.name!r} twice", _IA))
            seen.add(c.name)
            if c.name not in accepts:
                problems.append((f"unknown feature {c.name[:40]!r}", _IA))
                continue
            problem, sure = _column(c, count, accepts[c.name], c.name in dense)
            if problem is not None:
                (problems.append((f"{part}[{c.name!r}]: {problem}", _IA)) if sure else unsure.append(problem))
    if missing := set(accepts) - seen:
        problems.append((f"missing features {sorted(missing)[:3]}", _IA))
    if problems:
        return _invalid(problems)
    return _unsure("; ".join(unsure)) if unsure else _valid()
