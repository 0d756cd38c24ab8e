"""Losses, one family per file; each a plain ``nn.Module`` with its shapes and a usage example documented."""

from repsim.losses.clip import ClipLoss
from repsim.losses.dino import DINOLoss
from repsim.losses.gera import GeometricLoss, GeRALoss
from repsim.losses.ibot import IBOTPatchLoss
from repsim.losses.koleo import KoLeoLoss
from repsim.losses.ntxent import NTXentLoss
from repsim.losses.sop import MaskedSOPLoss, SOPLoss
from repsim.losses.supcon import SupConLoss
from repsim.losses.xclr import XCLRLoss

__all__ = ["ClipLoss", "DINOLoss", "GeRALoss", "GeometricLoss", "IBOTPatchLoss", "KoLeoLoss", "MaskedSOPLoss",
           "NTXentLoss", "SOPLoss", "SupConLoss", "XCLRLoss"]
