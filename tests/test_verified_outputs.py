"""Verified cache hits: a completed output whose files no longer match its record is reported and
rebuilt, never served; and clean leaves alone the inputs a running stage is reading."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from e2e import tiny_experiment
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from repsim.flows.cli import main
from repsim.data import load_spec, shard
from repsim.experiment import load_experiment
from repsim.stage import IN_USE, list_outputs, read_record, Reuse, sha256_file, unreferenced_outputs

DAY = 86400


@pytest.fixture
def sharded(make_image_folder, write_spec):
    """A spec of 16 images (12 train in 4 tars, 4 test in 2) and its completed shard output."""
    root = make_image_folder({"cat": 8, "dog": 8})
    spec = load_spec(write_spec({"name": "pets", "source": {"type": "image_folder", "root": str(root)},
                                 "classes": {"cat": "cat.n.01", "dog": "dog.n.01"},
                                 "split": {"type": "random", "fractions": {"train": 0.75, "test": 0.25}},
                                 "shard_size": 3}))
    return spec, shard(spec, progress=False)


def digests(path: Path) -> dict[str, str]:
    """sha256 of every file of an output directory but its stage.json (which holds build times)."""
    return {file.name: sha256_file(file) for file in sorted(path.iterdir()) if file.name != "stage.json"}


def stages_status(capsys, *args: str) -> str:
    """The status column of ``repsim stages shard ARGS``' only row (statuses may hold spaces)."""
    assert main(["stages", "shard", *args]) == 0
    [row] = capsys.readouterr().out.splitlines()[2:]
    return " ".join(row.split()[2:-2])


def test_the_shard_record_lists_each_tar_with_its_size_and_sample_count(sharded):
    _, result = sharded
    files = read_record(result.path)["files"]
    counts = pq.read_table(result.manifest, columns=["shard"])["shard"].to_pylist()
    tars = [tar for split in result.shards.values() for tar in split]
    assert len(tars) == 6
    for tar in tars:
        assert files[tar.name]["bytes"] == tar.stat().st_size
        assert files[tar.name]["samples"] == counts.count(tar.name)
        assert files[tar.name]["sha256"] == sha256_file(tar)
    assert set(files) == {*(tar.name for tar in tars), "manifest.parquet", "shards.json", "errors.json"}


def cut_short(path: Path) -> str:
    size = path.stat().st_size
    os.truncate(path, size // 2)
    return f"{path.name}: {size // 2} of {size} bytes"


@pytest.mark.parametrize(("damage", "name"), [
    (cut_short, "train-00001.tar"),
    (cut_short, "manifest.parquet"),
    (lambda path: (path.unlink(), f"{path.name}: missing")[1], "test-00001.tar"),
])
def test_a_damaged_shard_output_is_reported_listed_and_rebuilt_to_the_same_bytes(sharded, capsys, caplog,
                                                                                damage, name):
    spec, result = sharded
    before = digests(result.path)
    found = damage(result.path / name)
    assert stages_status(capsys) == f"damaged ({found})"

    with caplog.at_level(logging.WARNING, logger="repsim.stage"):
        again = shard(spec, progress=False)
    assert not again.cached and again.path == result.path
    assert [record.getMessage() for record in caplog.records] == [
        f"shard output {result.key} at {result.path} is damaged ({found}); building it again"]
    assert digests(again.path) == before
    assert sorted(path.name for path in result.path.parent.iterdir()) == [f".{result.key}.lock", result.key]
    assert stages_status(capsys) == "complete" and shard(spec, progress=False).cached


def corrupt_same_size(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def test_verify_finds_a_same_size_corruption_that_sizes_cannot(sharded, capsys):
    spec, result = sharded
    before = digests(result.path)
    corrupt_same_size(result.path / "train-00000.tar")
    assert stages_status(capsys) == "complete"
    assert shard(spec, progress=False).cached  # sizes alone cannot tell
    assert stages_status(capsys, "--verify") == "damaged (train-00000.tar: sha256 differs from its record)"

    verified = Reuse(verify=True)
    assert not shard(spec, progress=False, reuse=verified).cached
    assert shard(spec, progress=False, reuse=verified).cached
    assert digests(result.path) == before


def test_an_experiment_with_verify_plans_a_corrupted_stage_to_run_again(make_image_folder, write_spec, tmp_path):
    from repsim.flows.experiment import plan_experiment

    path = tiny_experiment(tmp_path, make_image_folder, write_spec)
    experiment = load_experiment(path)
    result = shard(experiment.data, progress=False)
    corrupt_same_size(result.shards["train"][0])

    def shard_status(overrides: list[str]) -> str:
        stages = plan_experiment(load_experiment(path, overrides))["stages"]
        return next(stage["status"] for stage in stages if stage["stage"] == "shard")

    assert shard_status([]) == "cached"
    assert shard_status(["verify=true"]) == "runs"


def test_an_output_recorded_without_files_is_served_and_listed_as_unverified(sharded, capsys):
    spec, result = sharded
    record = read_record(result.path)
    del record["files"]
    (result.path / "stage.json").write_text(json.dumps(record))
    cut_short(result.path / "train-00000.tar")
    assert shard(spec, progress=False).cached
    assert stages_status(capsys, "--verify") == "complete (unverified: its record lists no files)"


READER = textwrap.dedent("""
    import sys
    from repsim.stage import Stage, run_stage

    def build(tmp):
        print("reading", flush=True)
        sys.stdin.readline()
        (tmp / "out.txt").write_text("done")

    run_stage(Stage("reader", "1", {}, {"shards": sys.argv[1]}), build)
""")


def test_clean_leaves_alone_an_output_that_a_running_stage_in_another_process_reads(sharded, repsim_home, capsys):
    _, result = sharded
    stamp = time.time() - 10 * DAY
    os.utime(result.path / "stage.json", (stamp, stamp))
    assert [output.path for output in unreferenced_outputs(DAY)] == [result.path]

    env = {**os.environ, "REPSIM_HOME": str(repsim_home)}
    reader = subprocess.Popen([sys.executable, "-c", READER, result.key], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True, env=env)
    try:
        assert reader.stdout.readline().strip() == "reading"
        assert stages_status(capsys) == IN_USE
        assert main(["clean", "--older-than", "1d", "--yes"]) == 0
        assert "removed 0 outputs" in capsys.readouterr().out
        assert read_record(result.path) is not None
    finally:
        reader.communicate("go\n", timeout=30)
    assert reader.returncode == 0
    assert {output.stage: output.status for output in list_outputs()} == {"shard": "complete", "reader": "complete"}


@settings(max_examples=8, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(cut=st.floats(0.0, 0.999), target=st.sampled_from(["train-00000.tar", "test-00001.tar", "manifest.parquet"]))
def test_any_truncation_of_a_tar_or_the_manifest_is_rebuilt_to_the_same_bytes(sharded, cut, target):
    spec, result = sharded
    before = digests(result.path)
    damaged = result.path / target
    os.truncate(damaged, int(cut * damaged.stat().st_size))
    rebuilt = shard(spec, progress=False)
    assert not rebuilt.cached and rebuilt.path == result.path and digests(rebuilt.path) == before
