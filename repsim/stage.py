"""The stage/cache contract: a stage's output lives in ``$REPSIM_HOME/artifacts/<stage>/<key>/``, ``key``
hashing the stage name, version, resolved config and input keys. It is built under a temporary name and
renamed when complete; its ``stage.json`` records config, inputs, timings, metrics, library versions and
every file's size and sha256. A complete output that still matches it is served at once; a damaged one
is built again."""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
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

from repsim.errors import RepsimError, StageError, disk_full, disk_full_error

STAGE_FILE = "stage.json"
TRACKED_LIBRARIES = ("repsim", "torch", "torchvision", "numpy", "webdataset", "pyarrow")
log = logging.getLogger(__name__)


def repsim_home() -> Path:
    """The artifact root: ``$REPSIM_HOME``, default ``./.repsim``."""
    return Path(os.environ.get("REPSIM_HOME", ".repsim")).expanduser().resolve()


def artifacts_root() -> Path:
    return repsim_home() / "artifacts"


@dataclass(frozen=True)
class Stage:
    """One stage invocation. ``config`` is JSON-serialisable (``model_dump(mode="json")``); ``inputs``
    maps an input's name to its key (an upstream stage key or a source fingerprint)."""

    name: str
    version: str
    config: Mapping[str, Any]
    inputs: Mapping[str, str] = field(default_factory=dict)

    @property
    def key(self) -> str:
        payload = {"stage": self.name, "version": self.version, "config": self.config, "inputs": dict(self.inputs)}
        canonical = json.dumps(payload, sort_keys=True, separators=(",", ":"), default=str)
        return hashlib.sha256(canonical.encode()).hexdigest()[:20]

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


StageLike = StageOutput | str | Path  # a stage output or its directory


@dataclass(frozen=True)
class StageKind:
    """One kind of stage as the pipeline runs it. ``plan(**params) -> Stage`` keys it without building;
    ``build(**params, **options, out_dir=...) -> StageOutput`` builds it or finds it complete (``options``,
    e.g. a device, do not change the output). ``artifacts``: glob patterns of the files logged with it;
    ``streams``: ``build`` also takes ``log(metrics, step)`` to stream its curves; ``split``: ``build`` also
    takes ``executor``, a :class:`concurrent.futures.Executor` to run its pieces on (:mod:`repsim.pieces`);
    ``gpu``: those pieces want a GPU (unless its ``device`` parameter or option says ``cpu``); ``facts``: the
    metrics that are counts or settings the stage found (steps, image size), tracked as parameters;
    ``describe(config, metrics)``: one line on what an output holds, for summaries (default: its samples);
    ``scores(output)``: the metrics an output scores an encoder by, in an experiment's result table (default:
    none)."""

    name: str
    plan: Callable[..., Stage]
    build: Callable[..., StageOutput]
    artifacts: tuple[str, ...] = ()
    facts: tuple[str, ...] = ()
    streams: bool = False
    split: bool = False
    gpu: bool = False
    describe: Callable[[Mapping[str, Any], Mapping[str, Any]], str] = lambda _, metrics: f"{metrics['samples']} samples"
    scores: Callable[[StageOutput], Mapping[str, float]] = lambda _: {}


def fingerprint_files(paths: Iterable[Path], root: Path | None = None, content: bool = False) -> str:
    """An input key for source data: a digest of files' paths (relative to ``root``, itself included),
    sizes and modification times (with ``content``: their sha256 instead of times)."""
    digest = hashlib.sha256(str(root or "").encode())
    for path in paths:
        stat = Path(path).stat()
        what = sha256_file(Path(path)) if content else stat.st_mtime_ns
        digest.update(f"{Path(path).relative_to(root) if root else path}\0{stat.st_size}\0{what}\n".encode())
    return digest.hexdigest()


def read_record(path: Path) -> dict[str, Any] | None:
    """The ``stage.json`` of a completed stage directory, or None if ``path`` is not one."""
    try:
        return json.loads((path / STAGE_FILE).read_text())
    except FileNotFoundError:
        return None
    except (ValueError, NotADirectoryError) as err:  # not JSON, or not UTF-8
        raise StageError(f"{path / STAGE_FILE} is unreadable ({err})",
                         f"remove {path} and run the stage again") from err


def output_dir(output: StageLike) -> Path:
    """The directory of a stage output given as a StageOutput or as that directory (absolute, ``~`` expanded)."""
    return Path(output.path if isinstance(output, StageOutput) else output).expanduser().resolve()


def completed_output(output: StageLike, stage: str, error: type[RepsimError], what: str,
                     fix: str) -> tuple[Path, dict[str, Any]]:
    """(directory, record) of a completed ``stage`` output; ``error(..., fix)`` for any other directory."""
    path = output_dir(output)
    record = read_record(path)
    if record is None or record.get("stage") != stage:
        raise error(f"{path} is not a completed {what} output", fix)
    return path, record


def library_versions() -> dict[str, str]:
    versions = {"python": platform.python_version()}
    for name in TRACKED_LIBRARIES:
        with contextlib.suppress(metadata.PackageNotFoundError):
            versions[name] = metadata.version(name)
    return versions


@dataclass(frozen=True)
class Reuse:
    """Which complete outputs a stage serves instead of building: all that match their records, but those of
    the ``rebuild`` stages completed before ``since`` (a ``--force`` run's start); with ``verify``, matching
    also compares every file's sha256 (always: its size)."""

    rebuild: frozenset[str] = frozenset()
    since: float = 0.0
    verify: bool = False

    @classmethod
    def forcing(cls, stages: Iterable[str] = (), verify: bool = False) -> Reuse:
        """Rebuild the outputs of ``stages`` completed before now (those built from now on are served)."""
        return cls(frozenset(stages), time.time(), verify)

    def stale(self, record: Mapping[str, Any]) -> bool:
        """Whether a complete output's ``stage.json`` record is to be rebuilt."""
        return record.get("stage") in self.rebuild and record.get("started", 0) < self.since

    def serves(self, path: Path, record: Mapping[str, Any]) -> bool:
        """Whether the complete output at ``path`` is served: not to be rebuilt, and its files match ``record``."""
        return not self.stale(record) and damage(path, record, self.verify) is None


SERVE_COMPLETE = Reuse()  # every complete output whose files' sizes match its record is served


def sha256_file(path: Path) -> str:
    with open(path, "rb") as handle:
        return hashlib.file_digest(handle, "sha256").hexdigest()


def output_files(path: Path, details: Mapping[str, Mapping[str, Any]] | None = None) -> dict[str, dict[str, Any]]:
    """Every file under ``path`` but ``stage.json``, by relative path: its size, sha256 and entry in ``details``."""
    entries = {}
    for file in sorted(file for file in path.rglob("*") if file.is_file() and file.name != STAGE_FILE):
        name = file.relative_to(path).as_posix()
        entries[name] = {"bytes": file.stat().st_size, "sha256": sha256_file(file), **(details or {}).get(name, {})}
    return entries


def damage(path: Path, record: Mapping[str, Any], hashes: bool = False) -> str | None:
    """The first file of ``path`` that differs from its ``record`` (``train-00000.tar: 1234 of 5678 bytes``,
    ``... missing``), or None. Sizes first, then (with ``hashes``) sha256; a record listing no files matches."""
    files = record.get("files", {})
    for name, expected in files.items():
        try:
            size = (path / name).stat().st_size
        except (FileNotFoundError, NotADirectoryError):
            return f"{name}: missing"
        if size != expected["bytes"]:
            return f"{name}: {size} of {expected['bytes']} bytes"
    for name, expected in files.items() if hashes else ():
        if sha256_file(path / name) != expected["sha256"]:
            return f"{name}: sha256 differs from its record"
    return None


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


class OutputLock:
    """The cross-process lock of the stage output at ``out``: exclusive while a stage writes (or ``clean``
    removes) it, shared while running stages read it as an input. A flock(2) lock on ``.<key>.lock`` beside
    the output, so the OS releases it when a holder dies; the file is never removed (a waiting and a new
    process would lock different files). Not filelock's ``ReadWriteLock``: it queues readers behind a
    waiting writer, which could deadlock a stage holding one input while it waits for the next."""

    def __init__(self, out: Path) -> None:
        self.path = out.parent / f".{out.name}.lock"

    @contextlib.contextmanager
    def held(self, shared: bool = False, blocking: bool = True) -> Iterator[bool]:
        """Hold the lock, ``shared`` or exclusive, for the block; yields False if not ``blocking`` and taken."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.path, "a") as handle:  # closing it releases the lock
            try:
                fcntl.flock(handle, (fcntl.LOCK_SH if shared else fcntl.LOCK_EX) | (0 if blocking else fcntl.LOCK_NB))
            except BlockingIOError:
                yield False
                return
            yield True

    def holder(self) -> str | None:
        """``locked`` (held exclusively: being written), ``in use`` (held shared: being read) or None, at once."""
        if not self.path.exists():
            return None
        for shared, holder in ((False, None), (True, IN_USE)):
            with self.held(shared, blocking=False) as acquired:
                if acquired:
                    return holder
        return LOCKED


def _set_aside(path: Path) -> Path:
    """Rename the output ``path`` to a hidden ``.old-`` name beside it, which never looks complete."""
    aside = path.parent / f".{path.name}.old-{uuid.uuid4().hex[:8]}"
    os.rename(path, aside)
    return aside


@contextlib.contextmanager
def scratch_folder(stage: Stage) -> Iterator[Path]:
    """``$REPSIM_HOME/scratch/<stage>/<key>``, where ``stage`` keeps its pieces or checkpoints until its output is
    complete: removed once the block ends without an error."""
    scratch = repsim_home() / "scratch" / stage.name / stage.key
    yield scratch
    shutil.rmtree(scratch, ignore_errors=True)


@contextlib.contextmanager
def _reading(keys: Iterable[str]) -> Iterator[None]:
    """Hold shared the lock of every stored output whose key is among ``keys`` (a stage's inputs)."""
    inputs = [folder / key for folder in _subfolders(artifacts_root()) for key in set(keys)
              if (folder / key).is_dir()]
    with contextlib.ExitStack() as held:
        for path in inputs:
            held.enter_context(OutputLock(path).held(shared=True))
        yield


Build = Callable[[Path], Mapping[str, float] | None]
FileDetails = Callable[[Path], Mapping[str, Mapping[str, Any]]]


def run_stage(stage: Stage, build: Build, out_dir: str | Path | None = None,
              file_details: FileDetails | None = None, reuse: Reuse = SERVE_COMPLETE) -> StageOutput:
    """Build ``stage`` into its output directory unless ``reuse`` serves it (a damaged one is logged and
    built again). ``build(tmp_dir)`` writes every output file and may return metrics, stored in
    ``stage.json`` with every file's size, sha256 and entry of ``file_details(tmp_dir)``; the inputs' locks
    are held shared meanwhile."""
    out = stage.output_dir(out_dir)
    done = _completed(stage, out)
    if done is not None and reuse.serves(out, done.record):
        return done
    with OutputLock(out).held():
        done = _completed(stage, out)  # another process may have finished (or rebuilt) it meanwhile
        if done is not None and not reuse.stale(done.record):
            found = damage(out, done.record, reuse.verify)
            if found is None:
                return done
            log.warning("%s output %s at %s is damaged (%s); building it again", stage.name, stage.key, out, found)
            shutil.rmtree(_set_aside(out))
        record = _build_atomically(stage, build, out, file_details)
    return StageOutput(stage.name, stage.key, out, False, record)


def _build_atomically(stage: Stage, build: Build, out: Path, file_details: FileDetails | None) -> dict[str, Any]:
    for stale in [*out.parent.glob(f".{out.name}.tmp-*"), *out.parent.glob(f".{out.name}.old-*")]:
        shutil.rmtree(stale, ignore_errors=True)
    tmp = out.parent / f".{out.name}.tmp-{uuid.uuid4().hex[:8]}"
    tmp.mkdir(parents=True)
    try:
        started = time.time()
        with _reading(stage.inputs.values()):
            metrics = dict(build(tmp) or {})
        record = {
            "stage": stage.name, "key": stage.key, "version": stage.version,
            "config": stage.config, "inputs": dict(stage.inputs), "metrics": metrics,
            "started": started, "seconds": round(time.time() - started, 3),
            "libraries": library_versions(),
            "files": output_files(tmp, file_details(tmp) if file_details is not None else None),
        }
        (tmp / STAGE_FILE).write_text(json.dumps(record, indent=2, sort_keys=True, default=str))
        old = _set_aside(out) if out.exists() else None  # removed only once the new output is in place
        os.rename(tmp, out)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    except BaseException as err:
        full = disk_full(err)
        written = sum(file.stat().st_size for file in tmp.rglob("*") if file.is_file()) if full else 0
        shutil.rmtree(tmp, ignore_errors=True)
        if full:
            raise disk_full_error(out.parent, f"the {stage.name} stage had written {written:,} bytes into {out.parent} "
                                  "when it ran out of space, and its partial output is removed", written) from None
        raise
    return record


# ---------------------------------------------------------------------------------------------
# Listing and cleaning the artifact root

COMPLETE, DAMAGED, INCOMPLETE, LOCKED, IN_USE = "complete", "damaged", "incomplete", "locked", "in use"
UNVERIFIED = "unverified: its record lists no files"


@dataclass(frozen=True)
class StoredOutput:
    """One directory under the artifact root (or a train stage's scratch folder). ``status``: ``complete``,
    ``damaged`` (``note`` names the first bad file), ``incomplete`` (a partial build or a resumable scratch
    folder), ``locked`` (being written) or ``in use`` (read by a running stage). ``modified``: when completed
    (or last written)."""

    stage: str
    key: str
    status: str
    path: Path
    modified: float
    inputs: Mapping[str, str] = field(default_factory=dict)
    note: str = ""

    @property
    def shown(self) -> str:
        """The status as listed, e.g. ``damaged (train-00000.tar: 1234 of 5678 bytes)``."""
        return f"{self.status} ({self.note})" if self.note else self.status


def list_outputs(hashes: bool = False) -> list[StoredOutput]:
    """Every stage output under ``$REPSIM_HOME``, by stage then age; complete ones checked by :func:`damage`."""
    found = [output for folder in _subfolders(artifacts_root()) for output in _outputs_in(folder, hashes)]
    found += [_stored(folder.name, path.name, path, artifacts_root() / folder.name / path.name)
              for folder in _subfolders(repsim_home() / "scratch") for path in _subfolders(folder)]
    return sorted(found, key=lambda output: (output.stage, output.modified))


def unreferenced_outputs(older_than: float) -> list[StoredOutput]:
    """Outputs last modified over ``older_than`` seconds ago that no kept output (one modified since, or
    transitively an input of one) depends on, and that are neither locked nor in use."""
    outputs, cutoff = list_outputs(), time.time() - older_than
    complete = {output.key: output for output in outputs if output.status != INCOMPLETE}
    kept: set[str] = set()
    pending = [output for output in complete.values() if output.modified >= cutoff]
    while pending:
        output = pending.pop()
        if output.key not in kept:
            kept.add(output.key)
            pending += [complete[key] for key in output.inputs.values() if key in complete]
    return [output for output in outputs
            if output.status not in (LOCKED, IN_USE) and output.modified < cutoff and output.key not in kept]


def remove_output(output: StoredOutput) -> bool:
    """Remove ``output`` (renamed aside first); False, leaving it, while a process holds its lock."""
    with OutputLock(artifacts_root() / output.stage / output.key).held(blocking=False) as locked:
        if not locked or not output.path.exists():
            return False
        shutil.rmtree(_set_aside(output.path))
        return True


def _subfolders(root: Path) -> list[Path]:
    return sorted(path for path in root.iterdir() if path.is_dir()) if root.is_dir() else []


def _outputs_in(folder: Path, hashes: bool) -> Iterator[StoredOutput]:
    for path in _subfolders(folder):
        if not path.name.startswith("."):
            record = read_record(path)
            if record is not None:
                yield _stored(folder.name, path.name, path, path, record, hashes)
        elif ".tmp-" in path.name or ".old-" in path.name:  # a partial build, or a replaced output
            key = path.name[1:].split(".", 1)[0]
            yield _stored(folder.name, key, path, folder / key)


def _stored(stage: str, key: str, path: Path, output: Path, record: Mapping[str, Any] | None = None,
            hashes: bool = False) -> StoredOutput:
    """``path`` as listed: locked or in use by the lock of ``output``, else by its ``record`` (None: incomplete)."""
    status, note = OutputLock(output).holder(), ""
    if status is None and record is None:
        status = INCOMPLETE
    elif status is None:
        found = damage(path, record, hashes)
        status, note = (DAMAGED, found) if found else (COMPLETE, "" if "files" in record else UNVERIFIED)
    marker = path / STAGE_FILE if record is not None else path
    return StoredOutput(stage, key, status, path, marker.stat().st_mtime, dict((record or {}).get("inputs", {})), note)
