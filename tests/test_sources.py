"""Source readers and split assignment: what each source type lists and reads, and how it fails."""

from __future__ import annotations

import gzip
import io
import os
import pickle
import sys
import tarfile
from collections import Counter

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from PIL import Image

from repsim.data.sources import (animal_mnist_root, assign_splits, exact_counts, expand_urls, load_numpy_pickle,
                                 open_source, read_idx)
from repsim.data.spec import DataSpec, load_spec
from repsim.errors import DataError

CLASSES = {"cat": "cat.n.01", "dog": "dog.n.01"}


def folder_spec(root, split=None, **extra) -> DataSpec:
    return DataSpec.model_validate({"name": "tiny", "source": {"type": "image_folder", "root": str(root)},
                                    "classes": CLASSES, "split": split or {"type": "random"}, **extra})


def manifest_spec(manifest, classes=CLASSES, **extra) -> DataSpec:
    return DataSpec.model_validate({"name": "m", "source": {"type": "manifest", "path": str(manifest)},
                                    "classes": classes, **extra})


def write_gzip(path, payload: bytes):
    path.write_bytes(gzip.compress(payload))
    return path


# --- Fashion-MNIST IDX ----------------------------------------------------------------------------

def test_fashion_mnist_lists_its_official_splits_and_reads_rows():
    reader = open_source(load_spec("data_specs/fashion-mnist.yaml"))
    entries = reader.entries()
    assert Counter(e.split for e in entries) == {"train": 60000, "test": 10000}
    first_test = next(e for e in entries if e.split == "test")
    assert first_test.source_id == "test/0"
    pixels = reader.read(first_test)
    assert pixels.shape == (28, 28) and pixels.dtype == np.uint8


def test_idx_reader_checks_magic_and_length(tmp_path):
    header = bytes([0, 0, 0x08, 2]) + np.array([2, 3], ">u4").tobytes()
    good = write_gzip(tmp_path / "good.gz", header + bytes(range(6)))
    assert read_idx(good).tolist() == [[0, 1, 2], [3, 4, 5]]
    with pytest.raises(DataError, match="bad magic"):
        read_idx(write_gzip(tmp_path / "magic.gz", b"\x01\x02\x08\x02" + header[4:] + bytes(6)))
    with pytest.raises(DataError, match="truncated"):
        read_idx(write_gzip(tmp_path / "short.gz", header + bytes(5)))
    with pytest.raises(DataError, match="not a readable gzip"):
        read_idx(tmp_path / "missing.gz")


def test_fashion_mnist_with_fewer_classes_than_labels_is_refused():
    spec = load_spec("data_specs/fashion-mnist.yaml")
    spec = spec.model_copy(update={"classes": dict(list(spec.classes.items())[:3])})
    with pytest.raises(DataError, match="lists 3 classes"):
        open_source(spec).entries()


# --- Animal-MNIST and the restricted unpickler ------------------------------------------------------

def test_numpy_pickles_load(tmp_path):
    array = np.arange(12, dtype=np.int64).reshape(3, 4)
    path = write_gzip(tmp_path / "array.gz", pickle.dumps(array, protocol=4))
    assert np.array_equal(load_numpy_pickle(path), array)


class RunsACommand:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def test_unpickler_refuses_anything_but_numpy(tmp_path):
    marker = tmp_path / "pwned"
    path = write_gzip(tmp_path / "evil.gz", pickle.dumps(RunsACommand(marker)))
    with pytest.raises(DataError, match=r"refusing to unpickle (posix|os|nt)\.system"):
        load_numpy_pickle(path)
    assert not marker.exists()


def test_unpickler_refuses_non_array_values(tmp_path):
    path = write_gzip(tmp_path / "dict.gz", pickle.dumps({"a": 1}))
    with pytest.raises(DataError, match="not a numpy array"):
        load_numpy_pickle(path)


def test_animal_mnist_is_found_without_importing_the_package():
    reader = open_source(load_spec("data_specs/animal-mnist.yaml"))
    entries = reader.entries()
    assert "animal_mnist" not in sys.modules
    assert animal_mnist_root().is_dir()
    assert len(entries) == 10000 and Counter(e.label for e in entries) == {c: 1000 for c in range(10)}
    assert all(e.split is None for e in entries)
    assert reader.read(entries[0]).shape == (28, 28)


# --- Splits ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("total, fractions, expected", [
    (1000, [0.8, 0.2], [800, 200]), (7, [0.7, 0.2, 0.1], [5, 1, 1]), (10, [0.5, 0.5], [5, 5]),
    (3, [0.5, 0.5], [2, 1]), (0, [0.8, 0.2], [0, 0]),
])
def test_exact_counts_add_up(total, fractions, expected):
    assert exact_counts(total, fractions) == expected


def test_animal_mnist_random_split_is_exact_per_class_and_seeded():
    spec = load_spec("data_specs/animal-mnist.yaml")
    entries = open_source(spec).entries()
    splits = assign_splits(entries, spec)
    per_class = Counter((e.label, s) for e, s in zip(entries, splits))
    assert per_class == {**{(c, "train"): 800 for c in range(10)}, **{(c, "test"): 200 for c in range(10)}}
    assert assign_splits(entries, spec) == splits
    reseeded = spec.model_copy(update={"split": spec.split.model_copy(update={"seed": 1})})
    assert assign_splits(entries, reseeded) != splits


@pytest.mark.parametrize("name, sizes", [
    ("animal-mnist-2000", {"train": 200, "test": 100}), ("fashion-mnist-10k", {"train": 840, "test": 210}),
    ("fashion-mnist-10k-val", {"train": 672, "val": 168, "test": 210}), ("fashion-mnist-2000", {"train": 200, "test": 100}),
])
def test_subset_specs_cut_the_sizes_their_comments_state(name, sizes):
    spec = load_spec(f"data_specs/{name}.yaml")
    entries = open_source(spec).entries()
    per_class = Counter((e.label, s) for e, s in zip(entries, assign_splits(entries, spec)) if s != "unused")
    assert per_class == {(c, split): size for c in range(10) for split, size in sizes.items()}


def test_source_split_needs_a_source_with_splits(tmp_path):
    manifest = tmp_path / "list.csv"
    manifest.write_text("path,label\na.png,cat\n")
    spec = manifest_spec(manifest, split={"type": "source"})
    with pytest.raises(DataError, match="has no splits of its own.*type: random"):
        assign_splits(open_source(spec).entries(), spec)


def test_manifest_split_column_is_the_source_split(tmp_path):
    manifest = tmp_path / "list.csv"
    manifest.write_text("path,label,split\na.png,cat,train\nb.png,dog,val\n")
    spec = manifest_spec(manifest, split={"type": "source"})
    assert assign_splits(open_source(spec).entries(), spec) == ["train", "val"]


def test_unstratified_split_uses_the_whole_set(make_image_folder):
    spec = folder_spec(make_image_folder({"cat": 3, "dog": 7}),
                       split={"type": "random", "fractions": {"a": 0.5, "b": 0.5}, "stratify": False})
    assert Counter(assign_splits(open_source(spec).entries(), spec)) == {"a": 5, "b": 5}


# --- Image folders --------------------------------------------------------------------------------

def test_image_folder_lists_classes_and_split_folders(make_image_folder):
    root = make_image_folder({"cat": 2, "dog": 1}, splits=("train", "val"))
    reader = open_source(folder_spec(root, split={"type": "source"}))
    entries = reader.entries()
    assert [(e.source_id, e.label, e.split) for e in entries] == [
        ("train/cat/cat-0.png", 0, "train"), ("train/cat/cat-1.png", 0, "train"), ("train/dog/dog-0.png", 1, "train"),
        ("val/cat/cat-0.png", 0, "val"), ("val/cat/cat-1.png", 0, "val"), ("val/dog/dog-0.png", 1, "val")]
    records = list(reader.records())
    assert [r.source_id for r in records] == [e.source_id for e in entries]
    assert records[0].image == (root / "train" / "cat" / "cat-0.png").read_bytes()
    assert Image.open(io.BytesIO(records[0].image)).size == (8, 8)


def test_image_folder_without_split_folders_is_refused_for_source_split(make_image_folder):
    root = make_image_folder({"cat": 1, "dog": 1})
    with pytest.raises(DataError, match=r"holds class folders \['cat', 'dog'\].*<split>/<class>/<image>"):
        open_source(folder_spec(root, split={"type": "source"})).entries()


def test_image_folder_names_unknown_and_missing_class_folders(make_image_folder):
    root = make_image_folder({"cat": 1, "dog": 1, "cow": 1})
    with pytest.raises(DataError, match=r"folders \['cow'\] that are not classes"):
        open_source(folder_spec(root)).entries()
    (root / "cow" / "cow-0.png").unlink()
    (root / "cow").rmdir()
    (root / "dog" / "dog-0.png").unlink()
    (root / "dog").rmdir()
    with pytest.raises(DataError, match=r"no folder for classes \['dog'\]"):
        open_source(folder_spec(root)).entries()


def test_image_folder_fingerprint_follows_the_file_list(make_image_folder):
    root = make_image_folder({"cat": 2, "dog": 2})
    before = open_source(folder_spec(root)).fingerprint()
    assert open_source(folder_spec(root)).fingerprint() == before
    (root / "dog" / "dog-1.png").write_bytes(b"changed")
    assert open_source(folder_spec(root)).fingerprint() != before


def test_an_image_replaced_by_one_of_the_same_size_changes_the_fingerprint(make_image_folder):
    root = make_image_folder({"cat": 2, "dog": 2})
    image = root / "dog" / "dog-1.png"
    stat_before, content_before = (open_source(folder_spec(root, fingerprint=kind)).fingerprint()
                                   for kind in ("stat", "content"))
    original, times = image.read_bytes(), (image.stat().st_atime_ns, image.stat().st_mtime_ns)
    image.write_bytes(original[::-1])  # other bytes, the same size
    os.utime(image, ns=(times[0], times[1] + 1_000_000))
    assert open_source(folder_spec(root)).fingerprint() != stat_before  # the modification time tells
    os.utime(image, ns=times)  # a copy that kept the old time: only the content tells
    assert open_source(folder_spec(root)).fingerprint() == stat_before
    assert open_source(folder_spec(root, fingerprint="content")).fingerprint() != content_before
    image.write_bytes(original)
    os.utime(image, ns=(times[0], times[1] + 5_000_000))  # touched, unchanged
    assert open_source(folder_spec(root, fingerprint="content")).fingerprint() == content_before


# --- Manifests and WebDataset shards --------------------------------------------------------------

def test_manifest_rows_keep_order_and_resolve_paths(make_image_folder, tmp_path):
    root = make_image_folder({"cat": 1, "dog": 1})
    manifest = tmp_path / "images" / "list.csv"
    manifest.write_text("path,label,caption\ndog/dog-0.png,dog,\ncat/cat-0.png,cat,\"a cat, sitting\"\n")
    reader = open_source(manifest_spec(manifest, split={"type": "random"}))
    entries = reader.entries()
    assert [(e.source_id, e.label, e.caption) for e in entries] == [
        ("dog/dog-0.png", 1, None), ("cat/cat-0.png", 0, "a cat, sitting")]
    assert reader.read(entries[0]) == (root / "dog" / "dog-0.png").read_bytes()


@pytest.mark.parametrize("table, classes, error", [
    ("path,label\na.png,cat\nb.png,horse\n", CLASSES, r"row 1: class 'horse' is not in the spec's classes"),
    ("path,caption\na.png,one\n,two\n", None, "row 1 has no path"),
    ("path\na.png\n", None, "'label' and/or 'caption'"),
])
def test_a_malformed_manifest_names_its_problem(tmp_path, table, classes, error):
    manifest = tmp_path / "list.csv"
    manifest.write_text(table)
    with pytest.raises(DataError, match=error):
        open_source(manifest_spec(manifest, classes)).entries()


def test_a_repeated_manifest_image_is_refused_naming_both_rows(tmp_path):
    manifest = tmp_path / "list.csv"
    manifest.write_text("path,label\na.png,cat\nb.png,dog\n./a.png,dog\n")
    with pytest.raises(DataError, match=rf"manifest {manifest} rows 0 and 2 both give path \./a\.png; "
                                        "keep one row per image, or set 'on_error: skip'"):
        open_source(manifest_spec(manifest)).entries()


@pytest.mark.parametrize("table_format", ["csv", "parquet"])
def test_manifest_rows_without_a_label_are_refused_when_the_spec_lists_classes(tmp_path, table_format):
    manifest = tmp_path / f"list.{table_format}"
    if table_format == "csv":
        manifest.write_text("path,label\n0.png,cat\n1.png,\n2.png,NaN\n3.png, \n4.png,dog\n")
    else:
        pq.write_table(pa.table({"path": [f"{k}.png" for k in range(5)], "label": ["cat", None, "", " ", "dog"]}),
                       manifest)
    with pytest.raises(DataError, match=r"has no label in rows 1, 2, 3, but the spec lists classes; .*"
                                        r"or remove 'classes' for caption-only data"):
        open_source(manifest_spec(manifest)).entries()


def test_brace_and_glob_patterns_expand_in_order(tmp_path):
    for name in ("a-0.tar", "a-1.tar", "b-0.tar"):
        with tarfile.open(tmp_path / name, "w"):
            pass
    assert [p.name for p in expand_urls(f"{tmp_path}/a-{{1,0}}.tar")] == ["a-1.tar", "a-0.tar"]
    assert [p.name for p in expand_urls(f"{tmp_path}/*.tar")] == ["a-0.tar", "a-1.tar", "b-0.tar"]
    with pytest.raises(DataError, match="matches no tar"):
        expand_urls(f"{tmp_path}/c-*.tar")
