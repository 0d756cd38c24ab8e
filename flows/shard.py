"""The shard flow: turn data specs into WebDataset shards, tracked in MLflow."""

from __future__ import annotations

from prefect import flow

from repsim.errors import SpecError
from repsim.tasks.shard import shard_task
from repsim.tasks.stage import log_stage, reused
from repsim.tasks.tracking import Tracker


@flow(name="shard")
def shard_flow(specs: list[str], out_dir: str | None = None) -> list[dict]:
    """Shard every data spec in ``specs``; ``out_dir`` (one spec only) overrides the artifact root.

    Returns one summary per spec: name, key, path, cached, samples per split, errors.
    """
    if out_dir and len(specs) != 1:
        raise SpecError(f"--out names one directory but {len(specs)} specs were given", "shard one spec at a time")
    tracker = Tracker()
    summaries = []
    with tracker.flow_run("shard", {"specs": specs, "out_dir": out_dir}) as parent:
        for spec in specs:
            state = shard_task(spec, out_dir, return_state=True)
            result = state.result()
            log_stage(tracker, parent, result.path, state, artifacts=[result.manifest])
            summaries.append({"spec": spec, "key": result.key, "path": str(result.path),
                              "cached": reused(state),
                              "splits": dict(result.splits), "errors": result.errors})
    return summaries
