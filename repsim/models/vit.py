"""Vision Transformers for self-distillation: torchvision's ``VisionTransformer`` with 1 or 3 input
channels, no head, a learned mask token for masked patches (``forward_tokens``), and a position
embedding interpolated (bicubic) to any input's patch grid, so local crops use the same network;
``forward`` gives the [CLS] feature (B, D) and ``feature_dim`` is D, like :func:`repsim.models.resnet`.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn
from torchvision.models.vision_transformer import VisionTransformer

from repsim.errors import SpecError

PRESETS = {"tiny": (192, 3), "small": (384, 6)}  # width D, attention heads
VITS = tuple(f"vit_{preset}" for preset in PRESETS)


class MaskableViT(VisionTransformer):
    """A ViT whose position embedding is fitted for ``image_size`` inputs, cut into ``patch_size`` patches."""

    def __init__(self, image_size: int, patch_size: int, depth: int, width: int, heads: int, in_channels: int = 3):
        super().__init__(image_size=image_size, patch_size=patch_size, num_layers=depth, num_heads=heads,
                         hidden_dim=width, mlp_dim=4 * width)
        self.conv_proj = nn.Conv2d(in_channels, width, kernel_size=patch_size, stride=patch_size)
        nn.init.trunc_normal_(self.conv_proj.weight, std=math.sqrt(1 / (in_channels * patch_size ** 2)))
        nn.init.zeros_(self.conv_proj.bias)
        self.heads = nn.Identity()
        # learned only by a method that masks patches, which turns its gradient on: a parameter that no loss
        # reaches would stop DistributedDataParallel at its second step
        self.mask_token = nn.Parameter(torch.zeros(1, 1, width), requires_grad=False)
        self.feature_dim = width

    def patch_grid(self, height: int, width: int) -> tuple[int, int]:
        """Rows and columns of patches of an input of ``height`` × ``width`` pixels."""
        return height // self.patch_size, width // self.patch_size

    def forward_tokens(self, images: torch.Tensor,
                       mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """([CLS] (B, D), patches (B, P, D)) of images (B, C, H, W); ``mask`` (B, P) bool marks the
        patches (row-major over the grid) whose embedding becomes the mask token."""
        patches = self.conv_proj(images)
        rows, cols = patches.shape[-2:]
        patches = patches.flatten(2).transpose(1, 2)
        if mask is not None:
            if mask.shape != patches.shape[:2]:
                raise ValueError(f"the mask is {tuple(mask.shape)} but the images give {tuple(patches.shape[:2])} "
                                 f"(batch, patches)")
            patches = torch.where(mask[..., None], self.mask_token.to(patches.dtype), patches)
        tokens = torch.cat([self.class_token.expand(patches.shape[0], -1, -1), patches], dim=1)
        tokens = self.encoder.dropout(tokens + self.position_embedding(rows, cols))
        tokens = self.encoder.ln(self.encoder.layers(tokens))
        return tokens[:, 0], tokens[:, 1:]

    def position_embedding(self, rows: int, cols: int) -> torch.Tensor:
        """(1, 1 + rows·cols, D): the [CLS] position and the patch positions resized to the grid."""
        embedding = self.encoder.pos_embedding
        side = self.image_size // self.patch_size
        if (rows, cols) == (side, side):
            return embedding
        grid = embedding[:, 1:].reshape(1, side, side, -1).permute(0, 3, 1, 2)
        grid = F.interpolate(grid, size=(rows, cols), mode="bicubic", align_corners=False)
        return torch.cat([embedding[:, :1], grid.permute(0, 2, 3, 1).flatten(1, 2)], dim=1)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        """The [CLS] features (B, D) of images (B, C, H, W)."""
        return self.forward_tokens(images)[0]


def vit(preset: str = "tiny", image_size: int = 224, patch_size: int = 16, depth: int = 12,
        in_channels: int = 3) -> MaskableViT:
    """A randomly initialised ViT: ``tiny`` (D = 192, 3 heads) or ``small`` (D = 384, 6 heads),
    ``depth`` blocks, MLP width 4·D, position embedding for ``image_size`` inputs."""
    if preset not in PRESETS:
        raise SpecError(f"unknown ViT preset {preset!r}", f"use one of {', '.join(PRESETS)}")
    if image_size % patch_size:
        raise SpecError(f"a patch size of {patch_size} does not divide the image size {image_size}",
                        "choose model.patch_size dividing data.image_size (e.g. 4 for 28 px, 16 for 224 px)")
    width, heads = PRESETS[preset]
    network = MaskableViT(image_size, patch_size, depth, width, heads, in_channels)
    network.recipe = {"builder": "vit", "preset": preset, "image_size": image_size, "patch_size": patch_size,
                      "depth": depth, "in_channels": in_channels}
    return network
