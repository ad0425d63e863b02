"""Stream sources (``worker.stream``): batches cut by the log alone, positions that seek
and resume exactly, and a clear error, never a silent skip, when rows after a position
are gone. The Redis cases run a real ``redis-server``."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.redis_server import redis_server
from worker.data import ColumnSchema
from worker.stream import Lines, StreamError, open_stream

SCHEMA = ColumnSchema("y", ["n"], ["c"], sep=",", names=["y", "n", "c"])
HEADED = ColumnSchema("y", ["n"], ["c"], sep=",", header=True)


def rows(lo: int, hi: int) -> str:
    return "".join(f"{i % 2},{i},v{i}\n" for i in range(lo, hi))


def land(directory: Path, name: str, text: str) -> None:
    """Write ``text`` elsewhere, then rename it in: how files land."""
    tmp = directory / f".{name}.landing"
    tmp.write_text(text)
    os.replace(tmp, directory / name)


def drain(source, max_rows: int) -> list[Lines]:  # type: ignore[no-untyped-def]
    out = []
    while (lines := source.next_batch(max_rows, 0.0)) is not None:
        out.append(lines)
    return out


def values(batches: list[Lines]) -> list[bytes]:
    return [line for b in batches for line in b.data.splitlines()]


# -- a directory ----------------------------------------------------------------------


def test_directory_cuts_at_file_ends_and_reads_each_row_once(tmp_path: Path) -> None:
    land(tmp_path, "2026-01-01T00.csv", rows(0, 5))
    land(tmp_path, "2026-01-01T01.csv", rows(5, 7))
    source = open_stream(f"dir:{tmp_path}", SCHEMA)
    got = drain(source, 2)
    assert [b.rows for b in got] == [2, 2, 1, 2]  # never across a file's end
    assert values(got) == rows(0, 7).encode().splitlines()
    assert got[2].where.endswith("T00.csv") and got[2].first_line == 5
    assert got[-1].end["eof"] and got[-1].end["file"] == "2026-01-01T01.csv"


def test_directory_seeks_and_resumes_exactly(tmp_path: Path) -> None:
    for k in range(3):
        land(tmp_path, f"part-{k:03d}", rows(10 * k, 10 * k + 10))
    whole = values(drain(open_stream(f"dir:{tmp_path}", SCHEMA), 4))
    for stop in range(1, 9):
        first = open_stream(f"dir:{tmp_path}", SCHEMA)
        head = [first.next_batch(4, 0.0) for _ in range(stop)]
        assert all(h is not None for h in head)
        again = open_stream(f"dir:{tmp_path}", SCHEMA)
        again.seek(head[-1].end)  # type: ignore[union-attr]
        assert values(head) + values(drain(again, 4)) == whole, f"resumed after {stop} batches"


def test_directory_waits_for_a_file_still_landing_and_reads_it_once_renamed(tmp_path: Path) -> None:
    land(tmp_path, "a.csv", rows(0, 2))
    source = open_stream(f"dir:{tmp_path}", HEADED)
    (tmp_path / "a.csv").write_text("y,n,c\n" + rows(0, 2))
    assert values(drain(source, 10)) == rows(0, 2).encode().splitlines()
    for ignored in (".b.csv", "b.csv.tmp", "b.csv.part", "b.csv.inprogress"):  # still being written
        (tmp_path / ignored).write_text("y,n,c\n" + rows(2, 3))
    assert source.next_batch(10, 0.2) is None
    os.replace(tmp_path / ".b.csv", tmp_path / "b.csv")  # renamed in
    got = source.next_batch(10, 0.0)
    assert got is not None and got.header == ("y", "n", "c") and got.data == rows(2, 3).encode()
    assert got.first_line == 2  # the header is line 1


def test_directory_refuses_a_file_landing_before_one_it_read(tmp_path: Path) -> None:
    land(tmp_path, "b.csv", rows(0, 2))
    source = open_stream(f"dir:{tmp_path}", SCHEMA)
    drain(source, 10)
    land(tmp_path, "a.csv", rows(2, 4))  # sorts before b.csv: its rows would be skipped
    with pytest.raises(StreamError, match="sorts before b.csv"):
        source.next_batch(10, 0.0)


def test_directory_lets_old_files_go_but_not_one_it_is_inside_of(tmp_path: Path) -> None:
    land(tmp_path, "a.csv", rows(0, 4))
    land(tmp_path, "b.csv", rows(4, 8))
    source = open_stream(f"dir:{tmp_path}", SCHEMA)
    whole_a = source.next_batch(10, 0.0)
    half_b = source.next_batch(2, 0.0)
    assert whole_a is not None and half_b is not None
    (tmp_path / "a.csv").unlink()  # read to its end: retention may delete it
    land(tmp_path, "c.csv", rows(8, 9))
    resumed = open_stream(f"dir:{tmp_path}", SCHEMA)
    resumed.seek(half_b.end)
    assert values(drain(resumed, 10)) == rows(6, 9).encode().splitlines()
    gone = open_stream(f"dir:{tmp_path}", SCHEMA)
    gone.seek(whole_a.end)  # a.csv is gone but was read through: b.csv follows
    assert values(drain(gone, 10)) == rows(4, 9).encode().splitlines()
    (tmp_path / "b.csv").unlink()  # deleted while the position is inside it
    with pytest.raises(StreamError, match="b.csv, read up to byte 14 at the saved position, is gone"):
        open_stream(f"dir:{tmp_path}", SCHEMA).seek(half_b.end)


def test_directory_that_does_not_exist_is_one_line(tmp_path: Path) -> None:
    with pytest.raises(StreamError, match="no such directory"):
        open_stream(f"dir:{tmp_path / 'nope'}", SCHEMA)


# -- a Redis stream -------------------------------------------------------------------


@pytest.fixture(scope="module")
def redis_port(tmp_path_factory: pytest.TempPathFactory) -> Iterator[int]:
    with redis_server(tmp_path_factory.mktemp("redis")) as port:
        yield port


@pytest.fixture
def stream(redis_port: int, request: pytest.FixtureRequest) -> tuple[str, object]:
    import redis

    name = request.node.name
    r = redis.Redis("127.0.0.1", redis_port)
    r.delete(name)
    return f"redis://127.0.0.1:{redis_port}/{name}", r


def add(r, name: str, ms: int, lo: int, hi: int) -> None:  # type: ignore[no-untyped-def]
    """Rows ``[lo, hi)`` as entries with IDs ``ms-0, ms-1, ...`` (explicit: the test sets the ticks)."""
    for seq, line in enumerate(rows(lo, hi).splitlines()):
        r.xadd(name, {"row": line}, id=f"{ms}-{seq}")


def test_redis_cuts_at_ticks_and_max_rows_and_resumes_exactly(stream: tuple[str, object]) -> None:
    url, r = stream
    name = url.rsplit("/", 1)[1]
    add(r, name, 1000, 0, 3)  # tick 10 of 100 ms
    add(r, name, 1050, 3, 4)  # the same tick
    add(r, name, 1100, 4, 9)  # tick 11
    add(r, name, 5000, 9, 10)  # tick 50
    source = open_stream(url, SCHEMA, window_ms=100)
    got = drain(source, 3)
    assert [b.rows for b in got] == [3, 1, 3, 2, 1]
    assert values(got) == rows(0, 10).encode().splitlines()
    assert got[1].where == f"{url}#1050-0" and got[3].end["last"] == "1100-4"
    for stop in range(1, len(got)):
        again = open_stream(url, SCHEMA, window_ms=100)
        again.seek(got[stop - 1].end)
        assert values(got[:stop]) + values(drain(again, 3)) == rows(0, 10).encode().splitlines()


def test_redis_waits_for_the_tick_to_end_before_cutting_it(stream: tuple[str, object]) -> None:
    url, r = stream
    name = url.rsplit("/", 1)[1]
    r.xadd(name, {"row": "1,1,a"})  # now: the tick is still open for a moment
    source = open_stream(url, SCHEMA, window_ms=2000)
    assert source.next_batch(10, 0.0) is None  # 2 s ticks: not complete yet
    r.xadd(name, {"row": "0,2,b"})
    got = source.next_batch(10, 5.0)
    assert got is not None
    # The same tick unless the clock crossed a tick edge between the two appends.
    assert got.rows in (1, 2) and values([got])[0] == b"1,1,a"
    assert source.lag().rows == 2 - got.rows


def test_redis_refuses_a_stream_trimmed_past_its_position(stream: tuple[str, object]) -> None:
    url, r = stream
    name = url.rsplit("/", 1)[1]
    add(r, name, 1000, 0, 4)
    add(r, name, 2000, 4, 8)
    source = open_stream(url, SCHEMA, window_ms=100)
    first = source.next_batch(10, 0.0)
    assert first is not None and first.end == {"last": "1000-3", "next": "2000-0"}
    r.xtrim(name, maxlen=4, approximate=False)  # what was read: fine
    ok = open_stream(url, SCHEMA, window_ms=100)
    ok.seek(first.end)
    assert values(drain(ok, 10)) == rows(4, 8).encode().splitlines()
    r.xtrim(name, maxlen=2, approximate=False)  # two entries after the position are gone
    with pytest.raises(StreamError, match="trimmed past the saved position 1000-3"):
        open_stream(url, SCHEMA, window_ms=100).seek(first.end)


def test_redis_malformed_entries_keep_their_place(stream: tuple[str, object]) -> None:
    url, r = stream
    name = url.rsplit("/", 1)[1]
    r.xadd(name, {"row": "1,1,a"}, id="1000-0")
    r.xadd(name, {"other": "x"}, id="1000-1")
    r.xadd(name, {"row": "0,2,b\n1,3,c"}, id="1000-2")
    r.xadd(name, {"row": "0,4,d\r\n"}, id="1000-3")
    got = open_stream(url, SCHEMA, window_ms=100).next_batch(10, 0.0)
    assert got is not None and got.data == b"1,1,a\n\n\n0,4,d\n" and got.rows == 4


def test_redis_addresses_that_do_not_work_are_one_line(redis_port: int) -> None:
    with pytest.raises(StreamError, match="expected redis://HOST:PORT/STREAM"):
        open_stream(f"redis://127.0.0.1:{redis_port}", SCHEMA)
    with pytest.raises(StreamError, match="cannot reach Redis"):
        open_stream("redis://127.0.0.1:1/clicks", SCHEMA)
    with pytest.raises(ValueError, match="no header line"):
        open_stream(f"redis://127.0.0.1:{redis_port}/clicks", HEADED)


def test_workers_split_a_directory_and_a_stream_each_row_once(tmp_path: Path, stream: tuple[str, object]) -> None:
    for k in range(12):
        land(tmp_path, f"part-{k:03d}", rows(10 * k, 10 * k + 10))
    parts = [values(drain(open_stream(f"dir:{tmp_path}", SCHEMA, part=(r, 3)), 4)) for r in range(3)]
    assert all(parts) and sorted(sum(parts, [])) == sorted(rows(0, 120).encode().splitlines())
    url, r = stream
    name = url.rsplit("/", 1)[1]
    add(r, name, 1000, 0, 50)
    split = [values(drain(open_stream(url, SCHEMA, part=(k, 2)), 7)) for k in range(2)]
    assert all(split) and sorted(sum(split, [])) == sorted(rows(0, 50).encode().splitlines())
    again = open_stream(url, SCHEMA, part=(1, 2))  # resumes within its part
    first = again.next_batch(7, 0.0)
    assert first is not None
    resumed = open_stream(url, SCHEMA, part=(1, 2))
    resumed.seek(first.end)
    assert values([first]) + values(drain(resumed, 7)) == split[1]
