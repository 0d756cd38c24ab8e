"""Training and evaluation batches from the shard stage's WebDataset tars.

Batches are ``{"views": [B×C×H×W float, ...] (the preset's order), "label": B int64 (-1: none), "index": B
int64 (row in manifest.parquet), "caption": [str] * B (with_captions only)}``; images are decoded straight
to uint8 tensors (torchvision, no PIL). An epoch is cut from the samples of the tars in order (permuted by
(seed, epoch) when shuffling): each rank takes an even, contiguous share of them and each of its workers an
even, contiguous share of the rank's (a tar that a boundary cuts is read by both sides, each skipping to its
own samples). Each worker shuffles and batches what it reads; the main process joins the workers' partial
last batches into whole ones and, with ``drop_last``, stops every rank after ``⌊N / (world_size ×
batch_size)⌋`` batches, which leaves out fewer than a batch per rank. Seeds: shard order (seed,
epoch), shuffle buffer (seed, epoch, rank, worker), per-sample views (seed, epoch, manifest index), per-batch
views (seed, epoch, rank, batch position), so a pass resumed mid-epoch by skipping batches gives the rest the
same views; the global torch RNG is untouched. ``len(loader)``, from ``manifest.parquet``, is the exact
number of batches this rank yields in every epoch, the same for every rank with ``drop_last`` (the default
when shuffling), so DDP ranks step together. Unshuffled, with ``num_workers=0`` on one rank, an epoch yields
every sample once in manifest order.
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import json
import random
import tarfile
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace
from functools import partial
from itertools import islice
from pathlib import Path
from typing import Any

import torch
import webdataset as wds
from torch.utils.data import DataLoader, IterableDataset, get_worker_info
from torchvision.io import ImageReadMode, decode_image
from torchvision.transforms.v2 import functional as TF

from repsim.data.augment import Views, make_views
from repsim.data.batch_augment import BatchViews, forked_rng, make_batch_views
from repsim.data.remote import beside, exists, is_url, open_stream, reaching
from repsim.data.manifest import MANIFEST, shard_sizes
from repsim.data.stage import INDEX, ShardResult
from repsim.device import rank_and_world, torch_threads
from repsim.errors import DataError, RepsimError, SpecError

IMAGE_EXTENSIONS = ("png", "jpg", "jpeg", "webp")
SHARD_NUMBER = "[0-9]" * 5
READ_MODES = {1: ImageReadMode.GRAY, 3: ImageReadMode.RGB}
AUGMENT = {"sample": (Views, make_views), "batch": (BatchViews, make_batch_views)}
Batch = dict[str, Any]


def make_loader(shards: str | Path | ShardResult | Sequence[str | Path], preset: str | Views | BatchViews = "eval",
                batch_size: int = 256, *, split: str = "train", image_size: int | None = None,
                channels: int | None = None, shuffle: bool | None = None, shuffle_buffer: int = 2000,
                drop_last: bool | None = None, seed: int = 0, epoch: int = 0, num_workers: int = 0,
                rank: int | None = None, world_size: int | None = None, with_captions: bool = False,
                pin_memory: bool = False, manifest: str | Path | None = None,
                preset_options: dict[str, Any] | None = None, augment: str = "sample",
                device: str | torch.device | None = None) -> ShardLoader:
    """An iterable of batches (see the module docstring) over the ``split`` of ``shards``.

    ``shards``: a shard output directory, a ShardResult, or tar paths/URLs (or one brace pattern).
    ``preset``: a preset name (repsim.data.augment) built with ``preset_options``, or ready-made Views made
    per image in the workers; with ``augment="batch"``, BatchViews, made per batch in the main process on
    ``device`` (default CPU) from images the workers only decode and stack. ``image_size`` and ``channels``
    default to the first image's shorter side and channels, ``shuffle`` to ``split == "train"``, ``drop_last``
    to ``shuffle``, ``rank``/``world_size`` to torch.distributed's (else 0/1).
    """
    urls, manifest_path = resolve_shards(shards, split, manifest)
    shuffle = split == "train" if shuffle is None else shuffle
    default_rank, default_world_size = rank_and_world()
    rank, world_size = default_rank if rank is None else rank, default_world_size if world_size is None else world_size
    if not 0 <= rank < world_size:
        raise DataError(f"rank {rank} is outside world size {world_size}", "pass 0 <= rank < world_size")
    if channels is None or image_size is None:
        first_channels, first_size = peek_image(urls[0])
        channels, image_size = channels or first_channels, image_size or first_size
    views = build_views(preset, augment, image_size, channels, preset_options or {})
    batch_views = None if isinstance(views, Views) else views
    sizes = shard_sizes(manifest_path) if manifest_path else {}
    stream = ShardStream([ShardPart(url, sizes.get(Path(url).name)) for url in urls],
                         views if batch_views is None else None, channels,
                         batch_size=batch_size, shuffle=shuffle, shuffle_buffer=shuffle_buffer,
                         drop_last=shuffle if drop_last is None else drop_last, seed=seed, epoch=epoch,
                         rank=rank, world_size=world_size, num_workers=num_workers, with_captions=with_captions)
    if not stream.counted and world_size * max(1, num_workers) > 1:
        raise DataError(f"cutting an epoch between {world_size} rank(s) and {num_workers} worker(s) needs each tar's "
                        f"sample count, which {MANIFEST} gives", f"keep {MANIFEST} beside the shards or pass manifest=")
    return ShardLoader(stream, pin_memory, batch_views, device or "cpu")


def build_views(preset: str | Views | BatchViews, augment: str, image_size: int, channels: int,
                options: dict[str, Any]) -> Views | BatchViews:
    """``preset`` for the ``augment`` mode: Views per sample, BatchViews per batch (ready-made ones as they are)."""
    if augment not in AUGMENT:
        raise SpecError(f"unknown augment {augment!r}", "use 'sample' (per image, in the loader workers) "
                        "or 'batch' (per batch, on the training device)")
    kind, make = AUGMENT[augment]
    if isinstance(preset, str):
        return make(preset, image_size, channels, **options)
    if not isinstance(preset, kind):
        raise SpecError(f"augment={augment!r} takes a preset name or {kind.__name__}, not {type(preset).__name__}",
                        f"pass the preset's name or build it with {make.__name__}")
    return preset


# ---------------------------------------------------------------------------------------------
# Finding the shards

def resolve_shards(shards: str | Path | ShardResult | Sequence[str | Path], split: str,
                   manifest: str | Path | None) -> tuple[list[str], str | Path | None]:
    """(tar URLs in order, the manifest if one is known) for ``shards`` as make_loader accepts them."""
    if isinstance(shards, ShardResult):
        shards = shards.path
    if isinstance(shards, (str, Path)) and Path(shards).is_dir():
        urls, manifest = _split_tars(Path(shards), split), manifest or Path(shards) / MANIFEST
    else:
        urls = wds.shardlists.expand_urls(str(shards)) if isinstance(shards, (str, Path)) else [str(u) for u in shards]
        if not urls:
            raise DataError("no shards were given", "pass a shard directory or a list of tar files")
        manifest = manifest or beside(urls[0], MANIFEST)
    return urls, manifest if exists(manifest) else None


def _split_tars(folder: Path, split: str) -> list[str]:
    """The tars of ``split`` in the shard directory ``folder``: its own, or the URLs or absolute paths of
    shards read in place as its shards.json lists them (none when it lists names of tars beside it)."""
    tars = [str(path) for path in sorted(folder.glob(f"{split}-{SHARD_NUMBER}.tar"))]
    index = folder / INDEX
    if not tars and index.is_file():
        listed = json.loads(index.read_text())["splits"].get(split, {}).get("shards", [])
        tars = [tar for tar in listed if is_url(tar) or Path(tar).is_absolute()]
    if not tars:
        found = sorted({path.name.rsplit("-", 1)[0] for path in folder.glob(f"*-{SHARD_NUMBER}.tar")})
        raise DataError(f"{folder} holds no shards of split {split!r}",
                        f"choose one of the splits it holds: {', '.join(found) or 'none'}")
    return tars


def peek_image(url: str) -> tuple[int, int]:
    """(channels as decoded: 1 or 3, shorter side) of the first image in the tar at ``url``."""
    with contextlib.closing(read_samples(url)) as samples:
        sample = next(samples, None)
    if sample is None:
        raise DataError(f"shard {url} holds no samples", "re-run the shard stage")
    image = read_image(sample)
    return (1 if image.shape[0] in (1, 2) else 3), min(image.shape[-2:])


# ---------------------------------------------------------------------------------------------
# Cutting an epoch between ranks and workers

@dataclass(frozen=True)
class ShardPart:
    """Samples ``start`` to ``stop - 1`` of one tar; ``stop`` None: to its end, where read_samples checks the count
    against ``size``, the samples in the tar (None: unknown, without a manifest)."""

    url: str
    size: int | None
    start: int = 0
    stop: int | None = None


def span(start: int, stop: int, pieces: int, piece: int) -> tuple[int, int]:
    """(first, end) of piece ``piece`` of ``pieces`` even, contiguous pieces of the positions start..stop-1."""
    return start + piece * (stop - start) // pieces, start + (piece + 1) * (stop - start) // pieces


def cut(parts: list[ShardPart], start: int, stop: int) -> list[ShardPart]:
    """The parts (of known sizes) holding samples start..stop-1 of their concatenation, each cut to those."""
    cuts, offset = [], 0
    for part in parts:
        first, end = max(start - offset, 0), min(stop - offset, part.size)
        if first < end:
            cuts.append(replace(part, start=first, stop=None if end == part.size else end))
        offset += part.size
    return cuts


def read_parts(parts: list[ShardPart]) -> Iterator[dict[str, Any]]:
    """The raw samples (extension -> bytes) of each part, in order."""
    for part in parts:
        with contextlib.closing(read_samples(part.url, part.size)) as samples:
            yield from islice(samples, part.start, part.stop)


# ---------------------------------------------------------------------------------------------
# Reading tars

def read_samples(url: str, expected: int | None = None) -> Iterator[dict[str, Any]]:
    """The samples of one tar (path or URL) as ``{"__key__", ext: bytes, ...}``; DataError if the tar is
    corrupt or holds other than ``expected`` samples (the manifest's count; e.g. cut at a block boundary)."""
    count = 0
    with open_stream(url) as stream, reaching(url):
        try:
            files = ({**member, "__url__": url} for member in wds.tariterators.tar_file_iterator(stream))
            for sample in wds.tariterators.group_by_keys(files):
                count += 1
                yield sample
        except (tarfile.TarError, EOFError) as err:
            raise DataError(f"{url} is not a readable tar ({err})",
                            "re-run the shard stage or copy the file again") from None
    if expected is not None and count != expected:
        raise DataError(f"{url} holds {count} samples but its manifest lists {expected} (truncated?)",
                        "re-run the shard stage or copy the file again")


# ---------------------------------------------------------------------------------------------
# One epoch of one rank

def derive_seed(*values: int) -> int:
    """A well-mixed 63-bit seed from integers, the same in every process and Python version."""
    digest = hashlib.blake2b(repr(values).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


class ShardStream(IterableDataset):
    """The batches of one rank in one epoch; inside a DataLoader worker, that worker's share of them, whose last
    batch may be partial (:func:`rebatched` joins those). ``num_workers`` is the DataLoader's (0: the main process
    alone); without ``views`` batches hold ``images``."""

    def __init__(self, parts: list[ShardPart], views: Views | None, channels: int, *, batch_size: int, shuffle: bool,
                 shuffle_buffer: int, drop_last: bool, seed: int, epoch: int, rank: int, world_size: int,
                 num_workers: int, with_captions: bool):
        super().__init__()
        self.parts, self.views, self.channels = parts, views, channels
        self.batch_size, self.drop_last = batch_size, drop_last
        self.shuffle, self.shuffle_buffer = shuffle, shuffle_buffer
        self.seed, self.epoch = seed, epoch
        self.rank, self.world_size, self.num_workers = rank, world_size, num_workers
        self.with_captions = with_captions

    @property
    def counted(self) -> bool:
        """Whether every tar's sample count is known (from the manifest)."""
        return all(part.size is not None for part in self.parts)

    def rank_span(self) -> tuple[int, int]:
        """(first, end): this rank's even, contiguous share first..end-1 of the positions of the epoch's samples."""
        return span(0, sum(part.size for part in self.parts), self.world_size, self.rank)

    def worker_parts(self, worker: int) -> list[ShardPart]:
        """The parts ``worker`` reads in this epoch: its even, contiguous share of this rank's; every part when the
        counts are unknown (one reader alone)."""
        parts = list(self.parts)
        if self.shuffle:
            random.Random(derive_seed(self.seed, self.epoch)).shuffle(parts)
        if not self.counted:
            return parts
        return cut(parts, *span(*self.rank_span(), max(1, self.num_workers), worker))

    def __iter__(self) -> Iterator[Batch]:
        info = get_worker_info()
        worker = info.id if info else 0
        stages: list[Any] = [partial(iter, self.worker_parts(worker)), read_parts]
        if self.shuffle:
            seed = derive_seed(self.seed, self.epoch, self.rank, worker)
            stages.append(wds.shuffle(self.shuffle_buffer, initial=self.shuffle_buffer, seed=seed))
        stages += [wds.batched(self.batch_size, collation_fn=None), wds.map(self.decode_batch)]
        return _passing_errors_on(iter(wds.DataPipeline(*stages)))

    def decode_batch(self, samples: list[dict[str, Any]]) -> Batch:
        """Raw samples → a batch: all images decoded first (keeping each phase's working set in cache), then
        each augmented under its own seed (without views, stacked as uint8 B×C×H×W ``images``)."""
        images = [read_image(sample, READ_MODES[self.channels]) for sample in samples]
        indices = [manifest_index(sample) for sample in samples]
        labels = [int(sample["cls"]) if "cls" in sample else -1 for sample in samples]
        captions = [sample.get("txt", b"").decode() for sample in samples] if self.with_captions else None
        if self.views is None:
            return {"images": stack_images(images), **targets(labels, indices, captions)}
        with torch_threads(1):  # per-image and small batched ops gain nothing from intra-op threads
            views = [self.augment(image, index) for image, index in zip(images, indices)]
        return make_batch(views, labels, indices, captions)

    def augment(self, image: torch.Tensor, index: int) -> list[torch.Tensor]:
        """The views of the sample at manifest row ``index`` in this epoch, the same in any process."""
        with seeded_rng(derive_seed(self.seed, self.epoch, index)):
            return self.views(image)

    def batches(self) -> int:
        """The number of batches this rank yields in every epoch: with ``drop_last``, ⌊N / (world_size × batch_size)⌋
        for N samples, on every rank (each share holds at least that many whole batches)."""
        if self.drop_last:
            return sum(part.size for part in self.parts) // (self.world_size * self.batch_size)
        first, end = self.rank_span()
        return -(-(end - first) // self.batch_size)


def _passing_errors_on(batches: Iterator[Batch]) -> Iterator[Batch | RepsimError]:
    """The batches, then a RepsimError yielded in place of one: from a DataLoader worker it reaches the
    main process as it was (torch would wrap it in the worker's traceback), to be raised there as one line."""
    try:
        yield from batches
    except RepsimError as err:
        yield err


def _raising_errors(batches: Iterator[Batch | RepsimError]) -> Iterator[Batch]:
    for batch in batches:
        if isinstance(batch, RepsimError):
            raise batch
        yield batch


def rebatched(batches: Iterator[Batch], size: int, drop_last: bool) -> Iterator[Batch]:
    """The workers' batches with their partial last ones joined into batches of ``size`` as they come; what is
    left at the end (fewer than ``size``) comes last, unless ``drop_last``."""
    rest: Batch | None = None
    for batch in batches:
        if len(batch["index"]) < size:
            rest = batch if rest is None else joined(rest, batch)
            if len(rest["index"]) < size:
                continue
            batch, rest = sliced(rest, 0, size), sliced(rest, size, None)
        yield batch
    if rest is not None and len(rest["index"]) and not drop_last:
        yield rest


def joined(first: Batch, second: Batch) -> Batch:
    """One batch of the samples of ``first`` then those of ``second`` (``images`` at the size of the first image)."""
    def join(key: str, value: Any) -> Any:
        if key == "views":
            return [torch.cat(pair) for pair in zip(value, second[key])]
        if key == "images":
            return stack_images([*value, *second[key]])
        return torch.cat([value, second[key]]) if isinstance(value, torch.Tensor) else value + second[key]
    return {key: join(key, value) for key, value in first.items()}


def sliced(batch: Batch, start: int, stop: int | None) -> Batch:
    """The batch of the samples ``start`` to ``stop - 1`` of ``batch``."""
    return {key: [view[start:stop] for view in value] if key == "views" else value[start:stop]
            for key, value in batch.items()}


def seeded_rng(seed: int) -> contextlib.AbstractContextManager[None]:
    """Run the block with torch's default CPU generator seeded to ``seed``, then restore its state."""
    return forked_rng(seed, torch.device("cpu"))


def make_batch(views: list[list[torch.Tensor]], labels: list[int], indices: list[int],
               captions: list[str] | None = None) -> Batch:
    """The batch dict (see the module docstring) of per-sample views, labels, indices and captions."""
    return {"views": [torch.stack(view) for view in zip(*views)], **targets(labels, indices, captions)}


def targets(labels: list[int], indices: list[int], captions: list[str] | None = None) -> Batch:
    """A batch's ``label`` and ``index`` tensors, and its ``caption`` list when given."""
    batch: Batch = {"label": torch.tensor(labels, dtype=torch.long), "index": torch.tensor(indices, dtype=torch.long)}
    if captions is not None:
        batch["caption"] = captions
    return batch


def stack_images(images: list[torch.Tensor]) -> torch.Tensor:
    """uint8 C×H×W images → B×C×H×W at the first image's size (others resized by :func:`cover`)."""
    size = tuple(images[0].shape[-2:])
    return torch.stack([image if tuple(image.shape[-2:]) == size else cover(image, size) for image in images])


def cover(image: torch.Tensor, size: tuple[int, int]) -> torch.Tensor:
    """``image`` resized, aspect ratio kept, to cover ``size`` (H, W), then centre-cropped to it."""
    height, width = image.shape[-2:]
    scale = max(size[0] / height, size[1] / width)
    resized = TF.resize(image, [max(size[0], round(height * scale)), max(size[1], round(width * scale))],
                        antialias=True)
    return TF.center_crop(resized, list(size))


def manifest_index(sample: dict[str, Any]) -> int:
    """The sample's row in manifest.parquet, from its json member."""
    if "json" not in sample:
        raise DataError(f"sample {sample.get('__key__')} in {sample.get('__url__')} has no json member",
                        "write the shards with the shard stage, which records each sample's manifest index")
    return json.loads(sample["json"])["index"]


def read_image(sample: dict[str, Any], mode: ImageReadMode = ImageReadMode.UNCHANGED) -> torch.Tensor:
    """The raw sample's image member decoded straight to uint8 C×H×W (torchvision's decoder, no PIL)."""
    data = next((sample[ext] for ext in IMAGE_EXTENSIONS if ext in sample), None)
    if data is None:
        raise DataError(f"sample {sample.get('__key__')} in {sample.get('__url__')} has no image",
                        f"shards need one of the members {', '.join(IMAGE_EXTENSIONS)} per sample")
    return decode_image(torch.frombuffer(bytearray(data), dtype=torch.uint8), mode=mode)


# ---------------------------------------------------------------------------------------------
# The loader

class ShardLoader:
    """Iterable of batches over shards, one epoch per pass (each advances ``epoch``); ``len()`` is the number of
    batches in a pass. With ``batch_views`` the stream yields decoded images, and each batch's views are made
    here, on ``device``, on one torch thread."""

    def __init__(self, stream: ShardStream, pin_memory: bool = False, batch_views: BatchViews | None = None,
                 device: str | torch.device = "cpu"):
        self.stream, self.pin_memory = stream, pin_memory
        self.batch_views, self.device = batch_views, torch.device(device)

    @property
    def epoch(self) -> int:
        """The epoch the next pass uses."""
        return self.stream.epoch

    def set_epoch(self, epoch: int) -> None:
        self.stream.epoch = epoch

    @property
    def batch_size(self) -> int:
        return self.stream.batch_size

    def __len__(self) -> int:
        """Batches per pass; TypeError (as for any iterable without a length) when no manifest was found."""
        if not self.stream.counted:
            raise TypeError(f"the number of batches is unknown without {MANIFEST}; "
                            "keep it beside the shards or pass manifest=")
        return self.stream.batches()

    def __iter__(self) -> Iterator[Batch]:
        epoch_stream = copy.copy(self.stream)
        steps = len(self) if epoch_stream.counted else None
        self.stream.epoch += 1
        pin_memory = self.pin_memory or (self.batch_views is not None and self.device.type == "cuda")
        loader = DataLoader(epoch_stream, batch_size=None, num_workers=epoch_stream.num_workers,
                            pin_memory=pin_memory, generator=torch.Generator().manual_seed(epoch_stream.seed))
        batches = islice(rebatched(_raising_errors(iter(loader)), epoch_stream.batch_size, epoch_stream.drop_last), steps)
        return batches if self.batch_views is None else self.augmented(batches, epoch_stream)

    def augmented(self, batches: Iterator[Batch], stream: ShardStream) -> Iterator[Batch]:
        """Each batch with its views made on ``device``, seeded by (seed, epoch, rank, position in the epoch)."""
        for position, batch in enumerate(batches):
            images = batch.pop("images").to(self.device, non_blocking=True)
            with torch_threads(1):
                views = self.batch_views(images, derive_seed(stream.seed, stream.epoch, stream.rank, position))
            yield {"views": views, **batch}
