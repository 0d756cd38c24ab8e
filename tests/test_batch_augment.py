"""Batched augmentation: shapes and seeding, torchvision's colour semantics, view statistics equal to the
per-image pipeline's, and the loader's batch mode (same batches, seeded by position, resumable)."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from itertools import islice

import pytest
import torch
from scipy import stats
from torchvision.transforms.v2 import functional as TF

from repsim.data.augment import make_views
from repsim.data.batch_augment import ColorJitter, make_batch_views
from repsim.data.loader import make_loader, stack_images
from repsim.data.stage import ShardResult, shard
from repsim.errors import SpecError

SAMPLES = 2000  # views per statistic
STRICT = 1e-3  # smallest p-value accepted as "same distribution"
PLAIN = {"mean": 0.0, "std": 1.0}  # views equal to pixels / 255
STEP = 9  # grey levels per pixel of a ramp: 0, 9, ..., 243 across 28 pixels
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def images(batch: int, channels: int, height: int = 28, width: int = 28, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (batch, channels, height, width), dtype=torch.uint8, generator=generator)


def filled(*columns: int, batch: int = SAMPLES, size: int = 28) -> torch.Tensor:
    """uint8 B×1×size×size images split into vertical bands of the given grey levels."""
    band = torch.tensor(columns, dtype=torch.uint8).repeat_interleave(-(-size // len(columns)))[:size]
    return band.expand(batch, 1, size, size).contiguous()


def ramp(axis: int, batch: int = SAMPLES, size: int = 28) -> torch.Tensor:
    """uint8 B×1×size×size images rising by STEP per pixel along ``axis`` (-1: x, -2: y)."""
    levels = (torch.arange(size) * STEP).to(torch.uint8)
    image = levels.expand(size, size) if axis == -1 else levels[:, None].expand(size, size)
    return image.expand(batch, 1, size, size).contiguous()


def both(inputs: torch.Tensor, preset: str = "simclr", view: int = 0, **options) -> list[torch.Tensor]:
    """View ``view`` of ``inputs`` per image (image i under torch seed i), then batched: two B×C×s×s."""
    views = make_views(preset, 28, inputs.shape[1], **options)
    outputs = []
    for seed, image in enumerate(inputs):
        torch.manual_seed(seed)
        outputs.append(views(image)[view])
    return [torch.stack(outputs), make_batch_views(preset, 28, inputs.shape[1], **options)(inputs, seed=0)[view]]


def same_distribution(first: torch.Tensor, second: torch.Tensor) -> float:
    """Two-sample Kolmogorov-Smirnov p-value."""
    return stats.ks_2samp(first.numpy(), second.numpy()).pvalue


def has_rate(events: torch.Tensor, probability: float) -> float:
    """Binomial p-value that the boolean ``events`` are True with ``probability``."""
    return stats.binomtest(int(events.sum()), len(events), probability).pvalue


def grey_levels(views: torch.Tensor) -> torch.Tensor:
    """The mean of each view in grey levels (0-255, rounded)."""
    return (views.mean((1, 2, 3)) * 255).round()


def extent(views: torch.Tensor, axis: int) -> torch.Tensor:
    """The source pixels spanned by ramp views along ``axis``: the crop's side when upscaled."""
    profile = views.mean(dim=-2 if axis == -1 else -1)[:, 0]  # B×s along the ramp
    return (profile.amax(-1) - profile.amin(-1)) * 255 / STEP + 1


def area_fraction(x_views: torch.Tensor, y_views: torch.Tensor) -> torch.Tensor:
    return extent(x_views, -1).round() * extent(y_views, -2).round() / 28**2


def centre(x_views: torch.Tensor) -> torch.Tensor:
    return x_views.mean((1, 2, 3)) * 255 / STEP


def flipped(x_views: torch.Tensor) -> torch.Tensor:
    return x_views[:, 0, :, 0].mean(-1) > x_views[:, 0, :, -1].mean(-1)


def spread(views: torch.Tensor) -> torch.Tensor:
    """The range of each view in grey levels (0-255, rounded)."""
    return ((views.amax((1, 2, 3)) - views.amin((1, 2, 3))) * 255).round()


@pytest.mark.parametrize("channels", [1, 3])
@pytest.mark.parametrize(("preset", "options"), [("simclr", {}), ("multicrop", {}),
                                                 ("multicrop", {"local_crops": 2, "local_size": 16}),
                                                 ("eval", {}), ("eval", {"crop_fraction": 0.875})])
def test_views_have_the_shapes_and_dtypes_of_the_per_image_views(preset, options, channels):
    batch = images(4, channels, 30, 36)
    expected = [((4, *view.shape), view.dtype) for view in make_views(preset, 28, channels, **options)(batch[0])]
    batched = make_batch_views(preset, 28, channels, **options)(batch)
    assert [(tuple(view.shape), view.dtype) for view in batched] == expected


@pytest.mark.parametrize("channels", [1, 3])
def test_eval_views_equal_the_per_image_ones(channels):
    batch = images(3, channels, 40, 50)
    (expected,) = zip(*(make_views("eval", 24, channels, crop_fraction=0.875)(image) for image in batch))
    (view,) = make_batch_views("eval", 24, channels, crop_fraction=0.875)(batch)
    assert torch.equal(view, torch.stack(expected))


@pytest.mark.usefixtures("one_torch_thread")
def test_a_seed_fixes_the_views_and_leaves_the_global_rng_alone():
    views, batch = make_batch_views("multicrop", 28, 3), images(1, 3).repeat(8, 1, 1, 1)
    state = torch.get_rng_state()
    first, again, other = views(batch, seed=1), views(batch, seed=1), views(batch, seed=2)
    assert torch.equal(state, torch.get_rng_state())
    assert all(torch.equal(a, b) for a, b in zip(first, again))
    assert not any(torch.equal(a, c) for a, c in zip(first, other))
    assert all(not torch.equal(view[0], view[1]) for view in first)  # one image, parameters drawn per sample


def test_seeded_views_made_on_threads_at_once_are_the_views_made_alone():
    """Stages that run at once on threads share torch's default generator: a seed must still fix its views."""
    views, batch = make_batch_views("simclr", 28, 3), images(1, 3).repeat(32, 1, 1, 1)
    alone = {seed: views(batch, seed=seed) for seed in range(4)}
    with ThreadPoolExecutor(4) as pool:
        at_once = list(pool.map(lambda seed: (seed, views(batch, seed=seed)), [*range(4)] * 8))
    assert all(torch.equal(a, b) for seed, made in at_once for a, b in zip(alone[seed], made))


@cuda
def test_on_cuda_a_seed_gives_the_cpu_views_and_leaves_the_cuda_rng_alone():
    views, batch = make_batch_views("simclr", 28, 3), images(8, 3)
    state = torch.cuda.get_rng_state()
    on_cuda, again = views(batch.cuda(), seed=5), views(batch.cuda(), seed=5)
    assert torch.equal(state, torch.cuda.get_rng_state())
    assert all(torch.equal(a, b) for a, b in zip(on_cuda, again))
    for gpu, cpu in zip(on_cuda, views(batch, seed=5)):
        torch.testing.assert_close(gpu.cpu(), cpu, rtol=0, atol=1e-3)  # the same parameters, drawn on the CPU


def test_bad_presets_and_channel_counts_are_reported_as_per_image():
    with pytest.raises(SpecError, match="unknown augmentation preset 'byol'.*simclr, multicrop, eval"):
        make_batch_views("byol", 28, 3)
    with pytest.raises(SpecError, match="4 channels"):
        make_batch_views("simclr", 28, 4)


def test_colour_jitter_is_torchvisions_with_an_order_per_sample():
    jitter, batch = ColorJitter(0.4, 0.4, 0.4, 0.1, p=1.0), torch.rand(64, 3, 16, 16)
    params = jitter.forward_parameters(batch.shape)
    steps = (TF.adjust_brightness, TF.adjust_contrast, TF.adjust_saturation, TF.adjust_hue)
    expected = []
    for i, image in enumerate(batch):
        for step in params["order"][i].tolist():
            image = steps[step](image, params[ColorJitter.FACTORS[step]][i].item())
        expected.append(image)
    # kornia weighs RGB into grey with 0.299 where torchvision uses 0.2989
    torch.testing.assert_close(jitter(batch, params=params), torch.stack(expected), rtol=0, atol=2e-4)
    assert len({tuple(order) for order in params["order"].tolist()}) > 12


@pytest.mark.slow
@pytest.mark.usefixtures("one_torch_thread")
@pytest.mark.parametrize(("preset", "view", "options"), [
    ("simclr", 0, {"blur": (0.0, 0.0), "solarize": (0.0, 0.0)}),  # crops of (0.2, 1) upscaled to 28
    ("multicrop", 2, {"local_crops": 1}),  # crops of (0.05, 0.4) shrunk to 12, blurred half the time
])
def test_crop_area_position_and_flips_are_distributed_as_per_image(preset, view, options):
    options = {"jitter": (0.0, 0.0, 0.0, 0.0), **PLAIN, **options}
    (x_reference, x_batched), (y_reference, y_batched) = (both(ramp(axis), preset, view, **options)
                                                          for axis in (-1, -2))
    assert same_distribution(area_fraction(x_reference, y_reference), area_fraction(x_batched, y_batched)) > STRICT
    assert same_distribution(centre(x_reference), centre(x_batched)) > STRICT
    assert has_rate(flipped(x_reference), 0.5) > STRICT and has_rate(flipped(x_batched), 0.5) > STRICT


@pytest.mark.slow
@pytest.mark.usefixtures("one_torch_thread")
def test_brightness_and_contrast_jitter_are_distributed_as_per_image():
    still = {"blur": (0.0, 0.0), "solarize": (0.0, 0.0), "crop_scale": (1.0, 1.0), **PLAIN}
    brightened = [grey_levels(views) for views in both(filled(128), jitter=(0.4, 0.0, 0.0, 0.0), **still)]
    assert same_distribution(*brightened) > STRICT
    for levels in brightened:  # unchanged: jitter not applied (p = 0.2), or a factor within 1 ± 1/256 of U(0.6, 1.4)
        assert has_rate(levels == 128, 0.2 + 1 / 128) > STRICT
    contrasted = both(filled(64, 192), jitter=(0.0, 0.4, 0.0, 0.0), **still)
    assert same_distribution(*map(spread, contrasted)) > STRICT
    assert same_distribution(*map(grey_levels, contrasted)) > STRICT  # blended with the mean, which stays


@pytest.mark.slow
@pytest.mark.usefixtures("one_torch_thread")
def test_grayscale_and_solarize_rates_follow_each_views_probability():
    still = {"jitter": (0.0, 0.0, 0.0, 0.0), "blur": (0.0, 0.0), **PLAIN}
    for views in both(images(SAMPLES, 3), **still):
        assert has_rate((views[:, 0] == views[:, 1]).all(-1).all(-1), 0.2) > STRICT
    for view, probability in ((0, 0.0), (1, 0.2)):
        for views in both(filled(200), view=view, **still):
            assert has_rate(views.mean((1, 2, 3)) < 0.5, probability) > STRICT


def test_images_of_another_size_are_fitted_to_the_first():
    wide = torch.zeros(1, 24, 48, dtype=torch.uint8)
    wide[:, :, 8:40] = 255
    stacked = stack_images([torch.zeros(1, 12, 12, dtype=torch.uint8), wide, wide[:, :, 12:36]])
    assert stacked.shape == (3, 1, 12, 12)
    assert torch.all(stacked[1:] == 255)  # the white centre, shrunk by half


# ---------------------------------------------------------------------------------------------
# The loader's batch mode

@pytest.fixture
def gray(make_image_folder, write_spec, tmp_path) -> ShardResult:
    """40 grayscale 12×12 images: 32 train samples in 8 tars, 8 test samples in 2 tars."""
    path = write_spec({"name": "tiny", "source": {"type": "image_folder",
                                                  "root": str(make_image_folder({"cat": 20, "dog": 20}, size=12))},
                       "classes": {"cat": "cat.n.01", "dog": "dog.n.01"},
                       "split": {"type": "random", "fractions": {"train": 0.8, "test": 0.2}}, "shard_size": 4})
    return shard(path, out_dir=tmp_path / "shards", progress=False)


def same_views(first: list[dict], second: list[dict]) -> bool:
    return len(first) == len(second) and all(
        torch.equal(a["index"], b["index"]) and all(torch.equal(x, y) for x, y in zip(a["views"], b["views"]))
        for a, b in zip(first, second))


def test_batch_mode_yields_the_batches_of_sample_mode(gray):
    options = {"seed": 3, "with_captions": True, "preset_options": {"local_crops": 2}}
    per_sample = list(make_loader(gray.path, "multicrop", 8, **options))
    per_batch = list(make_loader(gray.path, "multicrop", 8, augment="batch", **options))
    assert len(per_batch) == len(per_sample) == 4
    for sample, batch in zip(per_sample, per_batch):
        assert list(batch) == list(sample) == ["views", "label", "index", "caption"]
        assert [(v.shape, v.dtype, v.device) for v in batch["views"]] == [
            (v.shape, v.dtype, v.device) for v in sample["views"]]
        assert torch.equal(batch["label"], sample["label"]) and torch.equal(batch["index"], sample["index"])
        assert batch["caption"] == sample["caption"]


@pytest.mark.parametrize("num_workers", [0, 2])
def test_batch_mode_is_seeded_by_position_so_a_resumed_epoch_repeats_its_views(gray, num_workers):
    loader = make_loader(gray.path, "simclr", 4, seed=1, num_workers=num_workers, augment="batch")
    state = torch.get_rng_state()
    first = list(loader)
    assert torch.equal(state, torch.get_rng_state())
    loader.set_epoch(0)
    assert same_views(first, list(loader))
    loader.set_epoch(0)
    assert same_views(first[3:], list(islice(loader, 3, None)))
    assert not same_views(first, list(make_loader(gray.path, "simclr", 4, seed=2, num_workers=num_workers,
                                                  augment="batch")))


@cuda
def test_batch_mode_makes_the_views_on_the_device(gray):
    batch = next(iter(make_loader(gray.path, "simclr", 8, augment="batch", device="cuda")))
    assert all(view.is_cuda for view in batch["views"]) and not batch["index"].is_cuda


def test_unknown_augment_modes_and_mismatched_views_are_reported(gray):
    with pytest.raises(SpecError, match="unknown augment 'gpu'; use 'sample'.*or 'batch'"):
        make_loader(gray.path, "simclr", 8, augment="gpu")
    with pytest.raises(SpecError, match="augment='batch' takes a preset name or BatchViews, not Views"):
        make_loader(gray.path, make_views("simclr", 12, 1), 8, augment="batch")
    views = make_batch_views("eval", 6, 1)
    assert next(iter(make_loader(gray.path, views, 4, augment="batch")))["views"][0].shape == (4, 1, 6, 6)
