"""The train stage as a Prefect task; its loss, learning rate and kNN curves stream to MLflow.

With a distributed :class:`~repsim.experiment.TorchrunLaunch` the task runs torchrun, whose ranks
all train directly (``repsim train --direct``); the curves reach MLflow from ``metrics.jsonl`` once
it finishes.
"""

from __future__ import annotations

import json
import subprocess
import time
from dataclasses import replace

from repsim.device import gpu_slot
from repsim.experiment import TorchrunLaunch
from repsim.methods.config import Config, load_config
from repsim.methods.stage import CHECKPOINT_FILE, METRICS_FILE, train, train_stage_of
from repsim.methods.train import LogFn, TrainingError
from repsim.methods.xclr import TARGET_HISTOGRAM_FILE
from repsim.models.backbones import ENCODER_FILE
from repsim.stage import Stage, StageOutput
from repsim.tasks.stage import run_streamed, stage_task
from repsim.tasks.tracking import StageRun

ARTIFACTS = (METRICS_FILE, ENCODER_FILE, CHECKPOINT_FILE, TARGET_HISTOGRAM_FILE)  # those that exist


def plan_train(config: str, overrides: list[str]) -> Stage:
    """The train stage of a config file with ``--set`` overrides (its shards must exist)."""
    return train_stage_of(load_config(config, overrides))


@stage_task("train", plan_train)
def train_task(config: str, overrides: list[str], parent_run_id: str,
               launch: TorchrunLaunch | None = None, run_name: str | None = None,
               model: str | None = None, encoder: str | None = None) -> StageOutput:
    """Train (or find cached) the config, logging to a nested MLflow run under ``parent_run_id``
    (``train <run_name>``, tagged with the ``encoder`` it trains, default ``run_name``); with a distributed
    ``launch``, through torchrun. With ``model``, the encoder is logged as an MLflow model and registered
    under that name (one version per stage key)."""
    resolved = load_config(config, overrides)

    def produce(log: LogFn) -> StageOutput:
        if launch is not None and launch.distributed:
            return _train_with_torchrun(resolved, launch.command(config, overrides), log)
        with gpu_slot() as device:  # trainings that run at once each get a GPU of their own
            return train(resolved, log=log, device=device)

    def register(run: StageRun, output: StageOutput) -> None:
        run.log_encoder(output.path, model)

    return run_streamed(parent_run_id, train_stage_of(resolved), produce, ARTIFACTS, run_name,
                        register if model else None, encoder=encoder)


def _train_with_torchrun(resolved: Config, command: list[str], log: LogFn) -> StageOutput:
    """Run ``command`` (torchrun), then replay its ``metrics.jsonl`` into ``log``."""
    started = time.time()
    exit_code = subprocess.run(command, check=False).returncode
    if exit_code:
        raise TrainingError(f"torchrun exited with code {exit_code}", "see the ranks' output above")
    output = train(resolved, progress=False)  # complete now: returns the output at once
    trained = output.record["started"] >= started
    if trained:
        for line in (output.path / METRICS_FILE).read_text().splitlines():
            metrics = json.loads(line)
            log(metrics, metrics.pop("step"))
    return replace(output, cached=not trained)
