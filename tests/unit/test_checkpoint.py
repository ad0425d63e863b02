"""Checkpoint paths: only under the shard's checkpoint root, bad ones refused with a status
a person can act on, and a refused or failed checkpoint leaves nothing behind."""

from __future__ import annotations

import os
from pathlib import Path

import grpc
import numpy as np
import pytest

from protos.rpc.settings import ConfigError
from ps.durability import Durability, resolve_existing_checkpoint
from ps.durability.checkpoint import MAX_PATH_BYTES, next_version_path, resolve_checkpoint_path
from ps.errors import InvalidRequest, NotConfigured, ShardError
from ps.service import ServerConfig
from ps.shard import Shard
from ps.store import Storage, read_manifest
from ps.table import TableSpec


@pytest.fixture
def root(tmp_path: Path) -> Path:
    r = tmp_path / "root"
    r.mkdir()
    return r


def refused(root: Path | None, path: str) -> ShardError:
    with pytest.raises(ShardError) as info:
        resolve_checkpoint_path(root, path, 0)
    return info.value


def test_relative_and_absolute_paths_under_the_root(root: Path) -> None:
    assert resolve_checkpoint_path(root, "a", 0) == root / "a"
    assert resolve_checkpoint_path(root, "run/shard-0", 0) == root / "run" / "shard-0"
    assert resolve_checkpoint_path(root, str(root / "x" / "y"), 0) == root / "x" / "y"
    assert resolve_checkpoint_path(root, "./a/./b", 0) == root / "a" / "b"
    assert resolve_checkpoint_path(root / "not-yet", "a", 0) == root / "not-yet" / "a"  # made when written


def test_relative_paths_never_resolve_against_the_working_directory(
    root: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    assert resolve_checkpoint_path(root, "ck", 0) == root / "ck"


@pytest.mark.parametrize(
    ("path", "message"),
    [
        ("/etc/ps-ckpt", "is not under this shard's checkpoint root"),
        ("../escape", "'..' component"),
        ("a/../../escape", "'..' component"),
        ("a/../b", "'..' component"),  # refused even when it would stay inside
        ("a\0b", "NUL byte"),
        ("x" * 5000, "over the limit of 4095"),
        ("a/" + "y" * 300, "over 255 bytes"),
        (".", "is not under"),
        ("", "is not under"),
    ],
)
def test_bad_paths_are_invalid_arguments_naming_the_root(root: Path, path: str, message: str) -> None:
    err = refused(root, path)
    assert isinstance(err, InvalidRequest) and err.code == grpc.StatusCode.INVALID_ARGUMENT
    assert message in str(err)
    if "not under" in message or ".." in message:
        assert str(root) in str(err)


def test_a_path_longer_than_path_max_once_resolved_is_refused(root: Path) -> None:
    size = MAX_PATH_BYTES - len(str(root))  # root + "/" + deep is one byte over
    deep = "".join("/" if i % 201 == 200 else "d" for i in range(size - 1)) + "d"
    assert len(deep) <= MAX_PATH_BYTES < len(str(root / deep))
    assert "bytes under" in str(refused(root, deep))


def test_symlinks_out_of_the_root_are_refused(root: Path, tmp_path: Path) -> None:
    (tmp_path / "outside").mkdir()
    (root / "link").symlink_to(tmp_path / "outside")
    assert "is not under" in str(refused(root, "link/ck"))
    (root / "loop").symlink_to(root / "loop")
    assert isinstance(refused(root, "loop/ck"), InvalidRequest)
    (root / "inside").mkdir()
    (root / "alias").symlink_to(root / "inside")
    assert resolve_checkpoint_path(root, "alias/ck", 0) == root / "inside" / "ck"


def test_existing_paths_and_non_directories_are_refused(root: Path) -> None:
    (root / "taken").mkdir()
    (root / "file").write_text("x")
    assert "exists" in str(refused(root, "taken"))
    assert "exists" in str(refused(root, "file"))
    assert "is not a directory" in str(refused(root, "file/ck"))


def test_no_root_is_a_failed_precondition() -> None:
    err = refused(None, "anything")
    assert isinstance(err, NotConfigured) and err.code == grpc.StatusCode.FAILED_PRECONDITION
    assert "--checkpoint-root" in str(err)


def test_a_root_that_is_not_a_directory_is_a_failed_precondition(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("x")
    shard = Shard(0, 1, Storage(tmp_path / "data", shard=0, num_shards=1), checkpoint_root=tmp_path / "file")
    try:
        shard.create_table(TableSpec("t", 2))
        with pytest.raises(NotConfigured, match="is not a directory"):
            shard.checkpoint("ck")
        assert shard.writable and (tmp_path / "file").read_text() == "x"
    finally:
        shard.shutdown()


def test_versions_count_up(root: Path) -> None:
    assert next_version_path(root) == root / "000001"
    (root / "000007").mkdir()
    (root / "rescue-x").mkdir()
    assert next_version_path(root) == root / "000008"
    assert next_version_path(root / "missing") == root / "missing" / "000001"


def test_config_field_and_its_spellings(tmp_path: Path) -> None:
    from ps.service import load_config

    assert load_config([f"--checkpoint-root={tmp_path}"], {}).checkpoint_root == tmp_path
    assert load_config([], {"PS_CHECKPOINT_ROOT": str(tmp_path)}).checkpoint_root == tmp_path
    assert ServerConfig().checkpoint_root is None
    with pytest.raises(ConfigError, match="NUL"):
        ServerConfig(checkpoint_root=Path("a\0b"))


# -- Shard.checkpoint --------------------------------------------------------------------------


def test_shard_default_root_is_under_its_data_dir(tmp_path: Path) -> None:
    shard = Shard(0, 1, Storage(tmp_path / "data", shard=0, num_shards=1), Durability.parse("checkpoint-only"))
    try:
        shard.create_table(TableSpec("t", 2))
        shard.table("t").lookup(np.arange(5))
        assert shard.checkpoint_root == tmp_path / "data" / "checkpoints"
        path, _ = shard.checkpoint("named")
        assert path == tmp_path / "data" / "checkpoints" / "named" / "shard-00000-of-00001"  # its part of "named"
        assert read_manifest(path)["rows"] == {"t": 5}
        assert shard.checkpoint()[0] == tmp_path / "data" / "checkpoints" / "000001" / "shard-00000-of-00001"
        with pytest.raises(InvalidRequest, match="not under"):
            shard.checkpoint(tmp_path / "elsewhere")
        assert not (tmp_path / "elsewhere").exists() and shard.writable
    finally:
        shard.shutdown()


def test_shard_without_data_dir_needs_a_root(tmp_path: Path) -> None:
    shard = Shard(0, 1)
    shard.create_table(TableSpec("t", 2))
    with pytest.raises(NotConfigured):
        shard.checkpoint(tmp_path / "ck")
    with pytest.raises(NotConfigured):
        shard.checkpoint()
    assert not (tmp_path / "ck").exists()
    rooted = Shard(0, 1, checkpoint_root=tmp_path / "ckpts")
    rooted.create_table(TableSpec("t", 2))
    path, manifest = rooted.checkpoint("one")
    assert path == tmp_path / "ckpts" / "one" / "shard-00000-of-00001" and manifest["rows"] == {"t": 0}


def test_a_checkpoint_that_cannot_be_written_leaves_nothing_and_the_shard_writable(tmp_path: Path) -> None:
    root = tmp_path / "ckpts"
    shard = Shard(0, 1, Storage(tmp_path / "data", shard=0, num_shards=1), checkpoint_root=root)
    try:
        shard.create_table(TableSpec("t", 2))
        root.mkdir()
        os.chmod(root, 0o500)
        if os.access(root, os.W_OK):  # root ignores permissions: nothing to check here
            pytest.skip("running as root: directory permissions do not stop writes")
        with pytest.raises(ShardError) as info:
            shard.checkpoint("ck")
        assert info.value.code == grpc.StatusCode.UNAVAILABLE
        assert shard.writable and not (root / "ck").exists()
    finally:
        os.chmod(root, 0o700)
        shard.shutdown()


def test_a_checkpoint_name_holds_one_part_per_shard_and_each_shard_finds_its_own(tmp_path: Path) -> None:
    root = tmp_path / "shared"
    shards = [Shard(i, 2, checkpoint_root=root) for i in range(2)]
    for s in shards:
        s.create_table(TableSpec("t", 2))
    parts = [s.checkpoint("v1")[0] for s in shards]  # the name exists once shard 0 wrote: shard 1 adds its part
    assert parts == [root / "v1" / "shard-00000-of-00002", root / "v1" / "shard-00001-of-00002"]
    for i in range(2):
        for name in ("v1", str(root / "v1")):
            assert resolve_existing_checkpoint(root, name, i, 2) == parts[i]
    numbered = Shard(0, 2, checkpoint_root=root).checkpoint()[0]
    assert numbered == root / "000001" / "shard-00000-of-00002"
    assert resolve_existing_checkpoint(root, "1", 0, 2) == numbered
    with pytest.raises(InvalidRequest, match="holds no checkpoint of shard 1 of 2.*000001, v1"):
        resolve_existing_checkpoint(root, "1", 1, 2)  # shard 1 wrote no part of 000001
    with pytest.raises(InvalidRequest, match="is a shard checkpoint already"):
        shards[0].checkpoint("v1/shard-00000-of-00002")


def test_a_serving_shard_without_the_right_root_is_told_which_root_to_give(tmp_path: Path) -> None:
    with pytest.raises(NotConfigured, match="ServeFrom: shard 1 has no checkpoint root.*training shard's"):
        resolve_existing_checkpoint(None, "1", 1, 2)
    with pytest.raises(InvalidRequest, match="its training shard's root"):
        resolve_existing_checkpoint(tmp_path, "1", 1, 2)
