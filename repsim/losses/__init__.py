"""Losses, one family per file; each a plain ``nn.Module`` with its shapes documented."""

from repsim.losses.clip import ClipLoss
from repsim.losses.ntxent import NTXentLoss
from repsim.losses.supcon import SupConLoss
from repsim.losses.xclr import XCLRLoss

__all__ = ["ClipLoss", "NTXentLoss", "SupConLoss", "XCLRLoss"]
