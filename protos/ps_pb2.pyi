from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class DType(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DTYPE_UNSPECIFIED: _ClassVar[DType]
    FLOAT32: _ClassVar[DType]
    FLOAT16: _ClassVar[DType]
    BFLOAT16: _ClassVar[DType]
    INT8: _ClassVar[DType]

class ServingDefault(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    SERVING_DEFAULT_UNSPECIFIED: _ClassVar[ServingDefault]
    ZEROS: _ClassVar[ServingDefault]
    INITIAL: _ClassVar[ServingDefault]
DTYPE_UNSPECIFIED: DType
FLOAT32: DType
FLOAT16: DType
BFLOAT16: DType
INT8: DType
SERVING_DEFAULT_UNSPECIFIED: ServingDefault
ZEROS: ServingDefault
INITIAL: ServingDefault

class InitializerSpec(_message.Message):
    __slots__ = ("kind", "low", "high", "mean", "std", "value")
    class Kind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        KIND_UNSPECIFIED: _ClassVar[InitializerSpec.Kind]
        UNIFORM: _ClassVar[InitializerSpec.Kind]
        NORMAL: _ClassVar[InitializerSpec.Kind]
        ZEROS: _ClassVar[InitializerSpec.Kind]
        CONSTANT: _ClassVar[InitializerSpec.Kind]
    KIND_UNSPECIFIED: InitializerSpec.Kind
    UNIFORM: InitializerSpec.Kind
    NORMAL: InitializerSpec.Kind
    ZEROS: InitializerSpec.Kind
    CONSTANT: InitializerSpec.Kind
    KIND_FIELD_NUMBER: _ClassVar[int]
    LOW_FIELD_NUMBER: _ClassVar[int]
    HIGH_FIELD_NUMBER: _ClassVar[int]
    MEAN_FIELD_NUMBER: _ClassVar[int]
    STD_FIELD_NUMBER: _ClassVar[int]
    VALUE_FIELD_NUMBER: _ClassVar[int]
    kind: InitializerSpec.Kind
    low: float
    high: float
    mean: float
    std: float
    value: float
    def __init__(self, kind: _Optional[_Union[InitializerSpec.Kind, str]] = ..., low: _Optional[float] = ..., high: _Optional[float] = ..., mean: _Optional[float] = ..., std: _Optional[float] = ..., value: _Optional[float] = ...) -> None: ...

class OptimizerSpec(_message.Message):
    __slots__ = ("kind", "lr", "weight_decay", "eps", "initial_accumulator_value", "beta1", "beta2", "l1", "l2", "lr_power", "beta")
    class Kind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        KIND_UNSPECIFIED: _ClassVar[OptimizerSpec.Kind]
        SGD: _ClassVar[OptimizerSpec.Kind]
        ADAGRAD: _ClassVar[OptimizerSpec.Kind]
        ADAM: _ClassVar[OptimizerSpec.Kind]
        FTRL: _ClassVar[OptimizerSpec.Kind]
        ROWWISE_ADAGRAD: _ClassVar[OptimizerSpec.Kind]
    KIND_UNSPECIFIED: OptimizerSpec.Kind
    SGD: OptimizerSpec.Kind
    ADAGRAD: OptimizerSpec.Kind
    ADAM: OptimizerSpec.Kind
    FTRL: OptimizerSpec.Kind
    ROWWISE_ADAGRAD: OptimizerSpec.Kind
    KIND_FIELD_NUMBER: _ClassVar[int]
    LR_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_DECAY_FIELD_NUMBER: _ClassVar[int]
    EPS_FIELD_NUMBER: _ClassVar[int]
    INITIAL_ACCUMULATOR_VALUE_FIELD_NUMBER: _ClassVar[int]
    BETA1_FIELD_NUMBER: _ClassVar[int]
    BETA2_FIELD_NUMBER: _ClassVar[int]
    L1_FIELD_NUMBER: _ClassVar[int]
    L2_FIELD_NUMBER: _ClassVar[int]
    LR_POWER_FIELD_NUMBER: _ClassVar[int]
    BETA_FIELD_NUMBER: _ClassVar[int]
    kind: OptimizerSpec.Kind
    lr: float
    weight_decay: float
    eps: float
    initial_accumulator_value: float
    beta1: float
    beta2: float
    l1: float
    l2: float
    lr_power: float
    beta: float
    def __init__(self, kind: _Optional[_Union[OptimizerSpec.Kind, str]] = ..., lr: _Optional[float] = ..., weight_decay: _Optional[float] = ..., eps: _Optional[float] = ..., initial_accumulator_value: _Optional[float] = ..., beta1: _Optional[float] = ..., beta2: _Optional[float] = ..., l1: _Optional[float] = ..., l2: _Optional[float] = ..., lr_power: _Optional[float] = ..., beta: _Optional[float] = ...) -> None: ...

class Lifecycle(_message.Message):
    __slots__ = ("admit_after", "admit_probability", "ttl_seconds", "evict_below_frequency")
    ADMIT_AFTER_FIELD_NUMBER: _ClassVar[int]
    ADMIT_PROBABILITY_FIELD_NUMBER: _ClassVar[int]
    TTL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    EVICT_BELOW_FREQUENCY_FIELD_NUMBER: _ClassVar[int]
    admit_after: int
    admit_probability: float
    ttl_seconds: float
    evict_below_frequency: int
    def __init__(self, admit_after: _Optional[int] = ..., admit_probability: _Optional[float] = ..., ttl_seconds: _Optional[float] = ..., evict_below_frequency: _Optional[int] = ...) -> None: ...

class TableSpec(_message.Message):
    __slots__ = ("name", "dim", "dtype", "initializer", "optimizer", "seed", "lifecycle", "serving_default", "state_dtype")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DIM_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    INITIALIZER_FIELD_NUMBER: _ClassVar[int]
    OPTIMIZER_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    LIFECYCLE_FIELD_NUMBER: _ClassVar[int]
    SERVING_DEFAULT_FIELD_NUMBER: _ClassVar[int]
    STATE_DTYPE_FIELD_NUMBER: _ClassVar[int]
    name: str
    dim: int
    dtype: DType
    initializer: InitializerSpec
    optimizer: OptimizerSpec
    seed: int
    lifecycle: Lifecycle
    serving_default: ServingDefault
    state_dtype: DType
    def __init__(self, name: _Optional[str] = ..., dim: _Optional[int] = ..., dtype: _Optional[_Union[DType, str]] = ..., initializer: _Optional[_Union[InitializerSpec, _Mapping]] = ..., optimizer: _Optional[_Union[OptimizerSpec, _Mapping]] = ..., seed: _Optional[int] = ..., lifecycle: _Optional[_Union[Lifecycle, _Mapping]] = ..., serving_default: _Optional[_Union[ServingDefault, str]] = ..., state_dtype: _Optional[_Union[DType, str]] = ...) -> None: ...

class CreateTableRequest(_message.Message):
    __slots__ = ("spec",)
    SPEC_FIELD_NUMBER: _ClassVar[int]
    spec: TableSpec
    def __init__(self, spec: _Optional[_Union[TableSpec, _Mapping]] = ...) -> None: ...

class CreateTableResponse(_message.Message):
    __slots__ = ("created", "spec")
    CREATED_FIELD_NUMBER: _ClassVar[int]
    SPEC_FIELD_NUMBER: _ClassVar[int]
    created: bool
    spec: TableSpec
    def __init__(self, created: _Optional[bool] = ..., spec: _Optional[_Union[TableSpec, _Mapping]] = ...) -> None: ...

class ListTablesRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListTablesResponse(_message.Message):
    __slots__ = ("tables", "shard", "num_shards")
    TABLES_FIELD_NUMBER: _ClassVar[int]
    SHARD_FIELD_NUMBER: _ClassVar[int]
    NUM_SHARDS_FIELD_NUMBER: _ClassVar[int]
    tables: _containers.RepeatedCompositeFieldContainer[TableSpec]
    shard: int
    num_shards: int
    def __init__(self, tables: _Optional[_Iterable[_Union[TableSpec, _Mapping]]] = ..., shard: _Optional[int] = ..., num_shards: _Optional[int] = ...) -> None: ...

class LookupEntry(_message.Message):
    __slots__ = ("table", "keys", "dtype")
    TABLE_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    table: str
    keys: bytes
    dtype: DType
    def __init__(self, table: _Optional[str] = ..., keys: _Optional[bytes] = ..., dtype: _Optional[_Union[DType, str]] = ...) -> None: ...

class LookupRequest(_message.Message):
    __slots__ = ("entries", "num_shards", "shard", "epoch")
    ENTRIES_FIELD_NUMBER: _ClassVar[int]
    NUM_SHARDS_FIELD_NUMBER: _ClassVar[int]
    SHARD_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    entries: _containers.RepeatedCompositeFieldContainer[LookupEntry]
    num_shards: int
    shard: int
    epoch: int
    def __init__(self, entries: _Optional[_Iterable[_Union[LookupEntry, _Mapping]]] = ..., num_shards: _Optional[int] = ..., shard: _Optional[int] = ..., epoch: _Optional[int] = ...) -> None: ...

class LookupResult(_message.Message):
    __slots__ = ("table", "rows", "dtype", "dim")
    TABLE_FIELD_NUMBER: _ClassVar[int]
    ROWS_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    DIM_FIELD_NUMBER: _ClassVar[int]
    table: str
    rows: bytes
    dtype: DType
    dim: int
    def __init__(self, table: _Optional[str] = ..., rows: _Optional[bytes] = ..., dtype: _Optional[_Union[DType, str]] = ..., dim: _Optional[int] = ...) -> None: ...

class LookupResponse(_message.Message):
    __slots__ = ("results", "publication")
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    PUBLICATION_FIELD_NUMBER: _ClassVar[int]
    results: _containers.RepeatedCompositeFieldContainer[LookupResult]
    publication: str
    def __init__(self, results: _Optional[_Iterable[_Union[LookupResult, _Mapping]]] = ..., publication: _Optional[str] = ...) -> None: ...

class PushEntry(_message.Message):
    __slots__ = ("table", "keys", "grads", "dtype", "seq")
    TABLE_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    GRADS_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    table: str
    keys: bytes
    grads: bytes
    dtype: DType
    seq: int
    def __init__(self, table: _Optional[str] = ..., keys: _Optional[bytes] = ..., grads: _Optional[bytes] = ..., dtype: _Optional[_Union[DType, str]] = ..., seq: _Optional[int] = ...) -> None: ...

class PushRequest(_message.Message):
    __slots__ = ("entries", "num_shards", "client_id", "seq", "shard", "epoch", "planned_epoch", "planned_shard")
    ENTRIES_FIELD_NUMBER: _ClassVar[int]
    NUM_SHARDS_FIELD_NUMBER: _ClassVar[int]
    CLIENT_ID_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    SHARD_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    PLANNED_EPOCH_FIELD_NUMBER: _ClassVar[int]
    PLANNED_SHARD_FIELD_NUMBER: _ClassVar[int]
    entries: _containers.RepeatedCompositeFieldContainer[PushEntry]
    num_shards: int
    client_id: str
    seq: int
    shard: int
    epoch: int
    planned_epoch: int
    planned_shard: int
    def __init__(self, entries: _Optional[_Iterable[_Union[PushEntry, _Mapping]]] = ..., num_shards: _Optional[int] = ..., client_id: _Optional[str] = ..., seq: _Optional[int] = ..., shard: _Optional[int] = ..., epoch: _Optional[int] = ..., planned_epoch: _Optional[int] = ..., planned_shard: _Optional[int] = ...) -> None: ...

class PushResponse(_message.Message):
    __slots__ = ("applied", "rows_updated")
    APPLIED_FIELD_NUMBER: _ClassVar[int]
    ROWS_UPDATED_FIELD_NUMBER: _ClassVar[int]
    applied: bool
    rows_updated: int
    def __init__(self, applied: _Optional[bool] = ..., rows_updated: _Optional[int] = ...) -> None: ...

class StatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class TableStats(_message.Message):
    __slots__ = ("name", "dim", "rows", "memory_bytes", "lookups", "pushes", "rows_created", "resident_rows", "spilled_rows", "bytes_per_resident_row", "ram_hits", "ram_misses", "ram_hit_rate", "rows_spilled", "rows_faulted_in", "spill_rows_per_s", "fault_in_rows_per_s", "lookups_not_admitted", "pushes_dropped", "rows_expired", "rows_evicted_rare", "admission_bytes", "rows_written", "rows_estimated", "storage_dtype", "state_dtype", "record_bytes", "disk_bytes", "values_clamped", "values_flushed", "new_keys_per_s", "rows_touched", "row_norm", "update_norm", "row_idle_s", "nonfinite_rows", "health_window_s", "health_scanned_unix_s", "rows_erased")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DIM_FIELD_NUMBER: _ClassVar[int]
    ROWS_FIELD_NUMBER: _ClassVar[int]
    MEMORY_BYTES_FIELD_NUMBER: _ClassVar[int]
    LOOKUPS_FIELD_NUMBER: _ClassVar[int]
    PUSHES_FIELD_NUMBER: _ClassVar[int]
    ROWS_CREATED_FIELD_NUMBER: _ClassVar[int]
    RESIDENT_ROWS_FIELD_NUMBER: _ClassVar[int]
    SPILLED_ROWS_FIELD_NUMBER: _ClassVar[int]
    BYTES_PER_RESIDENT_ROW_FIELD_NUMBER: _ClassVar[int]
    RAM_HITS_FIELD_NUMBER: _ClassVar[int]
    RAM_MISSES_FIELD_NUMBER: _ClassVar[int]
    RAM_HIT_RATE_FIELD_NUMBER: _ClassVar[int]
    ROWS_SPILLED_FIELD_NUMBER: _ClassVar[int]
    ROWS_FAULTED_IN_FIELD_NUMBER: _ClassVar[int]
    SPILL_ROWS_PER_S_FIELD_NUMBER: _ClassVar[int]
    FAULT_IN_ROWS_PER_S_FIELD_NUMBER: _ClassVar[int]
    LOOKUPS_NOT_ADMITTED_FIELD_NUMBER: _ClassVar[int]
    PUSHES_DROPPED_FIELD_NUMBER: _ClassVar[int]
    ROWS_EXPIRED_FIELD_NUMBER: _ClassVar[int]
    ROWS_EVICTED_RARE_FIELD_NUMBER: _ClassVar[int]
    ADMISSION_BYTES_FIELD_NUMBER: _ClassVar[int]
    ROWS_WRITTEN_FIELD_NUMBER: _ClassVar[int]
    ROWS_ESTIMATED_FIELD_NUMBER: _ClassVar[int]
    STORAGE_DTYPE_FIELD_NUMBER: _ClassVar[int]
    STATE_DTYPE_FIELD_NUMBER: _ClassVar[int]
    RECORD_BYTES_FIELD_NUMBER: _ClassVar[int]
    DISK_BYTES_FIELD_NUMBER: _ClassVar[int]
    VALUES_CLAMPED_FIELD_NUMBER: _ClassVar[int]
    VALUES_FLUSHED_FIELD_NUMBER: _ClassVar[int]
    NEW_KEYS_PER_S_FIELD_NUMBER: _ClassVar[int]
    ROWS_TOUCHED_FIELD_NUMBER: _ClassVar[int]
    ROW_NORM_FIELD_NUMBER: _ClassVar[int]
    UPDATE_NORM_FIELD_NUMBER: _ClassVar[int]
    ROW_IDLE_S_FIELD_NUMBER: _ClassVar[int]
    NONFINITE_ROWS_FIELD_NUMBER: _ClassVar[int]
    HEALTH_WINDOW_S_FIELD_NUMBER: _ClassVar[int]
    HEALTH_SCANNED_UNIX_S_FIELD_NUMBER: _ClassVar[int]
    ROWS_ERASED_FIELD_NUMBER: _ClassVar[int]
    name: str
    dim: int
    rows: int
    memory_bytes: int
    lookups: int
    pushes: int
    rows_created: int
    resident_rows: int
    spilled_rows: int
    bytes_per_resident_row: float
    ram_hits: int
    ram_misses: int
    ram_hit_rate: float
    rows_spilled: int
    rows_faulted_in: int
    spill_rows_per_s: float
    fault_in_rows_per_s: float
    lookups_not_admitted: int
    pushes_dropped: int
    rows_expired: int
    rows_evicted_rare: int
    admission_bytes: int
    rows_written: int
    rows_estimated: bool
    storage_dtype: DType
    state_dtype: DType
    record_bytes: int
    disk_bytes: int
    values_clamped: int
    values_flushed: int
    new_keys_per_s: float
    rows_touched: int
    row_norm: Histogram
    update_norm: Histogram
    row_idle_s: Histogram
    nonfinite_rows: int
    health_window_s: float
    health_scanned_unix_s: float
    rows_erased: int
    def __init__(self, name: _Optional[str] = ..., dim: _Optional[int] = ..., rows: _Optional[int] = ..., memory_bytes: _Optional[int] = ..., lookups: _Optional[int] = ..., pushes: _Optional[int] = ..., rows_created: _Optional[int] = ..., resident_rows: _Optional[int] = ..., spilled_rows: _Optional[int] = ..., bytes_per_resident_row: _Optional[float] = ..., ram_hits: _Optional[int] = ..., ram_misses: _Optional[int] = ..., ram_hit_rate: _Optional[float] = ..., rows_spilled: _Optional[int] = ..., rows_faulted_in: _Optional[int] = ..., spill_rows_per_s: _Optional[float] = ..., fault_in_rows_per_s: _Optional[float] = ..., lookups_not_admitted: _Optional[int] = ..., pushes_dropped: _Optional[int] = ..., rows_expired: _Optional[int] = ..., rows_evicted_rare: _Optional[int] = ..., admission_bytes: _Optional[int] = ..., rows_written: _Optional[int] = ..., rows_estimated: _Optional[bool] = ..., storage_dtype: _Optional[_Union[DType, str]] = ..., state_dtype: _Optional[_Union[DType, str]] = ..., record_bytes: _Optional[int] = ..., disk_bytes: _Optional[int] = ..., values_clamped: _Optional[int] = ..., values_flushed: _Optional[int] = ..., new_keys_per_s: _Optional[float] = ..., rows_touched: _Optional[int] = ..., row_norm: _Optional[_Union[Histogram, _Mapping]] = ..., update_norm: _Optional[_Union[Histogram, _Mapping]] = ..., row_idle_s: _Optional[_Union[Histogram, _Mapping]] = ..., nonfinite_rows: _Optional[int] = ..., health_window_s: _Optional[float] = ..., health_scanned_unix_s: _Optional[float] = ..., rows_erased: _Optional[int] = ...) -> None: ...

class Histogram(_message.Message):
    __slots__ = ("le", "counts", "sum", "recent")
    LE_FIELD_NUMBER: _ClassVar[int]
    COUNTS_FIELD_NUMBER: _ClassVar[int]
    SUM_FIELD_NUMBER: _ClassVar[int]
    RECENT_FIELD_NUMBER: _ClassVar[int]
    le: bytes
    counts: _containers.RepeatedScalarFieldContainer[int]
    sum: float
    recent: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, le: _Optional[bytes] = ..., counts: _Optional[_Iterable[int]] = ..., sum: _Optional[float] = ..., recent: _Optional[_Iterable[int]] = ...) -> None: ...

class LoopFailure(_message.Message):
    __slots__ = ("loop", "error", "failures", "first_failure_unix_s", "last_failure_unix_s")
    LOOP_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    FAILURES_FIELD_NUMBER: _ClassVar[int]
    FIRST_FAILURE_UNIX_S_FIELD_NUMBER: _ClassVar[int]
    LAST_FAILURE_UNIX_S_FIELD_NUMBER: _ClassVar[int]
    loop: str
    error: str
    failures: int
    first_failure_unix_s: float
    last_failure_unix_s: float
    def __init__(self, loop: _Optional[str] = ..., error: _Optional[str] = ..., failures: _Optional[int] = ..., first_failure_unix_s: _Optional[float] = ..., last_failure_unix_s: _Optional[float] = ...) -> None: ...

class StatsResponse(_message.Message):
    __slots__ = ("shard", "num_shards", "mode", "uptime_s", "tables", "duplicate_pushes", "memory_budget_bytes", "resident_bytes", "durability", "writable", "storage_error", "last_durable_unix_s", "failing_loops", "version", "follow", "lineage")
    SHARD_FIELD_NUMBER: _ClassVar[int]
    NUM_SHARDS_FIELD_NUMBER: _ClassVar[int]
    MODE_FIELD_NUMBER: _ClassVar[int]
    UPTIME_S_FIELD_NUMBER: _ClassVar[int]
    TABLES_FIELD_NUMBER: _ClassVar[int]
    DUPLICATE_PUSHES_FIELD_NUMBER: _ClassVar[int]
    MEMORY_BUDGET_BYTES_FIELD_NUMBER: _ClassVar[int]
    RESIDENT_BYTES_FIELD_NUMBER: _ClassVar[int]
    DURABILITY_FIELD_NUMBER: _ClassVar[int]
    WRITABLE_FIELD_NUMBER: _ClassVar[int]
    STORAGE_ERROR_FIELD_NUMBER: _ClassVar[int]
    LAST_DURABLE_UNIX_S_FIELD_NUMBER: _ClassVar[int]
    FAILING_LOOPS_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    FOLLOW_FIELD_NUMBER: _ClassVar[int]
    LINEAGE_FIELD_NUMBER: _ClassVar[int]
    shard: int
    num_shards: int
    mode: str
    uptime_s: float
    tables: _containers.RepeatedCompositeFieldContainer[TableStats]
    duplicate_pushes: int
    memory_budget_bytes: int
    resident_bytes: int
    durability: str
    writable: bool
    storage_error: str
    last_durable_unix_s: float
    failing_loops: _containers.RepeatedCompositeFieldContainer[LoopFailure]
    version: int
    follow: FollowStatus
    lineage: str
    def __init__(self, shard: _Optional[int] = ..., num_shards: _Optional[int] = ..., mode: _Optional[str] = ..., uptime_s: _Optional[float] = ..., tables: _Optional[_Iterable[_Union[TableStats, _Mapping]]] = ..., duplicate_pushes: _Optional[int] = ..., memory_budget_bytes: _Optional[int] = ..., resident_bytes: _Optional[int] = ..., durability: _Optional[str] = ..., writable: _Optional[bool] = ..., storage_error: _Optional[str] = ..., last_durable_unix_s: _Optional[float] = ..., failing_loops: _Optional[_Iterable[_Union[LoopFailure, _Mapping]]] = ..., version: _Optional[int] = ..., follow: _Optional[_Union[FollowStatus, _Mapping]] = ..., lineage: _Optional[str] = ...) -> None: ...

class FollowStatus(_message.Message):
    __slots__ = ("source", "leader", "checkpoint", "connected", "applied_version", "leader_version", "lag_versions", "lag_s", "snapshots", "batches", "error", "publication", "publications", "staged_batches", "published_only")
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    LEADER_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_FIELD_NUMBER: _ClassVar[int]
    CONNECTED_FIELD_NUMBER: _ClassVar[int]
    APPLIED_VERSION_FIELD_NUMBER: _ClassVar[int]
    LEADER_VERSION_FIELD_NUMBER: _ClassVar[int]
    LAG_VERSIONS_FIELD_NUMBER: _ClassVar[int]
    LAG_S_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOTS_FIELD_NUMBER: _ClassVar[int]
    BATCHES_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    PUBLICATION_FIELD_NUMBER: _ClassVar[int]
    PUBLICATIONS_FIELD_NUMBER: _ClassVar[int]
    STAGED_BATCHES_FIELD_NUMBER: _ClassVar[int]
    PUBLISHED_ONLY_FIELD_NUMBER: _ClassVar[int]
    source: str
    leader: str
    checkpoint: str
    connected: bool
    applied_version: int
    leader_version: int
    lag_versions: int
    lag_s: float
    snapshots: int
    batches: int
    error: str
    publication: str
    publications: int
    staged_batches: int
    published_only: bool
    def __init__(self, source: _Optional[str] = ..., leader: _Optional[str] = ..., checkpoint: _Optional[str] = ..., connected: _Optional[bool] = ..., applied_version: _Optional[int] = ..., leader_version: _Optional[int] = ..., lag_versions: _Optional[int] = ..., lag_s: _Optional[float] = ..., snapshots: _Optional[int] = ..., batches: _Optional[int] = ..., error: _Optional[str] = ..., publication: _Optional[str] = ..., publications: _Optional[int] = ..., staged_batches: _Optional[int] = ..., published_only: _Optional[bool] = ...) -> None: ...

class FollowRequest(_message.Message):
    __slots__ = ("history", "version", "shard", "num_shards")
    HISTORY_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    SHARD_FIELD_NUMBER: _ClassVar[int]
    NUM_SHARDS_FIELD_NUMBER: _ClassVar[int]
    history: str
    version: int
    shard: int
    num_shards: int
    def __init__(self, history: _Optional[str] = ..., version: _Optional[int] = ..., shard: _Optional[int] = ..., num_shards: _Optional[int] = ...) -> None: ...

class TableDelta(_message.Message):
    __slots__ = ("table", "keys", "rows", "dim", "deleted_keys", "dtype")
    TABLE_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    ROWS_FIELD_NUMBER: _ClassVar[int]
    DIM_FIELD_NUMBER: _ClassVar[int]
    DELETED_KEYS_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    table: str
    keys: bytes
    rows: bytes
    dim: int
    deleted_keys: bytes
    dtype: DType
    def __init__(self, table: _Optional[str] = ..., keys: _Optional[bytes] = ..., rows: _Optional[bytes] = ..., dim: _Optional[int] = ..., deleted_keys: _Optional[bytes] = ..., dtype: _Optional[_Union[DType, str]] = ...) -> None: ...

class FollowBatch(_message.Message):
    __slots__ = ("history", "version", "leader_version", "version_unix_s", "specs", "deltas", "snapshot_begin", "snapshot_end", "in_snapshot", "num_shards", "lineage", "published", "published_exact")
    HISTORY_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    LEADER_VERSION_FIELD_NUMBER: _ClassVar[int]
    VERSION_UNIX_S_FIELD_NUMBER: _ClassVar[int]
    SPECS_FIELD_NUMBER: _ClassVar[int]
    DELTAS_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOT_BEGIN_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOT_END_FIELD_NUMBER: _ClassVar[int]
    IN_SNAPSHOT_FIELD_NUMBER: _ClassVar[int]
    NUM_SHARDS_FIELD_NUMBER: _ClassVar[int]
    LINEAGE_FIELD_NUMBER: _ClassVar[int]
    PUBLISHED_FIELD_NUMBER: _ClassVar[int]
    PUBLISHED_EXACT_FIELD_NUMBER: _ClassVar[int]
    history: str
    version: int
    leader_version: int
    version_unix_s: float
    specs: _containers.RepeatedCompositeFieldContainer[TableSpec]
    deltas: _containers.RepeatedCompositeFieldContainer[TableDelta]
    snapshot_begin: bool
    snapshot_end: bool
    in_snapshot: bool
    num_shards: int
    lineage: str
    published: str
    published_exact: bool
    def __init__(self, history: _Optional[str] = ..., version: _Optional[int] = ..., leader_version: _Optional[int] = ..., version_unix_s: _Optional[float] = ..., specs: _Optional[_Iterable[_Union[TableSpec, _Mapping]]] = ..., deltas: _Optional[_Iterable[_Union[TableDelta, _Mapping]]] = ..., snapshot_begin: _Optional[bool] = ..., snapshot_end: _Optional[bool] = ..., in_snapshot: _Optional[bool] = ..., num_shards: _Optional[int] = ..., lineage: _Optional[str] = ..., published: _Optional[str] = ..., published_exact: _Optional[bool] = ...) -> None: ...

class PublishRequest(_message.Message):
    __slots__ = ("name", "hold", "wait_s")
    class Hold(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        KEEP: _ClassVar[PublishRequest.Hold]
        HOLD: _ClassVar[PublishRequest.Hold]
        RELEASE: _ClassVar[PublishRequest.Hold]
    KEEP: PublishRequest.Hold
    HOLD: PublishRequest.Hold
    RELEASE: PublishRequest.Hold
    NAME_FIELD_NUMBER: _ClassVar[int]
    HOLD_FIELD_NUMBER: _ClassVar[int]
    WAIT_S_FIELD_NUMBER: _ClassVar[int]
    name: str
    hold: PublishRequest.Hold
    wait_s: float
    def __init__(self, name: _Optional[str] = ..., hold: _Optional[_Union[PublishRequest.Hold, str]] = ..., wait_s: _Optional[float] = ...) -> None: ...

class PublishResponse(_message.Message):
    __slots__ = ("version", "held", "followers", "exact", "published", "held_by")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    HELD_FIELD_NUMBER: _ClassVar[int]
    FOLLOWERS_FIELD_NUMBER: _ClassVar[int]
    EXACT_FIELD_NUMBER: _ClassVar[int]
    PUBLISHED_FIELD_NUMBER: _ClassVar[int]
    HELD_BY_FIELD_NUMBER: _ClassVar[int]
    version: int
    held: bool
    followers: int
    exact: int
    published: str
    held_by: str
    def __init__(self, version: _Optional[int] = ..., held: _Optional[bool] = ..., followers: _Optional[int] = ..., exact: _Optional[int] = ..., published: _Optional[str] = ..., held_by: _Optional[str] = ...) -> None: ...

class RollBackRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class RollBackResponse(_message.Message):
    __slots__ = ("status",)
    STATUS_FIELD_NUMBER: _ClassVar[int]
    status: FollowStatus
    def __init__(self, status: _Optional[_Union[FollowStatus, _Mapping]] = ...) -> None: ...

class EraseRequest(_message.Message):
    __slots__ = ("table", "keys", "num_shards", "shard", "epoch", "compact", "checkpoints", "verify", "served", "others")
    TABLE_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    NUM_SHARDS_FIELD_NUMBER: _ClassVar[int]
    SHARD_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    COMPACT_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINTS_FIELD_NUMBER: _ClassVar[int]
    VERIFY_FIELD_NUMBER: _ClassVar[int]
    SERVED_FIELD_NUMBER: _ClassVar[int]
    OTHERS_FIELD_NUMBER: _ClassVar[int]
    table: str
    keys: bytes
    num_shards: int
    shard: int
    epoch: int
    compact: bool
    checkpoints: bool
    verify: bool
    served: bool
    others: bytes
    def __init__(self, table: _Optional[str] = ..., keys: _Optional[bytes] = ..., num_shards: _Optional[int] = ..., shard: _Optional[int] = ..., epoch: _Optional[int] = ..., compact: _Optional[bool] = ..., checkpoints: _Optional[bool] = ..., verify: _Optional[bool] = ..., served: _Optional[bool] = ..., others: _Optional[bytes] = ...) -> None: ...

class EraseResponse(_message.Message):
    __slots__ = ("erased_ram", "erased_disk", "version", "compacted", "compact_s", "checkpoints", "verified")
    ERASED_RAM_FIELD_NUMBER: _ClassVar[int]
    ERASED_DISK_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    COMPACTED_FIELD_NUMBER: _ClassVar[int]
    COMPACT_S_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINTS_FIELD_NUMBER: _ClassVar[int]
    VERIFIED_FIELD_NUMBER: _ClassVar[int]
    erased_ram: int
    erased_disk: int
    version: int
    compacted: bool
    compact_s: float
    checkpoints: _containers.RepeatedCompositeFieldContainer[ErasedCheckpoint]
    verified: bool
    def __init__(self, erased_ram: _Optional[int] = ..., erased_disk: _Optional[int] = ..., version: _Optional[int] = ..., compacted: _Optional[bool] = ..., compact_s: _Optional[float] = ..., checkpoints: _Optional[_Iterable[_Union[ErasedCheckpoint, _Mapping]]] = ..., verified: _Optional[bool] = ...) -> None: ...

class ErasedCheckpoint(_message.Message):
    __slots__ = ("path", "rows")
    PATH_FIELD_NUMBER: _ClassVar[int]
    ROWS_FIELD_NUMBER: _ClassVar[int]
    path: str
    rows: int
    def __init__(self, path: _Optional[str] = ..., rows: _Optional[int] = ...) -> None: ...

class ServeFromRequest(_message.Message):
    __slots__ = ("checkpoint",)
    CHECKPOINT_FIELD_NUMBER: _ClassVar[int]
    checkpoint: str
    def __init__(self, checkpoint: _Optional[str] = ...) -> None: ...

class ServeFromResponse(_message.Message):
    __slots__ = ("status",)
    STATUS_FIELD_NUMBER: _ClassVar[int]
    status: FollowStatus
    def __init__(self, status: _Optional[_Union[FollowStatus, _Mapping]] = ...) -> None: ...

class CheckpointRequest(_message.Message):
    __slots__ = ("path",)
    PATH_FIELD_NUMBER: _ClassVar[int]
    path: str
    def __init__(self, path: _Optional[str] = ...) -> None: ...

class CheckpointResponse(_message.Message):
    __slots__ = ("path", "manifest_json")
    PATH_FIELD_NUMBER: _ClassVar[int]
    MANIFEST_JSON_FIELD_NUMBER: _ClassVar[int]
    path: str
    manifest_json: str
    def __init__(self, path: _Optional[str] = ..., manifest_json: _Optional[str] = ...) -> None: ...

class LoadCheckpointRequest(_message.Message):
    __slots__ = ("checkpoint", "num_shards", "tables")
    CHECKPOINT_FIELD_NUMBER: _ClassVar[int]
    NUM_SHARDS_FIELD_NUMBER: _ClassVar[int]
    TABLES_FIELD_NUMBER: _ClassVar[int]
    checkpoint: str
    num_shards: int
    tables: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, checkpoint: _Optional[str] = ..., num_shards: _Optional[int] = ..., tables: _Optional[_Iterable[str]] = ...) -> None: ...

class LoadCheckpointResponse(_message.Message):
    __slots__ = ("rows", "parts")
    class RowsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    ROWS_FIELD_NUMBER: _ClassVar[int]
    PARTS_FIELD_NUMBER: _ClassVar[int]
    rows: _containers.ScalarMap[str, int]
    parts: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, rows: _Optional[_Mapping[str, int]] = ..., parts: _Optional[_Iterable[str]] = ...) -> None: ...

class ClusterMap(_message.Message):
    __slots__ = ("epoch", "num_shards", "addresses")
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    NUM_SHARDS_FIELD_NUMBER: _ClassVar[int]
    ADDRESSES_FIELD_NUMBER: _ClassVar[int]
    epoch: int
    num_shards: int
    addresses: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, epoch: _Optional[int] = ..., num_shards: _Optional[int] = ..., addresses: _Optional[_Iterable[str]] = ...) -> None: ...

class GetMapRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetMapResponse(_message.Message):
    __slots__ = ("map", "shard", "reshard", "follow")
    MAP_FIELD_NUMBER: _ClassVar[int]
    SHARD_FIELD_NUMBER: _ClassVar[int]
    RESHARD_FIELD_NUMBER: _ClassVar[int]
    FOLLOW_FIELD_NUMBER: _ClassVar[int]
    map: ClusterMap
    shard: int
    reshard: ReshardStatus
    follow: FollowStatus
    def __init__(self, map: _Optional[_Union[ClusterMap, _Mapping]] = ..., shard: _Optional[int] = ..., reshard: _Optional[_Union[ReshardStatus, _Mapping]] = ..., follow: _Optional[_Union[FollowStatus, _Mapping]] = ...) -> None: ...

class ReshardRequest(_message.Message):
    __slots__ = ("phase", "to", "max_rows_per_s")
    class Phase(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        STATUS: _ClassVar[ReshardRequest.Phase]
        PREPARE: _ClassVar[ReshardRequest.Phase]
        FREEZE: _ClassVar[ReshardRequest.Phase]
        COMMIT: _ClassVar[ReshardRequest.Phase]
        ABORT: _ClassVar[ReshardRequest.Phase]
    STATUS: ReshardRequest.Phase
    PREPARE: ReshardRequest.Phase
    FREEZE: ReshardRequest.Phase
    COMMIT: ReshardRequest.Phase
    ABORT: ReshardRequest.Phase
    PHASE_FIELD_NUMBER: _ClassVar[int]
    TO_FIELD_NUMBER: _ClassVar[int]
    FROM_FIELD_NUMBER: _ClassVar[int]
    MAX_ROWS_PER_S_FIELD_NUMBER: _ClassVar[int]
    phase: ReshardRequest.Phase
    to: ClusterMap
    max_rows_per_s: float
    def __init__(self, phase: _Optional[_Union[ReshardRequest.Phase, str]] = ..., to: _Optional[_Union[ClusterMap, _Mapping]] = ..., max_rows_per_s: _Optional[float] = ..., **kwargs) -> None: ...

class MoveSource(_message.Message):
    __slots__ = ("shard", "address", "connected", "snapshot_done", "complete", "rows", "bytes", "lag_versions", "error", "disk_failed", "first_copy_rows", "changed_rows")
    SHARD_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    CONNECTED_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOT_DONE_FIELD_NUMBER: _ClassVar[int]
    COMPLETE_FIELD_NUMBER: _ClassVar[int]
    ROWS_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    LAG_VERSIONS_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    DISK_FAILED_FIELD_NUMBER: _ClassVar[int]
    FIRST_COPY_ROWS_FIELD_NUMBER: _ClassVar[int]
    CHANGED_ROWS_FIELD_NUMBER: _ClassVar[int]
    shard: int
    address: str
    connected: bool
    snapshot_done: bool
    complete: bool
    rows: int
    bytes: int
    lag_versions: int
    error: str
    disk_failed: bool
    first_copy_rows: int
    changed_rows: int
    def __init__(self, shard: _Optional[int] = ..., address: _Optional[str] = ..., connected: _Optional[bool] = ..., snapshot_done: _Optional[bool] = ..., complete: _Optional[bool] = ..., rows: _Optional[int] = ..., bytes: _Optional[int] = ..., lag_versions: _Optional[int] = ..., error: _Optional[str] = ..., disk_failed: _Optional[bool] = ..., first_copy_rows: _Optional[int] = ..., changed_rows: _Optional[int] = ...) -> None: ...

class ReshardStatus(_message.Message):
    __slots__ = ("phase", "to", "sources", "rows_out", "bytes_out", "rows_dropped", "pending_ledgers")
    PHASE_FIELD_NUMBER: _ClassVar[int]
    FROM_FIELD_NUMBER: _ClassVar[int]
    TO_FIELD_NUMBER: _ClassVar[int]
    SOURCES_FIELD_NUMBER: _ClassVar[int]
    ROWS_OUT_FIELD_NUMBER: _ClassVar[int]
    BYTES_OUT_FIELD_NUMBER: _ClassVar[int]
    ROWS_DROPPED_FIELD_NUMBER: _ClassVar[int]
    PENDING_LEDGERS_FIELD_NUMBER: _ClassVar[int]
    phase: str
    to: ClusterMap
    sources: _containers.RepeatedCompositeFieldContainer[MoveSource]
    rows_out: int
    bytes_out: int
    rows_dropped: int
    pending_ledgers: int
    def __init__(self, phase: _Optional[str] = ..., to: _Optional[_Union[ClusterMap, _Mapping]] = ..., sources: _Optional[_Iterable[_Union[MoveSource, _Mapping]]] = ..., rows_out: _Optional[int] = ..., bytes_out: _Optional[int] = ..., rows_dropped: _Optional[int] = ..., pending_ledgers: _Optional[int] = ..., **kwargs) -> None: ...

class MoveRowsRequest(_message.Message):
    __slots__ = ("to", "destination", "max_rows_per_s")
    TO_FIELD_NUMBER: _ClassVar[int]
    DESTINATION_FIELD_NUMBER: _ClassVar[int]
    MAX_ROWS_PER_S_FIELD_NUMBER: _ClassVar[int]
    to: ClusterMap
    destination: int
    max_rows_per_s: float
    def __init__(self, to: _Optional[_Union[ClusterMap, _Mapping]] = ..., destination: _Optional[int] = ..., max_rows_per_s: _Optional[float] = ...) -> None: ...

class MovedRows(_message.Message):
    __slots__ = ("table", "keys", "rows", "deleted_keys")
    TABLE_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    ROWS_FIELD_NUMBER: _ClassVar[int]
    DELETED_KEYS_FIELD_NUMBER: _ClassVar[int]
    table: str
    keys: bytes
    rows: bytes
    deleted_keys: bytes
    def __init__(self, table: _Optional[str] = ..., keys: _Optional[bytes] = ..., rows: _Optional[bytes] = ..., deleted_keys: _Optional[bytes] = ...) -> None: ...

class MovedLedger(_message.Message):
    __slots__ = ("table", "client_id", "entry")
    TABLE_FIELD_NUMBER: _ClassVar[int]
    CLIENT_ID_FIELD_NUMBER: _ClassVar[int]
    ENTRY_FIELD_NUMBER: _ClassVar[int]
    table: str
    client_id: str
    entry: bytes
    def __init__(self, table: _Optional[str] = ..., client_id: _Optional[str] = ..., entry: _Optional[bytes] = ...) -> None: ...

class MovedAdmission(_message.Message):
    __slots__ = ("table", "counters")
    TABLE_FIELD_NUMBER: _ClassVar[int]
    COUNTERS_FIELD_NUMBER: _ClassVar[int]
    table: str
    counters: bytes
    def __init__(self, table: _Optional[str] = ..., counters: _Optional[bytes] = ...) -> None: ...

class MoveBatch(_message.Message):
    __slots__ = ("history", "version", "specs", "tables", "snapshot_begin", "snapshot_end", "ledgers", "admission", "done", "source_version")
    HISTORY_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    SPECS_FIELD_NUMBER: _ClassVar[int]
    TABLES_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOT_BEGIN_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOT_END_FIELD_NUMBER: _ClassVar[int]
    LEDGERS_FIELD_NUMBER: _ClassVar[int]
    ADMISSION_FIELD_NUMBER: _ClassVar[int]
    DONE_FIELD_NUMBER: _ClassVar[int]
    SOURCE_VERSION_FIELD_NUMBER: _ClassVar[int]
    history: str
    version: int
    specs: _containers.RepeatedCompositeFieldContainer[TableSpec]
    tables: _containers.RepeatedCompositeFieldContainer[MovedRows]
    snapshot_begin: bool
    snapshot_end: bool
    ledgers: _containers.RepeatedCompositeFieldContainer[MovedLedger]
    admission: _containers.RepeatedCompositeFieldContainer[MovedAdmission]
    done: bool
    source_version: int
    def __init__(self, history: _Optional[str] = ..., version: _Optional[int] = ..., specs: _Optional[_Iterable[_Union[TableSpec, _Mapping]]] = ..., tables: _Optional[_Iterable[_Union[MovedRows, _Mapping]]] = ..., snapshot_begin: _Optional[bool] = ..., snapshot_end: _Optional[bool] = ..., ledgers: _Optional[_Iterable[_Union[MovedLedger, _Mapping]]] = ..., admission: _Optional[_Iterable[_Union[MovedAdmission, _Mapping]]] = ..., done: _Optional[bool] = ..., source_version: _Optional[int] = ...) -> None: ...
