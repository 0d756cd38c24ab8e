"""The stage/cache contract shared by every pipeline stage.

A stage's output lives in ``$REPSIM_HOME/artifacts/<stage>/<key>/`` where ``key`` hashes the stage
name, its resolved config, the keys of its inputs and the stage version. The directory is built
under a temporary name and renamed when complete, so an interrupted stage leaves nothing that looks
done; ``stage.json`` inside records config, input keys, timings, metrics, library versions and
every output file with its size and sha256. Running a stage whose directory is complete and still
matches that list returns at once; a damaged one is reported and built again.
"""

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

import filelock

from repsim.errors import RepsimError, StageError, disk_full, disk_full_error

STAGE_FILE = "stage.json"
TRACKED_LIBRARIES = ("repsim", "torch", "torchvision", "numpy", "webdataset", "pyarrow")
log = logging.getLogger(__name__)


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


StageLike = StageOutput | str | Path  # a stage output or its directory


@dataclass(frozen=True)
class StageKind:
    """One kind of stage, declared once beside its code, as the pipeline runs it.

    ``plan(**params) -> Stage`` gives the stage (and its key) without building it;
    ``build(**params, **options, out_dir=...) -> StageOutput`` builds it, or finds it complete. The
    ``params`` decide the output; ``options`` (a batch size, a device) do not. ``artifacts``: glob
    patterns of the output files logged with the stage; ``streams``: ``build`` also takes
    ``log(metrics, step)``, through which its curves stream while it runs.
    """

    name: str
    plan: Callable[..., Stage]
    build: Callable[..., StageOutput]
    artifacts: tuple[str, ...] = ()
    streams: bool = False


def fingerprint_files(paths: Iterable[Path], root: Path | None = None, content: bool = False) -> str:
    """An input key for source data: a digest of files' paths (relative to ``root``, itself included,
    when given), sizes and modification times, or with ``content`` their bytes' sha256 instead of times."""
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
    """The directory (see :func:`output_dir`) and the record of a completed ``stage`` output; for any
    other directory, ``error`` saying that it is not a completed ``what`` output, and the ``fix``."""
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


@contextlib.contextmanager
def _environment(name: str, value: str | None) -> Iterator[None]:
    """Environment variable ``name`` set to ``value`` for the block (unchanged when ``value`` is None)."""
    previous = os.environ.get(name)
    if value is not None:
        os.environ[name] = value
    try:
        yield
    finally:
        if previous is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = previous


REBUILD_ENV = "REPSIM_REBUILD"
VERIFY_ENV = "REPSIM_VERIFY"


@contextlib.contextmanager
def rebuilding(stages: Iterable[str]) -> Iterator[None]:
    """Within the block, outputs of the named stages completed before it began are stale: the stage
    runs again and its new output replaces the old one (the old output stays until the new one is
    complete). An output built inside the block is reused. The setting travels in the environment
    variable ``REPSIM_REBUILD``, so subprocesses (e.g. torchrun ranks) see it too."""
    names = sorted(set(stages))
    with _environment(REBUILD_ENV, f"{','.join(names)}@{time.time()!r}" if names else None):
        yield


@contextlib.contextmanager
def verifying(enabled: bool = True) -> Iterator[None]:
    """Within the block (if ``enabled``), a cache hit also compares the sha256 of every output file with
    its record, not only its size. The setting travels in ``REPSIM_VERIFY``, so subprocesses see it too."""
    with _environment(VERIFY_ENV, "1" if enabled else None):
        yield


def verification_requested() -> bool:
    """Whether cache hits check hashes now (inside :func:`verifying`)."""
    return os.environ.get(VERIFY_ENV) == "1"


def is_stale(record: Mapping[str, Any]) -> bool:
    """Whether a completed output's ``stage.json`` record is to be rebuilt (see :func:`rebuilding`)."""
    names, _, since = os.environ.get(REBUILD_ENV, "").rpartition("@")
    return bool(since) and record.get("stage") in names.split(",") and record.get("started", 0) < float(since)


def sha256_file(path: Path) -> str:
    with open(path, "rb") as handle:
        return hashlib.file_digest(handle, "sha256").hexdigest()


def output_files(path: Path, details: Mapping[str, Mapping[str, Any]] | None = None) -> dict[str, dict[str, Any]]:
    """Every file under the output directory ``path`` but ``stage.json`` (by relative path) with its
    size, its sha256 and its entry in ``details``: what the record lists to verify cache hits by."""
    entries = {}
    for file in sorted(file for file in path.rglob("*") if file.is_file() and file.name != STAGE_FILE):
        name = file.relative_to(path).as_posix()
        entries[name] = {"bytes": file.stat().st_size, "sha256": sha256_file(file), **(details or {}).get(name, {})}
    return entries


def damage(path: Path, record: Mapping[str, Any], hashes: bool = False) -> str | None:
    """How the output directory ``path`` differs from the files its ``record`` lists, naming the first
    damaged file (``train-00000.tar: 1234 of 5678 bytes``, ``... missing``); None when it matches.
    Sizes are checked for every file first, then (with ``hashes``) the sha256 of each. A record written
    before files were listed lists none, so such an output counts as intact (unverifiable)."""
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


def is_current(path: Path, record: Mapping[str, Any]) -> bool:
    """Whether the complete output at ``path`` is to be served: it is not being rebuilt (see
    :func:`rebuilding`) and its files match its ``record`` (hashes too, inside :func:`verifying`)."""
    return not is_stale(record) and damage(path, record, verification_requested()) is None


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


class OutputLock:
    """The lock of the stage output at ``out``, across processes: exclusive while a stage writes the
    output (or ``clean`` removes it), shared while running stages read it as an input.

    Both modes are flock(2) locks on one file beside the output, ``.<key>.lock``, so the OS releases a
    holder's lock when it dies (kill -9 too), and a shared holder keeps out an exclusive one but not
    another shared one. The file is never removed: unlinking it would let a waiting and a new process
    lock different files. :class:`filelock.FileLock` takes the exclusive lock (``preserve_lock_file``
    also rules out its soft fallback, a marker file that a killed holder leaves behind). filelock has
    no shared flock, so that one is taken here on the same file: its only shared lock,
    ``ReadWriteLock``, an SQLite transaction, makes new readers wait behind a waiting writer, and a
    stage holding one input while it waits for the next could then deadlock with a rebuild.
    """

    def __init__(self, out: Path) -> None:
        self.path = out.parent / f".{out.name}.lock"

    @contextlib.contextmanager
    def held(self, shared: bool = False, blocking: bool = True) -> Iterator[bool]:
        """Hold the lock for the block, ``shared`` or exclusive; yields whether it does, which is
        False only when not ``blocking`` and another process holds it in a mode that excludes this."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with contextlib.ExitStack() as release:
            yield (self._share if shared else self._take)(release, blocking)

    def holder(self) -> str | None:
        """``locked`` if a process holds the lock exclusively now (writing the output), ``in use`` if
        processes hold it shared (reading it), None if no one holds it. Waits for nothing."""
        if not self.path.exists():
            return None
        for shared, holder in ((False, None), (True, IN_USE)):
            with self.held(shared, blocking=False) as acquired:
                if acquired:
                    return holder
        return LOCKED

    def _take(self, release: contextlib.ExitStack, blocking: bool) -> bool:
        lock = filelock.FileLock(self.path, preserve_lock_file=True)
        try:
            lock.acquire(blocking=blocking)
        except filelock.Timeout:
            return False
        release.callback(lock.release)
        return True

    def _share(self, release: contextlib.ExitStack, blocking: bool) -> bool:
        handle = release.enter_context(open(self.path, "a"))  # closing it releases the lock
        try:
            fcntl.flock(handle, fcntl.LOCK_SH | (0 if blocking else fcntl.LOCK_NB))
        except BlockingIOError:
            return False
        return True


def _set_aside(path: Path) -> Path:
    """Rename the output ``path`` to a hidden ``.old-`` name beside it, which never looks complete."""
    aside = path.parent / f".{path.name}.old-{uuid.uuid4().hex[:8]}"
    os.rename(path, aside)
    return aside


def _move_into_place(tmp: Path, out: Path) -> None:
    """Rename the complete ``tmp`` to ``out``; an old ``out`` is moved aside first and removed only after."""
    if not out.exists():
        os.rename(tmp, out)
        return
    old = _set_aside(out)
    os.rename(tmp, out)
    shutil.rmtree(old, ignore_errors=True)


@contextlib.contextmanager
def _reading(keys: Iterable[str]) -> Iterator[None]:
    """Hold shared the lock of every output under the artifact root whose key is among ``keys`` (a
    stage's inputs), so that :func:`remove_output` leaves them alone and a rebuild of one waits."""
    inputs = [folder / key for folder in _stage_folders(artifacts_root()) for key in set(keys)
              if (folder / key).is_dir()]
    with contextlib.ExitStack() as held:
        for path in inputs:
            held.enter_context(OutputLock(path).held(shared=True))
        yield


Build = Callable[[Path], Mapping[str, float] | None]
FileDetails = Callable[[Path], Mapping[str, Mapping[str, Any]]]


def run_stage(stage: Stage, build: Build, out_dir: str | Path | None = None,
              file_details: FileDetails | None = None) -> StageOutput:
    """Build ``stage`` into its output directory unless it is already complete and intact.

    ``build(tmp_dir)`` writes every output file into ``tmp_dir`` and may return metrics
    (e.g. samples, bytes); they are stored in ``stage.json``, with every file's size and sha256 (and
    what ``file_details(tmp_dir)`` adds to a file's entry, by relative path). The directory becomes
    visible under its final name only after ``build`` returns and ``stage.json`` is written. While
    ``build`` runs, the stage holds its inputs' locks shared (see :func:`list_outputs`).

    A complete output is served only if its files still have the recorded sizes (and, inside
    :func:`verifying`, hashes); a damaged one is logged, removed and built again. Inside
    :func:`rebuilding`, a complete output of a stage being rebuilt is built again and then replaces
    the old one.
    """
    out = stage.output_dir(out_dir)
    done = _completed(stage, out)
    if done is not None and is_current(out, done.record):
        return done
    with OutputLock(out).held():
        done = _completed(stage, out)  # another process may have finished (or rebuilt) it meanwhile
        if done is not None and not is_stale(done.record):
            found = damage(out, done.record, verification_requested())
            if found is None:
                return done
            log.warning("%s output %s at %s is damaged (%s); building it again", stage.name, stage.key, out, found)
            shutil.rmtree(_set_aside(out))
        record = _build_atomically(stage, build, out, file_details)
    return StageOutput(stage.name, stage.key, out, False, record)


def _build_atomically(stage: Stage, build: Build, out: Path, file_details: FileDetails | None) -> dict[str, Any]:
    _remove_stale_temporaries(out)
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
        _move_into_place(tmp, out)
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
    """One directory under the artifact root (or a train stage's scratch folder).

    ``status``: ``complete`` (it has its ``stage.json`` and its files match it), ``damaged`` (a file
    differs from the record: ``note`` names the first), ``incomplete`` (a partial build left by an
    interrupted run, or a resumable training scratch folder), ``locked`` (a process is writing this
    stage now) or ``in use`` (a running stage reads it as an input). A complete output recorded before
    records listed files has the note ``unverified: ...``. ``modified``: when it was completed (or
    last written, when incomplete).
    """

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
    """Every stage output under ``$REPSIM_HOME``, by stage then age (oldest first). A complete output
    is checked against its record: file sizes, and with ``hashes`` their sha256 too."""
    found = [output for folder in _stage_folders(artifacts_root()) for output in _outputs_in(folder, hashes)]
    found += [_stored(folder.name, path.name, path, artifacts_root() / folder.name / path.name)
              for folder in _stage_folders(repsim_home() / "scratch") for path in folder.iterdir() if path.is_dir()]
    return sorted(found, key=lambda output: (output.stage, output.modified))


def unreferenced_outputs(older_than: float, now: float | None = None) -> list[StoredOutput]:
    """What :func:`remove_output` may take: outputs last modified more than ``older_than`` seconds
    ago that no kept output depends on. Kept are the complete outputs modified since then and,
    transitively, every complete output whose key is among the ``inputs`` of a kept one. Locked
    outputs (being written) and those in use (read by a running stage) are never returned."""
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
            if output.status not in (LOCKED, IN_USE) and output.modified < cutoff and output.key not in kept]


def remove_output(output: StoredOutput) -> bool:
    """Remove ``output`` unless a process holds its lock now, writing it or reading it as an input
    (then return False). A complete output is renamed aside first, so no half-removed directory ever
    looks complete."""
    with OutputLock(artifacts_root() / output.stage / output.key).held(blocking=False) as locked:
        if not locked or not output.path.exists():
            return False
        shutil.rmtree(_set_aside(output.path))
        return True


def _stage_folders(root: Path) -> list[Path]:
    return sorted(path for path in root.iterdir() if path.is_dir()) if root.is_dir() else []


def _outputs_in(folder: Path, hashes: bool) -> Iterator[StoredOutput]:
    for path in folder.iterdir():
        if not path.is_dir():
            continue
        if not path.name.startswith("."):
            record = read_record(path)
            if record is not None:
                yield _stored(folder.name, path.name, path, path, record, hashes)
        elif ".tmp-" in path.name or ".old-" in path.name:  # a partial build, or a replaced output
            key = path.name[1:].split(".", 1)[0]
            yield _stored(folder.name, key, path, folder / key)


def _stored(stage: str, key: str, path: Path, output: Path, record: Mapping[str, Any] | None = None,
            hashes: bool = False) -> StoredOutput:
    """``path`` as listed: complete or damaged (with its ``record``) or incomplete (without), unless a
    process holds the lock of ``output`` now."""
    status, note = OutputLock(output).holder(), ""
    if status is None:
        status, note = _condition(path, record, hashes) if record is not None else (INCOMPLETE, "")
    marker = path / STAGE_FILE if record is not None else path
    return StoredOutput(stage, key, status, path, marker.stat().st_mtime, dict((record or {}).get("inputs", {})), note)


def _condition(path: Path, record: Mapping[str, Any], hashes: bool) -> tuple[str, str]:
    """(status, note) of a complete output: whether its files still match its record."""
    if "files" not in record:
        return COMPLETE, UNVERIFIED
    found = damage(path, record, hashes)
    return (COMPLETE, "") if found is None else (DAMAGED, found)
