"""Readers for every data-spec source type, and the split assignment.

A reader lists its samples cheaply as columns (:class:`Listing`, tens of bytes a sample) and reads an
image only when asked: encoded bytes (PNG, JPEG, ...) or a uint8 array (H, W) or (H, W, 3). Source ids are
stable across runs and machines: ``train/123`` (Fashion-MNIST split/row), ``123`` (Animal-MNIST row), the
path relative to the folder (image folders) or as written in the manifest, ``<tar name>/<sample key>``
(WebDataset shards).
"""

from __future__ import annotations

import glob
import gzip
import importlib.util
import json
import os
import pickle
import re
import tarfile
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass
from functools import cached_property
from itertools import chain, islice
from pathlib import Path
from typing import Any

import braceexpand
import numpy as np
import pyarrow as pa

from repsim.data import remote
from repsim.data.remote import beside, is_url
from repsim.data.spec import (FASHION_MNIST_FIX, AnimalMnistSource, DataSpec, FashionMnistSource, ImageFolderSource,
                              ManifestSource, RandomSplit, WebDatasetSource)
from repsim.errors import DataError
from repsim.stage import fingerprint_files

ImageData = bytes | np.ndarray
SPLIT_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_]*$")


@dataclass(frozen=True, slots=True)
class Entry:
    """One sample as listed, before its image is read; ``ref`` is the reader's handle to the image."""

    source_id: str
    label: int | None = None
    caption: str | None = None
    split: str | None = None
    ref: Any = None


LISTING_BATCH = 65536  # entries turned into columns at a time


class Listing(Sequence[Entry]):
    """A source's entries as columns: ids, captions and splits as pyarrow strings, labels int64 (-1: none),
    handles an int64 array (R, width) when all are tuples of ints, else a list. ``listing[i]`` builds entry i."""

    def __init__(self, entries: Iterable[Entry]):
        ids, labels, captions, splits, refs = [], [], [], [], []
        entries = iter(entries)
        while batch := list(islice(entries, LISTING_BATCH)):
            ids.append(pa.array([entry.source_id for entry in batch], pa.string()))
            labels.append(np.array([-1 if entry.label is None else entry.label for entry in batch], dtype=np.int64))
            captions.append(pa.array([entry.caption for entry in batch], pa.string()))
            splits.append(pa.array([entry.split for entry in batch], pa.string()))
            refs.append(_compact([entry.ref for entry in batch]))
        self.source_ids, self.captions, self.splits = (pa.concat_arrays(column) if column else pa.array([], pa.string())
                                                       for column in (ids, captions, splits))
        self.labels = np.concatenate(labels) if labels else np.empty(0, dtype=np.int64)
        self.refs = np.concatenate(refs) if refs and all(isinstance(part, np.ndarray) for part in refs) \
            else [ref for part in refs for ref in part]

    def __len__(self) -> int:
        return len(self.labels)

    @classmethod
    def _of_columns(cls, source_ids: pa.Array, captions: pa.Array, splits: pa.Array, labels: np.ndarray,
                    refs: np.ndarray | list[Any]) -> Listing:
        """A listing of these columns as they are (no Entry built)."""
        listing = object.__new__(cls)
        listing.source_ids, listing.captions, listing.splits, listing.labels, listing.refs = \
            source_ids, captions, splits, labels, refs
        return listing

    @classmethod
    def concat(cls, listings: Sequence[Listing]) -> Listing:
        """The entries of ``listings`` one after another, as one listing."""
        refs = [listing.refs for listing in listings]
        arrays = all(isinstance(part, np.ndarray) for part in refs) and len({part.shape[1] for part in refs}) == 1
        return cls._of_columns(*(pa.concat_arrays([getattr(listing, name) for listing in listings])
                                 for name in ("source_ids", "captions", "splits")),
                               np.concatenate([listing.labels for listing in listings]),
                               np.concatenate(refs) if arrays else
                               [tuple(ref.tolist()) if isinstance(part, np.ndarray) else ref for part in refs for ref in part])

    def take(self, rows: np.ndarray) -> Listing:
        """The entries at ``rows`` as a listing of their own."""
        positions = pa.array(rows, pa.int64())
        return self._of_columns(*(column.take(positions) for column in (self.source_ids, self.captions, self.splits)),
                                self.labels[rows],
                                self.refs[rows] if isinstance(self.refs, np.ndarray) else [self.refs[row] for row in rows])

    def __getitem__(self, row: int) -> Entry:
        if isinstance(row, slice):
            raise TypeError("a Listing is indexed one entry at a time")
        ref = self.refs[row]
        label = int(self.labels[row])
        return Entry(self.source_ids[row].as_py(), None if label < 0 else label, self.captions[row].as_py(),
                     self.splits[row].as_py(), tuple(ref.tolist()) if isinstance(ref, np.ndarray) else ref)


def _compact(refs: list[Any]) -> np.ndarray | list[Any]:
    """Handles that are all tuples of ints of one width as an int64 array (R, width), else as they are."""
    widths = {len(ref) if isinstance(ref, tuple) and all(isinstance(v, int) for v in ref) else -1 for ref in refs}
    return np.array(refs, dtype=np.int64).reshape(len(refs), -1) if len(widths) == 1 and widths != {-1} else refs


@dataclass(frozen=True, slots=True)
class Record:
    """One sample with its image: encoded bytes or a uint8 array (H, W) / (H, W, 3)."""

    source_id: str
    image: ImageData
    label: int | None
    caption: str | None
    split: str | None


class Reader(ABC):
    """Lists a source's samples and reads their images on demand; :attr:`skipped`: what ``on_error: skip`` left out."""

    def __init__(self, spec: DataSpec):
        self.spec = spec
        self.label_ids = {name: label for label, name in enumerate(spec.class_names)}
        self.skipped: list[dict[str, str]] = []
        self._listing: Listing | None = None

    @abstractmethod
    def fingerprint(self) -> str:
        """A digest of the source files (paths, sizes, times) that changes when the data does."""

    def entries(self, executor: Executor | None = None) -> Listing:
        """Every sample in source order, without reading images; listed once (so each problem is reported once).
        A source listed in :meth:`parts` lists them on ``executor`` when given."""
        if self._listing is None:
            parts = self.parts()
            if executor is None or len(parts) < 2:
                self._listing = Listing(self.list_entries())
            else:
                listed = list(executor.map(list_part, [self.spec] * len(parts), parts))
                self.skipped += [skipped for _, part_skipped in listed for skipped in part_skipped]
                self._listing = Listing.concat([listing for listing, _ in listed])
        return self._listing

    def parts(self) -> list[Any]:
        """The parts the listing can be cut into, each listed by :meth:`list_part`; by default one, the whole."""
        return [None]

    def list_part(self, part: Any) -> Iterable[Entry]:
        """The samples of one of :meth:`parts`, in source order; by default (the one part) all of them."""
        return self.list_entries()

    @abstractmethod
    def list_entries(self) -> Iterable[Entry]:
        """The samples as :meth:`entries` lists them."""

    @abstractmethod
    def read(self, entry: Entry) -> ImageData:
        """The image of ``entry``; raises OSError/ValueError/DataError when it cannot be read."""

    def locate(self, entry: Entry) -> str:
        """Where a person finds the sample, for error messages."""
        return entry.source_id

    def records(self) -> Iterator[Record]:
        """Every sample with its image, in source order; images are read one at a time."""
        for entry in self.entries():
            yield Record(entry.source_id, self.read(entry), entry.label, entry.caption, entry.split)

    def label_of(self, class_name: str, where: str) -> int:
        """The label id of a class name found in the data; DataError if the spec does not list it."""
        if not self.label_ids:
            raise DataError(f"{where} gives class {class_name!r} but spec {self.spec.name!r} lists no classes",
                            "add a 'classes' mapping (name: synset) to the data spec")
        if class_name not in self.label_ids:
            raise DataError(f"{where}: class {class_name!r} is not in the spec's classes",
                            f"use one of {self.spec.class_names} or add it to 'classes'")
        return self.label_ids[class_name]

    def fingerprint_of(self, paths: list[Path], root: Path | None = None) -> str:
        """:func:`repsim.stage.fingerprint_files` of ``paths`` as the spec's ``fingerprint`` asks."""
        return fingerprint_files(paths, root, content=self.spec.fingerprint == "content")

    def skip_or_fail(self, source_id: str, what: str, fix: str) -> None:
        """Raise DataError(what, fix) under ``on_error: fail``; under ``skip`` add ``{"source_id", "reason"}``
        to :attr:`skipped`, which the shard stage reports as its errors."""
        if self.spec.on_error == "fail":
            raise DataError(what, fix) from None
        self.skipped.append({"source_id": source_id, "reason": what})


class _ArrayReader(Reader):
    """Images (N, H, W) uint8 and labels (N,) in a pair of files per split (``None``: the source has no split):
    the pairs' names in :attr:`files`, read from :meth:`root` with :attr:`load`; ``ref`` is (split, row)."""

    files: dict[str | None, tuple[str, str]]
    missing_fix: str
    load: Callable[[Path], np.ndarray]

    def root(self) -> Path:
        return Path(self.spec.source.root)

    def _paths(self) -> dict[str | None, tuple[Path, Path]]:
        root = self.root()
        paths = {split: (root / images, root / labels) for split, (images, labels) in self.files.items()}
        for path in chain.from_iterable(paths.values()):
            if not path.is_file():
                raise DataError(f"{path} does not exist", self.missing_fix)
        return paths

    def fingerprint(self) -> str:
        return self.fingerprint_of(list(chain.from_iterable(self._paths().values())))

    @cached_property
    def _arrays(self) -> dict[str | None, tuple[np.ndarray, np.ndarray]]:
        arrays = {}
        for split, (images_path, labels_path) in self._paths().items():
            images, labels = self.load(images_path), self.load(labels_path)
            if images.dtype != np.uint8 or images.ndim != 3 or labels.ndim != 1 or len(images) != len(labels):
                raise DataError(f"{images_path} ({images.dtype} {images.shape}) and {labels_path} ({labels.shape}) "
                                "are not N uint8 images with N labels", "restore the original files")
            if labels.size and (labels.min() < 0 or labels.max() >= len(self.spec.class_names)):
                raise DataError(f"{labels_path} has labels {labels.min()}..{labels.max()} but the spec lists "
                                f"{len(self.spec.class_names)} classes", "list one class per label id in 'classes'")
            arrays[split] = (images, labels)
        return arrays

    def list_entries(self) -> Iterator[Entry]:
        for split, (_, labels) in self._arrays.items():
            for row, label in enumerate(labels):
                yield Entry(str(row) if split is None else f"{split}/{row}", int(label), None, split, (split, row))

    def read(self, entry: Entry) -> ImageData:
        split, row = entry.ref
        return self._arrays[split][0][row]


# ---------------------------------------------------------------------------------------------
# Fashion-MNIST (IDX)

IDX_DTYPES = {0x08: np.uint8, 0x09: np.int8, 0x0B: np.dtype(">i2"), 0x0C: np.dtype(">i4"),
              0x0D: np.dtype(">f4"), 0x0E: np.dtype(">f8")}


def read_idx(path: Path) -> np.ndarray:
    """A gzip'd IDX file as an array of its declared shape (e.g. images (N, 28, 28) uint8)."""
    try:
        with gzip.open(path, "rb") as handle:
            data = handle.read()
    except (OSError, EOFError) as err:
        raise DataError(f"{path} is not a readable gzip file ({err})", "restore the original file") from None
    if len(data) < 4 or data[0] != 0 or data[1] != 0 or data[2] not in IDX_DTYPES:
        raise DataError(f"{path} is not an IDX file (bad magic number)", "restore the original file")
    ndim = data[3]
    dims = tuple(int(d) for d in np.frombuffer(data, ">u4", count=ndim, offset=4))
    dtype = np.dtype(IDX_DTYPES[data[2]])
    offset = 4 + 4 * ndim
    if len(data) - offset != int(np.prod(dims)) * dtype.itemsize:
        raise DataError(f"{path} declares shape {dims} but holds {len(data) - offset} bytes of data",
                        "the file is truncated; restore the original file")
    return np.frombuffer(data, dtype, offset=offset).reshape(dims)


class FashionMnistReader(_ArrayReader):
    """Fashion-MNIST's IDX files; splits ``train`` (60000) and ``test`` (10000), images (28, 28)."""

    files = {"train": ("train-images-idx3-ubyte.gz", "train-labels-idx1-ubyte.gz"),
             "test": ("t10k-images-idx3-ubyte.gz", "t10k-labels-idx1-ubyte.gz")}
    missing_fix = FASHION_MNIST_FIX
    load = staticmethod(read_idx)


# ---------------------------------------------------------------------------------------------
# Animal-MNIST (gzip pickles of numpy arrays)

def _numpy_globals() -> dict[tuple[str, str], Any]:
    """The only globals a pickled numpy array needs, under their numpy 1 and numpy 2 module names."""
    try:
        from numpy._core import multiarray
    except ImportError:  # numpy < 2
        from numpy.core import multiarray
    allowed: dict[tuple[str, str], Any] = {("numpy", "ndarray"): np.ndarray, ("numpy", "dtype"): np.dtype}
    for module in ("numpy.core.multiarray", "numpy._core.multiarray"):
        allowed[(module, "_reconstruct")] = multiarray._reconstruct
        allowed[(module, "scalar")] = multiarray.scalar
    return allowed


class NumpyOnlyUnpickler(pickle.Unpickler):
    """Unpickles numpy arrays and nothing else: any other global raises DataError."""

    allowed = _numpy_globals()

    def find_class(self, module: str, name: str) -> Any:
        try:
            return self.allowed[(module, name)]
        except KeyError:
            raise DataError(f"refusing to unpickle {module}.{name}: only numpy arrays are allowed",
                            "use a pickle that holds a plain numpy array") from None


def load_numpy_pickle(path: Path) -> np.ndarray:
    """A gzip'd pickle of one numpy array, read with :class:`NumpyOnlyUnpickler`."""
    try:
        with gzip.open(path, "rb") as handle:
            value = NumpyOnlyUnpickler(handle).load()
    except (OSError, EOFError, pickle.UnpicklingError) as err:
        raise DataError(f"{path} is not a readable gzip pickle ({err})", "restore the original file") from None
    if not isinstance(value, np.ndarray):
        raise DataError(f"{path} holds a {type(value).__name__}, not a numpy array", "restore the original file")
    return value


def animal_mnist_root() -> Path:
    """The data folder of the installed ``animal-mnist`` package, found without importing it."""
    spec = importlib.util.find_spec("animal_mnist")
    if spec is None or not spec.submodule_search_locations:
        raise DataError("the package animal-mnist is not installed",
                        "pip install animal-mnist, or set source.root to the folder holding its .gz files")
    return Path(list(spec.submodule_search_locations)[0]) / "data" / "Animal_MNIST"


class AnimalMnistReader(_ArrayReader):
    """Animal-MNIST's 10000 silhouettes (28, 28) uint8 with labels 0..9; no split of its own."""

    files = {None: ("animal_data_version_3.gz", "animal_label_version_3.gz")}
    missing_fix = "reinstall animal-mnist or set source.root to the folder holding its .gz files"
    load = staticmethod(load_numpy_pickle)

    def root(self) -> Path:
        return Path(self.spec.source.root) if self.spec.source.root else animal_mnist_root()


# ---------------------------------------------------------------------------------------------
# Image folder

class _ImageFileReader(Reader):
    """A reader whose entries refer to their image files (``Entry.ref``: the file's path)."""

    def read(self, entry: Entry) -> ImageData:
        return entry.ref.read_bytes()

    def locate(self, entry: Entry) -> str:
        return str(entry.ref)


def _visible_dirs(folder: Path) -> list[Path]:
    return sorted(p for p in folder.iterdir() if p.is_dir() and not p.name.startswith("."))


class ImageFolderReader(_ImageFileReader):
    """``root/<class>/<image>`` or, with ``split: {type: source}``, ``root/<split>/<class>/<image>``."""

    @property
    def root(self) -> Path:
        return Path(self.spec.source.root)

    def list_entries(self) -> list[Entry]:
        """Every image, sorted by split, class and file name; ``ref``: its path."""
        if not self.root.is_dir():
            raise DataError(f"image folder {self.root} does not exist", "set source.root to a folder of class folders")
        split_dirs = {None: self.root}
        if self.spec.split.type == "source":
            split_dirs = {folder.name: folder for folder in _visible_dirs(self.root)}
            class_named = [name for name in split_dirs if name in self.label_ids]
            if class_named:
                raise DataError(f"{self.root} holds class folders {class_named}, but 'split: {{type: source}}' expects "
                                "<split>/<class>/<image>", "add split folders or use 'split: {type: random}'")
        entries, seen = [], set()
        for split, split_dir in split_dirs.items():
            for class_dir in self._class_dirs(split_dir):
                seen.add(class_dir.name)
                entries += [Entry(path.relative_to(self.root).as_posix(), self.label_ids[class_dir.name], None, split, path)
                            for path in sorted(class_dir.iterdir())
                            if path.suffix.lower() in self.spec.source.extensions and not path.name.startswith(".")]
        missing = [name for name in self.label_ids if name not in seen]
        if missing:
            raise DataError(f"image folder {self.root} has no folder for classes {missing}",
                            "add a folder per class or remove those classes from the spec")
        return entries

    def _class_dirs(self, folder: Path) -> list[Path]:
        class_dirs = _visible_dirs(folder)
        unknown = [d.name for d in class_dirs if d.name not in self.label_ids]
        if unknown:
            layout = "<split>/<class>/" if folder != self.root else "<class>/"
            raise DataError(f"{folder} has folders {unknown} that are not classes of the spec",
                            f"the layout is {layout}<image>; add those classes to 'classes' or move the folders")
        return class_dirs

    def fingerprint(self) -> str:
        return self.fingerprint_of(list(self.entries().refs), root=self.root)


# ---------------------------------------------------------------------------------------------
# CSV / Parquet manifest

MANIFEST_COLUMNS = ("path", "label", "caption", "split")


def read_table(path: Path) -> dict[str, list[Any]]:
    """The known columns of a CSV or Parquet manifest, as lists (empty CSV cells are None)."""
    import pyarrow.csv as pacsv
    import pyarrow.parquet as pq

    suffix = path.suffix.lower()
    try:
        if suffix == ".csv":
            options = pacsv.ConvertOptions(column_types={c: pa.string() for c in MANIFEST_COLUMNS},
                                           strings_can_be_null=True)
            table = pacsv.read_csv(path, convert_options=options)
        elif suffix in (".parquet", ".pq"):
            table = pq.read_table(path)
        else:
            raise DataError(f"manifest {path} is neither .csv nor .parquet", "save it as CSV or Parquet")
    except (pa.ArrowInvalid, OSError) as err:
        raise DataError(f"manifest {path} is unreadable ({err})", "check that it is valid CSV/Parquet") from None
    return {name: table.column(name).to_pylist() for name in MANIFEST_COLUMNS if name in table.column_names}


def _is_blank(value: Any) -> bool:
    """An absent, NaN or empty table cell."""
    return value is None or (isinstance(value, float) and np.isnan(value)) or (isinstance(value, str)
                                                                                and not value.strip())


def _name_rows(rows: list[int], shown: int = 5) -> str:
    """``row 3`` or ``rows 3, 7, 9`` (the first ``shown``, then how many more), for messages."""
    if len(rows) == 1:
        return f"row {rows[0]}"
    more = f" and {len(rows) - shown} more" if len(rows) > shown else ""
    return f"rows {', '.join(map(str, rows[:shown]))}{more}"


class ManifestReader(_ImageFileReader):
    """A table of ``path`` plus ``label`` (class name) and/or ``caption``, optionally ``split``."""

    @property
    def image_root(self) -> Path:
        source = self.spec.source
        return Path(source.root) if source.root else Path(source.path).parent

    def fingerprint(self) -> str:
        """The manifest file's path, size and mtime (the images it names are not visited)."""
        return self.fingerprint_of([Path(self.spec.source.path)])

    def list_entries(self) -> Iterator[Entry]:
        """The rows in order; a row that repeats an earlier row's image is a DataError, or under ``on_error:
        skip`` reported (the first row is kept). Only caption-only data, whose spec lists no classes, may be
        unlabelled."""
        path = Path(self.spec.source.path)
        columns = read_table(path)
        if "path" not in columns or not ({"label", "caption"} & columns.keys()):
            raise DataError(f"manifest {path} has columns {sorted(columns)}",
                            "it needs a 'path' column and a 'label' and/or 'caption' column")
        if None in columns["path"]:
            raise DataError(f"manifest {path} row {columns['path'].index(None)} has no path", "fill in every path")
        rows = len(columns["path"])
        labels, captions, splits = (columns.get(name, [None] * rows) for name in ("label", "caption", "split"))
        unlabelled = [row for row, label in enumerate(labels) if _is_blank(label)]
        if self.label_ids and unlabelled:
            raise DataError(f"manifest {path} has no label in {_name_rows(unlabelled)}, but the spec lists classes",
                            "give every row one of the spec's classes, or remove 'classes' for caption-only data")
        first_row: dict[str, int] = {}
        for row, (image, label, caption, split) in enumerate(zip(columns["path"], labels, captions, splits)):
            label = None if _is_blank(label) else self.label_of(str(label), f"manifest {path} row {row}")
            first = first_row.setdefault(os.path.normpath(self.image_root / str(image)), row)
            if first == row:
                yield Entry(str(image), label, caption, split, self.image_root / str(image))
            else:
                self.skip_or_fail(str(image), f"manifest {path} rows {first} and {row} both give path {image}",
                                  "keep one row per image, or set 'on_error: skip' in the data spec to keep the first")


# ---------------------------------------------------------------------------------------------
# Existing WebDataset shards

def expand_urls(pattern: str) -> list[Path]:
    """Tar paths from a brace pattern (``a/{000..009}.tar``) and/or glob, in pattern order."""
    paths = []
    for expanded in braceexpand.braceexpand(pattern):
        matches = sorted(glob.glob(expanded)) if glob.has_magic(expanded) else [expanded]
        paths += [Path(match) for match in matches]
    missing = [str(p) for p in paths if not p.is_file()]
    if not paths or missing:
        raise DataError(f"webdataset pattern {pattern!r} matches no tar file" if not paths
                        else f"webdataset shards {missing[:3]} do not exist", "correct source.urls")
    return paths


def split_member_name(name: str) -> tuple[str, str]:
    """WebDataset's convention: the key is the name up to the first dot of its last component."""
    folder, _, base = name.rpartition("/")
    stem, _, ext = base.partition(".")
    return (f"{folder}/{stem}" if folder else stem), ext


def _end_block_at(tar: Path, offset: int) -> bool:
    """Whether an end-of-archive (all-zero) block starts at ``offset``, where tarfile stopped listing: tarfile
    stops silently at the end of the file or at a garbled header too, so this tells a whole tar from a cut one."""
    with open(tar, "rb") as handle:
        handle.seek(offset)
        block = handle.read(tarfile.BLOCKSIZE)
    return bool(block) and not block.strip(b"\0")


class WebDatasetReader(Reader):
    """Samples of existing tars: ``{key}.{image_ext}``, caption ``{key}.txt``, metadata ``{key}.json``. Shards
    read in place (``source.manifest`` set) are keyed by :func:`repsim.data.remote.fingerprint` of each tar,
    the manifest and ``shards.json``."""

    @cached_property
    def tars(self) -> list[Path] | list[str]:
        urls = self.spec.source.urls
        return list(braceexpand.braceexpand(urls)) if is_url(urls) else expand_urls(urls)

    def fingerprint(self) -> str:
        manifest = self.spec.source.manifest
        if manifest is None:
            return self.fingerprint_of(self.tars)
        return remote.fingerprint([*map(str, self.tars), manifest, beside(manifest, "shards.json")])

    def list_entries(self) -> Iterator[Entry]:
        """``ref``: (tar number, data offset, size) of the image member, or None. A damaged tar is a DataError
        or, under ``on_error: skip``, reported, keeping all but its last sample read."""
        for number in self.parts():
            yield from self.list_part(number)

    def parts(self) -> list[int]:
        """Each tar, by its number."""
        return list(range(len(self.tars)))

    def list_part(self, number: int) -> Iterator[Entry]:
        tar = self.tars[number]
        samples, damage = self._tar_samples(tar)
        if damage:
            self.skip_or_fail(tar.name, f"{tar} {damage}", "re-create or re-download it, or set 'on_error: skip' "
                              "in the data spec to keep the samples before the damage")
            samples = dict(list(samples.items())[:-1])
        for key, members in samples.items():
            image = members.get(self.spec.source.image_ext)
            yield Entry(f"{tar.name}/{key}", self._label(members.get("json"), f"{tar}:{key}"), members.get("txt"),
                        None, None if image is None else (number, *image))

    def _tar_samples(self, tar: Path) -> tuple[dict[str, dict[str, Any]], str | None]:
        """{key: {extension: value}} in member order, and why the tar is damaged (None when it is whole)."""
        samples: dict[str, dict[str, Any]] = {}
        try:
            with tarfile.open(tar, "r:") as archive:
                for member in filter(tarfile.TarInfo.isfile, archive):
                    key, ext = split_member_name(member.name)
                    sample = samples.setdefault(key, {})
                    if ext == self.spec.source.image_ext:
                        sample[ext] = (member.offset_data, member.size)
                    elif ext in ("txt", "json"):
                        text = archive.extractfile(member).read().decode("utf-8", errors="replace")
                        sample[ext] = text.strip() if ext == "txt" else text
                ends = _end_block_at(tar, archive.offset)
        except (tarfile.TarError, OSError) as err:
            return samples, f"is not a readable tar ({err})"
        return samples, None if ends else "is truncated (no end-of-archive block after its last member)"

    def _label(self, metadata: str | None, where: str) -> int | None:
        field = self.spec.source.label_field
        if field is None or metadata is None:
            return None
        try:
            value = json.loads(metadata).get(field)
        except (ValueError, AttributeError):
            raise DataError(f"{where}.json is not a JSON object", "fix or remove that sample") from None
        return None if value is None else self.label_of(str(value), where)

    def read(self, entry: Entry) -> ImageData:
        if entry.ref is None:
            raise DataError(f"sample has no .{self.spec.source.image_ext} member",
                            "set source.image_ext to the shards' image extension")
        number, offset, size = entry.ref
        tar = self.tars[number]
        with open(tar, "rb") as handle:
            handle.seek(offset)
            data = handle.read(size)
        if len(data) != size:
            raise DataError(f"{tar} ends inside sample {entry.source_id}", "re-create or re-download it")
        return data

    def locate(self, entry: Entry) -> str:
        return f"{self.tars[entry.ref[0]]} sample {entry.source_id}" if entry.ref else entry.source_id


READERS: dict[type, type[Reader]] = {
    FashionMnistSource: FashionMnistReader, AnimalMnistSource: AnimalMnistReader,
    ImageFolderSource: ImageFolderReader, ManifestSource: ManifestReader, WebDatasetSource: WebDatasetReader,
}


def list_part(spec: DataSpec, part: Any) -> tuple[Listing, list[dict[str, str]]]:
    """(the entries of one part of ``spec``'s source, what ``on_error: skip`` left out of it). Runs on a worker."""
    reader = open_source(spec)
    return Listing(reader.list_part(part)), reader.skipped


def open_source(spec: DataSpec) -> Reader:
    """The reader for ``spec.source``; nothing is read until it is asked for."""
    return READERS[type(spec.source)](spec)


# ---------------------------------------------------------------------------------------------
# Splits

def assign_splits(entries: Listing, spec: DataSpec) -> list[str]:
    """The split of each entry: the source's own (``source``) or a seeded random split, which permutes each
    group (each label when ``stratify``, else all) and cuts it at the fractions by largest remainder, so every
    class gets exactly its share (1000 images at 0.8/0.2 give 800/200)."""
    if isinstance(spec.split, RandomSplit):
        splits = _random_splits(entries.labels, spec.split)
    else:
        splits = entries.splits.to_pylist()
        if any(split is None for split in splits):
            raise DataError(f"source {spec.source.type!r} of {spec.name!r} has no splits of its own",
                            "use 'split: {type: random}' in the data spec")
    bad = sorted({s for s in splits if not SPLIT_NAME.match(s)})
    if bad:
        raise DataError(f"split names {bad} are not plain names", "use letters, digits and underscores")
    return splits


def _random_splits(labels: np.ndarray, split: RandomSplit) -> list[str]:
    """Each entry's split name; ``labels`` (N,) int64, -1 for none (the last group)."""
    names = list(split.fractions)
    groups = labels if split.stratify else np.full(len(labels), -1)
    order = np.argsort(groups, kind="stable")  # each group's entries together, in source order
    values, starts, counts = np.unique(groups[order], return_index=True, return_counts=True)
    rng = np.random.default_rng(split.seed)
    assigned = np.zeros(len(labels), dtype=np.int64)
    for _, start, count in sorted(zip(values, starts, counts), key=lambda group: (group[0] < 0, group[0])):
        members = rng.permutation(order[start:start + count])
        bounds = np.cumsum([0, *exact_counts(len(members), list(split.fractions.values()))])
        for code, (first, last) in enumerate(zip(bounds[:-1], bounds[1:])):
            assigned[members[first:last]] = code
    return [names[code] for code in assigned]


def exact_counts(total: int, fractions: list[float]) -> list[int]:
    """Split ``total`` into integer counts proportional to ``fractions`` (largest remainder)."""
    raw = [total * f for f in fractions]
    counts = [int(np.floor(r)) for r in raw]
    by_remainder = sorted(range(len(raw)), key=lambda i: (counts[i] - raw[i], i))
    for i in by_remainder[:total - sum(counts)]:
        counts[i] += 1
    return counts


def split_order(splits: list[str], spec: DataSpec) -> list[str]:
    """Splits in the order they are written: the fractions' order, else first appearance."""
    present = dict.fromkeys(splits)
    if isinstance(spec.split, RandomSplit):
        return [name for name in spec.split.fractions if name in present]
    return list(present)
