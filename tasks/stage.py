"""What every stage task shares: Prefect's cache key is the stage key, and each stage run is logged
to MLflow as a nested run, whether it ran or was served from cache."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from prefect.context import TaskRunContext
from prefect.states import State

from repsim.stage import Stage, read_record
from repsim.tasks.tracking import StageRun, Tracker

Plan = Callable[..., tuple[Stage, Path]]


def stage_cache_key(plan: Plan) -> Callable[[TaskRunContext, dict[str, Any]], str | None]:
    """A Prefect ``cache_key_fn`` for a task whose parameters ``plan`` turns into (stage, out_dir).

    The key is the stage key once the output directory is complete, and None (no cache) before, so a
    deleted output is rebuilt rather than served stale from Prefect's result store.
    """

    def key(_: TaskRunContext, parameters: dict[str, Any]) -> str | None:
        stage, out = plan(**parameters)
        record = read_record(out) if out.is_dir() else None
        return f"{stage.name}-{stage.key}" if record and record.get("key") == stage.key else None

    return key


def log_stage(tracker: Tracker, parent: StageRun, path: Path, state: State,
              artifacts: Iterable[Path] = ()) -> None:
    """Log a finished stage (its ``stage.json`` at ``path``) as a nested run under ``parent``."""
    record = read_record(path)
    cached = state.name == "Cached" or bool(getattr(state.result(), "cached", False))
    with tracker.stage_run(parent.run_id, record["stage"], record["key"], path) as run:
        run.log_stage_output(path, cached, artifacts)
