"""The shard loader over real shard-stage output: batch format, pixels, coverage, determinism, DDP splits."""

from __future__ import annotations

import os
import shutil
from collections import Counter
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch
from PIL import Image

from repsim.data.augment import make_views
from repsim.data.loader import make_loader, read_samples
from repsim.data.stage import ShardResult, shard
from repsim.errors import DataError

CLASSES = {"cat": "cat.n.01", "dog": "dog.n.01"}
PLAIN = {"mean": 0.0, "std": 1.0}  # eval views equal to pixels / 255


def shard_folder(write_spec, folder: Path, tmp_path: Path, **spec) -> ShardResult:
    """Shard an image folder into ``train`` (80%, tars of 4) and ``test`` (20%, one tar)."""
    path = write_spec({"name": "tiny", "source": {"type": "image_folder", "root": str(folder)}, "classes": CLASSES,
                       "split": {"type": "random", "fractions": {"train": 0.8, "test": 0.2}}, "shard_size": 4,
                       **spec}, name=f"{folder.name}.yaml")
    return shard(path, out_dir=tmp_path / f"{folder.name}-shards", progress=False)


@pytest.fixture
def gray(make_image_folder, write_spec, tmp_path) -> ShardResult:
    """40 grayscale 12×12 images: 32 train samples in 8 tars, 8 test samples in 2 tars."""
    return shard_folder(write_spec, make_image_folder({"cat": 20, "dog": 20}, size=12), tmp_path)


def manifest(result: ShardResult, split: str) -> list[dict]:
    return [row for row in pq.read_table(result.manifest).to_pylist() if row["split"] == split]


def indices(batches: list[dict]) -> list[int]:
    return [i for batch in batches for i in batch["index"].tolist()]


def same_batches(first: list[dict], second: list[dict]) -> bool:
    return len(first) == len(second) and all(
        torch.equal(a["index"], b["index"]) and all(torch.equal(x, y) for x, y in zip(a["views"], b["views"]))
        for a, b in zip(first, second))


def test_batches_hold_views_labels_indices_and_captions(gray):
    loader = make_loader(gray.path, "simclr", 8, with_captions=True)
    batches = list(loader)
    assert len(batches) == len(loader) == 4
    rows = {row["index"]: row for row in manifest(gray, "train")}
    for batch in batches:
        assert [(tuple(v.shape), v.dtype) for v in batch["views"]] == [((8, 1, 12, 12), torch.float32)] * 2
        assert batch["label"].dtype == batch["index"].dtype == torch.long
        assert batch["label"].tolist() == [rows[i]["label"] for i in batch["index"].tolist()]
        assert batch["caption"] == [rows[i]["caption"] for i in batch["index"].tolist()]
        assert not torch.equal(batch["views"][0], batch["views"][1])
    assert "caption" not in next(iter(make_loader(gray.path, "eval", 8)))


def test_multicrop_batches_stack_each_view_position(gray):
    batch = next(iter(make_loader(gray.path, "multicrop", 4, preset_options={"local_crops": 3})))
    assert [tuple(v.shape) for v in batch["views"]] == [(4, 1, 12, 12)] * 2 + [(4, 1, 5, 5)] * 3


@pytest.mark.parametrize("mode", ["L", "RGB"])
def test_decoded_pixels_equal_the_source_images(make_image_folder, write_spec, tmp_path, mode):
    folder = make_image_folder({"cat": 3, "dog": 3}, mode=mode, size=10, name=f"images-{mode}")
    result = shard_folder(write_spec, folder, tmp_path)
    rows = pq.read_table(result.manifest).to_pylist()
    for split in ("train", "test"):
        for batch in make_loader(result.path, "eval", 4, split=split, preset_options=PLAIN):
            for view, index in zip(batch["views"][0], batch["index"].tolist()):
                pixels = np.array(Image.open(folder / rows[index]["source_id"]))
                expected = torch.from_numpy(pixels[None] if mode == "L" else pixels.transpose(2, 0, 1).copy())
                assert torch.equal((view * 255).round().to(torch.uint8), expected)


@pytest.mark.parametrize("split", ["train", "test"])
def test_an_eval_pass_yields_every_sample_once_in_manifest_order(gray, split):
    loader = make_loader(gray.path, "eval", 3, split=split, shuffle=False)
    batches = list(loader)
    rows = manifest(gray, split)
    assert len(batches) == len(loader) == -(-len(rows) // 3)
    assert indices(batches) == [row["index"] for row in rows]
    assert [label for batch in batches for label in batch["label"].tolist()] == [row["label"] for row in rows]


def test_the_same_seed_and_epoch_give_identical_batches(gray):
    first = list(make_loader(gray.path, "simclr", 8, seed=3, epoch=2))
    loader = make_loader(gray.path, "simclr", 8, seed=3, epoch=2)
    assert same_batches(first, list(loader))
    loader.set_epoch(2)
    assert same_batches(first, list(loader))
    assert not same_batches(first, list(make_loader(gray.path, "simclr", 8, seed=4, epoch=2)))


def test_each_pass_advances_the_epoch_and_reshuffles(gray):
    loader = make_loader(gray.path, "eval", 32, seed=0)
    first, second = (indices(list(loader)) for _ in range(2))
    assert loader.epoch == 2
    assert first != second and sorted(first) == sorted(second)


def test_the_global_torch_rng_and_thread_count_are_left_alone(gray):
    state, threads = torch.get_rng_state(), torch.get_num_threads()
    list(make_loader(gray.path, "simclr", 8))
    assert torch.equal(state, torch.get_rng_state()) and torch.get_num_threads() == threads


@pytest.mark.parametrize(("split", "world_size", "num_workers"),
                         [("train", 2, 0), ("train", 3, 0), ("test", 2, 0), ("test", 3, 0), ("train", 2, 2)])
def test_ranks_get_disjoint_subsets_that_cover_the_split(gray, split, world_size, num_workers):
    per_rank = [indices(list(make_loader(gray.path, "eval", 2, split=split, rank=rank, world_size=world_size,
                                         num_workers=num_workers, shuffle=True, drop_last=False)))
                for rank in range(world_size)]
    counts = Counter(i for rank in per_rank for i in rank)
    assert sorted(counts) == [row["index"] for row in manifest(gray, split)]
    assert set(counts.values()) == {1}


def test_ranks_read_disjoint_shards_when_there_are_enough(gray):
    shard_of = {row["index"]: row["shard"] for row in manifest(gray, "train")}
    shards = [{shard_of[i] for i in indices(list(make_loader(gray.path, "eval", 2, rank=rank, world_size=4,
                                                             drop_last=False)))}
              for rank in range(4)]
    assert [len(s) for s in shards] == [2] * 4 and len(set.union(*shards)) == 8


def test_with_drop_last_every_rank_yields_len_full_batches(gray):
    loaders = [make_loader(gray.path, "eval", 3, rank=rank, world_size=3, num_workers=0) for rank in range(3)]
    for _ in range(3):  # three epochs, shards in three orders
        for loader in loaders:
            batches = list(loader)
            assert len(batches) == len(loaders[0]) > 0
            assert all(len(batch["index"]) == 3 for batch in batches)


def test_workers_share_the_samples_and_keep_each_samples_views(gray):
    single = {i: batch["views"][0][k] for batch in make_loader(gray.path, "simclr", 4, shuffle=False)
              for k, i in enumerate(batch["index"].tolist())}
    loader = make_loader(gray.path, "simclr", 4, shuffle=False, num_workers=2)
    batches = list(loader)
    assert len(batches) == len(loader)
    assert sorted(indices(batches)) == sorted(single)
    for batch in batches:
        for k, i in enumerate(batch["index"].tolist()):
            assert torch.equal(batch["views"][0][k], single[i])


def test_unlabelled_samples_get_label_minus_one(tmp_path, write_spec, make_image_folder):
    folder = make_image_folder({"any": 4}, name="unlabelled")
    table = "path,caption\n" + "".join(f"any/any-{i}.png,picture {i}\n" for i in range(4))
    (folder / "manifest.csv").write_text(table)
    path = write_spec({"name": "unlabelled", "source": {"type": "manifest", "path": str(folder / "manifest.csv")},
                       "split": {"type": "random", "fractions": {"train": 1.0}, "stratify": False}})
    result = shard(path, out_dir=tmp_path / "unlabelled-shards", progress=False)
    batch = next(iter(make_loader(result.path, "eval", 4, with_captions=True, drop_last=False)))
    assert batch["label"].tolist() == [-1] * 4
    assert sorted(batch["caption"]) == [f"picture {i}" for i in range(4)]


def test_shards_can_be_a_result_a_list_of_tars_or_a_brace_pattern(gray):
    expected = indices(list(make_loader(gray.path, "eval", 5, split="test")))
    tars = [str(path) for path in gray.shards["test"]]
    pattern = str(gray.path / "test-{00000..00001}.tar")
    for shards in (gray, tars, pattern):
        loader = make_loader(shards, "eval", 5, split="test")
        assert indices(list(loader)) == expected and len(loader) == 2


def test_a_ready_made_views_object_is_used_as_is(gray):
    batch = next(iter(make_loader(gray.path, make_views("eval", 6, 1), 4, split="test")))
    assert batch["views"][0].shape == (4, 1, 6, 6)


def test_a_missing_split_names_the_splits_there_are(gray):
    with pytest.raises(DataError, match="no shards of split 'val'.*test, train"):
        make_loader(gray.path, "eval", 4, split="val")


def test_without_a_manifest_one_reader_gets_the_batches_but_no_length_and_more_are_refused(gray, tmp_path):
    tar = tmp_path / "elsewhere" / "train-00000.tar"
    tar.parent.mkdir()
    tar.write_bytes(gray.shards["train"][0].read_bytes())
    loader = make_loader([tar], "eval", 2)
    assert len(indices(list(loader))) == 4
    with pytest.raises(TypeError, match="number of batches is unknown without manifest.parquet"):
        len(loader)
    with pytest.raises(DataError, match="between 1 rank.* and 2 worker.*needs each tar's sample count"):
        make_loader([tar], "eval", 2, num_workers=2)


def test_truncated_or_corrupt_tars_are_reported(gray, tmp_path):
    original = gray.shards["test"][0].read_bytes()
    broken = {"cut": original[:1024], "cut_in_member": original[:1000],
              "flipped": original[:10] + b"X" + original[11:]}
    for name, data in broken.items():
        (tmp_path / name).write_bytes(data)
        with pytest.raises(DataError, match="is not a readable tar|holds 1 samples but its manifest lists"):
            list(read_samples(str(tmp_path / name), gray.splits["test"]))


@pytest.mark.parametrize("augment", ["sample", "batch"])
def test_a_damaged_shard_is_the_same_one_line_error_with_or_without_workers(gray, tmp_path, augment):
    copy = tmp_path / "copy"
    shutil.copytree(gray.path, copy)
    tar = sorted(copy.glob("test-*.tar"))[0]
    os.truncate(tar, tar.stat().st_size // 2 // 512 * 512)  # cut at a block boundary after its first sample
    messages = []
    for workers in (0, 2):
        loader = make_loader(copy, "simclr", 4, split="test", num_workers=workers, augment=augment)
        with pytest.raises(DataError) as raised:
            list(loader)
        messages.append(str(raised.value))
    assert messages[0] == messages[1] and "\n" not in messages[1]
    assert messages[1].startswith(f"{tar} holds ") and "but its manifest lists" in messages[1]
