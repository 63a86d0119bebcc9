"""TE's bias gradients under FP8 delayed scaling by fp8vit's kernel (lever 48).

In a backward pass TE casts each Linear's output gradient to FP8, with its transpose for the
weight gradient, and sums its columns for the bias gradient, in one fused call: the extension's
``bgrad_quantize`` (``dbias_dgelu`` for fc1 of a GELU MLP: the GELU's backward first). TE 2.20
finishes that sum with a reduction run by one thread per four columns: 21-23 us a call on an H100
at any width, 48 calls (1.0 ms) in a ViT-B/16 step at batch 128 and 96 (2.2 ms) in a ViT-L/16 one
(``docs/results/profile/*_sync_h100.kernels.txt``). :func:`set_bias_grad_kernel` sends both calls to
:func:`fp8vit._te.kernels.cast_transpose_dbias` where it applies (a per-tensor delayed-scaling
quantizer that wants both the cast and its transpose, a contiguous 16-bit CUDA gradient, Triton
running) and to TE's own function otherwise: the same FP8 bytes, amax and scale, the bias
gradient summed in another order.

It replaces the two functions in TE's extension module for the whole process: TE's modules look
them up there at each call (``module/base.py``, ``module/layernorm_mlp.py``; ``te.ops`` binds
``dbias_dgelu`` at import and keeps TE's).
"""

from __future__ import annotations

from typing import Any, Dict, List

import torch

from .kernels import cast_transpose_dbias, kernel_takes, triton_support
from .loader import te_module

__all__ = ["set_bias_grad_kernel", "bias_grad_kernel_enabled"]

_NAMES = ("bgrad_quantize", "dbias_dgelu")
_TE_FUNCTIONS: Dict[str, Any] = {}  # TE's own functions while fp8vit's are installed


def bias_grad_kernel_enabled() -> bool:
    """Whether TE's bias gradients currently run on fp8vit's kernel (:func:`set_bias_grad_kernel`)."""
    return bool(_TE_FUNCTIONS)


def set_bias_grad_kernel(enable: bool = True) -> bool:
    """Route TE's fused cast + transpose + bias-gradient calls to fp8vit's kernel, or back to TE's.

    Args:
        enable: install fp8vit's functions (True) or restore TE's (False).

    Returns:
        whether fp8vit's kernel is installed after the call: False where Triton cannot run
        (``fp8vit._te.kernels.triton_support()`` says why; ``FP8VIT_TRITON=0`` turns it off).

    Raises:
        TEUnavailableError: installing it where TE does not import (with the reason).
    """
    if enable == bias_grad_kernel_enabled():  # nothing to do (nor TE to import)
        return enable
    tex = te_module("transformer_engine_torch")
    if not enable:
        for name in _NAMES:
            setattr(tex, name, _TE_FUNCTIONS.pop(name))
    elif triton_support().ok:
        _TE_FUNCTIONS.update({name: getattr(tex, name) for name in _NAMES})
        tex.bgrad_quantize, tex.dbias_dgelu = _bgrad_quantize, _dbias_dgelu
    return bias_grad_kernel_enabled()


def _takes(grad: torch.Tensor, quantizer: Any) -> bool:
    """A delayed-scaling quantizer that wants the cast and its transpose, a gradient of at least
    two dimensions that fp8vit's kernels take (16-bit, CUDA, contiguous, Triton running)."""
    float8 = te_module("transformer_engine.pytorch.tensor.float8_tensor").Float8Quantizer
    return (type(quantizer) is float8 and quantizer.rowwise_usage and quantizer.columnwise_usage
            and grad.dim() >= 2 and grad.numel() > 0 and kernel_takes(grad))


def _quantize_dbias(grad: torch.Tensor, quantizer: Any, act_input=None) -> List[Any]:
    """``[bias gradient, the FP8 tensor]`` as TE's functions return them."""
    out = quantizer.make_empty(grad.shape, dtype=grad.dtype, device=grad.device)
    C = grad.shape[-1]
    e5m2 = quantizer.dtype == te_module("transformer_engine_torch").DType.kFloat8E5M2
    dbias = cast_transpose_dbias(grad.view(-1, C), out._data.view(-1, C), out._transpose.view(C, -1),
                                 quantizer.scale, quantizer.amax, out._scale_inv, e5m2,
                                 None if act_input is None else act_input.view(-1, C))
    out._transpose_invalid = False
    return [dbias, out]


def _bgrad_quantize(grad_output: torch.Tensor, quantizer: Any) -> List[Any]:
    """TE's ``bgrad_quantize(input, quantizer)``, on fp8vit's kernel where it applies."""
    if quantizer is None or not _takes(grad_output, quantizer):
        return _TE_FUNCTIONS["bgrad_quantize"](grad_output, quantizer)
    return _quantize_dbias(grad_output, quantizer)


def _dbias_dgelu(grad: torch.Tensor, fwd_input: torch.Tensor, quantizer: Any, **kwargs) -> List[Any]:
    """TE's ``dbias_dgelu(grad, fwd_input, quantizer)``, on fp8vit's kernel where it applies."""
    if (kwargs or quantizer is None or not _takes(grad, quantizer) or fwd_input.shape != grad.shape
            or not kernel_takes(grad, fwd_input)):
        return _TE_FUNCTIONS["dbias_dgelu"](grad, fwd_input, quantizer, **kwargs)
    return _quantize_dbias(grad, quantizer, fwd_input)
