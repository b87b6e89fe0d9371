"""Model factory: own models, timm, torchvision, and a clear error for unknown names."""
import pytest
import torch

from lightning_fastscale.models import create_model


@pytest.mark.parametrize("name", ["resnet_small", "resnet20", "resnet18", "torchvision.resnet18"])
def test_builds_with_num_classes(name):
    model = create_model(name, num_classes=7)
    assert model(torch.randn(2, 3, 32, 32)).shape == (2, 7)


def test_linear_probe_matches_resolution():
    assert create_model("linear", 5, resolution=24)(torch.randn(3, 3, 24, 24)).shape == (3, 5)


def test_unknown_model_is_named():
    with pytest.raises(ValueError, match="no_such_net"):
        create_model("no_such_net", 10)

