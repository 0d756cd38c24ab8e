"""The shard manifest's one reader: the columns asked for, and a one-line DataError naming the file
when it is missing, unreadable or lacks a column."""

from __future__ import annotations

import fsspec
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from repsim.data.manifest import (MANIFEST, MANIFEST_SCHEMA, ManifestWriter, manifest_labels, manifest_schema, read_manifest,
                                  shard_sizes)
from repsim.errors import DataError


def row(index: int, split: str, label: int | None) -> dict:
    return {"index": index, "key": f"{index:06d}", "shard": f"{split}-00000.tar", "split": split, "label": label,
            "class_name": None, "caption": f"a photo {index}", "sha256": "0" * 64, "width": 8, "height": 8,
            "source_id": f"src/{index}"}


@pytest.fixture
def manifest(tmp_path):
    path = tmp_path / MANIFEST
    rows = [row(index, split, label) for index, (split, label) in enumerate([("train", 0), ("train", None), ("test", 1)])]
    with ManifestWriter(path) as writer:
        writer.add(pa.Table.from_pylist(rows[:2], schema=manifest_schema()))
        writer.add(pa.Table.from_pylist(rows[2:], schema=manifest_schema()))
    assert (writer.rows, dict(writer.splits)) == (3, {"train": 2, "test": 1})
    return path


def one_line(err: pytest.ExceptionInfo) -> str:
    message = str(err.value)
    assert "\n" not in message
    return message


def test_the_written_manifest_reads_back_by_column_and_filter(manifest):
    assert pq.read_schema(manifest).names == list(MANIFEST_SCHEMA)
    assert read_manifest(manifest, ["key"]).column("key").to_pylist() == ["000000", "000001", "000002"]
    assert read_manifest(manifest, ["index"], filters=[("split", "==", "test")]).column("index").to_pylist() == [2]
    assert manifest_labels(manifest).tolist() == [0, -1, 1]
    assert shard_sizes(manifest) == {"train-00000.tar": 2, "test-00000.tar": 1}


def test_a_manifest_missing_a_column_is_one_line_naming_the_file_and_the_column(tmp_path):
    path = tmp_path / MANIFEST
    pq.write_table(pa.table({"index": [0, 1], "key": ["a", "b"]}), path)
    with pytest.raises(DataError) as err:
        read_manifest(path, ["index", "label"])
    assert f"the manifest {path} has no column 'label' (it has index, key)" in one_line(err)
    assert "re-run the shard stage" in err.value.fix
    with pytest.raises(DataError, match="no column 'split'"):
        read_manifest(path, ["index"], filters=[("split", "==", "train")])
    with pytest.raises(DataError, match="no column 'label'"):
        manifest_labels(path)


def test_a_missing_or_unreadable_manifest_is_one_line_naming_the_file(tmp_path):
    with pytest.raises(DataError) as err:
        read_manifest(tmp_path / MANIFEST, ["key"])
    assert one_line(err).startswith(f"the manifest {tmp_path / MANIFEST} does not exist; re-run the shard stage")
    (tmp_path / MANIFEST).write_bytes(b"not parquet at all")
    with pytest.raises(DataError) as err:
        read_manifest(tmp_path / MANIFEST, ["key"])
    assert one_line(err).startswith(f"the manifest {tmp_path / MANIFEST} is unreadable (ArrowInvalid: ")


def test_a_manifest_at_a_url_reads_and_refuses_alike(manifest):
    url = "memory://shards/manifest.parquet"
    fsspec.filesystem("memory").pipe(url, manifest.read_bytes())
    try:
        assert shard_sizes(url) == shard_sizes(manifest)
        with pytest.raises(DataError) as err:
            read_manifest(url, ["nope"])
        assert f"the manifest {url} has no column 'nope'" in one_line(err)
        with pytest.raises(DataError, match="memory://shards/other.parquet does not exist"):
            read_manifest("memory://shards/other.parquet", ["key"])
    finally:
        fsspec.filesystem("memory").rm("memory://shards", recursive=True)
