"""The shared Trainer: schedule, LARS, exact resume, the kNN monitor, errors and DDP on CPU (gloo)."""

from __future__ import annotations

import json
import logging
import math
import signal
import os
import socket
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
from torch import nn

from repsim import stopping
from repsim.data.loader import make_loader
from repsim.data.stage import ShardResult, shard
from repsim.methods.config import OptimConfig
from repsim.methods.simclr import SimCLR
from repsim.methods.trainer import (LARS, KnnMonitor, Trainer, TrainingError, autocast_dtype, embed_batches,
                                  parameter_groups, previous_of, seed_everything, warmup_cosine)
from repsim.models import ProjectionMLP

SETTINGS = OptimConfig(batch_size=8, epochs=3, warmup_epochs=1, lr=0.05, checkpoint_every=2)
CPU = torch.device("cpu")
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


class Crash(Exception):
    """Stands for a process killed in the middle of training."""


@pytest.fixture
def tiny_shards(make_image_folder, write_spec, tmp_path) -> ShardResult:
    """40 grayscale 12×12 images of two classes: 32 train samples in 8 tars, 8 test samples."""
    folder = make_image_folder({"cat": 20, "dog": 20}, size=12)
    spec = write_spec({"name": "tiny", "source": {"type": "image_folder", "root": str(folder)},
                       "classes": {"cat": "cat.n.01", "dog": "dog.n.01"},
                       "split": {"type": "random", "fractions": {"train": 0.8, "test": 0.2}}, "shard_size": 4})
    return shard(spec, out_dir=tmp_path / "shards", progress=False)


def tiny_encoder() -> nn.Module:
    encoder = nn.Sequential(nn.Conv2d(1, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
                            nn.AdaptiveAvgPool2d(1), nn.Flatten())
    encoder.feature_dim = 8
    return encoder


def tiny_simclr() -> SimCLR:
    return SimCLR(tiny_encoder(), ProjectionMLP(8, 16, 8), temperature=0.5)


def knn_monitor(shards: ShardResult) -> KnnMonitor:
    loaders = (make_loader(shards.path, "eval", 16, split=split, shuffle=False, drop_last=False, rank=0,
                           world_size=1) for split in ("train", "test"))
    return KnnMonitor(*loaders, k=5)


# ---------------------------------------------------------------------------------------------
# Schedule and optimisers

def test_warmup_then_cosine_at_given_steps():
    factors = [warmup_cosine(step, warmup_steps=4, total_steps=12) for step in range(13)]
    assert factors[:4] == [0.25, 0.5, 0.75, 1.0]
    assert factors[4] == 1.0 and math.isclose(factors[8], 0.5) and factors[12] == 0.0
    assert math.isclose(factors[6], 0.5 * (1 + math.cos(math.pi * 2 / 8)))
    assert all(a >= b for a, b in zip(factors[4:], factors[5:]))
    assert warmup_cosine(0, warmup_steps=0, total_steps=10) == 1.0


def test_lars_update_equals_the_formula():
    weight = nn.Parameter(torch.tensor([[3.0, 4.0]]))  # norm 5
    bias = nn.Parameter(torch.tensor([1.0]))
    optimizer = LARS([{"params": [weight]}, {"params": [bias], "lars_exclude": True, "weight_decay": 0.0}],
                     lr=0.1, momentum=0.9, weight_decay=0.01, trust_coefficient=0.002)
    gradient, bias_gradient = torch.tensor([[0.6, 0.8]]), torch.tensor([0.5])
    expected_weight, buffer = weight.detach().clone(), torch.zeros(1, 2)
    expected_bias, bias_buffer = bias.detach().clone(), torch.zeros(1)
    for _ in range(2):
        weight.grad, bias.grad = gradient.clone(), bias_gradient.clone()
        optimizer.step()
        update = gradient + 0.01 * expected_weight
        update = update * 0.002 * expected_weight.norm() / update.norm()
        buffer = 0.9 * buffer + update
        expected_weight = expected_weight - 0.1 * buffer
        bias_buffer = 0.9 * bias_buffer + bias_gradient  # excluded: no decay, no trust ratio
        expected_bias = expected_bias - 0.1 * bias_buffer
        torch.testing.assert_close(weight.detach(), expected_weight)
        torch.testing.assert_close(bias.detach(), expected_bias)


def test_biases_and_norm_parameters_are_neither_decayed_nor_adapted():
    module = nn.Sequential(nn.Linear(4, 3), nn.BatchNorm1d(3))
    decayed, excluded = parameter_groups(module, weight_decay=0.1)
    assert decayed["params"] == [module[0].weight] and decayed["weight_decay"] == 0.1 and not decayed["lars_exclude"]
    assert excluded["params"] == [module[0].bias, module[1].weight, module[1].bias]
    assert excluded["weight_decay"] == 0.0 and excluded["lars_exclude"]


# ---------------------------------------------------------------------------------------------
# Training, resume, monitor

def run(shards: ShardResult, checkpoint: Path, crash_at: int | None = None, settings: OptimConfig = SETTINGS,
        device: torch.device = CPU) -> tuple[list[tuple[int, float]], list[dict], nn.Module]:
    """Train a tiny SimCLR; returns (step, loss) pairs, the per-epoch records and the method."""
    seed_everything(0)
    method = tiny_simclr()
    losses, epochs = [], []

    def log(metrics: dict[str, float], step: int) -> None:
        if "loss" in metrics:
            losses.append((step, metrics["loss"]))
        else:
            epochs.append({"step": step, **metrics})
        if step == crash_at:
            raise Crash
    loader = make_loader(shards.path, "simclr", settings.batch_size, seed=1)
    trainer = Trainer(method, settings, loader, monitor=knn_monitor(shards), checkpoint_path=checkpoint,
                      log=log, device=device, progress=False)
    try:
        trainer.fit()
    except Crash:
        pass
    return losses, epochs, method


def test_a_resumed_run_repeats_the_uninterrupted_run_exactly(tiny_shards, tmp_path):
    full, full_epochs, finished = run(tiny_shards, tmp_path / "full.pt")
    assert [step for step, _ in full] == list(range(1, 13))  # 3 epochs of 4 batches
    crashed, _, _ = run(tiny_shards, tmp_path / "interrupted.pt", crash_at=7)  # last checkpoint: step 6
    assert len(crashed) == 7
    resumed, resumed_epochs, recovered = run(tiny_shards, tmp_path / "interrupted.pt")
    assert crashed[:6] + resumed == full
    assert resumed_epochs == full_epochs[1:]  # epoch 1 ended before the checkpoint
    for (name, a), (_, b) in zip(finished.state_dict().items(), recovered.state_dict().items()):
        assert torch.equal(a, b), name


def test_a_stop_that_cannot_wait_names_the_step_and_the_checkpoint_the_rerun_resumes_from(tiny_shards, tmp_path):
    lines = []

    def log(metrics: dict[str, float], step: int) -> None:
        if step in (1, 7):  # inside the step: before any checkpoint, and after the one of step 6
            lines.append(stopping.forced_stop(signal.SIGTERM))
    Trainer(tiny_simclr(), SETTINGS, make_loader(tiny_shards.path, "simclr", SETTINGS.batch_size, seed=1),
            checkpoint_path=tmp_path / "run.pt", log=log, progress=False).fit()
    assert lines == ["stopped by SIGTERM in step 1 of 12, which did not end within 8 s; the same command starts "
                     "the training again (no checkpoint yet)",
                     "stopped by SIGTERM in step 7 of 12, which did not end within 8 s; the same command resumes "
                     "from its checkpoint of step 6"]
    assert stopping.forced_stop(signal.SIGTERM).startswith("stopped by SIGTERM before the stage it was in ended")


def test_max_steps_ends_training_mid_epoch_and_resumes_exactly(tiny_shards, tmp_path):
    settings = SETTINGS.model_copy(update={"max_steps": 6})  # 3 epochs of 4 batches, cut in the second
    full, epochs, finished = run(tiny_shards, tmp_path / "full.pt", settings=settings)
    assert [step for step, _ in full] == list(range(1, 7))
    assert [(record["step"], record["epoch"]) for record in epochs] == [(4, 1), (6, 1.5)]  # the cut epoch too
    assert all(0 <= record["knn_top1_k5"] <= 1 for record in epochs)
    crashed, _, _ = run(tiny_shards, tmp_path / "cut.pt", crash_at=5, settings=settings)  # last checkpoint: step 4
    resumed, _, recovered = run(tiny_shards, tmp_path / "cut.pt", settings=settings)
    assert crashed[:4] + resumed == full
    for (name, a), (_, b) in zip(finished.state_dict().items(), recovered.state_dict().items()):
        assert torch.equal(a, b), name
    trainer = Trainer(tiny_simclr(), settings, make_loader(tiny_shards.path, "simclr", 8), progress=False)
    assert trainer.total_steps == 6 and warmup_cosine(6, trainer.warmup_steps, trainer.total_steps) == 0


def test_the_monitor_logs_knn_accuracy_each_epoch(tiny_shards, tmp_path):
    losses, epochs, _ = run(tiny_shards, tmp_path / "run.pt")
    assert [record["epoch"] for record in epochs] == [1, 2, 3]
    assert [record["step"] for record in epochs] == [4, 8, 12]
    assert all(0 <= record["knn_top1_k5"] <= 1 and record["knn_top5_k5"] == 1.0 for record in epochs)


def test_bf16_autocast_runs_on_the_cpu_when_asked(tiny_shards, tmp_path):
    settings = SETTINGS.model_copy(update={"precision": "bf16", "epochs": 1})
    assert autocast_dtype("bf16", CPU) is torch.bfloat16
    losses, epochs, method = run(tiny_shards, tmp_path / "run.pt", settings=settings)
    assert len(losses) == 4 and all(math.isfinite(loss) for _, loss in losses)
    assert all(p.dtype == torch.float32 for p in method.parameters())  # weights stay float32


def test_a_finished_checkpoint_resumes_to_nothing(tiny_shards, tmp_path):
    run(tiny_shards, tmp_path / "run.pt")
    again, epochs, _ = run(tiny_shards, tmp_path / "run.pt")
    assert again == [] and epochs == []


def test_features_come_in_loader_order_in_eval_mode(tiny_shards):
    encoder = tiny_encoder().train()
    loader = make_loader(tiny_shards.path, "eval", 16, split="test", shuffle=False, drop_last=False)
    features, labels = embed_batches(encoder, loader, CPU)
    assert features.shape == (8, 8) and labels.tolist() == [y for batch in loader for y in batch["label"].tolist()]
    assert encoder.training
    torch.testing.assert_close(features, encoder.eval()(torch.cat([b["views"][0] for b in loader])))


def test_batches_larger_than_the_split_are_an_error(tiny_shards):
    loader = make_loader(tiny_shards.path, "simclr", 64)
    with pytest.raises(TrainingError, match="no full batch of 64.*lower optim.batch_size"):
        Trainer(tiny_simclr(), SETTINGS, loader, device=CPU, progress=False)


def test_a_diverging_loss_stops_training(tiny_shards):
    method = tiny_simclr()
    method.training_step = lambda batch: {"loss": torch.tensor(float("nan"), requires_grad=True)}
    trainer = Trainer(method, SETTINGS, make_loader(tiny_shards.path, "simclr", 8), device=CPU, progress=False)
    with pytest.raises(TrainingError, match="the loss is nan at step 1; lower optim.lr"):
        trainer.fit()


def test_resuming_with_another_batch_size_is_an_error(tiny_shards, tmp_path):
    run(tiny_shards, tmp_path / "run.pt", crash_at=3)
    settings = SETTINGS.model_copy(update={"batch_size": 16})
    with pytest.raises(TrainingError, match="written with 4 steps per epoch, this run has 2"):
        run(tiny_shards, tmp_path / "run.pt", settings=settings)


# ---------------------------------------------------------------------------------------------
# DDP on CPU

def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _ddp_rank(rank: int, world: int, port: int, shards_path: str, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    from repsim.methods.trainer import init_distributed

    assert init_distributed("gloo") == (rank, world)
    try:
        seed_everything(rank)  # different initial weights: DDP must start every rank from rank 0's
        method = tiny_simclr()
        loader = make_loader(shards_path, "simclr", 4, seed=1)  # this rank's half of a global batch of 8
        settings = SETTINGS.model_copy(update={"epochs": 2})
        steps = []
        Trainer(method, settings, loader, checkpoint_path=Path(out) / "checkpoint.pt", device=CPU,
                log=lambda metrics, step: steps.append(step) if "loss" in metrics else None, progress=False).fit()
        torch.save(method.state_dict(), Path(out) / f"rank{rank}.pt")
        (Path(out) / f"rank{rank}.json").write_text(json.dumps({"steps_logged": len(steps)}))
    finally:
        torch.distributed.destroy_process_group()


@pytest.mark.slow
def test_two_gloo_ranks_end_with_identical_weights(tiny_shards, tmp_path):
    mp.spawn(_ddp_rank, args=(2, free_port(), str(tiny_shards.path), str(tmp_path)), nprocs=2, join=True)
    weights = [torch.load(tmp_path / f"rank{rank}.pt", weights_only=True) for rank in range(2)]
    for name, value in weights[0].items():
        assert torch.equal(value, weights[1][name]), name
    logged = [json.loads((tmp_path / f"rank{rank}.json").read_text())["steps_logged"] for rank in range(2)]
    assert logged == [8, 0]  # 2 epochs of 4 steps, logged by rank 0 only
    checkpoint = torch.load(tmp_path / "checkpoint.pt", weights_only=True)
    assert checkpoint["step"] == 8 and checkpoint["epoch"] == 2


# ---------------------------------------------------------------------------------------------
# On a GPU

@cuda
def test_cuda_bf16_channels_last_compiled_training_resumes(tiny_shards, tmp_path, monkeypatch):
    monkeypatch.setattr(torch.backends.cudnn, "deterministic", True)
    monkeypatch.setattr(torch.backends.cudnn, "benchmark", False)
    gpu = torch.device("cuda")
    assert autocast_dtype("auto", gpu) is torch.bfloat16 and autocast_dtype("auto", CPU) is None
    settings = SETTINGS.model_copy(update={"precision": "auto", "channels_last": True, "compile": True})
    full, full_epochs, _ = run(tiny_shards, tmp_path / "full.pt", settings=settings, device=gpu)
    run(tiny_shards, tmp_path / "interrupted.pt", crash_at=7, settings=settings, device=gpu)
    resumed, _, _ = run(tiny_shards, tmp_path / "interrupted.pt", settings=settings, device=gpu)
    assert [step for step, _ in resumed] == list(range(7, 13))
    # some CUDA backward kernels add atomically, so a resumed run agrees closely rather than bit for bit
    torch.testing.assert_close([loss for _, loss in resumed], [loss for _, loss in full[6:]], rtol=1e-2, atol=1e-2)
    assert all(math.isfinite(loss) for _, loss in full) and len(full_epochs) == 3


# ---------------------------------------------------------------------------------------------
# Checkpoints that do not load

@pytest.mark.parametrize("damage", ["truncated", "empty", "not a torch file"])
def test_an_unreadable_checkpoint_is_set_aside_and_training_resumes_from_the_one_before(tiny_shards, tmp_path,
                                                                                        caplog, damage):
    full, full_epochs, finished = run(tiny_shards, tmp_path / "full.pt")
    checkpoint = tmp_path / "cut.pt"
    crashed, _, _ = run(tiny_shards, checkpoint, crash_at=7)  # checkpoints at steps 4 and 6
    assert torch.load(previous_of(checkpoint), weights_only=True)["step"] == 4
    data = checkpoint.read_bytes()
    checkpoint.write_bytes({"truncated": data[:len(data) // 2], "empty": b"", "not a torch file": b"text"}[damage])
    with caplog.at_level(logging.WARNING, logger="repsim.methods.trainer"):
        resumed, _, recovered = run(tiny_shards, checkpoint)
    assert crashed[:4] + resumed == full  # from step 4, to the same losses and weights as without the cut
    for (name, a), (_, b) in zip(finished.state_dict().items(), recovered.state_dict().items()):
        assert torch.equal(a, b), name
    message, = [record.getMessage() for record in caplog.records]
    assert message.startswith(f"checkpoint {checkpoint} (") and "\n" not in message
    assert message.endswith(") does not load and is set aside as .unreadable; training resumes from cut.pt.previous "
                            "(step 4)")
    assert (tmp_path / "cut.pt.unreadable").is_file()


def test_without_a_readable_checkpoint_training_starts_over(tiny_shards, tmp_path, caplog):
    full, _, finished = run(tiny_shards, tmp_path / "full.pt")
    checkpoint = tmp_path / "cut.pt"
    checkpoint.write_bytes(b"")
    with caplog.at_level(logging.WARNING, logger="repsim.methods.trainer"):
        again, _, recovered = run(tiny_shards, checkpoint)
    assert again == full
    assert caplog.records[0].getMessage().endswith("training resumes from the start")
