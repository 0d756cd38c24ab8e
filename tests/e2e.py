"""Helpers for end-to-end tests: run the ``repsim`` console script, read back its MLflow runs."""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import yaml
from mlflow.entities import Run
from mlflow.tracking import MlflowClient

REPSIM = str(Path(sys.executable).parent / "repsim")
REPO = Path(__file__).resolve().parents[1]


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def isolated_env(home: Path) -> dict[str, str]:
    """This environment with ``REPSIM_HOME=home`` and no Prefect/MLflow server settings inherited."""
    env = {key: value for key, value in os.environ.items() if not key.startswith(("PREFECT_", "MLFLOW_"))}
    return env | {"REPSIM_HOME": str(home)}


def repsim(home: Path, *args: str) -> subprocess.CompletedProcess:
    """``repsim ARGS`` in :func:`isolated_env`."""
    return subprocess.run([REPSIM, *args], capture_output=True, text=True, env=isolated_env(home), timeout=600)


def flow_runs(home: Path, flow: str) -> list[tuple[Run, list[Run]]]:
    """Each MLflow parent run of ``flow`` under ``home`` (oldest first) with its nested stage runs."""
    client = MlflowClient(tracking_uri=f"sqlite:///{home / 'mlflow.db'}")
    experiment = client.get_experiment_by_name("repsim")
    found = client.search_runs([experiment.experiment_id], order_by=["attributes.start_time ASC"])
    return [(parent, [run for run in found if run.data.tags.get("mlflow.parentRunId") == parent.info.run_id])
            for parent in found if parent.data.tags.get("repsim.flow") == flow]


def built_then_cached(home: Path, stage_names: list[str]) -> list[tuple[Run, list[Run]]]:
    """The two experiment flow runs under ``home`` (:func:`flow_runs`), asserting that each tracks one
    finished nested run per stage of ``stage_names``, built in the first run and cached in the second."""
    runs = flow_runs(home, "experiment")
    assert len(runs) == 2
    for (parent, children), cached in zip(runs, ("false", "true")):
        assert sorted(run.data.tags["repsim.stage"] for run in children) == sorted(stage_names)
        assert {run.data.tags["repsim.cached"] for run in children} == {cached}
        assert all(run.info.status == "FINISHED" for run in [parent, *children])
    return runs


def logged_files(client: MlflowClient, run: Run) -> set[str]:
    """The output files a stage run shows: its artifacts, or, for a cached stage, the files it refers to."""
    referred = {tag.removeprefix("repsim.file.") for tag in run.data.tags if tag.startswith("repsim.file.")}
    return {artifact.path for artifact in client.list_artifacts(run.info.run_id)} | referred


def write_experiment(folder: Path, stages: list[dict], name: str = "tiny", data: str = "spec.yaml") -> Path:
    """An experiment YAML ``folder/<name>.yaml`` with ``stages``."""
    path = folder / f"{name}.yaml"
    path.write_text(yaml.safe_dump({"name": name, "data": data, "stages": stages}, sort_keys=False))
    return path


def tiny_experiment(folder: Path, make_image_folder, write_spec, align: bool = False) -> Path:
    """An experiment on 16 images of 16×16 pixels (2 classes, half train, half test) that takes
    seconds: WordNet similarity, one epoch of SupCon with batches of 4, kNN of it and of raw pixels,
    and, with ``align``, a few GeRA steps on 4 pairs."""
    root = make_image_folder({"cat": 8, "dog": 8}, size=16)
    spec = write_spec({"name": "pets", "source": {"type": "image_folder", "root": str(root)},
                       "classes": {"cat": "cat.n.01", "dog": "dog.n.01"},
                       "split": {"type": "random", "fractions": {"train": 0.5, "test": 0.5}}})
    settings = {"data": {"image_size": 16},
                "optim": {"epochs": 1, "batch_size": 4, "num_workers": 0, "warmup_epochs": 0},
                "model": {"small_images": False, "projection_dim": 8, "projection_hidden_dim": 16},
                "monitor": {"knn": False}}
    return write_experiment(folder, [
        {"kind": "precompute", "captions": False, "wordnet": ["wup"], "neighbors": 0},
        {"kind": "train", "settings": settings, "methods": [{"config": str(REPO / "configs" / "supcon.yaml")}]},
        {"kind": "evaluate", "suites": ["knn"], "knn_k": [3], "pixels": True},
        *([{"kind": "align", "config": str(REPO / "configs" / "gera.yaml"), "settings": TINY_ALIGN}] if align else [])],
        data=str(spec))


TINY_ALIGN = {"pairing": {"pairs": 4}, "neighbors": {"count": 3}, "geometry": {"samples": 2},
              "optim": {"epochs": 2, "batch_size": 4, "warmup_epochs": 0}, "asif": {"k": 4}}


def prefect_query(home: Path, body: str) -> object:
    """The JSON that ``body`` (lines of an ``async def main()`` holding ``client``, a Prefect client,
    that ``print(json.dumps(...))``) prints, run against the embedded Prefect store under ``home``."""
    script = ("import asyncio, json\n"
              "from prefect.client.orchestration import get_client\n"
              "from prefect.client.schemas.filters import *\n"
              "async def main():\n"
              "    async with get_client() as client:\n"
              + "".join(f"        {line}\n" for line in body.strip().splitlines()) +
              "asyncio.run(main())\n")
    env = isolated_env(home) | {"PREFECT_HOME": str(home / "prefect"), "PREFECT_SERVER_ANALYTICS_ENABLED": "false"}
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300, cwd=REPO)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])
