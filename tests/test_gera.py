"""The GeRA loss: kernels, the geometric term's invariances, gradients, and neighbor sampling."""

from __future__ import annotations

import math

import pytest
import torch

from repsim.align.method import sample_neighbors
from repsim.losses import ClipLoss, GeometricLoss, GeRALoss
from repsim.losses.gera import KERNEL_FLOOR, neighborhood_kernel
from repsim.models import AlignmentNetwork

B, M_POINTS, DIM = 6, 9, 12  # 6 neighborhoods of a paired point and 8 neighbors, 12-d


@pytest.fixture
def hoods() -> torch.Tensor:
    return torch.randn(B, M_POINTS, DIM, generator=torch.Generator().manual_seed(0))


def rotation(dim: int, seed: int = 1) -> torch.Tensor:
    q, _ = torch.linalg.qr(torch.randn(dim, dim, generator=torch.Generator().manual_seed(seed)))
    return q


@pytest.mark.parametrize("kind", ["heat", "heat_squared", "cosine", "knn"])
def test_every_kernel_row_is_a_distribution(hoods, kind):
    kernel = neighborhood_kernel(hoods, kind, sigma=0.5, knn_k=3)
    assert kernel.shape == (B, M_POINTS, M_POINTS)
    assert (kernel > 0).all()  # strictly positive, so the KL between rows is finite
    torch.testing.assert_close(kernel.sum(dim=-1), torch.ones(B, M_POINTS))


def test_heat_kernel_takes_epsilon_from_the_mean_distance_of_the_neighborhood_as_the_paper_does():
    points = torch.tensor([[[0.0, 0.0], [3.0, 0.0], [0.0, 4.0]]])  # a 3-4-5 triangle
    epsilon = 2.0 * (3 + 4 + 5) / 3  # sigma · the mean distance over the pairs of distinct points
    by_hand = torch.tensor([[1.0, math.exp(-9 / epsilon), math.exp(-16 / epsilon)],
                            [math.exp(-9 / epsilon), 1.0, math.exp(-25 / epsilon)],
                            [math.exp(-16 / epsilon), math.exp(-25 / epsilon), 1.0]])
    torch.testing.assert_close(neighborhood_kernel(points, "heat", sigma=2.0)[0],
                               by_hand / by_hand.sum(dim=1, keepdim=True))


def test_the_squared_ablation_takes_epsilon_from_the_mean_squared_distance():
    points = torch.tensor([[[0.0, 0.0], [1.0, 0.0], [0.0, 2.0]]])
    squared = torch.tensor([[0.0, 1.0, 4.0], [1.0, 0.0, 5.0], [4.0, 5.0, 0.0]])
    epsilon = 2.0 * squared.sum() / 6  # sigma · mean over the 6 ordered pairs of distinct points
    expected = torch.exp(-squared / epsilon)
    torch.testing.assert_close(neighborhood_kernel(points, "heat_squared", sigma=2.0)[0],
                               expected / expected.sum(dim=1, keepdim=True))


def test_the_papers_heat_kernel_sharpens_as_the_space_grows(hoods):
    small, large = (neighborhood_kernel(scale * hoods, "heat") for scale in (0.5, 2.0))
    diagonal = torch.eye(M_POINTS, dtype=torch.bool).expand(B, -1, -1)
    assert (large[diagonal] > small[diagonal]).all()  # more of each row on the point itself
    torch.testing.assert_close(neighborhood_kernel(0.5 * hoods, "heat_squared"),
                               neighborhood_kernel(2.0 * hoods, "heat_squared"))


def test_binary_knn_kernel_marks_the_k_nearest_including_self():
    points = torch.tensor([[[0.0], [1.0], [3.0], [10.0]]])
    kernel = neighborhood_kernel(points, "knn", knn_k=2)[0]
    expected = torch.tensor([[1, 1, 0, 0], [1, 1, 0, 0], [0, 1, 1, 0], [0, 0, 1, 1]]) / 2
    torch.testing.assert_close(kernel, expected.float())


@pytest.mark.parametrize(("kind", "scale"), [("heat", 1.0), *((kind, scale) for kind in ("heat_squared", "cosine", "knn")
                                                               for scale in (0.1, 1.0, 7.0))])
def test_geometric_term_vanishes_for_a_rotation_with_uniform_scaling(hoods, kind, scale):
    f = AlignmentNetwork(DIM, DIM, "linear").double()
    with torch.no_grad():
        f[0].weight.copy_(scale * rotation(DIM))
        f[0].bias.zero_()
    loss = GeometricLoss(kind, sigma=0.7, knn_k=3)(hoods.double(), f(hoods.double()))
    assert loss.item() == pytest.approx(0.0, abs=1e-10)


@pytest.mark.parametrize("kind", ["heat", "heat_squared", "cosine"])
def test_geometric_term_is_positive_for_a_map_that_is_no_isometry(hoods, kind):
    stretch = torch.diag(torch.logspace(-1, 1, DIM)) @ rotation(DIM)
    assert GeometricLoss(kind)(hoods, hoods @ stretch.T).item() > 1e-4


def test_geometric_term_is_the_mean_kl_divergence_between_kernel_rows(hoods):
    hoods = hoods.double()  # Categorical clamps probabilities at float32's eps, above KERNEL_FLOOR
    aligned = torch.randn(B, M_POINTS, 4, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    p, q = neighborhood_kernel(hoods, "heat", sigma=0.5), neighborhood_kernel(aligned, "heat", sigma=0.5)
    kl = torch.stack([torch.distributions.kl_divergence(torch.distributions.Categorical(probs=p[b, i]),
                                                        torch.distributions.Categorical(probs=q[b, i]))
                      for b in range(B) for i in range(M_POINTS)])
    torch.testing.assert_close(GeometricLoss("heat", sigma=0.5)(hoods, aligned), kl.mean())


def test_knn_geometric_term_counts_the_neighbors_lost():
    line = torch.tensor([[[0.0], [1.0], [3.0], [10.0]]])
    swapped = torch.tensor([[[0.0], [1.0], [10.0], [3.0]]])  # rows 2 and 3 each lose one of 2 neighbors
    loss = GeometricLoss("knn", knn_k=2)
    one_lost = loss(line, swapped).item()
    assert loss(line, line).item() == pytest.approx(0.0, abs=1e-6)
    assert one_lost == pytest.approx(2 / 4 * -math.log(KERNEL_FLOOR) / 2, rel=0.05)


def test_geometric_term_does_not_shrink_with_the_neighborhood_size():
    generator = torch.Generator().manual_seed(5)
    stretch = torch.diag(torch.logspace(-1, 1, DIM)) @ rotation(DIM)
    terms = [GeometricLoss()(points, points @ stretch.T).item()
             for points in (torch.randn(200, m, DIM, generator=generator) for m in (9, 33))]
    assert terms[1] > 0.5 * terms[0]


def test_gera_loss_is_infonce_plus_alpha_times_both_geometric_terms(hoods):
    text = torch.randn(B, M_POINTS, 5, generator=torch.Generator().manual_seed(2))
    fx, gy = torch.randn(B, M_POINTS, 4), torch.randn(B, M_POINTS, 4)
    out = GeRALoss(alpha=0.3, temperature=0.1, learn_temperature=False)(hoods, text, fx, gy)
    contrastive = ClipLoss(0.1, learnable=False)(fx[:, 0], gy[:, 0])
    geo_a, geo_b = GeometricLoss()(hoods, fx), GeometricLoss()(text, gy)
    torch.testing.assert_close(out["contrastive"], contrastive)
    torch.testing.assert_close(out["loss"], contrastive + 0.3 * (geo_a + geo_b))
    torch.testing.assert_close((out["geo_a"], out["geo_b"]), (geo_a, geo_b))


@pytest.mark.parametrize("alpha", [0.0, 1.0])
def test_gradients_reach_both_networks_and_only_alpha_gives_the_geometric_ones(hoods, alpha):
    text = torch.randn(B, M_POINTS, 5)
    f, g = AlignmentNetwork(DIM, 4, "mlp", hidden_dim=8), AlignmentNetwork(5, 4, "linear")
    loss = GeRALoss(alpha=alpha)
    out = loss(hoods, text, f(hoods), g(text))
    out["loss"].backward()
    for network in (f, g):
        assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in network.parameters())
        assert any(p.grad.abs().sum() > 0 for p in network.parameters())
    assert out["geo_a"].requires_grad == (alpha > 0)
    assert loss.contrastive.log_scale.grad is not None


@pytest.mark.parametrize("kind", ["heat", "heat_squared", "cosine"])
def test_geometric_gradient_matches_finite_differences(kind):
    generator = torch.Generator().manual_seed(4)
    points = torch.randn(2, 5, 3, dtype=torch.float64, generator=generator)
    aligned = torch.randn(2, 5, 3, dtype=torch.float64, generator=generator, requires_grad=True)
    assert torch.autograd.gradcheck(lambda x: GeometricLoss(kind, sigma=0.8)(points, x), (aligned,))


# ---------------------------------------------------------------------------------------------
# Neighbor sampling

@pytest.mark.parametrize("strategy", ["nearest", "uniform", "rank"])
def test_sampled_neighbors_are_valid_and_distinct(strategy):
    ranks = sample_neighbors(200, 30, 10, strategy, torch.Generator().manual_seed(0))
    assert ranks.shape == (200, 10) and ranks.dtype == torch.int64
    assert ranks.min() >= 0 and ranks.max() < 30
    assert all(len(set(row.tolist())) == 10 for row in ranks)


def test_nearest_takes_the_first_n():
    ranks = sample_neighbors(3, 30, 4, "nearest", torch.Generator())
    assert ranks.tolist() == [[0, 1, 2, 3]] * 3


def test_rank_biased_sampling_prefers_near_neighbors_and_uniform_does_not():
    generator = torch.Generator().manual_seed(0)
    biased = sample_neighbors(4000, 40, 1, "rank", generator, rank_exponent=1.0).flatten()
    uniform = sample_neighbors(4000, 40, 1, "uniform", generator).flatten()
    weights = 1 / torch.arange(1, 41, dtype=torch.float64)
    expected_first = (weights[0] / weights.sum()).item()  # P(rank 0) for one draw
    assert (biased == 0).double().mean().item() == pytest.approx(expected_first, abs=0.03)
    assert biased.double().mean() < 0.6 * uniform.double().mean()
    assert uniform.double().mean().item() == pytest.approx(19.5, abs=1.5)


def test_sampling_more_than_available_is_refused():
    with pytest.raises(ValueError, match="cannot sample 5 of 4"):
        sample_neighbors(2, 4, 5, "uniform", torch.Generator())
