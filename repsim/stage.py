"""The stage/cache contract shared by every pipeline stage.

A stage's output lives in ``$REPSIM_HOME/artifacts/<stage>/<key>/`` where ``key`` hashes the stage
name, its resolved config, the keys of its inputs and the stage version. The directory is built
under a temporary name and renamed when complete, so an interrupted stage leaves nothing that looks
done; ``stage.json`` inside records config, input keys, timings, metrics and library versions.
Running a stage whose directory is complete returns at once.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import platform
import shutil
import time
import uuid
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any

from repsim.errors import StageError

STAGE_FILE = "stage.json"
TRACKED_LIBRARIES = ("repsim", "torch", "torchvision", "numpy", "webdataset", "pyarrow")


def repsim_home() -> Path:
    """The artifact root: ``$REPSIM_HOME``, default ``./.repsim``."""
    return Path(os.environ.get("REPSIM_HOME", ".repsim")).expanduser().resolve()


def artifacts_root() -> Path:
    return repsim_home() / "artifacts"


def _canonical_json(value: Any) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), default=str)


@dataclass(frozen=True)
class Stage:
    """One stage invocation: what it is, how it is configured, and what it consumes.

    ``config`` must be JSON-serialisable (a resolved pydantic config's ``model_dump(mode="json")``);
    ``inputs`` maps an input's name to its key (an upstream stage key or a source fingerprint).
    """

    name: str
    version: str
    config: Mapping[str, Any]
    inputs: Mapping[str, str] = field(default_factory=dict)

    @property
    def key(self) -> str:
        payload = {"stage": self.name, "version": self.version,
                   "config": self.config, "inputs": dict(self.inputs)}
        return hashlib.sha256(_canonical_json(payload).encode()).hexdigest()[:20]

    def default_dir(self) -> Path:
        return artifacts_root() / self.name / self.key

    def output_dir(self, out_dir: str | Path | None = None) -> Path:
        """Where the stage writes: ``out_dir`` if given, else its content-addressed default."""
        return Path(out_dir).expanduser().resolve() if out_dir is not None else self.default_dir()


@dataclass(frozen=True)
class StageOutput:
    """A completed stage directory. ``cached`` says whether this call found it already done."""

    stage: str
    key: str
    path: Path
    cached: bool
    record: dict[str, Any]

    @property
    def metrics(self) -> dict[str, float]:
        return self.record.get("metrics", {})


def fingerprint_files(paths: Iterable[Path]) -> str:
    """A digest of files' paths, sizes and modification times: an input key for source data."""
    digest = hashlib.sha256()
    for path in paths:
        stat = Path(path).stat()
        digest.update(f"{path}\0{stat.st_size}\0{stat.st_mtime_ns}\n".encode())
    return digest.hexdigest()


def read_record(path: Path) -> dict[str, Any] | None:
    """The ``stage.json`` of a completed stage directory, or None if ``path`` is not one."""
    try:
        return json.loads((path / STAGE_FILE).read_text())
    except FileNotFoundError:
        return None
    except (json.JSONDecodeError, NotADirectoryError) as err:
        raise StageError(f"{path / STAGE_FILE} is unreadable ({err})",
                         f"remove {path} and run the stage again") from err


def library_versions() -> dict[str, str]:
    versions = {"python": platform.python_version()}
    for name in TRACKED_LIBRARIES:
        with contextlib.suppress(metadata.PackageNotFoundError):
            versions[name] = metadata.version(name)
    return versions


@contextlib.contextmanager
def _exclusive(lock_path: Path) -> Iterator[None]:
    """Serialise concurrent runs of the same stage output (across processes)."""
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    with open(lock_path, "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


REBUILD_ENV = "REPSIM_REBUILD"


@contextlib.contextmanager
def rebuilding(stages: Iterable[str]) -> Iterator[None]:
    """Within the block, outputs of the named stages completed before it began are stale: the stage
    runs again and its new output replaces the old one (the old output stays until the new one is
    complete). An output built inside the block is reused. The setting travels in the environment
    variable ``REPSIM_REBUILD``, so subprocesses (e.g. torchrun ranks) see it too."""
    names = sorted(set(stages))
    previous = os.environ.get(REBUILD_ENV)
    if names:
        os.environ[REBUILD_ENV] = f"{','.join(names)}@{time.time()!r}"
    try:
        yield
    finally:
        if previous is None:
            os.environ.pop(REBUILD_ENV, None)
        else:
            os.environ[REBUILD_ENV] = previous


def is_stale(record: Mapping[str, Any]) -> bool:
    """Whether a completed output's ``stage.json`` record is to be rebuilt (see :func:`rebuilding`)."""
    names, _, since = os.environ.get(REBUILD_ENV, "").rpartition("@")
    return bool(since) and record.get("stage") in names.split(",") and record.get("started", 0) < float(since)


def _completed(stage: Stage, out: Path) -> StageOutput | None:
    record = read_record(out)
    if record is None:
        if out.exists():
            raise StageError(f"{out} exists but is not a completed {stage.name} output",
                             "choose another output directory or remove it")
        return None
    if record.get("key") != stage.key:
        raise StageError(
            f"{out} holds {record.get('stage')} output {record.get('key')}, not {stage.name} {stage.key}",
            "choose another output directory or remove it")
    return StageOutput(stage.name, stage.key, out, True, record)


def _remove_stale_temporaries(out: Path) -> None:
    for pattern in (f".{out.name}.tmp-*", f".{out.name}.old-*"):
        for stale in out.parent.glob(pattern):
            shutil.rmtree(stale, ignore_errors=True)


def _lock_path(out: Path) -> Path:
    return out.parent / f".{out.name}.lock"


def _move_into_place(tmp: Path, out: Path) -> None:
    """Rename the complete ``tmp`` to ``out``; an old ``out`` is moved aside first and removed only after."""
    if not out.exists():
        os.rename(tmp, out)
        return
    old = out.parent / f".{out.name}.old-{uuid.uuid4().hex[:8]}"
    os.rename(out, old)
    os.rename(tmp, out)
    shutil.rmtree(old, ignore_errors=True)


def run_stage(stage: Stage, build: Callable[[Path], Mapping[str, float] | None],
              out_dir: str | Path | None = None) -> StageOutput:
    """Build ``stage`` into its output directory unless it is already complete.

    ``build(tmp_dir)`` writes every output file into ``tmp_dir`` and may return metrics
    (e.g. samples, bytes); they are stored in ``stage.json``. The directory becomes visible under
    its final name only after ``build`` returns and ``stage.json`` is written. Inside
    :func:`rebuilding`, a complete output of a stage being rebuilt is built again and then replaces
    the old one.
    """
    out = stage.output_dir(out_dir)
    done = _completed(stage, out)
    if done is not None and not is_stale(done.record):
        return done
    # The lock file stays: unlinking it would let a waiting and a new process lock different files.
    with _exclusive(_lock_path(out)):
        done = _completed(stage, out)  # another process may have finished it meanwhile
        if done is not None and not is_stale(done.record):
            return done
        record = _build_atomically(stage, build, out)
    return StageOutput(stage.name, stage.key, out, False, record)


def _build_atomically(stage: Stage, build: Callable[[Path], Mapping[str, float] | None], out: Path) -> dict[str, Any]:
    _remove_stale_temporaries(out)
    tmp = out.parent / f".{out.name}.tmp-{uuid.uuid4().hex[:8]}"
    tmp.mkdir(parents=True)
    try:
        started = time.time()
        metrics = dict(build(tmp) or {})
        record = {
            "stage": stage.name, "key": stage.key, "version": stage.version,
            "config": stage.config, "inputs": dict(stage.inputs), "metrics": metrics,
            "started": started, "seconds": round(time.time() - started, 3),
            "libraries": library_versions(),
        }
        (tmp / STAGE_FILE).write_text(json.dumps(record, indent=2, sort_keys=True, default=str))
        _move_into_place(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return record


# ---------------------------------------------------------------------------------------------
# Listing and cleaning the artifact root

COMPLETE, INCOMPLETE, LOCKED = "complete", "incomplete", "locked"


@dataclass(frozen=True)
class StoredOutput:
    """One directory under the artifact root (or a train stage's scratch folder).

    ``status``: ``complete`` (it has its ``stage.json``), ``incomplete`` (a partial build left by an
    interrupted run, or a resumable training scratch folder) or ``locked`` (a process is writing
    this stage now). ``modified``: when it was completed (or last written, when incomplete).
    """

    stage: str
    key: str
    status: str
    path: Path
    modified: float
    inputs: Mapping[str, str] = field(default_factory=dict)


def list_outputs() -> list[StoredOutput]:
    """Every stage output under ``$REPSIM_HOME``, by stage then age (oldest first)."""
    found = [output for folder in _stage_folders(artifacts_root()) for output in _outputs_in(folder)]
    found += [_stored(folder.name, path.name, path, INCOMPLETE, artifacts_root() / folder.name / path.name)
              for folder in _stage_folders(repsim_home() / "scratch") for path in folder.iterdir() if path.is_dir()]
    return sorted(found, key=lambda output: (output.stage, output.modified))


def unreferenced_outputs(older_than: float, now: float | None = None) -> list[StoredOutput]:
    """What :func:`remove_output` may take: outputs last modified more than ``older_than`` seconds
    ago that no kept output depends on. Kept are the complete outputs modified since then and,
    transitively, every complete output whose key is among the ``inputs`` of a kept one. Locked
    outputs (being written) are never returned."""
    outputs, cutoff = list_outputs(), (time.time() if now is None else now) - older_than
    complete = {output.key: output for output in outputs if output.status != INCOMPLETE}
    kept: set[str] = set()
    pending = [output for output in complete.values() if output.modified >= cutoff]
    while pending:
        output = pending.pop()
        if output.key not in kept:
            kept.add(output.key)
            pending += [complete[key] for key in output.inputs.values() if key in complete]
    return [output for output in outputs
            if output.status != LOCKED and output.modified < cutoff and output.key not in kept]


def remove_output(output: StoredOutput) -> bool:
    """Remove ``output`` unless its stage is being written now (then return False). A complete
    output is renamed aside first, so no half-removed directory ever looks complete."""
    with _try_exclusive(output.stage, output.key) as locked:
        if not locked or not output.path.exists():
            return False
        doomed = output.path.parent / f".{output.path.name}.old-{uuid.uuid4().hex[:8]}"
        os.rename(output.path, doomed)
        shutil.rmtree(doomed)
        return True


def _stage_folders(root: Path) -> list[Path]:
    return sorted(path for path in root.iterdir() if path.is_dir()) if root.is_dir() else []


def _outputs_in(folder: Path) -> Iterator[StoredOutput]:
    for path in folder.iterdir():
        if not path.is_dir():
            continue
        if not path.name.startswith("."):
            record = read_record(path)
            if record is not None:
                yield _stored(folder.name, path.name, path, COMPLETE, path, record.get("inputs", {}))
        elif ".tmp-" in path.name or ".old-" in path.name:  # a partial build, or a replaced output
            key = path.name[1:].split(".", 1)[0]
            yield _stored(folder.name, key, path, INCOMPLETE, folder / key)


def _stored(stage: str, key: str, path: Path, status: str, output: Path,
            inputs: Mapping[str, str] | None = None) -> StoredOutput:
    marker = path / STAGE_FILE if status == COMPLETE else path
    if _is_locked(_lock_path(output)):
        status = LOCKED
    return StoredOutput(stage, key, status, path, marker.stat().st_mtime, dict(inputs or {}))


def _is_locked(lock_path: Path) -> bool:
    """Whether a process holds the stage lock at ``lock_path`` now."""
    if not lock_path.exists():
        return False
    with open(lock_path) as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        fcntl.flock(handle, fcntl.LOCK_UN)
    return False


@contextlib.contextmanager
def _try_exclusive(stage: str, key: str) -> Iterator[bool]:
    """Hold the lock of output ``stage``/``key`` for the block if no one else does; yields whether it does."""
    lock_path = _lock_path(artifacts_root() / stage / key)
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    with open(lock_path, "a") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            yield False
            return
        try:
            yield True
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)
