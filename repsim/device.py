"""Where torch work runs by default."""

import os

import torch


def resolve_device(device: str | torch.device | None = None) -> torch.device:
    """``device`` as a torch device; None picks this process's GPU (``LOCAL_RANK``) when CUDA is
    present, else the CPU."""
    if device is not None:
        return torch.device(device)
    if torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device("cpu")
