"""The iBOT-style baseline to SOP (Zhou et al., 2022): DINO plus iBOT's masked-patch loss
(:class:`~repsim.losses.ibot.IBOTPatchLoss`) through the same head and prototypes.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from repsim.data.masking import BlockMasking
from repsim.losses.ibot import IBOTPatchLoss
from repsim.methods import dino
from repsim.methods.config import Config
from repsim.methods.base import TrainingData, register
from repsim.methods.self_distillation import MaskedPatchesSettings


class IBOTConfig(dino.DinoConfig, MaskedPatchesSettings):
    """DINO plus a masked-patch loss of weight ``patch_weight``, warmed up to ``patch_teacher_temperature``."""

    name: Literal["ibot"]  # type: ignore[assignment]
    patch_weight: float = Field(1.0, gt=0)


@register("ibot", settings=IBOTConfig)
def build(config: Config, data: TrainingData) -> dino.Dino:
    method = config.method
    patch_loss = IBOTPatchLoss(method.num_prototypes, method.student_temperature, method.teacher_temperature,
                               method.center_momentum)
    return dino.build(config, data, patch_loss=patch_loss, patch_weight=method.patch_weight,
                      masking=BlockMasking(method.mask_ratio, method.mask_share),
                      final_temperatures=(method.final_teacher_temperature, method.patch_teacher_temperature))
