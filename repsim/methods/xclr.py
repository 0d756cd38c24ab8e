"""X-CLR (Sobal et al., 2025): contrastive learning towards soft cross-sample similarities.

A batch's similarity comes from the :class:`~repsim.similarity.targets.SimilaritySource` that
``method.similarity`` names, for the global batch (indices and labels gathered from every rank).
"""

from __future__ import annotations

from functools import partial
from pathlib import Path
from typing import Annotated, Literal

import numpy as np
import torch
from pydantic import Field
from torch import nn

from repsim.data.manifest import read_manifest
from repsim.losses import XCLRLoss
from repsim.errors import SimilarityError
from repsim.losses._pairs import gather_no_grad
from repsim.losses.xclr import target_mass
from repsim.layering import NOT_KEYED, Strict
from repsim.methods.config import Config
from repsim.methods.contrastive import TwoViewMethod, backbone_and_projection, require_labels
from repsim.methods.base import TrainingData, Upstream, register
from repsim.methods.stage import file_digest
from repsim.methods.trainer import Batch
from repsim.plots import histogram_plot
from repsim.similarity.targets import (ClassMatrixSource, GraphSource, IdentitySource, LabelSource, SimilaritySource,
                                       load_class_matrix)
from repsim.similarity.stage import (caption_similarity, embed_captions_stage, embed_captions_stage_of, wordnet_similarity,
                                     wordnet_similarity_stage, wordnet_similarity_stage_of)

CLASS_LEVEL = ("wordnet", "labels", "matrix")
TARGET_HISTOGRAM_FILE = "target_similarity.png"
TARGET_HISTOGRAM_BATCHES = 10


class CaptionsSimilarity(Strict):
    """Cosine similarity of caption embeddings from a frozen sentence-transformer (default all-MiniLM-L6-v2)."""

    type: Literal["captions"]
    model: str | None = None


class WordnetSimilarity(Strict):
    """WordNet similarity of the classes' synsets."""

    type: Literal["wordnet"]
    measure: Literal["wup", "path", "lch", "hops"] = "wup"


class LabelsSimilarity(Strict):
    """1 for the same label, else 0."""

    type: Literal["labels"]


class IdentitySimilarity(Strict):
    """1 for a sample with itself, else 0: X-CLR's loss towards SimCLR's targets (an ablation of the
    soft graph, NT-Xent as ``target_temperature`` -> 0)."""

    type: Literal["identity"]


class MatrixSimilarity(Strict):
    """A user's (C, C) class similarity, CSV or Parquet (see ``load_class_matrix``)."""

    type: Literal["matrix"]
    path: Path = Field(json_schema_extra=NOT_KEYED)  # its contents' digest is the stage's upstream input


class GraphSimilarity(Strict):
    """A user's sparse sample graph with columns key_i, key_j, s (manifest keys), CSV or Parquet."""

    type: Literal["graph"]
    path: Path = Field(json_schema_extra=NOT_KEYED)


Similarity = Annotated[CaptionsSimilarity | WordnetSimilarity | LabelsSimilarity | IdentitySimilarity |
                       MatrixSimilarity | GraphSimilarity, Field(discriminator="type")]


class XCLRConfig(Strict):
    """X-CLR: ``temperature`` of the prediction, ``target_temperature`` of the similarity targets."""

    name: Literal["xclr"]
    temperature: float = Field(0.1, gt=0)
    target_temperature: float = Field(0.1, gt=0)
    similarity: Similarity = CaptionsSimilarity(type="captions")


class XCLR(TwoViewMethod):
    """Backbone + projection trained with :class:`XCLRLoss` towards ``source``'s similarities. Logs ``loss``
    and ``target_similarity`` (mean over pairs i ≠ j); ``target_samples`` keeps the off-diagonal
    similarities of the first TARGET_HISTOGRAM_BATCHES batches, on the CPU.
    """

    def __init__(self, encoder: nn.Module, projector: nn.Module, source: SimilaritySource,
                 temperature: float = 0.1, target_temperature: float = 0.1):
        super().__init__(encoder, projector)
        self.source = source
        self.loss = XCLRLoss(temperature, target_temperature, gather=True)
        self.target_samples: list[torch.Tensor] = []

    def training_step(self, batch: Batch) -> dict[str, torch.Tensor]:
        z1, z2 = self.project_views(batch)
        similarity = self.source(gather_no_grad(batch["index"], True), gather_no_grad(batch["label"], True))
        if len(self.target_samples) < TARGET_HISTOGRAM_BATCHES:
            self.target_samples.append(_off_diagonal(similarity).float().cpu())
        return {"loss": self.loss(z1, z2, similarity), "target_similarity": _mean_off_diagonal(similarity)}


def _off_diagonal(matrix: torch.Tensor) -> torch.Tensor:
    return matrix[~torch.eye(len(matrix), dtype=torch.bool, device=matrix.device)]


def _mean_off_diagonal(matrix: torch.Tensor) -> torch.Tensor:
    size = len(matrix)
    return (matrix.sum() - matrix.diagonal().sum()) / max(1, size * (size - 1))


def write_figures(method: XCLR, out: Path) -> None:
    """``target_similarity.png`` in ``out``: the histogram of ``method.target_samples``, if any."""
    if method.target_samples:
        histogram_plot(torch.cat(method.target_samples), out / TARGET_HISTOGRAM_FILE,
                       title="X-CLR target similarities (first batches)", xlabel="similarity of samples i ≠ j")


def upstream(config: Config, data: TrainingData) -> Upstream | None:
    """The precompute stage (captions, WordNet) or user file (matrix, graph) the similarity needs."""
    similarity = config.method.similarity
    if similarity.type == "captions":
        return Upstream(embed_captions_stage_of(data.shards, similarity.model).key,
                        partial(embed_captions_stage, data.shards, similarity.model))
    if similarity.type == "wordnet":
        return Upstream(wordnet_similarity_stage_of(data.spec, similarity.measure).key,
                        partial(wordnet_similarity_stage, data.spec, similarity.measure))
    if similarity.type in ("matrix", "graph"):
        return Upstream(file_digest(similarity.path, "method.similarity.path"))
    return None


def similarity_source(similarity: Similarity, data: TrainingData) -> SimilaritySource:
    """The source of ``similarity`` over ``data`` (with its upstream output for captions and WordNet)."""
    if similarity.type in CLASS_LEVEL:
        require_labels(data.labelled, f"the {similarity.type} similarity")
    if similarity.type == "captions":
        return caption_similarity(data.upstream.path)
    if similarity.type == "wordnet":
        return wordnet_similarity(data.upstream.path, data.spec.class_names)
    if similarity.type == "matrix":
        return ClassMatrixSource(load_class_matrix(similarity.path, data.spec.class_names), data.spec.class_names)
    if similarity.type == "graph":
        keys = read_manifest(data.shards.manifest, ["key"]).column("key").to_pylist()
        return GraphSource.from_parquet(similarity.path, keys)
    if similarity.type == "identity":
        return IdentitySource()
    return LabelSource()


@register("xclr", upstream=upstream, write_figures=write_figures, settings=XCLRConfig)
def build(config: Config, data: TrainingData) -> XCLR:
    method = config.method
    encoder, projector = backbone_and_projection(config.model, data.channels, data.image_size)
    return XCLR(encoder, projector, similarity_source(method.similarity, data), method.temperature,
                method.target_temperature)


def target_histogram(source: SimilaritySource, labels: np.ndarray, path: str | Path, name: str,
                     target_temperature: float = 0.1, batch_size: int = 256, seed: int = 0, batches: int = 8) -> Path:
    """How sharply a source and τ_s concentrate X-CLR's target mass on other samples: a PNG histogram at ``path`` of
    that mass on pairs of different samples, for the source called ``name``, over ``batches`` seeded random
    batches of ``batch_size`` of the N samples with ``labels`` (N,)."""
    count = len(labels)
    if count < 2 or target_temperature <= 0:
        raise SimilarityError(f"cannot sample targets from {count} samples at target_temperature={target_temperature}",
                              "pass at least 2 samples and a positive target temperature")
    rng = np.random.default_rng(seed)
    size = min(batch_size, count)
    values = []
    for _ in range(batches):
        indices = np.sort(rng.choice(count, size, replace=False))
        similarity = source(torch.from_numpy(indices), torch.from_numpy(labels[indices]))
        values.append(_off_diagonal(target_mass(similarity, target_temperature)).float().numpy())
    title = f"X-CLR targets, {name}, τ_s = {target_temperature:g}, B = {size}"
    return histogram_plot(np.concatenate(values), path, title=title,
                          xlabel=f"target probability of a view of sample j ≠ i (uniform: 1/{2 * size - 1})")
