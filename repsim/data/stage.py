"""The shard stage: a data spec's source written as deterministic WebDataset tars plus a manifest.

Output (``$REPSIM_HOME/artifacts/shard/<key>/`` unless given): ``{split}-{n:05d}.tar`` of at most
``shard_size`` samples, each ``{key}.png`` (or ``.jpg``), ``{key}.cls`` (label as ASCII int, absent when
unlabelled), ``{key}.txt`` (the source's caption, else a template's) and ``{key}.json`` (index, key, split,
label, class_name, source_id); ``manifest.parquet`` (:mod:`repsim.data.manifest`), row number = ``index``;
``shards.json`` (splits, sample counts, tar names); ``errors.json``, what ``on_error: skip`` left out as
``{"source_id", "reason"}``; and ``stage.json``, whose file list gives each tar's size, sha256 and samples.
Shards this stage wrote before, named by a ``webdataset`` source with a ``manifest`` (paths or URLs), are
read in place: the output holds their manifest and ``errors.json`` and a ``shards.json`` listing the URLs.

Samples are grouped by split, in source order permuted by ``shuffle_seed`` when set; keys are the
zero-padded global index. Pillow decodes and re-encodes every image (validating it, dropping metadata,
applying EXIF orientation): 1-channel images stay 8-bit "L", others become RGB; JPEG at ``jpeg_quality``.
Tar members have fixed mtime, owner and mode, so the same spec gives byte-identical tars. Each tar is
written by a piece of its own (:mod:`repsim.pieces`), on any worker, and the pieces are merged in write order:
the bytes do not depend on the number of workers. Under ``on_error: skip``, a tar after a skipped image is
renumbered in the merge, so indexes stay dense; a tar whose images were all skipped is left out.
"""

from __future__ import annotations

import hashlib
import io
import json
import tarfile
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import webdataset as wds
from PIL import Image, ImageOps, UnidentifiedImageError

from repsim.data import remote
from repsim.data.manifest import MANIFEST, ManifestWriter, read_manifest, shard_sizes, write_rows
from repsim.data.remote import beside, is_url
from repsim.data.sources import Entry, Listing, Reader, assign_splits, open_source, split_member_name, split_order
from repsim.data.spec import DataSpec, load_spec
from repsim.errors import DataError, StageError
from repsim.pieces import Piece, link_or_copy, run_pieces
from repsim.stage import SERVE_COMPLETE, Reuse, Stage, StageKind, completed_output, run_stage, scratch_folder

SHARD_VERSION = "3"
INDEX = "shards.json"
ERRORS = "errors.json"
PIL_FORMATS = {"png": "PNG", "jpg": "JPEG"}
GRAYSCALE_MODES = {"1", "L", "LA", "I", "I;16", "F"}
IMAGE_ERRORS = (OSError, ValueError, SyntaxError, EOFError, DataError, Image.DecompressionBombError)


@dataclass(frozen=True)
class ShardResult:
    """A completed shard directory: where it is, what it holds, and whether this call found it cached."""

    path: Path
    key: str
    cached: bool
    num_samples: int
    splits: dict[str, int]
    shards: dict[str, list[Path | str]]  # tar paths, or URLs of shards read in place
    manifest: Path
    errors: int
    image_format: str

    @classmethod
    def from_dir(cls, path: str | Path, cached: bool = True) -> ShardResult:
        """Describe an existing shard output directory; StageError if it is not a complete one."""
        path, record = completed_output(path, "shard", StageError, "shard", "run the shard stage for its data spec")
        index = json.loads((path / INDEX).read_text())
        return cls(path=path, key=record["key"], cached=cached, num_samples=index["num_samples"],
                   splits={split: info["samples"] for split, info in index["splits"].items()},
                   shards={split: [name if is_url(name) else path / name for name in info["shards"]]
                           for split, info in index["splits"].items()},
                   manifest=path / MANIFEST, errors=index["errors"], image_format=index["image_format"])

    @classmethod
    def of(cls, shards: ShardResult | str | Path) -> ShardResult:
        """``shards`` itself, or the completed shard output at that path (StageError if it is not one)."""
        return shards if isinstance(shards, cls) else cls.from_dir(shards)


def sharded(spec: DataSpec, shards: ShardResult | str | Path | None = None, progress: bool = True) -> ShardResult:
    """``shards`` when given (:meth:`ShardResult.of`), else ``spec`` sharded now or found cached."""
    return ShardResult.of(shards) if shards is not None else shard(spec, progress=progress)


def sharded_already(spec: DataSpec, shards: ShardResult | str | Path | None = None) -> ShardResult:
    """``shards`` when given, else the completed shard output of ``spec``, for planning without running
    (StageError if it has not been sharded)."""
    return ShardResult.of(shards if shards is not None else shard_stage(spec).default_dir())


def shard(spec: DataSpec | str | Path, out_dir: str | Path | None = None, progress: bool = True,
          executor: Executor | None = None, reuse: Reuse = SERVE_COMPLETE) -> ShardResult:
    """Write ``spec``'s samples as WebDataset shards (keyed by the spec and a fingerprint of the source
    files), or return the cached output at once, once each tar's first header shows it was not swapped since
    (:func:`check_tars`). Each tar is a piece run on ``executor`` (default: here), kept in
    ``$REPSIM_HOME/scratch/shard/<key>/`` until the output is complete, so a stopped stage resumes with the
    tars left. DataError for an unreadable source, and under ``on_error: fail`` for the first unreadable image,
    repeated manifest row or damaged source tar (``skip``: counted). ``reuse``: which complete output is served."""
    spec = spec if isinstance(spec, DataSpec) else load_spec(spec)
    reader = open_source(spec)
    stage = shard_stage(spec, reader)
    if getattr(spec.source, "manifest", None):
        output = run_stage(stage, lambda tmp: _in_place(spec, reader, tmp), out_dir, _tar_samples, reuse)
        return ShardResult.from_dir(output.path, cached=output.cached)
    with scratch_folder(stage) as scratch:
        output = run_stage(stage, lambda tmp: _build(spec, reader, tmp, progress, executor, scratch), out_dir,
                           _tar_samples, reuse)
    result = ShardResult.from_dir(output.path, cached=output.cached)
    if output.cached:  # the tars were right when built: a cache hit checks that none was swapped since
        check_tars([tar for tars in result.shards.values() for tar in tars], result.manifest,
                   f"remove {result.path} and shard again")
    return result


def shard_stage(spec: DataSpec, reader: Reader | None = None) -> Stage:
    """The shard stage of ``spec``: its key covers the spec and a fingerprint of the source files (by ``reader``)."""
    source = (reader or open_source(spec)).fingerprint()
    return Stage("shard", SHARD_VERSION, config=spec.model_dump(mode="json"), inputs={"source": source})


# ---------------------------------------------------------------------------------------------
# Building: one piece per output tar (:mod:`repsim.pieces`), merged in write order

ROWS = "rows.parquet"  # a piece's manifest rows
PIECE_TAR = "samples.tar"
TAR_OPTIONS = {"encoder": False, "mtime": 0, "user": "repsim", "group": "repsim"}  # identical samples, identical bytes


@dataclass(frozen=True)
class TarPiece:
    """The samples of one output tar: ``listing``'s entries at ``rows``, of ``split``, in write order, the first
    numbered ``first_index`` (its position in the write order: the final index unless images before it were
    skipped). Pickled for a worker, it carries only its own entries."""

    spec: DataSpec
    split: str
    listing: Listing
    rows: np.ndarray
    first_index: int
    key_width: int

    def entries(self) -> Iterator[Entry]:
        return (self.listing[int(row)] for row in self.rows)

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "listing": self.listing.take(self.rows), "rows": np.arange(len(self.rows))}


def _build(spec: DataSpec, reader: Reader, out: Path, progress: bool, executor: Executor | None,
           scratch: Path) -> dict[str, float]:
    started = time.time()
    entries = reader.entries(executor)  # a source listed in parts lists them on the workers too
    if not entries:
        raise DataError(f"the source of {spec.name!r} holds no samples", "check the source path and contents")
    pieces = _tar_pieces(spec, entries)
    results = run_pieces(write_tar_piece, pieces, scratch, executor, desc=f"shard {spec.name}", progress=progress)
    errors = reader.skipped + [error for result in results for error in result.summary["errors"]]
    tar_names: dict[str, list[str]] = {piece.argument.split: [] for piece in pieces}  # splits in write order
    with ManifestWriter(out / MANIFEST) as manifest:
        for piece, result in zip(pieces, results):
            if result.summary["samples"]:
                tars = tar_names[piece.argument.split]
                tars.append(f"{piece.argument.split}-{len(tars):05d}.tar")
                manifest.add(_place_tar(piece.argument, result.path, out / tars[-1], manifest.rows))
    if not manifest.rows:
        raise DataError(f"none of the {len(entries)} images of {spec.name!r} is readable",
                        f"see the first failure: {errors[0]['source_id']}: {errors[0]['reason']}")
    index = {"name": spec.name, "image_format": spec.image_format, "num_samples": manifest.rows, "errors": len(errors),
             "splits": {split: {"samples": manifest.splits.get(split, 0), "shards": names}
                        for split, names in tar_names.items() if names}}
    (out / INDEX).write_text(json.dumps(index, indent=2))
    (out / ERRORS).write_text(json.dumps(errors, indent=2))
    return _metrics(manifest.splits, len(errors), started, bytes=sum(path.stat().st_size for path in out.glob("*.tar")),
                    pieces=len(pieces), pieces_kept=sum(result.kept for result in results))


def _tar_pieces(spec: DataSpec, entries: Listing) -> list[Piece]:
    """One piece per output tar: each split's write order cut every ``shard_size`` entries."""
    key_width = max(6, len(str(len(entries) - 1)))
    pieces, position = [], 0
    for split, members in _write_order(assign_splits(entries, spec), spec):
        for number, start in enumerate(range(0, len(members), spec.shard_size)):
            rows = members[start:start + spec.shard_size]
            pieces.append(Piece(f"{split}-{number:05d}", TarPiece(spec, split, entries, rows, position, key_width)))
            position += len(rows)
    return pieces


def write_tar_piece(piece: TarPiece, folder: Path) -> dict[str, Any]:
    """Write ``piece``'s readable samples into ``folder`` (``samples.tar`` and their manifest rows, ``rows.parquet``);
    ``{"samples": count, "errors": [what on_error: skip left out]}``. Runs on a worker."""
    reader = open_source(piece.spec)
    rows = []
    with wds.TarWriter(str(folder / PIECE_TAR), **TAR_OPTIONS) as tar:
        for entry in piece.entries():
            encoded = _encode_or_report(reader, entry, piece.spec)
            if encoded is not None:
                members, row = _sample(entry, piece, piece.first_index + len(rows), encoded)
                tar.write(members)
                rows.append(row)
    if not rows:
        (folder / PIECE_TAR).unlink()
    write_rows(rows, folder / ROWS)
    return {"samples": len(rows), "errors": reader.skipped}


def _in_place(spec: DataSpec, reader: Reader, out: Path) -> dict[str, float]:
    """The output of shards read in place: their manifest and errors.json fetched, and a shards.json
    that lists the tars of ``source.urls`` by URL under the split their name starts with, each checked to start
    with the sample the manifest lists first for it."""
    started, manifest = time.time(), spec.source.manifest
    (out / MANIFEST).write_bytes(remote.read_bytes(str(manifest)))
    (out / ERRORS).write_bytes(remote.read_bytes(str(beside(manifest, ERRORS))))
    index, sizes, splits = json.loads(remote.read_bytes(str(beside(manifest, INDEX)))), shard_sizes(out / MANIFEST), {}
    for tar in map(str, reader.tars):
        name = tar.rsplit("/", 1)[-1]
        if name not in sizes:
            raise DataError(f"{tar} is not among the shards its manifest {manifest} lists", "correct source.urls")
        split = splits.setdefault(name.rsplit("-", 1)[0], {"samples": 0, "shards": []})
        split["samples"] += sizes[name]
        split["shards"].append(tar)
    check_tars(reader.tars, out / MANIFEST, "copy or upload the shards again from one shard output (repsim shard SPEC --out URL)")
    index |= {"name": spec.name, "num_samples": sum(split["samples"] for split in splits.values()), "splits": splits}
    (out / INDEX).write_text(json.dumps(index, indent=2))
    return _metrics({name: split["samples"] for name, split in splits.items()}, index["errors"], started)


def check_tars(tars: Sequence[str | Path], manifest: Path, fix: str) -> None:
    """DataError naming the tars whose first sample is not the one ``manifest`` lists first for them: a tar swapped
    for another shard's, or damaged (each tar's first header is read, nothing more)."""
    rows = read_manifest(manifest, ["shard", "key"])
    first = dict(zip(reversed(rows["shard"].to_pylist()), reversed(rows["key"].to_pylist())))  # each tar's first row
    wrong = []
    for tar in tars:
        header = remote.read_head(tar, tarfile.BLOCKSIZE)
        try:
            key, _ = split_member_name(tarfile.TarInfo.frombuf(header, "utf-8", "surrogateescape").name)
        except tarfile.HeaderError as err:
            raise DataError(f"{tar} is not a readable tar ({err})", fix) from None
        expected = first.get(str(tar).rsplit("/", 1)[-1])
        if key != expected:
            wrong.append(f"{tar} starts with sample {key} where the manifest lists {expected}")
    if wrong:
        raise DataError(f"{', '.join(wrong)} (swapped for another shard's tar?)", fix)


def _write_order(splits: list[str], spec: DataSpec) -> list[tuple[str, np.ndarray]]:
    """Entry positions grouped by split; within a split in source order, permuted by ``shuffle_seed`` if set."""
    rng = np.random.default_rng(spec.shuffle_seed) if spec.shuffle_seed is not None else None
    split_of = np.array(splits)
    order = []
    for split in split_order(splits, spec):
        members = np.flatnonzero(split_of == split)
        order.append((split, members[rng.permutation(len(members))] if rng is not None else members))
    return order


def _encode_or_report(reader: Reader, entry: Entry, spec: DataSpec) -> tuple[bytes, int, int] | None:
    """(encoded bytes, width, height), or None after the reader recorded why the image is unreadable."""
    try:
        return encode_image(reader.read(entry), spec.image_format, spec.jpeg_quality)
    except IMAGE_ERRORS as err:
        reason = "not an image format Pillow can read" if isinstance(err, UnidentifiedImageError) \
            else f"{type(err).__name__}: {err}"
        reader.skip_or_fail(entry.source_id, f"cannot read image {reader.locate(entry)} ({reason})",
                            "fix or remove it, or set 'on_error: skip' in the data spec to leave it out")
        return None


def encode_image(image: bytes | np.ndarray, image_format: str, jpeg_quality: int = 95) -> tuple[bytes, int, int]:
    """Encode an image (encoded bytes or uint8 (H, W) / (H, W, 3)) as PNG or JPEG: (bytes, width, height)."""
    pixels = decode_pixels(image)
    options = {"quality": jpeg_quality} if image_format == "jpg" else {}
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format=PIL_FORMATS[image_format], **options)
    height, width = pixels.shape[:2]
    return buffer.getvalue(), width, height


def decode_pixels(image: bytes | np.ndarray) -> np.ndarray:
    """uint8 pixels (H, W) for grayscale or (H, W, 3) for colour; raises ValueError/OSError if unreadable."""
    if isinstance(image, np.ndarray):
        pixels = image[..., 0] if image.ndim == 3 and image.shape[2] == 1 else image
        if pixels.dtype != np.uint8 or not (pixels.ndim == 2 or (pixels.ndim == 3 and pixels.shape[2] == 3)):
            raise ValueError(f"expected uint8 (H, W) or (H, W, 3) pixels, got {image.dtype} {image.shape}")
        return np.ascontiguousarray(pixels)
    with Image.open(io.BytesIO(image)) as opened:
        opened.load()
        upright = ImageOps.exif_transpose(opened)
        return np.asarray(upright.convert("L" if upright.mode in GRAYSCALE_MODES else "RGB"))


def _sample(entry: Entry, piece: TarPiece, index: int, encoded: tuple[bytes, int, int]) -> tuple[dict, dict]:
    """(tar members, manifest row without its ``shard``) of ``entry`` as sample ``index``."""
    image, width, height = encoded
    spec = piece.spec
    key = f"{index:0{piece.key_width}d}"
    class_name = spec.class_names[entry.label] if entry.label is not None else None
    caption = entry.caption or (spec.caption_for(entry.label, index) if entry.label is not None else "")
    metadata = {"index": index, "key": key, "split": piece.split, "label": entry.label,
                "class_name": class_name, "source_id": entry.source_id}
    members = {"__key__": key, spec.image_format: image, "txt": caption.encode(), "json": json.dumps(metadata).encode()}
    if entry.label is not None:
        members["cls"] = str(entry.label).encode()
    return members, {**metadata, "caption": caption, "sha256": hashlib.sha256(image).hexdigest(),
                     "width": width, "height": height}


def _place_tar(piece: TarPiece, folder: Path, tar: Path, first_index: int) -> pa.Table:
    """Put the piece's tar at ``tar`` (linked; renumbered from ``first_index`` when images before it were
    skipped); its manifest rows, numbered and naming the tar."""
    rows = pq.read_table(folder / ROWS)
    shift = first_index - piece.first_index
    if shift:
        _renumber(folder / PIECE_TAR, tar, shift, piece.key_width)
        indices = pc.add(rows["index"], shift)
        rows = rows.set_column(rows.schema.get_field_index("index"), "index", indices)
        keys = pa.array([f"{index:0{piece.key_width}d}" for index in indices.to_pylist()], pa.string())
        rows = rows.set_column(rows.schema.get_field_index("key"), "key", keys)
    else:
        link_or_copy(folder / PIECE_TAR, tar)
    return rows.set_column(rows.schema.get_field_index("shard"), "shard", pa.array([tar.name] * len(rows), pa.string()))


def _renumber(source: Path, tar: Path, shift: int, key_width: int) -> None:
    """Copy the tar ``source`` to ``tar`` with every sample's index (key and ``.json``) moved by ``shift``."""
    with tarfile.open(source) as archive, wds.TarWriter(str(tar), **TAR_OPTIONS) as writer:
        sample: dict[str, Any] = {}
        for member in archive:
            key, ext = member.name.split(".", 1)
            if sample and sample["__key__"] != key:
                writer.write(_renumbered(sample, shift, key_width))
                sample = {}
            sample["__key__"] = key
            sample[ext] = archive.extractfile(member).read()
        if sample:
            writer.write(_renumbered(sample, shift, key_width))


def _renumbered(sample: dict[str, Any], shift: int, key_width: int) -> dict[str, Any]:
    metadata = json.loads(sample["json"])
    metadata["index"] += shift
    metadata["key"] = f"{metadata['index']:0{key_width}d}"
    return {**sample, "__key__": metadata["key"], "json": json.dumps(metadata).encode()}


def _tar_samples(out: Path) -> dict[str, dict[str, int]]:
    """Each tar's sample count (from the manifest), for its entry in the stage record."""
    return {name: {"samples": count} for name, count in shard_sizes(out / MANIFEST).items()}


def _metrics(splits: dict[str, int], errors: int, started: float, **extra: int) -> dict[str, float]:
    """The stage's metrics: samples (in all and per split), ``extra``, errors and seconds taken."""
    per_split = {f"samples/{split}": count for split, count in splits.items()}
    return {"samples": sum(splits.values()), **extra, "errors": errors, **per_split,
            "seconds": round(time.time() - started, 3)}


SHARD = StageKind("shard", shard_stage, shard, (MANIFEST,), split=True)
