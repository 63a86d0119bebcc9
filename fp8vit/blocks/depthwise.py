"""Small depthwise convolutions as sums of shifted products under ``torch.compile`` (lever 47).

A depthwise ``k x k`` convolution (one filter per channel) reads each input pixel ``k*k`` times and
does ``k*k`` multiply-adds per output: its work is memory-bound. Under ``torch.compile`` Inductor
hands it to cuDNN as an opaque call, channels-last: at ViTamin-L/224 batch 64 the six 3x3 depthwise
convolutions of its conv stages take 7.1 ms a step on an H100, forward and backward, about twice
what their bytes need (docs/results/levers/depthwise_conv_vitamin_l_h100.log; NCHW is 4x slower).
Written as ``k*k`` shifted slices of the zero-padded input, each times its channel's weight, the
convolution is plain tensor arithmetic that Inductor fuses into one pointwise kernel (with the bias
and the activation after it), and its backward into a pointwise kernel for the input gradient and
reductions for the weight gradient.

The arithmetic is the convolution's under autocast: input and weight rounded to the autocast dtype,
products summed in fp32, the output in the autocast dtype (outside autocast: the input's dtype);
only the order of the fp32 sums differs. Eager calls, and shapes it does not cover, run the
``Conv2d`` it was: in eager the ``k*k`` slices would each be a kernel of their own.
"""

from __future__ import annotations

from typing import List, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from .timm_layers import register_notrace_module

__all__ = ["ShiftedDepthwiseConv2d", "depthwise_shifted", "depthwise_convs", "set_depthwise_shifts", "MAX_TAPS"]

MAX_TAPS = 9  # kernels up to 3x3 (ViTamin's); larger ones (ConvNeXt's 7x7) are not measured
_HALF = (torch.bfloat16, torch.float16)


def depthwise_shifted(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                      stride: Tuple[int, int], padding: Tuple[int, int]) -> torch.Tensor:
    """``F.conv2d(x, weight, bias, stride, padding, groups=C)`` as ``kh*kw`` shifted products.

    Args:
        x: ``[B, C, H, W]``, any memory format.
        weight: ``[C, 1, kh, kw]``: one filter per channel.
        bias: ``[C]`` or None.
        stride: ``(sh, sw)``.
        padding: ``(ph, pw)`` zeros on each side.

    Returns:
        ``[B, C, OH, OW]`` in the autocast dtype under 16-bit autocast, else in ``x``'s dtype.
    """
    dtype = x.dtype
    if torch.is_autocast_enabled(x.device.type) and torch.get_autocast_dtype(x.device.type) in _HALF:
        dtype = torch.get_autocast_dtype(x.device.type)  # what autocast's conv2d computes in
    b, c, h, w = x.shape
    kh, kw = weight.shape[-2:]
    (sh, sw), (ph, pw) = stride, padding
    oh, ow = (h + 2 * ph - kh) // sh + 1, (w + 2 * pw - kw) // sw + 1
    with torch.autocast(x.device.type, enabled=False):
        xp = F.pad(x.to(dtype), (pw, pw, ph, ph))
        wf = weight.to(dtype).float().view(c, kh * kw)  # rounded as autocast rounds it, summed in fp32
        out = None
        for i in range(kh):
            for j in range(kw):
                # the input pixels that tap (i, j) of every output pixel reads: [B, C, OH, OW]
                tap = xp[:, :, i:i + sh * (oh - 1) + 1:sh, j:j + sw * (ow - 1) + 1:sw].float()
                term = tap * wf[:, i * kw + j].view(1, c, 1, 1)
                out = term if out is None else out + term
        if bias is not None:
            out = out + bias.to(dtype).float().view(1, c, 1, 1)
        return out.to(dtype)


class ShiftedDepthwiseConv2d(nn.Conv2d):
    """A depthwise ``nn.Conv2d`` that runs as :func:`depthwise_shifted` under ``torch.compile``.

    Not built directly: :func:`set_depthwise_shifts` turns a model's small depthwise convolutions
    into one in place (their class only: the same parameters, hooks and state dict keys) and back.
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling() and x.dim() == 4:
            return depthwise_shifted(x, self.weight, self.bias, self.stride, self.padding)
        return super().forward(x)


def _shiftable(conv: nn.Module) -> bool:
    """A plain depthwise ``Conv2d`` (channel multiplier 1, zero padding given as numbers, no
    dilation) of at most :data:`MAX_TAPS` taps."""
    return (type(conv) in (nn.Conv2d, ShiftedDepthwiseConv2d) and conv.groups == conv.in_channels == conv.out_channels
            and conv.groups > 1 and conv.padding_mode == "zeros" and not isinstance(conv.padding, str)
            and tuple(conv.dilation) == (1, 1) and conv.kernel_size[0] * conv.kernel_size[1] <= MAX_TAPS)


def depthwise_convs(model: nn.Module) -> List[str]:
    """The names of ``model``'s convolutions that :func:`set_depthwise_shifts` switches."""
    return [name for name, m in model.named_modules() if _shiftable(m)]


def set_depthwise_shifts(model: nn.Module, enable: bool = True) -> List[str]:
    """Switch ``model``'s small depthwise convolutions (:func:`depthwise_convs`) to
    :class:`ShiftedDepthwiseConv2d` (``enable``) or back to ``nn.Conv2d``; returns their names."""
    names = depthwise_convs(model)
    for name in names:
        model.get_submodule(name).__class__ = ShiftedDepthwiseConv2d if enable else nn.Conv2d
    return names


# A leaf for timm's FX feature extraction, as the Conv2d it was: its forward branches on compiling.
register_notrace_module(ShiftedDepthwiseConv2d)
