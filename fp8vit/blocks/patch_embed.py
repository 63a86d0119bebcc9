"""The patch embedding's convolution as one GEMM (``PatchGemmConv2d``), for ``set_patch_gemm``.

A ViT's patch embedding is a ``Conv2d`` whose kernel equals its stride: every output pixel is one
patch times the weight, i.e. ``[B*N, C*p*q] @ [C*p*q, D]``. Under bf16 autocast on an H200, cuDNN
runs it as an NHWC implicit GEMM after converting the NCHW images (and, in the backward, the images
and the output gradient) to NHWC: ViT-B/16 at batch 128 spent 2.3 ms of its 27.7 ms of kernels in
the convolution, its layout conversions and its gradient
(docs/results/profile/vit_base_patch16_224_b128_fp8vit-fp8-delayed-graphed_h200.kernels.txt).
Here the images are cut into patches by one cast-and-permute copy and multiplied by the weight in
one GEMM (its transpose-GEMM in the backward; no input gradient for images).

The result is the convolution's, up to the order of the fp32 accumulation, and in its shape
``[B, D, H/p, W/q]``, laid out channels-last (a view of the GEMM's ``[B, N, D]``), so that
timm's ``flatten(2).transpose(1, 2)`` after it is a view too. Only under autocast to a 16-bit
dtype: in fp32 cuDNN may run TF32 (``torch.backends.cudnn.allow_tf32``) and a GEMM not, so an fp32
model would stop matching timm's. Otherwise, and for shapes the GEMM does not cover (an image
not a whole number of patches), it is the ``Conv2d`` it was.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from .timm_layers import register_notrace_module

__all__ = ["PatchGemmConv2d", "patchifies"]

_HALF = (torch.bfloat16, torch.float16)


def patchifies(conv: nn.Module) -> bool:
    """True if ``conv`` is a plain ``Conv2d`` (or a :class:`PatchGemmConv2d`) that cuts its input
    into patches: kernel == stride, no padding or dilation, one group."""
    return (type(conv) in (nn.Conv2d, PatchGemmConv2d)
            and tuple(conv.kernel_size) == tuple(conv.stride) and conv.groups == 1
            and tuple(conv.dilation) == (1, 1) and not isinstance(conv.padding, str)
            and tuple(conv.padding) == (0, 0))


class PatchGemmConv2d(nn.Conv2d):
    """A patchifying ``nn.Conv2d`` run as one GEMM under 16-bit autocast (module docstring).

    Not built directly: ``set_patch_gemm`` turns a model's patch-embedding ``Conv2d`` into one in
    place (its class only: the same parameters, hooks and state dict keys) and back.
    """

    def _gemm_dtype(self, x: torch.Tensor) -> Optional[torch.dtype]:
        """The autocast dtype this call runs the GEMM in, or None: run the convolution."""
        dev = x.device.type
        if x.dim() != 4 or x.is_meta or not torch.is_autocast_enabled(dev):  # meta: no autocast to ask
            return None
        dtype = torch.get_autocast_dtype(dev)
        p, q = self.kernel_size
        if dtype not in _HALF or x.shape[-2] % p or x.shape[-1] % q:
            return None
        return dtype

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = self._gemm_dtype(x)
        if dtype is None:
            return super().forward(x)
        b, c, h, w = x.shape
        p, q = self.kernel_size
        hp, wp = h // p, w // q
        # [B, C, hp, p, wp, q] -> [B, hp, wp, C, p, q]: each patch in the weight's (C, p, q) order,
        # cast to the autocast dtype in the same copy (one kernel)
        patches = torch.empty((b, hp, wp, c, p, q), dtype=dtype, device=x.device)
        patches.copy_(x.view(b, c, hp, p, wp, q).permute(0, 2, 4, 1, 3, 5))
        # [B, N, C*p*q] @ [C*p*q, D] -> [B, N, D]; autocast casts the weight and bias
        out = F.linear(patches.view(b, hp * wp, c * p * q), self.weight.view(self.out_channels, -1), self.bias)
        # the convolution's [B, D, hp, wp], channels-last: a view
        return out.view(b, hp, wp, self.out_channels).permute(0, 3, 1, 2)


# One leaf for timm's FX feature extraction, as the Conv2d it was: its forward branches on autocast.
register_notrace_module(PatchGemmConv2d)
