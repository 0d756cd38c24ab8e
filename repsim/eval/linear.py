"""Linear probe: multinomial logistic regression on frozen features standardised by the training rows,
minimising ``mean cross-entropy + weight_decay / 2 · ‖W‖²`` (scikit-learn's with ``C = 1 / (weight_decay ·
n_samples)``), the decay chosen on a seeded stratified held-out slice (ties to the larger). Full-batch
L-BFGS when features and logits fit in ``FULL_BATCH_BYTES`` (or a quarter of the GPU), else minibatch Adam.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace
from functools import partial

import numpy as np
import torch
import torch.nn.functional as F

from repsim.errors import EvalError
from repsim._checks import (ArrayLike, as_features, as_labels, check_same_width,
                                 check_several_classes, count_classes, resolve_device)
from repsim.eval.knn import ranked_classes, top_k_accuracy

DEFAULT_WEIGHT_DECAYS = (1e-6, 1e-5, 1e-4, 1e-3, 1e-2, 1e-1)
FULL_BATCH_BYTES = 8 * 2**30
CHUNK_ROWS = 65536
ADAM_LR = 1e-2

Parameters = tuple[torch.Tensor, torch.Tensor]  # weight (D, C), bias (C,)


def stratified_split(labels: ArrayLike, fraction: float, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Sorted row indices (kept, held_out): each class, permuted by ``default_rng(seed)``, holds out
    round(fraction · its size) rows but never all of them."""
    labels = np.asarray(labels)
    if not 0 < fraction < 1:
        raise EvalError(f"fraction={fraction} is outside (0, 1)", "pass a fraction such as 0.1")
    rng = np.random.default_rng(seed)
    held_out = []
    for label in np.unique(labels):
        members = rng.permutation(np.flatnonzero(labels == label))
        held_out.append(members[:min(round(fraction * len(members)), len(members) - 1)])
    held = np.sort(np.concatenate(held_out))
    return np.setdiff1d(np.arange(len(labels)), held), held


@dataclass(frozen=True)
class _Rows:
    """Some rows of features (N, D), possibly memory-mapped, read standardised by the training
    ``mean`` and ``std`` (D,) a chunk at a time: ``rows`` (R,) int64 positions in ``features`` (None: all)."""

    features: torch.Tensor
    labels: torch.Tensor
    mean: torch.Tensor
    std: torch.Tensor
    rows: torch.Tensor | None = None

    def __len__(self) -> int:
        return len(self.features) if self.rows is None else len(self.rows)

    def subset(self, positions: np.ndarray) -> _Rows:
        """The rows at ``positions`` (into this set), in that order."""
        positions = torch.as_tensor(positions, dtype=torch.long)
        return replace(self, rows=positions if self.rows is None else self.rows[positions])

    def take(self, start: int, stop: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Standardised float32 features (B, D) and labels (B,) of this set's rows ``start`` to ``stop``."""
        rows = slice(start, stop) if self.rows is None else self.rows[start:stop]
        return (self.features[rows].float() - self.mean) / self.std, self.labels[rows]

    def chunks(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """:meth:`take` of every :data:`CHUNK_ROWS` rows in turn."""
        for start in range(0, len(self), CHUNK_ROWS):
            yield self.take(start, start + CHUNK_ROWS)

    def on(self, device: torch.device) -> _Rows:
        """This set standardised whole on ``device`` (for a GPU that holds it), or itself on the CPU."""
        if device.type == "cpu":
            return self
        features, labels = self.take(0, len(self))
        zero, one = torch.zeros_like(self.mean), torch.ones_like(self.std)
        return _Rows(features.to(device), labels.to(device), zero.to(device), one.to(device))


Fit = Callable[[_Rows, float, Parameters], Parameters]  # (data, weight decay, initial parameters) -> fitted


def _fit(data: _Rows, weight_decay: float, init: Parameters, *, solver: str, device: torch.device, max_iter: int,
         epochs: int, batch_size: int, seed: int) -> Parameters:
    """The penalised softmax regression fitted on ``data`` from ``init``, by L-BFGS (``solver`` "lbfgs") or Adam."""
    weight, bias = (p.detach().clone().to(device).requires_grad_() for p in init)

    def cross_entropy(features: torch.Tensor, labels: torch.Tensor, reduction: str) -> torch.Tensor:
        return F.cross_entropy(features.to(device) @ weight + bias, labels.to(device), reduction=reduction)

    if solver == "lbfgs":
        optimiser = torch.optim.LBFGS([weight, bias], lr=1, max_iter=max_iter, history_size=10,
                                      tolerance_grad=1e-6, tolerance_change=1e-10, line_search_fn="strong_wolfe")

        def closure() -> torch.Tensor:
            """The objective over all rows, its gradient accumulated a chunk at a time."""
            optimiser.zero_grad()
            penalty = 0.5 * weight_decay * weight.square().sum()
            penalty.backward()
            total = penalty.detach()
            for features, labels in data.chunks():
                loss = cross_entropy(features, labels, "sum") / len(data)
                loss.backward()
                total = total + loss.detach()
            return total

        optimiser.step(closure)
        return weight.detach(), bias.detach()
    steps_per_epoch = -(-len(data) // batch_size)
    optimiser = torch.optim.Adam([weight, bias], lr=ADAM_LR)
    schedule = torch.optim.lr_scheduler.CosineAnnealingLR(optimiser, T_max=epochs * steps_per_epoch)
    generator = torch.Generator().manual_seed(seed)
    for _ in range(epochs):
        for positions in torch.randperm(len(data), generator=generator).split(batch_size):
            optimiser.zero_grad()
            features, labels = data.subset(positions).take(0, len(positions))
            (cross_entropy(features, labels, "mean") + 0.5 * weight_decay * weight.square().sum()).backward()
            optimiser.step()
            schedule.step()
    return weight.detach(), bias.detach()


def linear_probe(train_x: ArrayLike, train_y: ArrayLike, test_x: ArrayLike, test_y: ArrayLike,
                 weight_decays: Sequence[float] = DEFAULT_WEIGHT_DECAYS, *, val_fraction: float = 0.1, seed: int = 0,
                 max_iter: int = 1000, epochs: int = 30, batch_size: int = 4096, solver: str = "auto",
                 num_classes: int | None = None, device: str | torch.device | None = None) -> dict[str, float]:
    """Train on (train_x (N, D), train_y (N,)), score (test_x (M, D), test_y (M,)): ``linear_top1``,
    ``linear_top5``, ``linear_weight_decay`` (the chosen one) and, for several decays, ``linear_val_top1_wd{wd:g}``.
    ``max_iter`` bounds L-BFGS iterations per fit; ``epochs`` and ``batch_size`` configure Adam."""
    train_x, test_x = as_features(train_x, "train_x"), as_features(test_x, "test_x")
    check_same_width(train_x, "train_x", test_x, "test_x")
    train_y = as_labels(train_y, len(train_x), "train_y", "train_x")
    test_y = as_labels(test_y, len(test_x), "test_y", "test_x")
    check_several_classes(train_y, "train_y")
    decays = sorted({float(wd) for wd in weight_decays}, reverse=True)
    if not decays or decays[-1] < 0:
        raise EvalError(f"weight_decays={weight_decays!r} is empty or negative", "pass non-negative decays, e.g. (1e-4,)")
    num_classes = count_classes(train_y, num_classes, "train_y")
    mean, std = _moments(train_x)
    train, test = (_Rows(x, y, mean, std) for x, y in ((train_x, train_y), (test_x, test_y)))
    device = resolve_device(device)
    solver = _solver_kind(solver, train_x.shape, num_classes, device)
    fit = partial(_fit, solver=solver, device=device, max_iter=max_iter, epochs=epochs, batch_size=batch_size, seed=seed)
    if solver == "lbfgs":  # full-batch: on a GPU, move the features once, not once per fit
        train = train.on(device)
    init = (torch.zeros(train_x.shape[1], num_classes), torch.zeros(num_classes))
    metrics: dict[str, float] = {}
    if len(decays) > 1:
        val_accuracies, fitted = _validate(fit, train, decays, val_fraction, seed, init)
        metrics |= {f"linear_val_top1_wd{wd:g}": accuracy for wd, accuracy in val_accuracies.items()}
        decays = [max(val_accuracies, key=lambda wd: (val_accuracies[wd], wd))]
        init = fitted[decays[0]]
    parameters = fit(train, decays[0], init)
    test_accuracy = top_k_accuracy(_rank_classes(test, parameters), test_y.numpy())
    return {"linear_top1": test_accuracy[1], "linear_top5": test_accuracy[5], "linear_weight_decay": decays[0]} | metrics


def _moments(train: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The float32 mean and std (D,) of the training rows (N, D), summed in float64 a chunk at a time;
    a constant dimension's std is 1, so that it is only shifted."""
    chunks = train.split(CHUNK_ROWS)
    mean = sum(chunk.double().sum(dim=0) for chunk in chunks) / len(train)
    std = (sum((chunk.double() - mean).square().sum(dim=0) for chunk in chunks) / len(train)).sqrt()
    std[std == 0] = 1
    return mean.float(), std.float()


def _solver_kind(solver: str, shape: torch.Size, num_classes: int, device: torch.device) -> str:
    """L-BFGS when the features, logits and their gradient (float32) fit in the full-batch budget, else Adam."""
    if solver not in ("auto", "lbfgs", "adam"):
        raise EvalError(f"solver={solver!r} is unknown", "use 'auto', 'lbfgs' or 'adam'")
    if solver != "auto":
        return solver
    rows, dims = shape
    budget = FULL_BATCH_BYTES
    if device.type == "cuda":
        budget = max(budget, torch.cuda.get_device_properties(device).total_memory // 4)
    return "lbfgs" if 4 * rows * (dims + 2 * num_classes) <= budget else "adam"


def _validate(fit: Fit, train: _Rows, decays: list[float], val_fraction: float, seed: int,
              init: Parameters) -> tuple[dict[float, float], dict[float, Parameters]]:
    """Held-out top-1 and parameters per decay, fitted from the largest decay down, each warm-started."""
    labels = train.labels.cpu().numpy()
    kept, held_out = stratified_split(labels, val_fraction, seed)
    if len(held_out) == 0:
        raise EvalError(f"val_fraction={val_fraction} of {len(labels)} training rows holds out nothing",
                        "raise val_fraction or pass a single weight decay")
    accuracies, fitted = {}, {}
    for wd in decays:
        init = fitted[wd] = fit(train.subset(kept), wd, init)
        accuracies[wd] = top_k_accuracy(_rank_classes(train.subset(held_out), init), labels[held_out], (1,))[1]
    return accuracies, fitted


def _rank_classes(data: _Rows, parameters: Parameters, top: int = 5) -> np.ndarray:
    """Class ids (N, min(top, C)) by descending logit, ties to the lower class id."""
    weight, bias = parameters
    return np.concatenate([ranked_classes(features.to(weight.device) @ weight + bias, top) for features, _ in data.chunks()])
