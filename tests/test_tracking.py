"""What the UIs show of a run: an MLflow experiment that opens on its runs, stage runs that span the
stage's own time, trained encoders as registered MLflow models that `repsim eval` takes back, Prefect
task runs that are *Cached* from the first rerun on with one summary line each in their logs (and built
again once the stage store lost their output), and retries for transient failures only."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import mlflow
import mlflow.pytorch
import pytest
import requests
import torch
import yaml
from e2e import flow_runs, prefect_query, repsim, tiny_experiment
from mlflow.exceptions import MlflowException
from mlflow.tracking import MlflowClient

from repsim.errors import DataError
from repsim.models import load_encoder
from repsim.stage import read_record
from repsim.tasks.stage_tasks import transient
from repsim.tasks.tracking import EXPERIMENT_KIND, StageRun, share_file


def raised_from(cause: BaseException, error: BaseException) -> BaseException:
    try:
        try:
            raise cause
        except BaseException as inner:
            raise error from inner
    except BaseException as outer:
        return outer


@pytest.mark.parametrize(("error", "retried"), [
    (ConnectionRefusedError("refused"), True),
    (TimeoutError("timed out"), True),
    (requests.ConnectionError("Max retries exceeded"), True),
    (raised_from(requests.ConnectionError("no route"), MlflowException("API request failed")), True),
    (DataError("shard x.tar is truncated", "re-run the shard stage"), False),
    (raised_from(ConnectionError("refused"), DataError("cannot read", "fix it")), False),  # says what to fix
    (FileNotFoundError("no such file"), False),
    (ValueError("bad value"), False),
    (None, False),
])
def test_only_transient_failures_are_retried(error, retried):
    assert transient(error) is retried


class RecordingClient:
    """Stands in for MlflowClient: records what is logged, with a tracking URI of our choosing."""

    def __init__(self, tracking_uri: str):
        self.tracking_uri, self.logged, self.tags = tracking_uri, [], {}

    def log_artifact(self, run_id, path):
        self.logged.append(path)

    def set_tag(self, run_id, key, value):
        self.tags[key] = value


@pytest.mark.parametrize("uri", ["http://mlflow:5000", "https://tracking.example"])
def test_a_server_store_receives_large_files_too(tmp_path, uri, monkeypatch):
    monkeypatch.setattr("repsim.tasks.tracking.SMALL_ARTIFACT_BYTES", 100)
    large = tmp_path / "checkpoint.pt"
    large.write_bytes(b"x" * 101)
    client = RecordingClient(uri)
    StageRun(client, "run").log_artifacts([large])
    assert client.logged == [str(large)] and not client.tags


# ---------------------------------------------------------------------------------------------
# End to end

def prefect_task_runs(home) -> list[dict]:
    """Every task run in the Prefect store under ``home``: name, flow run, state and log lines."""
    return prefect_query(home, """
found = []
for run in await client.read_task_runs():
    logs = await client.read_logs(LogFilter(task_run_id=LogFilterTaskRunId(any_=[run.id])))
    found.append({'name': run.name, 'flow_run': str(run.flow_run_id), 'state': run.state.name,
                  'start': run.expected_start_time.isoformat(), 'logs': [log.message for log in logs]})
print(json.dumps(found))""")


def store_files(home: Path) -> dict[str, int]:
    """Every file under ``home`` and its size."""
    return {str(path.relative_to(home)): path.stat().st_size for path in home.rglob("*") if path.is_file()}


RECORDS = (".db", ".db-wal", ".db-shm", ".lock")  # the stores' databases: a rerun's runs and states go there


def test_a_copy_becomes_a_link_only_when_its_bytes_are_the_same(tmp_path):
    source, same, other, longer = (tmp_path / name for name in ("source", "same", "other", "longer"))
    source.write_bytes(b"weights")
    same.write_bytes(b"weights")
    other.write_bytes(b"WEIGHTS")
    longer.write_bytes(b"weights and more")
    for copy in (same, other, longer, tmp_path / "absent"):
        share_file(source, copy)
    assert os.path.samefile(source, same) and same.read_bytes() == b"weights"
    assert not os.path.samefile(source, other) and other.read_bytes() == b"WEIGHTS"
    assert not os.path.samefile(source, longer) and not (tmp_path / "absent").exists()
    assert sorted(path.name for path in tmp_path.iterdir()) == ["longer", "other", "same", "source"]  # no .link left


def assert_stored_once(trained: Path, model: Path, client: MlflowClient, run_id: str) -> None:
    """The encoder's weights are one file on disk, in the stage output and the logged model, and nowhere else."""
    assert os.path.samefile(trained / "encoder.pt", model / "data" / "model.pt2")
    assert sorted(path.relative_to(model).as_posix() for path in model.rglob("*.pt*")) == ["data/model.pt2"]
    assert not (trained / "checkpoint.pt").exists()  # removed once the stage completed
    assert {artifact.path for artifact in client.list_artifacts(run_id)} == {"stage.json", "metrics.jsonl"}


@pytest.mark.slow
@pytest.mark.orchestration
def test_runs_models_and_cache_hits_are_what_the_uis_show(make_image_folder, write_spec, tmp_path, monkeypatch):
    experiment = str(tiny_experiment(tmp_path, make_image_folder, write_spec, align=True))
    home = tmp_path / "home"
    spec = yaml.safe_load(Path(experiment).read_text())["data"]
    files = []
    for _ in range(2):
        done = repsim(home, "run", experiment)
        assert done.returncode == 0, done.stderr
        files.append(store_files(home))
    grown = {name: size - files[0].get(name, 0) for name, size in files[1].items() if size != files[0].get(name)}

    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{home / 'mlflow.db'}")
    client = MlflowClient()
    assert client.get_experiment_by_name("repsim").tags.items() >= EXPERIMENT_KIND.items()
    (first, stages), (second, _) = flow_runs(home, "experiment")
    table = f"mlartifacts/{second.info.run_id}/"  # the rerun's own result table and target histograms
    assert not {name for name in grown if not name.endswith(RECORDS) and not name.startswith(table)}, grown
    assert sum(grown.values()) < 4 * 2**20, grown  # a cached rerun copies no output: its records alone
    for run in stages:  # every stage ran in the first run: its MLflow run spans the stage's own time
        record = read_record(Path(run.data.tags["repsim.output"]))
        spent = (run.info.end_time - run.info.start_time) / 1000
        assert spent >= 0.9 * record["seconds"], (run.info.run_name, spent, record["seconds"])

    [train] = [run for run in stages if run.data.tags["repsim.stage"] == "train"]
    assert first.info.run_name.startswith("tiny 20") and second.info.run_name.startswith("tiny 20")
    assert not {"supcon.steps", "supcon.epochs", "supcon.loss"} & set(first.data.metrics)  # align's bookkeeping
    assert {run.data.tags["repsim.experiment"] for run in stages} == {"tiny"}  # a filter across experiments
    colours = {run.data.tags.get("repsim.encoder"): run.data.tags.get("mlflow.runColor") for run in stages}
    assert colours[None] is None and len({colours["pixels"], colours["supcon"]}) == 2  # one per encoder
    assert {run.data.tags["mlflow.runColor"] for run in stages if run.data.tags.get("repsim.encoder") == "supcon"} == {
        colours["supcon"]}
    [cached_train] = [run for run in flow_runs(home, "experiment")[1][1] if run.data.tags["repsim.stage"] == "train"]
    assert cached_train.data.tags["mlflow.runColor"] == colours["supcon"]  # the same colour on the rerun
    assert cached_train.data.tags["repsim.built_by"] == train.info.run_id
    note = cached_train.data.tags["mlflow.note.content"]  # the run page's overview: a link, and the files
    link = f"(#/experiments/{train.info.experiment_id}/runs/{train.info.run_id}?workflowType=machine_learning)"
    assert link in note and "metrics.jsonl`" in note
    assert cached_train.data.metrics["loss"] == train.data.metrics["loss"]  # the same final values
    curve = [(point.step, point.value) for point in client.get_metric_history(train.info.run_id, "loss")]
    assert len(curve) > 1  # and the same curves
    assert [(point.step, point.value) for point in client.get_metric_history(cached_train.info.run_id, "loss")] == curve
    trained = Path(train.data.tags["repsim.output"])
    summary = read_record(trained)["metrics"]  # the printed loss, the last epoch's mean, under its own name
    assert train.data.metrics["last_epoch_loss"] == pytest.approx(summary["loss"])
    assert train.data.metrics["loss"] == pytest.approx(summary["final_loss"])  # the curve's last step
    assert not {"steps", "epochs", "image_size", "channels", "loader_workers"} & set(train.data.metrics)  # no bars
    assert train.data.params["stage.steps"] == str(summary["steps"]) and train.data.params["stage.image_size"] == "16"
    assert cached_train.data.tags["repsim.file.metrics.jsonl"] == str(trained / "metrics.jsonl")
    assert not client.list_artifacts(cached_train.info.run_id)
    repsim_id = client.get_experiment_by_name("repsim").experiment_id
    [logged] = client.search_logged_models(experiment_ids=[repsim_id])
    assert logged.name == "tiny-supcon" and logged.source_run_id == train.info.run_id
    results = {metric.key for metric in logged.metrics}  # the model's results are its evaluation's, not training's
    assert results == {"knn_top1_k3", "knn_top5_k3"}
    assert logged.artifact_location.removeprefix("file://").startswith(str(home))
    assert not client.search_logged_models(experiment_ids=["0"])
    [version] = client.search_model_versions("name = 'tiny-supcon'")  # one version, also after the rerun
    assert version.tags["repsim.stage_key"] == train.data.tags["repsim.stage_key"]
    assert version.tags["repsim.output"] == train.data.tags["repsim.output"]
    model = mlflow.models.get_model_info(f"models:/tiny-supcon/{version.version}")
    assert model.signature is not None and model.saved_input_example_info is not None
    assert_stored_once(trained, Path(logged.artifact_location.removeprefix("file://")), client, train.info.run_id)
    images = torch.rand(3, *model.signature.inputs.to_dict()[0]["tensor-spec"]["shape"][1:])
    served = mlflow.pytorch.load_model(f"models:/tiny-supcon/{version.version}")
    torch.testing.assert_close(served(images), load_encoder(trained)(images))

    tasks = prefect_task_runs(home)
    by_flow: dict[str, list[dict]] = {}
    for task in sorted(tasks, key=lambda task: task["start"]):
        by_flow.setdefault(task["flow_run"], []).append(task)
    ran, rerun = by_flow[first.data.tags["prefect.flow_run_id"]], by_flow[second.data.tags["prefect.flow_run_id"]]
    assert {task["state"] for task in ran} == {"Completed"} and {task["state"] for task in rerun} == {"Cached"}
    assert "train supcon" in {task["name"] for task in ran} and "shard" in {task["name"] for task in ran}
    for tasks_run, how in ((ran, "; built in "), (rerun, "; found complete in the cache -> ")):
        for task in tasks_run:  # each task run's own log: one summary line, also when Prefect served it
            [summary] = [line for line in task["logs"] if line.startswith(f"{task['name']}: ")]
            assert how in summary and " -> " in summary, summary

    evaluated = repsim(home, "eval", spec, "--encoder", f"models:/tiny-supcon/{version.version}", "--suite", "knn",
                       "--k", "3")
    assert evaluated.returncode == 0, evaluated.stderr
    knn = [line.split()[-1] for line in evaluated.stdout.splitlines() if "knn_top1_k3" in line]
    assert knn == [f"{first.data.metrics['supcon.knn_top1_k3']:.4g}"]  # the registered encoder is the trained one

    shutil.rmtree(trained)  # the store is the one truth for "done": what Prefect remembers does not serve it
    again = repsim(home, "run", experiment)
    assert again.returncode == 0, again.stderr
    third = flow_runs(home, "experiment")[-1][0].data.tags["prefect.flow_run_id"]
    states = {task["name"]: task["state"] for task in prefect_task_runs(home) if task["flow_run"] == third}
    assert states["train supcon"] == "Completed" and states["shard"] == "Cached", states
    assert read_record(trained)["key"] == train.data.tags["repsim.stage_key"]
