"""Batched augmentation presets: a uint8 batch (B×C×H×W, C = 1 or 3) → a list of normalised float views.

The presets are repsim.data.augment's, built from its view recipes, so the two cannot drift. All views
of a batch are made in one call on its device, every random parameter drawn per sample; random views
run on kornia, float conversion, normalisation and ``eval`` (equal to the per-image view) on torchvision.
A view has the per-image distribution but for: crops resized from float pixels (not quantised to 1/255
before the colour steps); contrast and saturation greyed with kornia's 0.299/0.587/0.114 weights
(torchvision's 0.2989); the fallback crop, when none of ten candidates fits (p < 1e-6 for square images),
placed at random rather than centred. BatchViews holds no tensors: kornia draws parameters on the CPU,
so with ``seed`` the views are a function of (images, seed) alone, and the caller's RNG is untouched.
"""

from __future__ import annotations

import contextlib
import math
import threading
from collections.abc import Iterator, Sequence
from typing import Any

import kornia.augmentation as K
import torch
from kornia.enhance import (adjust_brightness_accumulative, adjust_contrast_with_mean_subtraction, adjust_hue,
                            adjust_saturation_with_gray_subtraction)
from torch import nn
from torchvision.transforms import v2

from repsim.data.augment import (BLUR_SIGMA, GRAYSCALE_P, JITTER_P, SOLARIZE_THRESHOLD, EvalView, RandomView,
                                 blur_kernel_size, eval_pipeline, preset_recipes)

TORCHVISION_LUMA = (0.2989, 0.587, 0.114)  # torchvision's RGB → grey weights


def make_batch_views(preset: str, image_size: int, channels: int = 3, **options) -> BatchViews:
    """:func:`repsim.data.augment.make_views`, batched: ``preset`` for square views of ``image_size``."""
    recipes = preset_recipes(preset, image_size, channels, **options)
    return BatchViews([eval_pipeline(recipe) if isinstance(recipe, EvalView) else random_view(recipe) for recipe in recipes])


class BatchViews(nn.Module):
    """Make every view of a batch in one call: uint8 B×C×H×W → list of float B×C×s×s, one per view."""

    def __init__(self, views: Sequence[nn.Module]):
        super().__init__()
        self.views = nn.ModuleList(views)

    def forward(self, images: torch.Tensor, seed: int | None = None) -> list[torch.Tensor]:
        """The views of ``images`` on their device; with ``seed``, a function of (images, seed) alone."""
        with forked_rng(seed, images.device):
            return [view(images) for view in self.views]

    def __len__(self) -> int:
        return len(self.views)


def random_view(recipe: RandomView) -> nn.Sequential:
    """Crop → flip → colour jitter → grayscale → blur → solarize → normalise, drawn per sample."""
    steps = [
        v2.ToDtype(torch.float32, scale=True),
        ResizedCrop(recipe.size, recipe.scale),
        K.RandomHorizontalFlip(),
        ColorJitter(*recipe.jitter, p=JITTER_P),
    ]
    if recipe.channels == 3:
        steps.append(K.RandomGrayscale(rgb_weights=torch.tensor(TORCHVISION_LUMA), p=GRAYSCALE_P))
    if recipe.blur_p > 0:
        steps.append(K.RandomGaussianBlur(blur_kernel_size(recipe.size), BLUR_SIGMA, p=recipe.blur_p))
    if recipe.solarize_p > 0:
        steps.append(K.RandomSolarize((SOLARIZE_THRESHOLD, SOLARIZE_THRESHOLD), 0.0, p=recipe.solarize_p))
    return nn.Sequential(*steps, v2.Normalize(recipe.mean, recipe.std))


class ResizedCrop(K.RandomResizedCrop):
    """kornia's RandomResizedCrop boxes (torchvision's sampling), resized as torchvision resizes them
    (bilinear on the half-pixel grid, antialiased), which kornia's own resize does not: float B×C×H×W →
    B×C×size×size, the whole batch by two matrix products with per-sample interpolation weights."""

    def __init__(self, size: int, scale: tuple[float, float]):
        super().__init__((size, size), scale=scale, align_corners=False)

    def apply_transform(self, input: torch.Tensor, params: dict[str, torch.Tensor], flags: dict[str, Any],
                        transform: torch.Tensor | None = None) -> torch.Tensor:
        corners = params["src"][:, [0, 2]].to(input.device, input.dtype, non_blocking=True)  # B×2×(x, y), inclusive
        start, length = corners[:, 0], corners[:, 1] - corners[:, 0] + 1
        height, width = flags["size"]
        rows = resize_weights(start[:, 1], length[:, 1], input.shape[-2], height)  # B×height×H
        columns = resize_weights(start[:, 0], length[:, 0], input.shape[-1], width)  # B×width×W
        return rows[:, None] @ input @ columns[:, None].transpose(-1, -2)


def resize_weights(start: torch.Tensor, length: torch.Tensor, size: int, out_size: int) -> torch.Tensor:
    """B×out_size×size weights resizing the span [start, start + length) of an axis of ``size`` pixels.

    torch's antialiased bilinear filter (the one torchvision resizes with): output pixel i is centred at
    start + (i + 0.5)·scale; input pixels of the span weigh by a triangle of half-width max(scale, 1).
    """
    scale = (length / out_size)[:, None, None]
    centres = start[:, None, None] + (torch.arange(out_size, device=start.device) + 0.5)[:, None] * scale
    pixels = torch.arange(size, device=start.device, dtype=start.dtype)
    weights = (1 - ((pixels + 0.5 - centres) / scale.clamp(min=1)).abs()).clamp(min=0)
    inside = (pixels >= start[:, None, None]) & (pixels < (start + length)[:, None, None])
    weights = weights * inside
    return weights / weights.sum(-1, keepdim=True)


class ColorJitter(K.ColorJitter):
    """torchvision's v2.ColorJitter on a float B×C×H×W batch in [0, 1], factors and order drawn per sample.

    kornia's ColorJitter has torchvision's steps and ranges but draws one order of the four steps for the
    whole batch; torchvision draws one per image, and so does this class.
    """

    NEUTRAL = (1.0, 1.0, 1.0, 0.0)
    FACTORS = ("brightness_factor", "contrast_factor", "saturation_factor", "hue_factor")

    def generate_parameters(self, batch_shape: tuple[int, ...]) -> dict[str, torch.Tensor]:
        params = super().generate_parameters(batch_shape)
        params["order"] = torch.rand(batch_shape[0], 4, device=self.device).argsort(dim=1)  # B×4 permutations
        return params

    def apply_transform(self, input: torch.Tensor, params: dict[str, torch.Tensor], flags: dict[str, Any],
                        transform: torch.Tensor | None = None) -> torch.Tensor:
        output = input.clone()
        for position in range(4):
            for step, (adjust, key, neutral) in enumerate(zip(ADJUSTMENTS, self.FACTORS, self.NEUTRAL)):
                factor = params[key]
                rows = torch.nonzero((params["order"][:, position] == step) & (factor != neutral)).squeeze(1)
                if len(rows):
                    on_device = rows.to(output.device, non_blocking=True)
                    output.index_copy_(0, on_device, adjust(output[on_device], factor[rows]))
        return output


def _adjust_hue_turns(image: torch.Tensor, turns: torch.Tensor) -> torch.Tensor:
    return adjust_hue(image, turns * 2 * math.pi)


ADJUSTMENTS = (adjust_brightness_accumulative, adjust_contrast_with_mean_subtraction,
               adjust_saturation_with_gray_subtraction, _adjust_hue_turns)


DEFAULT_GENERATORS = threading.RLock()
"""Held while a block seeds and draws from torch's default generators, which every thread of a process shares:
stages that run at once on threads (``repsim run --concurrency``) would otherwise draw from each other's seeds."""


@contextlib.contextmanager
def forked_rng(seed: int | None, device: torch.device) -> Iterator[None]:
    """Run the block with the CPU's and ``device``'s generators seeded to ``seed`` (if not None), then
    restore them; kornia draws on the CPU, ``device``'s generator is for modules moved there. The block
    holds :data:`DEFAULT_GENERATORS`, so no other thread's seeding or drawing falls inside it."""
    if seed is None:
        yield
        return
    accelerator = device.type != "cpu"
    with DEFAULT_GENERATORS, torch.random.fork_rng(devices=[device] if accelerator else [],
                                                    device_type=device.type):
        torch.default_generator.manual_seed(seed)
        if accelerator:
            module = torch.get_device_module(device.type)
            with module.device(device):
                module.manual_seed(seed)
        yield
