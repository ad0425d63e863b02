"""A shard's RAM + RocksDB tier against a plain-dict model, bit for bit.

A hypothesis state machine drives an in-process ``Shard`` on a real data directory
(no gRPC): lookups (training and serving), pushes (fresh, out of order, ``seq=0`` and
retried), evictions (explicit, and by the memory budget), flushes, checkpoints,
restores from a checkpoint, clean restarts and crashes.

A crash is a ``kill -9``: nothing is flushed; the storage is closed (RocksDB's WAL
keeps every committed batch, as the OS page cache does for a killed process) and a
new ``Shard`` opens the same directory with the same durability.

Three tables (SGD without state, Adagrad, Adam; dims 1, 3, 2) share a small key
space (negative and extreme int64 keys included), so rows are evicted, faulted back
in and re-created after a crash all the time. The model keeps, per table:

* ``rows``: key -> (values, optimizer state) of every row that exists (what a lookup
  returns); ``disk``: the same for what the column family on disk holds;
* ``ledger``/``disk_ledger``: which ``(client_id, seq)`` pushes the table's ledger in
  RAM / on disk knows;
* ``count``/``disk_count``: lookups of each row, in RAM / on disk (checked only where
  ``evict_below_frequency`` reads them).

In every-push mode a push's rows and ledger entry, and the rows a training lookup
creates, are on disk when the call returns. A push sums duplicate keys' gradients like
``Table.push`` (``np.add.at`` into zeros, in input order), creates missing rows with
``initial_rows`` + ``init_state`` and applies ``optimizers.apply`` to the model's own
arrays: the optimizer maths has its own tests, this file checks the tier's
bookkeeping. After every step, ``Table.export`` must equal ``rows``, a scan of the
column family must equal ``disk``, and both ledgers must match, values and state
compared by their bits.

The model does not predict which rows an eviction picks: it observes which rows left
RAM during a step. Each of those was written to disk in its current form, or deleted
if looked up fewer than ``evict_below_frequency`` times; the export and disk checks
then prove that it was.

``tests/unit/test_tier_model.py`` runs the machine: a plain run uses the short
profile (well under a minute), ``pytest -m slow`` the long one.
"""

from __future__ import annotations

import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import numpy.typing as npt
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from ps.durability import Durability, copy_checkpoint
from ps.shard import Shard
from ps.store import RowFormat, Rows, Storage
from ps.table import (
    InitializerKind,
    InitializerParams,
    Lifecycle,
    OptimizerKind,
    OptimizerParams,
    TableSpec,
    optimizers,
)
from ps.table.initializers import initial_rows
from ps.table.ledger import PushLedger
from tests.fakes import push_request

F32 = npt.NDArray[np.float32]
Row = tuple[F32, F32]  # (values, state); never mutated once in the model
Entry = tuple[str, list[int], list[list[float]]]  # (table, keys, grads) as sent

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1


def _specs(tag_lifecycle: Lifecycle) -> dict[str, TableSpec]:
    specs = (
        # No optimizer state (SGD: width 0).
        TableSpec("tag", 1, optimizer=OptimizerParams(OptimizerKind.SGD, lr=0.5), seed=7, lifecycle=tag_lifecycle),
        TableSpec(
            "user",
            3,
            initializer=InitializerParams(InitializerKind.UNIFORM, low=-1.0, high=1.0),
            optimizer=OptimizerParams(OptimizerKind.ADAGRAD, lr=0.1, initial_accumulator_value=0.1, weight_decay=0.01),
            seed=11,
        ),
        # Its name starts with the name of "user": ledger and spec keys must keep them apart.
        TableSpec(
            "user.item",
            2,
            initializer=InitializerParams(InitializerKind.NORMAL, mean=0.0, std=0.5),
            optimizer=OptimizerParams(OptimizerKind.ADAM, lr=0.05),
            seed=2**64 - 5,
        ),
    )
    return {s.name: s for s in specs}


SPECS = _specs(Lifecycle())
LIFECYCLE_SPECS = _specs(Lifecycle(evict_below_frequency=2))
NAMES = sorted(SPECS)
DIMS = {name: spec.dim for name, spec in SPECS.items()}
CLIENTS = ["w0", "w1"]

# A small key space, so evictions, faults and re-creations after a crash are common.
KEYS = [*range(30), -1, -2, -3, -1000, 2**31, 2**40 + 7, INT64_MIN, INT64_MIN + 1, INT64_MAX - 1, INT64_MAX]


@dataclass(frozen=True)
class Mode:
    name: str
    durability: Durability
    memory_budget_bytes: int = 0

    def __str__(self) -> str:
        return self.name


MODES = [
    Mode("every-push", Durability("every-push")),
    Mode("checkpoint-only", Durability("checkpoint-only")),
    # No maintenance thread runs here, so an interval this long never fires: the
    # budget's evictions (after each request; a few dozen rows fit) are what reaches disk.
    Mode("interval-budget", Durability("interval", 1e9), memory_budget_bytes=1000),
    Mode("every-push-budget", Durability("every-push"), memory_budget_bytes=1000),
]


class Clock:
    """Stands in for ``ps.table.lifecycle.now_tick`` in ``ps.table`` and ``ps.shard``: one tick
    per step, so an eviction picks the same rows whenever hypothesis replays a step
    sequence (with the wall clock it would depend on timing, and shrinking would fail)."""

    def __init__(self) -> None:
        self.tick = 0

    def __call__(self) -> np.uint32:
        return np.uint32(self.tick)


SHORT = settings(max_examples=20, stateful_step_count=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
LONG = settings(max_examples=600, stateful_step_count=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])

# Per example; more only cost time (hypothesis would otherwise take one in most steps).
MAX_CHECKPOINTS = 3

key_st = st.sampled_from(KEYS)
grad_st = st.floats(-2.0, 2.0, width=32)  # includes -0.0 and subnormals


@st.composite
def entries_st(draw: st.DrawFn) -> list[Entry]:
    names = draw(st.lists(st.sampled_from(NAMES), min_size=1, max_size=len(NAMES), unique=True))
    out: list[Entry] = []
    for name in names:
        dim = DIMS[name]
        keys = draw(st.lists(key_st, max_size=8))
        grads = [draw(st.lists(grad_st, min_size=dim, max_size=dim)) for _ in keys]
        out.append((name, keys, grads))
    return out


@dataclass
class TableModel:
    rows: dict[int, Row] = field(default_factory=dict)
    disk: dict[int, Row] = field(default_factory=dict)
    ledger: dict[str, frozenset[int]] = field(default_factory=dict)
    disk_ledger: dict[str, frozenset[int]] = field(default_factory=dict)
    # Lookups of each row (what ``evict_below_frequency`` compares), in RAM and on disk.
    count: dict[int, int] = field(default_factory=dict)
    disk_count: dict[int, int] = field(default_factory=dict)

    def copy(self) -> TableModel:
        return TableModel(
            dict(self.rows),
            dict(self.disk),
            dict(self.ledger),
            dict(self.disk_ledger),
            dict(self.count),
            dict(self.disk_count),
        )

    def persist_all(self) -> None:
        self.disk = dict(self.rows)
        self.disk_ledger = dict(self.ledger)
        self.disk_count = dict(self.count)

    def lose_ram(self) -> None:
        self.rows = dict(self.disk)
        self.ledger = dict(self.disk_ledger)
        self.count = dict(self.disk_count)


def new_row(spec: TableSpec, key: int) -> Row:
    values = initial_rows(spec.initializer, spec.seed, [key], spec.dim)[0]
    state = np.empty((1, optimizers.state_width(spec.optimizer, spec.dim)), np.float32)
    optimizers.init_state(spec.optimizer, state, np.zeros(1, np.int64))
    return values, state[0]


def bits(a: npt.NDArray[np.float32]) -> npt.NDArray[np.uint32]:
    return np.ascontiguousarray(a, dtype=np.float32).view(np.uint32)


def assert_rows_equal(what: str, keys: list[int], got_values: F32, got_state: F32, expected: dict[int, Row]) -> None:
    """``got_*[i]`` is the row of ``keys[i]``; it must equal ``expected`` bit for bit, and
    ``keys`` must be exactly the keys of ``expected``."""
    assert len(set(keys)) == len(keys), f"{what}: a key appears twice: {sorted(keys)}"
    missing, extra = sorted(set(expected) - set(keys)), sorted(set(keys) - set(expected))
    assert not missing and not extra, f"{what}: keys missing {missing}, unexpected {extra}"
    for i, k in enumerate(keys):
        values, state = expected[k]
        if not (np.array_equal(bits(got_values[i]), bits(values)) and np.array_equal(bits(got_state[i]), bits(state))):
            raise AssertionError(
                f"{what}: key {k}: got values {got_values[i].tolist()} state {got_state[i].tolist()}, "
                f"expected values {values.tolist()} state {state.tolist()}"
            )


def ledger_sets(entries: dict[str, bytes]) -> dict[str, frozenset[int]]:
    out = {}
    for client, data in entries.items():
        low, ranges = PushLedger.decode(data)
        seqs = frozenset(range(1, low + 1)).union(*(range(a, b + 1) for a, b in ranges))
        if seqs:
            out[client] = seqs
    return out


@dataclass
class Before:
    """What a step's observation needs from before it: spill counters and residency."""

    spills: dict[str, int]
    resident: dict[str, set[int]]


class TierMachine(RuleBasedStateMachine):
    def __init__(self, mode: Mode, specs: dict[str, TableSpec], root: Path, clock: Clock) -> None:
        super().__init__()
        assert sorted(specs) == NAMES
        self.clock = clock
        clock.tick = 1 << 20
        self.mode = mode
        self.specs = specs
        self.root = Path(tempfile.mkdtemp(dir=root))
        self.dirs = 0
        self.shard: Shard | None = None
        self.data_dir = self._new_dir()
        self.shard = self._open(fresh=True)
        self.model = {name: TableModel() for name in NAMES}
        self.next_seq = dict.fromkeys(CLIENTS, 0)
        self.gaps: dict[str, list[int]] = {c: [] for c in CLIENTS}
        self.sent: list[tuple[list[Entry], str, int]] = []
        self.checkpoints: list[tuple[Path, dict[str, TableModel]]] = []
        # Row counts (resident + spilled) are exact until the shard reopens a directory;
        # after that the spilled part is RocksDB's estimate.
        self.counts_exact = True

    # -- plumbing ------------------------------------------------------------------------

    def _new_dir(self) -> Path:
        self.dirs += 1
        return self.root / f"data{self.dirs}"

    def _open(self, *, fresh: bool = False) -> Shard:
        storage = Storage(self.data_dir, shard=0, num_shards=1)
        try:
            shard = Shard(0, 1, storage, self.mode.durability, self.mode.memory_budget_bytes, self.root)
            for spec in self.specs.values():
                # On a reopened directory the stored spec must round-trip to an identical one.
                assert shard.create_table(spec) == fresh
        except BaseException:
            storage.close()
            raise
        return shard

    def _close(self, clean: bool) -> None:
        shard, self.shard = self.shard, None
        if shard is None or shard.storage is None:
            return
        if clean:
            shard.shutdown()
        else:
            shard.storage.close()

    @property
    def every_push(self) -> bool:
        return self.mode.durability.kind == "every-push"

    def _live(self) -> Shard:
        assert self.shard is not None
        return self.shard

    def _floor(self, name: str) -> int:
        return self.specs[name].lifecycle.evict_below_frequency

    def _ensure(self, name: str, key: int) -> Row:
        m = self.model[name]
        if key not in m.rows:
            m.rows[key] = new_row(self.specs[name], key)
            m.count[key] = 0
        return m.rows[key]

    def _resident(self, name: str) -> set[int]:
        m = self.model[name]
        if not m.rows:
            return set()
        keys = np.fromiter(m.rows, np.int64, len(m.rows))
        return set(keys[self._live().table(name)._ram.slots(keys) >= 0].tolist())

    def _before(self) -> Before:
        self.clock.tick += 1
        shard = self._live()
        spills = {}
        for name in NAMES:
            c = shard.table(name).counters
            spills[name] = c.rows_spilled + c.rows_evicted_rare
        return Before(spills, {name: self._resident(name) for name in NAMES})

    def _observe_evictions(self, before: Before, touched: dict[str, set[int]]) -> None:
        """Apply what evictions during the step did (see the module docstring).

        The rows that left RAM are those not resident now that were resident before or
        were brought into RAM by the step (``touched``). Each was written to disk, or,
        if looked up fewer than the table's ``evict_below_frequency`` times, deleted.
        """
        shard = self._live()
        for name in NAMES:
            c, m = shard.table(name).counters, self.model[name]
            if c.rows_spilled + c.rows_evicted_rare != before.spills[name]:
                # Every eviction writes the ledger entries changed since the last write.
                m.disk_ledger = dict(m.ledger)
            was_in_ram = (before.resident[name] | touched.get(name, set())) & set(m.rows)
            floor = self._floor(name)
            for k in was_in_ram - self._resident(name):
                if floor and m.count[k] < floor:
                    del m.rows[k], m.count[k]
                    m.disk.pop(k, None)
                    m.disk_count.pop(k, None)
                else:
                    m.disk[k], m.disk_count[k] = m.rows[k], m.count[k]

    def _expect_push(self, entries: list[Entry], client: str, seq: int) -> tuple[bool, int]:
        applied, updated = False, 0
        for name, keys, grads in entries:
            spec, m = self.specs[name], self.model[name]
            if seq and seq in m.ledger.get(client, frozenset()):
                continue
            applied = True
            unique = list(dict.fromkeys(keys))
            updated += len(unique)
            if seq:
                m.ledger[client] = m.ledger.get(client, frozenset()) | {seq}
                if self.every_push:
                    m.disk_ledger[client] = m.ledger[client]
            if not unique:
                continue
            g = np.array(grads, np.float32).reshape(len(keys), spec.dim)
            if len(unique) < len(keys):
                # Table.push sums duplicates with np.add.at into zeros, in input order,
                # and then every row's gradient is that sum (0.0 + g turns -0.0 into +0.0).
                sums = {k: np.zeros(spec.dim, np.float32) for k in unique}
                for k, row in zip(keys, g, strict=True):
                    sums[k] = sums[k] + row
                g = np.stack([sums[k] for k in unique])
            rows = [self._ensure(name, k) for k in unique]
            values = np.stack([r[0] for r in rows])
            state = np.stack([r[1] for r in rows])
            optimizers.apply(
                spec.optimizer, values, state, np.arange(len(unique), dtype=np.int64), np.ascontiguousarray(g)
            )
            for i, k in enumerate(unique):
                m.rows[k] = (values[i].copy(), state[i].copy())
                if self.every_push:
                    m.disk[k], m.disk_count[k] = m.rows[k], m.count[k]
        return applied, updated

    def _send(self, entries: list[Entry], client: str, seq: int) -> None:
        shard = self._live()
        batch = [
            (name, np.array(keys, np.int64), np.array(grads, np.float32).reshape(len(keys), self.specs[name].dim))
            for name, keys, grads in entries
        ]
        # A table that knows this push leaves its rows where they are (even on disk).
        touched = {
            name: set(keys) for name, keys, _ in entries if not (seq and seq in self.model[name].ledger.get(client, ()))
        }
        before = self._before()
        got = shard.push(push_request(batch, client, seq))
        expected = self._expect_push(entries, client, seq)
        assert got == expected, f"push({client!r}, seq={seq}) returned (applied, rows) {got}, expected {expected}"
        self._observe_evictions(before, touched)

    # -- rules ---------------------------------------------------------------------------

    @rule(name=st.sampled_from(NAMES), keys=st.lists(key_st, max_size=10))
    def lookup(self, name: str, keys: list[int]) -> None:
        shard = self._live()
        before = self._before()
        got = shard.table(name).lookup(np.array(keys, np.int64))
        shard.budget.after_request()
        m = self.model[name]
        new = [k for k in dict.fromkeys(keys) if k not in m.rows]
        rows = [self._ensure(name, k) for k in keys]
        if self.every_push:  # the rows it creates are written before it returns, unused yet
            for k in new:
                m.disk[k], m.disk_count[k] = m.rows[k], 0
        for k in keys:  # every occurrence counts, duplicates too
            m.count[k] += 1
        expected = np.stack([r[0] for r in rows]) if rows else np.empty((0, self.specs[name].dim), np.float32)
        assert np.array_equal(bits(got), bits(expected)), (
            f"lookup {name} {keys}: got {got.tolist()}, expected {expected.tolist()}"
        )
        self._observe_evictions(before, {name: set(keys)})

    @rule(name=st.sampled_from(NAMES), keys=st.lists(key_st, max_size=10))
    def lookup_serving(self, name: str, keys: list[int]) -> None:
        # create=False: keys without a row read as zeros and nothing is created, but rows
        # on disk are faulted in.
        shard = self._live()
        before = self._before()
        got = shard.table(name).lookup(np.array(keys, np.int64), create=False)
        shard.budget.after_request()
        m, dim = self.model[name], self.specs[name].dim
        expected = np.zeros((len(keys), dim), np.float32)
        for i, k in enumerate(keys):
            if k in m.rows:
                expected[i] = m.rows[k][0]
                m.count[k] += 1
        assert np.array_equal(bits(got), bits(expected)), (
            f"serving lookup {name} {keys}: got {got.tolist()}, expected {expected.tolist()}"
        )
        self._observe_evictions(before, {name: set(keys)})

    @rule(entries=entries_st(), client=st.sampled_from(CLIENTS), skip=st.integers(0, 2))
    def push(self, entries: list[Entry], client: str, skip: int) -> None:
        # Skipped seqs are sent later by push_out_of_order.
        self.gaps[client].extend(range(self.next_seq[client] + 1, self.next_seq[client] + 1 + skip))
        self.next_seq[client] += 1 + skip
        seq = self.next_seq[client]
        self.sent.append((entries, client, seq))
        self._send(entries, client, seq)

    @precondition(lambda self: any(self.gaps.values()))
    @rule(entries=entries_st(), data=st.data())
    def push_out_of_order(self, entries: list[Entry], data: st.DataObject) -> None:
        client = data.draw(st.sampled_from([c for c in CLIENTS if self.gaps[c]]))
        seq = self.gaps[client].pop(data.draw(st.integers(0, len(self.gaps[client]) - 1)))
        self.sent.append((entries, client, seq))
        self._send(entries, client, seq)

    @rule(entries=entries_st(), client=st.sampled_from(CLIENTS))
    def push_unsequenced(self, entries: list[Entry], client: str) -> None:
        self.sent.append((entries, client, 0))
        self._send(entries, client, 0)

    @precondition(lambda self: bool(self.sent))
    @rule(data=st.data())
    def retry_push(self, data: st.DataObject) -> None:
        # Resent as it was, as a client does after UNAVAILABLE or a lost response: applied
        # only where the table's ledger does not know it (seq 0: always).
        entries, client, seq = self.sent[data.draw(st.integers(0, len(self.sent) - 1))]
        self._send(entries, client, seq)

    @rule(name=st.sampled_from(NAMES), count=st.integers(1, 40))
    def evict(self, name: str, count: int) -> None:
        table = self._live().table(name)
        resident = len(table)
        before = self._before()
        moved = table.evict(count)
        assert moved == min(count, resident), f"evict({count}) of {resident} resident rows moved {moved}"
        assert len(table) == resident - moved
        self._observe_evictions(before, {})

    @rule()
    def flush(self) -> None:
        self._live().flush()
        for m in self.model.values():
            m.persist_all()

    @precondition(lambda self: len(self.checkpoints) < MAX_CHECKPOINTS)
    @rule()
    def checkpoint(self) -> None:
        path = self.root / f"checkpoint{len(self.checkpoints) + 1}"
        written, manifest = self._live().checkpoint(path)
        assert written == path / "shard-00000-of-00001" and manifest["version"] == path.name
        for m in self.model.values():
            m.persist_all()
        self.checkpoints.append((written, {n: m.copy() for n, m in self.model.items()}))

    @precondition(lambda self: bool(self.checkpoints))
    @rule(data=st.data())
    def restore_checkpoint(self, data: st.DataObject) -> None:
        path, snapshot = self.checkpoints[data.draw(st.integers(0, len(self.checkpoints) - 1))]
        self._close(clean=True)
        self.data_dir = self._new_dir()
        copy_checkpoint(path, self.data_dir)
        self.shard = self._open()
        self.counts_exact = False
        self.model = {n: m.copy() for n, m in snapshot.items()}

    @rule()
    def clean_restart(self) -> None:
        self._close(clean=True)
        for m in self.model.values():
            m.persist_all()
        self.shard = self._open()
        self.counts_exact = False
        for m in self.model.values():
            m.lose_ram()

    @rule()
    def crash_and_restart(self) -> None:
        self._close(clean=False)
        self.shard = self._open()
        self.counts_exact = False
        for m in self.model.values():
            m.lose_ram()

    # -- invariants ----------------------------------------------------------------------

    @invariant()
    def rows_match_model(self) -> None:
        shard = self._live()
        for name in NAMES:
            spec, table, m = self.specs[name], shard.table(name), self.model[name]
            rows = table.export()
            assert_rows_equal(f"table {name!r} export", rows.keys.tolist(), rows.values, rows.state, m.rows)
            assert table._disk is not None
            sw = optimizers.state_width(spec.optimizer, spec.dim)
            disk = Rows.concat(list(table._disk.scan()), RowFormat(spec.dim, sw))
            assert_rows_equal(f"table {name!r} on disk", disk.keys.tolist(), disk.values, disk.state, m.disk)

    @invariant()
    def lookup_counts_match_model(self) -> None:
        # Only where a lifecycle rule reads them back: elsewhere a clean row's count is
        # not rewritten on purpose, so after a restart it is whatever was last written.
        shard = self._live()
        for name in NAMES:
            if not self._floor(name):
                continue
            table, m = shard.table(name), self.model[name]
            keys = np.fromiter(m.rows, np.int64, len(m.rows))
            slots = table._ram.slots(keys)
            in_ram = {int(k): int(table._ram.arena.frequency[s]) for k, s in zip(keys, slots) if s >= 0}
            expected = {k: m.count[k] for k in in_ram}
            assert in_ram == expected, f"table {name!r}: lookup counts in RAM {in_ram}, expected {expected}"
            assert table._disk is not None
            on_disk = {k: int(f) for rec in table._disk.scan() for k, f in zip(rec.keys.tolist(), rec.frequency)}
            assert on_disk == m.disk_count, f"table {name!r}: lookup counts on disk {on_disk}, expected {m.disk_count}"

    @invariant()
    def row_counts_match_model(self) -> None:
        if not self.counts_exact:
            return
        shard = self._live()
        for name in NAMES:
            table, n = shard.table(name), len(self.model[name].rows)
            assert len(table) + table.spilled == n, (
                f"table {name!r}: {len(table)} resident + {table.spilled} spilled rows, expected {n} in all"
            )

    @invariant()
    def ledgers_match_model(self) -> None:
        shard = self._live()
        for name in NAMES:
            table, m = shard.table(name), self.model[name]
            in_ram = ledger_sets({c: table.ledger.encode(c) for c in table.ledger.clients()})
            assert in_ram == m.ledger, f"table {name!r}: ledger in RAM {in_ram}, expected {m.ledger}"
            assert table._disk is not None
            on_disk = ledger_sets(table._disk.ledgers())
            assert on_disk == m.disk_ledger, f"table {name!r}: ledger on disk {on_disk}, expected {m.disk_ledger}"

    def teardown(self) -> None:
        try:
            self._close(clean=False)
        finally:
            shutil.rmtree(self.root, ignore_errors=True)
