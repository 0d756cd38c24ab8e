"""Augmentation presets: shapes, dtypes, exact eval pixels, randomness, channel handling, pickling."""

from __future__ import annotations

import pickle

import pytest
import torch
from torchvision.transforms import v2

from repsim.data.augment import blur_kernel_size, make_views
from repsim.errors import SpecError


def image(channels: int, size: int = 28, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (channels, size, size), dtype=torch.uint8, generator=generator)


def view_shapes(preset: str, channels: int, size: int = 28, **options) -> list[tuple[int, ...]]:
    views = make_views(preset, size, channels, **options)(image(channels, size))
    assert all(view.dtype == torch.float32 for view in views)
    return [tuple(view.shape) for view in views]


@pytest.mark.parametrize("channels", [1, 3])
def test_every_preset_gives_float_views_of_the_right_shapes(channels):
    assert view_shapes("simclr", channels) == [(channels, 28, 28)] * 2
    assert view_shapes("multicrop", channels) == [(channels, 28, 28)] * 2 + [(channels, 12, 12)] * 6
    assert view_shapes("multicrop", channels, local_crops=2, local_size=16) == (
        [(channels, 28, 28)] * 2 + [(channels, 16, 16)] * 2)
    assert view_shapes("eval", channels) == [(channels, 28, 28)]


@pytest.mark.parametrize("channels", [1, 3])
def test_eval_without_resizing_returns_exactly_the_normalised_pixels(channels):
    pixels = image(channels)
    mean, std = [0.2, 0.4, 0.6][:channels], [0.5, 0.25, 0.2][:channels]
    (view,) = make_views("eval", 28, channels, mean=mean, std=std)(pixels)
    expected = (pixels.float() / 255 - torch.tensor(mean)[:, None, None]) / torch.tensor(std)[:, None, None]
    torch.testing.assert_close(view, expected, rtol=0, atol=1e-6)


def test_eval_resizes_the_shorter_side_and_centre_crops():
    wide = torch.zeros(3, 40, 80, dtype=torch.uint8)
    wide[:, :, 10:70] = 255
    (view,) = make_views("eval", 20, 3)(wide)
    assert view.shape == (3, 20, 20)
    assert torch.all(view == 1.0)  # the centre is white: (1 - 0.5) / 0.5
    assert view_shapes("eval", 3, size=32, crop_fraction=0.875) == [(3, 32, 32)]


@pytest.mark.parametrize("preset", ["simclr", "multicrop"])
@pytest.mark.parametrize("channels", [1, 3])
def test_random_views_differ_and_stay_in_the_normalised_range(preset, channels):
    torch.manual_seed(0)
    views = make_views(preset, 28, channels)(image(channels))
    assert not torch.equal(views[0], views[1])
    assert all(view.min() >= -1 - 1e-6 and view.max() <= 1 + 1e-6 for view in views)


def test_single_channel_presets_leave_out_colour_only_ops():
    def ops(channels: int) -> list[v2.Transform]:
        (view, _) = make_views("simclr", 28, channels).transforms
        return [op for step in view.transforms for op in getattr(step, "transforms", [step])]

    gray_jitter = next(op for op in ops(1) if isinstance(op, v2.ColorJitter))
    rgb_jitter = next(op for op in ops(3) if isinstance(op, v2.ColorJitter))
    assert gray_jitter.saturation is None and gray_jitter.hue is None
    assert rgb_jitter.saturation == (0.6, 1.4) and rgb_jitter.hue == (-0.1, 0.1)
    assert not any(isinstance(op, v2.RandomGrayscale) for op in ops(1))
    assert any(isinstance(op, v2.RandomGrayscale) for op in ops(3))


def test_blur_and_solarize_follow_byol_asymmetry():
    first, second = make_views("simclr", 28, 3).transforms
    blur_p = [next(step.p for step in view.transforms if isinstance(step, v2.RandomApply)
                   and isinstance(step.transforms[0], v2.GaussianBlur)) for view in (first, second)]
    assert blur_p == [1.0, 0.1]
    assert not any(isinstance(step, v2.RandomSolarize) for step in first.transforms)
    assert [step.p for step in second.transforms if isinstance(step, v2.RandomSolarize)] == [0.2]


def test_crop_scale_and_blur_kernel_scale_with_the_image_size():
    def crop_scale(size: int) -> tuple[float, float]:
        return make_views("simclr", size, 3).transforms[0].transforms[0].scale

    assert crop_scale(28) == (0.2, 1.0) and crop_scale(224) == (0.08, 1.0)
    assert [blur_kernel_size(size) for size in (12, 28, 96, 224)] == [3, 3, 11, 23]


def test_views_survive_pickling_and_repeat_under_the_same_seed():
    views = pickle.loads(pickle.dumps(make_views("multicrop", 28, 1)))
    pixels = image(1)
    torch.manual_seed(7)
    first = views(pixels)
    torch.manual_seed(7)
    assert all(torch.equal(a, b) for a, b in zip(first, views(pixels)))


def test_bad_presets_and_normalisation_are_reported():
    with pytest.raises(SpecError, match="unknown augmentation preset 'byol'.*simclr, multicrop, eval"):
        make_views("byol", 28, 3)
    with pytest.raises(SpecError, match="mean has 3 values for 1-channel images"):
        make_views("eval", 28, 1, mean=[0.5, 0.5, 0.5])
    with pytest.raises(SpecError, match="4 channels"):
        make_views("eval", 28, 4)
