"""Backbones, heads and alignment networks."""

from repsim.models.alignment import AlignmentNetwork
from repsim.models.backbones import RESNETS, backbone, load_encoder, resnet, save_encoder
from repsim.models.heads import ProjectionMLP
from repsim.models.vit import VITS, MaskableViT, vit

__all__ = ["RESNETS", "VITS", "AlignmentNetwork", "MaskableViT", "ProjectionMLP", "backbone", "load_encoder", "resnet",
           "save_encoder", "vit"]
