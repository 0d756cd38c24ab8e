"""The sections of an experiment, each one declaration: its settings (a model tagged by ``kind``), the stage
kinds it runs and how it runs them for every member at once (:meth:`Section.run`), against a
:class:`StageRunner`: the experiment flow's stage tasks, or a plan. Sections register in :data:`SECTIONS`;
a package adds one through the ``repsim.sections`` entry points (docs/adding-a-stage.md)."""

from __future__ import annotations

import functools
import pkgutil
from abc import abstractmethod
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Annotated, Any, ClassVar, Literal, Protocol

from pydantic import Field, field_validator, model_validator

from repsim.data.remote import is_url
from repsim.device import TorchrunLaunch
from repsim.errors import SpecError
from repsim.eval.linear import DEFAULT_WEIGHT_DECAYS
from repsim.layering import Override, Strict
from repsim.registry import Registry
from repsim.similarity.neighbors import METRICS, STAGE_INDEXES
from repsim.stage import StageKind, StageOutput

ENTRY_POINTS = "repsim.sections"  # the entry-point group under which a package names its sections' modules
MEASURES = ("wup", "path", "lch", "hops")
SUITES = ("knn", "linear", "map", "diagnostics", "plots")  # those of repsim.eval that need only image features
PIXELS = "pixels"  # the image side that is the raw pixels (repsim.eval.stage.PIXELS)
AS_CONFIGURED = "config"  # the image side that an alignment config names itself
Settings = dict[str, Any]


class StageRunner(Protocol):
    """Where a section submits its stages: the flow's stage tasks, or a plan that only keys them."""

    def submit(self, kind: str, params: dict[str, Any], options: dict[str, Any] | None = None, *,
               out_dir: str | None = None, label: str | None = None, encoder: str | None = None,
               register: str | None = None) -> str:
        """Submit the ``kind`` stage of ``params`` (once per distinct request); the request, for :meth:`result`."""

    def result(self, request: str) -> StageOutput:
        """The output of a submitted request, once built."""

    def log_figures(self, draw: Callable[[Path], list[Path]]) -> None:
        """Keep the figures ``draw(folder)`` writes with the run."""

    def model_directory(self, uri: str) -> Path:
        """The local folder of a registered model, ``models:/NAME/VERSION``."""


class MemberState(Protocol):
    """One member of an experiment as the sections see it: its data spec and name, and the outputs so far."""

    data: Path
    name: str
    shards: StageOutput | None
    captions: StageOutput | None
    encoders: dict[str, StageOutput]  # trained encoders by label

    def tag(self, label: str, kind: str) -> str:
        """``label`` with what of the member (seed, grid values) can change its ``kind`` stage."""

    def score(self, encoder: str, output: StageOutput) -> None:
        """Keep what ``output`` (of a stage kind that ``scores``) scores ``encoder`` by, for the result table."""


class Section(Strict):
    """An experiment section: ``kind`` tags it; ``stage_kinds`` lists the :class:`StageKind` objects it runs (or
    ``module:NAME`` references, resolved on first use); ``seed_keys``, the settings one of an experiment's
    seeds sets; :meth:`run` submits its stages for every member."""

    kind: str
    stage_kinds: ClassVar[tuple[StageKind | str, ...]] = ()
    seed_keys: ClassVar[tuple[str, ...]] = ()

    def needs(self) -> tuple[str, ...]:
        """The section kinds that must come before this one."""
        return ()

    @classmethod
    @abstractmethod
    def run(cls, stages: StageRunner, members: list[tuple[MemberState, Any]]) -> None:
        """Submit this section's stages of every (member, its section), then wait for and keep their outputs."""


SECTIONS = Registry("section", "kind", ENTRY_POINTS, __name__, lambda: None, in_order=True)


def register_section(model: type[Section]) -> type[Section]:
    """Class decorator: register ``model`` under its ``kind``."""
    SECTIONS.accept(model.model_fields["kind"].default, model)
    return model


def stage_kinds() -> dict[str, StageKind]:
    """Every stage kind the registered sections run, by name."""
    return _stage_kinds_of(SECTIONS.models())


@functools.cache
def _stage_kinds_of(models: tuple[type[Section], ...]) -> dict[str, StageKind]:
    """The stage kinds of ``models``, resolved once per set of registered sections."""
    return {kind.name: kind for model in models for kind in map(_resolved, model.stage_kinds)}


def check_stage_names(names: Iterable[str], what: str = "--force") -> None:
    """SpecError in one line for a name among ``names`` that no registered section's stage kinds has."""
    known = stage_kinds()
    unknown = [name for name in names if name not in known]
    if unknown:
        raise SpecError(f"{what} {unknown[0]}: no stage of that name", f"use one of {', '.join(known)}")


def _resolved(kind: StageKind | str) -> StageKind:
    return pkgutil.resolve_name(kind) if isinstance(kind, str) else kind


@register_section
class ShardSection(Section):
    """Where the data spec's shards go (every experiment shards its data first, with or without this section)."""

    kind: Literal["shard"] = "shard"
    out: Path | None = Field(None, description="output folder; default: the stage's own under $REPSIM_HOME")
    stage_kinds: ClassVar = ("repsim.data.stage:SHARD",)

    @field_validator("out", mode="before")
    @classmethod
    def _out_is_a_folder(cls, out: Any) -> Any:
        if is_url(out):
            raise ValueError("out is a local folder; to put the shards in a bucket run 'repsim shard SPEC --out URL'")
        return out

    @classmethod
    def run(cls, stages: StageRunner, members: list[tuple[MemberState, ShardSection | None]]) -> None:
        """Shard each member's data spec (first, whatever the experiment lists)."""
        from repsim.data.spec import load_spec

        requests = [stages.submit("shard", {"spec": load_spec(run.data)},
                                  out_dir=str(section.out) if section is not None and section.out else None)
                    for run, section in members]
        for (run, _), request in zip(members, requests):
            run.shards = stages.result(request)


@register_section
class PrecomputeSection(Section):
    """Caption embeddings, WordNet class similarities and caption neighbors of the data spec."""

    kind: Literal["precompute"] = "precompute"
    captions: bool = True
    wordnet: list[Literal[MEASURES]] = Field(["wup"], description="WordNet measures, one stage each")
    neighbors: int = Field(10, ge=0, description="caption neighbors per sample; 0: none")
    index: Literal[STAGE_INDEXES] = "auto"
    metric: Literal[METRICS] = "cosine"
    model: str | None = Field(None, description="sentence-transformers model; default: all-MiniLM-L6-v2")
    target_temperature: float = Field(0.1, gt=0, description="of the X-CLR target histograms on the parent run")
    stage_kinds: ClassVar = ("repsim.similarity.stage:CAPTIONS", "repsim.similarity.stage:WORDNET",
                             "repsim.similarity.stage:NEIGHBORS")

    @model_validator(mode="after")
    def _neighbors_need_captions(self) -> PrecomputeSection:
        if self.neighbors and not self.captions:
            raise ValueError("neighbors are found among caption embeddings; set captions: true or neighbors: 0")
        return self

    @classmethod
    def run(cls, stages: StageRunner, members: list[tuple[MemberState, PrecomputeSection]]) -> None:
        """Captions and WordNet similarities at once, then the captions' neighbors; the target histograms."""
        from repsim.data.spec import load_spec

        captions = {run: stages.submit("captions", {"shards": str(run.shards.path), "model": section.model})
                    for run, section in members if section.captions}
        wordnet = {(run, measure): stages.submit("wordnet", {"classes": load_spec(run.data), "measure": measure})
                   for run, section in members for measure in section.wordnet}
        for run, request in captions.items():
            run.captions = stages.result(request)
        neighbors = [stages.submit("neighbors", {"embeddings": str(run.captions.path), "k": section.neighbors,
                                                 "index": section.index, "metric": section.metric})
                     for run, section in members if section.neighbors]
        similarities = {key: stages.result(request) for key, request in wordnet.items()}
        for request in neighbors:
            stages.result(request)
        for run, section in dict(members).items():
            measures = {measure: similarities[run, measure] for measure in section.wordnet}
            stages.log_figures(functools.partial(target_histograms, run, measures, section.target_temperature))


def target_histograms(run: MemberState, wordnet: dict[str, StageOutput], target_temperature: float,
                      folder: Path) -> list[Path]:
    """``target_similarity_<source>.png`` in ``folder`` for each source the precompute section prepared (and
    labels, if labelled): the histogram of X-CLR's targets on random batches at ``target_temperature``."""
    from repsim.data.manifest import MANIFEST, manifest_labels
    from repsim.methods.xclr import target_histogram
    from repsim.similarity.stage import precomputed_sources

    labels = manifest_labels(run.shards.path / MANIFEST)
    sources = precomputed_sources(labels, run.captions.path if run.captions is not None else None,
                                  {measure: output.path for measure, output in wordnet.items()})
    return [target_histogram(source, labels, folder / f"target_similarity_{name}.png", name, target_temperature)
            for name, source in sources.items()]


def distinct(values: list, what: str, fix: str, checked: Any) -> Any:
    """``checked`` when no value repeats, else a ValueError naming ``what`` and how to ``fix`` it."""
    if len(set(values)) != len(values):
        raise ValueError(f"{what} {values} repeat; {fix}")
    return checked


class MethodRun(Strict):
    """One method config to train, with ``settings`` (a nested mapping, like the config's YAML) over it."""

    config: Path
    name: str | None = Field(None, description="label in tables and MLflow; default: the config file's stem")
    settings: Settings = {}
    seeds: list[int] | None = Field(None, description="train it at only these of the experiment's seeds, e.g. [0] "
                                                      "for a costly row ([]: at none); default: at every seed")

    @property
    def label(self) -> str:
        return self.name or self.config.stem

    def runs_at(self, seed: int | None) -> bool:
        return self.seeds is None or seed in self.seeds


@register_section
class TrainSection(Section):
    """Train every method config in ``methods``, each with the shared ``settings`` and then its own."""

    kind: Literal["train"] = "train"
    methods: list[MethodRun] = Field(min_length=1)
    settings: Settings = Field({}, description="over every method config, e.g. {optim: {epochs: 2}}")
    launch: TorchrunLaunch = TorchrunLaunch()
    stage_kinds: ClassVar = ("repsim.methods.stage:TRAIN",)
    seed_keys: ClassVar = ("settings.optim.seed",)

    @model_validator(mode="after")
    def _distinct_labels(self) -> TrainSection:
        return distinct([run.label for run in self.methods], "method labels", "give the runs of one config distinct names",
                     self)

    def overrides(self, run: MethodRun, data: Path) -> list[Override]:
        """The overrides of ``run``'s config: the data spec, then the shared settings, then the run's own."""
        return [{"data": {"spec": str(data)}}, self.settings, run.settings]

    @classmethod
    def run(cls, stages: StageRunner, members: list[tuple[MemberState, TrainSection]]) -> None:
        """Train every method of every member at once; each encoder registered as ``<experiment>-<label>``."""
        from repsim.methods.config import load_config

        requests = [(run, method.label, stages.submit(
            "train", {"config": load_config(method.config, section.overrides(method, run.data))},
            {"launch": section.launch}, label=run.tag(method.label, "train"), encoder=method.label,
            register=f"{run.name}-{method.label}"))  # the registered model, e.g. animal-mnist-xclr
            for run, section in members for method in section.methods]
        for run, label, request in requests:
            run.encoders[label] = stages.result(request)


class LinearProbeOptions(Strict):
    """The linear probe's search (:func:`repsim.eval.linear.linear_probe`): one fit per weight decay,
    the best on a held-out tenth of the train split kept, each fit at most ``max_iter`` L-BFGS steps."""

    weight_decays: list[Annotated[float, Field(ge=0)]] = Field(list(DEFAULT_WEIGHT_DECAYS), min_length=1)
    max_iter: int = Field(1000, gt=0)


@register_section
class EvaluateSection(Section):
    """Evaluate every trained encoder (and the raw pixels, if ``pixels``) on the train/test splits."""

    kind: Literal["evaluate"] = "evaluate"
    suites: list[Literal[SUITES]] = Field(["knn", "linear"], min_length=1)
    knn_k: list[Annotated[int, Field(gt=0)]] = Field([20], min_length=1)
    linear: LinearProbeOptions = LinearProbeOptions()
    pixels: bool = Field(True, description="also evaluate raw pixels, the floor a learned encoder must beat")
    encoders: dict[str, str] = Field({}, description="label -> encoder to evaluate besides those trained: a train "
                                                     "stage folder, an encoder.pt or models:/NAME/VERSION")
    train_split: str = "train"
    test_split: str = "test"
    batch_size: int = Field(512, gt=0, description="of feature extraction")
    device: str | None = Field(None, description="default: the GPU if there is one, else the CPU")
    stage_kinds: ClassVar = ("repsim.eval.stage:FEATURES", "repsim.eval.stage:EVALUATE")

    @model_validator(mode="after")
    def _pixels_by_name(self) -> EvaluateSection:
        if PIXELS in self.encoders:
            raise ValueError(f"encoder label {PIXELS!r} names the raw pixels; set pixels: true instead")
        return self

    def needs(self) -> tuple[str, ...]:
        return () if self.pixels or self.encoders else ("train",)

    @classmethod
    def run(cls, stages: StageRunner, members: list[tuple[MemberState, EvaluateSection]]) -> None:
        """The features of both splits of every encoder at once, then every evaluation; their scores kept."""
        encoders = [(run, section, label, tag, encoder) for run, section in members
                    for label, tag, encoder in section.encoders_of(run, stages)]
        features = [[stages.submit("features", {"shards": str(run.shards.path), "encoder": encoder, "split": split,
                                                "device": section.device},
                                   {"batch_size": section.batch_size}, label=f"{tag} {split}", encoder=label)
                     for split in (section.train_split, section.test_split)]
                    for run, section, label, tag, encoder in encoders]
        evaluations = [stages.submit(
            "evaluate", {"train": str(stages.result(train).path), "test": str(stages.result(test).path),
                         "suites": list(section.suites), "knn_k": list(section.knn_k),
                         "linear_options": section.linear.model_dump(exclude_defaults=True)},
            {"device": section.device}, label=tag, encoder=label)
            for (run, section, label, tag, _), (train, test) in zip(encoders, features)]
        for (run, _, label, _, _), request in zip(encoders, evaluations):
            run.score(label, stages.result(request))

    def encoders_of(self, run: MemberState, stages: StageRunner) -> list[tuple[str, str, str]]:
        """(label, label shown with the member, encoder) of each encoder to evaluate: the raw pixels, those the
        section names (``models:/`` ones fetched), then those trained (the only ones whose label shows the member)."""
        named = {label: str(stages.model_directory(encoder)) if encoder.startswith("models:/") else encoder
                 for label, encoder in (({PIXELS: PIXELS} if self.pixels else {}) | self.encoders).items()}
        trained = [(label, run.tag(label, "evaluate"), str(output.path)) for label, output in run.encoders.items()]
        return [(label, label, encoder) for label, encoder in named.items()] + trained


@register_section
class AlignSection(Section):
    """Align every trained image encoder with caption embeddings (a GeRA config), then classify zero-shot."""

    kind: Literal["align"] = "align"
    config: Path = Field(description="alignment config YAML, e.g. configs/gera.yaml")
    settings: Settings = {}
    pixels: bool = Field(False, description="also align the raw pixels, the floor a learned image side must beat")
    as_configured: bool = Field(False, description="also align the image side the config names itself")
    stage_kinds: ClassVar = ("repsim.align.stage:ALIGN",)
    seed_keys: ClassVar = ("settings.optim.seed", "settings.pairing.seed", "settings.text.seed")

    def overrides(self, image: str, data: Path) -> list[Override]:
        """The overrides of the alignment config: the experiment's data spec, the ``image`` side (a train
        stage directory, ``pixels``, or ``config``: the config's own), then the section's settings."""
        sides = {PIXELS: [{"image": {"type": "pixels"}}], AS_CONFIGURED: []}
        side = sides.get(image, [{"image": {"type": "encoder", "path": image}}])
        return [{"data": {"spec": str(data)}}, *side, self.settings]

    def needs(self) -> tuple[str, ...]:
        return () if self.pixels or self.as_configured else ("train",)

    @classmethod
    def run(cls, stages: StageRunner, members: list[tuple[MemberState, AlignSection]]) -> None:
        """Align every image side of every member at once; their scores kept."""
        from repsim.align.config import load_align_config

        requests = [(run, label, stages.submit(
            "align", {"config": load_align_config(section.config, section.overrides(image, run.data))},
            label=run.tag(label, "align"), encoder=label))
            for run, section in members for label, image in section.image_sides(run)]
        for run, label, request in requests:
            run.score(label, stages.result(request))

    def image_sides(self, run: MemberState) -> list[tuple[str, str]]:
        """(label, image side: ``pixels``, ``config`` or a train stage directory) of each image side to align."""
        own = [(self.config.stem, AS_CONFIGURED)] * self.as_configured
        pixels = [(PIXELS, PIXELS)] * self.pixels
        return own + pixels + [(label, str(output.path)) for label, output in run.encoders.items()]
