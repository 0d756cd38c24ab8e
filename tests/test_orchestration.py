"""End to end through the CLI, the Prefect flow and MLflow, on the embedded defaults."""

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from e2e import REPSIM, flow_runs, isolated_env, logged_files, repsim
from mlflow.tracking import MlflowClient

from repsim.data.manifest import MANIFEST
from repsim.eval.stage import split_rows

REPO = Path(__file__).resolve().parents[1]

pytestmark = [pytest.mark.slow, pytest.mark.orchestration]


@pytest.fixture
def pets_spec(make_image_folder, write_spec):
    root = make_image_folder({"cat": 6, "dog": 6})
    return write_spec({"name": "pets", "source": {"type": "image_folder", "root": str(root)},
                       "classes": {"cat": "cat.n.01", "dog": "dog.n.01"},
                       "split": {"type": "random", "fractions": {"train": 0.5, "test": 0.5}}})


def test_shard_flow_runs_caches_and_tracks_every_stage(pets_spec, tmp_path):
    home = tmp_path / "home"
    first = repsim(home, "shard", str(pets_spec))
    assert first.returncode == 0, first.stderr
    second = repsim(home, "shard", str(pets_spec))
    assert second.returncode == 0, second.stderr
    for done, cached in ((first, "no"), (second, "yes")):
        row = next(line for line in done.stdout.splitlines() if line.startswith(str(pets_spec))).split()
        assert row[1] == "12" and set(row[2:4]) == {"train=6", "test=6"} and row[4:6] == ["0", cached]

    [output] = [path for path in (home / "artifacts" / "shard").iterdir() if not path.name.startswith(".")]
    client = MlflowClient(tracking_uri=f"sqlite:///{home / 'mlflow.db'}")
    runs = flow_runs(home, "experiment")
    assert len(runs) == 2
    for (parent, [stage]), cached in zip(runs, ("false", "true")):
        tags = stage.data.tags
        assert tags["mlflow.parentRunId"] == parent.info.run_id
        assert tags["repsim.stage_key"] == output.name and tags["repsim.output"] == str(output)
        assert tags["repsim.cached"] == cached and tags["prefect.flow_run_id"]
        assert parent.data.tags["prefect.flow_run_id"] == tags["prefect.flow_run_id"]
        assert stage.data.params["config.name"] == "pets" and stage.data.metrics["samples"] == 12
        assert logged_files(client, stage) >= {"manifest.parquet", "stage.json"}
        assert stage.info.status == parent.info.status == "FINISHED"


def test_unreadable_image_inside_the_flow_is_one_line_and_leaves_nothing(make_image_folder, write_spec, tmp_path):
    root = make_image_folder({"cat": 2, "dog": 2})
    (root / "dog" / "dog-1.png").write_bytes(b"not a png")
    spec = write_spec({"name": "broken", "source": {"type": "image_folder", "root": str(root)},
                       "classes": {"cat": "cat.n.01", "dog": "dog.n.01"}, "on_error": "fail",
                       "split": {"type": "random", "fractions": {"train": 0.5, "test": 0.5}}})
    done = repsim(tmp_path / "home", "shard", str(spec), "--out", str(tmp_path / "out"))
    assert done.returncode == 2
    [error] = [line for line in done.stderr.splitlines() if line.startswith("error: ")]
    assert error.startswith(f"error: cannot read image {root / 'dog' / 'dog-1.png'}")
    assert "Traceback" not in done.stderr, done.stderr
    assert not (tmp_path / "out").exists()


@pytest.fixture
def pets_16px(make_image_folder, write_spec):
    root = make_image_folder({"cat": 12, "dog": 12}, size=16)
    return write_spec({"name": "pets", "source": {"type": "image_folder", "root": str(root)},
                       "classes": {"cat": "cat.n.01", "dog": "dog.n.01"},
                       "split": {"type": "random", "fractions": {"train": 0.5, "test": 0.5}}})


def test_train_flow_streams_curves_to_mlflow_and_caches(pets_16px, tmp_path):
    config = tmp_path / "supcon.yaml"
    config.write_text(f"data: {{spec: {pets_16px}, image_size: 16}}\nmethod: {{name: supcon}}\n")
    settings = ["--set", "optim.epochs=2", "--set", "optim.batch_size=4", "--set", "optim.num_workers=0",
                "--set", "optim.warmup_epochs=0", "--set", "monitor.k=3", "--set", "model.projection_dim=16",
                "--set", "model.projection_hidden_dim=32"]
    home = tmp_path / "home"
    first = repsim(home, "train", str(config), *settings)
    assert first.returncode == 0, first.stderr
    second = repsim(home, "train", str(config), *settings)
    assert second.returncode == 0, second.stderr
    assert "trained: " in first.stdout and "cached: " in second.stdout
    [output] = [p for p in (home / "artifacts" / "train").iterdir() if not p.name.startswith(".")]
    assert second.stdout.strip().endswith(str(output))

    client = MlflowClient(tracking_uri=f"sqlite:///{home / 'mlflow.db'}")
    runs = client.search_runs([client.get_experiment_by_name("repsim").experiment_id],
                              filter_string="tags.`repsim.stage` = 'train'", order_by=["attributes.start_time ASC"])
    assert [run.data.tags["repsim.cached"] for run in runs] == ["false", "true"]
    trained = runs[0]
    assert trained.data.tags["repsim.stage_key"] == output.name
    losses = client.get_metric_history(trained.info.run_id, "loss")
    assert [m.step for m in losses] == list(range(1, 7))  # 3 batches of 4 per epoch, 2 epochs
    assert [m.step for m in client.get_metric_history(trained.info.run_id, "knn_top1_k3")] == [3, 6]
    assert {a.path for a in client.list_artifacts(trained.info.run_id)} == {"metrics.jsonl", "stage.json"}  # weights: the model
    assert trained.data.params["config.method.name"] == "supcon"


def test_config_mistake_is_one_line_before_any_orchestration(tmp_path):
    config = tmp_path / "bad.yaml"
    config.write_text("method: {name: xclr, similarity: {type: glove}}\n")
    done = repsim(tmp_path / "home", "train", str(config))
    assert done.returncode == 2 and done.stderr.count("\n") == 1 and done.stderr.startswith("error: ")
    assert str(config) in done.stderr and not (tmp_path / "home" / "prefect" / "prefect.db").exists()


def test_large_outputs_are_tagged_by_path_small_ones_logged(tmp_path, monkeypatch):
    from repsim.tasks.settings import use_embedded_defaults

    use_embedded_defaults()
    from repsim.tasks import tracking

    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow.db'}")
    monkeypatch.setattr(tracking, "SMALL_ARTIFACT_BYTES", 100)
    small, large = tmp_path / "metrics.jsonl", tmp_path / "checkpoint.pt"
    small.write_text("{}\n")
    large.write_bytes(b"x" * 101)
    tracker = tracking.Tracker()
    with tracker.flow_run("test", {}) as run:
        run.log_artifacts([small, large, tmp_path / "absent.png"])
    logged = tracker.client.get_run(run.run_id)
    assert [a.path for a in tracker.client.list_artifacts(run.run_id)] == ["metrics.jsonl"]
    assert logged.data.tags["repsim.file.checkpoint.pt"] == str(large.resolve())


def test_the_printed_runs_link_opens_a_saved_view_wide_enough_for_stage_names(tmp_path, monkeypatch):
    from repsim.tasks.settings import use_embedded_defaults

    use_embedded_defaults()
    from repsim.tasks import tracking

    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow.db'}")
    tracker = tracking.Tracker()
    experiment = tracker.client.get_experiment(tracker.experiment_id)
    tracker.client.delete_experiment_tag(tracker.experiment_id, f"mlflow.sharedViewState.{tracking.RUNS_VIEW}")
    assert tracking.Tracker().experiment_id == experiment.experiment_id  # an experiment made before the view

    link = tracking.runs_page("http://127.0.0.1:5000", experiment.experiment_id)
    key = link.partition("viewStateShareKey=")[2]
    tags = tracker.client.get_experiment(experiment.experiment_id).tags
    envelope = json.loads(tags[f"mlflow.sharedViewState.{key}"])
    state = json.loads(envelope["state"])
    assert envelope["createdAt"] == experiment.creation_time and isinstance(envelope["name"], str)
    assert state["columnOrder"][0] == "attributes.`Run Name`"  # MLflow applies the widths of ordered columns only
    assert state["selectedColumns"] == ["tags.`repsim.encoder`", "tags.`repsim.cached`"]
    tracking.show_in_runs_table(tracker.client, tracker.client.get_experiment(experiment.experiment_id),
                                ["knn_top1_k20", "linear_top1"])
    tracking.show_in_runs_table(tracker.client, tracker.client.get_experiment(experiment.experiment_id),
                                ["knn_top1_k3"])
    tracking.Tracker()  # a later run keeps the columns that earlier runs added
    envelope = json.loads(tracker.client.get_experiment(experiment.experiment_id).tags[f"mlflow.sharedViewState.{key}"])
    assert json.loads(envelope["state"])["selectedColumns"] == [
        "metrics.`knn_top1_k20`", "metrics.`linear_top1`", "metrics.`knn_top1_k3`", *state["selectedColumns"]]
    width = state["columnWidths"]["attributes.`Run Name`"]
    assert width >= 7 * len("features xclr-wordnet seed=1 train") + 80  # ~7 px a character, and the row's icons


OUTSIDE_METHOD = '''"""A method outside repsim: SimCLR under its own name and settings."""
from typing import Literal

from pydantic import BaseModel, ConfigDict

from repsim.methods.base import Method, TrainingData, method_spec, register
from repsim.methods.simclr import SimCLRConfig


class TinyConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    name: Literal["tiny"]
    temperature: float = 0.2


@register("tiny", settings=TinyConfig)
def build(config, data: TrainingData) -> Method:
    simclr = SimCLRConfig(name="simclr", temperature=config.method.temperature)
    return method_spec("simclr").build(config.model_copy(update={"method": simclr}), data)
'''


def install_outside(module: str, text: str, group: str, name: str, tmp_path: Path) -> Path:
    """Install the one-module package ``module`` (source ``text``), naming it as ``name`` under the entry-point
    ``group``, into a folder of its own; that folder."""
    package, site = tmp_path / "package", tmp_path / "site"
    package.mkdir()
    (package / f"{module}.py").write_text(text)
    (package / "pyproject.toml").write_text(f'''[build-system]
requires = ["setuptools"]
build-backend = "setuptools.build_meta"

[project]
name = "repsim-{module.replace("_", "-")}"
version = "0.1"

[project.entry-points."{group}"]
{name} = "{module}"

[tool.setuptools]
py-modules = ["{module}"]
''')
    installed = subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-index",
                                "--no-build-isolation", "--target", str(site), str(package)],
                               capture_output=True, text=True)
    assert installed.returncode == 0, installed.stderr
    return site


def page_module(page: str) -> str:
    """The module a documentation page shows: its first python block."""
    return re.search(r"```python\n(.*?)```", (REPO / "docs" / page).read_text(), re.DOTALL).group(1)


@pytest.mark.slow
@pytest.mark.orchestration
def test_a_stage_installed_as_a_package_runs_in_an_experiment(pets_16px, tmp_path):
    site = install_outside("count_stage", page_module("adding-a-stage.md"), "repsim.sections", "count", tmp_path)
    experiment = tmp_path / "counted.yaml"
    experiment.write_text(f"name: counted\ndata: {pets_16px}\nstages:\n  - kind: count\n    split: test\n")
    home, command = tmp_path / "home", [REPSIM, "run", str(experiment)]
    without = subprocess.run(command, capture_output=True, text=True, env=isolated_env(home), timeout=600)
    assert without.returncode == 2 and ("field 'stages.kind' is 'count', which is not known; use one of 'shard', "
                                        "'precompute', 'train', 'evaluate', 'align'") in without.stderr
    env = isolated_env(home) | {"PYTHONPATH": str(site)}
    runs = [subprocess.run([*command, *extra], capture_output=True, text=True, env=env, timeout=600)
            for extra in ([], [], ["--force", "count"], ["--force", "cont"])]
    assert [run.returncode for run in runs] == [0, 0, 0, 2], runs[0].stderr
    [shards] = (home / "artifacts" / "shard").glob("[!.]*")
    tests = split_rows(shards / MANIFEST, "test").num_rows
    counted = [[line.split() for line in run.stdout.splitlines() if line.startswith("count ")] for run in runs[:3]]
    assert [rows[0][1:4] for rows in counted] == [[str(tests), "test", "samples"]] * 3
    assert [rows[0][4] for rows in counted] == ["no", "yes", "no"]  # built, cached, forced
    assert "--force cont: no stage of that name; use one of" in runs[3].stderr


def test_a_method_installed_as_a_package_trains_with_repsim_train(pets_16px, tmp_path):
    site = install_outside("tiny_method", OUTSIDE_METHOD, "repsim.methods", "tiny", tmp_path)
    config = tmp_path / "tiny.yaml"
    config.write_text(f"data: {{spec: {pets_16px}, image_size: 16}}\nmethod: {{name: tiny, temperature: 0.3}}\n")
    command = [REPSIM, "train", str(config), "--set", "optim.epochs=1", "--set", "optim.batch_size=4",
               "--set", "optim.num_workers=0", "--set", "optim.warmup_epochs=0", "--set", "monitor.knn=false",
               "--set", "model.projection_dim=8", "--set", "model.projection_hidden_dim=16"]
    home = tmp_path / "home"
    without = subprocess.run(command, capture_output=True, text=True, env=isolated_env(home), timeout=600)
    assert without.returncode == 2 and "field 'method.name' is 'tiny', which is not known" in without.stderr
    done = subprocess.run(command, capture_output=True, text=True, timeout=600,
                          env=isolated_env(home) | {"PYTHONPATH": str(site)})
    assert done.returncode == 0, done.stderr
    [output] = [p for p in (home / "artifacts" / "train").iterdir() if not p.name.startswith(".")]
    assert done.stdout.strip().endswith(f"trained: {output}")
    assert json.loads((output / "stage.json").read_text())["config"]["method"] == {"name": "tiny", "temperature": 0.3}
