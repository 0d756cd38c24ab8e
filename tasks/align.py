"""The align stage as a Prefect task; its loss curves stream to MLflow, its scores and figures follow."""

from __future__ import annotations

from repsim.align.config import load_align_config
from repsim.align.stage import LOSS_PLOT_FILE, RESULTS_FILE, align, align_stage_of
from repsim.align.train import ALIGNMENT_FILE
from repsim.methods.stage import METRICS_FILE
from repsim.stage import Stage, StageOutput
from repsim.tasks.stage import run_streamed, stage_task

ARTIFACTS = (RESULTS_FILE, LOSS_PLOT_FILE, METRICS_FILE, ALIGNMENT_FILE)


def plan_align(config: str, overrides: list[str]) -> Stage:
    """The align stage of a config file with ``--set`` overrides (its shards must exist)."""
    return align_stage_of(load_align_config(config, overrides))


@stage_task("align", plan_align)
def align_task(config: str, overrides: list[str], parent_run_id: str, run_name: str | None = None,
               encoder: str | None = None) -> StageOutput:
    """Align (or find cached) the config, logging to a nested MLflow run under ``parent_run_id``
    (``align <run_name>``, tagged with the ``encoder`` it aligns, default ``run_name``)."""
    resolved = load_align_config(config, overrides)
    return run_streamed(parent_run_id, align_stage_of(resolved), lambda log: align(resolved, log=log), ARTIFACTS,
                        run_name, encoder=encoder)
