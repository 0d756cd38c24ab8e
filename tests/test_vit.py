"""The maskable ViT: mask token, token outputs, position-embedding interpolation, save and load."""

from __future__ import annotations

import pytest
import torch

from repsim.errors import SpecError
from repsim.models import load_encoder, save_encoder, vit


def tokens_entering_the_blocks(network, images: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """The (B, 1 + P, D) tokens the first encoder block receives (embeddings + position)."""
    seen = []
    handle = network.encoder.layers.register_forward_pre_hook(lambda module, inputs: seen.append(inputs[0]))
    try:
        network.forward_tokens(images, mask)
    finally:
        handle.remove()
    return seen[0]


def test_the_masked_forward_replaces_exactly_the_masked_patches():
    torch.manual_seed(0)
    network = vit("tiny", image_size=16, patch_size=4, depth=1, in_channels=1).eval()
    with torch.no_grad():
        network.mask_token.normal_()
    images = torch.randn(2, 1, 16, 16)
    mask = torch.zeros(2, 16, dtype=torch.bool)
    mask[0, [0, 5, 15]] = True
    mask[1, 7] = True
    plain = tokens_entering_the_blocks(network, images, None)
    masked = tokens_entering_the_blocks(network, images, mask)
    changed = (plain != masked).any(dim=2)
    assert not changed[:, 0].any()  # the [CLS] token
    assert torch.equal(changed[:, 1:], mask)
    position = network.encoder.pos_embedding[0, 1:]
    torch.testing.assert_close(masked[0, 1:][mask[0]], network.mask_token[0] + position[mask[0]])


def test_tokens_and_features_have_the_documented_shapes():
    network = vit("tiny", image_size=28, patch_size=4, depth=2, in_channels=1)
    cls, patches = network.forward_tokens(torch.randn(3, 1, 28, 28))
    assert cls.shape == (3, 192) and patches.shape == (3, 49, 192)
    assert network(torch.randn(3, 1, 28, 28)).shape == (3, network.feature_dim) and network.feature_dim == 192
    assert vit("small", image_size=32, patch_size=16, depth=1).feature_dim == 384


def test_smaller_and_non_square_inputs_get_an_interpolated_position_embedding():
    network = vit("tiny", image_size=28, patch_size=4, depth=1, in_channels=3)
    assert network.position_embedding(7, 7) is network.encoder.pos_embedding
    assert network.forward_tokens(torch.randn(2, 3, 12, 12))[1].shape == (2, 9, 192)
    assert network.forward_tokens(torch.randn(2, 3, 28, 16))[1].shape == (2, 28, 192)
    grid = network.position_embedding(14, 14)[0, 1:].reshape(14, 14, -1)
    assert grid.shape == (14, 14, 192) and not torch.equal(grid[0, 0], grid[13, 13])


def test_a_saved_vit_loads_with_the_same_outputs(tmp_path):
    network = vit("tiny", image_size=16, patch_size=4, depth=2, in_channels=1).eval()
    save_encoder(network, tmp_path / "encoder.pt")
    loaded = load_encoder(tmp_path)
    images = torch.randn(2, 1, 16, 16)
    with torch.no_grad():
        torch.testing.assert_close(loaded(images), network(images))
    assert loaded.recipe == network.recipe and loaded.feature_dim == 192


def test_bad_settings_are_one_line_errors():
    with pytest.raises(SpecError, match="patch size of 5 does not divide the image size 28"):
        vit("tiny", image_size=28, patch_size=5)
    with pytest.raises(SpecError, match="unknown ViT preset 'huge'"):
        vit("huge")
    with pytest.raises(ValueError, match="mask is"):
        vit("tiny", image_size=8, patch_size=4, depth=1).forward_tokens(torch.randn(1, 3, 8, 8),
                                                                         torch.zeros(1, 5, dtype=torch.bool))


def test_a_method_that_does_not_mask_trains_a_vit_under_distributed_data_parallel(tmp_path):
    """Only a masking method turns the mask token's gradient on: a parameter no loss reaches would stop
    DistributedDataParallel at its second step."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    network = vit("tiny", image_size=16, patch_size=4, depth=1, in_channels=1)
    assert not network.mask_token.requires_grad
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'rendezvous'}", rank=0, world_size=1)
    try:
        model = DistributedDataParallel(network)
        for _ in range(2):
            model(torch.randn(2, 1, 16, 16)).sum().backward()
    finally:
        dist.destroy_process_group()
