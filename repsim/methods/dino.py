"""The DINO-style baseline (Caron et al., 2021) to SOP: learnable prototypes instead of SOPs.

SOP's ViT, views, head and EMA teacher (:mod:`repsim.methods.self_distillation`), the unit projection
through K weight-normalised prototypes and :class:`~repsim.losses.dino.DINOLoss`. With a patch loss and
masking it is the iBOT-style baseline (:mod:`repsim.methods.ibot`).
"""

from __future__ import annotations

from typing import Literal

import torch
from pydantic import Field
import torch.nn.functional as F
from torch import nn

from repsim.data.masking import BlockMasking
from repsim.losses.dino import DINOLoss
from repsim.losses.ibot import IBOTPatchLoss
from repsim.methods.config import Config
from repsim.methods.base import TrainingData, register
from repsim.methods.self_distillation import (Memory, SelfDistillation, SelfDistillationSettings, projection_head,
                                             token_backbone)
from repsim.methods.trainer import Batch

DIAGNOSTIC_MEMORY = 4096


class DinoConfig(SelfDistillationSettings):
    """The DINO-style baseline: ``num_prototypes`` prototypes, the teacher centred with ``center_momentum``;
    the prototypes frozen for the first ``freeze_prototypes`` share of the steps, the teacher temperature
    warmed up to ``final_teacher_temperature`` over the first ``teacher_warmup`` share."""

    name: Literal["dino"]
    num_prototypes: int = Field(4096, gt=1)
    center_momentum: float = Field(0.9, ge=0, lt=1)
    freeze_prototypes: float = Field(0.01, ge=0, lt=1)
    final_teacher_temperature: float = Field(0.07, gt=0)
    teacher_warmup: float = Field(0.3, ge=0, le=1)


class Prototypes(nn.Module):
    """Logits (..., K) of unit embeddings (..., D) against K prototypes of unit length: a linear
    layer weight-normalised with the norm fixed at 1 (DINO's ``norm_last_layer``)."""

    def __init__(self, dim: int, count: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(count, dim))
        nn.init.trunc_normal_(self.weight, std=0.02)

    def forward(self, embeddings: torch.Tensor) -> torch.Tensor:
        return embeddings @ F.normalize(self.weight, dim=1).to(embeddings.dtype).T


class Dino(SelfDistillation):
    """DINO: ``head`` to the unit projection, then ``prototypes`` to K logits. Logs ``loss``, ``koleo`` and
    ``prototype_entropy``; the loss adds ``koleo_weight`` × ``koleo`` (:meth:`SelfDistillation.spreading`), and
    with ``patch_loss`` and ``masking`` (iBOT) ``patch_weight`` × the masked patches' loss, logged with
    ``cls_loss``. ``warmup``: share of the steps over which each teacher
    temperature reaches its ``final_temperatures`` entry ([CLS], patches); ``frozen``: share with no
    prototype update.
    """

    entropy_metric = "prototype_entropy"

    def __init__(self, encoder: nn.Module, head: nn.Module, prototypes: Prototypes, loss: DINOLoss,
                 momentum: float = 0.996, memory_size: int = DIAGNOSTIC_MEMORY, *,
                 patch_loss: IBOTPatchLoss | None = None, patch_weight: float = 1.0,
                 masking: BlockMasking | None = None, final_temperatures: tuple[float, ...] = (),
                 warmup: float = 0.0, frozen: float = 0.0, horizon: float | None = None, koleo_weight: float = 0.0):
        if (patch_loss is None) != (masking is None):
            raise ValueError("a patch loss needs masking, and masking needs a patch loss")
        super().__init__(encoder, nn.Sequential(head, prototypes), momentum, masking, horizon, koleo_weight)
        self.loss, self.patch_loss, self.patch_weight = loss, patch_loss, patch_weight
        self.memory = Memory(memory_size, prototypes.weight.shape[1])
        self.prototypes, self.frozen, self.warmup = prototypes, frozen, warmup
        losses = [loss, patch_loss] if patch_loss is not None else [loss]
        self.temperatures = [(found, float(found.teacher_temperature), final)
                             for found, final in zip(losses, final_temperatures)]
        self.warm_up(0.0 if warmup > 0 else 1.0)  # without a warm-up, the final temperatures from step 1

    @property
    def embeddings(self) -> Memory:
        return self.memory

    def before_optimizer_step(self, step: int, total_steps: int) -> None:
        if step < self.frozen * total_steps:
            for weight in self.prototypes.parameters():
                weight.grad = None  # no update at all, weight decay and momentum included

    def after_optimizer_step(self, step: int, total_steps: int) -> None:
        super().after_optimizer_step(step, total_steps)
        self.warm_up(min(step / (self.warmup * total_steps), 1.0) if self.warmup > 0 else 1.0)

    def warm_up(self, progress: float) -> None:
        """Each teacher temperature that share of the way from its start to its final value."""
        for loss, start, final in self.temperatures:
            loss.teacher_temperature.fill_(start + (final - start) * progress)

    def training_step(self, batch: Batch) -> dict[str, torch.Tensor]:
        globals_ = self.global_views(batch)
        mask = self.draw_mask(globals_)
        projection, prototypes = self.teacher_head
        teacher_cls, teacher_patches = self.teacher_tokens(globals_)
        teacher = projection(teacher_cls)
        teacher_logits = prototypes(teacher)
        student_cls, student_patches = self.student_tokens(batch, globals_, mask)
        entropy = self.record_targets(self.loss.teacher_probabilities(teacher_logits))
        student = [self.head[0](view) for view in student_cls]
        cls_loss = self.loss([self.prototypes(view) for view in student], list(teacher_logits.chunk(2)))
        koleo = self.spreading(student)
        self.memory.enqueue(teacher)
        loss = cls_loss + self.koleo_weight * koleo
        if self.patch_loss is None:
            return {"loss": loss, "koleo": koleo, "prototype_entropy": entropy}
        patch_loss = self.patch_loss(self.head(student_patches[mask]), self.teacher_head(teacher_patches[mask]))
        return {"loss": loss + self.patch_weight * patch_loss, "cls_loss": cls_loss, "patch_loss": patch_loss,
                "koleo": koleo, "prototype_entropy": entropy}


@register("dino", settings=DinoConfig)
def build(config: Config, data: TrainingData, **patch_options: object) -> Dino:
    """DINO; ``patch_options`` (patch_loss, patch_weight, masking, final_temperatures) make it iBOT."""
    method = config.method
    patch_options.setdefault("final_temperatures", (method.final_teacher_temperature,))
    encoder = token_backbone(config, data, patches=patch_options.get("patch_loss") is not None)
    return Dino(encoder, projection_head(encoder.feature_dim, config.model, method.head_batchnorm),
                Prototypes(config.model.projection_dim, method.num_prototypes),
                DINOLoss(method.num_prototypes, method.student_temperature, method.teacher_temperature,
                         method.center_momentum), momentum=method.teacher_momentum, frozen=method.freeze_prototypes,
                warmup=method.teacher_warmup, horizon=method.teacher_horizon, koleo_weight=method.koleo_weight,
                **patch_options)
