"""Every sample, every epoch: how the shard loader cuts an epoch between ranks and DataLoader workers."""

from __future__ import annotations

import io
import json
import tempfile
from collections import Counter
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
import webdataset as wds
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from PIL import Image

from repsim.data.loader import ShardPart, cut, make_loader, rebatched, span
from repsim.data.manifest import MANIFEST

pytestmark = pytest.mark.filterwarnings("ignore:This DataLoader will create")  # 3 workers on a 2-core machine
EPOCHS = settings(max_examples=8, deadline=None, derandomize=True, database=None,
                  suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])


def write_tars(folder: Path, sizes: list[int]) -> list[str]:
    """Tars of ``sizes`` samples (4×4 gray PNGs, manifest indices 0, 1, ... in tar order) and their manifest."""
    png = io.BytesIO()
    Image.fromarray(np.zeros((4, 4), np.uint8)).save(png, "PNG")
    tars, shard_of = [], []
    for number, size in enumerate(sizes):
        tars.append(str(folder / f"train-{number:05d}.tar"))
        with wds.TarWriter(tars[-1]) as sink:
            for _ in range(size):
                index = len(shard_of)
                sink.write({"__key__": f"{index:06d}", "png": png.getvalue(), "json": json.dumps({"index": index})})
                shard_of.append(Path(tars[-1]).name)
    pq.write_table(pa.table({"shard": shard_of}), folder / MANIFEST)
    return tars


def epoch_per_rank(tars: list[str], batch_size: int, world_size: int, **options) -> list[tuple[int, list[list[int]]]]:
    """Per rank: (len(loader), the manifest indices of each batch of one epoch)."""
    loaders = [make_loader(tars, "eval", batch_size, image_size=4, channels=1, rank=rank, world_size=world_size,
                           **options) for rank in range(world_size)]
    return [(len(loader), [batch["index"].tolist() for batch in loader]) for loader in loaders]


@pytest.mark.parametrize("world_size", [1, 2])
@pytest.mark.parametrize("num_workers", [0, 1, 2, 3])
@EPOCHS
@given(sizes=st.lists(st.integers(1, 13), min_size=1, max_size=6), batch_size=st.integers(1, 8),
       shuffle=st.booleans(), drop_last=st.booleans(), epoch=st.integers(0, 99), augment=st.sampled_from(["sample", "batch"]))
def test_an_epoch_yields_every_sample_once_but_less_than_a_batch_per_rank(num_workers, world_size, sizes, batch_size,
                                                                        shuffle, drop_last, epoch, augment):
    with tempfile.TemporaryDirectory() as folder:
        ranks = epoch_per_rank(write_tars(Path(folder), sizes), batch_size, world_size, num_workers=num_workers,
                               shuffle=shuffle, drop_last=drop_last, epoch=epoch, augment=augment)
    seen = Counter(index for _, batches in ranks for batch in batches for index in batch)
    assert set(seen.values()) <= {1}, "a sample came twice in one epoch"
    assert set(seen) <= set(range(sum(sizes)))
    assert sum(sizes) - len(seen) < (world_size * batch_size if drop_last else 1)
    assert all(length == len(batches) for length, batches in ranks)
    counts = {len(batches) for _, batches in ranks}
    assert len(counts) == 1 if drop_last else max(counts) - min(counts) <= 1
    whole = [batch for _, batches in ranks for batch in (batches if drop_last else batches[:-1])]
    assert all(len(batch) == batch_size for batch in whole), "a partial batch before a rank's last"


@pytest.mark.parametrize("num_workers", [0, 1, 2, 3])
def test_four_tars_of_32_give_four_batches_of_32_with_any_workers(tmp_path, num_workers):
    tars = write_tars(tmp_path, [32] * 4)
    [(length, batches)] = epoch_per_rank(tars, 32, 1, num_workers=num_workers, shuffle=True, drop_last=True)
    assert length == len(batches) == 4 and sorted(i for batch in batches for i in batch) == list(range(128))


def test_spans_are_even_contiguous_shares():
    assert [span(0, 10, 3, piece) for piece in range(3)] == [(0, 3), (3, 6), (6, 10)]
    assert [span(5, 13, 2, piece) for piece in range(2)] == [(5, 9), (9, 13)]
    assert [span(0, 2, 3, piece) for piece in range(3)] == [(0, 0), (0, 1), (1, 2)]


def test_the_partial_last_batches_of_workers_are_joined_into_whole_ones():
    def batch(*indices: int) -> dict:
        values = torch.tensor(indices)
        return {"views": [values[:, None], -values[:, None]], "index": values, "caption": [str(i) for i in indices]}

    workers = [batch(0, 1, 2), batch(3, 4), batch(5, 6, 7), batch(8), batch(9, 10)]
    for drop_last, sizes in ((False, [3, 3, 3, 2]), (True, [3, 3, 3])):
        batches = list(rebatched(iter(workers), 3, drop_last))
        assert [len(b["index"]) for b in batches] == sizes
        assert sorted(i for b in batches for i in b["index"].tolist()) == list(range(sum(sizes)))
        for b in batches:
            assert torch.equal(b["views"][0][:, 0], b["index"]) and torch.equal(b["views"][1][:, 0], -b["index"])
            assert b["caption"] == [str(i) for i in b["index"].tolist()]


def test_partial_batches_of_images_of_other_sizes_are_joined_at_the_size_of_the_first():
    first, second = torch.zeros(1, 1, 4, 6, dtype=torch.uint8), torch.full((1, 1, 8, 8), 9, dtype=torch.uint8)
    workers = [{"images": first, "index": torch.tensor([0])}, {"images": second, "index": torch.tensor([1])}]
    [batch] = rebatched(iter(workers), 2, True)
    assert batch["images"].shape == (2, 1, 4, 6) and batch["images"][1].eq(9).all()


def test_cutting_parts_keeps_the_samples_of_a_span_and_reads_to_the_end_where_a_part_ends_in_it():
    parts = [ShardPart("a.tar", 5), ShardPart("b.tar", 3), ShardPart("c.tar", 4)]
    assert cut(parts, 3, 9) == [ShardPart("a.tar", 5, 3), ShardPart("b.tar", 3), ShardPart("c.tar", 4, 0, 1)]
    assert cut(parts, 5, 8) == [ShardPart("b.tar", 3)]
    assert cut(parts, 6, 6) == []
