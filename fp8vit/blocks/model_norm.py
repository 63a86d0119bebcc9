"""A model's own LayerNorms (timm's final ``norm``, ``fc_norm``, ``norm_pre``) under autocast as one
Triton pass each way, for ``convert_to_te``.

Autocast runs torch's LayerNorm in fp32: after fp8vit's blocks the bf16 residual stream
``[B, N, C]`` is copied to fp32, normalized with fp32 weights into an fp32 output, and the backward
takes an fp32 input-gradient kernel, a separate weight-gradient reduction and a cast back to bf16.
At ViT-B/16 batch 128 that is about 0.35 ms a step on an H100 (the final norm over all 197 tokens;
lever 45 of docs/performance.md). Here the norm reads the bf16 stream as it is and writes autocast's
fp32 output in one pass (:class:`fp8vit.blocks.mlp.PaddedNorm`, nothing padded, fp32 weights), and
its backward writes the bf16 input gradient and fp32 weight-gradient partial sums in one more: the
same arithmetic as autocast's norm (fp32 statistics and affine on the exact bf16 inputs), up to the
order of the sums, and the same output dtype, so the model's outputs stay timm's.

Only there: a contiguous CUDA input under 16-bit autocast where Triton runs (fp32 inputs too: a
``norm_pre`` after timm's fp32 position embedding, or ``fp32_residual=True``; the backward then
still saves the weight-gradient reduction), outside ``torch.compile`` (which fuses the norm itself).
Otherwise, and with ``FP8VIT_TRITON=0``, it is the LayerNorm it was.
"""

from __future__ import annotations

from typing import Dict, Type

import torch
from timm.layers import LayerNorm as TimmLayerNorm
from torch import nn

from .._te.kernels import triton_support
from .mlp import PaddedNorm
from .timm_layers import register_notrace_module

__all__ = ["AutocastLayerNorm", "AutocastTimmLayerNorm", "MODEL_NORMS", "model_norms", "set_model_norms"]

# The model-level norm slots of timm's ViT-family models (VisionTransformer, Eva, Beit, ...).
MODEL_NORMS = ("norm_pre", "norm", "fc_norm")
_FLOATS = (torch.bfloat16, torch.float16, torch.float32)


class _AutocastNorm:
    """The forward of :class:`AutocastLayerNorm` and :class:`AutocastTimmLayerNorm`."""

    def _kernel_runs(self, x: torch.Tensor) -> bool:
        return (x.is_cuda and torch.is_autocast_enabled("cuda")
                and torch.get_autocast_dtype("cuda") in (torch.bfloat16, torch.float16)
                and not torch.compiler.is_compiling() and x.dtype in _FLOATS and x.is_contiguous()
                and x.dim() >= 2 and tuple(self.normalized_shape) == (x.shape[-1],)
                and self.weight is not None and triton_support().ok)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._kernel_runs(x):
            # fp32 out, as autocast's LayerNorm: the model's outputs and their dtype stay timm's
            return PaddedNorm.apply(x, self.weight, self.bias, x.shape[-1], self.eps, False, torch.float32)
        return super().forward(x)


class AutocastLayerNorm(_AutocastNorm, nn.LayerNorm):
    """An ``nn.LayerNorm`` whose forward under 16-bit autocast is one Triton pass each way (module
    docstring). Not built directly: :func:`set_model_norms` turns a model's norms into one in place
    (their class only: the same parameters, hooks and state dict keys) and back."""


class AutocastTimmLayerNorm(_AutocastNorm, TimmLayerNorm):
    """timm's ``LayerNorm`` (without its fast-norm option), as :class:`AutocastLayerNorm`."""


_TO_KERNEL: Dict[Type[nn.Module], Type[nn.Module]] = {nn.LayerNorm: AutocastLayerNorm,
                                                      TimmLayerNorm: AutocastTimmLayerNorm}
_BACK = {v: k for k, v in _TO_KERNEL.items()}


def model_norms(model: nn.Module) -> Dict[str, nn.Module]:
    """The norms :func:`set_model_norms` switches: ``model``'s own ``norm_pre``, ``norm`` and
    ``fc_norm`` that are torch's or timm's LayerNorm (switched or not) with weights over the last
    dimension, by name; timm's fast-norm LayerNorm is left alone."""
    found = {}
    for name in MODEL_NORMS:
        norm = getattr(model, name, None)
        if (type(norm) in _TO_KERNEL or type(norm) in _BACK) and norm.elementwise_affine \
                and len(norm.normalized_shape) == 1 and not getattr(norm, "_fast_norm", False):
            found[name] = norm
    return found


def set_model_norms(model: nn.Module, enable: bool = True) -> list:
    """Switch ``model``'s own LayerNorms (:func:`model_norms`) to their one-pass autocast forward
    (``enable``) or back to the class they were; returns their names."""
    norms = model_norms(model)
    for norm in norms.values():
        if enable:
            norm.__class__ = _TO_KERNEL.get(type(norm), type(norm))
        else:
            norm.__class__ = _BACK.get(type(norm), type(norm))
    return list(norms)


# Leaves for timm's FX feature extraction, as the LayerNorms they were: the forward branches on autocast.
register_notrace_module(AutocastLayerNorm)
register_notrace_module(AutocastTimmLayerNorm)
