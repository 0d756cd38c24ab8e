"""What every stage task shares: Prefect's cache key is the stage key, and each stage run is logged
to MLflow as a nested run, whether it ran or was served from cache."""

from __future__ import annotations

import hashlib

from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

from prefect.context import TaskRunContext
from prefect.states import State

from repsim.stage import Stage, StageOutput, is_current, read_record
from repsim.tasks.tracking import StageRun, Tracker

Plan = Callable[..., tuple[Stage, Path]]


def stage_cache_key(plan: Plan) -> Callable[[TaskRunContext, dict[str, Any]], str | None]:
    """A Prefect ``cache_key_fn`` for a task whose parameters ``plan`` turns into (stage, out_dir).

    The key is the stage key and the output directory once that directory is complete and intact, and
    None (no cache) before, while it is being rebuilt (:func:`repsim.stage.rebuilding`) or once it is
    damaged, so a deleted, forced or damaged output is built again rather than served stale from
    Prefect's result store, and a result is never served for another directory (another
    ``REPSIM_HOME`` sharing the Prefect store).
    """

    def key(_: TaskRunContext, parameters: dict[str, Any]) -> str | None:
        stage, out = plan(**parameters)
        where = hashlib.sha256(str(out.resolve()).encode()).hexdigest()[:12]
        return f"{stage.name}-{stage.key}-{where}" if current_record(stage, out) is not None else None

    return key


def current_record(stage: Stage, out: Path) -> dict[str, Any] | None:
    """The ``stage.json`` record of ``out`` if it is a complete output of ``stage`` not to be rebuilt:
    its files match the record (their hashes too, inside :func:`repsim.stage.verifying`)."""
    record = read_record(out) if out.is_dir() else None
    return record if record is not None and record.get("key") == stage.key and is_current(out, record) else None


def log_stage(tracker: Tracker, parent: StageRun, path: Path, state: State,
              artifacts: Iterable[Path] = (), label: str | None = None) -> None:
    """Log a finished stage (its ``stage.json`` at ``path``) as a nested run under ``parent``."""
    record = read_record(path)
    cached = state.name == "Cached" or bool(getattr(state.result(), "cached", False))
    with tracker.stage_run(parent.run_id, record["stage"], record["key"], path, label) as run:
        run.log_stage_output(path, cached, artifacts)


def track(tracker: Tracker, parent: StageRun, summaries: list[dict], state: State,
          artifacts: Sequence[str] = (), label: str | None = None, self_logging: bool = False) -> Any:
    """Log a finished stage task as a nested run (named with ``label``, with the files of its output
    matching the glob patterns ``artifacts``), append its summary to ``summaries``, and return its
    result. A ``self_logging`` task (train, align) logged its run while it ran, unless Prefect served
    it from its cache."""
    result = state.result()
    if not self_logging or state.name == "Cached":
        log_stage(tracker, parent, result.path, state,
                  sorted(path for pattern in artifacts for path in result.path.glob(pattern)), label)
    record = read_record(result.path)
    summaries.append({"stage": record["stage"], "detail": ": ".join(filter(None, [label, describe(record)])),
                      "key": result.key, "path": str(result.path),
                      "cached": result.cached or state.name == "Cached"})
    return result


def describe(record: dict) -> str:
    """One line on what a stage produced, for summary tables."""
    stage, config, metrics = record["stage"], record["config"], record["metrics"]
    if stage == "captions":
        return f"{metrics['samples']} x {metrics['dim']}, {metrics['unique_captions']} distinct captions"
    if stage == "wordnet":
        return f"{config['measure']}, {metrics['classes']} classes"
    if stage == "neighbors":
        recall = f", recall {metrics['recall_tie_aware']:.3f}" if "recall_tie_aware" in metrics else ""
        return f"{config['index']} k={config['k']}{recall}"
    if stage == "features":
        return f"{config['split']}: {metrics['samples']} x {metrics['dim']}"
    if stage == "evaluate":
        return ", ".join(config["suites"])
    if stage == "train":
        return f"{config['method']['name']}, {metrics['steps']} steps, loss {metrics['loss']:.3f}"
    if stage == "align":
        return ", ".join(f"{name} {metrics[name]:.3f}" for name in ("zeroshot_top1", "i2t_r1") if name in metrics)
    return f"{metrics['samples']} samples"


def run_streamed(parent_run_id: str, stage: Stage, produce: Callable[[Callable[[dict[str, float], int], None]],
                                                                      StageOutput],
                 artifacts: Sequence[str], label: str | None = None) -> StageOutput:
    """``produce(log)`` inside a nested run for ``stage`` (named with ``label``) under ``parent_run_id``:
    the curves it passes to ``log(metrics, step)`` stream to MLflow; then the output is logged with the
    files ``artifacts`` of its directory (those that exist)."""
    streamed: set[str] = set()
    with Tracker().stage_run(parent_run_id, stage.name, stage.key, stage.default_dir(), label) as run:

        def log(metrics: dict[str, float], step: int) -> None:
            streamed.update(metrics)
            run.log_metrics(metrics, step)

        output = produce(log)
        run.log_stage_output(output.path, output.cached, [output.path / name for name in artifacts], streamed)
    return output
