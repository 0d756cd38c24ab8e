"""What the two-view contrastive methods share: a backbone and a projection head over two views."""

from __future__ import annotations

import torch
from torch import nn

from repsim.errors import SpecError
from repsim.methods.config import ModelConfig
from repsim.methods.base import Method
from repsim.methods.trainer import Batch
from repsim.models import ProjectionMLP, backbone


class TwoViewMethod(Method):
    """``encoder`` (B, C, H, W) -> (B, F) followed by ``projector`` (B, F) -> (B, D)."""

    def __init__(self, encoder: nn.Module, projector: nn.Module):
        super().__init__()
        self.encoder, self.projector = encoder, projector

    def project_views(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        """(z1, z2), each (B, D), of the first two views, encoded in one pass (BatchNorm sees all 2B)."""
        first, second = batch["views"][:2]
        z1, z2 = self.projector(self.encoder(torch.cat([first, second]))).chunk(2)
        return z1, z2


def backbone_and_projection(model: ModelConfig, in_channels: int, image_size: int) -> tuple[nn.Module, ProjectionMLP]:
    """The configured backbone (ResNet or ViT) for the images' channels and size, and its projection head."""
    encoder = backbone(model.backbone, in_channels, image_size, model.small_images, model.patch_size, model.depth,
                       model.init_encoder)
    projector = ProjectionMLP(encoder.feature_dim, model.projection_hidden_dim, model.projection_dim,
                              model.projection_layers)
    return encoder, projector


def require_labels(labelled: bool, what: str) -> None:
    """SpecError unless the data spec lists classes, which ``what`` needs."""
    if not labelled:
        raise SpecError(f"{what} needs labelled data, but the data spec lists no classes",
                        "add 'classes' to the data spec, or choose a method or similarity that needs no labels")
