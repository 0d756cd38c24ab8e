"""What every stage task shares (:func:`stage_task`): Prefect's cache key is the stage key, a built
output's result is stored under that key at once, so the first rerun shows as *Cached*; each task
logs one summary line through Prefect's run logger; only transient failures (a connection) are
retried. Each stage run is logged to MLflow as a nested run spanning the stage's own start and end,
whether it ran or was served from cache."""

from __future__ import annotations

import functools
import hashlib
import inspect
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import httpx
import requests
from prefect import Task, task
from prefect.context import TaskRunContext
from prefect.logging import get_run_logger
from prefect.results import get_result_store
from prefect.runtime import task_run
from prefect.states import State

from repsim.errors import RepsimError
from repsim.stage import Stage, StageOutput, is_current, read_record
from repsim.tasks.tracking import StageRun, Tracker, stage_span, stage_tags

Plan = Callable[..., Stage]
RETRY_DELAYS_S = [5, 30]  # waits before the retries of a transient failure
TRANSIENT = (ConnectionError, TimeoutError, httpx.TransportError, requests.ConnectionError,  # a server that did
             requests.Timeout)  # not answer, or dropped the connection (Prefect's client, MLflow's)


def stage_cache_key(plan: Plan) -> Callable[[TaskRunContext, dict[str, Any]], str | None]:
    """A Prefect ``cache_key_fn`` for a task whose parameters ``plan`` turns into its stage (see
    :func:`_planned`).

    The key is the stage key and the output directory once that directory is complete and intact, and
    None (no cache) before, while it is being rebuilt (:func:`repsim.stage.rebuilding`) or once it is
    damaged, so a deleted, forced or damaged output is built again rather than served stale from
    Prefect's result store, and a result is never served for another directory (another
    ``REPSIM_HOME`` sharing the Prefect store).
    """

    def key(_: TaskRunContext, parameters: dict[str, Any]) -> str | None:
        stage, out = _planned(plan, parameters)
        where = hashlib.sha256(str(out.resolve()).encode()).hexdigest()[:12]
        return f"{stage.name}-{stage.key}-{where}" if current_record(stage, out) is not None else None

    return key


def stage_task(name: str, plan: Plan) -> Callable[[Callable[..., StageOutput]], Task]:
    """``@task`` for a stage whose parameters ``plan`` turns into its stage: cached by
    :func:`stage_cache_key`; once the output is built (or found complete by repsim) its result is
    stored under that key too, so the next run is *Cached* in Prefect, not only the one after; one
    summary line per run goes to the task's log; retried with backoff on :func:`transient` failures only."""

    def decorate(produce: Callable[..., StageOutput]) -> Task:
        key_of = stage_cache_key(plan)
        signature = inspect.signature(produce)
        produce.plan = plan  # for plan_call

        @functools.wraps(produce)
        def run(*args: Any, **kwargs: Any) -> StageOutput:
            output = produce(*args, **kwargs)
            bound = signature.bind(*args, **kwargs)
            bound.apply_defaults()
            key = key_of(None, dict(bound.arguments))
            if key is not None:
                get_result_store().write(output, key=key)
            get_run_logger().info(summary_line(output, task_run.get_name()))
            return output

        return task(name=name, cache_key_fn=key_of, persist_result=True, retries=len(RETRY_DELAYS_S),
                    retry_delay_seconds=RETRY_DELAYS_S, retry_condition_fn=retry_if_transient)(run)

    return decorate


def plan_call(stage_task: Task, args: tuple, kwargs: dict[str, Any]) -> tuple[Stage, Path]:
    """(stage, out_dir) of a call of a :func:`stage_task` with these arguments, without running it."""
    bound = inspect.signature(stage_task.fn).bind(*args, **kwargs)
    bound.apply_defaults()
    return _planned(stage_task.fn.plan, bound.arguments)


def _planned(plan: Plan, parameters: dict[str, Any]) -> tuple[Stage, Path]:
    """(stage, out_dir) of a stage task's parameters: ``plan`` takes, by name, the ones that decide the
    stage; the output goes to the task's ``out_dir`` when it has one and it is set, else the stage's default."""
    wanted = inspect.signature(plan).parameters
    stage = plan(**{name: value for name, value in parameters.items() if name in wanted})
    return stage, stage.output_dir(parameters.get("out_dir"))


def transient(error: BaseException | None) -> bool:
    """Whether ``error``, or an error it was raised from, is a connection that failed or timed out
    (worth retrying); never a RepsimError, which says what to fix and would fail again."""
    while error is not None and not isinstance(error, RepsimError):
        if isinstance(error, TRANSIENT):
            return True
        error = error.__cause__ or error.__context__
    return False


def retry_if_transient(_: Task, __: Any, state: State) -> bool:
    """Prefect's ``retry_condition_fn``: retry a failed stage task only after a :func:`transient` error."""
    return transient(state.result(raise_on_failure=False))


def summary_line(output: StageOutput, name: str | None = None) -> str:
    """``train simclr: xclr, 186 steps, loss 4.120; built in 95.2 s -> /path``: what the stage task
    ``name`` (default: the stage's name) did."""
    record = read_record(output.path)
    how = "found complete in the cache" if output.cached else f"built in {record.get('seconds', 0):.1f} s"
    return f"{name or record['stage']}: {describe(record)}; {how} -> {output.path}"


def current_record(stage: Stage, out: Path) -> dict[str, Any] | None:
    """The ``stage.json`` record of ``out`` if it is a complete output of ``stage`` not to be rebuilt:
    its files match the record (their hashes too, inside :func:`repsim.stage.verifying`)."""
    record = read_record(out) if out.is_dir() else None
    return record if record is not None and record.get("key") == stage.key and is_current(out, record) else None


def from_prefect_cache(state: State) -> bool:
    """Whether Prefect served the task run ``state`` from its cache, so the task did not run."""
    return state.name == "Cached"


def reused(state: State) -> bool:
    """Whether the finished stage task ``state`` built nothing: Prefect served it from its cache, or
    the task found the stage's output complete."""
    return from_prefect_cache(state) or state.result().cached


def log_stage(tracker: Tracker, parent: StageRun, path: Path, state: State,
              artifacts: Iterable[Path] = (), label: str | None = None, encoder: str | None = None) -> None:
    """Log a finished stage (its ``stage.json`` at ``path``) as a nested run under ``parent``, about
    ``encoder`` (:func:`stage_tags`)."""
    record = read_record(path)
    cached = reused(state)
    with tracker.stage_run(parent.run_id, record["stage"], record["key"], path, label,
                           None if cached else stage_span(record),
                           stage_tags(record["stage"], record["config"], encoder)) as run:
        run.log_stage_output(path, cached, artifacts)


def track(tracker: Tracker, parent: StageRun, summaries: list[dict], state: State,
          artifacts: Sequence[str] = (), label: str | None = None, self_logging: bool = False,
          encoder: str | None = None) -> Any:
    """Log a finished stage task as a nested run (named with ``label``, with the files of its output
    matching the glob patterns ``artifacts``), append its summary to ``summaries``, and return its
    result. A ``self_logging`` task (train, align) logged its run while it ran, unless Prefect served
    it from its cache."""
    result = state.result()
    if not self_logging or from_prefect_cache(state):
        log_stage(tracker, parent, result.path, state,
                  sorted(path for pattern in artifacts for path in result.path.glob(pattern)), label, encoder)
    record = read_record(result.path)
    summaries.append({"stage": record["stage"], "detail": ": ".join(filter(None, [label, describe(record)])),
                      "key": result.key, "path": str(result.path),
                      "cached": reused(state)})
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
                 artifacts: Sequence[str], label: str | None = None,
                 then: Callable[[StageRun, StageOutput], Any] | None = None, encoder: str | None = None) -> StageOutput:
    """``produce(log)`` inside a nested run for ``stage`` (named with ``label``, about ``encoder``, default
    ``label``) under ``parent_run_id``: the curves it passes to ``log(metrics, step)`` stream to MLflow;
    then the output is logged with the files ``artifacts`` of its directory (those that exist), and
    ``then(run, output)`` is called."""
    streamed: set[str] = set()
    with Tracker().stage_run(parent_run_id, stage.name, stage.key, stage.default_dir(), label,
                             tags=stage_tags(stage.name, stage.config, encoder or label)) as run:

        def log(metrics: dict[str, float], step: int) -> None:
            streamed.update(metrics)
            run.log_metrics(metrics, step)

        output = produce(log)
        run.log_stage_output(output.path, output.cached, [output.path / name for name in artifacts], streamed)
        if then is not None:
            then(run, output)
    return output
