"""Image backbones: torchvision ResNets (random init) that return pooled features, and the ViTs of
:mod:`repsim.models.vit`; each records its ``recipe``, so :func:`load_encoder` rebuilds a saved one.
"""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import Any

import torch
import torchvision
from torch import nn

from repsim.errors import SpecError, StageError, first_line
from repsim.models.vit import VITS, vit

RESNETS = ("resnet18", "resnet34", "resnet50")
ENCODER_FILE = "encoder.pt"
UNREADABLE_FIX = "pass an encoder written by the train stage (repsim.models.save_encoder)"


def backbone(name: str, in_channels: int, image_size: int, small_images: bool = True, patch_size: int = 4,
             depth: int = 12, init: str | Path | None = None) -> nn.Module:
    """The backbone ``name``, a :func:`resnet` or a ViT (``vit_tiny``, ``vit_small``: :func:`repsim.models.vit.vit`),
    with random weights or those of the saved encoder ``init`` (:func:`start_from`)."""
    if name in VITS:
        network = vit(name.removeprefix("vit_"), image_size, patch_size, depth, in_channels)
    else:
        network = resnet(name, small_images, in_channels)
    return network if init is None else start_from(network, init)


def resnet(name: str = "resnet18", small_images: bool = False, in_channels: int = 3) -> nn.Module:
    """A torchvision ResNet without weights or classifier: (B, C, H, W) -> (B, F), ``feature_dim`` F;
    ``small_images`` swaps the 7×7 stride-2 stem and its max-pool for one 3×3 stride-1 conv (CIFAR-size inputs)."""
    if name not in RESNETS:
        raise SpecError(f"unknown backbone {name!r}", f"use one of {', '.join(RESNETS + VITS)}")
    network = getattr(torchvision.models, name)(weights=None)
    stem_width = network.conv1.out_channels
    if small_images:
        network.conv1 = nn.Conv2d(in_channels, stem_width, kernel_size=3, stride=1, padding=1, bias=False)
        network.maxpool = nn.Identity()
    elif in_channels != 3:
        network.conv1 = nn.Conv2d(in_channels, stem_width, kernel_size=7, stride=2, padding=3, bias=False)
    network.feature_dim = network.fc.in_features
    network.fc = nn.Identity()
    network.recipe = {"builder": "resnet", "name": name, "small_images": small_images, "in_channels": in_channels}
    return network


BUILDERS = {"resnet": resnet, "vit": vit}


def save_encoder(encoder: nn.Module, path: str | Path) -> None:
    """Write ``encoder``'s recipe, feature width and weights to ``path`` (loadable with weights_only)."""
    torch.save({"recipe": encoder.recipe, "feature_dim": encoder.feature_dim,
                "state_dict": encoder.state_dict()}, path)


def encoder_file(path: str | Path) -> Path:
    """The saved encoder ``path`` names: the file itself, or a train stage directory's ``encoder.pt``."""
    path = Path(path)
    return path / ENCODER_FILE if path.is_dir() else path


def read_encoder(path: str | Path) -> dict[str, Any]:
    """A saved encoder's ``recipe``, ``feature_dim`` and ``state_dict`` (``path`` as in :func:`encoder_file`)."""
    path = encoder_file(path)
    if not path.is_file():
        raise StageError(f"no encoder at {path}", "pass a train stage directory or its encoder.pt")
    try:
        saved = torch.load(path, map_location="cpu", weights_only=True)
    except (pickle.UnpicklingError, RuntimeError, ValueError, EOFError, OSError) as err:
        raise StageError(f"cannot load encoder {path} ({first_line(err)})", UNREADABLE_FIX) from None
    if not isinstance(saved, dict) or not {"recipe", "state_dict"} <= saved.keys():
        raise StageError(f"{path} holds no encoder recipe and weights", UNREADABLE_FIX)
    return saved


def load_encoder(path: str | Path, device: str | torch.device = "cpu") -> nn.Module:
    """Rebuild a saved encoder (a file, or a train stage directory holding ``encoder.pt``) in eval mode."""
    saved = read_encoder(path)
    recipe = dict(saved["recipe"])
    encoder = BUILDERS[recipe.pop("builder")](**recipe)
    encoder.load_state_dict(saved["state_dict"])
    return encoder.to(device).eval()


def start_from(network: nn.Module, path: str | Path) -> nn.Module:
    """``network`` with the weights of the encoder saved at ``path``, which must have been built by
    the same recipe (SpecError naming both otherwise)."""
    saved = read_encoder(path)
    if saved["recipe"] != network.recipe:
        raise SpecError(f"the encoder at {encoder_file(path)} was built as {saved['recipe']}, but this config "
                        f"builds {network.recipe}", "start from an encoder of the same backbone, size and channels")
    network.load_state_dict(saved["state_dict"])
    return network
