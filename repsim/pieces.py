"""A stage's work cut into pieces that run on any :class:`concurrent.futures.Executor` (a Dask client's
``get_executor()`` spreads them over a cluster; None runs them here, one after another).

Each piece writes its files into a folder of its own under ``folder`` (``<name>/``), built under a temporary
name and renamed when complete, with ``piece.json`` listing every file's size and sha256. A piece found
complete and intact is kept, so a stopped stage resumes with the pieces left; a damaged one runs again.
Pieces run in any order on any worker: what they write depends on their arguments only, so the stage that
merges them (in the order given) writes the same bytes for any number of workers.
"""

from __future__ import annotations

import concurrent.futures
import json
import logging
import os
import shutil
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm

from repsim.errors import StageError
from repsim.stage import damage, output_files

PIECE_FILE = "piece.json"
log = logging.getLogger(__name__)

Work = Callable[[Any, Path], Any]  # work(argument, folder) writes the piece's files into folder; returns its summary


@dataclass(frozen=True)
class Piece:
    """One piece of a stage's work: ``name`` (its folder, unique within the stage) and what ``work`` takes."""

    name: str
    argument: Any


@dataclass(frozen=True)
class PieceResult:
    """A completed piece: its folder, the summary ``work`` returned, and whether an earlier run had built it."""

    name: str
    path: Path
    summary: Any
    kept: bool


def run_pieces(work: Work, pieces: Sequence[Piece], folder: Path, executor: concurrent.futures.Executor | None = None,
               desc: str = "pieces", progress: bool = True) -> list[PieceResult]:
    """Every piece built into ``folder/<name>/`` by ``work`` (on ``executor``, else here) unless complete and intact
    there already; the results in the order of ``pieces``. StageError, keeping the pieces done, if the executor
    loses a piece (its cluster went away); an error ``work`` raises propagates, also keeping them."""
    folder.mkdir(parents=True, exist_ok=True)
    _remove_partial(folder)
    results = {piece.name: result for piece in pieces if (result := kept_piece(folder / piece.name)) is not None}
    todo = [piece for piece in pieces if piece.name not in results]
    if results:
        log.info("%s: %d of %d pieces kept from an earlier run, %d to build", desc, len(results), len(pieces), len(todo))
    with tqdm(total=len(pieces), initial=len(results), desc=desc, unit="piece", disable=not progress) as bar:
        for result in _built(work, todo, folder, executor, desc):
            results[result.name] = result
            bar.update()
    return [results[piece.name] for piece in pieces]


def kept_piece(path: Path) -> PieceResult | None:
    """The piece complete at ``path`` whose files match its record (sizes and sha256), else None (a damaged one
    is removed)."""
    try:
        record = json.loads((path / PIECE_FILE).read_text())
    except (FileNotFoundError, NotADirectoryError, ValueError):
        shutil.rmtree(path, ignore_errors=True)
        return None
    found = damage(path, record, hashes=True)
    if found is not None:
        log.warning("piece %s is damaged (%s); building it again", path, found)
        shutil.rmtree(path, ignore_errors=True)
        return None
    return PieceResult(path.name, path, record.get("summary"), True)


def build_piece(work: Work, piece: Piece, folder: Path) -> PieceResult:
    """Build ``piece`` into ``folder/<name>/``: written under a temporary name, recorded, then renamed. Runs on a
    worker; if another worker finished the same piece first (a rerun of a piece thought lost), its copy is kept."""
    path = folder / piece.name
    tmp = folder / f".{piece.name}.tmp-{uuid.uuid4().hex[:8]}"
    tmp.mkdir(parents=True)
    try:
        summary = work(piece.argument, tmp)
        record = {"piece": piece.name, "summary": summary, "files": output_files(tmp)}
        (tmp / PIECE_FILE).write_text(json.dumps(record, indent=2, sort_keys=True))
        try:
            os.rename(tmp, path)
        except OSError:
            if kept_piece(path) is None:
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return PieceResult(piece.name, path, summary, False)


def _built(work: Work, pieces: Sequence[Piece], folder: Path, executor: concurrent.futures.Executor | None,
           desc: str):
    """Each piece's result as it completes: here in order without ``executor``, else as the executor finishes them."""
    if executor is None:
        yield from (build_piece(work, piece, folder) for piece in pieces)
        return
    futures = {executor.submit(build_piece, work, piece, folder): piece for piece in pieces}
    try:
        for future in concurrent.futures.as_completed(futures):
            try:
                yield future.result()
            except concurrent.futures.CancelledError:
                raise _lost(futures, folder, desc) from None
    finally:
        for future in futures:
            future.cancel()


def _lost(futures: dict[concurrent.futures.Future, Piece], folder: Path, desc: str) -> StageError:
    done = sum(1 for piece in futures.values() if (folder / piece.name / PIECE_FILE).is_file())
    return StageError(f"{desc}: the executor lost its pieces (its scheduler stopped or is unreachable); "
                      f"{done} of {len(futures)} pieces of this run are done and kept in {folder}",
                      "start the scheduler again (or leave out --cluster) and rerun: the kept pieces are reused")


def link_or_copy(source: Path, target: Path) -> None:
    """``source`` at ``target`` too: a hard link (no bytes copied), or a copy across file systems."""
    try:
        os.link(source, target)
    except OSError:
        shutil.copyfile(source, target)


def _remove_partial(folder: Path) -> None:
    """Remove what pieces stopped mid-way left: temporary folders never renamed."""
    for partial in folder.glob(".*.tmp-*"):
        shutil.rmtree(partial, ignore_errors=True)
