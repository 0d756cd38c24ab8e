"""Backbones and heads: shapes, the small-image stem, gradients, saving and loading encoders."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from repsim.errors import SpecError, StageError
from repsim.models import ProjectionMLP, backbone, load_encoder, resnet, save_encoder, vit
from repsim.models.backbones import start_from


@pytest.mark.parametrize("channels", [1, 3])
@pytest.mark.parametrize("small_images", [True, False])
def test_resnet_returns_pooled_features(channels, small_images):
    encoder = resnet("resnet18", small_images=small_images, in_channels=channels)
    features = encoder(torch.randn(2, channels, 28, 28))
    assert encoder.feature_dim == 512 and features.shape == (2, 512)


def test_resnet50_features_are_2048_wide():
    encoder = resnet("resnet50", small_images=True, in_channels=1)
    assert encoder.feature_dim == 2048 and encoder(torch.randn(2, 1, 8, 8)).shape == (2, 2048)


def test_small_stem_keeps_the_resolution_through_the_stem():
    def stem_output(encoder: nn.Module) -> torch.Size:
        x = torch.randn(1, 1, 28, 28)
        return encoder.maxpool(encoder.relu(encoder.bn1(encoder.conv1(x)))).shape
    assert stem_output(resnet("resnet18", small_images=True, in_channels=1)) == (1, 64, 28, 28)
    assert stem_output(resnet("resnet18", small_images=False, in_channels=1)) == (1, 64, 7, 7)


def test_unknown_backbone_names_the_choices():
    with pytest.raises(SpecError, match="unknown backbone 'resnet19'; use one of resnet18"):
        resnet("resnet19")


@pytest.mark.parametrize("layers", [1, 2, 3])
def test_projection_shapes_and_blocks(layers):
    head = ProjectionMLP(16, 32, 8, layers=layers)
    assert head(torch.randn(4, 16)).shape == (4, 8) and head.out_dim == 8
    assert sum(isinstance(m, nn.Linear) for m in head) == layers
    assert sum(isinstance(m, nn.BatchNorm1d) for m in head) == layers - 1
    assert isinstance(head[-1], nn.Linear) and head[-1].bias is not None  # nothing after the last linear


def test_gradients_reach_every_parameter():
    encoder = resnet("resnet18", small_images=True, in_channels=3)
    head = ProjectionMLP(encoder.feature_dim, 32, 8)
    head(encoder(torch.randn(4, 3, 12, 12))).pow(2).sum().backward()
    for module in (encoder, head):
        assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in module.parameters())


def test_saved_encoder_loads_without_the_training_config(tmp_path):
    encoder = resnet("resnet18", small_images=True, in_channels=1).eval()
    save_encoder(encoder, tmp_path / "encoder.pt", image_size=12)
    loaded = load_encoder(tmp_path)
    x = torch.randn(2, 1, 12, 12)
    assert not loaded.training and loaded.feature_dim == 512
    assert torch.equal(loaded(x), encoder(x))
    with pytest.raises(StageError, match="no encoder at"):
        load_encoder(tmp_path / "missing")


@pytest.mark.parametrize("network", [resnet("resnet18", small_images=False, in_channels=1), vit("tiny", 16, 4, 2, 1)],
                         ids=["resnet", "vit"])
def test_a_saved_encoder_is_a_program_that_runs_without_repsim_at_any_batch_size(network, tmp_path):
    save_encoder(network, tmp_path / "encoder.pt", image_size=16)
    with open(tmp_path / "encoder.pt", "rb") as handle:
        program = torch.export.load(handle).module()  # what mlflow.pytorch.load_model runs
    network.eval()
    for batch in (1, 5):
        images = torch.randn(batch, 1, 16, 16)
        torch.testing.assert_close(program(images), network(images))
    weights = sum(value.numel() * value.element_size() for value in network.state_dict().values())
    assert (tmp_path / "encoder.pt").stat().st_size < 1.05 * weights + 2**16  # the weights once, and a small graph


def test_an_encoder_saved_as_a_dict_of_recipe_and_weights_still_loads(tmp_path):
    encoder = vit("tiny", 16, 4, 1, 1).eval()
    torch.save({"recipe": encoder.recipe, "feature_dim": encoder.feature_dim, "state_dict": encoder.state_dict()},
               tmp_path / "encoder.pt")  # the format of stage outputs written before the archive
    images = torch.randn(3, 1, 16, 16)
    torch.testing.assert_close(load_encoder(tmp_path)(images), encoder(images))


def test_a_backbone_starts_from_a_saved_encoder_of_its_recipe(tmp_path):
    trained = vit("tiny", 28, 7, 2, 1)
    save_encoder(trained, tmp_path / "encoder.pt")
    started = backbone("vit_tiny", 1, 28, patch_size=7, depth=2, init=tmp_path)
    assert all(torch.equal(a, b) for a, b in zip(started.state_dict().values(), trained.state_dict().values()))
    assert not torch.equal(backbone("vit_tiny", 1, 28, patch_size=7, depth=2).conv_proj.weight,
                           trained.conv_proj.weight)


def test_starting_from_an_encoder_of_another_recipe_names_both(tmp_path):
    save_encoder(vit("tiny", 28, 7, 3, 1), tmp_path / "encoder.pt")
    with pytest.raises(SpecError) as raised:
        start_from(vit("tiny", 28, 7, 2, 1), tmp_path / "encoder.pt")
    message = str(raised.value)
    assert "'depth': 3" in message and "'depth': 2" in message and "\n" not in message


def test_an_unreadable_or_foreign_file_is_refused_in_one_line(tmp_path):
    (tmp_path / "garbage.pt").write_bytes(b"not a checkpoint")
    torch.save({"model": {}}, tmp_path / "checkpoint.pt")
    with pytest.raises(StageError, match=r"^cannot load encoder .*garbage.pt \(") as unreadable:
        start_from(vit("tiny", 28, 7, 2, 1), tmp_path / "garbage.pt")
    with pytest.raises(StageError, match="checkpoint.pt holds no encoder recipe and weights") as foreign:
        load_encoder(tmp_path / "checkpoint.pt")
    assert "\n" not in str(unreadable.value) + str(foreign.value)
