"""The shared Trainer: any :class:`~repsim.methods.base.Method` on a shard loader, with AdamW or LARS, warm-up + cosine,
mixed precision, checkpoints with exact resume, an online kNN monitor and DDP (rank 0 alone writes, logs and monitors).

Exact resume: a checkpoint holds the model, optimizer, progress and RNG states; the loader replays an epoch
identically, so a resumed run skips the consumed batches and takes the same steps as an uninterrupted one.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import random
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from itertools import islice
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from tqdm.auto import tqdm

from repsim import stopping
from repsim.data.batch_augment import DEFAULT_GENERATORS
from repsim.data.loader import Batch, ShardLoader
from repsim.device import distributed, rank_and_world, resolve_device
from repsim.errors import RepsimError, first_line
from repsim.eval.knn import knn_accuracy
from repsim.methods.base import Method
from repsim.methods.config import OptimConfig

LogFn = Callable[[dict[str, float], int], None]
CHECKPOINT_FIELDS = frozenset({"model", "optimizer", "step", "epoch", "position", "steps_per_epoch", "rng"})
log = logging.getLogger(__name__)


class TrainingError(RepsimError):
    """Training cannot go on: the loss diverged, or the data gives no full batch."""


# ---------------------------------------------------------------------------------------------
# Optimisers and schedule

class LARS(torch.optim.Optimizer):
    """SGD with momentum and layer-wise adaptive rate scaling (You et al., 2017), as in SimCLR/BYOL.

    Per tensor p with gradient g: ``u = g + weight_decay · p`` scaled by ``trust_coefficient · ‖p‖ / ‖u‖``
    (1 when either norm is 0); ``m ← momentum · m + u``; ``p ← p − lr · m``. Groups with
    ``lars_exclude=True`` (biases, normalisation weights) skip the decay and the scaling.
    """

    def __init__(self, params: Iterable, lr: float, momentum: float = 0.9, weight_decay: float = 0.0,
                 trust_coefficient: float = 1e-3, lars_exclude: bool = False):
        defaults = {"lr": lr, "momentum": momentum, "weight_decay": weight_decay,
                    "trust_coefficient": trust_coefficient, "lars_exclude": lars_exclude}
        super().__init__(params, defaults)

    @torch.no_grad()
    def step(self, closure: Callable[[], torch.Tensor] | None = None) -> torch.Tensor | None:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            for param in group["params"]:
                if param.grad is None:
                    continue
                update = param.grad
                if not group["lars_exclude"]:
                    update = update.add(param, alpha=group["weight_decay"])
                    param_norm, update_norm = param.norm(), update.norm()
                    trust = group["trust_coefficient"] * param_norm / update_norm
                    update = update * torch.where((param_norm > 0) & (update_norm > 0), trust, 1.0)
                state = self.state[param]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = torch.zeros_like(param)
                param.add_(state["momentum_buffer"].mul_(group["momentum"]).add_(update), alpha=-group["lr"])
        return loss


def parameter_groups(module: nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """Trainable parameters in two groups: weights (decayed, LARS-adapted) and 0-/1-d tensors (neither)."""
    trainable = [param for param in module.parameters() if param.requires_grad]
    groups = [{"params": [p for p in trainable if p.ndim > 1], "weight_decay": weight_decay, "lars_exclude": False},
              {"params": [p for p in trainable if p.ndim <= 1], "weight_decay": 0.0, "lars_exclude": True}]
    return [group for group in groups if group["params"]]


def make_optimizer(module: nn.Module, settings: OptimConfig) -> torch.optim.Optimizer:
    """AdamW or LARS over ``module``'s trainable parameters (see :func:`parameter_groups`)."""
    groups = parameter_groups(module, settings.weight_decay)
    if settings.optimizer == "lars":
        return LARS(groups, lr=settings.lr, momentum=settings.momentum, trust_coefficient=settings.trust_coefficient)
    return torch.optim.AdamW(groups, lr=settings.lr)


def warmup_cosine(step: int, warmup_steps: int, total_steps: int) -> float:
    """The learning-rate factor of 0-based ``step``: linear warm-up to 1 over ``warmup_steps`` steps
    ((step + 1) / warmup_steps), then a cosine decay reaching 0 at ``total_steps``."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    progress = (step - warmup_steps) / max(1, total_steps - warmup_steps)
    return 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))


# ---------------------------------------------------------------------------------------------
# Devices, precision, distribution

def init_distributed(backend: str | None = None) -> tuple[int, int]:
    """Join the process group torchrun describes (``WORLD_SIZE`` > 1; ``backend`` NCCL, one GPU per local
    rank, when CUDA is present, else gloo). Returns (rank, world size); (0, 1) for a single process."""
    if not (dist.is_available() and dist.is_initialized()) and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
        if backend == "nccl":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group(backend)
    return rank_and_world()


def is_main_process() -> bool:
    return not distributed() or dist.get_rank() == 0


def autocast_dtype(precision: str, device: torch.device) -> torch.dtype | None:
    """bfloat16 for ``bf16``, and for ``auto`` on a GPU that supports it; None (float32) otherwise."""
    bf16 = precision == "bf16" or (precision == "auto" and device.type == "cuda" and torch.cuda.is_bf16_supported())
    return torch.bfloat16 if bf16 else None


def autocast(device: torch.device, dtype: torch.dtype | None) -> contextlib.AbstractContextManager:
    return torch.autocast(device.type, dtype=dtype) if dtype is not None else contextlib.nullcontext()


def seed_everything(seed: int) -> None:
    """Seed python, numpy and torch (every device)."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


@contextlib.contextmanager
def seeded(seed: int) -> Iterator[None]:
    """:func:`seed_everything`, then the block (a model's initialisation) holding :data:`DEFAULT_GENERATORS`:
    its draws come from ``seed`` alone, whatever stages run on other threads of the process."""
    with DEFAULT_GENERATORS:
        seed_everything(seed)
        yield


def to_device(batch: Batch, device: torch.device, channels_last: bool = False) -> Batch:
    """The batch's tensors (and lists of tensors) on ``device``; 4-d views in channels-last if asked."""
    def move(value: Any) -> Any:
        if isinstance(value, list):
            return [move(item) for item in value]
        if not isinstance(value, torch.Tensor):
            return value
        value = value.to(device, non_blocking=True)
        return value.contiguous(memory_format=torch.channels_last) if channels_last and value.ndim == 4 else value
    return {key: move(value) for key, value in batch.items()}


# ---------------------------------------------------------------------------------------------
# Features and the kNN monitor

@torch.no_grad()
def embed_batches(encoder: nn.Module, loader: Iterable[Batch], device: torch.device,
                  dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(features (N, F) float32 on the CPU, labels (N,)) of the first view of every batch, in eval mode."""
    was_training = encoder.training
    encoder.eval()
    features, labels = [], []
    try:
        for batch in loader:
            with autocast(device, dtype):
                features.append(encoder(batch["views"][0].to(device, non_blocking=True)).float().cpu())
            labels.append(batch["label"])
    finally:
        encoder.train(was_training)
    return torch.cat(features), torch.cat(labels)


@dataclass
class KnnMonitor:
    """Weighted kNN accuracy (``knn_top1_k{k}``, ``knn_top5_k{k}``) of ``test`` samples voted by ``train``
    samples; both loaders use the eval preset without shuffling."""

    train: Iterable[Batch]
    test: Iterable[Batch]
    k: int = 20

    def __call__(self, encoder: nn.Module, device: torch.device, dtype: torch.dtype | None = None) -> dict[str, float]:
        train_x, train_y = embed_batches(encoder, self.train, device, dtype)
        test_x, test_y = embed_batches(encoder, self.test, device, dtype)
        return knn_accuracy(train_x, train_y, test_x, test_y, k=min(self.k, len(train_x)), device=device)


# ---------------------------------------------------------------------------------------------
# Checkpoints

@dataclass
class Progress:
    """Where training stands: optimizer steps taken, the current epoch and batches consumed in it."""

    step: int = 0
    epoch: int = 0
    position: int = 0


def rng_states() -> dict[str, Any]:
    """The python, numpy, torch and CUDA RNG states, loadable with ``torch.load(weights_only=True)``."""
    name, keys, position, has_gauss, cached = np.random.get_state()
    states = {"python": random.getstate(), "numpy": (name, torch.from_numpy(keys.astype(np.int64)), position,
                                                     has_gauss, cached), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        states["cuda"] = torch.cuda.get_rng_state_all()
    return states


def set_rng_states(states: dict[str, Any]) -> None:
    random.setstate(states["python"])
    name, keys, position, has_gauss, cached = states["numpy"]
    np.random.set_state((name, keys.numpy().astype(np.uint32), position, has_gauss, cached))
    torch.set_rng_state(states["torch"])
    if "cuda" in states and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(states["cuda"])


def save_atomically(payload: dict[str, Any], path: Path) -> None:
    """``torch.save`` to a temporary file, flushed to disk, then renamed over ``path`` (the file it replaces
    kept as :func:`previous_of` ``path``): a crash never leaves half a file there."""
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f".{path.name}.partial")
    try:
        with open(partial, "wb") as handle:
            torch.save(payload, handle)
            handle.flush()
            os.fsync(handle.fileno())
    except BaseException:
        partial.unlink(missing_ok=True)  # gives back the space a full disk needs
        raise
    if path.exists():
        os.replace(path, previous_of(path))
    os.replace(partial, path)
    folder = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(folder)  # the renames reach the disk too
    finally:
        os.close(folder)


def previous_of(path: Path) -> Path:
    """Where :func:`save_atomically` keeps the file that the last save replaced."""
    return path.with_name(f"{path.name}.previous")


def read_checkpoint(path: Path) -> tuple[dict[str, Any] | None, str | None]:
    """(the trainer checkpoint at ``path``, None), or (None, why) when it does not load or lacks a trainer's
    fields; such a file is moved aside to ``<name>.unreadable``."""
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
        missing = CHECKPOINT_FIELDS - state.keys() if isinstance(state, dict) else CHECKPOINT_FIELDS
        if missing:
            raise ValueError(f"it has no {', '.join(sorted(missing))}")
        return state, None
    except PermissionError:
        raise
    except Exception as err:  # torch.load fails on a damaged file with errors of many types (OSError, IndexError, ...)
        os.replace(path, path.with_name(f"{path.name}.unreadable"))
        return None, first_line(err)


# ---------------------------------------------------------------------------------------------
# The Trainer

class Trainer:
    """Train ``method`` on ``loader`` for ``settings.epochs`` epochs, or ``settings.max_steps`` steps if fewer.

    Checkpoints go to ``checkpoint_path`` every ``settings.checkpoint_every`` steps and at the end, and
    are resumed from. ``log(metrics, step)`` (rank 0) gets per-step ``loss``, ``lr`` and the method's
    scalars, and per-epoch ``epoch`` and kNN accuracies.
    """

    def __init__(self, method: Method, settings: OptimConfig, loader: ShardLoader, *,
                 monitor: KnnMonitor | None = None, checkpoint_path: Path | None = None,
                 log: LogFn | None = None, device: str | torch.device | None = None, progress: bool = True):
        self.settings, self.loader, self.monitor = settings, loader, monitor
        self.checkpoint_path, self.show_progress = checkpoint_path, progress
        self.log = log if log is not None and is_main_process() else lambda metrics, step: None
        self.device = resolve_device(device)
        if self.device.type == "cuda" and self.device.index is None:  # DistributedDataParallel needs the index
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.dtype = autocast_dtype(settings.precision, self.device)
        self.method = method.to(self.device)
        if settings.channels_last:
            self.method = self.method.to(memory_format=torch.channels_last)
        if settings.compile:
            self.method.encoder.compile()
        self.model = self.method
        if distributed():
            device_ids = [self.device.index] if self.device.type == "cuda" else None
            self.model = DistributedDataParallel(self.method, device_ids=device_ids)
        self.optimizer = make_optimizer(self.method, settings)
        self.steps_per_epoch = len(loader)
        if self.steps_per_epoch == 0:
            raise TrainingError(f"the training split gives no full batch of {loader.batch_size} per rank",
                                "lower optim.batch_size or train on more samples")
        self.total_steps = min(settings.epochs * self.steps_per_epoch,
                               math.inf if settings.max_steps is None else settings.max_steps)
        self.warmup_steps = round(settings.warmup_epochs * self.steps_per_epoch)
        self.saved_step: int | None = None  # the step of the checkpoint last written or resumed from

    def fit(self) -> Progress:
        """Train to the end (resuming from the checkpoint if there is one); returns the final progress."""
        progress, every = self._resume(), self.settings.checkpoint_every
        self.saved_step = progress.step or None
        with tqdm(total=self.total_steps, initial=progress.step, desc="train", unit="step",
                  disable=not (self.show_progress and is_main_process())) as bar, self._noted(progress):
            while progress.epoch < self.settings.epochs and progress.step < self.total_steps:
                for batch in self._remaining_batches(progress):
                    loss = self._step(batch, progress)
                    bar.update()
                    bar.set_postfix(loss=f"{loss:.4f}", epoch=progress.epoch)
                    if progress.position == self.steps_per_epoch or progress.step == self.total_steps:
                        self._end_epoch(progress)
                    if stopping.requested():
                        self._save(progress)
                        raise stopping.stopped(f"at step {progress.step} of {self.total_steps}, its checkpoint written")
                    if every > 0 and progress.step % every == 0 and progress.step < self.total_steps:
                        self._save(progress)
                    stopping.training_at(progress.step, self.total_steps, self.saved_step)
        if distributed():  # every rank ends with rank 0's buffers (e.g. BatchNorm statistics), as DDP gives them
            for buffer in self.method.buffers():
                dist.broadcast(buffer, src=0)
        self._save(progress)
        return progress

    @contextlib.contextmanager
    def _noted(self, progress: Progress) -> Iterator[None]:
        """Where the training is, noted for the line of a stop that cannot wait for the step to end."""
        stopping.training_at(progress.step, self.total_steps, self.saved_step)
        try:
            yield
        finally:
            stopping.training_ended()

    def _remaining_batches(self, progress: Progress) -> Iterator[Batch]:
        """This epoch's batches after the ``position`` already consumed, up to its end or the last step."""
        self.loader.set_epoch(progress.epoch)
        stop = min(self.steps_per_epoch, progress.position + self.total_steps - progress.step)
        yield from islice(self.loader, progress.position, stop)
        if stop == self.steps_per_epoch:
            progress.epoch, progress.position = progress.epoch + 1, 0

    def _step(self, batch: Batch, progress: Progress) -> float:
        lr = self.settings.lr * warmup_cosine(progress.step, self.warmup_steps, self.total_steps)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        with autocast(self.device, self.dtype):
            outputs = self.model(to_device(batch, self.device, self.settings.channels_last))
        scalars = _mean_over_ranks({name: value.detach().float() for name, value in outputs.items()})
        if not math.isfinite(scalars["loss"]):
            raise TrainingError(f"the loss is {scalars['loss']} at step {progress.step + 1}",
                                "lower optim.lr, set optim.grad_clip, or train in fp32")
        self.optimizer.zero_grad(set_to_none=True)
        outputs["loss"].backward()
        if self.settings.grad_clip is not None:
            nn.utils.clip_grad_norm_(self.method.parameters(), self.settings.grad_clip)
        self.method.before_optimizer_step(progress.step, self.total_steps)
        self.optimizer.step()
        progress.step += 1
        progress.position += 1
        self.method.after_optimizer_step(progress.step, self.total_steps)
        self.log({**scalars, "lr": lr}, progress.step)
        return scalars["loss"]

    def _end_epoch(self, progress: Progress) -> None:
        """Log the finished epoch, or the part of it that ends the training (``epoch`` 1.5: half of the second),
        with the kNN monitor and the method's epoch metrics (rank 0; the others wait)."""
        epoch = progress.epoch + progress.position / self.steps_per_epoch
        metrics = {"epoch": int(epoch) if epoch.is_integer() else round(epoch, 4)}
        if is_main_process():
            if self.monitor is not None:
                metrics |= {f"{prefix}{name}": value for prefix, encoder in self.method.monitored_encoders().items()
                            for name, value in self.monitor(encoder, self.device, self.dtype).items()}
            metrics |= self.method.epoch_metrics()
        if distributed():
            dist.barrier()
        self.log(metrics, progress.step)

    def _save(self, progress: Progress) -> None:
        if self.checkpoint_path is None or not is_main_process():
            return
        epoch, position = progress.epoch, progress.position
        if position == self.steps_per_epoch:  # the epoch is done: resume at the next one
            epoch, position = epoch + 1, 0
        save_atomically({"model": self.method.state_dict(), "optimizer": self.optimizer.state_dict(),
                         "step": progress.step, "epoch": epoch, "position": position,
                         "steps_per_epoch": self.steps_per_epoch, "rng": rng_states()}, self.checkpoint_path)
        self.saved_step = progress.step

    def _resume(self) -> Progress:
        """Progress from the checkpoint, else the one it replaced, else the start (unloadable ones set aside)."""
        if self.checkpoint_path is None:
            return Progress()
        unreadable, state = [], None
        for path in (self.checkpoint_path, previous_of(self.checkpoint_path)):
            state, why = read_checkpoint(path) if path.is_file() else (None, None)
            if why is not None:
                unreadable.append(f"{path} ({why})")
            if state is not None:
                break
        if unreadable:
            log.warning("checkpoint %s does not load and is set aside as .unreadable; training resumes from %s",
                        "; ".join(unreadable), f"{path.name} (step {state['step']})" if state else "the start")
        if state is None:
            return Progress()
        if state["steps_per_epoch"] != self.steps_per_epoch:
            raise TrainingError(f"{path} was written with {state['steps_per_epoch']} steps per "
                                f"epoch, this run has {self.steps_per_epoch}",
                                "resume with the same data, batch size and number of ranks, or delete it")
        self.method.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        set_rng_states(state["rng"])
        return Progress(state["step"], state["epoch"], state["position"])


def _mean_over_ranks(values: dict[str, torch.Tensor]) -> dict[str, float]:
    """Each scalar averaged over the DDP ranks (one all-reduce), as python floats."""
    stacked = torch.stack([value.reshape(()) for value in values.values()])
    if distributed():
        dist.all_reduce(stacked)
        stacked /= dist.get_world_size()
    return dict(zip(values, stacked.tolist()))
