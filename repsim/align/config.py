"""Alignment configs: pydantic models read from YAML (``configs/gera.yaml``), overridable by ``a.b=value``."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Annotated, Literal

from pydantic import Field, model_validator

from repsim.align.asif import BACKENDS
from repsim.losses.gera import KERNELS
from repsim.layering import NOT_KEYED, Override, Strict
from repsim.methods.config import OptimConfig, load_config
from repsim.similarity.neighbors import INDEX_KINDS


class AlignData(Strict):
    """The data spec, the split pairs are drawn from and the split scored; ``holdout`` > 0 scores that
    seeded fraction of ``train_split`` instead of ``test_split`` (a validation split, whatever the pairing seed)."""

    spec: Path = Field(json_schema_extra=NOT_KEYED)  # the splits' embedding tables are the stage's inputs
    train_split: str = Field("train", json_schema_extra=NOT_KEYED)
    test_split: str = Field("test", json_schema_extra=NOT_KEYED)
    holdout: float = Field(0.0, ge=0, lt=1)


class EncoderImages(Strict):
    """Image embeddings (from the cached features stage) of an encoder: a train stage directory, its
    ``encoder.pt`` or any :func:`repsim.models.save_encoder` file (a plain state dict has no recipe)."""

    type: Literal["encoder"]
    path: Path
    batch_size: int = Field(512, gt=0)


class PixelImages(Strict):
    """The flattened, normalised pixels as image embeddings (a floor, and fast for tests)."""

    type: Literal["pixels"]
    batch_size: int = Field(512, gt=0)


class TableImages(Strict):
    """A user's image embeddings: a Parquet file with columns ``key`` (manifest keys) and ``embedding``
    (a list of floats per row), or an ``.npy`` (N, D) whose row i is manifest index i."""

    type: Literal["table"]
    path: Path


ImageSource = Annotated[EncoderImages | PixelImages | TableImages, Field(discriminator="type")]


class AlignText(Strict):
    """Caption embeddings from a frozen sentence-transformer (default all-MiniLM-L6-v2): ``source: manifest``
    embeds each sample's own caption, ``classes`` one drawn (``seed``) from its class's captions
    (:func:`repsim.align.tables.class_captions`, ``templates`` defaulting to the data spec's)."""

    model: str | None = None
    source: Literal["classes", "manifest"] = "classes"
    templates: tuple[str, ...] | None = None
    lemmas: bool = True
    gloss: bool = True
    hypernym: bool = True
    seed: int = 0


class PairingConfig(Strict):
    """``pairs`` paired training samples (M), and ``unpaired`` samples per modality (default: all the
    rest), drawn independently for each modality; seeded."""

    pairs: int = Field(100, ge=2)
    unpaired: int | None = Field(None, ge=1)
    seed: int = 0


class NeighborConfig(Strict):
    """L nearest unpaired points of each paired point in its own modality, by cosine, with FAISS."""

    count: int = Field(100, ge=1, description="L")
    index: Literal[INDEX_KINDS] = "flat"


class GeometryConfig(Strict):
    """The geometric regulariser (:mod:`repsim.losses.gera`): weight ``alpha``, ``samples`` (n) neighbors
    drawn per paired point and step by ``strategy`` (:func:`repsim.align.method.sample_neighbors`), and
    the ``kernel`` with its ``sigma`` or ``knn_k`` (binary kNN passes no gradient, so needs alpha 0)."""

    alpha: float = Field(1000.0, ge=0)
    samples: int = Field(16, ge=1)
    strategy: Literal["nearest", "uniform", "rank"] = "rank"
    rank_exponent: float = Field(1.0, gt=0)
    kernel: Literal[KERNELS] = "heat"
    sigma: float = Field(0.25, gt=0)
    knn_k: int = Field(5, ge=1)

    @model_validator(mode="after")
    def _kernel_fits(self) -> GeometryConfig:
        if self.kernel == "knn" and self.alpha > 0:
            raise ValueError("kernel knn passes no gradient; use heat or cosine, or alpha 0 (to monitor it)")
        if self.kernel == "knn" and self.knn_k > self.samples + 1:
            raise ValueError(f"knn_k {self.knn_k} exceeds the neighborhood size samples + 1 = {self.samples + 1}")
        return self


class AlignModel(Strict):
    """f and g (:class:`repsim.models.AlignmentNetwork`): ``linear`` or a residual ``mlp``, into ``dim``."""

    kind: Literal["linear", "mlp"] = "linear"
    dim: int = Field(256, gt=0)
    hidden_dim: int = Field(512, gt=0)
    blocks: int = Field(1, ge=0)


class AlignLoss(Strict):
    """Symmetric InfoNCE on the paired points (CLIP's loss) at ``temperature``, learned if asked."""

    temperature: float = Field(0.07, gt=0)
    learn_temperature: bool = True


class ASIFConfig(Strict):
    """The training-free baseline over the M paired points: top ``k`` anchors (at most M), power ``p``."""

    k: int = Field(100, ge=1)
    p: float = Field(8.0, gt=0)
    backend: Literal[BACKENDS] = "exact"


class AlignEval(Strict):
    """Zero-shot prompt ``templates`` (default: the data spec's) and retrieval recall@``retrieval_k``."""

    templates: tuple[str, ...] | None = None
    retrieval_k: tuple[int, ...] = (1, 5, 10)


class AlignOptim(OptimConfig):
    """Optimisation of the alignment networks, whose batches come from embedding tables in memory: no loader
    worker changes them, so their number is kept out of the stage key whether set or not."""

    num_workers: int | None = Field(None, ge=0, json_schema_extra=NOT_KEYED, description="unused by the alignment")


class AlignConfig(Strict):
    """One alignment experiment: GeRA (alpha > 0) or contrastive alignment alone (alpha = 0)."""

    data: AlignData
    image: ImageSource = Field(json_schema_extra=NOT_KEYED)  # both sides: keyed through the tables
    text: AlignText = Field(AlignText(), json_schema_extra=NOT_KEYED)
    pairing: PairingConfig = PairingConfig()
    neighbors: NeighborConfig = NeighborConfig()
    geometry: GeometryConfig = GeometryConfig()
    model: AlignModel = AlignModel()
    loss: AlignLoss = AlignLoss()
    optim: AlignOptim = AlignOptim(epochs=100, batch_size=256, warmup_epochs=5)
    asif: ASIFConfig = ASIFConfig()
    evaluation: AlignEval = AlignEval()

    @model_validator(mode="after")
    def _samples_within_neighbors(self) -> AlignConfig:
        if self.geometry.samples > self.neighbors.count:
            raise ValueError(f"geometry.samples (n = {self.geometry.samples}) exceeds neighbors.count "
                             f"(L = {self.neighbors.count}); lower n or raise L")
        return self


def load_align_config(path: str | Path, overrides: Sequence[Override] = ()) -> AlignConfig:
    """Read the alignment config at ``path`` (or the shipped config of that name: ``gera``) and apply
    ``overrides`` (``"geometry.alpha=0"``); SpecError in one line naming the file and the field."""
    return load_config(path, overrides, schema=AlignConfig)
