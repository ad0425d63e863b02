"""What a training run leaves for serving: the exported dense model and the manifest that says
how raw feature values become its inputs.

A run directory (``runs/<time>/``) holds, besides ``dense.pt`` and ``metrics.json``:

* ``model.pt2``: the dense model as a ``torch.export`` program (``torch.export.load``;
  no model class or ``worker`` import needed). Its inputs are ``dense`` float32
  ``[B, num_dense]`` and a dict of pooled rows ``{feature: float32 [B, dim of its table]}``
  for every feature of ``manifest["program"]["embeddings"]``, in that order; it returns
  the logits float32 ``[B]``. ``B`` is dynamic.
* ``manifest.json`` (``format_version``: 1; 2 when a column is multi-valued; 3 when some
  table keeps rare values, which predictors of formats 1 and 2 would share): ``tables`` (name, dim, optimizer, initializer,
  seed, params), ``features`` (name, table, pooling, and ``keys``: the key feature whose
  keys it reads; ``C1.wide`` reads ``C1``'s keys from the table ``wide``),
  ``wide_suffix``, ``program`` (file and input order), ``schema`` (below), and, when
  rare values shared a row in training, ``rare_values`` (``min_count``, the vocabulary
  file, the rare key of every feature, and ``shared_by``: the tables whose readers shared
  them; format 3, and absent in formats 1 and 2, where every table's readers did).
* ``vocabulary.npz`` (only with ``rare_values``): per key feature, the sorted keys seen
  in at least ``min_count`` training rows. Any other key of that feature was trained
  as, and is served as, the feature's rare key, by the tables in ``shared_by``
  (``worker.rare``: the embeddings share rare values, the first-order weights keep them).

``manifest["schema"]`` describes the raw columns a request carries:

* ``source``: ``"synthetic"``, a built-in schema's name, or the schema file's path (then
  ``toml`` holds its text, to read the same log again).
* ``categorical``: ``[{"column", "values", "seed"}]``: a column is one key feature of
  the same name; its values are hashed with ``protos.keys.hash_feature(value, seed)``.
  ``values`` says how training saw them: ``"string"`` for click logs (the field's bytes
  exactly as in the file; an empty field is ``""``) and ``"int64"`` for synthetic data
  (the integer ids ``worker.synthetic`` draws, hashed as integers). An entry with a
  ``separator`` (format 2) is multi-valued: a value is split there into any number of
  keys (``worker.multivalued.split_keys``), all pooled into its feature. A manifest of
  format 1 has no such entry and reads as before.
* ``dense``: ``[{"column", "bucket_feature", "bucket_seed"}]``, in the order of the
  model's dense input. A value is a number (parsed from text as the click-log readers
  do) or missing (an empty field, or NaN); missing counts as 0. The model sees
  ``log1p(max(x, 0))`` when ``log_transform``, else ``x``, as float32. With
  ``bucket_feature`` the column is also that key feature: ``worker.fields.bucket_keys``
  of the value (a missing value has a bucket of its own). Synthetic data's dense columns
  are its counts (``worker.synthetic`` feeds ``log1p(count)``).

Example (a run directory written by ``worker.trainer``):
    model = load_model("runs/latest")
    model.program(dense, pooled)    # logits [B]
"""

from __future__ import annotations

import copy
import json
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import torch

from protos.columns import ValueType
from worker.config import EmbeddingTableConfig, FeatureConfig
from worker.data import SchemaColumns, feature_seed, schema_columns
from worker.dataset import SCHEMAS, schema_of
from worker.fields import MISSING_BUCKET
from worker.schemafile import load_schema_file

__all__ = [
    "FORMAT_VERSION",
    "PROGRAM_FILE",
    "KeyFeature",
    "ServingModel",
    "describe_data",
    "export_program",
    "load_model",
    "probabilities",
    "serving_manifest",
]

FORMAT_VERSION = 3  # the newest format this code writes; a run gets the oldest that holds it
READABLE_VERSIONS = (1, 2, 3)
PROGRAM_FILE = "model.pt2"
_EXAMPLE_BATCH = 16  # torch.export specialises sizes 0 and 1, so the example batch is larger
_SIGMOID_ALIGN = 64  # a multiple of two vectors of every SIMD width torch uses (AVX-512: 2 x 16 floats)
_SIGMOID_SLICE = 16384  # below torch's grain size (32768): one thread, one vector loop per slice


def describe_data(
    source: str,
    data_path: str | Path,
    features: Sequence[str],
    num_dense: int,
    columns: SchemaColumns | None = None,
) -> dict[str, Any]:
    """``manifest["schema"]`` of a run on ``source`` (``"synthetic"``, a schema name of
    ``worker.dataset.SCHEMAS`` or a schema file's path) whose batches have the key
    ``features`` and ``num_dense`` dense columns. Raises ``ValueError`` when the schema does
    not give those features."""
    if source == "synthetic":
        # worker.synthetic: feature C{f+1} is hash_features(id, feature_seed(name)), dense
        # column j is log1p(count); no buckets.
        names = [f"I{j + 1}" for j in range(num_dense)]
        cols = SchemaColumns(tuple(features), tuple(names), (), {f: feature_seed(f) for f in features})
        values: ValueType = "int64"
        log_transform = True
    else:
        schema = schema_of(source)
        cols = columns if columns is not None else schema_columns(data_path, schema)
        values, log_transform = "string", schema.log_transform
    keyed = [*cols.categorical, *cols.buckets, *cols.multi]
    if keyed != list(features) or len(cols.dense) != num_dense:
        raise ValueError(
            f"{source}: schema gives features {keyed} and "
            f"{len(cols.dense)} dense columns; the batches have {list(features)} and {num_dense}"
        )
    buckets = dict(zip(cols.dense, cols.buckets))
    multi = [{"column": c, "values": "string", "seed": cols.seeds[c], "separator": s} for c, s in cols.multi.items()]
    described: dict[str, Any] = {"source": source}
    if source != "synthetic" and source not in SCHEMAS:
        described["toml"] = load_schema_file(source).text
    return described | {
        "log_transform": log_transform,
        "categorical": [{"column": c, "values": values, "seed": cols.seeds[c]} for c in cols.categorical] + multi,
        "dense": [
            {"column": d, "bucket_feature": buckets.get(d), "bucket_seed": cols.seeds.get(buckets.get(d, ""))}
            for d in cols.dense
        ],
        "missing_bucket": MISSING_BUCKET,
    }


def export_program(model: torch.nn.Module, num_dense: int, dims: Mapping[str, int], path: Path) -> None:
    """Export a copy of ``model`` (on CPU, eval mode) taking ``dense`` and ``{feature: rows}``
    with ``dims[feature]`` columns each (in ``dims`` order) to ``path``; blocks a few seconds."""
    cpu = copy.deepcopy(model).to("cpu").eval()
    dense = torch.zeros(_EXAMPLE_BATCH, num_dense)
    pooled = {f: torch.zeros(_EXAMPLE_BATCH, d) for f, d in dims.items()}
    batch = torch.export.Dim("batch", min=1)
    shapes = ({0: batch}, {f: {0: batch} for f in dims})
    with torch.no_grad():
        program = torch.export.export(cpu, (dense, pooled), dynamic_shapes=shapes)
    torch.export.save(program, path)


def serving_manifest(
    model: torch.nn.Module,
    out: Path,
    tables: Sequence[EmbeddingTableConfig],
    features: Sequence[FeatureConfig],
    num_dense: int,
    schema: dict[str, Any],
    wide_suffix: str | None,
    rare_values: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """Export ``model`` to ``out/model.pt2``; returns the manifest entries serving needs
    beyond the trainer's own (``program``, ``schema``, each feature's ``keys``, and
    ``rare_values`` as given)."""
    started = time.perf_counter()
    dims = {t.name: t.dim for t in tables}
    export_program(model, num_dense, {f.name: dims[f.table] for f in features}, out / PROGRAM_FILE)

    def keys_of(name: str) -> str:
        return name.removesuffix(wide_suffix) if wide_suffix and name.endswith(wide_suffix) else name

    multi_valued = any("separator" in c for c in schema["categorical"])
    kept = rare_values is not None and set(rare_values["shared_by"]) != {t.name for t in tables}
    # Older predictors still read a run that needs nothing newer.
    return {
        "format_version": 3 if kept else 2 if multi_valued else 1,
        **({"rare_values": dict(rare_values)} if rare_values is not None else {}),
        "run": out.resolve().name,
        "program": {
            "file": PROGRAM_FILE,
            "dense": [d["column"] for d in schema["dense"]],
            "embeddings": [f.name for f in features],
            "output": "logits [batch]",
            "export_s": round(time.perf_counter() - started, 3),
        },
        "features": [
            {"name": f.name, "table": f.table, "pooling": f.pooling, "keys": keys_of(f.name)} for f in features
        ],
        "schema": schema,
    }


def probabilities(logits: torch.Tensor) -> torch.Tensor:
    """``sigmoid(logits)`` for a 1-D tensor, each value's bits independent of its position
    and of the tensor's length: training's evaluation and the predictor both score with it.

    On CPU, ``torch.sigmoid`` computes whole vectors with a SIMD ``exp`` and a loop's
    tail with the scalar one, which can differ in the last bit; so the input is padded
    to a multiple of ``_SIGMOID_ALIGN`` and sigmoid runs on slices too short to be split
    across threads: every value goes through the vector path.

    >>> x = torch.linspace(-5, 5, 100)
    >>> bool(torch.equal(probabilities(x)[77:80], probabilities(x[77:80].clone())))
    True
    """
    n = logits.shape[0]
    if pad := -n % _SIGMOID_ALIGN:
        logits = torch.cat([logits, logits.new_zeros(pad)])
    return torch.cat([torch.sigmoid(logits[i : i + _SIGMOID_SLICE]) for i in range(0, n + pad, _SIGMOID_SLICE)])[:n]


# --- loading


@dataclass(frozen=True)
class KeyFeature:
    """A feature whose keys come from one raw column: hashed (``string``/``int64``) or bucketed
    (``bucket``); with a ``separator``, a string column whose every value holds any number of keys."""

    name: str
    column: str
    hashing: str  # "string", "int64" or "bucket"
    seed: int
    vocabulary: npt.NDArray[np.int64] | None  # sorted; other keys become rare_key
    rare_key: int
    separator: str | None = None  # multi-valued: the values are split at it


@dataclass(frozen=True)
class ServingModel:
    """A run directory loaded for serving (``load_model``); immutable.

    ``program`` is the exported dense model (a ``torch.fx.GraphModule``, safe to call
    from several threads under ``torch.no_grad``). ``categorical`` maps each
    categorical column to the value type training hashed; ``dense`` lists the dense
    columns in input order; ``key_features`` and ``embeddings`` (name, table, pooling,
    index into ``key_features``) come in the program's order.
    """

    run: str
    manifest: Mapping[str, Any]
    program: torch.nn.Module
    categorical: Mapping[str, ValueType]
    dense: tuple[str, ...]
    log_transform: bool
    key_features: tuple[KeyFeature, ...]
    embeddings: tuple[tuple[str, str, str, int], ...]
    dims: Mapping[str, int]
    rare_shared_by: frozenset[str] | None = None  # tables reading rare values as the rare key; None: all
    directory: str = ""  # the run directory it was loaded from (its published/ weights: worker.published)

    @property
    def columns(self) -> tuple[str, ...]:
        """Every raw column a request must carry: the categorical ones, then the dense ones."""
        return (*self.categorical, *self.dense)


def load_model(run_dir: str | Path) -> ServingModel:
    """Load ``run_dir`` (``manifest.json``, ``model.pt2``, ``vocabulary.npz``) for serving.

    Raises ``ValueError`` naming the file for a missing file, a manifest of another
    format version (or one written before runs were exported), or an inconsistent one.
    """
    run_dir = Path(run_dir)
    path = run_dir / "manifest.json"
    try:
        manifest = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"{path}: {exc}") from None
    if manifest.get("format_version") not in READABLE_VERSIONS:
        raise ValueError(
            f"{path}: format_version {manifest.get('format_version')!r}, this predictor reads "
            f"{' and '.join(map(str, READABLE_VERSIONS))} (runs trained before models were exported have none: "
            "train again)"
        )
    try:
        return _parse(run_dir, manifest)
    except (KeyError, TypeError, OSError, RuntimeError) as exc:
        raise ValueError(f"{path}: not a servable run ({type(exc).__name__}: {exc})") from None


def _parse(run_dir: Path, manifest: dict[str, Any]) -> ServingModel:
    schema = manifest["schema"]
    rare = manifest.get("rare_values")
    vocab: dict[str, npt.NDArray[np.int64]] = {}
    if rare:
        with np.load(run_dir / rare["vocabulary"]) as npz:
            vocab = {name: np.asarray(npz[name], dtype=np.int64) for name in npz.files}
    rare_keys: dict[str, int] = dict(rare["rare_keys"]) if rare else {}
    shared_by = frozenset(rare["shared_by"]) if rare and "shared_by" in rare else None

    def key_feature(name: str, column: str, hashing: str, seed: int, separator: str | None = None) -> KeyFeature:
        if separator is not None and (not isinstance(separator, str) or len(separator) != 1 or hashing != "string"):
            raise ValueError(f"{run_dir / 'manifest.json'}: column {column!r}: separator {separator!r} of {hashing}")
        return KeyFeature(name, column, hashing, int(seed), vocab.get(name), int(rare_keys.get(name, 0)), separator)

    keys = [
        key_feature(c["column"], c["column"], c["values"], c["seed"], c.get("separator")) for c in schema["categorical"]
    ]
    keys += [
        key_feature(d["bucket_feature"], d["column"], "bucket", d["bucket_seed"])
        for d in schema["dense"]
        if d["bucket_feature"]
    ]
    position = {k.name: i for i, k in enumerate(keys)}
    by_name = {f["name"]: f for f in manifest["features"]}
    embeddings = tuple(
        (n, by_name[n]["table"], by_name[n]["pooling"], position[by_name[n]["keys"]])
        for n in manifest["program"]["embeddings"]
    )
    dims = {t["name"]: int(t["dim"]) for t in manifest["tables"]}
    program = torch.export.load(run_dir / manifest["program"]["file"]).module()
    return ServingModel(
        run=str(manifest.get("run", run_dir.resolve().name)),
        manifest=manifest,
        program=program,
        categorical={c["column"]: c["values"] for c in schema["categorical"]},
        dense=tuple(d["column"] for d in schema["dense"]),
        log_transform=bool(schema["log_transform"]),
        key_features=tuple(keys),
        embeddings=embeddings,
        dims=dims,
        rare_shared_by=shared_by,
        directory=str(run_dir),
    )
