"""TE's FP8 bias gradients under delayed scaling by fp8vit's kernel (lever 49).

In a backward pass TE casts each Linear's output gradient to FP8, with its transpose for the
weight gradient, and sums its columns for the bias gradient, in one fused call: the extension's
``bgrad_quantize``. TE 2.20 finishes that sum with a reduction run by one thread per four columns:
21-23 us a call on an H100 at any width. :func:`set_bias_grad_kernel` sends the call to
:func:`fp8vit._te.kernels.cast_transpose_dbias` where it applies (a per-tensor delayed-scaling
quantizer that wants both the cast and its transpose, a contiguous 16-bit CUDA gradient, Triton
running) and to TE's own function otherwise: the same FP8 bytes, amax and scale, the bias gradient
summed in another order. Graphed, a call at ViT-B/L widths takes 35-45 us against TE's 48-59
(proj, fc2) and 95-124 against 107-135 (qkv) on an H100
(``docs/results/levers/ct_dbias_sweep_lever49_h100.log``). fc1's ``dbias_dgelu`` (the GELU's
backward first) stays TE's: the same pass with the GELU was 15-25% slower than TE's there.

It replaces the function in TE's extension module for the whole process: TE's modules look it up
there at each call (``module/base.py``).
"""

from __future__ import annotations

import functools
from typing import Any, Callable, ContextManager, List

import torch

from .kernels import cast_transpose_dbias, kernel_takes, triton_support
from .loader import te_module
from .route import Route

__all__ = ["set_bias_grad_kernel", "bias_grad_kernel_enabled", "bias_grad_kernel"]

# TE's modules call the extension's bgrad_quantize; while installed it is _bgrad_quantize bound to TE's;
# installing needs TE (TEUnavailableError says why not) and Triton
_ROUTE = Route([("transformer_engine_torch", "bgrad_quantize")],
               lambda te_fn: functools.partial(_bgrad_quantize, te_fn),
               lambda: te_module("transformer_engine_torch") is not None and triton_support().ok)


def bias_grad_kernel_enabled() -> bool:
    """Whether TE's bias gradients currently run on fp8vit's kernel (:func:`set_bias_grad_kernel`)."""
    return _ROUTE.enabled()


def set_bias_grad_kernel(enable: bool = True) -> bool:
    """Route TE's fused cast + transpose + bias-gradient call to fp8vit's kernel, or back to TE's.

    Args:
        enable: install fp8vit's function (True) or restore TE's (False).

    Returns:
        whether fp8vit's kernel is installed after the call: False where Triton cannot run
        (``fp8vit._te.kernels.triton_support()`` says why; ``FP8VIT_TRITON=0`` turns it off).

    Raises:
        TEUnavailableError: installing it where TE does not import (with the reason).
    """
    return _ROUTE.set(enable)


def bias_grad_kernel(enabled: bool) -> ContextManager[bool]:
    """:func:`set_bias_grad_kernel` for the duration of a ``with`` block (it yields whether fp8vit's
    kernel is installed), then the previous setting again."""
    return _ROUTE.scope(enabled)


def _takes(grad: torch.Tensor, quantizer: Any) -> bool:
    """A delayed-scaling quantizer that wants the cast and its transpose, a gradient of at least
    two dimensions that fp8vit's kernels take (16-bit, CUDA, contiguous, Triton running)."""
    float8 = te_module("transformer_engine.pytorch.tensor.float8_tensor").Float8Quantizer
    return (type(quantizer) is float8 and quantizer.rowwise_usage and quantizer.columnwise_usage
            and grad.dim() >= 2 and grad.numel() > 0 and kernel_takes(grad))


def _bgrad_quantize(te_bgrad_quantize: Callable, grad_output: torch.Tensor, quantizer: Any) -> List[Any]:
    """TE's ``bgrad_quantize(input, quantizer)``: ``[bias gradient, the FP8 tensor]``, on fp8vit's
    kernel where it applies and on TE's function (the first argument) elsewhere."""
    if quantizer is None or not _takes(grad_output, quantizer):
        return te_bgrad_quantize(grad_output, quantizer)
    out = quantizer.make_empty(grad_output.shape, dtype=grad_output.dtype, device=grad_output.device)
    C = grad_output.shape[-1]
    e5m2 = quantizer.dtype == te_module("transformer_engine_torch").DType.kFloat8E5M2
    dbias = cast_transpose_dbias(grad_output.view(-1, C), out._data.view(-1, C), out._transpose.view(C, -1),
                                 quantizer.scale, quantizer.amax, out._scale_inv, e5m2)
    out._transpose_invalid = False
    return [dbias, out]
