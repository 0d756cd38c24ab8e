"""The align stage on a small Animal-MNIST subset (4 classes × 40 silhouettes, 128 train / 32 test):
embedding tables, captions, pairing, neighbors, training, scores, caching, config errors and the CLI."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from animals import CLASSES, animal_shards
from bounded import memory_mapped, peak_traced
import torch

from repsim.align.config import AlignConfig, load_align_config
from repsim.align.pairing import NEIGHBOUR_FILES, Pairing, draw_pairing, neighbor_lists
from repsim.align.stage import LOSS_PLOT_FILE, RESULTS_FILE, align, align_scores, align_stage_of
from repsim.align import tables as tables_module
from repsim.align.tables import class_captions, embedding_tables, hold_out, load_tables
from repsim.align.method import PairedBatches, load_alignment
from repsim.flows.cli import main
from repsim.data.stage import ShardResult
from repsim.data.spec import load_spec
from repsim.errors import DataError, EvalError, SpecError

REPO = Path(__file__).resolve().parents[1]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def animals(tmp_path_factory) -> tuple[Path, ShardResult]:
    return animal_shards(tmp_path_factory.mktemp("animals"), shard_size=64)


def tiny_config(spec: Path, **sections: dict) -> AlignConfig:
    values = {"data": {"spec": str(spec)}, "image": {"type": "pixels"},
              "pairing": {"pairs": 32, "seed": 1}, "neighbors": {"count": 20},
              "geometry": {"alpha": 1.0, "samples": 4}, "model": {"dim": 32},
              "optim": {"batch_size": 16, "epochs": 3, "warmup_epochs": 1, "lr": 0.003, "precision": "fp32"},
              "asif": {"k": 16}}
    for section, update in sections.items():
        values[section] = {**values.get(section, {}), **update}
    return AlignConfig.model_validate(values)


# ---------------------------------------------------------------------------------------------
# Pairing and neighbors

def test_pairing_is_seeded_and_disjoint():
    first, again, other = draw_pairing(100, 10, seed=3), draw_pairing(100, 10, seed=3), draw_pairing(100, 10, seed=4)
    np.testing.assert_array_equal(first.paired, again.paired)
    np.testing.assert_array_equal(first.unpaired_text, again.unpaired_text)
    assert not np.array_equal(first.paired, other.paired)
    assert len(first.paired) == 10 and len(np.unique(first.paired)) == 10
    for pool in (first.unpaired_image, first.unpaired_text):
        assert len(pool) == 90 and not np.intersect1d(pool, first.paired).size


def test_unpaired_pools_are_drawn_independently_per_modality():
    pairing = draw_pairing(1000, 50, unpaired=300, seed=0)
    assert len(pairing.unpaired_image) == len(pairing.unpaired_text) == 300
    shared = np.intersect1d(pairing.unpaired_image, pairing.unpaired_text).size
    assert 60 < shared < 140  # about 300 · 300 / 950 ≈ 95 by chance, not all 300


def test_pairing_round_trips_through_its_files(tmp_path):
    pairing = draw_pairing(50, 5, seed=2)
    pairing.save(tmp_path)
    loaded = Pairing.load(tmp_path)
    for name in ("paired", "unpaired_image", "unpaired_text"):
        np.testing.assert_array_equal(getattr(loaded, name), getattr(pairing, name))


def test_neighbors_come_from_the_pool_nearest_first():
    points = np.random.default_rng(0).standard_normal((60, 5)).astype(np.float32)
    paired, pool = np.arange(5), np.arange(20, 60)
    ids = neighbor_lists(points, paired, pool, 7)
    unit = points / np.linalg.norm(points, axis=1, keepdims=True)
    expected = pool[np.argsort(-(unit[paired] @ unit[pool].T), axis=1)[:, :7]]
    np.testing.assert_array_equal(ids, expected)


def test_batches_hold_each_paired_point_first_with_its_sampled_neighbors():
    image, text = np.arange(30.0)[:, None].repeat(3, 1), np.arange(30.0)[:, None].repeat(2, 1) + 100
    paired = np.array([0, 1, 2, 3, 4])
    neighbors = np.arange(5, 30).reshape(5, 5)
    config = tiny_config(Path("spec.yaml"), geometry={"samples": 3})
    batches = PairedBatches(image, text, paired, neighbors, neighbors, config.geometry, batch_size=2, seed=0)
    epoch = list(batches)
    assert len(batches) == len(epoch) == 3 and [len(batch["x"]) for batch in epoch] == [2, 2, 1]
    x = torch.cat([batch["x"] for batch in epoch])
    y = torch.cat([batch["y"] for batch in epoch])
    assert x.shape == (5, 4, 3) and y.shape == (5, 4, 2)
    assert sorted(x[:, 0, 0].long().tolist()) == paired.tolist()
    torch.testing.assert_close(y[:, 0, 0] - 100, x[:, 0, 0])  # the pair is the same row in both tables
    for hood in x[:, :, 0].long():
        assert set(hood[1:].tolist()) <= set(neighbors[hood[0]].tolist())
    batches.set_epoch(0)
    torch.testing.assert_close(next(iter(batches))["x"], epoch[0]["x"])  # an epoch replays identically


# ---------------------------------------------------------------------------------------------
# Captions and tables

def test_class_captions_vary_over_lemmas_gloss_and_hypernym():
    captions = class_captions("dog", "dog.n.01", ("a photo of a {name}.",))
    assert "a photo of a dog." in captions and "a photo of a domestic dog." in captions
    assert "a photo of a dog, a kind of canine." in captions  # of canine.n.02 and domestic_animal.n.01
    assert any("member of the genus Canis" in caption for caption in captions)
    assert class_captions("dog", "dog.n.01", ("a {name}.",), lemmas=False, gloss=False, hypernym=False) == ["a dog."]


def test_tables_are_keyed_like_the_manifest_with_varied_seeded_captions(animals):
    spec, shards = animals
    config = tiny_config(spec)
    tables = load_tables(embedding_tables(shards, load_spec(spec), config.image, config.text, "train", progress=False))
    manifest = pq.read_table(shards.manifest).to_pandas().query("split == 'train'").sort_values("index")
    assert tables.keys.to_pylist() == manifest["key"].tolist()
    np.testing.assert_array_equal(tables.labels, manifest["label"].to_numpy())
    assert tables.image.shape == (128, 28 * 28) and tables.text.shape == (128, 384)
    assert len(set(tables.captions.to_pylist())) > 4 * 3  # not one caption per class
    for caption, label in zip(tables.captions.to_pylist(), tables.labels):
        assert caption in class_captions(list(CLASSES)[label], list(CLASSES.values())[label],
                                         ("a photo of a {name}.", "a silhouette of a {name}."))


def _artifact(stage: str, key: str) -> Path:
    from repsim.stage import artifacts_root

    return artifacts_root() / stage / key


# ---------------------------------------------------------------------------------------------
# The stage

def test_align_stage_runs_scores_and_is_cached(animals):
    spec, shards = animals
    config = tiny_config(spec)
    logged = []
    output = align(config, shards=shards, progress=False, log=lambda metrics, step: logged.append(step))
    assert not output.cached and output.key == align_stage_of(config, shards).key
    results = json.loads((output.path / RESULTS_FILE).read_text())
    for suites in (results["suites"], results["baselines"]["asif"]["suites"]):
        assert set(suites) == {"zeroshot", "retrieval"}
        assert 0 <= suites["zeroshot"]["zeroshot_top1"] <= suites["zeroshot"]["zeroshot_top5"] == 1.0  # 4 classes
        assert set(suites["retrieval"]) == {f"{d}_r{k}" for d in ("i2t", "t2i") for k in (1, 5, 10)}
    assert results["samples"] == {"paired": 32, "unpaired_image": 96, "unpaired_text": 96, "test": 32}
    assert output.metrics["steps"] == 3 * 2 and sorted(set(logged)) == list(range(1, 7))
    assert {"zeroshot_top1", "i2t_r1", "asif_zeroshot_top1", "asif_t2i_r10", "loss"} <= set(output.metrics)
    assert {name: output.metrics[f"{name}_samples"] for name in results["samples"]} == results["samples"]
    assert align_scores(output) == {name: value for name, value in output.metrics.items()
                                    if name.startswith(("zeroshot", "i2t", "t2i", "asif_")) or name.endswith("_samples")}
    pairing = Pairing.load(output.path)
    np.testing.assert_array_equal(pairing.paired, draw_pairing(128, 32, seed=1).paired)
    assert np.load(output.path / NEIGHBOUR_FILES["image"]).shape == (32, 20)
    assert np.isin(np.load(output.path / NEIGHBOUR_FILES["text"]), pairing.unpaired_text).all()
    f, g = load_alignment(output.path)
    assert f(torch.zeros(2, 784)).shape == g(torch.zeros(2, 384)).shape == (2, 32)
    assert (output.path / LOSS_PLOT_FILE).read_bytes().startswith(PNG_MAGIC)
    again = align(config, shards=shards, progress=False)
    assert again.cached and again.path == output.path
    other = align_stage_of(tiny_config(spec, pairing={"pairs": 32, "seed": 2}), shards)
    assert other.key != output.key
    assert align_stage_of(tiny_config(spec, optim={"num_workers": 3}), shards).key == output.key


def test_alpha_zero_is_contrastive_alone_with_the_geometry_still_reported(animals):
    spec, shards = animals
    gera = align(tiny_config(spec), shards=shards, progress=False)
    contrastive = align(tiny_config(spec, geometry={"alpha": 0.0}), shards=shards, progress=False)
    assert gera.key != contrastive.key
    records = [json.loads(line) for line in (contrastive.path / "metrics.jsonl").read_text().splitlines()]
    steps = [record for record in records if "loss" in record]
    assert all(record["loss"] == pytest.approx(record["contrastive"]) and record["geo_a"] > 0 for record in steps)


def test_holdout_scores_a_seeded_part_of_the_train_split_instead_of_the_test_split(animals):
    spec, shards = animals
    config = tiny_config(spec, data={"holdout": 0.25}, optim={"epochs": 1})
    tables = load_tables(embedding_tables(shards, load_spec(spec), config.image, config.text, "train", progress=False))
    kept, held = hold_out(tables, 0.25)
    assert (len(kept.indices), len(held.indices)) == (96, 32)
    assert sorted([*kept.indices, *held.indices]) == sorted(tables.indices)
    np.testing.assert_array_equal(hold_out(tables, 0.25)[1].indices, held.indices)
    row = tables.keys.to_pylist().index(held.keys[5].as_py())
    np.testing.assert_array_equal(held.image[5], tables.image[row])
    assert (held.captions[5], held.labels[5], held.indices[5]) == (tables.captions[row], tables.labels[row],
                                                                  tables.indices[row])
    output = align(config, shards=shards, progress=False)
    samples = json.loads((output.path / RESULTS_FILE).read_text())["samples"]
    assert samples == {"paired": 32, "unpaired_image": 64, "unpaired_text": 64, "test": 32}
    assert output.key != align_stage_of(tiny_config(spec, optim={"epochs": 1}), shards).key


# ---------------------------------------------------------------------------------------------
# Mistakes

@pytest.mark.parametrize("sections, error, message", [
    ({"pairing": {"pairs": 500}}, SpecError, "pairing.pairs is 500 but the training split holds 128 samples"),
    ({"pairing": {"pairs": 100}, "neighbors": {"count": 50}}, SpecError,
     r"neighbors.count \(L = 50\) exceeds the 28 unpaired points"),
])
def test_impossible_sizes_fail_in_one_line(animals, sections, error, message):
    spec, shards = animals
    with pytest.raises(error, match=message) as raised:
        align(tiny_config(spec, **sections), shards=shards, progress=False)
    assert "\n" not in str(raised.value)


def test_tables_are_copied_and_read_memory_mapped_a_chunk_at_a_time(tmp_path, monkeypatch):
    source = memory_mapped(np.random.default_rng(0).standard_normal((4000, 64)).astype(np.float32),
                           tmp_path / "features.npy")
    monkeypatch.setattr(tables_module, "COPY_ROWS", 250)
    rows = np.arange(0, 4000, 2)
    peak = peak_traced(lambda: tables_module._copy_rows(source, rows, tmp_path / "image.npy", "image embeddings"))
    assert peak <= source.nbytes / 4  # gathering the 2,000 rows at once takes nbytes / 2
    copied = np.load(tmp_path / "image.npy", mmap_mode="r")
    np.testing.assert_array_equal(copied, source[rows])


def test_user_tables_with_nan_or_missing_rows_fail_in_one_line(animals, tmp_path):
    spec, shards = animals
    manifest = pq.read_table(shards.manifest, columns=["index", "split"]).to_pandas()
    embeddings = np.random.default_rng(0).standard_normal((len(manifest), 8)).astype(np.float32)
    embeddings[manifest.query("split == 'train'")["index"].iloc[3]] = np.nan
    np.save(tmp_path / "nan.npy", embeddings)
    np.save(tmp_path / "short.npy", embeddings[:10])
    for name, error, message in (("short.npy", DataError, "needs row"),
                                 ("nan.npy", EvalError, "image embeddings hold NaN or infinite values \\(first: row 3\\)")):
        config = tiny_config(spec, image={"type": "table", "path": str(tmp_path / name)})
        with pytest.raises(error, match=message) as raised:
            align(config, shards=shards, progress=False)
        assert "\n" not in str(raised.value)


def test_user_parquet_table_is_read_by_manifest_key(animals, tmp_path):
    spec, shards = animals
    manifest = pq.read_table(shards.manifest, columns=["key", "index"]).to_pandas()
    embeddings = np.random.default_rng(0).standard_normal((len(manifest), 6)).astype(np.float32)
    shuffled = manifest.sample(frac=1.0, random_state=0)
    pq.write_table(pa.table({"key": shuffled["key"].tolist(),
                             "embedding": embeddings[shuffled["index"].to_numpy()].tolist()}), tmp_path / "e.parquet")
    output = align(tiny_config(spec, image={"type": "table", "path": str(tmp_path / "e.parquet")},
                               optim={"epochs": 1}), shards=shards, progress=False)
    tables = load_tables(_artifact("embedding_tables", output.record["inputs"]["train_tables"]))
    np.testing.assert_allclose(tables.image, embeddings[tables.indices])


@pytest.mark.parametrize("overrides, message", [
    (["geometry.samples=300"], r"geometry.samples \(n = 300\) exceeds neighbors.count \(L = 200\)"),
    (["geometry.kernel=knn"], "kernel knn passes no gradient"),
    (["geometry.strategy=farthest"], "geometry.strategy"),
    (["pairing.pair=3"], "unknown field 'pairing.pair'; did you mean 'pairs'?"),
])
def test_config_mistakes_are_one_line_naming_the_field(overrides, message):
    with pytest.raises(SpecError, match=message) as raised:
        load_align_config(REPO / "configs" / "gera.yaml", overrides)
    assert "\n" not in str(raised.value)


def test_shipped_configs_differ_only_in_alpha():
    gera, contrastive = (load_align_config(REPO / "configs" / name) for name in ("gera.yaml", "align_contrastive.yaml"))
    assert gera.geometry.alpha > 0 and contrastive.geometry.alpha == 0
    assert gera.model_copy(update={"geometry": contrastive.geometry}) == contrastive


def test_cli_reports_a_config_mistake_in_one_line(capsys):
    assert main(["align", str(REPO / "configs" / "gera.yaml"), "--set", "geometry.samples=300"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1
