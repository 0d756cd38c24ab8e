"""CLIP's symmetric InfoNCE over image-text pairs (Radford et al., 2021)."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from repsim.losses._pairs import at_least_float32, gather_with_grad


class ClipLoss(nn.Module):
    """Mean of image->text and text->image cross-entropy of image, text (B, D) (normalised here), row i
    of each side a pair. The logit scale 1/temperature is learned when ``learnable`` (clamped at
    ``max_scale``, as in CLIP); ``gather`` contrasts against every rank's pairs under DDP.

    >>> loss = ClipLoss(temperature=0.07)
    >>> image, text = torch.randn(8, 32), torch.randn(8, 32)  # B = 8 pairs, D = 32
    >>> loss(image, text).shape  # a scalar
    torch.Size([])
    """

    def __init__(self, temperature: float = 0.07, learnable: bool = True, max_scale: float = 100.0,
                 gather: bool = False):
        super().__init__()
        if temperature <= 0:
            raise ValueError("temperature must be positive")
        log_scale = torch.tensor(math.log(1.0 / temperature))
        self.log_scale = nn.Parameter(log_scale) if learnable else nn.Buffer(log_scale)
        self.max_scale, self.gather = max_scale, gather

    @property
    def scale(self) -> torch.Tensor:
        return self.log_scale.exp().clamp(max=self.max_scale)

    def forward(self, image: torch.Tensor, text: torch.Tensor) -> torch.Tensor:
        if image.shape != text.shape or image.ndim != 2:
            raise ValueError(f"image and text must both be (B, D); got {tuple(image.shape)} and {tuple(text.shape)}")
        image, text = F.normalize(at_least_float32(image), dim=1), F.normalize(at_least_float32(text), dim=1)
        all_image, offset = gather_with_grad(image, self.gather)
        all_text, _ = gather_with_grad(text, self.gather)
        targets = torch.arange(image.shape[0], device=image.device) + offset
        image_to_text = self.scale * image @ all_text.T
        text_to_image = self.scale * text @ all_image.T
        return (F.cross_entropy(image_to_text, targets) + F.cross_entropy(text_to_image, targets)) / 2
