"""ServerConfig loading (defaults < file < env < flags, errors that name the setting) and TableSpec."""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import pytest

from protos.rpc.settings import ConfigError
from ps.service import ServerConfig, load_config
from ps.table import InitializerKind, InitializerParams, OptimizerKind, OptimizerParams, TableSpec
from ps.table.spec import MAX_DIM

FIELDS = [f.name for f in dataclasses.fields(ServerConfig)]


def write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


@pytest.fixture
def toml_file(tmp_path: Path) -> Path:
    return write(
        tmp_path / "ps.toml",
        'shard = 1\nnum_shards = 3\nthreads = 2\nlisten = "0.0.0.0:7000"\ngrace_s = 1.5\nlog_level = "debug"\n',
    )


@pytest.fixture
def json_file(tmp_path: Path) -> Path:
    return write(
        tmp_path / "ps.json",
        json.dumps(
            {"shard": 1, "num_shards": 3, "threads": 2, "listen": "0.0.0.0:7000", "grace_s": 1.5, "log_level": "debug"}
        ),
    )


# --- precedence ---------------------------------------------------------------------------


def test_defaults() -> None:
    assert load_config([], {}) == ServerConfig()
    cfg = ServerConfig()
    assert (cfg.shard, cfg.num_shards, cfg.listen, cfg.port_file, cfg.threads) == (0, 1, "127.0.0.1:0", None, 16)


@pytest.mark.parametrize("fixture", ["toml_file", "json_file"])
def test_precedence_defaults_file_env_flags(fixture: str, request: pytest.FixtureRequest) -> None:
    path: Path = request.getfixturevalue(fixture)
    from_file = load_config([f"--config={path}"], {})
    assert (from_file.shard, from_file.num_shards, from_file.threads) == (1, 3, 2)
    assert (from_file.listen, from_file.grace_s, from_file.log_level) == ("0.0.0.0:7000", 1.5, "debug")
    assert from_file.max_message_bytes == ServerConfig().max_message_bytes  # untouched: default

    env = {"PS_THREADS": "4", "PS_SHARD": "2"}
    from_env = load_config(["--config", str(path)], env)
    assert (from_env.threads, from_env.shard, from_env.num_shards) == (4, 2, 3)

    from_flags = load_config(["--config", str(path), "--threads=6", "--num-shards", "5"], env)
    assert (from_flags.threads, from_flags.shard, from_flags.num_shards) == (6, 2, 5)
    assert from_flags.listen == "0.0.0.0:7000"

    assert load_config(["--threads=6"], {"PS_THREADS": "4"}).threads == 6


def test_config_path_from_environment(toml_file: Path, tmp_path: Path) -> None:
    assert load_config([], {"PS_CONFIG": str(toml_file)}).threads == 2
    other = write(tmp_path / "other.toml", "threads = 3\n")
    assert load_config([f"--config={other}"], {"PS_CONFIG": str(toml_file)}).threads == 3


def test_values_are_converted() -> None:
    cfg = load_config(
        ["--port-file=/tmp/port", "--grace-s=0", "--max-message-bytes=0x100000"],
        {"PS_THREADS": "16", "PS_NUM_SHARDS": "4", "PS_SHARD": "3", "PATH": "/bin", "PSX": "1"},
    )
    assert cfg.port_file == Path("/tmp/port") and isinstance(cfg.port_file, Path)
    assert (cfg.grace_s, cfg.max_message_bytes, cfg.threads, cfg.shard, cfg.num_shards) == (0.0, 1 << 20, 16, 3, 4)
    assert load_config([], {"PS_PORT_FILE": ""}).port_file is None


def test_json_integral_float_is_an_int(tmp_path: Path) -> None:
    path = write(tmp_path / "c.json", '{"threads": 4.0}')
    cfg = load_config([f"--config={path}"], {})
    assert cfg.threads == 4 and type(cfg.threads) is int


# --- errors -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "suffix, text", [(".toml", "threads = 2\nthread_count = 4\n"), (".json", '{"thread_count": 4}')]
)
def test_unknown_file_key_lists_valid_names(tmp_path: Path, suffix: str, text: str) -> None:
    path = write(tmp_path / f"c{suffix}", text)
    with pytest.raises(ConfigError, match="unknown setting 'thread_count'") as exc:
        load_config([f"--config={path}"], {})
    for name in FIELDS:
        assert name in str(exc.value)


def test_unknown_environment_variable_lists_valid_names() -> None:
    with pytest.raises(ConfigError, match="unknown variable PS_THREAD_COUNT") as exc:
        load_config([], {"PS_THREAD_COUNT": "4"})
    for name in FIELDS:
        assert f"PS_{name.upper()}" in str(exc.value)
    assert "PS_CONFIG" in str(exc.value)


@pytest.mark.parametrize(
    "argv, environ, field",
    [
        (["--shard=-1", "--num-shards=2"], {}, "shard"),
        (["--num-shards=0"], {}, "num_shards"),
        ([], {"PS_THREADS": "four"}, "threads"),
        ([], {"PS_THREADS": "4.5"}, "threads"),
        (["--threads=0"], {}, "threads"),
        (["--shard=x"], {}, "shard"),
        (["--grace-s=soon"], {}, "grace_s"),
        (["--grace-s=-1"], {}, "grace_s"),
        (["--max-message-bytes=1024"], {}, "max_message_bytes"),
        (["--max-message-bytes=4294967296"], {}, "max_message_bytes"),
        (["--log-level=LOUD"], {}, "log_level"),
        (["--listen=localhost"], {}, "listen"),
        (["--listen=:50051"], {}, "listen"),
        (["--listen=localhost:http"], {}, "listen"),
        (["--listen=localhost:65536"], {}, "listen"),
        ([], {"PS_LISTEN": "127.0.0.1:"}, "listen"),
    ],
)
def test_bad_values_name_the_field(argv: list[str], environ: dict[str, str], field: str) -> None:
    with pytest.raises(ConfigError, match=rf"\b{field}\b"):
        load_config(argv, environ)


@pytest.mark.parametrize(
    "text, field",
    [('num_shards = "two"\n', "num_shards"), ("threads = true\n", "threads"), ("threads = 2.5\n", "threads")],
)
def test_bad_file_values_name_the_field(tmp_path: Path, text: str, field: str) -> None:
    path = write(tmp_path / "c.toml", text)
    with pytest.raises(ConfigError, match=rf"^--config {re.escape(str(path))}: .* for {field}$"):
        load_config([f"--config={path}"], {})


def test_bad_config_files(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="--config .*missing.toml"):
        load_config([f"--config={tmp_path / 'missing.toml'}"], {})
    bad_toml = write(tmp_path / "bad.toml", "threads = \n")
    with pytest.raises(ConfigError, match="bad.toml"):
        load_config([f"--config={bad_toml}"], {})
    bad_json = write(tmp_path / "bad.json", "{threads: 1}")
    with pytest.raises(ConfigError, match="bad.json"):
        load_config([f"--config={bad_json}"], {})
    list_json = write(tmp_path / "list.json", "[1, 2]")
    with pytest.raises(ConfigError, match="expected a table of settings"):
        load_config([f"--config={list_json}"], {})
    assert issubclass(ConfigError, ValueError)


@pytest.mark.parametrize("field", ["listen", "log_level", "shard"])
def test_json_null_is_a_config_error_naming_the_field(tmp_path: Path, field: str) -> None:
    path = write(tmp_path / "c.json", json.dumps({field: None}))
    with pytest.raises(ConfigError, match=field):
        load_config([f"--config={path}"], {})


def test_nan_grace_is_rejected() -> None:
    with pytest.raises(ConfigError, match="grace_s"):
        load_config(["--grace-s=nan"], {})


def test_unknown_flag_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        load_config(["--thread-count=4"], {})
    assert exc.value.code == 2
    assert "--thread-count" in capsys.readouterr().err


def test_help_mentions_every_flag_and_variable(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        load_config(["--help"], {})
    assert exc.value.code == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "--config" in out
    for f in dataclasses.fields(ServerConfig):
        flag, var = "--" + f.name.replace("_", "-"), "PS_" + f.name.upper()
        assert flag in out, flag
        assert var in out, var
        assert f.metadata["help"] in out, f.name


# --- TableSpec ----------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["user", "a", "A.b:c/d-e_f9", "x" * 128])
def test_table_spec_valid_names(name: str) -> None:
    assert TableSpec(name, 8).name == name


@pytest.mark.parametrize("name", ["", "a b", "tëst", "x" * 129, "a\tb", "\nuser"])
def test_table_spec_bad_name(name: str) -> None:
    with pytest.raises(ConfigError, match="table name"):
        TableSpec(name, 8)


def test_table_spec_rejects_trailing_newline() -> None:
    with pytest.raises(ConfigError, match="table name"):
        TableSpec("user\n", 8)


@pytest.mark.parametrize("dim", [0, -1, MAX_DIM + 1])
def test_table_spec_bad_dim(dim: int) -> None:
    with pytest.raises(ConfigError, match=rf"table 'user': dim={dim}"):
        TableSpec("user", dim)


@pytest.mark.parametrize("seed", [-1, 2**64])
def test_table_spec_bad_seed(seed: int) -> None:
    with pytest.raises(ConfigError, match=rf"table 'user': seed={seed}"):
        TableSpec("user", 4, seed=seed)


def test_table_spec_limits_and_dtype() -> None:
    assert TableSpec("t", MAX_DIM).dim == MAX_DIM == 65536
    assert TableSpec("t", 1, seed=2**64 - 1).seed == 2**64 - 1
    assert TableSpec("t", 4, storage_dtype="bfloat16", state_dtype="bfloat16").storage_dtype == "bfloat16"
    with pytest.raises(ConfigError, match="storage_dtype='int4'"):
        TableSpec("t", 4, storage_dtype="int4")
    with pytest.raises(ConfigError, match="state_dtype='float16'.*overflow"):
        TableSpec("t", 4, state_dtype="float16")


def test_table_spec_differences() -> None:
    base = TableSpec("user", 16)
    assert base.differences(TableSpec("user", 16)) == []
    assert base.differences(TableSpec("user", 32)) == ["dim: 16 != 32"]
    assert base.differences(TableSpec("item", 16)) == ["name: 'user' != 'item'"]
    assert base.differences(TableSpec("user", 16, optimizer=OptimizerParams(lr=0.1))) == ["optimizer.lr: 0.01 != 0.1"]
    other = TableSpec(
        "user",
        16,
        initializer=InitializerParams(kind=InitializerKind.NORMAL, std=0.5),
        optimizer=OptimizerParams(kind=OptimizerKind.ADAGRAD),
        seed=3,
    )
    diffs = base.differences(other)
    assert "initializer.kind: UNIFORM != NORMAL" in diffs
    assert "initializer.std: 0.01 != 0.5" in diffs
    assert "optimizer.kind: SGD != ADAGRAD" in diffs
    assert "seed: 0 != 3" in diffs
    assert [d.split(":")[0] for d in diffs] == [
        "initializer.kind",
        "initializer.std",
        "optimizer.kind",
        "optimizer.eps",
        "seed",
    ]
    assert [d.split(":")[0] for d in other.differences(base)] == [d.split(":")[0] for d in diffs]


# -- one loader for every command ---------------------------------------------------------


def _commands() -> list[tuple[str, type, str]]:
    from worker.config import ENV_PREFIX as TRAINER_PREFIX
    from worker.config import TrainerConfig
    from worker.serving import ENV_PREFIX as INFER_PREFIX
    from worker.serving import InferConfig

    return [
        ("ps-server", ServerConfig, "PS_"),
        ("ps-infer", InferConfig, INFER_PREFIX),
        ("trainer", TrainerConfig, TRAINER_PREFIX),
    ]


@pytest.mark.parametrize("command", ["ps-server", "ps-infer", "trainer"])
def test_every_command_reports_a_config_file_that_does_not_parse(command: str, tmp_path: Path) -> None:
    from protos.rpc.settings import load_settings

    (prog, cls, prefix) = next(c for c in _commands() if c[0] == command)
    bad = write(tmp_path / "bad.toml", "threads = = 2\n")
    with pytest.raises(ConfigError, match=rf"--config {re.escape(str(bad))}: "):
        load_settings(cls, [f"--config={bad}"], {}, prefix, prog)
    with pytest.raises(ConfigError, match=rf"--config {re.escape(str(bad))}: "):  # named by the environment
        load_settings(cls, [], {prefix + "CONFIG": str(bad)}, prefix, prog)


@pytest.mark.parametrize("command", ["ps-server", "ps-infer", "trainer"])
def test_every_command_names_where_a_bad_value_came_from(command: str) -> None:
    from protos.rpc.settings import load_settings

    (prog, cls, prefix) = next(c for c in _commands() if c[0] == command)
    field = next(f.name for f in dataclasses.fields(cls) if f.type in ("int", int))
    var = prefix + field.upper()
    with pytest.raises(ConfigError, match=rf"environment {var}: 'many' is not a valid int for {field}"):
        load_settings(cls, [], {var: "many"}, prefix, prog)


def test_ps_admins_addresses_variable_does_not_stop_a_server() -> None:
    # One shell exports PS_ADDRESSES for ps-admin and starts ps-server: not an unknown setting.
    config = load_config(["--shard=0", "--num-shards=2"], {"PS_ADDRESSES": "127.0.0.1:1,127.0.0.1:2"})
    assert config.num_shards == 2
