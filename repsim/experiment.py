"""Experiments: one YAML file naming a data spec and the stage sections to run on it, in order
(:data:`Section`; the data is always sharded first). ``seeds`` and a ``sweep`` grid expand it into
members (:func:`expand`). Overrides (``--set``) address a top-level field (``name=...``), a section by
its kind (``train.settings.optim.lr=0.01``) or a train method by its label
(``train.methods.xclr.settings.method.target_temperature=0.05``); values parse as YAML. Relative
paths resolve against the experiment file's folder, those in overrides against the working directory.
"""

from __future__ import annotations

import functools
import itertools
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import Field, ValidationError, field_validator, model_validator

from repsim.config_errors import describe
from repsim.data.remote import is_url
from repsim.device import TorchrunLaunch
from repsim.errors import SpecError
from repsim.eval.linear import DEFAULT_WEIGHT_DECAYS
from repsim.layering import (SettingsFile, Strict, as_overrides, inline, load_model, parse_override, resolve_paths,
                             set_dotted)
from repsim.shipped import locate
from repsim.similarity.neighbors import METRICS, STAGE_INDEXES

MEASURES = ("wup", "path", "lch", "hops")
SUITES = ("knn", "linear", "map", "diagnostics", "plots")  # those of repsim.eval that need only image features
PATH_FIELDS = ("data", "stages.*.methods.*.config", "stages.*.config", "stages.*.out")  # relative to the experiment's folder
DEPLOYMENT_PATH_FIELDS = ("deployments.*.experiment",)  # relative to the deployments file's folder
EXPERIMENT_FILE = SettingsFile("experiment", "experiments/default.yaml", "train.settings.optim.lr=0.01", PATH_FIELDS)
DEPLOYMENTS_FILE = SettingsFile("deployments file", "experiments/deployments.yaml", paths=DEPLOYMENT_PATH_FIELDS)
Settings = dict[str, Any]
PIXELS = "pixels"  # the image side that is the raw pixels (repsim.eval.stage.PIXELS)
AS_CONFIGURED = "config"  # the image side that an alignment config names itself


class _Section(Strict):
    def needs(self) -> tuple[str, ...]:  # the section kinds that must come before this one
        return ()


class ShardSection(_Section):
    """Where the data spec's shards go (every experiment shards its data first, with or without this section)."""

    kind: Literal["shard"] = "shard"
    out: Path | None = Field(None, description="output folder; default: the stage's own under $REPSIM_HOME")

    @field_validator("out", mode="before")
    @classmethod
    def _out_is_a_folder(cls, out: Any) -> Any:
        if is_url(out):
            raise ValueError("out is a local folder; to put the shards in a bucket run 'repsim shard SPEC --out URL'")
        return out


class PrecomputeSection(_Section):
    """Caption embeddings, WordNet class similarities and caption neighbors of the data spec."""

    kind: Literal["precompute"] = "precompute"
    captions: bool = True
    wordnet: list[Literal[MEASURES]] = Field(["wup"], description="WordNet measures, one stage each")
    neighbors: int = Field(10, ge=0, description="caption neighbors per sample; 0: none")
    index: Literal[STAGE_INDEXES] = "auto"
    metric: Literal[METRICS] = "cosine"
    model: str | None = Field(None, description="sentence-transformers model; default: all-MiniLM-L6-v2")
    target_temperature: float = Field(0.1, gt=0, description="of the X-CLR target histograms on the parent run")

    @model_validator(mode="after")
    def _neighbors_need_captions(self) -> PrecomputeSection:
        if self.neighbors and not self.captions:
            raise ValueError("neighbors are found among caption embeddings; set captions: true or neighbors: 0")
        return self


def _once(values: list, what: str, fix: str, checked: Any) -> Any:
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


class TrainSection(_Section):
    """Train every method config in ``methods``, each with the shared ``settings`` and then its own."""

    kind: Literal["train"] = "train"
    methods: list[MethodRun] = Field(min_length=1)
    settings: Settings = Field({}, description="over every method config, e.g. {optim: {epochs: 2}}")
    launch: TorchrunLaunch = TorchrunLaunch()

    @model_validator(mode="after")
    def _distinct_labels(self) -> TrainSection:
        return _once([run.label for run in self.methods], "method labels", "give the runs of one config distinct names",
                     self)

    def overrides(self, run: MethodRun, data: Path) -> list[str]:
        """``--set`` overrides of ``run``'s config: the data spec, then the shared settings, then the run's own."""
        return [f"data.spec={data}", *as_overrides(self.settings), *as_overrides(run.settings)]


class LinearProbeOptions(Strict):
    """The linear probe's search (:func:`repsim.eval.linear.linear_probe`): one fit per weight decay,
    the best on a held-out tenth of the train split kept, each fit at most ``max_iter`` L-BFGS steps."""

    weight_decays: list[Annotated[float, Field(ge=0)]] = Field(list(DEFAULT_WEIGHT_DECAYS), min_length=1)
    max_iter: int = Field(1000, gt=0)


class EvaluateSection(_Section):
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

    @model_validator(mode="after")
    def _pixels_by_name(self) -> EvaluateSection:
        if PIXELS in self.encoders:
            raise ValueError(f"encoder label {PIXELS!r} names the raw pixels; set pixels: true instead")
        return self

    def needs(self) -> tuple[str, ...]:
        return () if self.pixels or self.encoders else ("train",)


class AlignSection(_Section):
    """Align every trained image encoder with caption embeddings (a GeRA config), then classify zero-shot."""

    kind: Literal["align"] = "align"
    config: Path = Field(description="alignment config YAML, e.g. configs/gera.yaml")
    settings: Settings = {}
    pixels: bool = Field(False, description="also align the raw pixels, the floor a learned image side must beat")
    as_configured: bool = Field(False, description="also align the image side the config names itself")

    def overrides(self, image: str, data: Path) -> list[str]:
        """``--set`` overrides of the alignment config: the experiment's data spec, the ``image`` side
        (a train stage directory, ``pixels``, or ``config``: the config's own), then the section's settings."""
        sides = {PIXELS: ["image.type=pixels"], AS_CONFIGURED: []}
        image_sets = sides.get(image, ["image.type=encoder", f"image.path={image}"])
        return [f"data.spec={data}", *image_sets, *as_overrides(self.settings)]

    def needs(self) -> tuple[str, ...]:
        return () if self.pixels or self.as_configured else ("train",)


Section = Annotated[ShardSection | PrecomputeSection | TrainSection | EvaluateSection | AlignSection,
                    Field(discriminator="kind")]


SEED_KEYS = {"train": ("settings.optim.seed",),  # what one of an experiment's ``seeds`` sets, by section
             "align": ("settings.optim.seed", "settings.pairing.seed", "settings.text.seed")}


CLUSTER_PATTERN = r"^(local:[1-9][0-9]*|[a-z]+://\S+)$"  # a Dask scheduler address, or local:N


class Experiment(Strict):
    """A data spec and the stage sections to run on it, in order (the data is always sharded first);
    with ``seeds`` and a ``sweep`` grid, once per seed and grid point."""

    name: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")
    data: Path = Field(description="data spec YAML")
    stages: list[Section] = Field(min_length=1)
    seeds: list[int] = Field([], description="run once per seed (the seeds of SEED_KEYS); results: mean ± std")
    sweep: dict[str, Annotated[list[Any], Field(min_length=1)]] = Field(
        {}, description="--set key -> values, e.g. {train.settings.method.target_temperature: [0.05, 0.1]}; "
                        "every combination runs")
    verify: bool = Field(False, description="a cache hit also checks the sha256 of every output file against "
                                            "its record (always: their sizes); a damaged output is rebuilt")
    cluster: str | None = Field(None, pattern=CLUSTER_PATTERN,
                                description="the Dask cluster split stages run their pieces on: tcp://HOST:PORT (a running "
                                            "scheduler) or local:N (N worker processes here); default "
                                            "$DASK_SCHEDULER_ADDRESS, else none")

    @model_validator(mode="after")
    def _distinct_seeds_and_values(self) -> Experiment:
        _once(self.seeds, "seeds", "list each seed once", self)
        for key, values in self.sweep.items():
            if key.split(".")[0] in ("seeds", "sweep"):
                raise ValueError(f"sweep key {key!r} sweeps the sweep; list seeds under seeds:")
            if len({yaml.safe_dump(value) for value in values}) != len(values):
                raise ValueError(f"sweep values {values} of {key!r} repeat; list each value once")
        return self

    @model_validator(mode="after")
    def _method_seeds_among_seeds(self) -> Experiment:
        train = self.section("train")
        methods = train.methods if train else []
        for run in methods:
            if run.seeds is not None:
                _once(run.seeds, f"method {run.label}'s seeds", "list each seed once", self)
                if not set(run.seeds) <= set(self.seeds):
                    raise ValueError(f"method {run.label} runs at seeds {run.seeds}, not all among the experiment's "
                                     f"seeds {self.seeds}; list some of those, or set train.methods.{run.label}.seeds=null")
        idle = [seed for seed in self.seeds or [None] if methods and not any(run.runs_at(seed) for run in methods)]
        if idle == [None]:
            raise ValueError("every method has seeds: [], so none runs; unset one's seeds")
        if idle:
            raise ValueError(f"no method runs at seed {idle[0]}; add it to a method's seeds or drop it from seeds")
        return self

    @model_validator(mode="after")
    def _order(self) -> Experiment:
        kinds = [section.kind for section in self.stages]
        for position, section in enumerate(self.stages):
            if section.kind in kinds[:position]:
                raise ValueError(f"stage kind {section.kind!r} appears twice; merge the two sections")
            missing = [need for need in section.needs() if need not in kinds[:position]]
            if missing:
                raise ValueError(f"a {section.kind} section needs a {missing[0]} section before it")
        return self

    def section(self, kind: str) -> Section | None:
        return next((section for section in self.stages if section.kind == kind), None)


@dataclass(frozen=True)
class Member:
    """One grid point and seed of an experiment, as an experiment of its own (no seeds, no sweep)."""

    point: tuple[tuple[str, Any], ...]  # (sweep key, value) in the sweep's order
    seed: int | None
    experiment: Experiment

    @property
    def point_label(self) -> str:
        """The grid point as ``key=value`` pairs with each key's last part (``target_temperature=0.05``)."""
        return _label(self.point, None)

    @property
    def label(self) -> str:
        return _label(self.point, self.seed)

    def label_through(self, kind: str, method: str) -> str:
        """The label of a ``kind`` stage of ``method``'s encoder: the seed and only the grid values that can
        change it, so that a stage members share is named by what they share."""
        kinds = [section.kind for section in self.experiment.stages]
        later = set(kinds[kinds.index(kind) + 1:])
        return _label([(key, value) for key, value in self.point if _can_change(key, later, method)], self.seed)


def _can_change(key: str, later: set[str], method: str) -> bool:
    """Whether sweep ``key`` can change a stage of ``method``'s encoder before the ``later`` sections."""
    parts = key.split(".")
    if parts[0] == "train" and method == "pixels":
        return False
    return parts[0] not in later and not (parts[:2] == ["train", "methods"] and parts[2] != method)


def _label(point: Sequence[tuple[str, Any]], seed: int | None) -> str:
    pairs = [f"{key.rsplit('.', 1)[-1]}={inline(value)}" for key, value in point]
    return " ".join(pairs + ([] if seed is None else [f"seed={seed}"]))


def expand(experiment: Experiment) -> list[Member]:
    """Every grid point of ``experiment.sweep`` (in the order listed) times every seed; without either, the
    experiment itself. SpecError in one line for a sweep key or value that the experiment refuses."""
    single = experiment.model_copy(update={"seeds": [], "sweep": {}})
    points = [tuple(zip(experiment.sweep, values)) for values in itertools.product(*experiment.sweep.values())]
    return [Member(point, seed, _member(_methods_at(single, seed), point, seed))
            for point in points for seed in experiment.seeds or [None]]


def _methods_at(single: Experiment, seed: int | None) -> Experiment:
    """``single`` with only the train methods that run at ``seed`` (their ``seeds`` then unset)."""
    train = single.section("train")
    if train is None:
        return single
    methods = [run.model_copy(update={"seeds": None}) for run in train.methods if run.runs_at(seed)]
    stages = [section.model_copy(update={"methods": methods}) if section is train else section
              for section in single.stages]
    return single.model_copy(update={"stages": stages})


def _member(single: Experiment, point: tuple[tuple[str, Any], ...], seed: int | None) -> Experiment:
    kinds = [section.kind for section in single.stages]
    seeds = [] if seed is None else [f"{kind}.{key}={seed}" for kind in kinds for key in SEED_KEYS.get(kind, ())]
    sweep = [f"{key}={inline(value)}" for key, value in point]
    try:
        return with_overrides(single, [*sweep, *seeds], origin=f"experiment {single.name}")
    except SpecError as err:
        raise SpecError(f"sweep {', '.join(sweep) or f'seed {seed}'}: {err.what}", err.fix) from None


def load_experiment(path: str | Path, overrides: Sequence[str] = ()) -> Experiment:
    """Read the experiment at ``path`` (or the shipped experiment of that name: ``default``) and apply
    ``overrides``; SpecError in one line naming the file (or the overrides), the field and the fix."""
    experiment = load_model(Experiment, path, EXPERIMENT_FILE)
    return with_overrides(experiment, overrides, origin=str(locate(path, EXPERIMENT_FILE.kind)))


def single_section(name: str, data: str | Path, section: dict[str, Any], cluster: str | None = None) -> Experiment:
    """The experiment of one ``section`` on the data spec ``data`` (on ``cluster``), as ``repsim shard``,
    ``precompute``, ``train``, ``eval`` and ``align`` run it; ``name`` (a data spec's) made a valid experiment name."""
    name = re.sub(r"[^A-Za-z0-9_.-]+", "-", name).strip("-._") or "experiment"
    return _validate({"name": name, "data": str(data), "stages": [section], "cluster": cluster}, "the command line")


def with_overrides(experiment: Experiment, overrides: Sequence[str], origin: str = "experiment") -> Experiment:
    """``experiment`` with each ``key=value`` override applied in order (paths against the cwd)."""
    if not overrides:
        return experiment
    values = functools.reduce(_apply, overrides, experiment.model_dump(mode="json"))
    return _validate(resolve_paths(values, PATH_FIELDS, Path.cwd()), f"{origin} with --set {' '.join(overrides)}")


def _validate(values: dict[str, Any], origin: str) -> Experiment:
    try:
        return Experiment.model_validate(values)
    except ValidationError as err:
        raise SpecError(*describe(err, origin, Experiment)) from None


def _apply(values: dict[str, Any], override: str) -> dict[str, Any]:
    """``values`` with one ``key=value`` override set; the first key is a field or a section kind."""
    name = f"override {override!r}"
    keys, value = parse_override(override, "train.settings.optim.lr=0.01")
    head, *rest = keys
    if head in Experiment.model_fields and head != "stages":
        return set_dotted(values, keys, value)
    kinds = [section["kind"] for section in values["stages"]]
    if head not in kinds:
        raise SpecError(f"{name}: the experiment has no field or section {head!r}",
                        f"start the key with one of {', '.join(['name', 'data', *kinds])}")
    if not rest:
        raise SpecError(f"{name} replaces a whole section", f"set one of its fields, e.g. {head}.<field>=...")
    stages, index = list(values["stages"]), kinds.index(head)
    if head == "train" and rest[0] == "methods" and len(rest) > 2:
        stages[index] = {**stages[index], "methods": _set_method(stages[index]["methods"], rest[1], rest[2:], value, name)}
    else:
        stages[index] = set_dotted(stages[index], rest, value)
    return {**values, "stages": stages}


def _set_method(methods: list[dict[str, Any]], label: str, keys: Sequence[str], value: Any,
                name: str) -> list[dict[str, Any]]:
    """``methods`` with ``keys`` set in the run labelled ``label`` (``train.methods.<label>.settings...``)."""
    labels = [run.get("name") or Path(run["config"]).stem for run in methods]
    if label not in labels:
        raise SpecError(f"{name}: the train section has no method labelled {label!r}",
                        f"use one of {', '.join(labels)} (a run's name, else its config's file name)")
    return [set_dotted(run, keys, value) if run_label == label else run for run, run_label in zip(methods, labels)]


def check_experiment(experiment: Experiment) -> list[Member]:
    """The members, once their data spec and every method and alignment config load: SpecError before any work."""
    from repsim.align.config import load_align_config
    from repsim.data import load_spec
    from repsim.methods.config import load_config

    load_spec(experiment.data)
    members = expand(experiment)
    for member in members:
        try:
            train, align = member.experiment.section("train"), member.experiment.section("align")
            for run in train.methods if train is not None else ():
                load_config(run.config, train.overrides(run, member.experiment.data))
            if align is not None:
                load_align_config(align.config, align.overrides("encoder", member.experiment.data))
        except SpecError as err:
            raise SpecError(f"sweep member {member.label}: {err.what}" if member.label else err.what, err.fix) from None
    return members


class DeploymentSpec(Strict):
    """A deployment of the experiment flow: an experiment file with overrides, and an optional cron schedule."""

    name: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")
    experiment: Path
    overrides: list[str] = []
    cron: str | None = Field(None, description='e.g. "0 2 * * *": every night at 02:00')
    timezone: str = "UTC"
    description: str | None = None
    tags: list[str] = []


class Deployments(Strict):
    deployments: list[DeploymentSpec] = Field(min_length=1)

    @model_validator(mode="after")
    def _distinct_names(self) -> Deployments:
        return _once([deployment.name for deployment in self.deployments], "deployment names",
                     "give each a distinct name", self)


def load_deployments(path: str | Path) -> tuple[list[DeploymentSpec], list[Experiment]]:
    """The deployments at ``path`` (or the shipped deployments file of that name: ``deployments``) and,
    for each, its experiment with its overrides (validated)."""
    specs = load_model(Deployments, path, DEPLOYMENTS_FILE).deployments
    return specs, [load_experiment(spec.experiment, spec.overrides) for spec in specs]
