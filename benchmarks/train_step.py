"""What a training step costs beyond the model: a bare loop, the Trainer, and the Trainer fed by the loader.

On the default experiment's model and batch (``experiments/default.yaml``, method ``--method``), one
run times, alternating between them round by round:

- (a) **bare**: ``method.training_step`` + backward + AdamW step in a plain loop, on batches held
  in memory (no loader); inside it, the loss's forward + backward on that step's projections, for
  X-CLR and for NT-Xent, as a share of the whole step;
- (b) **trainer**: :class:`~repsim.methods.trainer.Trainer` on the same in-memory batches (learning-rate
  schedule, scalars, the stage's ``metrics.jsonl`` logger, progress bar);
- (c) **loader-fed**: the Trainer on the train stage's real shard loader, with the time spent
  waiting for each batch measured apart.

Each round runs one epoch (or ``--steps``) of each, a different variant first each round; the table
gives the median step time over the rounds, the ratios trainer/bare and loader-fed/bare (1 is a
step at the model's speed) and the share of loader-fed time spent waiting for data. Threads and
workers follow the train stage's defaults (:func:`repsim.device.cpu_plan`) unless ``--set`` changes them. Written to
``benchmarks/results/train_step.md``.

    python benchmarks/train_step.py [--method xclr] [--rounds 3] [--set data.augment=sample ...]
    python benchmarks/train_step.py --set model.backbone=resnet50 --set data.image_size=224 \\
        --set optim.precision=bf16 --set optim.channels_last=true --set optim.compile=true   # a GPU
"""

from __future__ import annotations

import argparse
import copy
import platform
import shlex
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from _report import markdown, median_seconds, synchronise, write_report
from repsim.device import cpu_plan, resolve_device, torch_threads
from repsim.experiment import load_experiment
from repsim.losses import NTXentLoss, XCLRLoss
from repsim.methods.config import Config, load_config
from repsim.methods.base import Method, method_spec
from repsim.methods.stage import JsonlMetrics, prepare, train_loader
from repsim.methods.trainer import Batch, Trainer, autocast, autocast_dtype, to_device

REPO = Path(__file__).resolve().parents[1]
EXPERIMENT = REPO / "experiments" / "default.yaml"
RESULTS = Path(__file__).parent / "results" / "train_step.md"


def experiment_config(path: Path, label: str, overrides: list[str]) -> Config:
    """The train config of method ``label`` in the experiment at ``path``, with ``overrides``."""
    experiment = load_experiment(path)
    section = experiment.section("train")
    run = next((run for run in section.methods if run.label == label), None)
    if run is None:
        sys.exit(f"error: {path} trains no method {label!r}; choose one of {[r.label for r in section.methods]}")
    return load_config(run.config, [*section.overrides(run, experiment.data), *overrides])


class InMemoryLoader:
    """The loader interface the Trainer uses (``len``, ``batch_size``, ``set_epoch``, iteration) over
    batches held in memory, ``steps`` per epoch, cycling through them."""

    def __init__(self, batches: list[Batch], steps: int):
        self.batches, self.steps = batches, steps
        self.batch_size = len(batches[0]["index"])

    def __len__(self) -> int:
        return self.steps

    def set_epoch(self, epoch: int) -> None:
        pass

    def __iter__(self) -> Iterator[Batch]:
        return (self.batches[step % len(self.batches)] for step in range(self.steps))


class WaitTimedLoader:
    """A loader of at most ``steps`` batches a pass whose iteration adds the seconds spent waiting for
    each batch to ``waited``."""

    def __init__(self, loader, steps: int):
        self.loader, self.steps, self.waited = loader, steps, 0.0
        self.batch_size = loader.batch_size

    def __len__(self) -> int:
        return min(self.steps, len(self.loader))

    def set_epoch(self, epoch: int) -> None:
        self.loader.set_epoch(epoch)

    def __iter__(self) -> Iterator[Batch]:
        batches = iter(self.loader)
        while True:
            started = time.perf_counter()
            batch = next(batches, None)
            self.waited += time.perf_counter() - started
            if batch is None:
                return
            yield batch


@dataclass
class Variant:
    """One way of training the same method; ``run()`` trains one epoch and returns (seconds, steps, waited)."""

    name: str
    run: Callable[[], tuple[float, int, float]]


def bare(method: Method, config: Config, batches: list[Batch], steps: int, device: torch.device) -> Variant:
    """The plain loop a user would write, in the Trainer's precision, memory layout and compilation."""
    settings = config.optim
    if settings.channels_last:
        method = method.to(memory_format=torch.channels_last)
    if settings.compile:
        method.encoder.compile()
    optimizer = torch.optim.AdamW(method.parameters(), lr=settings.lr, weight_decay=settings.weight_decay)
    dtype = autocast_dtype(settings.precision, device)

    def run() -> tuple[float, int, float]:
        started = time.perf_counter()
        for step in range(steps):
            optimizer.zero_grad(set_to_none=True)
            with autocast(device, dtype):
                loss = method.training_step(batches[step % len(batches)])["loss"]
            loss.backward()
            optimizer.step()
        synchronise(device)
        return time.perf_counter() - started, steps, 0.0
    return Variant("(a) bare loop", run)


def trainer(name: str, method: Method, config: Config, loader, steps: int, scratch: Path,
            device: torch.device) -> Variant:
    """The Trainer for one epoch of ``steps`` over ``loader`` per run, logging as the train stage does."""
    settings = config.optim.model_copy(update={"epochs": 1})
    timed = WaitTimedLoader(loader, steps)

    def run() -> tuple[float, int, float]:
        log = JsonlMetrics(scratch / f"{time.monotonic_ns()}.jsonl")
        fit = Trainer(method, settings, timed, log=log, device=device)
        timed.waited = 0.0
        started = time.perf_counter()
        fit.fit()
        synchronise(device)
        return time.perf_counter() - started, fit.steps_per_epoch, timed.waited
    return Variant(name, run)


def loss_shares(method: Method, batches: list[Batch], repeats: int) -> dict[str, float]:
    """Median seconds of X-CLR's and NT-Xent's forward + backward on the projections of ``batches``."""
    with torch.no_grad():
        z1, z2 = method.project_views(batches[0])
        similarity = method.source(batches[0]["index"], batches[0]["label"])
    temperature = method.loss.temperature
    xclr, ntxent = XCLRLoss(temperature, method.loss.target_temperature), NTXentLoss(temperature)

    def step(loss, *extra) -> Callable[[], None]:
        def run() -> None:
            a, b = z1.detach().requires_grad_(), z2.detach().requires_grad_()
            loss(a, b, *extra).backward()
        return run
    return median_seconds({"xclr": step(xclr, similarity), "ntxent": step(ntxent)}, z1.device, 3, repeats)


def measure(config: Config, rounds: int, held: int, steps: int | None,
            scratch: Path) -> tuple[dict[str, list[tuple[float, int, float]]], dict]:
    device = resolve_device()
    data, _ = prepare(config)
    plan = cpu_plan(device, config.optim.num_workers, config.optim.threads)
    torch.manual_seed(config.optim.seed)
    base = method_spec(config.method.name).build(config, data).to(device)
    loader = train_loader(config, data, device, plan.workers)
    batches = [to_device(batch, device, config.optim.channels_last) for _, batch in zip(range(held), loader)]
    steps = min(steps or len(loader), len(loader))
    variants = [bare(copy.deepcopy(base), config, batches, steps, device),
                trainer("(b) Trainer, in-memory batches", copy.deepcopy(base), config,
                        InMemoryLoader(batches, steps), steps, scratch, device),
                trainer("(c) Trainer, shard loader", copy.deepcopy(base), config, loader, steps, scratch, device)]
    results: dict[str, list[tuple[float, int, float]]] = {variant.name: [] for variant in variants}
    with torch_threads(plan.threads):
        for variant in variants:  # warm-up: one untimed epoch each
            variant.run()
        for round_number in range(rounds):
            shift = round_number % len(variants)  # each variant leads a round in turn
            for variant in variants[shift:] + variants[:shift]:
                results[variant.name].append(variant.run())
                seconds, count, waited = results[variant.name][-1]
                print(f"round {round_number + 1} {variant.name}: {seconds / count * 1e3:.0f} ms/step, "
                      f"waiting {waited / seconds:.1%}", flush=True)
        losses = loss_shares(base, batches, 10) if config.method.name == "xclr" else {}
    context = {"plan": plan, "device": device, "steps": steps, "batch": config.optim.batch_size}
    return results, {**context, "losses": losses}


def report(command: str, config: Config, results: dict[str, list[tuple[float, int, float]]], context: dict) -> str:
    step_ms = {name: statistics.median(seconds / steps for seconds, steps, _ in runs) * 1e3
               for name, runs in results.items()}
    waits = {name: statistics.median(waited / seconds for seconds, _, waited in runs) for name, runs in results.items()}
    bare_ms = next(iter(step_ms.values()))
    rows = [[name, f"{ms:,.0f}", f"{context['batch'] * 1e3 / ms:,.0f}", f"{bare_ms / ms:.2f}", f"{waits[name]:.1%}"]
            for name, ms in step_ms.items()]
    plan, losses = context["plan"], context["losses"]
    lines = [
        "# Training step: bare loop, Trainer, loader-fed", "", f"Command: `{command}`", "",
        (f"Method {config.method.name} ({config.model.backbone}, small_images={config.model.small_images}, "
         f"batch {context['batch']}, {context['steps']} steps an epoch, augment={config.data.augment}); "
         f"device {context['device']}, torch {torch.__version__}, {plan.threads} torch threads, "
         f"{plan.workers} loader workers, {platform.machine()}. Median step time over the rounds, one epoch "
         "per variant per round, the variants alternated (each leads a round in turn), after one warm-up epoch each."), "",
        markdown(["variant", "ms/step", "images/s", "bare / variant", "waiting for data"], rows), "",
    ]
    if losses:
        share = {name: seconds * 1e3 / bare_ms for name, seconds in losses.items()}
        lines += [(f"Loss forward + backward on the step's projections: X-CLR {losses['xclr'] * 1e3:.2f} ms "
                   f"({share['xclr']:.2%} of the bare step), NT-Xent {losses['ntxent'] * 1e3:.2f} ms "
                   f"({share['ntxent']:.2%}); X-CLR's extra cost is {share['xclr'] - share['ntxent']:.2%} of a step."),
                  ""]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--experiment", type=Path, default=EXPERIMENT)
    parser.add_argument("--method", default="xclr", help="the label of a method in the experiment's train section")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--held", type=int, default=8, help="batches held in memory for (a) and (b)")
    parser.add_argument("--steps", type=int, help="steps per epoch (default: the loader's whole epoch)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    config = experiment_config(args.experiment, args.method, args.overrides)
    with tempfile.TemporaryDirectory(prefix="train_step-") as scratch:  # the Trainer's metrics.jsonl files
        results, context = measure(config, args.rounds, args.held, args.steps, Path(scratch))
    text = report(shlex.join(["python", "benchmarks/train_step.py", *sys.argv[1:]]), config, results, context)
    write_report(args.out, text)
    print(text)


if __name__ == "__main__":
    main()
