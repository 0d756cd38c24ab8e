"""SupCon (Khosla et al., 2020): every view of the same class is a positive."""

from __future__ import annotations

from typing import Literal

import torch
from pydantic import Field
from torch import nn

from repsim.losses import SupConLoss
from repsim.layering import Strict
from repsim.methods.config import Config
from repsim.methods.contrastive import TwoViewMethod, backbone_and_projection, require_labels
from repsim.methods.base import TrainingData, register
from repsim.methods.trainer import Batch


class SupConConfig(Strict):
    """SupCon at ``temperature``; needs labelled data."""

    name: Literal["supcon"]
    temperature: float = Field(0.1, gt=0)


class SupCon(TwoViewMethod):
    """Backbone + projection trained with the supervised contrastive loss over all ranks' views."""

    def __init__(self, encoder: nn.Module, projector: nn.Module, temperature: float = 0.1):
        super().__init__(encoder, projector)
        self.loss = SupConLoss(temperature, gather=True)

    def training_step(self, batch: Batch) -> dict[str, torch.Tensor]:
        return {"loss": self.loss(*self.project_views(batch), batch["label"])}


@register("supcon", settings=SupConConfig)
def build(config: Config, data: TrainingData) -> SupCon:
    require_labels(data.labelled, "SupCon")
    return SupCon(*backbone_and_projection(config.model, data.channels, data.image_size), config.method.temperature)
