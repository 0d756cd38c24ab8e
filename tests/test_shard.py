"""The shard stage: WebDataset tars + manifest that reproduce the source exactly and deterministically."""

from __future__ import annotations

import functools
import gzip
import hashlib
import io
import json
import os
import signal
import subprocess
import sys
import tarfile
import time
from collections import Counter
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.csv as pacsv
import pyarrow.parquet as pq
import pytest
from PIL import Image

from bounded import peak_traced
from repsim.data import ShardResult, load_spec, shard
from repsim.data import stage as shard_module
from repsim.data.sources import open_source
from repsim.errors import DataError, StageError

CLASSES = {"cat": "cat.n.01", "dog": "dog.n.01"}
CLASSES_BY_LABEL = list(CLASSES)
FASHION_ROOT = Path("/usr/share/datasets/fashion-mnist")
REPO = Path(__file__).resolve().parents[1]


def read_tar(path: Path) -> dict[str, dict[str, bytes]]:
    """{key: {extension: bytes}} read with Python's tarfile only."""
    samples: dict[str, dict[str, bytes]] = {}
    with tarfile.open(path) as archive:
        for member in archive:
            key, ext = member.name.split(".", 1)
            samples.setdefault(key, {})[ext] = archive.extractfile(member).read()
    return samples


def write_webdataset_tar(path: Path, keys: list[str]) -> dict[str, tuple[str, str]]:
    """A tar of img2dataset-style samples (jpg, txt, json with a label); returns {key: (caption, label)}."""
    written = {}
    with tarfile.open(path, "w") as archive:
        for i, key in enumerate(keys):
            jpeg = io.BytesIO()
            Image.fromarray(np.full((6, 10, 3), 40 * i % 256, np.uint8)).save(jpeg, format="JPEG")
            written[key] = (f"caption {key}", ("cat", "dog")[i % 2])
            members = {"jpg": jpeg.getvalue(), "txt": written[key][0].encode(),
                       "json": json.dumps({"key": key, "label": written[key][1]}).encode()}
            for ext, data in members.items():
                info = tarfile.TarInfo(f"{key}.{ext}")
                info.size = len(data)
                archive.addfile(info, io.BytesIO(data))
    return written


def webdataset_spec(write_spec, urls: str, **extra) -> Path:
    return write_spec({"name": "cc", "source": {"type": "webdataset", "urls": urls, "label_field": "label"},
                       "classes": CLASSES, "image_format": "jpg", "split": {"type": "random"}, **extra})


def read_samples(result: ShardResult) -> dict[str, dict[str, bytes]]:
    return {key: members for tars in result.shards.values() for tar in tars for key, members in read_tar(tar).items()}


def manifest_rows(result: ShardResult) -> list[dict]:
    return pq.read_table(result.manifest).to_pylist()


def folder_spec(write_spec, root: Path, **extra) -> Path:
    return write_spec({"name": "tiny", "source": {"type": "image_folder", "root": str(root)},
                       "classes": CLASSES, "split": {"type": "random", "fractions": {"train": 0.75, "test": 0.25}},
                       "shard_size": 3, **extra})


def idx_array(name: str) -> np.ndarray:
    """An IDX file parsed independently of the library: uint8 data after a 4-byte magic and 4-byte dims."""
    data = gzip.decompress((FASHION_ROOT / name).read_bytes())
    ndim = data[3]
    dims = [int.from_bytes(data[4 + 4 * i: 8 + 4 * i], "big") for i in range(ndim)]
    return np.frombuffer(data, np.uint8, offset=4 + 4 * ndim).reshape(dims)


# --- Fashion-MNIST acceptance ---------------------------------------------------------------------

@pytest.mark.slow
def test_fashion_mnist_shards_reproduce_the_idx_source_exactly():
    result = shard(REPO / "data_specs" / "fashion-mnist.yaml", progress=False)
    assert not result.cached and result.errors == 0
    assert result.num_samples == 70000 and result.splits == {"train": 60000, "test": 10000}
    rows = manifest_rows(result)
    assert [row["index"] for row in rows] == list(range(70000))
    assert len({row["key"] for row in rows}) == 70000 and not any("." in row["key"] for row in rows)
    per_class = Counter((row["split"], row["label"]) for row in rows)
    assert per_class == {**{("train", c): 6000 for c in range(10)}, **{("test", c): 1000 for c in range(10)}}

    source = {split: (idx_array(f"{prefix}-images-idx3-ubyte.gz"), idx_array(f"{prefix}-labels-idx1-ubyte.gz"))
              for split, prefix in (("train", "train"), ("test", "t10k"))}
    decoded = {split: np.zeros_like(images) for split, (images, _) in source.items()}
    samples = read_samples(result)
    for row in rows:
        members = samples[row["key"]]
        assert hashlib.sha256(members["png"]).hexdigest() == row["sha256"]
        split, source_row = row["source_id"].split("/")
        image = Image.open(io.BytesIO(members["png"]))
        assert image.mode == "L" and split == row["split"]
        decoded[split][int(source_row)] = np.asarray(image)
        assert int(members["cls"]) == row["label"] == source[split][1][int(source_row)]
        assert members["txt"].decode() == row["caption"] and "{" not in row["caption"]
        assert json.loads(members["json"])["source_id"] == row["source_id"]
    for split, (images, _) in source.items():
        assert np.array_equal(decoded[split], images)

    again = shard(REPO / "data_specs" / "fashion-mnist.yaml", progress=False)
    assert again.cached and again.key == result.key and again.path == result.path


@pytest.mark.slow
def test_killed_sharding_leaves_nothing_that_looks_done_and_a_rerun_completes(tmp_path):
    out = tmp_path / "fashion"
    script = (f"from repsim.data import shard; "
              f"shard({str(REPO / 'data_specs' / 'fashion-mnist.yaml')!r}, out_dir={str(out)!r}, progress=False)")
    child = subprocess.Popen([sys.executable, "-c", script], cwd=REPO)
    try:
        deadline = time.time() + 300
        while not list(tmp_path.glob(".fashion.tmp-*/train-00001.tar")):  # past the first 10000 samples
            assert child.poll() is None and time.time() < deadline, "sharding ended before it could be killed"
            time.sleep(0.05)
    finally:
        os.kill(child.pid, signal.SIGKILL)
        child.wait()
    assert not out.exists()
    with pytest.raises(StageError, match="not a completed shard output"):
        ShardResult.from_dir(out)
    rerun = shard(REPO / "data_specs" / "fashion-mnist.yaml", out_dir=out, progress=False)
    assert not rerun.cached and rerun.num_samples == 70000
    assert not list(tmp_path.glob(".fashion.tmp-*"))


def test_animal_mnist_shards_an_exact_stratified_split():
    result = shard(REPO / "data_specs" / "animal-mnist.yaml", progress=False)
    assert result.splits == {"train": 8000, "test": 2000}
    rows = manifest_rows(result)
    per_class = Counter((row["split"], row["label"]) for row in rows)
    assert per_class == {**{("train", c): 800 for c in range(10)}, **{("test", c): 200 for c in range(10)}}
    assert sorted(int(row["source_id"]) for row in rows) == list(range(10000))


# --- Small synthetic sources ----------------------------------------------------------------------

def test_same_spec_gives_byte_identical_tars(make_image_folder, write_spec, tmp_path):
    spec = folder_spec(write_spec, make_image_folder({"cat": 4, "dog": 4}, mode="RGB"))
    first = shard(spec, out_dir=tmp_path / "first", progress=False)
    second = shard(spec, out_dir=tmp_path / "second", progress=False)
    assert not second.cached and first.key == second.key
    tars = sorted(p.name for p in first.path.glob("*.tar"))
    assert tars == ["test-00000.tar", "train-00000.tar", "train-00001.tar"]
    assert tars == sorted(p.name for p in second.path.glob("*.tar"))
    for name in tars:
        assert (first.path / name).read_bytes() == (second.path / name).read_bytes()
    assert pq.read_table(first.manifest).equals(pq.read_table(second.manifest))


def test_samples_carry_pixels_labels_and_template_captions(make_image_folder, write_spec):
    root = make_image_folder({"cat": 4, "dog": 4}, mode="RGB")
    spec_path = folder_spec(write_spec, root)
    result = shard(spec_path, progress=False)
    assert result.splits == {"train": 6, "test": 2} and [len(t) for t in result.shards.values()] == [2, 1]
    rows, samples = manifest_rows(result), read_samples(result)
    assert [row["split"] for row in rows] == ["train"] * 6 + ["test"] * 2
    assert Counter((row["split"], row["class_name"]) for row in rows) == {
        ("train", "cat"): 3, ("train", "dog"): 3, ("test", "cat"): 1, ("test", "dog"): 1}
    spec = load_spec(spec_path)
    for row in rows:
        members = samples[row["key"]]
        image = Image.open(io.BytesIO(members["png"]))
        source_pixels = np.asarray(Image.open(root / row["source_id"]))
        assert image.mode == "RGB" and np.array_equal(np.asarray(image), source_pixels)
        assert (row["width"], row["height"]) == image.size == (8, 8)
        assert row["class_name"] == CLASSES_BY_LABEL[row["label"]] == row["source_id"].split("/")[0]
        assert row["caption"] == spec.caption_for(row["label"], row["index"]) == members["txt"].decode()
        assert json.loads(members["json"]) == {key: row[key] for key in
                                               ("index", "key", "split", "label", "class_name", "source_id")}


def test_without_shuffle_seed_splits_come_in_source_order_unshuffled(make_image_folder, write_spec):
    root = make_image_folder({"cat": 2, "dog": 2}, splits=("train", "test"))
    spec = folder_spec(write_spec, root, split={"type": "source"}, shuffle_seed=None)
    rows = manifest_rows(shard(spec, progress=False))
    assert [row["source_id"] for row in rows] == [
        f"{split}/{name}/{name}-{i}.png" for split in ("test", "train") for name in ("cat", "dog") for i in (0, 1)]


def test_an_exception_mid_build_leaves_no_output_and_the_next_run_succeeds(
        make_image_folder, write_spec, tmp_path, monkeypatch):
    spec = folder_spec(write_spec, make_image_folder({"cat": 3, "dog": 3}))
    out = tmp_path / "out"
    real_encode, calls = shard_module.encode_image, []

    def encode_then_crash(*args, **kwargs):
        calls.append(1)
        if len(calls) == 4:
            raise RuntimeError("power cut")
        return real_encode(*args, **kwargs)

    monkeypatch.setattr(shard_module, "encode_image", encode_then_crash)
    with pytest.raises(RuntimeError, match="power cut"):
        shard(spec, out_dir=out, progress=False)
    assert not out.exists() and not list(tmp_path.glob(".out.tmp-*"))
    monkeypatch.setattr(shard_module, "encode_image", real_encode)
    result = shard(spec, out_dir=out, progress=False)
    assert not result.cached and result.num_samples == 6
    assert shard(spec, out_dir=out, progress=False).cached


@pytest.mark.parametrize("on_error", ["fail", "skip"])
def test_a_corrupt_image_fails_by_name_or_is_skipped_and_counted(make_image_folder, write_spec, on_error):
    root = make_image_folder({"cat": 3, "dog": 3})
    (root / "dog" / "dog-1.png").write_bytes(b"\x89PNG this is not an image")
    spec = folder_spec(write_spec, root, on_error=on_error)
    if on_error == "fail":
        with pytest.raises(DataError, match=r"cannot read image .*dog/dog-1\.png.*on_error: skip"):
            shard(spec, progress=False)
        return
    result = shard(spec, progress=False)
    assert result.errors == 1 and result.num_samples == 5
    assert "dog/dog-1.png" not in {row["source_id"] for row in manifest_rows(result)}
    assert [row["index"] for row in manifest_rows(result)] == list(range(5))
    errors = json.loads((result.path / "errors.json").read_text())
    assert [e["source_id"] for e in errors] == ["dog/dog-1.png"] and errors[0]["reason"]


@pytest.mark.parametrize("table_format", ["csv", "parquet"])
def test_manifest_source_round_trips_labels_and_captions(make_image_folder, write_spec, tmp_path, table_format):
    make_image_folder({"cat": 2, "dog": 2}, mode="RGB", name="pics")
    table = pa.table({"path": ["cat/cat-0.png", "cat/cat-1.png", "dog/dog-0.png", "dog/dog-1.png"],
                      "label": ["cat", "cat", "dog", "dog"],
                      "caption": ["a cat, on a mat", None, "a dog", None]})
    manifest = tmp_path / "pics" / f"list.{table_format}"
    if table_format == "csv":
        pacsv.write_csv(table, manifest)
    else:
        pq.write_table(table, manifest)
    spec_path = write_spec({"name": "listed", "source": {"type": "manifest", "path": str(manifest)},
                            "classes": CLASSES, "split": {"type": "random", "stratify": False}})
    result = shard(spec_path, progress=False)
    rows, samples = {row["source_id"]: row for row in manifest_rows(result)}, read_samples(result)
    spec = load_spec(spec_path)
    assert rows["cat/cat-0.png"]["caption"] == "a cat, on a mat" and rows["dog/dog-0.png"]["class_name"] == "dog"
    templated = rows["cat/cat-1.png"]
    assert templated["caption"] == spec.caption_for(0, templated["index"])
    assert samples[rows["dog/dog-0.png"]["key"]]["cls"] == b"1"


def test_a_caption_only_manifest_shards_unlabelled_samples(make_image_folder, write_spec, tmp_path):
    make_image_folder({"cat": 1, "dog": 1}, name="pics")
    manifest = tmp_path / "pics" / "list.parquet"
    pq.write_table(pa.table({"path": ["cat/cat-0.png", "dog/dog-0.png"], "label": [float("nan"), None],
                             "caption": ["a cat", "a dog"]}), manifest)
    spec = write_spec({"name": "captioned", "source": {"type": "manifest", "path": str(manifest)},
                       "split": {"type": "random", "stratify": False}})
    result = shard(spec, progress=False)
    samples = read_samples(result)
    for row in manifest_rows(result):
        assert row["label"] is None and row["class_name"] is None
        assert "cls" not in samples[row["key"]] and samples[row["key"]]["txt"] == row["caption"].encode()


def test_sharding_memory_grows_by_columns_not_by_a_python_row_per_sample(write_spec, tmp_path, monkeypatch):
    monkeypatch.setattr("repsim.data.sources.LISTING_BATCH", 100)
    peaks = {}
    for tars in (1, 2, 8):  # 250 samples to import what sharding imports, then 500 and 2,000
        folder = tmp_path / f"source-{tars}"
        folder.mkdir()
        for number in range(tars):
            write_webdataset_tar(folder / f"cc-{number:05d}.tar", [f"{number}-{i:03d}" for i in range(250)])
        spec = load_spec(webdataset_spec(write_spec, str(folder / f"cc-{{00000..{tars - 1:05d}}}.tar"), shard_size=100))
        peaks[tars * 250] = peak_traced(functools.partial(shard, spec, out_dir=tmp_path / f"shards-{tars}", progress=False))
    assert (peaks[2000] - peaks[500]) / 1500 < 200  # bytes a sample: no Entry nor manifest row held per sample
    manifest = pq.ParquetFile(tmp_path / "shards-8" / "manifest.parquet")
    assert manifest.metadata.num_row_groups == 20 and manifest.metadata.num_rows == 2000


def test_webdataset_source_round_trips_captions_and_json_labels(write_spec, tmp_path):
    expected = {}
    for tar_index in range(2):
        name = f"cc-{tar_index:05d}.tar"
        written = write_webdataset_tar(tmp_path / name, [f"{tar_index}{i:04d}" for i in range(3)])
        expected.update({f"{name}/{key}": value for key, value in written.items()})
    result = shard(webdataset_spec(write_spec, "cc-{00000..00001}.tar"), progress=False)
    rows, samples = manifest_rows(result), read_samples(result)
    assert {row["source_id"]: (row["caption"], row["class_name"]) for row in rows} == expected
    for row in rows:
        image = Image.open(io.BytesIO(samples[row["key"]]["jpg"]))
        assert image.format == "JPEG" and image.size == (10, 6) == (row["width"], row["height"])


def test_from_dir_refuses_a_directory_that_is_not_a_shard_output(tmp_path):
    with pytest.raises(StageError, match="not a completed shard output"):
        ShardResult.from_dir(tmp_path)


# --- Damaged and inconsistent sources ---------------------------------------------------------------

def test_under_skip_a_repeated_manifest_image_keeps_its_first_row_and_is_counted(make_image_folder, write_spec,
                                                                                  tmp_path):
    make_image_folder({"cat": 2, "dog": 1})
    manifest = tmp_path / "images" / "list.csv"
    manifest.write_text("path,label\ncat/cat-0.png,cat\ndog/dog-0.png,dog\ncat/cat-1.png,cat\n./cat/cat-0.png,dog\n")
    spec = write_spec({"name": "listed", "source": {"type": "manifest", "path": str(manifest)}, "classes": CLASSES,
                       "split": {"type": "random"}, "on_error": "skip"})
    result = shard(spec, progress=False)
    assert result.errors == 1 and result.num_samples == 3
    assert {row["source_id"]: row["class_name"] for row in manifest_rows(result)} == {
        "cat/cat-0.png": "cat", "dog/dog-0.png": "dog", "cat/cat-1.png": "cat"}
    errors = json.loads((result.path / "errors.json").read_text())
    assert errors == [{"source_id": "./cat/cat-0.png",
                       "reason": f"manifest {manifest} rows 0 and 3 both give path ./cat/cat-0.png"}]


def cut_points(tar: Path) -> dict[str, int]:
    """Byte offsets in a tar of three samples, at or inside the first member of the third sample."""
    with tarfile.open(tar) as archive:
        third = archive.getmembers()[6]
    return {"between samples": third.offset, "inside a header": third.offset + 100,
            "inside an image": third.offset_data + third.size // 2}


@pytest.mark.parametrize("cut", ["between samples", "inside a header", "inside an image"])
def test_a_truncated_source_tar_is_refused_by_name(write_spec, tmp_path, cut):
    tar = tmp_path / "cc-00000.tar"
    write_webdataset_tar(tar, ["0000", "0001", "0002"])
    os.truncate(tar, cut_points(tar)[cut])
    with pytest.raises(DataError, match=r"cc-00000\.tar is (truncated|not a readable tar).*on_error: skip") as err:
        shard(webdataset_spec(write_spec, "cc-00000.tar"), progress=False)
    assert "\n" not in str(err.value)


def test_under_skip_a_truncated_source_tar_is_counted_and_its_whole_samples_kept(write_spec, tmp_path):
    write_webdataset_tar(tmp_path / "cc-00000.tar", ["0000", "0001", "0002"])
    damaged = tmp_path / "cc-00001.tar"
    write_webdataset_tar(damaged, ["1000", "1001", "1002"])
    os.truncate(damaged, cut_points(damaged)["inside an image"])
    result = shard(webdataset_spec(write_spec, "cc-{00000..00001}.tar", on_error="skip"), progress=False)
    assert result.errors == 1
    assert sorted(row["source_id"] for row in manifest_rows(result)) == [
        "cc-00000.tar/0000", "cc-00000.tar/0001", "cc-00000.tar/0002", "cc-00001.tar/1000", "cc-00001.tar/1001"]
    errors = json.loads((result.path / "errors.json").read_text())
    assert [error["source_id"] for error in errors] == ["cc-00001.tar"]
    assert errors[0]["reason"].startswith(f"{damaged} is not a readable tar")


def test_a_source_tar_cut_after_listing_is_not_read_short(write_spec, tmp_path):
    tar = tmp_path / "cc-00000.tar"
    write_webdataset_tar(tar, ["0000", "0001", "0002"])
    reader = open_source(load_spec(webdataset_spec(write_spec, "cc-00000.tar")))
    last = reader.entries()[-1]
    os.truncate(tar, cut_points(tar)["inside an image"])
    with pytest.raises(DataError, match="ends inside sample cc-00000.tar/0002"):
        reader.read(last)
