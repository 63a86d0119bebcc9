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

Lever 67 (off unless :func:`set_gradient_sum_kernel` turns it on; not yet measured): a block reads
its residual stream twice, in a norm and in the residual add, so autograd sums two gradients (48
adds of a ViT-L/16 b128 step, 2.4 ms on an H100) and the next Linear's backward reads the sum again
for its cast. :func:`residual_fork` hands the stream to its two readers as two tensors, so their
gradients arrive apart: the fork's backward adds them in the bias-gradient kernel of the quantizer
that read its sum the step before (one pass: the sum, its FP8 cast and transpose, the bias
gradient), and ``bgrad_quantize`` for that sum returns what was made. The same bytes as the add and
the call apart: the cast is of the sum rounded to bf16.
"""

from __future__ import annotations

import contextlib
import weakref
from typing import Any, Dict, Iterator, List, Optional, Tuple

import torch

from .fp8 import active_fp8_recipe
from .kernels import cast_transpose_dbias, kernel_takes, triton_support
from .loader import te_module

__all__ = ["set_bias_grad_kernel", "bias_grad_kernel_enabled", "bias_grad_kernel",
           # lever 67: a forked tensor's two gradients summed in that kernel
           "set_gradient_sum_kernel", "residual_fork"]

_TE_FUNCTIONS: Dict[str, Any] = {}  # TE's own function while fp8vit's is installed
_SUM_KERNEL = [False]  # set_gradient_sum_kernel
# fork sites by the block that owns them (no state on the module: it pickles and copies as before)
_SITES: "weakref.WeakKeyDictionary[torch.nn.Module, Dict[str, _Site]]" = weakref.WeakKeyDictionary()
# in the backward pass under way: a fork's plain sum by its data pointer (weakly: whoever reads it
# in bgrad_quantize names the quantizer to fuse with), and a fused sum with its quantizer and result
_SUMS: Dict[int, Tuple["weakref.ref[torch.Tensor]", "_Site"]] = {}
_READY: Dict[int, Tuple[torch.Tensor, Any, List[Any], "_Site"]] = {}
_CLEANUP_QUEUED = [False]


def bias_grad_kernel_enabled() -> bool:
    """Whether TE's bias gradients currently run on fp8vit's kernel (:func:`set_bias_grad_kernel`)."""
    return bool(_TE_FUNCTIONS)


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
    if enable == bias_grad_kernel_enabled():  # nothing to do (nor TE to import)
        return enable
    tex = te_module("transformer_engine_torch")
    if not enable:
        tex.bgrad_quantize = _TE_FUNCTIONS.pop("bgrad_quantize")
    elif triton_support().ok:
        _TE_FUNCTIONS["bgrad_quantize"] = tex.bgrad_quantize
        tex.bgrad_quantize = _bgrad_quantize
    return bias_grad_kernel_enabled()


@contextlib.contextmanager
def bias_grad_kernel(enabled: bool) -> Iterator[bool]:
    """:func:`set_bias_grad_kernel` for the duration of the block (yields whether fp8vit's kernel is
    installed), then the previous setting again."""
    old = bias_grad_kernel_enabled()
    try:
        yield set_bias_grad_kernel(enabled)
    finally:
        set_bias_grad_kernel(old)


def _takes(grad: torch.Tensor, quantizer: Any) -> bool:
    """A delayed-scaling quantizer that wants the cast and its transpose, a gradient of at least
    two dimensions that fp8vit's kernels take (16-bit, CUDA, contiguous, Triton running)."""
    float8 = te_module("transformer_engine.pytorch.tensor.float8_tensor").Float8Quantizer
    return (type(quantizer) is float8 and quantizer.rowwise_usage and quantizer.columnwise_usage
            and grad.dim() >= 2 and grad.numel() > 0 and kernel_takes(grad))


def _bgrad_quantize(grad_output: torch.Tensor, quantizer: Any) -> List[Any]:
    """TE's ``bgrad_quantize(input, quantizer)``: ``[bias gradient, the FP8 tensor]``, on fp8vit's
    kernel where it applies; a fork's fused sum gets what its backward made (lever 67)."""
    if _READY:
        ready = _READY.pop(grad_output.data_ptr(), None)
        if ready is not None:
            total, q, result, site = ready
            if (q is quantizer and _same(total, grad_output) and result[1].shape == grad_output.shape
                    and _takes(grad_output, quantizer)):
                return result
            site.quantizer = None  # made for another reader: the sum holds, the cast is made anew
    if _SUMS:
        _learn(grad_output, quantizer)
    if quantizer is None or not _takes(grad_output, quantizer):
        return _TE_FUNCTIONS["bgrad_quantize"](grad_output, quantizer)
    return list(_cast(grad_output, quantizer, grad_output.shape))


def _cast(grad: torch.Tensor, quantizer: Any, shape: Tuple[int, ...], addend: Optional[torch.Tensor] = None,
          total: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, Any]:
    """(bias gradient, FP8 tensor of ``shape``) of ``grad`` (plus ``addend``, written to ``total``)."""
    C = grad.shape[-1]
    out = quantizer.make_empty(shape, dtype=grad.dtype, device=grad.device)
    e5m2 = quantizer.dtype == te_module("transformer_engine_torch").DType.kFloat8E5M2
    dbias = cast_transpose_dbias(grad.view(-1, C), out._data.view(-1, C), out._transpose.view(C, -1),
                                 quantizer.scale, quantizer.amax, out._scale_inv, e5m2,
                                 None if addend is None else addend.view(-1, C), None if total is None else total.view(-1, C))
    out._transpose_invalid = False
    return dbias, out


# ---------------------------------------------------------------- lever 67: forked gradients' sum
def set_gradient_sum_kernel(enable: bool = True) -> bool:
    """Fork the residual stream in fp8vit's blocks (:func:`residual_fork`) so that its two gradients
    are summed in the bias-gradient kernel of the sum's reader (True), or let autograd add them
    (False, the default). Takes effect where fp8vit's bias-gradient kernel is installed
    (:func:`set_bias_grad_kernel`, the graphs' capture by default). Returns the previous setting."""
    old, _SUM_KERNEL[0] = _SUM_KERNEL[0], bool(enable)
    return old


class _Site:
    """One fork of one block: the quantizer (weakly) whose ``bgrad_quantize`` read its last sum."""

    __slots__ = ("quantizer",)

    def __init__(self) -> None:
        self.quantizer: Optional["weakref.ref[Any]"] = None


def residual_fork(owner: torch.nn.Module, name: str, x: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """``x`` for two readers (a norm's input, a residual), as two tensors whose gradients reach
    the fork apart, where :func:`set_gradient_sum_kernel` and the bias-gradient kernel are on, TE's
    FP8 autocast runs delayed scaling (the kernel's) and ``x`` needs a gradient; else ``(x, x)``.

    Args:
        owner: the block the fork belongs to (its sites live as long as it does).
        name: the fork within the block (one learned reader each).
        x: the tensor read twice.
    """
    if not (_SUM_KERNEL[0] and bias_grad_kernel_enabled() and x.requires_grad and torch.is_grad_enabled()):
        return x, x
    recipe = active_fp8_recipe()
    if recipe is None or not recipe.delayed():  # no FP8 backward to cast the sum in, or not this kernel's
        return x, x
    site = _SITES.setdefault(owner, {}).setdefault(name, _Site())
    return _Fork.apply(x, site)


class _Fork(torch.autograd.Function):
    """``x`` twice; the backward sums the two gradients (:func:`_sum`)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, site: _Site):
        ctx.site = site
        return x.view_as(x), x.view_as(x)

    @staticmethod
    def backward(ctx, ga: Optional[torch.Tensor], gb: Optional[torch.Tensor]):
        if ga is None or gb is None:
            return (gb if ga is None else ga), None
        return _sum(ctx.site, ga, gb), None


def _sum(site: _Site, ga: torch.Tensor, gb: torch.Tensor) -> torch.Tensor:
    """``ga + gb``: with the cast and bias gradient of the quantizer that read the site's last sum,
    kept for its ``bgrad_quantize`` (:data:`_READY`); else torch's add, remembered (:data:`_SUMS`)
    so that its reader names the quantizer."""
    q = site.quantizer() if site.quantizer is not None else None
    _queue_cleanup()
    if (q is not None and bias_grad_kernel_enabled() and _takes(ga, q) and gb.dtype == ga.dtype
            and gb.shape == ga.shape and gb.is_contiguous() and gb.device == ga.device):
        total = torch.empty_like(ga)
        # [R, C]: the shape TE's grad_output_preprocess hands bgrad_quantize
        dbias, out = _cast(ga, q, (ga.numel() // ga.shape[-1], ga.shape[-1]), gb, total)
        _READY[total.data_ptr()] = (total, q, [dbias, out], site)
        return total
    total = ga + gb
    _SUMS[total.data_ptr()] = (weakref.ref(total), site)
    return total


def _same(total: torch.Tensor, grad: torch.Tensor) -> bool:
    """``grad`` is ``total``'s bytes (a contiguous view from its start; ``total`` is alive, so its
    address is not another tensor's)."""
    return (grad.data_ptr() == total.data_ptr() and grad.numel() == total.numel() and grad.dtype == total.dtype
            and grad.is_contiguous() and grad.shape[-1] == total.shape[-1])


def _learn(grad_output: torch.Tensor, quantizer: Any) -> None:
    """A fork's plain sum read by ``bgrad_quantize``: its next sums are fused for ``quantizer``
    where fp8vit's kernel takes it."""
    entry = _SUMS.pop(grad_output.data_ptr(), None)
    total = entry[0]() if entry is not None else None
    if total is not None and _same(total, grad_output) and quantizer is not None and _takes(grad_output, quantizer):
        entry[1].quantizer = weakref.ref(quantizer)


def _queue_cleanup() -> None:
    """Forget this backward pass's sums at its end; a fused one nobody read unlearns its site."""
    if not _CLEANUP_QUEUED[0]:
        _CLEANUP_QUEUED[0] = True
        torch.autograd.Variable._execution_engine.queue_callback(_end_of_backward)


def _end_of_backward() -> None:
    _CLEANUP_QUEUED[0] = False
    for _, _, _, site in _READY.values():
        site.quantizer = None
    _READY.clear()
    _SUMS.clear()
