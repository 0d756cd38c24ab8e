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
Tar members have fixed mtime, owner and mode, so the same spec gives byte-identical tars.
"""

from __future__ import annotations

import hashlib
import io
import json
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import webdataset as wds
from PIL import Image, ImageOps, UnidentifiedImageError
from tqdm.auto import tqdm

from repsim.data import remote
from repsim.data.manifest import MANIFEST, ManifestWriter, shard_sizes
from repsim.data.remote import beside, is_url
from repsim.data.sources import Entry, Reader, assign_splits, open_source, split_order
from repsim.data.spec import DataSpec, load_spec
from repsim.errors import DataError, StageError
from repsim.stage import Stage, StageKind, completed_output, run_stage

SHARD_VERSION = "2"
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


def shard(spec: DataSpec | str | Path, out_dir: str | Path | None = None, progress: bool = True) -> ShardResult:
    """Write ``spec``'s samples as WebDataset shards (keyed by the spec and a fingerprint of the source
    files), or return the cached output at once. DataError for an unreadable source, and under ``on_error:
    fail`` for the first unreadable image, repeated manifest row or damaged source tar (``skip``: counted)."""
    spec = spec if isinstance(spec, DataSpec) else load_spec(spec)
    reader = open_source(spec)
    build = _in_place if getattr(spec.source, "manifest", None) else _build
    output = run_stage(shard_stage(spec, reader), lambda tmp: build(spec, reader, tmp, progress), out_dir,
                       file_details=_tar_samples)
    return ShardResult.from_dir(output.path, cached=output.cached)


def shard_stage(spec: DataSpec, reader: Reader | None = None) -> Stage:
    """The shard stage of ``spec``: its key covers the spec and a fingerprint of the source files (by ``reader``)."""
    source = (reader or open_source(spec)).fingerprint()
    return Stage("shard", SHARD_VERSION, config=spec.model_dump(mode="json"), inputs={"source": source})


# ---------------------------------------------------------------------------------------------
# Building

def _build(spec: DataSpec, reader: Reader, out: Path, progress: bool) -> dict[str, float]:
    started = time.time()
    entries = reader.entries()
    if not entries:
        raise DataError(f"the source of {spec.name!r} holds no samples", "check the source path and contents")
    key_width = max(6, len(str(len(entries) - 1)))
    tar_paths: dict[str, list[str]] = {}
    with ManifestWriter(out / MANIFEST) as manifest, \
            tqdm(total=len(entries), desc=f"shard {spec.name}", unit="img", disable=not progress) as bar:
        for split, members in _write_order(assign_splits(entries, spec), spec):
            # tar members carry mtime 0, owner repsim and mode 0444, so identical samples give identical bytes
            with wds.ShardWriter(str(out / f"{split}-%05d.tar"), maxcount=spec.shard_size, verbose=0, encoder=False,
                                 post=tar_paths.setdefault(split, []).append, mtime=0, user="repsim",
                                 group="repsim") as tars:
                for position in members:
                    bar.update()
                    entry = entries[position]
                    encoded = _encode_or_report(reader, entry, spec)
                    if encoded is not None:
                        _write_sample(tars, manifest, entry, split, encoded, spec, key_width)
    errors = reader.skipped
    if not manifest.rows:
        raise DataError(f"none of the {len(entries)} images of {spec.name!r} is readable",
                        f"see the first failure: {errors[0]['source_id']}: {errors[0]['reason']}")
    index = {"name": spec.name, "image_format": spec.image_format, "num_samples": manifest.rows, "errors": len(errors),
             "splits": {split: {"samples": manifest.splits.get(split, 0), "shards": [Path(path).name for path in paths]}
                        for split, paths in tar_paths.items()}}
    (out / INDEX).write_text(json.dumps(index, indent=2))
    (out / ERRORS).write_text(json.dumps(errors, indent=2))
    return _metrics(manifest.splits, len(errors), started, bytes=sum(path.stat().st_size for path in out.glob("*.tar")))


def _in_place(spec: DataSpec, reader: Reader, out: Path, progress: bool) -> dict[str, float]:
    """The output of shards read in place: their manifest and errors.json fetched, and a shards.json
    that lists the tars of ``source.urls`` by URL under the split their name starts with."""
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
    index |= {"name": spec.name, "num_samples": sum(split["samples"] for split in splits.values()), "splits": splits}
    (out / INDEX).write_text(json.dumps(index, indent=2))
    return _metrics({name: split["samples"] for name, split in splits.items()}, index["errors"], started)


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


def _write_sample(tars: wds.ShardWriter, manifest: ManifestWriter, entry: Entry, split: str,
                  encoded: tuple[bytes, int, int], spec: DataSpec, key_width: int) -> None:
    image, width, height = encoded
    index = manifest.rows
    key = f"{index:0{key_width}d}"
    class_name = spec.class_names[entry.label] if entry.label is not None else None
    caption = entry.caption or (spec.caption_for(entry.label, index) if entry.label is not None else "")
    metadata = {"index": index, "key": key, "split": split, "label": entry.label,
                "class_name": class_name, "source_id": entry.source_id}
    members = {spec.image_format: image, "txt": caption.encode(), "json": json.dumps(metadata).encode()}
    if entry.label is not None:
        members["cls"] = str(entry.label).encode()
    tars.write({"__key__": key, **members})
    manifest.add({**metadata, "shard": Path(tars.fname).name, "caption": caption,
                  "sha256": hashlib.sha256(image).hexdigest(), "width": width, "height": height})


def _tar_samples(out: Path) -> dict[str, dict[str, int]]:
    """Each tar's sample count (from the manifest), for its entry in the stage record."""
    return {name: {"samples": count} for name, count in shard_sizes(out / MANIFEST).items()}


def _metrics(splits: dict[str, int], errors: int, started: float, **extra: int) -> dict[str, float]:
    """The stage's metrics: samples (in all and per split), ``extra``, errors and seconds taken."""
    per_split = {f"samples/{split}": count for split, count in splits.items()}
    return {"samples": sum(splits.values()), **extra, "errors": errors, **per_split,
            "seconds": round(time.time() - started, 3)}


SHARD = StageKind("shard", shard_stage, shard, (MANIFEST,))
