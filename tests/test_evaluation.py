"""The evaluation stages: features of an encoder as a cached stage, the suites run on them, and
`repsim eval` through Prefect and MLflow."""

import argparse
import io
import json
import tarfile
import zipfile

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch
from mlflow.tracking import MlflowClient
from PIL import Image
from e2e import built_then_cached, logged_files, repsim

from repsim.flows.cli import build_parser, main
from repsim.data import make_loader, shard
from repsim.errors import EvalError
from repsim.eval import knn_accuracy, zero_shot_accuracy
from repsim.eval import stage as evaluation_module
from repsim.plots import matrix_plot
from repsim.eval.stage import (CONFUSION_FILE, FEATURES_FILE, HISTOGRAM_FILE, INDICES_FILE, LABELS_FILE,
                                    RESULTS_FILE, SUITES, TSNE_FILE, TextEncoder, evaluate, evaluate_features,
                                    extract_features, features_stage_of, load_features)
from repsim.models import resnet, save_encoder
from repsim.stage import Stage, run_stage

PETS = {"cat": "cat.n.01", "dog": "dog.n.01"}
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
FAST_SUITES = ("knn", "diagnostics")


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def pets_spec_of(make_image_folder, write_spec, per_class: int = 8, fractions=None, mode: str = "L"):
    root = make_image_folder({"cat": per_class, "dog": per_class}, mode=mode)
    return write_spec({"name": "pets", "source": {"type": "image_folder", "root": str(root)}, "classes": PETS,
                       "split": {"type": "random", "fractions": fractions or {"train": 0.5, "test": 0.5}}})


@pytest.fixture
def pets_spec(make_image_folder, write_spec):
    return pets_spec_of(make_image_folder, write_spec)


@pytest.fixture
def pets_shards(pets_spec):
    return shard(pets_spec, progress=False)


def tar_pixels(shards, split: str) -> dict[int, np.ndarray]:
    """Manifest index -> the sample's PNG decoded with PIL, as float32 (H, W) in [0, 255]."""
    pixels = {}
    for path in shards.shards[split]:
        with tarfile.open(path) as tar:
            members = {member.name: tar.extractfile(member).read() for member in tar.getmembers()}
        for name, data in members.items():
            if name.endswith(".json"):
                index = json.loads(data)["index"]
                png = members[name[:-len("json")] + "png"]
                pixels[index] = np.asarray(Image.open(io.BytesIO(png)), dtype=np.float32)
    return pixels


# ---------------------------------------------------------------------------------------------
# Features

def test_pixel_features_are_the_normalised_pixels_in_manifest_order(pets_shards):
    output = extract_features(pets_shards, "pixels", "test", batch_size=3, progress=False)
    features, labels, indices = (np.load(output.path / name) for name in (FEATURES_FILE, LABELS_FILE, INDICES_FILE))
    manifest = pq.read_table(pets_shards.manifest).to_pandas()
    test_rows = manifest[manifest["split"] == "test"].sort_values("index")
    np.testing.assert_array_equal(indices, test_rows["index"].to_numpy())
    np.testing.assert_array_equal(labels, test_rows["label"].to_numpy())
    pixels = tar_pixels(pets_shards, "test")
    expected = np.stack([(pixels[index] / 255 - 0.5) / 0.5 for index in indices]).reshape(len(indices), -1)
    assert features.dtype == np.float32 and features.shape == (8, 64)
    np.testing.assert_allclose(features, expected, atol=1e-6)
    assert output.stage == "features" and output.metrics["samples"] == 8 and output.metrics["dim"] == 64
    assert output.record["inputs"] == {"shards": pets_shards.key, "encoder": "pixels"}


def test_the_key_ignores_batch_size_but_not_the_view(pets_shards):
    first = extract_features(pets_shards, split="train", batch_size=2, progress=False)
    assert extract_features(pets_shards, split="train", batch_size=5, progress=False).cached
    scaled = extract_features(pets_shards, split="train", preset_options={"mean": 0.0, "std": 1.0}, progress=False)
    assert not scaled.cached and scaled.key != first.key
    np.testing.assert_allclose(np.load(scaled.path / FEATURES_FILE), (np.load(first.path / FEATURES_FILE) + 1) / 2,
                               atol=1e-6)


def test_a_saved_encoder_gives_its_outputs_on_the_eval_views(pets_shards, tmp_path):
    torch.manual_seed(0)
    encoder = resnet("resnet18", small_images=True, in_channels=1).eval()
    save_encoder(encoder, tmp_path / "encoder.pt", image_size=8)
    output = extract_features(pets_shards, tmp_path / "encoder.pt", "test", device="cpu", progress=False)
    batch = next(iter(make_loader(pets_shards, "eval", 64, split="test", shuffle=False)))
    with torch.no_grad():
        expected = encoder(batch["views"][0]).numpy()
    np.testing.assert_allclose(np.load(output.path / FEATURES_FILE), expected, rtol=1e-4, atol=1e-5)
    assert output.record["config"]["precision"] == "float32"


def test_a_train_stage_encoder_is_keyed_by_the_stage_and_sees_its_normalisation(pets_shards):
    def write(out):
        save_encoder(resnet("resnet18", small_images=True, in_channels=3), out / "encoder.pt", image_size=6)
    config = {"data": {"image_size": 6, "preset_options": {"mean": 0.0, "std": 1.0, "local_crops": 2}}}
    trained = run_stage(Stage("train", "test", config), write)
    output = extract_features(pets_shards, trained.path, "test", device="cpu", progress=False)
    assert output.record["inputs"]["encoder"] == trained.key
    assert output.record["config"]["image_size"] == 6
    assert output.record["config"]["preset_options"] == {"mean": 0.0, "std": 1.0}
    assert features_stage_of(pets_shards, trained.path / "encoder.pt", "test", "cpu").key == output.key
    assert np.load(output.path / FEATURES_FILE).shape == (8, 512)  # grayscale decoded as RGB for the encoder


# ---------------------------------------------------------------------------------------------
# Evaluation

def test_results_hold_every_suite_with_knn_equal_to_knn_accuracy(pets_shards):
    output = evaluate(pets_shards, suites=("plots", "linear", "knn", "map", "diagnostics"), knn_k=(1, 3),
                      linear_options={"weight_decays": [1e-3]}, progress=False)
    results = json.loads((output.path / RESULTS_FILE).read_text())
    train, test = (load_features(extract_features(pets_shards, split=split, progress=False))
                   for split in ("train", "test"))
    assert results["suites"]["knn"] == knn_accuracy(train.features, train.labels, test.features, test.labels, (1, 3))
    assert list(results["suites"]) == ["knn", "linear", "map", "diagnostics", "plots"] == list(results["seconds"])
    assert 0 <= results["suites"]["map"]["map_at_r"] <= 1
    assert set(results["suites"]["linear"]) == {"linear_top1", "linear_top5", "linear_weight_decay"}
    assert set(results["suites"]["diagnostics"]) == {"effective_rank", "embedding_std", "uniformity"}
    assert results["samples"] == {"train": 8, "test": 8}
    for figure in (CONFUSION_FILE, HISTOGRAM_FILE, TSNE_FILE):
        assert (output.path / figure).read_bytes()[:8] == PNG_MAGIC
    assert output.metrics["knn_top1_k3"] == results["suites"]["knn"]["knn_top1_k3"]
    assert output.metrics["seconds_linear"] == results["seconds"]["linear"]
    assert output.record["inputs"] == {"train": train.key, "test": test.key}


def test_a_second_call_is_cached_and_computes_nothing(pets_shards, monkeypatch):
    first = evaluate(pets_shards, suites=FAST_SUITES, knn_k=(1, 3), progress=False)

    def fail(*args, **kwargs):
        raise AssertionError("recomputed")
    monkeypatch.setattr(evaluation_module, "_write_features", fail)
    monkeypatch.setattr(evaluation_module, "knn_rankings", fail)
    again = evaluate(pets_shards, suites=reversed(FAST_SUITES), knn_k=(3, 1), progress=False)
    assert again.cached and again.path == first.path


def test_the_zero_shot_hook_scores_against_prompt_embeddings(pets_shards):
    train, test = (extract_features(pets_shards, split=split, progress=False) for split in ("train", "test"))
    known, scored = load_features(train), load_features(test)
    class_means = np.stack([known.features[known.labels == label].mean(axis=0) for label in (0, 1)])
    text = TextEncoder(lambda prompts: np.stack([class_means[int("dog" in prompt)] for prompt in prompts]), "means")
    output = evaluate_features(train, test, ["zeroshot"], text_encoder=text)
    results = json.loads((output.path / RESULTS_FILE).read_text())
    assert results["suites"]["zeroshot"] == zero_shot_accuracy(scored.features, scored.labels, class_means)
    assert output.record["inputs"]["text_encoder"] == "means"


def test_the_retrieval_hook_pairs_test_rows_with_their_manifest_captions(pets_shards):
    train, test = (extract_features(pets_shards, split=split, progress=False) for split in ("train", "test"))
    pixels = load_features(test)

    def write(out):  # caption "embeddings" that are the test images' own pixels, at their manifest rows
        embeddings = np.zeros((16, 64), dtype=np.float16)
        embeddings[pixels.indices] = pixels.features
        np.save(out / "embeddings.npy", embeddings)
    captions = run_stage(Stage("captions", "test", {}), write)
    output = evaluate_features(train, test, ["retrieval"], captions=captions)
    results = json.loads((output.path / RESULTS_FILE).read_text())["suites"]["retrieval"]
    assert results["i2t_r1"] == results["t2i_r1"] == 1.0
    assert output.record["inputs"]["captions"] == captions.key


def test_features_land_at_their_manifest_rows_whatever_the_batch_order(tmp_path):
    indices = np.array([3, 5, 8, 13])
    batches = [{"index": torch.tensor([13, 3]), "views": [torch.tensor([[13.0], [3.0]])]},
               {"index": torch.tensor([8, 5]), "views": [torch.tensor([[8.0], [5.0]])]}]
    written = evaluation_module._encode_in_manifest_order(batches, lambda views: views.numpy(), indices,
                                                    tmp_path / "f.npy", lambda count: None)
    np.testing.assert_array_equal(np.load(tmp_path / "f.npy")[:, 0], indices)
    assert written.shape == (4, 1)
    short = batches[:1] + [{"index": torch.tensor([8]), "views": [torch.ones(1, 1)]}]
    with pytest.raises(EvalError, match="1 of 4 samples of the split were never read"):
        evaluation_module._encode_in_manifest_order(short, lambda views: views.numpy(), indices, tmp_path / "g.npy",
                                              lambda count: None)


@pytest.mark.parametrize(("suites", "message"), [
    (["knn", "tsne"], "unknown or no suites ['tsne']; choose from knn, linear"),
    (["zeroshot"], "suite zeroshot needs a text encoder"),
    (["retrieval"], "suite retrieval needs caption embeddings"),
])
def test_unknown_suites_and_missing_inputs_fail_in_one_line(pets_shards, suites, message):
    with pytest.raises(EvalError) as caught:
        evaluate(pets_shards, suites=suites, progress=False)
    assert str(caught.value).startswith(message) and "\n" not in str(caught.value)


def test_unlabelled_data_cannot_run_knn(make_image_folder, write_spec, tmp_path):
    root = make_image_folder({"any": 6})
    (tmp_path / "pairs.csv").write_text("path,caption\n" + "".join(f"any/any-{i}.png,picture {i}\n" for i in range(6)))
    spec = write_spec({"name": "captioned", "source": {"type": "manifest", "path": "pairs.csv", "root": str(root)},
                       "split": {"type": "random", "fractions": {"train": 0.5, "test": 0.5}}})
    with pytest.raises(EvalError) as caught:
        evaluate(shard(spec, progress=False), suites=["knn", "diagnostics"], progress=False)
    assert str(caught.value) == ("suites knn need class labels, which the data does not have; "
                                 "add classes to the data spec, or run only diagnostics, retrieval")


def test_an_empty_test_split_fails_in_one_line(make_image_folder, write_spec):
    spec = pets_spec_of(make_image_folder, write_spec, per_class=3, fractions={"train": 1.0})
    with pytest.raises(EvalError) as caught:
        evaluate(shard(spec, progress=False), suites=FAST_SUITES, progress=False)
    assert "hold no 'test' samples (splits: train=6)" in str(caught.value) and "\n" not in str(caught.value)


def test_a_missing_encoder_fails_in_one_line(pets_shards, tmp_path):
    with pytest.raises(EvalError) as caught:
        extract_features(pets_shards, tmp_path / "nowhere.pt", progress=False)
    assert str(caught.value) == (f"encoder {tmp_path / 'nowhere.pt'} does not exist; "
                                 "pass 'pixels', a train stage directory or its encoder.pt")


def test_an_unloadable_encoder_fails_in_one_line(pets_shards, tmp_path):
    with zipfile.ZipFile(tmp_path / "encoder.pt", "w") as archive:  # an archive, as torch.save writes, but no checkpoint
        archive.writestr("junk", "not a checkpoint")
    with pytest.raises(EvalError) as caught:
        extract_features(pets_shards, tmp_path / "encoder.pt", device="cpu", progress=False)
    assert str(caught.value).startswith(f"cannot load encoder {tmp_path / 'encoder.pt'} (")
    assert "\n" not in str(caught.value)


def test_matrix_plot_draws_square_matrices_only(tmp_path):
    assert matrix_plot(np.eye(3), tmp_path / "m.png", names=list("abc")).read_bytes()[:8] == PNG_MAGIC
    with pytest.raises(EvalError, match=r"matrix has shape \(2, 3\), expected \(C, C\)"):
        matrix_plot(np.ones((2, 3)), tmp_path / "bad.png")


# ---------------------------------------------------------------------------------------------
# Command line

def test_cli_suites_are_library_suites():
    commands = next(action for action in build_parser()._actions if isinstance(action, argparse._SubParsersAction))
    choices = {action.dest: action.choices for action in commands.choices["eval"]._actions}
    assert set(choices["suites"]) <= set(SUITES)


@pytest.mark.parametrize(("args", "message"), [
    (["--encoder", "missing.pt"], "error: encoder missing.pt does not exist"),
    (["--k", "0"], "error: knn_k=[0] is not a positive int"),
])
def test_cli_mistakes_fail_in_one_line_before_orchestration(pets_spec, args, message, capsys):
    assert main(["eval", str(pets_spec), *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith(message) and err.count("\n") == 1


@pytest.mark.slow
@pytest.mark.orchestration
def test_eval_runs_caches_and_tracks_every_stage(make_image_folder, write_spec, tmp_path):
    spec = pets_spec_of(make_image_folder, write_spec, per_class=20)
    home = tmp_path / "home"
    runs = [repsim(home, "eval", str(spec), "--k", "3", "--k", "5") for _ in range(2)]
    stage_names = ["shard", "features", "features", "evaluate"]
    for done, cached in zip(runs, ("no", "yes")):
        assert done.returncode == 0, done.stderr
        rows = [line.split() for line in done.stdout.splitlines() if line.split() and line.split()[0] in stage_names]
        assert [row[0] for row in rows] == stage_names and {row[-2] for row in rows} == {cached}, done.stdout
        assert any(line.split()[:2] == ["knn", "knn_top1_k5"] for line in done.stdout.splitlines()), done.stdout
    [results] = [line.split()[-1] for line in runs[0].stdout.splitlines() if line.startswith("results:")]
    assert json.loads(open(results).read())["suites"]["linear"]["linear_top1"] >= 0

    client = MlflowClient(tracking_uri=f"sqlite:///{home / 'mlflow.db'}")
    for parent, children in built_then_cached(home, stage_names):
        [evaluated] = [run for run in children if run.data.tags["repsim.stage"] == "evaluate"]
        assert logged_files(client, evaluated) >= \
            {RESULTS_FILE, CONFUSION_FILE, HISTOGRAM_FILE, TSNE_FILE, "stage.json"}
        assert 0 <= evaluated.data.metrics["knn_top1_k5"] <= 1 and "linear_top1" in evaluated.data.metrics
        assert parent.data.metrics["pixels.knn_top1_k5"] == evaluated.data.metrics["knn_top1_k5"]
