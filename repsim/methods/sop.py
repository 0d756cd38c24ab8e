"""SOP (Silva et al., 2025): self-distillation towards self-organizing visual prototypes.

The student and EMA teacher of :mod:`repsim.methods.self_distillation`; two FIFO memories keep the
teacher's [CLS] and (``patches_per_view`` per global view) patch embeddings, gathered from every rank.
Each step, K anchors drawn from a memory and their k nearest entries form the SOPs
(:mod:`repsim.losses.sop`); the [CLS] loss matches student and teacher distributions over [CLS] SOPs
across views, the MIM loss the masked patch tokens over patch SOPs. Anchors and masks come from
torch's global RNG and the memories are buffers, so checkpoints resume exactly.
"""

from __future__ import annotations

from typing import Any, Literal

import torch
from pydantic import Field, model_validator
from torch import nn

from repsim.data.masking import BlockMasking
from repsim.losses.sop import MaskedSOPLoss, SOPLoss, SOPs, Supports, assemble_sops, draw_supports
from repsim.methods.config import Config
from repsim.methods.base import TrainingData, register
from repsim.methods.self_distillation import (MaskedPatchesSettings, Memory, SelfDistillation, SelfDistillationSettings,
                                             projection_head, token_backbone)
from repsim.methods.trainer import Batch


class SOPConfig(SelfDistillationSettings, MaskedPatchesSettings):
    """SOP's settings (each option and ablation is described in docs/methods.md). ``cls_weight`` λ1 and
    ``mim_weight`` λ2 (0: no masking, no MIM) weight the [CLS] and masked-patch losses; ``preset: authors``
    sets :data:`AUTHORS` wherever the config does not set them itself.
    """

    name: Literal["sop"]
    num_anchors: int = Field(4096, gt=1)
    support_size: int = Field(8, gt=0)
    epsilon: float = Field(0.1, ge=0, lt=1)
    one_hot: bool = False
    fixed_anchors: bool = False
    fixed_supports: bool = False
    shared_supports: bool = True
    cls_memory: int = Field(65536, gt=1)
    patch_memory: int = Field(8192, gt=1)
    patches_per_view: int = Field(1, gt=0)
    cls_weight: float = Field(1.0, ge=0)
    mim_weight: float = Field(1.0, ge=0)
    anchor_share: float | None = Field(None, gt=0, lt=1)
    supports_from_anchors: bool = True
    patch_support_size: int | None = Field(None, ge=0)
    enqueue: Literal["both", "second"] = "both"
    memory_init: Literal["empty", "random"] = "empty"
    anchor_draws: int = Field(1, gt=0)
    preset: Literal["paper", "authors"] = "paper"

    @model_validator(mode="before")
    @classmethod
    def _preset(cls, values: Any) -> Any:
        if isinstance(values, dict) and values.get("preset") == "authors":
            return {**AUTHORS, **values}
        return values

    @model_validator(mode="after")
    def _supports_fixed_with_their_anchors(self) -> SOPConfig:
        if self.fixed_supports and not self.fixed_anchors:
            raise ValueError("fixed_supports keeps the supports of fixed anchors; set fixed_anchors=true too")
        return self


AUTHORS = {  # preset: authors. sthalles/sop at 0e5e5a1 (main_ibot.py, memory_bank.py); run.sh overrides none of them
    "cls_memory": 65536,              # --class_memory_size, main_ibot.py:55
    "anchor_share": 32 / 65536,       # --class_partition_size 64 drawn (main_ibot.py:156); "low_energy", on by default
                                      # (memory_bank.py:15), keeps a uniform random half of them (memory_bank.py:166-177)
    "support_size": 8,                # --num_class_experts 9: the anchor and its 8 nearest (main_ibot.py:144, memory_bank.py:139)
    "supports_from_anchors": False,   # neighbours among the entries that are no anchor (memory_bank.py:112-136)
    "anchor_draws": 4,                # --num_class_tasks, the [CLS] losses averaged (main_ibot.py:154, 536-543)
    "patch_memory": 8192,             # --patch_memory_size, main_ibot.py:152-153
    "num_anchors": 512,               # the patch bank's: --patch_partition_size, main_ibot.py:150-151
    "patch_support_size": 0,          # --num_patch_experts 1: each patch SOP is its anchor alone (main_ibot.py:146)
    "patches_per_view": 1,            # one random teacher patch per image (main_ibot.py:570-574)
    "enqueue": "second",              # the second global view's embeddings alone (main_ibot.py:545, 574)
    "memory_init": "random",          # unit Gaussian vectors (memory_bank.py:26-27)
    "teacher_momentum": 0.996,        # --momentum_teacher, cosine to 1 over the run (main_ibot.py:57, 375)
    "teacher_temperature": 0.04,      # main_ibot.py:75; its warm-up starts at 0.04 too (main_ibot.py:72)
    "patch_teacher_temperature": 0.04,  # the patch bank is given teacher_temp (main_ibot.py:553)
    "student_temperature": 0.1,       # --student_temp, main_ibot.py:162
    "epsilon": 0.1,                   # --smoothing, main_ibot.py:148
    "mask_ratio": (0.3, 0.3),         # --pred_ratio 0.3, --pred_ratio_var 0 (main_ibot.py:62, 64)
    "mask_share": 1.0,                # a single pred_ratio masks every global view
    "cls_weight": 1.0, "mim_weight": 1.0,  # loss = cls_ce + patch_ce (main_ibot.py:576)
}


SOP_DRAWING = ("epsilon", "one_hot", "fixed_anchors", "shared_supports", "fixed_supports",
               "supports_from_anchors")  # the settings of how both banks draw their SOPs


class SOPBank(nn.Module):
    """A :class:`~repsim.methods.self_distillation.Memory` and the SOPs drawn from it: ``sops()`` each step,
    ``memory.enqueue`` after. ``num_anchors`` anchors with ``support_size`` supports each, none until the
    memory holds more than ``max(support_size, 1)`` entries; ``fixed_anchors`` (and ``fixed_supports``)
    keep the first full-memory draw in buffers; ``random_start``: :meth:`Memory.fill_random`.
    """

    def __init__(self, size: int, dim: int, num_anchors: int = 4096, support_size: int = 8, epsilon: float = 0.1,
                 one_hot: bool = False, fixed_anchors: bool = False, shared_supports: bool = True,
                 fixed_supports: bool = False, supports_from_anchors: bool = True, random_start: bool = False):
        super().__init__()
        self.memory = Memory(size, dim)
        if random_start:
            self.memory.fill_random()
        self.num_anchors, self.support_size = min(num_anchors, size), support_size
        self.epsilon, self.one_hot, self.fixed_anchors = epsilon, one_hot, fixed_anchors
        self.shared_supports, self.fixed_supports = shared_supports, fixed_supports
        self.supports_from_anchors = supports_from_anchors
        self.register_buffer("anchors", torch.zeros(self.num_anchors, dim))
        self.register_buffer("anchor_ids", torch.full((self.num_anchors,), -1, dtype=torch.long))
        self.register_buffer("anchors_drawn", torch.zeros((), dtype=torch.bool))
        drawn = self.num_anchors * support_size if fixed_supports else 0
        self.register_buffer("supports", torch.zeros(drawn, dim))
        self.register_buffer("support_scores", torch.zeros(drawn))
        self.register_buffer("support_kept", torch.zeros(drawn, dtype=torch.bool))

    def sops(self) -> SOPs | None:
        if self.memory.filled <= max(self.support_size, 1):
            return None
        entries, ids = self.memory.contents()
        kept = self.fixed_anchors and bool(self.anchors_drawn)
        if kept:
            anchors, anchor_ids = self.anchors, self.anchor_ids
        else:
            rows = torch.randperm(len(entries))[:self.num_anchors].to(entries.device)
            anchors, anchor_ids = entries[rows], ids[rows]
        if kept and self.fixed_supports:
            supports = Supports(self.supports, self.support_scores, self.support_kept)
        else:
            supports = self._draw_supports(anchors, anchor_ids, entries, ids)
        if self.fixed_anchors and not kept and len(entries) == self.memory.size:  # the first full-memory draw
            self.anchors.copy_(anchors)
            self.anchor_ids.copy_(anchor_ids)
            self.anchors_drawn.fill_(True)
            if self.fixed_supports:
                self.supports.copy_(supports.embeddings)
                self.support_scores.copy_(supports.scores)
                self.support_kept.copy_(supports.kept)
        return assemble_sops(anchors, supports, self.epsilon, self.one_hot)

    def _draw_supports(self, anchors: torch.Tensor, anchor_ids: torch.Tensor, entries: torch.Tensor,
                       ids: torch.Tensor) -> Supports:
        if not self.supports_from_anchors:
            pool = ~torch.isin(ids, anchor_ids)
            entries, ids = entries[pool], ids[pool]
        if self.support_size == 0 or len(entries) <= self.support_size:
            empty = anchors[:0]
            return Supports(empty, empty[:, 0], empty[:, 0].bool())
        return draw_supports(anchors, anchor_ids, entries, ids, self.support_size, self.shared_supports)


class SOP(SelfDistillation):
    """SOP. Logs ``loss`` = λ1·``cls_loss`` + λ2·``mim_loss`` + ``koleo_weight``·``koleo`` (of the student's
    global [CLS] embeddings), ``sop_entropy`` and the number of [CLS] SOPs, ``sops``; the [CLS] loss is the
    mean over ``anchor_draws`` draws."""

    entropy_metric = "sop_entropy"

    def __init__(self, encoder: nn.Module, head: nn.Module, cls_bank: SOPBank, patch_bank: SOPBank, *,
                 cls_loss: SOPLoss, mim_loss: MaskedSOPLoss, cls_weight: float = 1.0, mim_weight: float = 1.0,
                 momentum: float = 0.996, masking: BlockMasking | None = None, patches_per_view: int = 1,
                 koleo_weight: float = 0.0, horizon: float | None = None, anchor_draws: int = 1,
                 enqueue_second_only: bool = False):
        super().__init__(encoder, head, momentum, masking if mim_weight > 0 else None, horizon, koleo_weight)
        self.cls_bank, self.patch_bank = cls_bank, patch_bank
        self.cls_loss, self.mim_loss = cls_loss, mim_loss
        self.cls_weight, self.mim_weight, self.patches_per_view = cls_weight, mim_weight, patches_per_view
        self.anchor_draws, self.enqueue_second_only = anchor_draws, enqueue_second_only

    @property
    def embeddings(self) -> Memory:
        return self.cls_bank.memory

    def training_step(self, batch: Batch) -> dict[str, torch.Tensor]:
        globals_ = self.global_views(batch)
        mask = self.draw_mask(globals_)
        teacher_cls, teacher_patches = self.teacher_tokens(globals_)
        teacher_cls = self.teacher_head(teacher_cls)
        student_cls, student_patches = self.student_tokens(batch, globals_, mask)
        student = [self.head(view) for view in student_cls]
        draws, zero = [self.cls_bank.sops() for _ in range(self.anchor_draws)], sum(view.sum() for view in student) * 0.0
        cls_sops, cls_loss, entropy = draws[0], zero, zero.detach()
        if cls_sops is not None:
            teacher = list(teacher_cls.chunk(2))
            cls_loss = torch.stack([self.cls_loss(student, teacher, sops) for sops in draws]).mean()
            entropy = self.record_targets(cls_sops.distribution(teacher_cls, self.cls_loss.teacher_temperature))
        mim_loss = self._mim_loss(student_patches, teacher_patches, mask, zero)
        enqueued = slice(len(teacher_cls) // 2, None) if self.enqueue_second_only else slice(None)
        self.cls_bank.memory.enqueue(teacher_cls[enqueued])
        if teacher_patches is not None:
            self.patch_bank.memory.enqueue(self._sample_patches(teacher_patches[enqueued]))
        koleo = self.spreading(student)
        count = torch.tensor(float(cls_sops.count if cls_sops is not None else 0), device=zero.device)
        loss = self.cls_weight * cls_loss + self.mim_weight * mim_loss + self.koleo_weight * koleo
        return {"loss": loss, "cls_loss": cls_loss, "mim_loss": mim_loss, "koleo": koleo,
                "sop_entropy": entropy, "sops": count}

    def _mim_loss(self, student_patches: torch.Tensor, teacher_patches: torch.Tensor, mask: torch.Tensor | None,
                  zero: torch.Tensor) -> torch.Tensor:
        """The MIM loss over freshly drawn patch SOPs; ``zero`` without masked patches or patch SOPs."""
        sops = self.patch_bank.sops() if mask is not None and mask.any() else None
        if sops is None:
            return zero
        return self.mim_loss(project_masked(self.head, student_patches, mask),
                             project_masked(self.teacher_head, teacher_patches, mask), mask, sops)

    @torch.no_grad()
    def _sample_patches(self, tokens: torch.Tensor) -> torch.Tensor:
        """``patches_per_view`` random teacher patch embeddings of each view: (N·n, D) from tokens (N, P, D')."""
        positions = torch.randint(tokens.shape[1], (len(tokens), self.patches_per_view)).to(tokens.device)
        chosen = tokens.gather(1, positions[..., None].expand(-1, -1, tokens.shape[2]))
        return self.teacher_head(chosen).flatten(0, 1)


def project_masked(head: nn.Module, tokens: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``head`` of the masked tokens of (V, P, D) at their positions (it sees only those), zeros elsewhere: (V, P, D')."""
    projected = head(tokens[mask])
    return projected.new_zeros(*mask.shape, projected.shape[-1]).index_put((mask,), projected)


@register("sop", settings=SOPConfig)
def build(config: Config, data: TrainingData) -> SOP:
    method, dim = config.method, config.model.projection_dim
    encoder = token_backbone(config, data, patches=method.mim_weight > 0)
    drawing = {name: getattr(method, name) for name in SOP_DRAWING} | {"random_start": method.memory_init == "random"}
    cls_anchors = round(method.anchor_share * method.cls_memory) if method.anchor_share else method.num_anchors
    patch_supports = method.support_size if method.patch_support_size is None else method.patch_support_size
    cls_bank = SOPBank(method.cls_memory, dim, max(cls_anchors, 2), method.support_size, **drawing)
    patch_bank = SOPBank(method.patch_memory, dim, method.num_anchors, patch_supports, **drawing)
    return SOP(encoder, projection_head(encoder.feature_dim, config.model, method.head_batchnorm), cls_bank, patch_bank,
               cls_loss=SOPLoss(method.student_temperature, method.teacher_temperature),
               mim_loss=MaskedSOPLoss(method.student_temperature, method.patch_teacher_temperature),
               cls_weight=method.cls_weight, mim_weight=method.mim_weight, momentum=method.teacher_momentum,
               masking=BlockMasking(method.mask_ratio, method.mask_share), patches_per_view=method.patches_per_view,
               koleo_weight=method.koleo_weight, horizon=method.teacher_horizon, anchor_draws=method.anchor_draws,
               enqueue_second_only=method.enqueue == "second")
