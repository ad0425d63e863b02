"""``Predictor``: raw feature values in, scores out, exactly as the trained model scores them.

Given a run directory (``worker.export``) and anything with ``lookup_many`` (a
``PSClient``, or rows held in memory), a ``Predictor``:

1. ``encode``: checks a request against the model's schema and turns its raw columns into
   keys and dense values with the training readers' own functions: strings through the
   FNV kernel ``protos.hashing.hash_fields`` (byte ranges of one buffer), integers through
   ``protos.keys.hash_features``, dense values through ``worker.fields`` (number parsing,
   ``log1p``, bucket keys), multi-valued columns through ``worker.multivalued.split_keys``
   (a candidate's value is one string, its values joined by the column's separator, as in
   the training file: a request's columns hold one string per candidate). No Python object per value.
2. ``score``: for one or many encoded requests together, keys outside the training
   vocabulary become the feature's rare key for the tables that shared rare values in
   training (``worker.rare.share_rare``: the embeddings, not the first-order weights), then
   one ``lookup_many`` (one RPC per shard) of each table's unique keys, pooling as ``DistributedEmbedding`` pools
   (``F.embedding_bag``), one call of the exported dense program, and
   ``worker.export.probabilities`` (sigmoid).

Each program call is padded (copies of the last row, whose scores are dropped) to a
multiple of ``PAD_ROWS`` rows and to at least ``MIN_ROWS``. On CPU the matrix kernels give
a row the same bits at any such batch size, while small ones take other paths: below 8
rows with one BLAS, below 16 with MKL on AVX-512 (seen on a 16-core Xeon), hence the
margin. ``probabilities`` does not depend on positions either. So a candidate's score
does not depend on which requests it was batched with, and equals the training
evaluation's (``worker.trainer.predict``) for the same raw values when that evaluated
them in such batches (its batches are, but for the last one).

Example (``rows`` is a ``PSClient`` or any ``RowSource``):
    p = Predictor.load("runs/latest", rows)
    scores = p.predict({"C1": "68fd1e64", ...}, [{"C2": "80e26c9b", "I1": "1"}, ...])   # float32 [n]
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import numpy.typing as npt
import torch
import torch.nn.functional as F

from client.batching import dedup
from protos.columns import Column, InvalidRequest, ValueType, columns_of
from protos.hashing import fnv_basis, hash_fields
from protos.keys import hash_features
from worker.export import KeyFeature, ServingModel, load_model, probabilities
from worker.fields import bucket_keys, dense_values, parse_numbers
from worker.multivalued import JaggedKeys, split_keys
from worker.published import PublishedDense
from worker.rare import share_rare

__all__ = ["MIN_ROWS", "PAD_ROWS", "Encoded", "Predictor", "RowSource"]

PAD_ROWS = 8
MIN_ROWS = 64  # ~0.1 ms more than 8 rows for DLRM's tower on one core
I64 = npt.NDArray[np.int64]
F32 = npt.NDArray[np.float32]
F64 = npt.NDArray[np.float64]
_NUMBER_TYPES: tuple[ValueType, ...] = ("float64", "int64", "string")


class RowSource(Protocol):
    """Where rows come from: ``PSClient.lookup_many``'s contract (rows ``[len(keys), dim]`` per table)."""

    def lookup_many(self, requests: Mapping[str, npt.ArrayLike]) -> dict[str, npt.NDArray[np.float32]]: ...


@dataclass(frozen=True)
class Encoded:
    """One request, encoded: ``keys`` int64 ``[key features, n]`` (the ``ServingModel.key_features``
    with one key per candidate, in order), ``dense`` float32 ``[n, dense columns]``, and
    ``bags``: the keys of each multi-valued key feature, in order."""

    keys: I64
    dense: F32
    bags: tuple[JaggedKeys, ...] = ()

    @property
    def n(self) -> int:
        return int(self.keys.shape[1])


class Predictor:
    """Scores raw feature values with a model exported by training (see the module docstring).

    ``encode`` and ``score`` are thread-safe and block (``score`` on the lookup);
    ``score`` raises what ``rows.lookup_many`` raises (``PSError`` subclasses for a
    ``PSClient``), ``encode`` raises ``InvalidRequest`` naming the field. Returned arrays
    are new and belong to the caller. Construction does no I/O beyond what it is given.
    """

    def __init__(self, model: ServingModel, rows: RowSource, *, max_candidates: int = 1000) -> None:
        if max_candidates < 1:
            raise ValueError(f"max_candidates={max_candidates}: must be >= 1")
        self.model, self.rows, self.max_candidates = model, rows, max_candidates
        # Rows from --published-only serving shards name their publication: they are scored
        # with the dense weights published with the oldest of them (worker.published).
        self.published = PublishedDense(model.directory, model.program)
        self._keyed = [k for k in model.key_features if k.separator is None]
        self._multi = [k for k in model.key_features if k.separator is not None]
        self._position = {k.name: i for i, k in enumerate(self._keyed)}
        self._bag_position = {k.name: i for i, k in enumerate(self._multi)}
        self._bases = {k.name: fnv_basis(k.seed) for k in model.key_features}
        # table -> (feature, pooling, whether it reads a bag, its key row or bag, the key
        # feature whose rare values it reads as the rare key, or None: every key as it is)
        self._readers: dict[str, list[tuple[str, str, bool, int, KeyFeature | None]]] = {}
        shared_by = model.rare_shared_by
        for name, table, pooling, index in model.embeddings:
            k = model.key_features[index]
            at = (True, self._bag_position[k.name]) if k.separator is not None else (False, self._position[k.name])
            shares = k.vocabulary is not None and (shared_by is None or table in shared_by)
            self._readers.setdefault(table, []).append((name, pooling, *at, k if shares else None))
        self._accepts: dict[str, tuple[ValueType, ...]] = {c: (t,) for c, t in model.categorical.items()}
        self._accepts |= dict.fromkeys(model.dense, _NUMBER_TYPES)

    @classmethod
    def load(cls, run_dir: str | Path, rows: RowSource, *, max_candidates: int = 1000) -> Predictor:
        """``Predictor(load_model(run_dir), rows)``; raises ``ValueError`` for a run it cannot serve."""
        return cls(load_model(run_dir), rows, max_candidates=max_candidates)

    def accepts(self) -> dict[str, tuple[ValueType, ...]]:
        """The value types each raw column takes, by column name (categorical columns first)."""
        return dict(self._accepts)

    # -- encode ---------------------------------------------------------------------
    def encode(self, num_candidates: int, context: Mapping[str, Column], candidates: Mapping[str, Column]) -> Encoded:
        """Check a request against the model and hash it (see the module docstring)."""
        n = num_candidates
        if not 1 <= n <= self.max_candidates:
            raise InvalidRequest(f"num_candidates: {n}, must be in [1, {self.max_candidates}]")
        accepts = self._accepts
        where: dict[str, str] = {}
        for part, columns, count in (("context", context, 1), ("candidates", candidates, n)):
            for name, col in columns.items():
                field = f"{part}[{name!r}]"
                if name not in accepts:
                    raise InvalidRequest(f"{field}: unknown feature; the model's features are {', '.join(accepts)}")
                if name in where:
                    raise InvalidRequest(f"{field}: also in {where[name]} (each feature goes in one of them)")
                if col.type not in accepts[name]:
                    raise InvalidRequest(
                        f"{field}: {col.type} values, the model takes {' or '.join(accepts[name])} "
                        "for this feature (as in its training data)"
                    )
                if len(col) != count:
                    what = "one value (it applies to every candidate)" if part == "context" else f"num_candidates={n}"
                    raise InvalidRequest(f"{field}: {len(col)} values, expected {what}")
                where[name] = field
        if missing := [c for c in accepts if c not in where]:
            raise InvalidRequest(f"missing features: {', '.join(missing)} (each goes in context or candidates)")
        columns = {**context, **candidates}
        keys = np.empty((len(self._keyed), n), np.int64)
        for k in self._keyed:
            if k.hashing != "bucket":
                keys[self._position[k.name]] = self._hash(k, columns[k.column])
        bags = tuple(self._split(k, columns[k.column], n) for k in self._multi)
        dense = np.empty((n, len(self.model.dense)), np.float32)
        buckets = {k.column: k for k in self.model.key_features if k.hashing == "bucket"}
        for j, name in enumerate(self.model.dense):
            raw, empty = _numbers(columns[name], where[name])
            dense[:, j] = dense_values(raw, self.model.log_transform)
            if (b := buckets.get(name)) is not None:
                keys[self._position[b.name]] = bucket_keys(raw, empty, b.seed)
        return Encoded(keys, dense, bags)

    def _split(self, k: KeyFeature, col: Column, n: int) -> JaggedKeys:
        """A multi-valued column's keys for ``n`` candidates (a context column: its one value's, for each)."""
        starts, ends = col.ranges()
        buf = col.values if col.values.shape[0] else np.zeros(1, np.uint8)
        if len(col) != n:  # the context: the same value for every candidate
            starts, ends = np.repeat(starts, n), np.repeat(ends, n)
        return split_keys(buf, starts, ends, ord(k.separator or ""), self._bases[k.name])

    def _hash(self, k: KeyFeature, col: Column) -> I64:
        if col.type == "int64":
            return hash_features(col.values, k.seed)
        starts, ends = col.ranges()
        out = np.empty((1, len(col)), np.uint64)
        buf = col.values if col.values.shape[0] else np.zeros(1, np.uint8)
        hash_fields(
            buf, starts[:, None], ends[:, None], np.zeros(1, np.int64), np.array([self._bases[k.name]], np.uint64), out
        )
        keys: I64 = out[0].view(np.int64)
        return keys

    # -- score ----------------------------------------------------------------------
    def score(self, batches: Sequence[Encoded]) -> list[F32]:
        """Scores (``sigmoid`` of the logits, float32) of each encoded request, from one
        lookup and one program call for all of them together."""
        sizes = [b.n for b in batches]
        n = sum(sizes)
        if n == 0:
            return [np.empty(0, np.float32) for _ in batches]
        keys = np.concatenate([b.keys for b in batches], axis=1) if len(batches) > 1 else batches[0].keys
        dense = np.concatenate([b.dense for b in batches]) if len(batches) > 1 else batches[0].dense
        bags = [JaggedKeys.concat(parts) for parts in zip(*(b.bags for b in batches))]
        if pad := max(MIN_ROWS - n, -n % PAD_ROWS):
            keys = np.concatenate([keys, np.repeat(keys[:, -1:], pad, axis=1)], axis=1)
            dense = np.concatenate([dense, np.repeat(dense[-1:], pad, axis=0)])
            last = np.r_[0:n, np.full(pad, n - 1)]
            bags = [bag.take(last) for bag in bags]
        rows_n = n + pad
        one_each = np.arange(rows_n + 1, dtype=np.int64)

        def ids_of(bag: bool, at: int, shares: KeyFeature | None) -> tuple[I64, I64]:
            """A reader's keys (rare values shared if it ``shares`` them) and offsets (``rows_n + 1``)."""
            values, offsets = (bags[at].values, bags[at].offsets) if bag else (keys[at], one_each)
            if shares is not None and shares.vocabulary is not None:
                values = share_rare(values, shares.vocabulary, shares.rare_key)
            return values, offsets

        unique: dict[str, I64] = {}
        index: dict[str, I64] = {}
        inputs: dict[str, list[tuple[I64, I64]]] = {}
        for table, readers in self._readers.items():
            # Features reading one table share a lookup, as in DistributedEmbedding.
            inputs[table] = [ids_of(bag, at, shares) for _, _, bag, at, shares in readers]
            parts = [values for values, _ in inputs[table]]
            unique[table], index[table] = dedup(np.concatenate(parts) if len(parts) > 1 else parts[0])
        rows = self.rows.lookup_many(unique)
        program = self.published.program(getattr(rows, "publications", ()))
        pooled: dict[str, torch.Tensor] = {}
        with torch.no_grad():
            for table, readers in self._readers.items():
                weight = torch.from_numpy(np.ascontiguousarray(rows[table]))
                inverse = torch.from_numpy(index[table])
                lo = 0
                for (name, pooling, *_), (values, offsets) in zip(readers, inputs[table]):
                    ids = inverse[lo : lo + values.shape[0]]
                    lo += values.shape[0]
                    starts = torch.from_numpy(offsets[:-1])
                    pooled[name] = F.embedding_bag(ids, weight, starts, mode=pooling)
            program_inputs = {name: pooled[name] for name, _, _, _ in self.model.embeddings}
            logits = program(torch.from_numpy(dense), program_inputs)
            scores = probabilities(logits).numpy()
        bounds = np.cumsum([0, *sizes])
        return [scores[lo:hi].copy() for lo, hi in zip(bounds[:-1], bounds[1:])]

    def predict(
        self, context: Mapping[str, Any] | None, candidates: Sequence[Mapping[str, Any]] | Mapping[str, Any]
    ) -> F32:
        """Scores for Python values (as ``protos.columns.columns_of`` takes them): ``encode`` + ``score``."""
        return self.score([self.encode(*columns_of(context, candidates))])[0]


def _numbers(col: Column, field: str) -> tuple[F64, npt.NDArray[np.bool_]]:
    """A dense column's values as float64 (0 where missing) and which are missing; raises ``InvalidRequest``."""
    if col.type == "int64":
        return col.values.astype(np.float64), np.zeros(len(col), np.bool_)
    if col.type == "float64":
        empty = np.isnan(col.values)
        if not np.isfinite(col.values[~empty]).all():
            i = int(np.flatnonzero(np.isinf(col.values))[0])
            raise InvalidRequest(f"{field}: value {i} is {col.values[i]}, expected a finite number or NaN (missing)")
        return np.where(empty, 0.0, col.values), empty
    starts, ends = col.ranges()
    buf = col.values if col.values.shape[0] else np.zeros(1, np.uint8)
    raw, empty, bad = parse_numbers(buf, starts[:, None], ends[:, None], np.zeros(1, np.int64))
    if bad.shape[0]:
        i = int(bad[0, 0])
        text = bytes(buf[starts[i] : ends[i]])[:100]
        raise InvalidRequest(f"{field}: value {i} is {text!r}, not a number (an empty string is missing)")
    return raw[:, 0], empty[:, 0]
