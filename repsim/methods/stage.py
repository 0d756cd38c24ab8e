"""The train stage: one experiment config trained into a cached output directory holding ``encoder.pt``
(a ``torch.export`` archive: :func:`load_encoder` rebuilds it), ``metrics.jsonl`` (one JSON object per step
and per epoch), the method's figures, if any, and with ``optim.keep_checkpoint`` the final ``checkpoint.pt``.

The key covers the config less the settings that do not change what is learned, with the shard key,
the upstream key and the digest of ``model.init_encoder`` in place of paths. While training runs,
checkpoints and metrics go to ``$REPSIM_HOME/scratch/train/<key>/``, which a rerun resumes from. Under
torchrun every rank calls :func:`train`; rank 0 writes.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from collections.abc import Callable, Mapping
from dataclasses import replace
from pathlib import Path

import torch
import torch.distributed as dist

from repsim.data.loader import ShardLoader, make_loader, peek_image
from repsim.data.stage import ShardResult, sharded, sharded_already
from repsim.data.spec import DataSpec, load_spec
from repsim.device import TorchrunLaunch, cpu_plan, distributed, gpu_slot, resolve_device, torch_threads
from repsim.errors import SpecError
from repsim.methods.config import Config
from repsim.methods.base import Method, TrainingData, Upstream, method_spec
from repsim.methods.trainer import (KnnMonitor, LogFn, Trainer, TrainingError, init_distributed, is_main_process,
                                  seeded)
from repsim.models.backbones import ENCODER_FILE, encoder_file, load_encoder, save_encoder
from repsim.layering import keyed_values
from repsim.stage import (SERVE_COMPLETE, Reuse, Stage, StageKind, StageOutput, read_record, repsim_home, run_stage,
                          sha256_file)

VERSION = "2"  # 2: the loader reads every sample once an epoch with several workers or ranks
CHECKPOINT_FILE = "checkpoint.pt"
METRICS_FILE = "metrics.jsonl"

__all__ = ["file_digest", "load_encoder", "prepare", "train", "train_loader", "train_stage_of"]


def file_digest(path: Path, field: str) -> str:
    """sha256 of a file's bytes; SpecError naming config ``field`` when it does not exist."""
    if not Path(path).is_file():
        raise SpecError(f"{field} points at {path}, which does not exist", "correct the path")
    return sha256_file(Path(path))


# ---------------------------------------------------------------------------------------------
# Planning

def train_stage_of(config: Config, shards: ShardResult | str | Path | None = None) -> Stage:
    """The train stage of ``config`` (its key) without training; ``shards`` default to the completed ones."""
    spec = load_spec(config.data.spec)
    data = training_data(config, spec, sharded_already(spec, shards))
    return _stage(config, data.shards, method_spec(config.method.name).upstream(config, data))


def _stage(config: Config, shards: ShardResult, upstream: Upstream | None) -> Stage:
    inputs = {"shards": shards.key} | ({"upstream": upstream.key} if upstream is not None else {})
    if config.model.init_encoder is not None:
        inputs["init_encoder"] = file_digest(encoder_file(config.model.init_encoder), "model.init_encoder")
    return Stage("train", VERSION, keyed_values(config), inputs)


def training_data(config: Config, spec: DataSpec, shards: ShardResult) -> TrainingData:
    """The spec, the shards, and the channels and view size of the training split's images."""
    split = config.data.split
    if split not in shards.shards:
        raise SpecError(f"data.split is {split!r}, which the shards of {spec.name!r} do not hold",
                        f"use one of {', '.join(shards.shards)}")
    channels, size = peek_image(str(shards.shards[split][0]))
    return TrainingData(spec, shards, channels, config.data.image_size or size)


# ---------------------------------------------------------------------------------------------
# Training

def train(config: Config, out_dir: str | Path | None = None, log: LogFn | None = None,
          shards: ShardResult | str | Path | None = None, device: str | torch.device | None = None,
          progress: bool = True, reuse: Reuse = SERVE_COMPLETE) -> StageOutput:
    """Train ``config`` into its stage directory (its shards and upstream stage first, all cached) on ``device``
    (default: this rank's GPU, else the CPU), resuming an interrupted run, unless ``reuse`` serves a complete
    output; ``log(metrics, step)`` on rank 0."""
    init_distributed()
    data, upstream = prepare(config, shards, progress and is_main_process())
    stage = _stage(config, data.shards, upstream)
    scratch = repsim_home() / "scratch" / "train" / stage.key
    build = _builder(config, data, scratch, log, resolve_device(device), progress)
    if distributed():
        return _train_distributed(stage, build, out_dir, scratch, reuse)
    output = run_stage(stage, build, out_dir, reuse=reuse)
    shutil.rmtree(scratch, ignore_errors=True)
    return output


def prepare(config: Config, shards: ShardResult | str | Path | None = None,
            progress: bool = True) -> tuple[TrainingData, Upstream | None]:
    """What ``config`` trains on: its shards (unless given) and its upstream output, both run (cached)."""
    spec = load_spec(config.data.spec)
    data = training_data(config, spec, sharded(spec, shards, progress))
    upstream = method_spec(config.method.name).upstream(config, data)
    if upstream is not None and upstream.run is not None:
        data = replace(data, upstream=upstream.run())
    return data, upstream


def launch_training(config: Config, out_dir: str | Path | None = None, log: LogFn | None = None,
                    launch: TorchrunLaunch | None = None, reuse: Reuse = SERVE_COMPLETE) -> StageOutput:
    """:func:`train` as the pipeline runs it: on a GPU of its own, or with a distributed ``launch`` through
    torchrun (``repsim train --direct`` on every rank, told to ``--rebuild`` an output ``reuse`` does not
    serve), its curves reaching ``log`` from ``metrics.jsonl``."""
    if launch is None or not launch.distributed:
        with gpu_slot() as device:
            return train(config, out_dir, log=log, device=device, reuse=reuse)
    stage = train_stage_of(config)
    out = stage.output_dir(out_dir)
    record = read_record(out)
    if record is not None and reuse.serves(out, record):
        return train(config, out_dir, progress=False)
    started = time.time()
    resolved = repsim_home() / "scratch" / "launch" / f"{stage.key}.json"
    resolved.parent.mkdir(parents=True, exist_ok=True)
    resolved.write_text(config.model_dump_json())  # JSON is YAML: the ranks read the config as resolved here
    try:
        rebuild = ["--rebuild"] if record is not None else []
        exit_code = subprocess.run(launch.command(resolved, options=rebuild), env=os.environ | launch.environment,
                                   check=False).returncode
    finally:
        resolved.unlink()
    if exit_code:
        raise TrainingError(f"torchrun exited with code {exit_code}", "see the ranks' output above")
    output = train(config, out_dir, progress=False)  # complete now: returns the output at once
    trained = output.record["started"] >= started
    if trained and log is not None:
        for line in _read_lines(output.path / METRICS_FILE):
            metrics = json.loads(line)
            log(metrics, metrics.pop("step"))
    return replace(output, cached=not trained)


def _train_distributed(stage: Stage, build: Callable[[Path | None], Mapping[str, float]],
                       out_dir: str | Path | None, scratch: Path, reuse: Reuse) -> StageOutput:
    """Rank 0 runs the stage and tells the others whether it trains; they train alongside, unwritten."""
    out = stage.output_dir(out_dir)
    if is_main_process():
        def announce_and_build(tmp: Path) -> Mapping[str, float]:
            _announce(True)
            return build(tmp)
        output = run_stage(stage, announce_and_build, out, reuse=reuse)
        if output.cached:
            _announce(False)
        shutil.rmtree(scratch, ignore_errors=True)
        dist.barrier()
        return output
    training = _announce(None)
    if training:
        build(None)
    dist.barrier()
    return StageOutput(stage.name, stage.key, out, not training, read_record(out))


def _announce(training: bool | None) -> bool:
    """Rank 0's ``training`` flag, broadcast to every rank (the others pass None and receive it)."""
    flag = [training]
    dist.broadcast_object_list(flag, src=0)
    return bool(flag[0])


def _builder(config: Config, data: TrainingData, scratch: Path, log: LogFn | None, device: torch.device,
             progress: bool) -> Callable[[Path | None], dict[str, float]]:
    """``build(out)``: train (resuming from ``scratch``) and write the outputs into ``out`` (None: write nothing)."""
    def build(out: Path | None) -> dict[str, float]:
        spec = method_spec(config.method.name)
        with seeded(config.optim.seed):
            method: Method = spec.build(config, data)
        metrics = JsonlMetrics(scratch / METRICS_FILE)
        plan = cpu_plan(device, config.optim.num_workers, config.optim.threads)
        trainer = Trainer(method, config.optim, train_loader(config, data, device, plan.workers),
                          monitor=_monitor(config, data, plan.workers), checkpoint_path=scratch / CHECKPOINT_FILE,
                          log=_tee(metrics, log), device=device, progress=progress)
        with torch_threads(plan.threads):
            trainer.fit()
        if out is None:
            return {}
        if config.optim.keep_checkpoint:
            shutil.copyfile(scratch / CHECKPOINT_FILE, out / CHECKPOINT_FILE)
        if metrics.path.is_file():
            shutil.copyfile(metrics.path, out / METRICS_FILE)
        else:  # no step was taken (optim.max_steps: 0)
            (out / METRICS_FILE).touch()
        save_encoder(method.encoder, out / ENCODER_FILE, data.image_size)
        spec.write_figures(method, out)
        seen = {"loader_workers": plan.workers, "channels": data.channels, "image_size": data.image_size}
        return summarise(out / METRICS_FILE, trainer.steps_per_epoch) | seen
    return build


def train_loader(config: Config, data: TrainingData, device: torch.device, workers: int) -> ShardLoader:
    """The training split's loader: this rank's share of the batch, augmented in the ``workers`` or on ``device``."""
    world_size = dist.get_world_size() if distributed() else 1
    if config.optim.batch_size % world_size:
        raise SpecError(f"optim.batch_size {config.optim.batch_size} does not split evenly over {world_size} ranks",
                        f"use a multiple of {world_size}")
    return make_loader(data.shards.path, config.data.preset, config.optim.batch_size // world_size,
                       split=config.data.split, image_size=data.image_size, channels=data.channels,
                       seed=config.optim.seed, num_workers=workers, preset_options=config.data.preset_options,
                       augment=config.data.augment, device=device, pin_memory=device.type == "cuda")


def _monitor(config: Config, data: TrainingData, workers: int) -> KnnMonitor | None:
    """kNN of the eval views of the training split against the test split, on rank 0 alone."""
    settings = config.monitor
    if not settings.knn:
        return None
    if not data.labelled:
        raise SpecError("monitor.knn needs labelled data, but the data spec lists no classes",
                        "set monitor.knn=false")
    if settings.test_split not in data.shards.shards:
        raise SpecError(f"monitor.test_split is {settings.test_split!r}, which the shards do not hold",
                        f"use one of {', '.join(data.shards.shards)}, or set monitor.knn=false")
    normalisation = {key: value for key, value in config.data.preset_options.items() if key in ("mean", "std")}
    train, test = (make_loader(data.shards.path, "eval", settings.batch_size, split=split, image_size=data.image_size,
                               channels=data.channels, shuffle=False, drop_last=False, rank=0, world_size=1,
                               num_workers=workers, preset_options=normalisation)
                   for split in (config.data.split, settings.test_split))
    return KnnMonitor(train, test, settings.k)


def _tee(first: LogFn, second: LogFn | None) -> LogFn:
    def log(metrics: dict[str, float], step: int) -> None:
        first(metrics, step)
        if second is not None:
            second(metrics, step)
    return log


class JsonlMetrics:
    """Appends ``{"step": step, **metrics}`` lines to ``path``; the first write drops lines of that step and
    later ones, left by the interrupted run being resumed."""

    def __init__(self, path: Path):
        self.path, self._fresh = path, True

    def __call__(self, metrics: dict[str, float], step: int) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if self._fresh:
            kept = [line for line in _read_lines(self.path) if json.loads(line)["step"] < step]
            self.path.write_text("".join(f"{line}\n" for line in kept))
            self._fresh = False
        with open(self.path, "a") as handle:
            handle.write(json.dumps({"step": step, **metrics}) + "\n")


def _read_lines(path: Path) -> list[str]:
    return path.read_text().splitlines() if path.is_file() else []


def summarise(metrics_path: Path, steps_per_epoch: int) -> dict[str, float]:
    """Stage metrics: ``loss`` and ``last_epoch_loss`` (the mean of the last epoch: MLflow's ``loss`` is the curve
    of steps), ``final_loss`` (of the last step), ``steps``, ``epochs``, the last kNN accuracies; without a step
    (``optim.max_steps: 0``), ``steps`` and ``epochs`` alone."""
    records = [json.loads(line) for line in _read_lines(metrics_path)]
    steps = [record for record in records if "loss" in record]
    if not steps:
        return {"steps": 0, "epochs": 0}
    last = steps[-1]["step"]
    last_epoch = [record["loss"] for record in steps if record["step"] > last - steps_per_epoch]
    epochs = [record for record in records if "epoch" in record]
    knn = {key: value for key, value in (epochs[-1] if epochs else {}).items()
           if key.startswith(("knn_", "teacher_knn_"))}
    mean = sum(last_epoch) / len(last_epoch)
    return {"loss": mean, "last_epoch_loss": mean, "final_loss": steps[-1]["loss"], "steps": last,
            "epochs": epochs[-1]["epoch"] if epochs else 0, **knn}


TRAIN = StageKind("train", train_stage_of, launch_training, (METRICS_FILE, "*.png"),
                  facts=("steps", "epochs", "loader_workers", "channels", "image_size"), streams=True,
                  describe=lambda config, m: f"{config['method']['name']}, {m['steps']} steps" + (
                      f", last epoch's loss {m['loss']:.3f}" if "loss" in m else ""))
