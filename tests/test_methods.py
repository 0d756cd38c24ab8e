"""Experiment configs, the methods and their registry, and the train stage, on a small
Animal-MNIST subset: 4 classes x 40 silhouettes (28×28), 128 train / 32 test samples."""

from __future__ import annotations

import json
import os
from dataclasses import replace
from pathlib import Path
from typing import Literal

import numpy as np
import pyarrow as pa
import pyarrow.csv as pacsv
import pyarrow.parquet as pq
import pytest
from pydantic import BaseModel, ConfigDict, Field
from animals import CLASSES, animal_shards
from e2e import free_port
import torch
import torch.multiprocessing as mp
import yaml

from repsim.data.loader import make_loader
from repsim.data.stage import ShardResult
from repsim.data.spec import load_spec
from repsim.errors import SpecError
from repsim.losses import NTXentLoss, XCLRLoss
from repsim.methods import base
from repsim.methods import config as method_config
from repsim.methods.config import Config, load_config
from repsim.methods.xclr import LabelsSimilarity
from repsim.methods.base import Method, TrainingData, Upstream, method_spec, register
from repsim.methods.stage import file_digest, prepare, train, train_stage_of, training_data
from repsim.methods.trainer import init_distributed, seed_everything
from repsim.methods.xclr import similarity_source, upstream
from repsim.models import MaskableViT, backbone, load_encoder, save_encoder
from repsim.models.backbones import read_encoder
from repsim.stage import repsim_home
from repsim.similarity.stage import EMBEDDINGS_FILE

REPO = Path(__file__).resolve().parents[1]
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


class Crash(Exception):
    """Stands for a process killed in the middle of training."""


@pytest.fixture(scope="module")
def animals(tmp_path_factory) -> tuple[Path, ShardResult]:
    return animal_shards(tmp_path_factory.mktemp("animals"), shard_size=32)


def tiny_config(spec: Path, method: dict | None = None, **sections: dict) -> Config:
    """resnet18 with the standard stem (cheap at 28 px), batches of 32: 4 steps per epoch."""
    values = {"method": method or {"name": "xclr", "similarity": {"type": "labels"}},
              "data": {"spec": str(spec), "image_size": 28},
              "model": {"small_images": False, "projection_hidden_dim": 64, "projection_dim": 32},
              "optim": {"batch_size": 32, "epochs": 3, "warmup_epochs": 0.5, "lr": 0.003, "checkpoint_every": 2},
              "monitor": {"k": 5, "batch_size": 64}}
    for section, update in sections.items():
        values[section] = {**values.get(section, {}), **update}
    return Config.model_validate(values)


def first_batch(shards: ShardResult, batch_size: int = 32) -> dict:
    return next(iter(make_loader(shards.path, "simclr", batch_size, seed=3)))


def read_metrics(output_path: Path) -> list[dict]:
    return [json.loads(line) for line in (output_path / "metrics.jsonl").read_text().splitlines()]


# ---------------------------------------------------------------------------------------------
# Configs

def test_shipped_configs_validate_over_the_defaults():
    for name in ("xclr", "simclr", "supcon", "clip"):
        config = load_config(REPO / "configs" / f"{name}.yaml")
        assert config.method.name == name
        assert config.data.spec == REPO / "data_specs" / "animal-mnist.yaml"
        assert config.model.backbone == "resnet18" and config.model.small_images and config.optim.batch_size == 256
    assert load_config(REPO / "configs" / "xclr.yaml").method.similarity.type == "captions"


def test_overrides_are_parsed_as_yaml(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    config = load_config(REPO / "configs" / "xclr.yaml", [
        "optim.lr=0.01", "monitor.knn=false", "optim.grad_clip=1.5", "optim.optimizer=lars",
        "method.similarity={type: matrix, path: m.csv}", "data.spec=specs/a.yaml"])
    assert config.optim.lr == 0.01 and config.monitor.knn is False and config.optim.grad_clip == 1.5
    assert config.optim.optimizer == "lars"
    assert config.method.similarity.path == tmp_path / "m.csv"  # overrides start at the working directory
    assert config.data.spec == tmp_path / "specs" / "a.yaml"


def test_changing_the_type_of_a_mapping_replaces_it(tmp_path):
    path = tmp_path / "matrix.yaml"
    path.write_text(yaml.safe_dump({"method": {"name": "xclr", "similarity": {"type": "matrix", "path": "m.csv"}}}))
    assert load_config(path).method.similarity.path == tmp_path / "m.csv"  # relative to the config's folder
    assert load_config(path, ["method.similarity.type=labels"]).method.similarity == LabelsSimilarity(type="labels")


SIMCLR = {"method": {"name": "simclr"}}


@pytest.mark.parametrize("content, overrides, expected", [
    ({"method": {"name": "xclr"}, "optim": {"lrr": 0.1}}, [],
     "{config}: unknown field 'optim.lrr'; did you mean 'lr'?"),
    ({"method": {"name": "xclr", "similarity": {"type": "captionz"}}}, [],
     "{config}: field 'method.similarity.type' is 'captionz', which is not known; use one of 'captions', 'wordnet'"),
    ({"method": {"name": "xclrr"}}, [], "{config}: field 'method.name' is 'xclrr', which is not known; use one of"),
    ({"data": {}}, [], "{config}: field 'method' is required; add it"),
    ({"method": {}}, [], "{config}: field 'method' has no 'name'; add 'name:' with one of 'clip', 'dino'"),
    (SIMCLR, ["optm.lr=1"], "override 'optm.lr=1': unknown field 'optm'; did you mean 'optim'?"),
    (SIMCLR, ["optim.lr=-1"], "override 'optim.lr=-1': field 'optim.lr': Input should be greater"),
    (SIMCLR, ["optim.lr"], "override 'optim.lr' is not of the form key=value"),
    ({"method": {"name": "xclr", "similarity": {"type": "wordnet", "measure": "wupp"}}}, [],
     "{config}: field 'method.similarity.measure': Input should be 'wup'"),
    (SIMCLR, ["data.preset_options={local_crops:4}"],  # YAML without a space after the colon: a key, no value
     "override 'data.preset_options={{local_crops:4}}': field 'data': preset_options 'local_crops:4' is no option of "
     "the simclr preset, whose options are crop_scale,"),
])
def test_config_errors_are_one_line_naming_file_and_field(tmp_path, content, overrides, expected):
    config = tmp_path / "experiment.yaml"
    config.write_text(yaml.safe_dump(content))
    with pytest.raises(SpecError) as raised:
        load_config(config, overrides)
    message = str(raised.value)
    assert "\n" not in message and "; " in message
    assert expected.format(config=config) in message


def test_a_missing_or_malformed_config_file_is_named(tmp_path):
    with pytest.raises(SpecError, match="config nowhere.yaml does not exist; check the path"):
        load_config("nowhere.yaml")
    (tmp_path / "bad.yaml").write_text("method: [")
    with pytest.raises(SpecError, match="bad.yaml: not valid YAML at line"):
        load_config(tmp_path / "bad.yaml")


# ---------------------------------------------------------------------------------------------
# Methods

def test_xclr_loss_is_the_xclr_loss_of_its_embeddings_and_the_same_label_matrix(animals):
    spec, shards = animals
    config = tiny_config(spec, {"name": "xclr", "temperature": 0.2, "target_temperature": 0.3,
                                "similarity": {"type": "labels"}})
    method = method_spec("xclr").build(config, training_data(config, load_spec(spec), shards))
    batch = first_batch(shards)
    outputs = method.training_step(batch)
    z1, z2 = method.project_views(batch)
    same_label = (batch["label"][:, None] == batch["label"][None, :]).float()
    torch.testing.assert_close(outputs["loss"], XCLRLoss(0.2, 0.3)(z1, z2, same_label), rtol=0, atol=1e-6)
    off_diagonal = same_label[~torch.eye(32, dtype=torch.bool)].mean()
    torch.testing.assert_close(outputs["target_similarity"], off_diagonal)


def test_xclr_towards_identity_targets_is_simclr_at_its_temperature(animals):
    spec, shards = animals
    config = tiny_config(spec, {"name": "xclr", "temperature": 0.2, "target_temperature": 1e-3,
                                "similarity": {"type": "identity"}})
    method = method_spec("xclr").build(config, training_data(config, load_spec(spec), shards))
    batch = first_batch(shards)
    z1, z2 = method.project_views(batch)
    torch.testing.assert_close(method.training_step(batch)["loss"], NTXentLoss(0.2)(z1, z2), rtol=0, atol=1e-5)


def _write_class_matrix(path: Path) -> np.ndarray:
    matrix = np.array([[1.0, 0.2, 0.3, 0.4], [0.2, 1.0, 0.5, 0.6], [0.3, 0.5, 1.0, 0.7], [0.4, 0.6, 0.7, 1.0]])
    names = list(CLASSES)
    pacsv.write_csv(pa.table({"class": names, **{name: matrix[:, k] for k, name in enumerate(names)}}), path)
    return matrix


def _write_graph(path: Path, shards: ShardResult, batch: dict) -> None:
    keys = pq.read_table(shards.manifest, columns=["key"]).column("key").to_pylist()
    first, second = batch["index"][:2].tolist()
    pq.write_table(pa.table({"key_i": [keys[first]], "key_j": [keys[second]], "s": [0.25]}), path)


@pytest.mark.parametrize("kind", ["labels", "identity", "wordnet", "captions", "matrix", "graph"])
def test_xclr_wires_the_configured_similarity_source(animals, tmp_path, kind):
    spec, shards = animals
    batch = first_batch(shards, 8)
    indices, labels = batch["index"], batch["label"]
    similarity = {"type": kind}
    if kind == "matrix":
        matrix = _write_class_matrix(tmp_path / "classes.csv")
        similarity["path"] = str(tmp_path / "classes.csv")
    if kind == "graph":
        _write_graph(tmp_path / "graph.parquet", shards, batch)
        similarity["path"] = str(tmp_path / "graph.parquet")
    config = tiny_config(spec, {"name": "xclr", "similarity": similarity})
    data = training_data(config, load_spec(spec), shards)
    plan = upstream(config, data)
    if plan is not None and plan.run is not None:
        data = replace(data, upstream=plan.run())
    got = similarity_source(config.method.similarity, data)(indices, labels)
    same_label = (labels[:, None] == labels[None, :]).float()
    if kind == "labels":
        assert plan is None
        expected = same_label
    elif kind == "identity":
        assert plan is None
        expected = torch.eye(8)
    elif kind == "wordnet":
        table = np.load(data.upstream.path / "similarity.npy")
        expected = torch.from_numpy(table)[labels[:, None], labels[None, :]]
        assert data.upstream.stage == "wordnet" and 0 < expected.min() < 1
    elif kind == "captions":
        rows = torch.nn.functional.normalize(torch.from_numpy(
            np.load(data.upstream.path / EMBEDDINGS_FILE)[indices.numpy()].astype(np.float32)), dim=1)
        expected = (rows @ rows.T).clamp(-1, 1).fill_diagonal_(1.0)
        assert data.upstream.stage == "captions"
    elif kind == "matrix":
        expected = torch.from_numpy(matrix).float()[labels[:, None], labels[None, :]]
        assert plan.key == file_digest(tmp_path / "classes.csv", "path")
    else:
        expected = torch.eye(8)
        expected[0, 1] = expected[1, 0] = 0.25
    torch.testing.assert_close(got, expected.float(), atol=1e-5, rtol=0)


ACCEPTED_METHODS = list(method_config.METHODS.registered())
SETTINGS = {"xclr": {"similarity": {"type": "labels"}}, "clip": {"text_hidden_dim": 16}}
TINY_VIT = {"backbone": "vit_tiny", "patch_size": 7, "depth": 1}


@pytest.mark.parametrize("name", ACCEPTED_METHODS)
def test_every_method_the_config_accepts_is_registered_and_takes_a_training_step(animals, name):
    spec, shards = animals
    vit = {"model": TINY_VIT} if name in ("sop", "dino", "ibot") else {}
    config = tiny_config(spec, {"name": name, **SETTINGS.get(name, {})}, **vit)
    data, _ = prepare(config, shards, progress=False)  # the method's upstream stage run
    model = method_spec(name).build(config, data)
    outputs = model.training_step(first_batch(shards, 8))
    outputs["loss"].backward()
    assert isinstance(model, Method) and torch.isfinite(outputs["loss"])
    assert all(p.grad is not None for p in model.encoder.parameters() if p.requires_grad)


def test_sop_with_the_authors_preset_builds_their_banks_and_takes_a_training_step(animals):
    spec, shards = animals
    config = tiny_config(spec, {"name": "sop", "preset": "authors", "cls_memory": 8192, "num_anchors": 16,
                                "patch_memory": 64}, model=TINY_VIT)
    data, _ = prepare(config, shards, progress=False)
    model = method_spec("sop").build(config, data)
    assert model.cls_bank.num_anchors == 4 and model.patch_bank.num_anchors == 16  # 32 of 65536, and as set
    assert model.patch_bank.support_size == 0 and model.anchor_draws == 4
    assert model.cls_bank.memory.filled == 8192 and model.patch_bank.memory.filled == 64  # random, full
    assert model.horizon is None and model.base_momentum == 0.996
    assert model.enqueue_second_only and not model.cls_bank.supports_from_anchors
    assert model.masking.share == 1.0 and model.masking.ratio == (0.3, 0.3)
    outputs = model.training_step(first_batch(shards, 8))
    outputs["loss"].backward()
    assert torch.isfinite(outputs["loss"]) and outputs["cls_loss"] > 0 and outputs["sops"] == 4


@pytest.mark.parametrize("name", ["simclr", "supcon", "xclr", "clip"])
def test_the_two_view_methods_train_a_vit_as_well(animals, name):
    spec, shards = animals
    config = tiny_config(spec, {"name": name, **SETTINGS.get(name, {})}, model=TINY_VIT)
    data, _ = prepare(config, shards, progress=False)
    model = method_spec(name).build(config, data)
    model.training_step(first_batch(shards, 8))["loss"].backward()
    assert isinstance(model.encoder, MaskableViT) and model.encoder(torch.zeros(2, 1, 28, 28)).shape == (2, 192)
    assert model.encoder.conv_proj.weight.grad.abs().sum() > 0


def test_a_method_registered_outside_the_library_is_found_by_the_train_stage(animals, monkeypatch):
    spec, shards = animals
    monkeypatch.setattr(base, "_methods", dict(base._methods))  # registered for this test only
    produced = object()

    def toy_upstream(config: Config, data: TrainingData) -> Upstream:
        return Upstream(f"toy-input-{data.image_size}", lambda: produced)

    @register("toy", upstream=toy_upstream)
    def build(config: Config, data: TrainingData) -> Method:
        return method_spec("simclr").build(config, data)

    simclr = tiny_config(spec, {"name": "simclr"})
    toy = simclr.model_copy(update={"method": simclr.method.model_copy(update={"name": "toy"})})
    data, upstream = prepare(toy, shards, progress=False)
    assert upstream.key == "toy-input-28" and data.upstream is produced
    assert method_spec("toy").build is build
    assert prepare(simclr, shards, progress=False)[1] is None  # a method without upstream


class ToyConfig(BaseModel):
    """The settings of a method outside the library."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    name: Literal["toy"]
    temperature: float = Field(0.1, gt=0)


@pytest.fixture
def registry_restored(monkeypatch):
    """The methods registered in the test are forgotten after it, by both registries."""
    monkeypatch.setattr(base, "_methods", dict(base._methods))
    monkeypatch.setattr(method_config.METHODS, "_models", dict(method_config.METHODS.registered()))


def test_a_method_registered_outside_the_library_with_its_settings_is_read_from_a_config(tmp_path,
                                                                                         registry_restored):
    def build(config: Config, data: TrainingData) -> Method:
        return method_spec("simclr").build(config, data)

    schema = Config.__pydantic_core_schema__
    register("toy", settings=ToyConfig)(build)
    assert Config.__pydantic_core_schema__ is schema  # the registry is consulted; the config class is not rebuilt
    path = tmp_path / "toy.yaml"
    path.write_text(yaml.safe_dump({"method": {"name": "toy", "temperature": 0.5}}))
    assert load_config(path).method == ToyConfig(name="toy", temperature=0.5)
    assert load_config("simclr").method.name == "simclr"  # the shipped methods still read
    for method, expected in [({"temperature": -1}, "field 'method.temperature': Input should be greater than 0"),
                             ({"temprature": 1}, "unknown field 'method.temprature'; did you mean 'temperature'?"),
                             ({"name": "tooy"}, "field 'method.name' is 'tooy', which is not known; use one of "
                                                "'clip', 'dino', 'ibot', 'simclr', 'sop', 'supcon', 'xclr', 'toy'")]:
        path.write_text(yaml.safe_dump({"method": {"name": "toy", **method}}))
        with pytest.raises(SpecError) as raised:
            load_config(path)
        assert "\n" not in str(raised.value) and f"{path}: {expected}" in str(raised.value)
    with pytest.raises(TypeError, match="must be a model with name: Literal\\['toy2'\\]"):
        register("toy2", settings=ToyConfig)(build)


def test_an_outside_method_registered_in_a_test_is_forgotten_after_it(tmp_path):
    path = tmp_path / "toy.yaml"
    path.write_text(yaml.safe_dump({"method": {"name": "toy"}}))
    with pytest.raises(SpecError, match="field 'method.name' is 'toy', which is not known"):
        load_config(path)
    assert "toy" not in base._methods


def test_an_unknown_method_name_is_one_line_naming_the_known_methods():
    with pytest.raises(SpecError) as raised:
        method_spec("xclrr")
    assert str(raised.value) == ("method.name is 'xclrr', which is not known; use one of "
                                 + ", ".join(repr(name) for name in method_config.METHODS.shipped()))
    assert method_config.METHODS.shipped() == tuple(ACCEPTED_METHODS)


@pytest.mark.parametrize("method, needs", [({"name": "supcon"}, "SupCon"),
                                           ({"name": "xclr", "similarity": {"type": "labels"}}, "labels similarity")])
def test_label_methods_refuse_unlabelled_data(animals, method, needs):
    spec, shards = animals
    config = tiny_config(spec, method)
    data = training_data(config, load_spec(spec), shards)
    unlabelled = replace(data, spec=data.spec.model_copy(update={"classes": None}))
    with pytest.raises(SpecError, match=f"{needs} needs labelled data"):
        method_spec(method["name"]).build(config, unlabelled)


# ---------------------------------------------------------------------------------------------
# The train stage

def test_the_stage_key_ignores_settings_that_do_not_change_the_result(animals):
    spec, shards = animals
    key = train_stage_of(tiny_config(spec), shards).key
    neutral = {"threads": 1, "checkpoint_every": 7, "keep_checkpoint": True}  # marked on the fields themselves
    assert train_stage_of(tiny_config(spec, optim=neutral), shards).key == key
    workers = {count: train_stage_of(tiny_config(spec, optim={"num_workers": count}), shards).key for count in (0, 2)}
    assert len({key, *workers.values()}) == 3  # the worker count changes the batches: keyed when set
    assert train_stage_of(tiny_config(spec, data={"augment": "batch"}), shards).key != key
    assert train_stage_of(tiny_config(spec, monitor={"batch_size": 7}), shards).key == key
    assert train_stage_of(tiny_config(spec, optim={"lr": 0.1}), shards).key != key
    wup, path = (tiny_config(spec, {"name": "xclr", "similarity": {"type": "wordnet", "measure": measure}})
                 for measure in ("wup", "path"))
    assert train_stage_of(wup, shards).inputs["upstream"] != train_stage_of(path, shards).inputs["upstream"]


def test_the_stage_key_holds_the_contents_of_the_starting_encoder_not_its_path(animals, tmp_path):
    spec, shards = animals
    for name, seed in (("a", 0), ("b", 0), ("c", 1)):
        torch.manual_seed(seed)
        (tmp_path / name).mkdir()
        save_encoder(backbone("vit_tiny", 1, 28, patch_size=7, depth=1), tmp_path / name / "encoder.pt")
    key = {name: train_stage_of(tiny_config(spec, model={**TINY_VIT, "init_encoder": str(tmp_path / name)}),
                                shards).key for name in "abc"}
    assert key["a"] == key["b"] != key["c"]
    assert train_stage_of(tiny_config(spec, model=TINY_VIT), shards).key not in key.values()
    with pytest.raises(SpecError, match=r"model.init_encoder points at .*missing, which does not exist"):
        train_stage_of(tiny_config(spec, model={**TINY_VIT, "init_encoder": str(tmp_path / "missing")}), shards)


def test_self_distillation_starts_student_and_teacher_from_a_contrastive_encoder(animals, tmp_path):
    spec, shards = animals
    supcon = tiny_config(spec, {"name": "supcon"}, model=TINY_VIT)
    data, _ = prepare(supcon, shards, progress=False)
    save_encoder(method_spec("supcon").build(supcon, data).encoder, tmp_path / "encoder.pt")
    saved = read_encoder(tmp_path / "encoder.pt")["state_dict"]
    sop = tiny_config(spec, {"name": "sop", **SETTINGS.get("sop", {})},
                      model={**TINY_VIT, "init_encoder": str(tmp_path / "encoder.pt")})
    model = method_spec("sop").build(sop, data)
    for network in (model.encoder, model.teacher_encoder):
        assert all(torch.equal(network.state_dict()[name], weights) for name, weights in saved.items())


@pytest.mark.slow
def test_zero_and_two_loader_workers_train_apart_to_different_weights(animals):
    """The worker count changes the batches, so the weights: neither training is served to the other."""
    spec, shards = animals
    outputs = {count: train(tiny_config(spec, optim={"num_workers": count, "epochs": 1}, monitor={"knn": False}),
                            shards=shards, device="cpu", progress=False) for count in (0, 2)}
    assert outputs[0].key != outputs[2].key and not outputs[2].cached
    assert {count: output.metrics["loader_workers"] for count, output in outputs.items()} == {0: 0, 2: 2}
    weights = [torch.cat([p.flatten() for p in load_encoder(output.path).parameters()]) for output in outputs.values()]
    assert not torch.allclose(*weights)
    again = train(tiny_config(spec, optim={"num_workers": 2, "epochs": 1}, monitor={"knn": False}), shards=shards,
                  device="cpu", progress=False)
    assert again.cached and again.path == outputs[2].path


def test_training_lowers_the_loss_and_writes_a_loadable_encoder(animals):
    spec, _ = animals
    config = tiny_config(spec)
    logged = []
    output = train(config, log=lambda metrics, step: logged.append(step), device="cpu", progress=False)  # shards too
    steps = [record for record in read_metrics(output.path) if "loss" in record]
    assert [record["step"] for record in steps] == list(range(1, 13))
    first, last = (np.mean([r["loss"] for r in steps[i:i + 4]]) for i in (0, 8))
    assert last < first
    epochs = [record for record in read_metrics(output.path) if "epoch" in record]
    assert [record["epoch"] for record in epochs] == [1, 2, 3] and "knn_top1_k5" in epochs[-1]
    assert logged == sorted(logged) and len(logged) == 15
    metrics = output.metrics
    assert metrics["steps"] == 12 and metrics["epochs"] == 3 and 0 <= metrics["knn_top1_k5"] <= 1
    assert metrics["loss"] == pytest.approx(last)
    encoder = load_encoder(output.path)
    assert encoder(torch.zeros(2, 1, 28, 28)).shape == (2, 512)
    assert not (output.path / "checkpoint.pt").exists()  # resume needs it only while training runs
    assert not (repsim_home() / "scratch" / "train" / output.key).exists()
    again = train(config, device="cpu", progress=False)
    assert again.cached and again.key == output.key == train_stage_of(config).key


def test_zero_steps_save_the_initialised_encoder_the_untrained_floor(animals):
    spec, shards = animals
    config = tiny_config(spec, {"name": "sop", "mim_weight": 0}, optim={"max_steps": 0, "seed": 4})
    output = train(config, shards=shards, device="cpu", progress=False)
    assert output.metrics["steps"] == 0 and "loss" not in output.metrics
    seed_everything(4)  # the method's networks as the train stage builds them, before any step
    initialised = method_spec("sop").build(config, training_data(config, load_spec(spec), shards)).encoder.eval()
    images = first_batch(shards)["views"][0][:4]
    with torch.no_grad():
        assert torch.equal(load_encoder(output.path).eval()(images), initialised(images))
    trained = train(config.model_copy(update={"optim": config.optim.model_copy(update={"max_steps": 1})}),
                    shards=shards, device="cpu", progress=False)
    with torch.no_grad():
        assert not torch.equal(load_encoder(trained.path).eval()(images), initialised(images))


@pytest.mark.parametrize("augment", ["sample", "batch"])
def test_an_interrupted_train_stage_resumes_to_the_same_result(animals, tmp_path, augment):
    spec, shards = animals
    config = tiny_config(spec, optim={"epochs": 2}, data={"augment": augment})
    uninterrupted = train(config, out_dir=tmp_path / "uninterrupted", shards=shards, device="cpu", progress=False)

    def crash_at_step_5(metrics: dict, step: int) -> None:
        if step == 5:
            raise Crash
    with pytest.raises(Crash):
        train(config, out_dir=tmp_path / "resumed", log=crash_at_step_5, shards=shards, device="cpu", progress=False)
    scratch = repsim_home() / "scratch" / "train" / uninterrupted.key
    assert (scratch / "checkpoint.pt").is_file() and not (tmp_path / "resumed").exists()
    resumed = train(config, out_dir=tmp_path / "resumed", shards=shards, device="cpu", progress=False)
    assert read_metrics(resumed.path) == read_metrics(uninterrupted.path)
    assert not scratch.exists()


def _train_on_rank(rank: int, world: int, port: int, config: dict, shards: str, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    init_distributed("gloo")
    try:
        output, again = (train(Config.model_validate(config), out_dir=Path(out) / "stage", shards=shards,
                               device="cpu", progress=False) for _ in range(2))
        (Path(out) / f"rank{rank}.json").write_text(json.dumps(
            {"key": output.key, "path": str(output.path), "cached": [output.cached, again.cached]}))
    finally:
        torch.distributed.destroy_process_group()


@pytest.mark.slow
def test_every_torchrun_rank_returns_the_stage_rank_0_wrote(animals, tmp_path):
    spec, shards = animals
    config = tiny_config(spec, optim={"epochs": 1}).model_dump(mode="json")
    mp.spawn(_train_on_rank, args=(2, free_port(), config, str(shards.path), str(tmp_path)), nprocs=2, join=True)
    ranks = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in range(2)]
    assert ranks[0]["key"] == ranks[1]["key"] and ranks[0]["path"] == ranks[1]["path"]
    assert ranks[0]["cached"] == ranks[1]["cached"] == [False, True]
    steps = [record for record in read_metrics(tmp_path / "stage") if "loss" in record]
    assert len(steps) == 4  # 64 samples per rank in batches of 16 (half the global batch of 32)
    assert load_encoder(tmp_path / "stage").feature_dim == 512


# ---------------------------------------------------------------------------------------------
# On a GPU

@cuda
def test_cuda_train_stage_in_bf16_channels_last_compiled(animals):
    spec, shards = animals
    config = tiny_config(spec, model={"small_images": True},
                         optim={"precision": "auto", "channels_last": True, "compile": True, "num_workers": 2})
    output = train(config, shards=shards, progress=False)
    steps = [record for record in read_metrics(output.path) if "loss" in record]
    first, last = (np.mean([r["loss"] for r in steps[i:i + 4]]) for i in (0, 8))
    assert len(steps) == 12 and last < first and "knn_top1_k5" in output.metrics
    assert load_encoder(output.path)(torch.zeros(2, 1, 28, 28)).shape == (2, 512)


@cuda
def test_cuda_shipped_xclr_config_learns_animal_mnist():
    config = load_config(REPO / "configs" / "xclr.yaml", ["optim.epochs=2", "optim.num_workers=4"])
    output = train(config, progress=False)
    assert output.metrics["epochs"] == 2 and output.metrics["knn_top1_k20"] > 0.3  # chance: 0.1


def test_an_xclr_train_stage_writes_the_histogram_of_its_target_similarities(animals, tmp_path):
    spec, shards = animals
    config = tiny_config(spec, {"name": "xclr", "similarity": {"type": "wordnet"}}, optim={"epochs": 1},
                         monitor={"knn": False})
    output = train(config, out_dir=tmp_path / "xclr", shards=shards, device="cpu", progress=False)
    assert (output.path / "target_similarity.png").read_bytes().startswith(b"\x89PNG")
    baseline = train(tiny_config(spec, {"name": "simclr"}, optim={"epochs": 1}, monitor={"knn": False}),
                     out_dir=tmp_path / "simclr", shards=shards, device="cpu", progress=False)
    assert not (baseline.path / "target_similarity.png").exists()
