"""SimCLR (Chen et al., 2020): two augmented views of each sample must find each other (NT-Xent)."""

from __future__ import annotations

from typing import Literal

import torch
from pydantic import Field
from torch import nn

from repsim.losses import NTXentLoss
from repsim.layering import Strict
from repsim.methods.config import Config
from repsim.methods.contrastive import TwoViewMethod, backbone_and_projection
from repsim.methods.base import TrainingData, register
from repsim.methods.trainer import Batch


class SimCLRConfig(Strict):
    """SimCLR's NT-Xent at ``temperature``."""

    name: Literal["simclr"]
    temperature: float = Field(0.1, gt=0)


class SimCLR(TwoViewMethod):
    """Backbone + projection trained with NT-Xent over all ranks' views."""

    def __init__(self, encoder: nn.Module, projector: nn.Module, temperature: float = 0.1):
        super().__init__(encoder, projector)
        self.loss = NTXentLoss(temperature, gather=True)

    def training_step(self, batch: Batch) -> dict[str, torch.Tensor]:
        return {"loss": self.loss(*self.project_views(batch))}


@register("simclr", settings=SimCLRConfig)
def build(config: Config, data: TrainingData) -> SimCLR:
    return SimCLR(*backbone_and_projection(config.model, data.channels, data.image_size), config.method.temperature)
