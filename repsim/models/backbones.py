"""Image backbones: torchvision ResNets (random init) that return pooled features, and the ViTs of
:mod:`repsim.models.vit`; each records its ``recipe``, so :func:`load_encoder` rebuilds a saved one.
"""

from __future__ import annotations

import copy
import json
import pickle
import threading
import zipfile
from pathlib import Path
from typing import Any

import torch
import torchvision
from torch import nn

from repsim.errors import SpecError, StageError, first_line
from repsim.models.vit import VITS, vit

RESNETS = ("resnet18", "resnet34", "resnet50")
ENCODER_FILE = "encoder.pt"
ABOUT_ENTRY = "repsim_encoder.json"  # in the archive's extra files: recipe, feature_dim, input_shape
EXPORTING = threading.Lock()  # torch.export saves and loads with process-wide state: one at a time
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


def save_encoder(encoder: nn.Module, path: str | Path, image_size: int | None = None) -> None:
    """Write ``encoder`` to ``path`` as a ``torch.export`` archive: a program that maps images (B, C, H, W) of
    any batch size B to features (B, F), which ``torch.export.load`` and ``mlflow.pytorch.load_model`` run
    without repsim, and its recipe, from which :func:`load_encoder` rebuilds a trainable copy. H = W =
    ``image_size`` (default: the recipe's; a ResNet's has none)."""
    recipe = encoder.recipe
    size = image_size or recipe.get("image_size")
    if size is None:
        raise ValueError(f"a {recipe['builder']} recipe holds no image size: pass image_size")
    network = copy.deepcopy(encoder).cpu().eval()
    example = torch.zeros(2, recipe["in_channels"], size, size)
    with EXPORTING:
        program = torch.export.export(network, (example,), dynamic_shapes=({0: torch.export.Dim.AUTO},))
    about = {"recipe": recipe, "feature_dim": encoder.feature_dim, "input_shape": list(example.shape[1:])}
    with open(path, "wb") as handle:  # a file object: torch.export wants the name to end in .pt2
        torch.export.save(program, handle, extra_files={ABOUT_ENTRY: json.dumps(about)})


def encoder_file(path: str | Path) -> Path:
    """The saved encoder ``path`` names: the file itself, or a train stage directory's ``encoder.pt``."""
    path = Path(path)
    return path / ENCODER_FILE if path.is_dir() else path


def read_encoder(path: str | Path) -> dict[str, Any]:
    """A saved encoder's ``recipe``, ``feature_dim`` and ``state_dict`` (``path`` as in :func:`encoder_file`):
    a :func:`save_encoder` archive, or the dict of recipe and weights that encoders were saved as before."""
    path = encoder_file(path)
    if not path.is_file():
        raise StageError(f"no encoder at {path}", "pass a train stage directory or its encoder.pt")
    try:
        saved = _read_program(path) if _is_program(path) else torch.load(path, map_location="cpu", weights_only=True)
    except (pickle.UnpicklingError, RuntimeError, ValueError, EOFError, OSError, KeyError) as err:
        raise StageError(f"cannot load encoder {path} ({first_line(err)})", UNREADABLE_FIX) from None
    if not isinstance(saved, dict) or not {"recipe", "state_dict"} <= saved.keys():
        raise StageError(f"{path} holds no encoder recipe and weights", UNREADABLE_FIX)
    return saved


def _is_program(path: Path) -> bool:
    """Whether ``path`` is a ``torch.export`` archive (a zip holding ``<name>/archive_format``)."""
    if not zipfile.is_zipfile(path):
        return False
    with zipfile.ZipFile(path) as archive:
        return any(name.endswith("/archive_format") for name in archive.namelist())


def _read_program(path: Path) -> dict[str, Any]:
    """:func:`read_encoder` of a :func:`save_encoder` archive: its recorded recipe and the program's weights."""
    extra = {ABOUT_ENTRY: ""}
    with open(path, "rb") as handle, EXPORTING:
        program = torch.export.load(handle, extra_files=extra)
    if not extra[ABOUT_ENTRY]:
        raise StageError(f"{path} is a torch.export archive without repsim's recipe", UNREADABLE_FIX)
    return json.loads(extra[ABOUT_ENTRY]) | {"state_dict": program.state_dict}


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
