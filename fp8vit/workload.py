"""The training workload shared by ``examples/train_vit.py`` and ``fp8vit-bench``.

A timm ViT (any timm name, or the sizes below), random init, one precision variant:

=============  ==========================================================
``bf16``       timm's blocks under bf16 autocast (the baseline)
``te-bf16``    fp8vit ``TE_Block``s, bf16 autocast, FP8 off
``fp8``        fp8vit ``TE_Block``s in ``fp8_context(recipe)``
=============  ==========================================================
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch import nn

from .context import fp8_context
from .convert import convert_to_te

__all__ = ["SIZES", "PRECISIONS", "build_model", "make_optimizer", "train_step_fn", "synthetic_batch", "train_flops",
           "Workload"]

# ViT sizes by short name: (embed_dim, depth, num_heads). Patch 16, 224 px.
SIZES = {
    "tiny": (192, 12, 3), "small": (384, 12, 6), "base": (768, 12, 12),
    "large": (1024, 24, 16), "huge": (1280, 32, 16),
    "micro": (64, 2, 4),  # CPU smoke tests
}
PRECISIONS = ("bf16", "te-bf16", "fp8")


@dataclasses.dataclass
class Workload:
    """A built model and its step settings."""

    model: nn.Module
    precision: str
    recipe: Optional[str]
    img_size: int
    num_classes: int


def build_model(model: str = "huge", *, precision: str = "fp8", recipe: Optional[str] = None,
                img_size: int = 224, num_classes: int = 1000, device: str = "cuda",
                backend: Optional[str] = None) -> Workload:
    """A randomly initialised timm ViT for ``precision``.

    Args:
        model: a key of :data:`SIZES` or any timm model name (``vit_base_patch16_224``, ...).
        precision: one of :data:`PRECISIONS`.
        recipe: FP8 recipe name for ``precision="fp8"`` (None: the GPU's default).
        img_size: input resolution.
        num_classes: classifier width.
        device: where to build it.
        backend: TE_Block backend (None: automatic).
    """
    import timm
    from timm.models.vision_transformer import VisionTransformer

    if precision not in PRECISIONS:
        raise ValueError(f"precision={precision!r}; choose one of {PRECISIONS}")
    if model in SIZES:
        dim, depth, heads = SIZES[model]
        net = VisionTransformer(img_size=img_size, patch_size=16, embed_dim=dim, depth=depth,
                                num_heads=heads, num_classes=num_classes)
    else:
        net = timm.create_model(model, pretrained=False, img_size=img_size, num_classes=num_classes)
    net = net.to(device)
    if precision != "bf16":
        convert_to_te(net, backend=backend)
    return Workload(net, precision, recipe, img_size, num_classes)


def make_optimizer(params, name: str = "sgd", *, lr: float, device: str = "cuda") -> torch.optim.Optimizer:
    """SGD with momentum 0.9 or AdamW, fused (one kernel per step) on CUDA.

    Args:
        params: the parameters to optimize.
        name: ``"sgd"`` or ``"adamw"``.
        lr: learning rate.
        device: ``"cuda"`` enables the fused implementation.
    """
    fused = device == "cuda"
    if name == "sgd":
        return torch.optim.SGD(params, lr=lr, momentum=0.9, fused=fused)
    if name == "adamw":
        return torch.optim.AdamW(params, lr=lr, fused=fused)
    raise ValueError(f"optimizer={name!r}; choose 'sgd' or 'adamw'")


def synthetic_batch(batch: int, wl: Workload, device: str = "cuda", seed: int = 0):
    """Images ``[B, 3, H, W]`` and labels ``[B]`` generated on ``device`` (no input pipeline)."""
    g = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(batch, 3, wl.img_size, wl.img_size, device=device, generator=g)
    y = torch.randint(0, wl.num_classes, (batch,), device=device, generator=g)
    return x, y


def train_step_fn(wl: Workload, optimizer: torch.optim.Optimizer,
                  model: Optional[Callable] = None) -> Callable:
    """``step(x, y) -> loss``: forward in the workload's precision, backward, optimizer step.

    Args:
        wl: the workload.
        optimizer: over ``wl.model``'s parameters.
        model: callable to run instead of ``wl.model`` (e.g. its ``torch.compile``d version).
    """
    net = model if model is not None else wl.model
    fp8 = wl.precision == "fp8"

    def step(x, y):
        with fp8_context(wl.recipe, enabled=fp8):
            loss = F.cross_entropy(net(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.detach()

    return step


def train_flops(model: nn.Module, batch: int, img_size: int) -> float:
    """Model FLOPs of one training step (forward + backward = 3x forward), GEMMs and attention.

    Per block and token: ``2 * (3C^2 + C^2 + 2 * C * hidden)`` for qkv, proj and the MLP, plus
    ``4 * N * C`` for the two attention matmuls; the patch embedding and head are added.
    """
    pe = model.patch_embed
    n_patches = (img_size // pe.patch_size[0]) * (img_size // pe.patch_size[1])
    tokens = n_patches + getattr(model, "num_prefix_tokens", 1)
    dim = model.embed_dim
    per_token = 0.0
    for blk in model.blocks:
        hidden = blk.cfg.mlp_hidden if hasattr(blk, "cfg") else blk.mlp.fc1.out_features
        per_token += 2 * (4 * dim * dim + 2 * dim * hidden) + 4 * tokens * dim
    fwd = batch * tokens * per_token
    fwd += batch * n_patches * 2 * dim * 3 * pe.patch_size[0] * pe.patch_size[1]
    head = getattr(model, "head", None)
    if isinstance(head, nn.Linear):
        fwd += batch * 2 * head.in_features * head.out_features
    return 3 * fwd
