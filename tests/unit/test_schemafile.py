"""``--schema my.toml``: the schema file loader, and each mistake (in the file, or of the file
against the data) told in one line that names the key or the column and the row, before any
shard starts."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from worker.config import TrainerConfig
from worker.data import load_click_log
from worker.dataset import open_data, schema_of
from worker.mistakes import user_error
from worker.schemafile import SchemaFileError, load_schema_file, parse_schema_file

REPO = Path(__file__).resolve().parents[2]
GOOD = """\
delimiter = ","
header = true
label = "clicked"

[columns]
price = "numeric"
user = "categorical"
tags = { kind = "multi-valued", separator = "|" }
"""


def clicks(path: Path, rows: int = 40, bad: dict[int, str] | None = None) -> Path:
    """A small click log; ``bad`` replaces data rows by their 1-based line number in the file."""
    lines = ["clicked,price,user,tags"]
    lines += [f"{i % 2},{i % 7}.5,u{i % 5},t{i % 3}|t{i % 4}" for i in range(rows)]
    for line_no, text in (bad or {}).items():
        lines[line_no - 1] = text
    path.write_text("\n".join(lines) + "\n")
    return path


def test_a_schema_file_describes_the_layout(tmp_path: Path) -> None:
    (tmp_path / "my.toml").write_text(GOOD)
    loaded = load_schema_file(tmp_path / "my.toml")
    s = loaded.schema
    assert (s.label, s.dense, s.categorical, s.multi_valued) == ("clicked", ("price",), ("user",), {"tags": "|"})
    assert (s.sep, s.header, s.log_transform, s.label_threshold) == (",", True, True, None)
    assert loaded.describe("price") == "price is numeric" and loaded.text == GOOD
    assert loaded.describe("clicked") == "clicked is the label: 0 or 1"
    assert schema_of(str(tmp_path / "my.toml")) == s and schema_of("criteo").names is not None
    log = load_click_log(clicks(tmp_path / "clicks.csv"), s)
    assert log.features == ("user", "tags") and log.dense.shape == (40, 1) and len(log.bags) == 1
    tsv = parse_schema_file(
        'delimiter = "\\t"\nheader = false\nnames = ["rating", "user", "genres"]\nlabel = "rating"\n'
        'label_threshold = 4\nlog_transform = false\n[columns.user]\nkind = "categorical"\n'
        '[columns.genres]\nkind = "multi-valued"\nseparator = ";"\n',
        "ml.toml",
    ).schema
    assert (tsv.sep, tsv.names, tsv.label_threshold, tsv.log_transform) == (
        "\t",
        ("rating", "user", "genres"),
        4.0,
        False,
    )
    assert tsv.multi_valued == {"genres": ";"} and tsv.categorical == ("user",)


@pytest.mark.parametrize(
    "change, message",
    [
        (("delimiter", "delimeter"), "unknown key 'delimeter'; valid keys: delimiter, header, names, label, "),
        (
            ('separator = "|" }', 'separator = "|", sep = ";" }'),
            "columns.tags: unknown key 'sep'; valid keys: kind, separator",
        ),
        (('"numeric"', '"number"'), "columns.price: kind 'number'; valid kinds: categorical, numeric, multi-valued"),
        ((', separator = "|"', ""), "columns.tags: a multi-valued column needs its separator"),
        (('separator = "|"', 'separator = ","'), "columns.tags: separator = ',': must be one ASCII character other"),
        (('separator = "|"', 'separator = "||"'), "columns.tags: separator = '||'"),
        (('"categorical"', '{ kind = "categorical", separator = "|" }'), "columns.user: separator is only for a multi"),
        (('label = "clicked"', ""), "label: missing; it must be the label column's name"),
        (('label = "clicked"', 'label = "price"'), "columns.price: 'price' is the label"),
        (
            (
                '[columns]\nprice = "numeric"\nuser = "categorical"\ntags = { kind = "multi-valued", separator = "|" }\n',
                "",
            ),
            "columns: missing",
        ),
        (
            ('user = "categorical"\ntags = { kind = "multi-valued", separator = "|" }\n', ""),
            "columns: no categorical or multi-valued column",
        ),
        (("header = true", "header = yes"), "not TOML: "),
        (("header = true", "header = false"), "header = false needs names = [...]"),
        (("header = true", 'names = ["a"]'), "names: only for a file without a header line"),
        (('delimiter = ","', 'delimiter = ", "'), "delimiter = ', ': must be one ASCII character"),
        (("header = true", 'header = "yes"'), "header = 'yes': must be true or false"),
        (("header = true", 'label_threshold = "4"'), "label_threshold = '4': must be a number"),
    ],
)
def test_each_mistake_in_a_schema_file_is_one_line_naming_the_key(
    tmp_path: Path, change: tuple[str, str], message: str
) -> None:
    old, new = change
    assert old in GOOD
    path = tmp_path / "my.toml"
    path.write_text(GOOD.replace(old, new, 1))
    with pytest.raises(SchemaFileError) as info:
        load_schema_file(path)
    text = str(info.value)
    assert text.startswith(f"schema {path}: ") and "\n" not in text, text
    assert message in text, text
    config = TrainerConfig(data=str(clicks(tmp_path / "clicks.csv")), schema=str(path))
    assert user_error(info.value, config) == text  # what the trainer prints, after "trainer: "


def explained(tmp_path: Path, data: Path, schema: str = GOOD) -> str:
    """The one line the trainer prints for ``data`` under ``schema``: from reading the data
    (``open_data``, what runs before any shard starts) to ``user_error``."""
    (tmp_path / "my.toml").write_text(schema)
    config = TrainerConfig(data=str(data), schema=str(tmp_path / "my.toml"))
    with pytest.raises(ValueError) as info:
        open_data(config)
    line = user_error(info.value, config)
    assert line is not None and "\n" not in line, info.value
    return line


def test_a_value_that_is_not_what_the_schema_says_names_the_column_and_the_row(tmp_path: Path) -> None:
    data = clicks(tmp_path / "clicks.csv", bad={17: "1,abc,u1,t1"})
    line = explained(tmp_path, data)
    assert line.startswith(f"{data}:17: column 'price' (field 2): b'abc' is not a finite number"), line
    assert f"(schema {tmp_path / 'my.toml'}: price is numeric)" in line and "--bad-lines skip" in line, line
    label = explained(tmp_path, clicks(tmp_path / "label.csv", bad={9: "2,1,u1,t1"}))
    assert ":9: column 'clicked' (field 1): label b'2', expected 0 or 1" in label, label
    assert "clicked is the label: 0 or 1)" in label, label
    fields = explained(tmp_path, clicks(tmp_path / "fields.csv", bad={30: "1,2,u1"}))
    assert ":30: 3 fields, expected 4" in fields and f"(schema {tmp_path / 'my.toml'})" in fields, fields


def test_a_column_the_header_lacks_is_named(tmp_path: Path) -> None:
    line = explained(tmp_path, clicks(tmp_path / "clicks.csv"), GOOD.replace("price =", "prize ="))
    assert "column 'prize' not in ['clicked', 'price', 'user', 'tags']" in line, line
    assert line.endswith(f"(schema {tmp_path / 'my.toml'}: prize is numeric)"), line


def test_a_schema_that_is_neither_a_name_nor_a_file_is_a_bad_setting() -> None:
    with pytest.raises(ValueError, match="schema='my.tmol': expected criteo, avazu, movielens or the path of a TOML"):
        TrainerConfig(schema="my.tmol")


def _train(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "deploy.train", "--progress", "false", "--num-shards", "1", *args],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        timeout=180,
    )


def test_the_trainer_says_it_in_one_line_before_any_shard_starts(tmp_path: Path) -> None:
    clicks(tmp_path / "clicks.csv", bad={17: "1,abc,u1,t1"})
    (tmp_path / "my.toml").write_text(GOOD)
    proc = _train(tmp_path, "--data", "clicks.csv", "--schema", "my.toml")
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr
    errors = [line for line in proc.stderr.splitlines() if "level=INFO" not in line]
    assert errors == [
        "train: clicks.csv:17: column 'price' (field 2): b'abc' is not a finite number (schema my.toml: price is "
        "numeric): fix the line, or pass --bad-lines skip to leave malformed lines out (they are counted and logged)"
    ], proc.stderr
    assert "local shards" not in proc.stderr, proc.stderr  # none was started
    (tmp_path / "my.toml").write_text(GOOD.replace("header", "heder"))
    proc = _train(tmp_path, "--data", "clicks.csv", "--schema", "my.toml")
    assert proc.returncode == 1 and "Traceback" not in proc.stderr and "local shards" not in proc.stderr, proc.stderr
    assert proc.stderr.strip().startswith("train: schema my.toml: unknown key 'heder'; valid keys: delimiter,"), (
        proc.stderr
    )
