"""Helpers for end-to-end tests: run the ``repsim`` console script, read back its MLflow runs."""

import os
import subprocess
import sys
from pathlib import Path

from mlflow.entities import Run
from mlflow.tracking import MlflowClient

REPSIM = str(Path(sys.executable).parent / "repsim")


def repsim(home: Path, *args: str) -> subprocess.CompletedProcess:
    """``repsim ARGS`` with ``REPSIM_HOME=home`` and no Prefect/MLflow server settings inherited."""
    env = {key: value for key, value in os.environ.items() if not key.startswith(("PREFECT_", "MLFLOW_"))}
    env["REPSIM_HOME"] = str(home)
    return subprocess.run([REPSIM, *args], capture_output=True, text=True, env=env, timeout=600)


def flow_runs(home: Path, flow: str) -> list[tuple[Run, list[Run]]]:
    """Each MLflow parent run of ``flow`` under ``home`` (oldest first) with its nested stage runs."""
    client = MlflowClient(tracking_uri=f"sqlite:///{home / 'mlflow.db'}")
    experiment = client.get_experiment_by_name("repsim")
    found = client.search_runs([experiment.experiment_id], order_by=["attributes.start_time ASC"])
    return [(parent, [run for run in found if run.data.tags.get("mlflow.parentRunId") == parent.info.run_id])
            for parent in found if parent.data.tags.get("repsim.flow") == flow]
