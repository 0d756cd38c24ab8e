"""CLIP baseline (Radford et al., 2021): one image view per sample against its caption, symmetric InfoNCE.

The text tower is the caption stage's frozen sentence-transformer (its ``embeddings.npy``, row = manifest
index) followed by a trainable projection, not a text encoder trained from scratch as in the paper.
"""

from __future__ import annotations

from functools import partial
from typing import Literal

import numpy as np
import torch
from pydantic import Field
from torch import nn

from repsim.losses import ClipLoss
from repsim.layering import Strict
from repsim.methods.config import Config
from repsim.methods.contrastive import backbone_and_projection
from repsim.methods.base import Method, TrainingData, Upstream, register
from repsim.methods.trainer import Batch
from repsim.models import ProjectionMLP
from repsim.similarity.stage import EMBEDDINGS_FILE, embed_captions_stage, embed_captions_stage_of


class ClipConfig(Strict):
    """Image tower against a frozen sentence-transformer's caption embeddings and a trainable projection."""

    name: Literal["clip"]
    temperature: float = Field(0.07, gt=0)
    learn_temperature: bool = True
    text_model: str | None = None
    text_hidden_dim: int | None = Field(None, gt=0, description="hidden width of the text projection; "
                                        "default: a linear projection")


class CLIP(Method):
    """Image tower ``projector(encoder(view))`` against text tower ``text_projection(E[index])``, both to
    ``projector.out_dim``; ``text_embeddings`` (N, T), e.g. a memory map. Logs ``loss`` and ``logit_scale``."""

    def __init__(self, encoder: nn.Module, projector: ProjectionMLP, text_embeddings: np.ndarray,
                 text_projection: nn.Module, temperature: float = 0.07, learn_temperature: bool = True):
        super().__init__()
        self.encoder, self.projector, self.text_projection = encoder, projector, text_projection
        self.text_embeddings = text_embeddings
        self.loss = ClipLoss(temperature, learnable=learn_temperature, gather=True)

    def training_step(self, batch: Batch) -> dict[str, torch.Tensor]:
        image = self.projector(self.encoder(batch["views"][0]))
        captions = np.asarray(self.text_embeddings[batch["index"].cpu().numpy()], dtype=np.float32)
        text = self.text_projection(torch.from_numpy(captions).to(batch["index"].device))
        return {"loss": self.loss(image, text), "logit_scale": self.loss.scale.detach()}


def upstream(config: Config, data: TrainingData) -> Upstream:
    """The caption stage with the method's text model."""
    model = config.method.text_model
    return Upstream(embed_captions_stage_of(data.shards, model).key, partial(embed_captions_stage, data.shards, model))


@register("clip", upstream=upstream, settings=ClipConfig)
def build(config: Config, data: TrainingData) -> CLIP:
    method = config.method
    text_embeddings = np.load(data.upstream.path / EMBEDDINGS_FILE, mmap_mode="r")
    encoder, projector = backbone_and_projection(config.model, data.channels, data.image_size)
    text_dim, hidden = text_embeddings.shape[1], method.text_hidden_dim
    text_projection = (nn.Linear(text_dim, projector.out_dim) if hidden is None
                       else ProjectionMLP(text_dim, hidden, projector.out_dim))
    return CLIP(encoder, projector, text_embeddings, text_projection, method.temperature, method.learn_temperature)
