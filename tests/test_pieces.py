"""Split stages: pieces on any executor give the same bytes as one process (shard, features, the kNN of
evaluate), a stopped stage resumes with the pieces left (kept ones verified), and a damaged kept piece is
built again."""

from __future__ import annotations

import concurrent.futures
import json
import multiprocessing
import os
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch

from repsim.data import load_spec, shard
from repsim.data import stage as shard_module
from repsim.data.stage import shard_stage
from repsim.errors import StageError
from repsim.eval import stage as evaluation_module
from repsim.eval.stage import evaluate_features, extract_features, read_results
from repsim.eval.knn import knn_metrics, knn_rankings
from repsim.models import resnet, save_encoder
from repsim.pieces import PIECE_FILE, Piece, run_pieces
from repsim.data.sources import open_source
from test_shard import CLASSES, cut_points, read_tar, webdataset_spec, write_webdataset_tar


def write_text(argument: str, folder: Path) -> int:
    (folder / "out.txt").write_text(argument)
    return len(argument)


def test_pieces_keep_their_order_and_an_intact_piece_is_kept_while_a_damaged_one_is_rebuilt(tmp_path):
    pieces = [Piece(f"p{i}", "x" * i) for i in range(5)]
    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        first = run_pieces(write_text, pieces, tmp_path, pool, progress=False)
    assert [result.summary for result in first] == [0, 1, 2, 3, 4] and not any(result.kept for result in first)
    (tmp_path / "p3" / "out.txt").write_text("yyy")  # same size, other bytes: only the digest tells
    again = run_pieces(write_text, pieces, tmp_path, progress=False)
    assert [result.kept for result in again] == [True, True, True, False, True]
    assert (tmp_path / "p3" / "out.txt").read_text() == "xxx"


def test_a_cancelled_piece_is_one_line_that_keeps_the_pieces_done(tmp_path):
    class Losing(concurrent.futures.Executor):  # a cluster that runs two pieces, then goes away
        submitted = 0

        def submit(self, fn, *args):
            self.submitted += 1
            future = concurrent.futures.Future()
            if self.submitted <= 2:
                future.set_result(fn(*args))
            else:
                future.cancel()
                future.set_running_or_notify_cancel()
            return future

    pieces = [Piece(f"p{i}", str(i)) for i in range(4)]
    with pytest.raises(StageError) as err:
        run_pieces(write_text, pieces, tmp_path, Losing(), desc="shard demo", progress=False)
    assert "\n" not in str(err.value) and "shard demo: the executor lost its pieces" in str(err.value)
    assert sorted(path.parent.name for path in tmp_path.glob(f"*/{PIECE_FILE}")) == ["p0", "p1"]
    assert [result.kept for result in run_pieces(write_text, pieces, tmp_path, progress=False)] == [True, True, False, False]


@pytest.fixture
def damaged_folder_spec(make_image_folder, write_spec):
    """24 images in tars of 3 under ``on_error: skip``, the second image unreadable: every later tar is renumbered."""
    root = make_image_folder({"cat": 12, "dog": 12})
    (root / "cat" / "cat-1.png").write_bytes(b"not a png")
    return load_spec(write_spec({"name": "pets", "source": {"type": "image_folder", "root": str(root)}, "classes": CLASSES,
                                 "shard_size": 3, "on_error": "skip", "split": {"type": "random", "fractions": {
                                     "train": 0.75, "test": 0.25}}}))


def output_bytes(path: Path) -> dict[str, bytes]:
    return {file.name: file.read_bytes() for file in sorted(path.iterdir()) if file.name != "stage.json"}


def test_three_workers_write_the_bytes_of_one_process_and_indexes_stay_dense_after_a_skip(damaged_folder_spec, tmp_path):
    alone = shard(damaged_folder_spec, out_dir=tmp_path / "alone", progress=False)
    with concurrent.futures.ProcessPoolExecutor(3) as pool:
        spread = shard(damaged_folder_spec, out_dir=tmp_path / "spread", progress=False, executor=pool)
    assert spread.key == alone.key and output_bytes(spread.path) == output_bytes(alone.path)
    manifest = pq.read_table(alone.manifest).to_pylist()
    assert [row["index"] for row in manifest] == list(range(23)) and alone.errors == 1
    for tar in sorted(alone.path.glob("*.tar")):
        for key, members in read_tar(tar).items():
            row = manifest[int(key)]
            assert (row["key"], row["shard"]) == (key, tar.name)
            assert json.loads(members["json"])["index"] == int(key)


def test_a_stage_stopped_after_k_pieces_resumes_with_the_rest_under_the_same_key(damaged_folder_spec, tmp_path,
                                                                                   monkeypatch):
    clean = shard(damaged_folder_spec, out_dir=tmp_path / "clean", progress=False)
    monkeypatch.setenv("REPSIM_HOME", str(tmp_path / "home"))
    written, real = [], shard_module.write_tar_piece

    def stop_after_three(piece, folder):
        if len(written) == 3:
            raise KeyboardInterrupt
        written.append(piece.first_index)
        return real(piece, folder)

    monkeypatch.setattr(shard_module, "write_tar_piece", stop_after_three)
    with pytest.raises(KeyboardInterrupt):
        shard(damaged_folder_spec, progress=False)
    scratch = tmp_path / "home" / "scratch" / "shard" / shard_stage(damaged_folder_spec).key
    assert len(list(scratch.glob(f"*/{PIECE_FILE}"))) == 3

    written.clear()
    monkeypatch.setattr(shard_module, "write_tar_piece", lambda piece, folder: written.append(1) or real(piece, folder))
    resumed = shard(damaged_folder_spec, progress=False)
    pieces = resumed_metrics(resumed.path)
    assert (len(written), pieces["pieces"], pieces["pieces_kept"]) == (5, 8, 3)
    assert resumed.key == clean.key and output_bytes(resumed.path) == output_bytes(clean.path)
    assert not scratch.exists()  # the pieces are in the output now


def without_timings(path: Path) -> dict:
    """The output files' bytes, with results.json's suites instead of its bytes (its ``seconds`` are timings)."""
    files = output_bytes(path)
    if "results.json" in files:
        files["results.json"] = json.loads(files["results.json"])["suites"]
    return files


def resumed_metrics(path: Path) -> dict:
    return json.loads((path / "stage.json").read_text())["metrics"]


@pytest.fixture
def small_tars_shards(make_image_folder, write_spec):
    """40 images in tars of 4 (5 train tars, 5 test tars), sharded."""
    root = make_image_folder({"cat": 20, "dog": 20})
    return shard(write_spec({"name": "pets", "source": {"type": "image_folder", "root": str(root)}, "classes": CLASSES,
                             "shard_size": 4, "split": {"type": "random", "fractions": {"train": 0.5, "test": 0.5}}}),
                 progress=False)


def test_features_and_knn_pieces_on_three_workers_write_the_bytes_of_one_process(small_tars_shards, tmp_path, monkeypatch):
    encoder = tmp_path / "encoder.pt"
    torch.manual_seed(0)
    save_encoder(resnet("resnet18", in_channels=1, small_images=True), encoder, image_size=8)
    monkeypatch.setattr(evaluation_module, "KNN_PIECE_QUERIES", 7)  # 20 test rows: pieces of 7, 7 and 6
    outputs = {}
    spawned = concurrent.futures.ProcessPoolExecutor(3, mp_context=multiprocessing.get_context("spawn"))  # torch: no fork
    for name, pool in (("alone", None), ("spread", spawned)):
        features = [extract_features(small_tars_shards, encoder, split, batch_size=3, progress=False, executor=pool,
                                     out_dir=tmp_path / name / split) for split in ("train", "test")]
        evaluated = evaluate_features(*features, ("knn",), (1, 3), executor=pool, out_dir=tmp_path / name / "evaluate")
        outputs[name] = [*features, evaluated]
        if pool is not None:
            pool.shutdown()
    for alone, spread in zip(outputs["alone"], outputs["spread"]):
        assert alone.key == spread.key
        assert without_timings(alone.path) == without_timings(spread.path)
    assert resumed_metrics(outputs["alone"][0].path)["pieces"] == 5
    whole = knn_rankings(*(np.load(outputs["alone"][0].path / name) for name in ("features.npy", "labels.npy")),
                         np.load(outputs["alone"][1].path / "features.npy"), (1, 3))
    assert read_results(outputs["alone"][2])["suites"]["knn"] == knn_metrics(whole, np.load(outputs["alone"][1].path /
                                                                                             "labels.npy"))


def test_a_source_of_tars_listed_on_workers_gives_the_listing_and_skips_of_one_process(write_spec, tmp_path):
    for number in range(3):
        write_webdataset_tar(tmp_path / f"cc-{number:05d}.tar", [f"{number}-{i:02d}" for i in range(5)])
    os.truncate(tmp_path / "cc-00001.tar", cut_points(tmp_path / "cc-00001.tar")["inside an image"])
    spec = load_spec(webdataset_spec(write_spec, str(tmp_path / "cc-{00000..00002}.tar"), on_error="skip"))
    alone = open_source(spec)
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        spread = open_source(spec)
        listing = spread.entries(pool)
    assert [listing[row] for row in range(len(listing))] == [alone.entries()[row] for row in range(len(alone.entries()))]
    assert spread.skipped == alone.skipped and len(alone.skipped) == 1 and len(listing) == 12
