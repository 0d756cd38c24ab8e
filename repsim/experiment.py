"""Experiments: one YAML file naming a data spec and the stage sections to run on it, in order
(:mod:`repsim.sections`; the data is always sharded first). ``seeds`` and a ``sweep`` grid expand it into
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
from typing import Annotated, Any

import yaml
from pydantic import Field, ValidationError, model_validator

from repsim.config_errors import describe
from repsim.errors import SpecError
from repsim.layering import SettingsFile, Strict, inline, load_model, parse_override, resolve_paths, set_dotted
from repsim.sections import SECTIONS, Section, distinct
from repsim.shipped import locate

PATH_FIELDS = ("data", "stages.*.methods.*.config", "stages.*.config", "stages.*.out")  # relative to the experiment's folder
DEPLOYMENT_PATH_FIELDS = ("deployments.*.experiment",)  # relative to the deployments file's folder
EXPERIMENT_FILE = SettingsFile("experiment", "experiments/default.yaml", "train.settings.optim.lr=0.01", PATH_FIELDS)
DEPLOYMENTS_FILE = SettingsFile("deployments file", "experiments/deployments.yaml", paths=DEPLOYMENT_PATH_FIELDS)
CLUSTER_PATTERN = r"^(local:[1-9][0-9]*|[a-z]+://\S+)$"  # a Dask scheduler address, or local:N


class Experiment(Strict):
    """A data spec and the stage sections to run on it, in order (the data is always sharded first);
    with ``seeds`` and a ``sweep`` grid, once per seed and grid point."""

    name: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")
    data: Path = Field(description="data spec YAML")
    stages: list[Annotated[Any, SECTIONS]] = Field(min_length=1, description="sections by kind (repsim.sections)")
    seeds: list[int] = Field([], description="run once per seed (the sections' seed_keys); results: mean ± std")
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
        distinct(self.seeds, "seeds", "list each seed once", self)
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
                distinct(run.seeds, f"method {run.label}'s seeds", "list each seed once", self)
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
        """The section of ``kind``, if the experiment has one."""
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
    seeds = [] if seed is None else [f"{section.kind}.{key}={seed}" for section in single.stages
                                     for key in section.seed_keys]
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
        return distinct([deployment.name for deployment in self.deployments], "deployment names",
                     "give each a distinct name", self)


def load_deployments(path: str | Path) -> tuple[list[DeploymentSpec], list[Experiment]]:
    """The deployments at ``path`` (or the shipped deployments file of that name: ``deployments``) and,
    for each, its experiment with its overrides (validated)."""
    specs = load_model(Deployments, path, DEPLOYMENTS_FILE).deployments
    return specs, [load_experiment(spec.experiment, spec.overrides) for spec in specs]
