"""``TE_ConvNeXtBlock``: timm's ``ConvNeXtBlock`` (ConvNeXt with its Linear MLP, ``conv_mlp=False``)
with the channels-last norm and MLP as one Transformer Engine ``LayerNormMLP``.

    x [B, C, H, W] --+-- conv_dw (torch: depthwise k x k) -> tokens [B, H*W, C]
                     |   -> mlp: norm fused into fc1 (FP8), GELU, fc2 (FP8) -> gamma -> drop_path
                     +-- (+) x as tokens -> [B, C, H, W] (a channels-last view)

timm permutes the depthwise convolution's output to ``[B, H, W, C]`` for its norm and MLP and
back. Here the residual add happens on the tokens too and the block returns them as a
``[B, C, H, W]`` view in channels-last memory: the next block's convolution takes that (PyTorch
keeps channels-last through it), so from the second block of a stage on, neither permute copies.

Refused (the block stays timm's, with the reason): the 1x1-convolution MLP (``conv_mlp=True``),
ConvNeXt-V2's ``GlobalResponseNormMlp``, a shortcut other than identity, norms TE cannot fuse.
"""

from __future__ import annotations

import copy
import dataclasses
from typing import List, Optional

import torch
from timm.layers import DropPath
from timm.models.convnext import ConvNeXtBlock
from torch import nn

from .base import FP8Block
from .mlp import MlpConfig, build_mlp, mlp_config_from_timm, mlp_ties, norm_in_dtype
from .timm_layers import register_notrace_module, require_timm_class, resolve_norm_module
from .weights import Tie, block_from_timm, load_timm_state, rename, timm_block_of

__all__ = ["TE_ConvNeXtBlock", "ConvNeXtBlockConfig", "convnext_config_from_timm"]


@dataclasses.dataclass(frozen=True)
class ConvNeXtBlockConfig:
    """A timm ``ConvNeXtBlock``'s settings in the form ``TE_ConvNeXtBlock`` builds from.

    Attributes:
        dim: channels ``C``.
        conv_bias: the depthwise convolution has a bias.
        layer_scale: ``gamma`` exists.
        drop_path: stochastic depth rate.
        norm, norm_eps: the norm before the MLP (TE name and eps), fused into fc1.
        mlp: the MLP (``fp8vit.blocks.mlp``).
    """

    dim: int
    conv_bias: bool
    layer_scale: bool
    drop_path: float
    norm: str
    norm_eps: float
    mlp: MlpConfig

    @property
    def fused_mlp(self) -> bool:
        """The MLP is one TE ``LayerNormMLP``."""
        return self.mlp.fused

    def ties(self) -> List[Tie]:
        """The weight layout (:mod:`fp8vit.blocks.weights`): the convolution and ``gamma`` under
        timm's names, timm's ``norm`` fused into fc1."""
        ties = [rename("conv_dw.weight", "conv_dw.weight")]
        ties += [rename("conv_dw.bias", "conv_dw.bias")] if self.conv_bias else []
        ties += [rename("gamma", "gamma")] if self.layer_scale else []
        return ties + mlp_ties(self.mlp, self.norm, timm_norm="norm.", te_norm="norm.")


def convnext_config_from_timm(block: nn.Module, *, exact_gelu: bool = False) -> ConvNeXtBlockConfig:
    """Read the settings of a built timm ``ConvNeXtBlock``.

    Raises:
        ValueError: a part of the block TE_ConvNeXtBlock does not implement, named.
    """
    require_timm_class(block, (ConvNeXtBlock,), "TE_ConvNeXtBlock")
    if block.use_conv_mlp:
        raise ValueError("ConvNeXtBlock with conv_mlp=True (1x1-convolution MLP on [B, C, H, W]) cannot be converted "
                         "to TE_ConvNeXtBlock: it fuses the Linear MLP of conv_mlp=False")
    if not isinstance(block.shortcut, nn.Identity):
        raise ValueError(f"ConvNeXtBlock with a {type(block.shortcut).__name__} shortcut (another width or a stride) "
                         "cannot be converted to TE_ConvNeXtBlock: only the identity shortcut")
    if not isinstance(block.drop_path, (nn.Identity, DropPath)) or (
            isinstance(block.drop_path, DropPath) and not block.drop_path.scale_by_keep):
        raise ValueError("ConvNeXtBlock with a drop path other than timm's DropPath(scale_by_keep=True) cannot be "
                         "converted to TE_ConvNeXtBlock")
    norm, eps = resolve_norm_module(block.norm)
    dim = block.norm.weight.shape[0]
    mlp = mlp_config_from_timm(block.mlp, exact_gelu=exact_gelu)
    dp = block.drop_path.drop_prob if isinstance(block.drop_path, DropPath) else 0.0
    return ConvNeXtBlockConfig(dim=dim, conv_bias=block.conv_dw.bias is not None, layer_scale=block.gamma is not None,
                               drop_path=float(dp), norm=norm, norm_eps=eps, mlp=mlp)


class TE_ConvNeXtBlock(FP8Block):  # noqa: N801 - named like TE_Block
    """timm's ``ConvNeXtBlock`` with its norm and MLP on Transformer Engine, built from a timm
    block (:meth:`from_timm`).

    Same contract as the other fp8vit blocks: weights exact both ways (:meth:`from_timm` /
    :meth:`to_timm`), any batch under FP8, activation checkpointing, MLP recompute, FP8 off per
    block. Input and output ``[B, C, H, W]``, as timm's (the output a channels-last view).

    Args:
        cfg: the block's settings (:func:`convnext_config_from_timm`).
        timm_skeleton: the timm block on the meta device (its convolution's shape, and what
            :meth:`to_timm` builds).
        device, dtype, backend, fp32_residual: as ``TE_EvaBlock``'s.

    Raises:
        TypeError: ``cfg`` is not a :class:`ConvNeXtBlockConfig`, ``timm_skeleton`` not a module,
            or the other arguments of the wrong type.
        ValueError: an unknown ``backend``, a bad ``device`` or ``dtype``.
    """

    def __init__(self, cfg: ConvNeXtBlockConfig, *, timm_skeleton: nn.Module, device=None,
                 dtype: Optional[torch.dtype] = None, backend: Optional[str] = None,
                 fp32_residual: bool = False) -> None:
        m, dd, tdd = self._init_from_skeleton(cfg, ConvNeXtBlockConfig,
                                              "a fp8vit ConvNeXtBlockConfig (convnext_config_from_timm)", timm_skeleton,
                                              device=device, dtype=dtype, backend=backend, fp32_residual=fp32_residual)
        self.conv_dw = copy.deepcopy(timm_skeleton.conv_dw).to_empty(device=tdd["device"])  # torch's convolution
        if dtype is not None:
            self.conv_dw.to(dtype)
        built = build_mlp(cfg.mlp, cfg.norm, cfg.norm_eps, m, dd, tdd)
        self.norm = built.norm  # None: the norm is fused into fc1
        self.mlp = built.mlp
        self.gamma = nn.Parameter(torch.ones(cfg.dim, **tdd)) if cfg.layer_scale else None
        self.drop_path = DropPath(cfg.drop_path) if cfg.drop_path > 0 else nn.Identity()

    # ------------------------------------------------------------------ timm interop
    @classmethod
    def from_timm(cls, block: nn.Module, *, exact_gelu: bool = False, backend: Optional[str] = None,
                  fp32_residual: bool = False) -> "TE_ConvNeXtBlock":
        """A ``TE_ConvNeXtBlock`` with the settings, weights, device, dtype, ``requires_grad``
        flags and mode of a timm ``ConvNeXtBlock``.

        Raises:
            ValueError: a part of ``block`` that TE_ConvNeXtBlock does not implement, named.
        """
        cfg = convnext_config_from_timm(block, exact_gelu=exact_gelu)
        return block_from_timm(cls, block, cfg, block.norm.weight, backend=backend, fp32_residual=fp32_residual)

    def load_timm_state_dict(self, sd) -> None:
        """Load a timm ``ConvNeXtBlock`` state dict (keys relative to the block) exactly.

        Raises:
            ValueError: keys that do not match this block's configuration, listed.
        """
        load_timm_state(self, sd)

    def to_timm(self) -> nn.Module:
        """The equivalent timm ``ConvNeXtBlock`` (same weights, device, dtype, ``requires_grad``
        flags, mode). FP8 scaling state is dropped."""
        return timm_block_of(self, self.conv_dw.weight)

    # ------------------------------------------------------------------ forward
    @torch.compiler.disable  # as TE_Block.forward: the blocks run outside dynamo
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Args:
            x: ``[B, C, H, W]``, as timm's block takes it (any memory format).

        Returns:
            ``[B, C, H, W]`` in channels-last memory, in the autocast dtype under autocast unless
            ``fp32_residual``.
        """
        if x.dim() != 4 or x.shape[1] != self.cfg.dim:
            raise ValueError(f"TE_ConvNeXtBlock expects x of shape [B, {self.cfg.dim}, H, W], got {tuple(x.shape)}")
        return self._dispatch(x)

    def _forward(self, x: torch.Tensor, mult: int, gelu_gemm: bool) -> torch.Tensor:
        B, C, H, W = x.shape
        # Channels-last first (a stage's first block gets NCHW from the stem or the downsample; one
        # copy, none for the later blocks): on NCHW, torch runs the depthwise conv as its own
        # generic kernel, ~3.8 ms fwd+bwd per block at ConvNeXt-B stage 1, batch 128 on the H200
        # (cuDNN's NHWC kernels: ~0.5 ms); the token views below are then free.
        x = x.contiguous(memory_format=torch.channels_last)
        y = self.conv_dw(x)  # [B, C, H, W]; channels-last in, channels-last out
        tokens = y.permute(0, 2, 3, 1).reshape(B, H * W, C)  # [B, H*W, C], a view
        h = tokens if self.norm is None else norm_in_dtype(self.norm, tokens)
        h = self._run_mlp(self.mlp, h, mult, gelu_gemm)
        shortcut = self._stream(x.permute(0, 2, 3, 1).reshape(B, H * W, C))
        out = self._add_branch(shortcut, h, self.gamma, self.drop_path)  # [B, H*W, C]
        return out.view(B, H, W, C).permute(0, 3, 1, 2)  # [B, C, H, W], channels-last memory

    def extra_repr(self) -> str:
        c = self.cfg
        return (f"dim={c.dim}, kernel={tuple(self.conv_dw.kernel_size)}, mlp={c.mlp.describe()}, "
                f"norm={c.norm}(eps={c.norm_eps}), backend={self.backend}")


# A TE_ConvNeXtBlock is one leaf for timm's FX feature extraction (TE's modules cannot be traced).
register_notrace_module(TE_ConvNeXtBlock)
