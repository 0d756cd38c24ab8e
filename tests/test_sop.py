"""SOP: the label matrix, SOP distributions, the memories, block masks, the losses, the EMA teacher
and training through the Trainer and the train stage (exact resume included)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
import yaml
import torch.nn.functional as F

from repsim.data.loader import make_loader
from repsim.data.masking import BlockMasking
from repsim.data.stage import ShardResult, shard
from repsim.errors import SpecError
from repsim.losses import KoLeoLoss
from repsim.losses.sop import (MaskedSOPLoss, SOPLoss, SOPs, build_sops, cross_entropy, mean_assignment_entropy,
                               mean_sample_entropy, nearest_supports)
from repsim.methods.config import Config, ModelConfig, OptimConfig, load_config
from repsim.methods.self_distillation import Memory, projection_head, teacher_momentum
from repsim.methods.sop import SOP, SOPBank
from repsim.methods.stage import train
from repsim.methods.trainer import Trainer, seed_everything
from repsim.models import load_encoder, resnet, vit

REPO = Path(__file__).resolve().parents[1]
HEAD = ModelConfig(projection_hidden_dim=32, projection_dim=16, projection_layers=3)


class Crash(Exception):
    """Stands for a process killed in the middle of training."""


def clustered(count: int, dim: int = 16, clusters: int = 8, seed: int = 0) -> torch.Tensor:
    """Unit rows around ``clusters`` random centres, like a memory of trained embeddings."""
    generator = torch.Generator().manual_seed(seed)
    centres = F.normalize(torch.randn(clusters, dim, generator=generator), dim=1)
    points = centres[torch.arange(count) % clusters] + 0.2 * torch.randn(count, dim, generator=generator)
    return F.normalize(points, dim=1)


def some_sops(one_hot: bool = False, anchors: int = 6, support: int = 4):
    memory = clustered(64)
    ids = torch.arange(64)
    rows = torch.randperm(64, generator=torch.Generator().manual_seed(1))[:anchors]
    return build_sops(memory[rows], ids[rows], memory, ids, support, epsilon=0.1, one_hot=one_hot), memory, rows


# ---------------------------------------------------------------------------------------------
# SOPs and their label matrix

@pytest.mark.parametrize("one_hot", [False, True])
def test_label_rows_sum_to_one_with_their_largest_entry_on_their_own_sop(one_hot):
    sops, _, _ = some_sops(one_hot)
    labels = sops.labels
    assert labels.shape == (6 * 5, 6)
    torch.testing.assert_close(labels.sum(dim=1), torch.ones(30))
    assert torch.equal(labels.argmax(dim=1), sops.sop_of)
    assert torch.equal(sops.sop_of, torch.tensor([0, 1, 2, 3, 4, 5] + [s for s in range(6) for _ in range(4)]))
    if one_hot:
        assert torch.equal(labels, F.one_hot(sops.sop_of, 6).float())
    else:
        torch.testing.assert_close(labels[:6].diagonal(), torch.full((6,), 0.9))  # anchors: 1 − ε
        torch.testing.assert_close(labels[:6].sum(dim=1) - 0.9, torch.full((6,), 0.1))


def test_support_weights_are_the_cosine_scores_of_the_nearest_other_entries():
    sops, memory, rows = some_sops()
    similarity = memory[rows] @ memory.T
    similarity[torch.arange(6), rows] = -math.inf
    expected = similarity.topk(4, dim=1)
    torch.testing.assert_close(sops.own[6:], expected.values.flatten().clamp(0, 1))
    torch.testing.assert_close(sops.elements[6:], memory[expected.indices.flatten()])
    torch.testing.assert_close(sops.spread, (1 - sops.own) / 5)


def test_non_shared_supports_keep_each_entry_once_for_the_anchor_it_is_nearest_to():
    memory, ids = clustered(64, clusters=2), torch.arange(64)
    rows = torch.arange(0, 24, 2)  # 12 anchors on 2 clusters: their 6 nearest overlap
    shared = build_sops(memory[rows], ids[rows], memory, ids, 6)
    alone = build_sops(memory[rows], ids[rows], memory, ids, 6, shared_supports=False)
    supports = [(sop, (alone.elements[m] @ memory.T).argmax().item()) for m, sop in
                enumerate(alone.sop_of.tolist()) if m >= 12]
    entries = [entry for _, entry in supports]
    assert len(entries) == len(set(entries)) and not set(entries) & set(rows.tolist())
    for sop, entry in supports:  # an entry drawn by several anchors stays with its nearest one
        drew = [a for a in range(12) if entry in (shared.elements[12 + 6 * a:18 + 6 * a] @ memory.T).argmax(1)]
        assert sop == max(drew, key=lambda a: (memory[rows[a]] @ memory[entry]).item())
    assert 12 < len(alone.elements) < len(shared.elements)
    torch.testing.assert_close(alone.labels.sum(dim=1), torch.ones(len(alone.elements)))


@pytest.mark.parametrize("backend", ["torch", "faiss"])
def test_an_anchor_is_never_its_own_support_even_with_duplicates_elsewhere(backend):
    memory = clustered(20)
    memory[7] = memory[3]  # an exact duplicate stays a legitimate support
    ids = torch.arange(20)
    scores, rows = nearest_supports(memory[[3, 7]], ids[[3, 7]], memory, ids, 5, backend=backend)
    assert 3 not in rows[0] and 7 not in rows[1]
    assert rows[0, 0] == 7 and rows[1, 0] == 3
    torch.testing.assert_close(scores[:, 0], torch.ones(2))


@pytest.mark.parametrize("backend", ["torch", "faiss", "auto"])
def test_supports_equal_a_brute_force_top_k_over_the_memory(backend):
    memory = clustered(500, dim=32, seed=4)
    ids = torch.randperm(500, generator=torch.Generator().manual_seed(5)) + 1000
    anchors = torch.cat([memory[[0, 13, 77, 250, 499]], clustered(2, dim=32, seed=6)])
    anchor_ids = torch.cat([ids[[0, 13, 77, 250, 499]], torch.tensor([-1, -2])])  # two anchors not in memory
    scores, rows = nearest_supports(anchors, anchor_ids, memory, ids, 6, backend=backend)
    similarity = anchors.double() @ memory.double().T
    similarity[anchor_ids[:, None] == ids[None, :]] = -math.inf
    expected = similarity.argsort(dim=1, descending=True, stable=True)[:, :6]
    assert torch.equal(rows, expected)
    torch.testing.assert_close(scores, similarity.gather(1, expected).float())


def test_faiss_and_torch_find_the_same_supports():
    memory = clustered(300, seed=2)
    ids = torch.arange(1000, 1300)
    anchors, anchor_ids = memory[::7].clone(), ids[::7].clone()
    anchors[0], anchor_ids[0] = clustered(1, seed=3)[0], -5  # a kept anchor no longer in memory
    by_torch = nearest_supports(anchors, anchor_ids, memory, ids, 8, backend="torch")
    by_faiss = nearest_supports(anchors, anchor_ids, memory, ids, 8, backend="faiss")
    torch.testing.assert_close(by_faiss[0], by_torch[0])
    assert torch.equal(by_faiss[1], by_torch[1])
    with pytest.raises(ValueError, match="unknown nearest-support backend"):
        nearest_supports(anchors, anchor_ids, memory, ids, 8, backend="annoy")


def test_sop_distributions_sum_to_one_and_equal_softmax_times_y():
    sops, _, _ = some_sops()
    embeddings = clustered(10, seed=5)
    for temperature in (0.04, 0.1):
        distribution = sops.distribution(embeddings, temperature)
        torch.testing.assert_close(distribution.sum(dim=1), torch.ones(10))
        expected = torch.softmax(embeddings @ sops.elements.T / temperature, dim=1) @ sops.labels
        torch.testing.assert_close(distribution, expected)


# ---------------------------------------------------------------------------------------------
# Memory and anchors

def test_the_memory_is_a_fifo_queue_that_wraps_around():
    memory = Memory(size=5, dim=1)
    memory.enqueue(torch.tensor([[0.0], [1.0], [2.0]]))
    assert memory.filled == 3
    assert memory.contents()[0].flatten().tolist() == [0, 1, 2] and memory.contents()[1].tolist() == [0, 1, 2]
    memory.enqueue(torch.tensor([[3.0], [4.0], [5.0], [6.0]]))  # overwrites the oldest, 0 and 1
    assert memory.filled == 5 and int(memory.count) == 7
    assert memory.entries.flatten().tolist() == [5, 6, 2, 3, 4] and memory.ids.tolist() == [5, 6, 2, 3, 4]
    memory.enqueue(torch.arange(7, 19, dtype=torch.float32)[:, None])  # more than fit: the newest five
    assert sorted(memory.entries.flatten().tolist()) == [14, 15, 16, 17, 18]
    assert torch.equal(memory.entries.flatten(), memory.ids.float()) and int(memory.count) == 19


def test_anchors_come_from_the_filled_entries_and_are_redrawn_each_step():
    torch.manual_seed(0)
    bank = SOPBank(size=100, dim=16, num_anchors=8, support_size=3)
    assert bank.sops() is None
    bank.memory.enqueue(clustered(20))
    first, second = bank.sops(), bank.sops()
    assert first.count == 8 and not torch.equal(first.elements[:8], second.elements[:8])
    filled = bank.memory.contents()[0]
    assert all((filled == anchor).all(dim=1).any() for anchor in first.elements[:8])


def test_fixed_anchors_are_drawn_once_the_memory_is_full_and_then_kept():
    torch.manual_seed(0)
    bank = SOPBank(size=32, dim=16, num_anchors=8, support_size=3, fixed_anchors=True)
    bank.memory.enqueue(clustered(16))
    assert not torch.equal(bank.sops().elements[:8], bank.sops().elements[:8])  # not full: redrawn
    bank.memory.enqueue(clustered(16, seed=1))
    kept = bank.sops().elements[:8].clone()
    for seed in (2, 3, 4):
        bank.memory.enqueue(clustered(40, seed=seed))  # every slot overwritten
        assert torch.equal(bank.sops().elements[:8], kept)
    restored = SOPBank(size=32, dim=16, num_anchors=8, support_size=3, fixed_anchors=True)
    restored.load_state_dict(bank.state_dict())
    assert torch.equal(restored.sops().elements[:8], kept)


def full_fixed_bank(fixed_supports: bool) -> tuple[SOPBank, SOPs]:
    """A bank with fixed anchors (and supports) and its first draw from a full memory."""
    torch.manual_seed(0)
    bank = SOPBank(size=32, dim=16, num_anchors=8, support_size=3, fixed_anchors=True, fixed_supports=fixed_supports)
    bank.memory.enqueue(clustered(32))
    return bank, bank.sops()


def test_fixed_supports_keep_the_sops_of_the_first_full_draw_whole():
    bank, kept = full_fixed_bank(fixed_supports=True)
    anchors_only, first = full_fixed_bank(fixed_supports=False)
    assert torch.equal(first.elements, kept.elements)
    for each in (bank, anchors_only):
        each.memory.enqueue(clustered(40, seed=5))  # every slot overwritten
    restored = SOPBank(size=32, dim=16, num_anchors=8, support_size=3, fixed_anchors=True, fixed_supports=True)
    restored.load_state_dict(bank.state_dict())
    for later in (bank.sops(), restored.sops()):
        assert torch.equal(later.elements, kept.elements) and torch.equal(later.own, kept.own)
    redrawn = anchors_only.sops()  # the same anchors, their supports found in the new memory
    assert torch.equal(redrawn.elements[:8], kept.elements[:8]) and not torch.equal(redrawn.elements, kept.elements)
    with pytest.raises(SpecError, match="set fixed_anchors=true too"):
        load_config(REPO / "configs" / "sop.yaml", ["method.fixed_supports=true"])


def test_supports_kept_from_anchors_are_drawn_among_the_other_entries_only():
    torch.manual_seed(0)
    bank = SOPBank(size=64, dim=16, num_anchors=16, support_size=3, supports_from_anchors=False)
    bank.memory.enqueue(clustered(64))
    sops = bank.sops()
    anchors, supports = sops.elements[:16], sops.elements[16:]
    assert len(supports) == 16 * 3 and not (supports @ anchors.T > 1 - 1e-6).any()
    torch.manual_seed(0)
    shared = SOPBank(size=64, dim=16, num_anchors=16, support_size=3)
    shared.memory.enqueue(clustered(64))
    drawn = shared.sops().elements
    assert (drawn[16:] @ drawn[:16].T > 1 - 1e-6).any()  # by default another anchor may support


def test_sops_of_anchors_alone_have_no_supports_and_a_random_memory_is_full_from_the_start():
    torch.manual_seed(0)
    bank = SOPBank(size=32, dim=16, num_anchors=8, support_size=0, random_start=True)
    assert bank.memory.filled == 32
    torch.testing.assert_close(bank.memory.entries.norm(dim=1), torch.ones(32))
    sops = bank.sops()  # before anything was enqueued
    assert sops.count == 8 and len(sops.elements) == 8 and torch.equal(sops.sop_of, torch.arange(8))
    bank.memory.enqueue(clustered(4))
    assert bank.memory.filled == 32 and torch.equal(bank.memory.ids[:4], torch.arange(32, 36))  # the oldest replaced
    assert (bank.memory.ids[4:] < -1).all()


def test_the_horizon_sets_the_teacher_momentum_from_the_run_length():
    torch.manual_seed(0)
    method = tiny_sop()
    method.horizon = 0.1  # an EMA over 10 of 100 steps: base momentum 0.9
    before = [p.detach().clone() for p in method.teacher_encoder.parameters()]
    with torch.no_grad():
        for p in method.encoder.parameters():
            p.add_(1.0)
    method.after_optimizer_step(0, 100)
    for old, new, p in zip(before, method.teacher_encoder.parameters(), method.encoder.parameters()):
        torch.testing.assert_close(new, 0.9 * old + 0.1 * p)


def test_the_cls_loss_is_the_mean_over_independent_anchor_draws():
    torch.manual_seed(0)
    method = tiny_sop()
    method.training_step(views(seed=1))
    first, second = method.cls_bank.sops(), method.cls_bank.sops()
    draws = iter([first, second])
    method.cls_bank.sops = lambda: next(draws)
    method.anchor_draws = 2
    state = torch.get_rng_state()
    both = method.training_step(views(seed=2))["cls_loss"]
    singles = []
    for sops in (first, second):
        method.cls_bank.sops = lambda sops=sops: sops
        method.anchor_draws = 1
        torch.set_rng_state(state)
        singles.append(method.training_step(views(seed=2))["cls_loss"])
    torch.testing.assert_close(both, (singles[0] + singles[1]) / 2)


def test_only_the_second_global_views_teacher_embeddings_enter_the_memories_when_asked():
    for second_only, per_step in ((False, 16), (True, 8)):
        torch.manual_seed(0)
        method = tiny_sop()
        method.enqueue_second_only = second_only
        method.training_step(views(batch=8, seed=1))
        assert int(method.cls_bank.memory.count) == per_step and int(method.patch_bank.memory.count) == 2 * per_step
    globals_ = torch.cat(views(batch=8, seed=1)["views"][:2])
    teacher = method.teacher_head(method.teacher_tokens(globals_)[0])
    torch.testing.assert_close(method.cls_bank.memory.contents()[0], teacher[8:])


def test_the_authors_preset_sets_every_option_the_config_does_not_set_itself():
    from repsim.methods.sop import AUTHORS

    path = REPO / "configs" / "sop.yaml"
    assert load_config(path).method.anchor_share is None  # the paper's SOP by default
    authors = load_config(path, ["method.preset=authors", "method.anchor_draws=3"]).method
    assert authors.anchor_draws == 3
    in_file = yaml.safe_load(path.read_text())["method"]
    assert authors.patches_per_view == in_file["patches_per_view"] == 4  # the file wins over the preset
    mine = {"anchor_draws", *in_file}
    assert {name: getattr(authors, name) for name in AUTHORS if name not in mine} == {
        name: value for name, value in AUTHORS.items() if name not in mine}
    assert authors.teacher_horizon is None and authors.anchor_share == 1 / 2048


# ---------------------------------------------------------------------------------------------
# Masks and losses

def test_block_masks_cover_the_drawn_ratio_on_the_chosen_share_of_views():
    torch.manual_seed(0)
    masks = BlockMasking(ratio=(0.2, 0.4), share=0.5)(40, (14, 14))
    assert masks.shape == (40, 196) and masks.dtype == torch.bool
    covered = masks.sum(dim=1)
    assert (covered > 0).sum() == 20
    assert covered.max() <= round(0.4 * 196) and covered[covered > 0].float().mean() > 0.15 * 196
    torch.manual_seed(0)
    assert torch.equal(BlockMasking(ratio=(0.2, 0.4), share=0.5)(40, (14, 14)), masks)  # global RNG
    with pytest.raises(SpecError, match="mask ratio range"):
        BlockMasking(ratio=(0.5, 1.2))


def test_the_mim_loss_ignores_unmasked_patches():
    sops, _, _ = some_sops()
    student, teacher = clustered(24, seed=2).reshape(2, 12, 16), clustered(24, seed=3).reshape(2, 12, 16)
    mask = torch.zeros(2, 12, dtype=torch.bool)
    mask[0, :4] = mask[1, 6:] = True
    loss = MaskedSOPLoss()(student, teacher, mask, sops)
    changed = torch.where(mask[..., None], student, clustered(24, seed=4).reshape(2, 12, 16))
    torch.testing.assert_close(MaskedSOPLoss()(changed, teacher, mask, sops), loss)
    target = sops.distribution(teacher[mask], 0.07)
    torch.testing.assert_close(loss, cross_entropy(target, sops.distribution(student[mask], 0.1)).mean())
    assert MaskedSOPLoss()(student, teacher, torch.zeros_like(mask), sops) == 0


def test_the_cls_loss_pairs_teacher_views_with_the_other_student_views():
    sops, _, _ = some_sops()
    teacher = [clustered(5, seed=6), clustered(5, seed=7)]
    student = [clustered(5, seed=8), clustered(5, seed=9), clustered(5, seed=10)]
    targets = [sops.distribution(view, 0.04) for view in teacher]
    predictions = [sops.distribution(view, 0.1) for view in student]
    pairs = [(0, 1), (0, 2), (1, 0), (1, 2)]
    expected = sum(cross_entropy(targets[i], predictions[j]).mean() for i, j in pairs) / 4
    torch.testing.assert_close(SOPLoss()(student, teacher, sops), expected)


def test_the_teacher_momentum_runs_from_its_base_to_one():
    assert teacher_momentum(0, 100, 0.996) == pytest.approx(0.996)
    assert teacher_momentum(50, 100, 0.996) == pytest.approx(0.998)
    assert teacher_momentum(100, 100, 0.996) == 1.0


# ---------------------------------------------------------------------------------------------
# The method

def tiny_sop(fixed_anchors: bool = False, mim_weight: float = 1.0, koleo_weight: float = 0.0) -> SOP:
    encoder = vit("tiny", image_size=16, patch_size=4, depth=1, in_channels=1)
    banks = (SOPBank(size=64, dim=16, num_anchors=16, support_size=4, fixed_anchors=fixed_anchors) for _ in range(2))
    return SOP(encoder, projection_head(encoder.feature_dim, HEAD), *banks, cls_loss=SOPLoss(),
               mim_loss=MaskedSOPLoss(), mim_weight=mim_weight, masking=BlockMasking((0.2, 0.5), 1.0),
               patches_per_view=2, koleo_weight=koleo_weight)


def test_a_batchnorm_head_ignores_a_shift_the_whole_batch_shares():
    torch.manual_seed(0)
    normed, plain = projection_head(32, HEAD, batchnorm=True), projection_head(32, HEAD)
    features, shift = torch.randn(16, 32), 5 * torch.rand(32)  # pooled ResNet features share such a mean
    torch.testing.assert_close(normed(features + shift), normed(features), atol=1e-5, rtol=0)
    assert not torch.allclose(plain(features + shift), plain(features), atol=1e-2)
    assert [type(layer) for layer in normed] == [torch.nn.Linear, torch.nn.BatchNorm1d, torch.nn.GELU] * (
        HEAD.projection_layers - 1) + [torch.nn.Linear, type(normed[-1])]


def views(batch: int = 8, seed: int = 0) -> dict:
    generator = torch.Generator().manual_seed(seed)
    return {"views": [torch.randn(batch, 1, 16, 16, generator=generator) for _ in range(2)] +
                     [torch.randn(batch, 1, 8, 8, generator=generator) for _ in range(2)]}


def test_gradients_reach_the_student_only_and_the_teacher_follows_by_ema():
    torch.manual_seed(0)
    method = tiny_sop()
    method.training_step(views(seed=1))  # fills the memories: the first step has no SOPs
    outputs = method.training_step(views(seed=2))
    assert outputs["cls_loss"] > 0 and outputs["mim_loss"] > 0 and outputs["sops"] == 16
    outputs["loss"].backward()
    assert all(p.grad is None for p in [*method.teacher_encoder.parameters(), *method.teacher_head.parameters()])
    student = [*method.encoder.parameters(), *method.head.parameters()]
    assert all(p.grad is not None for p in student) and method.encoder.mask_token.grad.abs().sum() > 0
    before = [p.detach().clone() for p in method.teacher_encoder.parameters()]
    with torch.no_grad():
        for p in student:
            p.add_(1.0)
    method.after_optimizer_step(0, 10)
    for old, new, p in zip(before, method.teacher_encoder.parameters(), method.encoder.parameters()):
        torch.testing.assert_close(new, 0.996 * old + 0.004 * p)


def test_the_koleo_option_adds_its_weight_times_the_koleo_loss_of_the_student_global_views():
    steps = {}
    for weight in (0.0, 0.5):
        torch.manual_seed(0)
        method = tiny_sop(koleo_weight=weight)
        method.training_step(views(seed=1))
        steps[weight] = method.training_step(views(seed=2))
    plain, spread = steps[0.0], steps[0.5]
    assert plain["koleo"] == 0 and spread["koleo"] != 0
    torch.testing.assert_close(spread["cls_loss"], plain["cls_loss"])
    torch.testing.assert_close(spread["loss"], plain["loss"] + 0.5 * spread["koleo"])
    torch.manual_seed(0)
    method = tiny_sop(koleo_weight=0.5)
    method.training_step(views(seed=1))
    globals_ = torch.cat(views(seed=2)["views"][:2])
    torch.manual_seed(1)
    mask = method.draw_mask(globals_)
    cls, _ = method.encoder.forward_tokens(globals_, mask)
    expected = torch.stack([KoLeoLoss()(method.head(view)) for view in cls.chunk(2)]).mean()
    torch.manual_seed(1)
    torch.testing.assert_close(method.training_step(views(seed=2))["koleo"], expected)


def test_without_mim_no_patch_is_masked_and_the_mask_token_is_frozen():
    method = tiny_sop(mim_weight=0.0)
    assert method.masking is None and not method.encoder.mask_token.requires_grad
    method.training_step(views(seed=1))
    assert method.training_step(views(seed=2))["mim_loss"] == 0


def test_a_bf16_autocast_step_keeps_float32_memories_and_a_finite_loss():
    torch.manual_seed(0)
    method = tiny_sop()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        method.training_step(views(seed=1))
        outputs = method.training_step(views(seed=2))
    assert torch.isfinite(outputs["loss"]) and outputs["mim_loss"] > 0
    assert method.cls_bank.memory.entries.dtype == torch.float32
    torch.testing.assert_close(method.cls_bank.memory.contents()[0].norm(dim=1), torch.ones(32), atol=1e-2, rtol=0)


def test_epoch_metrics_report_collapse_diagnostics_and_reset_the_entropy():
    torch.manual_seed(0)
    method = tiny_sop()
    for seed in range(3):
        method.training_step(views(seed=seed))
    metrics = method.epoch_metrics()
    assert set(metrics) == {"effective_rank", "embedding_std", "mean_cosine", "sop_entropy", "target_entropy"}
    assert 1 <= metrics["effective_rank"] <= 16 and 0 < metrics["sop_entropy"] <= 1
    assert 0 < metrics["target_entropy"] <= metrics["sop_entropy"]  # a mean is flatter than its parts
    assert "sop_entropy" not in method.epoch_metrics()


def test_the_target_entropy_is_one_for_uniform_targets_zero_for_one_hot_and_the_mean_per_row():
    uniform, one_hot = torch.full((1, 4), 0.25), torch.eye(4)[:1]
    half = torch.tensor([[0.5, 0.5, 0.0, 0.0]])  # entropy log 2 of log 4
    batch = torch.cat([uniform, one_hot, half])
    torch.testing.assert_close(mean_sample_entropy(batch), torch.tensor((1 + 0 + 0.5) / 3))
    torch.testing.assert_close(mean_assignment_entropy(one_hot.expand(4, 4)), torch.tensor(0.0))


# ---------------------------------------------------------------------------------------------
# Training: Trainer resume and the train stage

@pytest.fixture
def tiny_spec(make_image_folder, write_spec) -> Path:
    """40 grayscale 16×16 images of two classes: 32 train samples in 8 tars, 8 test samples."""
    folder = make_image_folder({"cat": 20, "dog": 20}, size=16)
    return write_spec({"name": "tiny", "source": {"type": "image_folder", "root": str(folder)},
                       "classes": {"cat": "cat.n.01", "dog": "dog.n.01"},
                       "split": {"type": "random", "fractions": {"train": 0.8, "test": 0.2}}, "shard_size": 4})


@pytest.fixture
def tiny_shards(tiny_spec, tmp_path) -> ShardResult:
    return shard(tiny_spec, out_dir=tmp_path / "shards", progress=False)


def run(shards: ShardResult, checkpoint: Path, crash_at: int | None = None,
        fixed_anchors: bool = False) -> tuple[list[tuple[int, float]], list[dict], SOP]:
    seed_everything(0)
    method = tiny_sop(fixed_anchors)
    losses, epochs = [], []

    def log(metrics: dict[str, float], step: int) -> None:
        if "loss" in metrics:
            losses.append((step, metrics["loss"]))
        else:
            epochs.append(metrics)
        if step == crash_at:
            raise Crash
    settings = OptimConfig(batch_size=8, epochs=3, warmup_epochs=1, lr=1e-3, checkpoint_every=2)
    loader = make_loader(shards.path, "multicrop", 8, seed=1, preset_options={"local_crops": 2})
    try:
        Trainer(method, settings, loader, checkpoint_path=checkpoint, log=log, device="cpu", progress=False).fit()
    except Crash:
        pass
    return losses, epochs, method


def test_a_resumed_sop_run_repeats_the_uninterrupted_run_exactly(tiny_shards, tmp_path):
    full, full_epochs, finished = run(tiny_shards, tmp_path / "full.pt")
    assert [step for step, _ in full] == list(range(1, 13))
    run(tiny_shards, tmp_path / "interrupted.pt", crash_at=6)
    resumed, resumed_epochs, recovered = run(tiny_shards, tmp_path / "interrupted.pt")
    assert resumed == full[4:]  # the checkpoint of step 4 was the last before the crash
    assert resumed_epochs == full_epochs[1:] and "sop_entropy" in full_epochs[-1]
    for name, value in finished.state_dict().items():
        assert torch.equal(value, recovered.state_dict()[name]), name


def test_fixed_anchors_stay_fixed_while_training(tiny_shards, tmp_path):
    _, _, method = run(tiny_shards, tmp_path / "fixed.pt", fixed_anchors=True)
    bank = method.cls_bank
    assert bool(bank.anchors_drawn)
    assert torch.equal(bank.sops().elements[:bank.num_anchors], bank.anchors)
    assert not torch.isin(bank.anchor_ids, bank.memory.ids).all()  # the memory moved on, the anchors did not


def test_sop_trains_through_the_train_stage(tiny_spec, tiny_shards, tmp_path):
    config = load_config(REPO / "configs" / "sop.yaml", [
        f"data.spec={tiny_spec}", "data.image_size=16", "model.depth=1", "model.projection_hidden_dim=32",
        "model.projection_dim=16", "optim.batch_size=16", "optim.epochs=2", "monitor.k=3",
        "method.num_anchors=8", "method.cls_memory=64", "method.patch_memory=64", "method.support_size=3",
        "optim.num_workers=0",
        "data.preset_options={local_crops: 2}"])
    output = train(config, out_dir=tmp_path / "out", shards=tiny_shards, device="cpu", progress=False)
    records = [json.loads(line) for line in (output.path / "metrics.jsonl").read_text().splitlines()]
    epochs = [record for record in records if "epoch" in record]
    assert len(epochs) == 2 and {"knn_top1_k3", "teacher_knn_top1_k3", "effective_rank", "embedding_std",
                                 "sop_entropy"} <= set(epochs[-1])
    assert output.metrics["steps"] == 4 and output.metrics["teacher_knn_top1_k3"] == epochs[-1]["teacher_knn_top1_k3"]
    assert load_encoder(output.path)(torch.randn(2, 1, 16, 16)).shape == (2, 192)


def test_without_mim_a_resnet_stands_in_for_the_vit_and_the_patch_memory_stays_empty():
    torch.manual_seed(0)
    encoder = resnet("resnet18", small_images=True, in_channels=1)
    banks = (SOPBank(size=64, dim=16, num_anchors=16, support_size=4) for _ in range(2))
    method = SOP(encoder, projection_head(encoder.feature_dim, HEAD), *banks, cls_loss=SOPLoss(),
                 mim_loss=MaskedSOPLoss(), mim_weight=0.0, masking=BlockMasking((0.2, 0.5), 1.0))
    method.training_step(views(seed=1))  # fills the [CLS] memory: the first step has no SOPs
    outputs = method.training_step(views(seed=2))
    assert outputs["cls_loss"] > 0 and outputs["mim_loss"] == 0 and outputs["sops"] == 16
    outputs["loss"].backward()
    assert all(parameter.grad is not None for parameter in encoder.parameters())
    assert int(method.cls_bank.memory.count) == 2 * 2 * 8 and int(method.patch_bank.memory.count) == 0


def test_a_resnet_trains_through_the_train_stage_without_mim_and_is_refused_with_it(tiny_spec, tiny_shards,
                                                                                     tmp_path):
    settings = {"method": {"name": "sop", "num_anchors": 8, "cls_memory": 64, "patch_memory": 64, "support_size": 3},
                "data": {"spec": str(tiny_spec), "image_size": 16, "preset": "multicrop",
                         "preset_options": {"local_crops": 2}},
                "model": {"backbone": "resnet18", "projection_hidden_dim": 32, "projection_dim": 16},
                "optim": {"batch_size": 16, "epochs": 1, "num_workers": 0}, "monitor": {"knn": False}}
    with pytest.raises(SpecError, match="method 'sop' with a patch loss needs a ViT, but model.backbone is 'resnet18'"):
        train(Config.model_validate(settings), shards=tiny_shards, device="cpu", progress=False)
    settings["method"]["mim_weight"] = 0
    output = train(Config.model_validate(settings), out_dir=tmp_path / "out", shards=tiny_shards, device="cpu",
                   progress=False)
    assert output.metrics["steps"] == 2 and load_encoder(output.path)(torch.randn(2, 1, 16, 16)).shape == (2, 512)
