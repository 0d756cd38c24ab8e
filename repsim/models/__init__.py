"""Backbones and heads."""

from repsim.models.backbones import RESNETS, load_encoder, resnet, save_encoder
from repsim.models.heads import ProjectionMLP

__all__ = ["RESNETS", "ProjectionMLP", "load_encoder", "resnet", "save_encoder"]
