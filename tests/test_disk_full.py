"""A full disk: one line naming the file system and the bytes to free, exit 2, no complete-looking
output left, and the same command succeeds once there is space. On a real small file system (a tmpfs,
where this machine allows mounting one) and with ENOSPC injected at the writers a tmpfs run does not
reach: a checkpoint, the MLflow store, the log records."""

from __future__ import annotations

import errno
import logging
import sqlite3
import subprocess
from pathlib import Path

import pytest
import torch
from e2e import REPSIM, isolated_env
from mlflow.exceptions import MlflowException

from repsim.flows import cli
from repsim.errors import DiskFull, mount_point
from repsim.methods.trainer import previous_of, save_atomically
from repsim.tasks.tracking import Tracker

FULL_STORE = MlflowException("(raised as a result of Query-invoked autoflush)\n(sqlite3.OperationalError) database or "
                             "disk is full")


@pytest.fixture
def small_disk(tmp_path):
    """``resize(megabytes)``: a tmpfs of that size at ``tmp_path / "disk"``, mounted on first call and
    resized (its files kept) on the next; skips the test where mounting is not allowed."""
    disk = tmp_path / "disk"
    disk.mkdir()

    def resize(megabytes: int) -> Path:
        options = f"size={megabytes}m" if not disk.is_mount() else f"remount,size={megabytes}m"
        mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(disk)], capture_output=True)
        if mounted.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.decode().strip()}")
        return disk

    yield resize
    if disk.is_mount():
        subprocess.run(["umount", "-l", str(disk)], check=False)


def shard(home: Path, spec: Path, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([REPSIM, "shard", str(spec)], capture_output=True, text=True, timeout=600,
                          env=isolated_env(home) | env)


@pytest.fixture
def noisy_spec(make_image_folder, write_spec):
    """A data spec of 300 64 px RGB noise images: ~4 MB of shards."""
    root = make_image_folder({"cat": 150, "dog": 150}, mode="RGB", size=64)
    return write_spec({"name": "noise", "source": {"type": "image_folder", "root": str(root)},
                       "classes": {"cat": "cat.n.01", "dog": "dog.n.01"},
                       "split": {"type": "random", "fractions": {"train": 0.5, "test": 0.5}}})


@pytest.mark.slow
@pytest.mark.orchestration
def test_a_disk_filled_while_sharding_is_one_line_and_a_rerun_with_space_succeeds(small_disk, noisy_spec):
    home = small_disk(8)  # the run records take ~6 MB of it
    failed = shard(home, noisy_spec, REPSIM_MIN_FREE_MB="0")
    assert failed.returncode == 2, failed.stderr
    assert "Traceback" not in failed.stderr
    [line] = [line for line in failed.stderr.splitlines() if line.startswith("error: ")]
    assert line.startswith(f"error: the file system at {home} is full: ") and "free more than " in line, line
    assert not list(home.rglob("stage.json")) and not list(home.rglob("*.tmp-*"))  # nothing complete-looking

    small_disk(64)
    done = shard(home, noisy_spec, REPSIM_MIN_FREE_MB="0")
    assert done.returncode == 0, done.stderr
    assert len(list((home / "artifacts" / "shard").glob("*/stage.json"))) == 1


def test_a_file_system_too_small_for_a_run_is_refused_before_anything_is_written(small_disk, noisy_spec):
    home = small_disk(8)
    refused = shard(home, noisy_spec, REPSIM_MIN_FREE_MB="100")
    assert refused.returncode == 2
    assert refused.stderr.strip().splitlines() == [
        f"error: the file system at {home} is full: a run (its stage outputs and run records) needs 104,857,600 bytes "
        f"free there ({8 * 2**20:,} of {8 * 2**20:,} bytes free now); free more than {100 * 2**20 - 8 * 2**20:,} bytes "
        "there, or point REPSIM_HOME (or the stage's output) at a larger disk"]
    assert [path.name for path in home.iterdir() if path.name != "lost+found"] == []  # not even prefect/


def test_a_checkpoint_cut_by_a_full_disk_leaves_the_previous_one_and_no_partial_file(tmp_path, monkeypatch):
    path = tmp_path / "checkpoint.pt"
    save_atomically({"step": 1}, path)
    save_atomically({"step": 2}, path)

    def fill_the_disk(payload, handle):
        handle.write(b"half a checkpoint")
        raise RuntimeError("[enforce fail at inline_container.cc:603] . unexpected pos 64 vs 0: No space left on device")

    monkeypatch.setattr(torch, "save", fill_the_disk)
    with pytest.raises(RuntimeError, match="No space left"):
        save_atomically({"step": 3}, path)
    monkeypatch.undo()
    assert torch.load(path)["step"] == 2 and torch.load(previous_of(path))["step"] == 1
    assert sorted(file.name for file in tmp_path.iterdir()) == ["checkpoint.pt", "checkpoint.pt.previous"]


def test_a_store_that_fails_too_does_not_hide_the_error_of_the_run(tmp_path, monkeypatch):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow.db'}")
    tracker = Tracker()

    def store_full(*_, **__):
        raise FULL_STORE

    monkeypatch.setattr(tracker.client, "set_terminated", store_full)
    with pytest.raises(DiskFull, match="the shard stage had written"), tracker.flow_run("experiment", {}):
        raise DiskFull("the shard stage had written 10 bytes", "free some")


@pytest.mark.parametrize("error", [
    FULL_STORE,  # MLflow's SQLite store
    RuntimeError("Timed out while attempting to connect to ephemeral Prefect API server"),  # on a disk already full
])
def test_a_full_store_outside_a_stage_is_one_line_naming_the_home_file_system(tmp_path, monkeypatch, capsys, error):
    monkeypatch.setenv("REPSIM_HOME", str(tmp_path))
    full = isinstance(error, MlflowException)
    monkeypatch.setattr(cli, "NEARLY_FULL_BYTES", 0 if full else 2**62)  # a disk with space; one without

    def fail(_):
        raise error

    monkeypatch.setattr(cli, "cmd_stages", fail)
    assert cli.main(["stages"]) == cli.EXIT_USER_ERROR
    [line] = capsys.readouterr().err.splitlines()
    assert line.startswith(f"error: the file system at {mount_point(tmp_path)} is full: the run records under "
                           f"{tmp_path} could not be written ("), line


def test_an_error_that_is_no_full_disk_is_not_taken_for_one(tmp_path, monkeypatch):
    monkeypatch.setenv("REPSIM_HOME", str(tmp_path))
    monkeypatch.setattr(cli, "cmd_stages", lambda _: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        cli.main(["stages"])


def test_log_records_of_a_full_disk_are_dropped_and_user_errors_lose_their_traceback():
    keep = cli._keep_log_record

    def record(message: str, error: BaseException | None = None) -> logging.LogRecord:
        return logging.LogRecord("prefect", logging.ERROR, __file__, 1, message, None,
                                 (type(error), error, None) if error else None)

    assert not keep(record("SQLAlchemy database error.\n(sqlite3.OperationalError) database or disk is full"))
    assert not keep(record("Finished in state Failed", OSError(errno.ENOSPC, "No space left on device")))
    assert not keep(record("failed", sqlite3.OperationalError("database or disk is full")))
    user = record("Finished in state Failed", DiskFull("the file system at /x is full", "free some"))
    assert keep(user) and user.exc_info is None
    other = record("Finished in state Failed", ValueError("a bug"))
    assert keep(other) and other.exc_info is not None
