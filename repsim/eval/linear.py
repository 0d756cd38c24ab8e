"""Linear probe: multinomial logistic regression on frozen, standardised features.

Features are standardised with the mean and std of the training rows. The model minimises
``mean cross-entropy + weight_decay / 2 · ‖W‖²`` (bias not penalised), which is scikit-learn's
``LogisticRegression`` objective with ``C = 1 / (weight_decay · n_samples)``. The weight decay is
chosen on a seeded, stratified held-out slice of the training set (ties go to the larger decay),
then the model is refit on all training rows.

Solvers: full-batch L-BFGS on the device when the standardised training set and its logits fit in
``FULL_BATCH_BYTES`` (or a quarter of the GPU's memory, if larger), else minibatch Adam on the same
objective (``solver`` forces either).

:func:`linear_probe` returns fractions in [0, 1]: ``linear_top1``, ``linear_top5``,
``linear_weight_decay`` (the chosen one) and ``linear_val_top1_wd{wd:g}`` per candidate decay
(absent when a single decay is given, since nothing is chosen).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from repsim.errors import EvalError
from repsim._checks import (ArrayLike, as_features, as_labels, check_same_width,
                                 check_several_classes, count_classes, resolve_device)
from repsim.eval.knn import top_k_accuracy

DEFAULT_WEIGHT_DECAYS = (1e-6, 1e-5, 1e-4, 1e-3, 1e-2, 1e-1)
FULL_BATCH_BYTES = 8 * 2**30
PREDICT_CHUNK = 8192
STATS_CHUNK = 65536
ADAM_LR = 1e-2

Parameters = tuple[torch.Tensor, torch.Tensor]  # weight (D, C), bias (C,)


def stratified_split(labels: ArrayLike, fraction: float, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Sorted row indices (kept, held_out): each class holds out round(fraction · its size) rows.

    Each class is permuted with ``numpy.random.default_rng(seed)``; a class never gives up all of
    its rows, so a class with one row stays wholly in ``kept``.
    """
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
class _Solver:
    """Fits the penalised softmax regression on (N, D) features; ``kind`` is "lbfgs" or "adam"."""

    kind: str
    device: torch.device
    max_iter: int
    epochs: int
    batch_size: int
    seed: int

    def fit(self, features: torch.Tensor, labels: torch.Tensor, weight_decay: float, init: Parameters) -> Parameters:
        weight, bias = (p.detach().clone().to(self.device).requires_grad_() for p in init)
        if self.kind == "lbfgs":
            self._lbfgs(features.to(self.device), labels.to(self.device), weight_decay, weight, bias)
        else:
            self._adam(features, labels, weight_decay, weight, bias)
        return weight.detach(), bias.detach()

    def _lbfgs(self, features, labels, weight_decay, weight, bias) -> None:
        optimiser = torch.optim.LBFGS([weight, bias], lr=1, max_iter=self.max_iter, history_size=10,
                                      tolerance_grad=1e-6, tolerance_change=1e-10, line_search_fn="strong_wolfe")

        def closure() -> torch.Tensor:
            optimiser.zero_grad()
            loss = _objective(features, labels, weight, bias, weight_decay)
            loss.backward()
            return loss

        optimiser.step(closure)

    def _adam(self, features, labels, weight_decay, weight, bias) -> None:
        steps_per_epoch = -(-len(features) // self.batch_size)
        optimiser = torch.optim.Adam([weight, bias], lr=ADAM_LR)
        schedule = torch.optim.lr_scheduler.CosineAnnealingLR(optimiser, T_max=self.epochs * steps_per_epoch)
        generator = torch.Generator().manual_seed(self.seed)
        for _ in range(self.epochs):
            for rows in torch.randperm(len(features), generator=generator).split(self.batch_size):
                optimiser.zero_grad()
                batch = features[rows].to(self.device), labels[rows].to(self.device)
                _objective(*batch, weight, bias, weight_decay).backward()
                optimiser.step()
                schedule.step()


def _objective(features, labels, weight, bias, weight_decay) -> torch.Tensor:
    return F.cross_entropy(features @ weight + bias, labels) + 0.5 * weight_decay * weight.square().sum()


def linear_probe(train_x: ArrayLike, train_y: ArrayLike, test_x: ArrayLike, test_y: ArrayLike,
                 weight_decays: Sequence[float] = DEFAULT_WEIGHT_DECAYS, *, val_fraction: float = 0.1, seed: int = 0,
                 max_iter: int = 1000, epochs: int = 30, batch_size: int = 4096, solver: str = "auto",
                 num_classes: int | None = None, device: str | torch.device | None = None) -> dict[str, float]:
    """Train on (train_x (N, D), train_y (N,)), report top-1/top-5 on (test_x (M, D), test_y (M,)).

    ``max_iter`` bounds L-BFGS iterations per fit; ``epochs`` and ``batch_size`` configure Adam.
    """
    train_x, test_x = as_features(train_x, "train_x"), as_features(test_x, "test_x")
    check_same_width(train_x, "train_x", test_x, "test_x")
    train_y = as_labels(train_y, len(train_x), "train_y", "train_x")
    test_y = as_labels(test_y, len(test_x), "test_y", "test_x")
    check_several_classes(train_y, "train_y")
    decays = sorted({float(wd) for wd in weight_decays}, reverse=True)
    if not decays or decays[-1] < 0:
        raise EvalError(f"weight_decays={weight_decays!r} is empty or negative", "pass non-negative decays, e.g. (1e-4,)")
    num_classes = count_classes(train_y, num_classes, "train_y")
    train_x, test_x = _standardised(train_x, test_x)
    device = resolve_device(device)
    solver = _Solver(_solver_kind(solver, train_x.shape, num_classes, device), device, max_iter, epochs, batch_size, seed)
    if solver.kind == "lbfgs":  # full-batch: move the features once, not once per fit
        train_x = train_x.to(device)
    zeros = (torch.zeros(train_x.shape[1], num_classes), torch.zeros(num_classes))
    metrics: dict[str, float] = {}
    init = zeros
    if len(decays) > 1:
        val_accuracies, fitted = _validate(solver, train_x, train_y, decays, val_fraction, seed, zeros)
        metrics |= {f"linear_val_top1_wd{wd:g}": accuracy for wd, accuracy in val_accuracies.items()}
        decays = [max(val_accuracies, key=lambda wd: (val_accuracies[wd], wd))]
        init = fitted[decays[0]]
    parameters = solver.fit(train_x, train_y, decays[0], init)
    test_accuracy = top_k_accuracy(_rank_classes(test_x, parameters), test_y.numpy())
    return {"linear_top1": test_accuracy[1], "linear_top5": test_accuracy[5], "linear_weight_decay": decays[0]} | metrics


def _standardised(train: torch.Tensor, test: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Both as float32, shifted and scaled by the training mean and std; constant dims are only shifted."""
    chunks = train.split(STATS_CHUNK)
    mean = sum(chunk.double().sum(dim=0) for chunk in chunks) / len(train)
    std = (sum((chunk.double() - mean).square().sum(dim=0) for chunk in chunks) / len(train)).sqrt()
    std[std == 0] = 1
    mean, std = mean.float(), std.float()
    return (train.float() - mean) / std, (test.float() - mean) / std


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


def _validate(solver: _Solver, features: torch.Tensor, labels: torch.Tensor, decays: list[float],
              val_fraction: float, seed: int, init: Parameters) -> tuple[dict[float, float], dict[float, Parameters]]:
    """Held-out top-1 and parameters per decay, fitted from the largest decay down, each warm-started."""
    kept, held_out = stratified_split(labels.numpy(), val_fraction, seed)
    if len(held_out) == 0:
        raise EvalError(f"val_fraction={val_fraction} of {len(labels)} training rows holds out nothing",
                        "raise val_fraction or pass a single weight decay")
    accuracies, fitted = {}, {}
    for wd in decays:
        init = fitted[wd] = solver.fit(features[kept], labels[kept], wd, init)
        accuracies[wd] = top_k_accuracy(_rank_classes(features[held_out], init), labels[held_out].numpy(), (1,))[1]
    return accuracies, fitted


def _rank_classes(features: torch.Tensor, parameters: Parameters, top: int = 5) -> np.ndarray:
    """Class ids (N, min(top, C)) by descending logit, ties to the lower class id."""
    weight, bias = parameters
    ranked = []
    for chunk in features.split(PREDICT_CHUNK):
        logits = chunk.to(weight.device) @ weight + bias
        ranked.append(logits.sort(dim=1, descending=True, stable=True).indices[:, :top].cpu())
    return torch.cat(ranked).numpy()
