"""What SOP and the DINO- and iBOT-style baselines share: a student ViT (or, without a patch loss, a
ResNet, its pooled features as [CLS]) with a projection head and its EMA teacher on multi-crop views,
block masking of the student's global views, a FIFO :class:`Memory` of teacher embeddings, and
collapse diagnostics each epoch. ``encoder`` is the student's backbone, what the evaluate stage scores.
"""

from __future__ import annotations

import copy
import math
from abc import abstractmethod

import torch
import torch.nn.functional as F
from pydantic import Field
from torch import nn

from repsim.data.masking import BlockMasking
from repsim.errors import SpecError
from repsim.eval.diagnostics import effective_rank, embedding_std, mean_cosine
from repsim.losses import KoLeoLoss
from repsim.losses._pairs import gather_no_grad
from repsim.losses.sop import mean_assignment_entropy, mean_sample_entropy
from repsim.layering import Strict
from repsim.methods.config import Config, ModelConfig
from repsim.methods.base import Method, TrainingData
from repsim.methods.trainer import Batch
from repsim.models import VITS, MaskableViT, backbone


class SelfDistillationSettings(Strict):
    """A student and its EMA teacher, momentum cosine from ``teacher_momentum`` (or 1 − 1/(h·steps) with
    ``teacher_horizon`` h) to 1; ``head_batchnorm``: BatchNorm in the projection head; ``koleo_weight``:
    the weight of KoLeo (DINOv2's spreading term) on the student's global unit embeddings, an option (0: off)."""

    student_temperature: float = Field(0.1, gt=0)
    teacher_temperature: float = Field(0.04, gt=0)
    teacher_momentum: float = Field(0.996, ge=0, le=1)
    teacher_horizon: float | None = Field(None, gt=0, le=1)
    head_batchnorm: bool = False
    koleo_weight: float = Field(0.0, ge=0)


class MaskedPatchesSettings(Strict):
    """Block masking for a masked-patch loss: ``mask_ratio``, the range of a masked view's ratio;
    ``mask_share``, the share of global views masked; ``patch_teacher_temperature``."""

    patch_teacher_temperature: float = Field(0.07, gt=0)
    mask_ratio: tuple[float, float] = (0.1, 0.5)
    mask_share: float = Field(0.5, ge=0, le=1)


class Memory(nn.Module):
    """A FIFO queue of ``size`` embeddings (D = ``dim``). Buffers: ``entries`` (size, D), ``ids`` (size,), the
    running number of each slot's embedding (-1 while empty), and ``count``, the number ever enqueued;
    until full, the ``filled`` entries are the first slots.
    """

    def __init__(self, size: int, dim: int):
        super().__init__()
        self.register_buffer("entries", torch.zeros(size, dim))
        self.register_buffer("ids", torch.full((size,), -1, dtype=torch.long))
        self.register_buffer("count", torch.zeros((), dtype=torch.long))

    @property
    def size(self) -> int:
        return len(self.entries)

    @property
    def filled(self) -> int:
        return min(int(self.count), self.size)

    def contents(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(embeddings (filled, D), their ids (filled,))."""
        return self.entries[:self.filled], self.ids[:self.filled]

    @torch.no_grad()
    def fill_random(self) -> None:
        """Fill every slot with a random unit vector (ids -2, -3, ...), replaced oldest first."""
        self.entries.copy_(F.normalize(torch.randn_like(self.entries), dim=1))
        self.ids.copy_(-2 - torch.arange(self.size, device=self.ids.device))
        self.count.fill_(self.size)

    @torch.no_grad()
    def enqueue(self, embeddings: torch.Tensor, gather: bool = True) -> None:
        """Append embeddings (n, D), those of every rank in rank order under DDP (when ``gather``)."""
        embeddings = gather_no_grad(embeddings.detach().contiguous(), gather)
        arriving = len(embeddings)
        numbers = self.count + torch.arange(arriving, device=self.count.device)
        embeddings, numbers = embeddings[-self.size:], numbers[-self.size:]  # more than fit: the newest
        self.entries[numbers % self.size] = embeddings.to(self.entries.dtype)
        self.ids[numbers % self.size] = numbers
        self.count += arriving


def teacher_momentum(step: int, total_steps: int, base: float) -> float:
    """The EMA momentum after ``step`` of ``total_steps``: cosine from ``base`` (step 0) to 1 (the last)."""
    return 1 - (1 - base) * (math.cos(math.pi * min(step, total_steps) / max(total_steps, 1)) + 1) / 2


class Normalize(nn.Module):
    """Rows scaled to unit length along the last dimension."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.normalize(x, dim=-1)


def projection_head(in_dim: int, model: ModelConfig, batchnorm: bool = False) -> nn.Sequential:
    """DINO's head: ``projection_layers`` linear maps with GELU between them (and with ``batchnorm`` a
    BatchNorm after each hidden one), to ``projection_dim``, then L2 normalisation."""
    widths = [in_dim] + [model.projection_hidden_dim] * (model.projection_layers - 1) + [model.projection_dim]
    layers: list[nn.Module] = []
    for width_in, width_out in zip(widths[:-2], widths[1:-1]):
        layers += [nn.Linear(width_in, width_out), *([nn.BatchNorm1d(width_out)] if batchnorm else []), nn.GELU()]
    return nn.Sequential(*layers, nn.Linear(widths[-2], widths[-1]), Normalize())


class SelfDistillation(Method):
    """A student (``encoder``, ``head``), its EMA teacher (``teacher_encoder``, ``teacher_head``) of base
    ``momentum`` (or averaging over the ``horizon`` share of the run), ``masking`` (None: none) and
    ``koleo_weight`` (:meth:`spreading`). :meth:`epoch_metrics` reads the memory ``embeddings`` and the
    targets passed to :meth:`record_targets`.
    """

    entropy_metric = "assignment_entropy"

    def __init__(self, encoder: nn.Module, head: nn.Module, momentum: float, masking: BlockMasking | None,
                 horizon: float | None = None, koleo_weight: float = 0.0):
        super().__init__()
        self.encoder, self.head, self.base_momentum, self.masking = encoder, head, momentum, masking
        self.horizon, self.koleo_weight, self.koleo = horizon, koleo_weight, KoLeoLoss()
        if masking is not None and isinstance(encoder, MaskableViT):
            encoder.mask_token.requires_grad_(True)
        self.teacher_encoder = copy.deepcopy(encoder).requires_grad_(False)
        self.teacher_head = copy.deepcopy(head).requires_grad_(False)
        self.register_buffer("entropy_sums", torch.zeros(2, dtype=torch.float64))  # of the mean, per sample
        self.register_buffer("entropy_steps", torch.zeros((), dtype=torch.long))

    @property
    @abstractmethod
    def embeddings(self) -> Memory:
        """The memory of teacher embeddings the collapse diagnostics look at."""

    def global_views(self, batch: Batch) -> torch.Tensor:
        """The two global views stacked (2B, C, H, W)."""
        if len(batch["views"]) < 2:
            raise SpecError(f"{type(self).__name__} needs two global views, the augmentation gives "
                            f"{len(batch['views'])}", "set data.preset to multicrop")
        return torch.cat(batch["views"][:2])

    def draw_mask(self, images: torch.Tensor) -> torch.Tensor | None:
        """(N, P) bool patch masks of images (N, C, H, W), or None without masking."""
        if self.masking is None:
            return None
        return self.masking(len(images), self.encoder.patch_grid(*images.shape[-2:])).to(images.device)

    @torch.no_grad()
    def teacher_tokens(self, images: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The teacher's ([CLS] (N, D), patches (N, P, D)) backbone tokens of images (N, C, H, W)."""
        return tokens(self.teacher_encoder, images)

    def student_tokens(self, batch: Batch, globals_: torch.Tensor,
                       mask: torch.Tensor | None) -> tuple[list[torch.Tensor], torch.Tensor | None]:
        """The student's [CLS] tokens, one (B, D) per view (global views masked by ``mask``), and the global
        views' patch tokens (2B, P, D)."""
        cls, patches = tokens(self.encoder, globals_, mask)
        local = batch["views"][2:]
        if local:
            cls = torch.cat([cls, self.encoder(torch.cat(local))])
        return list(cls.chunk(len(batch["views"]))), patches

    def spreading(self, student: list[torch.Tensor]) -> torch.Tensor:
        """KoLeo of the student's unit embeddings of the two global views (``student[:2]``, (B, D) each),
        their mean; a zero that keeps the graph when ``koleo_weight`` is 0."""
        if not self.koleo_weight:
            return sum(view.sum() for view in student[:2]) * 0.0
        return torch.stack([self.koleo(view) for view in student[:2]]).mean()

    @torch.no_grad()
    def after_optimizer_step(self, step: int, total_steps: int) -> None:
        base = 1 - 1 / max(self.horizon * total_steps, 1) if self.horizon else self.base_momentum
        momentum = teacher_momentum(step, total_steps, base)
        for student, teacher in ((self.encoder, self.teacher_encoder), (self.head, self.teacher_head)):
            torch._foreach_lerp_(list(teacher.parameters()), list(student.parameters()), 1 - momentum)

    @torch.no_grad()
    def record_targets(self, targets: torch.Tensor) -> torch.Tensor:
        """Add a step's teacher targets (B, K) to the epoch's entropies; returns their mean's normalised entropy."""
        entropies = torch.stack([mean_assignment_entropy(targets), mean_sample_entropy(targets)])
        self.entropy_sums += entropies.double()
        self.entropy_steps += 1
        return entropies[0]

    def monitored_encoders(self) -> dict[str, nn.Module]:
        """The student's backbone and, with ``teacher_`` metrics, the teacher's."""
        return {"": self.encoder, "teacher_": self.teacher_encoder}

    def epoch_metrics(self) -> dict[str, float]:
        """``effective_rank``, ``embedding_std`` and ``mean_cosine`` of the memory, and the epoch's means of
        ``entropy_metric`` (→ 0: collapse) and ``target_entropy`` (→ 1: flat targets), then reset."""
        metrics = {}
        entries, _ = self.embeddings.contents()
        if len(entries) >= 2:
            metrics |= {"effective_rank": effective_rank(entries, device=entries.device),
                        "embedding_std": embedding_std(entries, device=entries.device),
                        "mean_cosine": mean_cosine(entries, device=entries.device)}
        if int(self.entropy_steps):
            assignment, target = (self.entropy_sums / self.entropy_steps).tolist()
            metrics |= {self.entropy_metric: assignment, "target_entropy": target}
        self.entropy_sums.zero_()
        self.entropy_steps.zero_()
        return metrics


def tokens(encoder: nn.Module, images: torch.Tensor,
           mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """An encoder's [CLS] (N, D) and patch tokens (N, P, D) of images (N, C, H, W), masked by ``mask``; a
    ResNet gives its pooled features and None."""
    if isinstance(encoder, MaskableViT):
        return encoder.forward_tokens(images, mask)
    return encoder(images), None


def token_backbone(config: Config, data: TrainingData, patches: bool) -> nn.Module:
    """The configured backbone; SpecError for a ResNet where ``patches`` (a patch loss) need a ViT."""
    model = config.model
    if patches and model.backbone not in VITS:
        raise SpecError(f"method {config.method.name!r} with a patch loss needs a ViT, but model.backbone is "
                        f"{model.backbone!r}", f"set model.backbone to one of {', '.join(VITS)}, or turn the "
                        "patch loss off (SOP: method.mim_weight=0; DINO has none)")
    return backbone(model.backbone, data.channels, data.image_size, model.small_images, model.patch_size,
                    model.depth, model.init_encoder)
