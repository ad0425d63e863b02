"""Multi-valued columns (``tags`` holding ``a|b|c``): the split kernel and the click-log readers
against a plain-Python reference (split the field, drop empty values, ``hash_feature`` each),
and the row operations of ``JaggedKeys`` that the trainer's data path uses."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from protos.keys import hash_feature
from worker.data import BadLines, ClickLog, ColumnSchema, feature_seed, load_click_log, rare_key, read_click_log
from worker.dataset import cv_fold
from worker.multivalued import JaggedKeys, split_keys, split_values

SCHEMA = ColumnSchema("y", ["n"], ["user"], sep=",", header=True, multi_valued={"tags": "|"}, log_transform=False)

# Values: anything but the delimiter, the separator and line breaks (fields are not quoted).
value = st.text(st.characters(blacklist_characters=",|\r\n", blacklist_categories=("Cs",)), max_size=6)
field = st.lists(value, max_size=5).map("|".join)
row = st.tuples(st.integers(0, 1), st.integers(0, 99), value, field)


def reference(tags: str, feature: str = "tags") -> list[int]:
    """The keys of one field, in plain Python: split, leave empty values out, hash each."""
    return [hash_feature(v, feature_seed(feature)) for v in tags.split("|") if v]


def write(path: Path, rows: list[tuple[int, int, str, str]]) -> Path:
    path.write_text("y,n,user,tags\n" + "".join(f"{y},{n},{u},{t}\n" for y, n, u, t in rows), encoding="utf-8")
    return path


@settings(max_examples=60, deadline=None)
@given(st.lists(row, min_size=1, max_size=40), st.sampled_from([7, 64, 1 << 20]), st.integers(1, 9))
def test_the_reader_gives_each_row_the_keys_of_its_values(
    tmp_path_factory: pytest.TempPathFactory, rows: list[tuple[int, int, str, str]], chunk_bytes: int, batch_size: int
) -> None:
    p = write(tmp_path_factory.mktemp("mv") / "log.csv", rows)
    got: list[list[int]] = []
    users: list[int] = []
    for b in read_click_log(p, SCHEMA, batch_size, chunk_bytes=chunk_bytes):
        tags = b.sparse["tags"]
        assert tags.offsets.shape[0] == b.batch_size + 1 and int(tags.offsets[0]) == 0
        got += [tags.values[lo:hi].tolist() for lo, hi in zip(tags.offsets[:-1], tags.offsets[1:])]
        users += b.sparse["user"].values.tolist()
    assert got == [reference(t) for _, _, _, t in rows]
    assert users == [hash_feature(u, feature_seed("user")) for _, _, u, _ in rows]
    whole = load_click_log(p, SCHEMA, chunk_bytes=chunk_bytes)
    assert whole.features == ("user", "tags")
    bag = whole.bags[0]
    assert [bag.values[lo:hi].tolist() for lo, hi in zip(bag.offsets[:-1], bag.offsets[1:])] == got


def test_empty_fields_and_empty_values_have_no_keys(tmp_path: Path) -> None:
    p = write(tmp_path / "log.csv", [(1, 1, "u", ""), (0, 2, "u", "a||b|"), (1, 3, "u", "|"), (0, 4, "u", "a|a")])
    (b,) = read_click_log(p, SCHEMA, 8)
    assert b.sparse["tags"].offsets.tolist() == [0, 0, 2, 2, 4]
    assert b.sparse["tags"].values.tolist() == reference("a|b") + reference("a|a")


def test_a_seed_override_and_names_without_header(tmp_path: Path) -> None:
    p = tmp_path / "log.tsv"
    p.write_text("1\tx;y\n0\t\n")
    schema = ColumnSchema(0, (), (), names=["label", "genres"], multi_valued={"genres": ";"}, seeds={"genres": 5})
    (b,) = read_click_log(p, schema, 4)
    assert b.sparse["genres"].values.tolist() == [hash_feature("x", 5), hash_feature("y", 5)]
    assert b.sparse["genres"].offsets.tolist() == [0, 2, 2]
    indexed = ColumnSchema(0, (), (), multi_valued={1: ";"})  # no names: the feature is M1
    assert list(next(read_click_log(p, indexed, 4)).sparse) == ["M1"]


def test_skipped_lines_leave_their_bags_out(tmp_path: Path) -> None:
    p = tmp_path / "log.csv"
    p.write_text("y,n,user,tags\n1,1,u,a|b\n0,x,u,c\n1,2,u\n0,3,u,d|e|f\n")
    skipped = BadLines()
    (b,) = read_click_log(p, SCHEMA, 8, bad_lines=skipped)
    assert skipped.first == [3, 4]
    assert b.sparse["tags"].offsets.tolist() == [0, 2, 5]
    assert b.sparse["tags"].values.tolist() == reference("a|b") + reference("d|e|f")


def test_the_row_operations_of_the_trainers_data_path(tmp_path: Path) -> None:
    rows = [(i % 2, i, f"u{i % 3}", "|".join(f"t{(i * j) % 5}" for j in range(i % 4))) for i in range(20)]
    log = load_click_log(write(tmp_path / "log.csv", rows), SCHEMA)

    def tags(log: ClickLog) -> list[list[int]]:
        bag = log.bags[0]
        return [bag.values[lo:hi].tolist() for lo, hi in zip(bag.offsets[:-1], bag.offsets[1:])]

    expected = [reference(t) for *_, t in rows]
    assert tags(log[5:9]) == expected[5:9]
    moved, n_train = cv_fold(log, 4, 1)  # rows 5..9 evaluate, behind the others
    assert n_train == 15 and tags(moved) == expected[:5] + expected[10:] + expected[5:10]
    batches = list(log.batches(6, rank=1, world_size=2))
    assert [b.sparse["tags"].values.tolist() for b in batches] == [sum(expected[6:12], []), sum(expected[18:], [])]
    # Rare values: counted over every value of the training rows, shared per feature.
    counts = Counter(k for e in expected[:10] for k in e)
    assert min(counts.values()) < 4 <= max(counts.values())  # both kinds of value are there
    shared = log.with_rare_keys(4, counted_in=log[:10])
    assert tags(shared) == [[k if counts[k] >= 4 else rare_key("tags") for k in e] for e in expected]
    assert shared.keys.tolist() == log.with_rare_keys(4, counted_in=log[:10]).keys.tolist()


def test_split_values_and_jagged_keys() -> None:
    buf = np.frombuffer(b"ab|c||d", np.uint8)
    offsets, starts, ends = split_values(buf, np.array([0, 3, 7]), np.array([7, 3, 7]), ord("|"))
    assert offsets.tolist() == [0, 3, 3, 3] and [bytes(buf[s:e]) for s, e in zip(starts, ends)] == [b"ab", b"c", b"d"]
    bag = split_keys(buf, np.array([0]), np.array([7]), ord("|"), 0)
    assert bag.offsets.tolist() == [0, 3] and bag.values.dtype == np.int64
    a, b = JaggedKeys(np.array([1, 2]), np.array([0, 2])), JaggedKeys(np.array([3]), np.array([0, 0, 1]))
    both = JaggedKeys.concat([a, b])
    assert both.values.tolist() == [1, 2, 3] and both.offsets.tolist() == [0, 2, 2, 3]
    assert both.take(np.array([2, 2, 0])).offsets.tolist() == [0, 1, 2, 4]
    assert both.rows(1, 3).values.tolist() == [3] and len(both.rows(3, 9)) == 0
    with pytest.raises(ValueError, match="values"):
        both.with_values(np.zeros(2, np.int64))


def test_a_separator_that_cannot_be_one_is_refused() -> None:
    for sep in (",", "||", "\n", ""):
        with pytest.raises(ValueError, match=r"multi_valued\['tags'\]: separator"):
            ColumnSchema("y", (), (), sep=",", multi_valued={"tags": sep})
