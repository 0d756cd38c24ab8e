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
    for stale in out.parent.glob(f".{out.name}.tmp-*"):
        shutil.rmtree(stale, ignore_errors=True)


def run_stage(stage: Stage, build: Callable[[Path], Mapping[str, float] | None],
              out_dir: str | Path | None = None) -> StageOutput:
    """Build ``stage`` into its output directory unless it is already complete.

    ``build(tmp_dir)`` writes every output file into ``tmp_dir`` and may return metrics
    (e.g. samples, bytes); they are stored in ``stage.json``. The directory becomes visible under
    its final name only after ``build`` returns and ``stage.json`` is written.
    """
    out = stage.output_dir(out_dir)
    done = _completed(stage, out)
    if done is not None:
        return done
    # The lock file stays: unlinking it would let a waiting and a new process lock different files.
    with _exclusive(out.parent / f".{out.name}.lock"):
        done = _completed(stage, out)  # another process may have finished it meanwhile
        if done is not None:
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
        os.rename(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return record
