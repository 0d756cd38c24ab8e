"""The DINO- and iBOT-style baselines: their losses (centring, sharpening, multi-crop pairs, masked
patches), the prototypes and training through the train stage."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from repsim.data.stage import shard
from repsim.data.masking import BlockMasking
from repsim.losses.dino import DINOLoss, cross_view_cross_entropy
from repsim.losses.ibot import IBOTPatchLoss
from repsim.losses.koleo import KoLeoLoss
from repsim.methods.config import ModelConfig, load_config
from repsim.methods.dino import Dino, Prototypes
from repsim.methods.self_distillation import projection_head
from repsim.methods.stage import train
from repsim.errors import SpecError
from repsim.models import load_encoder, vit

REPO = Path(__file__).resolve().parents[1]


def test_the_loss_is_the_cross_entropy_of_centred_sharpened_teachers_over_other_views():
    generator = torch.Generator().manual_seed(0)
    student = [torch.randn(4, 10, generator=generator) for _ in range(3)]
    teacher = [torch.randn(4, 10, generator=generator) for _ in range(2)]
    loss = DINOLoss(10, student_temperature=0.1, teacher_temperature=0.04)
    loss.center.fill_(0.3)
    targets = [torch.softmax((t - 0.3) / 0.04, dim=1) for t in teacher]
    expected = sum(-(targets[i] * torch.log_softmax(student[j] / 0.1, dim=1)).sum(dim=1).mean()
                   for i, j in [(0, 1), (0, 2), (1, 0), (1, 2)]) / 4
    torch.testing.assert_close(loss(student, teacher), expected)


def test_the_centre_is_an_ema_of_the_teacher_means_in_training_only():
    loss = DINOLoss(3, center_momentum=0.9)
    teacher = [torch.tensor([[1.0, 2.0, 3.0]]), torch.tensor([[3.0, 2.0, 1.0]])]
    loss([torch.zeros(1, 3)] * 2, teacher)
    torch.testing.assert_close(loss.center, torch.full((3,), 0.2))
    loss.eval()
    loss([torch.zeros(1, 3)] * 2, teacher)
    torch.testing.assert_close(loss.center, torch.full((3,), 0.2))


def test_pairs_of_the_same_view_take_no_part():
    first, second = torch.tensor([[1.0, 0.0]]), torch.tensor([[0.0, 1.0]])
    predicts_second, predicts_first = torch.tensor([[0.1, 0.9]]).log(), torch.tensor([[0.9, 0.1]]).log()
    loss = cross_view_cross_entropy([first, second], [predicts_second, predicts_first])
    torch.testing.assert_close(loss, -torch.tensor(0.9).log())  # each view only predicts the other
    with pytest.raises(ValueError, match="cross-view pairs"):
        cross_view_cross_entropy([first], [predicts_first])


def test_prototype_logits_are_cosines_whatever_the_weight_norm():
    prototypes = Prototypes(dim=8, count=5)
    with torch.no_grad():
        prototypes.weight.mul_(torch.arange(1.0, 6.0)[:, None])
    embeddings = F.normalize(torch.randn(3, 8), dim=1)
    logits = prototypes(embeddings)
    torch.testing.assert_close(logits, embeddings @ F.normalize(prototypes.weight, dim=1).T)
    assert logits.abs().max() <= 1 + 1e-6


def test_gradients_reach_the_student_and_its_prototypes_only():
    torch.manual_seed(0)
    encoder = vit("tiny", image_size=16, patch_size=4, depth=1, in_channels=1)
    head = projection_head(encoder.feature_dim, ModelConfig(projection_hidden_dim=32, projection_dim=16))
    method = Dino(encoder, head, Prototypes(16, 12), DINOLoss(12))
    batch = {"views": [torch.randn(4, 1, 16, 16), torch.randn(4, 1, 16, 16), torch.randn(4, 1, 8, 8)]}
    outputs = method.training_step(batch)
    outputs["loss"].backward()
    assert 0 < outputs["prototype_entropy"] <= 1
    assert all(p.grad is None for p in [*method.teacher_encoder.parameters(), *method.teacher_head.parameters()])
    assert not encoder.mask_token.requires_grad
    assert all(p.grad is not None for name, p in method.named_parameters()
               if p.requires_grad and not name.startswith("teacher"))
    assert method.head[1].weight.grad.abs().sum() > 0


def test_the_patch_loss_is_the_cross_entropy_of_centred_sharpened_teachers_per_masked_patch():
    generator = torch.Generator().manual_seed(1)
    student, teacher = torch.randn(6, 10, generator=generator), torch.randn(6, 10, generator=generator)
    loss = IBOTPatchLoss(10, student_temperature=0.1, teacher_temperature=0.07, center_momentum=0.5)
    loss.center.fill_(0.2)
    target = torch.softmax((teacher - 0.2) / 0.07, dim=1)
    expected = -(target * torch.log_softmax(student / 0.1, dim=1)).sum(dim=1).mean()
    torch.testing.assert_close(loss(student, teacher), expected)
    torch.testing.assert_close(loss.center, 0.5 * 0.2 + 0.5 * teacher.mean(dim=0))


def test_no_masked_patch_gives_a_zero_patch_loss_and_keeps_the_centre():
    loss = IBOTPatchLoss(4)
    loss.center.fill_(0.3)
    student = torch.zeros(0, 4, requires_grad=True)
    value = loss(student, torch.zeros(0, 4))
    assert value.item() == 0 and value.requires_grad
    torch.testing.assert_close(loss.center, torch.full((4,), 0.3))
    with pytest.raises(ValueError, match=r"must both be \(N, K\)"):
        loss(torch.zeros(3, 4), torch.zeros(3, 5))


def ibot(share: float, koleo_weight: float = 0.0) -> Dino:
    torch.manual_seed(0)
    encoder = vit("tiny", image_size=16, patch_size=4, depth=1, in_channels=1)
    head = projection_head(encoder.feature_dim, ModelConfig(projection_hidden_dim=32, projection_dim=16))
    return Dino(encoder, head, Prototypes(16, 12), DINOLoss(12), patch_loss=IBOTPatchLoss(12), patch_weight=0.5,
                masking=BlockMasking((0.3, 0.5), share=share), koleo_weight=koleo_weight)


def test_ibot_adds_the_weighted_patch_loss_and_trains_the_mask_token():
    batch = {"views": [torch.randn(4, 1, 16, 16), torch.randn(4, 1, 16, 16), torch.randn(4, 1, 8, 8)]}
    method = ibot(share=1.0)
    outputs = method.training_step(batch)
    outputs["loss"].backward()
    assert outputs["patch_loss"] > 0
    torch.testing.assert_close(outputs["loss"], outputs["cls_loss"] + 0.5 * outputs["patch_loss"])
    assert method.encoder.mask_token.grad.abs().sum() > 0
    unmasked = ibot(share=0.0)
    outputs = unmasked.training_step(batch)
    outputs["loss"].backward()
    assert outputs["patch_loss"] == 0 and unmasked.encoder.mask_token.grad.abs().sum() == 0
    with pytest.raises(ValueError, match="patch loss needs masking"):
        Dino(method.encoder, projection_head(method.encoder.feature_dim, ModelConfig(projection_dim=16)),
             Prototypes(16, 12), DINOLoss(12), patch_loss=IBOTPatchLoss(12))


def test_the_koleo_option_adds_its_weight_times_koleo_of_the_global_unit_projections_before_the_prototypes():
    batch = {"views": [torch.randn(4, 1, 16, 16), torch.randn(4, 1, 16, 16), torch.randn(4, 1, 8, 8)]}
    steps = {}
    for weight in (0.0, 0.5):
        method = ibot(share=1.0, koleo_weight=weight)
        torch.manual_seed(1)
        steps[weight] = method.training_step(batch)
    plain, spread = steps[0.0], steps[0.5]
    assert plain["koleo"] == 0 and spread["koleo"] > 0
    torch.testing.assert_close(spread["cls_loss"], plain["cls_loss"])
    torch.testing.assert_close(spread["loss"], plain["loss"] + 0.5 * spread["koleo"])
    torch.manual_seed(1)
    globals_ = torch.cat(batch["views"][:2])
    cls, _ = method.encoder.forward_tokens(globals_, method.draw_mask(globals_))
    expected = torch.stack([KoLeoLoss()(method.head[0](view)) for view in cls.chunk(2)]).mean()
    torch.testing.assert_close(spread["koleo"], expected)
    spread["koleo"].backward()
    assert method.prototypes.weight.grad is None
    assert all(weight.grad is not None for weight in method.head[0].parameters())


def optimizer_steps(method: Dino, steps: int, total: int) -> list[torch.Tensor]:
    """The prototypes after each of ``steps`` steps of ``total`` with AdamW and weight decay, the hooks
    called as the Trainer calls them."""
    optimizer = torch.optim.AdamW([p for p in method.parameters() if p.requires_grad], lr=0.1, weight_decay=0.5)
    batch = {"views": [torch.randn(4, 1, 16, 16), torch.randn(4, 1, 16, 16)]}
    seen = []
    for step in range(steps):
        optimizer.zero_grad(set_to_none=True)
        method.training_step(batch)["loss"].backward()
        method.before_optimizer_step(step, total)
        optimizer.step()
        method.after_optimizer_step(step + 1, total)
        seen.append(method.prototypes.weight.detach().clone())
    return seen


def test_the_prototypes_stay_frozen_for_their_share_of_the_steps_then_train():
    method = ibot(share=1.0)
    method.frozen = 0.25  # 2 of 8 steps
    start = method.prototypes.weight.detach().clone()
    first, second, third = optimizer_steps(method, 3, total=8)
    assert torch.equal(first, start) and torch.equal(second, start)  # not even weight decay moved them
    assert not torch.equal(third, start)


def test_the_teacher_temperatures_warm_up_linearly_then_hold_and_a_checkpoint_keeps_them():
    method = ibot(share=1.0)
    method.loss.teacher_temperature.fill_(0.04)
    method.patch_loss.teacher_temperature.fill_(0.04)
    method.temperatures = [(method.loss, 0.04, 0.07), (method.patch_loss, 0.04, 0.1)]
    method.warmup = 0.5  # over 2 of 4 steps
    seen = []
    for step in range(4):
        method.after_optimizer_step(step + 1, 4)
        seen.append((method.loss.teacher_temperature.item(), method.patch_loss.teacher_temperature.item()))
    expected = [(0.055, 0.07), (0.07, 0.1), (0.07, 0.1), (0.07, 0.1)]
    for got, want in zip(seen, expected):
        assert got == pytest.approx(want)
    held = Dino(method.encoder, method.head[0], method.prototypes, DINOLoss(12, teacher_temperature=0.04),
                final_temperatures=(0.07,))  # no warm-up: the final temperature from the first step
    assert held.loss.teacher_temperature.item() == pytest.approx(0.07)
    restored = ibot(share=1.0)
    restored.load_state_dict(method.state_dict())
    assert restored.loss.teacher_temperature.item() == pytest.approx(0.07)


def test_the_shipped_baselines_carry_their_papers_stabilisers():
    dino_config, ibot_config = (load_config(REPO / "configs" / name).method for name in ("dino.yaml", "ibot.yaml"))
    assert (dino_config.freeze_prototypes, dino_config.teacher_temperature, dino_config.final_teacher_temperature,
            dino_config.teacher_warmup) == (0.01, 0.04, 0.07, 0.3)
    assert (ibot_config.teacher_temperature, ibot_config.patch_teacher_temperature) == (0.04, 0.07)


@pytest.fixture
def tiny_spec(make_image_folder, write_spec) -> Path:
    """40 grayscale 16×16 images of two classes: 32 train samples in 8 tars, 8 test samples."""
    folder = make_image_folder({"cat": 20, "dog": 20}, size=16)
    return write_spec({"name": "tiny", "source": {"type": "image_folder", "root": str(folder)},
                       "classes": {"cat": "cat.n.01", "dog": "dog.n.01"},
                       "split": {"type": "random", "fractions": {"train": 0.8, "test": 0.2}}, "shard_size": 4})


@pytest.fixture
def tiny_shards(tiny_spec, tmp_path):
    return shard(tiny_spec, out_dir=tmp_path / "shards", progress=False)


def tiny_config(config_file: str, spec: Path, *settings: str):
    return load_config(REPO / "configs" / config_file, [
        f"data.spec={spec}", "data.image_size=16", "model.depth=1", "model.projection_hidden_dim=32",
        "model.projection_dim=16", "optim.batch_size=16", "optim.epochs=2", "optim.num_workers=0", "monitor.k=3",
        "method.num_prototypes=32", "data.preset_options={local_crops: 2}", *settings])


@pytest.mark.parametrize("config_file", ["dino.yaml", "ibot.yaml"])
def test_dino_and_ibot_train_through_the_train_stage(config_file, tiny_spec, tiny_shards, tmp_path):
    config = tiny_config(config_file, tiny_spec,
                         f"method.freeze_prototypes={0.9 if config_file == 'dino.yaml' else 0.01}",  # dino: all 4 frozen
                         "optim.keep_checkpoint=true")
    output = train(config, out_dir=tmp_path / "out", shards=tiny_shards, device="cpu", progress=False)
    records = [json.loads(line) for line in (output.path / "metrics.jsonl").read_text().splitlines()]
    last_epoch = [record for record in records if "epoch" in record][-1]
    assert {"knn_top1_k3", "effective_rank", "embedding_std", "prototype_entropy"} <= set(last_epoch)
    assert output.metrics["steps"] == 4
    assert any("patch_loss" in record for record in records) == (config_file == "ibot.yaml")
    state = torch.load(output.path / "checkpoint.pt", weights_only=True)["model"]
    assert state["loss.teacher_temperature"].item() == pytest.approx(0.04 + 0.03 * min(4 / (0.3 * 4), 1))
    frozen_throughout = torch.equal(state["head.1.weight"], state["teacher_head.1.weight"])  # the EMA of a constant
    assert frozen_throughout == (config_file == "dino.yaml")


def test_dino_trains_a_resnet_on_its_pooled_features_and_ibot_needs_patch_tokens(tiny_spec, tiny_shards, tmp_path):
    config = tiny_config("dino.yaml", tiny_spec, "model.backbone=resnet18", "monitor.knn=false")
    output = train(config, out_dir=tmp_path / "out", shards=tiny_shards, device="cpu", progress=False)
    assert output.metrics["steps"] == 4 and load_encoder(output.path)(torch.randn(2, 1, 16, 16)).shape == (2, 512)
    ibot = tiny_config("ibot.yaml", tiny_spec, "model.backbone=resnet18")
    with pytest.raises(SpecError, match="method 'ibot' with a patch loss needs a ViT, but model.backbone is 'resnet18'"):
        train(ibot, out_dir=tmp_path / "ibot", shards=tiny_shards, device="cpu", progress=False)
