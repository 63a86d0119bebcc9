"""make_graphed_blocks refuses what it cannot capture, before touching the model (CPU)."""

import pytest
import torch
from timm.models.vision_transformer import VisionTransformer

import fp8vit


def _vit():
    return fp8vit.convert_to_te(VisionTransformer(img_size=32, patch_size=16, embed_dim=64, depth=2, num_heads=4,
                                                  num_classes=3), backend="reference")


def test_needs_a_vit_with_sequential_blocks():
    with pytest.raises(ValueError, match="Linear has no nn.Sequential .blocks."):
        fp8vit.make_graphed_blocks(torch.nn.Linear(4, 4), 8)


def test_needs_the_model_on_a_gpu():
    with pytest.raises(ValueError, match="blocks are on cpu.*model.cuda"):
        fp8vit.make_graphed_blocks(_vit(), 8, fp8=False)


def test_dtype_must_be_an_autocast_dtype():
    with pytest.raises(ValueError, match="dtype=torch.float32"):
        fp8vit.make_graphed_blocks(_vit(), 8, dtype=torch.float32)
