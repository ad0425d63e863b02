"""The trainer's choices and output without a cluster: automatic batch size and epoch
count, run directories and ``runs/latest``, progress lines, the config line, ``--help``."""

from __future__ import annotations

import dataclasses
import logging
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from worker.command import parse
from worker.config import TrainerConfig
from worker.data import ClickLog, ColumnSchema, load_click_log, rare_key
from worker.dataset import RunData, auto_batch_size, open_data, schemas_that_fit
from worker.distributed import Dist
from worker.output import ProgressLines, progress, run_dir
from worker.trainer import _best_epoch, _log_config


def test_batch_size_follows_the_training_rows() -> None:
    assert [auto_batch_size(n, 1) for n in (100, 8_000, 80_000, 200_000, 10**9)] == [32, 64, 512, 1024, 1024]
    assert auto_batch_size(8_000, 2) == 32  # the same steps per epoch with two workers


def test_epoch_choice_takes_the_latest_of_the_best() -> None:
    assert _best_epoch([0.50]) == (1, False)
    assert _best_epoch([0.50, 0.52]) == (1, True)  # worse: stop, train 1 epoch
    assert _best_epoch([0.50, 0.49, 0.4901]) == (3, False)  # a tie within 0.1%: the later one, keep going
    assert _best_epoch([0.50, 0.49, 0.4901, 0.50]) == (3, True)
    assert _best_epoch([0.5 - 0.01 * i for i in range(10)]) == (10, True)  # MAX_EPOCHS


def test_an_explicit_output_dir_is_used_as_given(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    out = run_dir(TrainerConfig(output_dir=tmp_path / "mine" / "run"))
    assert out == tmp_path / "mine" / "run" and out.is_dir()
    assert not (tmp_path / "runs").exists()


def test_runs_get_their_own_directory_and_latest_follows(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    made = [run_dir(TrainerConfig()) for _ in range(3)]  # same second: suffixes keep them apart
    assert len(set(made)) == 3 and all(p.is_dir() and p.parent == Path("runs") for p in made)
    latest = Path("runs/latest")
    assert latest.is_symlink() and latest.resolve() == made[-1].resolve()
    assert [p.name for p in Path("runs").iterdir() if p.name.startswith(".")] == []  # no temporary link left


def test_an_old_latest_directory_is_left_alone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "runs" / "latest").mkdir(parents=True)
    (tmp_path / "runs" / "latest" / "metrics.json").write_text("{}")
    with caplog.at_level(logging.WARNING):
        out = run_dir(TrainerConfig())
    assert out.is_dir() and (tmp_path / "runs" / "latest" / "metrics.json").exists()
    assert "not a link" in caplog.text


def test_progress_off_a_terminal_is_plain_lines(caplog: pytest.LogCaptureFixture) -> None:
    assert progress(False, 10, "x") is None
    bar = progress(True, 10, "training")  # pytest's stderr is not a terminal
    assert isinstance(bar, ProgressLines)
    lines = ProgressLines(total=8, desc="training", every_s=3600)
    lines.last -= 5  # as if the run started 5 s ago
    with caplog.at_level(logging.INFO, logger="worker.output"):
        for _ in range(8):
            lines.set_postfix(loss="0.5")
            lines.update(1)
            lines.last -= 1.5
        lines.close()
    got = [r.getMessage() for r in caplog.records]
    assert [m.split()[1] for m in got] == ["step=2/8", "step=4/8", "step=6/8", "step=8/8"]  # each quarter, once
    assert all("\r" not in m and "loss=0.5" in m for m in got)


def write_movielens(path: Path, rows: int) -> Path:
    rng = np.random.default_rng(0)
    with path.open("w") as f:
        for i in range(rows):
            f.write(f"{rng.integers(1, 30)}\t{rng.integers(1, 50)}\t{rng.integers(1, 6)}\t{1000 - i}\n")
    return path


def test_the_config_line_says_what_was_used(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = write_movielens(tmp_path / "u.data", 1000)
    config = TrainerConfig(data=str(path), schema="movielens", output_dir=tmp_path / "out")
    data = open_data(config)
    assert (data.train_rows, data.eval_rows) == (800, 200)
    resolved = TrainerConfig(data=str(path), schema="movielens", batch_size=32, epochs=1, output_dir=tmp_path / "out")
    with caplog.at_level(logging.INFO, logger="worker.trainer"):
        _log_config(config, resolved, data, Dist(), choose=False, probing=False)
    line = caplog.records[-1].getMessage()
    assert "checkpoint_every" not in line, "without checkpoints their interval means nothing"
    for part in (
        "schema=movielens",
        "train_rows=800",
        "eval_rows=200",
        "batch_size=32(auto)",
        "epochs=1(auto)",
        "rows_from=memory",
        "workers=1",
        f"output_dir={tmp_path / 'out'}",
    ):
        assert part in line.split(), (part, line)
    resumed = dataclasses.replace(resolved, epochs=4)
    with caplog.at_level(logging.INFO, logger="worker.trainer"):
        _log_config(config, resumed, data, Dist(), choose=True, probing=False)
    assert "epochs=4(auto,chosen_before_a_restart)" in caplog.records[-1].getMessage().split()
    assert "train_samples" not in line  # synthetic-only settings are left out
    assert "dense_lr=" not in line and len(line) < 400, line  # settings left at their defaults are not repeated
    with caplog.at_level(logging.DEBUG, logger="worker.trainer"):
        _log_config(config, resolved, data, Dist(), choose=False, probing=False)
    assert "dense_lr=" in caplog.records[-1].getMessage()  # every setting, at DEBUG


def test_rare_keys_are_counted_on_the_training_rows(tmp_path: Path) -> None:
    """The rows keep their keys as read (the first-order weights read every value); the
    vocabulary is counted on the training rows only, and the embeddings read every other
    key, in training and evaluation rows alike, as the feature's rare key."""
    path = write_movielens(tmp_path / "u.data", 1000)
    data = open_data(TrainerConfig(data=str(path), schema="movielens", min_count=30))
    raw = load_click_log(path, ColumnSchema.movielens())
    assert data.train is not None and data.test is not None and data.rare is not None
    assert (data.train.keys == raw.keys[:, :800]).all() and (data.test.keys == raw.keys[:, 800:]).all()
    users, counts = np.unique(raw.keys[0, :800], return_counts=True)
    assert data.rare.vocabulary["user_id"].tolist() == users[counts >= 30].tolist()
    for rows in (raw[:800], raw[800:]):
        keep = np.isin(rows.keys[0], users[counts >= 30])
        assert keep.any() and (~keep).any()  # both kinds of value are there
        read = data.rare.keys("user_id", rows.keys[0])
        assert (read[keep] == rows.keys[0, keep]).all() and (read[~keep] == rare_key("user_id")).all()
    assert open_data(TrainerConfig(data=str(path), schema="movielens", min_count=1)).rare is None
    assert isinstance(data, RunData) and isinstance(data.train, ClickLog)


def test_a_fold_evaluates_one_block_of_the_training_rows(tmp_path: Path) -> None:
    """folds=4, eval_fold=1: rows [200, 400) of the first 800 evaluate, the other 600 of them
    train (in row order, rare keys counted on them), the last 200 rows are not used."""
    path = write_movielens(tmp_path / "u.data", 1000)
    data = open_data(TrainerConfig(data=str(path), schema="movielens", folds=4, eval_fold=1, min_count=1))
    raw = load_click_log(path, ColumnSchema.movielens())
    assert (data.train_rows, data.eval_rows) == (600, 200)
    assert data.train is not None and data.test is not None and data.rows is not None
    assert (data.test.keys == raw.keys[:, 200:400]).all()
    assert (data.train.keys == np.concatenate([raw.keys[:, :200], raw.keys[:, 400:800]], axis=1)).all()
    assert (data.rows.labels[:600] == data.train.labels).all()  # the epoch probe splits these rows again
    counted = open_data(TrainerConfig(data=str(path), schema="movielens", folds=4, eval_fold=1, min_count=22))
    assert counted.rare is not None
    users, counts = np.unique(data.train.keys[0], return_counts=True)
    assert counted.rare.vocabulary["user_id"].tolist() == users[counts >= 22].tolist()
    assert 0 < len(counted.rare.vocabulary["user_id"]) < len(users)


def test_folds_over_every_row_make_the_last_block_the_default_split(tmp_path: Path) -> None:
    """folds=5 with train_fraction=1 cuts every row into fifths: block 0 evaluates a model
    trained on the four after it, and block 4 is exactly the split a run without folds makes
    (the first 80% train, the last 20% evaluate)."""
    path = write_movielens(tmp_path / "u.data", 1000)
    raw = load_click_log(path, ColumnSchema.movielens())
    first = open_data(
        TrainerConfig(data=str(path), schema="movielens", folds=5, eval_fold=0, train_fraction=1, min_count=1)
    )
    assert first.train is not None and first.test is not None
    assert (first.train_rows, first.eval_rows) == (800, 200)
    assert (first.test.keys == raw.keys[:, :200]).all() and (first.test.labels == raw.labels[:200]).all()
    assert (first.train.keys == raw.keys[:, 200:]).all() and (first.train.labels == raw.labels[200:]).all()
    last = open_data(TrainerConfig(data=str(path), schema="movielens", folds=5, eval_fold=4, train_fraction=1))
    plain = open_data(TrainerConfig(data=str(path), schema="movielens"))
    for a, b in ((last.train, plain.train), (last.test, plain.test)):
        assert a is not None and b is not None
        assert (a.keys == b.keys).all() and (a.labels == b.labels).all()


def test_every_row_in_a_block_needs_folds() -> None:
    with pytest.raises(ValueError, match="train_fraction=1.0: must be in \\(0, 1\\), or 1 with folds"):
        TrainerConfig(train_fraction=1.0)


@pytest.mark.parametrize(("folds", "eval_fold"), [(1, 0), (-2, 0), (4, 4), (4, -1), (0, 1)])
def test_bad_folds_are_refused(folds: int, eval_fold: int) -> None:
    with pytest.raises(ValueError, match="fold"):
        TrainerConfig(folds=folds, eval_fold=eval_fold)


@pytest.mark.parametrize("local_shards", [True, False])
def test_help_says_what_the_entry_point_does(local_shards: bool, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as done:
        parse(["--help"], local_shards=local_shards)
    assert done.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    if local_shards:
        assert "With no --addresses, --num-shards shard processes are started on 127.0.0.1" in text
    else:
        assert "--addresses (or TRAINER_ADDRESSES, which ps-launch sets) is required" in text
        assert "python -m deploy.train" in text
    assert "runs/<UTC time>/" in text and "movielens" in text


def test_an_empty_output_dir_means_the_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRAINER_OUTPUT_DIR", "")
    assert parse([]).output_dir is None
    assert parse(["--output-dir", "x/y"]).output_dir == Path("x/y")


def test_train_and_serve_help_says_it_starts_its_own_shards() -> None:
    repo = Path(__file__).resolve().parents[2]
    example = str(repo / "examples" / "train_and_serve.py")
    shown = subprocess.run([sys.executable, example, "--help"], capture_output=True, text=True, cwd=repo, timeout=120)
    text = " ".join(shown.stdout.split())
    assert shown.returncode == 0, shown.stderr
    assert "is required" not in text and "is ignored" not in text, text
    assert "--num-shards training shards and as many serving shards are started" in text
    refused = subprocess.run(
        [sys.executable, example, "--addresses", "127.0.0.1:1"], capture_output=True, text=True, cwd=repo, timeout=120
    )
    assert refused.returncode == 2 and refused.stderr.strip().count("\n") == 0, refused.stderr
    assert "starts its own shards" in refused.stderr and "Traceback" not in refused.stderr


def _trainer(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """``python -m worker.trainer`` against an address nothing listens on: each mistake here
    is found before the first call to a shard."""
    repo = Path(__file__).resolve().parents[2]
    return subprocess.run(
        [sys.executable, "-m", "worker.trainer", "--addresses", "127.0.0.1:1", "--progress", "false", *args],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(repo)},
        timeout=180,
    )


def _one_line(proc: subprocess.CompletedProcess[str]) -> str:
    assert proc.returncode == 1, proc.stderr
    errors = [line for line in proc.stderr.splitlines() if "level=INFO" not in line]
    assert len(errors) == 1 and "Traceback" not in proc.stderr, proc.stderr
    return errors[0]


def test_a_file_of_another_schema_says_which_schema_to_pass(tmp_path: Path) -> None:
    (tmp_path / "u.data").write_text(
        "".join(f"{u}\t{i}\t{1 + (u + i) % 5}\t{880000000 + i}\n" for u in range(5) for i in range(8))
    )
    line = _one_line(_trainer(tmp_path, "--data", "u.data"))  # --schema criteo, the default
    assert line.startswith("trainer: u.data does not read as --schema criteo (line 1: 4 fields, expected 40")
    assert line.endswith("pass --schema movielens"), line


def test_a_file_that_reads_as_no_schema_gets_none_suggested(tmp_path: Path) -> None:
    """A schema under which the file has no data row (its only line taken as a header) does
    not fit it: suggesting it would send the user to "no data rows" next."""
    (tmp_path / "two.tsv").write_text("a\tb\n")
    assert schemas_that_fit(tmp_path / "two.tsv") == []
    line = _one_line(_trainer(tmp_path, "--data", "two.tsv"))
    assert "pass --schema" not in line, line


def test_a_malformed_line_names_it_and_offers_bad_lines_skip(tmp_path: Path) -> None:
    rows = [
        f"{i % 2}\t" + "\t".join(str(i + j) for j in range(13)) + "\t" + "\t".join(f"{i * j:08x}" for j in range(26))
        for i in range(60)
    ]
    rows[30] = "1\t2\t3"
    (tmp_path / "log.txt").write_text("\n".join(rows) + "\n")
    line = _one_line(_trainer(tmp_path, "--data", "log.txt"))
    assert line.startswith("trainer: log.txt:31: 3 fields, expected 40") and "--bad-lines skip" in line, line
    data = open_data(TrainerConfig(data=str(tmp_path / "log.txt"), bad_lines="skip", min_count=1))
    assert data.bad_lines is not None and (data.bad_lines.count, data.bad_lines.first) == (1, [31])
    assert data.train_rows + data.eval_rows == 59


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_device_cuda_without_cuda_says_to_pass_cpu(tmp_path: Path) -> None:
    line = _one_line(_trainer(tmp_path, "--device", "cuda"))
    assert "torch sees no CUDA device" in line and "pass --device cpu" in line, line


def test_permission_denied_names_the_path(tmp_path: Path) -> None:
    locked = Path("/sys/ps-trainer-run")  # not writable by anyone, root included
    line = _one_line(
        _trainer(tmp_path, "--train-samples", "2000", "--eval-samples", "100", "--output-dir", str(locked))
    )
    assert line.startswith(f"trainer: permission denied: {locked}") and "--output-dir" in line, line


def test_a_file_too_small_to_hold_both_labels_in_each_part_says_so(tmp_path: Path) -> None:
    # Two data rows: the held-out part is one row, one label; the run must not train and then crash in AUC.
    rows = [f"{i}\t" + "\t".join(str(i + j) for j in range(13)) + "\t" + "\t".join(["0a0b0c0d"] * 26) for i in (0, 1)]
    (tmp_path / "tiny.txt").write_text("\n".join(rows) + "\n")
    line = _one_line(_trainer(tmp_path, "--data", "tiny.txt"))
    assert "held-out rows hold only label" in line and "use a larger file" in line, line
