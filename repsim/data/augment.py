"""Augmentation presets: one uint8 image (C×H×W, C = 1 or 3) → a list of normalised float views of side ``image_size``.

- ``simclr``: two views, crop → flip → colour jitter (p=0.8) → grayscale (p=0.2) → blur → solarize,
  with BYOL's asymmetric blur 1.0 / 0.1 and solarize 0.0 / 0.2 (SimCLR's: ``blur=(0.5, 0.5)``,
  ``solarize=(0.0, 0.0)``). Crop scale (0.08, 1) from 96 pixels up, else (0.2, 1): an 8% crop of 28×28
  keeps too little to recognise. Blur kernel 10% of the view, odd, at least 3, sigma in [0.1, 2.0].
- ``multicrop``: DINO/SOP, two global views, scale (0.4, 1), then ``local_crops`` local views at 3/7 of
  the size, scale (0.05, 0.4), blur 0.5.
- ``eval``: resize the shorter side to ``image_size / crop_fraction``, centre-crop; one view.

One-channel images keep one channel and skip saturation, hue and grayscale. Views are normalised as
``(x/255 - mean) / std`` per channel; the default 0.5 / 0.5 maps to [-1, 1] (Fashion-MNIST's own:
mean 0.286, std 0.353). A preset is a list of view recipes (:class:`RandomView`, :class:`EvalView`)
that :func:`make_views` builds as picklable torchvision pipelines, repsim.data.batch_augment as batched ones.
"""

from __future__ import annotations

import inspect

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial

import torch
from torchvision.transforms import v2

from repsim.errors import SpecError

Jitter = tuple[float, float, float, float]
DEFAULT_JITTER: Jitter = (0.4, 0.4, 0.4, 0.1)
JITTER_P = 0.8
GRAYSCALE_P = 0.2
BLUR_SIGMA = (0.1, 2.0)
SOLARIZE_THRESHOLD = 0.5


@dataclass
class Views:
    """Apply a fixed list of transforms to one image: uint8 C×H×W → list of float C×h×w views."""

    transforms: list[Callable[[torch.Tensor], torch.Tensor]]

    def __call__(self, image: torch.Tensor) -> list[torch.Tensor]:
        return [transform(image) for transform in self.transforms]

    def __len__(self) -> int:
        return len(self.transforms)


def make_views(preset: str, image_size: int, channels: int = 3, **options) -> Views:
    """The augmentation ``preset`` ('simclr', 'multicrop', 'eval') for square views of ``image_size``;
    ``options``: the keyword arguments of the preset's recipe (:data:`PRESETS`), e.g. ``blur``, ``mean``."""
    recipes = preset_recipes(preset, image_size, channels, **options)
    return Views([eval_pipeline(recipe) if isinstance(recipe, EvalView) else augmented_view(recipe) for recipe in recipes])


@dataclass(frozen=True)
class RandomView:
    """One random view: crop to ``size`` (area fraction in ``scale``) → flip → colour jitter (p=0.8) →
    grayscale (p=0.2, RGB only) → blur (``blur_p``) → solarize (``solarize_p``) → normalise."""

    size: int
    scale: tuple[float, float]
    blur_p: float
    solarize_p: float
    channels: int
    jitter: Jitter  # brightness, contrast, saturation, hue; saturation and hue 0 for one channel
    mean: list[float]
    std: list[float]


@dataclass(frozen=True)
class EvalView:
    """The deterministic view: resize the shorter side to ``resize``, centre-crop ``size``, normalise."""

    size: int
    resize: int
    mean: list[float]
    std: list[float]


ViewRecipe = RandomView | EvalView


def preset_options(preset: str) -> tuple[str, ...]:
    """The options a preset's recipe takes (its keyword-only parameters)."""
    parameters = inspect.signature(PRESETS[preset]).parameters.values()
    return tuple(parameter.name for parameter in parameters if parameter.kind is parameter.KEYWORD_ONLY)


def preset_recipes(preset: str, image_size: int, channels: int = 3, **options) -> list[ViewRecipe]:
    """The recipes of ``preset``'s views, in order; SpecError for an unknown preset or channel count."""
    if preset not in PRESETS:
        raise SpecError(f"unknown augmentation preset {preset!r}", f"use one of {', '.join(PRESETS)}")
    if channels not in (1, 3):
        raise SpecError(f"images have {channels} channels", "decode them to 1 (grayscale) or 3 (RGB)")
    return PRESETS[preset](image_size, channels, **options)


def simclr(image_size: int, channels: int, *, crop_scale: tuple[float, float] | None = None,
           blur: tuple[float, float] = (1.0, 0.1), solarize: tuple[float, float] = (0.0, 0.2),
           jitter: Jitter = DEFAULT_JITTER, mean: float | Sequence[float] = 0.5,
           std: float | Sequence[float] = 0.5) -> list[RandomView]:
    """Two augmented views; ``blur[i]``/``solarize[i]`` are view i's probabilities."""
    scale = crop_scale or ((0.08, 1.0) if image_size >= 96 else (0.2, 1.0))
    view = _random_view(channels, jitter, mean, std)
    return [view(image_size, scale, blur_p, solarize_p) for blur_p, solarize_p in zip(blur, solarize, strict=True)]


def multicrop(image_size: int, channels: int, *, local_crops: int = 6, local_size: int | None = None,
              global_scale: tuple[float, float] = (0.4, 1.0), local_scale: tuple[float, float] = (0.05, 0.4),
              jitter: Jitter = DEFAULT_JITTER, mean: float | Sequence[float] = 0.5,
              std: float | Sequence[float] = 0.5) -> list[RandomView]:
    """Two global views at ``image_size`` then ``local_crops`` local views at ``local_size`` (3/7 default)."""
    view = _random_view(channels, jitter, mean, std)
    local = view(local_size or max(1, round(image_size * 3 / 7)), local_scale, 0.5, 0.0)
    return [view(image_size, global_scale, 1.0, 0.0), view(image_size, global_scale, 0.1, 0.2)] + [local] * local_crops


def eval_view(image_size: int, channels: int, *, crop_fraction: float = 1.0,
              mean: float | Sequence[float] = 0.5, std: float | Sequence[float] = 0.5) -> list[EvalView]:
    """One deterministic view: resize the shorter side to ``image_size / crop_fraction``, centre-crop."""
    return [EvalView(image_size, round(image_size / crop_fraction), *_mean_std(channels, mean, std))]


PRESETS: dict[str, Callable[..., list[ViewRecipe]]] = {"simclr": simclr, "multicrop": multicrop, "eval": eval_view}


def eval_pipeline(recipe: EvalView) -> v2.Compose:
    """Resize → centre-crop → float → normalise; deterministic, so it applies to a B×C×H×W batch alike."""
    return v2.Compose([
        v2.Resize(recipe.resize, antialias=True),
        v2.CenterCrop(recipe.size),
        v2.ToDtype(torch.float32, scale=True),
        v2.Normalize(recipe.mean, recipe.std),
    ])


def augmented_view(recipe: RandomView) -> v2.Compose:
    """Crop → flip → colour jitter → grayscale → blur → solarize → normalise, for one view of ``size``."""
    steps = [
        v2.RandomResizedCrop(recipe.size, scale=recipe.scale, antialias=True),
        v2.RandomHorizontalFlip(),
        v2.ToDtype(torch.float32, scale=True),
        v2.RandomApply([v2.ColorJitter(*recipe.jitter)], p=JITTER_P),
    ]
    if recipe.channels == 3:
        steps.append(v2.RandomGrayscale(p=GRAYSCALE_P))
    if recipe.blur_p > 0:
        steps.append(v2.RandomApply([v2.GaussianBlur(blur_kernel_size(recipe.size), sigma=BLUR_SIGMA)],
                                    p=recipe.blur_p))
    if recipe.solarize_p > 0:
        steps.append(v2.RandomSolarize(threshold=SOLARIZE_THRESHOLD, p=recipe.solarize_p))
    return v2.Compose([*steps, v2.Normalize(recipe.mean, recipe.std)])


def blur_kernel_size(size: int) -> int:
    """About 10% of ``size``, odd, at least 3 (23 for 224, as in SimCLR)."""
    kernel = round(0.1 * size)
    return max(3, kernel + 1 - kernel % 2)


def _random_view(channels: int, jitter: Jitter, mean: float | Sequence[float],
                 std: float | Sequence[float]) -> Callable[..., RandomView]:
    """``view(size, scale, blur_p, solarize_p)``: a RandomView with the preset's shared settings."""
    brightness, contrast, saturation, hue = jitter
    colour = (brightness, contrast, saturation, hue) if channels == 3 else (brightness, contrast, 0.0, 0.0)
    mean, std = _mean_std(channels, mean, std)
    return partial(RandomView, channels=channels, jitter=colour, mean=mean, std=std)


def _mean_std(channels: int, mean: float | Sequence[float],
              std: float | Sequence[float]) -> tuple[list[float], list[float]]:
    return _per_channel(mean, channels, "mean"), _per_channel(std, channels, "std")


def _per_channel(value: float | Sequence[float], channels: int, name: str) -> list[float]:
    values = [float(value)] * channels if isinstance(value, (int, float)) else [float(v) for v in value]
    if len(values) != channels:
        raise SpecError(f"{name} has {len(values)} values for {channels}-channel images",
                        f"give one value or {channels}")
    return values
