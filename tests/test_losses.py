"""Contrastive losses: against loop references, their stated equivalences, and across DDP ranks;
the usage example of every loss."""

import doctest
import math
import os
import sys

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

from repsim import losses
from repsim.losses import ClipLoss, KoLeoLoss, NTXentLoss, SupConLoss, XCLRLoss

TINY = 1e-4  # a target temperature small enough to be the tau_s -> 0 limit


def views(batch=12, dim=6, seed=0, dtype=torch.float64):
    generator = torch.Generator().manual_seed(seed)
    z1 = torch.randn(batch, dim, generator=generator, dtype=dtype, requires_grad=True)
    z2 = torch.randn(batch, dim, generator=generator, dtype=dtype, requires_grad=True)
    return z1, z2


def labels_of(batch=12, classes=3, seed=0):
    return torch.randint(0, classes, (batch,), generator=torch.Generator().manual_seed(seed))


def same_label(labels):
    return (labels[:, None] == labels[None, :]).double()


def xclr_reference(z1, z2, similarity, tau, tau_s):
    """DESIGN's definition, one row at a time."""
    z = F.normalize(torch.cat([z1, z2]), dim=1)
    n, batch = len(z), len(z1)
    total = 0.0
    for row in range(n):
        others = [col for col in range(n) if col != row]
        s = torch.stack([similarity[row % batch, col % batch] if row % batch != col % batch
                         else torch.tensor(1.0, dtype=z.dtype) for col in others])
        target = torch.softmax(s / tau_s, dim=0)
        log_prediction = torch.log_softmax(torch.stack([z[row] @ z[col] for col in others]) / tau, dim=0)
        total = total - (target * log_prediction).sum()
    return total / n


def ntxent_reference(z1, z2, tau):
    z = F.normalize(torch.cat([z1, z2]), dim=1)
    n, batch = len(z), len(z1)
    total = 0.0
    for row in range(n):
        positive = (row + batch) % n
        denominator = sum(torch.exp(z[row] @ z[col] / tau) for col in range(n) if col != row)
        total = total - torch.log(torch.exp(z[row] @ z[positive] / tau) / denominator)
    return total / n


def supcon_reference(z1, z2, labels, tau):
    z = F.normalize(torch.cat([z1, z2]), dim=1)
    all_labels = labels.repeat(2)
    n = len(z)
    total = 0.0
    for row in range(n):
        denominator = sum(torch.exp(z[row] @ z[col] / tau) for col in range(n) if col != row)
        positives = [col for col in range(n) if col != row and all_labels[col] == all_labels[row]]
        total = total - sum(torch.log(torch.exp(z[row] @ z[p] / tau) / denominator) for p in positives) / len(positives)
    return total / n


def grads(loss, *tensors):
    return torch.autograd.grad(loss, tensors)


def test_xclr_matches_its_definition_for_a_soft_graph():
    z1, z2 = views()
    similarity = torch.rand(12, 12, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    similarity = (similarity + similarity.T) / 2
    expected = xclr_reference(z1, z2, similarity, tau=0.2, tau_s=0.3)
    actual = XCLRLoss(temperature=0.2, target_temperature=0.3)(z1, z2, similarity)
    torch.testing.assert_close(actual, expected)
    for got, want in zip(grads(actual, z1, z2), grads(expected, z1, z2)):
        torch.testing.assert_close(got, want)


def test_xclr_with_identity_targets_is_simclr():
    z1, z2 = views()
    xclr = XCLRLoss(temperature=0.3, target_temperature=TINY)(z1, z2, torch.eye(12, dtype=torch.float64))
    simclr = NTXentLoss(temperature=0.3)(z1, z2)
    torch.testing.assert_close(xclr, simclr)
    torch.testing.assert_close(simclr, ntxent_reference(z1, z2, 0.3))
    for got, want in zip(grads(xclr, z1, z2), grads(simclr, z1, z2)):
        torch.testing.assert_close(got, want)


def test_xclr_with_same_label_targets_is_supcon():
    z1, z2 = views()
    labels = labels_of()
    xclr = XCLRLoss(temperature=0.5, target_temperature=TINY)(z1, z2, same_label(labels))
    supcon = SupConLoss(temperature=0.5)(z1, z2, labels)
    torch.testing.assert_close(xclr, supcon)
    torch.testing.assert_close(supcon, supcon_reference(z1, z2, labels, 0.5))
    for got, want in zip(grads(xclr, z1, z2), grads(supcon, z1, z2)):
        torch.testing.assert_close(got, want)


def test_xclr_defines_self_similarity_as_one_and_ignores_scale():
    z1, z2 = views()
    similarity = torch.rand(12, 12, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    similarity = (similarity + similarity.T) / 2
    loss = XCLRLoss(0.2, 0.2)
    with_ones = similarity.clone().fill_diagonal_(1.0)
    torch.testing.assert_close(loss(z1, z2, similarity), loss(z1, z2, with_ones))
    torch.testing.assert_close(loss(z1, z2, similarity), loss(3 * z1, 0.5 * z2, similarity))


def test_xclr_gradient_is_exact():
    z1, z2 = views(batch=5, dim=3)
    similarity = torch.rand(5, 5, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    assert torch.autograd.gradcheck(lambda a, b: XCLRLoss(0.4, 0.2)(a, b, similarity), (z1, z2))


def test_xclr_minimum_is_reached_when_predictions_match_targets():
    """Cross-entropy is minimised (down to the target entropy) only by the target distribution."""
    z1, z2 = views(batch=4, dim=4)
    similarity = torch.eye(4, dtype=torch.float64)
    aligned = torch.eye(4, dtype=torch.float64) * 10  # both views identical, samples orthogonal
    tight = XCLRLoss(temperature=0.01, target_temperature=TINY)(aligned, aligned, similarity)
    assert tight.item() < 1e-6 < XCLRLoss(0.01, TINY)(z1, z2, similarity).item()


def test_clip_matches_symmetric_infonce_and_learns_its_scale():
    image, text = views(batch=8, dim=5)
    loss = ClipLoss(temperature=0.1).double()
    value = loss(image, text)
    i, t = F.normalize(image, dim=1), F.normalize(text, dim=1)
    logits = i @ t.T / 0.1
    targets = torch.arange(8)
    expected = (F.cross_entropy(logits, targets) + F.cross_entropy(logits.T, targets)) / 2
    torch.testing.assert_close(value, expected)
    (scale_grad,) = torch.autograd.grad(value, loss.log_scale)
    assert scale_grad.abs() > 0
    assert math.isclose(ClipLoss(temperature=0.001).scale.item(), 100.0)  # clamped as in CLIP
    assert not any(p.requires_grad for p in ClipLoss(learnable=False).parameters())


def test_wrong_shapes_are_refused():
    z1, z2 = views()
    with pytest.raises(ValueError, match=r"similarity must be \(12, 12\)"):
        XCLRLoss()(z1, z2, torch.eye(11))
    with pytest.raises(ValueError, match="must both be"):
        NTXentLoss()(z1, z2[:5])
    with pytest.raises(ValueError, match="labels must be"):
        SupConLoss()(z1, z2, torch.zeros(3, dtype=torch.long))


def _ddp_rank(rank, world, port, results):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        z1, z2 = views(batch=12)
        labels = labels_of()
        similarity = torch.rand(12, 12, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
        similarity = (similarity + similarity.T) / 2
        rows = slice(rank * 6, rank * 6 + 6)
        local = [z1.detach()[rows].clone().requires_grad_(), z2.detach()[rows].clone().requires_grad_()]
        out = {}
        for name, loss, extra in [("xclr", XCLRLoss(0.2, 0.3, gather=True), (similarity,)),
                                  ("ntxent", NTXentLoss(0.2, gather=True), ()),
                                  ("supcon", SupConLoss(0.2, gather=True), (labels[rows],))]:
            value = loss(*local, *extra)
            g1, g2 = torch.autograd.grad(value, local)
            out[name] = (value.item(), g1 / world, g2 / world)  # / world: DDP averages gradients
        results[rank] = out
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_gathered_losses_equal_the_global_batch_loss():
    world = 2
    results = mp.Manager().dict()
    mp.spawn(_ddp_rank, args=(world, 29517, results), nprocs=world, join=True)
    z1, z2 = views(batch=12)
    labels = labels_of()
    similarity = torch.rand(12, 12, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    similarity = (similarity + similarity.T) / 2
    full = {"xclr": XCLRLoss(0.2, 0.3)(z1, z2, similarity), "ntxent": NTXentLoss(0.2)(z1, z2),
            "supcon": SupConLoss(0.2)(z1, z2, labels)}
    for name, value in full.items():
        g1, g2 = grads(value, z1, z2)
        assert math.isclose(sum(results[r][name][0] for r in range(world)) / world, value.item(), rel_tol=1e-9)
        for rank in range(world):
            rows = slice(rank * 6, rank * 6 + 6)
            torch.testing.assert_close(results[rank][name][1], g1[rows])
            torch.testing.assert_close(results[rank][name][2], g2[rows])


@pytest.mark.parametrize("name", losses.__all__)
def test_every_loss_has_a_usage_example_that_runs_to_a_scalar(name):
    loss = getattr(losses, name)
    [example] = doctest.DocTestFinder(recurse=False).find(loss, name, module=sys.modules[loss.__module__])
    assert example.examples and example.examples[-1].want == "torch.Size([])\n"
    assert doctest.DocTestRunner().run(example).failed == 0


def test_koleo_is_minus_the_mean_log_distance_to_each_nearest_other_embedding():
    # three unit vectors at 0°, 90° and 180° (scaled, to show the normalisation): every point's
    # nearest other one is √2 away, so the loss is −log √2; duplicating a point makes its distance 0
    points = torch.tensor([[2.0, 0.0], [0.0, 3.0], [-1.0, 0.0]], dtype=torch.float64)
    assert math.isclose(KoLeoLoss(eps=0)(points).item(), -0.5 * math.log(2), rel_tol=1e-12)
    crowded = torch.tensor([[1.0, 0.0], [1.0, 0.0], [0.0, 1.0]], dtype=torch.float64)
    expected = -(2 * math.log(1e-8) + math.log(math.sqrt(2))) / 3
    assert math.isclose(KoLeoLoss(eps=1e-8)(crowded).item(), expected, rel_tol=1e-9)


def test_a_koleo_gradient_step_moves_crowded_embeddings_apart():
    generator = torch.Generator().manual_seed(0)
    embeddings = F.normalize(torch.randn(1, 8, generator=generator) + 0.05 * torch.randn(16, 8, generator=generator))
    embeddings.requires_grad_(True)

    def nearest_distance(x):
        distances = torch.cdist(x, x) + torch.eye(len(x)) * 9
        return distances.min(dim=1).values.mean()

    before = nearest_distance(F.normalize(embeddings.detach()))
    KoLeoLoss()(embeddings).backward()
    after = nearest_distance(F.normalize(embeddings.detach() - 0.01 * embeddings.grad))
    assert after > before
    with pytest.raises(ValueError, match="at least two"):
        KoLeoLoss()(torch.randn(1, 8))
